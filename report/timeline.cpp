// report/timeline.cpp — stacked-area SVG of an arena trace; see report/timeline.h.
//
// The trace can hold tens of thousands of events; the chart has a few hundred pixel columns.
// Each column shows the state at the highest total reached inside it (so the peak is never
// averaged away), which keeps the file small whatever the length of the step.
#include "report/timeline.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "report/svg.h"

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

// The plot's geometry: the time span, the byte scale, and the pixel box they map to.
struct Chart {
  int W, H, left, right, top, bottom, pw, ph;
  double t0, t1, ymax;
  double y_of(double bytes) const { return top + ph - bytes / ymax * ph; }
  double x_of(double t) const { return left + (t - t0) / (t1 - t0) * pw; }
};

// Per pixel column: the state at the column's highest total; and the highest total of all.
std::vector<State> columns(const Arena& arena, const Chart& ch, std::int64_t* peak) {
  const auto& ev = arena.trace();
  std::vector<State> col(static_cast<std::size_t>(ch.pw));
  State cur = arena.trace_base();
  *peak = total(cur);
  std::size_t e = 0;
  for (int c = 0; c < ch.pw; ++c) {
    const double end = ch.t0 + (ch.t1 - ch.t0) * (c + 1) / ch.pw;
    State best = cur;
    std::int64_t best_total = total(cur);
    while (e < ev.size() && (ev[e].time_us <= end || c == ch.pw - 1)) {
      cur[static_cast<int>(ev[e].category)] += static_cast<std::int64_t>(ev[e].rounded) * (ev[e].is_alloc ? 1 : -1);
      const std::int64_t t = total(cur);
      if (t > best_total) best_total = t, best = cur;
      ++e;
    }
    col[static_cast<std::size_t>(c)] = best;
    *peak = std::max(*peak, best_total);
  }
  return col;
}

// The category bands, bottom to top.
std::string bands(const Chart& ch, const std::vector<State>& col) {
  std::string s;
  for (std::size_t j = 0; j < kStack.size(); ++j) {
    const int cat = static_cast<int>(kStack[j]);
    bool any = false;
    for (const State& st : col) any = any || st[cat] > 0;
    if (!any) continue;
    std::string upper, lower;
    for (int c = 0; c < ch.pw; ++c) {
      const State& st = col[static_cast<std::size_t>(c)];
      std::int64_t below = 0;
      for (std::size_t i = 0; i < j; ++i) below += st[static_cast<int>(kStack[i])];
      const double top_y = ch.y_of(static_cast<double>(below + st[cat])), bottom_y = ch.y_of(static_cast<double>(below));
      upper += fmt::format("{},{:.1f} {},{:.1f} ", ch.left + c, top_y, ch.left + c + 1, top_y);
      lower = fmt::format("{},{:.1f} {},{:.1f} ", ch.left + c + 1, bottom_y, ch.left + c, bottom_y) + lower;
    }
    s += fmt::format("<polygon fill=\"{}\" stroke=\"none\" points=\"{}{}\"><title>{}</title></polygon>\n",
                     color(kStack[j]), upper, lower, svg::escape(category_name(kStack[j])));
  }
  return s;
}

// Axes, grid and ticks: bytes (KiB or MiB) up, milliseconds across.
std::string axes(const Chart& ch) {
  const int left = ch.left, top = ch.top, pw = ch.pw, ph = ch.ph;
  std::string s = svg::axes(left, top, pw, ph);
  const double mib = 1024.0 * 1024.0;
  const bool in_mib = ch.ymax >= 4 * mib;
  const double unit = in_mib ? mib : 1024.0;
  const double ystep = nice_step(ch.ymax / unit, 5);
  for (double v = 0; v * unit <= ch.ymax; v += ystep) {
    s += svg::y_tick(left, pw, ch.y_of(v * unit), fmt::format("{:g}", v));
  }
  s += svg::y_title(16, top + ph / 2, in_mib ? "MiB in use" : "KiB in use");
  const double span_ms = (ch.t1 - ch.t0) / 1000.0;
  const double xstep = nice_step(span_ms, 8);
  for (double v = 0; v <= span_ms + 1e-9; v += xstep) {
    s += svg::x_label(ch.x_of(ch.t0 + v * 1000.0), top + ph + 16, fmt::format("{:g}", v));
  }
  s += svg::x_label(left + pw / 2, top + ph + 36, "time (ms)");
  return s;
}

