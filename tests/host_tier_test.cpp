// The host tier (docs/host-tier.md) on the CPU device, where both tiers are host memory, so that
// every placement runs here:
//   * the optimizer's state moves into the host arena and back with its values, and a placed
//     optimizer's steps are bit-identical to the unplaced one's (SGD with momentum, AdamW);
//   * training with the optimizer on the host, and with the gradients accumulated there too, gives
//     the parameters, running statistics and optimizer state of the all-device run at the same
//     micro-batch, bit for bit (float32 and bf16, SGD and AdamW), with predicted == measured peaks
//     in both arenas, and the device holding no optimizer state (and only transient gradients);
//   * the executor's choice: the placement that allows the largest micro-batch, the one that
//     moves fewer bytes where they tie;
//   * a host tier too small is an error naming both tiers' needs; a placement without a host tier
//     an error naming what is missing.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/memory.h"
#include "mbp/executor.h"
#include "nn/recompute.h"
#include "optim/optimizer.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;

namespace {

std::unique_ptr<optim::Optimizer> make_optimizer(nn::Module& m, bool adamw) {
  if (adamw) return std::make_unique<optim::AdamW>(m.parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.05});
  return std::make_unique<optim::SGD>(m.parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4});
}

// A model and its optimizer built inside `budget` (their parameters, gradients and state live there).
struct Trained {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> optimizer;
  Trained(const std::shared_ptr<Arena>& budget, bool adamw, std::uint64_t seed = 5) {
    ArenaScope in_budget(budget);
    model = test::model("resnet20", "batch", seed);
    optimizer = make_optimizer(*model, adamw);
  }
};

