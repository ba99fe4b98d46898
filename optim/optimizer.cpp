// optim/optimizer.cpp — SGD and AdamW over persistent state (see optimizer.h for the contract,
// kernels/cpu/optim.cpp for the update formulas).
//
// Each step() checks every parameter first and only then updates any, so an error (a parameter
// moved to another device after the optimizer was built, a float64 parameter on a GPU) leaves all
// parameters and the step counter as they were. In a dry run the checks that concern data
// (addressable memory, an existing kernel) are skipped, as ops skip dispatch in a dry run.
// Updates dispatch like ops (core/dispatch.h): kernels::cpu or kernels::cuda, one fused kernel
// per parameter, enqueued on the GPU's compute stream without waiting.
#include "optim/optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/dispatch.h"
#include "core/error.h"
#include "core/dry_run.h"
#include "core/memory.h"

namespace tally::optim {

// ---- Optimizer ----------------------------------------------------------------------------------

Optimizer::Optimizer(std::string name, std::vector<Tensor> params, StateCreation when)
    : name_(std::move(name)), params_(std::move(params)), created_(when == StateCreation::now) {
  if (params_.empty()) throw Error(fmt::format("{}: got an empty parameter list", name_));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    if (!p.defined()) throw Error(fmt::format("{}: parameter {} is an undefined tensor", name_, i));
    if (p.dtype() != DType::Float32 && p.dtype() != DType::Float64)
      throw Error(fmt::format("{}: {} must be float32 or float64, found {}", name_, describe(i), dtype_name(p.dtype())));
    if (!p.is_contiguous()) throw Error(fmt::format("{}: {} must be contiguous", name_, describe(i)));
    const Tensor g = p.grad();
    if (!g.defined())
      throw Error(fmt::format("{}: {} has no gradient buffer (expected one allocated up front, "
                              "e.g. by Tensor::allocate_grad(); found none)", name_, describe(i)));
    if (g.shape() != p.shape() || g.dtype() != p.dtype() || g.device() != p.device())
      throw Error(fmt::format("{}: the gradient of {} must have the same shape, dtype and device, found {}", name_,
                              describe(i), g.str()));
    for (std::size_t j = 0; j < i; ++j)
      if (params_[j].same(p))
        throw Error(fmt::format("{}: {} is listed twice (as parameter {} and {})", name_, describe(i), j, i));
  }
}

std::string Optimizer::describe(std::size_t i) const {
  return fmt::format("parameter {} ({})", i, params_[i].str());
}

void Optimizer::require(bool ok, const char* option, const char* expected, double found) const {
  if (!ok) throw Error(fmt::format("{}: {} must be {}, found {}", name_, option, expected, found));
}

void Optimizer::set_lr(double lr) {
  require(std::isfinite(lr) && lr >= 0, "lr", ">= 0 and finite", lr);
  lr_ = lr;
}

void Optimizer::zero_grad() {
  if (!host_grads_.empty()) {
    for (Tensor& g : host_grads_) g.zero_();
    return;
  }
  for (Tensor& p : params_) p.zero_grad();
}

std::size_t Optimizer::state_bytes() const {
  std::size_t bytes = 0;
  for (const StateSpec& s : specs_) bytes += params_[s.param].nbytes();
  return bytes;
}

std::vector<std::size_t> Optimizer::state_tensor_bytes() const {
  std::vector<std::size_t> bytes;
  for (const StateSpec& s : specs_) bytes.push_back(params_[s.param].nbytes());
  return bytes;
}

void Optimizer::new_state(std::size_t i, const std::string& what, bool zero, Tensor* slot) {
  specs_.push_back({i, what, zero, slot});
  if (!created_) return;
  const Tensor& p = params_[i];
  const std::string op = fmt::format("{}.{}.{}", name_, what, i);
  Tensor s = zero ? Tensor::zeros(p.shape(), p.dtype(), p.device(), Category::optimizer_state, op)
                  : Tensor::empty(p.shape(), p.dtype(), p.device(), Category::optimizer_state, op);
  state_.push_back(s);
  named_state_.emplace_back(fmt::format("{}.{}", what, i), s);
  *slot = s;
}

void Optimizer::create_state(std::shared_ptr<Arena> host) {
  if (created_) return;
  if (host && !host->device().is_cpu())
    throw Error(fmt::format("{}.create_state: expected an arena of host memory, found one on {}", name_,
                            host->device().str()));
  for (const StateSpec& spec : specs_) {
    const Tensor& p = params_[spec.param];
    const std::string op = fmt::format("{}.{}.{}", name_, spec.what, spec.param);
    std::optional<ArenaScope> on_host;
    if (host) on_host.emplace(host);
    const Device where = host ? Device::cpu() : p.device();
    Tensor s = spec.zero ? Tensor::zeros(p.shape(), p.dtype(), where, Category::optimizer_state, op)
                         : Tensor::empty(p.shape(), p.dtype(), where, Category::optimizer_state, op);
    state_.push_back(s);
    named_state_.emplace_back(fmt::format("{}.{}", spec.what, spec.param), s);
    *spec.slot = s;
  }
  host_ = std::move(host);
  created_ = true;
}

