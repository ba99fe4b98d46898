// mbp/executor.h — one training step of a batch larger than memory, through micro-batches.
//
// A step of B samples (see docs/mbp.md):
//   1. The chooser (mbp/chooser.h) gives the step's configuration — the split into k balanced
//      micro-batches of at most m samples, the recomputation, where the state lives — measured by
//      dry runs alone; the executor applies it once (the segment modes set, the state moved or
//      created where the placement puts it) and then only runs steps.
//   2. The loss divisor D is counted on the host over the *whole* batch (samples, or weighted
//      non-ignored targets). Every micro-batch's loss is sum_i w_i * loss_i / D, so the
//      gradients accumulated over the micro-batches are the full batch's mean-loss gradient
//      for any split (not the mean of the micro-batch means, which is wrong when the last
//      micro-batch is smaller).
//   3. For each micro-batch: copy its inputs into the arena (category input; on CUDA into one of
//      two input slots that outlive the step, the next micro-batch's uploaded — host to pinned
//      staging, then on the copy stream — before the current one computes, so the upload overlaps
//      it, and the next step's first while this step's last computes), forward, backward.
//      Weight gradients accumulate with beta = 1 straight into the persistent gradient buffers;
//      every other byte of the micro-batch is freed by its end. Targets are checked on the host
//      once per step, and the loss is summed on the device.
//   4. BatchNorm: each micro-batch normalizes with its own statistics; the running statistics
//      are updated once per step from the moments of all micro-batches (nn/modules.h).
//   5. One optimizer step, then the gradients are zeroed; then the step's loss is read — on CUDA
//      the one time a step waits for the device.
//   6. Data parallelism (an MPI or NCCL communicator; docs/distributed.md): the batch given to
//      step() is this rank's share of the global batch; a part of the step (mbp/data_parallel.h)
//      sums the divisor before the first micro-batch and the gradients and moments after the
//      last, at the step's extension points (mbp/step_part.h).
//   7. Pipeline stages (ExecutorOptions::pipeline): the executor hands step 3's loop to a
//      StageRunner (mbp/stage_runner.h) — the stage's segments in the schedule's order, messages
//      to and from the neighbouring stages — and keeps the rest.
// The chooser's planner dry-runs exactly this code (run_step, under the placement it measures), so the predicted peak is the real
// step's peak. If the real step still runs out of memory, the partial step is discarded —
// gradients zeroed, BatchNorm moments dropped; parameters, optimizer state and running
// statistics were not touched yet — the micro-batch limit halves and the step is retried with
// the same samples.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/autograd.h"
#include "core/graphs.h"
#include "core/ops.h"
#include "core/pending.h"
#include "core/staging.h"
#include "core/tensor.h"
#include "distributed/communicator.h"
#include "nn/modules.h"
#include "nn/module.h"
#include "mbp/activations.h"
#include "mbp/chooser.h"
#include "mbp/pipeline.h"
#include "mbp/planner.h"
#include "mbp/recompute.h"
#include "mbp/step_inputs.h"
#include "mbp/step_part.h"
#include "optim/optimizer.h"

namespace tally {
class ConvTuning;  // core/conv_tuning.h
}

