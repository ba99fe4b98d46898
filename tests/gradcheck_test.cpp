// Float64 finite-difference gradient checks of every op and option, through the autograd engine.
// For an op y = f(inputs), L = sum(y * r) with r random; each input's analytic gradient from
// backward() is compared with central differences of L (h = 1e-6).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "core/autograd.h"
#include "core/ops.h"

using namespace tally;

namespace {

Tensor rand64(const Shape& s, std::mt19937& rng, double lo = -1, double hi = 1) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(s)));
  for (auto& x : v) x = u(rng);
  return Tensor::from_vector(v, s, Device::cpu(), Category::parameter);
}

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// Checks d(sum(f(x) * r))/dx for every input with requires_grad.
void gradcheck(const Fn& f, std::vector<Tensor> inputs, std::uint32_t seed = 1, double tol = 1e-6) {
  std::mt19937 rng(seed);
  for (auto& t : inputs)
    if (t.requires_grad()) t.zero_grad();
  Tensor r;
  {
    Tensor y = f(inputs);
    r = rand64(y.shape(), rng);
    Tensor loss = y.dim() == 0 ? mul(y, r) : sum(mul(y, r));
    loss.backward();
  }
  auto L = [&]() {
    NoGradGuard ng;
    Tensor y = f(inputs);
    return (y.dim() == 0 ? mul(y, r) : sum(mul(y, r))).item();
  };
  const double h = 1e-6;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    Tensor& x = inputs[k];
    if (!x.requires_grad()) continue;
    ASSERT_TRUE(x.grad().defined()) << "input " << k << " got no gradient";
    // In x's storage order (a channels-last input is perturbed element by element of its bytes).
    const Tensor grad = x.grad().contiguous(x.suggest_memory_format());
    const std::vector<double> analytic(grad.data<double>(), grad.data<double>() + grad.numel());
    double* p = x.data<double>();
    double max_err = 0, max_ref = 0;
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const double old = p[i];
      p[i] = old + h;
      const double lp = L();
      p[i] = old - h;
      const double lm = L();
      p[i] = old;
      const double num = (lp - lm) / (2 * h);
      ASSERT_TRUE(std::isfinite(analytic[static_cast<std::size_t>(i)])) << "NaN/inf gradient, input " << k;
      max_err = std::max(max_err, std::abs(num - analytic[static_cast<std::size_t>(i)]));
      max_ref = std::max(max_ref, std::abs(num));
    }
    EXPECT_LE(max_err, tol * std::max(1.0, max_ref)) << "input " << k << " " << x.str() << " max abs error " << max_err
                                                      << " (largest gradient " << max_ref << ")";
    EXPECT_GT(max_ref, 0.0) << "input " << k << ": all-zero gradient proves nothing";
  }
}

Tensor req(Tensor t) {
  t.set_requires_grad(true);
  return t;
}

struct ConvCase {
  Shape x, w;
  Conv2dOptions o;
  bool bias;
};

}  // namespace

TEST(GradCheck, Conv2d) {
  std::mt19937 rng(10);
  std::vector<ConvCase> cases;
  cases.push_back({{2, 3, 6, 5}, {4, 3, 3, 3}, {}, true});
  ConvCase c;
  c = {{2, 4, 7, 7}, {3, 4, 3, 3}, {}, false};
  c.o.stride = {2, 2}; c.o.padding = {1, 1};
  cases.push_back(c);
  c = {{1, 2, 9, 8}, {3, 2, 3, 3}, {}, true};
  c.o.padding = {2, 2}; c.o.dilation = {2, 2};
  cases.push_back(c);
  c = {{2, 4, 5, 5}, {6, 2, 3, 3}, {}, true};
  c.o.groups = 2; c.o.padding = {1, 1};
  cases.push_back(c);
  c = {{1, 3, 6, 6}, {3, 1, 3, 3}, {}, false};
  c.o.groups = 3; c.o.stride = {2, 1}; c.o.padding = {1, 0};
  cases.push_back(c);
  c = {{2, 5, 4, 4}, {3, 5, 1, 1}, {}, false};
  cases.push_back(c);
  for (const auto& cc : cases) {
    SCOPED_TRACE(shape_str(cc.x) + " w" + shape_str(cc.w));
    std::vector<Tensor> in{req(rand64(cc.x, rng)), req(rand64(cc.w, rng))};
    if (cc.bias) in.push_back(req(rand64({cc.w[0]}, rng)));
    gradcheck([&](const std::vector<Tensor>& t) { return conv2d(t[0], t[1], cc.bias ? t[2] : Tensor(), cc.o); }, in);
  }
}

