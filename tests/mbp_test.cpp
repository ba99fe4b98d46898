// MBP: the planner's exactness, the executor's equivalence with the full batch, out-of-memory
// recovery, budgets that cannot fit, and the memory timeline.
//   * Gradient equivalence (float32): ResNet-20 with norm group and none, B = 256, micro-batches
//     of 1, 7 and 64: every accumulated gradient within 1e-5 (relative, per tensor) of the
//     full-batch mean-loss gradient.
//   * Training equivalence (float64): parameters after 3 SGD steps with momentum and weight
//     decay through micro-batches of 7 match full-batch steps to 1e-10.
//   * Exactness: for several models, budgets and micro-batch sizes, the measured peak of real
//     steps equals the plan's predicted peak to the byte and never exceeds the budget.
//   * Fault injection: an allocation failed in the middle of a step; the step is retried with a
//     smaller micro-batch and the parameters equal, bit for bit, those of an uninterrupted run
//     with that micro-batch.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "apps/plan.h"
#include "kernels/cpu/cpu_kernels.h"
#include "apps/trainer.h"
#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/ops.h"
#include "nn/init.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "mbp/graph_replay.h"
#include "report/layer_table.h"
#include "report/timeline.h"
#include "optim/optimizer.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;

namespace {

std::int64_t transient_bytes(const Arena& a) {
  const ArenaStats s = a.stats();
  return s[Category::activation].current + s[Category::workspace].current + s[Category::input].current +
         s[Category::temporary].current;
}

class Mbp : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
TEST(BalancedSizes, DifferByAtMostOneLargerFirst) {
  EXPECT_EQ(mbp::balanced_sizes(10, 3), (std::vector<std::int64_t>{4, 3, 3}));
  EXPECT_EQ(mbp::balanced_sizes(256, 37).size(), 37u);
  for (std::int64_t B : {1, 7, 64, 255, 256, 1000})
    for (std::int64_t k = 1; k <= B; k += 1 + B / 9) {
      const auto s = mbp::balanced_sizes(B, k);
      std::int64_t sum = 0;
      for (auto v : s) sum += v;
      EXPECT_EQ(sum, B);
      EXPECT_LE(s.front() - s.back(), 1);
      EXPECT_TRUE(std::is_sorted(s.rbegin(), s.rend()));
    }
  EXPECT_THROW(mbp::balanced_sizes(4, 5), Error);
  EXPECT_THROW(mbp::balanced_sizes(4, 0), Error);
}

// ---------------------------------------------------------------------------------------------
class GradientEquivalence : public Mbp, public ::testing::WithParamInterface<std::string> {};

TEST_P(GradientEquivalence, MicroBatchesOf1_7_64MatchTheFullBatchFloat32) {
  const std::string norm = GetParam();
  const std::int64_t B = 128;  // m = 64 gives two micro-batches; m = 1 and 7 many, one of them short
  const Shape sample{3, 16, 16};
  auto m = model("resnet20", norm);
  auto opt = sgd(*m);
  const Data d = make_data(B, sample, 11);
  const double full_loss = full_batch_backward<float>(*m, d, B, sample);
  const auto ref = grads<float>(*m);
  m->zero_grad();
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  mbp::Executor ex(*m, *opt, eo);
  for (std::int64_t mb : {1, 7, 64}) {
    const auto sizes = mbp::balanced_sizes(B, (B + mb - 1) / mb);
    const double loss = ex.accumulate(d.images.data(), d.labels.data(), sizes);
    EXPECT_NEAR(loss, full_loss, 1e-5 * std::abs(full_loss)) << "m = " << mb;
    const auto g = grads<float>(*m);
    double worst = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      const double e = rel_error(g[i], ref[i]);
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-5) << "norm " << norm << ", m = " << mb << ", parameter " << i;
    }
    RecordProperty("worst_rel_error_m" + std::to_string(mb), std::to_string(worst));
    std::cout << "norm " << norm << ", micro-batches of " << mb << " (k = " << sizes.size()
              << "): worst per-tensor relative gradient error " << worst << "\n";
    m->zero_grad();
  }
}

// The mean of micro-batch means (what gradient accumulation usually does) is NOT the full-batch
// gradient when the micro-batches differ in size: the test above would catch that normalization.
TEST_F(Mbp, MeanOfMeansWouldBeWrongForUnequalSplits) {
  const std::int64_t B = 10;
  const Shape sample{3, 8, 8};
  auto m = model("resnet20", "none");
  const Data d = make_data(B, sample, 5);
  full_batch_backward<float>(*m, d, B, sample);
  const auto ref = grads<float>(*m);
  m->zero_grad();
  // micro-batches of 4, 3, 3, each loss its own mean divided by k.
  std::int64_t off = 0;
  for (std::int64_t n : {4, 3, 3}) {
    Data part;
    part.images.assign(d.images.begin() + off * 192, d.images.begin() + (off + n) * 192);
    part.labels.assign(d.labels.begin() + off, d.labels.begin() + off + n);
    Tensor loss = scale(cross_entropy((*m)(input_tensor<float>(part, n, sample)), Tensor::from_vector(part.labels, {n})),
                        1.0 / 3.0);
    loss.backward();
    off += n;
  }
  const auto g = grads<float>(*m);
  double worst = 0;
  for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, rel_error(g[i], ref[i]));
  EXPECT_GT(worst, 1e-3) << "a mean of means should differ from the full-batch gradient";
}

INSTANTIATE_TEST_SUITE_P(Norms, GradientEquivalence, ::testing::Values("group", "none"),
                         [](const auto& i) { return i.param; });