namespace tally::mbp {

class HostGradients;  // mbp/host_gradients.h
class StageRunner;   // mbp/stage_runner.h

// How each micro-batch's loss is divided (docs/mbp.md, "Loss normalization"):
//   exact           sum_i w_i loss_i / D with D counted over the whole batch: the accumulated
//                   gradient is the full batch's for any split (tally's default).
//   per_micro_batch each micro-batch's own mean loss divided by the number of micro-batches k
//                   (the MBP paper's reference code; plain gradient accumulation): the mean of
//                   the micro-batch means, which differs from the full batch's mean whenever the
//                   micro-batches differ in size (or in weighted/ignored targets). For teaching.
enum class LossNormalization { exact, per_micro_batch };

// The precision of a step (docs/precision.md):
//   fp32  every tensor in the model's dtype (float32, or float64 for a float64 model).
//   bf16  mixed precision: each micro-batch's input is converted to bfloat16, so the activations,
//         the tensors saved for backward and the activation gradients are bfloat16, while the
//         parameters (float32 master weights), their gradients (accumulated in float32 over the
//         micro-batches), the optimizer state, the normalization statistics and the loss stay
//         float32. Convolutions and GEMMs multiply bf16 values and sum in float32. Needs a
//         float32 model; both backends have bf16 kernels.
enum class Precision { fp32, bf16 };
// "fp32" / "bf16", and back (an Error naming --precision and the allowed values).
const char* precision_name(Precision p);
Precision parse_precision(const std::string& name);
const std::vector<std::string>& precision_names();
// --memory-format: auto | contiguous | channels_last (ExecutorOptions::memory_format); auto is
// preferred_memory_format(device, tensor_cores) (core/tensor.h: `tensor_cores` when the convolutions
// run in bf16 or with TF32), or contiguous for pipeline stages.
MemoryFormat parse_memory_format(const std::string& name, Device device, bool pipeline = false,
                                 bool tensor_cores = false);
const std::vector<std::string>& memory_format_names();

struct ExecutorOptions {
  Shape sample_shape{};                       // one input sample, e.g. {3, 32, 32}
  CrossEntropyOptions loss{};                 // reduction is always the whole batch's mean
  LossNormalization normalization = LossNormalization::exact;
  std::optional<std::int64_t> micro_batch{};  // fixed m; unset = the largest that fits
  int max_oom_retries = 16;
  // Data parallelism: the ranks this step is shared with (unset or distributed::local(): this process
  // alone). Must serve the model's device (MPI: CPU, NCCL: CUDA).
  std::shared_ptr<distributed::Communicator> communicator{};
  // The most bytes of gradients summed over the ranks in one collective.
  std::size_t bucket_bytes = std::size_t(8) << 20;
  // Called with a line of text when a step is retried after running out of memory.
  std::function<void(const std::string&)> log{};
  // Recomputation (nn/recompute.h) the chooser may use to fit the budget (mbp/chooser.h):
  //   "none" (the default): it changes nothing — the model recomputes what its modules are marked
  //     to (nothing, unless a caller marked some); a budget too small for one sample is an error
  //     that also states what recomputing everything would need;
  //   "auto": the first level of the model's ladder on which the batch's plan fits (none if it
  //     fits without), chosen once per batch size and left set on the model;
  //   a level by name: "blocks", "all", or "blocks+layerK[-layerL]" (as recompute_level_name
  //     prints it, without spaces);
  //   segments by name (mbp/activations.h): "offload" (every segment of nn::segment_names), or a
  //     list such as "stem=offload,layer1.0=recompute" (the others kept); offloading needs a host
  //     tier.
  // With a host tier, "auto" where nothing fits one sample chooses per segment between keeping,
  // recomputing and offloading by the cost model of mbp/activations.h (then, if that is not
  // enough, the ladder's higher levels); without one it climbs the ladder as described.
  // Recomputation costs step time (one more forward per level), which is why it is not the
  // library's default: MBP already runs any batch exactly in whatever fits one sample.
  std::string recompute = "none";
  Precision precision = Precision::fp32;
  // The memory format each micro-batch's input is given to the model in (core/tensor.h): with
  // ChannelsLast the input is converted once per micro-batch and the CPU's convolutions and batch
  // norms then run channels-last from layer to layer, with no reorder around each convolution
  // (docs/memory-format.md). Values agree with Contiguous to float rounding. Not with pipeline
  // stages (their messages are row-major).
  MemoryFormat memory_format = MemoryFormat::Contiguous;
  // The host tier (docs/host-tier.md): an arena of host memory (Arena::make_host: pinned where a
  // GPU is present) for what a placement puts there, beside the device arena; null: none.
  std::shared_ptr<Arena> host_arena{};
  // Offloaded segments on the CPU come back in the GPU's order — as soon as the backward of the
  // segment after them begins (core/offload.h, "Prefetch") — instead of at their own backward: the
  // same values and exact peaks, a higher host-tier peak. For tests of that order; a GPU always
  // prefetches.
  bool offload_prefetch_on_cpu = false;
  // Where the persistent state lives. Unset: with a host tier, the placement that allows the
  // largest micro-batch, ties to the one that moves the fewest bytes (device before optimizer),
  // chosen per batch size at the recomputation as set — so recomputation ("auto") is used only
  // where no placement fits one sample; without a host tier, device. A placement other than
  // device needs a host tier.
  std::optional<Placement> placement{};
  // The cost model's rates (mbp/activations.h), for choosing between recomputing and offloading
  // a segment. Unset: measured once per process when first needed (measure_cost_rates; not in a
  // dry run); with data parallelism every rank takes rank 0's.
  std::optional<CostRates> cost_rates{};
  // Pipeline stages (mbp/pipeline.h): this process runs stage `pipeline->stage` of the model's
  // segments, rank s of `communicator` running stage s, its micro-batches run by a StageRunner
  // (mbp/stage_runner.h, which says what differs).
  std::optional<PipelineStage> pipeline{};
  // Convolution engines chosen by measurement on a GPU (core/conv_tuning.h): when a plan is first
  // applied, the passes its step runs are measured (or found in the tuning file, or replayed from a
  // checkpoint's record), the fastest engines installed and the plan made again under them — never
  // with a smaller micro-batch than the heuristics' engines allow (the "within" choices, else none,
  // are taken then). Null: the heuristics' choices. Nothing on the CPU; not for pipeline stages.
  std::shared_ptr<ConvTuning> conv_tuning{};
  // The index of this process's first sample in the step's whole batch (data parallelism: its
  // shard's offset, distributed::shard): what a sample's randomness is drawn by (dropout, SampleScope),
  // so that ranks draw their samples' masks as one process would.
  std::int64_t first_sample = 0;
  // CUDA graphs (core/graphs.h; docs/gpu.md, "CUDA graphs"): on a GPU, a micro-batch's forward and
  // backward after the step's first are recorded once per arena layout, micro-batch size and loss
  // divisor, and replayed for every later micro-batch that meets the same — its host code (the
  // tape, the arena's bookkeeping, the launches) skipped; the same kernels on the same addresses,
  // so the same bits and the same peak. Only where nothing else joins the micro-batch: no step
  // parts (data parallelism, the host tier), no offloaded segment, no trace; a micro-batch whose
  // work cannot be replayed (dropout's masks) is run as recorded once and then without graphs. Not
  // with a Profiler on (a replay runs no op's host code to time). Nothing on the CPU.
  bool cuda_graphs = false;
  // The GPU's input slots (Executor, "Input slots") on the CPU too: the same values and exact
  // peaks. For tests of their planning; a GPU always has them.
  bool input_slots_on_cpu = false;
};

struct StepResult {
  // The full batch's mean loss: set by step(); from step_enqueued(), set only where the value was
  // there already (always on the CPU, by chance on a GPU), else 0 — read `pending_loss`, not this.
  double loss = 0;
  // The same value as a read under way (core/pending.h): ready after step(); after
  // step_enqueued(), on a GPU, get() waits for the step to finish.
  PendingScalar pending_loss;
  std::int64_t micro_batch = 0;    // m used (after any retry)
  std::int64_t micro_batches = 0;  // k used
  std::size_t predicted_peak = 0;  // the plan's prediction for the split used
  std::size_t peak = 0;            // the arena's measured peak during the step
  // The host tier's (0 without one): the plan's prediction and the measured peak of the step.
  std::size_t host_predicted_peak = 0;
  std::size_t host_peak = 0;
  int oom_retries = 0;             // retries this step needed
  // Data parallelism: host time spent in the step's collectives (the divisor's sum, the buckets,
  // the moments), waiting for the slowest rank included; on CUDA only their enqueueing (NCCL runs
  // on the compute stream). A pipeline stage: the time it waited for the other stages' messages.
  double communication_seconds = 0;
};

class Executor {
 public:
  // Runs on `arena`, the budget of the plan: the model's parameters and gradient buffers must live
  // in it and exist already (the planner counts them); the optimizer's state exists already or is
  // created where the first plan places it (optim::StateCreation::when_placed). The
  // model's device and dtype are those of its first parameter. A pipeline stage
  // (ExecutorOptions::pipeline) needs only its own stage's parameters and gradients there.
  Executor(nn::Module& model, optim::Optimizer& optimizer, std::shared_ptr<Arena> arena, ExecutorOptions options);
  // Convenience: on the arena the model's parameters live in (the budget they were built in).
  Executor(nn::Module& model, optim::Optimizer& optimizer, ExecutorOptions options);

