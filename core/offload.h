// core/offload.h — offloaded segments: what a part of the forward saves for its backward moved to
// the host tier's memory in between (activation offloading; the third choice beside keeping and
// recomputing, mbp/activations.h).
//
// offload(f, x) runs y = f(x) with its history recorded, as a plain call does. When f returns,
// every storage its forward made that is still alive — what the backward of its ops saved:
// categories activation and input; not statistics (temporary) nor workspaces — except y's, and
// x's own storage, move to the host tier's arena (core/memory.h, current_host_arena). When
// backward reaches the segment (a node between y and f's last op), they come back to the device's
// current arena before any op of the segment runs its backward. Bytes are copied, never changed:
// gradients are bit for bit those of a plain run.
//   * x moves too: the caller guarantees that nothing after the segment's forward reads x but its
//     backward — true of the recomputation ladder's segments (nn/recompute.h), links of a chain
//     whose every input is the previous link's output. Every view of a moved storage follows it.
//   * Prefetch: when the segment's input was the output of another offloaded segment (the one
//     whose backward comes next), that one's storages come back as soon as this one's backward
//     begins — on a GPU on the copy stream, beside this backward's compute, the compute stream
//     waiting for them (an event) only before that segment's backward. On the CPU they come back
//     at their own segment's backward (a copy there has nothing to overlap with), unless the host
//     tier's scope asks for the GPU's order (core/memory.h: HostArenaScope, offload_prefetches;
//     tests: the same values, the same exact peaks in both arenas).
//   * On a GPU the copies out run on the copy stream after the compute that wrote them; the
//     compute stream waits for them before any later work can reuse the freed blocks. No host wait
//     anywhere; host blocks freed after an upload are reused only by later copies on the same
//     stream within the step (the step allocates no other host block until its backward ends).
//   * In a dry run nothing is copied and no stream is touched; both arenas see the real step's
//     allocations, so the planner predicts both tiers exactly.
//   * Inside a recomputed segment's re-run (recomputing()) or with grad mode off, offload(f, x) is
//     f(x): what a re-run saves is needed at once.
// Without a host tier (no HostArenaScope), offload throws tally::Error naming what it needs.
#pragma once
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally {

// `name` names the segment in errors and in an OffloadLog ("layer1.0").
Tensor offload(const std::function<Tensor(const Tensor&)>& f, const Tensor& x, const std::string& name);

// Moves `s` between a device's arena and the host tier's, either way, with a copy that is done
// when it returns (on a GPU after the compute work enqueued before it): persistent state moved
// once, not a step's activations. Every view of the storage follows.
void move_storage(Storage& s, std::shared_ptr<Arena> to);

// What each offload on this thread moved while an OffloadLog is alive (innermost log only): the
// planner's measure of a segment for its cost model (mbp/activations.h).
struct OffloadRecord {
  std::string name;            // the segment
  std::size_t bytes = 0;       // moved to the host, and back
  double forward_flops = 0;    // f's forward work (core/ops.h, FlopCount::forward)
};
class OffloadLog {
 public:
  OffloadLog();
  ~OffloadLog();
  OffloadLog(const OffloadLog&) = delete;
  OffloadLog& operator=(const OffloadLog&) = delete;
  const std::vector<OffloadRecord>& records() const { return records_; }
  static void add(OffloadRecord r);  // to the current log, if any

 private:
  OffloadLog* outer_;
  std::vector<OffloadRecord> records_;
};

}  // namespace tally