// Marks: micro-batch boundaries and the optimizer step. Every n-th is labelled so that labels
// do not pile up.
std::string mark_lines(const Chart& ch, const std::vector<Arena::TraceMark>& marks) {
  std::string s;
  const std::size_t every = std::max<std::size_t>(1, marks.size() / 12);
  for (std::size_t i = 0; i < marks.size(); ++i) {
    const double x = ch.x_of(marks[i].time_us);
    s += svg::line(x, ch.top, x, ch.top + ch.ph, "stroke=\"#555555\" stroke-width=\"0.6\" stroke-dasharray=\"2,2\"",
                   marks[i].label);
    const bool is_step = marks[i].label.rfind("optimizer", 0) == 0;
    if (i % every == 0 || is_step) {
      const std::string label = is_step ? "step" : fmt::format("{}", i + 1);
      s += svg::text(x + 2, ch.top + 10, "font-size=\"9\" fill=\"#555555\"", label);
    }
  }
  return s;
}

// The budget's line, the peak's line with the prediction beside it, and the legend.
std::string budget_peak_legend(const Chart& ch, const TimelineOptions& o, std::int64_t peak) {
  const int left = ch.left, pw = ch.pw;
  std::string s;
  if (o.budget) {
    const double y = ch.y_of(static_cast<double>(*o.budget));
    s += svg::line(left, y, left + pw, y, "stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"6,4\"");
    s += svg::text(left + pw + 6, y + 4, "fill=\"#d62728\"", "budget " + format_bytes(*o.budget));
  }
  const double y = ch.y_of(static_cast<double>(peak));
  s += svg::line(left, y, left + pw, y, "stroke=\"black\" stroke-width=\"1\"");
  // Above the line, inside the plot (nothing stands higher than the peak), clear of the legend.
  std::string label = fmt::format("peak {}", format_bytes(static_cast<std::size_t>(peak)));
  if (o.predicted_peak)
    label += fmt::format(" — predicted {}{}", format_bytes(*o.predicted_peak),
                         static_cast<std::int64_t>(*o.predicted_peak) == peak ? " (exact)" : "");
  s += svg::text(left + 6, y - 5, "", label);
  int ly = ch.top + ch.ph - 7 * 18;
  for (auto it = kStack.rbegin(); it != kStack.rend(); ++it) {
    s += svg::rect(left + pw + 6, ly, 12, 12, fmt::format("fill=\"{}\"", color(*it)));
    s += svg::text(left + pw + 24, ly + 10, "", category_name(*it));
    ly += 18;
  }
  return s;
}

}  // namespace

std::string memory_svg(const Arena& device, const TimelineOptions& device_options, const Arena& host,
                       const TimelineOptions& host_options) {
  const int width = std::max({device_options.width, host_options.width, 400});
  const int top = std::max(device_options.height, 240), bottom = std::max(host_options.height, 240);
  return fmt::format("{}<g>\n{}</g>\n<g transform=\"translate(0,{})\">\n{}</g>\n{}", svg::begin(width, top + bottom),
                     memory_svg(device, device_options), top, memory_svg(host, host_options), svg::kEnd);
}

std::string memory_svg(const Arena& arena, const TimelineOptions& o) {
  const auto& ev = arena.trace();
  const auto& marks = arena.marks();
  Chart ch{};
  ch.W = std::max(o.width, 400), ch.H = std::max(o.height, 240);
  ch.left = 78, ch.right = 190, ch.top = 40, ch.bottom = 48;
  ch.pw = ch.W - ch.left - ch.right, ch.ph = ch.H - ch.top - ch.bottom;
  // Time span: from the first mark or event to the last event.
  ch.t0 = ev.empty() ? 0.0 : ev.front().time_us, ch.t1 = ev.empty() ? 1.0 : ev.back().time_us;
  if (!marks.empty()) ch.t0 = std::min(ch.t0, marks.front().time_us);
  if (ch.t1 <= ch.t0) ch.t1 = ch.t0 + 1.0;
  std::int64_t peak = 0;
  const std::vector<State> col = columns(arena, ch, &peak);
  double ymax = static_cast<double>(peak);
  if (o.budget) ymax = std::max(ymax, static_cast<double>(*o.budget));
  if (o.predicted_peak) ymax = std::max(ymax, static_cast<double>(*o.predicted_peak));
  ch.ymax = std::max(ymax * 1.08, 1024.0);

  std::string s = svg::begin(ch.W, ch.H, "Helvetica, Arial, sans-serif") + svg::background(ch.W, ch.H);
  s += svg::text(ch.left, 24, "font-size=\"15\" font-weight=\"bold\"",
                 o.title.empty() ? "memory over one training step" : o.title);
  s += bands(ch, col);
  s += axes(ch);
  s += mark_lines(ch, marks);
  s += budget_peak_legend(ch, o, peak);
  s += svg::kEnd;
  return s;
}

}  // namespace tally::report
