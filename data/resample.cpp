// data/resample.cpp — PIL's bilinear resize, byte for byte; see data/resample.h.
#include "data/resample.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"

namespace tally::data {

namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // Pillow's PRECISION_BITS for 8-bit images

// One axis's weights: for each output position its first input and the integer weights of the
// inputs from there (Pillow's precompute_coeffs and normalize_coeffs_8bpc, for BILINEAR).
struct Coefficients {
  int taps = 0;                // weights per output (the largest count)
  std::vector<int> first, count;
  std::vector<std::int32_t> weights;  // out x taps
};

Coefficients coefficients(int in, int out) {
  const double scale = static_cast<double>(in) / out;
  const double filterscale = std::max(scale, 1.0), support = 1.0 * filterscale;
  Coefficients c;
  c.taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(static_cast<std::size_t>(out));
  c.count.resize(static_cast<std::size_t>(out));
  c.weights.assign(static_cast<std::size_t>(out) * static_cast<std::size_t>(c.taps), 0);
  std::vector<double> k(static_cast<std::size_t>(c.taps));
  for (int xx = 0; xx < out; ++xx) {
    const double center = (xx + 0.5) * scale, ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in) xmax = in;
    xmax -= xmin;
    double ww = 0;
    for (int x = 0; x < xmax; ++x) {
      const double d = std::abs((x + xmin - center + 0.5) * ss);
      const double w = d < 1.0 ? 1.0 - d : 0.0;
      k[static_cast<std::size_t>(x)] = w;
      ww += w;
    }
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[static_cast<std::size_t>(x)] / ww : k[static_cast<std::size_t>(x)];
      c.weights[static_cast<std::size_t>(xx) * static_cast<std::size_t>(c.taps) + static_cast<std::size_t>(x)] =
          static_cast<std::int32_t>(w * (1 << kPrecisionBits) + (w < 0 ? -0.5 : 0.5));
    }
    c.first[static_cast<std::size_t>(xx)] = xmin;
    c.count[static_cast<std::size_t>(xx)] = xmax;
  }
  return c;
}

std::uint8_t clip8(std::int64_t v) {
  const std::int64_t s = v >> kPrecisionBits;
  return static_cast<std::uint8_t>(s < 0 ? 0 : s > 255 ? 255 : s);
}

}  // namespace

std::vector<std::uint8_t> resize_bilinear(const std::uint8_t* src, int sw, int sh, int channels, int x0, int y0, int cw,
                                          int ch, int dw, int dh) {
  if (channels < 1 || cw < 1 || ch < 1 || dw < 1 || dh < 1 || x0 < 0 || y0 < 0 || x0 + cw > sw || y0 + ch > sh)
    throw Error(fmt::format("resize_bilinear: the region {}x{} at ({}, {}) of a {}x{} image to {}x{}, {} channels: "
                            "expected a region inside the image and positive sizes",
                            cw, ch, x0, y0, sw, sh, dw, dh, channels));
  const auto C = static_cast<std::size_t>(channels);
  const auto at = [&](int x, int y) { return src + (static_cast<std::size_t>(y) * static_cast<std::size_t>(sw) + static_cast<std::size_t>(x)) * C; };
  // Horizontal pass (when the width changes) over the rows the vertical pass reads.
  const Coefficients v = coefficients(ch, dh);
  const int rows_first = dh == ch ? 0 : v.first.front();
  const int rows_last = dh == ch ? ch : v.first.back() + v.count.back();
  const int rows = rows_last - rows_first;
  std::vector<std::uint8_t> mid;
  const std::uint8_t* hsrc = nullptr;  // rows [rows_first, rows_last) of the region, dw wide
  std::size_t hstride = 0;
  if (dw != cw) {
    const Coefficients h = coefficients(cw, dw);
    mid.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(dw) * C);
    for (int y = 0; y < rows; ++y)
      for (int xx = 0; xx < dw; ++xx) {
        const std::int32_t* k = &h.weights[static_cast<std::size_t>(xx) * static_cast<std::size_t>(h.taps)];
        const int xmin = h.first[static_cast<std::size_t>(xx)], n = h.count[static_cast<std::size_t>(xx)];
        for (std::size_t c = 0; c < C; ++c) {
          std::int64_t ss = std::int64_t(1) << (kPrecisionBits - 1);
          for (int x = 0; x < n; ++x) ss += static_cast<std::int64_t>(at(x0 + xmin + x, y0 + rows_first + y)[c]) * k[x];
          mid[(static_cast<std::size_t>(y) * static_cast<std::size_t>(dw) + static_cast<std::size_t>(xx)) * C + c] = clip8(ss);
        }
      }
    hsrc = mid.data();
    hstride = static_cast<std::size_t>(dw) * C;
  }
  std::vector<std::uint8_t> out(static_cast<std::size_t>(dw) * static_cast<std::size_t>(dh) * C);
  // The row r (of the region) as the vertical pass reads it, at column x of the output width.
  const auto row_pixel = [&](int r, int x) -> const std::uint8_t* {
    if (hsrc) return hsrc + static_cast<std::size_t>(r - rows_first) * hstride + static_cast<std::size_t>(x) * C;
    return at(x0 + x, y0 + r);
  };
  if (dh == ch) {
    for (int y = 0; y < dh; ++y)
      for (int x = 0; x < dw; ++x) std::copy_n(row_pixel(y, x), C, &out[(static_cast<std::size_t>(y) * static_cast<std::size_t>(dw) + static_cast<std::size_t>(x)) * C]);
    return out;
  }
  for (int yy = 0; yy < dh; ++yy) {
    const std::int32_t* k = &v.weights[static_cast<std::size_t>(yy) * static_cast<std::size_t>(v.taps)];
    const int ymin = v.first[static_cast<std::size_t>(yy)], n = v.count[static_cast<std::size_t>(yy)];
    for (int x = 0; x < dw; ++x)
      for (std::size_t c = 0; c < C; ++c) {
        std::int64_t ss = std::int64_t(1) << (kPrecisionBits - 1);
        for (int y = 0; y < n; ++y) ss += static_cast<std::int64_t>(row_pixel(ymin + y, x)[c]) * k[y];
        out[(static_cast<std::size_t>(yy) * static_cast<std::size_t>(dw) + static_cast<std::size_t>(x)) * C + c] = clip8(ss);
      }
  }
  return out;
}

}  // namespace tally::data
