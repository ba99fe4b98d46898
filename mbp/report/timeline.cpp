// mbp/report/timeline.cpp — stacked-area SVG of an arena trace; see mbp/report/timeline.h.
//
// The trace can hold tens of thousands of events; the chart has a few hundred pixel columns.
// Each column shows the state at the highest total reached inside it (so the peak is never
// averaged away), which keeps the file small whatever the length of the step.
#include "mbp/report/timeline.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include <fmt/format.h>

namespace tally::report {

namespace {

using State = std::array<std::int64_t, kNumCategories>;

std::int64_t total(const State& s) {
  std::int64_t t = 0;
  for (auto b : s) t += b;
  return t;
}

// Bottom to top.
constexpr std::array<Category, kNumCategories> kStack = {Category::parameter, Category::gradient,
                                                         Category::optimizer_state, Category::input,
                                                         Category::workspace, Category::temporary,
                                                         Category::activation};

const char* color(Category c) {
  switch (c) {
    case Category::parameter: return "#4e79a7";
    case Category::gradient: return "#f28e2b";
    case Category::optimizer_state: return "#e15759";
    case Category::activation: return "#76b7b2";
    case Category::workspace: return "#59a14f";
    case Category::input: return "#edc948";
    case Category::temporary: return "#b07aa1";
  }
  return "#999999";
}

// A "nice" step (1, 2, 5 x 10^n) giving about `n` ticks over [0, span].
double nice_step(double span, int n) {
  const double raw = span / n;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double f : {1.0, 2.0, 5.0, 10.0})
    if (raw <= f * p) return f * p;
  return 10 * p;
}

}  // namespace

std::string svg_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

