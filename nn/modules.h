// nn/modules.h — the standard layers: thin Modules over the ops of core/ops.h.
//
// Names, shapes, defaults and initialization follow torch.nn, so state dicts interchange:
//   Conv2d       weight (out, in/groups, k, k), bias (out)    kaiming_uniform(a = sqrt(5))
//   Linear       weight (out, in), bias (out)                 kaiming_uniform(a = sqrt(5))
//                (biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)))
//   BatchNorm2d  weight 1, bias 0 (C); buffers running_mean 0, running_var 1 (C),
//                num_batches_tracked 0 (int64, shape [])
//   GroupNorm    weight 1, bias 0 (C)
//
// BatchNorm2d and micro-batching (see docs/mbp.md): PyTorch updates the running statistics
// once per forward. When the MBP executor splits a batch into k micro-batches, k forwards would
// update them k times with k small-batch statistics. Instead BatchNorm2d is a StepState
// (nn/module.h): the executor begins a step on it, runs the micro-batches (each normalizes with
// its own statistics and adds its moments to the step's), then apply() updates the running
// statistics exactly once, as if the whole batch had gone through in one forward.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "core/ops.h"
#include "nn/module.h"

namespace tally::nn {

class Conv2d : public Module {
 public:
  Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size, std::int64_t stride = 1,
         std::int64_t padding = 0, std::int64_t dilation = 1, std::int64_t groups = 1, bool bias = true);
  Tensor forward(const Tensor& x) override;  // (N, in, H, W) -> (N, out, P, Q)

  Tensor weight;  // (out, in / groups, k, k)
  Tensor bias;    // (out) or undefined
  std::int64_t in_channels, out_channels, kernel_size;
  Conv2dOptions options;
};

class Linear : public Module {
 public:
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true);
  Tensor forward(const Tensor& x) override;  // (N, in) -> (N, out)

  Tensor weight;  // (out, in)
  Tensor bias;    // (out) or undefined
  std::int64_t in_features, out_features;
};

class BatchNorm2d : public Module, public StepState {
 public:
  explicit BatchNorm2d(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1);
  // Training: batch statistics, running statistics updated and num_batches_tracked += 1 — or,
  // during an MBP step, the batch's moments added to the step's (below). Eval: running statistics.
  Tensor forward(const Tensor& x) override;
  // relu(forward(x) + residual) in one op (core/ops.h's fused batch norm; residual may be
  // undefined): the same values, gradients, statistics and MBP moments, fewer passes over memory.
  // x by value: a caller that moves its handle in lets a gradient-free run write y over x.
  Tensor forward_relu(Tensor x, const Tensor& residual = {});

  // The MBP step (module.h's StepState): training forwards add their per-channel moments (sums of
  // x and x^2, float64 tensors of category temporary on the module's device, allocated by the first
  // forward of the step — in dry runs too — and added to without a host wait); apply() updates
  // running_mean / running_var once, as PyTorch would for one batch of all of them
  // (batch_norm_update_running in core/ops.h), and num_batches_tracked += 1. A step in which no
  // training forward ran changes nothing.
  StepState* step_state() override { return this; }
  void begin_step() override;
  std::vector<Tensor> reducible() override;
  void scale_to_global(std::int64_t local_batch, std::int64_t global_batch) override;
  void apply() override;
  void discard() override;
  bool in_step() const { return in_step_; }
  std::int64_t step_count() const { return count_; }  // values per channel contributed so far

  Tensor weight, bias;              // (C)
  Tensor running_mean, running_var;  // (C), category parameter, no grad
  // Always a CPU int64 scalar (shape []), whatever device the module is on: a host-side counter
  // that nothing on the device reads, so incrementing it never launches a kernel (Module::to
  // leaves integer buffers on the CPU). Saved as I64 [] like PyTorch's.
  Tensor num_batches_tracked;
  std::int64_t num_features;
  double eps, momentum;