std::vector<float> state_values(const optim::Optimizer& o) {
  std::vector<float> all;
  for (const auto& [name, t] : o.named_state()) {
    const std::vector<float> v = t.to_vector<float>();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST(HostTier, OptimizerStateMovesToTheHostAndBackWithItsValues) {
  for (const bool adamw : {false, true}) {
    SCOPED_TRACE(adamw ? "AdamW" : "SGD");
    const auto device = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
    const auto host = Arena::make_host(std::size_t(64) << 20);
    Trained a(device, adamw), b(device, adamw);
    const Shape sample{3, 16, 16};
    const Data d = make_data(8, sample, 21);
    const std::size_t state_bytes = a.optimizer->state_bytes();
    ASSERT_GT(state_bytes, 0u);
    b.optimizer->place_state(host);
    EXPECT_EQ(b.optimizer->state_host(), host);
    EXPECT_GE(static_cast<std::size_t>(host->stats()[Category::optimizer_state].current), state_bytes);
    for (int step = 0; step < 2; ++step) {
      for (Trained* r : {&a, &b}) {
        ArenaScope in_budget(device);
        full_batch_backward<float>(*r->model, d, 8, sample);
        r->optimizer->step();
        r->optimizer->zero_grad();
      }
      EXPECT_TRUE(bitwise_equal(values<float>(*a.model), values<float>(*b.model))) << "step " << step;
      EXPECT_TRUE(same_bits(state_values(*a.optimizer), state_values(*b.optimizer))) << "step " << step;
    }
    EXPECT_EQ(host->stats()[Category::parameter].current, 0) << "the staging outlived the step";
    EXPECT_GT(host->stats()[Category::parameter].peak, 0) << "the update was not staged in the host tier";
    // Back beside the parameters: the host tier is empty again and the values are kept.
    const std::vector<float> kept = state_values(*b.optimizer);
    {
      ArenaScope in_budget(device);
      b.optimizer->place_state(nullptr);
    }
    EXPECT_EQ(b.optimizer->state_host(), nullptr);
    EXPECT_EQ(host->stats().total.current, 0);
    EXPECT_TRUE(same_bits(state_values(*b.optimizer), kept));
    for (const auto& [name, t] : b.optimizer->named_state()) EXPECT_EQ(t.storage()->arena(), device) << name;
  }
}

TEST(HostTier, PlacementsOnTheHostTrainBitIdenticalToTheDeviceWithExactPeaksInBothTiers) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 17;
  std::vector<Data> batches;
  for (int s = 0; s < 3; ++s) batches.push_back(make_data(B, sample, 40 + static_cast<std::uint32_t>(s)));
  for (const mbp::Placement placement : {mbp::Placement::optimizer, mbp::Placement::gradients})
  for (const bool adamw : {false, true})
    for (const mbp::Precision precision : {mbp::Precision::fp32, mbp::Precision::bf16}) {
      if (placement == mbp::Placement::gradients && adamw != (precision == mbp::Precision::fp32)) continue;  // two of four
      SCOPED_TRACE(fmt::format("placement {}, {} {}", mbp::placement_name(placement), adamw ? "AdamW" : "SGD",
                               mbp::precision_name(precision)));
      mbp::ExecutorOptions eo;
      eo.sample_shape = sample;
      eo.micro_batch = 5;
      eo.precision = precision;
      const auto ref_budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
      Trained ref(ref_budget, adamw);
      mbp::Executor ref_ex(*ref.model, *ref.optimizer, ref_budget, eo);

      const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
      Trained run(budget, adamw);
      eo.host_arena = Arena::make_host(std::size_t(32) << 20);
      eo.placement = placement;
      mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
      for (const Data& d : batches) {
        ref_ex.step(d.images.data(), d.labels.data(), B);
        const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
        EXPECT_EQ(r.peak, r.predicted_peak);
        EXPECT_GT(r.host_peak, run.optimizer->state_bytes());
        EXPECT_EQ(r.host_peak, r.host_predicted_peak);
        EXPECT_EQ(budget->stats()[Category::optimizer_state].current, 0) << "state left on the device";
        if (placement == mbp::Placement::gradients) {
          EXPECT_EQ(budget->stats()[Category::gradient].current, 0) << "a gradient left on the device";
          EXPECT_LT(budget->stats()[Category::gradient].peak, ref_budget->stats()[Category::gradient].current / 2)
              << "the transient gradients should be a fraction of the model's";
        }
      }
      EXPECT_EQ(ex.placement_choice().placement, placement);
      EXPECT_TRUE(bitwise_equal(values<float>(*run.model), values<float>(*ref.model))) << "parameters differ";
      EXPECT_TRUE(bitwise_equal(values<float>(*run.model, true), values<float>(*ref.model, true)))
          << "running statistics differ";
      EXPECT_TRUE(same_bits(state_values(*run.optimizer), state_values(*ref.optimizer))) << "optimizer state differs";
    }
}

TEST(HostTier, TheExecutorTakesThePlacementThatAllowsTheLargestMicroBatch) {
  const Shape sample{3, 16, 16};
  const std::size_t tight = std::size_t(10) << 20;
  // The micro-batch each placement allows in a tight budget, each on its own model.
  const auto micro_batch_at = [&](mbp::Placement p, std::int64_t batch) {
    const auto budget = std::make_shared<Arena>(Device::cpu(), tight);
    Trained run(budget, true);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.host_arena = Arena::make_host(std::size_t(32) << 20);
    eo.placement = p;
    mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
    return ex.plan(batch).micro_batch;
  };
  const std::int64_t on_device = micro_batch_at(mbp::Placement::device, 256);
  const std::int64_t with_optimizer = micro_batch_at(mbp::Placement::optimizer, 256);
  const std::int64_t on_host = micro_batch_at(mbp::Placement::gradients, 256);
  ASSERT_GT(with_optimizer, on_device) << "the budget should make the optimizer's state matter";
  ASSERT_GT(on_host, with_optimizer) << "the budget should make the gradients matter";

  const auto budget = std::make_shared<Arena>(Device::cpu(), tight);
  Trained run(budget, true);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.host_arena = Arena::make_host(std::size_t(32) << 20);
  mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
  EXPECT_EQ(ex.plan(256).micro_batch, on_host);
  EXPECT_EQ(ex.placement_choice().placement, mbp::Placement::gradients);
  EXPECT_EQ(ex.placement_choice().why,
            fmt::format("micro-batches of {} instead of {} with placement device, {} with placement optimizer", on_host,
                        on_device, with_optimizer));
  EXPECT_EQ(budget->stats()[Category::optimizer_state].current, 0);
  EXPECT_EQ(budget->stats()[Category::gradient].current, 0);
  const Data d = make_data(256, sample, 3);
  const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), 256);
  EXPECT_EQ(r.peak, r.predicted_peak);
  EXPECT_EQ(r.host_peak, r.host_predicted_peak);

  // A batch that fits whole on the device keeps everything there (no bytes moved for nothing); one
  // that fits whole with the optimizer on the host leaves the gradients on the device.
  EXPECT_EQ(ex.plan(on_device).micro_batch, on_device);
  EXPECT_EQ(ex.placement_choice().placement, mbp::Placement::device);
  EXPECT_EQ(ex.placement_choice().why, "the whole batch fits on the device at once");
  EXPECT_GT(budget->stats()[Category::optimizer_state].current, 0);
  EXPECT_GT(budget->stats()[Category::gradient].current, 0);
  EXPECT_EQ(ex.plan(with_optimizer).micro_batch, with_optimizer);
  EXPECT_EQ(ex.placement_choice().placement, mbp::Placement::optimizer);
  // And back, from the cache of choices; a step there is still exact in both tiers.
  EXPECT_EQ(ex.plan(256).micro_batch, on_host);
  EXPECT_EQ(ex.placement_choice().placement, mbp::Placement::gradients);
  const mbp::StepResult again = ex.step(d.images.data(), d.labels.data(), 256);
  EXPECT_EQ(again.peak, again.predicted_peak);
  EXPECT_EQ(again.host_peak, again.host_predicted_peak);
}

