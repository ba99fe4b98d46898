// mbp/host_gradients.cpp — gradients accumulated in the host tier; see mbp/host_gradients.h.
#include "mbp/host_gradients.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tally::mbp {

HostGradients::HostGradients(std::vector<Tensor> parameters, std::vector<Tensor> accumulators) {
  if (parameters.size() != accumulators.size())
    throw Error(fmt::format("HostGradients: expected one accumulator per parameter ({}), found {}", parameters.size(),
                            accumulators.size()));
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    if (accumulators[i].shape() != parameters[i].shape() || !accumulators[i].device().is_cpu())
      throw Error(fmt::format("HostGradients: the accumulator of parameter {} must be a host tensor of its shape {}, "
                              "found {}", i, shape_str(parameters[i].shape()), accumulators[i].str()));
    slots_[&parameters[i].impl()].accumulator = accumulators[i];
  }
}

std::unique_ptr<HostGradients> HostGradients::simulated(const std::vector<Tensor>& parameters) {
  std::unique_ptr<HostGradients> h(new HostGradients());
  for (const Tensor& p : parameters) h->slots_[&p.impl()];
  return h;
}

std::unique_ptr<HostGradients> HostGradients::standing_in(const std::vector<Tensor>& parameters) {
  std::unique_ptr<HostGradients> h(new HostGradients());
  h->standing_in_ = true;
  for (const Tensor& p : parameters) {
    auto alias = std::make_shared<TensorImpl>();
    alias->storage = p.impl().storage;
    alias->offset = p.impl().offset;
    alias->shape = p.impl().shape;
    alias->strides = p.impl().strides;
    alias->dtype = p.impl().dtype;
    alias->device = p.impl().device;
    h->slots_[&p.impl()].transient = std::move(alias);
  }
  return h;
}

std::shared_ptr<TensorImpl>* HostGradients::gradient_slot(const Tensor& parameter) {
  const auto it = slots_.find(&parameter.impl());
  if (it == slots_.end()) return nullptr;  // not a trained parameter
  Slot& s = it->second;
  if (!s.transient) {
    Tensor transient = Tensor::empty(parameter.shape(), parameter.dtype(), parameter.device(), Category::gradient,
                                     "host_gradients.transient");
    // The sums so far: the writers accumulate into them as into a persistent buffer.
    if (s.accumulator.defined()) transient.copy_(s.accumulator);
    s.transient = transient.impl_ptr();
  }
  return &s.transient;
}

void HostGradients::gradient_ready(const Tensor& parameter) {
  const auto it = slots_.find(&parameter.impl());
  if (standing_in_ || it == slots_.end() || !it->second.transient) return;
  Slot& s = it->second;
  if (s.accumulator.defined()) s.accumulator.copy_(Tensor(s.transient));
  s.transient.reset();  // the transient buffer goes with the node's last handle to it
}

void HostGradients::drop_transient() {
  if (standing_in_) return;
  for (auto& [impl, s] : slots_) s.transient.reset();
}

}  // namespace tally::mbp
