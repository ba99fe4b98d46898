// Channels-last tensors (core/tensor.h MemoryFormat) and the ops that run on them:
//   * the layout itself: strides, is_contiguous / suggest_memory_format, conversions both ways,
//     copy_ and fill_ into a channels-last tensor, the ambiguous shapes (C == 1, H == W == 1);
//   * every op that keeps the layout (conv2d on oneDNN, batch norm with and without the fused
//     residual and ReLU, relu, add, scale, cast, sigmoid, scale_channels, concat, max_pool2d)
//     against the same op on the row-major tensor: outputs and every gradient, float64 / float32 /
//     bf16, fresh random inputs — the per-element formulas are the same, so the only differences
//     are the order of the per-channel sums (float64: 1e-12) and oneDNN's summation order in its
//     two layouts (float32: 1e-5);
//   * gradients that meet in different layouts (one consumer writes channels-last, another
//     row-major) add up exactly as in the all-row-major run;
//   * ResNet-20 training steps with ExecutorOptions::memory_format = ChannelsLast: the same
//     parameters as row-major to float32 rounding, micro-batched as well as whole, predicted ==
//     measured peak, and a dry run that allocates exactly as the real one.
#include <gtest/gtest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <random>
#include <vector>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "kernels/cpu/cpu_kernels.h"
#include "mbp/executor.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;
using MF = MemoryFormat;

namespace {

class MemoryFormatTest : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

Tensor random_tensor(const Shape& s, DType dt, std::mt19937& rng, double mean = 0.2) {
  std::normal_distribution<double> n(mean, 1.0);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(s)));
  for (double& x : v) x = n(rng);
  Tensor t = Tensor::from_vector(v, s, Device::cpu(), Category::activation);
  return dt == DType::Float64 ? t : t.to(dt);
}

std::vector<double> as_doubles(const Tensor& t) { return t.to(DType::Float64).to_vector<double>(); }

// Worst |a - b| / (|b| + 1) over the elements; a NaN anywhere fails.
double worst(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    w = std::max(w, std::abs(a[i] - b[i]) / (std::abs(b[i]) + 1.0));
  }
  return w;
}

}  // namespace

TEST_F(MemoryFormatTest, StridesConversionsAndAmbiguousShapes) {
  std::mt19937 rng(11);
  const Tensor x = random_tensor({2, 3, 4, 5}, DType::Float32, rng);
  EXPECT_TRUE(x.is_contiguous());
  EXPECT_FALSE(x.is_contiguous(MF::ChannelsLast));
  EXPECT_EQ(x.suggest_memory_format(), MF::Contiguous);
  const Tensor c = x.contiguous(MF::ChannelsLast);
  EXPECT_EQ(c.strides(), (Shape{60, 1, 15, 3}));
  EXPECT_TRUE(c.is_contiguous(MF::ChannelsLast));
  EXPECT_FALSE(c.is_contiguous());
  EXPECT_EQ(c.suggest_memory_format(), MF::ChannelsLast);
  EXPECT_EQ(c.to_vector<float>(), x.to_vector<float>());  // the same values, element by element
  // Stored NHWC: element (n, c, h, w) at ((n * H + h) * W + w) * C + c.
  const auto* raw = c.data<float>();
  const auto v = x.to_vector<float>();
  EXPECT_EQ(raw[((1 * 4 + 2) * 5 + 3) * 3 + 1], v[((1 * 3 + 1) * 4 + 2) * 5 + 3]);
  EXPECT_EQ(c.contiguous().to_vector<float>(), v);
  EXPECT_TRUE(c.contiguous(MF::ChannelsLast).same(c));  // already channels-last: itself
  // copy_ into a channels-last tensor, from either layout; fill_.
  Tensor d = Tensor::empty(x.shape(), DType::Float32, Device::cpu(), Category::activation, "d", MF::ChannelsLast);
  d.copy_(x);
  EXPECT_EQ(d.to_vector<float>(), v);
  d.fill_(2.5);
  d.copy_(c);
  EXPECT_EQ(d.to_vector<float>(), v);
  d.fill_(2.5);
  for (float e : d.to_vector<float>()) EXPECT_EQ(e, 2.5f);
  // C == 1 and H == W == 1: the two layouts are the same bytes, and such a tensor is row-major.
  for (const Shape& s : {Shape{2, 1, 3, 3}, Shape{4, 8, 1, 1}}) {
    const Tensor a = Tensor::empty(s, DType::Float32, Device::cpu(), Category::activation, "a", MF::ChannelsLast);
    EXPECT_TRUE(a.is_contiguous());
    EXPECT_EQ(a.suggest_memory_format(), MF::Contiguous);
  }
  // Only 4-d tensors have a channels-last layout.
  EXPECT_THROW(Tensor::empty({2, 3}, DType::Float32, Device::cpu(), Category::activation, "e", MF::ChannelsLast),
               ShapeError);
  EXPECT_THROW(random_tensor({2, 3, 4}, DType::Float32, rng).contiguous(MF::ChannelsLast), ShapeError);
}