// An out-of-memory in the middle of a micro-batch with the gradients on the host: the step is
// discarded (the accumulators zeroed, the transient buffers dropped) and retried with smaller
// micro-batches; the parameters are those of an uninterrupted run at the smaller size.
TEST(HostTier, AnOutOfMemoryRetryWithTheGradientsOnTheHostLosesNothing) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 16;
  std::vector<Data> batches;
  for (int s = 0; s < 2; ++s) batches.push_back(make_data(B, sample, 60 + static_cast<std::uint32_t>(s)));
  const auto run_with = [&](std::int64_t micro_batch, bool inject) {
    const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
    Trained run(budget, true);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = micro_batch;
    eo.host_arena = Arena::make_host(std::size_t(32) << 20);
    eo.placement = mbp::Placement::gradients;
    mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
    for (std::size_t s = 0; s < batches.size(); ++s) {
      if (inject && s == 0) budget->fail_allocation_after(200);  // inside the second micro-batch's work
      const mbp::StepResult r = ex.step(batches[s].images.data(), batches[s].labels.data(), B);
      if (inject && s == 0) {
        EXPECT_EQ(r.oom_retries, 1);
        EXPECT_EQ(r.micro_batch, micro_batch / 2);
      }
      EXPECT_EQ(budget->stats()[Category::gradient].current, 0) << "a transient gradient outlived the step";
    }
    return values<float>(*run.model);
  };
  const auto reference = run_with(4, false);
  EXPECT_TRUE(bitwise_equal(run_with(8, true), reference)) << "the retried step differs from the uninterrupted run";
}

