// nn/resnet.h — the ResNet family, with torchvision's module names so that state dicts
// interchange with PyTorch (load a torchvision checkpoint converted to safetensors, or save one
// PyTorch can load).
//
// torchvision ResNet-18/34/50 (torchvision.models.resnet):
//   conv1 (7x7/2, pad 3, no bias) bn1 relu maxpool (3/2, pad 1)
//   layer1..layer4: blocks of widths 64, 128, 256, 512; the first block of layer2..4 has stride 2
//   avgpool (adaptive 1x1) fc (Linear(512 * expansion, classes))
//   BasicBlock (expansion 1): conv1 3x3/stride bn1 relu conv2 3x3 bn2 (+ shortcut) relu
//   Bottleneck v1.5 (expansion 4): conv1 1x1 bn1 conv2 3x3/stride bn2 conv3 1x1 bn3 (+ shortcut)
//   shortcut: identity, or downsample = Sequential(conv 1x1/stride no bias "0", norm "1") when
//   the stride is not 1 or the channel count changes.
//   Init as torchvision: convs kaiming_normal_(fan_out, relu), norms weight 1 bias 0, fc the
//   default Linear init.
//
// CIFAR ResNet-20/32/44/56/110 (He et al. 2016, §4.2; n = (depth - 2) / 6):
//   conv1 (3x3, 16, no bias) bn1 relu, layer1..layer3 of n BasicBlocks of widths 16, 32, 64 (the
//   first block of layer2 and layer3 has stride 2; shortcut: identity, or the projection
//   downsample above when the shape changes — "option B"), avgpool (global) fc Linear(64, classes).
//   Same init as the torchvision models.
//
// ResNet-9 (the DAWNBench CIFAR-10 network of Myrtle.ai / David Page). Module names:
//   prep    = Sequential(conv 3x3 -> 64 "prep.0", norm "prep.1", relu "prep.2")
//   layer1  = Sequential(conv -> 128 "layer1.0", norm "layer1.1", relu "layer1.2", maxpool 2 "layer1.3")
//   res1    = Sequential(Sequential(conv, norm, relu) "res1.0", Sequential(conv, norm, relu) "res1.1")
//             with 128 channels, added to its input: x = x + res1(x)
//   layer2  = as layer1 with 256 channels, layer3 = as layer1 with 512 channels
//   res3    = as res1 with 512 channels
//   then a global max pool (kernel = the remaining spatial size), flatten,
//   fc = Linear(512, classes, bias = false), and the logits scaled by 0.125.
//   Every conv is 3x3, stride 1, pad 1, no bias. So e.g. "res3.1.0.weight" is the second conv of
//   the second residual block, "layer2.1.running_var" the norm after the layer2 conv.
//
// Norm: Batch -> BatchNorm2d(C); Group -> GroupNorm(min(32, C / 4), C); None -> Identity. The
// module names (bn1, bn2, downsample.1, prep.1, ...) stay the same whatever the norm.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/modules.h"
#include "nn/recompute.h"  // the recomputation ladder these models take part in

namespace tally::nn {

enum class Norm { Batch, Group, None };
Norm parse_norm(const std::string& s);  // "batch" | "group" | "none"; tally::Error otherwise
const char* norm_name(Norm n);
std::shared_ptr<Module> make_norm(Norm norm, std::int64_t channels);
// relu(norm(x) + residual) (residual may be undefined): one fused op when `norm` is a BatchNorm2d
// or a GroupNorm (their forward_relu), the unfused ops for the others (Identity).
// x by value: moved in, a gradient-free run may write the result over it.
Tensor norm_relu(Module& norm, Tensor x, const Tensor& residual = {});

class BasicBlock : public Module {
 public:
  static constexpr std::int64_t expansion = 1;
  BasicBlock(std::int64_t in_planes, std::int64_t planes, std::int64_t stride, Norm norm);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Conv2d> conv1, conv2;
  std::shared_ptr<Module> bn1, bn2;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> downsample;  // null: identity shortcut
};

class Bottleneck : public Module {
 public:
  static constexpr std::int64_t expansion = 4;
  Bottleneck(std::int64_t in_planes, std::int64_t planes, std::int64_t stride, Norm norm);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Conv2d> conv1, conv2, conv3;
  std::shared_ptr<Module> bn1, bn2, bn3;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> downsample;  // null: identity shortcut
};

enum class BlockKind { Basic, Bottleneck };

// torchvision's ResNet (ImageNet stem).
class ResNet : public Module {
 public:
  ResNet(BlockKind block, const std::vector<std::int64_t>& layers, std::int64_t in_channels, std::int64_t num_classes,
         Norm norm);
  Tensor forward(const Tensor& x) override;
  RecomputeParts recompute_parts() override;
  std::vector<Segment> segments() override;  // stem, layer1.0 .. layer4.N, head

  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<Module> bn1;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<MaxPool2d> maxpool;
  std::shared_ptr<Sequential> layer1, layer2, layer3, layer4;
  std::shared_ptr<AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<Linear> fc;
  // The stem (conv1, bn1, ReLU, max pool) as one segment (nn/recompute.h): kept, recomputed or offloaded.
  SegmentMode stem_mode = SegmentMode::keep;

 private:
  Tensor stem(const Tensor& x);
};

// He et al.'s CIFAR ResNet of depth 6n + 2.
class CifarResNet : public Module {
 public:
  CifarResNet(std::int64_t depth, std::int64_t in_channels, std::int64_t num_classes, Norm norm);
  Tensor forward(const Tensor& x) override;
  RecomputeParts recompute_parts() override;
  std::vector<Segment> segments() override;  // stem, layer1.0 .. layer3.N, head

  std::shared_ptr<Conv2d> conv1;
  std::shared_ptr<Module> bn1;
  std::shared_ptr<ReLU> relu;
  std::shared_ptr<Sequential> layer1, layer2, layer3;
  std::shared_ptr<AdaptiveAvgPool2d> avgpool;
  std::shared_ptr<Linear> fc;
};

// DAWNBench ResNet-9 (names in the header comment).
class ResNet9 : public Module {
 public:
  ResNet9(std::int64_t in_channels, std::int64_t num_classes, Norm norm);
  Tensor forward(const Tensor& x) override;
  RecomputeParts recompute_parts() override;
  std::vector<Segment> segments() override;  // prep, layer1, res1 (with its add), layer2, layer3, res3 (with its add), head

  std::shared_ptr<Sequential> prep, layer1, res1, layer2, layer3, res3;
  std::shared_ptr<Linear> fc;

 private:
  Tensor stem(const Tensor& x);  // prep, in the master weights' precision
};

struct ModelConfig {
  std::string name;
  std::int64_t in_channels = 3, num_classes = 10;
  Norm norm = Norm::Batch;
};
// resnet20 | resnet32 | resnet44 | resnet56 | resnet110 | resnet18 | resnet34 | resnet50 |
// resnet9, then the names registered (register_model); tally::Error listing them otherwise.
std::shared_ptr<Module> make_model(const ModelConfig& config);
const std::vector<std::string>& model_names();
// A model of one's own by name: from now on make_model and model_names know it, and so does every
// part of tally that makes a model by name — `tally`'s command line (apps/command_line.h:
// `--model NAME` for train, plan and sweep, a run's checkpoints and --resume). The factory gets
// the run's ModelConfig (its input channels, classes and --norm, which it may ignore). Register
// before anything asks for the name; an Error for an empty name or one already taken.
using ModelFactory = std::function<std::shared_ptr<Module>(const ModelConfig& config)>;
void register_model(const std::string& name, ModelFactory factory);

}  // namespace tally::nn
