// kernels/cpu/onednn.h — float32 and bf16 convolutions on oneDNN (kernels/cpu/conv_onednn.cpp),
// used by kernels/cpu/conv.cpp when the build has oneDNN and the CPU convolution algorithm is
// `onednn`. Same shapes, layouts (NCHW, (G)OIHW) and workspace convention as the im2col kernels;
// no bias (conv.cpp adds it). `elem` is the activations' type; weights and weight gradients are
// float32 either way.
#pragma once
#include <cstddef>

#include "kernels/common.h"

namespace tally::kernels::cpu::onednn {

// Whether oneDNN takes this shape and pass (a plan is made and cached on the first question).
enum class Elem { f32, bf16 };
bool supports(const Conv2dShape& s, ConvPass pass, Elem elem);
std::size_t conv_workspace_bytes(const Conv2dShape& s, ConvPass pass, Elem elem);
void conv_forward(const Conv2dShape& s, Elem elem, const void* x, const float* w, void* y, void* workspace);
void conv_backward_data(const Conv2dShape& s, Elem elem, const void* dy, const float* w, void* dx, bool accumulate,
                        void* workspace);
void conv_backward_filter(const Conv2dShape& s, Elem elem, const void* x, const void* dy, float* dw, bool accumulate,
                          void* workspace);

}  // namespace tally::kernels::cpu::onednn