namespace {

const std::function<bool(DType)> always = [](DType) { return true; };
const std::function<bool(DType)> never = [](DType) { return false; };

// One forward and backward of `f` on (x, r) as given, returning the output and the gradients of
// x, r and the parameters; `format` is the inputs' layout.
struct OpRun {
  std::vector<std::vector<double>> all;
  MF out_format = MF::Contiguous;
};

using OpFn = std::function<Tensor(const Tensor& x, const Tensor& r, const std::vector<Tensor>& params)>;

OpRun run_op(const OpFn& f, MF format, DType act, std::uint32_t seed, const Shape& xs, const Shape& rs,
           const std::vector<Shape>& param_shapes) {
  std::mt19937 rng(seed);
  const DType pdt = act == DType::BFloat16 ? DType::Float32 : act;
  Tensor x = random_tensor(xs, act, rng).contiguous(format);
  Tensor r = random_tensor(rs, act, rng).contiguous(format);
  std::vector<Tensor> params;
  for (const Shape& s : param_shapes) params.push_back(random_tensor(s, pdt, rng));
  for (Tensor* t : {&x, &r}) t->set_requires_grad(true);
  for (Tensor& p : params) p.set_requires_grad(true);
  Tensor y = f(x, r, params);
  const Tensor gy = random_tensor(y.shape(), y.dtype(), rng);
  OpRun out;
  out.out_format = y.suggest_memory_format();
  // sum(y * gy) as the loss: its gradient is gy, whatever layout y has.
  sum(mul(y.to(DType::Float64), gy.to(DType::Float64))).backward();
  out.all.push_back(as_doubles(y));
  out.all.push_back(as_doubles(x.grad()));
  if (r.grad().defined()) out.all.push_back(as_doubles(r.grad()));
  for (const Tensor& p : params) out.all.push_back(as_doubles(p.grad()));
  return out;
}

void expect_same_in_both_layouts(const char* what, const OpFn& f, const Shape& xs, const Shape& rs,
                                 const std::vector<Shape>& ps, double tol64, double tol32, double tol16,
                                 const std::function<bool(DType)>& keeps_layout) {
  for (DType act : {DType::Float64, DType::Float32, DType::BFloat16}) {
    SCOPED_TRACE(std::string(what) + " " + dtype_name(act));
    const OpRun rm = run_op(f, MF::Contiguous, act, 21, xs, rs, ps);
    const OpRun cl = run_op(f, MF::ChannelsLast, act, 21, xs, rs, ps);
    ASSERT_EQ(rm.all.size(), cl.all.size());
    const double tol = act == DType::Float64 ? tol64 : act == DType::Float32 ? tol32 : tol16;
    for (std::size_t i = 0; i < rm.all.size(); ++i) {
      const double w = worst(cl.all[i], rm.all[i]);
      EXPECT_LE(w, tol) << "tensor " << i << " (0: output, then gradients)";
    }
    EXPECT_EQ(rm.out_format, MF::Contiguous);
    if (keeps_layout(act)) {
      EXPECT_EQ(cl.out_format, MF::ChannelsLast) << "the output keeps the input's layout";
    }
  }
}

}  // namespace

