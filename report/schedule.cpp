// report/schedule.cpp — the pipeline schedule's SVG; see report/schedule.h.
#include "report/schedule.h"

#include <algorithm>

#include <fmt/format.h>

#include "report/svg.h"

namespace tally::report {

std::string pipeline_svg(const std::vector<mbp::PipelineTrace>& stages, const std::string& title, int width) {
  const int left = 170, right = 20, top = 56, row = 46, gap = 10;
  const int height = top + static_cast<int>(stages.size()) * (row + gap) + 50;
  double span = 0;
  for (const auto& st : stages) span = std::max(span, st.seconds);
  if (span <= 0) span = 1e-3;
  const double px = (width - left - right) / span;
  std::string out = svg::begin(width, height, "sans-serif") + svg::background(width, height);
  out += svg::text(10, 22, "font-size=\"15\"", title);
  out += svg::text(10, 42, "fill=\"#555\"",
                   "forward (blue), backward (orange), the last stage's forward and backward together (green); "
                   "grey: waiting for a message");
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const auto& st = stages[s];
    const int y = top + static_cast<int>(s) * (row + gap);
    const double idle = st.seconds > 0 ? 100.0 * st.idle_seconds / st.seconds : 0.0;
    out += svg::text(10, y + row / 2 - 2, "", fmt::format("stage {} (rank {})", s, s));
    out += svg::text(10, y + row / 2 + 13, "fill=\"#555\"",
                     fmt::format("waits {:.1f}% of {:.0f} ms", idle, 1000.0 * st.seconds));
    out += svg::rect(left, y, st.seconds * px, row, "fill=\"#e6e6e6\"");
    const bool last = s + 1 == stages.size();
    for (const auto& e : st.events) {
      const double x = left + e.start * px, w = std::max(1.0, (e.end - e.start) * px);
      const char* fill = last ? "#59a14f" : e.forward ? "#4e79a7" : "#f28e2b";
      out += svg::rect(x, y, w, row, fmt::format("fill=\"{}\" stroke=\"white\"", fill));
      if (w > 14)
        out += svg::text(x + w / 2, y + row / 2 + 4, "fill=\"white\" text-anchor=\"middle\"",
                         fmt::format("{}{}", last ? "" : e.forward ? "F" : "B", e.index + 1));
    }
  }
  const int axis = top + static_cast<int>(stages.size()) * (row + gap) + 10;
  out += svg::line(left, axis, width - right, axis, "stroke=\"#333\"");
  for (int i = 0; i <= 5; ++i) {
    const double t = span * i / 5;
    out += svg::text(left + t * px, axis + 16, "text-anchor=\"middle\" fill=\"#333\"",
                     fmt::format("{:.0f} ms", 1000.0 * t));
  }
  out += svg::kEnd;
  return out;
}

}  // namespace tally::report
