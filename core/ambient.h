// core/ambient.h — the one ambient context of a thread, inside core/ (docs/architecture.md, "The
// ambient context"): what an op reads from its surroundings rather than from its arguments, as
// in PyTorch — where a new tensor's bytes come from (per device), the host tier, whether this is a
// dry run, and the log a planner's measure of offloaded segments reads. Set and restored only by
// the scopes that own each field: ArenaScope and HostArenaScope (core/memory.h), DryRunGuard
// (core/dry_run.h) — and DryRun, which sets arenas, host tier and switch together — OffloadLog
// (core/offload.h) and SampleScope (core/ops.h). Nothing above core/ includes this header.
#pragma once
#include <memory>
#include <optional>
#include <unordered_map>

#include "core/arena.h"
#include "core/ops.h"  // SampleIndex

namespace tally {
class OffloadLog;  // core/offload.h
}

namespace tally::detail {

struct AmbientContext {
  std::shared_ptr<Arena> cpu_arena;                             // ArenaScope on the CPU (null: the default arena)
  std::unordered_map<int, std::shared_ptr<Arena>> cuda_arenas;  // ArenaScope per GPU
  std::shared_ptr<Arena> host_tier;                             // HostArenaScope (null: none)
  bool offload_prefetch_on_cpu = false;                         // HostArenaScope's option (core/offload.h)
  bool dry_run = false;                                         // DryRunGuard
  OffloadLog* offload_log = nullptr;                            // the innermost OffloadLog alive
  std::optional<SampleIndex> samples;                           // SampleScope (core/ops.h)
};

// This thread's.
AmbientContext& ambient();

}  // namespace tally::detail
