// core/ops_linear.cpp — linear and matmul: row-major GEMMs: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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

}  // namespace tally
