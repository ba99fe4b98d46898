// core/dry_run.h — the dry-run switch, and the one guard for a step's side effects.
//
// Under a DryRunGuard every op allocates its outputs, saved tensors and workspaces exactly as in
// a real run but launches no kernel. Run on a virtual arena (core/arena.h), a dry run of a
// training step predicts the real step's peak to the byte: that is how the MBP planner
// (mbp/planner.h) measures a micro-batch size without computing anything. The switch is
// per thread, so a planner's probes never affect another thread's real work.
//
// Who looks at the switch:
//   * kernels: nobody above the dispatch — TALLY_DISPATCH (core/dispatch.h) checks device and
//     dtype as a real run does and then skips the kernel, so op bodies, optimizer updates and
//     tensor copies carry no dry-run checks;
//   * a step's side effects: one guard, `if (skip_side_effects()) return;` (or around the one
//     statement), for what a dry run must not do although it launches no kernel — change host
//     state that outlives the step (an optimizer's step counter, BatchNorm's num_batches_tracked,
//     the initializers' random draws), read device values or input data on the host (a loss, a
//     gradient seed, the images of a micro-batch, a check that memory is real), or talk to other
//     ranks (collectives). Without it every planner probe would, e.g., advance SGD's step count.
// Only core/ reads is_dry_run() itself (allocation paths that must behave alike in both runs).
//
// Who starts one: a DryRun (below) — the one object above core/ that turns the switch on, makes a
// virtual arena current and hands out virtual arenas (the planner's probes, a pipeline stage's
// input shape, the layer table, `tally plan`). The switch and the current arena are the two
// ambient contexts an op reads (core/memory.h: ops allocate from the current arena).
#pragma once
#include <cstddef>
#include <memory>
#include <optional>

#include "core/memory.h"

namespace tally {

bool is_dry_run();

// The guard for a step's side effects (above): true in a dry run.
inline bool skip_side_effects() { return is_dry_run(); }

// The switch alone, for its scope (core/ and tests; above core/, a DryRun).
class DryRunGuard {
 public:
  DryRunGuard();
  ~DryRunGuard();
  DryRunGuard(const DryRunGuard&) = delete;
  DryRunGuard& operator=(const DryRunGuard&) = delete;

 private:
  bool previous_;
};

// A dry run for the object's lifetime: the switch on and, unless made with no arena, a virtual
// arena made current for its device on this thread (ggml's gallocr "reserve" is the model:
// measuring is a call on an allocator, not a mode spread over the code).
//   DryRun dry(real);            a virtual clone of `real` in its exact state: what the next
//                                allocations would do there (capacity: real's, or `capacity`
//                                if given and larger — how much a step *would* need); and of
//                                the host tier's arena when one is current (core/memory.h:
//                                current_host_arena), made current the same way;
//   DryRun dry(device, bytes);   a fresh virtual arena of that capacity;
//   DryRun dry;                  the switch only: for a caller that builds on virtual arenas
//                                of its own (virtual_arena()) and scopes them itself.
class DryRun {
 public:
  DryRun();
  explicit DryRun(const Arena& real, std::optional<std::size_t> capacity = std::nullopt);
  DryRun(Device device, std::size_t capacity);
  ~DryRun();
  DryRun(const DryRun&) = delete;
  DryRun& operator=(const DryRun&) = delete;

  // The run's current arena (an Error for a DryRun made with no arena).
  Arena& arena() const;
  // The virtual clone of the host tier's arena (null when none was current).
  const std::shared_ptr<Arena>& host_arena() const { return host_; }
  const std::shared_ptr<Arena>& arena_ptr() const;
  // A new virtual arena of `capacity` bytes on `device`, not made current.
  std::shared_ptr<Arena> virtual_arena(Device device, std::size_t capacity) const;

 private:
  DryRunGuard guard_;
  std::shared_ptr<Arena> arena_;
  std::optional<ArenaScope> scope_;
  std::shared_ptr<Arena> host_;
  std::optional<HostArenaScope> host_scope_;
};

class Tensor;  // core/tensor.h
// In a dry run on a virtual clone of `t`'s arena (a DryRun(real)): frees the clone's copy of t's
// block, as dropping `t` frees the real one at that point of the real run — for a step that
// replaces a tensor made before it (the MBP executor's input slots). An Error outside a dry run,
// on an arena that is not virtual, or where the clone has no live block at t's offset.
void free_in_dry_run(const Tensor& t);

}  // namespace tally