  // The plan for a batch of `batch` samples under the current limit: the chooser's configuration
  // (mbp/chooser.h; cached there), applied — the segment modes set on the model, the state moved
  // (or created) where the placement puts it — once; then only run.
  // A pipeline stage's plan has the micro-batch agreed across the stages (StageRunner::choose).
  const Plan& plan(std::int64_t batch);
  // What plan(batch) would run, measured by dry runs alone: nothing real is moved, allocated or
  // changed (Chooser::choose). A pipeline stage's agrees its micro-batch with the other stages: a
  // collective, called by every rank.
  StepConfig choose(std::int64_t batch);
  // The same with micro-batches of exactly `micro_batch`, at the recomputation plan(batch) would
  // choose (Chooser::choose_with): e.g. a pipeline stage's plan at the micro-batch the stages agree on.
  StepConfig choose_with(std::int64_t batch, std::int64_t micro_batch);
  // The configuration of the last plan(): its recomputation and its placement (device, "no host
  // tier", before the first).
  const RecomputeChoice& recompute_choice() const { return config_.recompute; }
  const PlacementChoice& placement_choice() const { return config_.placement; }
  // A traced dry run of `plan`'s step (the memory report's data): every micro-batch when there
  // are at most Planner::kVerifyAll, else the shortened split the planner verified (*all says
  // which). Nothing is computed; the returned virtual arena holds the trace.
  std::shared_ptr<Arena> traced_dry_step(const Plan& plan, bool* all = nullptr);
  // The plan of `batch` at level `level` of the model's recomputation ladder (micro-batches of
  // exactly `micro_batch` if given), measured only (Chooser::at_level): what the chosen level
  // saves over another.
  Plan at_level(std::int64_t batch, std::optional<std::int64_t> micro_batch, int level) {
    return chooser_.at_level(batch, micro_batch, level, limit_, layout());
  }
  // The chooser this executor asks (mbp/chooser.h).
  Chooser& chooser() { return chooser_; }
  // The state as applied (the chooser's starting point): its moves so far, and the input slots
  // where they exist (plans are keyed by both).
  StateLayout layout() const;

