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

std::uint8_t clip8(std::int32_t v) {
  const std::int32_t s = v >> kPrecisionBits;
  return static_cast<std::uint8_t>(s < 0 ? 0 : s > 255 ? 255 : s);
}

}  // namespace

void resize_bilinear(const std::uint8_t* src, int sw, int sh, int channels, int x0, int y0, int cw, int ch, int dw,
                     int dh, std::vector<std::uint8_t>& out) {
  if (channels < 1 || cw < 1 || ch < 1 || dw < 1 || dh < 1 || x0 < 0 || y0 < 0 || x0 + cw > sw || y0 + ch > sh)
    throw Error(fmt::format("resize_bilinear: the region {}x{} at ({}, {}) of a {}x{} image to {}x{}, {} channels: "
                            "expected a region inside the image and positive sizes",
                            cw, ch, x0, y0, sw, sh, dw, dh, channels));
  const auto C = static_cast<std::size_t>(channels);
  const std::size_t src_stride = static_cast<std::size_t>(sw) * C;
  // The horizontal pass (when the width changes) over the rows the vertical pass reads: `rows`
  // rows of dw pixels, row r of them region row rows_first + r. Sums in 32 bits, as Pillow's: at
  // most 255 * 2^22 * (weights summing to about 1).
  const Coefficients v = coefficients(ch, dh);
  const int rows_first = dh == ch ? 0 : v.first.front();
  const int rows_last = dh == ch ? ch : v.first.back() + v.count.back();
  const int rows = rows_last - rows_first;
  thread_local std::vector<std::uint8_t> mid;
  const std::uint8_t* base = src + static_cast<std::size_t>(y0) * src_stride + static_cast<std::size_t>(x0) * C;
  std::size_t stride = src_stride;  // of the rows the vertical pass reads, from `base`
  if (dw != cw) {
    const Coefficients h = coefficients(cw, dw);
    const std::size_t out_stride = static_cast<std::size_t>(dw) * C;
    mid.resize(static_cast<std::size_t>(rows) * out_stride);
    for (int y = 0; y < rows; ++y) {
      const std::uint8_t* row = base + static_cast<std::size_t>(rows_first + y) * src_stride;
      std::uint8_t* out = mid.data() + static_cast<std::size_t>(y) * out_stride;
      for (int xx = 0; xx < dw; ++xx) {
        const std::int32_t* k = &h.weights[static_cast<std::size_t>(xx) * static_cast<std::size_t>(h.taps)];
        const std::uint8_t* in = row + static_cast<std::size_t>(h.first[static_cast<std::size_t>(xx)]) * C;
        const int n = h.count[static_cast<std::size_t>(xx)];
        if (C == 3) {
          std::int32_t s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
          for (int x = 0; x < n; ++x, in += 3) s0 += in[0] * k[x], s1 += in[1] * k[x], s2 += in[2] * k[x];
          out[0] = clip8(s0), out[1] = clip8(s1), out[2] = clip8(s2);
          out += 3;
        } else {
          for (std::size_t c = 0; c < C; ++c) {
            std::int32_t ss = 1 << (kPrecisionBits - 1);
            for (int x = 0; x < n; ++x) ss += in[static_cast<std::size_t>(x) * C + c] * k[x];
            *out++ = clip8(ss);
          }
        }
      }
    }
    base = mid.data() - static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rows_first) * out_stride);
    stride = out_stride;
  }
  const std::size_t width = static_cast<std::size_t>(dw) * C;  // bytes of an output row
  out.resize(static_cast<std::size_t>(dh) * width);
  if (dh == ch) {
    for (int y = 0; y < dh; ++y) std::copy_n(base + static_cast<std::size_t>(y) * stride, width, &out[static_cast<std::size_t>(y) * width]);
    return;
  }
  thread_local std::vector<std::int32_t> acc;
  acc.resize(width);
  for (int yy = 0; yy < dh; ++yy) {
    const std::int32_t* k = &v.weights[static_cast<std::size_t>(yy) * static_cast<std::size_t>(v.taps)];
    const int ymin = v.first[static_cast<std::size_t>(yy)], n = v.count[static_cast<std::size_t>(yy)];
    std::fill(acc.begin(), acc.end(), 1 << (kPrecisionBits - 1));
    for (int y = 0; y < n; ++y) {
      const std::uint8_t* row = base + static_cast<std::size_t>(ymin + y) * stride;
      const std::int32_t w = k[y];
      for (std::size_t i = 0; i < width; ++i) acc[i] += row[i] * w;
    }
    std::uint8_t* o = &out[static_cast<std::size_t>(yy) * width];
    for (std::size_t i = 0; i < width; ++i) o[i] = clip8(acc[i]);
  }
}

std::vector<std::uint8_t> resize_bilinear(const std::uint8_t* src, int sw, int sh, int channels, int x0, int y0, int cw,
                                          int ch, int dw, int dh) {
  std::vector<std::uint8_t> out;
  resize_bilinear(src, sw, sh, channels, x0, y0, cw, ch, dw, dh, out);
  return out;
}

}  // namespace tally::data
