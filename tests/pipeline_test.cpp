// Pipeline stages (mbp/pipeline.h, and the executor's mbp::StageRunner, mbp/stage_runner.h).
// In one process (PipelineParts.*): the segments of every model compose to its forward bit for
// bit; the schedules' orders; the cut and --pipeline-split's errors. Under `mpirun -np 2`
// (PipelineStages.*; each skips, saying so, in a world of one): float64 ResNet-20 through 2 stages,
// several SGD-momentum steps, against one process — with group norm and no norm its full-batch step
// (<= 1e-12), with BatchNorm its micro-batched step at the same micro-batch (<= 1e-12, running
// statistics too) — under 1F1B and GPipe, with equal and with different limits per rank (the
// micro-batch is then the smaller stage's); predicted == measured peak on every rank every step.
// StagedPipelineStages.*: the same stages with their messages through host memory (the transport
// of a GPU's stages) change no bit, and take exactly the staging the plan says. GpuStages.* (ctest
// pipeline.gpu_two_stages_one_gpu; skips without a GPU, saying so): two ranks on one GPU as two
// stages against one process on it.
// PipelineCommandLine.* (no mpirun; they start it): `tally train --pipeline-stages 2` against one
// process, and ResNet-50 in 300 MiB per stage.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/safetensors.h"
#include "distributed/communicator.h"
#include "distributed/staged.h"
#include "mbp/executor.h"
#include "mbp/pipeline.h"
#include "mbp/stage_runner.h"
#include "tests/command_line.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;

namespace tally::mbp {
// How gtest shows a schedule (--gtest_list_tests, a failure): by its name, not its bytes.
void PrintTo(PipelineSchedule s, std::ostream* os) { *os << pipeline_schedule_name(s); }
}  // namespace tally::mbp

namespace {

std::shared_ptr<distributed::Communicator> world() { return distributed::process_world(); }

class PipelineParts : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

}  // namespace

// The segments' composition is the model's forward, bit for bit, in training mode with gradients
// (the same ops in the same order) — for every model family.
TEST_F(PipelineParts, SegmentsComposeToTheForwardBitForBit) {
  for (const auto& [name, input] : std::vector<std::pair<std::string, Shape>>{
           {"resnet20", {3, 16, 16}}, {"resnet9", {3, 32, 32}}, {"resnet18", {3, 64, 64}}}) {
    for (const std::string norm : {"batch", "group"}) {
      auto m = model(name, norm, 4, DType::Float64);
      const Data d = make_data(3, input, 11);
      const Tensor x = input_tensor<double>(d, 3, input);
      const auto segments = m->segments();
      ASSERT_GE(segments.size(), 3u) << name;
      EXPECT_EQ(segments.front().name, name == "resnet9" ? "prep" : "stem");
      EXPECT_EQ(segments.back().name, "head");
      EXPECT_NO_THROW(mbp::check_segments_cover(*m, segments)) << name;
      const auto want = m->forward(x).to_vector<double>();
      Tensor y = x;
      for (const auto& s : segments) y = s.forward(y);
      const auto got = y.to_vector<double>();
      ASSERT_EQ(got.size(), want.size());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << name << " " << norm;
      EXPECT_TRUE(std::none_of(got.begin(), got.end(), [](double v) { return std::isnan(v); }));
    }
  }
}