// --loss-normalization: exact is the full batch for any split; per-micro-batch (the MBP paper's
// code) equals it for an even split and differs for an uneven one.
TEST_F(Mbp, PerMicroBatchNormalizationDiffersFromTheFullBatchOnlyForUnevenSplits) {
  const std::int64_t B = 10;
  const Shape sample{3, 8, 8};
  auto m = model("resnet20", "none", 4, DType::Float64);
  auto opt = sgd(*m);
  const Data d = make_data(B, sample, 21);
  const double full_loss = full_batch_backward<double>(*m, d, B, sample);
  const auto ref = grads<double>(*m);
  m->zero_grad();
  auto worst_error = [&](mbp::LossNormalization how, const std::vector<std::int64_t>& sizes, double* loss) {
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.normalization = how;
    mbp::Executor ex(*m, *opt, eo);
    *loss = ex.accumulate(d.images.data(), d.labels.data(), sizes);
    const auto g = grads<double>(*m);
    double worst = 0;
    for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, rel_error(g[i], ref[i]));
    m->zero_grad();
    return worst;
  };
  double loss = 0;
  for (const auto& sizes : {std::vector<std::int64_t>{5, 5}, std::vector<std::int64_t>{4, 3, 3}}) {
    EXPECT_LE(worst_error(mbp::LossNormalization::exact, sizes, &loss), 1e-12);
    EXPECT_NEAR(loss, full_loss, 1e-12 * std::abs(full_loss));
  }
  const double even = worst_error(mbp::LossNormalization::per_micro_batch, {5, 5}, &loss);
  EXPECT_LE(even, 1e-12) << "an even split: the mean of the means is the full mean";
  EXPECT_NEAR(loss, full_loss, 1e-12 * std::abs(full_loss));
  const double uneven = worst_error(mbp::LossNormalization::per_micro_batch, {4, 3, 3}, &loss);
  EXPECT_GT(uneven, 1e-3) << "an uneven split: the mean of the means is not the full batch's";
  EXPECT_GT(std::abs(loss - full_loss), 1e-6 * std::abs(full_loss));
  std::cout << "split 4+3+3 of 10: per-micro-batch normalization's worst per-tensor gradient difference from the "
               "full batch " << uneven << ", loss " << loss << " vs " << full_loss << "\n";
}

// ---------------------------------------------------------------------------------------------
class TrainingEquivalence : public Mbp, public ::testing::WithParamInterface<std::string> {};

TEST_P(TrainingEquivalence, ThreeSgdStepsThroughMicroBatchesOf7MatchFullBatchFloat64) {
  const std::string norm = GetParam();
  const std::int64_t B = 20;
  const Shape sample{3, 16, 16};
  auto ref = model("resnet20", norm, 3, DType::Float64);
  auto mbp_model = model("resnet20", norm, 3, DType::Float64);
  ASSERT_TRUE(bitwise_equal(values<double>(*ref), values<double>(*mbp_model)));
  auto ref_opt = sgd(*ref);
  auto mbp_opt = sgd(*mbp_model);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 7;
  mbp::Executor ex(*mbp_model, *mbp_opt, eo);
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(B, sample, 100 + static_cast<std::uint32_t>(step));
    const double ref_loss = full_batch_backward<double>(*ref, d, B, sample);
    {
      NoGradGuard ng;
      ref_opt->step();
      ref_opt->zero_grad();
    }
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
    EXPECT_EQ(r.micro_batch, 7);
    EXPECT_EQ(r.micro_batches, 3);  // 20 = 7 + 7 + 6
    EXPECT_NEAR(r.loss, ref_loss, 1e-12 * std::abs(ref_loss));
  }
  const auto a = values<double>(*mbp_model), b = values<double>(*ref);
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double e = rel_error(a[i], b[i]);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-10) << "parameter " << i;
  }
  std::cout << "norm " << norm << ": after 3 steps, worst per-tensor relative parameter difference " << worst << "\n";
  // The parameters moved: the comparison is not between two untouched models.
  const auto init = values<double>(*model("resnet20", norm, 3, DType::Float64));
  double moved = 0;
  for (std::size_t i = 0; i < a.size(); ++i) moved = std::max(moved, rel_error(a[i], init[i]));
  EXPECT_GT(moved, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Norms, TrainingEquivalence, ::testing::Values("group", "none"),
                         [](const auto& i) { return i.param; });

// BatchNorm: running statistics are updated once per step, from the moments of every
// micro-batch. The first BatchNorm sees the same samples either way, so its running statistics
// equal the full batch's; num_batches_tracked counts steps, not micro-batches.
// CUDA graphs (ExecutorOptions::cuda_graphs) are a GPU's: asked for on the CPU, nothing is recorded
// or tried (a recording there would fail and be counted), and the steps are the same bits.
TEST_F(Mbp, CudaGraphsAskedForOnTheCpuChangeNothing) {
  const std::int64_t B = 22;
  const Shape sample{3, 16, 16};
  auto plain = model("resnet20", "batch", 6, DType::Float64), asked = model("resnet20", "batch", 6, DType::Float64);
  auto plain_opt = sgd(*plain), asked_opt = sgd(*asked);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 4;  // 6 micro-batches, two sizes
  mbp::Executor a(*plain, *plain_opt, eo);
  eo.cuda_graphs = true;
  mbp::Executor b(*asked, *asked_opt, eo);
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(B, sample, 90 + static_cast<std::uint32_t>(step));
    const mbp::StepResult ra = a.step(d.images.data(), d.labels.data(), B);
    const mbp::StepResult rb = b.step(d.images.data(), d.labels.data(), B);
    EXPECT_EQ(rb.loss, ra.loss);
    EXPECT_EQ(rb.peak, rb.predicted_peak);
  }
  EXPECT_TRUE(bitwise_equal(values<double>(*asked, true), values<double>(*plain, true)));
  const mbp::Executor::GraphStats& g = b.graph_stats();
  EXPECT_EQ(g.recorded + g.replayed + g.unreplayable, 0);
  EXPECT_EQ(g.failed, "");
}

TEST_F(Mbp, BatchNormRunningStatisticsOncePerStepFromTheWholeBatch) {
  const std::int64_t B = 30;
  const Shape sample{3, 16, 16};
  auto ref = model("resnet20", "batch", 4, DType::Float64);
  auto mb = model("resnet20", "batch", 4, DType::Float64);
  auto ref_opt = sgd(*ref), mb_opt = sgd(*mb);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 4;
  mbp::Executor ex(*mb, *mb_opt, eo);
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(B, sample, 40 + static_cast<std::uint32_t>(step));
    full_batch_backward<double>(*ref, d, B, sample);
    {
      NoGradGuard ng;
      ref_opt->step();
      ref_opt->zero_grad();
    }
    NoGradGuard ng;  // the executor records its tape anyway (EnableGradGuard inside)
    ex.step(d.images.data(), d.labels.data(), B);
  }
  for (auto* bn : nn::batch_norm_layers(*mb)) EXPECT_EQ(bn->num_batches_tracked.to_vector<std::int64_t>()[0], 2);
  for (auto* bn : nn::batch_norm_layers(*ref)) EXPECT_EQ(bn->num_batches_tracked.to_vector<std::int64_t>()[0], 2);

  // One step from equal weights: the first BatchNorm's input is the same samples either way.
  auto ref1 = model("resnet20", "batch", 5, DType::Float64), mb1 = model("resnet20", "batch", 5, DType::Float64);
  auto mb1_opt = sgd(*mb1);
  mbp::Executor ex1(*mb1, *mb1_opt, eo);
  const Data d = make_data(B, sample, 77);
  full_batch_backward<double>(*ref1, d, B, sample);
  ex1.step(d.images.data(), d.labels.data(), B);
  const auto* a = nn::batch_norm_layers(*mb1).front();
  const auto* b = nn::batch_norm_layers(*ref1).front();
  const auto am = a->running_mean.to_vector<double>(), bm = b->running_mean.to_vector<double>();
  const auto av = a->running_var.to_vector<double>(), bv = b->running_var.to_vector<double>();
  EXPECT_LE(rel_error(std::vector<double>(am.begin(), am.end()), std::vector<double>(bm.begin(), bm.end())), 1e-12);
  EXPECT_LE(rel_error(std::vector<double>(av.begin(), av.end()), std::vector<double>(bv.begin(), bv.end())), 1e-12);
  EXPECT_GT(rel_error(std::vector<double>(am.begin(), am.end()), std::vector<double>(am.size(), 0.0)), 0.0);
}

