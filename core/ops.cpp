// core/ops.cpp — forward and backward of every op: checks, allocation, dispatch, autograd nodes.
//
// Pattern of every op: check operands -> allocate outputs (activation) -> dispatch to the kernel
// (core/dispatch.h; a dry run stops there) -> if grad is needed, a Node saves what backward needs (activation)
// and records the edges. Each Node's backward asks grad_target() for the buffer of each needed
// input gradient: beta = 1 means accumulate into an existing buffer (a parameter's persistent
// gradient, or a tensor consumed twice), beta = 0 means a fresh buffer.
#include "core/ops.h"

#include <cmath>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/dispatch.h"
#include "core/dry_run.h"
#include "core/memory.h"

namespace tally {
using i64 = std::int64_t;

namespace {

Tensor out_like(const Tensor& like, const Shape& shape, const char* op,
                MemoryFormat format = MemoryFormat::Contiguous) {
  return Tensor::empty(shape, like.dtype(), like.device(), Category::activation, op, format);
}

// The tensor itself when it is dense in its memory format (row-major or channels-last), else a
// row-major copy: what an elementwise kernel, which runs over the bytes, takes.
Tensor dense(const Tensor& t) { return t.contiguous(t.suggest_memory_format()); }

Tensor workspace(const Tensor& like, std::size_t bytes, const char* op) {
  if (bytes == 0) return {};
  return Tensor::empty({static_cast<i64>((bytes + 7) / 8)}, DType::Int64, like.device(), Category::workspace,
                       fmt::format("{}_workspace", op));
}
void* ws_ptr(const Tensor& ws) { return ws.defined() ? ws.raw_data() : nullptr; }
std::size_t ws_size(const Tensor& ws) { return ws.defined() ? static_cast<std::size_t>(ws.numel()) * 8 : 0; }

// The budget of the arena `like`'s device allocates from now: workspace sizes are fractions of it
// (fixed when the arena was created and kept by its virtual clones, so dry runs choose as real
// steps do).
std::size_t arena_budget(const Tensor& like) { return current_arena(like.device())->budget(); }

// Scratch of one GEMM of (M, K) by (K, N) on `like`'s device and dtype: cuBLAS's workspace on
// CUDA; on the CPU none for float32 and float64, the float32 copies of the operands for bfloat16.
// (linear's and matmul's three GEMMs are the same three sizes permuted: one size for all.)
std::size_t gemm_workspace_bytes(const Tensor& like, i64 M, i64 N, i64 K) {
  std::size_t bytes = 0;
  TALLY_DISPATCH_QUERY("gemm", like, FLOATING, bytes = kk::gemm_workspace_bytes<T>(arena_budget(like), M, N, K));
  return bytes;
}

// Scratch of a batch norm on `like`'s device (the CUDA kernels' partial sums; none on the CPU).
// `like` channels-last: the CPU's partial sums of its chunks.
std::size_t batch_norm_workspace_bytes(const Tensor& like, i64 N, i64 C, i64 HW) {
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
bool reusable(const Tensor& t) {
  return t.defined() && t.impl_ptr().use_count() == 1 && t.storage().use_count() == 1 &&
         t.is_contiguous(t.suggest_memory_format()) &&
         !(t.is_leaf() && t.requires_grad()) && t.category() == Category::activation;
}
// A new handle on `x`'s buffer for an op's output (no history yet).
Tensor alias_for_output(const Tensor& x) { return x.detach(); }

// Saved tensors of a Node: released after its backward.
template <std::size_t N>
struct Saved {
  std::array<Tensor, N> t;
  void release() {
    for (auto& x : t) x = Tensor();
  }
};

void check_matching(const char* op, const Tensor& x, const Tensor& p, const char* what, i64 expected) {
  if (!p.defined()) return;
  check_param(op, what, x, p);
  if (p.dim() != 1 || p.size(0) != expected)
    throw ShapeError(fmt::format("{}: expected {} of shape [{}], found {}", op, what, expected, p.str()));
}

template <class T>
T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

i64 spatial(const Tensor& x) {
  i64 hw = 1;
  for (i64 d = 2; d < x.dim(); ++d) hw *= x.size(d);
  return hw;
}

}  // namespace

FlopCount& flop_count() {
  thread_local FlopCount count;
  return count;
}

namespace {
// Counts a forward op's multiply-adds (see flop_count()).
void count_forward(double multiply_adds) {
  FlopCount& c = flop_count();
  (recomputing() ? c.recompute : c.forward) += 2 * multiply_adds;
}
void count_backward(double multiply_adds) { flop_count().backward += 2 * multiply_adds; }
double conv_multiply_adds(const kernels::Conv2dShape& s) {
  return static_cast<double>(s.N) * s.K * s.P() * s.Q() * (s.C / s.groups) * s.R * s.S;
}
}  // namespace

// =============================================================================================
// conv2d
namespace {
kernels::Conv2dShape conv_shape(const Tensor& x, const Tensor& w, const Conv2dOptions& o) {
  kernels::Conv2dShape s;
  s.N = x.size(0); s.C = x.size(1); s.H = x.size(2); s.W = x.size(3);
  s.K = w.size(0); s.R = w.size(2); s.S = w.size(3);
  s.stride_h = o.stride[0]; s.stride_w = o.stride[1];
  s.pad_h = o.padding[0]; s.pad_w = o.padding[1];
  s.dil_h = o.dilation[0]; s.dil_w = o.dilation[1];
  s.groups = o.groups;
  TALLY_DISPATCH_QUERY("conv2d", x, ANY, s.workspace_limit = kk::conv_workspace_limit(arena_budget(x)));
  return s;
}

struct Conv2dBackward : Node {
  Saved<2> saved;  // x, weight
  kernels::Conv2dShape s;
  bool has_bias;
  const char* name() const override { return "conv2d"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor &x = saved.t[0], &w = saved.t[1];
    const Tensor dy = gy.contiguous(s.channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous);
    double beta = 0;
    // Each pass carves its own workspace just before it runs and returns it right after.
    if (g[0].needed) {
      Tensor& dx = grad_target(g[0], x, beta, "conv2d");
      std::size_t ws_bytes = 0;
      TALLY_DISPATCH_QUERY("conv2d", x, FLOATING, ws_bytes = kk::conv2d_workspace_bytes<T>(s, kernels::ConvPass::backward_data));
      const Tensor ws = workspace(x, ws_bytes, "conv2d_backward_data");
      // Timed apart from the filter pass (`tally train --profile` shows where a backward's time goes).
      TALLY_DISPATCH("conv2d input gradient", x, FLOATING, kk::conv2d_backward_data<T>(s, dy.data<T>(), w.data<TP>(), dx.data<T>(), TP(beta), ws_ptr(ws)));
      count_backward(conv_multiply_adds(s));
    }
    if (g[1].needed) {
      Tensor& dw = grad_target(g[1], w, beta, "conv2d");
      std::size_t ws_bytes = 0;
      TALLY_DISPATCH_QUERY("conv2d", x, FLOATING, ws_bytes = kk::conv2d_workspace_bytes<T>(s, kernels::ConvPass::backward_filter));
      const Tensor ws = workspace(x, ws_bytes, "conv2d_backward_filter");
      TALLY_DISPATCH("conv2d weight gradient", x, FLOATING, kk::conv2d_backward_filter<T>(s, x.data<T>(), dy.data<T>(), dw.data<TP>(), TP(beta), ws_ptr(ws)));
      count_backward(conv_multiply_adds(s));
    }
    if (has_bias && g[2].needed) {
      Tensor& db = grad_target(g[2], {s.K}, param_dtype(x.dtype()), x.device(), beta, "conv2d");
      TALLY_DISPATCH("conv2d", x, FLOATING, kk::conv2d_backward_bias<T>(s, dy.data<T>(), db.data<TP>(), TP(beta)));
    }
  }
};
}  // namespace

Tensor conv2d(const Tensor& x_, const Tensor& w_, const Tensor& b, const Conv2dOptions& o) {
  const char* op = "conv2d";
  check_dim(op, "input", x_, 4);
  check_dim(op, "weight", w_, 4);
  check_floating(op, x_);
  check_param(op, "weight", x_, w_);
  for (int i = 0; i < 2; ++i)
    if (o.stride[i] < 1 || o.dilation[i] < 1 || o.padding[i] < 0)
      throw ShapeError(fmt::format("conv2d: stride and dilation must be >= 1 and padding >= 0, found stride ({}, {}) "
                                   "padding ({}, {}) dilation ({}, {})", o.stride[0], o.stride[1], o.padding[0],
                                   o.padding[1], o.dilation[0], o.dilation[1]));
  if (o.groups < 1 || x_.size(1) % o.groups != 0 || w_.size(0) % o.groups != 0)
    throw ShapeError(fmt::format("conv2d: groups {} must divide input channels {} and output channels {}", o.groups,
                                 x_.size(1), w_.size(0)));
  if (w_.size(1) * o.groups != x_.size(1))
    throw ShapeError(fmt::format("conv2d: weight {} expects {} input channels (groups {}), input is {}", w_.str(),
                                 w_.size(1) * o.groups, o.groups, x_.str()));
  check_matching(op, x_, b, "bias", w_.size(0));
  // A channels-last input gives a channels-last output where the backend runs the convolution so
  // (the CPU's oneDNN, no bias); otherwise the convolution runs row-major.
  kernels::Conv2dShape s = conv_shape(x_, w_, o);
  s.bias = b.defined();
  if (x_.suggest_memory_format() == MemoryFormat::ChannelsLast)
    TALLY_DISPATCH_QUERY(op, x_, FLOATING,
                         s.channels_last = kk::conv2d_takes_channels_last<T>(s));
  const MemoryFormat format = s.channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  const Tensor x = x_.contiguous(format), w = w_.contiguous();
  if (s.P() < 1 || s.Q() < 1)
    throw ShapeError(fmt::format("conv2d: input {} is too small for kernel {}x{} with padding ({}, {}) and dilation ({}, {})",
                                 x.str(), s.R, s.S, s.pad_h, s.pad_w, s.dil_h, s.dil_w));
  Tensor y = out_like(x, {s.N, s.K, s.P(), s.Q()}, op, format);
  {
    std::size_t ws_bytes = 0;
    TALLY_DISPATCH_QUERY(op, x, FLOATING, ws_bytes = kk::conv2d_workspace_bytes<T>(s, kernels::ConvPass::forward));
    Tensor ws = workspace(x, ws_bytes, op);
    TALLY_DISPATCH(op, x, FLOATING, kk::conv2d_forward<T>(s, x.data<T>(), w.data<TP>(), ptr_or_null<TP>(b), y.data<T>(), ws_ptr(ws)));
    count_forward(conv_multiply_adds(s));
  }
  if (any_requires_grad({&x_, &w_, &b})) {
    auto n = std::make_shared<Conv2dBackward>();
    n->saved.t = {x, w};
    n->s = s;
    n->has_bias = b.defined();
    set_history(y, n, {&x_, &w_, &b});
  }
  return y;
}

// =============================================================================================
// linear / matmul: row-major GEMMs.
namespace {
struct LinearBackward : Node {
  Saved<2> saved;  // x (N, in), the weight (out, in) as the forward multiplied it (x's dtype)
  bool has_bias;
  const char* name() const override { return "linear"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor &x = saved.t[0], &w = saved.t[1];
    const Tensor dy = gy.contiguous();
    const i64 N = x.size(0), I = x.size(1), O = w.size(0);
    const DType pt = param_dtype(x.dtype());
    Tensor ws = (g[0].needed || g[1].needed) ? workspace(x, gemm_workspace_bytes(x, N, I, O), "linear_backward") : Tensor();
    double beta = 0;
    if (g[0].needed) {  // dx (N, in) = dy (N, out) @ w (out, in)
      Tensor& dx = grad_target(g[0], x, beta, "linear");
      TALLY_DISPATCH("linear", x, FLOATING, kk::gemm<T>(false, false, N, I, O, TP(1), dy.data<T>(), O, w.data<T>(), I, TP(beta), dx.data<T>(), I, ws_ptr(ws), ws_size(ws)));
      count_backward(static_cast<double>(N) * I * O);
    }
    if (g[1].needed) {  // dw (out, in) = dy^T (out, N) @ x (N, in), into the weight's own dtype
      Tensor& dw = grad_target(g[1], w.shape(), pt, x.device(), beta, "linear");
      TALLY_DISPATCH("linear", x, FLOATING, kk::gemm<T, TP>(true, false, O, I, N, TP(1), dy.data<T>(), O, x.data<T>(), I, TP(beta), dw.data<TP>(), I, ws_ptr(ws), ws_size(ws)));
      count_backward(static_cast<double>(N) * I * O);
    }
    if (has_bias && g[2].needed) {
      Tensor& db = grad_target(g[2], {O}, pt, x.device(), beta, "linear");
      TALLY_DISPATCH("linear", x, FLOATING, kk::sum_rows<T>(N, O, dy.data<T>(), db.data<TP>(), TP(beta)));
    }
  }
};

struct MatmulBackward : Node {
  Saved<2> saved;  // a (M, K), b (K, N)
  const char* name() const override { return "matmul"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor &a = saved.t[0], &b = saved.t[1];
    const Tensor dy = gy.contiguous();
    const i64 M = a.size(0), K = a.size(1), N = b.size(1);
    Tensor ws = (g[0].needed || g[1].needed) ? workspace(a, gemm_workspace_bytes(a, M, N, K), "matmul_backward") : Tensor();
    double beta = 0;
    if (g[0].needed) {  // da (M, K) = dy (M, N) @ b^T
      Tensor& da = grad_target(g[0], a, beta, "matmul");
      TALLY_DISPATCH("matmul", a, FLOATING, kk::gemm<T>(false, true, M, K, N, TP(1), dy.data<T>(), N, b.data<T>(), N, TP(beta), da.data<T>(), K, ws_ptr(ws), ws_size(ws)));
      count_backward(static_cast<double>(M) * N * K);
    }
    if (g[1].needed) {  // db (K, N) = a^T @ dy
      Tensor& db = grad_target(g[1], b, beta, "matmul");
      TALLY_DISPATCH("matmul", a, FLOATING, kk::gemm<T>(true, false, K, N, M, TP(1), a.data<T>(), K, dy.data<T>(), N, TP(beta), db.data<T>(), N, ws_ptr(ws), ws_size(ws)));
      count_backward(static_cast<double>(M) * N * K);
    }
  }
};
}  // namespace

Tensor linear(const Tensor& x_, const Tensor& w_, const Tensor& b) {
  const char* op = "linear";
  check_dim(op, "input", x_, 2);
  check_dim(op, "weight", w_, 2);
  check_floating(op, x_);
  check_param(op, "weight", x_, w_);
  if (x_.size(1) != w_.size(1))
    throw ShapeError(fmt::format("linear: input {} has {} features, weight {} expects {}", x_.str(), x_.size(1),
                                 w_.str(), w_.size(1)));
  check_matching(op, x_, b, "bias", w_.size(0));
  const Tensor x = x_.contiguous();
  // The weight as the GEMMs multiply it: itself, or (bfloat16 activations) rounded to bfloat16 — an
  // activation of this step, saved for backward, so that dx uses the very weights y was made of.
  Tensor w = w_.contiguous();
  if (w.dtype() != x.dtype()) {
    Tensor wk = Tensor::empty(w.shape(), x.dtype(), x.device(), Category::activation, "linear_weight");
    detail::convert_into(w, wk);
    w = wk;
  }
  const i64 N = x.size(0), I = x.size(1), O = w.size(0);
  Tensor y = out_like(x, {N, O}, op);
  {
    Tensor ws = workspace(x, gemm_workspace_bytes(x, N, O, I), op);
    if (b.defined() && x.dtype() != b.dtype()) {
      // bf16 with a bias: the product and the bias summed in float32, rounded to bf16 once.
      Tensor yf = Tensor::empty({N, O}, b.dtype(), x.device(), Category::temporary, "linear_float32");
      TALLY_DISPATCH(op, x, FLOATING, kk::gemm<T, TP>(false, true, N, O, I, TP(1), x.data<T>(), I, w.data<T>(), I, TP(0), yf.data<TP>(), O, ws_ptr(ws), ws_size(ws)));
      TALLY_DISPATCH(op, yf, FULL_PRECISION, kk::add_bias_rows<T>(N, O, yf.data<T>(), b.data<T>(), yf.data<T>()));
      detail::convert_into(yf, y);
    } else {
      TALLY_DISPATCH(op, x, FLOATING, {
        kk::gemm<T>(false, true, N, O, I, TP(1), x.data<T>(), I, w.data<T>(), I, TP(0), y.data<T>(), O, ws_ptr(ws), ws_size(ws));
        if (b.defined()) kk::add_bias_rows<T>(N, O, y.data<T>(), b.data<TP>(), y.data<T>());
      });
    }
    count_forward(static_cast<double>(N) * O * I);
  }
  if (any_requires_grad({&x_, &w_, &b})) {
    auto n = std::make_shared<LinearBackward>();
    n->saved.t = {x, w};
    n->has_bias = b.defined();
    set_history(y, n, {&x_, &w_, &b});
  }
  return y;
}

Tensor matmul(const Tensor& a_, const Tensor& b_) {
  const char* op = "matmul";
  check_dim(op, "a", a_, 2);
  check_dim(op, "b", b_, 2);
  check_floating(op, a_);
  check_same_device(op, a_, b_);
  check_same_dtype(op, a_, b_);
  if (a_.size(1) != b_.size(0))
    throw ShapeError(fmt::format("matmul: inner dimensions differ: {} @ {}", a_.str(), b_.str()));
  const Tensor a = a_.contiguous(), b = b_.contiguous();
  const i64 M = a.size(0), K = a.size(1), N = b.size(1);
  Tensor y = out_like(a, {M, N}, op);
  {
    Tensor ws = workspace(a, gemm_workspace_bytes(a, M, N, K), op);
    TALLY_DISPATCH(op, a, FLOATING, kk::gemm<T>(false, false, M, N, K, TP(1), a.data<T>(), K, b.data<T>(), N, TP(0), y.data<T>(), N, ws_ptr(ws), ws_size(ws)));
    count_forward(static_cast<double>(M) * N * K);
  }
  if (any_requires_grad({&a_, &b_})) {
    auto n = std::make_shared<MatmulBackward>();
    n->saved.t = {a, b};
    set_history(y, n, {&a_, &b_});
  }
  return y;
}

// =============================================================================================
// batch_norm / group_norm
namespace {
// Gradient buffers of a normalization's (x, weight, bias). The kernels take one beta for dweight
// and dbias together, so the two must both accumulate (persistent buffers) or both be fresh.
struct NormGrads {
  Tensor dx, dw, db;
  double beta_dx = 0, beta_param = 0;
};
// `dx_given`: g[0].buffer was set by the caller to a buffer to overwrite (beta 0), not to add into.
NormGrads norm_grad_targets(std::vector<GradSlot>& g, const Tensor& x, const Tensor& w, bool has_weight,
                            bool has_bias, i64 C, const char* op, bool dx_given = false) {
  NormGrads r;
  double bw = 0, bb = 0;
  if (g[0].needed) r.dx = dx_given ? g[0].buffer : grad_target(g[0], x, r.beta_dx, op);
  if (has_weight && g[1].needed) r.dw = grad_target(g[1], w, bw, op);
  if (has_bias && g[2].needed) r.db = grad_target(g[2], {C}, param_dtype(x.dtype()), x.device(), bb, op);
  if (r.dw.defined() && r.db.defined() && bw != bb)
    throw Error(fmt::format("{} backward: weight and bias gradients must both accumulate or both be fresh", op));
  r.beta_param = r.dw.defined() ? bw : bb;
  return r;
}

// A fused norm's backward owns its incoming gradient dz and reuses its buffer: as the residual's
// gradient (dz written over itself, masked) when that slot is fresh, else as x's (dx written over
// it) — so the fused op allocates no more than the unfused ReLU, add and norm did.
struct TakenGradient {
  Tensor dres;          // the residual's gradient buffer (dz itself, or its slot's own), or undefined
  double beta_res = 0;  // 1 when dres is the slot's existing buffer (accumulate)
  bool dz_taken = false;    // the residual took dz
  bool dx_over_dz = false;  // dx is written over dz (g[0].buffer is dz, beta 0)
};
TakenGradient take_incoming_gradient(std::vector<GradSlot>& g, const Tensor& x, const Tensor& dz, bool has_residual,
                                     const char* op) {
  auto fresh = [](const GradSlot& slot) { return !slot.buffer.defined() && slot.category != Category::gradient; };
  TakenGradient t;
  if (has_residual && g[3].needed) {
    if (fresh(g[3])) g[3].buffer = t.dres = dz, t.dz_taken = true;
    else t.dres = grad_target(g[3], x, t.beta_res, op);
  }
  if (g[0].needed && !t.dz_taken && fresh(g[0])) g[0].buffer = dz, t.dx_over_dz = true;
  return t;
}

// What a fused norm's backward kernel is told of the fused ops: ReLU's mask (y, when relu), where
// the residual's gradient goes (dres, =|+= by beta_res), and the layout.
template <class T>
kernels::NormActGrad<T> fused_grad(bool relu, const Tensor& y, const Tensor& dres, double beta_res, bool channels_last) {
  kernels::NormActGrad<T> act;
  act.y = relu ? y.data<T>() : nullptr;
  act.relu = relu;
  act.dresidual = ptr_or_null<T>(dres);
  act.beta_residual = static_cast<kernels::compute_t<T>>(beta_res);
  act.channels_last = channels_last;
  return act;
}

struct BatchNormBackward : Node {
  Saved<4> saved;  // x, weight (may be undefined), save_mean, save_invstd  — or running stats in eval
  Saved<2> running;  // eval: running_mean, running_var
  Saved<1> output;   // fused ReLU (training): y, whose sign is the mask
  bool training;
  bool relu = false, has_residual = false;  // the fused activation (BatchNormOptions::relu, residual)
  double eps;
  i64 N, C, HW;
  bool has_weight, has_bias;
  const char* name() const override { return relu || has_residual ? "batch_norm_relu" : "batch_norm"; }
  void release() override { saved.release(); running.release(); output.release(); }
  // Training on the CPU keeps a channels-last x channels-last (x, y, dy and dx alike).
  bool channels_last() const { return saved.t[0].suggest_memory_format() == MemoryFormat::ChannelsLast; }
  // The fused backward (take_incoming_gradient: with no residual nothing at all is allocated for dx).
  void fused_backward(const Tensor& gy, std::vector<GradSlot>& g) {
    const char* op = "batch_norm";
    const Tensor& x = saved.t[0];
    const Tensor& w = saved.t[1];
    const Tensor dz = gy.contiguous(x.suggest_memory_format());
    const auto [dres, beta_res, dz_taken, dx_over_dz] = take_incoming_gradient(g, x, dz, has_residual, op);
    // The residual took dz and x needs a buffer of its own: ReLU's mask (y) is dropped before that
    // buffer is taken — one fewer activation-sized buffer at a backward's peak (ResNet-50 224² in
    // 8 GiB at --recompute all: micro-batches of 342 instead of 293). The second call takes the
    // first's channel sums (CPU; CUDA sums the masked dz again: the same bits either way).
    if (dz_taken && relu) {
      GradSlot none;
      std::vector<GradSlot> params = {none, g[1], g[2]};
      auto [unused, dw, db, bdx0, bp] = norm_grad_targets(params, x, w, has_weight, has_bias, C, op);
      g[1] = params[1], g[2] = params[2];
      // The CPU keeps the first call's channel sums for the second (2C doubles) rather than sum
      // the same dz and x again; CUDA sums again.
      const Tensor sums = x.device().is_cpu() ? Tensor::empty({2 * C}, DType::Float64, x.device(), Category::temporary,
                                                              "batch_norm_backward_sums")
                                              : Tensor();
      {
        const Tensor ws = workspace(x, batch_norm_workspace_bytes(x, N, C, HW), "batch_norm_backward");
        TALLY_DISPATCH(op, x, FLOATING, {
          kernels::NormActGrad<T> act = fused_grad<T>(true, output.t[0], dres, beta_res, channels_last());
          act.sums_out = ptr_or_null<double>(sums);
          kk::batch_norm_backward<T>(N, C, HW, dz.data<T>(), x.data<T>(), ptr_or_null<TP>(w), saved.t[2].data<TP>(),
                                     saved.t[3].data<TP>(), static_cast<T*>(nullptr), TP(0), ptr_or_null<TP>(dw),
                                     ptr_or_null<TP>(db), TP(bp), ws_ptr(ws), act);
        });
      }
      output.release();
      if (!g[0].needed) return;
      double bdx = 0;
      Tensor& dx = grad_target(g[0], x, bdx, op);
      const Tensor ws = workspace(x, batch_norm_workspace_bytes(x, N, C, HW), "batch_norm_backward");
      TALLY_DISPATCH(op, x, FLOATING, {
        kernels::NormActGrad<T> plain;
        plain.channels_last = channels_last();
        plain.sums_in = ptr_or_null<double>(sums);
        kk::batch_norm_backward<T>(N, C, HW, dz.data<T>(), x.data<T>(), ptr_or_null<TP>(w), saved.t[2].data<TP>(),
                                   saved.t[3].data<TP>(), dx.data<T>(), TP(bdx), static_cast<TP*>(nullptr),
                                   static_cast<TP*>(nullptr), TP(0), ws_ptr(ws), plain);
      });
      return;
    }
    auto [dx, dw, db, bdx, bp] = norm_grad_targets(g, x, w, has_weight, has_bias, C, op, dx_over_dz);
    const Tensor ws = workspace(x, batch_norm_workspace_bytes(x, N, C, HW), "batch_norm_backward");
    TALLY_DISPATCH(op, x, FLOATING, {
      const kernels::NormActGrad<T> act = fused_grad<T>(relu, output.t[0], dres, beta_res, channels_last());
      kk::batch_norm_backward<T>(N, C, HW, dz.data<T>(), x.data<T>(), ptr_or_null<TP>(w), saved.t[2].data<TP>(),
                                 saved.t[3].data<TP>(), ptr_or_null<T>(dx), TP(bdx), ptr_or_null<TP>(dw),
                                 ptr_or_null<TP>(db), TP(bp), ws_ptr(ws), act);
    });
  }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    if (training && (relu || has_residual)) return fused_backward(gy, g);
    const Tensor& x = saved.t[0];
    const Tensor& w = saved.t[1];
    const Tensor dy = gy.contiguous(x.suggest_memory_format());
    auto [dx, dw, db, bdx, bp] = norm_grad_targets(g, x, w, has_weight, has_bias, C, "batch_norm");
    const Tensor ws = workspace(x, batch_norm_workspace_bytes(x, N, C, HW), "batch_norm_backward");
    if (training) {
      TALLY_DISPATCH("batch_norm", x, FLOATING, {
        kernels::NormActGrad<T> plain;
        plain.channels_last = channels_last();
        kk::batch_norm_backward<T>(N, C, HW, dy.data<T>(), x.data<T>(), ptr_or_null<TP>(w), saved.t[2].data<TP>(),
                                   saved.t[3].data<TP>(), ptr_or_null<T>(dx), TP(bdx), ptr_or_null<TP>(dw),
                                   ptr_or_null<TP>(db), TP(bp), ws_ptr(ws), plain);
      });
    } else {
      TALLY_DISPATCH("batch_norm", x, FLOATING, kk::batch_norm_backward_eval<T>(N, C, HW, dy.data<T>(), x.data<T>(), ptr_or_null<TP>(w),
                                                                                running.t[0].data<TP>(), running.t[1].data<TP>(), TP(eps),
                                                                                ptr_or_null<T>(dx), TP(bdx), ptr_or_null<TP>(dw),
                                                                                ptr_or_null<TP>(db), TP(bp), ws_ptr(ws)));
    }
  }
};

struct GroupNormBackward : Node {
  Saved<4> saved;  // x, weight, save_mean, save_invstd
  Saved<1> output;  // fused ReLU: y, whose sign is the mask
  i64 N, C, HW, G;
  bool has_weight, has_bias;
  bool relu = false, has_residual = false;  // fused (group_norm's relu and residual)
  const char* name() const override { return relu || has_residual ? "group_norm_relu" : "group_norm"; }
  void release() override { saved.release(); output.release(); }
  // Fused (relu or a residual): the incoming gradient is taken as batch norm's fused backward takes
  // it (take_incoming_gradient); dgamma and dbeta are summed before anything is written over it.
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const char* op = "group_norm";
    const Tensor& x = saved.t[0];
    const Tensor& w = saved.t[1];
    const Tensor dy = gy.contiguous();
    TakenGradient taken;
    if (relu || has_residual) taken = take_incoming_gradient(g, x, dy, has_residual, op);
    const Tensor dres = taken.dres;
    const double beta_res = taken.beta_res;
    auto [dx, dw, db, bdx, bp] = norm_grad_targets(g, x, w, has_weight, has_bias, C, op, taken.dx_over_dz);
    TALLY_DISPATCH(op, x, FLOATING, {
      const kernels::NormActGrad<T> act = fused_grad<T>(relu, output.t[0], dres, beta_res, false);
      kk::group_norm_backward<T>(N, C, HW, G, dy.data<T>(), x.data<T>(), ptr_or_null<TP>(w), saved.t[2].data<TP>(),
                                 saved.t[3].data<TP>(), ptr_or_null<T>(dx), TP(bdx), ptr_or_null<TP>(dw),
                                 ptr_or_null<TP>(db), TP(bp), act);
    });
  }
};
}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, const BatchNormOptions& opt, const Tensor& residual) {
  return batch_norm_with_stats(x, weight, bias, running_mean, running_var, opt, residual).y;
}