// A model built as a Sequential is cut without help (nn::Sequential::segments): one segment per
// child, a Sequential child giving its own children's; they cover the model, compose to its forward
// bit for bit, and a cut of them into two stages is made by the planner's model of the stages.
TEST_F(PipelineParts, ASequentialModelIsCutWithoutHelp) {
  using nn::Sequential;
  nn::manual_seed(5);
  const auto block = [](std::int64_t c) {
    return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<nn::Conv2d>(c, c, 3, 1, 1, 1, 1, false), std::make_shared<nn::BatchNorm2d>(c),
        std::make_shared<nn::ReLU>()});
  };
  auto stage = std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{block(8), block(8)});
  Sequential m{std::make_shared<nn::Conv2d>(3, 8, 3, 1, 1, 1, 1, false), std::make_shared<nn::BatchNorm2d>(8),
               std::make_shared<nn::ReLU>(), stage, std::make_shared<nn::AdaptiveAvgPool2d>(1, 1),
               std::make_shared<nn::Flatten>(1), std::make_shared<nn::Linear>(8, 10)};
  const auto segments = m.segments();
  std::vector<std::string> names;
  for (const auto& sg : segments) names.push_back(sg.name);
  EXPECT_EQ(names, (std::vector<std::string>{"0", "1", "2", "3.0.0", "3.0.1", "3.0.2", "3.1.0", "3.1.1", "3.1.2",
                                             "4", "5", "6"}));
  EXPECT_NO_THROW(mbp::check_segments_cover(m, segments));
  const Data d = make_data(3, {3, 8, 8}, 13);
  const Tensor x = input_tensor<float>(d, 3, {3, 8, 8});
  const auto want = m.forward(x).to_vector<float>();
  Tensor y = x;
  for (const auto& sg : segments) y = sg.forward(y);
  EXPECT_EQ(y.to_vector<float>(), want);
  const auto costs = mbp::segment_costs(m, {3, 8, 8}, DType::Float32, 3);
  ASSERT_EQ(costs.size(), segments.size());
  const auto cut = mbp::balanced_cut(costs, 2, {64 << 20, 64 << 20}, 16);
  EXPECT_EQ(cut.size(), 3u) << "two stages: their bounds";
}

// Every micro-batch's forward and backward once, forward first; 1F1B holds at most S - s micro-batches
// on stage s, GPipe all k; the last stage runs forwards only (each with its backward).
TEST_F(PipelineParts, SchedulesRunEveryMicroBatchOnceAndHoldWhatTheySay) {
  for (auto schedule : {mbp::PipelineSchedule::one_f_one_b, mbp::PipelineSchedule::gpipe})
    for (int S : {2, 3, 4})
      for (int s = 0; s < S; ++s)
        for (std::int64_t k : {1, 2, 5, 8}) {
          const auto order = mbp::pipeline_order(schedule, s, S, k);
          const bool last = s == S - 1;
          std::vector<int> forwards(k, 0), backwards(k, 0);
          std::int64_t held = 0, most = 0;
          for (const auto& op : order) {
            if (op.forward) {
              EXPECT_EQ(forwards[op.index]++, 0);
              if (!last) most = std::max(most, ++held);
            } else {
              EXPECT_EQ(forwards[op.index], 1) << "backward before forward";
              EXPECT_EQ(backwards[op.index]++, 0);
              --held;
            }
          }
          for (std::int64_t i = 0; i < k; ++i) {
            EXPECT_EQ(forwards[i], 1);
            EXPECT_EQ(backwards[i], last ? 0 : 1);
          }
          mbp::PipelineStage st;
          st.stage = s, st.stages = S, st.schedule = schedule;
          if (!last) {
            EXPECT_EQ(most, st.in_flight(k)) << "stage " << s << " of " << S << ", k " << k;
            EXPECT_EQ(most, schedule == mbp::PipelineSchedule::gpipe ? k : std::min<std::int64_t>(S - s, k));
          }
        }
}

