// Every CUDA kernel (kernels/cuda) against its CPU reference (kernels/cpu) on fresh random inputs
// at several shapes, odd sizes included (ctest label `gpu`; each test skips with a message when
// no GPU is present, and the whole file is one skipping test in a build without CUDA).
//
// Device buffers are exact-size cudaMalloc allocations (class Buf, tests/gpu_buffer.h), so that
// compute-sanitizer sees each one's bounds. Outputs written with beta = 0 start as NaN on both sides, so an element
// the kernel forgets stays NaN and fails; beta = 1 starts both sides from the same random values and checks the
// accumulation. Tolerances (max-norm relative error, tests/gpu_common.h): 1e-5 for elementwise
// kernels, pooling and the optimizer updates, 1e-4 for GEMM, convolution, norms and the loss
// (float32, TF32 off). Reductions are also run twice and must agree bit for bit.
#include "tests/gpu_common.h"
#include "tally/config.h"

#if !TALLY_HAVE_CUDA

TEST(GpuKernels, NeedTheCudaBackend) { GTEST_SKIP() << "CPU-only build: " << tally::build_info(); }

#else

#include <array>
#include <cstring>
#include <fmt/format.h>
#include <utility>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
#include "tests/gpu_buffer.h"

using namespace tally;
using namespace tally::test;
namespace kc = tally::kernels::cpu;
namespace kg = tally::kernels::cuda;
using i64 = std::int64_t;

namespace {

constexpr double kElementwiseTol = 1e-5, kMathTol = 1e-4;

Buf<i64> dev_i64(const std::vector<i64>& v) { return Buf<i64>(v); }
std::vector<float> nans(std::size_t n) { return std::vector<float>(n, NAN); }

// Runs an accumulating kernel on both sides for beta = 0 (outputs NaN-poisoned) and beta = 1
// (outputs from the same random start) and compares. cpu(out, beta) / gpu(out, beta).
template <class Cpu, class Gpu>
void check_beta(std::size_t n, std::mt19937& rng, double tol, Cpu cpu, Gpu gpu) {
  for (float beta : {0.f, 1.f}) {
    SCOPED_TRACE(testing::Message() << "beta " << beta);
    const std::vector<float> init = beta == 0.f ? nans(n) : uniform(n, rng);
    std::vector<float> want = init;
    cpu(want.data(), beta);
    Buf<float> d = dev(init);
    gpu(P(d), beta);
    EXPECT_CLOSE(host(d), want, tol);
  }
}

}  // namespace

// ---- elementwise --------------------------------------------------------------------------------

