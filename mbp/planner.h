// mbp/planner.h — the MBP planner: the largest micro-batch whose whole training step fits.
//
// Algorithm (see docs/mbp.md):
//   * Parameters, gradients and optimizer state are allocated before planning, so they are
//     already in the arena and count against the budget like everything else.
//   * A *probe* of a split — micro-batch sizes (n_1, ..., n_k) — is a dry run of the real step
//     (the caller's StepFn: forward and backward of every micro-batch, then the optimizer step)
//     on a virtual clone of the arena: same allocation sequence as the real step, no memory, no
//     compute. The probe fits if no allocation fails; its peak is the real step's peak, to the
//     byte, because the arena is deterministic.
//   * A batch of B samples through micro-batches of at most m becomes k = ceil(B / m) balanced
//     micro-batches (sizes differ by at most one, larger first). The search gallops m = 1, 2, 4,
//     ... until a split fails (or m reaches B), then bisects between the last fit and the first
//     failure. Search probes run a shortened split (each run of equal sizes cut to two: after a
//     micro-batch everything but the persistent state is freed, so further repetitions replay the
//     same allocations); the chosen plan is then verified by a traced dry run of its exact split
//     (of up to kVerifyAll micro-batches; beyond, of its shortened split, so that planning takes
//     the same time and memory at any batch size), which gives the predicted peak and what is live
//     at that moment. Its work (FlopCount) is counted on the micro-batches it ran and scaled to
//     the batch: every counted op's work is proportional to its samples.
//   * Plans are cached by (B, budget, upper limit on m, and the caller's `variant`: what else
//     decides the step's allocations — the executor passes the model's recomputation state).
//   * A split that cannot run at any budget (BatchNorm needs more than one value per channel, so a
//     ResNet whose last feature map is 1x1 cannot train on micro-batches of 1) is skipped: the
//     search gallops on to the first size that runs.
// An explicit micro-batch size skips the search; if it does not fit, or if even the smallest
// size does not, the error states the smallest budget that would run it — the high-water mark
// of a dry run on a virtual clone with room to spare, exact because the arena's layout does not
// depend on its capacity (core/arena.h) — and what is live at the peak, by category.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/ops.h"

namespace tally::mbp {

// The capacity of a virtual clone of `a` with room to spare (64x its capacity, at least 64 TiB of
// offsets): what a step would need is measured on it whatever the budget (DryRun(a, this)).
std::size_t unbounded_capacity(const Arena& a);

// k micro-batch sizes that split `batch` samples as evenly as possible, larger ones first.
std::vector<std::int64_t> balanced_sizes(std::int64_t batch, std::int64_t micro_batches);

// The same balanced split held as its two runs — n_large micro-batches of `large` samples, then
// n_small of large - 1 — so that a plan of any batch size takes constant memory (a batch of 2^31
// samples is "21,474,837 micro-batches of 100", not a vector of them).
struct Split {
  std::int64_t large = 0, n_large = 0, n_small = 0;
  // The split of `batch` samples into micro-batches of at most m: k = ceil(batch / m) of them.
  static Split of(std::int64_t batch, std::int64_t m);
  std::int64_t count() const { return n_large + n_small; }         // k
  std::int64_t small() const { return n_small > 0 ? large - 1 : large; }
  std::int64_t batch() const { return large * n_large + small() * n_small; }
  std::vector<std::int64_t> sizes() const;  // every micro-batch, in order (a real step's)
  // Each run cut to at most `keep` micro-batches: what a dry run needs to see the split's peak
  // (after a micro-batch everything but the persistent state is freed, so further ones replay the
  // same allocations; see Planner::set_repeats).
  std::vector<std::int64_t> shortened(std::size_t keep) const;
};

// Bytes live per category at one moment (the peak of a step).
struct Breakdown {
  std::array<std::int64_t, kNumCategories> bytes{};
  std::int64_t total() const;
  std::string str() const;  // "parameter 1.0 MiB, gradient 1.0 MiB, ..." (non-zero entries)
};

struct Plan {
  std::int64_t batch_size = 0;     // B
  std::int64_t micro_batch = 0;    // m: the largest micro-batch of the split
  std::int64_t micro_batches = 0;  // k = ceil(B / m)
  Split split;                     // the balanced split, k micro-batches, B samples
  std::vector<std::int64_t> sizes() const { return split.sizes(); }
  std::size_t predicted_peak = 0;  // bytes live at the step's peak (arena rounding included)
  std::size_t budget = 0;          // the arena's capacity
  Breakdown at_peak;               // what is live at that moment
  // The host tier (docs/host-tier.md), when the step has one (its arena was current while
  // planning: core/memory.h, current_host_arena): its predicted peak, capacity and what is live
  // at its peak; 0 and empty without one.
  std::size_t host_predicted_peak = 0;
  std::size_t host_budget = 0;
  Breakdown host_at_peak;
  FlopCount flops;                 // the step's work, from the verifying dry run (core/ops.h)
  int probes = 0;                  // dry runs the plan took
  double seconds = 0;              // time the planning took
  // "B 1024 = 19 micro-batches of 54 (16 of 54, 3 of 53) | predicted peak 47.9 MiB of 48.0 MiB"
  std::string summary() const;
};

// Runs one training step's allocations for these micro-batch sizes on the current arena; the
// planner calls it inside a DryRun on a virtual clone of its arena (core/dry_run.h).
using StepFn = std::function<void(const std::vector<std::int64_t>& sizes)>;

class Planner {
 public:
  // Up to this many micro-batches the verifying dry run walks every one of them.
  static constexpr std::int64_t kVerifyAll = 64;

