// bfloat16 compute on the CPU: every op with bf16 activations (and float32 parameters, as mixed
// precision runs them) against the float32 reference on the same values, forward and backward.
//
// Inputs, parameters and upstream gradients are random values that bf16 holds exactly, so both
// runs multiply the same numbers: what may differ is the rounding of each bf16 result (half a
// bf16 ulp, 2^-9 relative, once per element stored) and float32 summation order. Parameter
// gradients are float32 in both runs and must agree to float32 accuracy — a weight gradient
// rounded to bf16 anywhere on its way fails. The float32 reference itself is checked against
// float64 finite differences and PyTorch in gradcheck_test and golden_test.
//
// The convolutions run on both routes a bf16 convolution has: oneDNN (AVX-512 CPUs) and the
// widened float32 fallback. ctest runs this binary again under ONEDNN_MAX_CPU_ISA=AVX512_CORE
// (oneDNN's emulated bf16) and =AVX2 (no bf16 in oneDNN: the fallback takes over).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/option_names.h"
#include "kernels/cpu/cpu_kernels.h"
#include "mbp/executor.h"
#include "tests/gpu_common.h"
#include "tests/model_common.h"

using namespace tally;
using kernels::bf16;
using test::fresh_seed;

namespace {

// n normal values times `scale`, each one a bf16 value (so float32 and bf16 tensors hold the same).
std::vector<float> bf16_values(std::int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(bf16(d(rng)));
  return v;
}

Tensor make(const std::vector<float>& v, const Shape& s, DType dt, Category cat = Category::input) {
  if (dt == DType::BFloat16) {
    std::vector<bf16> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) b[i] = bf16(v[i]);
    return Tensor::from_vector(b, s, Device::cpu(), cat);
  }
  return Tensor::from_vector(v, s, Device::cpu(), cat);
}

std::vector<float> values(const Tensor& t) {
  if (t.dtype() == DType::Float32) return t.to_vector<float>();
  std::vector<float> out;
  if (t.dtype() == DType::BFloat16)
    for (bf16 b : t.to_vector<bf16>()) out.push_back(static_cast<float>(b));
  else
    for (double d : t.to_vector<double>()) out.push_back(static_cast<float>(d));
  return out;
}

// |got - ref| <= rtol |ref| + atol max|ref| everywhere; a NaN never passes, and the reference must
// hold something (not all zeros).
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double max_ref = 0;
  for (float r : ref) {
    ASSERT_TRUE(std::isfinite(r)) << what << ": the reference is not finite";
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(r)));
  }
  ASSERT_GT(max_ref, 0) << what << ": the reference is all zeros";
  int bad = 0;
  double worst = 0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double tol = rtol * std::fabs(static_cast<double>(ref[i])) + atol * max_ref;
    if (!(diff <= tol)) {
      ++bad;
      const double ratio = std::isnan(diff) ? INFINITY : diff / tol;
      if (ratio > worst) worst = ratio, worst_at = i;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements off; worst at " << worst_at
                    << ": got " << got[worst_at] << ", reference " << ref[worst_at] << " (" << worst
                    << "x the tolerance)";
}

// One op: activations (bf16 in the mixed run), parameters (float32 in both runs) and the function.
struct OpCase {
  std::string name;
  std::vector<Shape> activations;
  std::vector<Shape> parameters;
  std::function<Tensor(const std::vector<Tensor>& a, const std::vector<Tensor>& p)> f;
  // Tolerance of bf16 results, relative to the element and to the largest reference element.
  double rtol = std::ldexp(1.0, -8), atol = std::ldexp(1.0, -9);
  float scale = 1.f;  // of the random activations
};

struct Run {
  std::vector<float> y;
  std::vector<std::vector<float>> da, dp;
  DType y_dtype;
};

Run run(const OpCase& c, DType act, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Tensor> a, p;
  for (const Shape& s : c.activations) {
    a.push_back(make(bf16_values(shape_numel(s), rng, c.scale), s, act));
    a.back().set_requires_grad(true);
  }
  for (const Shape& s : c.parameters) {
    p.push_back(make(bf16_values(shape_numel(s), rng, 0.5f), s, DType::Float32, Category::parameter));
    p.back().set_requires_grad(true);
  }
  Tensor y = c.f(a, p);
  // An upstream gradient of bf16 values, in y's dtype (the same values in both runs).
  const Tensor seed_grad = make(bf16_values(y.numel(), rng), y.shape(), y.dtype(), Category::temporary);
  Run r;
  r.y = values(y);
  r.y_dtype = y.dtype();
  run_backward(y, seed_grad);
  for (const Tensor& t : a) {
    EXPECT_EQ(t.grad().dtype(), act) << c.name << ": an activation's gradient has the activation's dtype";
    r.da.push_back(values(t.grad()));
  }
  for (const Tensor& t : p) {
    EXPECT_EQ(t.grad().dtype(), DType::Float32) << c.name << ": a parameter's gradient stays float32";
    r.dp.push_back(values(t.grad()));
  }
  return r;
}

