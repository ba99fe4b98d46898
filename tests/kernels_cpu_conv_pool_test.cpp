// tests/kernels_cpu_conv_pool_test.cpp — checks the CPU reference kernels gemm, conv2d_* and
// the pooling kernels (kernels/cpu/{gemm,conv,pool}.cpp):
//   * forward results against naive loops written straight from the definitions,
//   * backward results against central finite differences of L = sum(y * dy_random),
//   * the beta convention (0 overwrites a NaN-filled buffer, 1 adds onto an existing one),
//   * that nothing is written outside the outputs and the workspace.
// Inputs are uniform in [-1, 1] from std::mt19937 with fixed seeds, never zero.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"

namespace {

using tally::kernels::i64;
namespace k = tally::kernels::cpu;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kFdStep = 1e-6;  // central-difference step
constexpr double kFdRtol = 1e-6;  // finite differences vs analytic gradient
constexpr double kRtolD = 1e-12;  // double kernels vs naive double loops
constexpr double kRtolF = 1e-5;   // float kernels vs naive double loops
constexpr int kGuard = 16;        // sentinel elements after every output / workspace
constexpr double kSentinel = 12345.678;

// n values uniform in [-1, 1], none with |v| < 1e-3 (so never zero).
template <class T = double>
std::vector<T> random_vec(i64 n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& e : v) {
    double d;
    do d = dist(gen);
    while (std::abs(d) < 1e-3);
    e = static_cast<T>(d);
  }
  return v;
}

// n distinct values in [-1, 1], none zero, pairwise at least 1/n apart (stable argmax under
// a finite-difference step of 1e-6), in a random order.
std::vector<double> distinct_vec(i64 n, unsigned seed) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (i64 i = 0; i < n; ++i)
    v[i] = -1.0 + (2.0 * static_cast<double>(i) + 1.0) / static_cast<double>(n);
  std::mt19937 gen(seed);
  std::shuffle(v.begin(), v.end(), gen);
  return v;
}

template <class T>
testing::AssertionResult all_finite(const std::vector<T>& v, i64 n = -1) {
  const i64 m = n < 0 ? static_cast<i64>(v.size()) : n;
  for (i64 i = 0; i < m; ++i)
    if (!std::isfinite(v[i]))
      return testing::AssertionFailure() << "non-finite value " << v[i] << " at index " << i;
  return testing::AssertionSuccess();
}

// |got - want| <= rtol * max(1, |want|) for every element (inputs are O(1), so this is a
// relative tolerance that does not blow up on results that cancel to near zero). Also fails
// on any NaN / inf.
template <class A, class B>
testing::AssertionResult all_close(const std::vector<A>& got, const std::vector<B>& want,
                                   double rtol, i64 n = -1) {
  const i64 m = n < 0 ? static_cast<i64>(want.size()) : n;
  if (static_cast<i64>(got.size()) < m) return testing::AssertionFailure() << "size mismatch";
  double worst = 0.0;
  for (i64 i = 0; i < m; ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    if (!std::isfinite(g) || !std::isfinite(w))
      return testing::AssertionFailure() << "non-finite at " << i << ": got " << g << " want " << w;
    const double err = std::abs(g - w) / std::max(1.0, std::abs(w));
    worst = std::max(worst, err);
    if (err > rtol)
      return testing::AssertionFailure() << "mismatch at " << i << ": got " << g << " want " << w
                                         << " (rel err " << err << " > " << rtol << ")";
  }
  return testing::AssertionSuccess() << "worst rel err " << worst;
}

// A buffer of n elements followed by kGuard sentinels; guard_ok() checks they are intact.
template <class T>
std::vector<T> guarded(i64 n, T fill) {
  std::vector<T> v(static_cast<std::size_t>(n + kGuard), static_cast<T>(kSentinel));
  std::fill(v.begin(), v.begin() + n, fill);
  return v;
}
template <class T>
testing::AssertionResult guard_ok(const std::vector<T>& v) {
  for (std::size_t i = v.size() - kGuard; i < v.size(); ++i)
    if (!(v[i] == static_cast<T>(kSentinel)))
      return testing::AssertionFailure() << "write past the end at guard element " << i;
  return testing::AssertionSuccess();
}

