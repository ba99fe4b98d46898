// models/wide_resnet.cpp — the Wide ResNets for CIFAR (names, structure and sources in
// wide_resnet.h), on tally's public API alone.
#include "models/wide_resnet.h"

#include <fmt/format.h>

#include "core/error.h"
#include "models/common.h"
#include "nn/init.h"

namespace tally::models {

WideBasic::WideBasic(std::int64_t in, std::int64_t out, std::int64_t stride, double p, nn::Norm norm) {
  bn1 = register_module("bn1", nn::make_norm(norm, in));
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(in, out, 3, 1, 1, 1, 1, false));
  dropout = register_module("dropout", std::make_shared<nn::Dropout>(p));
  bn2 = register_module("bn2", nn::make_norm(norm, out));
  conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(out, out, 3, stride, 1, 1, 1, false));
  if (stride != 1 || in != out)
    shortcut = register_module("shortcut", std::make_shared<nn::Conv2d>(in, out, 1, stride, 0, 1, 1, false));
}

// The paper's code strides the second convolution (and the shortcut), as here.
Tensor WideBasic::forward(const Tensor& x) {
  Tensor out = (*conv1)(nn::norm_relu(*bn1, x));
  out = (*dropout)(out);
  out = (*conv2)(nn::norm_relu(*bn2, std::move(out)));
  return add(std::move(out), shortcut ? (*shortcut)(x) : x);
}

WideResNet::WideResNet(const WideResNetOptions& o) {
  if (o.depth < 10 || (o.depth - 4) % 6 != 0 || o.width < 1)
    throw Error(fmt::format("WideResNet: expected a depth 6n + 4 (n >= 1) and a width of at least 1, found depth {} "
                            "and width {}", o.depth, o.width));
  const std::int64_t n = (o.depth - 4) / 6, k = o.width;
  conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(o.in_channels, 16, 3, 1, 1, 1, 1, false));
  std::int64_t in = 16;
  const std::int64_t widths[3] = {16 * k, 32 * k, 64 * k}, strides[3] = {1, 2, 2};
  std::shared_ptr<nn::Sequential>* layers[3] = {&layer1, &layer2, &layer3};
  for (int g = 0; g < 3; ++g) {
    *layers[g] = register_module(fmt::format("layer{}", g + 1), std::make_shared<nn::Sequential>());
    for (std::int64_t i = 0; i < n; ++i) {
      (*layers[g])->push_back(std::make_shared<WideBasic>(in, widths[g], i == 0 ? strides[g] : 1, o.dropout, o.norm));
      in = widths[g];
    }
  }
  bn = register_module("bn", nn::make_norm(o.norm, in));
  fc = register_module("fc", std::make_shared<nn::Linear>(in, o.num_classes));
  init_convs(*this);
}

Tensor WideResNet::run_stem(const Tensor& x) {
  return run_segment(stem_mode, [this](const Tensor& t) { return stem_conv(*conv1, t); }, x, "conv1");
}

Tensor WideResNet::run_head(const Tensor& x) {
  const Tensor pooled = flatten(adaptive_avg_pool2d(nn::norm_relu(*bn, x), {1, 1}), 1);
  return classify(*fc, fc->weight, pooled);
}

Tensor WideResNet::forward(const Tensor& x) { return run_head((*layer3)((*layer2)((*layer1)(run_stem(x))))); }

nn::Module::RecomputeParts WideResNet::recompute_parts() {
  RecomputeParts parts;
  for (auto& [name, layer] : named_children()) {
    auto* seq = dynamic_cast<nn::Sequential*>(layer.get());
    if (!seq) continue;
    parts.stages.emplace_back(name, seq);
    for (auto& [i, block] : seq->named_children()) parts.blocks.push_back(block.get());
  }
  parts.stem = &stem_mode;
  return parts;
}

std::vector<nn::Module::Segment> WideResNet::segments() {
  std::vector<Segment> out;
  out.push_back({"conv1", {conv1.get()}, [this](const Tensor& x) { return run_stem(x); }});
  for (auto& [name, layer] : named_children()) {
    auto* seq = dynamic_cast<nn::Sequential*>(layer.get());
    if (!seq) continue;
    for (auto& [i, block] : seq->named_children()) {
      nn::Module* m = block.get();
      out.push_back({fmt::format("{}.{}", name, i), {m}, [m](const Tensor& x) { return (*m)(x); }});
    }
  }
  out.push_back({"head", {bn.get(), fc.get()}, [this](const Tensor& x) { return run_head(x); }});
  return out;
}

}  // namespace tally::models
