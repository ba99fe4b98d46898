// models/families.cpp — the families by name (families.h): each is a setting of resnet_v1.h's,
// resnet_v2.h's or wide_resnet.h's builder, registered with nn::register_model.
#include "models/families.h"

#include <mutex>

#include "models/resnet_v1.h"
#include "models/resnet_v2.h"
#include "models/wide_resnet.h"

namespace tally::models {

namespace {

// ResNet-50's layers (3, 4, 6, 3) of bottlenecks as `block` says, under `reference`'s names.
std::shared_ptr<nn::Module> bottleneck_resnet50(const nn::ModelConfig& c, BottleneckOptions block,
                                                Reference reference) {
  ResNetOptions o;
  o.layers = {3, 4, 6, 3};
  o.block = block;
  o.block.norm = c.norm;
  o.reference = reference;
  o.in_channels = c.in_channels;
  o.num_classes = c.num_classes;
  return std::make_shared<ResNet>(o);
}

}  // namespace

// timm/models/resnet.py, seresnet50: Bottleneck, layers (3, 4, 6, 3), block_args = dict(attn_layer = 'se').
std::shared_ptr<nn::Module> make_seresnet50(const nn::ModelConfig& c) {
  return bottleneck_resnet50(c, {.groups = 1, .width_per_group = 64, .se = true}, Reference::timm);
}

// torchvision.models.resnext50_32x4d: Bottleneck, layers [3, 4, 6, 3], groups 32, width_per_group 4.
std::shared_ptr<nn::Module> make_resnext50_32x4d(const nn::ModelConfig& c) {
  return bottleneck_resnet50(c, {.groups = 32, .width_per_group = 4, .se = false}, Reference::torchvision);
}

// timm/models/resnetv2.py, resnetv2_18: layers [2, 2, 2, 2], channels (64, 128, 256, 512), basic.
std::shared_ptr<nn::Module> make_resnetv2_18(const nn::ModelConfig& c) {
  ResNetV2Options o;
  o.in_channels = c.in_channels;
  o.num_classes = c.num_classes;
  o.norm = c.norm;
  return std::make_shared<ResNetV2>(o);
}

// Zagoruyko & Komodakis 2016, Table 1 (the CIFAR networks WRN-d-k); dropout 0.3 as their section 2.4.
std::shared_ptr<nn::Module> make_wide_resnet(const nn::ModelConfig& c, std::int64_t depth, std::int64_t width,
                                             double dropout) {
  WideResNetOptions o;
  o.depth = depth, o.width = width, o.dropout = dropout;
  o.in_channels = c.in_channels;
  o.num_classes = c.num_classes;
  o.norm = c.norm;
  return std::make_shared<WideResNet>(o);
}

void register_families() {
  static std::once_flag once;
  std::call_once(once, [] {
    nn::register_model("seresnet50", make_seresnet50);
    nn::register_model("resnext50_32x4d", make_resnext50_32x4d);
    nn::register_model("resnetv2_18", make_resnetv2_18);
    nn::register_model("wrn28_10", [](const nn::ModelConfig& c) { return make_wide_resnet(c, 28, 10, 0.3); });
    nn::register_model("wrn10_1", [](const nn::ModelConfig& c) { return make_wide_resnet(c, 10, 1, 0.3); });
  });
}

}  // namespace tally::models
