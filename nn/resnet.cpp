// nn/resnet.cpp — ResNet builders (names and structure in resnet.h).
#include "nn/resnet.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "nn/init.h"

namespace tally::nn {

// ---- norm ---------------------------------------------------------------------------------------
Norm parse_norm(const std::string& s) {
  if (s == "batch") return Norm::Batch;
  if (s == "group") return Norm::Group;
  if (s == "none") return Norm::None;
  throw Error(fmt::format("unknown norm '{}': expected one of batch, group, none", s));
}

const char* norm_name(Norm n) {
  switch (n) {
    case Norm::Batch: return "batch";
    case Norm::Group: return "group";
    case Norm::None: return "none";
  }
  return "?";
}

std::shared_ptr<Module> make_norm(Norm norm, std::int64_t channels) {
  switch (norm) {
    case Norm::Batch: return std::make_shared<BatchNorm2d>(channels);
    case Norm::Group: return std::make_shared<GroupNorm>(std::min<std::int64_t>(32, std::max<std::int64_t>(1, channels / 4)), channels);
    case Norm::None: return std::make_shared<Identity>();
  }
  throw Error("make_norm: invalid norm");
}

namespace {

std::shared_ptr<Conv2d> conv3x3(std::int64_t in, std::int64_t out, std::int64_t stride = 1) {
  return std::make_shared<Conv2d>(in, out, 3, stride, 1, 1, 1, false);
}
std::shared_ptr<Conv2d> conv1x1(std::int64_t in, std::int64_t out, std::int64_t stride = 1) {
  return std::make_shared<Conv2d>(in, out, 1, stride, 0, 1, 1, false);
}

std::shared_ptr<Sequential> make_downsample(std::int64_t in, std::int64_t out, std::int64_t stride, Norm norm) {
  if (stride == 1 && in == out) return nullptr;
  auto ds = std::make_shared<Sequential>();
  ds->push_back(conv1x1(in, out, stride));
  ds->push_back(make_norm(norm, out));
  return ds;
}

// torchvision's init: every conv kaiming_normal_(fan_out, relu); norms are already weight 1,
// bias 0 and Linear keeps its default init.
void init_convs(Module& m) {
  if (auto* conv = dynamic_cast<Conv2d*>(&m)) kaiming_normal_(conv->weight, 0.0, FanMode::FanOut, Nonlinearity::ReLU);
  for (auto& [name, child] : m.named_children()) init_convs(*child);
}

// A stage of `blocks` blocks; the first has `stride` and takes in_planes (updated to the output).
template <class Block>
std::shared_ptr<Sequential> make_stage(std::int64_t& in_planes, std::int64_t planes, std::int64_t blocks,
                                       std::int64_t stride, Norm norm) {
  auto stage = std::make_shared<Sequential>();
  for (std::int64_t i = 0; i < blocks; ++i) {
    stage->push_back(std::make_shared<Block>(in_planes, planes, i == 0 ? stride : 1, norm));
    in_planes = planes * Block::expansion;
  }
  return stage;
}

}  // namespace

// ---- blocks -------------------------------------------------------------------------------------
BasicBlock::BasicBlock(std::int64_t in_planes, std::int64_t planes, std::int64_t stride, Norm norm) {
  conv1 = register_module("conv1", conv3x3(in_planes, planes, stride));
  bn1 = register_module("bn1", make_norm(norm, planes));
  relu = register_module("relu", std::make_shared<ReLU>());
  conv2 = register_module("conv2", conv3x3(planes, planes));
  bn2 = register_module("bn2", make_norm(norm, planes));
  if (auto ds = make_downsample(in_planes, planes * expansion, stride, norm)) downsample = register_module("downsample", ds);
}

Tensor norm_relu(Module& norm, Tensor x, const Tensor& residual) {
  if (auto* bn = dynamic_cast<BatchNorm2d*>(&norm)) return bn->forward_relu(std::move(x), residual);
  if (auto* gn = dynamic_cast<GroupNorm*>(&norm)) return gn->forward_relu(x, residual);
  Tensor y = norm(x);
  if (residual.defined()) y = add(std::move(y), residual);
  return tally::relu(std::move(y));
}

namespace {
// Mixed precision keeps a network's first and last layers in its master weights' precision
// (docs/precision.md, "The first and last layers"). With bf16 activations the stem's convolution
// and norm run on the input widened back to float32, and the classifier takes the pooled features
// widened and gives float32 logits to the float32 loss. The stem's sums run over few products (9
// for one 3x3 channel, 147 for a 7x7 RGB stem), so its bf16 weights and outputs are the least
// averaged rounding of the network, and the logits decide the loss: rounding either tips make
// train's warm-up into loss spikes (bench/RESULTS.md, "bf16: the first and last layers in
// float32"). With float32 or float64 activations the stem is the plain conv-norm-ReLU.
//
// widened_stem: the stem on activations of another dtype than the master weights'. The norm's
// float32 output is rounded to x's dtype before the ReLU (in place), not after: the same values
// (rounding keeps a value's sign, so ReLU commutes with it) and the same gradients (the ReLU's mask
// is the same; the rounding's backward widens exactly), but the float32 output is dropped at once
// instead of kept for the fused norm-ReLU's backward (ResNet-20 3x32x32 batch 128: 8 MiB of a
// 114.7 MiB step; ResNet-50 224x224: 8 more samples in 8 GiB).
Tensor widened_stem(Module& conv, Module& norm, DType master, const Tensor& x) {
  return tally::relu(norm(conv(x.to(master))).to(x.dtype()));
}

Tensor stem_in_master_precision(Conv2d& conv, Module& norm, const Tensor& x) {
  const DType master = conv.weight.dtype();
  return x.dtype() == master ? norm_relu(norm, conv(x)) : widened_stem(conv, norm, master, x);
}

Tensor classify(Linear& fc, const Tensor& features) { return fc(features.to(fc.weight.dtype())); }

// The ResNets' head — global average pool, flatten, classifier — and its segment.
Tensor pool_and_classify(Module& avgpool, Linear& fc, const Tensor& x) { return classify(fc, flatten(avgpool(x), 1)); }
Module::Segment head_segment(Module* avgpool, Linear* fc) {
  return {"head", {avgpool, fc}, [avgpool, fc](const Tensor& x) { return pool_and_classify(*avgpool, *fc, x); }};
}
}  // namespace

// The blocks' forwards hold one intermediate at a time: each step's input handle is dropped as the
// next is assigned (a tensor no backward saved is freed there, e.g. in a recomputed segment's
// first, gradient-free run). The norm, the residual add and the ReLU are one op (norm_relu) — or,
// for the norms without a fused op, ReLU and the add write in place into the norm's output, which
// nothing else holds (core/ops.h), as torchvision's inplace ReLU and `out += identity` do.
Tensor BasicBlock::forward(const Tensor& x) {
  Tensor out = (*conv1)(x);
  out = norm_relu(*bn1, std::move(out));
  out = (*conv2)(out);
  return norm_relu(*bn2, std::move(out), downsample ? (*downsample)(x) : x);
}

Bottleneck::Bottleneck(std::int64_t in_planes, std::int64_t planes, std::int64_t stride, Norm norm) {
  conv1 = register_module("conv1", conv1x1(in_planes, planes));
  bn1 = register_module("bn1", make_norm(norm, planes));
  conv2 = register_module("conv2", conv3x3(planes, planes, stride));  // v1.5: stride on the 3x3
  bn2 = register_module("bn2", make_norm(norm, planes));
  conv3 = register_module("conv3", conv1x1(planes, planes * expansion));
  bn3 = register_module("bn3", make_norm(norm, planes * expansion));
  relu = register_module("relu", std::make_shared<ReLU>());
  if (auto ds = make_downsample(in_planes, planes * expansion, stride, norm)) downsample = register_module("downsample", ds);
}

Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = (*conv1)(x);
  out = norm_relu(*bn1, std::move(out));
  out = (*conv2)(out);
  out = norm_relu(*bn2, std::move(out));
  out = (*conv3)(out);
  return norm_relu(*bn3, std::move(out), downsample ? (*downsample)(x) : x);
}

