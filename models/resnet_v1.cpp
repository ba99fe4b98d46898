// models/resnet_v1.cpp — the bottleneck ResNet of SE-ResNet-50 and ResNeXt-50 (names, structure and
// sources in resnet_v1.h), on tally's public API alone.
#include "models/resnet_v1.h"

#include <algorithm>

#include <fmt/format.h>

#include "models/common.h"
#include "nn/init.h"

namespace tally::models {

namespace {
std::shared_ptr<nn::Conv2d> conv1x1(std::int64_t in, std::int64_t out, std::int64_t stride = 1, bool bias = false) {
  return std::make_shared<nn::Conv2d>(in, out, 1, stride, 0, 1, 1, bias);
}
}  // namespace

// ---- squeeze and excitation ---------------------------------------------------------------------
// timm/layers/helpers.py, make_divisible(v, divisor = 8, min_value = None, round_limit = 0.):
// max(divisor, int(v + divisor / 2) // divisor * divisor), never raised (round_limit 0).
std::int64_t se_reduced_channels(std::int64_t channels) {
  const double v = static_cast<double>(channels) / 16.0, divisor = 8.0;
  return std::max<std::int64_t>(8, static_cast<std::int64_t>(v + divisor / 2) / 8 * 8);
}

SEModule::SEModule(std::int64_t channels, std::int64_t reduced) {
  fc1 = register_module("fc1", conv1x1(channels, reduced, 1, /*bias=*/true));
  act = register_module("act", std::make_shared<nn::ReLU>());
  fc2 = register_module("fc2", conv1x1(reduced, channels, 1, /*bias=*/true));
  gate = register_module("gate", std::make_shared<nn::Sigmoid>());
}

// timm's SEModule.forward: x * gate(fc2(act(fc1(x.mean((2, 3), keepdim = True))))). The excitation
// s is (N, C, 1, 1); scale_channels keeps x and s for its backward.
Tensor SEModule::forward(const Tensor& x) {
  Tensor s = adaptive_avg_pool2d(x, {1, 1});
  s = (*gate)((*fc2)((*act)((*fc1)(s))));
  return scale_channels(x, s);
}

// ---- the block ----------------------------------------------------------------------------------
Bottleneck::Bottleneck(std::int64_t in_planes, std::int64_t planes, std::int64_t stride, const BottleneckOptions& o) {
  // torchvision: int(planes * (base_width / 64.)) * groups; timm: int(floor(planes * (base_width / 64)))
  // * cardinality — the same for integers.
  const std::int64_t width = planes * o.width_per_group / 64 * o.groups;
  const std::int64_t out = planes * expansion;
  conv1 = register_module("conv1", conv1x1(in_planes, width));
  bn1 = register_module("bn1", nn::make_norm(o.norm, width));
  conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(width, width, 3, stride, 1, 1, o.groups, false));
  bn2 = register_module("bn2", nn::make_norm(o.norm, width));
  conv3 = register_module("conv3", conv1x1(width, out));
  bn3 = register_module("bn3", nn::make_norm(o.norm, out));
  if (o.se) se = register_module("se", std::make_shared<SEModule>(out, se_reduced_channels(out)));
  if (stride != 1 || in_planes != out) {
    auto ds = std::make_shared<nn::Sequential>();
    ds->push_back(conv1x1(in_planes, out, stride));
    ds->push_back(nn::make_norm(o.norm, out));
    downsample = register_module("downsample", ds);
  }
}

// One intermediate at a time, as the zoo's blocks (nn/resnet.cpp). Without SE the last norm, the
// residual add and the ReLU are one op; with SE the excitation comes between the norm and the add,
// so the add and the ReLU write in place into the SE output, which nothing else holds.
Tensor Bottleneck::forward(const Tensor& x) {
  Tensor out = (*conv1)(x);
  out = nn::norm_relu(*bn1, std::move(out));
  out = (*conv2)(out);
  out = nn::norm_relu(*bn2, std::move(out));
  out = (*conv3)(out);
  const Tensor shortcut = downsample ? (*downsample)(x) : x;
  if (!se) return nn::norm_relu(*bn3, std::move(out), shortcut);
  out = (*se)((*bn3)(out));
  return relu(add(std::move(out), shortcut));
}

