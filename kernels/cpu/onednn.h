// kernels/cpu/onednn.h — float32 convolutions on oneDNN (kernels/cpu/conv_onednn.cpp), used by
// kernels/cpu/conv.cpp when the build has oneDNN and the CPU convolution algorithm is `onednn`.
// Same shapes, layouts (NCHW, (G)OIHW) and workspace convention as the im2col kernels; no bias
// (conv.cpp adds it).
#pragma once
#include <cstddef>

#include "kernels/common.h"

namespace tally::kernels::cpu::onednn {

// Whether oneDNN takes this shape and pass (a plan is made and cached on the first question).
bool supports(const Conv2dShape& s, ConvPass pass);
std::size_t conv_workspace_bytes(const Conv2dShape& s, ConvPass pass);
void conv_forward(const Conv2dShape& s, const float* x, const float* w, float* y, void* workspace);
void conv_backward_data(const Conv2dShape& s, const float* dy, const float* w, float* dx, bool accumulate,
                        void* workspace);
void conv_backward_filter(const Conv2dShape& s, const float* x, const float* dy, float* dw, bool accumulate,
                          void* workspace);

}  // namespace tally::kernels::cpu::onednn
