// Tests of models/: the families written with tally's public API (SE-ResNet-50, ResNeXt-50 32x4d,
// the pre-activation ResNet-18) against their references.
//   * Parameter counts at 1000 classes: seresnet50 28,088,024 (timm's ResNet-50 25,557,032 plus
//     the SE modules' 2,530,992), resnext50_32x4d 25,028,904 (torchvision), resnetv2_18 11,687,720
//     (counted from timm's resnetv2.py below).
//   * Names and shapes: resnext50_32x4d against torchvision's own list
//     (tests/fixtures/resnext50_32x4d_names.json); seresnet50 against torchvision's ResNet-50 list
//     (tests/fixtures/model_resnet50.safetensors) with timm's SE entries inserted; resnetv2_18
//     against the list timm's resnetv2.py gives (expected_resnetv2_18 below, written from its source).
//   * Numbers: torchvision's own ResNet class at a small ResNeXt width
//     (tests/fixtures/model_resnext_tiny.safetensors, tests/gen_model_fixtures.py): eval and train
//     outputs within 1e-4, the loss and a few parameters' gradients within 5e-4 (relative; the
//     reference is computed in float64, see the fixture's note in the script).
//   * Each family trains 2 steps (3x32x32, batch 4, micro-batches of 2) with the measured peak equal
//     to the plan's to the byte, its recomputation ladder and pipeline segments, and
//     `tally plan --model <each>` succeeds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/safetensors.h"
#include "mbp/executor.h"
#include "models/families.h"
#include "models/resnet_v1.h"
#include "models/resnet_v2.h"
#include "models/wide_resnet.h"
#include "nn/init.h"
#include "nn/recompute.h"
#include "nn/resnet.h"
#include "tests/model_common.h"

using namespace tally;

namespace {

using NamedShapes = std::vector<std::pair<std::string, Shape>>;

std::string fixture(const std::string& name) { return std::string(TALLY_FIXTURES_DIR) + "/" + name; }

std::shared_ptr<nn::Module> make(const std::string& name, std::int64_t classes = 10) {
  models::register_families();
  nn::manual_seed(1);
  return nn::make_model({name, 3, classes, nn::Norm::Batch});
}

std::int64_t count_parameters(const nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& t : m.parameters()) n += t.numel();
  return n;
}

bool is_buffer(const std::string& name) {
  for (const char* b : {"running_mean", "running_var", "num_batches_tracked"})
    if (name.size() >= std::string(b).size() && name.substr(name.size() - std::string(b).size()) == b) return true;
  return false;
}

std::vector<std::string> keys(const std::vector<std::pair<std::string, Tensor>>& v) {
  std::vector<std::string> out;
  for (const auto& e : v) out.push_back(e.first);
  return out;
}

// The model's parameters and buffers, each in its order, and every shape, against a reference's
// state dict (PyTorch's order: a module's parameters, its buffers, then its children's); `params`
// and `buffers` are the reference's own orders where it gives them (else the state dict's, filtered).
void expect_state_dict(const nn::Module& model, const NamedShapes& ref, std::vector<std::string> params = {},
                       std::vector<std::string> buffers = {}) {
  if (params.empty())
    for (const auto& [name, shape] : ref) (is_buffer(name) ? buffers : params).push_back(name);
  EXPECT_EQ(keys(model.named_parameters()), params);
  EXPECT_EQ(keys(model.named_buffers()), buffers);
  std::map<std::string, Shape> ours;
  for (const auto& [k, t] : model.named_parameters()) ours[k] = t.shape();
  for (const auto& [k, t] : model.named_buffers()) ours[k] = t.shape();
  EXPECT_EQ(ours.size(), ref.size());
  for (const auto& [name, shape] : ref) {
    const auto it = ours.find(name);
    ASSERT_NE(it, ours.end()) << "the model has no " << name;
    EXPECT_EQ(it->second, shape) << name;
  }
}

NamedShapes batch_norm(const std::string& prefix, std::int64_t c) {
  return {{prefix + ".weight", {c}}, {prefix + ".bias", {c}}, {prefix + ".running_mean", {c}},
          {prefix + ".running_var", {c}}, {prefix + ".num_batches_tracked", {}}};
}

