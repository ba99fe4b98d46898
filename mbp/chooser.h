// mbp/chooser.h — what a training step of a batch will be, chosen by dry runs alone: the
// micro-batches, the recomputation (a level of the model's ladder, or each segment kept,
// recomputed or offloaded), where the persistent state lives, and the predicted peaks of both tiers.
//
// A plan is a question — "what would fit?" — and answering it must not change the subject. The
// Chooser answers it by measuring (mbp/planner.h: dry runs on virtual clones of the arenas) and
// returns a plain value, a StepConfig; the executor (mbp/executor.h) applies a configuration once
// and then only runs steps. Measuring never moves, allocates or changes a real tensor, part or
// option:
//   * placements are simulated: before each dry run, the virtual clones of the device arena and of
//     the host tier get the moves that placement would make (simulate_placement: each block of
//     state allocated where it goes and freed where it was, in the order of the real moves), and
//     the dry run's step updates and accumulates as placed (the executor's DryStep with the
//     placement: Optimizer::dry_step, HostGradients::simulated);
//   * the model's segment modes are set while a level or a set of modes is measured and restored
//     before choose() returns (nn::RecomputeStateScope) — the configuration carries them.
// The policies (ExecutorOptions::recompute, ::placement, ::micro_batch; docs/mbp.md,
// docs/host-tier.md, docs/activations.md):
//   * recompute "none", a level by name, segments by name: measured as given; "auto": the first
//     level of the ladder on which the plan fits (none if it fits without) — with a host tier, where
//     nothing fits one sample, each segment kept, recomputed or offloaded by the cost model first;
//   * placement unset (with a host tier): device, optimizer, gradients, in the order of the bytes
//     they move; the largest micro-batch wins, ties to the fewer bytes moved.
// Why "auto" takes the first level on which the plan fits: once one sample fits, MBP already
// runs any batch exactly, and every level of recomputation costs step time; whoever wants larger
// micro-batches for speed asks for a level. Choices are cached per batch size (and plans by the
// planner, per recomputation state and the layout the state starts from).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mbp/activations.h"
#include "mbp/planner.h"
#include "mbp/recompute.h"
#include "nn/recompute.h"

namespace tally::optim {
class Optimizer;
}
namespace tally::nn {
class Module;
}

namespace tally::mbp {

struct ExecutorOptions;  // mbp/executor.h

// Where the step's persistent state lives (docs/host-tier.md):
//   device     everything in the device arena (the only placement without a host tier);
//   optimizer  the optimizer's state in the host tier's arena and its update run there on the
//              CPU (optim/optimizer.h, "Host placement"): the device holds the parameters, their
//              gradients and one micro-batch's work; each step moves every gradient and parameter
//              to the host and the parameters back.
//   gradients  the optimizer as above, and the gradients accumulated in the host tier
//              (mbp/host_gradients.h): the device holds the parameters, one micro-batch's work and
//              only the gradients being written; each micro-batch moves every gradient in and out.
//              Not with data parallelism (its all-reduce sums device buffers).
// A placement moves bytes, never changes a value: on the CPU device the parameters after any
// number of steps are bit-identical under all three.
enum class Placement { device, optimizer, gradients };
const char* placement_name(Placement p);

// The placement a plan runs with, and why (ExecutorOptions::placement unset: the chooser's
// choice; given: "as given").
struct PlacementChoice {
  Placement placement = Placement::device;
  std::string why;
};

// What a step of one batch size is: everything the executor applies before running it.
struct StepConfig {
  Plan plan;                   // the micro-batches and the predicted peaks of both tiers
  RecomputeChoice recompute;   // the level or the segments' modes, and why
  PlacementChoice placement;   // where the state lives, and why
  nn::RecomputeState segments; // the model's segment modes to set
};

// The state as the executor has applied it: where it lies, and the moves that laid it out
// ("built>optimizer>…": plans are keyed by it, since a dry run starts from that layout).
struct StateLayout {
  Placement placed = Placement::device;
  std::string name = "built";
};

class Chooser {
 public:
  // A dry run of the step for these micro-batch sizes under `placement`, on the current (virtual)
  // arenas, with the model's segment modes as they are: the executor's run_step.
  using DryStep = std::function<void(Placement placement, const std::vector<std::int64_t>& sizes)>;

