// core/ops.h — the differentiable operations, one API for every device.
//
// Each op checks its operands (shape, dtype, device; a mismatch throws ShapeError naming the op
// and the operands), allocates its output (category activation) from the current arena of the
// operands' device, dispatches to kernels/cpu or kernels/cuda (core/dispatch.h), and — when grad
// mode is on and an input requires grad — records a Node whose saved tensors are category
// activation. In a dry run (core/memory.h) everything is allocated exactly as in a real run and
// no kernel runs. Inputs that are not contiguous are made contiguous first.
// Semantics and defaults follow PyTorch's torch.nn.functional.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/tensor.h"

namespace tally {

// ---- convolution and linear algebra ------------------------------------------------------------
struct Conv2dOptions {
  std::array<std::int64_t, 2> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  std::int64_t groups = 1;
};
// x (N, C, H, W), weight (K, C/groups, R, S), bias (K) or undefined -> (N, K, P, Q).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = {}, const Conv2dOptions& opt = {});
// x (N, in), weight (out, in), bias (out) or undefined -> x weight^T + bias (N, out).
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
// a (M, K) @ b (K, N) -> (M, N).
Tensor matmul(const Tensor& a, const Tensor& b);

// ---- normalization ----------------------------------------------------------------------------
struct BatchNormOptions {
  bool training = true;
  double momentum = 0.1;
  double eps = 1e-5;
  // Fused after the norm: y = relu(batch_norm(x) + residual) — the residual add and the ReLU ride
  // on the normalizing pass, and in backward ReLU's mask on the norm's passes, which hand the
  // residual its gradient (dz) too. Values and gradients are the unfused ops' bit for bit (the
  // residual added to the normalized value rounded to x's dtype, then relu's NaN-passing ReLU).
  // Its backward keeps x, the statistics and y (the next layer's input, kept by it anyway): no
  // more than the unfused ops. In eval mode the unfused ops run.
  bool relu = false;
};
// x (N, C, ...) ; weight, bias (C) or undefined ; running_mean/var (C) or undefined.
// Training: normalizes with batch statistics and updates the running statistics in place if given
// (unbiased variance); it never tracks num_batches_tracked itself (the module does).
// `residual` (x's shape, dtype and device, or undefined) is added before the ReLU (above).
Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, const BatchNormOptions& opt = {}, const Tensor& residual = {});
// batch_norm, and in training the batch statistics it normalized with (torch.native_batch_norm's
// save_mean and save_invstd): per channel the mean and 1 / sqrt(biased variance + eps), the
// activations its backward keeps; undefined in eval mode.
struct BatchNormResult {
  Tensor y, mean, invstd;
};
BatchNormResult batch_norm_with_stats(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                      const Tensor& running_mean, const Tensor& running_var,
                                      const BatchNormOptions& opt = {}, const Tensor& residual = {});
// The same on an x whose handle the caller gives up (as relu(Tensor&&)): when nothing else holds
// its buffer and no gradient is recorded (a recomputed segment's first run, evaluation), y is
// written over x — one buffer instead of two.
BatchNormResult batch_norm_with_stats(Tensor&& x, const Tensor& weight, const Tensor& bias,
                                      const Tensor& running_mean, const Tensor& running_var,
                                      const BatchNormOptions& opt = {}, const Tensor& residual = {});
// Moments over several batches (no gradient): adds one batch's, from its statistics over `count`
// values per channel, to float64 (C) sums on the statistics' device — sum += count * mean,
// sum_sq += count * (var + mean^2), var = 1 / invstd^2 - eps — without a host wait.
void batch_norm_add_moments(const Tensor& mean, const Tensor& invstd, double eps, std::int64_t count, Tensor& sum,
                            Tensor& sum_sq);