TEST_F(PipelineParts, CutsAndSplitsAndTheirErrors) {
  auto m = model("resnet20", "batch", 1);
  const auto segments = m->segments();
  ASSERT_EQ(segments.size(), 11u);  // stem, 9 blocks, head
  const auto costs = mbp::segment_costs(*m, {3, 32, 32}, DType::Float32, 1);
  for (const auto& c : costs) {
    EXPECT_GT(c.activation_bytes, 0) << c.name;
    EXPECT_GT(c.persistent_bytes, 0) << c.name;
  }
  EXPECT_GT(costs[0].activation_bytes, costs[9].activation_bytes) << "full resolution before quarter resolution";
  EXPECT_GT(costs[9].parameters, costs[1].parameters) << "64 channels before 16";
  double work = 0;
  for (const auto& c : costs) {
    EXPECT_GT(c.flops, 0) << c.name;
    work += c.flops;
  }
  // By work: two stages within one block of half the forward FLOPs each, and its split text parses back.
  const auto even = mbp::work_balanced_cut(costs, 2);
  double first_stage = 0;
  for (std::size_t i = 0; i < even[1]; ++i) first_stage += costs[i].flops;
  EXPECT_NEAR(first_stage / work, 0.5, 0.1);
  EXPECT_EQ(mbp::parse_pipeline_split(mbp::split_text(costs, even), segments, 2), even);
  EXPECT_EQ(mbp::work_shares(costs, {0, 11}), "100%");
  for (int S : {1, 2, 3, 11}) {
    const auto b = mbp::balanced_cut(costs, S, std::vector<std::int64_t>(S, std::int64_t(1) << 30), 128);
    ASSERT_EQ(b.size(), static_cast<std::size_t>(S) + 1);
    EXPECT_EQ(b.front(), 0u);
    EXPECT_EQ(b.back(), 11u);
    for (int s = 0; s < S; ++s) EXPECT_LT(b[s], b[s + 1]) << "every stage has a segment";
  }
  // A tight first limit moves the cut: fewer segments on stage 0.
  const auto loose = mbp::balanced_cut(costs, 2, {std::int64_t(64) << 20, std::int64_t(64) << 20}, 128);
  const auto tight = mbp::balanced_cut(costs, 2, {std::int64_t(8) << 20, std::int64_t(64) << 20}, 128);
  EXPECT_LE(tight[1], loose[1]);
  auto error_of = [](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of([&] { mbp::balanced_cut(costs, 12, std::vector<std::int64_t>(12, 1 << 30), 8); })
                .find("the model has 11 segments to cut between (stem, layer1.0"),
            std::string::npos);
  const auto split = mbp::parse_pipeline_split("layer2.0,layer3.0", segments, 3);
  EXPECT_EQ(split, (std::vector<std::size_t>{0, 4, 7, 11}));
  EXPECT_NE(error_of([&] { mbp::parse_pipeline_split("layer9.0", segments, 2); })
                .find("'layer9.0' names no segment of the model; its segments are stem, layer1.0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mbp::parse_pipeline_split("layer2.0", segments, 3); })
                .find("expected 2 segment names (where each stage after the first begins) for 3 stages, found 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mbp::parse_pipeline_split("layer3.0,layer2.0", segments, 3); }).find("does not come after"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mbp::parse_pipeline_split("stem", segments, 2); }).find("does not come after"),
            std::string::npos);
  EXPECT_EQ(mbp::segment_range(segments, 0, 4), "stem .. layer1.2");
  EXPECT_EQ(mbp::segment_range(segments, 10, 11), "head");
}

// A stage's executor refuses what a pipeline cannot do, naming it.
TEST_F(PipelineParts, StageOptionsThatCannotWorkAreErrors) {
  auto m = model("resnet20", "group", 1);
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 16, 16};
  mbp::PipelineStage st;
  st.stages = 2, st.stage = 0, st.bounds = {0, 5, 11};
  eo.pipeline = st;
  eo.recompute = "all";
  try {
    mbp::Executor ex(*m, *opt, default_arena(Device::cpu()), eo);
    FAIL() << "--recompute all accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recomputes its residual blocks at most (none|blocks|auto)"), std::string::npos);
  }
  eo.recompute = "none";
  st.bounds = {0, 5, 12};
  eo.pipeline = st;
  try {
    mbp::Executor ex(*m, *opt, default_arena(Device::cpu()), eo);
    FAIL() << "bounds past the segments accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected S + 1 increasing segment indices from 0 to 11"), std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------------
// Two stages against one process. Each rank builds the whole model (same seed) on the default
// arena, moves its stage into a budget of its own and trains it there.
namespace {

struct Stage {
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<Arena> budget;
  std::unique_ptr<optim::SGD> optimizer;
  std::vector<nn::Module::Segment> segments;
  mbp::PipelineStage stage;
};

Stage make_stage(const std::string& norm, int rank, const std::vector<std::size_t>& bounds,
                 mbp::PipelineSchedule schedule, std::size_t budget_bytes, Device device = Device::cpu(),
                 DType dtype = DType::Float64) {
  Stage s;
  s.model = model("resnet20", norm, 7, dtype);
  s.segments = s.model->segments();
  s.budget = std::make_shared<Arena>(device, budget_bytes);
  s.stage.stage = rank, s.stage.stages = 2, s.stage.bounds = bounds, s.stage.schedule = schedule;
  std::vector<Tensor> params = mbp::place_stage(s.segments, bounds, rank, s.budget);
  ArenaScope in_budget(s.budget);
  optim::SGDOptions so;
  so.lr = 0.05, so.momentum = 0.9, so.weight_decay = 5e-4;
  s.optimizer = std::make_unique<optim::SGD>(std::move(params), so);
  return s;
}

}  // namespace

class PipelineStages
    : public PipelineParts,
      public ::testing::WithParamInterface<std::tuple<std::string, mbp::PipelineSchedule, bool>> {};