// ---- torchvision ResNet -------------------------------------------------------------------------
ResNet::ResNet(BlockKind block, const std::vector<std::int64_t>& layers, std::int64_t in_channels,
               std::int64_t num_classes, Norm norm) {
  if (layers.size() != 4) throw Error(fmt::format("ResNet: expected 4 stage sizes, found {}", layers.size()));
  conv1 = register_module("conv1", std::make_shared<Conv2d>(in_channels, 64, 7, 2, 3, 1, 1, false));
  bn1 = register_module("bn1", make_norm(norm, 64));
  relu = register_module("relu", std::make_shared<ReLU>());
  maxpool = register_module("maxpool", std::make_shared<MaxPool2d>(3, 2, 1));
  std::int64_t in_planes = 64;
  const std::int64_t widths[4] = {64, 128, 256, 512};
  std::shared_ptr<Sequential>* stages[4] = {&layer1, &layer2, &layer3, &layer4};
  for (int i = 0; i < 4; ++i) {
    const std::int64_t stride = i == 0 ? 1 : 2;
    auto stage = block == BlockKind::Basic ? make_stage<BasicBlock>(in_planes, widths[i], layers[i], stride, norm)
                                           : make_stage<Bottleneck>(in_planes, widths[i], layers[i], stride, norm);
    *stages[i] = register_module(fmt::format("layer{}", i + 1), stage);
  }
  avgpool = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
  fc = register_module("fc", std::make_shared<Linear>(in_planes, num_classes));
  init_convs(*this);
}

