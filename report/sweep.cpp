// report/sweep.cpp — the picture of a batch-size sweep; see report/sweep.h.
#include "report/sweep.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/arena.h"
#include "report/svg.h"

namespace tally::report {

std::string sweep_svg(const std::vector<SweepPoint>& points, std::int64_t memory_limit_bytes, const std::string& title) {
  const int W = 840, left = 80, right = 40, pw = W - left - right, ph = 200, top1 = 60, gap = 70;
  const int top2 = top1 + ph + gap, H = top2 + ph + 80;
  std::vector<SweepPoint> r = points;
  std::sort(r.begin(), r.end(), [](const SweepPoint& a, const SweepPoint& b) { return a.batch_size < b.batch_size; });
  std::string s = svg::begin(W, H, "sans-serif") + svg::background();
  s += svg::text(left, 22, "font-size=\"15\" font-weight=\"bold\"", title);
  s += svg::text(left, 40, "",
                 fmt::format("memory limit {}; filled: the batch ran as micro-batches (k > 1), hollow: in one piece",
                             format_bytes(static_cast<std::size_t>(memory_limit_bytes))));
  if (r.empty()) {
    s += svg::kEnd;
    return s;
  }
  const double lx0 = std::log2(static_cast<double>(r.front().batch_size)) - 0.5;
  const double lx1 = std::log2(static_cast<double>(r.back().batch_size)) + 0.5;
  auto x_of = [&](std::int64_t b) {
    return left + pw * (std::log2(static_cast<double>(b)) - lx0) / (lx1 - lx0);
  };
  auto panel = [&](int top, const char* label, const char* color, auto value, double lo, double hi, auto fmt_tick) {
    std::string p = svg::axes(left, top, pw, ph) + svg::y_title(18, top + ph / 2, label);
    for (int t = 0; t <= 4; ++t)
      p += svg::y_tick(left, pw, top + ph - ph * t / 4.0, fmt_tick(lo + (hi - lo) * t / 4.0));
    auto y_of = [&](double v) { return top + ph - ph * (v - lo) / (hi - lo > 0 ? hi - lo : 1.0); };
    std::string path;
    for (const SweepPoint& row : r)
      path += fmt::format("{}{:.1f},{:.1f}", path.empty() ? "M" : " L", x_of(row.batch_size), y_of(value(row)));
    p += fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", path, color);
    for (const SweepPoint& row : r) {
      const bool split = row.micro_batches_per_step > 1;
      p += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"5\" fill=\"{}\" stroke=\"{}\" stroke-width=\"2\">"
                       "<title>{}</title></circle>\n",
                       x_of(row.batch_size), y_of(value(row)), split ? color : "white", color,
                       svg::escape(fmt::format("batch {}: {} micro-batches of <= {}", row.batch_size,
                                               row.micro_batches_per_step, row.micro_batch)));
    }
    return p;
  };
  double amin = 1, amax = 0, imax = 0;
  bool measured = false;  // the test accuracy (not with --no-eval)
  for (const SweepPoint& row : r) {
    if (row.test_accuracy) {
      measured = true;
      amin = std::min(amin, *row.test_accuracy);
      amax = std::max(amax, *row.test_accuracy);
    }
    imax = std::max(imax, row.images_per_second);
  }
  if (measured) {
    const double alo = std::max(0.0, std::floor((amin - 0.02) * 50) / 50), ahi = std::min(1.0, std::ceil((amax + 0.01) * 50) / 50);
    s += panel(top1, "test accuracy (%)", "#4e79a7", [](const SweepPoint& row) { return row.test_accuracy.value_or(0); },
               alo, ahi > alo ? ahi : alo + 0.02, [](double v) { return fmt::format("{:.1f}", 100 * v); });
  } else {
    s += svg::text(left + pw / 2, top1 + ph / 2, "text-anchor=\"middle\"", "test accuracy not measured (--no-eval)");
  }
  s += panel(top2, "training images/s", "#f28e2b", [](const SweepPoint& row) { return row.images_per_second; }, 0.0,
             imax > 0 ? imax * 1.1 : 1.0, [](double v) { return fmt::format("{:.0f}", v); });
  for (const SweepPoint& row : r)
    s += svg::x_label(x_of(row.batch_size), top2 + ph + 18, fmt::format("{}", row.batch_size));
  s += svg::x_label(left + pw / 2, top2 + ph + 40, "batch size (log scale)");
  s += svg::kEnd;
  return s;
}

}  // namespace tally::report