TEST_P(PipelineStages, TwoStagesEqualOneProcess) {
  if (world()->size() != 2) GTEST_SKIP() << "needs exactly 2 ranks: run under mpirun -np 2 (this world has "
                                         << world()->size() << ")";
  const auto [norm, schedule, uneven] = GetParam();
  auto comm = world();
  const int rank = comm->rank();
  const std::int64_t B = 12;
  const Shape sample{3, 16, 16};
  const std::vector<std::size_t> bounds{0, 5, 11};  // stem .. layer2.0 | layer2.1 .. head
  // Uneven: rank 0 in 4 MiB, where fewer samples fit than rank 1's 64 MiB: the stages agree on the
  // smaller micro-batch. Even: both fit micro-batches of 3 (given), k = 4.
  // (GPipe's stage 0 holds every micro-batch whatever their size, so there rank 0 has 16 MiB, fits
  // the whole batch, and rank 1 is given micro-batches of 4.)
  const bool gpipe = schedule == mbp::PipelineSchedule::gpipe;
  Stage st = make_stage(norm, rank, bounds, schedule,
                        uneven && rank == 0 ? parse_size(gpipe ? "16MiB" : "4MiB") : parse_size("64MiB"));
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  if (!uneven) eo.micro_batch = 3;
  if (uneven && gpipe && rank == 1) eo.micro_batch = 4;  // rank 0 fits all 12: the stages agree on 4
  eo.communicator = comm;
  eo.pipeline = st.stage;
  mbp::Executor ex(*st.model, *st.optimizer, st.budget, eo);
  // The reference: one process, the same weights, the full batch (group/none) or the same micro-batches (batch).
  auto ref = model("resnet20", norm, 7, DType::Float64);
  auto ref_opt = sgd(*ref);
  std::unique_ptr<mbp::Executor> ref_ex;
  std::int64_t m = 0;
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(B, sample, 500 + static_cast<std::uint32_t>(step));
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
    if (step == 0) m = r.micro_batch;
    EXPECT_EQ(r.micro_batch, m);
    EXPECT_EQ(r.peak, r.predicted_peak) << "rank " << rank << " step " << step;
    EXPECT_GT(r.micro_batches, 1) << "a pipeline of one micro-batch would test nothing";
    double ms[2] = {0, 0};
    ms[rank] = static_cast<double>(r.micro_batch);
    comm->all_reduce_sum(ms, 2);
    EXPECT_EQ(ms[0], ms[1]) << "one micro-batch for every stage";
    double ref_loss = 0;
    if (norm == "batch") {
      if (!ref_ex) {
        mbp::ExecutorOptions ro;
        ro.sample_shape = sample;
        ro.micro_batch = m;
        ref_ex = std::make_unique<mbp::Executor>(*ref, *ref_opt, ro);
      }
      ref_loss = ref_ex->step(d.images.data(), d.labels.data(), B).loss;
    } else {
      ref_loss = full_batch_backward<double>(*ref, d, B, sample);
      NoGradGuard ng;
      ref_opt->step();
      ref_opt->zero_grad();
    }
    EXPECT_NEAR(r.loss, ref_loss, 1e-12 * std::abs(ref_loss)) << "step " << step;
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  if (uneven && !gpipe) {
    EXPECT_LT(m, B) << "4 MiB holds fewer than the batch";
  } else if (uneven) {
    EXPECT_EQ(m, 4) << "rank 1's micro-batch, the smaller";
  } else {
    EXPECT_EQ(m, 3);
  }
  mbp::gather_stages(*st.model, st.segments, bounds, *comm);
  // Parameters, and BatchNorm's running statistics.
  const bool batch_norm = norm == "batch";  // (clang 16 cannot capture a structured binding)
  auto all = [batch_norm](const nn::Module& mod) {
    auto v = values<double>(mod);
    if (batch_norm)
      for (auto& buf : values<double>(mod, true)) v.push_back(std::move(buf));
    return v;
  };
  const auto a = all(*st.model), b = all(*ref);
  const auto init = values<double>(*model("resnet20", norm, 7, DType::Float64));
  ASSERT_EQ(a.size(), b.size());
  double worst = 0, moved = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, rel_error(a[i], b[i]));
    EXPECT_LE(rel_error(a[i], b[i]), 1e-12) << "tensor " << i;
  }
  const auto pa = values<double>(*st.model);
  for (std::size_t i = 0; i < pa.size(); ++i) moved = std::max(moved, rel_error(pa[i], init[i]));
  EXPECT_GT(moved, 1e-3) << "the parameters moved";
  if (rank == 0)
    std::cout << fmt::format("norm {}, {}, micro-batches of {}{}: worst per-tensor relative difference from one process {}\n",
                             norm, mbp::pipeline_schedule_name(schedule), m, uneven ? fmt::format(" ({})", gpipe ? "stage 1 given 4" : "stage 0 in 4 MiB") : std::string(), worst);
}

