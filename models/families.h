// models/families.h — the model families of models/, by name: SE-ResNet-50 (timm's `seresnet50`),
// ResNeXt-50 32x4d (torchvision's `resnext50_32x4d`), the pre-activation ResNet-18 (timm's
// `resnetv2_18`) and the Wide ResNets WRN-28-10 and WRN-10-1 (the paper's, with dropout), each
// written with tally's public API only (resnet_v1.h, resnet_v2.h, wide_resnet.h), with its
// reference's state-dict names. register_families() gives them to nn::make_model, so `tally
// train|plan|sweep --model seresnet50|resnext50_32x4d|resnetv2_18|wrn28_10|wrn10_1` build them;
// `tally` calls it at start (apps/main.cpp).
#pragma once
#include <cstdint>
#include <memory>

#include "nn/module.h"
#include "nn/resnet.h"

namespace tally::models {

// Each takes the run's input channels, classes and norm (batch, group or none; the names stay).
std::shared_ptr<nn::Module> make_seresnet50(const nn::ModelConfig& config);
std::shared_ptr<nn::Module> make_resnext50_32x4d(const nn::ModelConfig& config);
std::shared_ptr<nn::Module> make_resnetv2_18(const nn::ModelConfig& config);
// WRN-d-k with dropout p (wide_resnet.h): wrn28_10 is (28, 10, 0.3), wrn10_1 (10, 1, 0.3).
std::shared_ptr<nn::Module> make_wide_resnet(const nn::ModelConfig& config, std::int64_t depth, std::int64_t width,
                                             double dropout);

// Registers "seresnet50", "resnext50_32x4d", "resnetv2_18", "wrn28_10" and "wrn10_1" with
// nn::register_model. Once per
// process: a second call does nothing.
void register_families();

}  // namespace tally::models