// ---------------------------------------------------------------------------------------------
struct ExactCase {
  std::string model, norm;
  Shape sample;
  std::int64_t batch;
  std::string budget;               // arena capacity
  std::optional<std::int64_t> micro;  // fixed m, else searched
  std::string name;
};

// How gtest shows a case (--gtest_list_tests, a failure): its fields, not its bytes.
void PrintTo(const ExactCase& c, std::ostream* os) {
  *os << c.model << ", norm " << c.norm << ", " << shape_str(c.sample) << ", batch " << c.batch << " in " << c.budget
      << ", micro-batch " << (c.micro ? std::to_string(*c.micro) : "searched");
}

class PlannerExact : public Mbp, public ::testing::WithParamInterface<ExactCase> {};

TEST_P(PlannerExact, PredictedPeakEqualsMeasuredPeak) {
  const ExactCase& c = GetParam();
  const std::size_t budget = parse_size(c.budget);
  configure_arena(Device::cpu(), budget);
  auto m = model(c.model, c.norm);
  auto opt = sgd(*m, 0.01);
  mbp::ExecutorOptions eo;
  eo.sample_shape = c.sample;
  eo.micro_batch = c.micro;
  mbp::Executor ex(*m, *opt, eo);
  const mbp::Plan& p = ex.plan(c.batch);
  EXPECT_LE(p.predicted_peak, budget);
  if (c.micro) {
    EXPECT_LE(p.micro_batch, *c.micro);
  }
  // The planner's compressed probes agree with a full dry run of the split.
  EXPECT_EQ(ex.planner().probe(p.sizes(), false).peak, p.predicted_peak);
  // The search found the largest m: the split with one micro-batch fewer (the next larger m)
  // does not fit.
  if (!c.micro && p.micro_batches > 1) {
    const auto bigger = mbp::balanced_sizes(c.batch, p.micro_batches - 1);
    EXPECT_FALSE(ex.planner().probe(bigger, false).fits) << "a split with micro-batches of " << bigger.front() << " fits too";
  }
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(c.batch, c.sample, 7 + static_cast<std::uint32_t>(step));
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), c.batch);
    EXPECT_EQ(r.oom_retries, 0);
    EXPECT_EQ(r.peak, r.predicted_peak) << "step " << step;
    EXPECT_LE(r.peak, budget);
    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_EQ(transient_bytes(*ex.arena()), 0) << "a step leaves only the persistent state";
  }
  std::cout << c.name << ": " << p.summary() << " (" << p.probes << " dry runs)\n";
}

// Budgets that split the batch on every instruction set oneDNN may run (ResNet-18's smallest
// step needs 174 MiB under AVX2, whose scratchpads are larger than AVX-512's: 150 MiB failed there).
INSTANTIATE_TEST_SUITE_P(
    Models, PlannerExact,
    ::testing::Values(ExactCase{"resnet20", "batch", {3, 32, 32}, 64, "12MiB", {}, "resnet20_batch_12MiB"},
                      ExactCase{"resnet20", "group", {3, 32, 32}, 64, "24MiB", {}, "resnet20_group_24MiB"},
                      ExactCase{"resnet20", "none", {3, 32, 32}, 50, "8GiB", 7, "resnet20_none_m7"},
                      ExactCase{"resnet20", "batch", {3, 32, 32}, 40, "8GiB", 40, "resnet20_batch_full"},
                      ExactCase{"resnet32", "batch", {3, 16, 16}, 33, "8MiB", {}, "resnet32_batch_8MiB"},
                      ExactCase{"resnet9", "batch", {3, 32, 32}, 24, "120MiB", {}, "resnet9_120MiB"},
                      ExactCase{"resnet18", "batch", {3, 32, 32}, 48, "200MiB", {}, "resnet18_200MiB"}),
    [](const auto& info) { return info.param.name; });

// Convolutions whose oneDNN buffers would exceed the workspace limit (budget / 32, at least
// 64 MiB) run over chunks of samples: at 1 GiB a ResNet-20 micro-batch of 600 takes at most
// 64 MiB of workspace (its 3x3 convolutions at 32x32 would take 75 MiB whole, as they do at
// 16 GiB), the plan is still exact, and the step trains to the same parameters (the filter
// gradients' sums ordered by chunk: float32 rounding apart).
TEST_F(Mbp, ChunkedConvolutionsKeepThePlanExactAndTheStep) {
  if (!kernels::cpu::have_onednn()) GTEST_SKIP() << "this build has no oneDNN: nothing is chunked";
  const Shape sample{3, 32, 32};
  const std::int64_t B = 600;
  std::vector<std::vector<std::vector<double>>> params;
  std::vector<std::int64_t> workspace;
  for (const char* budget : {"1GiB", "16GiB"}) {
    SCOPED_TRACE(budget);
    configure_arena(Device::cpu(), parse_size(budget));
    auto m = model("resnet20", "batch", 5);
    auto opt = sgd(*m, 0.05);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = B;
    mbp::Executor ex(*m, *opt, eo);
    const Data d = make_data(B, sample, 77);
    ex.arena()->reset_peak();
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
    EXPECT_EQ(r.peak, r.predicted_peak);
    EXPECT_EQ(r.micro_batches, 1);
    workspace.push_back(ex.arena()->stats()[Category::workspace].peak);
    params.push_back(values<float>(*m));
  }
  EXPECT_LE(workspace[0], std::int64_t(64) << 20);
  EXPECT_GT(workspace[1], std::int64_t(64) << 20);
  double worst = 0;
  for (std::size_t i = 0; i < params[0].size(); ++i) worst = std::max(worst, rel_error(params[0][i], params[1][i]));
  EXPECT_LT(worst, 1e-5);
  EXPECT_GT(worst, 0) << "the chunked filter gradients round differently; equal bits would mean nothing was chunked";
  std::cout << fmt::format("workspace peak {} chunked, {} whole; parameters differ by {:.1e}\n",
                           format_bytes(workspace[0]), format_bytes(workspace[1]), worst);
}

