// bfloat16 on the GPU (ctest label `gpu`; every test skips with a message when no GPU is present,
// and the file builds without the CUDA backend too): every bf16 CUDA kernel against the CPU's bf16
// kernel, every op of a mixed-precision step through tally's API on both devices, a ResNet-20 bf16
// training step on the GPU against the same step on the CPU, and micro-batched bf16 steps planned
// exactly. (The dry run of a single bf16 step is checked beside float32's, in gpu_ops_test:
// GpuOps.DryRunPeakOfAResNet20StepEqualsTheRealStepToTheByte.)
//
// Inputs are fresh random values that bf16 holds exactly (parameters are float32, as mixed
// precision keeps them), the same on both sides. Both backends compute in float32 (or double) and
// round once per bf16 element stored, but they sum in other orders (cuBLAS and cuDNN choose
// theirs; nvcc contracts a * b + c into one fma), so a result may round to the neighbouring bf16
// value of the CPU's. Tolerances, per element against the CPU (`want`) and for the whole output:
//   kBf16          bf16 outputs: |got - want| <= 2^-7 |want| + 2^-10 max|want| (one bf16 ulp of the
//                  element, plus float32 summation order where a sum cancels), and the whole output
//                  ||got - want|| <= 2^-8 ||want|| (about one rounding, 2^-8 relative).
//   kTwoRoundings  a convolution forward with a bias: the GPU rounds cuDNN's output to bf16 and
//                  again after adding the float32 bias (the CPU rounds once): 2^-7 |want| + 2^-8
//                  max|want| per element, 2^-8 for the whole.
//   kFloat32       float32 outputs formed from bf16 products and sums (GEMM weight gradients, bias
//                  gradients, norm statistics, dgamma and dbeta): float32 accumulation-order accuracy,
//                  every element within 1e-4 max|want|, the whole within 1e-4.
//   kConvWeight    the convolution's weight gradient: on the GPU it passes through bf16 (cuDNN
//                  writes it in bf16, then it is added into the float32 dw; the CPU forms it in
//                  float32), so it is off by up to half a bf16 ulp of the gradient: 2^-8 |want| +
//                  2^-8 max|want| per element, 2^-8 for the whole.
// A NaN or Inf where the CPU has a finite value fails every check; outputs written with beta = 0
// start as NaN on both sides, so an element a kernel forgets stays NaN and fails; beta = 1 starts
// both from the same random values and checks the accumulation. A bf16 output accumulated with
// beta = 1 may be rounded before the addition as well as after it (a library's blend with the old
// value; the CPU's oneDNN does so): there the per-element bound is at least 2^-8 max|want|, half a
// bf16 ulp of the larger addend.
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <type_traits>

#include "core/autograd.h"
#include "core/conv_tuning.h"
#include "core/dry_run.h"
#include "core/ops.h"
#include "mbp/executor.h"
#include "models/families.h"
#include "nn/init.h"
#include "nn/modules.h"
#include "nn/resnet.h"
#include "optim/optimizer.h"
#include "tally/config.h"
#include "tests/gpu_common.h"
#if TALLY_HAVE_CUDA
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "tests/gpu_buffer.h"
#endif

using namespace tally;
using namespace tally::test;
using kernels::bf16;
using i64 = std::int64_t;

namespace {

struct Tol {
  double rtol, atol, whole;  // |got - want| <= rtol |want| + atol max|want|; ||got - want|| <= whole ||want||
};
constexpr Tol kBf16{1.0 / 128, 1.0 / 1024, 1.0 / 256};
constexpr Tol kTwoRoundings{1.0 / 128, 1.0 / 256, 1.0 / 256};
constexpr Tol kFloat32{0.0, 1e-4, 1e-4};
constexpr Tol kConvWeight{1.0 / 256, 1.0 / 256, 1.0 / 256};

double value(float v) { return v; }
double value(bf16 v) { return static_cast<float>(v); }

// got against want under `tol`; non-finite elements must be the same non-finite value on both
// sides (a NaN both sides propagate on purpose, or an output neither writes).
template <class T>
testing::AssertionResult close(const std::vector<T>& got, const std::vector<T>& want, const Tol& tol) {
  if (got.size() != want.size())
    return testing::AssertionFailure() << got.size() << " elements, expected " << want.size();
  double max_want = 0;
  for (const T& w : want)
    if (std::isfinite(value(w))) max_want = std::max(max_want, std::abs(value(w)));
  double num = 0, den = 0, worst = 0;
  std::size_t bad = 0, worst_at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = value(got[i]), w = value(want[i]);
    if (!std::isfinite(g) || !std::isfinite(w)) {
      if ((std::isnan(g) && std::isnan(w)) || g == w) continue;
      return testing::AssertionFailure() << "element " << i << ": got " << g << ", the CPU " << w;
    }
    const double diff = std::abs(g - w), bound = tol.rtol * std::abs(w) + tol.atol * max_want;
    num += diff * diff;
    den += w * w;
    if (!(diff <= bound)) {
      ++bad;
      const double ratio = bound > 0 ? diff / bound : INFINITY;
      if (ratio > worst) worst = ratio, worst_at = i;
    }
  }
  const double whole = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (bad > 0)
    return testing::AssertionFailure() << bad << " of " << got.size() << " elements off; worst at " << worst_at
                                       << ": got " << value(got[worst_at]) << ", the CPU " << value(want[worst_at])
                                       << " (" << worst << "x the tolerance); whole-output relative error " << whole;
  if (!(whole <= tol.whole))
    return testing::AssertionFailure() << "whole-output relative error " << whole << " > " << tol.whole;
  return testing::AssertionSuccess();
}

// n random values in [lo, hi) that bf16 holds exactly, as T.
template <class T>
std::vector<T> random_values(std::size_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::vector<T> v(n);
  const auto u = uniform(n, rng, lo, hi);
  for (std::size_t i = 0; i < n; ++i) v[i] = T(static_cast<float>(bf16(u[i])));
  return v;
}
template <class T>
std::vector<T> poisoned(std::size_t n) { return std::vector<T>(n, T(NAN)); }

std::vector<std::uint16_t> bits(const std::vector<bf16>& v) {
  std::vector<std::uint16_t> b;
  for (const bf16 x : v) b.push_back(x.bits);
  return b;
}

}  // namespace

#if TALLY_HAVE_CUDA
// =============================================================================================
// Kernels: kernels/cuda against kernels/cpu, bf16 activations beside float32 parameters.
namespace kc = tally::kernels::cpu;
namespace kg = tally::kernels::cuda;

namespace {

// Runs an accumulating kernel on both sides for beta = 0 (outputs NaN-poisoned) and beta = 1
// (outputs from the same random start) and compares. O is the output's type (bf16 or float).
template <class O, class Cpu, class Gpu>
void check_beta(std::size_t n, std::mt19937& rng, const Tol& tol, Cpu cpu, Gpu gpu) {
  for (float beta : {0.f, 1.f}) {
    SCOPED_TRACE(testing::Message() << "beta " << beta);
    const std::vector<O> init = beta == 0.f ? poisoned<O>(n) : random_values<O>(n, rng);
    std::vector<O> want = init;
    cpu(want.data(), beta);
    Buf<O> d = dev(init);
    gpu(P(d), beta);
    Tol t = tol;
    if (std::is_same_v<O, bf16> && beta != 0.f) t.atol = std::max(t.atol, 1.0 / 256);  // rounded before the sum too
    EXPECT_TRUE(close(host(d), want, t));
  }
}

}  // namespace

