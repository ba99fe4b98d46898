// core/ops_elementwise.cpp — elementwise ops (ReLU, add, mul, sigmoid, ... and the in-place forms) and channel
// scaling: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ambient.h"
#include "core/graphs.h"
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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

// =============================================================================================
// sigmoid and channel scaling (squeeze-and-excitation)
namespace {
struct SigmoidBackward : Node {
  Saved<1> saved;  // y (the output: dx = dy * y * (1 - y))
  const char* name() const override { return "sigmoid"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor& y = saved.t[0];
    const Tensor dy = gy.contiguous(y.suggest_memory_format());
    double beta = 0;
    Tensor& dx = grad_target(g[0], y, beta, "sigmoid");
    TALLY_DISPATCH("sigmoid", y, FLOATING,
                   kk::sigmoid_backward<T>(y.numel(), dy.data<T>(), y.data<T>(), dx.data<T>(), TP(beta)));
  }
};

struct ScaleChannelsBackward : Node {
  Saved<2> saved;  // x (kept when s needs its gradient), s as (N, C) (kept when x needs its gradient)
  i64 N = 0, C = 0, HW = 0;
  MemoryFormat format = MemoryFormat::Contiguous;  // x's, y's, dy's and dx's
  Shape s_shape;
  const char* name() const override { return "scale_channels"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const char* op = "scale_channels";
    const bool cl = format == MemoryFormat::ChannelsLast;
    const Tensor dy = gy.contiguous(format);
    if (g[0].needed) {  // dx = dy * s
      double beta = 0;
      const Tensor& s = saved.t[1];
      Tensor& dx = grad_target(g[0], dy, beta, op);
      TALLY_DISPATCH(op, dy, FLOATING,
                     kk::scale_channels<T>(N, C, HW, cl, dy.data<T>(), s.data<T>(), dx.data<T>(), TP(beta)));
    }
    if (g[1].needed) {  // ds = sum over HW of dy * x
      double beta = 0;
      const Tensor& x = saved.t[0];
      Tensor& ds = grad_target(g[1], s_shape, dy.dtype(), dy.device(), beta, op);
      TALLY_DISPATCH(op, dy, FLOATING,
                     kk::scale_channels_backward_scale<T>(N, C, HW, cl, dy.data<T>(), x.data<T>(), ds.data<T>(),
                                                          TP(beta)));
    }
  }
};

// s's shape must be (N, C) or (N, C, 1, ...) with x's number of dimensions.
bool is_channel_scale_shape(const Tensor& x, const Tensor& s) {
  if (s.dim() < 2 || s.size(0) != x.size(0) || s.size(1) != x.size(1)) return false;
  if (s.dim() == 2) return true;
  if (s.dim() != x.dim()) return false;
  for (i64 d = 2; d < s.dim(); ++d)
    if (s.size(d) != 1) return false;
  return true;
}
}  // namespace