double dot(const std::vector<double>& a, const std::vector<double>& b, i64 n) {
  double s = 0.0;
  for (i64 i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Central finite differences of f with respect to v[i] for i = 0, step, 2*step, ... < n (v is
// restored afterwards). step > 1 samples the larger cases, where every element would be slow.
struct FdGradient {
  std::vector<i64> idx;
  std::vector<double> g;
};
template <class F>
FdGradient fd_gradient(std::vector<double>& v, i64 n, F f, i64 step = 1) {
  FdGradient out;
  for (i64 i = 0; i < n; i += step) {
    const double old = v[i];
    v[i] = old + kFdStep;
    const double lp = f();
    v[i] = old - kFdStep;
    const double lm = f();
    v[i] = old;
    out.idx.push_back(i);
    out.g.push_back((lp - lm) / (2.0 * kFdStep));
  }
  return out;
}

// got[idx] vs the finite differences, |got - fd| <= kFdRtol * max(1, |fd|).
template <class V>
testing::AssertionResult matches_fd(const V& got, const FdGradient& fd) {
  std::vector<double> sel(fd.idx.size());
  for (std::size_t j = 0; j < fd.idx.size(); ++j) sel[j] = got[fd.idx[j]];
  auto r = all_close(sel, fd.g, kFdRtol);
  if (!r) r << " (compared at sampled index position above; " << fd.idx.size() << " samples)";
  return r;
}

// ============================================================================================
// GEMM
// ============================================================================================

struct GemmCase {
  i64 M, N, K;
  bool ta, tb;
};

// Naive row-major reference in double: C = alpha op(A) op(B) + beta C (C not read if beta == 0).
// Padding columns j >= N of C are copied unchanged (the kernel must not touch them).
template <class T>
std::vector<double> naive_gemm(const GemmCase& c, double alpha, const std::vector<T>& A, i64 lda,
                               const std::vector<T>& B, i64 ldb, double beta,
                               const std::vector<T>& C, i64 ldc) {
  std::vector<double> out(C.begin(), C.end());
  for (i64 i = 0; i < c.M; ++i)
    for (i64 j = 0; j < c.N; ++j) {
      double s = 0.0;
      for (i64 p = 0; p < c.K; ++p) {
        const double a = c.ta ? A[p * lda + i] : A[i * lda + p];
        const double b = c.tb ? B[j * ldb + p] : B[p * ldb + j];
        s += a * b;
      }
      out[i * ldc + j] =
          alpha * s + (beta == 0.0 ? 0.0 : beta * static_cast<double>(C[i * ldc + j]));
    }
  return out;
}

template <class T>
void check_gemm(const GemmCase& c, double rtol, unsigned seed) {
  SCOPED_TRACE("M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" +
               std::to_string(c.K) + " ta=" + std::to_string(c.ta) + " tb=" + std::to_string(c.tb));
  // Leading dimensions larger than the minimum, to exercise lda / ldb / ldc.
  const i64 a_rows = c.ta ? c.K : c.M, a_cols = c.ta ? c.M : c.K;
  const i64 b_rows = c.tb ? c.N : c.K, b_cols = c.tb ? c.K : c.N;
  const i64 lda = a_cols + 3, ldb = b_cols + 2, ldc = c.N + 5;
  const auto A = random_vec<T>(a_rows * lda, seed);
  const auto B = random_vec<T>(b_rows * ldb, seed + 1);
  const T alpha = static_cast<T>(0.75);

  // beta = 0 over a NaN-filled C: C must be overwritten, never read.
  std::vector<T> C0(static_cast<std::size_t>(c.M * ldc), std::numeric_limits<T>::quiet_NaN());
  k::gemm<T>(c.ta, c.tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, T(0), C0.data(), ldc);
  const auto ref0 = naive_gemm(c, alpha, A, lda, B, ldb, 0.0, C0, ldc);
  for (i64 i = 0; i < c.M; ++i)
    for (i64 j = 0; j < c.N; ++j) {
      const double g = C0[i * ldc + j], w = ref0[i * ldc + j];
      ASSERT_TRUE(std::isfinite(g)) << "NaN leaked through beta = 0 at (" << i << ", " << j << ")";
      ASSERT_LE(std::abs(g - w), rtol * std::max(1.0, std::abs(w))) << "(" << i << ", " << j << ")";
    }
  // Padding columns of C (j >= N) must stay untouched (still NaN).
  for (i64 i = 0; i < c.M; ++i)
    for (i64 j = c.N; j < ldc; ++j) ASSERT_TRUE(std::isnan(C0[i * ldc + j]));

  // beta = 1 accumulates; beta = -0.5 scales (general beta).
  for (double beta : {1.0, -0.5}) {
    auto C1 = random_vec<T>(c.M * ldc, seed + 2);
    const auto ref1 = naive_gemm(c, alpha, A, lda, B, ldb, beta, C1, ldc);
    k::gemm<T>(c.ta, c.tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, static_cast<T>(beta),
               C1.data(), ldc);
    EXPECT_TRUE(all_close(C1, ref1, rtol)) << "beta = " << beta;
  }
}

TEST(CpuGemm, AllTransposesDouble) {
  unsigned seed = 100;
  for (GemmCase base : {GemmCase{5, 7, 3, false, false}, GemmCase{37, 29, 41, false, false},
                        GemmCase{1, 13, 9, false, false}, GemmCase{64, 65, 130, false, false}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        GemmCase c = base;
        c.ta = ta;
        c.tb = tb;
        check_gemm<double>(c, kRtolD, seed += 10);
      }
}

TEST(CpuGemm, AllTransposesFloat) {
  unsigned seed = 200;
  for (GemmCase base : {GemmCase{5, 7, 3, false, false}, GemmCase{37, 29, 41, false, false},
                        GemmCase{1, 13, 9, false, false}, GemmCase{64, 65, 130, false, false}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        GemmCase c = base;
        c.ta = ta;
        c.tb = tb;
        check_gemm<float>(c, kRtolF, seed += 10);
      }
}

TEST(CpuGemm, EmptyInnerDimension) {
  // K = 0: C = beta * C; beta = 0 must overwrite NaN with zeros.
  std::vector<double> C(6, kNaN);
  k::gemm<double>(false, false, 2, 3, 0, 1.0, nullptr, 1, nullptr, 3, 0.0, C.data(), 3);
  for (double v : C) EXPECT_EQ(v, 0.0);
  std::vector<double> D = {1, 2, 3, 4, 5, 6};
  k::gemm<double>(true, true, 2, 3, 0, 1.0, nullptr, 2, nullptr, 1, 1.0, D.data(), 3);
  EXPECT_EQ(D, (std::vector<double>{1, 2, 3, 4, 5, 6}));
}

// ============================================================================================
// Convolution
// ============================================================================================

struct ConvCase {
  const char* name;
  tally::kernels::Conv2dShape s;
  bool bias;
  i64 fd_step = 1;  // finite differences on every fd_step-th element
};

std::ostream& operator<<(std::ostream& os, const ConvCase& c) { return os << c.name; }

i64 x_size(const tally::kernels::Conv2dShape& s) { return s.N * s.C * s.H * s.W; }
i64 w_size(const tally::kernels::Conv2dShape& s) { return s.K * (s.C / s.groups) * s.R * s.S; }
i64 y_size(const tally::kernels::Conv2dShape& s) { return s.N * s.K * s.P() * s.Q(); }

tally::kernels::Conv2dShape conv(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 S, i64 sh, i64 sw, i64 ph, i64 pw,
                    i64 dh, i64 dw, i64 g) {
  tally::kernels::Conv2dShape s{N, C, H, W, K, R, S};
  s.stride_h = sh;
  s.stride_w = sw;
  s.pad_h = ph;
  s.pad_w = pw;
  s.dil_h = dh;
  s.dil_w = dw;
  s.groups = g;
  return s;
}

// Direct convolution, seven nested loops (n, k, p, q, c, r, s), straight from the definition.
template <class T>
std::vector<double> naive_conv(const tally::kernels::Conv2dShape& s, const std::vector<T>& x,
                               const std::vector<T>& w, const T* bias) {
  const i64 P = s.P(), Q = s.Q(), Cg = s.C / s.groups, Kg = s.K / s.groups;
  std::vector<double> y(static_cast<std::size_t>(y_size(s)));
  for (i64 n = 0; n < s.N; ++n)
    for (i64 kk = 0; kk < s.K; ++kk)
      for (i64 p = 0; p < P; ++p)
        for (i64 q = 0; q < Q; ++q) {
          const i64 g = kk / Kg;
          double acc = bias ? static_cast<double>(bias[kk]) : 0.0;
          for (i64 c = 0; c < Cg; ++c)
            for (i64 r = 0; r < s.R; ++r)
              for (i64 t = 0; t < s.S; ++t) {
                const i64 h = p * s.stride_h - s.pad_h + r * s.dil_h;
                const i64 ww = q * s.stride_w - s.pad_w + t * s.dil_w;
                if (h < 0 || h >= s.H || ww < 0 || ww >= s.W) continue;
                acc += static_cast<double>(x[((n * s.C + g * Cg + c) * s.H + h) * s.W + ww]) *
                       static_cast<double>(w[((kk * Cg + c) * s.R + r) * s.S + t]);
              }
          y[((n * s.K + kk) * P + p) * Q + q] = acc;
        }
  return y;
}

const ConvCase kConvCases[] = {
    {"Basic3x3Pad1Bias", conv(2, 3, 7, 9, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1), true},
    {"OddStride2Pad1", conv(2, 3, 9, 11, 5, 3, 3, 2, 2, 1, 1, 1, 1, 1), false},
    {"Pad2Dil2Groups2Bias", conv(1, 4, 8, 7, 6, 3, 3, 1, 1, 2, 2, 2, 2, 2), true},
    {"RectKernelMixedStridePadGroups2", conv(2, 4, 10, 9, 6, 3, 5, 2, 1, 2, 1, 1, 1, 2), false},
    {"Depthwise3x3Bias", conv(2, 6, 7, 7, 6, 3, 3, 1, 1, 1, 1, 1, 1, 6), true},
    {"DepthwiseMultiplier2Stride2", conv(2, 4, 9, 8, 8, 3, 3, 2, 2, 1, 1, 1, 1, 4), true},
    {"Plain1x1Bias", conv(3, 5, 6, 5, 7, 1, 1, 1, 1, 0, 0, 1, 1, 1), true},
    {"Plain1x1Groups2", conv(2, 4, 5, 3, 6, 1, 1, 1, 1, 0, 0, 1, 1, 2), false},
    {"OneByOneStride2", conv(2, 4, 7, 7, 3, 1, 1, 2, 2, 0, 0, 1, 1, 1), true},
    {"OneByOnePad1Stride2", conv(1, 2, 5, 5, 3, 1, 1, 2, 2, 1, 1, 1, 1, 1), true},
    {"DilatedRectStride2", conv(2, 3, 11, 10, 4, 2, 3, 2, 2, 0, 2, 2, 1, 1), false},
    {"KernelLargerThanInputPadded", conv(1, 2, 3, 4, 3, 5, 5, 1, 1, 2, 2, 1, 1, 1), true},
    {"Strided5x5Pad2Dil2Groups3", conv(2, 6, 13, 12, 9, 5, 5, 3, 2, 2, 2, 2, 1, 3), true},
    // Large enough to take the OpenMP paths of im2col / col2im / bias (sampled FD).
    {"Large32x32Groups2", conv(2, 8, 32, 32, 8, 3, 3, 1, 1, 1, 1, 1, 1, 2), true, 37},
};

class CpuConv : public testing::TestWithParam<ConvCase> {
 protected:
  void SetUp() override {
    const auto& s = GetParam().s;
    ASSERT_GT(s.P(), 0);
    ASSERT_GT(s.Q(), 0);
    x = random_vec(x_size(s), 1);
    w = random_vec(w_size(s), 2);
    b = random_vec(s.K, 3);
    dy = random_vec(y_size(s), 4);
    const std::size_t bytes = k::conv2d_workspace_bytes<double>(s, tally::kernels::ConvPass::forward);
    const bool plain =
        s.R == 1 && s.S == 1 && s.stride_h == 1 && s.stride_w == 1 && s.pad_h == 0 && s.pad_w == 0;
    const i64 expect = plain ? 0 : (s.C / s.groups) * s.R * s.S * s.P() * s.Q();
    ASSERT_EQ(bytes, static_cast<std::size_t>(expect) * sizeof(double));
    if (k::conv_algorithm() == k::ConvAlgorithm::reference) {
      ASSERT_EQ(k::conv2d_workspace_bytes<float>(s, tally::kernels::ConvPass::forward),
                static_cast<std::size_t>(expect) * sizeof(float));
    }
    ws = guarded<double>(expect, kNaN);  // garbage in the workspace must not matter
  }
  const double* bias_ptr() const { return GetParam().bias ? b.data() : nullptr; }
  // L = sum(y * dy) with y from the kernel's own forward (checked against naive separately);
  // with_bias forces the bias in, for the bias gradient of cases that have none.
  double loss(bool with_bias = false) {
    const auto& s = GetParam().s;
    std::vector<double> y(static_cast<std::size_t>(y_size(s)));
    k::conv2d_forward<double>(s, x.data(), w.data(), with_bias ? b.data() : bias_ptr(), y.data(),
                              ws.data());
    return dot(y, dy, y_size(s));
  }
  // Checks one backward kernel `run(out, beta)` against fd: beta = 0 over NaN, beta = 1 over
  // random values (result = old + fresh), and the result is bitwise reproducible.
  template <class Run>
  void check_backward(i64 n, const FdGradient& fd, Run run) {
    auto fresh = guarded<double>(n, kNaN);
    run(fresh.data(), 0.0);
    EXPECT_TRUE(all_finite(fresh, n)) << "beta = 0 must overwrite a NaN-filled buffer";
    EXPECT_TRUE(guard_ok(fresh));
    EXPECT_TRUE(matches_fd(fresh, fd)) << "vs finite differences";

    auto again = guarded<double>(n, kNaN);
    run(again.data(), 0.0);
    EXPECT_EQ(0, std::memcmp(fresh.data(), again.data(), sizeof(double) * n)) << "not reproducible";

    const auto old = random_vec(n, 77);
    auto acc = guarded<double>(n, 0.0);
    std::copy(old.begin(), old.end(), acc.begin());
    run(acc.data(), 1.0);
    std::vector<double> want(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i) want[i] = old[i] + fresh[i];
    EXPECT_TRUE(all_close(acc, want, kRtolD, n)) << "beta = 1 must add onto the old values";
    EXPECT_TRUE(guard_ok(acc));
    EXPECT_TRUE(guard_ok(ws)) << "workspace overrun";
  }

  std::vector<double> x, w, b, dy, ws;
};

TEST_P(CpuConv, ForwardMatchesNaiveDouble) {
  const auto& s = GetParam().s;
  auto y = guarded<double>(y_size(s), kNaN);
  k::conv2d_forward<double>(s, x.data(), w.data(), bias_ptr(), y.data(), ws.data());
  EXPECT_TRUE(all_close(y, naive_conv(s, x, w, bias_ptr()), kRtolD, y_size(s)));
  EXPECT_TRUE(guard_ok(y));
  EXPECT_TRUE(guard_ok(ws)) << "workspace overrun";
}

TEST_P(CpuConv, ForwardMatchesNaiveFloat) {
  const auto& s = GetParam().s;
  std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end()), bf(b.begin(), b.end());
  auto y = guarded<float>(y_size(s), std::numeric_limits<float>::quiet_NaN());
  auto wsf = guarded<float>(static_cast<i64>(k::conv2d_workspace_bytes<float>(s, tally::kernels::ConvPass::forward) / sizeof(float)),
                            std::numeric_limits<float>::quiet_NaN());
  const float* bp = GetParam().bias ? bf.data() : nullptr;
  k::conv2d_forward<float>(s, xf.data(), wf.data(), bp, y.data(), wsf.data());
  EXPECT_TRUE(all_close(y, naive_conv(s, xf, wf, bp), kRtolF, y_size(s)));
  EXPECT_TRUE(guard_ok(y));
  EXPECT_TRUE(guard_ok(wsf));
}

TEST_P(CpuConv, BackwardDataMatchesFiniteDifferences) {
  const auto& s = GetParam().s;
  const auto fd = fd_gradient(
      x, x_size(s), [&] { return loss(); }, GetParam().fd_step);
  check_backward(x_size(s), fd, [&](double* dx, double beta) {
    k::conv2d_backward_data<double>(s, dy.data(), w.data(), dx, beta, ws.data());
  });
}

TEST_P(CpuConv, BackwardFilterMatchesFiniteDifferences) {
  const auto& s = GetParam().s;
  const auto fd = fd_gradient(
      w, w_size(s), [&] { return loss(); }, GetParam().fd_step);
  check_backward(w_size(s), fd, [&](double* dw, double beta) {
    k::conv2d_backward_filter<double>(s, x.data(), dy.data(), dw, beta, ws.data());
  });
}

TEST_P(CpuConv, BackwardBiasMatchesFiniteDifferences) {
  const auto& s = GetParam().s;
  const auto fd = fd_gradient(b, s.K, [&] { return loss(/*with_bias=*/true); });
  check_backward(s.K, fd, [&](double* db, double beta) {
    k::conv2d_backward_bias<double>(s, dy.data(), db, beta);
  });
}

// The fast path (oneDNN, float32) against the reference (im2col + GEMM) on the same inputs:
// forward, backward data and backward filter, each with beta = 0 over NaN-filled outputs and
// beta = 1 onto random values, in NaN-filled workspaces with guards. The reference is itself
// checked against naive loops and finite differences above.
testing::AssertionResult fast_path_matches_reference(const tally::kernels::Conv2dShape& s, unsigned seed) {
  using tally::kernels::ConvPass;
  const auto x = random_vec<float>(x_size(s), seed), w = random_vec<float>(w_size(s), seed + 1);
  const auto dy = random_vec<float>(y_size(s), seed + 2), old_dx = random_vec<float>(x_size(s), seed + 3);
  const auto old_dw = random_vec<float>(w_size(s), seed + 4);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Out {
    std::vector<float> y, dx0, dx1, dw0, dw1;
  };
  auto run_all = [&](k::ConvAlgorithm a, bool* guards) {
    k::set_conv_algorithm(a);
    Out o;
    auto ws = [&](ConvPass pass) {
      return guarded<float>(static_cast<i64>((k::conv2d_workspace_bytes<float>(s, pass) + 3) / sizeof(float)), nan);
    };
    auto wf = ws(ConvPass::forward), wd = ws(ConvPass::backward_data), wb = ws(ConvPass::backward_filter);
    o.y = guarded<float>(y_size(s), nan);
    k::conv2d_forward<float>(s, x.data(), w.data(), nullptr, o.y.data(), wf.data());
    o.dx0 = guarded<float>(x_size(s), nan);
    k::conv2d_backward_data<float>(s, dy.data(), w.data(), o.dx0.data(), 0.f, wd.data());
    o.dx1 = guarded<float>(x_size(s), 0.f);
    std::copy(old_dx.begin(), old_dx.end(), o.dx1.begin());
    k::conv2d_backward_data<float>(s, dy.data(), w.data(), o.dx1.data(), 1.f, wd.data());
    o.dw0 = guarded<float>(w_size(s), nan);
    k::conv2d_backward_filter<float>(s, x.data(), dy.data(), o.dw0.data(), 0.f, wb.data());
    o.dw1 = guarded<float>(w_size(s), 0.f);
    std::copy(old_dw.begin(), old_dw.end(), o.dw1.begin());
    k::conv2d_backward_filter<float>(s, x.data(), dy.data(), o.dw1.data(), 1.f, wb.data());
    *guards = guard_ok(wf) && guard_ok(wd) && guard_ok(wb) && guard_ok(o.y) && guard_ok(o.dx0) && guard_ok(o.dx1) &&
              guard_ok(o.dw0) && guard_ok(o.dw1);
    return o;
  };
  const k::ConvAlgorithm before = k::conv_algorithm();
  k::set_conv_algorithm(k::ConvAlgorithm::onednn);
  for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter})
    if (!k::conv2d_on_onednn(s, pass)) {
      k::set_conv_algorithm(before);
      return testing::AssertionFailure() << "oneDNN does not take pass " << static_cast<int>(pass)
                                         << ": the comparison would be the reference with itself";
    }
  bool ref_guards = false, fast_guards = false;
  const Out ref = run_all(k::ConvAlgorithm::reference, &ref_guards);
  const Out fast = run_all(k::ConvAlgorithm::onednn, &fast_guards);
  k::set_conv_algorithm(before);
  if (!ref_guards || !fast_guards) return testing::AssertionFailure() << "a write past the end of an output or workspace";
  // Sums of C*R*S (forward, backward data) or N*P*Q (backward filter) float products: the
  // tolerance grows with the length of the sum.
  const double tol = 2e-6 * std::sqrt(static_cast<double>(std::max(s.C / s.groups * s.R * s.S, s.N * s.P() * s.Q())));
  for (auto [name, got, want, n] :
       {std::tuple{"y", &fast.y, &ref.y, y_size(s)}, std::tuple{"dx (beta 0)", &fast.dx0, &ref.dx0, x_size(s)},
        std::tuple{"dx (beta 1)", &fast.dx1, &ref.dx1, x_size(s)}, std::tuple{"dw (beta 0)", &fast.dw0, &ref.dw0, w_size(s)},
        std::tuple{"dw (beta 1)", &fast.dw1, &ref.dw1, w_size(s)}}) {
    auto r = all_close(*got, *want, tol, n);
    if (!r) return testing::AssertionFailure() << name << ": " << r.message();
  }
  return testing::AssertionSuccess();
}

TEST_P(CpuConv, FastPathMatchesTheReferenceFloat) {
  if (!k::have_onednn()) GTEST_SKIP() << "this build has no oneDNN: the reference is the only CPU convolution";
  EXPECT_TRUE(fast_path_matches_reference(GetParam().s, 11));
}

// A pass over its workspace limit runs over chunks of samples (conv_onednn.cpp): the workspace
// stays within the limit (or one sample's, when even that is over it) and the results still
// match the reference, a filter gradient summed over the chunks with beta 0 and 1.
TEST(CpuConvChunks, APassOverTheWorkspaceLimitRunsInChunksOfSamples) {
  if (!k::have_onednn()) GTEST_SKIP() << "this build has no oneDNN: the reference is the only CPU convolution";
  using tally::kernels::ConvPass;
  const k::ConvAlgorithm before = k::conv_algorithm();
  k::set_conv_algorithm(k::ConvAlgorithm::onednn);
  int chunked = 0;
  for (auto s : {conv(7, 8, 12, 12, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1), conv(9, 16, 10, 10, 8, 1, 1, 2, 2, 0, 0, 1, 1, 1),
                 conv(5, 4, 9, 11, 12, 3, 3, 1, 1, 1, 1, 2, 1, 2)}) {
    for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter}) {
      const std::size_t whole = k::conv2d_workspace_bytes<float>(s, pass);
      auto one = s;
      one.N = 1;
      const std::size_t sample = k::conv2d_workspace_bytes<float>(one, pass);
      for (const std::size_t limit : {whole / 2, whole / 3, std::size_t(1)}) {
        auto c = s;
        c.workspace_limit = limit;
        const std::size_t bytes = k::conv2d_workspace_bytes<float>(c, pass);
        EXPECT_LE(bytes, std::max(limit, sample)) << "pass " << static_cast<int>(pass) << " limit " << limit;
        if (bytes < whole) ++chunked;
      }
    }
    for (const std::size_t divisor : {2, 3, 1000000}) {
      auto c = s;
      c.workspace_limit = k::conv2d_workspace_bytes<float>(s, ConvPass::backward_filter) / divisor;
      EXPECT_TRUE(fast_path_matches_reference(c, 40 + static_cast<unsigned>(divisor))) << "limit 1/" << divisor;
    }
  }
  k::set_conv_algorithm(before);
  EXPECT_GT(chunked, 12) << "the limits should have split most passes";
}

