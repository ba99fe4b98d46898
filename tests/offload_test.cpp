// Activations offloaded to the host tier (core/offload.h) and the per-segment choice between
// keeping, recomputing and offloading (mbp/activations.h), on the CPU device, where both tiers are
// host memory, so that every path runs here:
//   * offload(f, x) moves what a segment saved, and its input, to the host arena and back, and the
//     gradients are bit for bit a plain run's — with and without prefetching the next segment;
//   * training with segments offloaded (all of them, or a list mixing the three modes) gives the
//     parameters of a plain run at the same micro-batch bit for bit, float32 and bf16, with
//     predicted == measured peaks in both arenas and less on the device;
//   * recompute "auto" with a host tier: the cost model's rates decide each segment's mode (fast
//     copies: offload; fast compute: recompute), the plan fits where nothing fit before, the choice
//     is the same for the same rates; without a host tier the ladder is as it was;
//   * errors: offloading without a host tier, a segment list naming no segment of the model.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/offload.h"
#include "core/ops.h"
#include "mbp/activations.h"
#include "mbp/executor.h"
#include "nn/recompute.h"
#include "optim/optimizer.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;

namespace {

// A model and its optimizer built inside `budget`.
struct Trained {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> optimizer;
  Trained(const std::shared_ptr<Arena>& budget, std::uint64_t seed = 5) {
    ArenaScope in_budget(budget);
    model = test::model("resnet20", "batch", seed);
    optimizer = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 1e-3, .weight_decay = 0.05});
  }
};

std::vector<float> floats(const Tensor& t) { return t.contiguous().to_vector<float>(); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

Tensor random_tensor(const Shape& shape, std::uint32_t seed) {
  const Data d = make_data(1, {shape_numel(shape)}, seed);
  return Tensor::from_vector(d.images, shape);
}

}  // namespace

