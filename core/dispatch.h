// core/dispatch.h — choosing the kernel for an op from its operands' device and dtype.
//
// Ops call TALLY_DISPATCH(op_name, tensor, body). The body is written once for both backends:
// it runs with `T` bound to the element type and `kk` a block-scope alias of the kernel
// namespace —
//   cpu:  T = float or double, kk = tally::kernels::cpu
//   cuda: T = float,           kk = tally::kernels::cuda (after making the tensor's device current)
// — so `kk::relu_forward<T>(n, x, y)` reaches the CPU reference or its CUDA twin, which have the
// same names and signatures (kernels/cpu/cpu_kernels.h, kernels/cuda/cuda_kernels.h). A device or
// dtype without an implementation throws a ShapeError naming the op: float64 on CUDA, or any
// CUDA tensor in a build without the CUDA backend. In a dry run the caller skips dispatch of
// kernels altogether (TALLY_RUN in core/ops.cpp, core/memory.h); size queries (workspace bytes)
// still dispatch, so that dry and real runs allocate alike.
#pragma once
#include <fmt/format.h>

#include "core/autograd.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tally/config.h"
#if TALLY_HAVE_CUDA
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
#endif

namespace tally::detail {
[[noreturn]] inline void no_kernel(const char* op, const Tensor& t) {
  throw ShapeError(fmt::format("{}: no kernel for {} (float32 and float64 on cpu, float32 on cuda{})", op, t.str(),
                               TALLY_HAVE_CUDA ? "" : "; this build has no CUDA backend"));
}
}  // namespace tally::detail

#define TALLY_DISPATCH_CPU(op, t, ...)                         \
  do {                                                         \
    const ::tally::kernels::cpu::OpTimer tally_cpu_timer_(op, ::tally::in_backward()); \
    switch ((t).dtype()) {                                     \
      case ::tally::DType::Float32: {                          \
        using T = float;                                       \
        namespace kk = ::tally::kernels::cpu;                  \
        __VA_ARGS__;                                           \
        break;                                                 \
      }                                                        \
      case ::tally::DType::Float64: {                          \
        using T = double;                                      \
        namespace kk = ::tally::kernels::cpu;                  \
        __VA_ARGS__;                                           \
        break;                                                 \
      }                                                        \
      default: ::tally::detail::no_kernel(op, t);              \
    }                                                          \
  } while (0)

#if TALLY_HAVE_CUDA
#define TALLY_DISPATCH_CUDA(op, t, ...)                                             \
  do {                                                                              \
    if ((t).dtype() != ::tally::DType::Float32) ::tally::detail::no_kernel(op, t);  \
    ::tally::kernels::cuda::use_device((t).device().index);                         \
    const ::tally::kernels::cuda::OpTimer tally_op_timer_(op, ::tally::in_backward()); \
    using T = float;                                                                \
    namespace kk = ::tally::kernels::cuda;                                          \
    __VA_ARGS__;                                                                    \
  } while (0)
#else
#define TALLY_DISPATCH_CUDA(op, t, ...) ::tally::detail::no_kernel(op, t)
#endif

// The body on whichever backend `t` lives.
#define TALLY_DISPATCH(op, t, ...)                                  \
  do {                                                              \
    if ((t).device().is_cpu()) TALLY_DISPATCH_CPU(op, t, __VA_ARGS__); \
    else TALLY_DISPATCH_CUDA(op, t, __VA_ARGS__);                   \
  } while (0)
