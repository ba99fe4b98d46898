// core/graphs.h — a micro-batch's device work recorded once as a CUDA graph and replayed without its
// host code (docs/gpu.md, "CUDA graphs"; the MBP executor's --cuda-graphs).
//
// What a replay may skip is the host's side of the work: the autograd tape, the arena's bookkeeping,
// the dispatch, the launches. That is exact only where the host side leaves nothing behind that the
// device work did not record, so recording checks it:
//   * the arena: its layout (core/arena.h: every block, used or free) must be the same after the
//     work as before — what the work allocates, it frees — so a replay, which allocates nothing,
//     leaves the arena as a run would; and the caller keys its graphs by the layout before (the
//     same layout, the same requests: the same addresses, which the graph has baked in);
//   * host state the work advances (a BatchNorm's count of values, the FLOP counters): declared
//     with on_replay() while recording, done again at each replay;
//   * host values a kernel takes as an argument and that change from call to call (dropout's sample
//     index): declared with not_replayable(), which makes the recording good for one launch only.
// Anything that waits for the device inside the work breaks the capture: an Error naming CUDA's
// reason, the capture abandoned. The work recorded is launched once at once, so a recording is
// also the run of its micro-batch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"

namespace tally {

class Arena;

class DeviceGraph {
 public:
  // Launches the work again on the compute stream (no host wait) and does the host effects.
  void replay() const;
  // Whether replay() may be called: no not_replayable() while it was recorded. Why not, if not.
  bool replayable() const { return why_not_.empty(); }
  const std::string& why_not() const { return why_not_; }
  std::size_t nodes() const { return nodes_; }
  std::size_t device_bytes() const { return device_bytes_; }  // instantiating it took, outside the arena
  // The allocate() calls the work made in its arena: a replay counts them (Arena::count_replayed)
  // without making them, so a fault injected among them needs the work run (Arena::fault_within).
  std::uint64_t allocations() const { return allocations_; }

 private:
  friend DeviceGraph record_device_work(Device device, Arena& arena, const std::function<void()>& work);
  std::shared_ptr<void> graph_;  // the backend's executable graph
  std::function<void()> launch_;
  std::vector<std::function<void()>> effects_;
  std::string why_not_;
  std::size_t nodes_ = 0, device_bytes_ = 0;
  std::uint64_t allocations_ = 0;
};

// Runs `work` (its host code, once) while the compute stream of `device` (a GPU) records what it
// enqueues, checks what is said above against `arena` (the arena the work allocates from), then
// launches the recording once. The peaks the work reached in the arena (core/arena.h: Arena::Peaks)
// and its allocate() and free() calls are kept, and each replay raises the arena's peaks to them and
// counts the calls (and the fault-injection countdown), as a run of the work would. Throws
// tally::Error on a CPU device or a build without CUDA, while a Profiler times ops (its events
// cannot be read back from a graph), when the capture breaks (naming CUDA's reason), and when the
// arena's layout after the work differs from before (saying so).
DeviceGraph record_device_work(Device device, Arena& arena, const std::function<void()>& work);

// While work is recorded on this thread: `effect` is done again at each replay (the work advanced
// this host state once, as each replay must). Otherwise nothing.
void on_replay(std::function<void()> effect);
// While work is recorded on this thread: the recording may be launched only once (`why`: what
// changes between calls). Otherwise nothing.
void not_replayable(const std::string& why);
bool recording_device_work();

}  // namespace tally
