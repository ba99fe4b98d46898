// mbp/graph_replay.h — whether the micro-batches of a step allocate at the same addresses: what
// replaying one micro-batch's captured work (a CUDA graph) for the next needs (docs/gpu.md, "Toward
// CUDA graphs").
//
// A CUDA graph replays kernels with the pointers they were captured with. MBP runs k micro-batches
// of one or two sizes through the same code, and tally's arena is deterministic (core/arena.h): the
// same requests from the same state give the same offsets. After a micro-batch everything but the
// persistent state is freed, so micro-batch i + 1 starts from the state micro-batch i started from
// — *if* nothing of micro-batch i outlives it. This check reads a traced step (Executor::
// traced_dry_step: the arena's events with a mark at each micro-batch's start) and compares each
// micro-batch's events — allocation or free, offset, bytes, in order — with the micro-batches before
// it: where two are equal event for event, one's captured graph could run as the other.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "core/arena.h"

namespace tally::mbp {

struct ReplayCheck {
  // Per micro-batch, in order: its samples (from the mark's label) and the index of the first
  // micro-batch whose events it repeats exactly (its own index when none before does).
  std::vector<std::int64_t> samples;
  std::vector<std::size_t> same_as;
  std::size_t events = 0;  // the events of the micro-batches compared, all together
  // "7 micro-batches: 2 patterns (1; 2-6 as 2), the last (5 samples) its own"; or why none.
  std::string summary() const;
};

// The check of a traced step's arena (its trace and marks, as traced_dry_step returns it). A trace
// without the executor's micro-batch marks: an empty check.
ReplayCheck check_replay(const Arena& traced);

}  // namespace tally::mbp