TEST(HostTier, AHostTierTooSmallNamesBothTiersNeeds) {
  const Shape sample{3, 16, 16};
  const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
  Trained run(budget, true);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.host_arena = Arena::make_host(std::size_t(1) << 20);
  eo.placement = mbp::Placement::optimizer;
  mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
  try {
    ex.plan(64);
    ADD_FAILURE() << "a host tier of 1 MiB held AdamW's state of a ResNet-20";
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("host memory limit 1.0 MiB (1048576 bytes) is too small for placement optimizer: the host "
                        "tier needs"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("optimizer state 2.1 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("the device tier then holds"), std::string::npos) << what;
    EXPECT_GT(e.requested(), std::size_t(1) << 20);
  }
  EXPECT_EQ(run.optimizer->state_host(), nullptr) << "a placement that does not fit moved the state";

  // The executor's choice when no placement fits: the device's error and need, and each host
  // placement's reason.
  eo.placement.reset();
  // 4.25 MiB: the persistent state (4.19 MiB) and not one sample beside it.
  const auto small = std::make_shared<Arena>(Device::cpu(), parse_size("4.25MiB"));
  Trained tight(small, true);
  mbp::Executor chooser(*tight.model, *tight.optimizer, small, eo);
  try {
    chooser.plan(64);
    ADD_FAILURE() << "a plan fitted in 4.25 MiB with a host tier of 1 MiB";
  } catch (const OutOfMemory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("(4456448 bytes) is too small"), std::string::npos) << what;
    EXPECT_NE(what.find("(with placement optimizer: host memory limit 1.0 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("(with placement gradients: host memory limit 1.0 MiB"), std::string::npos) << what;
    EXPECT_GT(e.requested(), std::size_t(4456448)) << "the bytes the device would need were lost";
  }
  EXPECT_EQ(tight.optimizer->state_host(), nullptr);
}

TEST(HostTier, APlacementOnTheHostNeedsAHostTier) {
  const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
  Trained run(budget, false);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 16, 16};
  eo.placement = mbp::Placement::optimizer;
  try {
    mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
    ADD_FAILURE() << "placement optimizer without a host tier was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("placement optimizer needs a host tier"), std::string::npos) << e.what();
  }
  eo.placement.reset();
  eo.host_arena = budget;
  try {
    mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
    ADD_FAILURE() << "the device's own arena was accepted as the host tier";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("an arena of its own"), std::string::npos) << e.what();
  }
}

namespace {

// Where every real tensor of a run lives: each storage's arena and offset (parameters, their
// gradients, buffers, the optimizer's state and accumulators), the optimizer's placement and the
// model's segment modes — what choosing must leave as it found it.
std::vector<std::string> where_everything_is(nn::Module& model, const optim::Optimizer& optimizer) {
  std::vector<std::string> at;
  const auto add = [&](const std::string& what, const Tensor& t) {
    if (!t.defined()) return at.push_back(what + " none");
    at.push_back(fmt::format("{} {} {} {}", what, fmt::ptr(t.storage().get()), fmt::ptr(t.storage()->arena().get()),
                             t.storage()->offset()));
  };
  for (const auto& [name, p] : model.named_parameters()) add(name, p), add(name + ".grad", p.grad());
  for (const auto& [name, b] : model.named_buffers()) add(name, b);
  for (const auto& [name, s] : optimizer.named_state()) add("optimizer." + name, s);
  for (std::size_t i = 0; i < optimizer.host_gradients().size(); ++i)
    add(fmt::format("accumulator.{}", i), optimizer.host_gradients()[i]);
  const optim::Optimizer::Where w = optimizer.where();
  at.push_back(fmt::format("state on host {}, gradients on host {}", w.state_on_host, w.gradients_on_host));
  at.push_back("segments " + nn::recompute_state(model).str());
  return at;
}

}  // namespace

// Choosing is a question: a full search — recomputation auto with a host tier, every placement
// tried in a budget where each changes the answer, from the device and from a placement applied
// earlier — moves, allocates and changes nothing real; the choice, applied, is then the plan that
// runs, exact in both tiers.
TEST(HostTier, ChoosingMovesNothing) {
  const Shape sample{3, 16, 16};
  const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(10) << 20);
  Trained run(budget, true);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.recompute = "auto";
  eo.host_arena = Arena::make_host(std::size_t(32) << 20);
  eo.cost_rates = mbp::CostRates{10e9, 100e9, "given"};
  mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
  for (const std::int64_t batch : {256, 8, 64}) {
    SCOPED_TRACE(fmt::format("batch {}", batch));
    const std::vector<std::string> before = where_everything_is(*run.model, *run.optimizer);
    const auto device_used = budget->stats().total.current, host_used = eo.host_arena->stats().total.current;
    const mbp::StepConfig c = ex.choose(batch);
    EXPECT_EQ(where_everything_is(*run.model, *run.optimizer), before);
    EXPECT_EQ(budget->stats().total.current, device_used);
    EXPECT_EQ(eo.host_arena->stats().total.current, host_used);
    // Applied: the plan chosen is the plan run.
    const mbp::Plan& p = ex.plan(batch);
    EXPECT_EQ(p.micro_batch, c.plan.micro_batch);
    EXPECT_EQ(p.predicted_peak, c.plan.predicted_peak);
    EXPECT_EQ(p.host_predicted_peak, c.plan.host_predicted_peak);
    EXPECT_EQ(ex.placement_choice().placement, c.placement.placement);
    EXPECT_EQ(nn::recompute_state(*run.model).str(), c.segments.str());
    const Data d = make_data(batch, sample, 11);
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), batch);
    EXPECT_EQ(r.peak, r.predicted_peak);
    EXPECT_EQ(r.host_peak, r.host_predicted_peak);
    if (batch == 256) {
      EXPECT_EQ(c.placement.placement, mbp::Placement::gradients) << c.placement.why;
    }
  }
}