INSTANTIATE_TEST_SUITE_P(NormsSchedulesLimits, PipelineStages,
                         ::testing::Combine(::testing::Values("group", "none", "batch"),
                                            ::testing::Values(mbp::PipelineSchedule::one_f_one_b,
                                                              mbp::PipelineSchedule::gpipe),
                                            ::testing::Bool()),
                         [](const auto& i) {
                           return fmt::format("{}_{}_{}", std::get<0>(i.param),
                                              mbp::pipeline_schedule_name(std::get<1>(i.param)),
                                              std::get<2>(i.param) ? "uneven" : "even");
                         });

// Through the staged transport (distributed/staged.h: how a GPU's stages exchange activations and
// gradients), here with the CPU as its device: the step is the direct transport's bit for bit, and
// the staging buffer, made with 256 bytes, grows before the first step to exactly what the plan says
// its messages take (mbp::message_staging_bytes) — and they reach exactly that.
class StagedPipelineStages : public PipelineParts, public ::testing::WithParamInterface<mbp::PipelineSchedule> {};

TEST_P(StagedPipelineStages, MessagesThroughHostMemoryChangeNoBitAndTakeWhatThePlanSays) {
  if (world()->size() != 2) GTEST_SKIP() << "needs exactly 2 ranks: run under mpirun -np 2 (this world has "
                                         << world()->size() << ")";
  const mbp::PipelineSchedule schedule = GetParam();
  const int rank = world()->rank();
  const std::int64_t B = 11;
  const Shape sample{3, 16, 16};
  const std::vector<std::size_t> bounds{0, 5, 11};
  // Made with the default staging (64 MiB, the chunk size of collectives), as tally train makes it:
  // the stage's first reservation sets it to exactly the plan's bytes, what tally plan prints.
  const auto staged = distributed::make_staged(world(), Device::cpu());
  Stage direct = make_stage("group", rank, bounds, schedule, parse_size("64MiB"));
  Stage through = make_stage("group", rank, bounds, schedule, parse_size("64MiB"));
  const auto executor = [&](Stage& st, std::shared_ptr<distributed::Communicator> comm) {
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 4;  // 4, 4, 3: micro-batches of two sizes
    eo.communicator = std::move(comm);
    eo.pipeline = st.stage;
    return std::make_unique<mbp::Executor>(*st.model, *st.optimizer, st.budget, eo);
  };
  auto a = executor(direct, world()), b = executor(through, staged);
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(B, sample, 700 + static_cast<std::uint32_t>(step));
    const mbp::StepResult ra = a->step(d.images.data(), d.labels.data(), B);
    const mbp::StepResult rb = b->step(d.images.data(), d.labels.data(), B);
    EXPECT_EQ(rb.loss, ra.loss) << "step " << step;
    EXPECT_EQ(rb.peak, rb.predicted_peak) << "rank " << rank << " step " << step;
    const std::size_t predicted = b->message_staging_bytes(b->plan(B));
    // Two messages of 4 samples at least (32x8x8 float64 per sample cross the cut either way).
    EXPECT_GE(predicted, std::size_t(2 * 4 * 32 * 8 * 8 * 8));
    EXPECT_EQ(distributed::staging_capacity(*staged), predicted) << "set to the plan's bytes";
    EXPECT_EQ(distributed::staging_high_water(*staged), predicted) << "rank " << rank << " step " << step;
  }
  EXPECT_TRUE(bitwise_equal(values<double>(*through.model, true), values<double>(*direct.model, true)));
  if (rank == 0)
    std::cout << fmt::format("{}: message staging {} bytes on rank 0\n", mbp::pipeline_schedule_name(schedule),
                             distributed::staging_high_water(*staged));
}

INSTANTIATE_TEST_SUITE_P(Schedules, StagedPipelineStages,
                         ::testing::Values(mbp::PipelineSchedule::one_f_one_b, mbp::PipelineSchedule::gpipe),
                         [](const auto& i) { return std::string(mbp::pipeline_schedule_name(i.param)); });