TEST_F(MemoryFormatTest, ElementwiseOpsKeepTheLayoutAndAgree) {
  const Shape s{3, 6, 5, 4};
  const OpFn f = [](const Tensor& x, const Tensor& r, const std::vector<Tensor>&) {
    return scale(relu(add(x, r)), 0.5).to(x.dtype() == DType::BFloat16 ? DType::Float32 : x.dtype());
  };
  expect_same_in_both_layouts("relu(add) scale cast", f, s, s, {}, 0, 0, 0, always);
  // Mixed layouts: b row-major added to a channels-last a (converted to a's layout).
  std::mt19937 rng(3);
  const Tensor a = random_tensor(s, DType::Float32, rng), b = random_tensor(s, DType::Float32, rng);
  const Tensor y = add(a.contiguous(MF::ChannelsLast), b);
  EXPECT_EQ(y.suggest_memory_format(), MF::ChannelsLast);
  EXPECT_EQ(y.to_vector<float>(), add(a, b).to_vector<float>());
}

// sigmoid, scale_channels and concat keep the layout and agree bit for bit (the same per-element
// formulas; scale_channels' ds sums each (n, c) in the same order in both layouts), float64,
// float32 and bf16; a squeeze-and-excitation gate (pool, sigmoid, scale) on a channels-last x.
TEST_F(MemoryFormatTest, SigmoidScaleChannelsAndConcatKeepTheLayoutAndAgree) {
  const Shape s{3, 6, 5, 4};
  expect_same_in_both_layouts(
      "sigmoid", [](const Tensor& x, const Tensor& r, const std::vector<Tensor>&) { return sigmoid(add(x, r)); }, s, s,
      {}, 0, 0, 0, always);
  expect_same_in_both_layouts(
      "scale_channels",
      [](const Tensor& x, const Tensor& r, const std::vector<Tensor>&) { return scale_channels(x, r); }, s,
      {3, 6, 1, 1}, {}, 0, 0, 0, always);
  // x's gradient meets in two layouts here (the pool's is row-major): bf16 adds the pool's share
  // rounded to bf16 once more than the all-row-major run, which accumulates it in float32 (one
  // bf16 rounding apart, as the batch norm's 1/128 below).
  expect_same_in_both_layouts(
      "squeeze-and-excitation",
      [](const Tensor& x, const Tensor&, const std::vector<Tensor>&) {
        return scale_channels(x, sigmoid(adaptive_avg_pool2d(x, {1, 1})));
      },
      s, {3, 6, 1, 1}, {}, 0, 0, 1.0 / 128, always);
  expect_same_in_both_layouts(
      "concat",
      [](const Tensor& x, const Tensor& r, const std::vector<Tensor>&) { return concat({x, r, sigmoid(x)}); }, s,
      {3, 2, 5, 4}, {}, 0, 0, 0, always);
}

// concat's inputs share one layout: channels-last and row-major 4-d tensors mixed are an error
// naming both; a tensor whose bytes are the same in both layouts (one channel) joins either; a
// view dense in neither is converted.
TEST_F(MemoryFormatTest, ConcatTakesOneLayout) {
  std::mt19937 rng(5);
  const Tensor a = random_tensor({2, 3, 4, 5}, DType::Float32, rng);
  const Tensor b = random_tensor({2, 2, 4, 5}, DType::Float32, rng);
  const Tensor one = random_tensor({2, 1, 4, 5}, DType::Float32, rng);
  try {
    concat({a.contiguous(MF::ChannelsLast), b});
    ADD_FAILURE() << "mixed layouts were accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("expected channels_last (as input 0), found contiguous at input 1"),
              std::string::npos)
        << e.what();
  }
  const Tensor want = concat({a, one, b});
  const Tensor y = concat({a.contiguous(MF::ChannelsLast), one, b.contiguous(MF::ChannelsLast)});
  EXPECT_EQ(y.suggest_memory_format(), MF::ChannelsLast);
  EXPECT_EQ(y.to_vector<float>(), want.to_vector<float>());
  // (2, 3, 4, 5), dense in neither layout
  const Tensor view = random_tensor({2, 5, 4, 3}, DType::Float32, rng).transpose(1, 3);
  const Tensor v = concat({a.contiguous(MF::ChannelsLast), view});
  EXPECT_EQ(v.suggest_memory_format(), MF::ChannelsLast);
  EXPECT_EQ(v.to_vector<float>(), concat({a, view.contiguous()}).to_vector<float>());
}

