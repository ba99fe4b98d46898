// nn/modules.cpp — Conv2d, Linear, BatchNorm2d, GroupNorm, pools, Sequential.
#include "nn/modules.h"

#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "core/dry_run.h"
#include "core/graphs.h"
#include "core/memory.h"
#include "nn/init.h"

namespace tally::nn {

namespace {

Tensor new_parameter(const Shape& shape, const char* op) {
  return Tensor::zeros(shape, DType::Float32, Device::cpu(), Category::parameter, op);
}

void check_positive(const char* layer, const char* what, std::int64_t v, std::int64_t min = 1) {
  if (v < min) throw Error(fmt::format("{}: {} must be >= {}, found {}", layer, what, min, v));
}

// PyTorch's reset_parameters() of Conv2d and Linear.
void default_init(Tensor& weight, Tensor& bias) {
  kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const auto fan_in = fan_in_and_fan_out(weight).first;
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    uniform_(bias, -bound, bound);
  }
}

}  // namespace

// ---- Conv2d -------------------------------------------------------------------------------------
Conv2d::Conv2d(std::int64_t in, std::int64_t out, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
               std::int64_t dilation, std::int64_t groups, bool with_bias)
    : in_channels(in), out_channels(out), kernel_size(kernel) {
  check_positive("Conv2d", "in_channels", in);
  check_positive("Conv2d", "out_channels", out);
  check_positive("Conv2d", "kernel_size", kernel);
  check_positive("Conv2d", "stride", stride);
  check_positive("Conv2d", "padding", padding, 0);
  check_positive("Conv2d", "dilation", dilation);
  check_positive("Conv2d", "groups", groups);
  if (in % groups != 0 || out % groups != 0)
    throw Error(fmt::format("Conv2d: groups ({}) must divide in_channels ({}) and out_channels ({})", groups, in, out));
  options.stride = {stride, stride};
  options.padding = {padding, padding};
  options.dilation = {dilation, dilation};
  options.groups = groups;
  weight = register_parameter("weight", new_parameter({out, in / groups, kernel, kernel}, "conv2d.weight"));
  if (with_bias) bias = register_parameter("bias", new_parameter({out}, "conv2d.bias"));
  default_init(weight, bias);
}

Tensor Conv2d::forward(const Tensor& x) { return conv2d(x, weight, bias, options); }

// ---- Linear -------------------------------------------------------------------------------------
Linear::Linear(std::int64_t in, std::int64_t out, bool with_bias) : in_features(in), out_features(out) {
  check_positive("Linear", "in_features", in);
  check_positive("Linear", "out_features", out);
  weight = register_parameter("weight", new_parameter({out, in}, "linear.weight"));
  if (with_bias) bias = register_parameter("bias", new_parameter({out}, "linear.bias"));
  default_init(weight, bias);
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight, bias); }

// ---- BatchNorm2d --------------------------------------------------------------------------------
BatchNorm2d::BatchNorm2d(std::int64_t c, double eps_, double momentum_) : num_features(c), eps(eps_), momentum(momentum_) {
  check_positive("BatchNorm2d", "num_features", c);
  weight = register_parameter("weight", Tensor::full({c}, 1.0, DType::Float32, Device::cpu(), Category::parameter, "bn.weight"));
  bias = register_parameter("bias", new_parameter({c}, "bn.bias"));
  running_mean = register_buffer("running_mean", new_parameter({c}, "bn.running_mean"));
  running_var = register_buffer("running_var",
                                Tensor::full({c}, 1.0, DType::Float32, Device::cpu(), Category::parameter, "bn.running_var"));
  num_batches_tracked = register_buffer(
      "num_batches_tracked", Tensor::zeros({}, DType::Int64, Device::cpu(), Category::parameter, "bn.num_batches_tracked"));
}

void BatchNorm2d::count_batch() {
  if (skip_side_effects()) return;  // a dry run changes no state
  num_batches_tracked.data<std::int64_t>()[0] += 1;
}

Tensor BatchNorm2d::forward(const Tensor& x) { return normalize(x, Tensor(), false); }

Tensor BatchNorm2d::forward_relu(Tensor x, const Tensor& residual) {
  if (recompute()) {  // a segment of its own keeps only x: the residual's gradient needs the unfused ops
    Tensor y = (*this)(x);
    if (residual.defined()) y = add(std::move(y), residual);
    return relu(std::move(y));
  }
  return observed([&] { return normalize(std::move(x), residual, true); });
}

Tensor BatchNorm2d::normalize(Tensor x, const Tensor& residual, bool relu) {
  if (x.defined() && x.dim() != 4)
    throw ShapeError(fmt::format("BatchNorm2d: expected input (N, C, H, W), found {}", x.str()));
  BatchNormOptions opt;
  opt.training = is_training();
  opt.momentum = momentum;
  opt.eps = eps;
  opt.relu = relu;
  if (is_training() && recomputing()) {
    // The forward re-run of a recomputed segment: the batch's statistics again (the same input,
    // so the same values), but the running statistics and the step's moments were counted the
    // first time.
    return batch_norm(x, weight, bias, Tensor(), Tensor(), opt, residual);
  }
  const std::int64_t values = x.defined() ? x.size(0) * x.size(2) * x.size(3) : 0;
  const Device device = x.defined() ? x.device() : Device::cpu();  // x may be given up below
  if (!is_training() || !in_step_) {
    Tensor y = batch_norm_with_stats(std::move(x), weight, bias, running_mean, running_var, opt, residual).y;
    if (is_training()) count_batch();
    return y;
  }
  BatchNormResult r = batch_norm_with_stats(std::move(x), weight, bias, Tensor(), Tensor(), opt, residual);
  if (!sum_.defined()) {  // the step's first forward allocates the sums (a dry run too)
    sum_ = Tensor::zeros({num_features}, DType::Float64, device, Category::temporary, "batch_norm_moments");
    sum_sq_ = Tensor::zeros({num_features}, DType::Float64, device, Category::temporary, "batch_norm_moments");
  }
  batch_norm_add_moments(r.mean, r.invstd, eps, values, sum_, sum_sq_);
  count_ += values;
  on_replay([this, values] { count_ += values; });  // recorded device work (core/graphs.h) counts again
  return std::move(r.y);
}

