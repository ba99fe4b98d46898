// mbp/host_gradients.cpp — gradients accumulated in the host tier; see mbp/host_gradients.h.
#include "mbp/host_gradients.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tally::mbp {

HostGradients::HostGradients(std::vector<Tensor> parameters, std::vector<Tensor> accumulators)
    : parameters_(std::move(parameters)) {
  if (parameters_.size() != accumulators.size())
    throw Error(fmt::format("HostGradients: expected one accumulator per parameter ({}), found {}", parameters_.size(),
                            accumulators.size()));
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (accumulators[i].shape() != parameters_[i].shape() || !accumulators[i].device().is_cpu())
      throw Error(fmt::format("HostGradients: the accumulator of parameter {} must be a host tensor of its shape {}, "
                              "found {}", i, shape_str(parameters_[i].shape()), accumulators[i].str()));
    accumulator_.emplace(&parameters_[i].impl(), accumulators[i]);
  }
}

void HostGradients::gradient_needed(const Tensor& parameter) {
  const auto it = accumulator_.find(&parameter.impl());
  if (it == accumulator_.end()) return;  // not a trained parameter
  Tensor transient = Tensor::empty(parameter.shape(), parameter.dtype(), parameter.device(), Category::gradient,
                                   "host_gradients.transient");
  transient.copy_(it->second);  // the sums so far: the writers accumulate into them as into a persistent buffer
  parameter.impl().grad = transient.impl_ptr();
}

void HostGradients::gradient_ready(const Tensor& parameter) {
  const auto it = accumulator_.find(&parameter.impl());
  if (it == accumulator_.end() || !parameter.impl().grad) return;
  it->second.copy_(Tensor(parameter.impl().grad));
  parameter.impl().grad.reset();  // the transient buffer goes with the node's last handle to it
}

void HostGradients::drop_transient() {
  for (const Tensor& p : parameters_) p.impl().grad.reset();
}

}  // namespace tally::mbp