TEST(GpuBf16Kernels, ElementwiseMapsMatchTheCpu) {
  REQUIRE_GPU();
  for (i64 n : {i64{1}, i64{7}, i64{1000}, i64{65536 * 4 + 13}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
    std::mt19937 rng(seed);
    const auto a = random_values<bf16>(n, rng), b = random_values<bf16>(n, rng);
    Buf<bf16> da = dev(a), db = dev(b);
    std::vector<bf16> want(n);
    for (float alpha : {1.f, -1.f, 0.5f}) {
      kc::add<bf16>(n, a.data(), b.data(), alpha, want.data());
      Buf<bf16> y = dev(poisoned<bf16>(n));
      kg::add<bf16>(n, P(da), P(db), alpha, P(y));
      EXPECT_TRUE(close(host(y), want, kBf16)) << "add alpha " << alpha;
    }
    kc::mul<bf16>(n, a.data(), b.data(), want.data());
    Buf<bf16> y = dev(poisoned<bf16>(n));
    kg::mul<bf16>(n, P(da), P(db), P(y));
    EXPECT_TRUE(close(host(y), want, kBf16)) << "mul";
    {
      SCOPED_TRACE("axpby");
      check_beta<bf16>(n, rng, kBf16, [&](bf16* o, float beta) { kc::axpby<bf16>(n, -0.75f, a.data(), beta, o); },
                       [&](bf16* o, float beta) { kg::axpby<bf16>(n, -0.75f, P(da), beta, o); });
    }
    {
      SCOPED_TRACE("mul_backward");
      check_beta<bf16>(n, rng, kBf16, [&](bf16* o, float beta) { kc::mul_backward<bf16>(n, a.data(), b.data(), o, beta); },
                       [&](bf16* o, float beta) { kg::mul_backward<bf16>(n, P(da), P(db), o, beta); });
    }
  }
}

// sigmoid, squeeze-and-excitation's channel scaling (both layouts; the channel sums are double and
// rounded once, as the CPU's) and concatenation's row-block copies (exact at beta 0).
TEST(GpuBf16Kernels, SigmoidChannelScalingAndRowCopiesMatchTheCpu) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const i64 N = 3, C = 70, HW = 49, n = N * C * HW;
  const auto x = random_values<bf16>(n, rng, -8.f, 8.f), dy = random_values<bf16>(n, rng);
  const auto s = random_values<bf16>(N * C, rng);
  Buf<bf16> dx = dev(x), ddy = dev(dy), ds = dev(s);
  std::vector<bf16> y(n);
  kc::sigmoid_forward<bf16>(n, x.data(), y.data());
  Buf<bf16> gy = dev(poisoned<bf16>(n));
  kg::sigmoid_forward<bf16>(n, P(dx), P(gy));
  EXPECT_TRUE(close(host(gy), y, kBf16)) << "sigmoid_forward";
  Buf<bf16> dyv = dev(y);
  {
    SCOPED_TRACE("sigmoid_backward");
    check_beta<bf16>(
        n, rng, kBf16, [&](bf16* o, float beta) { kc::sigmoid_backward<bf16>(n, dy.data(), y.data(), o, beta); },
        [&](bf16* o, float beta) { kg::sigmoid_backward<bf16>(n, P(ddy), P(dyv), o, beta); });
  }
  for (const bool cl : {false, true}) {
    SCOPED_TRACE(cl ? "channels-last" : "row-major");
    check_beta<bf16>(n, rng, kBf16,
                     [&](bf16* o, float beta) { kc::scale_channels<bf16>(N, C, HW, cl, x.data(), s.data(), o, beta); },
                     [&](bf16* o, float beta) { kg::scale_channels<bf16>(N, C, HW, cl, P(dx), P(ds), o, beta); });
    check_beta<bf16>(
        N * C, rng, kBf16,
        [&](bf16* o, float beta) {
          kc::scale_channels_backward_scale<bf16>(N, C, HW, cl, dy.data(), x.data(), o, beta);
        },
        [&](bf16* o, float beta) { kg::scale_channels_backward_scale<bf16>(N, C, HW, cl, P(ddy), P(dx), o, beta); });
  }
  const i64 rows = 500, cols = 7, ld = 19, off = 5;
  std::vector<bf16> want = poisoned<bf16>(rows * ld);
  kc::copy_rows<bf16>(rows, cols, x.data(), cols, want.data() + off, ld, 0.f);
  Buf<bf16> wide = dev(poisoned<bf16>(rows * ld));
  kg::copy_rows<bf16>(rows, cols, P(dx), cols, P(wide) + off, ld, 0.f);
  EXPECT_EQ(bits(host(wide)), bits(want)) << "copy_rows copies the bits";
  check_beta<bf16>(rows * cols, rng, kBf16,
                   [&](bf16* o, float beta) { kc::copy_rows<bf16>(rows, cols, x.data() + off, ld, o, cols, beta); },
                   [&](bf16* o, float beta) { kg::copy_rows<bf16>(rows, cols, P(dx) + off, ld, o, cols, beta); });
}

// ReLU is exact: the GPU keeps the CPU's bits, signed zeros, NaN and infinities included.
TEST(GpuBf16Kernels, ReluMatchesTheCpuBitForBit) {
  REQUIRE_GPU();
  const auto seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const i64 n = 5000;
  auto x = random_values<bf16>(n, rng), dy = random_values<bf16>(n, rng);
  const std::array<std::uint16_t, 8> specials = {0x8000, 0x0000, 0x7fc0, 0xffc1, 0xff80, 0x7f80, 0x0001, 0x8001};
  for (std::size_t i = 0; i < specials.size(); ++i) x[i] = bf16::from_bits(specials[i]);
  Buf<bf16> dx_in = dev(x), ddy = dev(dy);
  std::vector<bf16> want(n);
  kc::relu_forward<bf16>(n, x.data(), want.data());
  Buf<bf16> y = dev(poisoned<bf16>(n));
  kg::relu_forward<bf16>(n, P(dx_in), P(y));
  EXPECT_EQ(bits(host(y)), bits(want)) << "relu_forward";
  // the backward masks dy where the forward output y (here x) is <= 0
  kc::relu_backward<bf16>(n, dy.data(), x.data(), want.data(), 0.f);
  Buf<bf16> g = dev(poisoned<bf16>(n));
  kg::relu_backward<bf16>(n, P(ddy), P(dx_in), P(g), 0.f);
  EXPECT_EQ(bits(host(g)), bits(want)) << "relu_backward";
  x.erase(x.begin(), x.begin() + specials.size());  // beta = 1 from finite values
  dy.resize(x.size());
  Buf<bf16> xf = dev(x), dyf = dev(dy);
  check_beta<bf16>(x.size(), rng, kBf16,
                   [&](bf16* o, float beta) { kc::relu_backward<bf16>(static_cast<i64>(x.size()), dy.data(), x.data(), o, beta); },
                   [&](bf16* o, float beta) { kg::relu_backward<bf16>(static_cast<i64>(x.size()), P(dyf), P(xf), o, beta); });
}

TEST(GpuBf16Kernels, RowBroadcastsAndReductionsMatchTheCpu) {
  REQUIRE_GPU();
  for (auto [rows, cols] : std::vector<std::pair<i64, i64>>{{1, 1}, {3, 5}, {1000, 33}, {7, 100}, {4097, 10}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols << " seed " << seed);
    std::mt19937 rng(seed);
    const auto x = random_values<bf16>(rows * cols, rng);
    const auto bias = uniform(cols, rng);  // float32 parameters, not bf16 values
    Buf<bf16> dx = dev(x);
    Buf<float> dbias = dev(bias);
    std::vector<bf16> want(rows * cols);
    kc::add_bias_rows<bf16>(rows, cols, x.data(), bias.data(), want.data());
    Buf<bf16> y = dev(poisoned<bf16>(rows * cols));
    kg::add_bias_rows<bf16>(rows, cols, P(dx), P(dbias), P(y));
    EXPECT_TRUE(close(host(y), want, kBf16)) << "add_bias_rows";
    kg::add_bias_rows<bf16>(rows, cols, P(dx), P(dbias), P(dx));  // in place, as linear() calls it
    EXPECT_TRUE(close(host(dx), want, kBf16)) << "add_bias_rows in place";
    dx = dev(x);
    {
      SCOPED_TRACE("sum_rows into float32");
      check_beta<float>(cols, rng, kFloat32, [&](float* o, float beta) { kc::sum_rows<bf16>(rows, cols, x.data(), o, beta); },
                        [&](float* o, float beta) { kg::sum_rows<bf16>(rows, cols, P(dx), o, beta); });
    }
    Buf<float> r1 = dev(poisoned<float>(cols)), r2 = dev(poisoned<float>(cols));
    kg::sum_rows<bf16>(rows, cols, P(dx), P(r1), 0.f);
    kg::sum_rows<bf16>(rows, cols, P(dx), P(r2), 0.f);
    EXPECT_EQ(host(r1), host(r2)) << "sum_rows must be deterministic";
  }
  for (i64 n : {i64{1}, i64{1000}, (i64{1} << 20) + 3}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
    std::mt19937 rng(seed);
    const auto x = random_values<bf16>(n, rng, -1.f, 2.f);
    Buf<bf16> dx = dev(x);
    const bf16 want = kc::sum_all<bf16>(n, x.data());
    const bf16 got = kg::sum_all<bf16>(n, P(dx));
    EXPECT_TRUE(close(std::vector<bf16>{got}, std::vector<bf16>{want}, kBf16)) << "sum_all";
    EXPECT_EQ(kg::sum_all<bf16>(n, P(dx)).bits, got.bits) << "sum_all must be deterministic";
    // the mean's form: y[0] = sum / n, where the values live (the CPU rounds the sum first, then the
    // quotient; the GPU rounds once: at most one ulp apart)
    const float factor = 1.f / static_cast<float>(n);
    bf16 want_mean;
    kc::sum_to<bf16>(n, x.data(), factor, &want_mean);
    Buf<bf16> mean = dev(poisoned<bf16>(1));
    kg::sum_to<bf16>(n, P(dx), factor, P(mean));
    EXPECT_TRUE(close(host(mean), std::vector<bf16>{want_mean}, kBf16)) << "sum_to";
    // its gradient spread over n elements, and the loss's product of two device scalars
    {
      SCOPED_TRACE("broadcast_scalar");
      const std::vector<bf16> s = {bf16(-1.625f)};
      Buf<bf16> ds = dev(s);
      check_beta<bf16>(n, rng, kBf16, [&](bf16* o, float beta) { kc::broadcast_scalar<bf16>(n, s.data(), 0.37f, o, beta); },
                       [&](bf16* o, float beta) { kg::broadcast_scalar<bf16>(n, P(ds), 0.37f, o, beta); });
      const std::vector<bf16> t = {bf16(0.3125f)};
      Buf<bf16> dt = dev(t);
      std::vector<bf16> wp(n);
      kc::fill_product<bf16>(n, s.data(), t.data(), wp.data());
      Buf<bf16> gp = dev(poisoned<bf16>(n));
      kg::fill_product<bf16>(n, P(ds), P(dt), P(gp));
      EXPECT_EQ(bits(host(gp)), bits(wp)) << "fill_product";
    }
  }
}