void BatchNorm2d::begin_step() {
  discard();
  in_step_ = true;
}

std::vector<Tensor> BatchNorm2d::reducible() {
  if (!sum_.defined()) return {};
  return {sum_, sum_sq_};
}

void BatchNorm2d::scale_to_global(std::int64_t local_batch, std::int64_t global_batch) {
  // Every sample adds the same number of values per channel (H * W), so the global count follows
  // from the batch sizes without a collective.
  if (count_ == 0) return;
  if (local_batch < 1 || count_ % local_batch != 0)
    throw Error(fmt::format("BatchNorm2d: saw {} values per channel for {} samples", count_, local_batch));
  count_ = count_ / local_batch * global_batch;
}

void BatchNorm2d::apply() {
  // Where the statistics live: on a GPU nothing waits.
  if (count_ > 0) {
    batch_norm_update_running(sum_, sum_sq_, count_, momentum, running_mean, running_var);
    count_batch();
  }
  discard();
}

void BatchNorm2d::discard() {
  in_step_ = false;
  sum_ = Tensor();
  sum_sq_ = Tensor();
  count_ = 0;
}

// ---- GroupNorm ----------------------------------------------------------------------------------
GroupNorm::GroupNorm(std::int64_t groups, std::int64_t c, double eps_) : num_groups(groups), num_channels(c), eps(eps_) {
  check_positive("GroupNorm", "num_groups", groups);
  check_positive("GroupNorm", "num_channels", c);
  if (c % groups != 0)
    throw Error(fmt::format("GroupNorm: num_groups ({}) must divide num_channels ({})", groups, c));
  weight = register_parameter("weight", Tensor::full({c}, 1.0, DType::Float32, Device::cpu(), Category::parameter, "gn.weight"));
  bias = register_parameter("bias", new_parameter({c}, "gn.bias"));
}

Tensor GroupNorm::forward(const Tensor& x) { return group_norm(x, num_groups, weight, bias, eps); }

Tensor GroupNorm::forward_relu(const Tensor& x, const Tensor& residual) {
  if (recompute()) {
    Tensor y = (*this)(x);
    if (residual.defined()) y = add(std::move(y), residual);
    return relu(std::move(y));
  }
  return observed([&] { return group_norm(x, num_groups, weight, bias, eps, true, residual); });
}

// ---- pooling ------------------------------------------------------------------------------------
MaxPool2d::MaxPool2d(std::int64_t k, std::optional<std::int64_t> s, std::int64_t p)
    : kernel_size(k), stride(s.value_or(k)), padding(p) {
  check_positive("MaxPool2d", "kernel_size", kernel_size);
  check_positive("MaxPool2d", "stride", stride);
  check_positive("MaxPool2d", "padding", padding, 0);
}

Tensor MaxPool2d::forward(const Tensor& x) {
  return max_pool2d(x, {kernel_size, kernel_size}, {stride, stride}, {padding, padding});
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::int64_t oh, std::int64_t ow) : output_h(oh), output_w(ow) {
  check_positive("AdaptiveAvgPool2d", "output_h", oh);
  check_positive("AdaptiveAvgPool2d", "output_w", ow);
}

// ---- Sequential ---------------------------------------------------------------------------------
Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const auto& m : modules) push_back(m);
}

void Sequential::push_back(std::shared_ptr<Module> module) {
  register_module(std::to_string(modules_.size()), module);
  modules_.push_back(std::move(module));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& m : modules_) y = (*m)(y);
  return y;
}

std::vector<Module::Segment> Sequential::segments() {
  std::vector<Segment> out;
  for (std::size_t i = 0; i < modules_.size(); ++i) {
    const std::shared_ptr<Module>& m = modules_[i];
    if (auto* inner = dynamic_cast<Sequential*>(m.get())) {
      for (Segment& s : inner->segments()) out.push_back({fmt::format("{}.{}", i, s.name), std::move(s.modules),
                                                          std::move(s.forward)});
    } else {
      Module* child = m.get();
      out.push_back({std::to_string(i), {child}, [child](const Tensor& x) { return (*child)(x); }});
    }
  }
  return out;
}

// ---- helpers ------------------------------------------------------------------------------------
namespace {
void find_batch_norms(Module& m, std::vector<BatchNorm2d*>& out) {
  if (auto* bn = dynamic_cast<BatchNorm2d*>(&m)) out.push_back(bn);
  for (auto& [name, child] : m.named_children()) find_batch_norms(*child, out);
}
}  // namespace

std::vector<BatchNorm2d*> batch_norm_layers(Module& root) {
  std::vector<BatchNorm2d*> out;
  find_batch_norms(root, out);
  return out;
}

}  // namespace tally::nn

namespace tally::nn {

Dropout::Dropout(double p) : p_(p), seed_(default_generator()()) {
  if (!(p >= 0 && p <= 1)) throw Error(fmt::format("Dropout: expected a probability p in [0, 1], found {}", p));
}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p_ == 0) return x;
  if (const std::optional<SampleIndex> at = current_samples()) return dropout(x, p_, seed_, *at);
  return dropout(x, p_, seed_, SampleIndex{calls_++, 0});
}

}  // namespace tally::nn
