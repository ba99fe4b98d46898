// mbp/data_parallel.cpp — data parallelism as a part of the step; see mbp/data_parallel.h.
#include "mbp/data_parallel.h"

#include <chrono>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/memory.h"
#include "distributed/replicas.h"

namespace tally::mbp {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

DataParallel::DataParallel(std::shared_ptr<distributed::Communicator> comm, std::vector<Tensor> parameters,
                           const std::vector<nn::StepState*>& states, std::size_t bucket_bytes,
                           CrossEntropyOptions loss)
    : comm_(std::move(comm)), parameters_(std::move(parameters)), states_(states), bucket_bytes_(bucket_bytes),
      loss_(std::move(loss)) {}

void DataParallel::begin_step(const std::int64_t* labels, std::int64_t batch) {
  seconds_ = 0;
  const auto t0 = std::chrono::steady_clock::now();
  // D and the batch size over every rank, before any micro-batch (and outside the retry loop: a
  // retry on this rank must not repeat a collective the others do not).
  double sums[2] = {cross_entropy_divisor(labels, batch, loss_), static_cast<double>(batch)};
  comm_->all_reduce_sum(sums, 2);
  if (!(sums[0] > 0))
    throw Error(fmt::format("MBP executor: the global batch of {} has no counted target (all ignore_index {} or "
                            "zero class weight), so its mean loss is undefined", sums[1], loss_.ignore_index));
  divisor_ = sums[0];
  local_batch_ = batch;
  global_batch_ = static_cast<std::int64_t>(sums[1]);
  seconds_ += seconds_since(t0);
}

void DataParallel::before_optimizer_step(Tensor& loss) {
  const auto t0 = std::chrono::steady_clock::now();
  mark_trace(loss.device(), "all-reduce");
  distributed::StateReduction states(*comm_, states_);
  distributed::all_reduce_gradients(*comm_, parameters_, loss, bucket_bytes_, [&] { states.reserve(); });
  states.run(local_batch_, global_batch_);
  if (!skip_side_effects()) seconds_ += seconds_since(t0);
}

}  // namespace tally::mbp
