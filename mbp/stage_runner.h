// mbp/stage_runner.h — how one pipeline stage (mbp/pipeline.h; docs/distributed.md, "Pipeline
// stages") runs a step's micro-batches: a part of the executor (mbp/executor.h), not a kind of it.
// The executor keeps what every step does — the plan and its retries, the inputs, the step
// states, the optimizer step — and hands the micro-batch loop to its StageRunner when
// ExecutorOptions::pipeline is set: the stage's segments in the schedule's order (1F1B or GPipe),
// activations and their gradients exchanged with the neighbouring stages' ranks; the last stage
// counts D and the loss; every stage steps its own optimizer; the micro-batch agreed across the
// stages. What differs from the plain step:
//   * the model's other stages' parameters may live anywhere (outside the arena); the optimizer
//     holds this stage's; a stage's step states are its own modules';
//   * recomputation: none, blocks or auto (the blocks of the stage);
//   * an out-of-memory step is not retried (the ranks would wait on each other's messages): it
//     ends the run, which the exact plan makes a bug, not an event;
//   * row-major activations, the exact loss normalization, no data parallelism besides (rank s
//     runs stage s), no host tier. On a GPU the messages travel through host memory (the staged
//     transport, distributed/staged.h), sized per plan: message_staging_bytes.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/ops.h"
#include "core/staging.h"
#include "core/tensor.h"
#include "distributed/communicator.h"
#include "mbp/chooser.h"
#include "mbp/pipeline.h"
#include "mbp/planner.h"
#include "nn/module.h"

namespace tally::mbp {

struct StepResult;  // mbp/executor.h

class StageRunner {
 public:
  // The stage `options.pipeline` of `model` (options.pipeline set; options.communicator set: rank s
  // runs stage s), on `arena`, its inputs staged by `stager` (the executor's). Checks what a stage
  // can run and configures `chooser` for it (the stage's ladder, the schedule's repeats).
  StageRunner(nn::Module& model, const ExecutorOptions& options, std::shared_ptr<Arena> arena, DType activation_dtype,
              InputStager& stager, Chooser& chooser);

  // The parameters this stage trains, and its modules' state across micro-batches.
  std::vector<Tensor> trained() const;
  const std::vector<nn::StepState*>& step_states() const { return states_; }

  // The stage's configuration for `batch`: with several ranks every stage runs the same
  // micro-batch, the smallest of the largest that fits each stage (agreed over the communicator, a
  // collective, once per batch size). An out-of-memory error names the stage.
  StepConfig choose(Chooser& chooser, std::int64_t batch, std::int64_t limit, const StateLayout& layout);
  // At exactly `micro_batch`, measured only.
  StepConfig choose_with(Chooser& chooser, std::int64_t batch, std::int64_t micro_batch, std::int64_t limit,
                         const StateLayout& layout) const;

  // The step's host data: the images on the first stage, the labels on the last.
  void check_step_data(const float* images, const std::int64_t* labels) const;
  // The micro-batches' forwards and backwards in the schedule's order; the step's loss on the last
  // stage (undefined on the others, and in a dry run's values).
  // `step`: the training step (the optimizer's count), for the samples' randomness (SampleScope).
  Tensor run(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
             std::uint64_t step);
  // What a real step's result adds: the time waited for the other stages, the loss on every rank.
  void finish_step(StepResult& r) const;
  // A pipeline does not retry a step that ran out of memory (more than one stage): throws.
  void before_retry(const OutOfMemory& e, std::int64_t batch, const Plan& p) const;

  // A no-grad forward of n samples through every stage, for evaluation (every rank calls it for
  // every batch): stage 0 takes `x`, the others receive their input; the logits on the last
  // stage, an undefined tensor on the others.
  Tensor forward_through_stages(const Tensor& x, std::int64_t n);
  const PipelineStage& stage() const { return stage_; }
  // The stage's last real step: what it ran when, and how long it waited.
  const PipelineTrace& trace() const { return trace_; }
  Device device() const { return device_; }
  DType activation_dtype() const { return activation_dtype_; }
  // The host memory this stage's messages of a step in micro-batches of `sizes` take where they are
  // staged (the communicator reserves it before the step; mbp::message_staging_bytes).
  std::size_t message_staging_bytes(const std::vector<std::int64_t>& sizes) const;
  // The values per sample this stage stages from the host beside the labels (reserve_staging's
  // sample_numel): the model's input on the first stage, none on the last (its input arrives from
  // the stage before); nothing at all on a middle stage (nullopt).
  std::optional<std::int64_t> staged_sample_numel() const;

 private:
  struct Run;  // one step under way: what its forwards and backwards share
  bool agrees_across_stages() const { return comm_->size() > 1; }
  void describe(StepConfig& c) const;
  Shape input_shape(std::int64_t n) const;  // one micro-batch's input: n samples of the stage's input shape
  // The per-sample output shape of segments [from, to) for per-sample input `sample`: a no-grad dry
  // run where their parameters live (this stage's device, or the host for the stages before).
  Shape probe(const Shape& sample, std::size_t from, std::size_t to) const;
  Tensor run_segments(Tensor x);
  void forward(Run& r, std::size_t i);
  void backward(Run& r, std::size_t i);
  void send_back(Run& r, const Tensor& x);

  PipelineStage stage_;
  std::shared_ptr<distributed::Communicator> comm_;
  CrossEntropyOptions loss_;
  std::shared_ptr<Arena> arena_;
  Device device_;
  DType dtype_;             // the model's parameters (and the loss)
  DType activation_dtype_;  // the stage's inputs and messages
  InputStager& stager_;
  std::vector<nn::Module::Segment> segments_;
  std::vector<nn::StepState*> states_;
  Shape model_sample_shape_;                     // the model's input, per sample (stage 0's)
  std::int64_t model_sample_numel_ = 1;
  Shape sample_shape_;                           // the stage's input, per sample
  Shape output_sample_shape_;                    // the stage's output, per sample
  std::map<std::int64_t, std::int64_t> agreed_;  // the micro-batch agreed per batch size
  PipelineTrace trace_;
};

}  // namespace tally::mbp