// Two ranks on one GPU as two stages, their messages through host memory (the staged transport: NCCL
// refuses two ranks on one device), against one process on the GPU at the same micro-batches:
// float32 ResNet-20, group norm, both schedules; predicted == measured on both ranks, the message
// staging exactly the plan's.
class GpuStages : public PipelineParts, public ::testing::WithParamInterface<mbp::PipelineSchedule> {};

TEST_P(GpuStages, TwoStagesShareOneGpuThroughHostMemory) {
  if (world()->size() != 2) GTEST_SKIP() << "needs exactly 2 ranks: run under mpirun -np 2 (this world has "
                                         << world()->size() << ")";
  if (!cuda_available()) GTEST_SKIP() << "no GPU present: " << build_info();
  const mbp::PipelineSchedule schedule = GetParam();
  const Device gpu = Device::cuda(0);
  const auto comm = distributed::for_device(world(), gpu, distributed::Collectives::mpi);
  ASSERT_EQ(comm->backend(), "mpi (staged)");
  const int rank = comm->rank();
  const std::int64_t B = 12, m = 5;
  const Shape sample{3, 16, 16};
  const std::vector<std::size_t> bounds{0, 5, 11};
  Stage st = make_stage("group", rank, bounds, schedule, parse_size("256MiB"), gpu, DType::Float32);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = m;
  eo.communicator = comm;
  eo.pipeline = st.stage;
  mbp::Executor ex(*st.model, *st.optimizer, st.budget, eo);
  // One process: the same weights (same seed), the same micro-batches, on the same GPU.
  const auto ref_arena = std::make_shared<Arena>(gpu, parse_size("256MiB"));
  std::shared_ptr<nn::Module> ref;
  std::unique_ptr<optim::SGD> ref_opt;
  {
    ArenaScope scope(ref_arena);
    ref = model("resnet20", "group", 7, DType::Float32);
    ref->to(gpu);
    optim::SGDOptions so;
    so.lr = 0.05, so.momentum = 0.9, so.weight_decay = 5e-4;
    ref_opt = std::make_unique<optim::SGD>(ref->parameters(), so);
  }
  mbp::ExecutorOptions ro;
  ro.sample_shape = sample;
  ro.micro_batch = m;
  mbp::Executor ref_ex(*ref, *ref_opt, ref_arena, ro);
  double worst_loss = 0;
  for (int step = 0; step < 3; ++step) {
    const Data d = make_data(B, sample, 900 + static_cast<std::uint32_t>(step));
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
    const double ref_loss = ref_ex.step(d.images.data(), d.labels.data(), B).loss;
    EXPECT_EQ(r.peak, r.predicted_peak) << "rank " << rank << " step " << step;
    EXPECT_EQ(distributed::staging_high_water(*comm), ex.message_staging_bytes(ex.plan(B))) << "rank " << rank;
    EXPECT_TRUE(std::isfinite(r.loss));
    EXPECT_NEAR(r.loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step;
    worst_loss = std::max(worst_loss, std::abs(r.loss - ref_loss) / std::abs(ref_loss));
  }
  mbp::gather_stages(*st.model, st.segments, bounds, *comm);
  const auto a = values<float>(*st.model), b = values<float>(*ref);
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, rel_error(a[i], b[i]));
    EXPECT_LE(rel_error(a[i], b[i]), 1e-5) << "parameter " << i;
  }
  if (rank == 0)
    std::cout << fmt::format("{} on one GPU: worst loss difference {:.3g}, worst parameter {:.3g}, message staging "
                             "{} bytes\n", mbp::pipeline_schedule_name(schedule), worst_loss, worst,
                             distributed::staging_high_water(*comm));
}

INSTANTIATE_TEST_SUITE_P(Schedules, GpuStages,
                         ::testing::Values(mbp::PipelineSchedule::one_f_one_b, mbp::PipelineSchedule::gpipe),
                         [](const auto& i) { return std::string(mbp::pipeline_schedule_name(i.param)); });

// ---------------------------------------------------------------------------------------------
// The command line: `mpirun -np 2 tally train --pipeline-stages 2` (these tests start mpirun).
#ifdef TALLY_MPIEXEC
namespace {

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

}  // namespace

