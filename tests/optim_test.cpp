// Optimizer and learning-rate-schedule tests against PyTorch 1.13.
//
// tests/gen_optim_fixtures.py wrote, for each optimizer case, two float32 parameters, four random
// gradients and torch.optim's parameters after each step (in float32, and the same run in
// float64), and for each schedule case the learning rate of every step (torch.optim.lr_scheduler).
// Tolerances: relative error ||tally - torch|| / ||torch|| <= 1e-6 per float32 tensor, <= 1e-12
// per float64 tensor, and <= 1e-12 per learning rate.
//
// Besides the numbers: optimizer state is allocated at construction (category optimizer_state)
// and step() allocates nothing; bad options and unusable parameters throw errors that name the
// option or parameter, the expectation and the value found; a dry-run step changes nothing.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dry_run.h"
#include "core/memory.h"
#include "core/safetensors.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

using namespace tally;
using optim::AdamW;
using optim::AdamWOptions;
using optim::LRSchedule;
using optim::Optimizer;
using optim::ScheduleOptions;
using optim::SGD;
using optim::SGDOptions;

namespace {

std::string fixtures_dir() {
#ifdef TALLY_FIXTURES_DIR
  return TALLY_FIXTURES_DIR;
#else
  return (std::filesystem::path(__FILE__).parent_path() / "fixtures").string();
#endif
}

safetensors::File load(const std::string& name) { return safetensors::read(fixtures_dir() + "/" + name + ".safetensors"); }

const safetensors::Entry& entry(const safetensors::File& f, const std::string& k) {
  auto it = f.tensors.find(k);
  if (it == f.tensors.end()) throw Error("fixture has no tensor '" + k + "'");
  return it->second;
}

const std::string& meta(const safetensors::File& f, const std::string& k) {
  auto it = f.metadata.find(k);
  if (it == f.metadata.end()) throw Error("fixture has no metadata '" + k + "'");
  return it->second;
}
double meta_num(const safetensors::File& f, const std::string& k) { return std::stod(meta(f, k)); }

// A float32 or float64 tensor from a fixture entry (F32 converted exactly when T = double).
template <class T>
Tensor tensor_from(const safetensors::Entry& e, Category category) {
  std::vector<T> v;
  if (e.dtype == "F32") {
    for (float x : safetensors::as_f32(e)) v.push_back(static_cast<T>(x));
  } else {
    for (double x : safetensors::as_f64(e)) v.push_back(static_cast<T>(x));
  }
  return Tensor::from_vector(v, e.shape, Device::cpu(), category);
}

template <class T>
double rel_err(const std::vector<T>& x, const std::vector<T>& y) {
  EXPECT_EQ(x.size(), y.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size() && i < y.size(); ++i) {
    if (!std::isfinite(static_cast<double>(x[i]))) return INFINITY;
    const double d = static_cast<double>(x[i]) - static_cast<double>(y[i]);
    num += d * d;
    den += static_cast<double>(y[i]) * static_cast<double>(y[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// A CPU parameter with its persistent gradient buffer, as nn::Module parameters have.
Tensor parameter(const std::vector<float>& v, const Shape& shape) {
  Tensor p = Tensor::from_vector(v, shape, Device::cpu(), Category::parameter);
  p.set_requires_grad(true);
  p.allocate_grad();
  return p;
}

std::unique_ptr<Optimizer> make_optimizer(const safetensors::File& f, std::vector<Tensor> params) {
  if (meta(f, "optimizer") == "sgd") {
    SGDOptions o;
    o.lr = meta_num(f, "lr");
    o.momentum = meta_num(f, "momentum");
    o.dampening = meta_num(f, "dampening");
    o.weight_decay = meta_num(f, "weight_decay");
    o.nesterov = meta(f, "nesterov") == "true";
    return std::make_unique<SGD>(std::move(params), o);
  }
  AdamWOptions o;
  o.lr = meta_num(f, "lr");
  o.beta1 = meta_num(f, "beta1");
  o.beta2 = meta_num(f, "beta2");
  o.eps = meta_num(f, "eps");
  o.weight_decay = meta_num(f, "weight_decay");
  return std::make_unique<AdamW>(std::move(params), o);
}

// Checks that fn throws tally::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& p : parts) EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
    return;
  }
  ADD_FAILURE() << "expected a tally::Error";
}

// ---- PyTorch fixtures: optimizers ------------------------------------------------------------------

class OptimizerFixture : public ::testing::TestWithParam<std::string> {};

// Runs the fixture's four steps with parameters of type T and compares with torch's run of the
// same type (param.<s>.<k> for float32, param64.<s>.<k> for float64).
template <class T>
void run_fixture(const std::string& name, const std::string& prefix, double tol) {
  const auto f = load(name);
  const int num_params = static_cast<int>(meta_num(f, "num_params"));
  const int steps = static_cast<int>(meta_num(f, "steps"));
  std::vector<Tensor> params;
  for (int k = 0; k < num_params; ++k) {
    Tensor p = tensor_from<T>(entry(f, "param.init." + std::to_string(k)), Category::parameter);
    p.set_requires_grad(true);
    p.allocate_grad();
    params.push_back(p);
  }
  auto opt = make_optimizer(f, params);
  for (int s = 0; s < steps; ++s) {
    for (int k = 0; k < num_params; ++k)
      params[k].grad().copy_(tensor_from<T>(entry(f, fmt::format("grad.{}.{}", s, k)), Category::input));
    opt->step();
    EXPECT_EQ(opt->steps(), s + 1);
    for (int k = 0; k < num_params; ++k) {
      const Tensor want = tensor_from<T>(entry(f, fmt::format("{}.{}.{}", prefix, s, k)), Category::input);
      EXPECT_LE(rel_err(params[k].to_vector<T>(), want.to_vector<T>()), tol)
          << name << ": parameter " << k << " after step " << s << " (" << params[k].str() << ")";
    }
  }
}

TEST_P(OptimizerFixture, Float32MatchesTorch) { run_fixture<float>(GetParam(), "param", 1e-6); }
TEST_P(OptimizerFixture, Float64MatchesTorch) { run_fixture<double>(GetParam(), "param64", 1e-12); }

INSTANTIATE_TEST_SUITE_P(Torch, OptimizerFixture,
                         ::testing::Values("optim_sgd", "optim_sgd_momentum_wd", "optim_sgd_nesterov",
                                           "optim_sgd_dampening", "optim_adamw", "optim_adamw_wd"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- PyTorch fixtures: schedules ------------------------------------------------------------------

TEST(LRSchedule, MatchesTorchSchedulers) {
  const auto f = load("optim_lr_schedules");
  const std::string cases = meta(f, "cases");
  int checked = 0;
  for (std::size_t begin = 0; begin < cases.size();) {
    std::size_t end = cases.find(',', begin);
    if (end == std::string::npos) end = cases.size();
    const std::string c = cases.substr(begin, end - begin);
    begin = end + 1;
    ScheduleOptions o;
    o.kind = meta(f, c + ".kind");
    o.base_lr = meta_num(f, c + ".base_lr");
    o.total_steps = std::stoll(meta(f, c + ".total_steps"));
    o.warmup_steps = std::stoll(meta(f, c + ".warmup_steps"));
    o.step_size = std::stoll(meta(f, c + ".step_size"));
    o.gamma = meta_num(f, c + ".gamma");
    o.eta_min = meta_num(f, c + ".eta_min");
    o.onecycle_pct_start = meta_num(f, c + ".onecycle_pct_start");
    o.onecycle_div_factor = meta_num(f, c + ".onecycle_div_factor");
    o.onecycle_final_div_factor = meta_num(f, c + ".onecycle_final_div_factor");
    const LRSchedule sched(o);
    const auto want = safetensors::as_f64(entry(f, "lr." + c));
    ASSERT_EQ(static_cast<std::int64_t>(want.size()), o.total_steps) << c;
    for (std::size_t s = 0; s < want.size(); ++s) {
      const double got = sched.lr_at(static_cast<std::int64_t>(s));
      EXPECT_LE(std::abs(got - want[s]), 1e-12 * std::abs(want[s])) << c << " step " << s << ": " << got << " vs torch " << want[s];
    }
    ++checked;
  }
  EXPECT_EQ(checked, 10);
}

TEST(LRSchedule, DocumentedShapes) {
  ScheduleOptions o;
  o.kind = "cosine", o.base_lr = 1.0, o.total_steps = 14, o.warmup_steps = 4;
  const LRSchedule cos(o);
  EXPECT_DOUBLE_EQ(cos.lr_at(0), 0.25);  // warm-up: (s + 1) / W
  EXPECT_DOUBLE_EQ(cos.lr_at(3), 1.0);
  EXPECT_DOUBLE_EQ(cos.lr_at(4), 1.0);  // cosine restarts at t = 0
  EXPECT_NEAR(cos.lr_at(9), 0.5, 1e-15);  // t = T / 2
  o.kind = "onecycle", o.warmup_steps = 100;  // ignored by onecycle
  o.total_steps = 10, o.onecycle_pct_start = 0.3, o.onecycle_div_factor = 4, o.onecycle_final_div_factor = 10;
  const LRSchedule one(o);
  EXPECT_DOUBLE_EQ(one.lr_at(0), 0.25);    // initial = max / div_factor
  EXPECT_DOUBLE_EQ(one.lr_at(2), 1.0);     // end of phase 1: e1 = 0.3 * 10 - 1
  EXPECT_DOUBLE_EQ(one.lr_at(9), 0.025);   // final = initial / final_div_factor
  EXPECT_NO_THROW(one.lr_at(10));          // PyTorch allows step N
  // A zero-length first phase (pct_start * N == 1), where PyTorch divides by zero: finished.
  o.onecycle_pct_start = 0.1;
  EXPECT_DOUBLE_EQ(LRSchedule(o).lr_at(0), 1.0);
  o = ScheduleOptions{};
  o.kind = "step", o.base_lr = 2, o.total_steps = 9, o.gamma = 0.5;  // step_size 0 -> 3
  const LRSchedule st(o);
  EXPECT_DOUBLE_EQ(st.lr_at(2), 2.0);
  EXPECT_DOUBLE_EQ(st.lr_at(3), 1.0);
  EXPECT_DOUBLE_EQ(st.lr_at(8), 0.5);
  o = ScheduleOptions{};
  o.base_lr = 0.3;  // constant, total_steps unused
  EXPECT_DOUBLE_EQ(LRSchedule(o).lr_at(1000), 0.3);
}

TEST(LRSchedule, BadOptions) {
  auto with = [](const std::function<void(ScheduleOptions&)>& edit) {
    ScheduleOptions o;
    o.kind = "cosine", o.total_steps = 10;
    edit(o);
    return [o] { LRSchedule s(o); };
  };
  expect_error(with([](auto& o) { o.kind = "linear"; }), {"kind", "constant|step|cosine|onecycle", "'linear'"});
  expect_error(with([](auto& o) { o.base_lr = -1; }), {"base_lr", ">= 0", "-1"});
  expect_error(with([](auto& o) { o.warmup_steps = -2; }), {"warmup_steps", ">= 0", "-2"});
  expect_error(with([](auto& o) { o.warmup_steps = 10; }), {"total_steps", "> warmup_steps (10)", "10"});
  expect_error(with([](auto& o) { o.eta_min = -0.5; }), {"eta_min", ">= 0", "-0.5"});
  expect_error(with([](auto& o) { o.kind = "step", o.total_steps = 2; }), {"total_steps", ">= 3", "2"});
  expect_error(with([](auto& o) { o.kind = "step", o.step_size = -1; }), {"step_size", ">= 1", "-1"});
  expect_error(with([](auto& o) { o.kind = "step", o.gamma = -0.1; }), {"gamma", ">= 0", "-0.1"});
  expect_error(with([](auto& o) { o.kind = "onecycle", o.total_steps = 0; }), {"total_steps", "> 0", "0"});
  expect_error(with([](auto& o) { o.kind = "onecycle", o.onecycle_pct_start = 1.5; }),
               {"onecycle_pct_start", "[0, 1]", "1.5"});
  expect_error(with([](auto& o) { o.kind = "onecycle", o.onecycle_div_factor = 0; }),
               {"onecycle_div_factor", "> 0", "0"});
  expect_error(with([](auto& o) { o.kind = "onecycle", o.onecycle_final_div_factor = -1; }),
               {"onecycle_final_div_factor", "> 0", "-1"});
  ScheduleOptions o;
  o.kind = "onecycle", o.total_steps = 10;
  const LRSchedule one(o);
  expect_error([&] { one.lr_at(-1); }, {"step", ">= 0", "-1"});
  expect_error([&] { one.lr_at(11); }, {"step", "<= total_steps (10)", "11"});
}

// ---- memory: state at construction, nothing allocated by step ---------------------------------

TEST(Optimizer, StateAllocatedAtConstructionNotInStep) {
  const auto& arena = current_arena(Device::cpu());
  Tensor a = parameter(std::vector<float>(12, 1.f), {3, 4});
  Tensor b = parameter(std::vector<float>(300, 1.f), {300});
  a.grad().fill_(0.5);
  b.grad().fill_(-0.25);
  const std::size_t expect_bytes = a.nbytes() + b.nbytes();
  const auto expect_rounded = static_cast<std::int64_t>(Arena::round_up(a.nbytes()) + Arena::round_up(b.nbytes()));

  struct Case {
    const char* name;
    std::function<std::unique_ptr<Optimizer>()> make;
    int buffers_per_param;
  };
  const std::vector<Case> cases = {
      {"SGD", [&] { return std::make_unique<SGD>(std::vector<Tensor>{a, b}, SGDOptions{}); }, 0},
      {"SGD momentum", [&] { return std::make_unique<SGD>(std::vector<Tensor>{a, b}, SGDOptions{.momentum = 0.9}); }, 1},
      {"AdamW", [&] { return std::make_unique<AdamW>(std::vector<Tensor>{a, b}, AdamWOptions{}); }, 2},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const ArenaStats s0 = arena->stats();
    auto opt = c.make();
    const ArenaStats s1 = arena->stats();
    EXPECT_EQ(opt->state_bytes(), static_cast<std::size_t>(c.buffers_per_param) * expect_bytes);
    EXPECT_EQ(s1[Category::optimizer_state].current - s0[Category::optimizer_state].current,
              c.buffers_per_param * expect_rounded);
    EXPECT_EQ(s1[Category::optimizer_state].allocations - s0[Category::optimizer_state].allocations,
              2 * c.buffers_per_param);
    EXPECT_EQ(s1.total.allocations - s0.total.allocations, 2 * c.buffers_per_param);  // nothing else
    for (int i = 0; i < 3; ++i) {
      opt->step();
      opt->zero_grad();
      a.grad().fill_(0.5);
    }
    const ArenaStats s2 = arena->stats();
    EXPECT_EQ(s2.total.allocations, s1.total.allocations) << "step() or zero_grad() allocated";
    EXPECT_EQ(s2.total.current, s1.total.current);
    EXPECT_EQ(opt->steps(), 3);
    opt.reset();
    EXPECT_EQ(arena->stats()[Category::optimizer_state].current, s0[Category::optimizer_state].current)
        << "state freed with the optimizer";
  }
}

TEST(Optimizer, StateLivesOnTheArenaWithItsName) {
  Tensor a = parameter({1, 2, 3}, {3});
  const AdamW opt({a}, AdamWOptions{});
  int found = 0;
  for (const auto& [offset, info] : current_arena(Device::cpu())->live_blocks())
    if (info.category == Category::optimizer_state && (info.op == "AdamW.exp_avg.0" || info.op == "AdamW.exp_avg_sq.0"))
      ++found;
  EXPECT_EQ(found, 2);
}

// ---- behaviour -------------------------------------------------------------------------------------

TEST(Optimizer, ZeroGradKeepsBuffers) {
  Tensor a = parameter({1, 2, 3}, {3});
  a.grad().fill_(7);
  void* before = a.grad().raw_data();
  SGD opt({a}, SGDOptions{});
  opt.zero_grad();
  EXPECT_EQ(a.grad().raw_data(), before);
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{0, 0, 0}));
}

TEST(Optimizer, SetLrTakesEffect) {
  Tensor a = parameter({1, 2, 3}, {3});
  a.grad().fill_(1);
  SGD opt({a}, SGDOptions{.lr = 0});
  opt.step();
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2, 3}));
  opt.set_lr(0.5);
  EXPECT_EQ(opt.lr(), 0.5);
  opt.step();
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{0.5f, 1.5f, 2.5f}));
  expect_error([&] { opt.set_lr(-0.1); }, {"SGD", "lr", ">= 0", "-0.1"});
  expect_error([&] { opt.set_lr(NAN); }, {"lr", "finite", "nan"});
  EXPECT_EQ(opt.lr(), 0.5);
}