void check_case(const OpCase& c) {
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("{} (seed {})", c.name, seed));
  const Run ref = run(c, DType::Float32, seed);
  const Run got = run(c, DType::BFloat16, seed);
  expect_close(got.y, ref.y, c.rtol, c.atol, c.name + " forward");
  for (std::size_t i = 0; i < ref.da.size(); ++i)
    expect_close(got.da[i], ref.da[i], c.rtol, c.atol, fmt::format("{} gradient of activation {}", c.name, i));
  // Float32 parameter gradients from the same bf16 values: float32 accuracy.
  for (std::size_t i = 0; i < ref.dp.size(); ++i)
    expect_close(got.dp[i], ref.dp[i], 1e-4, 1e-5, fmt::format("{} gradient of parameter {}", c.name, i));
}

Conv2dOptions conv_opts(std::int64_t stride, std::int64_t pad, std::int64_t dil = 1, std::int64_t groups = 1) {
  Conv2dOptions o;
  o.stride = {stride, stride};
  o.padding = {pad, pad};
  o.dilation = {dil, dil};
  o.groups = groups;
  return o;
}

std::vector<OpCase> conv_cases() {
  return {
      {"conv2d 3x3 pad 1 with bias", {{3, 5, 9, 9}}, {{6, 5, 3, 3}, {6}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], p[1], conv_opts(1, 1)); }},
      {"conv2d 1x1 (a plain GEMM)", {{2, 16, 6, 6}}, {{8, 16, 1, 1}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], {}, conv_opts(1, 0)); }},
      {"conv2d 3x3 stride 2 dilation 2 groups 2", {{2, 6, 11, 10}}, {{4, 3, 3, 3}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], {}, conv_opts(2, 2, 2, 2)); }},
      {"conv2d 7x7 stride 2 (a stem)", {{2, 3, 20, 20}}, {{8, 3, 7, 7}},
       [](auto& a, auto& p) { return conv2d(a[0], p[0], {}, conv_opts(2, 3)); }},
  };
}

bool expect_onednn_bf16() {
  const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (isa != nullptr && std::string(isa).rfind("AVX2", 0) == 0) return false;
  if (isa != nullptr && std::string(isa).rfind("SSE", 0) == 0) return false;
  return kernels::cpu::have_onednn() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

kernels::Conv2dShape shape_of(const Shape& x, const Shape& w, const Conv2dOptions& o) {
  kernels::Conv2dShape s;
  s.N = x[0], s.C = x[1], s.H = x[2], s.W = x[3], s.K = w[0], s.R = w[2], s.S = w[3];
  s.stride_h = s.stride_w = o.stride[0], s.pad_h = s.pad_w = o.padding[0], s.dil_h = s.dil_w = o.dilation[0];
  s.groups = o.groups;
  s.workspace_limit = kernels::cpu::conv_workspace_limit(std::size_t(1) << 30);
  return s;
}

struct AlgorithmGuard {
  kernels::cpu::ConvAlgorithm saved = kernels::cpu::conv_algorithm();
  ~AlgorithmGuard() { kernels::cpu::set_conv_algorithm(saved); }
};

}  // namespace

// Convolutions: on oneDNN where this CPU (and ONEDNN_MAX_CPU_ISA) gives it bf16, else on the
// widened fallback — which route runs is checked, not assumed — and on the fallback forced.
TEST(BFloat16Ops, ConvolutionsOnOneDnnAndOnTheFallbackMatchFloat32) {
  AlgorithmGuard guard;
  kernels::cpu::set_conv_algorithm(kernels::cpu::ConvAlgorithm::onednn);
  const bool onednn = expect_onednn_bf16();
  const kernels::Conv2dShape s = shape_of({3, 5, 9, 9}, {6, 5, 3, 3}, conv_opts(1, 1));
  for (auto pass : {kernels::ConvPass::forward, kernels::ConvPass::backward_data, kernels::ConvPass::backward_filter})
    EXPECT_EQ(kernels::cpu::conv2d_on_onednn(s, pass, true), onednn)
        << "oneDNN bf16 convolutions are expected " << (onednn ? "on" : "off") << " on this CPU and ISA limit";
  for (const OpCase& c : conv_cases()) check_case(c);
  kernels::cpu::set_conv_algorithm(kernels::cpu::ConvAlgorithm::reference);
  EXPECT_FALSE(kernels::cpu::conv2d_on_onednn(s, kernels::ConvPass::forward, true));
  for (OpCase c : conv_cases()) {
    c.name += " (widened fallback)";
    check_case(c);
  }
}