TEST(GpuKernels, ElementwiseMapsMatchTheCpu) {
  REQUIRE_GPU();
  for (i64 n : {i64{1}, i64{7}, i64{1000}, i64{65536 * 4 + 13}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
    std::mt19937 rng(seed);
    const auto a = uniform(n, rng), b = uniform(n, rng);
    Buf<float> da = dev(a), db = dev(b);
    std::vector<float> want(n);

    Buf<float> y = dev(nans(n));
    kg::fill<float>(n, 0.625f, P(y));
    EXPECT_CLOSE(host(y), std::vector<float>(n, 0.625f), 0.0);

    y = dev(nans(n));
    kg::copy<float>(n, P(da), P(y));
    EXPECT_EQ(host(y), a);

    for (float alpha : {1.f, -1.f, 0.5f}) {
      kc::add<float>(n, a.data(), b.data(), alpha, want.data());
      y = dev(nans(n));
      kg::add<float>(n, P(da), P(db), alpha, P(y));
      EXPECT_CLOSE(host(y), want, kElementwiseTol) << "add alpha " << alpha;
    }
    kc::mul<float>(n, a.data(), b.data(), want.data());
    y = dev(nans(n));
    kg::mul<float>(n, P(da), P(db), P(y));
    EXPECT_CLOSE(host(y), want, kElementwiseTol) << "mul";

    kc::relu_forward<float>(n, a.data(), want.data());
    y = dev(nans(n));
    kg::relu_forward<float>(n, P(da), P(y));
    EXPECT_CLOSE(host(y), want, kElementwiseTol) << "relu_forward";

    check_beta(n, rng, kElementwiseTol, [&](float* o, float beta) { kc::axpby<float>(n, -0.75f, a.data(), beta, o); },
               [&](float* o, float beta) { kg::axpby<float>(n, -0.75f, P(da), beta, o); });
    check_beta(n, rng, kElementwiseTol, [&](float* o, float beta) { kc::mul_backward<float>(n, a.data(), b.data(), o, beta); },
               [&](float* o, float beta) { kg::mul_backward<float>(n, P(da), P(db), o, beta); });
    check_beta(n, rng, kElementwiseTol, [&](float* o, float beta) { kc::relu_backward<float>(n, a.data(), b.data(), o, beta); },
               [&](float* o, float beta) { kg::relu_backward<float>(n, P(da), P(db), o, beta); });

    // float <-> double
    std::vector<double> wd(n);
    kc::convert<float, double>(n, a.data(), wd.data());
    Buf<double> yd(n);
    kg::convert<float, double>(n, P(da), P(yd));
    EXPECT_EQ(host(yd), wd);
    Buf<float> back = dev(nans(n));
    kg::convert<double, float>(n, P(yd), P(back));
    EXPECT_EQ(host(back), a);
  }
}

// sigmoid (over a range that would overflow exp(-x) in a naive formula), the channel scaling of
// squeeze-and-excitation in both layouts, and concatenation's row-block copies, each with beta 0
// (outputs NaN-poisoned) and 1; the channel sums run twice and must agree bit for bit.
TEST(GpuKernels, SigmoidChannelScalingAndRowCopiesMatchTheCpu) {
  REQUIRE_GPU();
  for (i64 n : {i64{1}, i64{7}, i64{1000}, i64{65536 * 4 + 13}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
    std::mt19937 rng(seed);
    auto x = uniform(n, rng, -20.f, 20.f);
    if (n >= 4) x[0] = 100.f, x[1] = -100.f, x[2] = 1e30f, x[3] = -1e30f;
    const auto dy = uniform(n, rng);
    Buf<float> dx = dev(x), ddy = dev(dy);
    std::vector<float> want(n);
    kc::sigmoid_forward<float>(n, x.data(), want.data());
    Buf<float> y = dev(nans(n));
    kg::sigmoid_forward<float>(n, P(dx), P(y));
    EXPECT_CLOSE(host(y), want, kElementwiseTol) << "sigmoid_forward";
    const std::vector<float> yv = want;
    Buf<float> dyv = dev(yv);
    check_beta(
        n, rng, kElementwiseTol,
        [&](float* o, float beta) { kc::sigmoid_backward<float>(n, dy.data(), yv.data(), o, beta); },
        [&](float* o, float beta) { kg::sigmoid_backward<float>(n, P(ddy), P(dyv), o, beta); });
  }
  struct Shape4 {
    i64 N, C, HW;
  };
  for (const Shape4 sh : {Shape4{1, 1, 1}, Shape4{2, 3, 5}, Shape4{3, 70, 49}, Shape4{4, 64, 1000}, Shape4{2, 5, 4099}})
    for (const bool cl : {false, true}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << sh.N << " C " << sh.C << " HW " << sh.HW
                                      << (cl ? " channels-last" : "") << " seed " << seed);
      std::mt19937 rng(seed);
      const i64 n = sh.N * sh.C * sh.HW, nc = sh.N * sh.C;
      const auto x = uniform(n, rng), dy = uniform(n, rng), sc = uniform(nc, rng);
      Buf<float> dx = dev(x), ddy = dev(dy), ds = dev(sc);
      check_beta(
          n, rng, kElementwiseTol,
          [&](float* o, float beta) { kc::scale_channels<float>(sh.N, sh.C, sh.HW, cl, x.data(), sc.data(), o, beta); },
          [&](float* o, float beta) { kg::scale_channels<float>(sh.N, sh.C, sh.HW, cl, P(dx), P(ds), o, beta); });
      check_beta(nc, rng, kElementwiseTol,
                 [&](float* o, float beta) {
                   kc::scale_channels_backward_scale<float>(sh.N, sh.C, sh.HW, cl, dy.data(), x.data(), o, beta);
                 },
                 [&](float* o, float beta) {
                   kg::scale_channels_backward_scale<float>(sh.N, sh.C, sh.HW, cl, P(ddy), P(dx), o, beta);
                 });
      Buf<float> r1 = dev(nans(nc)), r2 = dev(nans(nc));
      kg::scale_channels_backward_scale<float>(sh.N, sh.C, sh.HW, cl, P(ddy), P(dx), P(r1), 0.f);
      kg::scale_channels_backward_scale<float>(sh.N, sh.C, sh.HW, cl, P(ddy), P(dx), P(r2), 0.f);
      EXPECT_EQ(host(r1), host(r2)) << "scale_channels_backward_scale must be deterministic";
    }
  // A (rows, cols) block of x (rows, ldx) into columns [off, off + cols) of y (rows, ldy), and back.
  for (auto [rows, cols, ld, off] : std::vector<std::array<i64, 4>>{{1, 1, 1, 0}, {3, 5, 12, 7}, {1000, 33, 40, 2},
                                                                     {4097, 10, 10, 0}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols << " ld " << ld << " seed " << seed);
    std::mt19937 rng(seed);
    const auto x = uniform(rows * cols, rng), wide = uniform(rows * ld, rng);
    Buf<float> dx = dev(x), dwide = dev(wide);
    check_beta(rows * ld, rng, 0.0,
               [&](float* o, float beta) { kc::copy_rows<float>(rows, cols, x.data(), cols, o + off, ld, beta); },
               [&](float* o, float beta) { kg::copy_rows<float>(rows, cols, P(dx), cols, o + off, ld, beta); });
    check_beta(rows * cols, rng, 0.0,
               [&](float* o, float beta) { kc::copy_rows<float>(rows, cols, wide.data() + off, ld, o, cols, beta); },
               [&](float* o, float beta) { kg::copy_rows<float>(rows, cols, P(dwide) + off, ld, o, cols, beta); });
  }
}

TEST(GpuKernels, RowBroadcastsAndReductionsMatchTheCpu) {
  REQUIRE_GPU();
  for (auto [rows, cols] : std::vector<std::pair<i64, i64>>{{1, 1}, {3, 5}, {1000, 33}, {7, 100}, {4097, 10}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "rows " << rows << " cols " << cols << " seed " << seed);
    std::mt19937 rng(seed);
    const auto x = uniform(rows * cols, rng), bias = uniform(cols, rng);
    Buf<float> dx = dev(x), dbias = dev(bias);
    std::vector<float> want(rows * cols);
    kc::add_bias_rows<float>(rows, cols, x.data(), bias.data(), want.data());
    Buf<float> y = dev(nans(rows * cols));
    kg::add_bias_rows<float>(rows, cols, P(dx), P(dbias), P(y));
    EXPECT_CLOSE(host(y), want, kElementwiseTol) << "add_bias_rows";
    // in place, as linear() calls it
    kg::add_bias_rows<float>(rows, cols, P(dx), P(dbias), P(dx));
    EXPECT_CLOSE(host(dx), want, kElementwiseTol) << "add_bias_rows in place";

    dx = dev(x);
    check_beta(cols, rng, kElementwiseTol, [&](float* o, float beta) { kc::sum_rows<float>(rows, cols, x.data(), o, beta); },
               [&](float* o, float beta) { kg::sum_rows<float>(rows, cols, P(dx), o, beta); });
    Buf<float> r1 = dev(nans(cols)), r2 = dev(nans(cols));
    kg::sum_rows<float>(rows, cols, P(dx), P(r1), 0.f);
    kg::sum_rows<float>(rows, cols, P(dx), P(r2), 0.f);
    EXPECT_EQ(host(r1), host(r2)) << "sum_rows must be deterministic";
  }
  for (i64 n : {i64{1}, i64{1000}, (i64{1} << 20) + 3}) {
    std::mt19937 rng(fresh_seed());
    const auto x = uniform(n, rng, -1.f, 2.f);
    Buf<float> dx = dev(x);
    const float want = kc::sum_all<float>(n, x.data());
    const float got = kg::sum_all<float>(n, P(dx));
    EXPECT_NEAR(got, want, 1e-6 * std::max(1.0, std::abs(double(want)))) << "sum_all n " << n;
    EXPECT_EQ(kg::sum_all<float>(n, P(dx)), got) << "sum_all must be deterministic";
  }
  EXPECT_EQ(kg::sum_all<float>(0, nullptr), 0.f);
}

TEST(GpuKernels, StridedCopyMatchesTheCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(fresh_seed());
  const auto x = uniform(3 * 5 * 7, rng);
  Buf<float> dx = dev(x);
  struct Case {
    std::vector<i64> shape, strides;
    i64 offset;
  };
  const std::vector<Case> cases = {
      {{7, 5, 3}, {1, 7, 35}, 0},     // full transpose of (3, 5, 7)
      {{3, 7}, {35, 1}, 7},           // a slice
      {{4, 5, 6}, {0, 7, 1}, 1},      // broadcast along a stride-0 dimension
      {{2, 2, 2, 2}, {35, 14, 7, 2}, 3},
      {{}, {}, 11},                   // a scalar view
  };
  for (const Case& c : cases) {
    i64 n = 1;
    for (i64 d : c.shape) n *= d;
    std::vector<float> want(n);
    kc::strided_copy<float>(static_cast<int>(c.shape.size()), c.shape.data(), c.strides.data(), x.data() + c.offset,
                            want.data());
    Buf<float> y = dev(nans(n));
    kg::strided_copy<float>(static_cast<int>(c.shape.size()), c.shape.data(), c.strides.data(), P(dx) + c.offset, P(y));
    EXPECT_EQ(host(y), want) << "ndim " << c.shape.size();
  }
}

// ---- GEMM ---------------------------------------------------------------------------------------

// cuBLAS is opened on first use, not linked (kernels/cuda/cublas_library.h): the loaded library is
// the major version the headers declare and its status strings are cuBLAS's own. Needs the
// library, not a GPU: it runs wherever the CUDA backend is built.
TEST(GpuKernels, CublasIsOpenedOnFirstUse) {
  namespace kd = tally::kernels::cuda::detail;
  const kd::CublasLibrary& lib = kd::cublas_library();
  EXPECT_EQ(&lib, &kd::cublas_library());  // opened once
  int major = -1, minor = -1;
  ASSERT_EQ(lib.get_property(MAJOR_VERSION, &major), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(lib.get_property(MINOR_VERSION, &minor), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(major, CUBLAS_VER_MAJOR);
  EXPECT_GE(minor, 0);
  EXPECT_STREQ(lib.get_status_name(CUBLAS_STATUS_NOT_INITIALIZED), "CUBLAS_STATUS_NOT_INITIALIZED");
  EXPECT_STREQ(kd::cublas_soname(), ("libcublas.so." + std::to_string(CUBLAS_VER_MAJOR)).c_str());
}

TEST(GpuKernels, GemmMatchesTheCpuForEveryTransposeAndBeta) {
  REQUIRE_GPU();
  // The smallest workspace gemm accepts, and the one a 2 GiB budget gives (32 MiB on Hopper).
  for (std::size_t ws_bytes : {kg::kGemmMinWorkspace, kg::gemm_workspace_bytes(std::size_t(2) << 30)}) {
    const auto ws = scratch(ws_bytes);
    for (auto [M, N, K] : std::vector<std::array<i64, 3>>{{1, 1, 1}, {3, 5, 7}, {64, 33, 17}, {128, 10, 64}, {5, 3, 0},
                                                          {512, 1000, 2048}}) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          const auto seed = fresh_seed();
          SCOPED_TRACE(testing::Message() << "M " << M << " N " << N << " K " << K << " ta " << ta << " tb " << tb
                                          << " workspace " << ws_bytes << " seed " << seed);
          std::mt19937 rng(seed);
          // leading dimensions with padding, so that ld != the logical width is exercised
          const i64 lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 1, ldc = N + 3;
          const auto A = uniform((ta ? K : M) * lda, rng), B = uniform((tb ? N : K) * ldb, rng);
          Buf<float> dA = dev(A), dB = dev(B);
          // Padding columns (j >= N) are never written: NaN stays NaN (beta 0) and the random
          // start stays (beta 1) on both sides, which compares equal.
          check_beta(M * ldc, rng, kMathTol,
                     [&](float* C, float beta) {
                       kc::gemm<float>(ta, tb, M, N, K, 1.5f, A.data(), lda, B.data(), ldb, beta, C, ldc);
                     },
                     [&](float* C, float beta) {
                       kg::gemm<float>(ta, tb, M, N, K, 1.5f, P(dA), lda, P(dB), ldb, beta, C, ldc, ws_ptr(ws), ws_bytes);
                     });
        }
      }
    }
  }
}

TEST(GpuKernels, GemmWithoutAWorkspaceIsAClearError) {
  REQUIRE_GPU();
  EXPECT_GE(kg::gemm_workspace_bytes(0), kg::kGemmMinWorkspace) << "a tiny budget still gives the minimum";
  EXPECT_LE(kg::gemm_workspace_bytes(std::size_t(1) << 40), std::size_t(32) << 20) << "at most the recommendation";
  Buf<float> A = dev(std::vector<float>(4, 1.f)), C = dev(nans(4));
  const auto small = scratch(kg::kGemmMinWorkspace / 2);
  for (auto [ptr, bytes] : std::vector<std::pair<void*, std::size_t>>{{nullptr, 0}, {ws_ptr(small), kg::kGemmMinWorkspace / 2}}) {
    try {
      kg::gemm<float>(false, false, 2, 2, 2, 1.f, P(A), 2, P(A), 2, 0.f, P(C), 2, ptr, bytes);
      ADD_FAILURE() << "gemm with a workspace of " << bytes << " bytes should be refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("workspace of at least"), std::string::npos) << e.what();
    }
  }
}

// Sets a process-wide CUDA switch for one scope and restores it however the scope ends, so that a
// failing check cannot leave TF32 (or non-determinism) on for every later test.
class ScopedSwitch {
 public:
  ScopedSwitch(void (*set)(bool), bool (*get)(), bool on) : set_(set), old_(get()) { set_(on); }
  ~ScopedSwitch() { set_(old_); }
  ScopedSwitch(const ScopedSwitch&) = delete;
  ScopedSwitch& operator=(const ScopedSwitch&) = delete;

 private:
  void (*set_)(bool);
  bool old_;
};
ScopedSwitch tf32(bool on) { return ScopedSwitch(kg::set_allow_tf32, kg::allow_tf32, on); }

