// core/ops_norm.cpp — batch norm and group norm, alone and fused with the residual add and ReLU: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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
  // Training keeps a channels-last x channels-last (x, y, dy and dx alike).
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
  // Training runs channels-last in place on both backends (x, the residual and y in x's layout);
  // evaluation takes row-major tensors.
  const MemoryFormat format = opt.training ? x_.suggest_memory_format() : MemoryFormat::Contiguous;
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

}  // namespace tally