// gemm<bf16> (bf16 C, rounded once after beta * C is added) and gemm<bf16, float> (the weight
// gradient's form: a float32 C that micro-batches accumulate into with beta = 1).
TEST(GpuBf16Kernels, GemmMatchesTheCpuWithBf16AndFloat32Outputs) {
  REQUIRE_GPU();
  const std::size_t ws_bytes = kg::gemm_workspace_bytes(std::size_t(2) << 30);
  const auto ws = scratch(ws_bytes);
  for (auto [M, N, K] : std::vector<std::array<i64, 3>>{{1, 1, 1}, {3, 5, 7}, {64, 33, 17}, {128, 10, 64}, {5, 3, 0},
                                                        {300, 257, 1024}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const auto seed = fresh_seed();
        SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " ta " << ta << " tb " << tb
                                        << " seed " << seed);
        std::mt19937 rng(seed);
        // leading dimensions with padding, so that ld != the logical width is exercised
        const i64 lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 1, ldc = N + 3;
        const auto A = random_values<bf16>((ta ? K : M) * lda, rng), B = random_values<bf16>((tb ? N : K) * ldb, rng);
        Buf<bf16> dA = dev(A), dB = dev(B);
        std::vector<float> cpu_ws(kc::gemm_workspace_bytes<bf16>(0, M, N, K) / sizeof(float) + 1);
        {
          SCOPED_TRACE("bf16 C");
          check_beta<bf16>(M * ldc, rng, kBf16,
                           [&](bf16* C, float beta) {
                             kc::gemm<bf16>(ta, tb, M, N, K, 1.5f, A.data(), lda, B.data(), ldb, beta, C, ldc,
                                            cpu_ws.data(), cpu_ws.size() * sizeof(float));
                           },
                           [&](bf16* C, float beta) {
                             kg::gemm<bf16>(ta, tb, M, N, K, 1.5f, P(dA), lda, P(dB), ldb, beta, C, ldc, ws_ptr(ws),
                                            ws_bytes);
                           });
        }
        {
          SCOPED_TRACE("float32 C");
          check_beta<float>(M * ldc, rng, kFloat32,
                            [&](float* C, float beta) {
                              kc::gemm<bf16, float>(ta, tb, M, N, K, 1.f, A.data(), lda, B.data(), ldb, beta, C, ldc,
                                                    cpu_ws.data(), cpu_ws.size() * sizeof(float));
                            },
                            [&](float* C, float beta) {
                              kg::gemm<bf16, float>(ta, tb, M, N, K, 1.f, P(dA), lda, P(dB), ldb, beta, C, ldc,
                                                    ws_ptr(ws), ws_bytes);
                            });
        }
      }
    }
  }
}

// ---- convolution ----------------------------------------------------------------------------------

namespace {

kernels::Conv2dShape conv_shape(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 S, i64 stride, i64 pad, i64 dil,
                                i64 groups, bool bias, std::size_t limit = std::size_t(64) << 20) {
  kernels::Conv2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.K = K, s.R = R, s.S = S;
  s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad;
  s.dil_h = s.dil_w = dil;
  s.groups = groups;
  s.workspace_limit = limit;
  s.bias = bias;
  return s;
}

struct ConvCase {
  const char* name;
  kernels::Conv2dShape s;
};

std::vector<ConvCase> conv_cases() {
  constexpr std::size_t kLarge = std::size_t(1) << 30;
  return {
      {"3x3 same, odd sizes, bias", conv_shape(3, 5, 7, 9, 4, 3, 3, 1, 1, 1, 1, true)},
      {"1x1 stride 1", conv_shape(2, 8, 5, 5, 6, 1, 1, 1, 0, 1, 1, false)},
      {"1x1 stride 2 (projection shortcut)", conv_shape(3, 16, 9, 9, 32, 1, 1, 2, 0, 1, 1, false)},
      {"1x1 stride 2, even input", conv_shape(2, 8, 10, 10, 16, 1, 1, 2, 0, 1, 1, false)},
      {"3x3 stride 2, bias", conv_shape(3, 4, 9, 7, 8, 3, 3, 2, 1, 1, 1, true)},
      {"groups 2, bias", conv_shape(2, 6, 8, 8, 4, 3, 3, 1, 1, 1, 2, true)},
      {"depthwise", conv_shape(2, 5, 7, 9, 5, 3, 3, 1, 1, 1, 5, false)},
      {"dilation 2, no padding", conv_shape(2, 3, 11, 10, 4, 3, 3, 1, 0, 2, 1, false)},
      {"5x5 rectangular input, bias", conv_shape(1, 3, 12, 17, 2, 5, 5, 1, 2, 1, 1, true)},
      {"ResNet-20 stage 1 3x3", conv_shape(8, 16, 32, 32, 16, 3, 3, 1, 1, 1, 1, false, kLarge)},
      {"ResNet-20 stem 3x3", conv_shape(8, 3, 32, 32, 16, 3, 3, 1, 1, 1, 1, false, kLarge)},
      {"ResNet-50 3x3 at 28x28", conv_shape(4, 128, 28, 28, 128, 3, 3, 1, 1, 1, 1, false, kLarge)},
      {"ResNet-50 stem 7x7 stride 2", conv_shape(2, 3, 224, 224, 64, 7, 7, 2, 3, 1, 1, false, kLarge)},
  };
}

// Every pass of `s` in bf16 on the GPU and on the CPU (its reference route: the widened float32
// convolution on bf16 values, the weights rounded to bf16 as cuDNN's copy is) from the same inputs.
void check_conv(const kernels::Conv2dShape& s) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed << "\n" << kg::conv2d_plan_description<bf16>(s));
  std::mt19937 rng(seed);
  const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * (s.C / s.groups) * s.R * s.S, ny = s.N * s.K * s.P() * s.Q();
  const auto x = random_values<bf16>(nx, rng), dy = random_values<bf16>(ny, rng);
  const auto w = uniform(nw, rng, -0.5f, 0.5f), b = uniform(s.K, rng);  // float32 master weights and bias
  Buf<bf16> dx_in = dev(x), ddy = dev(dy);
  Buf<float> dw_in = dev(w), db_in = dev(b);
  const UseCpuReferenceConvolutions use_reference;
  using kernels::ConvPass;
  auto cpu_ws = [&](ConvPass pass) { return std::vector<unsigned char>(kc::conv2d_workspace_bytes<bf16>(s, pass) + 1); };
  std::vector<unsigned char> cws_f = cpu_ws(ConvPass::forward), cws_d = cpu_ws(ConvPass::backward_data),
                             cws_w = cpu_ws(ConvPass::backward_filter);
  // Each pass's workspace: the bf16 weight copy (256-byte aligned), then cuDNN's part within the limit.
  const std::size_t copy = (static_cast<std::size_t>(nw) * sizeof(bf16) + 255) / 256 * 256;
  for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter}) {
    const std::size_t bytes = kg::conv2d_workspace_bytes<bf16>(s, pass);
    EXPECT_GE(bytes, copy);
    EXPECT_LE(bytes - copy, s.workspace_limit);
  }
  const auto ws_f = scratch(kg::conv2d_workspace_bytes<bf16>(s, ConvPass::forward));
  const auto ws_d = scratch(kg::conv2d_workspace_bytes<bf16>(s, ConvPass::backward_data));
  const auto ws_w = scratch(kg::conv2d_workspace_bytes<bf16>(s, ConvPass::backward_filter));

  std::vector<bf16> want = poisoned<bf16>(ny);
  kc::conv2d_forward<bf16>(s, x.data(), w.data(), s.bias ? b.data() : nullptr, want.data(), cws_f.data());
  Buf<bf16> y = dev(poisoned<bf16>(ny));
  kg::conv2d_forward<bf16>(s, P(dx_in), P(dw_in), s.bias ? P(db_in) : nullptr, P(y), ws_ptr(ws_f));
  EXPECT_TRUE(close(host(y), want, s.bias ? kTwoRoundings : kBf16)) << "forward";
  {
    SCOPED_TRACE("backward data");
    check_beta<bf16>(nx, rng, kBf16,
                     [&](bf16* o, float beta) { kc::conv2d_backward_data<bf16>(s, dy.data(), w.data(), o, beta, cws_d.data()); },
                     [&](bf16* o, float beta) { kg::conv2d_backward_data<bf16>(s, P(ddy), P(dw_in), o, beta, ws_ptr(ws_d)); });
  }
  {
    SCOPED_TRACE("backward filter into float32");
    check_beta<float>(nw, rng, kConvWeight,
                      [&](float* o, float beta) { kc::conv2d_backward_filter<bf16>(s, x.data(), dy.data(), o, beta, cws_w.data()); },
                      [&](float* o, float beta) { kg::conv2d_backward_filter<bf16>(s, P(dx_in), P(ddy), o, beta, ws_ptr(ws_w)); });
  }
  if (s.bias) {
    SCOPED_TRACE("backward bias into float32");
    check_beta<float>(s.K, rng, kFloat32, [&](float* o, float beta) { kc::conv2d_backward_bias<bf16>(s, dy.data(), o, beta); },
                      [&](float* o, float beta) { kg::conv2d_backward_bias<bf16>(s, P(ddy), o, beta); });
  }
  // Deterministic mode (the default): the same backward twice, bit for bit — unless no
  // deterministic algorithm fitted the limit (the plan says so).
  if (kg::conv2d_plan_description<bf16>(s).find("NOT deterministic") != std::string::npos) return;
  Buf<float> f1 = dev(poisoned<float>(nw)), f2 = dev(poisoned<float>(nw));
  Buf<bf16> d1 = dev(poisoned<bf16>(nx)), d2 = dev(poisoned<bf16>(nx));
  kg::conv2d_backward_filter<bf16>(s, P(dx_in), P(ddy), P(f1), 0.f, ws_ptr(ws_w));
  kg::conv2d_backward_filter<bf16>(s, P(dx_in), P(ddy), P(f2), 0.f, ws_ptr(ws_w));
  EXPECT_EQ(host(f1), host(f2)) << "backward filter must be deterministic";
  kg::conv2d_backward_data<bf16>(s, P(ddy), P(dw_in), P(d1), 0.f, ws_ptr(ws_d));
  kg::conv2d_backward_data<bf16>(s, P(ddy), P(dw_in), P(d2), 0.f, ws_ptr(ws_d));
  EXPECT_EQ(bits(host(d1)), bits(host(d2))) << "backward data must be deterministic";
}

}  // namespace