// The state is created where the chosen placement puts it, never on the device first: a budget
// below the parameters, gradients and state together trains, with the values of the all-device run.
TEST(HostTier, StateIsCreatedInItsTier) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 12;
  std::size_t all_persistent = 0;
  {
    const auto probe = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
    Trained t(probe, true);
    all_persistent = static_cast<std::size_t>(probe->stats().total.current);
  }
  const std::size_t small = all_persistent - (std::size_t(512) << 10);  // the state does not fit beside the rest
  {
    const auto budget = std::make_shared<Arena>(Device::cpu(), small);
    EXPECT_THROW(Trained t(budget, true), OutOfMemory) << "the budget should not hold the state on the device";
  }
  const auto budget = std::make_shared<Arena>(Device::cpu(), small);
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> optimizer;
  {
    ArenaScope in_budget(budget);
    model = test::model("resnet20", "batch", 5);
    optimizer = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.05},
                                               optim::StateCreation::when_placed);
  }
  EXPECT_FALSE(optimizer->state_created());
  EXPECT_EQ(budget->stats()[Category::optimizer_state].current, 0);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 4;
  eo.host_arena = Arena::make_host(std::size_t(32) << 20);
  mbp::Executor ex(*model, *optimizer, budget, eo);

  const auto ref_budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
  Trained ref(ref_budget, true);
  mbp::ExecutorOptions ref_eo = eo;
  ref_eo.host_arena.reset();
  mbp::Executor ref_ex(*ref.model, *ref.optimizer, ref_budget, ref_eo);
  for (int s = 0; s < 2; ++s) {
    const Data d = make_data(B, sample, 70 + static_cast<std::uint32_t>(s));
    ref_ex.step(d.images.data(), d.labels.data(), B);
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
    EXPECT_EQ(r.peak, r.predicted_peak);
    EXPECT_EQ(r.host_peak, r.host_predicted_peak);
  }
  EXPECT_TRUE(optimizer->state_created());
  EXPECT_NE(ex.placement_choice().placement, mbp::Placement::device);
  EXPECT_EQ(budget->stats()[Category::optimizer_state].peak, 0) << "the state passed through the device";
  EXPECT_TRUE(bitwise_equal(values<float>(*model), values<float>(*ref.model))) << "parameters differ";
  EXPECT_TRUE(same_bits(state_values(*optimizer), state_values(*ref.optimizer))) << "optimizer state differs";
}