// The running statistics updated once as PyTorch would for one batch of `count` values per channel
// whose sums are sum, sum_sq: mean = sum / count, biased var = sum_sq / count - mean^2,
// running_var takes the unbiased var * count / (count - 1), with `momentum` (no gradient).
void batch_norm_update_running(const Tensor& sum, const Tensor& sum_sq, std::int64_t count, double momentum,
                               Tensor& running_mean, Tensor& running_var);
// x (N, C, ...), groups dividing C, weight/bias (C) or undefined. With `relu` and/or a `residual`
// (x's shape), fused as batch_norm's: y = relu(group_norm(x) + residual) in the normalizing pass,
// ReLU's mask and the residual's gradient inside the norm's backward passes; values and gradients
// the unfused ops' bit for bit. Row-major (a channels-last x is converted first).
Tensor group_norm(const Tensor& x, std::int64_t groups, const Tensor& weight = {}, const Tensor& bias = {},
                  double eps = 1e-5, bool relu = false, const Tensor& residual = {});

// ---- work --------------------------------------------------------------------------------------
// Floating-point operations of the convolutions and matrix products run on this thread, 2 per
// multiply-add, counted from the shapes — dry runs count what a real run would compute (the
// planner reports a step's work, and what recomputation adds, without running it). Forward work
// done while a recomputed segment re-runs (recomputing(), core/autograd.h) counts as recompute;
// the gradient GEMMs and convolutions of backward as backward. Other ops (norms, elementwise)
// are not counted: in a ResNet they are well under 1% of these.
struct FlopCount {
  double forward = 0, recompute = 0, backward = 0;
  double total() const { return forward + recompute + backward; }
};
FlopCount& flop_count();  // this thread's; assign {} to start over

// ---- elementwise --------------------------------------------------------------------------------
// x converted to `dtype` (float32, float64 and bfloat16 to one another; same category), with a
// gradient: the output's gradient converted back to x's dtype. Tensor::to(DType) is this op.
Tensor cast(const Tensor& x, DType dtype);
Tensor relu(const Tensor& x);
Tensor add(const Tensor& a, const Tensor& b);  // same shape (residual add)
// The same ops on a tensor whose handle the caller gives up (a temporary, or std::move(t)): the
// output takes its buffer when nothing else holds that buffer (no saved tensor, view or copy of
// it; not a leaf requiring grad) — torch's inplace ReLU and `out += identity` without the
// version-counter errors: when the buffer is shared, the op runs out of place. The caller must
// not use the given-up handle afterwards. Values and gradients are those of the out-of-place op.
Tensor relu(Tensor&& x);
Tensor add(Tensor&& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);  // same shape
Tensor scale(const Tensor& x, double alpha);
// The logistic function 1 / (1 + exp(-x)), any shape, computed without overflow for any |x|; its
// backward keeps the output y: dx = dy * y * (1 - y).
Tensor sigmoid(const Tensor& x);
// Squeeze-and-excitation's channel scaling: x (N, C, ...) times s (N, C, 1, 1) or (N, C), one
// factor per sample and channel, y[n, c, ...] = x[n, c, ...] * s[n, c]. s has x's dtype and device
// (an activation: bfloat16 with bfloat16 x). y has x's memory format (row-major or channels-last).
// Backward: dx = dy * s; ds[n, c] = the sum over the spatial positions of dy * x, in double.
Tensor scale_channels(const Tensor& x, const Tensor& s);
// Dropout (docs/models.md, "Dropout"): y = x * m with m = 1 / (1 - p) for the elements kept and 0
// for those dropped (probability p, 0 <= p <= 1), the mask a counter-based function of the layer's
// `seed`, the training step and each element's sample in the step's whole batch (`at`) and place
// in its sample (kernels/common.h: dropout_keeps) — nothing saved for the backward, which draws
// the same mask. Any shape (N, ...), either memory format (the same elements kept in both).
struct SampleIndex {
  std::uint64_t step = 0;   // the training step (the optimizer's count of steps done)
  std::int64_t first = 0;   // the index of the tensor's first sample in the step's whole batch
};
Tensor dropout(const Tensor& x, double p, std::uint64_t seed, SampleIndex at);
// The samples a forward runs on, for ops whose randomness must not depend on how a batch is split:
// the MBP executor sets it around each micro-batch (its step, and the micro-batch's first sample
// in the step's batch across micro-batches, ranks and pipeline stages); none outside one.
class SampleScope {
 public:
  explicit SampleScope(SampleIndex at);
  ~SampleScope();
  SampleScope(const SampleScope&) = delete;
  SampleScope& operator=(const SampleScope&) = delete;