TEST(GpuBf16Kernels, ConvolutionMatchesTheCpu) {
  REQUIRE_GPU();
  const UseCudnnConvApi use_legacy(kernels::cuda::CudnnConvApi::legacy);  // the graph API: below
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    const std::size_t before = kg::conv2d_workspace_bytes<bf16>(c.s, kernels::ConvPass::forward);
    check_conv(c.s);
    EXPECT_EQ(kg::conv2d_workspace_bytes<bf16>(c.s, kernels::ConvPass::forward), before)
        << "the cached choice must not change";
    EXPECT_EQ(kg::conv2d_plan_description<bf16>(c.s).rfind("bf16 conv2d", 0), 0u)
        << "a bf16 plan of its own: " << kg::conv2d_plan_description<bf16>(c.s);
  }
}

// The same through cuDNN's graph (backend) API.
TEST(GpuBf16Kernels, ConvolutionThroughTheGraphApiMatchesTheCpu) {
  REQUIRE_GPU();
  const UseCudnnConvApi use_graph(kernels::cuda::CudnnConvApi::graph);
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    const std::string plan = kg::conv2d_plan_description<bf16>(c.s);
    EXPECT_EQ(plan.rfind("bf16 conv2d", 0), 0u) << plan;
    EXPECT_NE(plan.find("through the graph API"), std::string::npos) << plan;
    check_conv(c.s);
  }
}

// The bf16 weight copy and weight gradient live in the workspace: a call without one says so.
TEST(GpuBf16Kernels, ConvolutionWithoutItsWorkspaceIsAClearError) {
  REQUIRE_GPU();
  const kernels::Conv2dShape s = conv_shape(2, 4, 6, 6, 3, 3, 3, 1, 1, 1, 1, false);
  Buf<bf16> x = dev(std::vector<bf16>(2 * 4 * 36, bf16(0.5f))), y(2 * 3 * 36);
  Buf<float> w = dev(std::vector<float>(3 * 4 * 9, 0.25f));
  try {
    kg::conv2d_forward<bf16>(s, P(x), P(w), nullptr, P(y), nullptr);
    kg::synchronize();
    ADD_FAILURE() << "a bf16 convolution without its workspace should be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("conv2d_workspace_bytes<bf16>"), std::string::npos) << e.what();
  }
}

// ---- norms -----------------------------------------------------------------------------------------

TEST(GpuBf16Kernels, BatchNormMatchesTheCpu) {
  REQUIRE_GPU();
  // The last two are large enough that a channel's sum is split over several blocks.
  for (auto [N, C, HW] : std::vector<std::array<i64, 3>>{{3, 5, 63}, {2, 16, 1}, {8, 3, 1024}, {16, 64, 784}, {32, 16, 1024}}) {
    for (bool affine : {true, false}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " HW " << HW << " affine " << affine << " seed "
                                      << seed);
      std::mt19937 rng(seed);
      const i64 n = N * C * HW;
      const auto bnws = scratch(kg::batch_norm_workspace_bytes(N, C, HW));
      const auto x = random_values<bf16>(n, rng, 2.f, 6.f);  // an offset mean: the two-pass variance matters
      const auto dy = random_values<bf16>(n, rng);
      const auto gamma = uniform(C, rng, 0.5f, 1.5f), beta_ = uniform(C, rng);
      auto rm = uniform(C, rng), rv = uniform(C, rng, 0.5f, 2.f);
      Buf<bf16> dx_in = dev(x), ddy = dev(dy);
      Buf<float> dgm = dev(gamma), dbt = dev(beta_), drm = dev(rm), drv = dev(rv);
      const float* g_c = affine ? gamma.data() : nullptr;
      const float* b_c = affine ? beta_.data() : nullptr;
      const float* g_g = affine ? P(dgm) : nullptr;
      const float* b_g = affine ? P(dbt) : nullptr;

      std::vector<bf16> y = poisoned<bf16>(n);
      std::vector<float> sm = poisoned<float>(C), si = poisoned<float>(C);
      kc::batch_norm_forward_train<bf16>(N, C, HW, x.data(), g_c, b_c, 1e-5f, 0.1f, rm.data(), rv.data(), y.data(),
                                         sm.data(), si.data());
      Buf<bf16> gy = dev(poisoned<bf16>(n));
      Buf<float> gsm = dev(poisoned<float>(C)), gsi = dev(poisoned<float>(C));
      kg::batch_norm_forward_train<bf16>(N, C, HW, P(dx_in), g_g, b_g, 1e-5f, 0.1f, P(drm), P(drv), P(gy), P(gsm),
                                         P(gsi), ws_ptr(bnws));
      EXPECT_TRUE(close(host(gy), y, kBf16)) << "y";
      EXPECT_TRUE(close(host(gsm), sm, kFloat32)) << "save_mean";
      EXPECT_TRUE(close(host(gsi), si, kFloat32)) << "save_invstd";
      EXPECT_TRUE(close(host(drm), rm, kFloat32)) << "running_mean";
      EXPECT_TRUE(close(host(drv), rv, kFloat32)) << "running_var";

      // training backward, from the CPU's saved statistics on both sides
      Buf<float> csm = dev(sm), csi = dev(si);
      {
        SCOPED_TRACE("backward dx");
        check_beta<bf16>(n, rng, kBf16,
                         [&](bf16* o, float beta) {
                           kc::batch_norm_backward<bf16>(N, C, HW, dy.data(), x.data(), g_c, sm.data(), si.data(), o,
                                                         beta, nullptr, nullptr, 0.f);
                         },
                         [&](bf16* o, float beta) {
                           kg::batch_norm_backward<bf16>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), o, beta,
                                                         nullptr, nullptr, 0.f, ws_ptr(bnws));
                         });
      }
      for (float bp : {0.f, 1.f}) {
        std::vector<float> dg = bp == 0.f ? poisoned<float>(C) : uniform(C, rng);
        std::vector<float> db = bp == 0.f ? poisoned<float>(C) : uniform(C, rng);
        Buf<float> gdg = dev(dg), gdb = dev(db);
        kc::batch_norm_backward<bf16>(N, C, HW, dy.data(), x.data(), g_c, sm.data(), si.data(), nullptr, 0.f,
                                      dg.data(), db.data(), bp);
        kg::batch_norm_backward<bf16>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), nullptr, 0.f, P(gdg), P(gdb),
                                      bp, ws_ptr(bnws));
        EXPECT_TRUE(close(host(gdg), dg, kFloat32)) << "dgamma beta " << bp;
        EXPECT_TRUE(close(host(gdb), db, kFloat32)) << "dbeta beta " << bp;
      }
      Buf<bf16> r1 = dev(poisoned<bf16>(n)), r2 = dev(poisoned<bf16>(n));
      kg::batch_norm_backward<bf16>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), P(r1), 0.f, nullptr, nullptr, 0.f,
                                    ws_ptr(bnws));
      kg::batch_norm_backward<bf16>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), P(r2), 0.f, nullptr, nullptr, 0.f,
                                    ws_ptr(bnws));
      EXPECT_EQ(bits(host(r1)), bits(host(r2))) << "batch norm backward must be deterministic";

      // eval forward and backward (running statistics as constants)
      std::vector<bf16> ye = poisoned<bf16>(n);
      kc::batch_norm_forward_eval<bf16>(N, C, HW, x.data(), g_c, b_c, rm.data(), rv.data(), 1e-5f, ye.data());
      Buf<bf16> gye = dev(poisoned<bf16>(n));
      Buf<float> erm = dev(rm), erv = dev(rv);
      kg::batch_norm_forward_eval<bf16>(N, C, HW, P(dx_in), g_g, b_g, P(erm), P(erv), 1e-5f, P(gye));
      EXPECT_TRUE(close(host(gye), ye, kBf16)) << "eval y";
      {
        SCOPED_TRACE("eval backward dx");
        check_beta<bf16>(n, rng, kBf16,
                         [&](bf16* o, float beta) {
                           kc::batch_norm_backward_eval<bf16>(N, C, HW, dy.data(), x.data(), g_c, rm.data(), rv.data(),
                                                              1e-5f, o, beta, nullptr, nullptr, 0.f);
                         },
                         [&](bf16* o, float beta) {
                           kg::batch_norm_backward_eval<bf16>(N, C, HW, P(ddy), P(dx_in), g_g, P(erm), P(erv), 1e-5f, o,
                                                              beta, nullptr, nullptr, 0.f, ws_ptr(bnws));
                         });
      }
      std::vector<float> dgc = poisoned<float>(C), dbc = poisoned<float>(C);
      kc::batch_norm_backward_eval<bf16>(N, C, HW, dy.data(), x.data(), g_c, rm.data(), rv.data(), 1e-5f, nullptr, 0.f,
                                         dgc.data(), dbc.data(), 0.f);
      Buf<float> gdg = dev(poisoned<float>(C)), gdb = dev(poisoned<float>(C));
      kg::batch_norm_backward_eval<bf16>(N, C, HW, P(ddy), P(dx_in), g_g, P(erm), P(erv), 1e-5f, nullptr, 0.f, P(gdg),
                                         P(gdb), 0.f, ws_ptr(bnws));
      EXPECT_TRUE(close(host(gdg), dgc, kFloat32)) << "eval dgamma";
      EXPECT_TRUE(close(host(gdb), dbc, kFloat32)) << "eval dbeta";
    }
  }
}