// A fallback convolution whose workspace limit holds one sample converts and convolves sample
// by sample, and accumulates dx (beta = 1) and dw over the chunks exactly like the whole batch.
TEST(BFloat16Ops, TheWidenedFallbackRunsInChunksOfSamples) {
  AlgorithmGuard guard;
  kernels::cpu::set_conv_algorithm(kernels::cpu::ConvAlgorithm::reference);
  namespace kc = kernels::cpu;
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937 rng(seed);
  kernels::Conv2dShape s = shape_of({5, 4, 8, 8}, {6, 4, 3, 3}, conv_opts(1, 1));
  const std::int64_t nx = 5 * 4 * 64, ny = 5 * 6 * 64, nw = 6 * 4 * 9;
  const auto xv = bf16_values(nx, rng), dyv = bf16_values(ny, rng), wv = bf16_values(nw, rng, 0.3f);
  std::vector<bf16> x(xv.begin(), xv.end()), dy(dyv.begin(), dyv.end());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf16(xv[i]);
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = bf16(dyv[i]);
  auto run_with_limit = [&](std::size_t limit) {
    s.workspace_limit = limit;
    std::vector<char> ws(std::max<std::size_t>(
        {kc::conv2d_workspace_bytes<bf16>(s, kernels::ConvPass::forward),
         kc::conv2d_workspace_bytes<bf16>(s, kernels::ConvPass::backward_data),
         kc::conv2d_workspace_bytes<bf16>(s, kernels::ConvPass::backward_filter), std::size_t(1)}));
    std::vector<bf16> y(ny), dx(nx, bf16(0.25f));
    std::vector<float> dw(nw, 0.5f);
    kc::conv2d_forward<bf16>(s, x.data(), wv.data(), nullptr, y.data(), ws.data());
    kc::conv2d_backward_data<bf16>(s, dy.data(), wv.data(), dx.data(), 1.f, ws.data());
    kc::conv2d_backward_filter<bf16>(s, x.data(), dy.data(), dw.data(), 1.f, ws.data());
    std::vector<float> out;
    for (bf16 v : y) out.push_back(float(v));
    for (bf16 v : dx) out.push_back(float(v));
    out.insert(out.end(), dw.begin(), dw.end());
    return out;
  };
  const std::vector<float> whole = run_with_limit(std::size_t(1) << 30);
  const std::vector<float> chunked = run_with_limit(1);  // one sample at a time
  ASSERT_EQ(whole.size(), chunked.size());
  for (std::size_t i = 0; i < whole.size(); ++i) ASSERT_EQ(whole[i], chunked[i]) << i;
}

TEST(BFloat16Ops, GemmsNormsPoolsElementwiseAndTheLossMatchFloat32) {
  BatchNormOptions eval;
  eval.training = false;
  const std::vector<OpCase> cases = {
      {"linear with bias", {{6, 20}}, {{7, 20}, {7}}, [](auto& a, auto& p) { return linear(a[0], p[0], p[1]); }},
      {"matmul", {{9, 13}, {13, 5}}, {}, [](auto& a, auto&) { return matmul(a[0], a[1]); }},
      {"batch_norm (training)", {{4, 6, 5, 5}}, {{6}, {6}}, [](auto& a, auto& p) {
         Tensor rm = Tensor::zeros({6}), rv = Tensor::full({6}, 1.0);
         return batch_norm(a[0], p[0], p[1], rm, rv, {});
       }, std::ldexp(1.0, -8), std::ldexp(1.0, -9), 2.f},
      {"batch_norm (eval)", {{3, 6, 4, 4}}, {{6}, {6}}, [eval](auto& a, auto& p) {
         Tensor rm = Tensor::full({6}, 0.3), rv = Tensor::full({6}, 1.7);
         return batch_norm(a[0], p[0], p[1], rm, rv, eval);
       }},
      {"group_norm", {{3, 8, 4, 5}}, {{8}, {8}}, [](auto& a, auto& p) { return group_norm(a[0], 4, p[0], p[1]); }},
      {"relu", {{5, 7, 3}}, {}, [](auto& a, auto&) { return relu(a[0]); }},
      {"add", {{4, 9}, {4, 9}}, {}, [](auto& a, auto&) { return add(a[0], a[1]); }},
      {"sub", {{4, 9}, {4, 9}}, {}, [](auto& a, auto&) { return sub(a[0], a[1]); }},
      {"mul", {{4, 9}, {4, 9}}, {}, [](auto& a, auto&) { return mul(a[0], a[1]); }},
      {"scale", {{4, 9}}, {}, [](auto& a, auto&) { return scale(a[0], -0.37); }},
      // The backward reads the saved bf16 output y (as PyTorch's): y's rounding, up to 2^-9 absolute
      // near saturation, moves y * (1 - y) by as much absolutely, however small y * (1 - y) is there,
      // so an element's error is up to about 2^-9 |dy| — against the largest reference gradient (at
      // most max|dy| / 4, less where the largest dy meet a saturated y) more than 2^-7 of it — and
      // the gradient is rounded once more. 2^-7 failed 21 of 200 fresh seeds (worst 1.5x it); 2^-5
      // held in 300.
      {"sigmoid", {{5, 7, 3}}, {}, [](auto& a, auto&) { return sigmoid(a[0]); }, std::ldexp(1.0, -5)},
      {"scale_channels by (N, C, 1, 1)", {{3, 6, 5, 4}, {3, 6, 1, 1}}, {}, [](auto& a, auto&) {
         return scale_channels(a[0], a[1]);
       }},
      {"scale_channels by (N, C)", {{2, 5, 7, 3}, {2, 5}}, {}, [](auto& a, auto&) {
         return scale_channels(a[0], a[1]);
       }},
      {"concat", {{2, 3, 4, 5}, {2, 1, 4, 5}, {2, 4, 4, 5}}, {}, [](auto& a, auto&) {
         return concat({a[0], a[1], a[2]});
       }},
      {"max_pool2d 3x3 stride 2 pad 1", {{2, 3, 9, 8}}, {}, [](auto& a, auto&) {
         return max_pool2d(a[0], {3, 3}, {2, 2}, {1, 1});
       }},
      {"avg_pool2d counting padding", {{2, 3, 9, 8}}, {}, [](auto& a, auto&) {
         return avg_pool2d(a[0], {3, 3}, {2, 2}, {1, 1}, true);
       }},
      {"avg_pool2d not counting padding", {{2, 3, 9, 8}}, {}, [](auto& a, auto&) {
         return avg_pool2d(a[0], {3, 3}, {2, 2}, {1, 1}, false);
       }},
      {"adaptive_avg_pool2d 7x5 to 3x2", {{2, 4, 7, 5}}, {}, [](auto& a, auto&) {
         return adaptive_avg_pool2d(a[0], {3, 2});
       }},
      {"flatten + reshape", {{2, 3, 4, 2}}, {}, [](auto& a, auto&) { return reshape(flatten(a[0]), {4, 12}); }},
      {"sum", {{5, 11}}, {}, [](auto& a, auto&) { return sum(a[0]); }},
      {"mean", {{5, 11}}, {}, [](auto& a, auto&) { return mean(a[0]); }},
  };
  for (const OpCase& c : cases) check_case(c);
}

