// models/resnet_v1.h — ResNet v1.5 bottleneck families beyond the zoo's ResNet-50, written with
// tally's public API only (core/ops.h, nn/modules.h, nn/resnet.h, nn/init.h), as a user would write
// them: SE-ResNet-50 (timm's `seresnet50`) and ResNeXt-50 32x4d (torchvision's `resnext50_32x4d`).
//
// Both are torchvision's / timm's ResNet skeleton with a wider bottleneck block:
//   conv1 (7x7/2, pad 3, no bias) bn1 ReLU maxpool (3/2, pad 1)
//   layer1..layer4 of Bottleneck blocks, planes 64, 128, 256, 512, the first block of layer2..4 of
//     stride 2 (on its 3x3 convolution: v1.5)
//   global average pool, fc = Linear(2048, classes)
//   Bottleneck: width = floor(planes * width_per_group / 64) * groups
//     conv1 1x1 (in -> width) bn1 ReLU
//     conv2 3x3/stride, groups (width -> width) bn2 ReLU
//     conv3 1x1 (width -> planes * 4) bn3
//     [se: SEModule(planes * 4)]
//     + shortcut (identity, or downsample = Sequential(conv 1x1/stride "0", norm "1")), ReLU
//   SEModule (timm/layers/squeeze_excite.py, SEModule with rd_ratio 1/16, rd_divisor 8):
//     rd = make_divisible(C / 16, 8, round_limit = 0) (C / 16 rounded to a multiple of 8: 16, 32,
//     64, 128 for the four stages)
//     s = mean over H, W (N, C, 1, 1) -> fc1 (1x1 conv C -> rd, bias) -> act (ReLU)
//       -> fc2 (1x1 conv rd -> C, bias) -> gate (sigmoid); y = x * s per channel (scale_channels)
//
// State-dict names are the references' exactly:
//   resnext50_32x4d: torchvision.models.resnet (ResNet, Bottleneck with groups = 32,
//     width_per_group = 4): conv1, bn1, layer1.0.conv1 .. layer4.2.bn3, layerN.0.downsample.{0,1}, fc.
//   seresnet50: timm/models/resnet.py (ResNet, Bottleneck, make_blocks, downsample_conv;
//     `seresnet50` = _create_resnet with block_args=dict(attn_layer='se')): the same names plus
//     layerN.M.se.fc1.{weight,bias} and layerN.M.se.fc2.{weight,bias}, registered after bn3 and
//     before downsample, as timm's Bottleneck registers `self.se` after `self.bn3`.
// The references' parameterless modules are named as they name them where they are called: the
// pool is torchvision's `avgpool` or timm's `global_pool`, the SE module's `act` and `gate`. Their
// ReLU modules (torchvision's `relu`, timm's `act1`..`act3`) are not registered: the ReLUs ride on
// the norms (nn::norm_relu: batch norm, residual add and ReLU in one op).
//
// Init: every convolution kaiming_normal_(fan_out, relu) (torchvision's and timm's, the SE
// module's 1x1 convolutions too; their biases keep Conv2d's default), norms weight 1 bias 0, fc the
// default Linear init; timm's ResNet also zero-initializes each block's last norm weight
// (zero_init_last = True), which `seresnet50` does here too.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/ops.h"
#include "nn/module.h"
#include "nn/modules.h"
#include "nn/resnet.h"

namespace tally::models {

// Whose names and init the model follows where torchvision and timm differ.
enum class Reference { torchvision, timm };

// timm's SEModule: channel attention from the globally pooled features.
class SEModule : public nn::Module {
 public:
  SEModule(std::int64_t channels, std::int64_t reduced);
  Tensor forward(const Tensor& x) override;  // (N, C, H, W) -> (N, C, H, W)

  std::shared_ptr<nn::Conv2d> fc1, fc2;  // (rd, C, 1, 1) + (rd); (C, rd, 1, 1) + (C)
  std::shared_ptr<nn::ReLU> act;
  std::shared_ptr<nn::Sigmoid> gate;
};
// timm's reduced width for rd_ratio 1/16, rd_divisor 8 (make_divisible with round_limit 0).
std::int64_t se_reduced_channels(std::int64_t channels);

struct BottleneckOptions {
  std::int64_t groups = 1, width_per_group = 64;  // ResNeXt's cardinality and base width
  bool se = false;                                // a squeeze-and-excitation module after bn3
  nn::Norm norm = nn::Norm::Batch;
};

class Bottleneck : public nn::Module {
 public:
  static constexpr std::int64_t expansion = 4;
  Bottleneck(std::int64_t in_planes, std::int64_t planes, std::int64_t stride, const BottleneckOptions& o);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<nn::Conv2d> conv1, conv2, conv3;
  std::shared_ptr<nn::Module> bn1, bn2, bn3;
  std::shared_ptr<SEModule> se;                // null unless options.se
  std::shared_ptr<nn::Sequential> downsample;  // null: identity shortcut
};

struct ResNetOptions {
  std::vector<std::int64_t> layers{3, 4, 6, 3};
  BottleneckOptions block;
  Reference reference = Reference::torchvision;
  std::int64_t in_channels = 3, num_classes = 1000;
};

// The bottleneck ResNet of `options`: SE-ResNet-50 and ResNeXt-50 are two settings of it (families.h).
class ResNet : public nn::Module {
 public:
  explicit ResNet(const ResNetOptions& options);
  Tensor forward(const Tensor& x) override;
  // The zoo's ResNets' parts (nn/resnet.cpp): stages layer1..layer4, their blocks, the stem as a
  // segment of its own; segments stem, layer1.0 .. layer4.2, head.
  RecomputeParts recompute_parts() override;
  std::vector<Segment> segments() override;

  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::Module> bn1;
  std::shared_ptr<nn::MaxPool2d> maxpool;
  std::vector<std::shared_ptr<nn::Sequential>> layers;  // layer1 .. layer4
  std::shared_ptr<nn::AdaptiveAvgPool2d> pool;          // "avgpool" (torchvision) or "global_pool" (timm)
  std::shared_ptr<nn::Linear> fc;
  nn::SegmentMode stem_mode = nn::SegmentMode::keep;

 private:
  Tensor stem(const Tensor& x);
  Tensor head(const Tensor& x);
};

}  // namespace tally::models
