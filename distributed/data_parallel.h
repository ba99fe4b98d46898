// distributed/data_parallel.h — what data-parallel training needs besides the step (mbp::Executor runs
// the step itself when given a communicator; docs/distributed.md):
//
//   shard                 rank r of N takes samples [r*B/N, (r+1)*B/N) of a global batch of B:
//                         sizes differ by at most one, and every sample belongs to one rank.
//   broadcast_parameters  rank 0's parameters and buffers (BatchNorm running statistics) to all:
//                         every rank starts from the same weights.
//   parameters_identical  whether every rank holds rank 0's parameters and buffers bit for bit.
//   check_same_text       every rank was started with the same options (an Error naming the first
//                         line that differs from rank 0's).
#pragma once
#include <cstdint>
#include <string>

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

}  // namespace tally::distributed