// Random shapes (fresh each run; the seed is printed): groups, dilation, strides, paddings.
TEST(CpuConvRandom, FastPathMatchesTheReferenceOnRandomShapes) {
  if (!k::have_onednn()) GTEST_SKIP() << "this build has no oneDNN: the reference is the only CPU convolution";
  const unsigned seed = std::random_device{}();
  std::cout << "seed " << seed << "\n";
  std::mt19937 rng(seed);
  auto pick = [&](i64 lo, i64 hi) { return std::uniform_int_distribution<i64>(lo, hi)(rng); };
  int tested = 0;
  while (tested < 24) {
    const i64 g = pick(1, 3), R = pick(1, 5), S = pick(1, 5), dh = pick(1, 2), dw = pick(1, 2);
    const auto s = conv(pick(1, 3), g * pick(1, 4), pick(3, 14), pick(3, 14), g * pick(1, 4), R, S, pick(1, 3),
                        pick(1, 3), pick(0, R / 2 + 1), pick(0, S / 2 + 1), dh, dw, g);
    if (s.P() < 1 || s.Q() < 1) continue;
    ++tested;
    EXPECT_TRUE(fast_path_matches_reference(s, seed + static_cast<unsigned>(tested)))
        << "N " << s.N << " C " << s.C << " H " << s.H << " W " << s.W << " K " << s.K << " R " << s.R << " S " << s.S
        << " stride " << s.stride_h << "x" << s.stride_w << " pad " << s.pad_h << "x" << s.pad_w << " dil " << s.dil_h
        << "x" << s.dil_w << " groups " << s.groups;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuConv, testing::ValuesIn(kConvCases),
                         [](const testing::TestParamInfo<ConvCase>& i) {
                           return std::string(i.param.name);
                         });

// ============================================================================================
// Pooling
// ============================================================================================

struct PoolCase {
  const char* name;
  tally::kernels::Pool2dShape s;
  i64 fd_step = 1;  // finite differences on every fd_step-th element
};
std::ostream& operator<<(std::ostream& os, const PoolCase& c) { return os << c.name; }

tally::kernels::Pool2dShape pool(i64 N, i64 C, i64 H, i64 W, i64 kh, i64 kw, i64 sh, i64 sw, i64 ph, i64 pw) {
  tally::kernels::Pool2dShape s{N, C, H, W, kh, kw, sh, sw};
  s.pad_h = ph;
  s.pad_w = pw;
  return s;
}

const PoolCase kPoolCases[] = {
    {"K3S2P1Odd", pool(2, 3, 7, 9, 3, 3, 2, 2, 1, 1)},
    {"K2S2", pool(2, 2, 8, 8, 2, 2, 2, 2, 0, 0)},
    {"RectMixed", pool(1, 3, 9, 7, 3, 2, 1, 2, 1, 0)},
    {"K3S3P1", pool(2, 2, 6, 5, 3, 3, 3, 3, 1, 1)},
    {"K4S2P2Odd", pool(1, 2, 11, 10, 4, 4, 2, 2, 2, 2)},
    {"K3S1P1Overlap", pool(2, 2, 5, 6, 3, 3, 1, 1, 1, 1)},
    {"GlobalK", pool(2, 3, 4, 5, 4, 5, 1, 1, 0, 0)},
    // Large enough to take the OpenMP paths (sampled FD).
    {"Large32x32", pool(4, 8, 32, 32, 3, 3, 1, 1, 1, 1), 97},
};

i64 px_size(const tally::kernels::Pool2dShape& s) { return s.N * s.C * s.H * s.W; }
i64 py_size(const tally::kernels::Pool2dShape& s) { return s.N * s.C * s.P() * s.Q(); }

// Naive max pooling: padding is -inf, the window is [p*sh - ph, p*sh - ph + kh).
void naive_max_pool(const tally::kernels::Pool2dShape& s, const std::vector<double>& x, std::vector<double>& y,
                    std::vector<std::int32_t>& arg) {
  const i64 P = s.P(), Q = s.Q();
  y.assign(static_cast<std::size_t>(py_size(s)), 0.0);
  arg.assign(static_cast<std::size_t>(py_size(s)), -1);
  for (i64 pl = 0; pl < s.N * s.C; ++pl)
    for (i64 p = 0; p < P; ++p)
      for (i64 q = 0; q < Q; ++q) {
        double best = -std::numeric_limits<double>::infinity();
        std::int32_t bi = -1;
        for (i64 r = 0; r < s.kh; ++r)
          for (i64 t = 0; t < s.kw; ++t) {
            const i64 h = p * s.stride_h - s.pad_h + r, w = q * s.stride_w - s.pad_w + t;
            if (h < 0 || h >= s.H || w < 0 || w >= s.W) continue;
            const double v = x[pl * s.H * s.W + h * s.W + w];
            if (v > best) {
              best = v;
              bi = static_cast<std::int32_t>(h * s.W + w);
            }
          }
        y[pl * P * Q + p * Q + q] = best;
        arg[pl * P * Q + p * Q + q] = bi;
      }
}

// Naive average pooling (floor mode): sum of the in-bounds window elements divided by kh*kw
// (count_include_pad) or by the number of in-bounds elements.
std::vector<double> naive_avg_pool(const tally::kernels::Pool2dShape& s, bool include_pad,
                                   const std::vector<double>& x) {
  const i64 P = s.P(), Q = s.Q();
  std::vector<double> y(static_cast<std::size_t>(py_size(s)));
  for (i64 pl = 0; pl < s.N * s.C; ++pl)
    for (i64 p = 0; p < P; ++p)
      for (i64 q = 0; q < Q; ++q) {
        double acc = 0.0;
        i64 cnt = 0;
        for (i64 r = 0; r < s.kh; ++r)
          for (i64 t = 0; t < s.kw; ++t) {
            const i64 h = p * s.stride_h - s.pad_h + r, w = q * s.stride_w - s.pad_w + t;
            if (h < 0 || h >= s.H || w < 0 || w >= s.W) continue;
            acc += x[pl * s.H * s.W + h * s.W + w];
            ++cnt;
          }
        y[pl * P * Q + p * Q + q] = acc / static_cast<double>(include_pad ? s.kh * s.kw : cnt);
      }
  return y;
}

class CpuPool : public testing::TestWithParam<PoolCase> {};

TEST_P(CpuPool, MaxForwardMatchesNaive) {
  const auto& s = GetParam().s;
  const auto x = distinct_vec(px_size(s), 11);
  std::vector<double> yref;
  std::vector<std::int32_t> aref;
  naive_max_pool(s, x, yref, aref);
  auto y = guarded<double>(py_size(s), kNaN);
  auto arg = guarded<std::int32_t>(py_size(s), -7);
  k::max_pool2d_forward<double>(s, x.data(), y.data(), arg.data());
  EXPECT_TRUE(all_close(y, yref, 0.0, py_size(s)));
  EXPECT_TRUE(std::equal(aref.begin(), aref.end(), arg.begin()));
  EXPECT_TRUE(guard_ok(y));
  EXPECT_TRUE(guard_ok(arg));
}

TEST_P(CpuPool, MaxPaddingIsMinusInfinity) {
  // All inputs negative: a zero-padding implementation would output 0 at the borders.
  const auto& s = GetParam().s;
  auto x = distinct_vec(px_size(s), 12);
  for (auto& v : x) v = -1.5 - v;  // in [-2.5, -0.5]
  std::vector<double> y(static_cast<std::size_t>(py_size(s)));
  std::vector<std::int32_t> arg(static_cast<std::size_t>(py_size(s)));
  k::max_pool2d_forward<double>(s, x.data(), y.data(), arg.data());
  for (double v : y) EXPECT_LT(v, -0.4);
}

TEST_P(CpuPool, MaxBackwardMatchesFiniteDifferences) {
  const auto& s = GetParam().s;
  auto x = distinct_vec(px_size(s), 13);
  const auto dy = random_vec(py_size(s), 14);
  std::vector<double> y(static_cast<std::size_t>(py_size(s)));
  std::vector<std::int32_t> arg(static_cast<std::size_t>(py_size(s)));
  auto loss = [&] {
    k::max_pool2d_forward<double>(s, x.data(), y.data(), arg.data());
    return dot(y, dy, py_size(s));
  };
  const auto fd = fd_gradient(x, px_size(s), loss, GetParam().fd_step);
  k::max_pool2d_forward<double>(s, x.data(), y.data(), arg.data());

  const i64 n = px_size(s);
  auto fresh = guarded<double>(n, kNaN);
  k::max_pool2d_backward<double>(s, dy.data(), arg.data(), fresh.data(), 0.0);
  EXPECT_TRUE(all_finite(fresh, n));
  EXPECT_TRUE(matches_fd(fresh, fd));
  EXPECT_TRUE(guard_ok(fresh));

  const auto old = random_vec(n, 15);
  auto acc = guarded<double>(n, 0.0);
  std::copy(old.begin(), old.end(), acc.begin());
  k::max_pool2d_backward<double>(s, dy.data(), arg.data(), acc.data(), 1.0);
  std::vector<double> want(static_cast<std::size_t>(n));
  for (i64 i = 0; i < n; ++i) want[i] = old[i] + fresh[i];
  EXPECT_TRUE(all_close(acc, want, kRtolD, n));
  EXPECT_TRUE(guard_ok(acc));
}

TEST_P(CpuPool, AvgForwardMatchesNaive) {
  const auto& s = GetParam().s;
  const auto x = random_vec(px_size(s), 21);
  for (bool include_pad : {true, false}) {
    auto y = guarded<double>(py_size(s), kNaN);
    k::avg_pool2d_forward<double>(s, include_pad, x.data(), y.data());
    EXPECT_TRUE(all_close(y, naive_avg_pool(s, include_pad, x), kRtolD, py_size(s)))
        << "count_include_pad = " << include_pad;
    EXPECT_TRUE(guard_ok(y));

    std::vector<float> xf(x.begin(), x.end());
    auto yf = guarded<float>(py_size(s), std::numeric_limits<float>::quiet_NaN());
    k::avg_pool2d_forward<float>(s, include_pad, xf.data(), yf.data());
    std::vector<double> xd(xf.begin(), xf.end());
    EXPECT_TRUE(all_close(yf, naive_avg_pool(s, include_pad, xd), kRtolF, py_size(s)));
  }
}

TEST_P(CpuPool, AvgBackwardMatchesFiniteDifferences) {
  const auto& s = GetParam().s;
  auto x = random_vec(px_size(s), 22);
  const auto dy = random_vec(py_size(s), 23);
  const i64 n = px_size(s);
  for (bool include_pad : {true, false}) {
    std::vector<double> y(static_cast<std::size_t>(py_size(s)));
    const auto fd = fd_gradient(
        x, n,
        [&] {
          k::avg_pool2d_forward<double>(s, include_pad, x.data(), y.data());
          return dot(y, dy, py_size(s));
        },
        GetParam().fd_step);
    auto fresh = guarded<double>(n, kNaN);
    k::avg_pool2d_backward<double>(s, include_pad, dy.data(), fresh.data(), 0.0);
    EXPECT_TRUE(all_finite(fresh, n));
    EXPECT_TRUE(matches_fd(fresh, fd)) << "count_include_pad = " << include_pad;
    EXPECT_TRUE(guard_ok(fresh));

    const auto old = random_vec(n, 24);
    auto acc = guarded<double>(n, 0.0);
    std::copy(old.begin(), old.end(), acc.begin());
    k::avg_pool2d_backward<double>(s, include_pad, dy.data(), acc.data(), 1.0);
    std::vector<double> want(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i) want[i] = old[i] + fresh[i];
    EXPECT_TRUE(all_close(acc, want, kRtolD, n));
    EXPECT_TRUE(guard_ok(acc));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuPool, testing::ValuesIn(kPoolCases),
                         [](const testing::TestParamInfo<PoolCase>& i) {
                           return std::string(i.param.name);
                         });

TEST(CpuMaxPool, NaNPropagates) {
  // 1 plane 4x4, k2 s2: put a NaN in the top-left window; that output is NaN, the others not.
  const auto s = pool(1, 1, 4, 4, 2, 2, 2, 2, 0, 0);
  auto x = distinct_vec(16, 31);
  x[1 * 4 + 1] = kNaN;
  std::vector<double> y(4);
  std::vector<std::int32_t> arg(4);
  k::max_pool2d_forward<double>(s, x.data(), y.data(), arg.data());
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(arg[0], 5);
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(std::isfinite(y[i]));
}

// Adaptive average pooling ---------------------------------------------------------------------

struct AdaptiveCase {
  const char* name;
  i64 N, C, H, W, OH, OW;
  i64 fd_step = 1;  // finite differences on every fd_step-th element
};
std::ostream& operator<<(std::ostream& os, const AdaptiveCase& c) { return os << c.name; }

const AdaptiveCase kAdaptiveCases[] = {
    {"Down7x9To3x4", 2, 3, 7, 9, 3, 4},        {"Identity5x5", 1, 2, 5, 5, 5, 5},
    {"Global8x8", 2, 4, 8, 8, 1, 1},           {"Global7x5", 1, 3, 7, 5, 1, 1},
    {"Overlap6x10To4x3", 2, 2, 6, 10, 4, 3},   {"Up3x3To5x4", 1, 2, 3, 3, 5, 4},
    {"LargeGlobal", 8, 16, 17, 15, 1, 1, 101},
};

// Window of output i: [floor(i*H/OH), ceil((i+1)*H/OH)), computed in floating point.
std::vector<double> naive_adaptive(const AdaptiveCase& c, const std::vector<double>& x) {
  std::vector<double> y(static_cast<std::size_t>(c.N * c.C * c.OH * c.OW));
  for (i64 pl = 0; pl < c.N * c.C; ++pl)
    for (i64 i = 0; i < c.OH; ++i)
      for (i64 j = 0; j < c.OW; ++j) {
        const i64 h0 = static_cast<i64>(std::floor(double(i * c.H) / double(c.OH)));
        const i64 h1 = static_cast<i64>(std::ceil(double((i + 1) * c.H) / double(c.OH)));
        const i64 w0 = static_cast<i64>(std::floor(double(j * c.W) / double(c.OW)));
        const i64 w1 = static_cast<i64>(std::ceil(double((j + 1) * c.W) / double(c.OW)));
        double acc = 0.0;
        for (i64 h = h0; h < h1; ++h)
          for (i64 w = w0; w < w1; ++w) acc += x[pl * c.H * c.W + h * c.W + w];
        y[(pl * c.OH + i) * c.OW + j] = acc / double((h1 - h0) * (w1 - w0));
      }
  return y;
}

class CpuAdaptivePool : public testing::TestWithParam<AdaptiveCase> {};

TEST_P(CpuAdaptivePool, ForwardMatchesNaive) {
  const auto& c = GetParam();
  const i64 nx = c.N * c.C * c.H * c.W, ny = c.N * c.C * c.OH * c.OW;
  const auto x = random_vec(nx, 41);
  auto y = guarded<double>(ny, kNaN);
  k::adaptive_avg_pool2d_forward<double>(c.N, c.C, c.H, c.W, c.OH, c.OW, x.data(), y.data());
  EXPECT_TRUE(all_close(y, naive_adaptive(c, x), kRtolD, ny));
  EXPECT_TRUE(guard_ok(y));

  std::vector<float> xf(x.begin(), x.end());
  auto yf = guarded<float>(ny, std::numeric_limits<float>::quiet_NaN());
  k::adaptive_avg_pool2d_forward<float>(c.N, c.C, c.H, c.W, c.OH, c.OW, xf.data(), yf.data());
  EXPECT_TRUE(
      all_close(yf, naive_adaptive(c, std::vector<double>(xf.begin(), xf.end())), kRtolF, ny));
}

TEST_P(CpuAdaptivePool, BackwardMatchesFiniteDifferences) {
  const auto& c = GetParam();
  const i64 nx = c.N * c.C * c.H * c.W, ny = c.N * c.C * c.OH * c.OW;
  auto x = random_vec(nx, 42);
  const auto dy = random_vec(ny, 43);
  std::vector<double> y(static_cast<std::size_t>(ny));
  const auto fd = fd_gradient(
      x, nx,
      [&] {
        k::adaptive_avg_pool2d_forward<double>(c.N, c.C, c.H, c.W, c.OH, c.OW, x.data(), y.data());
        return dot(y, dy, ny);
      },
      c.fd_step);
  auto fresh = guarded<double>(nx, kNaN);
  k::adaptive_avg_pool2d_backward<double>(c.N, c.C, c.H, c.W, c.OH, c.OW, dy.data(), fresh.data(),
                                          0.0);
  EXPECT_TRUE(all_finite(fresh, nx));
  EXPECT_TRUE(matches_fd(fresh, fd));
  EXPECT_TRUE(guard_ok(fresh));

  const auto old = random_vec(nx, 44);
  auto acc = guarded<double>(nx, 0.0);
  std::copy(old.begin(), old.end(), acc.begin());
  k::adaptive_avg_pool2d_backward<double>(c.N, c.C, c.H, c.W, c.OH, c.OW, dy.data(), acc.data(),
                                          1.0);
  std::vector<double> want(static_cast<std::size_t>(nx));
  for (i64 i = 0; i < nx; ++i) want[i] = old[i] + fresh[i];
  EXPECT_TRUE(all_close(acc, want, kRtolD, nx));
  EXPECT_TRUE(guard_ok(acc));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuAdaptivePool, testing::ValuesIn(kAdaptiveCases),
                         [](const testing::TestParamInfo<AdaptiveCase>& i) {
                           return std::string(i.param.name);
                         });

}  // namespace
