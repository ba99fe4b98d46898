// Recomputation (gradient checkpointing, core/autograd.h recompute(), Module::set_recompute):
//   * bit for bit: ResNet-20 with every residual block recomputed trains through MBP
//     micro-batches to exactly the parameters, BatchNorm running statistics and losses of the
//     plain run (norm batch, group and none; float64 on the reference kernels, float32 on the
//     fast ones), also with a segment whose input needs no gradient (the first convolution);
//   * the same for every level of the ladder (nn/resnet.h): blocks, and stages nested around
//     their blocks (ResNet-20's and ResNet-18's), whose blocks run their forward three times;
//   * memory: the recomputed step keeps fewer activation bytes at its peak, and its dry run still
//     predicts the real step's peak to the byte; ResNet-50's planned one-sample activations and
//     micro-batch at batch 4096 in 8 GiB by level (the recomputation issue's targets);
//   * the work: the FLOPs a level re-runs, counted by the dry run, against the model's forward;
//   * the executor's policy (ExecutorOptions::recompute): auto takes the first level of the
//     ladder on which the plan fits and keeps it, none states what recomputing everything would
//     need, plans at another level leave the model as it was, and plans are cached per
//     recomputation state (no caller forgets the cache).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "optim/optimizer.h"
#include "tests/model_common.h"
#include "examples/consumer/small_resnet.h"

using namespace tally;
using namespace tally::test;

namespace {

class Recompute : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

// A model, its optimizer and an executor in `arena` (a virtual one: call inside a DryRun).
struct Planned {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::SGD> optimizer;
  std::unique_ptr<mbp::Executor> executor;
};
Planned planned(const std::shared_ptr<Arena>& arena, const nn::ModelConfig& mc, const Shape& sample,
                const std::string& recompute) {
  ArenaScope scope(arena);
  Planned p;
  p.model = nn::make_model(mc);
  p.optimizer = std::make_unique<optim::SGD>(p.model->parameters(), optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.recompute = recompute;
  p.executor = std::make_unique<mbp::Executor>(*p.model, *p.optimizer, arena, eo);
  return p;
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<double>> params, buffers;
  std::vector<mbp::StepResult> steps;
};

template <class T>
Trained train(const std::string& norm, DType dtype, int level, bool recompute_stem) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 20;
  auto m = model("resnet20", norm, 7, dtype);
  EXPECT_EQ(nn::recompute_levels(*m), 4);  // none, blocks, + layer1, all (+ layer1-layer2)
  if (level > 0) {
    EXPECT_EQ(nn::set_recompute_level(*m, level), 8 + (level - 1));  // CIFAR ResNet: 8 of its 9 blocks, then stages
  }
  if (recompute_stem)
    for (auto& [name, child] : m->named_children())
      if (name == "conv1") child->set_recompute(true);
  auto opt = sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = 7;
  mbp::Executor ex(*m, *opt, eo);
  Trained r;
  for (int step = 0; step < 2; ++step) {
    const Data d = make_data(B, sample, 500 + static_cast<std::uint32_t>(step));
    r.steps.push_back(ex.step(d.images.data(), d.labels.data(), B));
    r.losses.push_back(r.steps.back().loss);
  }
  r.params = values<T>(*m);
  r.buffers = values<T>(*m, true);
  return r;
}

}  // namespace

class RecomputeBitForBit : public Recompute,
                           public ::testing::WithParamInterface<std::tuple<std::string, bool, int>> {};

TEST_P(RecomputeBitForBit, TwoMicroBatchedStepsEqualThePlainRun) {
  const auto [norm, float64, level] = GetParam();
  const Trained plain = float64 ? train<double>(norm, DType::Float64, 0, false) : train<float>(norm, DType::Float32, 0, false);
  const Trained rec = float64 ? train<double>(norm, DType::Float64, level, true) : train<float>(norm, DType::Float32, level, true);
  EXPECT_EQ(rec.losses, plain.losses);
  EXPECT_TRUE(bitwise_equal(rec.params, plain.params)) << "parameters differ";
  EXPECT_TRUE(bitwise_equal(rec.buffers, plain.buffers)) << "running statistics differ";
  for (const auto* run : {&plain, &rec})
    for (const auto& s : run->steps) {
      EXPECT_EQ(s.peak, s.predicted_peak);
      EXPECT_EQ(s.micro_batches, 3);
    }
  const auto init = float64 ? values<double>(*model("resnet20", norm, 7, DType::Float64))
                            : values<float>(*model("resnet20", norm, 7, DType::Float32));
  double moved = 0;
  for (std::size_t i = 0; i < init.size(); ++i) moved = std::max(moved, rel_error(plain.params[i], init[i]));
  EXPECT_GT(moved, 1e-3) << "the parameters moved";
  std::cout << fmt::format("norm {} {}: step peak {} bytes plain, {} recomputed\n", norm,
                           float64 ? "float64" : "float32", plain.steps[1].peak, rec.steps[1].peak);
  EXPECT_LT(rec.steps[1].peak, plain.steps[1].peak) << "recomputation keeps fewer bytes";
}

