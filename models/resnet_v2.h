// models/resnet_v2.h — the pre-activation ResNet-18 of timm (`resnetv2_18`, He et al. 2016,
// "Identity Mappings in Deep Residual Networks"), written with tally's public API only.
//
// From timm/models/resnetv2.py (`resnetv2_18`: ResNetV2(layers = [2, 2, 2, 2], channels = (64, 128,
// 256, 512), basic = True, bottle_ratio = 1.0, conv_layer = create_conv2d, norm_layer =
// BatchNormAct2d); create_resnetv2_stem with stem_type '' and preact = True; ResNetStage; PreActBasic;
// DownsampleConv with preact = True; ClassifierHead with use_conv = True):
//   stem.conv   7x7/2, pad 3, no bias (create_conv2d: symmetric padding, bias False), 3 -> 64
//   stem.pool   max pool 3/2, pad 1 (no norm in the stem: pre-activation)
//   stages.0 .. stages.3, each a ResNetStage whose blocks are stages.N.blocks.M (PreActBasic), widths
//   64, 128, 256, 512, the first block of stages.1..3 of stride 2:
//     PreActBasic(in, out, stride), registered in timm's order — downsample first:
//       downsample.conv  1x1/stride, no bias (only where the stride or the width changes; its norm is
//                        an Identity under preact), applied to the pre-activated input
//       norm1  BatchNormAct2d(in): batch norm then ReLU        -> x_preact
//       conv1  3x3/stride (in -> out), no bias
//       norm2  BatchNormAct2d(out)
//       conv2  3x3 (out -> out), no bias
//       y = conv2(norm2(conv1(x_preact))) + (downsample(x_preact) or x)   (no ReLU after the add)
//   norm        BatchNormAct2d(512): the final pre-activation
//   head        global_pool (average), fc = 1x1 Conv2d(512 -> classes, bias), flatten
// State-dict names: stem.conv.weight, stages.N.blocks.M.{downsample.conv.weight, norm1.*, conv1.weight,
// norm2.*, conv2.weight}, norm.*, head.fc.{weight,bias} (weight (classes, 512, 1, 1)).
// Init (timm's _init_weights, zero_init_last False): convolutions kaiming_normal_(fan_out, relu);
// head.fc normal(0, 0.01), bias 0; norms weight 1, bias 0.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/ops.h"
#include "nn/module.h"
#include "nn/modules.h"
#include "nn/resnet.h"

namespace tally::models {

// timm's create_resnetv2_stem (stem_type '', preact): stem.conv, stem.pool. The convolution runs in
// the master weights' precision (models/common.h).
class Stem : public nn::Module {
 public:
  explicit Stem(std::int64_t in_channels, std::int64_t out);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::Conv2d> conv;
  std::shared_ptr<nn::MaxPool2d> pool;
};

// timm's DownsampleConv under preact: the 1x1 projection alone (its norm is an Identity).
class DownsampleConv : public nn::Module {
 public:
  DownsampleConv(std::int64_t in, std::int64_t out, std::int64_t stride);
  Tensor forward(const Tensor& x) override { return (*conv)(x); }
  std::shared_ptr<nn::Conv2d> conv;
};

class PreActBasic : public nn::Module {
 public:
  PreActBasic(std::int64_t in, std::int64_t out, std::int64_t stride, nn::Norm norm);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<DownsampleConv> downsample;  // null: identity shortcut
  std::shared_ptr<nn::Module> norm1, norm2;
  std::shared_ptr<nn::Conv2d> conv1, conv2;
};

// A stage: its blocks under "blocks" (timm's ResNetStage).
class ResNetStage : public nn::Module {
 public:
  ResNetStage(std::int64_t in, std::int64_t out, std::int64_t stride, std::int64_t depth, nn::Norm norm);
  Tensor forward(const Tensor& x) override { return (*blocks)(x); }
  std::shared_ptr<nn::Sequential> blocks;
};

// timm's ClassifierHead with use_conv = True: global_pool (average, not flattened), fc (a 1x1
// convolution with bias), flatten. The classifier runs on features widened to its weights' dtype.
class ClassifierHead : public nn::Module {
 public:
  ClassifierHead(std::int64_t in, std::int64_t num_classes);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<nn::AdaptiveAvgPool2d> global_pool;
  std::shared_ptr<nn::Conv2d> fc;
  std::shared_ptr<nn::Flatten> flatten;
};

struct ResNetV2Options {
  std::vector<std::int64_t> layers{2, 2, 2, 2};
  std::vector<std::int64_t> channels{64, 128, 256, 512};
  std::int64_t in_channels = 3, num_classes = 1000;
  nn::Norm norm = nn::Norm::Batch;
};

class ResNetV2 : public nn::Module {
 public:
  explicit ResNetV2(const ResNetV2Options& options);
  Tensor forward(const Tensor& x) override;
  // Its stages are stages.0 .. stages.3 with their blocks stages.N.blocks.M (Module's default would
  // take `stages` for the only stage and its four ResNetStages for blocks), and the stem is a
  // segment of its own. Segments: stem, stages.0.blocks.0 .. stages.3.blocks.1, head (the final
  // norm, pool, classifier).
  RecomputeParts recompute_parts() override;
  std::vector<Segment> segments() override;

  std::shared_ptr<Stem> stem;
  std::shared_ptr<nn::Sequential> stages;  // ResNetStage "0" .. "3"
  std::shared_ptr<nn::Module> norm;        // the final pre-activation (norm, ReLU)
  std::shared_ptr<ClassifierHead> head;
  nn::SegmentMode stem_mode = nn::SegmentMode::keep;

 private:
  Tensor run_stem(const Tensor& x);
  Tensor run_head(const Tensor& x);
};

}  // namespace tally::models