TEST(GpuKernels, GemmWithTf32AllowedStaysWithinTf32Accuracy) {
  REQUIRE_GPU();
  std::mt19937 rng(fresh_seed());
  const i64 M = 96, N = 80, K = 256;
  const auto A = uniform(M * K, rng), B = uniform(K * N, rng);
  std::vector<float> want(M * N);
  kc::gemm<float>(false, false, M, N, K, 1.f, A.data(), K, B.data(), N, 0.f, want.data(), N);
  Buf<float> dA = dev(A), dB = dev(B), C = dev(nans(M * N)), C32 = dev(nans(M * N));
  const auto ws = scratch(kg::kGemmMinWorkspace);
  {
    const auto on = tf32(true);
    kg::gemm<float>(false, false, M, N, K, 1.f, P(dA), K, P(dB), N, 0.f, P(C), N, ws_ptr(ws), kg::kGemmMinWorkspace);
  }
  EXPECT_FALSE(kg::allow_tf32()) << "the switch is restored";
  kg::gemm<float>(false, false, M, N, K, 1.f, P(dA), K, P(dB), N, 0.f, P(C32), N, ws_ptr(ws), kg::kGemmMinWorkspace);
  EXPECT_CLOSE(host(C), want, 1e-2);
  EXPECT_CLOSE(host(C32), want, kMathTol);
}

// ---- convolution ----------------------------------------------------------------------------------

namespace {
struct ConvCase {
  const char* name;
  tally::kernels::Conv2dShape s;
  bool bias;
};

tally::kernels::Conv2dShape conv_shape(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 S, i64 stride, i64 pad, i64 dil, i64 groups,
                           std::size_t limit = std::size_t(64) << 20) {
  tally::kernels::Conv2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.K = K, s.R = R, s.S = S;
  s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad;
  s.dil_h = s.dil_w = dil;
  s.groups = groups;
  s.workspace_limit = limit;
  return s;
}

std::vector<ConvCase> conv_cases() {
  constexpr std::size_t kLarge = std::size_t(1) << 30;  // room for FFT and Winograd workspaces
  return {
      {"3x3 same, odd sizes", conv_shape(3, 5, 7, 9, 4, 3, 3, 1, 1, 1, 1), true},
      {"1x1 stride 1", conv_shape(2, 8, 5, 5, 6, 1, 1, 1, 0, 1, 1), false},
      {"1x1 stride 2 (projection shortcut)", conv_shape(3, 16, 9, 9, 32, 1, 1, 2, 0, 1, 1), false},
      // An even input: the last row and column are not reached (the graph API refused this shape's
      // descriptor once, on an H100: its post-padding came out negative).
      {"1x1 stride 2, even input", conv_shape(2, 8, 10, 10, 16, 1, 1, 2, 0, 1, 1), false},
      {"3x3 stride 2", conv_shape(3, 4, 9, 7, 8, 3, 3, 2, 1, 1, 1), true},
      {"groups 2", conv_shape(2, 6, 8, 8, 4, 3, 3, 1, 1, 1, 2), true},
      {"depthwise", conv_shape(2, 5, 7, 9, 5, 3, 3, 1, 1, 1, 5), false},
      {"dilation 2, no padding", conv_shape(2, 3, 11, 10, 4, 3, 3, 1, 0, 2, 1), false},
      {"5x5 rectangular input", conv_shape(1, 3, 12, 17, 2, 5, 5, 1, 2, 1, 1), true},
      // ResNet shapes, large enough that cuDNN ranks FFT and Winograd algorithms.
      {"ResNet-20 stage 1 3x3", conv_shape(8, 16, 32, 32, 16, 3, 3, 1, 1, 1, 1, kLarge), false},
      {"ResNet-20 stage 3 3x3", conv_shape(8, 64, 8, 8, 64, 3, 3, 1, 1, 1, 1, kLarge), false},
      {"ResNet-20 stem 3x3", conv_shape(8, 3, 32, 32, 16, 3, 3, 1, 1, 1, 1, kLarge), false},
      // The stage 1 -> 2 transition, where ResNet-20's GPU gradients first parted from the CPU's.
      {"ResNet-20 stage 2 entry 3x3 stride 2", conv_shape(8, 16, 32, 32, 32, 3, 3, 2, 1, 1, 1, kLarge), false},
      {"ResNet-20 stage 2 shortcut 1x1 stride 2", conv_shape(8, 16, 32, 32, 32, 1, 1, 2, 0, 1, 1, kLarge), false},
      {"ResNet-50 3x3 at 28x28", conv_shape(4, 128, 28, 28, 128, 3, 3, 1, 1, 1, 1, kLarge), false},
      {"ResNet-50 1x1 at 56x56", conv_shape(4, 256, 56, 56, 64, 1, 1, 1, 0, 1, 1, kLarge), false},
      {"ResNet-50 stem 7x7 stride 2", conv_shape(2, 3, 224, 224, 64, 7, 7, 2, 3, 1, 1, kLarge), false},
  };
}

// Runs every pass of `s` on the GPU and the CPU from the same random inputs and compares (beta 0
// with NaN-poisoned outputs, beta 1 from random values); each pass gets exactly its own
// workspace, so memcheck sees a pass that uses more.
void check_conv(const tally::kernels::Conv2dShape& s, bool bias, double tol) {
  const auto seed = fresh_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed << "\n" << kg::conv2d_plan_description(s));
  std::mt19937 rng(seed);
  const i64 P_ = s.P(), Q_ = s.Q();
  const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * (s.C / s.groups) * s.R * s.S, ny = s.N * s.K * P_ * Q_;
  const auto x = uniform(nx, rng), w = uniform(nw, rng), b = uniform(s.K, rng), dy = uniform(ny, rng);
  Buf<float> dx_in = dev(x), dw_in = dev(w), db_in = dev(b), ddy = dev(dy);
  // The CUDA kernels against the CPU reference (im2col + GEMM; its workspace is the same for every
  // pass), not against the CPU's oneDNN fast path.
  const UseCpuReferenceConvolutions use_reference;
  std::vector<unsigned char> cpu_ws(kc::conv2d_workspace_bytes<float>(s, kernels::ConvPass::forward));
  using kernels::ConvPass;
  const auto ws_f = scratch(kg::conv2d_workspace_bytes<float>(s, ConvPass::forward));
  const auto ws_d = scratch(kg::conv2d_workspace_bytes<float>(s, ConvPass::backward_data));
  const auto ws_w = scratch(kg::conv2d_workspace_bytes<float>(s, ConvPass::backward_filter));
  for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter})
    EXPECT_LE(kg::conv2d_workspace_bytes<float>(s, pass), s.workspace_limit);

  std::vector<float> want(ny, NAN);
  kc::conv2d_forward<float>(s, x.data(), w.data(), bias ? b.data() : nullptr, want.data(), cpu_ws.data());
  Buf<float> y = dev(nans(ny));
  kg::conv2d_forward<float>(s, P(dx_in), P(dw_in), bias ? P(db_in) : nullptr, P(y), ws_ptr(ws_f));
  EXPECT_CLOSE(host(y), want, tol) << "forward";

  {
    SCOPED_TRACE("backward data");
    check_beta(nx, rng, tol,
               [&](float* o, float beta) { kc::conv2d_backward_data<float>(s, dy.data(), w.data(), o, beta, cpu_ws.data()); },
               [&](float* o, float beta) { kg::conv2d_backward_data<float>(s, P(ddy), P(dw_in), o, beta, ws_ptr(ws_d)); });
  }
  {
    SCOPED_TRACE("backward filter");
    check_beta(nw, rng, tol,
               [&](float* o, float beta) { kc::conv2d_backward_filter<float>(s, x.data(), dy.data(), o, beta, cpu_ws.data()); },
               [&](float* o, float beta) { kg::conv2d_backward_filter<float>(s, P(dx_in), P(ddy), o, beta, ws_ptr(ws_w)); });
  }
  if (bias) {
    SCOPED_TRACE("backward bias");
    check_beta(s.K, rng, tol, [&](float* o, float beta) { kc::conv2d_backward_bias<float>(s, dy.data(), o, beta); },
               [&](float* o, float beta) { kg::conv2d_backward_bias<float>(s, P(ddy), o, beta); });
  }

  // Deterministic mode (the default): the same backward twice, bit for bit — unless no
  // deterministic algorithm fitted the limit (the plan says so).
  if (kg::conv2d_plan_description(s).find("NOT deterministic") != std::string::npos) return;
  Buf<float> f1 = dev(nans(nw)), f2 = dev(nans(nw)), d1 = dev(nans(nx)), d2 = dev(nans(nx));
  kg::conv2d_backward_filter<float>(s, P(dx_in), P(ddy), P(f1), 0.f, ws_ptr(ws_w));
  kg::conv2d_backward_filter<float>(s, P(dx_in), P(ddy), P(f2), 0.f, ws_ptr(ws_w));
  EXPECT_EQ(host(f1), host(f2)) << "backward filter must be deterministic";
  kg::conv2d_backward_data<float>(s, P(ddy), P(dw_in), P(d1), 0.f, ws_ptr(ws_d));
  kg::conv2d_backward_data<float>(s, P(ddy), P(dw_in), P(d2), 0.f, ws_ptr(ws_d));
  EXPECT_EQ(host(d1), host(d2)) << "backward data must be deterministic";
}
}  // namespace

TEST(GpuKernels, ConvolutionMatchesTheCpu) {
  REQUIRE_GPU();
  const UseCudnnConvApi use_legacy(kernels::cuda::CudnnConvApi::legacy);  // the graph API: below
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    const std::size_t before = kg::conv2d_workspace_bytes<float>(c.s, kernels::ConvPass::forward);
    check_conv(c.s, c.bias, kMathTol);
    EXPECT_EQ(kg::conv2d_workspace_bytes<float>(c.s, kernels::ConvPass::forward), before)
        << "the cached choice must not change";
  }
}