INSTANTIATE_TEST_SUITE_P(NormsDtypesAndLevels, RecomputeBitForBit,
                         ::testing::Combine(::testing::Values("batch", "group", "none"), ::testing::Bool(),
                                            ::testing::Values(1, 3)),
                         [](const auto& i) {
                           return std::get<0>(i.param) + (std::get<1>(i.param) ? "_float64" : "_float32") +
                                  (std::get<2>(i.param) == 1 ? "_blocks" : "_all");
                         });

// ---- a model that says nothing: its ladder from its module tree (Module::recompute_parts) ----------

// docs/models.md's model (examples/consumer/small_resnet.h: its own residual block, its stages as
// Sequentials, no recompute_parts() or segments() of its own) at ResNet-20's shape, three blocks a
// stage, gets the zoo ResNet-20's ladder — the same levels, names and segments — from its module
// tree, and at each level two micro-batched steps are exact (predicted == measured) and bit for bit
// the plain run's; each segment can also be offloaded on its own (segment_names).
TEST_F(Recompute, AModelThatSaysNothingGetsItsLadderFromItsModuleTree) {
  const auto zoo = model("resnet20", "batch", 7);
  nn::manual_seed(7);
  auto mine = std::make_shared<my::SmallResNet>(3, 10);
  mine->train();
  const int levels = nn::recompute_levels(*zoo);
  ASSERT_EQ(nn::recompute_levels(*mine), levels);
  for (int level = 0; level < levels; ++level)
    EXPECT_EQ(nn::recompute_level_name(*mine, level), nn::recompute_level_name(*zoo, level)) << "level " << level;
  EXPECT_EQ(nn::segment_names(*mine), nn::segment_names(*zoo));
  EXPECT_EQ(nn::recompute_level_description(*mine, 1), "8 segments: every block but the last");

  const Shape sample{3, 16, 16};
  const std::int64_t B = 20;
  std::vector<std::vector<double>> plain;
  std::vector<double> plain_losses;
  for (int level = 0; level < levels; ++level) {
    SCOPED_TRACE(nn::recompute_level_name(*mine, level));
    nn::manual_seed(7);
    auto m = std::make_shared<my::SmallResNet>(3, 10);
    m->train();
    EXPECT_EQ(nn::set_recompute_level(*m, level), level == 0 ? 0 : 8 + (level - 1));
    auto opt = sgd(*m);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 7;
    eo.recompute = "none";  // the level as set
    mbp::Executor ex(*m, *opt, eo);
    std::vector<double> losses;
    for (int step = 0; step < 2; ++step) {
      const Data d = make_data(B, sample, 500 + static_cast<std::uint32_t>(step));
      const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
      EXPECT_EQ(r.peak, r.predicted_peak);
      EXPECT_EQ(r.micro_batches, 3);
      losses.push_back(r.loss);
    }
    if (level == 0) {
      plain = values<float>(*m), plain_losses = losses;
    } else {
      EXPECT_EQ(losses, plain_losses);
      EXPECT_TRUE(bitwise_equal(values<float>(*m), plain)) << "parameters differ from the plain run's";
    }
  }
}

// A plain backward through a recomputed segment, outside MBP: the BatchNorm running statistics
// are updated once (by the first forward), and gradients match.
TEST_F(Recompute, RunningStatisticsAreUpdatedOnceAndGradientsMatch) {
  for (bool rec : {false, true}) {
    SCOPED_TRACE(rec ? "recomputed" : "plain");
    auto a = model("resnet20", "batch", 9, DType::Float64);
    auto b = model("resnet20", "batch", 9, DType::Float64);
    if (rec) {
      EXPECT_EQ(nn::set_recompute_blocks(*b, true), 8);
    }
    const Shape sample{3, 16, 16};
    const Data d = make_data(6, sample, 33);
    full_batch_backward<double>(*a, d, 6, sample);
    full_batch_backward<double>(*b, d, 6, sample);
    EXPECT_TRUE(bitwise_equal(grads<double>(*a), grads<double>(*b)));
    EXPECT_TRUE(bitwise_equal(values<double>(*a, true), values<double>(*b, true)));
    for (auto* bn : nn::batch_norm_layers(*b)) EXPECT_EQ(bn->num_batches_tracked.to_vector<std::int64_t>()[0], 1);
  }
}