TEST_F(MemoryFormatTest, BatchNormFusedAndPlainAgreeInBothLayouts) {
  const Shape s{4, 16, 6, 5};  // 16 channels: the channel loop is a vector's width
  for (bool residual : {false, true})
    for (bool relu_after : {false, true}) {
      const OpFn f = [=](const Tensor& x, const Tensor& r, const std::vector<Tensor>& p) {
        BatchNormOptions o;
        o.relu = relu_after;
        return batch_norm(x, p[0], p[1], Tensor(), Tensor(), o, residual ? r : Tensor());
      };
      // float64: the sums are added in another order (1e-12); bf16: one rounding of a value whose
      // statistics moved in the last bits of double can land on the other side (2^-8 relative).
      expect_same_in_both_layouts(residual ? (relu_after ? "bn+add+relu" : "bn+add") : (relu_after ? "bn+relu" : "bn"),
                                  f, s, s, {{16}, {16}}, 1e-12, 1e-5, 1.0 / 128, always);
    }
}

// The channels-last batch norms' AVX-512 copy against their baseline copy: the same loops without
// contraction, so the same bits — outputs and every gradient. On a processor without AVX-512 (or a
// build whose compiler made no such copy) the request is refused and the baseline stays: that is
// what is checked there, rather than skipping (no test may depend on the processor).
TEST_F(MemoryFormatTest, Avx512AndBaselineBatchNormsGiveTheSameBits) {
  if (!kernels::cpu::set_avx512_kernels(true)) {
    EXPECT_FALSE(kernels::cpu::avx512_kernels()) << "refused, yet the AVX-512 copy is selected";
    std::cout << "no AVX-512 copy on this processor or build: the request was refused, the baseline runs\n";
    return;
  }
  const Shape s{4, 24, 5, 7};  // 24 channels: a vector and a half of float32
  for (DType act : {DType::Float64, DType::Float32, DType::BFloat16})
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(std::string(dtype_name(act)) + " variant " + std::to_string(variant));
      const bool residual = variant & 1, relu_after = variant & 2;
      const OpFn f = [=](const Tensor& x, const Tensor& r, const std::vector<Tensor>& p) {
        BatchNormOptions o;
        o.relu = relu_after;
        return batch_norm(x, p[0], p[1], Tensor(), Tensor(), o, residual ? r : Tensor());
      };
      kernels::cpu::set_avx512_kernels(true);
      const OpRun wide = run_op(f, MF::ChannelsLast, act, 33, s, s, {{24}, {24}});
      kernels::cpu::set_avx512_kernels(false);
      EXPECT_FALSE(kernels::cpu::avx512_kernels());
      const OpRun base = run_op(f, MF::ChannelsLast, act, 33, s, s, {{24}, {24}});
      kernels::cpu::set_avx512_kernels(true);
      ASSERT_EQ(wide.all.size(), base.all.size());
      for (std::size_t i = 0; i < wide.all.size(); ++i) EXPECT_EQ(wide.all[i], base.all[i]) << "tensor " << i;
    }
}