  // `arena`: the real arena the step will run on (holding the persistent state now).
  Planner(std::shared_ptr<Arena> arena, StepFn step);

  // The plan for a batch of `batch` samples: the largest m <= max_micro_batch that fits, or
  // exactly `micro_batch` if given. Throws OutOfMemory with the bytes needed if nothing fits.
  // `variant` names the state of whatever else decides what a step allocates (the model's
  // recomputation, mbp/executor.h): plans of different variants are cached apart.
  const Plan& plan(std::int64_t batch, std::optional<std::int64_t> micro_batch = std::nullopt,
                   std::int64_t max_micro_batch = INT64_MAX, const std::string& variant = "");

  struct Probe {
    bool fits = false;
    std::size_t peak = 0;        // bytes live at the peak (valid when fits)
    std::size_t high_water = 0;  // highest end offset: the smallest budget that runs it
    Breakdown at_peak;           // valid when fits and detailed
    // The host tier's, when one was current (valid when fits; at_peak when detailed).
    std::size_t host_peak = 0, host_high_water = 0, host_capacity = 0;
    Breakdown host_at_peak;
    FlopCount flops;             // the work the dry run counted (valid when fits)
    std::string error;           // the split cannot run at all (BatchNorm on 1 value), not OOM
  };
  // Dry-runs the step for `sizes` on a virtual clone of the arena (of `capacity` bytes if
  // given and larger). `detailed` traces the run to find what is live at the peak.
  Probe probe(const std::vector<std::int64_t>& sizes, bool detailed,
              std::optional<std::size_t> capacity = std::nullopt);
  int probes() const { return probes_; }
  // A traced dry run of the step for `sizes` on a virtual clone of the arena, returned with its
  // trace (Arena::trace, marks and all): what the memory report draws for a plan.
  std::shared_ptr<Arena> traced(const std::vector<std::int64_t>& sizes);
  // How many micro-batches of one size a search probe keeps of a run of them (2: after a micro-batch
  // everything but the persistent state is freed). A pipeline stage holds up to S of them at once
  // under 1F1B (S + 1 keeps the steady state), all of them under GPipe (no shortening at all).
  void set_repeats(std::size_t repeats);
  // What to do to the virtual clones of the device arena and of the host tier's (null when none is
  // current) before each dry run's step, while it is set: the executor's simulation of a placement
  // it measures (mbp/chooser.cpp), so that measuring moves no real state. Plans of different
  // preparations must differ in their `variant`.
  using Prepare = std::function<void(Arena& device, Arena* host)>;
  void set_prepare(Prepare prepare) { prepare_ = std::move(prepare); }

 private:
  [[noreturn]] void throw_too_small(std::int64_t batch, std::int64_t m, const std::string& why);

  std::shared_ptr<Arena> arena_;
  StepFn step_;
  int probes_ = 0;
  std::size_t repeats_ = 2;
  Prepare prepare_;
  std::map<std::tuple<std::int64_t, std::size_t, std::int64_t, std::int64_t, std::string>, Plan> cache_;
};

}  // namespace tally::mbp
