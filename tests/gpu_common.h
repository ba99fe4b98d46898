// tests/gpu_common.h — what the GPU tests (ctest label `gpu`) share: the skip when no GPU is
// present, a bounded arena, random inputs and the comparison that a NaN never passes.
//
// Relative error here is max_i |got_i - want_i| / max_i |want_i| (the max-norm of the error over
// the max-norm of the reference): elementwise, it bounds every element's error by tol times the
// reference's scale, and it does not blow up on elements that are near zero by cancellation. A
// NaN or Inf in `got` where `want` is finite — or a length mismatch — is an infinite error.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally::test {

// Each GPU test process reserves this much device memory for its arena (instead of the default,
// nearly all free memory), so that several test processes can share one GPU.
inline constexpr std::size_t kGpuTestArenaBytes = std::size_t(2) << 30;

inline bool gpu_ready() {
  if (!cuda_available()) return false;
  static const bool configured = [] {
    configure_arena(Device::cuda(0), kGpuTestArenaBytes);
    return true;
  }();
  return configured;
}

}  // namespace tally::test

// First statement of every GPU test.
#define REQUIRE_GPU() \
  if (!::tally::test::gpu_ready()) GTEST_SKIP() << "no GPU present: " << ::tally::build_info()

namespace tally::test {

// A fresh seed per check, printed by SCOPED_TRACE so that a failure can be replayed:
// TALLY_TEST_SEED=N in the environment makes every check of the process take N.
inline std::uint32_t fresh_seed() {
  if (const char* s = std::getenv("TALLY_TEST_SEED")) return static_cast<std::uint32_t>(std::strtoul(s, nullptr, 10));
  static std::random_device rd;
  return rd();
}

inline std::vector<float> uniform(std::size_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

template <class T>
double max_rel_err(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    if (!std::isfinite(g) || !std::isfinite(w)) {
      if (std::isfinite(w) || std::isfinite(g)) return INFINITY;  // one finite, the other not
      if (std::isnan(g) != std::isnan(w) || (!std::isnan(g) && g != w)) return INFINITY;
      continue;  // both the same non-finite value (a NaN propagated on purpose)
    }
    num = std::max(num, std::abs(g - w));
    den = std::max(den, std::abs(w));
  }
  return den == 0 ? num : num / den;
}

// Norm-wise relative error ||got - want||_2 / ||want||_2 of two tensors (any devices), infinite
// on a NaN or a shape mismatch: for whole-network comparisons.
inline double norm_rel_err(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape()) return INFINITY;
  const auto a = got.to(Device::cpu()).to_vector<float>(), b = want.to(Device::cpu()).to_vector<float>();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// A (N, C, HW) array's values stored channels-last, (N, HW, C), and back: the bytes of a
// channels-last tensor, for kernels compared with the CPU's row-major reference.
template <class T>
std::vector<T> nhwc_permuted(const std::vector<T>& v, std::int64_t N, std::int64_t C, std::int64_t HW, bool to_nhwc) {
  std::vector<T> out(v.size());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t j = 0; j < HW; ++j) {
        const std::int64_t rows = (n * C + c) * HW + j, nhwc = (n * HW + j) * C + c;
        out[to_nhwc ? nhwc : rows] = v[to_nhwc ? rows : nhwc];
      }
  return out;
}
template <class T>
std::vector<T> to_nhwc(const std::vector<T>& v, std::int64_t N, std::int64_t C, std::int64_t HW) {
  return nhwc_permuted(v, N, C, HW, true);
}
template <class T>
std::vector<T> from_nhwc(const std::vector<T>& v, std::int64_t N, std::int64_t C, std::int64_t HW) {
  return nhwc_permuted(v, N, C, HW, false);
}

// For a scope, the CPU's convolutions through its reference (im2col + GEMM), not oneDNN: what the
// CUDA kernels are compared with.
struct UseCpuReferenceConvolutions {
  kernels::cpu::ConvAlgorithm before = kernels::cpu::conv_algorithm();
  UseCpuReferenceConvolutions() { kernels::cpu::set_conv_algorithm(kernels::cpu::ConvAlgorithm::reference); }
  ~UseCpuReferenceConvolutions() { kernels::cpu::set_conv_algorithm(before); }
  UseCpuReferenceConvolutions(const UseCpuReferenceConvolutions&) = delete;
  UseCpuReferenceConvolutions& operator=(const UseCpuReferenceConvolutions&) = delete;
};

// For a scope, the GPU convolutions through one cuDNN API (the API before, after).
struct UseCudnnConvApi {
  kernels::cuda::CudnnConvApi before = kernels::cuda::cudnn_conv_api();
  explicit UseCudnnConvApi(kernels::cuda::CudnnConvApi api) { kernels::cuda::set_cudnn_conv_api(api); }
  ~UseCudnnConvApi() { kernels::cuda::set_cudnn_conv_api(before); }
  UseCudnnConvApi(const UseCudnnConvApi&) = delete;
  UseCudnnConvApi& operator=(const UseCudnnConvApi&) = delete;
};

}  // namespace tally::test

#define EXPECT_CLOSE(got, want, tol) \
  EXPECT_LE(::tally::test::max_rel_err(got, want), tol) << "relative error of " #got " against " #want
