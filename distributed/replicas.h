// distributed/replicas.h — what data-parallel replicas share besides the step (the step's
// data-parallel part, mbp/data_parallel.h, calls the reductions; docs/distributed.md):
//
//   shard                 rank r of N takes samples [r*B/N, (r+1)*B/N) of a global batch of B:
//                         sizes differ by at most one, and every sample belongs to one rank.
//   broadcast_parameters  rank 0's parameters and buffers (BatchNorm running statistics) to all:
//                         every rank starts from the same weights.
//   parameters_identical  whether every rank holds rank 0's parameters and buffers bit for bit.
//   check_same_text       every rank was started with the same options (an Error naming the first
//                         line that differs from rank 0's).
//   all_reduce_gradients  a step's gradients and loss summed over the ranks in buckets;
//   all_reduce_states     its step states' tensors (BatchNorm's moments) in one buffer, then
//                         scaled to the global batch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "distributed/communicator.h"
#include "nn/module.h"

namespace tally::distributed {

struct Shard {
  std::int64_t offset = 0, size = 0;
};
// An Error when the batch has fewer samples than there are ranks.
Shard shard(std::int64_t batch, int ranks, int rank);

void broadcast_parameters(nn::Module& model, Communicator& comm);
bool parameters_identical(const nn::Module& model, Communicator& comm);

// `what` names the text in the error ("options").
void check_same_text(const std::string& text, Communicator& comm, const std::string& what);

// The gradients of `parameters`, flattened, then `loss` (one more element), summed over the ranks
// in buckets of at most `bucket_bytes` of the gradients' dtype, each copied back. The one bucket
// (category temporary, "gradient_bucket") is allocated from the current arena before the first
// collective — with all_reduce_states' buffer, allocated by `reserve_states` first when given, so
// that a dry run counts both and no rank runs out of memory inside a collective.
void all_reduce_gradients(Communicator& comm, const std::vector<Tensor>& parameters, Tensor& loss,
                          std::size_t bucket_bytes, const std::function<void()>& reserve_states = {});

// The step states' tensors in one float64 buffer (category temporary, "batch_norm_moments"),
// summed over the ranks in one collective and copied back; then (not in a dry run) each state
// scales what it counted per local sample to the global batch. `reserve` allocates the buffer
// without a collective (for all_reduce_gradients' reserve_states); the reduction uses it.
class StateReduction {
 public:
  StateReduction(Communicator& comm, const std::vector<nn::StepState*>& states);
  void reserve();
  void run(std::int64_t local_batch, std::int64_t global_batch);

 private:
  Communicator& comm_;
  const std::vector<nn::StepState*>& states_;
  std::vector<Tensor> tensors_;
  std::int64_t count_ = 0;
  Tensor buffer_;
};

}  // namespace tally::distributed
