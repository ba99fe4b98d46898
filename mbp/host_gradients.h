// mbp/host_gradients.h — gradients accumulated in the host tier (docs/host-tier.md), a part of the
// step (mbp/step_part.h) that the executor holds under Placement::gradients.
//
// The parameters keep no gradient buffer on the device; the optimizer holds one float32
// accumulator per parameter in the host tier's arena (optim::Optimizer::place_gradients). During
// each micro-batch's backward, before the first node that writes a parameter's gradient runs, a
// transient buffer is allocated on the device (category gradient) and loaded with the
// accumulator; that node and any other writer accumulate into it with beta = 1 exactly as into a
// persistent buffer, so the sums are the all-device run's, bit for bit (a partial sum added on the
// host afterwards would round differently). When the gradient is complete the buffer is copied
// back into the accumulator and freed. The device therefore holds, at any moment, only the
// gradients whose writers are running — for a ResNet one layer's — at the price of one copy in
// and one copy out per parameter and micro-batch. After the last micro-batch the optimizer steps
// on the accumulators, on the CPU (optim/optimizer.h, "Host placement").
#pragma once
#include <map>
#include <vector>

#include "core/tensor.h"
#include "mbp/step_part.h"

namespace tally::mbp {

class HostGradients : public StepPart {
 public:
  // `parameters` and their `accumulators` (host tensors of the same shapes), in the same order.
  HostGradients(std::vector<Tensor> parameters, std::vector<Tensor> accumulators);
  bool wants_gradient_needed() const override { return true; }
  void gradient_needed(const Tensor& parameter) override;
  bool wants_gradient_ready() const override { return true; }
  void gradient_ready(const Tensor& parameter) override;
  // Drops a transient buffer a failed micro-batch left behind (its accumulator keeps the sums up
  // to the last complete gradient: the executor discards the step and zeroes them).
  void drop_transient();

 private:
  std::vector<Tensor> parameters_;
  std::map<const TensorImpl*, Tensor> accumulator_;  // by parameter
};

}  // namespace tally::mbp