// ---------------------------------------------------------------------------------------------
// An allocation fails in the middle of a step (the k-th allocation of the step, inside its second
// micro-batch). The step is discarded and retried with half the micro-batch; the run must equal,
// bit for bit, an uninterrupted run that used the smaller micro-batch from the start, and
// nothing of the failed attempt may remain (no transient bytes, BatchNorm counted once).
TEST_F(Mbp, InjectedOutOfMemoryRetriesTheStepAndLosesNothing) {
  const std::int64_t B = 32;
  const Shape sample{3, 16, 16};
  std::vector<Data> batches;
  for (int s = 0; s < 2; ++s) batches.push_back(make_data(B, sample, 300 + static_cast<std::uint32_t>(s)));

  // Reference: micro-batches of 4 throughout.
  auto ref = model("resnet20", "batch", 9);
  auto ref_opt = sgd(*ref);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 4;
  mbp::Executor ref_ex(*ref, *ref_opt, eo);
  const auto arena = ref_ex.arena();
  const std::int64_t allocs_before = arena->stats().total.allocations;
  ref_ex.step(batches[0].images.data(), batches[0].labels.data(), B);
  const std::int64_t step_allocs = arena->stats().total.allocations - allocs_before;  // 8 micro-batches
  ref_ex.step(batches[1].images.data(), batches[1].labels.data(), B);

  // Faulted run: micro-batches of 8; the allocation in the middle of micro-batch 2 of 4 fails.
  auto run = model("resnet20", "batch", 9);
  auto run_opt = sgd(*run);
  eo.micro_batch = 8;
  std::vector<std::string> log;
  eo.log = [&](const std::string& l) { log.push_back(l); };
  mbp::Executor ex(*run, *run_opt, eo);
  const auto params_before = values<float>(*run);
  const auto buffers_before = values<float>(*run, true);
  const std::uint64_t k = static_cast<std::uint64_t>(step_allocs / 8 * 3 / 2);  // inside micro-batch 2
  arena->fail_allocation_after(k);
  const mbp::StepResult r = ex.step(batches[0].images.data(), batches[0].labels.data(), B);
  EXPECT_EQ(r.oom_retries, 1);
  EXPECT_EQ(r.micro_batch, 4);
  EXPECT_EQ(ex.micro_batch_limit(), 4);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_NE(log[0].find("injected"), std::string::npos) << log[0];
  EXPECT_EQ(transient_bytes(*arena), 0);
  EXPECT_FALSE(bitwise_equal(values<float>(*run), params_before));
  ex.step(batches[1].images.data(), batches[1].labels.data(), B);
  EXPECT_TRUE(bitwise_equal(values<float>(*run), values<float>(*ref))) << "parameters differ from the uninterrupted run";
  EXPECT_TRUE(bitwise_equal(values<float>(*run, true), values<float>(*ref, true))) << "running statistics differ";
  for (auto* bn : nn::batch_norm_layers(*run)) EXPECT_EQ(bn->num_batches_tracked.to_vector<std::int64_t>()[0], 2);
  (void)buffers_before;
}

// ---------------------------------------------------------------------------------------------
// The GPU's input slots (mbp/executor.h), run on the CPU: two slots of the plan's largest
// micro-batch outlive each step, are made again when a plan needs another size (batch 5 after
// batches of 40, then 40 again: the planner's dry runs free the old ones in their clones as the
// step does), and an out-of-memory retry makes them again for the smaller micro-batch. Every
// step's peak equals its plan's, and the values are those of the step without slots, bit for bit
// (the same micro-batches: only where the inputs lie differs).
TEST_F(Mbp, InputSlotsKeepPlansExactAndStepsBitForBit) {
  const Shape sample{3, 16, 16};
  const std::vector<std::int64_t> batches{40, 40, 5, 40, 23};
  std::vector<Data> data;
  for (std::size_t s = 0; s < batches.size(); ++s)
    data.push_back(make_data(batches[s], sample, 500 + static_cast<std::uint32_t>(s)));
  const auto slot_bytes = [&](std::int64_t n) {  // x and y of one slot, as the arena rounds them
    return static_cast<std::int64_t>(Arena::round_up(static_cast<std::size_t>(n * 3 * 16 * 16) * sizeof(float)) +
                                     Arena::round_up(static_cast<std::size_t>(n) * sizeof(std::int64_t)));
  };
  std::vector<std::vector<std::vector<double>>> params;
  for (const bool slots : {false, true})
  for (const MemoryFormat format : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast}) {
    SCOPED_TRACE(fmt::format("{}, {}", slots ? "slots" : "no slots", memory_format_name(format)));
    configure_arena(Device::cpu(), parse_size("64MiB"));
    auto m = model("resnet20", "batch", 3);
    auto opt = sgd(*m);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 6;
    eo.memory_format = format;  // a slot is staged channels-last: no conversion on the device
    eo.input_slots_on_cpu = slots;
    mbp::Executor ex(*m, *opt, eo);
    for (std::size_t s = 0; s < batches.size(); ++s) {
      const mbp::StepResult r = ex.step(data[s].images.data(), data[s].labels.data(), batches[s]);
      EXPECT_EQ(r.peak, r.predicted_peak) << "step " << s;
      EXPECT_TRUE(std::isfinite(r.loss));
      const std::int64_t held = ex.arena()->stats()[Category::input].current;
      EXPECT_EQ(held, slots ? 2 * slot_bytes(std::min<std::int64_t>(6, batches[s])) : 0) << "step " << s;
    }
    params.push_back(values<float>(*m));
  }
  // (no slots, slots) x (contiguous, channels-last): the slots change no value in either format.
  EXPECT_TRUE(bitwise_equal(params[0], params[2])) << "the slots changed a value";
  EXPECT_TRUE(bitwise_equal(params[1], params[3])) << "the channels-last slots changed a value";

  // Searched micro-batches in a budget that splits the batch, and a retry: exact throughout.
  configure_arena(Device::cpu(), parse_size("12MiB"));
  auto m = model("resnet20", "batch", 4);
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.input_slots_on_cpu = true;
  std::vector<std::string> log;
  eo.log = [&](const std::string& l) { log.push_back(l); };
  mbp::Executor ex(*m, *opt, eo);
  std::int64_t first_m = 0;
  for (std::size_t s = 0; s < batches.size(); ++s) {
    if (s == 3) ex.arena()->fail_allocation_after(200);  // inside the step: it is retried
    const mbp::StepResult r = ex.step(data[s].images.data(), data[s].labels.data(), batches[s]);
    if (s == 0) first_m = r.micro_batch;
    EXPECT_EQ(r.oom_retries, s == 3 ? 1 : 0) << "step " << s;
    EXPECT_EQ(r.peak, r.predicted_peak) << "step " << s << ": micro-batches of " << r.micro_batch;
    EXPECT_LE(r.peak, parse_size("12MiB"));
    EXPECT_EQ(ex.arena()->stats()[Category::input].current,
              2 * slot_bytes(std::min<std::int64_t>(r.micro_batch, batches[s])))
        << "step " << s;
  }
  EXPECT_GT(first_m, 1);
  EXPECT_LT(first_m, 40) << "the budget was to split the batch";
  EXPECT_EQ(ex.micro_batch_limit(), first_m / 2);
  EXPECT_EQ(log.size(), 1u);

  // Offloaded segments move the model's input to the host tier with the stem's activations
  // (core/offload.h): a step that offloads takes no slots (those of the steps before freed, in the
  // dry runs too), and is the step without slots, bit for bit.
  std::vector<std::vector<std::vector<double>>> offloaded;
  for (const bool slots : {false, true}) {
    SCOPED_TRACE(slots ? "offloaded, slots asked for" : "offloaded");
    configure_arena(Device::cpu(), parse_size("64MiB"));
    auto om = model("resnet20", "batch", 5);
    auto oopt = sgd(*om);
    mbp::ExecutorOptions oo;
    oo.sample_shape = sample;
    oo.micro_batch = 6;
    oo.host_arena = Arena::make_host(std::size_t(64) << 20);
    oo.placement = mbp::Placement::device;
    oo.input_slots_on_cpu = slots;
    mbp::Executor ox(*om, *oopt, oo);
    for (std::size_t s = 0; s < batches.size(); ++s) {
      const mbp::StepResult r = ox.step(data[s].images.data(), data[s].labels.data(), batches[s]);
      EXPECT_EQ(r.peak, r.predicted_peak) << "step " << s;
      EXPECT_EQ(r.host_peak, r.host_predicted_peak) << "step " << s;
      EXPECT_EQ(r.host_peak > 0, s >= 2) << "step " << s << ": offloaded from the third step on";
      EXPECT_EQ(ox.arena()->stats()[Category::input].current,
                slots && s < 2 ? 2 * slot_bytes(std::min<std::int64_t>(6, batches[s])) : 0)
          << "step " << s;
      if (s == 1) {  // every segment offloaded from the next step on (recompute "none": as marked)
        const std::size_t n = nn::segment_modes(*om).size();
        nn::set_segment_modes(*om, std::vector<nn::SegmentMode>(n, nn::SegmentMode::offload));
      }
    }
    offloaded.push_back(values<float>(*om));
  }
  EXPECT_TRUE(bitwise_equal(offloaded[0], offloaded[1])) << "the slots changed an offloaded step's value";
}