// bf16 logits give a float32 loss (the logits converted first, as autocast runs the loss in
// float32) and a bf16 gradient.
// The batch norm's bf16 input gradient is its float64 computation from the same bf16 inputs and
// saved statistics, rounded once: within one bf16 rounding of it, element by element, also where
// the three terms of dx cancel (two values per channel, a mean far from zero) — row-major and
// channels-last. (A float32 form that subtracted terms the size of x's mean once parted from
// the GPU's double by 3 bf16 ulps at N 2 C 16 HW 1, on an H100.)
TEST(BFloat16Ops, BatchNormInputGradientIsItsFloat64ComputationRoundedOnce) {
  namespace kc = kernels::cpu;
  using kernels::bf16;
  using kernels::i64;
  for (const auto& [N, C, HW] : std::vector<std::array<i64, 3>>{{2, 16, 1}, {3, 5, 63}, {8, 16, 64}, {2, 7, 3}})
    for (bool channels_last : {false, true})
      for (int draw = 0; draw < 8; ++draw) {
        const auto seed = fresh_seed();
        SCOPED_TRACE(fmt::format("N {} C {} HW {} channels_last {} seed {}", N, C, HW, channels_last, seed));
        std::mt19937 rng(seed);
        const i64 n = N * C * HW;
        std::uniform_real_distribution<float> ux(2.f, 6.f), ud(-1.f, 1.f), ug(0.5f, 1.5f);
        std::vector<bf16> x(n), dy(n), dx(n, bf16(std::nanf("")));
        std::vector<double> xd(n), dyd(n), dxd(n);
        for (i64 i = 0; i < n; ++i) x[i] = bf16(ux(rng)), dy[i] = bf16(ud(rng)), xd[i] = float(x[i]), dyd[i] = float(dy[i]);
        std::vector<float> gamma(C), mean(C), invstd(C);
        std::vector<double> gammad(C), meand(C), invstdd(C);
        for (i64 c = 0; c < C; ++c) {  // the statistics of x, as a forward would have saved them
          double s = 0, s2 = 0;
          for (i64 m = 0; m < N * HW; ++m) {
            const i64 o = channels_last ? m * C + c : (m / HW * C + c) * HW + m % HW;
            s += xd[o], s2 += xd[o] * xd[o];
          }
          const double mu = s / static_cast<double>(N * HW), var = s2 / static_cast<double>(N * HW) - mu * mu;
          gamma[c] = ug(rng), mean[c] = static_cast<float>(mu), invstd[c] = static_cast<float>(1.0 / std::sqrt(var + 1e-5));
          gammad[c] = gamma[c], meand[c] = mean[c], invstdd[c] = invstd[c];
        }
        kernels::NormActGrad<bf16> act;
        act.channels_last = channels_last;
        kernels::NormActGrad<double> actd;
        actd.channels_last = channels_last;
        std::vector<unsigned char> ws(kc::batch_norm_workspace_bytes(N, C, HW, channels_last));
        kc::batch_norm_backward<bf16>(N, C, HW, dy.data(), x.data(), gamma.data(), mean.data(), invstd.data(), dx.data(),
                                      0.f, nullptr, nullptr, 0.f, ws.data(), act);
        kc::batch_norm_backward<double>(N, C, HW, dyd.data(), xd.data(), gammad.data(), meand.data(), invstdd.data(),
                                        dxd.data(), 0.0, nullptr, nullptr, 0.0, ws.data(), actd);
        double top = 0;
        for (double v : dxd) top = std::max(top, std::abs(v));
        for (i64 i = 0; i < n; ++i) {
          const double want = static_cast<double>(static_cast<float>(bf16(dxd[i])));  // rounded once
          ASSERT_LE(std::abs(float(dx[i]) - want), std::ldexp(std::abs(want), -8) + std::ldexp(top, -12))
              << "element " << i << ": got " << float(dx[i]) << ", float64 rounded once " << want;
        }
      }
}

TEST(BFloat16Ops, CrossEntropyOfBf16LogitsIsFloat32) {
  const std::vector<std::int64_t> t{3, 0, 6, 6, 1, 2, 5, 4};
  for (double smoothing : {0.0, 0.1}) {
    CrossEntropyOptions o;
    o.label_smoothing = smoothing;
    OpCase c{fmt::format("cross_entropy (label smoothing {})", smoothing), {{8, 7}}, {},
             [t, o](auto& a, auto&) {
               Tensor y = cross_entropy(a[0], Tensor::from_vector(t, {8}), o);
               EXPECT_EQ(y.dtype(), DType::Float32);
               return y;
             }};
    c.scale = 3.f;
    check_case(c);
  }
}

