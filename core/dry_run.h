// core/dry_run.h — the dry-run switch, and the one guard for host-side work.
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
//   * host-side work of a step: one guard, `if (skip_host_work()) return;` (or around the one
//     statement), for what a dry run must not do although it launches no kernel — change host
//     state that outlives the step (an optimizer's step counter, BatchNorm's num_batches_tracked,
//     the initializers' random draws), read device values or input data on the host (a loss, a
//     gradient seed, the images of a micro-batch, a check that memory is real), or talk to other
//     ranks (collectives). Without it every planner probe would, e.g., advance SGD's step count.
// Only core/ reads is_dry_run() itself (allocation paths that must behave alike in both runs).
#pragma once

namespace tally {

bool is_dry_run();

// The guard for host-side work (above): true in a dry run.
inline bool skip_host_work() { return is_dry_run(); }

class DryRunGuard {
 public:
  DryRunGuard();
  ~DryRunGuard();
  DryRunGuard(const DryRunGuard&) = delete;
  DryRunGuard& operator=(const DryRunGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace tally
