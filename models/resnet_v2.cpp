// models/resnet_v2.cpp — timm's pre-activation ResNet (resnetv2_18; names, structure and sources in
// resnet_v2.h), on tally's public API alone.
#include "models/resnet_v2.h"

#include <fmt/format.h>

#include "models/common.h"
#include "nn/init.h"

namespace tally::models {

Stem::Stem(std::int64_t in_channels, std::int64_t out) {
  conv = register_module("conv", std::make_shared<nn::Conv2d>(in_channels, out, 7, 2, 3, 1, 1, false));
  pool = register_module("pool", std::make_shared<nn::MaxPool2d>(3, 2, 1));
}

Tensor Stem::forward(const Tensor& x) { return (*pool)(stem_conv(*conv, x)); }

DownsampleConv::DownsampleConv(std::int64_t in, std::int64_t out, std::int64_t stride) {
  conv = register_module("conv", std::make_shared<nn::Conv2d>(in, out, 1, stride, 0, 1, 1, false));
}

// timm's PreActBasic registers its downsample before norm1, so the state dict lists it first.
PreActBasic::PreActBasic(std::int64_t in, std::int64_t out, std::int64_t stride, nn::Norm norm) {
  if (stride != 1 || in != out)
    downsample = register_module("downsample", std::make_shared<DownsampleConv>(in, out, stride));
  norm1 = register_module("norm1", nn::make_norm(norm, in));
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(in, out, 3, stride, 1, 1, 1, false));
  norm2 = register_module("norm2", nn::make_norm(norm, out));
  conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(out, out, 3, 1, 1, 1, 1, false));
}

// BatchNormAct2d is batch norm then ReLU: nn::norm_relu's fused op. The pre-activated input feeds
// both the residual branch and the projection; the identity shortcut takes x itself.
Tensor PreActBasic::forward(const Tensor& x) {
  const Tensor x_preact = nn::norm_relu(*norm1, x);
  Tensor out = (*conv1)(x_preact);
  out = nn::norm_relu(*norm2, std::move(out));
  out = (*conv2)(out);
  return add(std::move(out), downsample ? (*downsample)(x_preact) : x);
}

ResNetStage::ResNetStage(std::int64_t in, std::int64_t out, std::int64_t stride, std::int64_t depth, nn::Norm norm) {
  blocks = register_module("blocks", std::make_shared<nn::Sequential>());
  for (std::int64_t i = 0; i < depth; ++i)
    blocks->push_back(std::make_shared<PreActBasic>(i == 0 ? in : out, out, i == 0 ? stride : 1, norm));
}

ClassifierHead::ClassifierHead(std::int64_t in, std::int64_t num_classes) {
  global_pool = register_module("global_pool", std::make_shared<nn::AdaptiveAvgPool2d>(1, 1));
  fc = register_module("fc", std::make_shared<nn::Conv2d>(in, num_classes, 1, 1, 0, 1, 1, true));
  flatten = register_module("flatten", std::make_shared<nn::Flatten>(1));
}

Tensor ClassifierHead::forward(const Tensor& x) { return (*flatten)(classify(*fc, fc->weight, (*global_pool)(x))); }

ResNetV2::ResNetV2(const ResNetV2Options& o) {
  if (o.layers.size() != o.channels.size() || o.layers.empty())
    throw Error(fmt::format("ResNetV2: expected as many stage sizes as widths (at least one), found {} and {}",
                            o.layers.size(), o.channels.size()));
  stem = register_module("stem", std::make_shared<Stem>(o.in_channels, 64));
  stages = register_module("stages", std::make_shared<nn::Sequential>());
  std::int64_t in = 64;
  for (std::size_t i = 0; i < o.layers.size(); ++i) {
    stages->push_back(std::make_shared<ResNetStage>(in, o.channels[i], i == 0 ? 1 : 2, o.layers[i], o.norm));
    in = o.channels[i];
  }
  norm = register_module("norm", nn::make_norm(o.norm, in));
  head = register_module("head", std::make_shared<ClassifierHead>(in, o.num_classes));
  // timm's _init_weights: convolutions kaiming_normal_(fan_out, relu) (none of them has a bias but
  // the head's), the head's 1x1 convolution normal(0, 0.01) with bias 0; norms are weight 1, bias 0.
  init_convs(*this);
  nn::normal_(head->fc->weight, 0.0, 0.01);
  nn::constant_(head->fc->bias, 0.0);
}

Tensor ResNetV2::run_stem(const Tensor& x) {
  return run_segment(stem_mode, [this](const Tensor& t) { return (*stem)(t); }, x, "stem");
}

Tensor ResNetV2::run_head(const Tensor& x) { return (*head)(nn::norm_relu(*norm, x)); }

Tensor ResNetV2::forward(const Tensor& x) { return run_head((*stages)(run_stem(x))); }

nn::Module::RecomputeParts ResNetV2::recompute_parts() {
  RecomputeParts parts;
  for (auto& [index, stage] : stages->named_children()) {
    parts.stages.emplace_back(fmt::format("stages.{}", index), stage.get());
    for (auto& [b, block] : static_cast<ResNetStage&>(*stage).blocks->named_children())
      parts.blocks.push_back(block.get());
  }
  parts.stem = &stem_mode;
  return parts;
}

std::vector<nn::Module::Segment> ResNetV2::segments() {
  std::vector<Segment> out;
  out.push_back({"stem", {stem.get()}, [this](const Tensor& x) { return run_stem(x); }});
  for (auto& [index, stage] : stages->named_children())
    for (auto& [b, block] : static_cast<ResNetStage&>(*stage).blocks->named_children()) {
      nn::Module* m = block.get();
      out.push_back({fmt::format("stages.{}.blocks.{}", index, b), {m}, [m](const Tensor& x) { return (*m)(x); }});
    }
  out.push_back({"head", {norm.get(), head.get()}, [this](const Tensor& x) { return run_head(x); }});
  return out;
}

}  // namespace tally::models