// An ImageNet ResNet with its stem (whose input, the images, needs no gradient) and every block
// recomputed, through two micro-batched steps: bit for bit the plain run.
TEST_F(Recompute, ResNet18StemAndBlocksBitForBit) {
  const Shape sample{3, 32, 32};
  const std::int64_t B = 6;
  std::vector<std::vector<std::vector<double>>> params, buffers;
  for (int level : {0, 1, 2, 4}) {
    SCOPED_TRACE(fmt::format("level {}", level));
    auto m = model("resnet18", "batch", 21);
    ASSERT_EQ(nn::recompute_levels(*m), 5);
    if (level > 0) {
      EXPECT_EQ(nn::set_recompute_level(*m, level), 8 + (level - 1));  // the stem and 7 of 8 blocks, then stages
    }
    auto opt = sgd(*m);
    mbp::ExecutorOptions eo;
    eo.sample_shape = sample;
    eo.micro_batch = 3;
    mbp::Executor ex(*m, *opt, eo);
    for (int step = 0; step < 2; ++step) {
      const Data d = make_data(B, sample, 600 + static_cast<std::uint32_t>(step));
      const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), B);
      EXPECT_EQ(r.peak, r.predicted_peak);
    }
    params.push_back(values<float>(*m));
    buffers.push_back(values<float>(*m, true));
  }
  for (std::size_t i = 1; i < params.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(params[0], params[i])) << "run " << i;
    EXPECT_TRUE(bitwise_equal(buffers[0], buffers[i])) << "run " << i;
  }
}

// The ladder's names, and what each level marks.
TEST_F(Recompute, TheLevelsOfAResNet) {
  auto m = model("resnet50", "batch", 1);
  ASSERT_EQ(nn::recompute_levels(*m), 5);
  const std::vector<std::string> names{"none", "blocks", "blocks + layer1", "blocks + layer1-layer2", "all"};
  for (int level = 0; level < 5; ++level) EXPECT_EQ(nn::recompute_level_name(*m, level), names[level]);
  EXPECT_EQ(nn::recompute_level_description(*m, 2),
            "17 segments: the stem and every residual block but the last, and layer1 around their blocks");
  EXPECT_EQ(nn::set_recompute_level(*m, 3), 18);
  auto* r = dynamic_cast<nn::ResNet*>(m.get());
  EXPECT_TRUE(r->stem_mode == nn::SegmentMode::recompute && r->layer1->recompute() && r->layer2->recompute() && !r->layer3->recompute());
  const auto& blocks4 = r->layer4->named_children();
  EXPECT_TRUE(blocks4[1].second->recompute() && !blocks4[2].second->recompute()) << "the last block is not a segment";
  EXPECT_EQ(nn::set_recompute_level(*m, 4), 19);
  EXPECT_FALSE(r->layer4->recompute()) << "nor the last stage";
  r->layer4->set_recompute(true);
  EXPECT_EQ(nn::set_recompute_level(*m, 0), 0);
  EXPECT_FALSE(r->stem_mode != nn::SegmentMode::keep || r->layer1->recompute() || r->layer4->recompute());
  EXPECT_THROW(nn::set_recompute_level(*m, 5), Error);
  EXPECT_EQ(nn::recompute_levels(*model("resnet9", "batch", 1)), 2);  // ResNet-9: its six units, no stages
}

// ResNet-50 at 3x224x224 in an 8 GiB budget, planned (nothing computed): the activations live at
// a one-sample step's peak and the micro-batch at batch 4096, by level; the work each level
// re-runs. The recomputation issue's targets: all >= 4x fewer activation bytes than none at the
// one-sample peak, and micro-batches >= 3x the 96 planned without recomputation.
TEST_F(Recompute, ResNet50PlansByLevel) {
  const DryRun dry;
  const auto arena = dry.virtual_arena(Device::cpu(), std::size_t(8) << 30);
  nn::ModelConfig mc;
  mc.name = "resnet50";
  mc.num_classes = 1000;
  const Planned setup = planned(arena, mc, {3, 224, 224}, "none");
  mbp::Executor& ex = *setup.executor;
  const int levels = nn::recompute_levels(*setup.model);
  std::vector<std::int64_t> activation, micro_batch;
  std::vector<FlopCount> flops;
  for (int level = 0; level < levels; ++level) {
    nn::set_recompute_level(*setup.model, level);  // plans are cached per recomputation state
    const mbp::Plan& one = ex.plan(1);
    activation.push_back(one.at_peak.bytes[static_cast<int>(Category::activation)]);
    flops.push_back(one.flops);
    micro_batch.push_back(ex.plan(4096).micro_batch);
    std::cout << fmt::format("{}: one sample {} of activations at the peak, {:.2f} GFLOP re-run; batch 4096: m = {}\n",
                             nn::recompute_level_name(*setup.model, level), format_bytes(activation.back()),
                             flops.back().recompute / 1e9, micro_batch.back());
  }
  // The work: ResNet-50's forward is 4.09 G multiply-adds per sample (torchvision's figure),
  // backward twice that. blocks re-runs every convolution but the last block's and the
  // classifier; all re-runs layer1-layer3 once more.
  EXPECT_NEAR(flops[0].forward / 2e9, 4.09, 0.05);
  const double stem = 2.0 * 64 * 112 * 112 * 3 * 7 * 7, fc = 2.0 * 2048 * 1000;
  EXPECT_DOUBLE_EQ(flops[0].backward, 2 * flops[0].forward - stem);  // the images need no gradient
  EXPECT_EQ(flops[0].recompute, 0);
  // The last block (layer4.2, 7x7) and the last stage are never re-run.
  const double last = 2.0 * 49 * (2048 * 512 + 512 * 512 * 9 + 512 * 2048);
  const double stage4 = 2.0 * (1024 * 512 * 196 + 512 * 512 * 9 * 49 + 512 * 2048 * 49 + 1024 * 2048 * 49) + 2 * last;
  EXPECT_DOUBLE_EQ(flops[1].recompute, flops[0].forward - fc - last);
  EXPECT_DOUBLE_EQ(flops[levels - 1].recompute - flops[1].recompute, flops[0].forward - fc - stem - stage4);
  for (int level = 0; level < levels; ++level) EXPECT_DOUBLE_EQ(flops[level].forward, flops[0].forward);
  // The memory.
  EXPECT_LE(4 * activation[levels - 1], activation[0]);
  EXPECT_GE(micro_batch[levels - 1], 3 * micro_batch[0]);
  EXPECT_GE(micro_batch[0], 90);
  for (int level = 1; level < levels; ++level) EXPECT_LT(activation[level], activation[0]);
}