 private:
  void count_batch();
  Tensor normalize(Tensor x, const Tensor& residual, bool relu);
  bool in_step_ = false;
  Tensor sum_, sum_sq_;     // (C) float64: the step's sums of x and x^2 over every value seen
  std::int64_t count_ = 0;  // values per channel seen in the step
};

class GroupNorm : public Module {
 public:
  GroupNorm(std::int64_t num_groups, std::int64_t num_channels, double eps = 1e-5);
  Tensor forward(const Tensor& x) override;
  // relu(forward(x) + residual) as one op (core/ops.h group_norm's relu and residual); the unfused
  // ops when this module is recomputed on its own (its segment keeps x alone).
  Tensor forward_relu(const Tensor& x, const Tensor& residual = {});

  Tensor weight, bias;  // (C)
  std::int64_t num_groups, num_channels;
  double eps;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override { return relu(x); }
};

class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& x) override { return sigmoid(x); }
};

// Dropout (torch.nn.Dropout; docs/models.md, "Dropout"): in training mode dropout(x, p, seed, at)
// (core/ops.h), in eval mode x itself. Its mask depends on the layer's seed — drawn from nn's
// generator (nn/init.h) when the layer is made, so manual_seed reproduces it and two layers differ
// — on the training step and on each sample's index in the step's whole batch: inside the MBP
// executor (SampleScope) the executor's, so a micro-batched step equals the full batch and a
// recomputed segment draws the same mask; outside one, this layer's count of training forwards as
// the step and 0 as the first sample.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);  // an Error unless 0 <= p <= 1
  Tensor forward(const Tensor& x) override;
  double p() const { return p_; }
  std::uint64_t seed() const { return seed_; }

 private:
  double p_;
  std::uint64_t seed_;
  std::uint64_t calls_ = 0;  // training forwards outside an executor
};

class MaxPool2d : public Module {
 public:
  // stride defaults to kernel_size, as in PyTorch.
  explicit MaxPool2d(std::int64_t kernel_size, std::optional<std::int64_t> stride = std::nullopt,
                     std::int64_t padding = 0);
  Tensor forward(const Tensor& x) override;
  std::int64_t kernel_size, stride, padding;
};

class AdaptiveAvgPool2d : public Module {
 public:
  AdaptiveAvgPool2d(std::int64_t output_h, std::int64_t output_w);
  Tensor forward(const Tensor& x) override { return adaptive_avg_pool2d(x, {output_h, output_w}); }
  std::int64_t output_h, output_w;
};

class Flatten : public Module {
 public:
  explicit Flatten(std::int64_t start_dim = 1) : start_dim(start_dim) {}
  Tensor forward(const Tensor& x) override { return flatten(x, start_dim); }
  std::int64_t start_dim;
};

class Identity : public Module {
 public:
  Tensor forward(const Tensor& x) override { return x; }
};

// Children named "0", "1", ... in order; forward applies them in turn.
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  void push_back(std::shared_ptr<Module> module);
  Tensor forward(const Tensor& x) override;
  std::size_t size() const { return modules_.size(); }
  const std::shared_ptr<Module>& operator[](std::size_t i) const { return modules_.at(i); }
  // A Sequential's forward is the chain of its children, so it is cut where they meet without help:
  // one segment per child, a child that is a Sequential itself giving its own children's (a model
  // built as Sequential(stem, Sequential(blocks...), Sequential(blocks...), head) is cut at every
  // block). Named by each child's path below this module ("1.0"). A model of its own whose forward is
  // more than a chain overrides segments() (docs/models.md, "Segments without help").
  std::vector<Segment> segments() override;

 private:
  std::vector<std::shared_ptr<Module>> modules_;
};

// Every BatchNorm2d in the tree rooted at `root` (root included), in registration order.
std::vector<BatchNorm2d*> batch_norm_layers(Module& root);

}  // namespace tally::nn
