// mbp/pipeline_executor.h — the step of one pipeline stage (mbp/pipeline.h; docs/distributed.md,
// "Pipeline stages"): the plain step's pieces (mbp/executor.h: the plan, the inputs, the step
// states, the optimizer step) with the stage's own micro-batch loop — its segments run in the
// schedule's order (1F1B or GPipe), activations and their gradients exchanged with the
// neighbouring stages' ranks; the last stage counts D and the loss; every stage steps its own
// optimizer — and the micro-batch agreed across the stages. What differs from the plain step:
//   * the model's other stages' parameters may live anywhere (outside the arena); the optimizer
//     holds this stage's; a stage's step states are its own modules';
//   * recomputation: none, blocks or auto (the blocks of the stage);
//   * an out-of-memory step is not retried (the ranks would wait on each other's messages): it
//     ends the run, which the exact plan makes a bug, not an event;
//   * CPU only (MPI ranks), row-major activations, the exact loss normalization, no data
//     parallelism besides (rank s runs stage s).
// Built by apps/setup.cpp's make_executor when ExecutorOptions::pipeline is set.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "mbp/executor.h"
#include "mbp/pipeline.h"

namespace tally::mbp {

class PipelineExecutor final : public Executor {
 public:
  // options.pipeline must be set.
  PipelineExecutor(nn::Module& model, optim::Optimizer& optimizer, std::shared_ptr<Arena> arena,
                   ExecutorOptions options);

  // The plan of this stage: with several ranks, every stage's plan has the same micro-batch, the
  // smallest of the largest that fits each stage (agreed over the communicator, a collective).
  const Plan& plan(std::int64_t batch) override;
  // The plan of this stage at exactly m, at the recomputation plan() chooses (measured only).
  Plan agreed_plan(std::int64_t batch, std::int64_t micro_batch);

  // A no-grad forward of n samples through every stage, for evaluation (every rank calls it for
  // every batch): stage 0 takes `x`, the others receive their input; the logits on the last
  // stage, an undefined tensor on the others.
  Tensor forward_through_stages(const Tensor& x, std::int64_t n);
  const PipelineStage& stage() const { return *options().pipeline; }
  // The stage's last real step: what it ran when, and how long it waited.
  const PipelineTrace& trace() const { return trace_; }

 protected:
  void check_step_data(const float* images, const std::int64_t* labels) const override;
  Tensor run_micro_batches(const float* images, const std::int64_t* labels,
                           const std::vector<std::int64_t>& sizes) override;
  void finish_step(StepResult& r) override;
  void before_retry(const OutOfMemory& e, std::int64_t batch, const Plan& p) override;

 private:
  struct Run;  // one step under way: what its forwards and backwards share
  void set_up(nn::Module& model);
  bool agrees_across_stages() const;
  StepConfig alone(std::int64_t batch);  // this stage's configuration, before the stages agree
  StepConfig agreed(std::int64_t batch, std::int64_t micro_batch);  // at the micro-batch agreed
  void describe_stage(StepConfig& c) const;
  Shape input_shape(std::int64_t n) const;  // one micro-batch's input: n samples of the stage's input shape
  Tensor run_segments(Tensor x);
  void forward(Run& r, std::size_t i);
  void backward(Run& r, std::size_t i);
  void send_back(Run& r, const Tensor& x);

  std::vector<nn::Module::Segment> segments_;
  Shape sample_shape_;                         // the stage's input, per sample
  std::map<std::int64_t, std::int64_t> agreed_;  // the micro-batch agreed per batch size
  PipelineTrace trace_;
};

// The executor of a stage, or an Error naming what `what` needs (a pipeline stage).
PipelineExecutor& as_stage(Executor& executor, const char* what);

}  // namespace tally::mbp