// sum and mean round once: factor * (the sum in double) to bf16, as the CUDA kernel does. A sum
// rounded to bf16 before the factor is applied gives another result in about one draw in four of
// these, so a kernel that rounds twice fails within the first few draws.
TEST(BFloat16Ops, SumAndMeanRoundOnce) {
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937 rng(seed);
  for (std::int64_t n : {55, 40000}) {  // one block of the CPU's reduction and three
    for (int draw = 0; draw < 100; ++draw) {
      const std::vector<float> v = bf16_values(n, rng);
      std::vector<bf16> x(v.size());
      double exact = 0;  // bf16 values have 8 significant bits: these sums are exact in double
      for (std::size_t i = 0; i < v.size(); ++i) x[i] = bf16(v[i]), exact += v[i];
      const double factor = 1.0 / static_cast<double>(n);
      bf16 got{};
      kernels::cpu::sum_to<bf16>(n, x.data(), static_cast<float>(factor), &got);
      // The kernel multiplies by the float32 factor, the parameter type of a bf16 kernel.
      const float want = static_cast<float>(bf16(exact * static_cast<double>(static_cast<float>(factor))));
      ASSERT_EQ(static_cast<float>(got), want) << "n " << n << ", draw " << draw << ": sum " << exact;
    }
  }
}

// Mixed precision keeps parameters float32: a bf16 parameter, or a float64 one, is an error that
// names what was expected; a bf16 step of ops without kernels on a device says so.
TEST(BFloat16Ops, Bf16ActivationsTakeFloat32ParametersAndSaySo) {
  const Tensor x = Tensor::full({2, 3, 4, 4}, 0.5, DType::BFloat16);
  const Tensor w16 = Tensor::full({4, 3, 3, 3}, 0.1, DType::BFloat16);
  try {
    conv2d(x, w16);
    FAIL() << "a bf16 weight was taken";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("expected a float32 weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("master weights"), std::string::npos) << e.what();
  }
  EXPECT_THROW(linear(Tensor::full({2, 3}, 1.0, DType::BFloat16), Tensor::full({4, 3}, 1.0, DType::Float64)),
               ShapeError);
  EXPECT_THROW(batch_norm(x, Tensor::full({3}, 1.0, DType::BFloat16), {}, {}, {}, {}), ShapeError);
  // float32 activations still take float32 parameters only.
  EXPECT_THROW(conv2d(Tensor::full({2, 3, 4, 4}, 0.5), w16), ShapeError);
}

// ---------------------------------------------------------------------------------------------
// Mixed-precision training steps (mbp::Precision::bf16): the executor converts each micro-batch's
// input to bf16; the model keeps float32 parameters, gradients and optimizer state.
namespace {

class MixedPrecision : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

// Gradients of the float32 model's parameters after a bf16 step of `sizes`, as doubles.
std::vector<std::vector<double>> bf16_step_grads(nn::Module& m, optim::Optimizer& opt, const test::Data& d,
                                                 const Shape& sample, const std::vector<std::int64_t>& sizes,
                                                 double* loss) {
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.precision = mbp::Precision::bf16;
  mbp::Executor ex(m, opt, eo);
  EXPECT_EQ(ex.activation_dtype(), DType::BFloat16);
  m.zero_grad();
  *loss = ex.accumulate(d.images.data(), d.labels.data(), sizes);
  auto g = test::grads<float>(m);
  m.zero_grad();
  return g;
}

}  // namespace

// How accurate a bf16 step can be: the gradients of a residual network of convolutions, batch
// norms and ReLUs, computed three ways — float64 (the truth), tally's bf16 kernels, and the
// float32 kernels with every activation and activation gradient rounded to bf16 by casts (R
// below: what bf16 storage alone costs; the weights are bf16 values, so rounding them costs
// nothing in either). The bf16 kernels must be about as close to float64 as the rounding itself
// allows, layer by layer; their errors and the emulation's are printed.
TEST(MixedPrecisionAccuracy, Bf16KernelsAreAsAccurateAsBf16RoundingAllows) {
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937 rng(seed);
  const std::int64_t L = 6, C = 16, N = 12, H = 10, layers = 2 * L + 1;
  std::vector<std::vector<float>> ws;
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::int64_t cin = l == 0 ? 3 : C;
    std::normal_distribution<float> d(0.f, std::sqrt(2.f / static_cast<float>(cin * 9)));
    std::vector<float> w(static_cast<std::size_t>(C * cin * 9));
    for (auto& v : w) v = static_cast<float>(bf16(d(rng)));  // bf16 values: the weights' rounding is no error here
    ws.push_back(w);
  }
  const std::vector<float> xv = bf16_values(N * 3 * H * H, rng);
  std::vector<std::int64_t> labels(N);
  for (auto& v : labels) v = static_cast<std::int64_t>(rng() % C);
  enum Mode { f64, bf16_kernels, rounded_f32 };
  auto gradients = [&](Mode mode) {
    const DType pd = mode == f64 ? DType::Float64 : DType::Float32;
    std::vector<Tensor> w;
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::int64_t cin = l == 0 ? 3 : C;
      w.push_back(make(ws[static_cast<std::size_t>(l)], {C, cin, 3, 3}, DType::Float32, Category::parameter)
                      .to(pd).detach());
      w.back().set_requires_grad(true);
    }
    auto R = [&](const Tensor& t) { return mode == rounded_f32 ? cast(cast(t, DType::BFloat16), DType::Float32) : t; };
    Tensor x = make(xv, {N, 3, H, H}, DType::Float32).to(mode == bf16_kernels ? DType::BFloat16 : pd);
    Conv2dOptions o;
    o.padding = {1, 1};
    auto bn = [&](const Tensor& t) { return batch_norm(t, {}, {}, {}, {}, {}); };
    Tensor h = R(relu(R(bn(R(conv2d(x, w[0], {}, o))))));
    for (std::int64_t l = 0; l < L; ++l) {
      Tensor b = R(relu(R(bn(R(conv2d(h, w[static_cast<std::size_t>(1 + 2 * l)], {}, o))))));
      b = R(bn(R(conv2d(b, w[static_cast<std::size_t>(2 + 2 * l)], {}, o))));
      h = R(relu(R(add(h, b))));
    }
    cross_entropy(R(flatten(adaptive_avg_pool2d(h, {1, 1}))), Tensor::from_vector(labels, {N})).backward();
    std::vector<std::vector<double>> g;
    for (const Tensor& p : w) g.push_back(p.grad().to(DType::Float64).to_vector<double>());
    return g;
  };
  const auto truth = gradients(f64), got = gradients(bf16_kernels), rounded = gradients(rounded_f32);
  // Measured: e / er between 0.9 and 1.1 for nearly every layer of nearly every draw (batch norm's
  // scale invariance makes both large for the layers before one: 0.04 to 0.2, as large in the
  // emulation as in the kernels). The two paths sum in different orders, so now and then a few
  // sums round to different bf16 values and the network amplifies the difference — either way
  // round: one draw in about 50 has a layer at 1.5 (TALLY_TEST_SEED=1082006489: the last layer
  // 0.034 against 0.022) and others have the kernels closer. So each layer is held to twice the
  // rounding's error, and the layers together to 1.2 times theirs: over seeds 1-150 the sum's
  // ratio had median 1.000, 99th percentile 1.084 and maximum 1.094, and one draw in a few hundred
  // goes further (TALLY_TEST_SEED=548461427: 1.145, with the kernels before and after the bf16
  // batch norm's dx moved to double alike — 1.1 failed a clean run).
  std::string table;
  double sum_e = 0, sum_er = 0;
  for (std::size_t l = 0; l < truth.size(); ++l) {
    const double e = test::rel_error(got[l], truth[l]), er = test::rel_error(rounded[l], truth[l]);
    table += fmt::format(" {:.4f}/{:.4f}", e, er);
    sum_e += e;
    sum_er += er;
    EXPECT_LE(e, 2.0 * er + 0.005) << "layer " << l << ": bf16 kernels " << e << ", bf16 rounding alone " << er;
  }
  EXPECT_LE(sum_e, 1.2 * sum_er) << "all layers: bf16 kernels " << sum_e << ", bf16 rounding alone " << sum_er;
  std::cout << "per-layer relative gradient error against float64, bf16 kernels / rounding alone:" << table << "\n";
}

