// mbp/pipeline.h — pipeline stages: a model cut into S contiguous stages, one per rank, fed by the
// micro-batches MBP makes (docs/distributed.md, "Pipeline stages").
//
// The cut points are the model's segments (nn::Module::segments(): a ResNet's stem, each residual
// block, its head). Stage s runs segments [bounds[s], bounds[s + 1]); rank s of the job runs stage
// s. What a stage does in one step (mbp::StageRunner, mbp/stage_runner.h):
//   forward  of micro-batch i: stage 0 reads its images; stage s > 0 receives the activations of
//            stage s - 1 (point-to-point, into an arena buffer); the last stage computes the loss
//            with the whole batch's divisor (its targets are the only ones it needs) and runs its
//            backward at once; the other stages send their output on and keep it for backward;
//   backward of micro-batch i: stage s < S - 1 receives the gradient of its output, runs backward
//            (weight gradients accumulate in the stage's persistent buffers, beta = 1) and sends the
//            gradient of its input back to stage s - 1.
// The order (pipeline_order): GPipe — every forward, then every backward; 1F1B (PipeDream-flush) —
// S - s - 1 forwards, then one forward and one backward in turn, then the remaining backwards, so
// stage s holds at most S - s micro-batches' activations. Every stage takes its optimizer step
// once per batch, after its last backward: the step equals one process's step over the same
// micro-batches.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "distributed/communicator.h"
#include "nn/module.h"

