// kernels/common.h — conventions shared by every kernel in kernels/cpu and kernels/cuda.
//
// Kernels know raw pointers, sizes and (on CUDA) a stream: no Tensor, no arena, no autograd.
// Conventions, so that the CPU and CUDA files of one op family read side by side:
//   * Layout is NCHW, densely packed (contiguous, row-major). Shapes are written next to
//     every pointer: `x  // (N, C, H, W)`.
//   * Element type T is float or double on CPU (double exists for gradient checks), float on CUDA.
//   * An output that a backward kernel may *accumulate* into takes `T beta` (0 or 1):
//       beta == 0  -> out = value           (out is never read: it may hold garbage or NaN)
//       beta == 1  -> out = out + value     (gradient accumulation, "beta = 1 in GEMM")
//   * A kernel that needs scratch memory never allocates: it has a `*_workspace_bytes` companion
//     and receives a `void* workspace` of at least that size, carved from the arena by core/.
//   * Integer labels are int64 (PyTorch's torch.long); pooling argmax indices are int32.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tally::kernels {
using i64 = std::int64_t;

// The three passes of a convolution; each has its own workspace (conv2d_workspace_bytes).
enum class ConvPass { forward, backward_data, backward_filter };
}  // namespace tally::kernels
