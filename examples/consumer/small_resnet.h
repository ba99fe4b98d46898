// examples/consumer/small_resnet.h — docs/models.md's model: a residual block of one's own and a
// small ResNet of it, written with tally's public API alone (no override of recompute_parts or
// segments). Used by my_resnet.cpp (planned and trained through the executor) and my_cli.cpp (the
// whole `tally` command line for it).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/ops.h"
#include "nn/modules.h"

namespace my {

using namespace tally;

// A basic residual block, named as torchvision names its own (conv1, bn1, conv2, bn2,
// downsample.0, downsample.1), so its state dict reads like theirs.
class ResBlock : public nn::Module {
 public:
  ResBlock(std::int64_t in, std::int64_t out, std::int64_t stride) {
    conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(in, out, 3, stride, 1, 1, 1, /*bias=*/false));
    bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(out));
    conv2 = register_module("conv2", std::make_shared<nn::Conv2d>(out, out, 3, 1, 1, 1, 1, false));
    bn2 = register_module("bn2", std::make_shared<nn::BatchNorm2d>(out));
    if (stride != 1 || in != out)  // a projection where the shape changes
      downsample = register_module("downsample", std::make_shared<nn::Sequential>(
                                           std::initializer_list<std::shared_ptr<nn::Module>>{
                                               std::make_shared<nn::Conv2d>(in, out, 1, stride, 0, 1, 1, false),
                                               std::make_shared<nn::BatchNorm2d>(out)}));
  }
  Tensor forward(const Tensor& x) override {
    const Tensor y = (*bn2)((*conv2)(relu((*bn1)((*conv1)(x)))));
    return relu(add(y, downsample ? (*downsample)(x) : x));
  }

 private:
  std::shared_ptr<nn::Conv2d> conv1, conv2;
  std::shared_ptr<nn::BatchNorm2d> bn1, bn2;
  std::shared_ptr<nn::Sequential> downsample;
};

// Three stages of `blocks` blocks (16, 32 and 64 channels) on images of `in_channels` channels. Each stage is a
// Sequential of blocks, called as a module: that is all the planner needs to offer recomputation
// and per-segment offload for it (Module::recompute_parts' default, docs/models.md).
class SmallResNet : public nn::Module {
 public:
  SmallResNet(int blocks, std::int64_t classes, std::int64_t in_channels = 3) {
    conv1 = register_module("conv1", std::make_shared<nn::Conv2d>(in_channels, 16, 3, 1, 1, 1, 1, false));
    bn1 = register_module("bn1", std::make_shared<nn::BatchNorm2d>(16));
    std::int64_t in = 16;
    for (int s = 0; s < 3; ++s) {
      auto stage = std::make_shared<nn::Sequential>();
      const std::int64_t out = std::int64_t{16} << s;
      for (int b = 0; b < blocks; ++b)
        stage->push_back(std::make_shared<ResBlock>(b == 0 ? in : out, out, b == 0 && s > 0 ? 2 : 1));
      layers.push_back(register_module(fmt::format("layer{}", s + 1), stage));
      in = out;
    }
    fc = register_module("fc", std::make_shared<nn::Linear>(in, classes));
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = relu((*bn1)((*conv1)(x)));
    for (const auto& stage : layers) y = (*stage)(y);
    return (*fc)(flatten(adaptive_avg_pool2d(y, {1, 1}), 1));
  }

 private:
  std::shared_ptr<nn::Conv2d> conv1;
  std::shared_ptr<nn::BatchNorm2d> bn1;
  std::vector<std::shared_ptr<nn::Sequential>> layers;
  std::shared_ptr<nn::Linear> fc;
};

}  // namespace my