TEST(Optimizer, Float64AndMixedParameters) {
  Tensor a = Tensor::from_vector(std::vector<double>{1, 2}, {2}, Device::cpu(), Category::parameter);
  a.allocate_grad();
  a.grad().fill_(0.25);
  Tensor b = parameter({4}, {1});
  b.grad().fill_(1);
  SGD opt({a, b}, SGDOptions{.lr = 0.5, .momentum = 0.5});
  opt.step();  // first step: buf = g
  opt.step();  // buf = 0.5 buf + g = 1.5 g
  EXPECT_EQ(a.to_vector<double>(), (std::vector<double>{1 - 0.5 * 0.25 * 2.5, 2 - 0.5 * 0.25 * 2.5}));
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{4 - 0.5f * 2.5f}));
}

TEST(Optimizer, DryRunStepChangesNothing) {
  for (bool adamw : {false, true}) {
    SCOPED_TRACE(adamw ? "AdamW" : "SGD momentum");
    Tensor a = parameter({1, 2, 3, 4}, {2, 2});
    a.grad().fill_(0.5);
    std::unique_ptr<Optimizer> opt;
    if (adamw) opt = std::make_unique<AdamW>(std::vector<Tensor>{a}, AdamWOptions{.lr = 0.1});
    else opt = std::make_unique<SGD>(std::vector<Tensor>{a}, SGDOptions{.lr = 0.1, .momentum = 0.9});
    const ArenaStats s0 = current_arena(Device::cpu())->stats();
    {
      const DryRun dry;  // the switch alone, on the real arena: nothing may be allocated or changed
      opt->step();
      opt->step();
      opt->zero_grad();
    }
    EXPECT_EQ(current_arena(Device::cpu())->stats().total.allocations, s0.total.allocations);
    EXPECT_EQ(opt->steps(), 0);
    EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
    EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>(4, 0.5f)));
    // The first real step is still a first step (SGD: buf = g; AdamW: t = 1) — compare with a
    // fresh optimizer on a twin parameter.
    opt->step();
    Tensor twin = parameter({1, 2, 3, 4}, {2, 2});
    twin.grad().fill_(0.5);
    std::unique_ptr<Optimizer> fresh;
    if (adamw) fresh = std::make_unique<AdamW>(std::vector<Tensor>{twin}, AdamWOptions{.lr = 0.1});
    else fresh = std::make_unique<SGD>(std::vector<Tensor>{twin}, SGDOptions{.lr = 0.1, .momentum = 0.9});
    fresh->step();
    EXPECT_EQ(a.to_vector<float>(), twin.to_vector<float>());
  }
}