namespace {

// Training: the batch's statistics, the running statistics updated if given, the fused residual
// and ReLU applied; the node keeps x, the statistics and (fused ReLU) y.
BatchNormResult batch_norm_train(const Tensor& x_, const Tensor& x, const Tensor& weight, const Tensor& bias,
                                 const Tensor& running_mean, const Tensor& running_var, const BatchNormOptions& opt,
                                 const Tensor& residual_, const Tensor& residual, bool in_place) {
  const char* op = "batch_norm";
  const i64 N = x.size(0), C = x.size(1), HW = spatial(x);
  const MemoryFormat format = x.suggest_memory_format();
  Tensor y = in_place ? alias_for_output(x) : out_like(x, x.shape(), op, format);
  // Saved statistics are activations: they live exactly as long as the backward needs them.
  Tensor save_mean = Tensor::empty({C}, param_dtype(x.dtype()), x.device(), Category::activation, "batch_norm_mean");
  Tensor save_invstd = Tensor::empty({C}, param_dtype(x.dtype()), x.device(), Category::activation, "batch_norm_invstd");
  const bool update = running_mean.defined();
  {
    const Tensor ws = workspace(x, batch_norm_workspace_bytes(x, N, C, HW), op);
    TALLY_DISPATCH(op, x, FLOATING, {
      kernels::NormAct<T> act;
      act.residual = ptr_or_null<T>(residual);
      act.relu = opt.relu;
      act.channels_last = format == MemoryFormat::ChannelsLast;
      kk::batch_norm_forward_train<T>(N, C, HW, x.data<T>(), ptr_or_null<TP>(weight), ptr_or_null<TP>(bias), TP(opt.eps),
                                      TP(opt.momentum), update ? running_mean.data<TP>() : nullptr,
                                      update ? running_var.data<TP>() : nullptr, y.data<T>(), save_mean.data<TP>(),
                                      save_invstd.data<TP>(), ws_ptr(ws), act);
    });
  }
  if (any_requires_grad({&x_, &weight, &bias, &residual_})) {
    auto n = std::make_shared<BatchNormBackward>();
    n->saved.t = {x, weight, save_mean, save_invstd};
    n->training = true;
    n->relu = opt.relu, n->has_residual = residual.defined();
    n->eps = opt.eps;
    n->N = N, n->C = C, n->HW = HW;
    n->has_weight = weight.defined(), n->has_bias = bias.defined();
    set_history(y, n, {&x_, &weight, &bias, &residual_});
    if (opt.relu) n->output.t[0] = y.detach();  // the node must not own a handle that points back at itself
  }
  return {y, save_mean, save_invstd};
}

}  // namespace