// A bf16 ResNet-20 step: its loss within 0.3% of float64's, and micro-batches of 6 adding up to
// the whole batch's loss and gradients. With group norm each sample's forward is the same bit for
// bit however the batch is split, but the float32 classifier's GEMM sums in an order that depends
// on its rows (24 or 6): its 1e-7-relative differences in the features' gradient flip a bf16
// rounding in about 2 draws of 100, and from there the backward's roundings part ways. Measured over 200 draws: 1e-6 worst
// per-tensor error, 2.5e-3-4.2e-3 in those 4 draws; bound 2e-2. A lost or doubled micro-batch, or
// a wrong loss divisor, is an error of 25% or more.
TEST_F(MixedPrecision, ResNet20LossIsCloseToFloat64AndMicroBatchesAddUp) {
  const std::int64_t B = 24;
  const Shape sample{3, 16, 16};
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const test::Data d = test::make_data(B, sample, seed);
  auto m = test::model("resnet20", "group", 5);
  auto opt = test::sgd(*m);
  double loss_full = 0, loss_micro = 0;
  const auto g_full = bf16_step_grads(*m, *opt, d, sample, {B}, &loss_full);
  const auto g_micro = bf16_step_grads(*m, *opt, d, sample, mbp::balanced_sizes(B, 4), &loss_micro);
  auto ref = test::model("resnet20", "group", 5, DType::Float64);
  const double ref_loss = test::full_batch_backward<double>(*ref, d, B, sample);
  EXPECT_NEAR(loss_full, ref_loss, 3e-3 * std::abs(ref_loss));
  EXPECT_NEAR(loss_micro, loss_full, 1e-5 * std::abs(loss_full));
  double worst = 0;
  for (std::size_t i = 0; i < g_full.size(); ++i) {
    const double e = test::rel_error(g_micro[i], g_full[i]);
    worst = std::max(worst, e);
    EXPECT_LE(e, 2e-2) << "parameter " << i << ": micro-batches of 6 against the whole batch, both bf16";
  }
  std::cout << "bf16 loss " << loss_full << ", float64 " << ref_loss
            << "; micro-batches of 6 against the whole batch: worst per-tensor relative gradient error " << worst
            << "\n";
}

