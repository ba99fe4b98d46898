// core/dispatch.h — the one way core/ reaches a backend's kernels: every op (core/ops.cpp), every
// tensor method that moves data (core/tensor.cpp), the optimizers and the modules that update
// state go through it. The rest of core's backend code is device-level: GPU memory for the arena,
// device queries and the TF32 switch (core/device.cpp), the step's input uploads
// (core/staging.cpp) and the profiler (core/profiler.cpp). None of them has an `#if`: the CUDA
// declarations (kernels/cuda/cuda_kernels.h, kernels/cuda/context.h) are plain C++ in every build,
// and the CUDA branches are `if constexpr (kHaveCudaBackend)`, whose calls a build without the
// backend never compiles into code (a discarded statement needs no definition).
//
//   TALLY_DISPATCH(op, t, SET, body)        runs kernels
//   TALLY_DISPATCH_QUERY(op, t, SET, body)  asks a size (a workspace, a plan) and runs nothing
//
// The body is written once for both backends. It runs with `kk` a block-scope alias of the kernel
// namespace of `t`'s device (tally::kernels::cpu, or tally::kernels::cuda after making the device
// current), `T` the C++ type of `t`'s dtype and `TP` the type of the parameters, statistics and
// scalars beside T's activations (kernels::compute_t<T>: T itself, float for bfloat16), so that
// `kk::relu_forward<T>(n, x, y)` reaches the CPU reference or its CUDA twin, which have the same
// names and signatures. SET says which dtypes the body is compiled for, per backend:
//
//   SET             cpu                            cuda
//   FLOATING        float32, float64, bfloat16     float32, bfloat16  (the compute ops)
//   FULL_PRECISION  float32, float64               float32            (optimizers, norm moments,
//                                                                      the loss: never bfloat16)
//   INTEGER         int32, int64                   int32, int64
//   ALL             float32, float64, bfloat16,    the same           (fill, copies)
//                   int32, int64
//   FLOAT_STORAGE   float32, float64, bfloat16     the same           (conversions)
//   ANY             -- the body binds no T (byte copies, dtype-free sizes) --
//
// bfloat16 computes on both backends (mixed precision, docs/precision.md): float32 math, its
// parameters float32 (TP). A dtype outside the set, a CUDA tensor in a build without the CUDA
// backend, throws a ShapeError naming the op, the tensor and what the set takes.
//
// Dry runs (core/dry_run.h): TALLY_DISPATCH checks device and dtype exactly as a real run does and
// then skips the body, so op bodies carry no dry-run checks of their own; TALLY_DISPATCH_QUERY
// runs its body in a dry run too, so that dry and real runs size their workspaces alike. Under
// the profiler (`tally train --profile`) each TALLY_DISPATCH is timed under `op`, forward and
// backward apart.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "core/autograd.h"
#include "core/device.h"
#include "core/dry_run.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally::detail {
// Throws the ShapeError of a tensor whose dtype no kernel of the op takes on its backend.
[[noreturn]] void no_kernel(const char* op, const Tensor& t, std::initializer_list<DType> takes);
// Throws the error of a CUDA tensor in a build without the CUDA backend.
[[noreturn]] void no_backend(const char* op, const Tensor& t);
}  // namespace tally::detail

// ---- dtype sets: X(DType enumerator, C++ type, ...) per dtype a backend has kernels for ----------
#define TALLY_TYPES_cpu_FULL_PRECISION(X, ...) X(Float32, float, __VA_ARGS__) X(Float64, double, __VA_ARGS__)
#define TALLY_TYPES_cuda_FULL_PRECISION(X, ...) X(Float32, float, __VA_ARGS__)
#define TALLY_TYPES_cpu_FLOATING(X, ...) \
  TALLY_TYPES_cpu_FULL_PRECISION(X, __VA_ARGS__) X(BFloat16, ::tally::kernels::bf16, __VA_ARGS__)
#define TALLY_TYPES_cuda_FLOATING(X, ...) \
  TALLY_TYPES_cuda_FULL_PRECISION(X, __VA_ARGS__) X(BFloat16, ::tally::kernels::bf16, __VA_ARGS__)
#define TALLY_TYPES_cpu_INTEGER(X, ...) X(Int32, std::int32_t, __VA_ARGS__) X(Int64, std::int64_t, __VA_ARGS__)
#define TALLY_TYPES_cuda_INTEGER(X, ...) TALLY_TYPES_cpu_INTEGER(X, __VA_ARGS__)
#define TALLY_TYPES_cpu_FLOAT_STORAGE(X, ...) \
  X(Float32, float, __VA_ARGS__) X(Float64, double, __VA_ARGS__) X(BFloat16, ::tally::kernels::bf16, __VA_ARGS__)
