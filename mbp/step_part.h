// mbp/step_part.h — what a mode adds to the plain step (mbp/executor.h), at named points instead
// of branches inside it. The executor calls every part it holds, in order, at each point; a dry
// run of the step (the planner's) calls them too, so what a part allocates is planned. Today's
// parts: data parallelism (mbp/data_parallel.h) and gradients accumulated on the host tier
// (mbp/host_gradients.h); a caller adds its own with Executor::add_part. A pipeline stage is not a
// part: its micro-batches run in another order, by the executor's StageRunner (mbp/stage_runner.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/tensor.h"

namespace tally::mbp {

class StepPart {
 public:
  virtual ~StepPart() = default;
  // Once per step, before its plan and its first micro-batch, outside the out-of-memory retry (a
  // retry must not repeat what other ranks do once); real steps only. `labels` and `batch`: this
  // process's share of the batch.
  virtual void begin_step(const std::int64_t* /*labels*/, std::int64_t /*batch*/) {}
  // The loss divisor D the step's micro-batches divide by, when this part counts it (the whole
  // batch's, over every rank); unset: the executor counts this process's batch.
  virtual std::optional<double> divisor() const { return std::nullopt; }
  // During a micro-batch's backward, when `parameter`'s gradient for it is complete (every node
  // that writes into it has run), in backward order — what an overlapped reduction or a copy to
  // host memory needs. Called only for a part whose wants_gradient_ready() is true (the engine
  // then counts each leaf's writers; core/autograd.h: GradientReadyScope).
  virtual bool wants_gradient_ready() const { return false; }
  virtual void gradient_ready(const Tensor& /*parameter*/) {}
  // During a micro-batch's backward, where `parameter`'s gradient lives (core/autograd.h:
  // GradientSlotScope): a slot of the part's own — the host tier's accumulators load a transient
  // device buffer into one (mbp/host_gradients.h) — or null for the parameter's own buffer. Asked
  // for every node that writes the gradient: the same slot each time. Only for a part whose
  // wants_gradient_slot() is true.
  virtual bool wants_gradient_slot() const { return false; }
  virtual std::shared_ptr<TensorImpl>* gradient_slot(const Tensor& /*parameter*/) { return nullptr; }
  // After micro-batch `index` (of `count`) has run its backward: its gradients are accumulated.
  virtual void after_micro_batch(std::size_t /*index*/, std::size_t /*count*/) {}
  // After the last micro-batch, before the step states apply and the optimizer steps; `loss` is the
  // step's loss, summed where it was computed (undefined in a dry run of a stage without it).
  virtual void before_optimizer_step(Tensor& /*loss*/) {}
  // Host seconds of the last step spent communicating (StepResult::communication_seconds).
  virtual double communication_seconds() const { return 0; }
};

}  // namespace tally::mbp