Tensor sigmoid(const Tensor& x_) {
  check_floating("sigmoid", x_);
  const Tensor x = dense(x_);
  Tensor y = out_like(x, x.shape(), "sigmoid", x.suggest_memory_format());
  TALLY_DISPATCH("sigmoid", x, FLOATING, kk::sigmoid_forward<T>(x.numel(), x.data<T>(), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<SigmoidBackward>();
    set_history(y, n, {&x_});
    n->saved.t[0] = y.detach();  // the node must not own a handle that points back at itself
  }
  return y;
}

Tensor scale_channels(const Tensor& x_, const Tensor& s_) {
  const char* op = "scale_channels";
  check_floating(op, x_);
  if (x_.dim() < 2) throw ShapeError(fmt::format("{}: expected x of shape (N, C, ...), found {}", op, x_.str()));
  if (!s_.defined()) throw ShapeError(fmt::format("{}: the scale s is undefined", op));
  check_same_device(op, x_, s_);
  check_same_dtype(op, x_, s_);
  if (!is_channel_scale_shape(x_, s_)) {
    Shape ones(static_cast<std::size_t>(x_.dim()), 1);
    ones[0] = x_.size(0), ones[1] = x_.size(1);
    throw ShapeError(fmt::format("{}: expected s of shape {} or [{}, {}] for x {}, found {}", op, shape_str(ones),
                                 x_.size(0), x_.size(1), x_.str(), s_.str()));
  }
  // In x's memory format (channels-last stays channels-last); s as (N, C) row-major.
  const MemoryFormat format = x_.suggest_memory_format();
  const bool cl = format == MemoryFormat::ChannelsLast;
  const Tensor x = x_.contiguous(format), s = s_.contiguous();
  const i64 N = x.size(0), C = x.size(1), HW = spatial(x);
  Tensor y = out_like(x, x.shape(), op, format);
  TALLY_DISPATCH(op, x, FLOATING,
                 kk::scale_channels<T>(N, C, HW, cl, x.data<T>(), s.data<T>(), y.data<T>(), TP(0)));
  if (any_requires_grad({&x_, &s_})) {
    auto n = std::make_shared<ScaleChannelsBackward>();
    // Each gradient needs the other operand only.
    if (any_requires_grad({&s_})) n->saved.t[0] = x.detach();
    if (any_requires_grad({&x_})) n->saved.t[1] = s.detach();
    n->N = N, n->C = C, n->HW = HW, n->format = format, n->s_shape = s_.shape();
    set_history(y, n, {&x_, &s_});
  }
  return y;
}

// ---- dropout ----

namespace {

struct DropoutBackward : Node {
  kernels::DropoutKey key;
  i64 N = 0, C = 0, HW = 0;
  MemoryFormat format = MemoryFormat::Contiguous;  // x's, y's, dy's and dx's
  const char* name() const override { return "dropout"; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const bool cl = format == MemoryFormat::ChannelsLast;
    const Tensor dy = gy.contiguous(format);
    double beta = 0;
    Tensor& dx = grad_target(g[0], dy, beta, "dropout");
    TALLY_DISPATCH("dropout", dy, FLOATING,
                   kk::dropout_backward<T>(N, C, HW, cl, key, dy.data<T>(), dx.data<T>(), TP(beta)));
  }
};

}  // namespace

Tensor dropout(const Tensor& x_, double p, std::uint64_t seed, SampleIndex at) {
  const char* op = "dropout";
  check_floating(op, x_);
  if (!(p >= 0 && p <= 1)) throw Error(fmt::format("{}: expected a probability p in [0, 1], found {}", op, p));
  if (x_.dim() < 1) throw ShapeError(fmt::format("{}: expected x of shape (N, ...), found {}", op, x_.str()));
  // The mask's counter (the samples, the step) is a kernel argument that changes from call to call.
  if (p > 0) not_replayable("dropout draws its mask from each call's sample index");
  const MemoryFormat format = x_.suggest_memory_format();
  const bool cl = format == MemoryFormat::ChannelsLast;
  const Tensor x = x_.contiguous(format);
  const i64 N = x.size(0), C = x.dim() >= 2 ? x.size(1) : 1, HW = N * C == 0 ? 0 : x.numel() / (N * C);
  const kernels::DropoutKey key = kernels::dropout_key(p, seed, at.step, at.first);
  Tensor y = out_like(x, x.shape(), op, format);
  TALLY_DISPATCH(op, x, FLOATING, kk::dropout_forward<T>(N, C, HW, cl, key, x.data<T>(), y.data<T>()));
  if (any_requires_grad({&x_})) {
    auto n = std::make_shared<DropoutBackward>();
    n->key = key, n->N = N, n->C = C, n->HW = HW, n->format = format;
    set_history(y, n, {&x_});
  }
  return y;
}

SampleScope::SampleScope(SampleIndex at) : previous_(detail::ambient().samples) { detail::ambient().samples = at; }
SampleScope::~SampleScope() { detail::ambient().samples = previous_; }
std::optional<SampleIndex> current_samples() { return detail::ambient().samples; }

void add_into(Tensor& dst, const Tensor& src_) {
  check_same_shape("add_into", dst, src_);
  const MemoryFormat format = dst.suggest_memory_format();
  if (!dst.is_contiguous(format))
    throw ShapeError(fmt::format("add_into: destination {} must be dense (contiguous or channels_last)", dst.str()));
  const Tensor src = src_.contiguous(format);
  TALLY_DISPATCH("add_into", dst, FLOATING, kk::axpby<T>(dst.numel(), TP(1), src.data<T>(), TP(1), dst.data<T>()));
}

}  // namespace tally