namespace {
BatchNormResult batch_norm_any(const Tensor& x_, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                               const Tensor& running_var, const BatchNormOptions& opt, const Tensor& residual_,
                               bool given_up) {
  const char* op = "batch_norm";
  if (!x_.defined() || x_.dim() < 2) throw ShapeError(fmt::format("batch_norm: expected input (N, C, ...), found {}", x_.str()));
  check_floating(op, x_);
  const i64 N = x_.size(0), C = x_.size(1), HW = spatial(x_);
  check_matching(op, x_, weight, "weight", C);
  check_matching(op, x_, bias, "bias", C);
  check_matching(op, x_, running_mean, "running_mean", C);
  check_matching(op, x_, running_var, "running_var", C);
  if (residual_.defined()) check_same_shape("batch_norm (residual)", x_, residual_);
  if (!opt.training && (!running_mean.defined() || !running_var.defined()))
    throw ShapeError("batch_norm: eval mode needs running_mean and running_var");
  if (opt.training && N * HW < 2)
    throw ShapeError(fmt::format("batch_norm: expected more than 1 value per channel when training, got input {}", x_.str()));
  // y over x: x's handle given up and nothing else holding its buffer, and no backward to keep it.
  const bool in_place = given_up && reusable(x_) && !any_requires_grad({&x_, &weight, &bias, &residual_});
  // Training on the CPU runs channels-last in place (x, the residual and y in x's layout); the
  // CUDA kernels and evaluation take row-major tensors.
  const MemoryFormat format =
      opt.training && x_.device().is_cpu() ? x_.suggest_memory_format() : MemoryFormat::Contiguous;
  const Tensor x = x_.contiguous(format);
  if (opt.training)
    return batch_norm_train(x_, x, weight, bias, running_mean, running_var, opt, residual_,
                            residual_.defined() ? residual_.contiguous(format) : Tensor(), in_place);
  Tensor y = in_place ? alias_for_output(x) : out_like(x, x.shape(), op);
  TALLY_DISPATCH(op, x, FLOATING, kk::batch_norm_forward_eval<T>(N, C, HW, x.data<T>(), ptr_or_null<TP>(weight), ptr_or_null<TP>(bias),
                                                                 running_mean.data<TP>(), running_var.data<TP>(), TP(opt.eps), y.data<T>()));
  if (any_requires_grad({&x_, &weight, &bias})) {
    auto n = std::make_shared<BatchNormBackward>();
    n->saved.t = {x, weight, Tensor(), Tensor()};
    n->running.t = {running_mean, running_var};
    n->training = false;
    n->eps = opt.eps;
    n->N = N, n->C = C, n->HW = HW;
    n->has_weight = weight.defined(), n->has_bias = bias.defined();
    set_history(y, n, {&x_, &weight, &bias});
  }
  // Eval: the fused activation as the unfused ops (the buffer handed on, so no copies).
  if (residual_.defined()) y = add(std::move(y), residual_);
  if (opt.relu) y = relu(std::move(y));
  return {y, Tensor(), Tensor()};
}
}  // namespace