// ---- the network --------------------------------------------------------------------------------
ResNet::ResNet(const ResNetOptions& o) {
  if (o.layers.size() != 4)
    throw Error(fmt::format("ResNet: expected 4 stage sizes, found {}", o.layers.size()));
  if (o.block.groups < 1 || o.block.width_per_group < 1)
    throw Error(fmt::format("ResNet: groups and width_per_group must be >= 1, found {} and {}",
                                            o.block.groups, o.block.width_per_group));
  const bool timm = o.reference == Reference::timm;
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(o.in_channels, 64, 7, 2, 3, 1, 1, false));
  bn1 = register_module("bn1", nn::make_norm(o.block.norm, 64));
  maxpool = register_module("maxpool", std::make_shared<nn::MaxPool2d>(3, 2, 1));
  std::int64_t in_planes = 64;
  for (std::size_t i = 0; i < 4; ++i) {
    auto stage = std::make_shared<nn::Sequential>();
    const std::int64_t planes = std::int64_t{64} << i;
    for (std::int64_t b = 0; b < o.layers[i]; ++b) {
      stage->push_back(std::make_shared<Bottleneck>(in_planes, planes, b == 0 && i > 0 ? 2 : 1, o.block));
      in_planes = planes * Bottleneck::expansion;
    }
    layers.push_back(register_module(fmt::format("layer{}", i + 1), stage));
  }
  pool = register_module(timm ? "global_pool" : "avgpool", std::make_shared<nn::AdaptiveAvgPool2d>(1, 1));
  fc = register_module("fc", std::make_shared<nn::Linear>(in_planes, o.num_classes));
  init_convs(*this);
  // timm's ResNet.init_weights(zero_init_last = True): each block's bn3.weight = 0.
  if (timm)
    for (const auto& stage : layers)
      for (auto& [index, block] : stage->named_children())
        for (auto& [name, p] : static_cast<Bottleneck&>(*block).bn3->named_parameters())
          if (name == "weight") nn::constant_(p, 0.0);
}

Tensor ResNet::stem(const Tensor& x) { return (*maxpool)(stem_conv_norm_relu(*conv1, *bn1, x)); }

Tensor ResNet::head(const Tensor& x) { return classify(*fc, fc->weight, flatten((*pool)(x), 1)); }

Tensor ResNet::forward(const Tensor& x) {
  Tensor y = run_segment(stem_mode, [this](const Tensor& t) { return stem(t); }, x, "stem");
  for (const auto& stage : layers) y = (*stage)(y);
  return head(y);
}

nn::Module::RecomputeParts ResNet::recompute_parts() {
  RecomputeParts parts;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    parts.stages.emplace_back(fmt::format("layer{}", i + 1), layers[i].get());
    for (auto& [index, block] : layers[i]->named_children()) parts.blocks.push_back(block.get());
  }
  parts.stem = &stem_mode;
  return parts;
}

std::vector<nn::Module::Segment> ResNet::segments() {
  std::vector<Segment> out;
  out.push_back({"stem", {conv1.get(), bn1.get(), maxpool.get()}, [this](const Tensor& x) {
                   return run_segment(stem_mode, [this](const Tensor& t) { return stem(t); }, x, "stem");
                 }});
  for (std::size_t i = 0; i < layers.size(); ++i)
    for (auto& [index, block] : layers[i]->named_children()) {
      nn::Module* b = block.get();
      out.push_back({fmt::format("layer{}.{}", i + 1, index), {b}, [b](const Tensor& x) { return (*b)(x); }});
    }
  out.push_back({"head", {pool.get(), fc.get()}, [this](const Tensor& x) { return head(x); }});
  return out;
}

}  // namespace tally::models