// timm/models/resnetv2.py's resnetv2_18, entry by entry in state-dict order: ResNetV2 registers stem
// (create_resnetv2_stem: stem.conv, no norm under preact), stages (ResNetStage: blocks), norm, head
// (ClassifierHead, use_conv: head.fc a 1x1 conv with bias); PreActBasic registers downsample
// (DownsampleConv: conv, its norm an Identity under preact) before norm1, conv1, norm2, conv2.
NamedShapes expected_resnetv2_18(std::int64_t classes) {
  NamedShapes out{{"stem.conv.weight", {64, 3, 7, 7}}};
  std::int64_t in = 64;
  const std::int64_t widths[4] = {64, 128, 256, 512};
  for (int s = 0; s < 4; ++s)
    for (int b = 0; b < 2; ++b) {
      const std::string p = fmt::format("stages.{}.blocks.{}.", s, b);
      const std::int64_t c = widths[s], cin = b == 0 ? in : c;
      if (b == 0 && cin != c) out.push_back({p + "downsample.conv.weight", {c, cin, 1, 1}});
      for (auto& e : batch_norm(p + "norm1", cin)) out.push_back(e);
      out.push_back({p + "conv1.weight", {c, cin, 3, 3}});
      for (auto& e : batch_norm(p + "norm2", c)) out.push_back(e);
      out.push_back({p + "conv2.weight", {c, c, 3, 3}});
      in = c;
    }
  for (auto& e : batch_norm("norm", 512)) out.push_back(e);
  out.push_back({"head.fc.weight", {classes, 512, 1, 1}});
  out.push_back({"head.fc.bias", {classes}});
  return out;
}

// timm's seresnet50: torchvision's ResNet-50 names (timm/models/resnet.py keeps them: conv1, bn1,
// layerN.M.{conv1..bn3, downsample.0/1}, fc) with each Bottleneck's `se` (SEModule: fc1, fc2, 1x1
// convs with bias; rd = make_divisible(C / 16, 8, round_limit = 0) = C / 16 here) after bn3.
NamedShapes expected_seresnet50(const NamedShapes& resnet50) {
  NamedShapes out;
  for (const auto& e : resnet50) {
    out.push_back(e);
    const std::string& name = e.first;
    const std::string tail = "bn3.num_batches_tracked";
    if (name.size() < tail.size() || name.substr(name.size() - tail.size()) != tail) continue;
    const std::string p = name.substr(0, name.size() - tail.size()) + "se.";
    const std::int64_t c = std::int64_t{256} << (name[5] - '1'), rd = c / 16;  // "layerN."
    out.push_back({p + "fc1.weight", {rd, c, 1, 1}});
    out.push_back({p + "fc1.bias", {rd}});
    out.push_back({p + "fc2.weight", {c, rd, 1, 1}});
    out.push_back({p + "fc2.bias", {c}});
  }
  return out;
}

NamedShapes from_json(const nlohmann::json& list) {
  NamedShapes out;
  for (const auto& e : list) out.emplace_back(e.at(0).get<std::string>(), e.at(1).get<Shape>());
  return out;
}

nlohmann::json metadata_json(const safetensors::File& f, const std::string& key) {
  return nlohmann::json::parse(f.metadata.at(key));
}

Tensor to_tensor(const safetensors::Entry& e) {
  if (e.dtype == "I64") return Tensor::from_vector(safetensors::as_i64(e), e.shape);
  return Tensor::from_vector(safetensors::as_f32(e), e.shape);
}

using test::rel_err;

// tests/gen_model_fixtures.py's formula weights: the k-th state-dict entry (PyTorch's order), index i.
void load_formula_weights(nn::Module& model, const NamedShapes& state_dict) {
  std::map<std::string, Tensor> ours;
  for (auto& [k, t] : model.named_parameters()) ours[k] = t;
  for (auto& [k, t] : model.named_buffers()) ours[k] = t;
  for (std::size_t k = 0; k < state_dict.size(); ++k) {
    const auto& [name, shape] = state_dict[k];
    Tensor t = ours.at(name);
    const auto ends = [&](const std::string& s) {
      return name.size() >= s.size() && name.substr(name.size() - s.size()) == s;
    };
    if (ends("num_batches_tracked")) {
      t.zero_();
      continue;
    }
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double di = static_cast<double>(i), dk = static_cast<double>(k);
      double val = 0.05 * std::sin(0.37 * di + 1.3 * dk);
      if (ends("running_mean")) val = 0.1 * std::sin(di - dk);
      else if (ends("running_var")) val = 1.0 + 0.1 * std::abs(std::cos(di + dk));
      v[i] = static_cast<float>(val);
    }
    t.copy_(Tensor::from_vector(v, shape));
  }
}

}  // namespace

// ---- parameter counts, names and shapes ---------------------------------------------------------