TEST_F(MemoryFormatTest, ConvolutionAgreesInBothLayouts) {
  const Shape xs{3, 16, 9, 8};
  for (int stride : {1, 2}) {
    const OpFn f = [=](const Tensor& x, const Tensor&, const std::vector<Tensor>& p) {
      Conv2dOptions o;
      o.stride = {stride, stride};
      o.padding = {1, 1};
      return conv2d(x, p[0], Tensor(), o);
    };
    // float64 runs row-major (no oneDNN): the same kernel, bit for bit; float32 and bf16 run
    // oneDNN's NHWC and blocked convolutions, which sum in different orders.
    const bool onednn = kernels::cpu::conv_algorithm() == kernels::cpu::ConvAlgorithm::onednn;
    for (DType act : {DType::Float32, DType::BFloat16}) {
      kernels::Conv2dShape cs{3, 16, 9, 8, 32, 3, 3, stride, stride, 1, 1};
      const bool takes = act == DType::BFloat16 ? kernels::cpu::conv2d_takes_channels_last<kernels::bf16>(cs)
                                                : kernels::cpu::conv2d_takes_channels_last<float>(cs);
      EXPECT_EQ(takes, onednn && kernels::cpu::conv2d_on_onednn(cs, kernels::ConvPass::forward, act == DType::BFloat16));
    }
    EXPECT_FALSE(kernels::cpu::conv2d_takes_channels_last<double>(kernels::Conv2dShape{3, 16, 9, 8, 32, 3, 3}));
    // The output keeps the input's channels-last layout where oneDNN runs the convolution: float32,
    // and bf16 only on a processor oneDNN 2.x has bf16 convolutions for (AVX-512; kernels/cpu/conv_onednn.cpp).
    const kernels::Conv2dShape shape{3, 16, 9, 8, 32, 3, 3, stride, stride, 1, 1};
    expect_same_in_both_layouts("conv2d", f, xs, xs, {{32, 16, 3, 3}}, 0, 1e-5, 1.0 / 64, [=](DType d) {
      return onednn && d != DType::Float64 &&
             kernels::cpu::conv2d_on_onednn(shape, kernels::ConvPass::forward, d == DType::BFloat16);
    });
  }
  // The stem's 3 input channels.
  const OpFn stem = [](const Tensor& x, const Tensor&, const std::vector<Tensor>& p) {
    Conv2dOptions o;
    o.padding = {1, 1};
    return conv2d(x, p[0], Tensor(), o);
  };
  expect_same_in_both_layouts("stem conv2d", stem, {2, 3, 8, 8}, {2, 3, 8, 8}, {{16, 3, 3, 3}}, 0, 1e-5, 1.0 / 64,
                              never);
}

TEST_F(MemoryFormatTest, MaxPoolGivesItsOutputBackChannelsLast) {
  const OpFn f = [](const Tensor& x, const Tensor&, const std::vector<Tensor>&) {
    return max_pool2d(x, {3, 3}, {2, 2}, {1, 1});
  };
  expect_same_in_both_layouts("max_pool2d", f, {2, 8, 9, 9}, {2, 8, 9, 9}, {}, 0, 0, 0, always);
}

// x feeds a channels-last batch norm (its gradient written channels-last) and an average pool
// (row-major): the two gradients meet in different layouts and must add up as row-major ones do.
TEST_F(MemoryFormatTest, GradientsMeetingInTwoLayoutsAddUp) {
  const OpFn f = [](const Tensor& x, const Tensor&, const std::vector<Tensor>& p) {
    BatchNormOptions o;
    o.relu = true;
    const Tensor a = batch_norm(x, p[0], p[1], Tensor(), Tensor(), o);
    const Tensor b = avg_pool2d(x, {2, 2}, {2, 2});
    const Tensor c = avg_pool2d(a, {2, 2}, {2, 2});
    return add(b, c);
  };
  expect_same_in_both_layouts("bn and pool of one x", f, {2, 16, 6, 6}, {2, 16, 6, 6}, {{16}, {16}}, 1e-12, 1e-5,
                              1.0 / 128, never);
}

