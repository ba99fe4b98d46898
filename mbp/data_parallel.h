// mbp/data_parallel.h — data parallelism as a part of the step (mbp/step_part.h; docs/distributed.md):
// the batch given to Executor::step is this rank's share of the global batch. Before the first
// micro-batch the divisor D and the global batch size are summed over the ranks, so each rank's
// gradients are its part of the global batch's mean-loss gradient; after the last micro-batch
// the gradients (and the step's loss) are summed over the ranks once, in buckets of at most
// bucket_bytes, and the BatchNorm moments once, in one buffer — both allocated before the first
// collective (distributed/replicas.h), so the planner counts them and an out-of-memory
// retry never leaves another rank inside a collective. Every rank then takes the same optimizer
// step. Each rank plans its own micro-batches for its own arena.
#pragma once
#include <memory>
#include <vector>

#include "core/ops.h"
#include "distributed/communicator.h"
#include "mbp/step_part.h"
#include "nn/module.h"

namespace tally::mbp {

class DataParallel : public StepPart {
 public:
  // `parameters` and `states`: the model's, in order; the communicator must serve their device.
  DataParallel(std::shared_ptr<distributed::Communicator> comm, std::vector<Tensor> parameters,
               const std::vector<nn::StepState*>& states, std::size_t bucket_bytes, CrossEntropyOptions loss);
  void begin_step(const std::int64_t* labels, std::int64_t batch) override;
  std::optional<double> divisor() const override { return divisor_; }
  void before_optimizer_step(Tensor& loss) override;
  double communication_seconds() const override { return seconds_; }

 private:
  std::shared_ptr<distributed::Communicator> comm_;
  std::vector<Tensor> parameters_;
  const std::vector<nn::StepState*>& states_;
  std::size_t bucket_bytes_;
  CrossEntropyOptions loss_;
  std::optional<double> divisor_;
  std::int64_t local_batch_ = 0, global_batch_ = 0;
  double seconds_ = 0;
};

}  // namespace tally::mbp
