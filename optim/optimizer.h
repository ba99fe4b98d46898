// optim/optimizer.h — optimizers with persistent state: SGD (momentum, Nesterov) and AdamW.
//
// Usage, as with torch.optim:
//   optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});
//   loss.backward(); opt.step(); opt.zero_grad();
//
// Semantics are torch.optim's single-tensor path (PyTorch 1.13, amsgrad/maximize off); the
// formulas are in kernels/cpu/optim.cpp. Every parameter is updated on every step from its
// persistent gradient buffer (Tensor::allocate_grad, which nn::Module parameters have from the
// start), so — unlike PyTorch, which skips a parameter whose .grad is None — a parameter without
// a gradient buffer is an error at construction.
//
// Memory: all optimizer state is allocated once — in the constructor (StateCreation::now, the
// default), or, for a step whose chooser puts it in a tier first (StateCreation::when_placed;
// mbp/executor.h), by create_state() where the configuration says, never on the device first —
// from the current arena of each parameter's device (or the host tier's arena) with category optimizer_state (SGD: one momentum buffer per parameter
// when momentum != 0; AdamW: exp_avg and exp_avg_sq per parameter). Memory planning therefore
// sees it before the first step, and step() allocates nothing. SGD's buffers start
// uninitialised: the kernel's first_step flag makes the first step write buf = g without reading
// it (PyTorch's "buf = clone(grad) when there is no buffer yet"). AdamW's moments start at zero,
// as PyTorch's do (its first update reads them).
//
// Dry run (core/memory.h): step() checks shapes, dtypes and devices and computes nothing —
// parameters, state and steps() are left as they were (so the next real step is still "first")
// — and zero_grad() writes nothing; neither allocates, as in a real run. Like ops, a dry run
// does not ask for a kernel, so a dry-run step of CUDA parameters succeeds.
//
// step() checks every parameter before updating any: a failing step changes nothing.
//
// Step counter: steps() counts completed real steps; AdamW's bias correction uses t = steps()+1
// and SGD's first step is steps() == 0. The learning rate can change between steps (set_lr,
// e.g. from an optim::LRSchedule: opt.set_lr(schedule.lr_at(opt.steps()))).
//
// Devices: CPU parameters (float32 or float64, contiguous) run kernels::cpu::sgd_update /
// adamw_update; CUDA parameters (float32) get their state on the GPU at construction and run the
// fused kernels::cuda twins, enqueued on the compute stream (step() does not wait for them).
//
// Host placement (place_state; docs/host-tier.md): the state moves into an arena of host memory
// (the host tier's), values kept, and step() updates each parameter on the CPU, one at a time:
// its gradient and its value are copied into two staging buffers of the host tier's current arena
// (core/memory.h: current_host_arena, else the state's arena), the CPU kernel runs there, and the
// value is copied back; the staging is freed before the next parameter, so the host tier holds
// the state and the staging of the largest parameter (host_bytes). The parameters stay
// where they are and remain the truth: a checkpoint, a resume or a write to a parameter between
// steps needs nothing else. On the CPU device the update is the same kernel on the same values,
// so the parameters are bit-identical to the unplaced optimizer's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace tally::optim {

// torch.optim.SGD's options and defaults (lr has no default there; 0.1 here).
struct SGDOptions {
  double lr = 0.1, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
};

// torch.optim.AdamW's options and defaults (betas = (beta1, beta2)).
struct AdamWOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
};

// When an optimizer allocates its state: in its constructor, beside the parameters (as
// torch.optim's first step would), or when create_state() names the tier (the executor, once the
// chooser has placed it: a budget below parameters + gradients + state then works whenever the
// chosen configuration fits).
enum class StateCreation { now, when_placed };

class Optimizer {
 public:
  // Checks the parameters: at least one; each defined, float32 or float64, contiguous, with a
  // gradient buffer of the same shape, dtype and device, and none listed twice. Throws
  // tally::Error naming the parameter (by index and description) otherwise.
  explicit Optimizer(std::vector<Tensor> params) : Optimizer("Optimizer", std::move(params)) {}
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter from its .grad() (on the host for placed state).
  void step();
  // Zero-fills every parameter's persistent gradient buffer (the buffers are kept).
  void zero_grad();

  double lr() const { return lr_; }
  void set_lr(double lr);  // lr >= 0 and finite, else tally::Error
  std::int64_t steps() const { return steps_; }  // completed (real) steps
  // Bytes of optimizer state (the tensors' sizes; the arena rounds each up to 256 bytes), created
  // or not.
  std::size_t state_bytes() const;
  // Whether the state exists (always, unless built with StateCreation::when_placed and not created).
  bool state_created() const { return created_; }
  // Creates the state (StateCreation::when_placed) in `host` (an arena of host memory: placed as
  // place_state(host) would, without passing through the device) or beside the parameters when
  // null, in creation order; a no-op when it exists.
  void create_state(std::shared_ptr<Arena> host);
  // Each state tensor's size in creation order, created or not (as asked of the arena):
  // what creating it, or moving it, does to an arena — the chooser's simulation (mbp/chooser.h).
  std::vector<std::size_t> state_tensor_bytes() const;
  const std::vector<Tensor>& params() const { return params_; }
  const std::string& name() const { return name_; }

  // Checkpoints (mbp/checkpoint.h): every state tensor under "<what>.<i>" (e.g.
  // "momentum_buffer.3", "exp_avg_sq.0": what, for parameter i), in creation order. Writing into
  // these tensors and set_steps() restores a saved optimizer exactly.
  const std::vector<std::pair<std::string, Tensor>>& named_state() const { return named_state_; }
  void set_steps(std::int64_t steps);  // steps >= 0, else tally::Error