BatchNormResult batch_norm_with_stats(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                      const Tensor& running_mean, const Tensor& running_var,
                                      const BatchNormOptions& opt, const Tensor& residual) {
  return batch_norm_any(x, weight, bias, running_mean, running_var, opt, residual, false);
}

BatchNormResult batch_norm_with_stats(Tensor&& x, const Tensor& weight, const Tensor& bias,
                                      const Tensor& running_mean, const Tensor& running_var,
                                      const BatchNormOptions& opt, const Tensor& residual) {
  BatchNormResult r = batch_norm_any(x, weight, bias, running_mean, running_var, opt, residual, true);
  x = Tensor();  // given up
  return r;
}

void batch_norm_add_moments(const Tensor& mean, const Tensor& invstd, double eps, i64 count, Tensor& sum,
                            Tensor& sum_sq) {
  const char* op = "batch_norm";
  check_dim(op, "mean", mean, 1);
  const i64 C = mean.size(0);
  check_same_shape(op, mean, invstd);
  for (const Tensor* t : {&sum, &sum_sq})
    if (!t->defined() || t->dtype() != DType::Float64 || t->dim() != 1 || t->size(0) != C || t->device() != mean.device())
      throw ShapeError(fmt::format("batch_norm: moment sums must be float64 [{}] on {}, found {}", C,
                                   mean.device().str(), t->str()));
  TALLY_DISPATCH(op, mean, FULL_PRECISION,
                 kk::batch_norm_accumulate_moments<T>(C, count, T(eps), mean.data<T>(), invstd.data<T>(),
                                                      sum.data<double>(), sum_sq.data<double>()));
}