// A part added to the step (mbp/step_part.h) is called at its points: begin_step once per real step,
// every parameter's gradient_ready once per micro-batch, after_micro_batch after each,
// before_optimizer_step once with the step's loss — and in the planner's dry runs too, which it
// can tell by skip_side_effects().
namespace {
struct RecordingPart : mbp::StepPart {
  int begins = 0, ends = 0, dry_calls = 0;
  std::vector<std::size_t> after;                       // indices of after_micro_batch calls
  std::vector<std::map<const TensorImpl*, int>> ready;  // per micro-batch: times each parameter was reported
  void begin_step(const std::int64_t*, std::int64_t) override { ++begins, ready.clear(), after.clear(); }
  bool wants_gradient_ready() const override { return true; }
  void gradient_ready(const Tensor& p) override {
    if (skip_side_effects()) return (void)++dry_calls;
    if (ready.size() == after.size()) ready.emplace_back();
    ++ready.back()[&p.impl()];
  }
  void after_micro_batch(std::size_t i, std::size_t) override {
    if (!skip_side_effects()) after.push_back(i);
  }
  void before_optimizer_step(Tensor& loss) override {
    if (skip_side_effects()) return;
    ++ends;
    EXPECT_TRUE(loss.defined());
  }
};
}  // namespace

TEST_F(Mbp, PartsAreCalledAtEveryExtensionPointOfTheStep) {
  const std::int64_t B = 10;
  const Shape sample{3, 16, 16};
  auto m = model("resnet20", "batch", 2);
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 4;
  mbp::Executor ex(*m, *opt, eo);
  auto owned = std::make_unique<RecordingPart>();
  RecordingPart& part = *owned;
  ex.add_part(std::move(owned));
  EXPECT_THROW(ex.add_part(nullptr), Error);
  const Data d = make_data(B, sample, 4);
  const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
  ASSERT_EQ(r.micro_batches, 3);
  EXPECT_EQ(part.begins, 1);
  EXPECT_EQ(part.ends, 1);
  EXPECT_EQ(part.after, (std::vector<std::size_t>{0, 1, 2}));
  EXPECT_GT(part.dry_calls, 0) << "the planner's dry runs reach the parts too";
  ASSERT_EQ(part.ready.size(), 3u);
  const auto params = m->parameters();
  for (const auto& per_micro_batch : part.ready) {
    EXPECT_EQ(per_micro_batch.size(), params.size());
    for (const Tensor& p : params) {
      const auto it = per_micro_batch.find(&p.impl());
      EXPECT_EQ(it == per_micro_batch.end() ? 0 : it->second, 1);
    }
  }
}

