// core/dry_run.h — the dry-run switch.
//
// Under a DryRunGuard every op allocates its outputs, saved tensors and workspaces exactly as in
// a real run but launches no kernel. Run on a virtual arena (core/arena.h), a dry run of a
// training step predicts the real step's peak to the byte: that is how the MBP planner
// (mbp/planner.h) measures a micro-batch size without computing anything. The switch is
// per thread, so a planner's probes never affect another thread's real work.
#pragma once

namespace tally {

bool is_dry_run();

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