namespace {
// A ResNet's stages and their blocks, for the recomputation ladder (nn/recompute.h).
// The residual blocks of `stages`, one segment each ("layer2.1").
void add_block_segments(std::vector<Module::Segment>& out,
                        std::initializer_list<std::pair<const char*, Module*>> stages) {
  for (const auto& [name, stage] : stages)
    for (auto& [index, block] : stage->named_children()) {
      Module* b = block.get();
      out.push_back({fmt::format("{}.{}", name, index), {b}, [b](const Tensor& x) { return (*b)(x); }});
    }
}

Module::RecomputeParts staged_parts(std::initializer_list<std::pair<const char*, Module*>> stages) {
  Module::RecomputeParts parts;
  for (const auto& [name, stage] : stages) {
    parts.stages.emplace_back(name, stage);
    for (auto& [index, block] : stage->named_children()) parts.blocks.push_back(block.get());
  }
  return parts;
}
}  // namespace

Module::RecomputeParts ResNet::recompute_parts() {
  RecomputeParts parts = staged_parts(
      {{"layer1", layer1.get()}, {"layer2", layer2.get()}, {"layer3", layer3.get()}, {"layer4", layer4.get()}});
  parts.stem = &stem_mode;
  return parts;
}

std::vector<Module::Segment> ResNet::segments() {
  std::vector<Segment> out;
  out.push_back({"stem", {conv1.get(), bn1.get(), relu.get(), maxpool.get()}, [this](const Tensor& x) {
                   return run_segment(stem_mode, [this](const Tensor& t) { return stem(t); }, x, "stem");
                 }});
  add_block_segments(out, {{"layer1", layer1.get()}, {"layer2", layer2.get()}, {"layer3", layer3.get()},
                           {"layer4", layer4.get()}});
  out.push_back(head_segment(avgpool.get(), fc.get()));
  return out;
}

Tensor ResNet::stem(const Tensor& x) {
  return (*maxpool)(stem_in_master_precision(*conv1, *bn1, x));
}

Tensor ResNet::forward(const Tensor& x) {
  Tensor y = run_segment(stem_mode, [this](const Tensor& t) { return stem(t); }, x, "stem");
  y = (*layer4)((*layer3)((*layer2)((*layer1)(y))));
  return pool_and_classify(*avgpool, *fc, y);
}