void batch_norm_update_running(const Tensor& sum, const Tensor& sum_sq, i64 count, double momentum,
                               Tensor& running_mean, Tensor& running_var) {
  const char* op = "batch_norm";
  check_dim(op, "running_mean", running_mean, 1);
  const i64 C = running_mean.size(0);
  check_same_shape(op, running_mean, running_var);
  for (const Tensor* t : {&sum, &sum_sq})
    if (!t->defined() || t->dtype() != DType::Float64 || t->dim() != 1 || t->size(0) != C ||
        t->device() != running_mean.device())
      throw ShapeError(fmt::format("batch_norm: moment sums must be float64 [{}] on {}, found {}", C,
                                   running_mean.device().str(), t->str()));
  if (count < 2)
    throw ShapeError(fmt::format("batch_norm: need more than 1 value per channel for an unbiased variance, found {}", count));
  TALLY_DISPATCH(op, running_mean, FULL_PRECISION,
                 kk::batch_norm_apply_moments<T>(C, count, T(momentum), sum.data<double>(), sum_sq.data<double>(),
                                                 running_mean.data<T>(), running_var.data<T>()));
}

Tensor group_norm(const Tensor& x_, i64 groups, const Tensor& weight, const Tensor& bias, double eps, bool relu,
                  const Tensor& residual_) {
  const char* op = "group_norm";
  if (!x_.defined() || x_.dim() < 2) throw ShapeError(fmt::format("group_norm: expected input (N, C, ...), found {}", x_.str()));
  check_floating(op, x_);
  const i64 N = x_.size(0), C = x_.size(1), HW = spatial(x_);
  if (groups < 1 || C % groups != 0)
    throw ShapeError(fmt::format("group_norm: {} groups must divide the {} channels of {}", groups, C, x_.str()));
  check_matching(op, x_, weight, "weight", C);
  check_matching(op, x_, bias, "bias", C);
  if (residual_.defined()) {
    check_same_shape("group_norm (residual)", x_, residual_);
    check_same_device("group_norm (residual)", x_, residual_);
    check_same_dtype("group_norm (residual)", x_, residual_);
  }
  const Tensor x = x_.contiguous();
  const Tensor residual = residual_.defined() ? residual_.contiguous() : Tensor();
  Tensor y = out_like(x, x.shape(), op);
  Tensor save_mean = Tensor::empty({N, groups}, param_dtype(x.dtype()), x.device(), Category::activation, "group_norm_mean");
  Tensor save_invstd = Tensor::empty({N, groups}, param_dtype(x.dtype()), x.device(), Category::activation, "group_norm_invstd");
  TALLY_DISPATCH(op, x, FLOATING, {
    kernels::NormAct<T> act;
    act.residual = ptr_or_null<T>(residual);
    act.relu = relu;
    kk::group_norm_forward<T>(N, C, HW, groups, x.data<T>(), ptr_or_null<TP>(weight), ptr_or_null<TP>(bias), TP(eps),
                              y.data<T>(), save_mean.data<TP>(), save_invstd.data<TP>(), act);
  });
  if (any_requires_grad({&x_, &weight, &bias, &residual_})) {
    auto n = std::make_shared<GroupNormBackward>();
    n->saved.t = {x, weight, save_mean, save_invstd};
    n->N = N, n->C = C, n->HW = HW, n->G = groups;
    n->has_weight = weight.defined(), n->has_bias = bias.defined();
    n->relu = relu, n->has_residual = residual.defined();
    set_history(y, n, {&x_, &weight, &bias, &residual_});
    if (relu) n->output.t[0] = y.detach();  // the node must not own a handle that points back at itself
  }
  return y;
}