TEST(GpuBf16Kernels, GroupNormMatchesTheCpu) {
  REQUIRE_GPU();
  for (auto [N, C, HW, G] : std::vector<std::array<i64, 4>>{{3, 6, 63, 3}, {2, 5, 35, 5}, {2, 5, 35, 1}, {4, 32, 64, 8}}) {
    for (bool affine : {true, false}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " HW " << HW << " G " << G << " affine " << affine
                                      << " seed " << seed);
      std::mt19937 rng(seed);
      const i64 n = N * C * HW;
      const auto x = random_values<bf16>(n, rng, -3.f, 5.f), dy = random_values<bf16>(n, rng);
      const auto gamma = uniform(C, rng, 0.5f, 1.5f), beta_ = uniform(C, rng);
      Buf<bf16> dx_in = dev(x), ddy = dev(dy);
      Buf<float> dgm = dev(gamma), dbt = dev(beta_);
      const float* g_c = affine ? gamma.data() : nullptr;
      const float* b_c = affine ? beta_.data() : nullptr;
      const float* g_g = affine ? P(dgm) : nullptr;
      const float* b_g = affine ? P(dbt) : nullptr;
      std::vector<bf16> y = poisoned<bf16>(n);
      std::vector<float> sm = poisoned<float>(N * G), si = poisoned<float>(N * G);
      kc::group_norm_forward<bf16>(N, C, HW, G, x.data(), g_c, b_c, 1e-5f, y.data(), sm.data(), si.data());
      Buf<bf16> gy = dev(poisoned<bf16>(n));
      Buf<float> gsm = dev(poisoned<float>(N * G)), gsi = dev(poisoned<float>(N * G));
      kg::group_norm_forward<bf16>(N, C, HW, G, P(dx_in), g_g, b_g, 1e-5f, P(gy), P(gsm), P(gsi));
      EXPECT_TRUE(close(host(gy), y, kBf16)) << "y";
      EXPECT_TRUE(close(host(gsm), sm, kFloat32)) << "save_mean";
      EXPECT_TRUE(close(host(gsi), si, kFloat32)) << "save_invstd";

      Buf<float> csm = dev(sm), csi = dev(si);
      {
        SCOPED_TRACE("backward dx");
        check_beta<bf16>(n, rng, kBf16,
                         [&](bf16* o, float beta) {
                           kc::group_norm_backward<bf16>(N, C, HW, G, dy.data(), x.data(), g_c, sm.data(), si.data(), o,
                                                         beta, nullptr, nullptr, 0.f);
                         },
                         [&](bf16* o, float beta) {
                           kg::group_norm_backward<bf16>(N, C, HW, G, P(ddy), P(dx_in), g_g, P(csm), P(csi), o, beta,
                                                         nullptr, nullptr, 0.f);
                         });
      }
      for (float bp : {0.f, 1.f}) {
        std::vector<float> dg = bp == 0.f ? poisoned<float>(C) : uniform(C, rng);
        std::vector<float> db = bp == 0.f ? poisoned<float>(C) : uniform(C, rng);
        Buf<float> gdg = dev(dg), gdb = dev(db);
        kc::group_norm_backward<bf16>(N, C, HW, G, dy.data(), x.data(), g_c, sm.data(), si.data(), nullptr, 0.f,
                                      dg.data(), db.data(), bp);
        kg::group_norm_backward<bf16>(N, C, HW, G, P(ddy), P(dx_in), g_g, P(csm), P(csi), nullptr, 0.f, P(gdg), P(gdb),
                                      bp);
        EXPECT_TRUE(close(host(gdg), dg, kFloat32)) << "dgamma beta " << bp;
        EXPECT_TRUE(close(host(gdb), db, kFloat32)) << "dbeta beta " << bp;
      }
    }
  }
}

// ---- pooling ---------------------------------------------------------------------------------------

TEST(GpuBf16Kernels, PoolingMatchesTheCpu) {
  REQUIRE_GPU();
  const std::vector<kernels::Pool2dShape> shapes = {
      {3, 5, 7, 9, 3, 3, 2, 2, 1, 1},  // ResNet stem: overlapping windows, padding
      {2, 4, 8, 8, 2, 2, 2, 2, 0, 0},  // non-overlapping
      {2, 3, 7, 9, 3, 3, 1, 1, 1, 1},  // stride 1: every input in 9 windows
      {1, 2, 9, 7, 3, 2, 2, 3, 1, 0},  // rectangular kernel and strides
  };
  for (const kernels::Pool2dShape& s : shapes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "kernel " << s.kh << "x" << s.kw << " stride " << s.stride_h << "x"
                                    << s.stride_w << " pad " << s.pad_h << "x" << s.pad_w << " seed " << seed);
    std::mt19937 rng(seed);
    const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P() * s.Q();
    const auto x = random_values<bf16>(nx, rng), dy = random_values<bf16>(ny, rng);
    Buf<bf16> dxi = dev(x), ddy = dev(dy);

    std::vector<bf16> y = poisoned<bf16>(ny);
    std::vector<std::int32_t> am(ny, -7);
    kc::max_pool2d_forward<bf16>(s, x.data(), y.data(), am.data());
    Buf<bf16> gy = dev(poisoned<bf16>(ny));
    Buf<std::int32_t> gam(std::vector<std::int32_t>(ny, -7));
    kg::max_pool2d_forward<bf16>(s, P(dxi), P(gy), P(gam));
    EXPECT_EQ(bits(host(gy)), bits(y)) << "max pool y (exact)";
    EXPECT_EQ(host(gam), am) << "max pool argmax";
    {
      SCOPED_TRACE("max pool backward");
      check_beta<bf16>(nx, rng, kBf16, [&](bf16* o, float beta) { kc::max_pool2d_backward<bf16>(s, dy.data(), am.data(), o, beta); },
                       [&](bf16* o, float beta) { kg::max_pool2d_backward<bf16>(s, P(ddy), P(gam), o, beta); });
    }
    for (bool cip : {true, false}) {
      SCOPED_TRACE(testing::Message() << "avg pool, count_include_pad " << cip);
      std::vector<bf16> ya = poisoned<bf16>(ny);
      kc::avg_pool2d_forward<bf16>(s, cip, x.data(), ya.data());
      Buf<bf16> gya = dev(poisoned<bf16>(ny));
      kg::avg_pool2d_forward<bf16>(s, cip, P(dxi), P(gya));
      EXPECT_TRUE(close(host(gya), ya, kBf16)) << "avg pool y";
      check_beta<bf16>(nx, rng, kBf16, [&](bf16* o, float beta) { kc::avg_pool2d_backward<bf16>(s, cip, dy.data(), o, beta); },
                       [&](bf16* o, float beta) { kg::avg_pool2d_backward<bf16>(s, cip, P(ddy), o, beta); });
    }
  }
  for (auto [H, W, OH, OW] : std::vector<std::array<i64, 4>>{{7, 9, 1, 1}, {7, 9, 3, 4}, {8, 8, 2, 2}, {5, 3, 7, 6}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "adaptive " << H << "x" << W << " -> " << OH << "x" << OW << " seed " << seed);
    std::mt19937 rng(seed);
    const i64 N = 2, C = 3, nx = N * C * H * W, ny = N * C * OH * OW;
    const auto x = random_values<bf16>(nx, rng), dy = random_values<bf16>(ny, rng);
    Buf<bf16> dxi = dev(x), ddy = dev(dy);
    std::vector<bf16> y = poisoned<bf16>(ny);
    kc::adaptive_avg_pool2d_forward<bf16>(N, C, H, W, OH, OW, x.data(), y.data());
    Buf<bf16> gy = dev(poisoned<bf16>(ny));
    kg::adaptive_avg_pool2d_forward<bf16>(N, C, H, W, OH, OW, P(dxi), P(gy));
    EXPECT_TRUE(close(host(gy), y, kBf16)) << "adaptive y";
    check_beta<bf16>(nx, rng, kBf16,
                     [&](bf16* o, float beta) { kc::adaptive_avg_pool2d_backward<bf16>(N, C, H, W, OH, OW, dy.data(), o, beta); },
                     [&](bf16* o, float beta) { kg::adaptive_avg_pool2d_backward<bf16>(N, C, H, W, OH, OW, P(ddy), o, beta); });
  }
}

#else

TEST(GpuBf16Kernels, NeedTheCudaBackend) { GTEST_SKIP() << "CPU-only build: " << tally::build_info(); }

#endif  // TALLY_HAVE_CUDA