TEST(Optimizer, BuiltInADryRunOnAVirtualArena) {
  Tensor a = parameter({1, 2}, {2});
  std::unique_ptr<AdamW> opt;
  {
    const DryRun dry(*current_arena(Device::cpu()));
    opt = std::make_unique<AdamW>(std::vector<Tensor>{a}, AdamWOptions{});
    EXPECT_EQ(opt->state_bytes(), 2 * a.nbytes());
    opt->step();  // nothing to compute, nothing to complain about
  }
  expect_error([&] { opt->step(); }, {"AdamW.step", "parameter 0", "no memory", "dry run"});
}

// ---- errors ------------------------------------------------------------------------------------------

TEST(Optimizer, BadOptions) {
  auto p = [] { return std::vector<Tensor>{parameter({1, 2}, {2})}; };
  expect_error([&] { (void)SGD(p(), SGDOptions{.lr = -1}); }, {"SGD", "lr", ">= 0", "-1"});
  expect_error([&] { (void)SGD(p(), SGDOptions{.momentum = -0.5}); }, {"SGD", "momentum", ">= 0", "-0.5"});
  expect_error([&] { (void)SGD(p(), SGDOptions{.weight_decay = -1e-4}); }, {"SGD", "weight_decay", ">= 0", "-0.0001"});
  expect_error([&] { (void)SGD(p(), SGDOptions{.nesterov = true}); },
               {"SGD", "nesterov", "momentum > 0 and dampening == 0", "momentum 0"});
  expect_error([&] { (void)SGD(p(), SGDOptions{.momentum = 0.9, .dampening = 0.1, .nesterov = true}); },
               {"SGD", "nesterov", "dampening 0.1"});
  expect_error([&] { (void)AdamW(p(), AdamWOptions{.lr = -1e-3}); }, {"AdamW", "lr", ">= 0", "-0.001"});
  expect_error([&] { (void)AdamW(p(), AdamWOptions{.beta1 = 1.0}); }, {"AdamW", "beta1", "in [0, 1)", "1"});
  expect_error([&] { (void)AdamW(p(), AdamWOptions{.beta2 = -0.1}); }, {"AdamW", "beta2", "in [0, 1)", "-0.1"});
  expect_error([&] { (void)AdamW(p(), AdamWOptions{.eps = 0}); }, {"AdamW", "eps", "> 0", "0"});
  expect_error([&] { (void)AdamW(p(), AdamWOptions{.weight_decay = -1}); }, {"AdamW", "weight_decay", ">= 0", "-1"});
  // Accepted: what torch.optim accepts.
  EXPECT_NO_THROW((void)SGD(p(), SGDOptions{.lr = 0, .momentum = 0.9, .nesterov = true}));
  EXPECT_NO_THROW((void)AdamW(p(), AdamWOptions{.beta1 = 0, .weight_decay = 0}));
}