// When retries are exhausted the step fails with an error, and the training state is exactly
// what it was before the step: parameters, running statistics, zero gradients.
TEST_F(Mbp, FailedStepLeavesTheTrainingStateUntouched) {
  const std::int64_t B = 12;
  const Shape sample{3, 16, 16};
  auto m = model("resnet20", "batch", 2);
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 4;
  eo.max_oom_retries = 0;
  mbp::Executor ex(*m, *opt, eo);
  const Data d = make_data(B, sample, 8);
  ex.step(d.images.data(), d.labels.data(), B);  // state with momentum, moved weights
  const auto p0 = values<float>(*m), b0 = values<float>(*m, true);
  ex.arena()->fail_allocation_after(150);
  const Data d2 = make_data(B, sample, 9);
  EXPECT_THROW(ex.step(d2.images.data(), d2.labels.data(), B), OutOfMemory);
  EXPECT_TRUE(bitwise_equal(values<float>(*m), p0));
  EXPECT_TRUE(bitwise_equal(values<float>(*m, true), b0));
  for (const auto& g : grads<float>(*m))
    for (double v : g) ASSERT_EQ(v, 0.0);
  EXPECT_EQ(transient_bytes(*ex.arena()), 0);
  // A bad label is not an out-of-memory error: also discarded, state intact, error names it.
  Data bad = make_data(B, sample, 10);
  bad.labels[7] = 10;
  try {
    ex.step(bad.images.data(), bad.labels.data(), B);
    FAIL() << "expected an error for label 10 of 10 classes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("10"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(bitwise_equal(values<float>(*m), p0));
  EXPECT_EQ(transient_bytes(*ex.arena()), 0);
}

// ---------------------------------------------------------------------------------------------
TEST_F(Mbp, BudgetTooSmallForOneSampleStatesTheExactBudgetNeeded) {
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 32, 32};
  auto plan_in = [&](std::size_t budget) {
    configure_arena(Device::cpu(), budget);
    auto m = model("resnet20", "batch");
    auto opt = sgd(*m);
    mbp::Executor ex(*m, *opt, eo);
    return ex.plan(128);
  };
  std::size_t needed = 0;
  try {
    plan_in(parse_size("4MiB"));
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("4.0 MiB"), std::string::npos) << w;
    EXPECT_NE(w.find("not even one sample fits"), std::string::npos) << w;
    EXPECT_NE(w.find(fmt::format("at least {} ({} bytes)", format_bytes(e.requested()), e.requested())), std::string::npos) << w;
    for (const char* c : {"parameter", "gradient", "optimizer_state", "activation", "input"})
      EXPECT_NE(w.find(c), std::string::npos) << c << " missing from: " << w;
    needed = e.requested();
  }
  // The stated budget is exact: it plans micro-batches of 1, one alignment unit less does not.
  ASSERT_GT(needed, parse_size("4MiB"));
  const mbp::Plan p = plan_in(needed);
  EXPECT_EQ(p.micro_batch, 1);
  EXPECT_LE(p.predicted_peak, needed);
  EXPECT_THROW(plan_in(needed - Arena::kAlignment), OutOfMemory);
}

// ResNet-18 on 32x32 inputs ends in a 1x1 feature map: BatchNorm cannot train on one sample
// there, at any budget. The planner passes over micro-batches of 1 instead of failing.
TEST_F(Mbp, SplitsThatCannotRunAreSkipped) {
  configure_arena(Device::cpu(), parse_size("8GiB"));
  auto m = model("resnet18", "batch");
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 32, 32};
  mbp::Executor ex(*m, *opt, eo);
  EXPECT_FALSE(ex.planner().probe({1, 1}, false).error.empty());
  EXPECT_EQ(ex.plan(8).micro_batches, 1);
  eo.micro_batch = 1;
  mbp::Executor fixed(*m, *opt, eo);
  try {
    fixed.plan(8);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than 1 value per channel"), std::string::npos) << e.what();
  }
}

TEST_F(Mbp, ExplicitMicroBatchThatCannotFitIsAnErrorWithTheBreakdown) {
  configure_arena(Device::cpu(), parse_size("16MiB"));
  auto m = model("resnet20", "none");
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 32, 32};
  eo.micro_batch = 64;
  mbp::Executor ex(*m, *opt, eo);
  try {
    ex.plan(128);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("the fixed micro-batch of 64 does not fit"), std::string::npos) << w;
    EXPECT_NE(w.find("activation"), std::string::npos) << w;
  }
}

TEST_F(Mbp, PlansAreCachedAndErrorsOnBadSizes) {
  auto m = model("resnet20", "none");
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 8, 8};
  mbp::Executor ex(*m, *opt, eo);
  const mbp::Plan& a = ex.plan(16);
  const int probes = ex.planner().probes();
  const mbp::Plan& b = ex.plan(16);
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(ex.planner().probes(), probes);
  EXPECT_EQ(a.micro_batches, 1);  // 8 GiB: the whole batch fits
  EXPECT_THROW(ex.plan(0), Error);
  eo.micro_batch = 0;
  EXPECT_THROW(mbp::Executor(*m, *opt, eo), Error);
  eo.micro_batch.reset();
  eo.sample_shape = {};
  EXPECT_THROW(mbp::Executor(*m, *opt, eo), Error);
}

// ---------------------------------------------------------------------------------------------
// The budget as an argument: the executor runs on the arena it is given, not on a default one,
// and refuses a model whose parameters live elsewhere.
TEST_F(Mbp, ExecutorRunsOnTheArenaItIsGivenAndChecksTheParametersLiveThere) {
  const Shape sample{3, 16, 16};
  const auto budget = std::make_shared<Arena>(Device::cpu(), parse_size("24MiB"));
  std::shared_ptr<nn::Module> m;
  std::unique_ptr<optim::SGD> opt;
  {
    ArenaScope in_budget(budget);
    m = model("resnet20", "batch");
    opt = sgd(*m);
  }
  const auto& fallback = default_arena(Device::cpu());
  const std::int64_t fallback_before = fallback->stats().total.peak;
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  mbp::Executor ex(*m, *opt, budget, eo);
  EXPECT_EQ(ex.arena(), budget);
  const Data d = make_data(40, sample, 9);
  const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), 40);
  EXPECT_EQ(r.peak, r.predicted_peak);
  EXPECT_LE(r.peak, budget->capacity());
  EXPECT_GT(budget->stats()[Category::activation].peak, 0);
  EXPECT_EQ(fallback->stats().total.peak, fallback_before) << "the default arena was used";

  const auto elsewhere = std::make_shared<Arena>(Device::cpu(), parse_size("24MiB"));
  try {
    mbp::Executor wrong(*m, *opt, elsewhere, eo);
    ADD_FAILURE() << "an executor on an arena that does not hold the parameters was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another arena"), std::string::npos) << e.what();
  }
}

TEST(Memory, ReleaseDefaultArenaOnlyWhenNothingElseHoldsIt) {
  configure_arena(Device::cpu(), parse_size("8MiB"));
  {
    const std::shared_ptr<Arena> held = default_arena(Device::cpu());
    EXPECT_FALSE(release_default_arena(Device::cpu()));
    EXPECT_EQ(default_arena(Device::cpu()), held);
  }
  EXPECT_TRUE(release_default_arena(Device::cpu()));
  EXPECT_FALSE(release_default_arena(Device::cpu()));  // nothing left to release
  EXPECT_EQ(default_arena(Device::cpu())->capacity(), kDefaultCpuArenaBytes);  // a fresh default on next use
}