// =============================================================================================
// Ops through tally's API: the same op on the CPU and on the GPU with bf16 activations and float32
// parameters, forward and backward; a ResNet-20 step; the arena accounting of a bf16 step.
namespace {

// A host tensor of random bf16 values, as dtype.
Tensor host_tensor(const Shape& s, std::mt19937& rng, DType dtype, float lo = -1.f, float hi = 1.f,
                   Category cat = Category::input) {
  const auto v = random_values<float>(static_cast<std::size_t>(shape_numel(s)), rng, lo, hi);
  return Tensor::from_vector(v, s, Device::cpu(), cat).to(dtype);
}

// A tensor's values as floats, and in its own dtype for the comparisons.
template <class T>
std::vector<T> values(const Tensor& t) { return t.to(Device::cpu()).contiguous().to_vector<T>(); }

testing::AssertionResult close_tensors(const Tensor& got, const Tensor& want, const Tol& tol) {
  if (got.dtype() != want.dtype())
    return testing::AssertionFailure() << "dtype " << dtype_name(got.dtype()) << ", the CPU's "
                                       << dtype_name(want.dtype());
  if (got.shape() != want.shape()) return testing::AssertionFailure() << got.str() << " against " << want.str();
  if (want.dtype() == DType::BFloat16) return close(values<bf16>(got), values<bf16>(want), tol);
  return close(values<float>(got), values<float>(want), tol);
}

// One op: activations (bf16), float32 parameters, the function and its tolerances: of the output
// and the activations' gradients (bf16), and of each parameter's gradient (float32).
struct OpCase {
  std::string name;
  std::vector<Shape> activations, parameters;
  std::function<Tensor(const std::vector<Tensor>& a, const std::vector<Tensor>& p)> f;
  Tol out = kBf16;
  std::vector<Tol> param_tol = {};  // kFloat32 where not given
  float lo = -1.f, hi = 1.f;        // of the random activations
};

struct Run {
  Tensor y;
  std::vector<Tensor> da, dp;
};

Run run_op(const OpCase& c, Device d, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Tensor> a, p;
  for (const Shape& s : c.activations) {
    a.push_back(host_tensor(s, rng, DType::BFloat16, c.lo, c.hi).to(d).detach());
    a.back().set_requires_grad(true);
  }
  for (const Shape& s : c.parameters) {
    p.push_back(host_tensor(s, rng, DType::Float32, -0.5f, 0.5f, Category::parameter).to(d).detach());
    p.back().set_requires_grad(true);
  }
  Run r;
  r.y = c.f(a, p);
  // An upstream gradient of bf16 values in y's dtype, the same on both devices.
  const Tensor seed_grad = host_tensor(r.y.shape(), rng, r.y.dtype()).to(d);
  run_backward(r.y, seed_grad);
  for (const Tensor& t : a) r.da.push_back(t.grad());
  for (const Tensor& t : p) r.dp.push_back(t.grad());
  return r;
}

void check_op(const OpCase& c) {
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("{} (seed {})", c.name, seed));
  const Run cpu = run_op(c, Device::cpu(), seed);
  const Run gpu = run_op(c, Device::cuda(), seed);
  ASSERT_TRUE(gpu.y.device().is_cuda());
  EXPECT_TRUE(close_tensors(gpu.y, cpu.y, c.out)) << "output";
  for (std::size_t i = 0; i < cpu.da.size(); ++i) {
    EXPECT_EQ(gpu.da[i].dtype(), DType::BFloat16) << "an activation's gradient has the activation's dtype";
    EXPECT_TRUE(close_tensors(gpu.da[i], cpu.da[i], kBf16)) << "gradient of activation " << i;
  }
  for (std::size_t i = 0; i < cpu.dp.size(); ++i) {
    EXPECT_EQ(gpu.dp[i].dtype(), DType::Float32) << "a parameter's gradient stays float32";
    const Tol tol = i < c.param_tol.size() ? c.param_tol[i] : kFloat32;
    EXPECT_TRUE(close_tensors(gpu.dp[i], cpu.dp[i], tol)) << "gradient of parameter " << i;
  }
}

Conv2dOptions conv_opts(i64 stride, i64 pad, i64 dil = 1, i64 groups = 1) {
  Conv2dOptions o;
  o.stride = {stride, stride};
  o.padding = {pad, pad};
  o.dilation = {dil, dil};
  o.groups = groups;
  return o;
}

}  // namespace

// Every op of a mixed-precision step, alone, on both devices (the CPU's convolutions on whichever
// route this CPU takes: oneDNN's bf16 or the widened fallback — both sum bf16 products in float32).
TEST(GpuBf16Ops, EveryOpForwardAndBackwardMatchesTheCpu) {
  REQUIRE_GPU();
  BatchNormOptions eval;
  eval.training = false;
  const std::vector<OpCase> cases = {
      {"conv2d 3x3 pad 1 with bias", {{3, 5, 9, 9}}, {{6, 5, 3, 3}, {6}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], p[1], conv_opts(1, 1)); }, kTwoRoundings, {kConvWeight, kFloat32}},
      {"conv2d 1x1", {{2, 16, 6, 6}}, {{8, 16, 1, 1}}, [](auto& a, auto& p) { return conv2d(a[0], p[0], {}, conv_opts(1, 0)); },
       kBf16, {kConvWeight}},
      {"conv2d 3x3 stride 2 dilation 2 groups 2", {{2, 6, 11, 10}}, {{4, 3, 3, 3}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], {}, conv_opts(2, 2, 2, 2)); }, kBf16, {kConvWeight}},
      {"conv2d 7x7 stride 2 (a stem)", {{2, 3, 20, 20}}, {{8, 3, 7, 7}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], {}, conv_opts(2, 3)); }, kBf16, {kConvWeight}},
      {"linear with bias", {{6, 20}}, {{7, 20}, {7}}, [](auto& a, auto& p) { return linear(a[0], p[0], p[1]); }},
      {"linear without bias", {{9, 33}}, {{5, 33}}, [](auto& a, auto& p) { return linear(a[0], p[0]); }},
      {"matmul", {{9, 13}, {13, 5}}, {}, [](auto& a, auto&) { return matmul(a[0], a[1]); }},
      {"batch_norm (training)", {{4, 6, 5, 5}}, {{6}, {6}},
       [](auto& a, auto& p) {
         Tensor rm = Tensor::zeros({6}, DType::Float32, a[0].device()), rv = Tensor::full({6}, 1.0, DType::Float32, a[0].device());
         return batch_norm(a[0], p[0], p[1], rm, rv, {});
       }},
      {"batch_norm (eval)", {{3, 6, 4, 4}}, {{6}, {6}},
       [eval](auto& a, auto& p) {
         Tensor rm = Tensor::full({6}, 0.3, DType::Float32, a[0].device()), rv = Tensor::full({6}, 1.7, DType::Float32, a[0].device());
         return batch_norm(a[0], p[0], p[1], rm, rv, eval);
       }},
      {"group_norm", {{3, 8, 4, 5}}, {{8}, {8}}, [](auto& a, auto& p) { return group_norm(a[0], 4, p[0], p[1]); }},
      {"relu", {{5, 7, 3}}, {}, [](auto& a, auto&) { return relu(a[0]); }},
      {"add", {{4, 9}, {4, 9}}, {}, [](auto& a, auto&) { return add(a[0], a[1]); }},
      {"sub", {{4, 9}, {4, 9}}, {}, [](auto& a, auto&) { return sub(a[0], a[1]); }},
      {"mul", {{4, 9}, {4, 9}}, {}, [](auto& a, auto&) { return mul(a[0], a[1]); }},
      {"scale", {{4, 9}}, {}, [](auto& a, auto&) { return scale(a[0], -0.37); }},
      {"sigmoid", {{5, 7, 3}}, {}, [](auto& a, auto&) { return sigmoid(a[0]); }, kBf16, {}, -6.f, 6.f},
      {"scale_channels", {{3, 6, 5, 4}, {3, 6, 1, 1}}, {}, [](auto& a, auto&) { return scale_channels(a[0], a[1]); }},
      {"concat", {{2, 3, 4, 5}, {2, 1, 4, 5}}, {}, [](auto& a, auto&) { return concat({a[0], a[1]}); }},
      {"max_pool2d 3x3 stride 2 pad 1", {{2, 3, 9, 8}}, {}, [](auto& a, auto&) { return max_pool2d(a[0], {3, 3}, {2, 2}, {1, 1}); }},
      {"avg_pool2d", {{2, 3, 9, 8}}, {}, [](auto& a, auto&) { return avg_pool2d(a[0], {3, 3}, {2, 2}, {1, 1}, true); }},
      {"adaptive_avg_pool2d 7x5 to 3x2", {{2, 4, 7, 5}}, {}, [](auto& a, auto&) { return adaptive_avg_pool2d(a[0], {3, 2}); }},
      {"sum", {{5, 11}}, {}, [](auto& a, auto&) { return sum(a[0]); }},
      {"mean", {{5, 11}}, {}, [](auto& a, auto&) { return mean(a[0]); }},
      {"cross_entropy (float32 loss of bf16 logits)", {{8, 7}}, {}, [](auto& a, auto&) {
         CrossEntropyOptions o;
         o.label_smoothing = 0.1;
         const Tensor t = Tensor::from_vector(std::vector<i64>{3, 0, 6, 6, 1, 2, 5, 4}, {8}).to(a[0].device());
         Tensor y = cross_entropy(a[0], t, o);
         EXPECT_EQ(y.dtype(), DType::Float32);
         return y;
       }, kFloat32, {}, -3.f, 3.f},
  };
  for (const OpCase& c : cases) check_op(c);
}

