// Autograd engine: memory behaviour (activations freed during backward, gradients persistent),
// dry runs allocating exactly like real runs, accumulation, grad mode.
#include <gtest/gtest.h>

#include <random>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"

using namespace tally;

namespace {

Tensor randn(const Shape& s, std::mt19937& rng, Category cat, float scale = 1.f) {
  std::normal_distribution<float> n(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(shape_numel(s)));
  for (auto& x : v) x = n(rng);
  return Tensor::from_vector(v, s, Device::cpu(), cat);
}

// A small residual network: conv-bn-relu, a residual block, pooling, linear.
struct Net {
  std::vector<Tensor> params;
  Tensor rm1, rv1;
  explicit Net(std::mt19937& rng) {
    for (const Shape& s : std::vector<Shape>{{8, 3, 3, 3}, {8}, {8}, {8, 8, 3, 3}, {8, 8, 3, 3}, {10, 8}, {10}}) {
      params.push_back(randn(s, rng, Category::parameter, 0.2f));
      params.back().set_requires_grad(true);
      params.back().allocate_grad();
    }
    rm1 = Tensor::zeros({8}, DType::Float32, Device::cpu(), Category::parameter, "running_mean");
    rv1 = Tensor::full({8}, 1.0, DType::Float32, Device::cpu(), Category::parameter, "running_var");
  }
  Tensor loss(const Tensor& x, const Tensor& y, const std::function<void()>& after_forward = {}) {
    Conv2dOptions same;
    same.padding = {1, 1};
    Tensor h = relu(batch_norm(conv2d(x, params[0], {}, same), params[1], params[2], rm1, rv1));
    Tensor b = relu(conv2d(h, params[3], {}, same));
    h = relu(add(h, conv2d(b, params[4], {}, same)));
    b = Tensor();
    Tensor l = cross_entropy(linear(flatten(adaptive_avg_pool2d(max_pool2d(h, {2, 2}, {2, 2}), {1, 1})), params[5], params[6]), y);
    h = Tensor();
    if (after_forward) after_forward();
    return l;
  }
};

struct Ev {
  bool alloc;
  std::size_t requested, offset;
  Category cat;
  std::string op;
  bool operator==(const Ev&) const = default;
};
std::vector<Ev> events(const Arena& a) {
  std::vector<Ev> e;
  for (const auto& t : a.trace()) e.push_back({t.is_alloc, t.requested, t.offset, t.category, t.op});
  return e;
}

}  // namespace

TEST(Autograd, ActivationsRiseInForwardReturnToZeroAfterBackwardGradientsConstant) {
  auto arena = std::make_shared<Arena>(Device::cpu(), 64 << 20);
  ArenaScope scope(arena);
  std::mt19937 rng(1);
  Net net(rng);
  const std::int64_t grad_bytes = arena->stats()[Category::gradient].current;
  EXPECT_GT(grad_bytes, 0);
  for (int step = 0; step < 3; ++step) {
    EXPECT_EQ(arena->stats()[Category::activation].current, 0);
    Tensor x = randn({4, 3, 8, 8}, rng, Category::input);
    Tensor y = Tensor::from_vector(std::vector<std::int64_t>{1, 7, 3, 0}, {4});
    std::int64_t act_after_forward = 0;
    Tensor l = net.loss(x, y, [&] { act_after_forward = arena->stats()[Category::activation].current; });
    EXPECT_GT(act_after_forward, 4 * 8 * 8 * 8 * 4) << "forward should hold saved activations";
    l.backward();
    EXPECT_TRUE(std::isfinite(l.item()));
    l = Tensor();  // the scalar loss itself is the last activation
    EXPECT_EQ(arena->stats()[Category::activation].current, 0) << "step " << step;
    EXPECT_EQ(arena->stats()[Category::temporary].current, 0) << "step " << step;
    EXPECT_EQ(arena->stats()[Category::workspace].current, 0) << "step " << step;
    EXPECT_EQ(arena->stats()[Category::gradient].current, grad_bytes) << "step " << step;
    for (auto& p : net.params) p.zero_grad();
  }
}

TEST(Autograd, DryRunAllocatesExactlyLikeTheRealRun) {
  auto arena = std::make_shared<Arena>(Device::cpu(), 64 << 20);
  ArenaScope scope(arena);
  std::mt19937 rng(2);
  Net net(rng);
  Tensor x = randn({3, 3, 8, 8}, rng, Category::input);
  Tensor y = Tensor::from_vector(std::vector<std::int64_t>{1, 2, 3}, {3});
  arena->reset_peak();
  // dry run first, on a virtual clone of the arena in its current state
  auto virt = arena->virtual_clone();
  virt->set_tracing(true);
  {
    ArenaScope vs(virt);
    DryRunGuard dry;
    Tensor l = net.loss(x, y);
    l.backward();
  }
  arena->set_tracing(true);
  {
    Tensor l = net.loss(x, y);
    l.backward();
  }
  const auto dry = events(*virt), real = events(*arena);
  ASSERT_GT(real.size(), 40u);
  ASSERT_EQ(dry.size(), real.size());
  for (std::size_t i = 0; i < real.size(); ++i) ASSERT_EQ(dry[i], real[i]) << "event " << i << " op " << real[i].op;
  EXPECT_EQ(virt->stats().total.peak, arena->stats().total.peak);
}

TEST(Autograd, GradientsAccumulateIntoPersistentBuffers) {
  std::mt19937 rng(3);
  Tensor w = randn({4, 3}, rng, Category::parameter);
  w.set_requires_grad(true);
  w.allocate_grad();
  const void* buffer = w.grad().raw_data();
  Tensor x = randn({5, 3}, rng, Category::input);
  sum(linear(x, w)).backward();
  const auto g1 = w.grad().to_vector<float>();
  sum(linear(x, w)).backward();
  const auto g2 = w.grad().to_vector<float>();
  EXPECT_EQ(w.grad().raw_data(), buffer) << "the gradient buffer must not move";
  for (std::size_t i = 0; i < g1.size(); ++i) EXPECT_FLOAT_EQ(g2[i], 2 * g1[i]);
  w.zero_grad();
  for (float v : w.grad().to_vector<float>()) EXPECT_EQ(v, 0.f);
}

TEST(Autograd, NoGradGuardRecordsNothing) {
  auto arena = std::make_shared<Arena>(Device::cpu(), 16 << 20);
  ArenaScope scope(arena);
  std::mt19937 rng(4);
  Tensor w = randn({8, 3, 3, 3}, rng, Category::parameter);
  w.set_requires_grad(true);
  Tensor x = randn({2, 3, 6, 6}, rng, Category::input);
  NoGradGuard ng;
  Tensor y = relu(conv2d(x, w));
  EXPECT_EQ(y.grad_fn(), nullptr);
  EXPECT_EQ(arena->stats()[Category::activation].current, static_cast<std::int64_t>(Arena::round_up(y.nbytes())));
  EXPECT_THROW(sum(y).backward(), Error);
}

TEST(Autograd, BackwardNeedsAScalar) {
  std::mt19937 rng(5);
  Tensor w = randn({3}, rng, Category::parameter);
  w.set_requires_grad(true);
  EXPECT_THROW(scale(w, 2.0).backward(), ShapeError);
}
