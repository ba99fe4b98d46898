// core/ops_shape.cpp — shape ops (reshape, flatten, concat) and reductions: forward, backward, autograd nodes
// (core/ops.h; the pattern is in core/ops.cpp).
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
// concat (along the channels)
namespace {
// One input's slice of the output as the kernels copy it: `rows` rows of `cols` values, dense in
// the input and `ld` apart in the output, from `offset` on. Row-major (N, C, inner): a sample's
// Ci * inner values; channels-last (N, HW, C): a position's Ci channels.
struct ConcatSlice {
  i64 rows, cols, ld, offset;
};
ConcatSlice concat_slice(i64 N, i64 inner, i64 channels, i64 total_channels, i64 first_channel, bool channels_last) {
  if (channels_last) return {N * inner, channels, total_channels, first_channel};
  return {N, channels * inner, total_channels * inner, first_channel * inner};
}

struct ConcatBackward : Node {
  std::vector<Shape> shapes;         // the inputs'
  std::vector<i64> first_channel;    // where each input starts in the output's channels
  i64 N = 0, inner = 0, total_channels = 0;
  MemoryFormat format = MemoryFormat::Contiguous;  // the output's, dy's and every dx's
  DType dtype = DType::Float32;
  Device device;
  const char* name() const override { return "concat"; }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override {
    const Tensor dy = gy.contiguous(format);
    const bool cl = format == MemoryFormat::ChannelsLast;
    for (std::size_t i = 0; i < g.size(); ++i) {
      if (!g[i].needed) continue;
      double beta = 0;
      Tensor& dx = grad_target(g[i], shapes[i], dtype, device, beta, "concat", format);
      const ConcatSlice c = concat_slice(N, inner, shapes[i][1], total_channels, first_channel[i], cl);
      TALLY_DISPATCH("concat", dy, FLOATING,
                     kk::copy_rows<T>(c.rows, c.cols, dy.data<T>() + c.offset, c.ld, dx.data<T>(), c.cols, TP(beta)));
    }
  }
};

// "[2, *, 5, 5]": the shape every input must have, any size in dim 1.
std::string concat_expected(const Shape& s) {
  std::string out = "[";
  for (std::size_t d = 0; d < s.size(); ++d)
    out += (d ? ", " : "") + (d == 1 ? std::string("*") : std::to_string(s[d]));
  return out + "]";
}
}  // namespace

Tensor concat(const std::vector<Tensor>& tensors, i64 dim) {
  const char* op = "concat";
  if (tensors.empty()) throw ShapeError("concat: no tensors to join");
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].defined()) throw ShapeError(fmt::format("concat: input {} is undefined", i));
  const Tensor& first = tensors[0];
  check_floating(op, first);
  if (first.dim() < 2)
    throw ShapeError(fmt::format("concat: expected tensors of shape (N, C, ...), found input 0 {}", first.str()));
  if ((dim < 0 ? dim + first.dim() : dim) != 1)
    throw ShapeError(
        fmt::format("concat: joins along dim 1 (the channels) only, found dim {} for {}", dim, first.str()));
  // The one memory format: channels-last when an input is, and then every input dense row-major
  // only (not channels-last) is a mismatch; an input dense in neither layout is converted.
  std::size_t cl_input = tensors.size();
  for (std::size_t i = 0; i < tensors.size() && cl_input == tensors.size(); ++i)
    if (tensors[i].suggest_memory_format() == MemoryFormat::ChannelsLast) cl_input = i;
  const MemoryFormat format = cl_input < tensors.size() ? MemoryFormat::ChannelsLast : MemoryFormat::Contiguous;
  std::vector<Tensor> xs;
  i64 total_channels = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    check_same_device(op, first, t);
    check_same_dtype(op, first, t);
    bool same = t.dim() == first.dim();
    for (i64 d = 0; same && d < t.dim(); ++d) same = d == 1 || t.size(d) == first.size(d);
    if (!same)
      throw ShapeError(fmt::format("concat: input {} has shape {}, expected {} (input 0 is {}; only dim 1 may differ)",
                                   i, shape_str(t.shape()), concat_expected(first.shape()), first.str()));
    if (!t.is_contiguous(format) && (t.is_contiguous() || t.is_contiguous(MemoryFormat::ChannelsLast)))
      throw ShapeError(fmt::format("concat: the inputs must share one memory format: expected {} (as input {}), "
                                   "found {} at input {} {}",
                                   memory_format_name(format), cl_input, memory_format_name(t.suggest_memory_format()),
                                   i, t.str()));
    xs.push_back(t.contiguous(format));
    total_channels += t.size(1);
  }
  const i64 N = first.size(0), inner = spatial(first);
  const bool cl = format == MemoryFormat::ChannelsLast;
  Shape out_shape = first.shape();
  out_shape[1] = total_channels;
  Tensor y = out_like(first, out_shape, op, format);
  std::vector<i64> first_channel;
  i64 channel = 0;
  for (const Tensor& x : xs) {
    const ConcatSlice c = concat_slice(N, inner, x.size(1), total_channels, channel, cl);
    TALLY_DISPATCH(op, x, FLOATING,
                   kk::copy_rows<T>(c.rows, c.cols, x.data<T>(), c.cols, y.data<T>() + c.offset, c.ld, TP(0)));
    first_channel.push_back(channel);
    channel += x.size(1);
  }
  if (any_requires_grad(tensors)) {
    auto n = std::make_shared<ConcatBackward>();
    for (const Tensor& t : tensors) n->shapes.push_back(t.shape());
    n->first_channel = std::move(first_channel);
    n->N = N, n->inner = inner, n->total_channels = total_channels, n->format = format;
    n->dtype = first.dtype(), n->device = first.device();
    set_history(y, n, tensors);
  }
  return y;
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