namespace tally::mbp {

enum class PipelineSchedule { one_f_one_b, gpipe };
const std::vector<std::string>& pipeline_schedule_names();  // "1f1b", "gpipe"
// An Error naming --pipeline-schedule and the allowed values otherwise.
PipelineSchedule parse_pipeline_schedule(const std::string& name);
const char* pipeline_schedule_name(PipelineSchedule s);

// This rank's place in a pipeline.
struct PipelineStage {
  int stage = 0, stages = 1;
  std::vector<std::size_t> bounds;  // S + 1 segment indices: stage s runs [bounds[s], bounds[s + 1])
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  std::size_t first() const { return bounds.at(static_cast<std::size_t>(stage)); }
  std::size_t last() const { return bounds.at(static_cast<std::size_t>(stage) + 1); }
  // How many micro-batches' activations the stage holds at most, for k micro-batches.
  std::int64_t in_flight(std::int64_t micro_batches) const;
};

// One operation of a stage's step: the forward or the backward of micro-batch `index`.
struct PipelineOp {
  bool forward = true;
  std::int64_t index = 0;
};
// The order stage `stage` of `stages` runs k micro-batches in. The last stage runs each backward
// right after its forward: its order has forwards only (each one with its backward).
std::vector<PipelineOp> pipeline_order(PipelineSchedule schedule, int stage, int stages, std::int64_t k);

// The host memory a stage's messages of one step take where they travel through host memory (the
// staged transport, distributed/staged.h: a CUDA stage's activations and gradients): the
// high-water mark of a best-fit arena (core/arena.h) replaying the stage runner's messages in
// `schedule`'s order — a send's host copy kept until the runner waits for it (an activation until
// its gradient came back, a gradient until the next is sent), a receive's only while it arrives —
// for micro-batches of `sizes` samples, `input_bytes` and `output_bytes` per sample of the stage's
// input and output. The same arena lays the same messages out alike, so this is the exact size.
std::size_t message_staging_bytes(const PipelineStage& stage, const std::vector<std::int64_t>& sizes,
                                  std::size_t input_bytes, std::size_t output_bytes);

// What a stage did in a real step, for the schedule's picture (report::pipeline_svg): each forward
// and backward with its start and end in seconds from the step's start (the last stage's forwards
// include their backward), and the time it waited for a message.
struct PipelineEvent {
  bool forward = true;
  std::int64_t index = 0;
  double start = 0, end = 0;
};
struct PipelineTrace {
  std::vector<PipelineEvent> events;
  double seconds = 0;       // the stage's step, from its first micro-batch to its last
  double idle_seconds = 0;  // of those, waiting in recv (and for a send to be taken)
};

// What each segment costs a stage, measured by one dry run: its persistent bytes (parameters,
// gradients and `state_per_parameter` optimizer-state copies of them) and the bytes its training
// forward keeps per sample until its backward (output included).
struct SegmentCost {
  std::string name;
  std::int64_t parameters = 0;        // elements
  std::int64_t persistent_bytes = 0;  // parameters, gradients, optimizer state
  std::int64_t activation_bytes = 0;  // per sample, kept for backward
  double flops = 0;                   // per sample, of its forward (convolutions and GEMMs; core/ops.h)
};
std::vector<SegmentCost> segment_costs(nn::Module& model, const Shape& sample_shape, DType activation_dtype,
                                       int state_per_parameter);

// The cut the planner proposes, by a model of each stage's bytes: stage s's parameters, gradients
// and optimizer state plus m samples' activations times the micro-batches it holds under 1F1B (S - s;
// one on the last). First the cut on which the largest micro-batch m (<= batch) fits every stage's
// limit; among those, the one whose largest stage is smallest at that m. The exact plan of the cut
// then comes from each stage's dry runs. An Error when there are fewer segments than stages.
std::vector<std::size_t> balanced_cut(const std::vector<SegmentCost>& costs, int stages,
                                      const std::vector<std::int64_t>& limits, std::int64_t batch);
// The cut that makes the largest stage's work smallest (forward FLOPs: backward is about twice
// them everywhere), memory aside: what --pipeline-split would name to balance time.
std::vector<std::size_t> work_balanced_cut(const std::vector<SegmentCost>& costs, int stages);
// The --pipeline-split text of a cut ("layer2.1,layer3.0").
std::string split_text(const std::vector<SegmentCost>& costs, const std::vector<std::size_t>& bounds);
// Each stage's share of the model's forward work under a cut, in percent ("27% / 73%").
std::string work_shares(const std::vector<SegmentCost>& costs, const std::vector<std::size_t>& bounds);

// --pipeline-split "layer2.1,layer3.0": the first segment of every stage after the first, in
// order. An Error naming the option (core/option_names.h), what was expected and what was found
// otherwise. (The words "memory" and "work" name the two cuts above; apps/setup.cpp's build_setup
// reads all three.)
std::vector<std::size_t> parse_pipeline_split(const std::string& text, const std::vector<nn::Module::Segment>& segments,
                                              int stages);
// "stem .. layer2.0" (the segments of [first, last)).
std::string segment_range(const std::vector<nn::Module::Segment>& segments, std::size_t first, std::size_t last);

// The modules of stage `stage` under `bounds`.
std::vector<nn::Module*> stage_modules(const std::vector<nn::Module::Segment>& segments,
                                       const std::vector<std::size_t>& bounds, int stage);

// Moves the parameters (with their gradient buffers) and buffers of stage `stage` into `arena` (its
// rank's budget; the model was built elsewhere) and returns the stage's parameters, for its
// optimizer. An OutOfMemory names the stage, its segments and the bytes it needs.
std::vector<Tensor> place_stage(const std::vector<nn::Module::Segment>& segments, const std::vector<std::size_t>& bounds,
                                int stage, const std::shared_ptr<Arena>& arena);

// Checks that every parameter and buffer of `model` is used by exactly one segment (a model whose
// segments miss or share one cannot be cut); an Error naming the first that is not.
void check_segments_cover(nn::Module& model, const std::vector<nn::Module::Segment>& segments);

// After training, every rank gets every stage's parameters and buffers (each broadcast from the
// rank of its stage) through host memory: on rank 0 the whole model can then be saved under its
// usual names. Ranks hold the other stages' tensors outside their budget (the model was built
// there), so nothing here touches the budget's arena; a GPU stage's own tensors go through a host copy.
void gather_stages(nn::Module& model, const std::vector<nn::Module::Segment>& segments,
                   const std::vector<std::size_t>& bounds, distributed::Communicator& comm);

}  // namespace tally::mbp