  // One training step on host data: images (batch, sample_shape...) as float32, labels (batch).
  // With a communicator of N > 1 ranks: this rank's share of the global batch (distributed::shard), and
  // every rank calls step() for every global step.
  StepResult step(const float* images, const std::int64_t* labels, std::int64_t batch);
  // The same step, returning as soon as it is enqueued: the loss is read later through
  // StepResult::pending_loss, so that on a GPU the host prepares the next step while this one
  // computes and the device never waits for it (tally train's loop; docs/mbp.md, "The loss, a
  // step late"). Everything else of the result is known at once (the peaks are the arena's, kept
  // on the host). On the CPU the loss is there at once, as from step().
  StepResult step_enqueued(const float* images, const std::int64_t* labels, std::int64_t batch);

  // Forward and backward of every micro-batch of `sizes` (sum = batch), accumulating into the
  // gradient buffers and BatchNorm moment accumulators; returns the full-batch loss (0 in a dry
  // run). The step's building block; public for tests of gradient equivalence.
  double accumulate(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes);

  // Adds a part to the step (mbp/step_part.h), called after the executor's own (data parallelism)
  // at each extension point, in the order added; between steps only (a plan made before does not
  // count what the part allocates: call it before the first plan).
  void add_part(std::unique_ptr<StepPart> part);