TEST(ModelFamilies, ParameterCountsMatchTheReferences) {
  EXPECT_EQ(count_parameters(*make("seresnet50", 1000)), 28088024);
  EXPECT_EQ(count_parameters(*make("resnext50_32x4d", 1000)), 25028904);
  EXPECT_EQ(count_parameters(*make("resnetv2_18", 1000)), 11687720);
  // The counts of the lists below (they are what the references build).
  std::int64_t v2 = 0;
  for (const auto& [name, shape] : expected_resnetv2_18(1000))
    if (!is_buffer(name)) v2 += shape_numel(shape);
  EXPECT_EQ(v2, 11687720);
}

TEST(ModelFamilies, Resnext50NamesAndShapesAreTorchvisions) {
  std::ifstream in(fixture("resnext50_32x4d_names.json"));
  ASSERT_TRUE(in) << fixture("resnext50_32x4d_names.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  const auto model = make("resnext50_32x4d", 1000);
  EXPECT_EQ(count_parameters(*model), ref.at("parameter_count").get<std::int64_t>());
  expect_state_dict(*model, from_json(ref.at("state_dict")), ref.at("parameters").get<std::vector<std::string>>(),
                    ref.at("buffers").get<std::vector<std::string>>());
}

TEST(ModelFamilies, Seresnet50NamesAndShapesAreTimms) {
  const auto f = safetensors::read(fixture("model_resnet50.safetensors"));  // torchvision resnet50, 10 classes
  const NamedShapes want = expected_seresnet50(from_json(metadata_json(f, "state_dict")));
  ASSERT_EQ(want.size(), 320u + 16 * 4);
  const auto model = make("seresnet50", 10);
  expect_state_dict(*model, want);
  // timm's zero_init_last: every block's bn3 starts at weight 0.
  for (const auto& [name, t] : model->named_parameters()) {
    if (name.find("bn3.weight") != std::string::npos) {
      EXPECT_EQ(sum(t).item(), 0.0) << name;
    }
  }
}

TEST(ModelFamilies, Resnetv2_18NamesAndShapesAreTimms) {
  expect_state_dict(*make("resnetv2_18", 1000), expected_resnetv2_18(1000));
  EXPECT_EQ(models::se_reduced_channels(256), 16);
  EXPECT_EQ(models::se_reduced_channels(2048), 128);
  EXPECT_EQ(models::se_reduced_channels(100), 8);  // make_divisible's floor of one divisor
}

// ---- numbers: torchvision's own ResNet class at a ResNeXt width ---------------------------------

TEST(ModelFamilies, ResnextMatchesTorchvisionForwardAndBackward) {
  const auto f = safetensors::read(fixture("model_resnext_tiny.safetensors"));
  models::ResNetOptions o;
  o.layers = {1, 1, 1, 1};
  o.block.groups = 4;
  o.block.width_per_group = 4;
  o.num_classes = 10;
  nn::manual_seed(1);
  models::ResNet model(o);
  const NamedShapes sd = from_json(metadata_json(f, "state_dict"));
  expect_state_dict(model, sd, metadata_json(f, "parameters").get<std::vector<std::string>>(),
                    metadata_json(f, "buffers").get<std::vector<std::string>>());
  load_formula_weights(model, sd);
  const Tensor x = to_tensor(f.tensors.at("x"));
  {
    NoGradGuard no_grad;
    model.eval();
    EXPECT_LE(rel_err(model(x), to_tensor(f.tensors.at("y"))), 1e-4) << "eval";
  }
  model.train();
  const Tensor y = model(x);
  EXPECT_LE(rel_err(y, to_tensor(f.tensors.at("y_train"))), 1e-4) << "train";
  const Tensor loss = cross_entropy(y, to_tensor(f.tensors.at("targets")));
  EXPECT_NEAR(loss.item(), to_tensor(f.tensors.at("loss")).item(), 1e-5 * std::abs(loss.item()) + 1e-6);
  loss.backward();
  std::map<std::string, Tensor> params;
  for (auto& [k, t] : model.named_parameters()) params[k] = t;
  int checked = 0;
  double worst = 0;
  for (const auto& [key, entry] : f.tensors) {
    if (key.rfind("grad.", 0) != 0) continue;
    const std::string name = key.substr(5);
    const double e = rel_err(params.at(name).grad(), to_tensor(entry));
    EXPECT_LE(e, 5e-4) << name;
    worst = std::max(worst, e);
    ++checked;
  }
  EXPECT_EQ(checked, 8);
  std::cout << "worst relative gradient error of " << checked << " parameters: " << worst << "\n";
}

// ---- recomputation, pipeline segments, planned training -----------------------------------------

TEST(ModelFamilies, LaddersAndSegments) {
  struct Case {
    const char* name;
    std::size_t segments;
    const char* level2;
  };
  for (const Case& c : {Case{"seresnet50", 1 + 16 + 1, "blocks + layer1"},
                        Case{"resnext50_32x4d", 1 + 16 + 1, "blocks + layer1"},
                        Case{"resnetv2_18", 1 + 8 + 1, "blocks + stages.0"}}) {
    SCOPED_TRACE(c.name);
    const auto m = make(c.name);
    EXPECT_EQ(nn::recompute_levels(*m), 5);  // none, blocks, + the first stage, + two, all
    EXPECT_EQ(nn::recompute_level_name(*m, 2), c.level2);
    EXPECT_EQ(nn::segment_names(*m).front(), "stem");
    const auto segments = m->segments();
    ASSERT_EQ(segments.size(), c.segments);
    EXPECT_EQ(segments.back().name, "head");
    // Each parameter belongs to exactly one segment.
    std::int64_t in_segments = 0;
    for (const auto& s : segments)
      for (const Tensor& p : nn::parameters_of(s.modules)) in_segments += p.numel();
    EXPECT_EQ(in_segments, count_parameters(*m));
    // The segments in order are the forward.
    m->eval();
    NoGradGuard no_grad;
    const test::Data d = test::make_data(2, {3, 32, 32}, 5);
    const Tensor x = test::input_tensor<float>(d, 2, {3, 32, 32});
    Tensor y = x;
    for (const auto& s : segments) y = s.forward(y);
    EXPECT_EQ(rel_err(y, (*m)(x)), 0.0);
  }
}

struct TrainCase {
  const char* model;
  const char* recompute;
  mbp::Precision precision;
};

class FamilyTrains : public ::testing::TestWithParam<TrainCase> {};

// Two steps of batch 4 in micro-batches of 2, each measured peak the plan's to the byte (as
// tests/mbp_test.cpp's PlannerExact).
TEST_P(FamilyTrains, TwoStepsPlannedExactly) {
  const TrainCase& c = GetParam();
  configure_arena(Device::cpu(), std::size_t(8) << 30);
  const auto m = make(c.model);
  m->train();
  const auto opt = test::sgd(*m, 0.01);
  mbp::ExecutorOptions eo;
  eo.sample_shape = {3, 32, 32};
  eo.micro_batch = 2;
  eo.recompute = c.recompute;
  eo.precision = c.precision;
  mbp::Executor ex(*m, *opt, eo);
  const mbp::Plan& p = ex.plan(4);
  EXPECT_EQ(p.micro_batches, 2);
  for (int step = 0; step < 2; ++step) {
    const test::Data d = test::make_data(4, eo.sample_shape, 7 + static_cast<std::uint32_t>(step));
    const mbp::StepResult r = ex.step(d.images.data(), d.labels.data(), 4);
    EXPECT_EQ(r.oom_retries, 0);
    EXPECT_EQ(r.peak, r.predicted_peak) << "step " << step;
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  std::cout << c.model << " (" << c.recompute << "): " << p.summary() << "\n";
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyTrains,
    ::testing::Values(TrainCase{"seresnet50", "none", mbp::Precision::fp32},
                      TrainCase{"resnext50_32x4d", "none", mbp::Precision::fp32},
                      TrainCase{"resnetv2_18", "none", mbp::Precision::fp32},
                      TrainCase{"seresnet50", "all", mbp::Precision::fp32},
                      TrainCase{"resnetv2_18", "all", mbp::Precision::bf16},
                      TrainCase{"wrn10_1", "none", mbp::Precision::fp32},
                      TrainCase{"wrn10_1", "all", mbp::Precision::bf16}),
    [](const auto& info) {
      return fmt::format("{}_{}_{}", info.param.model, info.param.recompute,
                         info.param.precision == mbp::Precision::bf16 ? "bf16" : "fp32");
    });

// ---- Wide ResNets and dropout --------------------------------------------------------------------

namespace {

// A WRN-10-1 (one block a group) with dropout 0.3 and the given norm, from seed 3.
std::shared_ptr<models::WideResNet> tiny_wrn(nn::Norm norm) {
  models::WideResNetOptions o;
  o.depth = 10, o.width = 1, o.dropout = 0.3, o.norm = norm;
  nn::manual_seed(3);
  return std::make_shared<models::WideResNet>(o);
}

}  // namespace

// WRN-28-10 as the paper's Table 1 builds it: 36,479,194 parameters at 10 classes (wide_resnet.h sums
// them); the names, segments and ladder of the family; a depth that is not 6n + 4 is an error.
TEST(WideResNet, CountsNamesSegmentsAndLadder) {
  EXPECT_EQ(count_parameters(*make("wrn28_10")), 36479194);
  const auto m = make("wrn10_1");
  const std::vector<std::string> names = keys(m->named_parameters());
  for (const char* n : {"conv1.weight", "layer1.0.bn1.weight", "layer1.0.conv1.weight", "layer1.0.bn2.bias",
                        "layer1.0.conv2.weight", "layer2.0.shortcut.weight", "layer3.0.shortcut.weight", "bn.weight",
                        "fc.weight", "fc.bias"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  EXPECT_EQ(std::find(names.begin(), names.end(), "layer1.0.shortcut.weight"), names.end())
      << "16 -> 16 at stride 1: the identity";
  const auto segments = m->segments();
  ASSERT_EQ(segments.size(), 5u);  // conv1, three blocks, head
  EXPECT_EQ(segments[1].name, "layer1.0");
  ASSERT_EQ(nn::recompute_levels(*m), 4);  // one block a group: none, blocks, blocks + layer1, all
  EXPECT_EQ(nn::recompute_level_name(*m, 2), "blocks + layer1");
  models::WideResNetOptions bad;
  bad.depth = 27;
  EXPECT_THROW(models::WideResNet{bad}, Error);
}

// A micro-batched step with dropout is the full batch's (group norm: batch norm's statistics are a
// micro-batch's by design): each sample draws its own mask wherever it runs. The same micro-batches
// with every segment recomputed give the same bits (the recomputed forward draws the forward's
// mask). With masks drawn per micro-batch instead, the gradients would differ by their size.
TEST(WideResNet, DropoutLeavesMicroBatchedAndRecomputedStepsAsTheFullBatch) {
  configure_arena(Device::cpu(), std::size_t(1) << 30);
  const std::int64_t B = 12;
  const Shape sample{3, 16, 16};
  const test::Data d = test::make_data(B, sample, 17);
  const auto m = tiny_wrn(nn::Norm::Group);
  m->train();
  double full_loss = 0;
  {
    const SampleScope at({0, 0});  // step 0 (no optimizer step yet), the batch from sample 0
    full_loss = test::full_batch_backward<float>(*m, d, B, sample);
  }
  const auto ref = test::grads<float>(*m);
  m->zero_grad();
  const auto opt = test::sgd(*m);
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  mbp::Executor ex(*m, *opt, eo);
  std::vector<std::vector<double>> plain;
  for (const std::int64_t mb : {1, 5, 12}) {
    const auto sizes = mbp::balanced_sizes(B, (B + mb - 1) / mb);
    const double loss = ex.accumulate(d.images.data(), d.labels.data(), sizes);
    EXPECT_NEAR(loss, full_loss, 1e-5 * std::abs(full_loss)) << "m = " << mb;
    const auto g = test::grads<float>(*m);
    for (std::size_t i = 0; i < g.size(); ++i)
      EXPECT_LE(test::rel_error(g[i], ref[i]), 1e-5) << "m = " << mb << ", parameter " << i;
    if (mb == 5) plain = g;
    m->zero_grad();
  }
  nn::set_recompute_level(*m, nn::recompute_levels(*m) - 1);  // every segment recomputed
  (void)ex.accumulate(d.images.data(), d.labels.data(), mbp::balanced_sizes(B, 3));
  EXPECT_TRUE(test::bitwise_equal(test::grads<float>(*m), plain)) << "recomputed: the same masks, the same bits";
  m->zero_grad();
  // Dropout off (eval mode would change the norms too): the gradients move.
  nn::set_recompute_level(*m, 0);
  {
    const SampleScope at({1, 0});  // another step: other masks
    (void)test::full_batch_backward<float>(*m, d, B, sample);
  }
  EXPECT_GT(test::rel_error(test::grads<float>(*m)[1], ref[1]), 1e-3) << "another step's masks change the step";
}

// ---- the command line ---------------------------------------------------------------------------

TEST(ModelFamilies, TallyPlansEachFamily) {
  for (const char* name : {"seresnet50", "resnext50_32x4d", "resnetv2_18", "wrn28_10"}) {
    SCOPED_TRACE(name);
    const std::string cmd = fmt::format(
        "OMP_WAIT_POLICY=passive {} plan --model {} --input 3x64x64 --batch-size 64 --memory-limit 512MiB 2>&1",
        TALLY_EXE, name);
    FILE* pipe = popen(cmd.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string out;
    char buf[4096];
    while (std::size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
    const int status = pclose(pipe);
    EXPECT_EQ(status, 0) << out;
    EXPECT_NE(out.find("plan: batch 64 = "), std::string::npos) << out;
  }
}