// =============================================================================================
// elementwise
namespace {
struct ReluBackward : Node {
  Saved<1> saved;  // y (the output: dx = dy * (y > 0))
  const char* name() const override { return "relu"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor& y = saved.t[0];
    const Tensor dy = gy.contiguous(y.suggest_memory_format());
    double beta = 0;
    Tensor& dx = grad_target(g[0], y, beta, "relu");
    TALLY_DISPATCH("relu", y, FLOATING, kk::relu_backward<T>(y.numel(), dy.data<T>(), y.data<T>(), dx.data<T>(), TP(beta)));
  }
};

// d(alpha_a * a + alpha_b * b): each input receives alpha * dy.
struct LinearCombinationBackward : Node {
  double alpha[2] = {1.0, 1.0};
  const char* op = "add";
  const char* name() const override { return op; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor dy = dense(gy);
    bool aliased = false;
    for (std::size_t i = 0; i < g.size(); ++i) {
      if (!g[i].needed) continue;
      // One input may take the incoming gradient itself (no copy): it is this node's alone. A
      // second input, or a leaf's persistent buffer, gets its own.
      if (!g[i].buffer.defined() && alpha[i] == 1.0 && !aliased && g[i].category != Category::gradient) {
        g[i].buffer = dy;
        aliased = true;
        continue;
      }
      double beta = 0;
      Tensor& dx = grad_target(g[i], dy, beta, op);
      TALLY_DISPATCH(op, dy, FLOATING, kk::axpby<T>(dy.numel(), TP(alpha[i]), dy.data<T>(), TP(beta), dx.data<T>()));
    }
  }
};

struct MulBackward : Node {
  Saved<2> saved;  // a, b
  const char* name() const override { return "mul"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor dy = gy.contiguous(saved.t[0].suggest_memory_format());
    double beta = 0;
    for (int i = 0; i < 2; ++i) {
      if (!g[i].needed) continue;
      const Tensor& other = saved.t[1 - i];
      Tensor& d = grad_target(g[i], saved.t[i], beta, "mul");
      TALLY_DISPATCH("mul", dy, FLOATING, kk::mul_backward<T>(dy.numel(), dy.data<T>(), other.data<T>(), d.data<T>(), TP(beta)));
    }
  }
};

// y = a + alpha_b * b — in a's own buffer when `in_place` (the caller found it reusable()).
Tensor lincomb(const Tensor& a_, const Tensor& b_, double alpha_b, const char* op, bool in_place = false) {
  check_same_shape(op, a_, b_);
  check_floating(op, a_);
  check_same_device(op, a_, b_);
  check_same_dtype(op, a_, b_);
  // In a's memory format (b converted to it when it differs), as the output.
  const MemoryFormat format = a_.suggest_memory_format();
  const Tensor a = a_.contiguous(format), b = b_.contiguous(format);
  Tensor y = in_place ? alias_for_output(a) : out_like(a, a.shape(), op, format);
  TALLY_DISPATCH(op, a, FLOATING, kk::add<T>(a.numel(), a.data<T>(), b.data<T>(), TP(alpha_b), y.data<T>()));
  if (any_requires_grad({&a_, &b_})) {
    auto n = std::make_shared<LinearCombinationBackward>();
    n->alpha[1] = alpha_b;
    n->op = op;
    set_history(y, n, {&a_, &b_});
  }
  return y;
}

// relu(x) — in x's own buffer when `in_place` (the caller found it reusable()).
Tensor relu_into(const Tensor& x_, bool in_place) {
  check_floating("relu", x_);
  const Tensor x = dense(x_);
  Tensor y = in_place ? alias_for_output(x) : out_like(x, x.shape(), "relu", x.suggest_memory_format());
  TALLY_DISPATCH("relu", x, FLOATING, kk::relu_forward<T>(x.numel(), x.data<T>(), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<ReluBackward>();
    set_history(y, n, {&x_});
    n->saved.t[0] = y.detach();  // the node must not own a handle that points back at itself
  }
  return y;
}
}  // namespace

Tensor relu(const Tensor& x) { return relu_into(x, false); }

Tensor relu(Tensor&& x) {
  const bool in_place = reusable(x);
  Tensor y = relu_into(x, in_place);
  if (in_place) x = Tensor();  // the caller gave this handle up; its values are the output's now
  return y;
}

Tensor add(const Tensor& a, const Tensor& b) { return lincomb(a, b, 1.0, "add"); }

Tensor add(Tensor&& a, const Tensor& b) {
  const bool in_place = reusable(a);
  Tensor y = lincomb(a, b, 1.0, "add", in_place);
  if (in_place) a = Tensor();
  return y;
}
Tensor sub(const Tensor& a, const Tensor& b) { return lincomb(a, b, -1.0, "sub"); }

Tensor mul(const Tensor& a_, const Tensor& b_) {
  check_same_shape("mul", a_, b_);
  check_floating("mul", a_);
  const MemoryFormat format = a_.suggest_memory_format();
  const Tensor a = a_.contiguous(format), b = b_.contiguous(format);
  Tensor y = out_like(a, a.shape(), "mul", format);
  TALLY_DISPATCH("mul", a, FLOATING, kk::mul<T>(a.numel(), a.data<T>(), b.data<T>(), y.data<T>()));
  if (any_requires_grad({&a_, &b_})) {
    auto n = std::make_shared<MulBackward>();
    n->saved.t = {a.detach(), b.detach()};
    set_history(y, n, {&a_, &b_});
  }
  return y;
}

namespace {
struct CastBackward : Node {
  Shape shape;
  DType dtype;  // the input's
  Device device;
  const char* name() const override { return "cast"; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    if (!g[0].needed) return;
    double beta = 0;
    const MemoryFormat format = gy.suggest_memory_format();
    Tensor& dx = grad_target(g[0], shape, dtype, device, beta, "cast", format);
    if (beta == 0) return detail::convert_into(gy, dx);
    Tensor converted = Tensor::empty(shape, dtype, device, Category::temporary, "cast_grad", format);
    detail::convert_into(gy, converted);
    add_into(dx, converted);
  }
};
}  // namespace

Tensor cast(const Tensor& x, DType dtype) {
  if (!x.defined()) throw ShapeError("cast: the input is undefined");
  if (x.dtype() == dtype) return x;
  Tensor y = Tensor::empty(x.shape(), dtype, x.device(), x.category(), "to_dtype", x.suggest_memory_format());
  detail::convert_into(x, y);
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<CastBackward>();
    n->shape = x.shape(), n->dtype = x.dtype(), n->device = x.device();
    set_history(y, n, {&x});
  }
  return y;
}