// The executor owns the choice: on a budget between what one sample needs with the most
// recomputation and without any, "auto" takes the first level of the ladder that fits (the one
// below it does not), keeps it on the model and reuses it without another dry run; "none" is a
// too-small error that says what --recompute all would fit; a named level is set as asked; a
// plan at another level leaves the model's recomputation as it was.
TEST_F(Recompute, TheExecutorClimbsTheLadderOnAuto) {
  const DryRun dry;
  nn::ModelConfig mc;
  mc.name = "resnet20";
  mc.in_channels = 1;
  const Shape sample{1, 28, 28};
  std::size_t none_peak = 0, all_peak = 0;
  int levels = 0;
  {
    const auto big = dry.virtual_arena(Device::cpu(), std::size_t(1) << 30);
    const Planned p = planned(big, mc, sample, "none");
    levels = nn::recompute_levels(*p.model);
    none_peak = p.executor->plan(1).predicted_peak;
    const std::string before = nn::recompute_state(*p.model).str();
    all_peak = p.executor->at_level(1, 1, levels - 1).predicted_peak;
    EXPECT_EQ(nn::recompute_state(*p.model).str(), before);
  }
  ASSERT_EQ(levels, 4);
  ASSERT_LT(all_peak, none_peak);
  const std::size_t budget = (all_peak + (none_peak - all_peak) / 2) / 4096 * 4096;
  const auto arena = [&] { return dry.virtual_arena(Device::cpu(), budget); };  // one per model

  const Planned a = planned(arena(), mc, sample, "auto");
  const mbp::Plan& plan = a.executor->plan(1);
  const mbp::RecomputeChoice choice = a.executor->recompute_choice();
  EXPECT_GE(choice.level, 1);
  EXPECT_LE(plan.predicted_peak, budget);
  EXPECT_EQ(choice.name, nn::recompute_level_name(*a.model, choice.level));
  EXPECT_NE(choice.why.find("not even one sample fits"), std::string::npos) << choice.why;
  EXPECT_THROW(a.executor->at_level(1, 1, choice.level - 1), OutOfMemory);
  const int probes = a.executor->planner().probes();
  EXPECT_EQ(&a.executor->plan(1), &plan);  // the same cached plan, at the same level
  EXPECT_EQ(a.executor->planner().probes(), probes);
  EXPECT_EQ(a.executor->recompute_choice().level, choice.level);
  EXPECT_NE(choice.summary(plan).find("re-runs"), std::string::npos) << choice.summary(plan);

  const Planned n = planned(arena(), mc, sample, "none");
  try {
    n.executor->plan(1);
    ADD_FAILURE() << "a budget below one sample's need planned without recomputation";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("; ExecutorOptions::recompute all ("), std::string::npos) << e.what();
  }
  EXPECT_EQ(nn::recompute_state(*n.model).str(), std::string(1 + 9 + 3, '0'));  // left as it was

  const Planned all = planned(arena(), mc, sample, "all");
  EXPECT_LE(all.executor->plan(1).predicted_peak, budget);
  EXPECT_EQ(all.executor->recompute_choice().level, levels - 1);
  EXPECT_EQ(all.executor->recompute_choice().name, "all");
}