// ---- CIFAR ResNet -------------------------------------------------------------------------------
CifarResNet::CifarResNet(std::int64_t depth, std::int64_t in_channels, std::int64_t num_classes, Norm norm) {
  if (depth < 8 || (depth - 2) % 6 != 0)
    throw Error(fmt::format("CifarResNet: depth must be 6n + 2 with n >= 1, found {}", depth));
  const std::int64_t n = (depth - 2) / 6;
  conv1 = register_module("conv1", conv3x3(in_channels, 16));
  bn1 = register_module("bn1", make_norm(norm, 16));
  relu = register_module("relu", std::make_shared<ReLU>());
  std::int64_t in_planes = 16;
  layer1 = register_module("layer1", make_stage<BasicBlock>(in_planes, 16, n, 1, norm));
  layer2 = register_module("layer2", make_stage<BasicBlock>(in_planes, 32, n, 2, norm));
  layer3 = register_module("layer3", make_stage<BasicBlock>(in_planes, 64, n, 2, norm));
  avgpool = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
  fc = register_module("fc", std::make_shared<Linear>(64, num_classes));
  init_convs(*this);
}

Module::RecomputeParts CifarResNet::recompute_parts() {
  return staged_parts({{"layer1", layer1.get()}, {"layer2", layer2.get()}, {"layer3", layer3.get()}});
}

Tensor CifarResNet::forward(const Tensor& x) {
  Tensor y = stem_in_master_precision(*conv1, *bn1, x);
  y = (*layer3)((*layer2)((*layer1)(y)));
  return pool_and_classify(*avgpool, *fc, y);
}

std::vector<Module::Segment> CifarResNet::segments() {
  std::vector<Segment> out;
  out.push_back({"stem", {conv1.get(), bn1.get(), relu.get()}, [this](const Tensor& x) {
                   return stem_in_master_precision(*conv1, *bn1, x);
                 }});
  add_block_segments(out, {{"layer1", layer1.get()}, {"layer2", layer2.get()}, {"layer3", layer3.get()}});
  out.push_back(head_segment(avgpool.get(), fc.get()));
  return out;
}

// ---- ResNet-9 -----------------------------------------------------------------------------------
namespace {
std::shared_ptr<Sequential> conv_norm_relu(std::int64_t in, std::int64_t out, Norm norm, bool pool = false) {
  auto s = std::make_shared<Sequential>();
  s->push_back(conv3x3(in, out));
  s->push_back(make_norm(norm, out));
  s->push_back(std::make_shared<ReLU>());
  if (pool) s->push_back(std::make_shared<MaxPool2d>(2));
  return s;
}
std::shared_ptr<Sequential> residual(std::int64_t c, Norm norm) {
  return std::make_shared<Sequential>(
      std::initializer_list<std::shared_ptr<Module>>{conv_norm_relu(c, c, norm), conv_norm_relu(c, c, norm)});
}
}  // namespace

ResNet9::ResNet9(std::int64_t in_channels, std::int64_t num_classes, Norm norm) {
  prep = register_module("prep", conv_norm_relu(in_channels, 64, norm));
  layer1 = register_module("layer1", conv_norm_relu(64, 128, norm, true));
  res1 = register_module("res1", residual(128, norm));
  layer2 = register_module("layer2", conv_norm_relu(128, 256, norm, true));
  layer3 = register_module("layer3", conv_norm_relu(256, 512, norm, true));
  res3 = register_module("res3", residual(512, norm));
  fc = register_module("fc", std::make_shared<Linear>(512, num_classes, false));
}

// Its six units are the blocks (no stages: they are not grouped).
Module::RecomputeParts ResNet9::recompute_parts() {
  RecomputeParts parts;
  parts.blocks = {prep.get(), layer1.get(), res1.get(), layer2.get(), layer3.get(), res3.get()};
  parts.block_noun = "unit";
  return parts;
}

Tensor ResNet9::stem(const Tensor& x) {  // prep: convolution, norm, ReLU
  const DType master = fc->weight.dtype();
  return x.dtype() == master ? (*prep)(x) : widened_stem(*(*prep)[0], *(*prep)[1], master, x);
}