// Two stages train the weights one process does (group norm: the step is the full batch's, for any
// micro-batches — one process takes the batch whole in 128 MiB, the stages split it), within
// float32 rounding; both ranks' peaks exact; --save holds every stage's tensors under the model's
// names.
TEST(PipelineCommandLine, TwoStagesTrainTheWeightsOfOneProcess) {
  if (distributed::launched_by_mpi()) GTEST_SKIP() << "starts mpirun itself";
  const auto dir = fresh_dir("tally_pipeline_cli");
  // One step: float32 runs of different splits drift apart in later steps whatever runs them (one
  // process at 128 MiB against itself at 16 MiB: 9e-8 after one step, 9e-4 after two).
  const std::string common = "train --norm group --steps 1 --batch-size 64 --no-progress --no-eval";
  ASSERT_EQ(run_command(fmt::format("OMP_NUM_THREADS=1 {} {} --memory-limit 128MiB --save {}/one.safetensors > {}/one.log",
                                    TALLY_EXE, common, dir.string(), dir.string())), 0);
  ASSERT_EQ(run_command(fmt::format("{} {} {} --pipeline-stages 2 --memory-limit 16MiB,48MiB --save {}/two.safetensors "
                                    "--out {}/two > {}/two.log",
                                    mpirun_two(TALLY_MPIEXEC, 400), TALLY_EXE, common, dir.string(), dir.string(),
                                    dir.string())), 0);
  const double worst = compare_state_dicts(dir / "one.safetensors", dir / "two.safetensors", 1e-5);
  std::cout << "worst per-tensor relative difference, 2 pipeline stages vs 1 process: " << worst << "\n";
  const auto j = read_json(dir / "two" / "summary.json");
  EXPECT_EQ(j.at("pipeline_stages"), 2);
  ASSERT_EQ(j.at("ranks").size(), 2u);
  for (const auto& r : j["ranks"]) {
    EXPECT_EQ(r["peak_bytes"], r["predicted_peak_bytes"]);
    EXPECT_GT(r["parameters"].get<std::int64_t>(), 0);
    EXPECT_FALSE(r["segments"].get<std::string>().empty());
  }
  EXPECT_EQ(j["ranks"][0]["micro_batch"], j["ranks"][1]["micro_batch"]) << "one micro-batch for every stage";
  EXPECT_EQ(j["ranks"][0]["parameters"].get<std::int64_t>() + j["ranks"][1]["parameters"].get<std::int64_t>(), 272474)
      << "ResNet-20's parameters, each on one stage";
}

// ResNet-50 at 224x224 trains in 300 MiB per stage, which one process cannot do at any batch size
// or recomputation level (tally plan says so, with what it would need).
TEST(PipelineCommandLine, ResNet50TrainsInThreeHundredMiBPerStage) {
  if (distributed::launched_by_mpi()) GTEST_SKIP() << "starts mpirun itself";
  const auto dir = fresh_dir("tally_pipeline_r50");
  EXPECT_NE(run_command(fmt::format("{} plan --model resnet50 --batch-size 4 --memory-limit 300MiB --no-layers > "
                                    "{}/one.log 2>&1",
                                    TALLY_EXE, dir.string())),
            0);
  std::ifstream f(dir / "one.log");
  const std::string one((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(one.find("not even one sample fits"), std::string::npos) << one;
  EXPECT_NE(one.find("with --recompute all"), std::string::npos) << one;
  ASSERT_EQ(run_command(fmt::format("{} {} train --pipeline-stages 2 --model resnet50 --data synthetic:3x224x224 "
                                    "--steps 2 --batch-size 4 --lr 0.01 --memory-limit 300MiB --no-progress --no-eval "
                                    "--save {}/w.safetensors --out {}/two > {}/two.log",
                                    mpirun_two(TALLY_MPIEXEC, 400), TALLY_EXE, dir.string(), dir.string(),
                                    dir.string())),
            0);
  const auto j = read_json(dir / "two" / "summary.json");
  ASSERT_EQ(j.at("ranks").size(), 2u);
  for (const auto& r : j["ranks"]) {
    EXPECT_EQ(r["peak_bytes"], r["predicted_peak_bytes"]);
    EXPECT_LE(r["peak_bytes"].get<std::int64_t>(), 300 << 20);
  }
  EXPECT_TRUE(std::isfinite(j.at("train_loss").get<double>()));
  EXPECT_EQ(safetensors::read((dir / "w.safetensors").string()).tensors.size(), 320u) << "every tensor of ResNet-50";
}
#endif