// The graph (backend) API's convolutions on every test shape, each pass against the CPU as the
// legacy path's are (check_conv: beta 0 and 1, workspaces within the limit, deterministic), and
// the choice cached: the workspace the dry run reads is the one the step uses.
TEST(GpuKernels, ConvolutionThroughTheGraphApiMatchesTheCpu) {
  REQUIRE_GPU();
  const UseCudnnConvApi use_graph(kernels::cuda::CudnnConvApi::graph);
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    const std::string plan = kg::conv2d_plan_description(c.s);
    EXPECT_NE(plan.find("through the graph API"), std::string::npos) << plan;
    std::size_t before[3];
    for (int i = 0; i < 3; ++i) before[i] = kg::conv2d_workspace_bytes<float>(c.s, static_cast<kernels::ConvPass>(i));
    check_conv(c.s, c.bias, kMathTol);
    for (int i = 0; i < 3; ++i)
      EXPECT_EQ(kg::conv2d_workspace_bytes<float>(c.s, static_cast<kernels::ConvPass>(i)), before[i])
          << "the cached choice must not change";
    // And against the legacy API directly, every pass on the same inputs.
    std::mt19937 rng(fresh_seed());
    const auto& s = c.s;
    const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * (s.C / s.groups) * s.R * s.S, ny = s.N * s.K * s.P() * s.Q();
    Buf<float> x = dev(uniform(nx, rng)), w = dev(uniform(nw, rng)), dy = dev(uniform(ny, rng));
    auto run = [&](kg::CudnnConvApi api) {
      kg::set_cudnn_conv_api(api);
      using kernels::ConvPass;
      const auto ws_f = scratch(kg::conv2d_workspace_bytes<float>(s, ConvPass::forward));
      const auto ws_d = scratch(kg::conv2d_workspace_bytes<float>(s, ConvPass::backward_data));
      const auto ws_w = scratch(kg::conv2d_workspace_bytes<float>(s, ConvPass::backward_filter));
      Buf<float> y = dev(nans(ny)), dx = dev(nans(nx)), dw = dev(nans(nw));
      kg::conv2d_forward<float>(s, P(x), P(w), nullptr, P(y), ws_ptr(ws_f));
      kg::conv2d_backward_data<float>(s, P(dy), P(w), P(dx), 0.f, ws_ptr(ws_d));
      kg::conv2d_backward_filter<float>(s, P(x), P(dy), P(dw), 0.f, ws_ptr(ws_w));
      return std::array<std::vector<float>, 3>{host(y), host(dx), host(dw)};
    };
    const auto legacy = run(kg::CudnnConvApi::legacy), graph = run(kg::CudnnConvApi::graph);
    EXPECT_CLOSE(graph[0], legacy[0], kMathTol) << "forward: graph API against legacy";
    EXPECT_CLOSE(graph[1], legacy[1], kMathTol) << "backward data: graph API against legacy";
    EXPECT_CLOSE(graph[2], legacy[2], kMathTol) << "backward filter: graph API against legacy";
  }
}

// Channels-last activations (x, y, dx, dy stored NHWC; the weights as stored) on every test shape,
// through the API that takes them (the graph API: kernels::cuda::conv2d_takes_channels_last), each
// pass against the CPU's row-major reference on the same values (beta 0 NaN-poisoned, beta 1 from
// random values); the plan must say it is channels-last's and through the graph API.
TEST(GpuKernels, ConvolutionChannelsLastMatchesTheCpu) {
  REQUIRE_GPU();
  const UseCudnnConvApi use_auto(kernels::cuda::CudnnConvApi::automatic);
  const UseCpuReferenceConvolutions use_reference;
  using kernels::ConvPass;
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    tally::kernels::Conv2dShape g = c.s, r = c.s;  // the GPU's (channels-last) and the CPU's (row-major)
    g.channels_last = true;
    ASSERT_TRUE(kg::conv2d_takes_channels_last<float>(g));
    const std::string plan = kg::conv2d_plan_description(g);
    EXPECT_NE(plan.find("through the graph API"), std::string::npos) << plan;
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "seed " << seed << "\n" << plan);
    std::mt19937 rng(seed);
    const i64 HW = r.H * r.W, PQ = r.P() * r.Q();
    const i64 nx = r.N * r.C * HW, nw = r.K * (r.C / r.groups) * r.R * r.S, ny = r.N * r.K * PQ;
    const auto x = uniform(nx, rng), w = uniform(nw, rng), dy = uniform(ny, rng);
    Buf<float> gx = dev(to_nhwc(x, r.N, r.C, HW)), gw = dev(w), gdy = dev(to_nhwc(dy, r.N, r.K, PQ));
    std::vector<unsigned char> cpu_ws(kc::conv2d_workspace_bytes<float>(r, ConvPass::forward));
    const auto ws_f = scratch(kg::conv2d_workspace_bytes<float>(g, ConvPass::forward));
    const auto ws_d = scratch(kg::conv2d_workspace_bytes<float>(g, ConvPass::backward_data));
    const auto ws_w = scratch(kg::conv2d_workspace_bytes<float>(g, ConvPass::backward_filter));

    std::vector<float> want(ny, NAN);
    kc::conv2d_forward<float>(r, x.data(), w.data(), nullptr, want.data(), cpu_ws.data());
    Buf<float> y = dev(nans(ny));
    kg::conv2d_forward<float>(g, P(gx), P(gw), nullptr, P(y), ws_ptr(ws_f));
    EXPECT_CLOSE(from_nhwc(host(y), r.N, r.K, PQ), want, kMathTol) << "forward";
    for (float beta : {0.f, 1.f}) {
      SCOPED_TRACE(testing::Message() << "beta " << beta);
      const std::vector<float> init = beta == 0.f ? nans(nx) : uniform(nx, rng);
      std::vector<float> dx = init;
      kc::conv2d_backward_data<float>(r, dy.data(), w.data(), dx.data(), beta, cpu_ws.data());
      Buf<float> gdx = dev(to_nhwc(init, r.N, r.C, HW));
      kg::conv2d_backward_data<float>(g, P(gdy), P(gw), P(gdx), beta, ws_ptr(ws_d));
      EXPECT_CLOSE(from_nhwc(host(gdx), r.N, r.C, HW), dx, kMathTol) << "backward data";
    }
    check_beta(nw, rng, kMathTol,
               [&](float* o, float beta) { kc::conv2d_backward_filter<float>(r, x.data(), dy.data(), o, beta, cpu_ws.data()); },
               [&](float* o, float beta) { kg::conv2d_backward_filter<float>(g, P(gx), P(gdy), o, beta, ws_ptr(ws_w)); });
  }
}

// A limit between two candidates' workspaces: the choice under the larger limit no longer fits,
// so the best one that does must be picked (and compute the same convolution); at a limit of 0
// only workspace-free algorithms remain, or a clear error.
TEST(GpuKernels, ConvolutionWorkspaceFollowsTheLimit) {
  REQUIRE_GPU();
  using kernels::ConvPass;
  int narrowed = 0;
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter}) {
      tally::kernels::Conv2dShape s = c.s;
      s.workspace_limit = std::size_t(1) << 30;
      const std::size_t wide = kg::conv2d_workspace_bytes<float>(s, pass);
      if (wide == 0) continue;
      s.workspace_limit = wide - 1;  // the wide choice is now over the limit by one byte
      try {
        EXPECT_LT(kg::conv2d_workspace_bytes<float>(s, pass), wide);
        ++narrowed;
        check_conv(s, c.bias, kMathTol);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("workspace limit of"), std::string::npos) << e.what();
      }
    }
    tally::kernels::Conv2dShape s = c.s;
    s.workspace_limit = 0;
    try {
      for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter})
        EXPECT_EQ(kg::conv2d_workspace_bytes<float>(s, pass), 0u);
      check_conv(s, c.bias, kMathTol);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("workspace limit of 0 bytes"), std::string::npos) << e.what();
    }
  }
  EXPECT_GT(narrowed, 0) << "no case had a choice that needed a workspace: the limit was never exercised";
}

// With determinism on, the automatic API never plans a row-major float32 pass nondeterministically
// where the graph API has a deterministic engine within the same limit: a shape whose legacy plan
// found none goes through the graph API (kernels/cuda/conv.cu, use_graph_api). ResNet-50's 1x1
// stride-2 projection at 64x256x56x56, TF32 off and on, limits from 0 to 1 GiB (on an H200 the
// legacy API had no deterministic backward passes for it at batch 256 in 1 GiB with TF32). The
// count of cases where the legacy API fell back is printed: 0 means the rule was not exercised.
TEST(GpuKernels, AutomaticApiTakesTheGraphApiWhereTheLegacyOneIsNotDeterministic) {
  REQUIRE_GPU();
  const ScopedSwitch determinism(kg::set_deterministic, kg::deterministic, true);
  int legacy_fell_back = 0, switched = 0;
  for (bool on : {false, true}) {
    const auto t = tf32(on);
    for (std::size_t limit : {std::size_t(0), std::size_t(1) << 20, std::size_t(8) << 20, std::size_t(64) << 20,
                              std::size_t(1) << 30}) {
      SCOPED_TRACE(std::string("TF32 ") + (on ? "on" : "off") + ", limit " + std::to_string(limit));
      const tally::kernels::Conv2dShape s = conv_shape(64, 256, 56, 56, 512, 1, 1, 2, 0, 1, 1, limit);
      auto plan = [&](kg::CudnnConvApi api) -> std::string {
        const UseCudnnConvApi use(api);
        try {
          return kg::conv2d_plan_description(s);
        } catch (const Error& e) {  // nothing at all within the limit: the same clear error either way
          EXPECT_NE(std::string(e.what()).find("workspace limit of"), std::string::npos) << e.what();
          return "none";
        }
      };
      const std::string legacy = plan(kg::CudnnConvApi::legacy), graph = plan(kg::CudnnConvApi::graph),
                        automatic = plan(kg::CudnnConvApi::automatic);
      const bool legacy_nondet = legacy.find("NOT deterministic") != std::string::npos;
      legacy_fell_back += legacy_nondet;
      if (automatic.find("NOT deterministic") != std::string::npos) {
        EXPECT_TRUE(graph == "none" || graph.find("NOT deterministic") != std::string::npos)
            << "automatic: " << automatic << "\ngraph: " << graph;
      }
      if (legacy_nondet && automatic.find("through the graph API") != std::string::npos) {
        ++switched;
        const UseCudnnConvApi use(kg::CudnnConvApi::automatic);
        check_conv(s, false, on ? 1e-2 : kMathTol);  // and its values, deterministic, through the graph API
      }
    }
  }
  std::printf("legacy API not deterministic in %d of 10 cases; the automatic API took the graph API in %d\n",
              legacy_fell_back, switched);
}