std::string memory_svg(const Arena& arena, const TimelineOptions& o) {
  const auto& ev = arena.trace();
  const auto& marks = arena.marks();
  const int W = std::max(o.width, 400), H = std::max(o.height, 240);
  const int left = 78, right = 190, top = 40, bottom = 48;
  const int pw = W - left - right, ph = H - top - bottom;

  // Time span: from the first mark or event to the last event.
  double t0 = ev.empty() ? 0.0 : ev.front().time_us, t1 = ev.empty() ? 1.0 : ev.back().time_us;
  if (!marks.empty()) t0 = std::min(t0, marks.front().time_us);
  if (t1 <= t0) t1 = t0 + 1.0;

  // Per pixel column: the state at the column's highest total.
  std::vector<State> col(static_cast<std::size_t>(pw));
  State cur = arena.trace_base();
  std::int64_t peak = total(cur);
  std::size_t e = 0;
  for (int c = 0; c < pw; ++c) {
    const double end = t0 + (t1 - t0) * (c + 1) / pw;
    State best = cur;
    std::int64_t best_total = total(cur);
    while (e < ev.size() && (ev[e].time_us <= end || c == pw - 1)) {
      cur[static_cast<int>(ev[e].category)] += static_cast<std::int64_t>(ev[e].rounded) * (ev[e].is_alloc ? 1 : -1);
      const std::int64_t t = total(cur);
      if (t > best_total) best_total = t, best = cur;
      ++e;
    }
    col[static_cast<std::size_t>(c)] = best;
    peak = std::max(peak, best_total);
  }

  double ymax = static_cast<double>(peak);
  if (o.budget) ymax = std::max(ymax, static_cast<double>(*o.budget));
  if (o.predicted_peak) ymax = std::max(ymax, static_cast<double>(*o.predicted_peak));
  ymax = std::max(ymax * 1.08, 1024.0);
  const auto y_of = [&](double bytes) { return top + ph - bytes / ymax * ph; };
  const auto x_of = [&](double t) { return left + (t - t0) / (t1 - t0) * pw; };

  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"15\" font-weight=\"bold\">{3}</text>\n",
      W, H, left, svg_escape(o.title.empty() ? "memory over one training step" : o.title));

  // Bands, bottom to top.
  for (std::size_t j = 0; j < kStack.size(); ++j) {
    const int cat = static_cast<int>(kStack[j]);
    bool any = false;
    for (const State& st : col) any = any || st[cat] > 0;
    if (!any) continue;
    std::string upper, lower;
    for (int c = 0; c < pw; ++c) {
      const State& st = col[static_cast<std::size_t>(c)];
      std::int64_t below = 0;
      for (std::size_t i = 0; i < j; ++i) below += st[static_cast<int>(kStack[i])];
      upper += fmt::format("{},{:.1f} {},{:.1f} ", left + c, y_of(static_cast<double>(below + st[cat])), left + c + 1,
                           y_of(static_cast<double>(below + st[cat])));
      lower = fmt::format("{},{:.1f} {},{:.1f} ", left + c + 1, y_of(static_cast<double>(below)), left + c,
                          y_of(static_cast<double>(below))) + lower;
    }
    s += fmt::format("<polygon fill=\"{}\" stroke=\"none\" points=\"{}{}\"><title>{}</title></polygon>\n",
                     color(kStack[j]), upper, lower, category_name(kStack[j]));
  }

  // Axes and ticks.
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"black\"/>\n", left, top, top + ph);
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"black\"/>\n", left, top + ph, left + pw);
  const double mib = 1024.0 * 1024.0;
  const bool in_mib = ymax >= 4 * mib;
  const double unit = in_mib ? mib : 1024.0;
  const double ystep = nice_step(ymax / unit, 5);
  for (double v = 0; v * unit <= ymax; v += ystep) {
    const double y = y_of(v * unit);
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#dddddd\"/>\n", left, y, left + pw, y);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:g}</text>\n", left - 6, y + 4, v);
  }
  s += fmt::format("<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">{} in use</text>\n",
                   top + ph / 2, top + ph / 2, in_mib ? "MiB" : "KiB");
  const double span_ms = (t1 - t0) / 1000.0;
  const double xstep = nice_step(span_ms, 8);
  for (double v = 0; v <= span_ms + 1e-9; v += xstep) {
    const double x = x_of(t0 + v * 1000.0);
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:g}</text>\n", x, top + ph + 16, v);
  }
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">time (ms)</text>\n", left + pw / 2, top + ph + 36);

  // Marks: micro-batch boundaries and the optimizer step. Label every n-th so labels don't pile up.
  const std::size_t every = std::max<std::size_t>(1, marks.size() / 12);
  for (std::size_t i = 0; i < marks.size(); ++i) {
    const double x = x_of(marks[i].time_us);
    s += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#555555\" stroke-width=\"0.6\" "
                     "stroke-dasharray=\"2,2\"><title>{3}</title></line>\n",
                     x, top, top + ph, svg_escape(marks[i].label));
    const bool is_step = marks[i].label.rfind("optimizer", 0) == 0;
    if (i % every == 0 || is_step) {
      const std::string label = is_step ? "step" : fmt::format("{}", i + 1);
      s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"9\" fill=\"#555555\">{}</text>\n", x + 2, top + 10,
                       label);
    }
  }

  // Budget and peak.
  if (o.budget) {
    const double y = y_of(static_cast<double>(*o.budget));
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#d62728\" stroke-width=\"1.5\" "
                     "stroke-dasharray=\"6,4\"/>\n", left, y, left + pw, y);
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" fill=\"#d62728\">budget {}</text>\n", left + pw + 6, y + 4,
                     format_bytes(*o.budget));
  }
  {
    const double y = y_of(static_cast<double>(peak));
    s += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"black\" stroke-width=\"1\"/>\n", left,
                     y, left + pw, y);
    // Above the line, inside the plot (nothing stands higher than the peak), clear of the legend.
    std::string label = fmt::format("peak {}", format_bytes(static_cast<std::size_t>(peak)));
    if (o.predicted_peak)
      label += fmt::format(" — predicted {}{}", format_bytes(*o.predicted_peak),
                           static_cast<std::int64_t>(*o.predicted_peak) == peak ? " (exact)" : "");
    s += fmt::format("<text x=\"{}\" y=\"{:.1f}\">{}</text>\n", left + 6, y - 5, label);
  }

  // Legend.
  int ly = top + ph - 7 * 18;
  for (auto it = kStack.rbegin(); it != kStack.rend(); ++it) {
    s += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/>\n", left + pw + 6, ly, color(*it));
    s += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", left + pw + 24, ly + 10, category_name(*it));
    ly += 18;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace tally::report