TEST(GradCheck, LinearAndMatmul) {
  std::mt19937 rng(11);
  gradcheck([](const std::vector<Tensor>& t) { return linear(t[0], t[1], t[2]); },
            {req(rand64({5, 7}, rng)), req(rand64({4, 7}, rng)), req(rand64({4}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return linear(t[0], t[1]); },
            {req(rand64({3, 2}, rng)), req(rand64({6, 2}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return matmul(t[0], t[1]); },
            {req(rand64({3, 5}, rng)), req(rand64({5, 4}, rng))});
}

TEST(GradCheck, BatchNorm) {
  std::mt19937 rng(12);
  Tensor rm = rand64({3}, rng), rv = rand64({3}, rng, 0.5, 1.5);
  BatchNormOptions train;
  gradcheck([&](const std::vector<Tensor>& t) { return batch_norm(t[0], t[1], t[2], rm, rv, train); },
            {req(rand64({4, 3, 3, 2}, rng)), req(rand64({3}, rng)), req(rand64({3}, rng))});
  gradcheck([&](const std::vector<Tensor>& t) { return batch_norm(t[0], {}, {}, {}, {}, train); },
            {req(rand64({5, 2, 2, 2}, rng))});
  gradcheck([&](const std::vector<Tensor>& t) { return batch_norm(t[0], t[1], t[2], {}, {}, train); },
            {req(rand64({6, 4}, rng)), req(rand64({4}, rng)), req(rand64({4}, rng))});  // (N, C) input
  BatchNormOptions eval;
  eval.training = false;
  gradcheck([&](const std::vector<Tensor>& t) { return batch_norm(t[0], t[1], t[2], rm, rv, eval); },
            {req(rand64({2, 3, 3, 3}, rng)), req(rand64({3}, rng)), req(rand64({3}, rng))});
}

// The fused batch norm + residual add + ReLU (BatchNormOptions::relu): x, the residual, weight, bias.
TEST(GradCheck, BatchNormFusedWithResidualAndRelu) {
  std::mt19937 rng(3);
  BatchNormOptions fused;
  fused.relu = true;
  gradcheck([&](const std::vector<Tensor>& t) { return batch_norm(t[0], t[2], t[3], {}, {}, fused, t[1]); },
            {req(rand64({2, 3, 3, 4}, rng)), req(rand64({2, 3, 3, 4}, rng)), req(rand64({3}, rng)),
             req(rand64({3}, rng))});
}

TEST(GradCheck, GroupNormFusedWithResidualAndRelu) {
  std::mt19937 rng(4);
  gradcheck([](const std::vector<Tensor>& t) { return group_norm(t[0], 3, t[2], t[3], 1e-5, true, t[1]); },
            {req(rand64({2, 6, 3, 2}, rng)), req(rand64({2, 6, 3, 2}, rng)), req(rand64({6}, rng)),
             req(rand64({6}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return group_norm(t[0], 2, {}, {}, 1e-5, false, t[1]); },
            {req(rand64({3, 4, 2, 2}, rng)), req(rand64({3, 4, 2, 2}, rng))});
}

TEST(GradCheck, GroupNorm) {
  std::mt19937 rng(13);
  for (std::int64_t g : {1, 2, 3, 6}) {
    SCOPED_TRACE(g);
    gradcheck([g](const std::vector<Tensor>& t) { return group_norm(t[0], g, t[1], t[2]); },
              {req(rand64({2, 6, 3, 2}, rng)), req(rand64({6}, rng)), req(rand64({6}, rng))});
  }
  gradcheck([](const std::vector<Tensor>& t) { return group_norm(t[0], 2); }, {req(rand64({3, 4, 2, 2}, rng))});
}

TEST(GradCheck, Elementwise) {
  std::mt19937 rng(14);
  // relu: keep inputs away from the kink
  Tensor x = rand64({3, 4, 5}, rng);
  {
    double* p = x.data<double>();
    for (std::int64_t i = 0; i < x.numel(); ++i)
      if (std::abs(p[i]) < 0.05) p[i] = 0.3;
  }
  gradcheck([](const std::vector<Tensor>& t) { return relu(t[0]); }, {req(x)});
  gradcheck([](const std::vector<Tensor>& t) { return add(t[0], t[1]); }, {req(rand64({2, 3}, rng)), req(rand64({2, 3}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return sub(t[0], t[1]); }, {req(rand64({2, 3}, rng)), req(rand64({2, 3}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return mul(t[0], t[1]); }, {req(rand64({4, 2}, rng)), req(rand64({4, 2}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return scale(t[0], 0.37); }, {req(rand64({5}, rng))});
  // one tensor used twice: gradients from both uses must add up
  gradcheck([](const std::vector<Tensor>& t) { return mul(t[0], t[0]); }, {req(rand64({6}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return add(t[0], t[0]); }, {req(rand64({6}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { Tensor h = scale(t[0], 2.0); return mul(add(h, t[0]), h); },
            {req(rand64({7}, rng))});
}

TEST(GradCheck, Sigmoid) {
  std::mt19937 rng(19);
  gradcheck([](const std::vector<Tensor>& t) { return sigmoid(t[0]); }, {req(rand64({3, 4, 5}, rng, -4, 4))});
  gradcheck([](const std::vector<Tensor>& t) { return sigmoid(t[0]); },
            {req(rand64({2, 3, 4, 2}, rng, -3, 3).contiguous(MemoryFormat::ChannelsLast))});
  // composed: sigmoid(x) * x (the swish), x reaching the product twice
  gradcheck([](const std::vector<Tensor>& t) { return mul(sigmoid(t[0]), t[0]); }, {req(rand64({7}, rng, -2, 2))});
}

// Dropout with a fixed key (seed, step, first sample): a fixed mask, so y = x * m is checked like any
// op; both layouts, and p = 0.5 so both kinds of element are there.
TEST(GradCheck, Dropout) {
  std::mt19937 rng(23);
  const auto f = [](const std::vector<Tensor>& t) { return dropout(t[0], 0.5, 1234, SampleIndex{7, 100}); };
  gradcheck(f, {req(rand64({3, 4, 5}, rng))});
  gradcheck(f, {req(rand64({2, 3, 4, 2}, rng).contiguous(MemoryFormat::ChannelsLast))});
  gradcheck([](const std::vector<Tensor>& t) { return mul(dropout(t[0], 0.3, 99, SampleIndex{}), t[0]); },
            {req(rand64({4, 6}, rng))});
}

// x (N, C, H, W) times s (N, C, 1, 1) or (N, C), both layouts of x; and a squeeze-and-excitation
// gate, where x reaches the output directly and through s.
TEST(GradCheck, ScaleChannels) {
  std::mt19937 rng(20);
  const auto f = [](const std::vector<Tensor>& t) { return scale_channels(t[0], t[1]); };
  gradcheck(f, {req(rand64({2, 3, 4, 5}, rng)), req(rand64({2, 3, 1, 1}, rng))});
  gradcheck(f, {req(rand64({3, 2, 3, 3}, rng)), req(rand64({3, 2}, rng))});
  gradcheck(f, {req(rand64({2, 5, 3, 2}, rng).contiguous(MemoryFormat::ChannelsLast)), req(rand64({2, 5, 1, 1}, rng))});
  gradcheck(f, {req(rand64({4, 3, 5}, rng)), req(rand64({4, 3, 1}, rng))});  // (N, C, L)
  gradcheck(f, {rand64({2, 3, 4, 4}, rng), req(rand64({2, 3}, rng))});     // only s needs a gradient
  gradcheck(f, {req(rand64({2, 3, 4, 4}, rng)), rand64({2, 3}, rng)});     // only x
  gradcheck(
      [](const std::vector<Tensor>& t) {
        const Tensor squeeze = adaptive_avg_pool2d(t[0], {1, 1});  // (N, C, 1, 1)
        return scale_channels(t[0], sigmoid(scale(squeeze, 3.0)));
      },
      {req(rand64({2, 4, 3, 3}, rng).contiguous(MemoryFormat::ChannelsLast))});
}

TEST(GradCheck, Concat) {
  std::mt19937 rng(21);
  gradcheck([](const std::vector<Tensor>& t) { return concat({t[0], t[1], t[2]}); },
            {req(rand64({2, 3, 4, 4}, rng)), req(rand64({2, 1, 4, 4}, rng)), req(rand64({2, 2, 4, 4}, rng))});
  const MemoryFormat cl = MemoryFormat::ChannelsLast;
  gradcheck([](const std::vector<Tensor>& t) { return concat({t[0], t[1]}, -3); },
            {req(rand64({2, 3, 3, 2}, rng).contiguous(cl)), req(rand64({2, 4, 3, 2}, rng).contiguous(cl))});
  // one input twice (its gradient gets both slices), one without a gradient, 2-d tensors
  gradcheck([](const std::vector<Tensor>& t) { return concat({t[0], t[1], t[0]}); },
            {req(rand64({3, 2, 2, 2}, rng)), rand64({3, 3, 2, 2}, rng)});
  gradcheck([](const std::vector<Tensor>& t) { return concat({t[0], t[1]}); },
            {req(rand64({4, 3}, rng)), req(rand64({4, 5}, rng))});
}

TEST(GradCheck, Pooling) {
  std::mt19937 rng(15);
  gradcheck([](const std::vector<Tensor>& t) { return max_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}); }, {req(rand64({2, 2, 7, 7}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return max_pool2d(t[0], {2, 2}, {2, 2}); }, {req(rand64({1, 3, 6, 5}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return avg_pool2d(t[0], {2, 2}, {2, 2}); }, {req(rand64({2, 2, 6, 6}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return avg_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}, true); }, {req(rand64({1, 2, 7, 6}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return avg_pool2d(t[0], {3, 3}, {2, 2}, {1, 1}, false); }, {req(rand64({1, 2, 7, 6}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return adaptive_avg_pool2d(t[0], {3, 2}); }, {req(rand64({2, 3, 7, 5}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return adaptive_avg_pool2d(t[0], {1, 1}); }, {req(rand64({2, 4, 5, 5}, rng))});
}

TEST(GradCheck, ShapeAndReductions) {
  std::mt19937 rng(16);
  gradcheck([](const std::vector<Tensor>& t) { return flatten(t[0]); }, {req(rand64({2, 3, 2, 2}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return reshape(t[0], {3, -1}); }, {req(rand64({2, 3}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return sum(t[0]); }, {req(rand64({3, 4}, rng))});
  gradcheck([](const std::vector<Tensor>& t) { return mean(t[0]); }, {req(rand64({3, 4}, rng))});
}

TEST(GradCheck, CrossEntropy) {
  std::mt19937 rng(17);
  const Tensor targets = Tensor::from_vector(std::vector<std::int64_t>{0, 2, 1, 4, 2, 3}, {6});
  const Tensor weight = rand64({5}, rng, 0.2, 2.0);
  std::vector<std::pair<const char*, CrossEntropyOptions>> cases;
  CrossEntropyOptions o;
  cases.push_back({"mean", o});
  o.reduction = Reduction::Sum;
  cases.push_back({"sum", o});
  o = {};
  o.label_smoothing = 0.1;
  cases.push_back({"smoothing", o});
  o = {};
  o.ignore_index = 2;
  cases.push_back({"ignore_index", o});
  o = {};
  o.weight = weight;
  cases.push_back({"weight", o});
  o = {};
  o.weight = weight;
  o.ignore_index = 1;
  o.label_smoothing = 0.2;
  cases.push_back({"all", o});
  o = {};
  o.divisor = 17.0;
  o.ignore_index = 4;
  cases.push_back({"divisor", o});
  for (auto& [name, opt] : cases) {
    SCOPED_TRACE(name);
    gradcheck([&, opt = opt](const std::vector<Tensor>& t) { return cross_entropy(t[0], targets, opt); },
              {req(rand64({6, 5}, rng, -2, 2))});
  }
}

TEST(GradCheck, ResidualBlockComposite) {
  std::mt19937 rng(18);
  Conv2dOptions same;
  same.padding = {1, 1};
  Tensor rm = rand64({3}, rng), rv = rand64({3}, rng, 0.5, 1.5);
  gradcheck(
      [&](const std::vector<Tensor>& t) {
        Tensor h = relu(batch_norm(conv2d(t[0], t[1], {}, same), t[2], t[3], rm, rv));
        h = group_norm(conv2d(h, t[4], {}, same), 3, t[2], t[3]);
        return relu(add(h, t[0]));
      },
      {req(rand64({2, 3, 4, 4}, rng)), req(rand64({3, 3, 3, 3}, rng)), req(rand64({3}, rng, 0.5, 1.5)),
       req(rand64({3}, rng)), req(rand64({3, 3, 3, 3}, rng))},
      1, 1e-5);
}