void Optimizer::set_steps(std::int64_t steps) {
  if (steps < 0) throw Error(fmt::format("{}.set_steps: expected steps >= 0, found {}", name_, steps));
  steps_ = steps;
}

void Optimizer::step() {
  if (!created_)
    throw Error(fmt::format("{}.step: the state has not been created yet (StateCreation::when_placed: create_state "
                            "first)", name_));
  run_step(where(), false);
}

void Optimizer::dry_step(Where where) {
  if (!skip_side_effects()) throw Error(fmt::format("{}.dry_step: only in a dry run (core/dry_run.h)", name_));
  run_step(where, true);
}

void Optimizer::run_step(Where where, bool simulated) {
  // Simulated: the parameters stand in for the gradients and the state (a dry run reads no value).
  std::vector<Tensor> grads(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) grads[i] = simulated ? params_[i] : checked_grad(i, state_of(i));
  const bool first = steps_ == 0;
  if (!where.state_on_host) {
    for (std::size_t i = 0; i < params_.size(); ++i) update(i, params_[i], grads[i], first);
  } else {
    // Placed: each parameter's value and gradient staged in the host tier, updated there by the
    // CPU kernel, the value copied back; the staging freed before the next parameter.
    const std::shared_ptr<Arena>& tier = current_host_arena() ? current_host_arena() : host_;
    if (!tier) throw Error(fmt::format("{}.step: the state is placed on the host but no host arena is current", name_));
    ArenaScope on_host(tier);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const Tensor& p = params_[i];
      Tensor g = grads[i];  // the accumulator itself when the gradients live on the host
      if (!where.gradients_on_host) {
        g = Tensor::empty(p.shape(), p.dtype(), Device::cpu(), Category::gradient,
                          fmt::format("{}.host_gradient.{}", name_, i));
        g.copy_(grads[i]);
      }
      Tensor v = Tensor::empty(p.shape(), p.dtype(), Device::cpu(), Category::parameter,
                               fmt::format("{}.host_parameter.{}", name_, i));
      v.copy_(p);
      update(i, v, g, first);
      Tensor(p).copy_(v);
    }
  }
  if (!skip_side_effects()) ++steps_;
}

void Optimizer::place_state(std::shared_ptr<Arena> host) {
  if (host && !host->device().is_cpu())
    throw Error(fmt::format("{}.place_state: expected an arena of host memory, found one on {}", name_,
                            host->device().str()));
  if (host == host_) return;
  if (!host && !host_grads_.empty())
    throw Error(fmt::format("{}.place_state: the gradients are on the host; place them back first", name_));
  for (std::size_t i = 0, k = 0; i < params_.size(); ++i)
    for (Tensor s : state_of(i)) {
      const std::string& what = named_state_[k++].first;
      s.move_to(host ? host : current_arena(params_[i].device()), fmt::format("{}.{}", name_, what));
    }
  host_ = std::move(host);
}

void Optimizer::place_gradients(std::shared_ptr<Arena> host) {
  if (host && !host_)
    throw Error(fmt::format("{}.place_gradients: the gradients go to the host with the state: place the state first",
                            name_));
  if (host && !host->device().is_cpu())
    throw Error(fmt::format("{}.place_gradients: expected an arena of host memory, found one on {}", name_,
                            host->device().str()));
  if (host && !host_grads_.empty()) return;
  if (!host && host_grads_.empty()) return;
  if (host) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Tensor p = params_[i];
      Tensor g = p.grad();
      if (!g.defined()) throw Error(fmt::format("{}.place_gradients: {} has no gradient buffer", name_, describe(i)));
      g.move_to(host, fmt::format("{}.host_gradient_accumulator.{}", name_, i));
      host_grads_.push_back(g);
      p.impl().grad.reset();
    }
    return;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Tensor p = params_[i];
    Tensor g = host_grads_[i];
    g.move_to(current_arena(p.device()), "grad");
    p.impl().grad = g.impl_ptr();
  }
  host_grads_.clear();
}

Optimizer::HostBytes Optimizer::host_bytes(bool with_gradients) const {
  HostBytes b;
  for (const std::size_t bytes : state_tensor_bytes()) b.state += Arena::round_up(bytes);
  std::size_t largest = 0;
  for (const Tensor& p : params_) {
    if (with_gradients) b.gradients += Arena::round_up(p.nbytes());
    largest = std::max(largest, Arena::round_up(p.nbytes()));
  }
  b.staging = with_gradients ? largest : 2 * largest;
  return b;
}

