// core/ops_conv.cpp — 2-D convolution (conv2d) and its gradients: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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

// A GPU convolution's operand as cuDNN may take it: `t` in `format`, and, where it is a view that
// does not start on a 16-byte boundary (a batch sliced at an odd sample size), a copy that does —
// the graph API's tensors promise cuDNN that alignment (kernels/cuda/conv.cu). Decided by offsets
// alone (every arena block starts aligned), so a dry run copies exactly where the step does.
Tensor conv_operand(const Tensor& t, MemoryFormat format) {
  Tensor c = t.contiguous(format);
  if (!c.device().is_cuda() || (static_cast<std::size_t>(c.offset()) * dtype_size(c.dtype())) % 16 == 0) return c;
  Tensor out = Tensor::empty(c.shape(), c.dtype(), c.device(), c.category(), "conv2d.aligned", format);
  out.copy_(c);
  return out;
}

struct Conv2dBackward : Node {
  Saved<2> saved;  // x, weight
  kernels::Conv2dShape s;
  bool has_bias;
  const char* name() const override { return "conv2d"; }
  void release() override { saved.release(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor &x = saved.t[0], &w = saved.t[1];
    const Tensor dy = conv_operand(gy, s.channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous);
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
  // (the CPU's oneDNN, CUDA's graph API; no bias); otherwise the convolution runs row-major.
  kernels::Conv2dShape s = conv_shape(x_, w_, o);
  s.bias = b.defined();
  if (x_.suggest_memory_format() == MemoryFormat::ChannelsLast)
    TALLY_DISPATCH_QUERY(op, x_, FLOATING,
                         s.channels_last = kk::conv2d_takes_channels_last<T>(s));
  const MemoryFormat format = s.channels_last ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  const Tensor x = conv_operand(x_, format), w = conv_operand(w_, MemoryFormat::Contiguous);
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

}  // namespace tally