// ---------------------------------------------------------------------------------------------
TEST_F(Mbp, LayerTableAccountsEveryLayer) {
  auto m = model("resnet20", "batch");
  const auto rows = report::layer_table(*m, *current_arena(Device::cpu()), {3, 32, 32}, 4);
  std::int64_t params = 0, kept = 0;
  bool saw_conv1 = false, saw_fc = false;
  for (const auto& r : rows) {
    params += r.parameters;
    kept += r.kept_bytes;
    if (r.name == "conv1") {
      saw_conv1 = true;
      EXPECT_EQ(r.type, "Conv2d");
      EXPECT_EQ(r.output, (Shape{16, 32, 32}));
      EXPECT_EQ(r.parameters, 16 * 3 * 9);
      EXPECT_EQ(r.kept_bytes, 4 * 16 * 32 * 32 * 4);  // its output, float32
    }
    if (r.name == "fc") {
      saw_fc = true;
      EXPECT_EQ(r.output, (Shape{10}));
    }
  }
  EXPECT_TRUE(saw_conv1 && saw_fc);
  EXPECT_EQ(params, 272474);
  EXPECT_GT(kept, 0);
  const std::string text = report::format_layer_table(rows, 4);
  EXPECT_NE(text.find("layer1.0.conv1"), std::string::npos);
}

TEST_F(Mbp, PlanCommandResNet50At224Batch4096In8GiB) {
  app::PlanOptions po;
  po.model = "resnet50";
  po.input = "3x224x224";
  po.batch_size = 4096;
  po.memory_limit = "8GiB";
  std::ostringstream out;
  const mbp::Plan p = app::plan(po, out);
  EXPECT_GT(p.micro_batch, 1);
  EXPECT_LT(p.micro_batch, 4096);
  EXPECT_LE(p.predicted_peak, parse_size("8GiB"));
  EXPECT_NE(out.str().find("layer4.2.conv3"), std::string::npos);
  EXPECT_NE(out.str().find("plan: batch 4096"), std::string::npos);
  std::cout << out.str().substr(out.str().find("plan:"));
}

TEST_F(Mbp, PlanCommandRejectsBadOptions) {
  app::PlanOptions po;
  po.input = "3x224";
  EXPECT_THROW(app::plan(po, std::cout), Error);
  po.input = "3xax224";
  EXPECT_THROW(app::plan(po, std::cout), Error);
  po.input = "3x32x32";
  po.memory_limit = "lots";
  EXPECT_THROW(app::plan(po, std::cout), Error);
  po.memory_limit = "1MiB";
  EXPECT_THROW(app::plan(po, std::cout), OutOfMemory);  // resnet50's parameters alone are ~100 MiB
}

// ---------------------------------------------------------------------------------------------
TEST_F(Mbp, TimelineDrawsBandsMarksBudgetAndPeak) {
  configure_arena(Device::cpu(), parse_size("64MiB"));
  auto m = model("resnet20", "group");
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 16, 16};
  eo.micro_batch = 5;
  mbp::Executor ex(*m, *opt, eo);
  const Data d = make_data(12, {3, 16, 16}, 1);
  ex.arena()->set_tracing(true);
  const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), 12);
  ex.arena()->set_tracing(false);
  ASSERT_EQ(ex.arena()->marks().size(), 4u);  // 3 micro-batches + the optimizer step
  EXPECT_EQ(ex.arena()->marks()[0].label, "micro-batch 1/3 (4 samples)");
  report::TimelineOptions to;
  to.budget = ex.arena()->capacity();
  to.predicted_peak = r.predicted_peak;
  const std::string svg = report::memory_svg(*ex.arena(), to);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("budget 64.0 MiB"), std::string::npos);
  EXPECT_NE(svg.find("(exact)"), std::string::npos);
  EXPECT_NE(svg.find("micro-batch 3/3"), std::string::npos);
  for (const char* c : {"parameter", "gradient", "optimizer_state", "activation"})
    EXPECT_NE(svg.find(fmt::format("<title>{}</title>", c)), std::string::npos) << c;
  // The Perfetto trace starts from the live persistent bytes and carries the marks.
  const auto j = nlohmann::json::parse(ex.arena()->trace_json());
  int marks = 0;
  for (const auto& e : j["traceEvents"]) marks += e.value("cat", "") == "mark";
  EXPECT_EQ(marks, 4);
}

// Every allocation of a traced step names who made it: the module whose forward ran (its dotted
// path, as named_parameters() names its weights), the backward of a node that module recorded, or
// its forward re-run in backward (recomputation); inputs, the loss and the optimizer step are
// "other". A free carries its allocation's site; the Perfetto trace has both in its args.
TEST_F(Mbp, TheTraceNamesTheModuleAndPhaseOfEveryAllocation) {
  configure_arena(Device::cpu(), parse_size("64MiB"));
  auto m = model("resnet20", "batch");
  EXPECT_EQ(m->path(), "");
  auto opt = sgd(*m);
  EXPECT_EQ(nn::set_recompute_blocks(*m, true), 8);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 16, 16};
  eo.micro_batch = 6;
  mbp::Executor ex(*m, *opt, eo);
  const Data d = make_data(12, {3, 16, 16}, 2);
  ex.arena()->set_tracing(true);
  ex.step(d.images.data(), d.labels.data(), 12);
  ex.arena()->set_tracing(false);
  std::map<std::string, std::map<std::string, int>> by_module;  // module -> phase -> allocations
  std::map<std::size_t, std::pair<std::string, Phase>> live;   // offset -> the allocation's site
  for (const TraceEvent& e : ex.arena()->trace()) {
    if (e.is_alloc) {
      ++by_module[e.module][phase_name(e.phase)];
      live[e.offset] = {e.module, e.phase};
    } else if (const auto it = live.find(e.offset); it != live.end()) {
      EXPECT_EQ(e.module, it->second.first) << "a free names another site than its allocation";
      EXPECT_EQ(e.phase, it->second.second);
      live.erase(it);
    }
  }
  // A recomputed block's convolution: forward, re-run in backward, and its own backward (its
  // workspaces, the data gradient).
  for (const char* phase : {"forward", "recompute", "backward"})
    EXPECT_GT(by_module["layer2.0.conv1"][phase], 0) << phase;
  // The last block is not recomputed (its backward begins where its forward ended).
  EXPECT_GT(by_module["layer3.2.conv1"]["forward"], 0);
  EXPECT_EQ(by_module["layer3.2.conv1"]["recompute"], 0);
  EXPECT_GT(by_module[""]["other"], 0) << "inputs and the loss belong to no module";
  EXPECT_EQ(by_module[""]["forward"], 0) << "the model's own ops run inside its modules";
  const auto j = nlohmann::json::parse(ex.arena()->trace_json());
  int named = 0;
  for (const auto& e : j["traceEvents"])
    if (e.value("cat", "") == "alloc" && e["args"]["module"] == "layer1.1.bn2" && e["args"]["phase"] == "backward")
      ++named;
  EXPECT_GT(named, 0);
}