// One SGD step of ResNet-20 in bf16 on the GPU and on the CPU, both measured against the same step
// in float64 on the CPU. bf16 storage alone puts a fresh ResNet-20's gradients far from float64 on
// a batch of 8 (batch norm amplifies the rounding, docs/precision.md "What the rounding costs"):
// per tensor 0.5% (fc) to 70% (early batch-norm parameters), 27% to 30% on average, measured on
// the CPU; and differently on each device, so the two bf16 runs are not compared element by
// element. Two CPU routes that round differently (oneDNN's bf16 convolutions and the widened
// fallback) measured 0.58 to 1.73 for the ratio of their per-tensor errors, and 0.97 to 1.03 for the
// ratio of their mean errors. So, per tensor (loss, gradients, parameters after the step compared
// as updates, running statistics): the GPU's error <= 2 x the CPU's + 0.05; over the gradients and
// over the updates, the GPU's mean error <= 1.5 x the CPU's; the loss within 5e-3 of the CPU's.
// `format`: the GPU's activations (channels-last: NHWC convolutions through the graph API and NHWC
// batch norms); the CPU's are row-major.
static void bf16_resnet20_step_matches_the_cpu(MemoryFormat format) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed << ", the GPU's input " << memory_format_name(format));
  nn::manual_seed(seed);
  auto ref = nn::make_model({"resnet20"});
  ref->to(DType::Float64);
  nn::manual_seed(seed);
  auto cpu = nn::make_model({"resnet20"});
  nn::manual_seed(seed);
  auto gpu = nn::make_model({"resnet20"});
  gpu->to(Device::cuda());
  std::vector<Tensor> initial;
  for (const Tensor& p : cpu->parameters()) initial.push_back(p.clone(Category::temporary));
  const optim::SGDOptions so{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4};
  optim::SGD opt_r(ref->parameters(), so), opt_c(cpu->parameters(), so), opt_g(gpu->parameters(), so);
  struct Errors {
    double cpu = 0, gpu = 0;
    int n = 0;
  };
  // Each tensor's check; returns the two errors against float64 for the means.
  auto like_cpu = [](const Tensor& g, const Tensor& c, const Tensor& r64, const std::string& what, Errors* sum) {
    const Tensor r = r64.to(DType::Float32);
    const double ec = norm_rel_err(c.to(DType::Float32), r), eg = norm_rel_err(g.to(DType::Float32), r);
    EXPECT_LE(eg, 2 * ec + 0.05) << what << ": GPU bf16 error " << eg << ", CPU bf16 error " << ec;
    if (sum) sum->cpu += ec, sum->gpu += eg, ++sum->n;
  };
  std::mt19937 rng(seed);
  const Tensor x = host_tensor({8, 3, 32, 32}, rng, DType::Float32);  // bf16 values: every run reads the same
  std::vector<i64> labels(8);
  for (auto& l : labels) l = static_cast<i64>(rng() % 10);
  const Tensor y = Tensor::from_vector(labels, {8});
  Tensor lr = cross_entropy((*ref)(x.to(DType::Float64)), y);
  Tensor lc = cross_entropy((*cpu)(x.to(DType::BFloat16)), y);
  Tensor lg = cross_entropy((*gpu)(x.to(Device::cuda()).to(DType::BFloat16).contiguous(format)), y.to(Device::cuda()));
  ASSERT_EQ(lg.dtype(), DType::Float32) << "the loss of bf16 logits is float32";
  EXPECT_NEAR(lg.item(), lc.item(), 5e-3 * std::abs(lc.item())) << "loss; float64: " << lr.item();
  like_cpu(lg, lc, lr, "loss", nullptr);
  lr.backward();
  lc.backward();
  lg.backward();
  const auto pr = ref->named_parameters(), pc = cpu->named_parameters(), pg = gpu->named_parameters();
  ASSERT_EQ(pc.size(), pg.size());
  Errors grads, updates;
  for (std::size_t i = 0; i < pc.size(); ++i) {
    ASSERT_EQ(pg[i].second.grad().dtype(), DType::Float32) << pc[i].first;
    like_cpu(pg[i].second.grad(), pc[i].second.grad(), pr[i].second.grad(), "gradient of " + pc[i].first, &grads);
  }
  for (auto* o : {&opt_r, &opt_c, &opt_g}) o->step();
  // The parameters after the step, compared as updates (the parameters themselves barely move and
  // would hide a wrong step); the running statistics followed.
  for (std::size_t i = 0; i < pc.size(); ++i) {
    const Tensor ur = sub(pr[i].second.detach(), initial[i].to(DType::Float64));
    const Tensor uc = sub(pc[i].second.detach(), initial[i]);
    const Tensor ug = sub(pg[i].second.detach(), initial[i].to(Device::cuda()));
    like_cpu(ug, uc, ur, "update of " + pc[i].first, &updates);
  }
  const auto br = ref->named_buffers(), bc = cpu->named_buffers(), bg = gpu->named_buffers();
  for (std::size_t i = 0; i < bc.size(); ++i) {
    if (bc[i].second.dtype() == DType::Float32) {
      like_cpu(bg[i].second, bc[i].second, br[i].second, bc[i].first, nullptr);
    } else {
      EXPECT_EQ(bg[i].second.item(), bc[i].second.item()) << bc[i].first;
    }
  }
  for (const auto& [what, e] : {std::pair{"gradients", grads}, std::pair{"updates", updates}}) {
    ASSERT_GT(e.n, 0);
    const double mc = e.cpu / e.n, mg = e.gpu / e.n;
    EXPECT_LE(mg, 1.5 * mc) << what << ": mean error against float64 of the GPU's bf16 step " << mg << ", the CPU's " << mc;
    EXPECT_LT(mc, 0.5) << what << ": even the CPU's bf16 step is far from float64: the comparison says nothing";
  }
}

TEST(GpuBf16Ops, ResNet20TrainingStepMatchesTheCpuStep) {
  REQUIRE_GPU();
  bf16_resnet20_step_matches_the_cpu(MemoryFormat::Contiguous);
}

TEST(GpuBf16Ops, ResNet20TrainingStepChannelsLastMatchesTheCpuStep) {
  REQUIRE_GPU();
  bf16_resnet20_step_matches_the_cpu(MemoryFormat::ChannelsLast);
}

// A batch of B fresh random samples of `sample` (values bf16 holds exactly) and labels of 10 classes.
static std::pair<std::vector<float>, std::vector<i64>> random_batch(i64 B, const Shape& sample) {
  std::mt19937 rng(fresh_seed());
  auto images = random_values<float>(static_cast<std::size_t>(B * shape_numel(sample)), rng);
  std::vector<i64> labels(B);
  for (auto& l : labels) l = static_cast<i64>(rng() % 10);
  return {std::move(images), std::move(labels)};
}