  const ExecutorOptions& options() const { return opt_; }
  const std::optional<PipelineStage>& pipeline() const { return opt_.pipeline; }
  // The runner of this pipeline stage's micro-batches (its schedule's trace, the forward through
  // every stage for evaluation); null unless ExecutorOptions::pipeline is set.
  StageRunner* stage() { return stage_.get(); }
  const StageRunner* stage() const { return stage_.get(); }
  // Upper limit on m after out-of-memory retries (INT64_MAX if none happened).
  std::int64_t micro_batch_limit() const { return limit_; }
  // Restores a limit saved with a checkpoint (mbp/checkpoint.h): m is planned below it from the
  // next step on, as after the retries that set it. limit >= 1, else tally::Error.
  void set_micro_batch_limit(std::int64_t limit);
  int total_oom_retries() const { return total_retries_; }
  Planner& planner() { return chooser_.planner(); }
  const std::shared_ptr<Arena>& arena() const { return arena_; }
  Device device() const { return device_; }
  // The dtype of the step's activations: the model's, or bfloat16 under Precision::bf16.
  DType activation_dtype() const { return activation_dtype_; }
  // The page-locked host memory the steps of `plan` stage their inputs through (core/staging.h: a
  // GPU's ring; 0 on the CPU, which copies straight into the inputs). Outside both budgets;
  // `tally plan` shows it.
  std::size_t input_staging_bytes(const Plan& plan) const;
  // The page-locked host memory a pipeline stage's messages of `plan` take where they travel through
  // host memory (a GPU's stages, distributed/staged.h; the CPU's stages send their arena tensors as
  // they are); 0 for a step that is no stage. Outside both budgets; `tally plan` shows it for GPUs.
  std::size_t message_staging_bytes(const Plan& plan) const;
  // What CUDA graphs (ExecutorOptions::cuda_graphs) did so far: micro-batches recorded, replayed,
  // and run without a graph because their recording could not be replayed; the graphs kept, their
  // nodes and the device memory instantiating them took (outside the arena). A recording that fails
  // (a call CUDA does not allow in a capture) discards the step, which runs again without graphs, as
  // does the rest of the run; `failed` says why.
  // At most kMaxGraphs recordings are kept per configuration: a loss divisor that changes from step
  // to step (class weights, ignored targets) would otherwise record every micro-batch anew; past
  // it, new keys run without a graph (`over_cap` counts them).
  static constexpr std::size_t kMaxGraphs = 16;
  struct GraphStats {
    std::int64_t recorded = 0, replayed = 0, unreplayable = 0, over_cap = 0;
    std::size_t graphs = 0, nodes = 0, device_bytes = 0;
    std::string failed;
  };
  const GraphStats& graph_stats() const { return graph_stats_; }
  MemoryFormat memory_format() const { return opt_.memory_format; }
  // The convolution tuning in use (ExecutorOptions::conv_tuning; null: none), and another in its
  // place from the next plan on (a resumed run's replay of its checkpoint's record).
  const std::shared_ptr<ConvTuning>& conv_tuning() const { return opt_.conv_tuning; }
  void set_conv_tuning(std::shared_ptr<ConvTuning> tuning);

  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

 private:
  // Each of `trained` (a parameter of `model`) has a gradient buffer, and both live in the arena.
  void check_trained(const nn::Module& model, const std::vector<Tensor>& trained) const;
  // Applies a configuration: the segment modes, then the placement (apply_placement).
  void apply(const StepConfig& config);
  // Tunes the convolutions of the applied plan's step once per configuration (conv_tuning) and
  // applies the plan made again under the tuned engines.
  void tune(std::int64_t batch);
  // Moves the persistent state to `p` (a no-op when there), creating the optimizer's state there
  // if it does not exist yet: the one place real state moves.
  void apply_placement(Placement p);
  // The host tier's arena while the applied placement or an offloaded segment uses it (a step's, a
  // trace's), else null.
  std::shared_ptr<Arena> placed_host_arena() const { return chooser_.host_arena_for(placed_); }

  nn::Module& model_;
  optim::Optimizer& optimizer_;
  ExecutorOptions opt_;
  Device device_;
  DType dtype_;             // the model's parameters (and the loss)
  DType activation_dtype_;  // the inputs, and so every activation of the step
  std::shared_ptr<Arena> arena_;
  std::vector<nn::StepState*> states_;  // the model's state across micro-batches (nn/module.h)
  std::int64_t sample_numel_ = 1;
  std::int64_t limit_ = INT64_MAX;
  // Input slots. On a GPU a step's inputs go through two slots in the arena (category input) that
  // outlive the step, taken in turn from micro-batch to micro-batch and from step to step. The
  // upload of the next micro-batch — the next step's first one too — then waits only for the
  // compute work that last read its slot (a fence of the stager after that micro-batch), never for
  // the whole step before: the double-buffered input the device needs so as not to wait for the
  // host. Sized for the plan's largest micro-batch, made again when a plan needs another size (the
  // planner's dry runs do the same on their virtual clones: plans stay exact). None for a step that
  // offloads a segment (the model's input may move to the host tier with the first one's).
  using InputSlots = detail::InputSlots;  // mbp/step_inputs.h
  InputSlots slots_;  // before stager_: freed after its uploads are done
  // The slots a step of micro-batches of `sizes` takes: slots_, made again for its largest
  // micro-batch if need be; in a dry run a copy in `local` (slots_ untouched; where the step makes
  // others or none, the old ones' blocks freed in the virtual clone as the real step frees them).
  // Null where the step takes none (the CPU, an offloading step).
  InputSlots* step_slots(const std::vector<std::int64_t>& sizes, InputSlots& local);
  std::unique_ptr<InputStager> stager_;  // the step's inputs onto the device (core/staging.h)
  Chooser chooser_;
  StepConfig config_;                     // the last configuration applied
  Placement placed_ = Placement::device;  // where the state is now
  std::string layout_ = "built";          // the real moves of state so far, as "built>optimizer>…": plans are keyed by it
  std::unique_ptr<HostGradients> host_gradients_;  // the part accumulating gradients on the host (Placement::gradients)
  std::vector<StepPart*> step_parts_;     // the parts of the step running now (run_step)
  std::unique_ptr<StageRunner> stage_;    // a pipeline stage's micro-batch loop (ExecutorOptions::pipeline)
  // The configurations tune() has seen: batch, micro-batch, micro-batches, predicted peak, layout
  // (plan() asks at every step: a comparison, no formatting).
  using TunedKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::size_t, std::string>;
  TunedKey tuned_key(std::int64_t batch) const;
  std::set<TunedKey> tuned_;