namespace {

struct Trained {
  std::vector<std::vector<double>> params;
  std::vector<mbp::StepResult> steps;
};

Trained train(MF format, std::optional<std::int64_t> micro, bool dry_first) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 12;
  auto m = model("resnet20", "batch", 5, DType::Float32);
  auto opt = sgd(*m, 0.1);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = micro;
  eo.memory_format = format;
  mbp::Executor ex(*m, *opt, eo);
  if (dry_first) ex.plan(B);
  Trained r;
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(B, sample, 90 + static_cast<std::uint32_t>(step));
    r.steps.push_back(ex.step(d.images.data(), d.labels.data(), B));
  }
  r.params = values<float>(*m);
  return r;
}

}  // namespace

TEST_F(MemoryFormatTest, ResNetStepsAgreeWithRowMajorAndArePlannedExactly) {
  // BatchNorm normalizes each micro-batch by its own statistics: a split is compared with the
  // same split in the other layout.
  const Trained rm = train(MF::Contiguous, std::nullopt, false);
  const Trained cl = train(MF::ChannelsLast, std::nullopt, true);
  const Trained rm_micro = train(MF::Contiguous, 4, false);
  const Trained cl_micro = train(MF::ChannelsLast, 4, false);
  double w = 0, wm = 0;
  for (std::size_t i = 0; i < rm.params.size(); ++i) {
    w = std::max(w, rel_error(cl.params[i], rm.params[i]));
    wm = std::max(wm, rel_error(cl_micro.params[i], rm_micro.params[i]));
  }
  std::cout << fmt::format("channels_last vs contiguous after 3 SGD steps: worst parameter {:.2e} (whole batch), "
                           "{:.2e} (micro-batches of 4)\n", w, wm);
  // The whole batch of 12 at 16x16 parts by 8.25e-4 on an AVX2 processor (oneDNN's avx2 kernels
  // sum the two layouts' convolutions in orders further apart; measured on an AMD EPYC) and by
  // under 1e-4 on AVX-512 ones; its micro-batches of 4 by 1.1e-6 on both.
  EXPECT_LE(w, 2e-3);
  EXPECT_LE(wm, 1e-4);
  for (const Trained* t : {&rm, &cl, &rm_micro, &cl_micro})
    for (const auto& s : t->steps) {
      EXPECT_EQ(s.peak, s.predicted_peak) << "predicted == measured";
      EXPECT_TRUE(std::isfinite(s.loss));
    }
  EXPECT_EQ(cl_micro.steps[0].micro_batches, 3);
}

TEST_F(MemoryFormatTest, ExecutorRefusesChannelsLastWhereItCannotApply) {
  auto m = model("resnet20", "batch", 5, DType::Float32);
  auto opt = sgd(*m, 0.1);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3 * 16 * 16};
  eo.memory_format = MF::ChannelsLast;
  try {
    mbp::Executor ex(*m, *opt, eo);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("channels_last is a layout of images"), std::string::npos) << e.what();
  }
  EXPECT_EQ(mbp::parse_memory_format("channels_last", Device::cpu()), MF::ChannelsLast);
  EXPECT_EQ(mbp::parse_memory_format("contiguous", Device::cpu()), MF::Contiguous);
  EXPECT_EQ(mbp::parse_memory_format("auto", Device::cpu()), preferred_memory_format(Device::cpu()));
  EXPECT_EQ(mbp::parse_memory_format("auto", Device::cpu(), true), MF::Contiguous);  // pipeline stages
  // CUDA: channels-last where the convolutions run on tensor cores (bf16, TF32), not plain float32.
  EXPECT_EQ(mbp::parse_memory_format("auto", Device::cuda(0)), MF::Contiguous);
  EXPECT_EQ(mbp::parse_memory_format("auto", Device::cuda(0), false, true), MF::ChannelsLast);
  EXPECT_EQ(mbp::parse_memory_format("auto", Device::cuda(0), true, true), MF::Contiguous);  // a stage
  EXPECT_EQ(preferred_memory_format(Device::cpu()), kernels::cpu::conv_algorithm() == kernels::cpu::ConvAlgorithm::onednn
                                                        ? MF::ChannelsLast
                                                        : MF::Contiguous);
  EXPECT_THROW(mbp::parse_memory_format("nhwc", Device::cpu()), Error);
}