// A model of the zoo (ResNet-20 unless named) on `d` with SGD momentum, every byte in an arena of
// its own of 256 MiB, from seed `seed`.
struct ModelRun {
  std::shared_ptr<Arena> arena;
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::SGD> opt;
};
static ModelRun model_in_arena(Device d, std::uint64_t seed, const char* name = "resnet20") {
  ModelRun r;
  r.arena = std::make_shared<Arena>(d, std::size_t(256) << 20);
  ArenaScope scope(r.arena);
  nn::manual_seed(seed);
  r.model = nn::make_model({name});
  r.model->to(d);
  r.opt = std::make_unique<optim::SGD>(r.model->parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
  return r;
}

// Mixed-precision MBP steps on the GPU (mbp::Precision::bf16, as `tally train --precision bf16
// --device cuda` runs them): a batch of 48 in micro-batches of 16, every step's peak as predicted
// by its dry run, and the first step's loss near the CPU's for the same model, batch and split.
TEST(GpuBf16Ops, MicroBatchedBf16StepsArePlannedExactly) {
  REQUIRE_GPU();
  const i64 B = 48;
  const Shape sample{3, 32, 32};
  const auto batch = random_batch(B, sample);  // (not a structured binding: the lambdas below capture it)
  const std::vector<float>& images = batch.first;
  const std::vector<i64>& labels = batch.second;
  auto first_loss = [&](Device d) {
    auto [arena, model, opt] = model_in_arena(d, 21);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 16;
    eo.precision = mbp::Precision::bf16;
    mbp::Executor ex(*model, *opt, arena, eo);
    EXPECT_EQ(ex.activation_dtype(), DType::BFloat16);
    double loss = 0;
    for (int step = 0; step < 2; ++step) {
      const mbp::StepResult r = ex.step(images.data(), labels.data(), B);
      EXPECT_EQ(r.micro_batches, 3) << d.str();
      EXPECT_EQ(r.peak, r.predicted_peak) << d.str() << " step " << step;
      EXPECT_TRUE(std::isfinite(r.loss)) << d.str() << " step " << step;
      if (step == 0) loss = r.loss;
    }
    for (const Tensor& p : model->parameters()) EXPECT_EQ(p.dtype(), DType::Float32) << "master weights";
    return loss;
  };
  const double gpu_loss = first_loss(Device::cuda(0));
  const double cpu_loss = first_loss(Device::cpu());
  EXPECT_NEAR(gpu_loss, cpu_loss, 5e-3 * std::abs(cpu_loss));
}

// Convolution engines chosen by measurement (core/conv_tuning.h): a bf16 channels-last ResNet-20
// trained with tuning on measures its passes once, writes them to its tuning file, plans exactly
// (predicted == measured) under the tuned engines; a second run from the file measures nothing and
// gives the same bits; so does a run replaying the first's record (a resumed run's). Without tuning
// the step stays within the tuned one's rounding.
TEST(GpuBf16Ops, TunedConvolutionsPlanExactlyAndReplayBitForBit) {
  REQUIRE_GPU();
  // Tuning is the graph API's: the automatic choice takes it for bf16 channels-last, whatever API a
  // run of the other convolution tests forces (TALLY_CUDNN_CONV_API).
  const UseCudnnConvApi api(kernels::cuda::CudnnConvApi::automatic);
  const i64 B = 32;
  const Shape sample{3, 32, 32};
  const auto batch = random_batch(B, sample);  // (not a structured binding: the lambdas below capture it)
  const std::vector<float>& images = batch.first;
  const std::vector<i64>& labels = batch.second;
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / fmt::format("tally-tuning-{}.json", ::getpid());
  std::filesystem::remove(file);
  struct Reset {
    std::filesystem::path file;
    ~Reset() {
      kernels::cuda::set_conv_tuning({});
      std::filesystem::remove(file);
    }
  } reset{file};
  // Two steps; returns the parameters after them.
  auto train = [&](const std::shared_ptr<ConvTuning>& tuning) {
    const Device d = Device::cuda(0);
    auto [arena, model, opt] = model_in_arena(d, 21);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 16;
    eo.precision = mbp::Precision::bf16;
    eo.memory_format = MemoryFormat::ChannelsLast;
    eo.conv_tuning = tuning;
    mbp::Executor ex(*model, *opt, arena, eo);
    for (int step = 0; step < 2; ++step) {
      const mbp::StepResult r = ex.step(images.data(), labels.data(), B);
      EXPECT_EQ(r.peak, r.predicted_peak) << "step " << step << (tuning ? ", " + tuning->report() : "");
      EXPECT_TRUE(std::isfinite(r.loss));
    }
    std::vector<float> values;
    for (const Tensor& p : model->parameters()) {
      const auto v = p.to(Device::cpu()).to_vector<float>();
      values.insert(values.end(), v.begin(), v.end());
    }
    return values;
  };
  // A cap no pass reaches: a pass the cap cut short is kept by no file, and the second run would
  // measure it.
  constexpr double kNoCap = 600;
  const auto first = std::make_shared<ConvTuning>(file, kNoCap);
  const std::vector<float> tuned = train(first);
  EXPECT_EQ(first->report().find("passes, 0 measured"), std::string::npos) << first->report();
  EXPECT_EQ(first->report().find("left to the heuristics"), std::string::npos) << first->report();
  fmt::print("first run's {}\n", first->report());
  ASSERT_TRUE(std::filesystem::exists(file)) << first->report();
  EXPECT_FALSE(first->table().empty());
  const std::string record = first->record();
  const auto again = std::make_shared<ConvTuning>(file, kNoCap);
  kernels::cuda::set_conv_tuning({});
  EXPECT_EQ(train(again), tuned) << "the same engines from the file: the same bits";
  EXPECT_NE(again->report().find(", 0 measured"), std::string::npos) << again->report();
  kernels::cuda::set_conv_tuning({});
  EXPECT_EQ(train(ConvTuning::replaying(record, "the first run's record")), tuned) << "replayed: the same bits";
  kernels::cuda::set_conv_tuning({});
  const std::vector<float> plain = train(nullptr);
  ASSERT_EQ(plain.size(), tuned.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    ASSERT_NEAR(plain[i], tuned[i], 2e-2 * (1 + std::abs(tuned[i]))) << "parameter element " << i;
}

// CUDA graphs (ExecutorOptions::cuda_graphs, core/graphs.h): ResNet-20 with batch norm, a batch of
// 44 in micro-batches of 8, 8, 7, 7, 7, 7 (two sizes, double-buffered inputs, a last micro-batch
// without a next), four steps with graphs and four without — in float32, in bf16 channels-last,
// and with every block recomputed: the same losses and the same parameters and running statistics
// bit for bit (the same kernels on the same addresses), every peak as predicted, the arena's
// allocate() and free() calls counted alike (a replay counts those it skips), and most
// micro-batches after the first step replayed (their host code skipped). Before the fourth step TF32
// is switched on in both: the recordings of other kernels are dropped, not replayed. In float32, a
// fault injected in the arena's countdown in the middle of the third step fires at the same
// allocation with graphs as without. WRN-10-1, whose dropout takes each call's sample index: its
// recordings run once and are never replayed, the same bits.
TEST(GpuGraphs, ReplayedMicroBatchesGiveTheLaunchedStepsBitsAndPeaks) {
  REQUIRE_GPU();
  const i64 B = 44;
  const Shape sample{3, 32, 32};
  const auto batch = random_batch(B, sample);  // (not a structured binding: the lambdas below capture it)
  const std::vector<float>& images = batch.first;
  const std::vector<i64>& labels = batch.second;
  struct Case {
    const char* name;
    mbp::Precision precision;
    MemoryFormat format;
    const char* recompute;
    const char* model = "resnet20";
  };
  models::register_families();  // wrn10_1: dropout, whose recordings may not be replayed
  struct Run {
    std::vector<float> values;
    std::vector<double> losses;
    std::vector<std::int64_t> allocations, frees;  // the arena's calls after each step
    std::int64_t fired_at = -1;                    // the arena's allocations when the injected fault fired
    int fired_in_step = -1;
    mbp::Executor::GraphStats stats;
  };
  struct Tf32Off {  // however the test ends
    ~Tf32Off() { set_allow_tf32(false); }
  } tf32_off;
  for (const Case c : {Case{"float32", mbp::Precision::fp32, MemoryFormat::Contiguous, "none"},
                       Case{"bf16 channels-last", mbp::Precision::bf16, MemoryFormat::ChannelsLast, "none"},
                       Case{"float32, blocks recomputed", mbp::Precision::fp32, MemoryFormat::Contiguous, "blocks"},
                       Case{"WRN-10-1 with dropout", mbp::Precision::fp32, MemoryFormat::Contiguous, "none", "wrn10_1"}}) {
    SCOPED_TRACE(c.name);
    const bool dropout = std::string(c.model) == "wrn10_1";
    // fault_at: the countdown set before the third step (0: none); the fault's action notes where it fired.
    auto train = [&](bool graphs, std::uint64_t fault_at = 0) {
      const Device d = Device::cuda(0);
      auto [arena, model, opt] = model_in_arena(d, 23, c.model);
      mbp::ExecutorOptions eo;
      eo.sample_shape = sample;
      eo.micro_batch = 8;
      eo.precision = c.precision;
      eo.memory_format = c.format;
      eo.recompute = c.recompute;
      eo.cuda_graphs = graphs;
      mbp::Executor ex(*model, *opt, arena, eo);
      Run run;
      set_allow_tf32(false);
      for (int step = 0; step < 4; ++step) {
        if (step == 2 && fault_at > 0)
          arena->at_allocation(fault_at, [&run, &counted = *arena, step] {
            run.fired_at = counted.stats().total.allocations, run.fired_in_step = step;
          });
        if (step == 3) set_allow_tf32(true);
        const mbp::StepResult r = ex.step(images.data(), labels.data(), B);
        EXPECT_EQ(r.micro_batches, 6);
        EXPECT_EQ(r.peak, r.predicted_peak) << "step " << step << (graphs ? ", graphs on" : ", graphs off");
        EXPECT_TRUE(std::isfinite(r.loss));
        run.losses.push_back(r.loss);
        run.allocations.push_back(arena->stats().total.allocations);
        run.frees.push_back(arena->stats().total.frees);
      }
      set_allow_tf32(false);
      for (const Tensor& t : model->parameters()) {
        const auto v = t.to(Device::cpu()).to_vector<float>();
        run.values.insert(run.values.end(), v.begin(), v.end());
      }
      for (const auto& [name, t] : model->named_buffers()) {
        if (t.dtype() != DType::Float32) continue;  // the batch counters: compared by the values they scale
        const auto v = t.to(Device::cpu()).to_vector<float>();
        run.values.insert(run.values.end(), v.begin(), v.end());
      }
      run.stats = ex.graph_stats();
      return run;
    };
    const Run off = train(false), on = train(true);
    EXPECT_EQ(on.stats.failed, "") << "a recording failed: the steps ran again without graphs";
    EXPECT_EQ(off.stats.recorded, 0);
    EXPECT_GT(on.stats.recorded, 0);
    if (dropout) {  // recorded once per layout, run as recorded, then launched op by op
      EXPECT_GT(on.stats.unreplayable, 0);
      EXPECT_EQ(on.stats.replayed, 0);
    } else {
      EXPECT_GE(on.stats.replayed, 8) << "steps 2 and 3 replay their micro-batches 2..6 (5 each)";
      EXPECT_EQ(on.stats.unreplayable, 0);
    }
    EXPECT_EQ(on.losses, off.losses);
    EXPECT_TRUE(on.values == off.values) << "parameters and running statistics, bit for bit";
    EXPECT_EQ(on.allocations, off.allocations) << "a replay counts the allocations it skips";
    EXPECT_EQ(on.frees, off.frees);
    if (c.precision == mbp::Precision::fp32 && std::string(c.recompute) == "none" && !dropout) {
      // Half-way through the third step's allocations (0-based: step 2), counted from its start.
      const auto fault_at = static_cast<std::uint64_t>((off.allocations[2] - off.allocations[1]) / 2);
      const Run off_fault = train(false, fault_at), on_fault = train(true, fault_at);
      EXPECT_EQ(off_fault.fired_in_step, 2);
      EXPECT_EQ(on_fault.fired_in_step, off_fault.fired_in_step) << "a replay skipped the injected fault";
      EXPECT_EQ(on_fault.fired_at, off_fault.fired_at);
      EXPECT_GT(on_fault.stats.replayed, 0);
    }
    std::cout << fmt::format("{}: {} micro-batches recorded, {} replayed, {} nodes, {} bytes of graph memory\n",
                             c.name, on.stats.recorded, on.stats.replayed, on.stats.nodes, on.stats.device_bytes);
  }
}