TEST(Offload, ASegmentsTensorsGoToTheHostAndBackAndTheGradientsAreAPlainRunsBitForBit) {
  for (const bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "prefetching" : "each at its own backward");
    const auto device = std::make_shared<Arena>(Device::cpu(), std::size_t(16) << 20);
    const auto host = Arena::make_host(std::size_t(16) << 20);
    const ArenaScope on_device(device);
    const HostArenaScope tier(host, prefetch);
    Tensor w1 = random_tensor({8, 3, 3, 3}, 1).set_requires_grad(true);
    Tensor w2 = random_tensor({8, 8, 3, 3}, 2).set_requires_grad(true);
    const auto segment = [](const Tensor& w) {
      return [w](const Tensor& x) {
        Conv2dOptions o;
        o.padding = {1, 1};
        return relu(conv2d(x, w, {}, o));
      };
    };
    // Two chained segments: the second's input is the first's output (a prefetch's case).
    const auto run = [&](bool offloaded, std::vector<float>* g1, std::vector<float>* g2, std::size_t* moved) {
      Tensor x = random_tensor({2, 3, 8, 8}, 3);  // in the device's arena, as a step's input is
      OffloadLog log;
      const std::int64_t before = device->stats().total.current;
      Tensor a = offloaded ? offload(segment(w1), x, "one") : segment(w1)(x);
      Tensor b = offloaded ? offload(segment(w2), a, "two") : segment(w2)(a);
      Tensor loss = sum(b);
      if (offloaded) {
        ASSERT_EQ(log.records().size(), 2u);
        EXPECT_EQ(log.records()[0].name, "one");
        EXPECT_GT(log.records()[0].forward_flops, 0);
        *moved = log.records()[0].bytes + log.records()[1].bytes;
        EXPECT_EQ(static_cast<std::size_t>(host->stats().total.current), *moved) << "on the host between the passes";
        EXPECT_LT(device->stats().total.current - before, static_cast<std::int64_t>(b.nbytes() + loss.nbytes() +
                                                                                      (std::size_t(4) << 10)))
            << "only the last output (and the loss) should stay on the device";
      }
      x = Tensor();
      a = Tensor();
      b = Tensor();
      w1.zero_grad();
      w2.zero_grad();
      loss.backward();
      EXPECT_EQ(host->stats().total.current, 0) << "everything came back";
      *g1 = floats(w1.grad());
      *g2 = floats(w2.grad());
    };
    std::vector<float> p1, p2, o1, o2;
    std::size_t moved = 0;
    run(false, &p1, &p2, &moved);
    run(true, &o1, &o2, &moved);
    EXPECT_GT(moved, 0u);
    EXPECT_TRUE(same_bits(p1, o1));
    EXPECT_TRUE(same_bits(p2, o2));
    for (const float v : o1) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(Offload, WithoutAHostTierIsAnErrorNamingWhatItNeeds) {
  const Tensor w = random_tensor({4}, 7).set_requires_grad(true);
  try {
    (void)offload([&](const Tensor& x) { return mul(x, w); }, random_tensor({4}, 8), "layer9.9");
    ADD_FAILURE() << "offload without a host tier was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("offload of segment 'layer9.9': expected a host tier"), std::string::npos)
        << e.what();
  }
}

TEST(Offload, OffloadedSegmentsTrainBitIdenticalToKeepingThemWithExactPeaksInBothTiers) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 17;
  std::vector<Data> batches;
  for (int s = 0; s < 2; ++s) batches.push_back(make_data(B, sample, 60 + static_cast<std::uint32_t>(s)));
  struct Case {
    std::string policy;
    mbp::Precision precision;
    bool prefetch;
  };
  for (const Case& c : {Case{"offload", mbp::Precision::fp32, false}, Case{"offload", mbp::Precision::bf16, true},
                        Case{"layer1.0=offload,layer2.0=recompute,layer1.2=offload,layer3.1=keep",
                             mbp::Precision::fp32, true}}) {
    SCOPED_TRACE(fmt::format("{} {}{}", c.policy, mbp::precision_name(c.precision), c.prefetch ? ", prefetching" : ""));
    mbp::ExecutorOptions eo;
    eo.offload_prefetch_on_cpu = c.prefetch;
    eo.sample_shape = sample;
    eo.micro_batch = 5;
    eo.precision = c.precision;
    const auto ref_budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
    Trained ref(ref_budget);
    mbp::Executor ref_ex(*ref.model, *ref.optimizer, ref_budget, eo);

    const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
    Trained run(budget);
    eo.host_arena = Arena::make_host(std::size_t(32) << 20);
    eo.recompute = c.policy;
    mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
    for (const Data& d : batches) {
      const mbp::StepResult a = ref_ex.step(d.images.data(), d.labels.data(), B);
      const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
      EXPECT_EQ(r.peak, r.predicted_peak);
      EXPECT_EQ(r.host_peak, r.host_predicted_peak);
      EXPECT_GT(r.host_peak, 0u) << "nothing went to the host tier";
      EXPECT_LT(r.peak, a.peak) << "offloading should lower the device's peak";
      EXPECT_EQ(r.loss, a.loss);
    }
    EXPECT_EQ(ex.recompute_choice().name, "per segment");
    EXPECT_EQ(ex.placement_choice().placement, mbp::Placement::device) << "the state stays on the device";
    EXPECT_TRUE(bitwise_equal(values<float>(*run.model), values<float>(*ref.model))) << "parameters differ";
    EXPECT_TRUE(bitwise_equal(values<float>(*run.model, true), values<float>(*ref.model, true)))
        << "running statistics differ";
  }
}

