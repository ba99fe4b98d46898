// Autograd engine: memory behaviour (activations freed during backward, gradients persistent),
// dry runs allocating exactly like real runs, accumulation, grad mode.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "core/autograd.h"
#include "core/dry_run.h"
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

// `step` run as a dry run on a virtual clone of `arena`, then for real on it: the same allocations
// and frees, event by event (at least `min_events` of them), and the same peak.
void expect_dry_run_as_real(const std::shared_ptr<Arena>& arena, const std::function<void()>& step,
                            std::size_t min_events) {
  arena->reset_peak();
  std::shared_ptr<Arena> virt;
  {
    const DryRun dry(*arena);
    virt = dry.arena_ptr();
    virt->set_tracing(true);
    step();
  }
  arena->set_tracing(true);
  step();
  const auto dry = events(*virt), real = events(*arena);
  ASSERT_GT(real.size(), min_events);
  ASSERT_EQ(dry.size(), real.size());
  for (std::size_t i = 0; i < real.size(); ++i) ASSERT_EQ(dry[i], real[i]) << "event " << i << " op " << real[i].op;
  EXPECT_EQ(virt->stats().total.peak, arena->stats().total.peak);
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
  // dry run first, on a virtual clone of the arena in its current state
  expect_dry_run_as_real(arena, [&] {
    Tensor l = net.loss(x, y);
    l.backward();
  }, 40);
}

