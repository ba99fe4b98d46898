// models/common.h — what the families of models/ share, on tally's public API alone: torchvision's
// convolution init and the mixed-precision rule for a network's first and last layers.
//
// Mixed precision (docs/precision.md, "The first and last layers"): with bfloat16 activations and
// float32 master weights, the zoo's ResNets run their stem on the input widened to float32 and
// their classifier on the pooled features widened, giving float32 logits to the loss. A model
// chooses its own precision by converting its input (Tensor::to carries the gradient back), so
// the families here do the same with these two helpers. With float32 or float64 activations they
// are plain calls.
#pragma once
#include "core/ops.h"
#include "nn/init.h"
#include "nn/module.h"
#include "nn/modules.h"
#include "nn/resnet.h"

namespace tally::models {

// torchvision's (and timm's) convolution init: every Conv2d under `m` kaiming_normal_(fan_out, relu).
inline void init_convs(nn::Module& m) {
  if (auto* conv = dynamic_cast<nn::Conv2d*>(&m))
    nn::kaiming_normal_(conv->weight, 0.0, nn::FanMode::FanOut, nn::Nonlinearity::ReLU);
  for (auto& [name, child] : m.named_children()) init_convs(*child);
}

// The ImageNet stem's convolution, norm and ReLU (nn::norm_relu's fused op), in the master weights'
// precision: with activations of another dtype, x is widened first and the norm's output rounded
// back before the ReLU (the zoo's order, nn/resnet.cpp: the float32 output is not kept for a fused
// ReLU's backward; rounding keeps a value's sign, so the values and gradients are the same).
inline Tensor stem_conv_norm_relu(nn::Conv2d& conv, nn::Module& norm, const Tensor& x) {
  const DType master = conv.weight.dtype();
  if (x.dtype() == master) return nn::norm_relu(norm, conv(x));
  return relu(norm(conv(x.to(master))).to(x.dtype()));
}

// A stem convolution alone in the master weights' precision, its output rounded back to x's dtype.
inline Tensor stem_conv(nn::Conv2d& conv, const Tensor& x) {
  const DType master = conv.weight.dtype();
  return x.dtype() == master ? conv(x) : conv(x.to(master)).to(x.dtype());
}

// The classifier on features widened to its weights' dtype: float32 logits for the loss.
inline Tensor classify(nn::Module& fc, const Tensor& weight, const Tensor& features) {
  return fc(features.to(weight.dtype()));
}

}  // namespace tally::models