// Every algorithm cuDNN offers at ResNet shapes, run directly with FMA math, against the CPU: the
// table (printed) says which algorithms are accurate to float32 rounding; the plan's own choice
// must be (checked in ConvolutionMatchesTheCpu).
TEST(GpuKernels, ConvolutionEveryCudnnAlgorithmAtResNetShapes) {
  REQUIRE_GPU();
  cudnnHandle_t h = kg::detail::cudnn();
  for (const ConvCase& c : conv_cases()) {
    const tally::kernels::Conv2dShape& s = c.s;
    if (s.N * s.C * s.H * s.W < 20000) continue;
    std::mt19937 rng(fresh_seed());
    const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S, ny = s.N * s.K * s.P() * s.Q();
    const auto x = uniform(nx, rng), w = uniform(nw, rng), dy = uniform(ny, rng);
    std::vector<unsigned char> cpu_ws(kc::conv2d_workspace_bytes<float>(s, kernels::ConvPass::forward));
    std::vector<float> ref_y(ny), ref_dx(nx), ref_dw(nw);
    kc::conv2d_forward<float>(s, x.data(), w.data(), nullptr, ref_y.data(), cpu_ws.data());
    kc::conv2d_backward_data<float>(s, dy.data(), w.data(), ref_dx.data(), 0.f, cpu_ws.data());
    kc::conv2d_backward_filter<float>(s, x.data(), dy.data(), ref_dw.data(), 0.f, cpu_ws.data());
    Buf<float> dx_in = dev(x), dw_in = dev(w), ddy = dev(dy);
    cudnnTensorDescriptor_t xd, yd;
    cudnnFilterDescriptor_t wd;
    cudnnConvolutionDescriptor_t cd;
    TALLY_CUDNN_CHECK(cudnnCreateTensorDescriptor(&xd));
    TALLY_CUDNN_CHECK(cudnnCreateTensorDescriptor(&yd));
    TALLY_CUDNN_CHECK(cudnnCreateFilterDescriptor(&wd));
    TALLY_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&cd));
    TALLY_CUDNN_CHECK(cudnnSetTensor4dDescriptor(xd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, s.N, s.C, s.H, s.W));
    TALLY_CUDNN_CHECK(cudnnSetTensor4dDescriptor(yd, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, s.N, s.K, s.P(), s.Q()));
    TALLY_CUDNN_CHECK(cudnnSetFilter4dDescriptor(wd, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW, s.K, s.C, s.R, s.S));
    TALLY_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(cd, s.pad_h, s.pad_w, s.stride_h, s.stride_w, s.dil_h, s.dil_w,
                                                      CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    TALLY_CUDNN_CHECK(cudnnSetConvolutionMathType(cd, CUDNN_FMA_MATH));
    std::string table = std::string(c.name) + ": pass algo workspace error\n";
    const float one = 1.f, zero = 0.f;
    auto row = [&](const char* pass, int algo, cudnnStatus_t st, std::size_t bytes, auto run, const Buf<float>& out,
                   const std::vector<float>& ref) {
      if (st != CUDNN_STATUS_SUCCESS) {
        table += fmt::format("  {:15} {} {:>10} {}\n", pass, algo, "-", cudnnGetErrorString(st));
        return;
      }
      const auto ws = scratch(bytes);
      const cudnnStatus_t rs = run(ws_ptr(ws), bytes);
      if (rs != CUDNN_STATUS_SUCCESS) {
        table += fmt::format("  {:15} {} {:>10} run: {}\n", pass, algo, bytes, cudnnGetErrorString(rs));
        return;
      }
      const double err = max_rel_err(host(out), ref);
      table += fmt::format("  {:15} {} {:>10} {:.2e}\n", pass, algo, bytes, err);
      EXPECT_LE(err, 1e-2) << pass << " algorithm " << algo << " of " << c.name << " is far off";
    };
    for (int a = 0; a < CUDNN_CONVOLUTION_FWD_ALGO_COUNT; ++a) {
      const auto algo = static_cast<cudnnConvolutionFwdAlgo_t>(a);
      std::size_t bytes = 0;
      const auto st = cudnnGetConvolutionForwardWorkspaceSize(h, xd, wd, cd, yd, algo, &bytes);
      Buf<float> out = dev(nans(ny));
      row("forward", a, st, bytes, [&](void* ws, std::size_t b) {
        return cudnnConvolutionForward(h, &one, xd, P(dx_in), wd, P(dw_in), cd, algo, ws, b, &zero, yd, P(out));
      }, out, ref_y);
    }
    for (int a = 0; a < CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT; ++a) {
      const auto algo = static_cast<cudnnConvolutionBwdDataAlgo_t>(a);
      std::size_t bytes = 0;
      const auto st = cudnnGetConvolutionBackwardDataWorkspaceSize(h, wd, yd, cd, xd, algo, &bytes);
      Buf<float> out = dev(nans(nx));
      row("backward data", a, st, bytes, [&](void* ws, std::size_t b) {
        return cudnnConvolutionBackwardData(h, &one, wd, P(dw_in), yd, P(ddy), cd, algo, ws, b, &zero, xd, P(out));
      }, out, ref_dx);
    }
    for (int a = 0; a < CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT; ++a) {
      const auto algo = static_cast<cudnnConvolutionBwdFilterAlgo_t>(a);
      std::size_t bytes = 0;
      const auto st = cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd, yd, cd, wd, algo, &bytes);
      Buf<float> out = dev(nans(nw));
      row("backward filter", a, st, bytes, [&](void* ws, std::size_t b) {
        return cudnnConvolutionBackwardFilter(h, &one, xd, P(dx_in), yd, P(ddy), cd, algo, ws, b, &zero, wd, P(out));
      }, out, ref_dw);
    }
    TALLY_CUDNN_CHECK(cudnnDestroyConvolutionDescriptor(cd));
    TALLY_CUDNN_CHECK(cudnnDestroyFilterDescriptor(wd));
    TALLY_CUDNN_CHECK(cudnnDestroyTensorDescriptor(yd));
    TALLY_CUDNN_CHECK(cudnnDestroyTensorDescriptor(xd));
    std::printf("%s%s\n", table.c_str(), kg::conv2d_plan_description(s).c_str());
  }
}

// ---- normalization --------------------------------------------------------------------------------

// Both sides compute every sum and every element in double and round once: they agree to float
// rounding even where the backward cancels (few values per channel, an offset mean).
constexpr double kNormTol = 1e-5;