  // `arena`: the device arena the step runs on; the model's parameters and the optimizer's state
  // (created or declared: optim::StateCreation) as the executor holds them; `options` outlives the
  // chooser; `data_parallel`: the gradients' all-reduce sums device buffers (no placement gradients).
  Chooser(nn::Module& model, const optim::Optimizer& optimizer, std::shared_ptr<Arena> arena,
          const ExecutorOptions& options, bool data_parallel, DType activation_dtype, DryStep step);
  Chooser(const Chooser&) = delete;  // its planner's step refers to it
  Chooser& operator=(const Chooser&) = delete;

  // The configuration for a batch of `batch` samples with micro-batches of at most `limit`
  // (out-of-memory retries lower it), the state laid out as `now` says. Throws OutOfMemory naming
  // what would be needed when nothing fits.
  StepConfig choose(std::int64_t batch, std::int64_t limit, const StateLayout& now);
  // The same recomputation and placement as choose() picks for `batch`, with micro-batches of
  // exactly `micro_batch` (a pipeline's stages agree on one).
  StepConfig choose_with(std::int64_t batch, std::int64_t micro_batch, std::int64_t limit, const StateLayout& now);
  // The plan of `batch` at level `level` of the model's ladder (micro-batches of exactly
  // `micro_batch` if given), at the placement choose() would take: what one level saves over another.
  Plan at_level(std::int64_t batch, std::optional<std::int64_t> micro_batch, int level, std::int64_t limit,
                const StateLayout& now);

  // The highest level of the ladder "auto" climbs (a pipeline stage: its blocks only).
  void set_top_level(int level) { top_level_ = level; }
  // The cost model's rates (mbp/activations.h): given, or measured once (with data parallelism
  // rank 0's, broadcast).
  const CostRates& cost_rates();
  Planner& planner() { return planner_; }
  // What `p`'s moves do to the arenas, replayed on a dry run's virtual clones (the state laid out
  // as `now`); without a clone of the host tier its side is skipped.
  void simulate_placement(Placement p, const StateLayout& now, Arena& device, Arena* host) const;
  // Throws an OutOfMemory naming both tiers' needs when the host tier cannot hold what `p` puts
  // there (the state laid out as `now`).
  void check_host_holds(Placement p, const StateLayout& now) const;
  // The host tier's arena while placement `p` or an offloaded segment uses it, else null.
  std::shared_ptr<Arena> host_arena_for(Placement p) const;

 private:
  // The search, working on the model's segment modes (restored by the public entries) and on
  // choice_ / placement_ (copied into the configuration).
  const Plan& by_policy(std::int64_t batch);
  const Plan& ladder(std::int64_t batch);
  const Plan* per_segment(std::int64_t batch);
  const Plan& named_segments(std::int64_t batch);
  const Plan& as_set(std::int64_t batch, std::optional<std::int64_t> micro_batch);
  const Plan& measure(std::int64_t batch, std::optional<std::int64_t> micro_batch, Placement p);
  [[noreturn]] void throw_none_too_small(const OutOfMemory& without, std::int64_t batch);
  const std::vector<ActivationCost>& segment_costs();
  RecomputeChoice segment_choice(const std::vector<nn::SegmentMode>& modes, const std::string& name);
  bool offloading() const;
  StepConfig config(const Plan& plan);
  void kernels_changed();

  nn::Module& model_;
  const optim::Optimizer& optimizer_;
  std::shared_ptr<Arena> arena_;
  const ExecutorOptions& opt_;
  bool data_parallel_;
  DType activation_dtype_;
  Planner planner_;
  int top_level_;
  // The call under way: its limit and layout, and the placement its dry runs simulate.
  std::int64_t limit_ = INT64_MAX;
  StateLayout now_;
  std::optional<Placement> measuring_;
  RecomputeChoice choice_;
  PlacementChoice placement_;
  std::map<std::int64_t, RecomputeChoice> auto_choices_;  // recompute "auto": the choice per batch size
  // The placement chosen per (batch size, recomputation state) when the chooser chooses.
  std::map<std::pair<std::int64_t, std::string>, PlacementChoice> placement_choices_;
  std::optional<CostRates> rates_;
  // What chose the kernels the choices were made under (core/conv_tuning.h: kernel_choices — the
  // tuning table and TF32, determinism, the convolution API: other engines, other workspaces).
  std::pair<std::uint64_t, std::uint64_t> kernels_{};
  std::optional<std::vector<ActivationCost>> segment_costs_;
};

}  // namespace tally::mbp
