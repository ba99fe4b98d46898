// report/schedule.cpp — the pipeline schedule's SVG; see report/schedule.h.
#include "report/schedule.h"

#include <algorithm>

#include <fmt/format.h>

#include "report/timeline.h"

namespace tally::report {

std::string pipeline_svg(const std::vector<mbp::PipelineTrace>& stages, const std::string& title, int width) {
  const int left = 170, right = 20, top = 56, row = 46, gap = 10;
  const int height = top + static_cast<int>(stages.size()) * (row + gap) + 50;
  double span = 0;
  for (const auto& st : stages) span = std::max(span, st.seconds);
  if (span <= 0) span = 1e-3;
  const double px = (width - left - right) / span;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"10\" y=\"22\" font-size=\"15\">{2}</text>\n"
      "<text x=\"10\" y=\"42\" fill=\"#555\">forward (blue), backward (orange), the last stage's forward and backward "
      "together (green); grey: waiting for a message</text>\n",
      width, height, svg_escape(title));
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const auto& st = stages[s];
    const int y = top + static_cast<int>(s) * (row + gap);
    const double idle = st.seconds > 0 ? 100.0 * st.idle_seconds / st.seconds : 0.0;
    svg += fmt::format("<text x=\"10\" y=\"{}\">stage {} (rank {})</text>\n", y + row / 2 - 2, s, s);
    svg += fmt::format("<text x=\"10\" y=\"{}\" fill=\"#555\">waits {:.1f}% of {:.0f} ms</text>\n", y + row / 2 + 13,
                       idle, 1000.0 * st.seconds);
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"#e6e6e6\"/>\n", left, y,
                       st.seconds * px, row);
    const bool last = s + 1 == stages.size();
    for (const auto& e : st.events) {
      const double x = left + e.start * px, w = std::max(1.0, (e.end - e.start) * px);
      const char* fill = last ? "#59a14f" : e.forward ? "#4e79a7" : "#f28e2b";
      svg += fmt::format("<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\" stroke=\"white\"/>\n", x,
                         y, w, row, fill);
      if (w > 14)
        svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" fill=\"white\" text-anchor=\"middle\">{}{}</text>\n", x + w / 2,
                           y + row / 2 + 4, last ? "" : e.forward ? "F" : "B", e.index + 1);
    }
  }
  const int axis = top + static_cast<int>(stages.size()) * (row + gap) + 10;
  svg += fmt::format("<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333\"/>\n", left, axis, width - right, axis);
  for (int i = 0; i <= 5; ++i) {
    const double t = span * i / 5;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\" fill=\"#333\">{:.0f} ms</text>\n",
                       left + t * px, axis + 16, 1000.0 * t);
  }
  return svg + "</svg>\n";
}

}  // namespace tally::report