Tensor scale(const Tensor& x_, double alpha) {
  check_floating("scale", x_);
  const Tensor x = dense(x_);
  Tensor y = out_like(x, x.shape(), "scale", x.suggest_memory_format());
  TALLY_DISPATCH("scale", x, FLOATING, kk::axpby<T>(x.numel(), TP(alpha), x.data<T>(), TP(0), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<LinearCombinationBackward>();
    n->alpha[0] = alpha;
    n->op = "scale";
    set_history(y, n, {&x_});
  }
  return y;
}

void add_into(Tensor& dst, const Tensor& src_) {
  check_same_shape("add_into", dst, src_);
  const MemoryFormat format = dst.suggest_memory_format();
  if (!dst.is_contiguous(format))
    throw ShapeError(fmt::format("add_into: destination {} must be dense (contiguous or channels_last)", dst.str()));
  const Tensor src = src_.contiguous(format);
  TALLY_DISPATCH("add_into", dst, FLOATING, kk::axpby<T>(dst.numel(), TP(1), src.data<T>(), TP(1), dst.data<T>()));
}

// =============================================================================================
// pooling
namespace {
kernels::Pool2dShape pool_shape(const Tensor& x, std::array<i64, 2> k, std::array<i64, 2> s, std::array<i64, 2> p,
                           const char* op) {
  check_dim(op, "input", x, 4);
  check_floating(op, x);
  if (k[0] < 1 || k[1] < 1 || s[0] < 1 || s[1] < 1 || p[0] < 0 || p[1] < 0)
    throw ShapeError(fmt::format("{}: kernel and stride must be >= 1, padding >= 0; found kernel ({}, {}) stride ({}, {}) "
                                 "padding ({}, {})", op, k[0], k[1], s[0], s[1], p[0], p[1]));
  if (p[0] * 2 > k[0] || p[1] * 2 > k[1])
    throw ShapeError(fmt::format("{}: padding ({}, {}) must be at most half the kernel ({}, {})", op, p[0], p[1], k[0], k[1]));
  kernels::Pool2dShape ps{x.size(0), x.size(1), x.size(2), x.size(3), k[0], k[1], s[0], s[1], p[0], p[1]};
  if (ps.H + 2 * ps.pad_h < ps.kh || ps.W + 2 * ps.pad_w < ps.kw)
    throw ShapeError(fmt::format("{}: input {} is smaller than the kernel ({}, {})", op, x.str(), k[0], k[1]));
  return ps;
}

struct MaxPoolBackward : Node {
  kernels::Pool2dShape s;
  Tensor argmax;  // int32 (N, C, P, Q), category activation
  Shape in_shape;
  DType dtype;
  Device device;
  const char* name() const override { return "max_pool2d"; }
  void release() override { argmax = Tensor(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const MemoryFormat format = s.channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
    const Tensor dy = gy.contiguous(format);
    double beta = 0;
    Tensor& dx = grad_target(g[0], in_shape, dtype, device, beta, "max_pool2d", format);
    TALLY_DISPATCH("max_pool2d", dy, FLOATING, kk::max_pool2d_backward<T>(s, dy.data<T>(), argmax.data<std::int32_t>(), dx.data<T>(), TP(beta)));
  }
};

struct AvgPoolBackward : Node {
  kernels::Pool2dShape s;
  bool count_include_pad;
  bool adaptive;
  i64 OH, OW;
  Shape in_shape;
  const char* name() const override { return adaptive ? "adaptive_avg_pool2d" : "avg_pool2d"; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor dy = gy.contiguous();
    double beta = 0;
    Tensor& dx = grad_target(g[0], in_shape, dy.dtype(), dy.device(), beta, name());
    if (adaptive)
      TALLY_DISPATCH("adaptive_avg_pool2d", dy, FLOATING, kk::adaptive_avg_pool2d_backward<T>(s.N, s.C, s.H, s.W, OH, OW, dy.data<T>(), dx.data<T>(), TP(beta)));
    else
      TALLY_DISPATCH("avg_pool2d", dy, FLOATING, kk::avg_pool2d_backward<T>(s, count_include_pad, dy.data<T>(), dx.data<T>(), TP(beta)));
  }
};
}  // namespace

Tensor max_pool2d(const Tensor& x_, std::array<i64, 2> kernel, std::array<i64, 2> stride, std::array<i64, 2> padding) {
  kernels::Pool2dShape s = pool_shape(x_, kernel, stride, padding, "max_pool2d");
  // The CPU pools a channels-last input as it is (ResNet's stem: the convolutions after it stay
  // channels-last); CUDA takes row-major tensors.
  s.channels_last = x_.device().is_cpu() && x_.suggest_memory_format() == MemoryFormat::ChannelsLast;
  const MemoryFormat format = s.channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  const Tensor x = x_.contiguous(format);
  Tensor y = out_like(x, {s.N, s.C, s.P(), s.Q()}, "max_pool2d", format);
  const bool need = any_requires_grad({&x_});
  // The argmax is what backward needs; without grad it is scratch. In y's layout.
  Tensor argmax = Tensor::empty(y.shape(), DType::Int32, x.device(), need ? Category::activation : Category::workspace,
                                "max_pool2d_argmax", format);
  TALLY_DISPATCH("max_pool2d", x, FLOATING, kk::max_pool2d_forward<T>(s, x.data<T>(), y.data<T>(), argmax.data<std::int32_t>()));
  if (need) {
    auto n = std::make_shared<MaxPoolBackward>();
    n->s = s;
    n->argmax = argmax;
    n->in_shape = x.shape();
    n->dtype = x.dtype();
    n->device = x.device();
    set_history(y, n, {&x_});
  }
  return y;
}

Tensor avg_pool2d(const Tensor& x_, std::array<i64, 2> kernel, std::array<i64, 2> stride, std::array<i64, 2> padding,
                  bool count_include_pad) {
  const kernels::Pool2dShape s = pool_shape(x_, kernel, stride, padding, "avg_pool2d");
  const Tensor x = x_.contiguous();
  Tensor y = out_like(x, {s.N, s.C, s.P(), s.Q()}, "avg_pool2d");
  TALLY_DISPATCH("avg_pool2d", x, FLOATING, kk::avg_pool2d_forward<T>(s, count_include_pad, x.data<T>(), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<AvgPoolBackward>();
    n->s = s;
    n->count_include_pad = count_include_pad;
    n->adaptive = false;
    n->in_shape = x.shape();
    set_history(y, n, {&x_});
  }
  return y;
}

Tensor adaptive_avg_pool2d(const Tensor& x_, std::array<i64, 2> out) {
  const char* op = "adaptive_avg_pool2d";
  check_dim(op, "input", x_, 4);
  check_floating(op, x_);
  if (out[0] < 1 || out[1] < 1)
    throw ShapeError(fmt::format("{}: output size must be positive, found ({}, {})", op, out[0], out[1]));
  const Tensor x = x_.contiguous();
  const i64 N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  if (H < 1 || W < 1) throw ShapeError(fmt::format("{}: empty input {}", op, x.str()));
  Tensor y = out_like(x, {N, C, out[0], out[1]}, op);
  TALLY_DISPATCH(op, x, FLOATING, kk::adaptive_avg_pool2d_forward<T>(N, C, H, W, out[0], out[1], x.data<T>(), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<AvgPoolBackward>();
    n->s = kernels::Pool2dShape{N, C, H, W, 1, 1, 1, 1};
    n->adaptive = true;
    n->OH = out[0], n->OW = out[1];
    n->in_shape = x.shape();
    set_history(y, n, {&x_});
  }
  return y;
}

// =============================================================================================
// shape
namespace {
struct ReshapeBackward : Node {
  Shape in_shape;
  const char* name() const override { return "reshape"; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor dy = gy.contiguous().view(in_shape);
    if (!g[0].buffer.defined()) {
      g[0].buffer = g[0].category == Category::gradient ? dy.clone(Category::gradient) : dy;  // alias when we may
      return;
    }
    add_into(g[0].buffer, dy);
  }
};
}  // namespace

Tensor reshape(const Tensor& x, const Shape& shape) {
  Tensor y = x.reshape(shape);
  if (any_requires_grad({&x})) {
    auto n = std::make_shared<ReshapeBackward>();
    n->in_shape = x.shape();
    set_history(y, n, {&x});
  }
  return y;
}

Tensor flatten(const Tensor& x, i64 start_dim) {
  const i64 nd = x.dim();
  if (start_dim < 0) start_dim += nd;
  if (start_dim < 0 || start_dim >= std::max<i64>(nd, 1))
    throw ShapeError(fmt::format("flatten: start_dim {} out of range for {}", start_dim, x.str()));
  Shape s(x.shape().begin(), x.shape().begin() + start_dim);
  s.push_back(-1);
  if (x.numel() == 0) s.back() = 0;
  return reshape(x, s);
}

// =============================================================================================
// reductions
namespace {
struct SumBackward : Node {
  Shape in_shape;
  double factor;  // 1 for sum, 1/n for mean
  const char* name() const override { return "sum"; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    if (!g[0].needed) return;
    // gradient of a scalar: every element receives factor * dy. Read dy on the host (one value).
    double beta = 0;
    Tensor& dx = grad_target(g[0], in_shape, gy.dtype(), gy.device(), beta, "sum");
    const Tensor dy = gy.contiguous();
    TALLY_DISPATCH("sum", dx, FLOATING, kk::broadcast_scalar<T>(dx.numel(), dy.data<T>(), TP(factor), dx.data<T>(), TP(beta)));
  }
};

Tensor reduce_all(const Tensor& x_, double factor, const char* op) {
  check_floating(op, x_);
  const Tensor x = x_.contiguous();
  Tensor y = out_like(x, {}, op);
  // Reduced where x lives, into y: nothing waits.
  TALLY_DISPATCH(op, x, FLOATING, kk::sum_to<T>(x.numel(), x.data<T>(), TP(factor), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<SumBackward>();
    n->in_shape = x.shape();
    n->factor = factor;
    set_history(y, n, {&x_});
  }
  return y;
}
}  // namespace

Tensor sum(const Tensor& x) { return reduce_all(x, 1.0, "sum"); }
Tensor mean(const Tensor& x) {
  if (x.numel() == 0) throw ShapeError(fmt::format("mean: empty input {}", x.str()));
  return reduce_all(x, 1.0 / static_cast<double>(x.numel()), "mean");
}

// =============================================================================================
// cross entropy
namespace {
void check_ce(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& o) {
  const char* op = "cross_entropy";
  check_dim(op, "logits (N, C)", logits, 2);
  check_floating(op, logits);
  check_dim(op, "targets (N)", targets, 1);
  if (targets.dtype() != DType::Int64)
    throw ShapeError(fmt::format("cross_entropy: expected int64 targets, found {}", targets.str()));
  check_same_device(op, logits, targets);
  if (targets.size(0) != logits.size(0))
    throw ShapeError(fmt::format("cross_entropy: {} targets for {} rows of logits {}", targets.size(0), logits.size(0),
                                 logits.str()));
  if (o.label_smoothing < 0.0 || o.label_smoothing > 1.0)
    throw ShapeError(fmt::format("cross_entropy: label_smoothing must be in [0, 1], found {}", o.label_smoothing));
  if (o.weight.defined()) check_matching(op, logits, o.weight, "class weight", logits.size(1));
  if (o.divisor && !(*o.divisor > 0.0))
    throw ShapeError(fmt::format("cross_entropy: divisor must be positive, found {}", *o.divisor));
}

struct CrossEntropyBackward : Node {
  Saved<4> saved;  // logits, targets, weight, scale (a device scalar: d loss / d (sum_i loss_i))
  double label_smoothing;
  i64 ignore_index;
  const char* name() const override { return "cross_entropy"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    if (!g[0].needed) return;
    const Tensor &logits = saved.t[0], &targets = saved.t[1], &w = saved.t[2], &scale = saved.t[3];
    const i64 N = logits.size(0), C = logits.size(1);
    Tensor dloss = Tensor::empty({N}, logits.dtype(), logits.device(), Category::temporary, "cross_entropy_dloss");
    double beta = 0;
    Tensor& dx = grad_target(g[0], logits, beta, "cross_entropy");
    const Tensor dy = gy.contiguous();
    TALLY_DISPATCH("cross_entropy", logits, FULL_PRECISION, kk::fill_product<T>(N, dy.data<T>(), scale.data<T>(), dloss.data<T>()));
    TALLY_DISPATCH("cross_entropy", logits, FULL_PRECISION,
                   kk::cross_entropy_backward<T>(N, C, logits.data<T>(), targets.data<i64>(), ptr_or_null<T>(w),
                                                 ignore_index, T(label_smoothing), dloss.data<T>(), dx.data<T>(), T(beta)));
  }
};
}  // namespace

double cross_entropy_divisor(const Tensor& targets, const CrossEntropyOptions& o) {
  if (targets.dtype() != DType::Int64 || targets.dim() != 1)
    throw ShapeError(fmt::format("cross_entropy_divisor: expected int64 targets (N), found {}", targets.str()));
  const std::vector<i64> t = targets.to_vector<i64>();
  return cross_entropy_divisor(t.data(), static_cast<i64>(t.size()), o);
}

double cross_entropy_divisor(const i64* t, i64 n, const CrossEntropyOptions& o) {
  std::vector<double> w;
  if (o.weight.defined()) {
    if (o.weight.dtype() == DType::Float32) {
      auto f = o.weight.to_vector<float>();
      w.assign(f.begin(), f.end());
    } else {
      w = o.weight.to_vector<double>();
    }
  }
  double d = 0;
  for (i64 i = 0; i < n; ++i) {
    const i64 v = t[i];
    if (v == o.ignore_index) continue;
    if (!w.empty()) {
      if (v < 0 || v >= static_cast<i64>(w.size()))
        throw ShapeError(fmt::format("cross_entropy: target {} out of range [0, {})", v, w.size()));
      d += w[static_cast<std::size_t>(v)];
    } else {
      d += 1.0;
    }
  }
  return d;
}

Tensor cross_entropy(const Tensor& logits_, const Tensor& targets_, const CrossEntropyOptions& o) {
  // The loss is float32 whatever the logits: bfloat16 logits are converted first (an op with a
  // gradient, so dlogits comes back in bfloat16), as autocast runs cross_entropy in float32.
  if (logits_.defined() && logits_.dtype() == DType::BFloat16) return cross_entropy(cast(logits_, DType::Float32), targets_, o);
  check_ce(logits_, targets_, o);
  const Tensor logits = logits_.contiguous(), targets = targets_.contiguous();
  const Tensor w = o.weight.defined() ? o.weight.contiguous() : Tensor();
  const i64 N = logits.size(0), C = logits.size(1);
  Tensor y = out_like(logits, {}, "cross_entropy");
  // Per-sample losses and weights are scratch: the backward recomputes the softmax from logits.
  // The scale d loss / d (sum_i loss_i) stays on the device for the backward (the mean's
  // 1 / sum of weights is known only there).
  Tensor loss = Tensor::empty({N}, logits.dtype(), logits.device(), Category::temporary, "cross_entropy_loss");
  Tensor sw = Tensor::empty({N}, logits.dtype(), logits.device(), Category::temporary, "cross_entropy_weight");
  Tensor scale = Tensor::empty({}, logits.dtype(), logits.device(), Category::activation, "cross_entropy_scale");
  i64 bad = -1;  // stays -1 in a dry run, which runs no kernel
  TALLY_DISPATCH("cross_entropy", logits, FULL_PRECISION,
                      bad = kk::cross_entropy_forward<T>(N, C, logits.data<T>(), targets.data<i64>(), ptr_or_null<T>(w),
                                                         o.ignore_index, T(o.label_smoothing), loss.data<T>(), sw.data<T>(),
                                                         !o.targets_checked));
  if (bad >= 0)
    throw ShapeError(fmt::format("cross_entropy: target {} of sample {} is out of range [0, {}) and is not ignore_index {}",
                                 targets.to_vector<i64>()[static_cast<std::size_t>(bad)], bad, C, o.ignore_index));
  // A positive fixed scale (a divisor, or 1 for the sum); 0 asks for 1 / sum of weights (the
  // mean: 0/0 = NaN when every target is ignored, as PyTorch).
  const double fixed = o.divisor ? 1.0 / *o.divisor : o.reduction == Reduction::Mean ? 0.0 : 1.0;
  TALLY_DISPATCH("cross_entropy", logits, FULL_PRECISION,
                      kk::cross_entropy_reduce<T>(N, loss.data<T>(), sw.data<T>(), T(fixed), y.data<T>(), scale.data<T>()));
  if (any_requires_grad({&logits_})) {
    auto n = std::make_shared<CrossEntropyBackward>();
    n->saved.t = {logits, targets, w, scale};
    n->label_smoothing = o.label_smoothing;
    n->ignore_index = o.ignore_index;
    set_history(y, n, {&logits_});
  }
  return y;
}

void check_cross_entropy_targets(const i64* t, i64 n, i64 classes, i64 ignore_index) {
  for (i64 i = 0; i < n; ++i)
    if (t[i] != ignore_index && (t[i] < 0 || t[i] >= classes))
      throw ShapeError(fmt::format("cross_entropy: target {} of sample {} is out of range [0, {}) and is not ignore_index {}",
                                   t[i], i, classes, ignore_index));
}

}  // namespace tally
