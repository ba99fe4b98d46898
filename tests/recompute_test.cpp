// Recomputation (gradient checkpointing, core/autograd.h recompute(), Module::set_recompute):
//   * bit for bit: ResNet-20 with every residual block recomputed trains through MBP
//     micro-batches to exactly the parameters, BatchNorm running statistics and losses of the
//     plain run (norm batch, group and none; float64 on the reference kernels, float32 on the
//     fast ones), also with a segment whose input needs no gradient (the first convolution);
//   * memory: the recomputed step keeps fewer activation bytes at its peak, and its dry run still
//     predicts the real step's peak to the byte.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/memory.h"
#include "layers/resnet.h"
#include "mbp/executor.h"
#include "tests/model_common.h"

using namespace tally;
using namespace tally::test;

namespace {

class Recompute : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<double>> params, buffers;
  std::vector<mbp::StepResult> steps;
};

template <class T>
Trained train(const std::string& norm, DType dtype, bool recompute, bool recompute_stem) {
  const Shape sample{3, 16, 16};
  const std::int64_t B = 20;
  auto m = model("resnet20", norm, 7, dtype);
  if (recompute) {
    EXPECT_EQ(nn::set_recompute_blocks(*m, true), 9);  // CIFAR ResNet: blocks only
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

class RecomputeBitForBit : public Recompute, public ::testing::WithParamInterface<std::tuple<std::string, bool>> {};

TEST_P(RecomputeBitForBit, TwoMicroBatchedStepsEqualThePlainRun) {
  const auto [norm, float64] = GetParam();
  const Trained plain = float64 ? train<double>(norm, DType::Float64, false, false) : train<float>(norm, DType::Float32, false, false);
  const Trained rec = float64 ? train<double>(norm, DType::Float64, true, true) : train<float>(norm, DType::Float32, true, true);
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

INSTANTIATE_TEST_SUITE_P(NormsAndDtypes, RecomputeBitForBit,
                         ::testing::Combine(::testing::Values("batch", "group", "none"), ::testing::Bool()),
                         [](const auto& i) {
                           return std::get<0>(i.param) + (std::get<1>(i.param) ? "_float64" : "_float32");
                         });

// A plain backward through a recomputed segment, outside MBP: the BatchNorm running statistics
// are updated once (by the first forward), and gradients match.
TEST_F(Recompute, RunningStatisticsAreUpdatedOnceAndGradientsMatch) {
  for (bool rec : {false, true}) {
    SCOPED_TRACE(rec ? "recomputed" : "plain");
    auto a = model("resnet20", "batch", 9, DType::Float64);
    auto b = model("resnet20", "batch", 9, DType::Float64);
    if (rec) {
      EXPECT_EQ(nn::set_recompute_blocks(*b, true), 9);
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
  for (bool rec : {false, true}) {
    auto m = model("resnet18", "batch", 21);
    if (rec) {
      EXPECT_EQ(nn::set_recompute_blocks(*m, true), 9);  // the stem and 8 blocks
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
  EXPECT_TRUE(bitwise_equal(params[0], params[1]));
  EXPECT_TRUE(bitwise_equal(buffers[0], buffers[1]));
}
