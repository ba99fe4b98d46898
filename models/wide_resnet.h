// models/wide_resnet.h — the Wide ResNets of Zagoruyko & Komodakis ("Wide Residual Networks", BMVC
// 2016) for CIFAR, WRN-d-k with dropout between each block's convolutions, written with tally's
// public API only. Registered as "wrn28_10" (the paper's CIFAR network: depth 28, width 10,
// dropout 0.3; 36.5M parameters at 10 classes) and "wrn10_1" (the smallest of the family — one block
// a group, width 1 — for tests and demos).
//
// The paper's network (its Table 1, and its Lua code's `wide_basic`): conv1 3x3 (3 -> 16); three
// groups of n = (d - 4) / 6 pre-activation blocks of widths 16k, 32k, 64k, the first block of groups
// 2 and 3 of stride 2; a final BN-ReLU, global average pool and a linear classifier. A block:
//   y = conv2(relu(bn2(dropout(conv1(relu(bn1(x))))))) + shortcut(x)
// with shortcut a 1x1 convolution (stride, no bias) where the width or the stride changes, else x;
// the paper puts the dropout between the two convolutions, after conv1's ReLU'd input has been
// convolved (as its code does). There is no torchvision or timm Wide ResNet for CIFAR, so the
// state-dict names are tally's, those of the common PyTorch port of the paper's code:
//   conv1.weight, layer{1,2,3}.{i}.{bn1.*, conv1.weight, bn2.*, conv2.weight, shortcut.weight},
//   bn.*, fc.{weight,bias}
// Init: convolutions kaiming_normal_(fan_out, relu), batch norms 1 and 0, the classifier as Linear's.
// Dropout's mask (nn::Dropout, docs/models.md "Dropout") is a function of the layer's seed, the
// step and each sample's index in the step's batch: micro-batches, ranks, recomputation and a
// resumed run draw it as one full-batch step would.
#pragma once
#include <cstdint>
#include <memory>

#include "core/ops.h"
#include "nn/module.h"
#include "nn/modules.h"
#include "nn/resnet.h"

namespace tally::models {

class WideBasic : public nn::Module {
 public:
  WideBasic(std::int64_t in, std::int64_t out, std::int64_t stride, double dropout, nn::Norm norm);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::Module> bn1, bn2;
  std::shared_ptr<nn::Conv2d> conv1, conv2, shortcut;
  std::shared_ptr<nn::Dropout> dropout;
};

struct WideResNetOptions {
  std::int64_t depth = 28, width = 10;  // d = 6n + 4, k
  double dropout = 0.3;
  std::int64_t in_channels = 3, num_classes = 10;
  nn::Norm norm = nn::Norm::Batch;
};

class WideResNet : public nn::Module {
 public:
  explicit WideResNet(const WideResNetOptions& o);  // an Error unless depth = 6n + 4, n >= 1, width >= 1
  Tensor forward(const Tensor& x) override;
  RecomputeParts recompute_parts() override;
  std::vector<Segment> segments() override;  // conv1, every block, head (bn, pool, fc)

  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::Sequential> layer1, layer2, layer3;
  std::shared_ptr<nn::Module> bn;
  std::shared_ptr<nn::Linear> fc;

 private:
  Tensor run_stem(const Tensor& x);
  Tensor run_head(const Tensor& x);
  nn::SegmentMode stem_mode = nn::SegmentMode::keep;
};

}  // namespace tally::models