TEST(Optimizer, BadParameters) {
  Tensor ok = parameter({1, 2}, {2});
  Tensor no_grad = Tensor::from_vector(std::vector<float>{1, 2, 3}, {3}, Device::cpu(), Category::parameter);
  no_grad.set_requires_grad(true);  // lazily allocated gradient: not there yet
  expect_error([&] { (void)SGD({ok, no_grad}, SGDOptions{}); }, {"SGD", "parameter 1", "float32[3] on cpu", "no gradient buffer"});
  expect_error([&] { (void)AdamW({no_grad}, AdamWOptions{}); }, {"AdamW", "parameter 0", "no gradient buffer"});
  Tensor ints = Tensor::from_vector(std::vector<std::int64_t>{1, 2}, {2}, Device::cpu(), Category::parameter);
  expect_error([&] { (void)SGD({ok, ints}, SGDOptions{}); }, {"parameter 1", "float32 or float64", "int64"});
  expect_error([&] { (void)SGD({}, SGDOptions{}); }, {"SGD", "empty parameter list"});
  expect_error([&] { (void)SGD({ok, ok}, SGDOptions{}); }, {"parameter 1", "listed twice"});
  Tensor m = parameter({1, 2, 3, 4, 5, 6}, {2, 3});
  expect_error([&] { (void)SGD({m.transpose(0, 1)}, SGDOptions{}); }, {"parameter 0", "contiguous"});
  expect_error([&] { (void)SGD({Tensor()}, SGDOptions{}); }, {"parameter 0", "undefined"});
}

// A failing step leaves every parameter as it was (all are checked before any is updated).
TEST(Optimizer, FailingStepUpdatesNothing) {
  Tensor a = parameter({1, 2}, {2});
  Tensor b = parameter({3}, {1});
  a.grad().fill_(1);
  SGD opt({a, b}, SGDOptions{});
  b.impl().grad.reset();  // the gradient buffer went away after construction
  expect_error([&] { opt.step(); }, {"SGD.step", "parameter 1", "no gradient buffer"});
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2}));
  EXPECT_EQ(opt.steps(), 0);
}

}  // namespace
