// core/dispatch.h — choosing the kernel for an op from its operands' device and dtype.
//
// Ops call TALLY_DISPATCH(op_name, tensor, cpu_body, cuda_body). On the CPU the body runs with
// `T` bound to float or double; on CUDA with `T` = float (the CUDA backend is float32). A device
// or dtype without an implementation throws a ShapeError naming the op. In a dry run the caller
// skips dispatch altogether (see core/memory.h).
#pragma once
#include <fmt/format.h>

#include "core/error.h"
#include "core/tensor.h"
#include "tally/config.h"

namespace tally::detail {
[[noreturn]] inline void no_kernel(const char* op, const Tensor& t) {
  throw ShapeError(fmt::format("{}: no kernel for {} (float32 and float64 on cpu, float32 on cuda)", op, t.str()));
}
}  // namespace tally::detail

#define TALLY_DISPATCH_CPU(op, t, ...)                         \
  do {                                                         \
    switch ((t).dtype()) {                                     \
      case ::tally::DType::Float32: {                          \
        using T = float;                                       \
        __VA_ARGS__;                                           \
        break;                                                 \
      }                                                        \
      case ::tally::DType::Float64: {                          \
        using T = double;                                      \
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
    using T = float;                                                                \
    __VA_ARGS__;                                                                    \
  } while (0)
#else
#define TALLY_DISPATCH_CUDA(op, t, ...) ::tally::detail::no_kernel(op, t)
#endif