// What replaying one micro-batch's captured work for the next (a CUDA graph) needs: the micro-batches
// of one size allocate at the same offsets, event for event (mbp/graph_replay.h). Checked on the
// traced dry run of a plan (the real step's allocations: the arena is deterministic), plain, with
// recomputed blocks, and in bf16 channels-last.
TEST_F(Mbp, MicroBatchesOfOneSizeAllocateAtTheSameAddresses) {
  for (const std::string variant : {"plain", "recomputed", "bf16", "bf16 slots"}) {
    SCOPED_TRACE(variant);
    configure_arena(Device::cpu(), parse_size("64MiB"));
    auto m = model("resnet20", "batch");
    auto opt = sgd(*m);
    if (variant == "recomputed") nn::set_recompute_blocks(*m, true);
    mbp::ExecutorOptions eo;
    eo.sample_shape = {3, 16, 16};
    eo.micro_batch = 6;
    if (variant.starts_with("bf16")) eo.precision = mbp::Precision::bf16, eo.memory_format = MemoryFormat::ChannelsLast;
    eo.input_slots_on_cpu = variant == "bf16 slots";  // the GPU's inputs: no allocation in a micro-batch
    mbp::Executor ex(*m, *opt, eo);
    const mbp::Plan& p = ex.plan(40);  // 7 micro-batches: 5 of 6, 2 of 5
    ASSERT_EQ(p.micro_batches, 7);
    const mbp::ReplayCheck c = mbp::check_replay(*ex.traced_dry_step(p));
    ASSERT_EQ(c.same_as.size(), 7u) << c.summary();
    EXPECT_GT(c.events, 7u * 20) << "each micro-batch allocates";
    EXPECT_EQ(c.samples, (std::vector<std::int64_t>{6, 6, 6, 6, 6, 5, 5}));
    for (std::size_t i = 2; i < 5; ++i)
      EXPECT_EQ(c.same_as[i], c.same_as[1]) << "micro-batch " << i + 1 << ": " << c.summary();
    // The second micro-batch of 5 repeats the first; with slots (no input allocated first) the first
    // of 5 starts from the holes the micro-batches of 6 left and is a pattern of its own.
    EXPECT_EQ(c.same_as[6], eo.input_slots_on_cpu ? 6u : 5u) << c.summary();
    // The first micro-batch is a pattern of its own: it allocates the batch norms' moment
    // accumulators, which live to the step's end (two per batch norm); nothing else differs.
    EXPECT_EQ(c.same_as[1], 1u) << c.summary();
    const auto traced = ex.traced_dry_step(p);
    const auto& t = traced->trace();
    const auto& marks = traced->marks();
    std::map<std::string, int> first, second;
    for (std::size_t e = marks[0].event_index; e < marks[1].event_index; ++e) first[t[e].op] += t[e].is_alloc;
    for (std::size_t e = marks[1].event_index; e < marks[2].event_index; ++e) second[t[e].op] += t[e].is_alloc;
    EXPECT_EQ(first["batch_norm_moments"], 2 * 21);  // the stem's, two a block, the two projections'
    EXPECT_EQ(second["batch_norm_moments"], 0);
    first.erase("batch_norm_moments"), second.erase("batch_norm_moments");
    EXPECT_EQ(first, second);
  }
}

// ---------------------------------------------------------------------------------------------
// The done-when run, shortened to one step: batch 1024 in 48 MiB.
TEST_F(Mbp, TrainBatch1024In48MiBPlansAndMeasuresExactly) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_mbp_train";
  std::filesystem::remove_all(dir);
  app::TrainOptions o;
  o.data = "synthetic";
  o.batch_size = 1024;
  o.memory_limit = "48MiB";
  o.steps = 1;
  o.out = dir.string();
  o.progress = false;
  o.device = "cpu";
  std::ostringstream log;
  app::TrainResult r;
  try {
    r = app::train(o, log);
  } catch (const std::exception& e) {
    FAIL() << e.what() << "\nthe run's log:\n" << log.str();
  }
  SCOPED_TRACE("the run's log:\n" + log.str());  // every failure below shows what the run printed
  EXPECT_LT(r.micro_batch, 1024);
  EXPECT_GT(r.micro_batch, 1);
  EXPECT_EQ(r.peak_bytes, r.predicted_peak_bytes);
  EXPECT_LE(r.peak_bytes, parse_size("48MiB"));
  EXPECT_EQ(r.memory_limit_bytes, static_cast<std::int64_t>(parse_size("48MiB")));
  EXPECT_NE(log.str().find("plan: batch 1024"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("exact"), std::string::npos) << log.str();
  std::ifstream f(dir / "summary.json");
  const auto j = nlohmann::json::parse(f);
  for (const char* k : {"predicted_peak_bytes", "micro_batch", "micro_batches_per_step", "memory_limit_bytes", "oom_retries"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["predicted_peak_bytes"], j["peak_bytes"]);
  EXPECT_TRUE(std::filesystem::exists(dir / "memory.svg"));
  EXPECT_TRUE(std::filesystem::exists(dir / "memory_trace.json"));
}

TEST_F(Mbp, TrainRecoversFromAnInjectedOutOfMemoryAndCountsIt) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_mbp_inject";
  std::filesystem::remove_all(dir);
  app::TrainOptions o;
  o.data = "synthetic";
  o.batch_size = 32;
  o.micro_batch = 16;
  o.steps = 2;
  o.out = dir.string();
  o.progress = false;
  o.device = "cpu";
  o.inject_oom = std::make_pair(std::int64_t{0}, std::uint64_t{100});
  std::ostringstream log;
  const app::TrainResult r = app::train(o, log);
  EXPECT_EQ(r.oom_retries, 1);
  EXPECT_EQ(r.micro_batch, 8);
  EXPECT_NE(log.str().find("retrying with at most 8"), std::string::npos) << log.str();
  std::ifstream f(dir / "summary.json");
  EXPECT_EQ(nlohmann::json::parse(f)["oom_retries"], 1);
}

TEST_F(Mbp, TrainRejectsBadBudgetsAndMicroBatches) {
  app::TrainOptions o;
  o.steps = 1;
  o.progress = false;
  std::ostringstream log;
  o.memory_limit = "48 elephants";
  EXPECT_THROW(app::train(o, log), Error);
  o.memory_limit = "auto";
  o.micro_batch = 0;
  EXPECT_THROW(app::train(o, log), Error);
  o.micro_batch = o.batch_size + 1;
  EXPECT_THROW(app::train(o, log), Error);
  o.micro_batch.reset();
  o.memory_limit = "512KiB";  // not even the parameters
  try {
    app::train(o, log);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("do not fit"), std::string::npos) << e.what();
  }
}
