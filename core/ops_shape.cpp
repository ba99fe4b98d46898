// core/ops_shape.cpp — shape ops and reductions: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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

}  // namespace tally
