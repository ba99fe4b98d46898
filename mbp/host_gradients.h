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
//
// The transient buffers live in slots of this part (core/autograd.h: GradientSlotScope), never in
// the parameters' own `grad`: so the chooser's dry run of this placement (mbp/chooser.h), made
// with no accumulators at all (`simulated`), allocates and frees the same transients while the
// parameters keep whatever buffers they have.
#pragma once
#include <map>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "mbp/step_part.h"

namespace tally::mbp {

class HostGradients : public StepPart {
 public:
  // `parameters` and their `accumulators` (host tensors of the same shapes), in the same order.
  HostGradients(std::vector<Tensor> parameters, std::vector<Tensor> accumulators);
  // A dry run's: the same transients, no accumulators (a dry run copies nothing).
  static std::unique_ptr<HostGradients> simulated(const std::vector<Tensor>& parameters);
  // A dry run's of a placement that keeps the gradients beside the parameters, measured while they
  // are really on the host (the parameters have no buffer to accumulate into): each slot holds an
  // alias of its parameter standing in for the persistent buffer — accumulated into, never
  // allocated, as the buffers the simulated move back would be (a dry run reads no value).
  static std::unique_ptr<HostGradients> standing_in(const std::vector<Tensor>& parameters);
  bool wants_gradient_slot() const override { return true; }
  std::shared_ptr<TensorImpl>* gradient_slot(const Tensor& parameter) override;
  bool wants_gradient_ready() const override { return true; }
  void gradient_ready(const Tensor& parameter) override;
  // Drops a transient buffer a failed micro-batch left behind (its accumulator keeps the sums up
  // to the last complete gradient: the executor discards the step and zeroes them).
  void drop_transient();

 private:
  HostGradients() = default;
  bool standing_in_ = false;
  struct Slot {
    Tensor accumulator;                     // undefined when simulated
    std::shared_ptr<TensorImpl> transient;  // the device buffer while the gradient's writers run
  };
  std::map<const TensorImpl*, Slot> slots_;  // by parameter
};

}  // namespace tally::mbp