TEST(Offload, SegmentPoliciesNameTheModelsSegments) {
  auto m = model("resnet20", "batch", 1);
  const std::vector<std::string> names = nn::segment_names(*m);
  ASSERT_EQ(names.size(), 8u);  // a CIFAR ResNet-20: no stem, 8 of its 9 blocks
  EXPECT_EQ(names.front(), "layer1.0");
  EXPECT_EQ(names.back(), "layer3.1");
  EXPECT_TRUE(mbp::is_segment_policy("offload"));
  EXPECT_TRUE(mbp::is_segment_policy("layer1.0=offload,layer2.1=recompute"));
  EXPECT_FALSE(mbp::is_segment_policy("layer1.0=fly"));
  EXPECT_FALSE(mbp::is_segment_policy("layer1.0=offload,"));
  EXPECT_NO_THROW(mbp::check_recompute_policy("layer1.0=offload"));
  EXPECT_THROW(mbp::check_recompute_policy("layer1.0=fly"), Error);
  const std::vector<nn::SegmentMode> modes = mbp::segment_policy_modes(*m, "layer2.1=recompute,layer1.0=offload");
  EXPECT_EQ(modes[0], nn::SegmentMode::offload);
  EXPECT_EQ(modes[4], nn::SegmentMode::recompute);
  EXPECT_EQ(std::count(modes.begin(), modes.end(), nn::SegmentMode::keep), 6);
  const auto error_of = [&](const std::string& policy) {
    try {
      (void)mbp::segment_policy_modes(*m, policy);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(error_of("layer9.0=offload").find("'layer9.0' is not a segment of this model; expected one of layer1.0, "
                                              "layer1.1, layer1.2, layer2.0"),
            std::string::npos)
      << error_of("layer9.0=offload");
  EXPECT_NE(error_of("layer1.0=offload,layer1.0=keep").find("segment 'layer1.0' is named twice"), std::string::npos);
  EXPECT_NE(error_of("layer3.2=offload").find("is not a segment"), std::string::npos) << "the last block is none";
  // The modes round-trip through the model's state, which keys the plans.
  nn::set_segment_modes(*m, modes);
  EXPECT_EQ(nn::segment_modes(*m), modes);
  EXPECT_EQ(nn::recompute_state(*m).str(), "0200010000000");

  // Offloading without a host tier: an error before any plan.
  const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(64) << 20);
  Trained run(budget);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 16, 16};
  eo.recompute = "offload";
  mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
  try {
    (void)ex.plan(8);
    ADD_FAILURE() << "offload without a host tier was planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ExecutorOptions::recompute offload: offloading a segment needs a host tier"),
              std::string::npos)
        << e.what();
  }
}

