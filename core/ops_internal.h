// core/ops_internal.h — what the op families of core/ops_*.cpp share (not installed): output and
// workspace allocation, the in-place rule, saved tensors, operand checks, the FLOP counters.
// core/ops.cpp says the pattern every op follows.
#pragma once
#include <cmath>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/dispatch.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/ops.h"

namespace tally::ops_detail {

using i64 = std::int64_t;

inline Tensor out_like(const Tensor& like, const Shape& shape, const char* op,
                MemoryFormat format = MemoryFormat::Contiguous) {
  return Tensor::empty(shape, like.dtype(), like.device(), Category::activation, op, format);
}

// The tensor itself when it is dense in its memory format (row-major or channels-last), else a
// row-major copy: what an elementwise kernel, which runs over the bytes, takes.
inline Tensor dense(const Tensor& t) { return t.contiguous(t.suggest_memory_format()); }

inline Tensor workspace(const Tensor& like, std::size_t bytes, const char* op) {
  if (bytes == 0) return {};
  return Tensor::empty({static_cast<i64>((bytes + 7) / 8)}, DType::Int64, like.device(), Category::workspace,
                       fmt::format("{}_workspace", op));
}
inline void* ws_ptr(const Tensor& ws) { return ws.defined() ? ws.raw_data() : nullptr; }
inline std::size_t ws_size(const Tensor& ws) { return ws.defined() ? static_cast<std::size_t>(ws.numel()) * 8 : 0; }

// The budget of the arena `like`'s device allocates from now: workspace sizes are fractions of it
// (fixed when the arena was created and kept by its virtual clones, so dry runs choose as real
// steps do).
inline std::size_t arena_budget(const Tensor& like) { return current_arena(like.device())->budget(); }

// Scratch of one GEMM of (M, K) by (K, N) on `like`'s device and dtype: cuBLAS's workspace on
// CUDA; on the CPU none for float32 and float64, the float32 copies of the operands for bfloat16.
// (linear's and matmul's three GEMMs are the same three sizes permuted: one size for all.)
inline std::size_t gemm_workspace_bytes(const Tensor& like, i64 M, i64 N, i64 K) {
  std::size_t bytes = 0;
  TALLY_DISPATCH_QUERY("gemm", like, FLOATING, bytes = kk::gemm_workspace_bytes<T>(arena_budget(like), M, N, K));
  return bytes;
}

// Scratch of a batch norm on `like`'s device (the CUDA kernels' partial sums; none on the CPU).
// `like` channels-last: the CPU's partial sums of its chunks.
inline std::size_t batch_norm_workspace_bytes(const Tensor& like, i64 N, i64 C, i64 HW) {
  std::size_t bytes = 0;
  const bool cl = like.suggest_memory_format() == MemoryFormat::ChannelsLast;
  TALLY_DISPATCH_QUERY("batch_norm", like, ANY, bytes = kk::batch_norm_workspace_bytes(N, C, HW, cl));
  return bytes;
}

// In-place outputs (relu(Tensor&&), add(Tensor&&, b)): a tensor whose handle the caller gives up
// may take the output in its own buffer when nothing else can see that buffer — this handle is
// the only one on its TensorImpl and on its Storage (a saved tensor, a view or a copy of the
// handle would hold a second reference), it is dense, and it is not a leaf that requires grad.
// Nobody can observe the old values afterwards, so results are those of the out-of-place op,
// and one buffer is not allocated. The decision depends on reference counts only, which a dry
// run reproduces exactly, so plans stay exact.
inline bool reusable(const Tensor& t) {
  return t.defined() && t.impl_ptr().use_count() == 1 && t.storage().use_count() == 1 &&
         t.is_contiguous(t.suggest_memory_format()) &&
         !(t.is_leaf() && t.requires_grad()) && t.category() == Category::activation;
}
// A new handle on `x`'s buffer for an op's output (no history yet).
inline Tensor alias_for_output(const Tensor& x) { return x.detach(); }

// Saved tensors of a Node: released after its backward.
template <std::size_t N>
struct Saved {
  std::array<Tensor, N> t;
  void release() {
    for (auto& x : t) x = Tensor();
  }
};

inline void check_matching(const char* op, const Tensor& x, const Tensor& p, const char* what, i64 expected) {
  if (!p.defined()) return;
  check_param(op, what, x, p);
  if (p.dim() != 1 || p.size(0) != expected)
    throw ShapeError(fmt::format("{}: expected {} of shape [{}], found {}", op, what, expected, p.str()));
}

template <class T>
inline T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

inline i64 spatial(const Tensor& x) {
  i64 hw = 1;
  for (i64 d = 2; d < x.dim(); ++d) hw *= x.size(d);
  return hw;
}

// Counts a forward op's multiply-adds (see flop_count()).
inline void count_forward(double multiply_adds) {
  FlopCount& c = flop_count();
  (recomputing() ? c.recompute : c.forward) += 2 * multiply_adds;
}
inline void count_backward(double multiply_adds) { flop_count().backward += 2 * multiply_adds; }
inline double conv_multiply_adds(const kernels::Conv2dShape& s) {
  return static_cast<double>(s.N) * s.K * s.P() * s.Q() * (s.C / s.groups) * s.R * s.S;
}
}  // namespace tally::ops_detail