// Several SGD steps (momentum 0.9, the same batches): a bf16 run follows the float64 run — whole,
// and in the micro-batches a 5 MiB budget plans (group norm: the split changes no sample's
// activations) — its parameters' distance from float64's within kStepsBound of float64's change
// from the init, its first loss (the same weights: bf16's rounding alone) within 0.2% of float64's
// and the later ones (after the parameters have drifted apart) within 3%; every step planned
// exactly. Measured over 55 draws: the distance 0.15-0.21 (one step's gradients are 4-20% off in
// bf16, docs/precision.md, carried through 4 steps of momentum), the first loss at most 0.034% off,
// the later ones at most 1.13% (seed 2536933895, the 4th step; the others below 0.5%) — the 1%
// that bound used to be failed that draw.
constexpr double kStepsBound = 0.35;
TEST_F(MixedPrecision, SgdStepsFollowFloat64WholeAndThroughMicroBatches) {
  const std::int64_t B = 24, steps = 4;
  const Shape sample{3, 16, 16};
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  struct Run {
    std::vector<double> losses;
    std::vector<std::vector<double>> params;
    std::int64_t micro_batch = 0;
  };
  // The run in `budget` bytes: the planner takes the largest micro-batch that fits.
  auto run = [&](DType dtype, mbp::Precision precision, std::size_t budget) {
    configure_arena(Device::cpu(), budget);
    auto m = test::model("resnet20", "group", 7, dtype);
    auto opt = test::sgd(*m, 0.05);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.precision = precision;
    mbp::Executor ex(*m, *opt, eo);
    Run r;
    r.micro_batch = ex.plan(B).micro_batch;
    for (std::int64_t step = 0; step < steps; ++step) {
      const test::Data d = test::make_data(B, sample, seed + static_cast<std::uint32_t>(step));
      const mbp::StepResult res = ex.step(d.images.data(), d.labels.data(), B);
      EXPECT_EQ(res.peak, res.predicted_peak) << "step " << step;
      r.losses.push_back(res.loss);
    }
    r.params = dtype == DType::Float64 ? test::values<double>(*m) : test::values<float>(*m);
    return r;
  };
  const auto init = test::values<double>(*test::model("resnet20", "group", 7, DType::Float64));
  const Run ref = run(DType::Float64, mbp::Precision::fp32, kDefaultCpuArenaBytes);
  ASSERT_EQ(ref.micro_batch, B);
  for (const std::size_t budget : {kDefaultCpuArenaBytes, parse_size("5MiB")}) {
    const Run got = run(DType::Float32, mbp::Precision::bf16, budget);
    const std::string split = fmt::format("micro-batches of {} in {} bytes", got.micro_batch, budget);
    SCOPED_TRACE(split);
    if (budget != kDefaultCpuArenaBytes) {
      EXPECT_LT(got.micro_batch, B / 2) << "the small budget should split the batch";
    }
    for (std::int64_t step = 0; step < steps; ++step)
      EXPECT_NEAR(got.losses[step], ref.losses[step], (step == 0 ? 2e-3 : 3e-2) * std::abs(ref.losses[step]))
          << "step " << step;
    double diff = 0, change = 0;
    for (std::size_t i = 0; i < ref.params.size(); ++i)
      for (std::size_t j = 0; j < ref.params[i].size(); ++j) {
        diff += (got.params[i][j] - ref.params[i][j]) * (got.params[i][j] - ref.params[i][j]);
        change += (ref.params[i][j] - init[i][j]) * (ref.params[i][j] - init[i][j]);
      }
    ASSERT_GT(change, 0) << "float64 did not move";
    const double e = std::sqrt(diff / change);
    ASSERT_TRUE(std::isfinite(e));
    EXPECT_LE(e, kStepsBound) << "bf16's parameters off float64's by " << e << " of float64's change from the init";
    std::cout << split << ": after " << steps
              << " steps, the parameters off float64 by " << e << " of its change; losses (bf16/float64)";
    for (std::int64_t step = 0; step < steps; ++step) std::cout << " " << got.losses[step] << "/" << ref.losses[step];
    std::cout << "\n";
  }
}

// The planner dry-runs the bf16 step exactly as it runs (two-byte activations), so predicted ==
// measured; the same budget fits micro-batches nearly twice the float32 ones.
TEST_F(MixedPrecision, PlansAreExactAndFitNearlyTwiceTheMicroBatch) {
  const std::size_t budget = parse_size("12MiB");
  const std::int64_t B = 96;
  const Shape sample{3, 32, 32};
  std::int64_t m_fp32 = 0, m_bf16 = 0;
  for (mbp::Precision p : {mbp::Precision::fp32, mbp::Precision::bf16}) {
    configure_arena(Device::cpu(), budget);
    auto m = test::model("resnet20", "batch", 2);
    auto opt = test::sgd(*m, 0.01);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.precision = p;
    mbp::Executor ex(*m, *opt, eo);
    const mbp::Plan& plan = ex.plan(B);
    (p == mbp::Precision::bf16 ? m_bf16 : m_fp32) = plan.micro_batch;
    for (int step = 0; step < 2; ++step) {
      const test::Data d = test::make_data(B, sample, 40 + static_cast<std::uint32_t>(step));
      const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
      EXPECT_EQ(r.peak, r.predicted_peak) << mbp::precision_name(p) << " step " << step;
      EXPECT_LE(r.peak, budget);
      EXPECT_TRUE(std::isfinite(r.loss));
    }
    std::cout << mbp::precision_name(p) << ": " << plan.summary() << "\n";
  }
  // Where oneDNN runs bf16 convolutions (AVX-512 and AMX), their two-byte workspaces too: 1.8x.
  // Elsewhere (AVX2) they take the widened float32 route, whose scratch is float32: 1.5x (1.6x
  // measured under ONEDNN_MAX_CPU_ISA=AVX2, 8 against 5).
  const double bound = expect_onednn_bf16() ? 1.8 : 1.5;
  EXPECT_GE(static_cast<double>(m_bf16), bound * static_cast<double>(m_fp32))
      << "fp32 micro-batch " << m_fp32 << ", bf16 " << m_bf16 << " (bound " << bound << "x)";
}

