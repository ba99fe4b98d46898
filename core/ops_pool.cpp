// core/ops_pool.cpp — max and average pooling: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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
  // A channels-last input is pooled as it is, on both backends (ResNet's stem: the convolutions
  // after it stay channels-last).
  s.channels_last = x_.suggest_memory_format() == MemoryFormat::ChannelsLast;
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

}  // namespace tally
