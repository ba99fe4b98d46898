// core/ops_loss.cpp — cross entropy: forward, backward, autograd nodes (core/ops.h; the pattern is in core/ops.cpp).
#include "core/ops_internal.h"

namespace tally {
using namespace ops_detail;

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
