// tests/dropout_check.h — one test body for dropout (core/ops.h, kernels/common.h: dropout_keeps)
// on any device, float32 and bf16: every element is x * (float)(1 / (1 - p)) where the key keeps it
// and 0 (x * 0) where not, as the host computes it from the key, bit for bit; about 1 - p of them
// kept; the same elements in both memory formats; a sample's mask is its own wherever it sits (a
// slice whose first sample is given equals the whole tensor's rows); the backward masks alike; p 0
// and 1; a NaN stays NaN. tensor_test runs it on the CPU, gpu_ops_test on a GPU.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/tensor.h"
#include "kernels/common.h"

namespace tally::test {

// The host's dropout of x (N, C, H, W) row-major, from the key alone, in x's dtype's rounding.
template <class T>
std::vector<float> expected_dropout(const std::vector<float>& x, std::int64_t N, std::int64_t F,
                                    const kernels::DropoutKey& k) {
  std::vector<float> y(x.size());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t e = 0; e < F; ++e) {
      const float m = kernels::dropout_keeps(k, n, e) ? k.scale : 0.f;
      y[n * F + e] = static_cast<float>(T(x[n * F + e] * m));
    }
  return y;
}

inline void check_dropout(Device device, std::uint32_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " on " + device.str());
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const std::int64_t N = 6, C = 5, H = 7, W = 3, F = C * H * W;
  const double p = 0.3;
  const SampleIndex at{41, 1000};
  const std::uint64_t layer = rng();
  std::vector<float> xs(static_cast<std::size_t>(N * F));
  for (auto& v : xs) v = nd(rng);
  for (const DType dtype : {DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Tensor x = Tensor::from_vector(xs, {N, C, H, W}).to(dtype).to(device);
    // What the host computes from the key, on x as this dtype holds it.
    const std::vector<float> xq = x.to(DType::Float32).to(Device::cpu()).to_vector<float>();
    const kernels::DropoutKey key = kernels::dropout_key(p, layer, at.step, at.first);
    const std::vector<float> want = dtype == DType::Float32 ? expected_dropout<float>(xq, N, F, key)
                                                            : expected_dropout<kernels::bf16>(xq, N, F, key);
    const auto host = [](const Tensor& t) { return t.contiguous().to(DType::Float32).to(Device::cpu()).to_vector<float>(); };
    const std::vector<float> got = host(dropout(x, p, layer, at));
    ASSERT_EQ(got, want);
    std::int64_t kept = 0;
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t e = 0; e < F; ++e) kept += kernels::dropout_keeps(key, n, e);
    const double total = static_cast<double>(N * F), sigma = std::sqrt(total * p * (1 - p));
    EXPECT_NEAR(static_cast<double>(kept), total * (1 - p), 5 * sigma) << "the fraction kept";
    // The same elements in channels-last.
    const Tensor xc = x.contiguous(MemoryFormat::ChannelsLast);
    const Tensor yc = dropout(xc, p, layer, at);
    EXPECT_EQ(yc.suggest_memory_format(), MemoryFormat::ChannelsLast);
    EXPECT_EQ(host(yc), want);
    // Samples 2..4 alone, told where they sit, draw their own rows of the whole tensor's mask.
    const std::vector<float> part = host(dropout(x.narrow(0, 2, 3), p, layer, SampleIndex{at.step, at.first + 2}));
    EXPECT_EQ(part, std::vector<float>(want.begin() + 2 * F, want.begin() + 5 * F));
    // Another step, another mask.
    EXPECT_NE(host(dropout(x, p, layer, SampleIndex{at.step + 1, at.first})), want);
    // The backward: dx = dy * m.
    Tensor xg = x.detach();
    xg.set_requires_grad(true);
    Tensor y = dropout(xg, p, layer, at);
    const Tensor dy = Tensor::from_vector(xs, {N, C, H, W}).to(dtype).to(device);  // any values: x's
    sum(mul(y, dy)).backward();  // dL/dy = dy
    EXPECT_EQ(host(xg.grad()), want) << "dx = dy * m, with dy = x";
    // p = 0 keeps everything as it was; p = 1 keeps nothing.
    EXPECT_EQ(host(dropout(x, 0.0, layer, at)), xq);
    for (const float v : host(dropout(x, 1.0, layer, at))) ASSERT_EQ(v, 0.f);
  }
  // A NaN stays NaN, kept or dropped (PyTorch multiplies by its mask).
  std::vector<float> nans(static_cast<std::size_t>(N * F), std::nanf(""));
  const Tensor xn = Tensor::from_vector(nans, {N, C, H, W}).to(device);
  const std::vector<float> yn = dropout(xn, p, layer, at).to(Device::cpu()).to_vector<float>();
  for (std::size_t i = 0; i < yn.size(); ++i) ASSERT_TRUE(std::isnan(yn[i])) << "element " << i << ": " << yn[i];
  EXPECT_THROW(dropout(Tensor::from_vector(xs, {N, C, H, W}).to(device), 1.5, layer, at), Error);
}

}  // namespace tally::test