// The stem and the classifier run in the master weights' precision (docs/precision.md, "The first
// and last layers"): from a bf16 input, the stem's output is its float32 computation on the
// widened input rounded once to bf16, and the logits are the float32 classifier's on the widened
// features — bit for bit, through the segments (pipeline stages, recomputation) and the whole
// forward alike; every family. The stem's parameter gradients likewise.
TEST_F(MixedPrecision, TheStemAndTheClassifierRunInFloat32) {
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937 rng(seed);
  for (const char* name : {"resnet20", "resnet18", "resnet9"}) {
    SCOPED_TRACE(name);
    auto m = test::model(name, "batch");
    const Tensor x = make(bf16_values(2 * 3 * 32 * 32, rng), {2, 3, 32, 32}, DType::BFloat16);
    auto segments = m->segments();
    ASSERT_GE(segments.size(), 3u);
    const Tensor stem = segments.front().forward(x);
    const Tensor stem32 = segments.front().forward(x.to(DType::Float32));
    EXPECT_EQ(stem.dtype(), DType::BFloat16);
    EXPECT_EQ(stem32.dtype(), DType::Float32);
    EXPECT_EQ(stem.to(DType::Float32).to_vector<float>(), stem32.to(DType::BFloat16).to(DType::Float32).to_vector<float>());
    // And its parameters' gradients, bit for bit against the float32 stem's output rounded to bf16
    // (which keeps the float32 norm's output for its backward; the bf16 stem rounds before the ReLU
    // and does not). Not ResNet-18's stem: it ends in a bf16 max pool, where the rounding can tie
    // values the float32 max told apart, and the pool's gradient then picks the first of them.
    if (std::string(name) != "resnet18") {
      const Tensor g = make(bf16_values(stem.numel(), rng), stem.shape(), DType::BFloat16, Category::temporary);
      m->zero_grad();
      run_backward(segments.front().forward(x), g);
      const auto got = test::grads<float>(*m);
      m->zero_grad();
      run_backward(segments.front().forward(x.to(DType::Float32)).to(DType::BFloat16), g);
      const auto want = test::grads<float>(*m);
      m->zero_grad();
      int stem_parameters = 0;
      for (std::size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i], want[i]) << "parameter " << i;
        stem_parameters += std::any_of(want[i].begin(), want[i].end(), [](double v) { return v != 0; });
      }
      EXPECT_EQ(stem_parameters, 3) << "the stem's convolution weight and norm weight and bias have gradients";
    }
    Tensor h = stem;
    for (std::size_t i = 1; i + 1 < segments.size(); ++i) h = segments[i].forward(h);
    EXPECT_EQ(h.dtype(), DType::BFloat16);
    // The head pools in bf16 (one rounding of each pooled feature), then the classifier computes
    // in float32 on the widened features.
    const Tensor logits = segments.back().forward(h);
    Tensor want;
    if (auto* r9 = dynamic_cast<nn::ResNet9*>(m.get())) {
      const Tensor pooled = flatten(max_pool2d(h, {h.size(2), h.size(3)}, {h.size(2), h.size(3)}), 1);
      want = scale(linear(pooled.to(DType::Float32), r9->fc->weight, {}), 0.125);
    } else {
      auto* fc = dynamic_cast<nn::Linear*>(m->named_children().back().second.get());
      ASSERT_NE(fc, nullptr);
      want = linear(flatten(adaptive_avg_pool2d(h, {1, 1}), 1).to(DType::Float32), fc->weight, fc->bias);
    }
    EXPECT_EQ(logits.dtype(), DType::Float32);
    EXPECT_EQ(logits.to_vector<float>(), want.to_vector<float>());
    const Tensor y = (*m)(x);
    EXPECT_EQ(y.dtype(), DType::Float32);
    EXPECT_EQ(y.to_vector<float>(), logits.to_vector<float>());
    for (float v : y.to_vector<float>()) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST_F(MixedPrecision, NeedsAFloat32ModelAndANamedPrecision) {
  auto m = test::model("resnet20", "none", 1, DType::Float64);
  auto opt = test::sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 8, 8};
  eo.precision = mbp::Precision::bf16;
  try {
    mbp::Executor ex(*m, *opt, eo);
    FAIL() << "a float64 model was taken for bf16 mixed precision";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float32 master weights; the model is float64"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(mbp::parse_precision("bf16"), mbp::Precision::bf16);
  EXPECT_EQ(mbp::parse_precision("fp32"), mbp::Precision::fp32);
  // The error names what the caller set: the function for a C++ caller, the flag for `tally`'s
  // users (core/option_names.h).
  auto message = [] {
    try {
      mbp::parse_precision("fp16");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(), "mbp::parse_precision 'fp16': expected fp32|bf16");
  name_options_as_flags(true);
  EXPECT_EQ(message(), "--precision 'fp16': expected fp32|bf16");
  name_options_as_flags(false);
  EXPECT_FALSE(options_named_as_flags());
}