  // Moves every state tensor into `host` (an arena of host memory: the host tier's), values kept,
  // or back beside each parameter, into the current arena of its device, when `host` is null. A
  // no-op when the state is there already. Between steps only.
  void place_state(std::shared_ptr<Arena> host);
  // The host arena the state lives in (null: beside the parameters).
  const std::shared_ptr<Arena>& state_host() const { return host_; }
  // Moves every parameter's gradient into `host` as the optimizer's gradient accumulators (values
  // kept; the parameters keep no gradient buffer: the host tier's accumulation fills these,
  // mbp/host_gradients.h), or back into gradient buffers beside the parameters, in the current
  // arena of their device, when `host` is null. Needs the state on the host (place_state) first,
  // and back last. step() then reads the accumulators, zero_grad() zeroes them. Between steps only.
  void place_gradients(std::shared_ptr<Arena> host);
  // The accumulators, one per parameter (empty: the gradients are the parameters' own buffers).
  const std::vector<Tensor>& host_gradients() const { return host_grads_; }
  // What a placement puts in the host tier, each tensor rounded as the arena rounds it: the state,
  // the gradient accumulators (with_gradients), and the staging of a placed step — one parameter's
  // value, and its gradient unless the gradients are on the host too, the largest parameter's.
  struct HostBytes {
    std::size_t state = 0, gradients = 0, staging = 0;
    std::size_t total() const { return state + gradients + staging; }
  };
  HostBytes host_bytes(bool with_gradients) const;

  // Where a step finds the state and the gradients: as placed now (where()), or, for a dry run of
  // another placement (the chooser's, mbp/chooser.h), as simulated there: dry_step(where) allocates
  // what step() would under that placement — host staging from the current host arena — and
  // touches no tensor of this optimizer (its state need not exist yet).
  struct Where {
    bool state_on_host = false, gradients_on_host = false;
  };
  Where where() const { return {host_ != nullptr, !host_grads_.empty()}; }
  void dry_step(Where where);

 protected:
  Optimizer(std::string name, std::vector<Tensor> params, StateCreation when = StateCreation::now);

  // Updates parameter i — `p`, its gradient `g` (the parameter itself, or its host staging copy)
  // — with its state; `first`: no real step has completed yet.
  virtual void update(std::size_t i, const Tensor& p, const Tensor& g, bool first) = 0;
  // Parameter i's state tensors (checked before any update).
  virtual std::vector<Tensor> state_of(std::size_t i) const = 0;

  // Declares a state tensor shaped like parameter i, category optimizer_state, named
  // "<name>.<what>.<i>" in the arena, zero-filled if `zero`, stored into `*slot` when created: now
  // (StateCreation::now: on the parameter's device) or by create_state(). Counted by state_bytes().
  void new_state(std::size_t i, const std::string& what, bool zero, Tensor* slot);
  // Checks parameter i, its gradient and `state` before an update: gradient present, same shape,
  // dtype and device, contiguous; state on the parameter's device; outside a dry run also a
  // kernel for it (float32 on CUDA) and memory behind every pointer (not built in a dry run on a
  // virtual arena). Returns the gradient; throws tally::Error naming the parameter.
  Tensor checked_grad(std::size_t i, const std::vector<Tensor>& state) const;
  // Throws tally::Error("<name>: <option> must be <expected>, found <value>") unless ok.
  void require(bool ok, const char* option, const char* expected, double found) const;
  std::string describe(std::size_t i) const;  // "parameter 1 (float32[5] on cpu)"

  std::string name_;
  std::vector<Tensor> params_;
  struct StateSpec {
    std::size_t param;
    std::string what;
    bool zero;
    Tensor* slot;  // the derived class's member the tensor goes to
  };
  void run_step(Where where, bool simulated);
  std::vector<StateSpec> specs_;  // every state tensor, in creation order
  bool created_ = true;
  std::vector<Tensor> state_;  // every state tensor once created
  std::vector<std::pair<std::string, Tensor>> named_state_;  // the same, named for checkpoints
  double lr_ = 0;
  std::int64_t steps_ = 0;
  std::shared_ptr<Arena> host_;  // where the state lives when placed on the host
  std::vector<Tensor> host_grads_;  // the gradient accumulators when placed on the host
};

class SGD : public Optimizer {
 public:
  // Validates as torch.optim.SGD does: lr >= 0, momentum >= 0, weight_decay >= 0, and nesterov
  // only with momentum > 0 and dampening == 0.
  SGD(std::vector<Tensor> params, SGDOptions options, StateCreation when = StateCreation::now);
  const SGDOptions& options() const { return options_; }

 private:
  void update(std::size_t i, const Tensor& p, const Tensor& g, bool first) override;
  std::vector<Tensor> state_of(std::size_t i) const override;
  SGDOptions options_;
  std::vector<Tensor> momentum_;  // (shape of param i) or undefined when momentum == 0
};

class AdamW : public Optimizer {
 public:
  // Validates as torch.optim.AdamW does: lr >= 0, eps >= 0 (here eps > 0), 0 <= beta < 1,
  // weight_decay >= 0.
  AdamW(std::vector<Tensor> params, AdamWOptions options, StateCreation when = StateCreation::now);
  const AdamWOptions& options() const { return options_; }

 private:
  void update(std::size_t i, const Tensor& p, const Tensor& g, bool first) override;
  std::vector<Tensor> state_of(std::size_t i) const override;
  AdamWOptions options_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;  // (shape of param i)
};

}  // namespace tally::optim
