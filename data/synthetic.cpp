// data/synthetic.cpp — procedural synthetic images as a data set; see data/synthetic.h.
#include "data/synthetic.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "data/formats.h"
#include "data/random.h"

namespace tally::data {

// Classes (shape, colour): 0 filled square red, 1 disk green, 2 horizontal stripes blue,
// 3 vertical stripes yellow, 4 diagonal stripes magenta, 5 cross cyan, 6 ring orange,
// 7 triangle white, 8 checkerboard violet, 9 two dots pink. Per image: half-size 6..10 px,
// centre anywhere that keeps the shape inside, stripe/checker phase and dot direction random,
// colour jittered by +-20 levels per channel, background a random dark colour (0..100 levels
// per channel), and noise of about 18 levels (0.07) standard deviation on every value (sum of
// four random bytes, an Irwin–Hall approximation of a gaussian). Coordinates are integers in
// 1/8-pixel units; all arithmetic is on integers.

namespace {

constexpr int kSynSide = 32;
constexpr int kSynClasses = 10;
constexpr std::array<std::array<int, 3>, kSynClasses> kPalette = {{
    {230, 51, 51},    // red
    {51, 217, 64},    // green
    {64, 89, 242},    // blue
    {242, 230, 51},   // yellow
    {230, 64, 217},   // magenta
    {51, 217, 230},   // cyan
    {250, 140, 38},   // orange
    {235, 235, 235},  // white
    {153, 77, 242},   // violet
    {250, 153, 178},  // pink
}};

struct ShapeParams {
  int cls;
  std::int64_t cx, cy, s;  // centre and half-size, 1/8-pixel units
  std::int64_t phase;      // stripe / checker phase
  std::int64_t dx, dy;     // two-dots offset of each dot from the centre
};

bool inside(const ShapeParams& p, std::int64_t u, std::int64_t v) {
  const std::int64_t s = p.s;
  const bool box = std::abs(u) <= s && std::abs(v) <= s;
  switch (p.cls) {
    case 0: return box;
    case 1: return u * u + v * v <= s * s;
    case 2: return box && ((v + s + p.phase) / 16) % 2 == 0;
    case 3: return box && ((u + s + p.phase) / 16) % 2 == 0;
    case 4: return box && ((u + v + 2 * s + p.phase) / 24) % 2 == 0;
    case 5: {
      const std::int64_t t = s / 4;
      return (std::abs(u) <= t && std::abs(v) <= s) || (std::abs(v) <= t && std::abs(u) <= s);
    }
    case 6: {
      const std::int64_t r2 = u * u + v * v, in = s * 11 / 20;
      return r2 <= s * s && r2 >= in * in;
    }
    case 7: return std::abs(v) <= s && 2 * std::abs(u) <= v + s;
    case 8: return box && (((u + s + p.phase) / 24) + ((v + s + p.phase) / 24)) % 2 == 0;
    case 9: {
      const std::int64_t r = s * 2 / 5, a = u - p.dx, b = v - p.dy, c = u + p.dx, d = v + p.dy;
      return a * a + b * b <= r * r || c * c + d * d <= r * r;
    }
    default: return false;
  }
}

// The six orders of three colour channels: classes 10k..10k+9 use order k mod 6.
constexpr std::array<std::array<int, 3>, 6> kChannelOrders = {{{0, 1, 2}, {1, 2, 0}, {2, 0, 1}, {0, 2, 1}, {2, 1, 0}, {1, 0, 2}}};

// Draws one 3x32x32 image of class `cls` as levels 0..255 into q (3*32*32).
void draw_synthetic(int cls, std::uint64_t image_key, std::uint8_t* q) {
  Rng rng(image_key);
  ShapeParams p{};
  p.cls = cls % kSynClasses;
  const auto& order = kChannelOrders[static_cast<std::size_t>(cls / kSynClasses) % kChannelOrders.size()];
  p.s = rng.between(48, 80);
  p.cx = rng.between(p.s, kSynSide * 8 - p.s);
  p.cy = rng.between(p.s, kSynSide * 8 - p.s);
  p.phase = rng.between(0, 47);
  const std::int64_t axis = p.s * 3 / 5, diag = p.s * 53 / 125;  // 0.6 s and 0.6 s / sqrt(2)
  switch (rng.below(4)) {
    case 0: p.dx = axis, p.dy = 0; break;
    case 1: p.dx = 0, p.dy = axis; break;
    case 2: p.dx = diag, p.dy = diag; break;
    default: p.dx = diag, p.dy = -diag; break;
  }
  int fg[3], bg[3];
  for (int c = 0; c < 3; ++c)
    fg[c] = std::clamp(kPalette[static_cast<std::size_t>(p.cls)][static_cast<std::size_t>(order[c])] +
                           static_cast<int>(rng.between(-20, 20)),
                       0, 255);
  for (int c = 0; c < 3; ++c) bg[c] = static_cast<int>(rng.between(0, 100));

  constexpr int kPlane = kSynSide * kSynSide;
  std::uint8_t mask[kPlane];
  for (int y = 0; y < kSynSide; ++y)
    for (int x = 0; x < kSynSide; ++x)
      mask[y * kSynSide + x] = inside(p, 8 * x + 4 - p.cx, 8 * y + 4 - p.cy) ? 1 : 0;

  // Noise: each 64-bit draw gives two values, each (sum of four bytes - 510) / 8.
  std::uint64_t bits = 0;
  for (int c = 0; c < 3; ++c) {
    for (int i = 0; i < kPlane; ++i) {
      if ((i & 1) == 0) bits = rng.next();
      const int sum = int(bits & 0xff) + int((bits >> 8) & 0xff) + int((bits >> 16) & 0xff) +
                      int((bits >> 24) & 0xff);
      bits >>= 32;
      const int noise = (sum - 510) >> 3;  // arithmetic shift: floor division by 8
      const int base = mask[i] ? fg[c] : bg[c];
      q[c * kPlane + i] = static_cast<std::uint8_t>(std::clamp(base + noise, 0, 255));
    }
  }
}

struct LevelStats {
  std::array<std::uint64_t, 3> sum{}, sumsq{};
  std::uint64_t per_channel = 0;  // values counted per channel
};

Dataset make_synthetic_set(std::int64_t n, std::uint64_t seed, std::uint64_t split,
                           LevelStats* stats) {
  Dataset ds;
  ds.name = "synthetic";
  ds.channels = 3;
  ds.height = kSynSide;
  ds.width = kSynSide;
  ds.num_classes = kSynClasses;
  // Balanced labels (i mod 10) in a random order.
  ds.labels.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ds.labels[static_cast<std::size_t>(i)] = i % kSynClasses;
  Rng label_rng(key(seed, kTagLabels, split));
  shuffle(ds.labels, label_rng);

  constexpr std::int64_t numel = 3 * kSynSide * kSynSide;
  ds.images.resize(static_cast<std::size_t>(n * numel));
  const auto& lut = level_to_float();
  std::uint8_t q[numel];
  for (std::int64_t i = 0; i < n; ++i) {
    draw_synthetic(static_cast<int>(ds.labels[static_cast<std::size_t>(i)]),
                   key(key(seed, kTagSynth, split), static_cast<std::uint64_t>(i)), q);
    float* dst = ds.images.data() + i * numel;
    for (std::int64_t j = 0; j < numel; ++j) dst[j] = lut[q[j]];
    if (stats) {
      for (int c = 0; c < 3; ++c) {
        std::uint64_t s = 0, ss = 0;
        for (int j = 0; j < kSynSide * kSynSide; ++j) {
          const std::uint64_t v = q[c * kSynSide * kSynSide + j];
          s += v;
          ss += v * v;
        }
        stats->sum[c] += s;
        stats->sumsq[c] += ss;
      }
      stats->per_channel += kSynSide * kSynSide;
    }
  }
  return ds;
}

// The procedural synthetic set of `o`'s shape: labels now, images drawn on demand.
Dataset procedural_synthetic_set(const SyntheticOptions& o, std::int64_t n, std::uint64_t split) {
  Dataset ds;
  ds.name = fmt::format("synthetic:{}x{}x{}", o.channels, o.height, o.width);
  ds.channels = o.channels;
  ds.height = o.height;
  ds.width = o.width;
  ds.num_classes = o.num_classes;
  ds.labels.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ds.labels[static_cast<std::size_t>(i)] = i % o.num_classes;
  Rng label_rng(key(o.seed, kTagLabels, split));
  shuffle(ds.labels, label_rng);
  const std::uint64_t image_key = key(o.seed, kTagSynth, split);
  const auto labels = std::make_shared<const std::vector<std::int64_t>>(ds.labels);
  const std::int64_t C = o.channels, H = o.height, W = o.width;
  ds.generate = [labels, image_key, C, H, W](std::int64_t i, float* dst) {
    std::uint8_t q[3 * kSynSide * kSynSide];
    draw_synthetic(static_cast<int>((*labels)[static_cast<std::size_t>(i)]), key(image_key, static_cast<std::uint64_t>(i)), q);
    const auto& lut = level_to_float();
    // Nearest neighbour: output pixel (y, x) takes drawing pixel (y * 32 / H, x * 32 / W).
    std::vector<int> xs(static_cast<std::size_t>(W));
    for (std::int64_t x = 0; x < W; ++x) xs[static_cast<std::size_t>(x)] = static_cast<int>(x * kSynSide / W);
    for (std::int64_t c = 0; c < C; ++c) {
      const std::uint8_t* plane = q + (c % 3) * kSynSide * kSynSide;
      for (std::int64_t y = 0; y < H; ++y) {
        const std::uint8_t* row = plane + (y * kSynSide / H) * kSynSide;
        float* out = dst + (c * H + y) * W;
        for (std::int64_t x = 0; x < W; ++x) out[x] = lut[row[xs[static_cast<std::size_t>(x)]]];
      }
    }
  };
  return ds;
}

}  // namespace

Split make_synthetic(const SyntheticOptions& o) {
  if (o.n_train <= 0 || o.n_test < 0)
    throw Error(fmt::format("make_synthetic: expected n_train > 0 and n_test >= 0, found {} and {}", o.n_train,
                            o.n_test));
  if (o.channels < 1 || o.height < 1 || o.width < 1 || o.num_classes < 1)
    throw Error(fmt::format("synthetic data: expected a shape CxHxW and a class count of at least 1 each, found "
                            "{}x{}x{} and {} classes", o.channels, o.height, o.width, o.num_classes));
  if (o.channels == 3 && o.height == kSynSide && o.width == kSynSide && o.num_classes == kSynClasses)
    return make_synthetic(o.n_train, o.n_test, o.seed);
  Split s;
  s.train = procedural_synthetic_set(o, o.n_train, 0);
  s.test = procedural_synthetic_set(o, o.n_test, 1);
  // Normalisation constants: per colour channel over the first drawings of the train set.
  LevelStats st;
  const std::int64_t probe = std::min<std::int64_t>(o.n_train, 2000);
  std::uint8_t q[3 * kSynSide * kSynSide];
  for (std::int64_t i = 0; i < probe; ++i) {
    draw_synthetic(static_cast<int>(s.train.labels[static_cast<std::size_t>(i)]),
                   key(key(o.seed, kTagSynth, 0), static_cast<std::uint64_t>(i)), q);
    for (int c = 0; c < 3; ++c)
      for (int j = 0; j < kSynSide * kSynSide; ++j) {
        const std::uint64_t v = q[c * kSynSide * kSynSide + j];
        st.sum[c] += v;
        st.sumsq[c] += v * v;
      }
    st.per_channel += kSynSide * kSynSide;
  }
  for (std::int64_t c = 0; c < std::min<std::int64_t>(o.channels, 3); ++c) {
    const double n = static_cast<double>(st.per_channel), sum = static_cast<double>(st.sum[c % 3]);
    const double mean = sum / n, var = static_cast<double>(st.sumsq[c % 3]) / n - mean * mean;
    s.train.mean[static_cast<std::size_t>(c)] = static_cast<float>(mean / 255.0);
    s.train.stddev[static_cast<std::size_t>(c)] = static_cast<float>(std::sqrt(std::max(var, 0.0)) / 255.0);
  }
  s.test.mean = s.train.mean;
  s.test.stddev = s.train.stddev;
  return s;
}

Split make_synthetic(std::int64_t n_train, std::int64_t n_test, std::uint64_t seed) {
  if (n_train <= 0 || n_test < 0)
    throw Error(fmt::format("make_synthetic: expected n_train > 0 and n_test >= 0, found {} and {}",
                            n_train, n_test));
  LevelStats st;
  Split s;
  s.train = make_synthetic_set(n_train, seed, 0, &st);
  s.test = make_synthetic_set(n_test, seed, 1, nullptr);
  // mean = sum / (n 255); var = (n sumsq - sum^2) / (n^2 255^2), the numerator exact in 128 bits.
  const auto n = static_cast<unsigned __int128>(st.per_channel);
  for (int c = 0; c < 3; ++c) {
    const unsigned __int128 num = n * st.sumsq[c] - static_cast<unsigned __int128>(st.sum[c]) *
                                                        st.sum[c];
    const double mean = static_cast<double>(st.sum[c]) / (static_cast<double>(n) * 255.0);
    const double var =
        static_cast<double>(num) / (static_cast<double>(n) * static_cast<double>(n) * 65025.0);
    s.train.mean[c] = static_cast<float>(mean);
    s.train.stddev[c] = static_cast<float>(std::sqrt(var));
  }
  s.test.mean = s.train.mean;
  s.test.stddev = s.train.stddev;
  return s;
}

}  // namespace tally::data