Tensor ResNet9::forward(const Tensor& x) {
  Tensor y = (*layer1)(stem(x));
  y = add(y, (*res1)(y));
  y = (*layer3)((*layer2)(y));
  y = add(y, (*res3)(y));
  // Global max pool: one window over whatever spatial size is left (4x4 for 32x32 inputs).
  const std::int64_t h = y.size(2), w = y.size(3);
  y = flatten(max_pool2d(y, {h, w}, {h, w}), 1);
  return scale(classify(*fc, y), 0.125);
}

std::vector<Module::Segment> ResNet9::segments() {
  auto unit = [](Sequential* m) { return [m](const Tensor& x) { return (*m)(x); }; };
  auto residual_unit = [](Sequential* m) { return [m](const Tensor& x) { return add(x, (*m)(x)); }; };
  return {{"prep", {prep.get()}, [this](const Tensor& x) { return stem(x); }},
          {"layer1", {layer1.get()}, unit(layer1.get())},
          {"res1", {res1.get()}, residual_unit(res1.get())},
          {"layer2", {layer2.get()}, unit(layer2.get())},
          {"layer3", {layer3.get()}, unit(layer3.get())},
          {"res3", {res3.get()}, residual_unit(res3.get())},
          {"head", {fc.get()}, [this](const Tensor& x) {
             const std::int64_t h = x.size(2), w = x.size(3);
             return scale(classify(*fc, flatten(max_pool2d(x, {h, w}, {h, w}), 1)), 0.125);
           }}};
}

// ---- factory ------------------------------------------------------------------------------------
namespace {
std::vector<std::string>& names() {
  static std::vector<std::string> all = {"resnet20", "resnet32", "resnet44", "resnet56", "resnet110",
                                         "resnet18", "resnet34", "resnet50", "resnet9"};
  return all;
}
std::map<std::string, ModelFactory>& registered() {
  static std::map<std::string, ModelFactory> factories;
  return factories;
}
}  // namespace

const std::vector<std::string>& model_names() { return names(); }

void register_model(const std::string& name, ModelFactory factory) {
  if (name.empty() || !factory) throw Error("register_model: expected a name and a factory, found an empty one");
  if (std::find(names().begin(), names().end(), name) != names().end())
    throw Error(fmt::format("register_model: expected a new name, found '{}', which is taken (models: {})", name,
                            fmt::join(names(), ", ")));
  registered().emplace(name, std::move(factory));
  names().push_back(name);
}

std::shared_ptr<Module> make_model(const ModelConfig& c) {
  if (c.in_channels < 1 || c.num_classes < 1)
    throw Error(fmt::format("make_model: in_channels and num_classes must be >= 1, found {} and {}", c.in_channels,
                            c.num_classes));
  if (const auto it = registered().find(c.name); it != registered().end()) {
    std::shared_ptr<Module> m = it->second(c);
    if (!m) throw Error(fmt::format("make_model: the factory registered for '{}' made no model", c.name));
    return m;
  }
  for (std::int64_t depth : {20, 32, 44, 56, 110})
    if (c.name == fmt::format("resnet{}", depth)) return std::make_shared<CifarResNet>(depth, c.in_channels, c.num_classes, c.norm);
  if (c.name == "resnet18")
    return std::make_shared<ResNet>(BlockKind::Basic, std::vector<std::int64_t>{2, 2, 2, 2}, c.in_channels, c.num_classes, c.norm);
  if (c.name == "resnet34")
    return std::make_shared<ResNet>(BlockKind::Basic, std::vector<std::int64_t>{3, 4, 6, 3}, c.in_channels, c.num_classes, c.norm);
  if (c.name == "resnet50")
    return std::make_shared<ResNet>(BlockKind::Bottleneck, std::vector<std::int64_t>{3, 4, 6, 3}, c.in_channels, c.num_classes,
                                    c.norm);
  if (c.name == "resnet9") return std::make_shared<ResNet9>(c.in_channels, c.num_classes, c.norm);
  throw Error(fmt::format("make_model: unknown model '{}': expected one of {}", c.name, fmt::join(model_names(), ", ")));
}

}  // namespace tally::nn