TEST(GpuKernels, BatchNormMatchesTheCpu) {
  REQUIRE_GPU();
  // The last two are large enough that a channel's sum is split over several blocks.
  for (auto [N, C, HW] : std::vector<std::array<i64, 3>>{{3, 5, 63}, {2, 16, 1}, {8, 3, 1024}, {1, 7, 2}, {16, 64, 784}, {32, 16, 1024}}) {
    for (bool affine : {true, false}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " HW " << HW << " affine " << affine << " seed "
                                      << seed);
      std::mt19937 rng(seed);
      const i64 n = N * C * HW;
      const auto bnws = scratch(kg::batch_norm_workspace_bytes(N, C, HW));
      const auto x = uniform(n, rng, 2.f, 6.f);  // an offset mean: the two-pass variance matters
      const auto gamma = uniform(C, rng, 0.5f, 1.5f), beta_ = uniform(C, rng), dy = uniform(n, rng);
      auto rm = uniform(C, rng), rv = uniform(C, rng, 0.5f, 2.f);
      Buf<float> dx_in = dev(x), dgm = dev(gamma), dbt = dev(beta_), ddy = dev(dy), drm = dev(rm), drv = dev(rv);
      const float* g_c = affine ? gamma.data() : nullptr;
      const float* b_c = affine ? beta_.data() : nullptr;
      const float* g_g = affine ? P(dgm) : nullptr;
      const float* b_g = affine ? P(dbt) : nullptr;

      std::vector<float> y(n, NAN), sm(C, NAN), si(C, NAN);
      kc::batch_norm_forward_train<float>(N, C, HW, x.data(), g_c, b_c, 1e-5f, 0.1f, rm.data(), rv.data(), y.data(),
                                          sm.data(), si.data());
      Buf<float> gy = dev(nans(n)), gsm = dev(nans(C)), gsi = dev(nans(C));
      kg::batch_norm_forward_train<float>(N, C, HW, P(dx_in), g_g, b_g, 1e-5f, 0.1f, P(drm), P(drv), P(gy), P(gsm),
                                          P(gsi), ws_ptr(bnws));
      EXPECT_CLOSE(host(gy), y, kNormTol) << "y";
      EXPECT_CLOSE(host(gsm), sm, kNormTol) << "save_mean";
      EXPECT_CLOSE(host(gsi), si, kNormTol) << "save_invstd";
      EXPECT_CLOSE(host(drm), rm, kNormTol) << "running_mean";
      EXPECT_CLOSE(host(drv), rv, kNormTol) << "running_var";

      // training backward, from the CPU's saved statistics on both sides
      Buf<float> csm = dev(sm), csi = dev(si);
      check_beta(n, rng, kNormTol,
                 [&](float* o, float beta) {
                   kc::batch_norm_backward<float>(N, C, HW, dy.data(), x.data(), g_c, sm.data(), si.data(), o, beta,
                                                  nullptr, nullptr, 0.f);
                 },
                 [&](float* o, float beta) {
                   kg::batch_norm_backward<float>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), o, beta, nullptr,
                                                  nullptr, 0.f, ws_ptr(bnws));
                 });
      for (float bp : {0.f, 1.f}) {
        std::vector<float> dg = bp == 0.f ? nans(C) : uniform(C, rng), db = bp == 0.f ? nans(C) : uniform(C, rng);
        Buf<float> gdg = dev(dg), gdb = dev(db);
        kc::batch_norm_backward<float>(N, C, HW, dy.data(), x.data(), g_c, sm.data(), si.data(), nullptr, 0.f,
                                       dg.data(), db.data(), bp);
        kg::batch_norm_backward<float>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), nullptr, 0.f, P(gdg), P(gdb),
                                       bp, ws_ptr(bnws));
        EXPECT_CLOSE(host(gdg), dg, kNormTol) << "dgamma beta " << bp;
        EXPECT_CLOSE(host(gdb), db, kNormTol) << "dbeta beta " << bp;
      }
      Buf<float> r1 = dev(nans(n)), r2 = dev(nans(n));
      kg::batch_norm_backward<float>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), P(r1), 0.f, nullptr, nullptr, 0.f, ws_ptr(bnws));
      kg::batch_norm_backward<float>(N, C, HW, P(ddy), P(dx_in), g_g, P(csm), P(csi), P(r2), 0.f, nullptr, nullptr, 0.f, ws_ptr(bnws));
      EXPECT_EQ(host(r1), host(r2)) << "batch norm backward must be deterministic";

      // eval forward and backward
      std::vector<float> ye(n, NAN);
      kc::batch_norm_forward_eval<float>(N, C, HW, x.data(), g_c, b_c, rm.data(), rv.data(), 1e-5f, ye.data());
      Buf<float> gye = dev(nans(n)), erm = dev(rm), erv = dev(rv);
      kg::batch_norm_forward_eval<float>(N, C, HW, P(dx_in), g_g, b_g, P(erm), P(erv), 1e-5f, P(gye));
      EXPECT_CLOSE(host(gye), ye, kNormTol) << "eval y";
      check_beta(n, rng, kNormTol,
                 [&](float* o, float beta) {
                   std::vector<float> dg(C), db(C);
                   kc::batch_norm_backward_eval<float>(N, C, HW, dy.data(), x.data(), g_c, rm.data(), rv.data(), 1e-5f,
                                                       o, beta, dg.data(), db.data(), 0.f);
                 },
                 [&](float* o, float beta) {
                   Buf<float> dg = dev(nans(C)), db = dev(nans(C));
                   kg::batch_norm_backward_eval<float>(N, C, HW, P(ddy), P(dx_in), g_g, P(erm), P(erv), 1e-5f, o,
                                                       beta, P(dg), P(db), 0.f, ws_ptr(bnws));
                   std::vector<float> dgc(C), dbc(C);
                   kc::batch_norm_backward_eval<float>(N, C, HW, dy.data(), x.data(), g_c, rm.data(), rv.data(),
                                                       1e-5f, nullptr, 0.f, dgc.data(), dbc.data(), 0.f);
                   EXPECT_CLOSE(host(dg), dgc, kNormTol) << "eval dgamma";
                   EXPECT_CLOSE(host(db), dbc, kNormTol) << "eval dbeta";
                 });
    }
  }
}

// Batch norm on channels-last x (N, HW, C), plain and fused with the residual add and ReLU, against
// the CPU's row-major kernels on the same values: the statistics, y, and the backward (dx at beta 0
// and 1, dgamma, dbeta, the residual's gradient); run twice, bit for bit. The shapes: fewer channels
// than a tile (32), more but not a multiple, one value per channel and image, and ResNet sizes
// where a channel's rows span several blocks.
TEST(GpuKernels, BatchNormChannelsLastMatchesTheCpu) {
  REQUIRE_GPU();
  for (auto [N, C, HW] : std::vector<std::array<i64, 3>>{{3, 5, 63}, {2, 16, 1}, {4, 40, 49}, {8, 3, 1024}, {16, 64, 784}, {32, 16, 1024}}) {
    for (bool fused : {false, true}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " HW " << HW << " fused " << fused << " seed " << seed);
      std::mt19937 rng(seed);
      const i64 n = N * C * HW;
      const auto nhwc = [&](const std::vector<float>& v) { return to_nhwc(v, N, C, HW); };
      const auto back = [&](const Buf<float>& b) { return from_nhwc(host(b), N, C, HW); };
      const auto bnws = scratch(kg::batch_norm_workspace_bytes(N, C, HW, true));
      const auto x = uniform(n, rng, 2.f, 6.f), res = uniform(n, rng, -6.f, 2.f), dy = uniform(n, rng);
      const auto gamma = uniform(C, rng, 0.5f, 1.5f), beta_ = uniform(C, rng);
      auto rm = uniform(C, rng), rv = uniform(C, rng, 0.5f, 2.f);
      Buf<float> gx = dev(nhwc(x)), gres = dev(nhwc(res)), gdy = dev(nhwc(dy)), ggm = dev(gamma), gbt = dev(beta_),
                 grm = dev(rm), grv = dev(rv);
      kernels::NormAct<float> cact, gact;
      if (fused) cact.relu = gact.relu = true, cact.residual = res.data(), gact.residual = P(gres);
      gact.channels_last = true;

      std::vector<float> y(n, NAN), sm(C, NAN), si(C, NAN);
      kc::batch_norm_forward_train<float>(N, C, HW, x.data(), gamma.data(), beta_.data(), 1e-5f, 0.1f, rm.data(),
                                          rv.data(), y.data(), sm.data(), si.data(), nullptr, cact);
      Buf<float> gy = dev(nans(n)), gsm = dev(nans(C)), gsi = dev(nans(C));
      kg::batch_norm_forward_train<float>(N, C, HW, P(gx), P(ggm), P(gbt), 1e-5f, 0.1f, P(grm), P(grv), P(gy), P(gsm),
                                          P(gsi), ws_ptr(bnws), gact);
      EXPECT_CLOSE(back(gy), y, kNormTol) << "y";
      EXPECT_CLOSE(host(gsm), sm, kNormTol) << "save_mean";
      EXPECT_CLOSE(host(gsi), si, kNormTol) << "save_invstd";
      EXPECT_CLOSE(host(grm), rm, kNormTol) << "running_mean";
      EXPECT_CLOSE(host(grv), rv, kNormTol) << "running_var";

      // The backward from the CPU's statistics and (fused) the CPU's y on both sides.
      Buf<float> csm = dev(sm), csi = dev(si), cy = dev(nhwc(y));
      for (float beta : {0.f, 1.f}) {
        SCOPED_TRACE(testing::Message() << "beta " << beta);
        const std::vector<float> init = beta == 0.f ? nans(n) : uniform(n, rng);
        const std::vector<float> pinit = beta == 0.f ? nans(C) : uniform(C, rng);
        std::vector<float> dx = init, dres = init, dg = pinit, db = pinit;
        kernels::NormActGrad<float> cg, gg;
        Buf<float> gdx = dev(nhwc(init)), gdres = dev(nhwc(init)), gdg = dev(pinit), gdb = dev(pinit);
        if (fused) {
          cg.relu = gg.relu = true, cg.y = y.data(), gg.y = P(cy);
          cg.dresidual = dres.data(), gg.dresidual = P(gdres), cg.beta_residual = gg.beta_residual = beta;
        }
        gg.channels_last = true;
        kc::batch_norm_backward<float>(N, C, HW, dy.data(), x.data(), gamma.data(), sm.data(), si.data(), dx.data(), beta,
                                       dg.data(), db.data(), beta, nullptr, cg);
        kg::batch_norm_backward<float>(N, C, HW, P(gdy), P(gx), P(ggm), P(csm), P(csi), P(gdx), beta, P(gdg), P(gdb),
                                       beta, ws_ptr(bnws), gg);
        EXPECT_CLOSE(back(gdx), dx, kNormTol) << "dx";
        EXPECT_CLOSE(host(gdg), dg, kNormTol) << "dgamma";
        EXPECT_CLOSE(host(gdb), db, kNormTol) << "dbeta";
        if (fused) {
          EXPECT_CLOSE(back(gdres), dres, kNormTol) << "the residual's gradient";
        }
      }
      Buf<float> r1 = dev(nans(n)), r2 = dev(nans(n));
      kernels::NormActGrad<float> plain;
      plain.channels_last = true;
      for (Buf<float>* r : {&r1, &r2})
        kg::batch_norm_backward<float>(N, C, HW, P(gdy), P(gx), P(ggm), P(csm), P(csi), P(*r), 0.f, nullptr, nullptr, 0.f,
                                       ws_ptr(bnws), plain);
      EXPECT_EQ(host(r1), host(r2)) << "batch norm backward must be deterministic";
    }
  }
}