TEST(Offload, TheCostModelsRatesDecideEachSegmentsModeWhereNothingFitsOneSample) {
  const Shape sample{3, 32, 32};
  const std::int64_t B = 6;
  // What one sample needs with nothing and with everything offloaded, on a model of the same
  // persistent state: the budget lies between.
  const auto need = [&](const std::string& policy) {
    const auto big = std::make_shared<Arena>(Device::cpu(), std::size_t(256) << 20);
    Trained run(big);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 1;
    eo.recompute = policy;
    eo.host_arena = Arena::make_host(std::size_t(64) << 20);
    eo.placement = mbp::Placement::device;  // the state stays: only the activations decide
    mbp::Executor ex(*run.model, *run.optimizer, big, eo);
    return ex.plan(B).predicted_peak;
  };
  const std::size_t kept = need("none"), offloaded = need("offload");
  ASSERT_LT(offloaded + (std::size_t(256) << 10), kept) << "offloading should save more than the arena's rounding";
  const std::size_t budget_bytes = (kept + offloaded) / 2 / 256 * 256;

  struct Rates {
    double copy, compute;
    nn::SegmentMode cheaper;
  };
  for (const Rates& rates : {Rates{1e15, 1e6, nn::SegmentMode::offload}, Rates{1e3, 1e15, nn::SegmentMode::recompute}}) {
    SCOPED_TRACE(fmt::format("copies {} B/s, compute {} FLOP/s", rates.copy, rates.compute));
    std::vector<std::vector<nn::SegmentMode>> chosen;
    for (int again = 0; again < 2; ++again) {
      const auto budget = std::make_shared<Arena>(Device::cpu(), budget_bytes);
      Trained run(budget);
      mbp::ExecutorOptions eo;
      eo.sample_shape = sample;
      eo.recompute = "auto";
      eo.host_arena = Arena::make_host(std::size_t(64) << 20);
      eo.placement = mbp::Placement::device;
      eo.cost_rates = mbp::CostRates{rates.copy, rates.compute, ""};
      mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
      const mbp::Plan& p = ex.plan(B);
      const mbp::RecomputeChoice& c = ex.recompute_choice();
      EXPECT_EQ(c.name, "per segment");
      ASSERT_TRUE(c.rates.has_value());
      EXPECT_EQ(c.rates->source, "given");
      ASSERT_EQ(c.segments.size(), 8u);
      std::vector<nn::SegmentMode> modes;
      for (const mbp::ActivationCost& s : c.segments) {
        modes.push_back(s.mode);
        EXPECT_GT(s.bytes, 0) << s.name;
        EXPECT_GT(s.flops, 0) << s.name;
      }
      const auto taken = std::count_if(modes.begin(), modes.end(), [](nn::SegmentMode m) { return m != nn::SegmentMode::keep; });
      EXPECT_GT(taken, 0) << "nothing taken off the device, yet nothing fit";
      if (rates.cheaper == nn::SegmentMode::offload) {
        EXPECT_EQ(std::count(modes.begin(), modes.end(), nn::SegmentMode::recompute), 0) << "copies are free here";
      }
      EXPECT_NE(c.why.find("not even one sample fits"), std::string::npos) << c.why;
      EXPECT_EQ(nn::segment_modes(*run.model), modes) << "the choice is set on the model";
      // The plan prints a line per segment and the step's estimate.
      const std::vector<std::string> lines = c.cost_lines(p);
      ASSERT_EQ(lines.size(), 2u + 8u + 1u);
      EXPECT_NE(lines.back().find("estimated step"), std::string::npos);
      EXPECT_NE(c.summary(p).find("against"), std::string::npos);
      // And the step runs as planned, in both tiers.
      const Data d = make_data(B, sample, 9);
      const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
      EXPECT_EQ(r.peak, r.predicted_peak);
      EXPECT_EQ(r.host_peak, r.host_predicted_peak);
      EXPECT_LE(r.peak, budget_bytes);
      chosen.push_back(modes);
    }
    EXPECT_EQ(chosen[0], chosen[1]) << "the same rates must give the same choice";
  }

  // Without a host tier, auto climbs the recomputation ladder as before: no segment offloaded.
  const auto budget = std::make_shared<Arena>(Device::cpu(), budget_bytes);
  Trained run(budget);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.recompute = "auto";
  mbp::Executor ex(*run.model, *run.optimizer, budget, eo);
  (void)ex.plan(B);
  EXPECT_NE(ex.recompute_choice().name, "per segment");
  EXPECT_GT(ex.recompute_choice().level, 0);
  EXPECT_TRUE(ex.recompute_choice().segments.empty());
  EXPECT_FALSE(nn::recompute_state(*run.model).offloads());
}

TEST(Offload, TheRatesAreMeasuredOnceAndArePositive) {
  const mbp::CostRates a = mbp::measure_cost_rates(Device::cpu(), DType::Float32);
  EXPECT_GT(a.copy_bytes_per_second, 1e6);
  EXPECT_GT(a.flops_per_second, 1e6);
  EXPECT_EQ(a.source, "measured");
  const mbp::CostRates b = mbp::measure_cost_rates(Device::cpu(), DType::Float32);
  EXPECT_EQ(a.copy_bytes_per_second, b.copy_bytes_per_second) << "measured once per process";
  const mbp::CostRates given = mbp::complete_cost_rates(mbp::CostRates{5e9, 0, ""}, Device::cpu(), DType::Float32);
  EXPECT_EQ(given.copy_bytes_per_second, 5e9);
  EXPECT_EQ(given.flops_per_second, a.flops_per_second);
  EXPECT_EQ(given.source, "copies given, compute measured");
}