  // The loss options of micro-batch i of k (n samples from labels[offset]): the whole batch's
  // `divisor`, or with per-micro-batch normalization its own mean's.
  CrossEntropyOptions micro_batch_loss(const std::int64_t* labels, std::int64_t offset, std::int64_t n, std::size_t i,
                                       std::size_t k, double divisor) const;
  // CUDA graphs: a micro-batch's compute, recorded under `key` or replayed — the arena's layout
  // (Arena::layout_hash), its size, its loss divisor, and where its inputs and the step's loss lie
  // (two blocks of one layout may swap roles: the double-buffered inputs); whether micro-batch
  // `index` of this step may be (ExecutorOptions::cuda_graphs). The recordings are of the kernels
  // chosen when they were made: what chooses them (core/conv_tuning.h: kernel_choices) changed
  // since, they are dropped (kernels_for_graphs), and each size
  // runs once without a graph again before it is recorded (its new plans are built outside a capture).
  using GraphKey = std::tuple<std::uint64_t, std::int64_t, double, const void*, const void*, const void*>;
  bool graphs_for(std::size_t index) const;
  void kernels_for_graphs();
  std::optional<std::pair<std::uint64_t, std::uint64_t>> graph_kernels_;  // as the recordings were made
  void run_graphed(const GraphKey& key, const std::function<void()>& compute);
  // Every recording gone (another configuration or other engines): graph_stats_ then counts none.
  void drop_graphs();
  std::map<GraphKey, DeviceGraph> graphs_;  // of the configuration applied now (apply() clears them)
  std::set<GraphKey> unreplayable_;
  // Micro-batch sizes run without a graph since the configuration was applied: a size is recorded
  // only after that (its first run builds cuDNN's and cuBLAS's plans for its shapes, which a
  // capture must not).
  std::set<std::int64_t> warmed_sizes_;
  GraphStats graph_stats_;

  void discard_partial_step();
  // accumulate() with the loss left where it was computed (undefined in a dry run: no values).
  // `divisor`: the loss divisor D when it was counted elsewhere (over every rank's samples). Runs
  // on the current arena: arena_ in a real step (step() makes it current), the planner's virtual
  // clone of it in a dry run (the planner's DryRun makes that current).
  Tensor accumulate_loss(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
                         std::optional<double> divisor = std::nullopt);
  // The allocation sequence of a step, on the current arena; real data when images != nullptr,
  // else a dry run.
  std::vector<StepPart*> parts_for(Placement placement, std::unique_ptr<HostGradients>& simulated) const;
  // step() (wait: the loss read) and step_enqueued() (not).
  StepResult run(const float* images, const std::int64_t* labels, std::int64_t batch, bool wait);
  void run_step(Placement placement, const float* images, const std::int64_t* labels,
                const std::vector<std::int64_t>& sizes, PendingScalar* loss);
  // The hooks that tell the parts each parameter's gradient as it completes and when it is first
  // needed without a buffer (empty: no part wants it), and a backward under them.
  GradientReadyHook gradient_ready_hook() const;
  GradientSlotHook gradient_slot_hook() const;
  static void backward_watched(Tensor& loss, const GradientReadyHook& ready, const GradientSlotHook& slot);

  int total_retries_ = 0;
  // What modes add to the step at its extension points (mbp/step_part.h): data parallelism.
  std::vector<std::unique_ptr<StepPart>> parts_;
  std::map<const TensorImpl*, Tensor> trained_;  // the model's parameters by their impl, for the parts' hooks
};

}  // namespace tally::mbp