// The vectorized channels-last passes (4 channels a thread, norm.cu) against the scalar ones they
// replace where C is a multiple of 4: the forward's y and the backward's dx (beta 0 and 1, plain
// and fused with the residual add and ReLU), bit for bit, in float32 and bf16; and an array at an
// odd offset (not aligned to a vector) takes the scalar pass and gives the same bits too.
template <class T>
void vectorized_batch_norm_gives_the_scalar_bits() {
  const auto to = [](const std::vector<float>& v) {
    std::vector<T> o(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) o[i] = static_cast<T>(v[i]);
    return o;
  };
  const auto bits = [](const std::vector<T>& v) {
    std::vector<std::uint32_t> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      std::uint32_t u = 0;
      std::memcpy(&u, &v[i], sizeof(T));
      b[i] = u;
    }
    return b;
  };
  struct Vectorized {  // the switch for the scope
    explicit Vectorized(bool v) { kg::set_batch_norm_vectorized(v); }
    ~Vectorized() { kg::set_batch_norm_vectorized(true); }
  };
  for (auto [N, C, HW] : std::vector<std::array<i64, 3>>{{4, 40, 49}, {16, 64, 784}, {2, 2048, 49}, {3, 12, 5}}) {
    for (bool fused : {false, true}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " HW " << HW << " fused " << fused << " seed "
                                      << seed);
      std::mt19937 rng(seed);
      const i64 n = N * C * HW;
      const auto bnws = scratch(kg::batch_norm_workspace_bytes(N, C, HW, true));
      // One element more than the tensor: +1 gives each array an offset no vector is aligned to.
      Buf<T> gx = dev(to(uniform(n + 1, rng, 2.f, 6.f))), gres = dev(to(uniform(n + 1, rng, -6.f, 2.f))),
             gdy = dev(to(uniform(n + 1, rng)));
      Buf<float> ggm = dev(uniform(C, rng, 0.5f, 1.5f)), gbt = dev(uniform(C, rng)), grm = dev(uniform(C, rng)),
                 grv = dev(uniform(C, rng, 0.5f, 2.f)), gsm = dev(nans(C)), gsi = dev(nans(C));
      const std::vector<T> init = to(uniform(n + 1, rng));
      std::vector<std::vector<std::uint32_t>> runs[2];  // [vectorized]: y, then dx for each beta, each offset
      for (int offset : {0, 1}) {
        for (bool vec : {true, false}) {
          const Vectorized scope(vec);
          kernels::NormAct<T> act;
          act.channels_last = true;
          if (fused) act.relu = true, act.residual = P(gres) + offset;
          Buf<T> gy = dev(to(nans(n + 1)));
          kg::batch_norm_forward_train<T>(N, C, HW, P(gx) + offset, P(ggm), P(gbt), 1e-5f, 0.1f, P(grm), P(grv),
                                          P(gy) + offset, P(gsm), P(gsi), ws_ptr(bnws), act);
          runs[vec].push_back(bits(host(gy)));
          for (float beta : {0.f, 1.f}) {
            kernels::NormActGrad<T> g;
            g.channels_last = true;
            if (fused) g.relu = true, g.y = P(gy) + offset;
            Buf<T> gdx = dev(init);
            kg::batch_norm_backward<T>(N, C, HW, P(gdy) + offset, P(gx) + offset, P(ggm), P(gsm), P(gsi),
                                       P(gdx) + offset, beta, nullptr, nullptr, 0.f, ws_ptr(bnws), g);
            runs[vec].push_back(bits(host(gdx)));
          }
        }
      }
      ASSERT_EQ(runs[0].size(), runs[1].size());
      for (std::size_t i = 0; i < runs[0].size(); ++i)
        EXPECT_EQ(runs[1][i], runs[0][i]) << "run " << i << " (y, dx beta 0, dx beta 1; aligned, then offset by one)";
    }
  }
}

TEST(GpuKernels, BatchNormVectorizedPassesGiveTheScalarBits) {
  REQUIRE_GPU();
  vectorized_batch_norm_gives_the_scalar_bits<float>();
  vectorized_batch_norm_gives_the_scalar_bits<kernels::bf16>();
}

TEST(GpuKernels, GroupNormMatchesTheCpu) {
  REQUIRE_GPU();
  for (auto [N, C, HW, G] : std::vector<std::array<i64, 4>>{{3, 6, 63, 3}, {2, 5, 35, 5}, {2, 5, 35, 1}, {4, 32, 64, 8}}) {
    for (bool affine : {true, false}) {
      const auto seed = fresh_seed();
      SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " HW " << HW << " G " << G << " affine " << affine
                                      << " seed " << seed);
      std::mt19937 rng(seed);
      const i64 n = N * C * HW;
      const auto x = uniform(n, rng, -3.f, 5.f), gamma = uniform(C, rng, 0.5f, 1.5f), beta_ = uniform(C, rng);
      const auto dy = uniform(n, rng);
      Buf<float> dx_in = dev(x), dgm = dev(gamma), dbt = dev(beta_), ddy = dev(dy);
      const float* g_c = affine ? gamma.data() : nullptr;
      const float* b_c = affine ? beta_.data() : nullptr;
      const float* g_g = affine ? P(dgm) : nullptr;
      const float* b_g = affine ? P(dbt) : nullptr;
      std::vector<float> y(n, NAN), sm(N * G, NAN), si(N * G, NAN);
      kc::group_norm_forward<float>(N, C, HW, G, x.data(), g_c, b_c, 1e-5f, y.data(), sm.data(), si.data());
      Buf<float> gy = dev(nans(n)), gsm = dev(nans(N * G)), gsi = dev(nans(N * G));
      kg::group_norm_forward<float>(N, C, HW, G, P(dx_in), g_g, b_g, 1e-5f, P(gy), P(gsm), P(gsi));
      EXPECT_CLOSE(host(gy), y, kNormTol) << "y";
      EXPECT_CLOSE(host(gsm), sm, kNormTol) << "save_mean";
      EXPECT_CLOSE(host(gsi), si, kNormTol) << "save_invstd";

      Buf<float> csm = dev(sm), csi = dev(si);
      check_beta(n, rng, kNormTol,
                 [&](float* o, float beta) {
                   kc::group_norm_backward<float>(N, C, HW, G, dy.data(), x.data(), g_c, sm.data(), si.data(), o, beta,
                                                  nullptr, nullptr, 0.f);
                 },
                 [&](float* o, float beta) {
                   kg::group_norm_backward<float>(N, C, HW, G, P(ddy), P(dx_in), g_g, P(csm), P(csi), o, beta,
                                                  nullptr, nullptr, 0.f);
                 });
      for (float bp : {0.f, 1.f}) {
        std::vector<float> dg = bp == 0.f ? nans(C) : uniform(C, rng), db = bp == 0.f ? nans(C) : uniform(C, rng);
        Buf<float> gdg = dev(dg), gdb = dev(db);
        kc::group_norm_backward<float>(N, C, HW, G, dy.data(), x.data(), g_c, sm.data(), si.data(), nullptr, 0.f,
                                       dg.data(), db.data(), bp);
        kg::group_norm_backward<float>(N, C, HW, G, P(ddy), P(dx_in), g_g, P(csm), P(csi), nullptr, 0.f, P(gdg),
                                       P(gdb), bp);
        EXPECT_CLOSE(host(gdg), dg, kNormTol) << "dgamma beta " << bp;
        EXPECT_CLOSE(host(gdb), db, kNormTol) << "dbeta beta " << bp;
      }
    }
  }
}

// ---- pooling --------------------------------------------------------------------------------------