 private:
  std::optional<SampleIndex> previous_;
};
std::optional<SampleIndex> current_samples();
// dst += src (same shape, dtype, device), no autograd: gradient accumulation.
void add_into(Tensor& dst, const Tensor& src);

// ---- pooling and shape ------------------------------------------------------------------------
Tensor max_pool2d(const Tensor& x, std::array<std::int64_t, 2> kernel, std::array<std::int64_t, 2> stride,
                  std::array<std::int64_t, 2> padding = {0, 0});
Tensor avg_pool2d(const Tensor& x, std::array<std::int64_t, 2> kernel, std::array<std::int64_t, 2> stride,
                  std::array<std::int64_t, 2> padding = {0, 0}, bool count_include_pad = true);
Tensor adaptive_avg_pool2d(const Tensor& x, std::array<std::int64_t, 2> output_size);
Tensor flatten(const Tensor& x, std::int64_t start_dim = 1);
Tensor reshape(const Tensor& x, const Shape& shape);  // differentiable view/copy
// torch.cat along the channels: (N, Ci, ...) tensors of one dtype and device, equal in every
// dimension but 1 -> (N, C0 + C1 + ..., ...); dim must be 1 (or -3 of 4-d tensors). The inputs
// share one memory format, which the output has (channels-last 4-d tensors give channels-last; a
// tensor dense in neither layout, a view, is converted first); a mismatch of shapes or formats
// is a ShapeError naming the input, what was expected and what was found. Backward hands each
// input its slice of the gradient.
Tensor concat(const std::vector<Tensor>& tensors, std::int64_t dim = 1);

// ---- reductions and loss ------------------------------------------------------------------------
Tensor sum(const Tensor& x);   // scalar (shape [])
Tensor mean(const Tensor& x);  // scalar

enum class Reduction { Mean, Sum };
struct CrossEntropyOptions {
  Reduction reduction = Reduction::Mean;
  double label_smoothing = 0.0;
  std::int64_t ignore_index = -100;
  Tensor weight;  // per-class weights (C) or undefined
  // MBP loss normalization: if set, the result is sum_i w_i * loss_i / *divisor whatever the
  // reduction (the divisor is the whole batch's count of weighted targets), see docs/mbp.md.
  std::optional<double> divisor;
  // The caller has checked every target (in [0, C) or ignore_index) on the host: on a GPU the op
  // then never waits for the device. Unset, an invalid target is a ShapeError, which on a GPU
  // costs one wait for the targets.
  bool targets_checked = false;
};
// Throws ShapeError naming the first of n host targets that is neither in [0, classes) nor
// ignore_index (what cross_entropy would report).
void check_cross_entropy_targets(const std::int64_t* targets, std::int64_t n, std::int64_t classes,
                                 std::int64_t ignore_index);
// logits (N, C), targets int64 (N) -> scalar.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, const CrossEntropyOptions& opt = {});
// The mean reduction's denominator for these targets: sum over kept samples of weight[target]
// (the number of non-ignored targets without class weights). Computed on the host.
double cross_entropy_divisor(const Tensor& targets, const CrossEntropyOptions& opt);
// The same over n host targets (the MBP executor counts the whole batch before splitting it).
double cross_entropy_divisor(const std::int64_t* targets, std::int64_t n, const CrossEntropyOptions& opt);

}  // namespace tally