#define TALLY_TYPES_cuda_FLOAT_STORAGE(X, ...) TALLY_TYPES_cpu_FLOAT_STORAGE(X, __VA_ARGS__)
#define TALLY_TYPES_cpu_ALL(X, ...) TALLY_TYPES_cpu_FLOAT_STORAGE(X, __VA_ARGS__) TALLY_TYPES_cpu_INTEGER(X, __VA_ARGS__)
#define TALLY_TYPES_cuda_ALL(X, ...) TALLY_TYPES_cpu_ALL(X, __VA_ARGS__)

// ---- implementation ----------------------------------------------------------------------------
// One case of the dtype switch: the body with T bound, when tally_run_ (not a kernel in a dry run).
#define TALLY_DISPATCH_CASE_(dtype, type, timed, op, ...)                 \
  case ::tally::DType::dtype:                                             \
    if (tally_run_) {                                                     \
      const ::tally::detail::Timer<kk::OpTimer, timed> tally_timer_(op); \
      using T = type;                                                     \
      using TP [[maybe_unused]] = ::tally::kernels::compute_t<T>;         \
      __VA_ARGS__;                                                        \
    }                                                                     \
    break;
#define TALLY_DISPATCH_DTYPE_(dtype, type, ...) ::tally::DType::dtype,

#define TALLY_DISPATCH_SWITCH_FLOATING(backend, timed, op, t, ...) TALLY_DISPATCH_SWITCH_(backend, FLOATING, timed, op, t, __VA_ARGS__)
#define TALLY_DISPATCH_SWITCH_FULL_PRECISION(backend, timed, op, t, ...) \
  TALLY_DISPATCH_SWITCH_(backend, FULL_PRECISION, timed, op, t, __VA_ARGS__)
#define TALLY_DISPATCH_SWITCH_INTEGER(backend, timed, op, t, ...) TALLY_DISPATCH_SWITCH_(backend, INTEGER, timed, op, t, __VA_ARGS__)
#define TALLY_DISPATCH_SWITCH_ALL(backend, timed, op, t, ...) TALLY_DISPATCH_SWITCH_(backend, ALL, timed, op, t, __VA_ARGS__)
#define TALLY_DISPATCH_SWITCH_FLOAT_STORAGE(backend, timed, op, t, ...) \
  TALLY_DISPATCH_SWITCH_(backend, FLOAT_STORAGE, timed, op, t, __VA_ARGS__)
#define TALLY_DISPATCH_SWITCH_ANY(backend, timed, op, t, ...)          \
  if (tally_run_) {                                                   \
    const ::tally::detail::Timer<kk::OpTimer, timed> tally_timer_(op); \
    __VA_ARGS__;                                                      \
  }
#define TALLY_DISPATCH_SWITCH_(backend, set, timed, op, t, ...)                                          \
  switch ((t).dtype()) {                                                                               \
    TALLY_TYPES_##backend##_##set(TALLY_DISPATCH_CASE_, timed, op, __VA_ARGS__) default                  \
        : ::tally::detail::no_kernel(op, t, {TALLY_TYPES_##backend##_##set(TALLY_DISPATCH_DTYPE_, )}); \
  }

#define TALLY_DISPATCH_IMPL_(kernel, op, t, set, ...)                                    \
  do {                                                                                   \
    const ::tally::Tensor& tally_t_ = (t);                                               \
    [[maybe_unused]] const bool tally_run_ = !(kernel) || !::tally::is_dry_run();        \
    if (tally_t_.device().is_cpu()) {                                                    \
      namespace kk = ::tally::kernels::cpu;                                              \
      TALLY_DISPATCH_SWITCH_##set(cpu, kernel, op, tally_t_, __VA_ARGS__)                 \
    } else if constexpr (::tally::kHaveCudaBackend) {                                    \
      if (tally_run_) ::tally::kernels::cuda::use_device(tally_t_.device().index);       \
      namespace kk = ::tally::kernels::cuda;                                             \
      TALLY_DISPATCH_SWITCH_##set(cuda, kernel, op, tally_t_, __VA_ARGS__)                \
    } else {                                                                             \
      ::tally::detail::no_backend(op, tally_t_);                                         \
    }                                                                                    \
  } while (0)

#define TALLY_DISPATCH(op, t, set, ...) TALLY_DISPATCH_IMPL_(true, op, t, set, __VA_ARGS__)
#define TALLY_DISPATCH_QUERY(op, t, set, ...) TALLY_DISPATCH_IMPL_(false, op, t, set, __VA_ARGS__)

namespace tally::detail {
// The profiler's timer of a kernel dispatch (the backend contract's OpTimer, kernels/backend.inc);
// nothing for a query.
template <class OpTimer, bool timed>
struct Timer {
  explicit Timer(const char*) {}
};
template <class OpTimer>
struct Timer<OpTimer, true> {
  explicit Timer(const char* op) : timer(op, in_backward()) {}
  OpTimer timer;
};
}  // namespace tally::detail