Tensor Optimizer::checked_grad(std::size_t i, const std::vector<Tensor>& state) const {
  const Tensor& p = params_[i];
  const Tensor g = host_grads_.empty() ? p.grad() : host_grads_[i];
  if (!g.defined()) throw Error(fmt::format("{}.step: {} has no gradient buffer", name_, describe(i)));
  if (g.shape() != p.shape() || g.dtype() != p.dtype() ||
      g.device() != (host_grads_.empty() ? p.device() : Device::cpu()) || !g.is_contiguous())
    throw Error(fmt::format("{}.step: the gradient of {} must be a contiguous tensor of the same shape, dtype and "
                            "device, found {}", name_, describe(i), g.str()));
  for (const Tensor& s : state)
    if (s.device() != (host_ ? Device::cpu() : p.device()))
      throw Error(fmt::format("{}.step: {} is on {} but its optimizer state is on {} (build the optimizer after "
                              "moving the model)", name_, describe(i), p.device().str(), s.device().str()));
  if (p.numel() > 0 && !skip_side_effects()) {
    bool null = p.raw_data() == nullptr || g.raw_data() == nullptr;
    for (const Tensor& s : state) null = null || s.raw_data() == nullptr;
    if (null)
      throw Error(fmt::format("{}.step: {}, its gradient or its state has no memory behind it (created in a dry "
                              "run?); a real step needs real tensors", name_, describe(i)));
  }
  return g;
}

// ---- SGD ----------------------------------------------------------------------------------------

SGD::SGD(std::vector<Tensor> params, SGDOptions options, StateCreation when)
    : Optimizer("SGD", std::move(params), when), options_(options) {
  const SGDOptions& o = options_;
  set_lr(o.lr);
  require(std::isfinite(o.momentum) && o.momentum >= 0, "momentum", ">= 0", o.momentum);
  require(std::isfinite(o.dampening), "dampening", "finite", o.dampening);
  require(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "weight_decay", ">= 0", o.weight_decay);
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    throw Error(fmt::format("SGD: nesterov = true requires momentum > 0 and dampening == 0, found momentum {}, "
                            "dampening {}", o.momentum, o.dampening));
  momentum_.resize(params_.size());
  if (o.momentum != 0)
    for (std::size_t i = 0; i < params_.size(); ++i) new_state(i, "momentum_buffer", false, &momentum_[i]);
}

std::vector<Tensor> SGD::state_of(std::size_t i) const {
  if (momentum_[i].defined()) return {momentum_[i]};
  return {};
}

void SGD::update(std::size_t i, const Tensor& p, const Tensor& g, bool first) {
  const SGDOptions& o = options_;  // first: every buffer is written on the first step, read afterwards
  TALLY_DISPATCH("SGD.step", p, FULL_PRECISION, {
    T* buf = momentum_[i].defined() ? momentum_[i].data<T>() : nullptr;
    kk::sgd_update<T>(p.numel(), p.data<T>(), g.data<T>(), buf, static_cast<T>(lr_), static_cast<T>(o.momentum),
                      static_cast<T>(o.dampening), static_cast<T>(o.weight_decay), o.nesterov, first);
  });
}

// ---- AdamW --------------------------------------------------------------------------------------

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options, StateCreation when)
    : Optimizer("AdamW", std::move(params), when), options_(options) {
  const AdamWOptions& o = options_;
  set_lr(o.lr);
  require(o.beta1 >= 0 && o.beta1 < 1, "beta1", "in [0, 1)", o.beta1);
  require(o.beta2 >= 0 && o.beta2 < 1, "beta2", "in [0, 1)", o.beta2);
  require(std::isfinite(o.eps) && o.eps > 0, "eps", "> 0", o.eps);
  require(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "weight_decay", ">= 0", o.weight_decay);
  exp_avg_.resize(params_.size());
  exp_avg_sq_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    new_state(i, "exp_avg", true, &exp_avg_[i]);
    new_state(i, "exp_avg_sq", true, &exp_avg_sq_[i]);
  }
}

std::vector<Tensor> AdamW::state_of(std::size_t i) const { return {exp_avg_[i], exp_avg_sq_[i]}; }

void AdamW::update(std::size_t i, const Tensor& p, const Tensor& g, bool) {
  const AdamWOptions& o = options_;
  const std::int64_t t = steps_ + 1;  // 1-based, as torch's state['step'] after its increment
  TALLY_DISPATCH("AdamW.step", p, FULL_PRECISION,
                 kk::adamw_update<T>(p.numel(), p.data<T>(), g.data<T>(), exp_avg_[i].data<T>(),
                                     exp_avg_sq_[i].data<T>(), static_cast<T>(lr_), static_cast<T>(o.beta1),
                                     static_cast<T>(o.beta2), static_cast<T>(o.eps), static_cast<T>(o.weight_decay),
                                     t));
}

}  // namespace tally::optim