TEST(GpuKernels, PoolingMatchesTheCpu) {
  REQUIRE_GPU();
  const std::vector<tally::kernels::Pool2dShape> shapes = {
      {3, 5, 7, 9, 3, 3, 2, 2, 1, 1},  // ResNet stem: overlapping windows, padding
      {2, 4, 8, 8, 2, 2, 2, 2, 0, 0},  // non-overlapping
      {2, 3, 7, 9, 3, 3, 1, 1, 1, 1},  // stride 1: every input in 9 windows
      {1, 2, 9, 7, 3, 2, 2, 3, 1, 0},  // rectangular kernel and strides
  };
  for (const tally::kernels::Pool2dShape& s : shapes) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "kernel " << s.kh << "x" << s.kw << " stride " << s.stride_h << "x"
                                    << s.stride_w << " pad " << s.pad_h << "x" << s.pad_w << " seed " << seed);
    std::mt19937 rng(seed);
    const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P() * s.Q();
    const auto x = uniform(nx, rng), dy = uniform(ny, rng);
    Buf<float> dxi = dev(x), ddy = dev(dy);

    std::vector<float> y(ny, NAN);
    std::vector<std::int32_t> am(ny, -7);
    kc::max_pool2d_forward<float>(s, x.data(), y.data(), am.data());
    Buf<float> gy = dev(nans(ny));
    Buf<std::int32_t> gam(std::vector<std::int32_t>(ny, -7));
    kg::max_pool2d_forward<float>(s, P(dxi), P(gy), P(gam));
    EXPECT_CLOSE(host(gy), y, kElementwiseTol) << "max pool y";
    EXPECT_EQ(host(gam), am) << "max pool argmax";
    check_beta(nx, rng, kElementwiseTol,
               [&](float* o, float beta) { kc::max_pool2d_backward<float>(s, dy.data(), am.data(), o, beta); },
               [&](float* o, float beta) { kg::max_pool2d_backward<float>(s, P(ddy), P(gam), o, beta); });
    {  // channels-last max pooling: the same values stored (N, H, W, C), the same argmax (h * W + w)
      SCOPED_TRACE("channels-last max pool");
      tally::kernels::Pool2dShape c = s;
      c.channels_last = true;
      const i64 HW = s.H * s.W, PQ = s.P() * s.Q();
      Buf<float> cx = dev(to_nhwc(x, s.N, s.C, HW)), cdy = dev(to_nhwc(dy, s.N, s.C, PQ)), cy = dev(nans(ny));
      Buf<std::int32_t> cam(std::vector<std::int32_t>(ny, -7));
      kg::max_pool2d_forward<float>(c, P(cx), P(cy), P(cam));
      EXPECT_CLOSE(from_nhwc(host(cy), s.N, s.C, PQ), y, kElementwiseTol) << "max pool y";
      EXPECT_EQ(from_nhwc(host(cam), s.N, s.C, PQ), am) << "max pool argmax";
      for (float beta : {0.f, 1.f}) {
        const std::vector<float> init = beta == 0.f ? nans(nx) : uniform(nx, rng);
        std::vector<float> want = init;
        kc::max_pool2d_backward<float>(s, dy.data(), am.data(), want.data(), beta);
        Buf<float> cdx = dev(to_nhwc(init, s.N, s.C, HW));
        kg::max_pool2d_backward<float>(c, P(cdy), P(cam), P(cdx), beta);
        EXPECT_CLOSE(from_nhwc(host(cdx), s.N, s.C, HW), want, kElementwiseTol) << "max pool dx, beta " << beta;
      }
    }

    for (bool cip : {true, false}) {
      SCOPED_TRACE(testing::Message() << "count_include_pad " << cip);
      std::vector<float> ya(ny, NAN);
      kc::avg_pool2d_forward<float>(s, cip, x.data(), ya.data());
      Buf<float> gya = dev(nans(ny));
      kg::avg_pool2d_forward<float>(s, cip, P(dxi), P(gya));
      EXPECT_CLOSE(host(gya), ya, kElementwiseTol) << "avg pool y";
      check_beta(nx, rng, kElementwiseTol,
                 [&](float* o, float beta) { kc::avg_pool2d_backward<float>(s, cip, dy.data(), o, beta); },
                 [&](float* o, float beta) { kg::avg_pool2d_backward<float>(s, cip, P(ddy), o, beta); });
    }
  }
  for (auto [H, W, OH, OW] : std::vector<std::array<i64, 4>>{{7, 9, 1, 1}, {7, 9, 3, 4}, {7, 9, 5, 5}, {8, 8, 2, 2},
                                                              {5, 3, 7, 6}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "adaptive " << H << "x" << W << " -> " << OH << "x" << OW << " seed " << seed);
    std::mt19937 rng(seed);
    const i64 N = 2, C = 3, nx = N * C * H * W, ny = N * C * OH * OW;
    const auto x = uniform(nx, rng), dy = uniform(ny, rng);
    Buf<float> dxi = dev(x), ddy = dev(dy);
    std::vector<float> y(ny, NAN);
    kc::adaptive_avg_pool2d_forward<float>(N, C, H, W, OH, OW, x.data(), y.data());
    Buf<float> gy = dev(nans(ny));
    kg::adaptive_avg_pool2d_forward<float>(N, C, H, W, OH, OW, P(dxi), P(gy));
    EXPECT_CLOSE(host(gy), y, kElementwiseTol) << "adaptive y";
    check_beta(nx, rng, kElementwiseTol,
               [&](float* o, float beta) { kc::adaptive_avg_pool2d_backward<float>(N, C, H, W, OH, OW, dy.data(), o, beta); },
               [&](float* o, float beta) { kg::adaptive_avg_pool2d_backward<float>(N, C, H, W, OH, OW, P(ddy), o, beta); });
  }
}

// ---- loss -----------------------------------------------------------------------------------------

TEST(GpuKernels, CrossEntropyMatchesTheCpu) {
  REQUIRE_GPU();
  for (auto [N, C] : std::vector<std::pair<i64, i64>>{{1, 1}, {37, 10}, {5, 1000}, {300, 3}}) {
    for (bool weighted : {false, true}) {
      for (float smoothing : {0.f, 0.1f}) {
        const auto seed = fresh_seed();
        SCOPED_TRACE(testing::Message() << "N " << N << " C " << C << " weighted " << weighted << " smoothing "
                                        << smoothing << " seed " << seed);
        std::mt19937 rng(seed);
        const auto logits = uniform(N * C, rng, -4.f, 4.f), w = uniform(C, rng, 0.2f, 2.f), dloss = uniform(N, rng);
        std::vector<i64> t(N);
        for (i64 i = 0; i < N; ++i) t[i] = (i % 7 == 3) ? -100 : static_cast<i64>(rng() % C);  // some ignored
        Buf<float> dl = dev(logits), dw = dev(w), ddl = dev(dloss);
        Buf<i64> dt = dev_i64(t);
        const float* wc = weighted ? w.data() : nullptr;
        const float* wg = weighted ? P(dw) : nullptr;
        std::vector<float> loss(N, NAN), sw(N, NAN);
        EXPECT_EQ(kc::cross_entropy_forward<float>(N, C, logits.data(), t.data(), wc, -100, smoothing, loss.data(),
                                                   sw.data()),
                  -1);
        Buf<float> gl = dev(nans(N)), gsw = dev(nans(N));
        EXPECT_EQ(kg::cross_entropy_forward<float>(N, C, P(dl), P(dt), wg, -100, smoothing, P(gl), P(gsw)), -1);
        EXPECT_CLOSE(host(gl), loss, kMathTol) << "loss";
        EXPECT_CLOSE(host(gsw), sw, kMathTol) << "sample weight";
        check_beta(N * C, rng, kMathTol,
                   [&](float* o, float beta) {
                     kc::cross_entropy_backward<float>(N, C, logits.data(), t.data(), wc, -100, smoothing,
                                                       dloss.data(), o, beta);
                   },
                   [&](float* o, float beta) {
                     kg::cross_entropy_backward<float>(N, C, P(dl), P(dt), wg, -100, smoothing, P(ddl), o,
                                                       beta);
                   });
      }
    }
  }
  // An invalid target is reported by its index, the first one, as on the CPU.
  std::vector<i64> t = {1, 2, 9, 0, -5};
  const auto logits = std::vector<float>(5 * 3, 0.5f);
  Buf<float> dl = dev(logits), gl = dev(nans(5)), gsw = dev(nans(5));
  Buf<i64> dt = dev_i64(t);
  EXPECT_EQ(kg::cross_entropy_forward<float>(5, 3, P(dl), P(dt), nullptr, -100, 0.f, P(gl), P(gsw)), 2);
}

// ---- optimizers -----------------------------------------------------------------------------------

TEST(GpuKernels, FusedOptimizerUpdatesMatchTheCpu) {
  REQUIRE_GPU();
  for (i64 n : {i64{1}, i64{1000}, i64{100003}}) {
    const auto seed = fresh_seed();
    SCOPED_TRACE(testing::Message() << "n " << n << " seed " << seed);
    std::mt19937 rng(seed);
    struct Sgd {
      float momentum, dampening, wd;
      bool nesterov;
    };
    for (const Sgd& o : {Sgd{0.f, 0.f, 0.f, false}, Sgd{0.9f, 0.f, 5e-4f, false}, Sgd{0.9f, 0.f, 1e-4f, true},
                         Sgd{0.5f, 0.3f, 0.f, false}}) {
      auto p = uniform(n, rng), buf = nans(n);
      Buf<float> dp = dev(p), dbuf = dev(buf);
      for (int step = 0; step < 3; ++step) {
        const auto g = uniform(n, rng);
        Buf<float> dg = dev(g);
        kc::sgd_update<float>(n, p.data(), g.data(), o.momentum != 0 ? buf.data() : nullptr, 0.1f, o.momentum,
                              o.dampening, o.wd, o.nesterov, step == 0);
        kg::sgd_update<float>(n, P(dp), P(dg), o.momentum != 0 ? P(dbuf) : nullptr, 0.1f, o.momentum, o.dampening,
                              o.wd, o.nesterov, step == 0);
      }
      EXPECT_CLOSE(host(dp), p, kElementwiseTol) << "SGD param, momentum " << o.momentum << " nesterov " << o.nesterov;
      if (o.momentum != 0) {
        EXPECT_CLOSE(host(dbuf), buf, kElementwiseTol) << "SGD momentum buffer";
      }
    }
    auto p = uniform(n, rng), m = std::vector<float>(n, 0.f), v = std::vector<float>(n, 0.f);
    Buf<float> dp = dev(p), dm = dev(m), dv = dev(v);
    for (i64 step = 1; step <= 5; ++step) {
      const auto g = uniform(n, rng);
      Buf<float> dg = dev(g);
      kc::adamw_update<float>(n, p.data(), g.data(), m.data(), v.data(), 1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, step);
      kg::adamw_update<float>(n, P(dp), P(dg), P(dm), P(dv), 1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, step);
    }
    EXPECT_CLOSE(host(dp), p, kElementwiseTol) << "AdamW param";
    EXPECT_CLOSE(host(dm), m, kElementwiseTol) << "AdamW exp_avg";
    EXPECT_CLOSE(host(dv), v, kElementwiseTol) << "AdamW exp_avg_sq";
  }
}

// ---- context: pinned memory and overlapped uploads --------------------------------------------------

TEST(GpuKernels, PinnedUploadOnTheCopyStreamIsSeenByTheComputeStream) {
  REQUIRE_GPU();
  const i64 n = 1 << 20;
  kg::PinnedBuffer pinned(n * sizeof(float));
  std::mt19937 rng(fresh_seed());
  const auto v = uniform(n, rng);
  std::memcpy(pinned.data(), v.data(), n * sizeof(float));
  Buf<float> dst = dev(nans(n)), y = dev(nans(n));
  kg::Event up = kg::upload_async(P(dst), pinned.data(), n * sizeof(float));
  kg::compute_wait(up);                        // the compute stream orders after the upload...
  kg::copy<float>(n, P(dst), P(y));            // ...so this copy reads the uploaded values
  EXPECT_EQ(host(y), v);
  EXPECT_TRUE(up.done());
  kg::Event moved = std::move(up);
  EXPECT_FALSE(up.valid());
  moved.wait();
}

#endif  // TALLY_HAVE_CUDA