// The same for a squeeze-and-excitation block with a concatenation (sigmoid, scale_channels,
// concat), row-major and channels-last: the dry run's allocations are the real run's, event by event.
TEST(Autograd, DryRunOfASqueezeExcitationBlockAllocatesExactlyLikeTheRealRun) {
  for (const MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
    SCOPED_TRACE(memory_format_name(format));
    auto arena = std::make_shared<Arena>(Device::cpu(), 64 << 20);
    ArenaScope scope(arena);
    std::mt19937 rng(5);
    std::vector<Tensor> w;
    for (const Shape& s : std::vector<Shape>{{2, 4}, {4, 2}}) {
      w.push_back(randn(s, rng, Category::parameter, 0.3f));
      w.back().set_requires_grad(true);
      w.back().allocate_grad();
    }
    Tensor x = randn({3, 4, 6, 6}, rng, Category::input).contiguous(format);
    x.set_requires_grad(true);
    x.allocate_grad();
    auto step = [&] {
      // relu keeps the layout (a convolution keeps it only where oneDNN or cuDNN runs it).
      const Tensor h = relu(x);                                                       // (3, 4, 6, 6)
      const Tensor z = relu(linear(flatten(adaptive_avg_pool2d(h, {1, 1})), w[0]));  // (3, 2)
      const Tensor s = sigmoid(linear(z, w[1]));                                      // (3, 4)
      const Tensor y = concat({scale_channels(h, s), h, x});                          // (3, 12, 6, 6)
      EXPECT_EQ(y.suggest_memory_format(), format);
      sum(y).backward();
    };
    expect_dry_run_as_real(arena, step, 20);
    for (const Tensor* p : {&w[0], &w[1], &x})
      for (float g : p->grad().to_vector<float>()) ASSERT_TRUE(std::isfinite(g));
  }
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

// The gradient-ready hook (core/autograd.h): each leaf reported once per backward, when the last
// node writing into it has run — a leaf used by two nodes after the second, a leaf used twice by
// one node after that node — in backward order, its gradient then final; no hook, no reports.
TEST(Autograd, GradientReadyReportsEachLeafOnceWhenItsGradientIsComplete) {
  std::mt19937 rng(11);
  std::vector<Tensor> leaves;
  for (int i = 0; i < 3; ++i) {
    leaves.push_back(randn({4}, rng, Category::parameter));
    leaves.back().set_requires_grad(true);
    leaves.back().allocate_grad();
  }
  const Tensor &a = leaves[0], &b = leaves[1], &c = leaves[2];
  const Tensor x = randn({4}, rng, Category::input);
  auto loss = [&] {
    const Tensor p = mul(a, x), q = mul(a, b), r = mul(c, c);  // a in two nodes, c twice in one
    return sum(add(add(p, q), r));
  };
  std::vector<int> order;
  std::vector<std::vector<float>> at_report(3);
  {
    const GradientReadyScope watch([&](TensorImpl* leaf) {
      for (int i = 0; i < 3; ++i)
        if (leaves[static_cast<std::size_t>(i)].impl_ptr().get() == leaf) {
          order.push_back(i);
          at_report[static_cast<std::size_t>(i)] = leaves[static_cast<std::size_t>(i)].grad().to_vector<float>();
        }
    });
    loss().backward();
  }
  EXPECT_EQ(order, (std::vector<int>{2, 1, 0})) << "c's node runs first, then q's (b, and a's first use), then p's";
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(at_report[static_cast<std::size_t>(i)], leaves[static_cast<std::size_t>(i)].grad().to_vector<float>())
        << "leaf " << i << " reported before its gradient was complete";
  const auto ga = a.grad().to_vector<float>(), gb = b.grad().to_vector<float>(), gc = c.grad().to_vector<float>();
  const auto va = a.to_vector<float>(), vb = b.to_vector<float>(), vc = c.to_vector<float>(), vx = x.to_vector<float>();
  for (std::size_t k = 0; k < 4; ++k) {
    EXPECT_FLOAT_EQ(ga[k], vx[k] + vb[k]);
    EXPECT_FLOAT_EQ(gb[k], va[k]);
    EXPECT_FLOAT_EQ(gc[k], 2 * vc[k]);
  }
  order.clear();
  loss().backward();  // no hook in scope
  EXPECT_TRUE(order.empty());
}

// to(DType) is an op with a gradient: the gradient flows back converted to the input's dtype
// (float64 -> float32 -> back, float32 -> bfloat16 -> back), and two casts of one input add up
// in its gradient buffer.
TEST(Autograd, CastsPassTheGradientBackInTheInputsDtype) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> v(12);
  for (auto& e : v) e = n(rng);
  Tensor x = Tensor::from_vector(v, {3, 4}, Device::cpu(), Category::parameter);
  x.set_requires_grad(true);
  const double alpha = 1.0 + std::abs(n(rng));
  sum(scale(x.to(DType::Float32), alpha)).backward();
  ASSERT_EQ(x.grad().dtype(), DType::Float64);
  for (double g : x.grad().to_vector<double>()) EXPECT_EQ(g, static_cast<double>(static_cast<float>(alpha)));
  x.zero_grad();
  sum(add(x.to(DType::Float32), x.to(DType::Float32))).backward();
  for (double g : x.grad().to_vector<double>()) EXPECT_EQ(g, 2.0);

  Tensor f = Tensor::from_vector(std::vector<float>(v.begin(), v.end()), {3, 4}, Device::cpu(), Category::parameter);
  f.set_requires_grad(true);
  const Tensor b = f.to(DType::BFloat16);
  EXPECT_NE(b.grad_fn(), nullptr);  // on the tape
  sum(scale(b.to(DType::Float32), 3.0)).backward();
  for (float g : f.grad().to_vector<float>()) EXPECT_EQ(g, 3.f);
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

// relu(Tensor&&) and add(Tensor&&, b) take the output in the given-up tensor's buffer only when
// nothing else holds it; values and gradients are those of the out-of-place ops either way.
TEST(Autograd, InPlaceReluAndAddOnlyWhenNothingElseHoldsTheBuffer) {
  std::mt19937 rng(71);
  Tensor a = randn({6, 7}, rng, Category::parameter), b = randn({6, 7}, rng, Category::parameter);
  const Tensor w = randn({6, 7}, rng, Category::input);  // sum(y * w): a gradient with both signs
  for (Tensor* p : {&a, &b}) {
    p->set_requires_grad(true);
    p->allocate_grad();
  }
  const Arena& arena = *current_arena(Device::cpu());
  struct Run {
    std::vector<float> y, ga, gb;
    std::int64_t activations;  // activation buffers the forward allocated
  };
  auto run = [&](const std::function<Tensor()>& forward) {
    a.zero_grad();
    b.zero_grad();
    const std::int64_t before = arena.stats()[Category::activation].allocations;
    Tensor y = forward();
    Run r{y.to_vector<float>(), {}, {}, arena.stats()[Category::activation].allocations - before};
    sum(mul(y, w)).backward();
    r.ga = a.grad().to_vector<float>();
    r.gb = b.grad().to_vector<float>();
    return r;
  };
  // mul saves its inputs, not its output: the product's buffer is free to take the sum and then
  // the ReLU (1 buffer instead of 3).
  const Run plain = run([&] {
    Tensor t = mul(a, b);
    Tensor u = add(t, b);
    return relu(u);
  });
  const Run in_place = run([&] { return relu(add(mul(a, b), b)); });
  EXPECT_EQ(plain.activations, 3);
  EXPECT_EQ(in_place.activations, 1);
  EXPECT_EQ(in_place.y, plain.y);
  EXPECT_EQ(in_place.ga, plain.ga);
  EXPECT_EQ(in_place.gb, plain.gb);
  bool some_negative = false;
  for (float v : plain.ga) some_negative |= v < 0;
  EXPECT_TRUE(some_negative) << "the test needs ReLU to mask something";

  // A second handle on the buffer: out of place, and the other handle keeps its values.
  const Run shared = run([&] {
    Tensor t = mul(a, b);
    const Tensor keep = t;
    const auto kept = keep.to_vector<float>();
    Tensor y = relu(add(std::move(t), b));
    EXPECT_EQ(keep.to_vector<float>(), kept);
    return y;
  });
  EXPECT_EQ(shared.activations, 2);  // the sum out of place; the ReLU in place into the sum's new buffer
  EXPECT_EQ(shared.ga, plain.ga);
  // A buffer a backward saved (ReLU saves its output): the second ReLU may not overwrite it.
  const Run saved = run([&] { return relu(relu(add(mul(a, b), b))); });
  EXPECT_EQ(saved.activations, 2);
  EXPECT_EQ(saved.y, plain.y);
  EXPECT_EQ(saved.ga, plain.ga);
  // A leaf that requires grad is never written, even when its handle is the only one.
  Tensor leaf = randn({6, 7}, rng, Category::activation);
  leaf.set_requires_grad(true);
  const auto before = leaf.to_vector<float>();
  const Tensor r = relu(std::move(leaf));
  ASSERT_TRUE(leaf.defined());  // NOLINT(bugprone-use-after-move): out of place leaves it as it was
  EXPECT_EQ(leaf.to_vector<float>(), before);
  EXPECT_FALSE(r.storage() == leaf.storage());
}
