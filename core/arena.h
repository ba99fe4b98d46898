// core/arena.h — the device arena: every byte of device memory tally uses comes from here.
//
// Algorithm (read this first):
//   * One arena per device is reserved once with a fixed capacity — the memory budget. On CUDA
//     that is a single cudaMalloc; on the CPU a single mmap(MAP_NORESERVE), so a large CPU budget
//     costs nothing until touched. A *virtual* arena runs the identical algorithm with no memory
//     behind it (base pointer null, offsets only): a dry run of a training step on it yields the
//     offsets and peak the real step will have (ggml's "measure" allocator is the model).
//   * The arena is tiled by blocks, each free or used, kept in an offset-ordered map. Free blocks
//     are also kept in a set ordered by (size, offset). allocate() rounds the request up to 256
//     bytes and takes the *best fit*: the smallest free block that is large enough, the lowest
//     offset among equals — except the *tail* (the free block that ends at the capacity), which
//     is used only when no other free block fits. The block is split: the front is used, the rest
//     stays free. free() marks the block free and coalesces it with free neighbours.
//   * Tail last makes the layout independent of the capacity: a sequence that never reaches past
//     offset H lays out identically in any arena of capacity >= H (the tail's size never decides
//     a choice). H, the high-water mark, is therefore the smallest budget that runs the sequence,
//     and a dry run on a virtual arena with room to spare measures it exactly.
//   * Deterministic: the result depends only on the sequence of requests and frees — no
//     addresses, clocks or thread counts — so the same sequence gives the same offsets and the
//     same peak. This is the property the MBP planner stands on.
//   * Every allocation carries a Category and the name of the op that asked for it. Statistics
//     per category and in total: current, peak, allocations, frees (bytes are rounded sizes,
//     i.e. what the allocation takes out of the budget), plus free bytes and largest free block.
//   * An optional trace records each allocation and free (time, size, offset, category, op);
//     it exports as Chrome trace-event JSON that opens in Perfetto.
//   * A request that cannot be met throws tally::OutOfMemory naming the request, the free bytes,
//     the largest free block and the live bytes per category; the arena is left exactly as it was.
#pragma once
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/error.h"

namespace tally {

enum class Category : std::uint8_t {
  parameter,
  gradient,
  optimizer_state,
  activation,
  workspace,
  input,
  temporary,
};
inline constexpr int kNumCategories = 7;
const char* category_name(Category c);

struct MemoryStat {
  std::int64_t current = 0;      // bytes live now
  std::int64_t peak = 0;         // most bytes live at once since creation / reset_peak()
  std::int64_t allocations = 0;  // number of allocate() calls that succeeded
  std::int64_t frees = 0;        // number of free() calls
};

struct ArenaStats {
  std::array<MemoryStat, kNumCategories> by_category{};
  MemoryStat total{};
  std::size_t capacity = 0;
  std::size_t high_water = 0;  // highest end offset of a used block since creation / reset_peak()
  std::size_t free_bytes = 0;
  std::size_t largest_free_block = 0;
  const MemoryStat& operator[](Category c) const { return by_category[static_cast<int>(c)]; }
};

// Where in a training step an allocation is made, for the arena's trace: the forward of a module,
// the backward of a node that a module's forward recorded, a forward re-run in backward
// (recomputation), or elsewhere (inputs, the loss, the optimizer step).
enum class Phase : std::uint8_t { other, forward, backward, recompute };
const char* phase_name(Phase p);  // "other", "forward", "backward", "recompute"

// Who allocates on this thread now: the dotted path of the module whose forward runs (or whose
// forward recorded the node whose backward runs; "" for the model itself), and the phase. Set by
// nn::Module's calls and autograd's engine through an AllocationSiteScope; read by a tracing arena.
struct AllocationSite {
  const std::string* module = nullptr;  // owned by the module (lives as long as it); null: none
  Phase phase = Phase::other;
};
const AllocationSite& allocation_site();
class AllocationSiteScope {
 public:
  explicit AllocationSiteScope(AllocationSite site);
  ~AllocationSiteScope();
  AllocationSiteScope(const AllocationSiteScope&) = delete;
  AllocationSiteScope& operator=(const AllocationSiteScope&) = delete;

 private:
  AllocationSite previous_;
};

struct TraceEvent {
  double time_us;        // since the arena was created
  bool is_alloc;         // allocation or free
  std::size_t offset;
  std::size_t requested;  // bytes asked for
  std::size_t rounded;    // bytes taken from the budget
  Category category;
  std::string op;         // who asked
  std::int64_t total_after;  // total live bytes after the event
  // Where the allocation was made (a free carries its allocation's): the module path ("" when
  // none, "layer2.0.conv1") and the phase (allocation_site()).
  std::string module;
  Phase phase = Phase::other;
};

class OutOfMemory : public Error {
 public:
  OutOfMemory(const std::string& what, std::size_t requested) : Error(what), requested_(requested) {}
  std::size_t requested() const { return requested_; }

 private:
  std::size_t requested_;
};

// Where the bytes of a block live: offset within the arena, and the address (null in a virtual
// arena).
struct Block {
  std::size_t offset = 0;
  void* ptr = nullptr;
};

class Arena {
 public:
  static constexpr std::size_t kAlignment = 256;

  // Reserves `capacity` bytes on `device` (rounded down to the alignment).
  Arena(Device device, std::size_t capacity);
  // The same algorithm with no memory behind it.
  static std::shared_ptr<Arena> make_virtual(Device device, std::size_t capacity);
  // The host tier's arena (docs/host-tier.md): `capacity` bytes of host memory on Device::cpu,
  // reserved once — page-locked with one cudaHostAlloc where a GPU is present (copies to and from
  // the device then run without staging, and nothing is pinned per tensor), else one
  // mmap(MAP_NORESERVE) like the CPU device's arena.
  static std::shared_ptr<Arena> make_host(std::size_t capacity);
  bool is_pinned() const { return pinned_; }
  // A virtual arena in exactly this arena's state (blocks, statistics, trace switch): a dry run
  // on it continues from here as the real arena would.
  std::shared_ptr<Arena> virtual_clone() const;
  // The same, with a larger capacity (the extra bytes free at the end): how many bytes a step
  // *would* need is measured on it when the real budget is too small (the planner's error).
  std::shared_ptr<Arena> virtual_clone(std::size_t capacity) const;
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Block allocate(std::size_t bytes, Category category, const std::string& op);
  void free(std::size_t offset);

  static std::size_t round_up(std::size_t bytes) {
    const std::size_t r = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    return r == 0 ? kAlignment : r;
  }

  Device device() const { return device_; }
  bool is_virtual() const { return base_ == nullptr; }
  void* base() const { return base_; }
  std::size_t capacity() const { return capacity_; }
  // The capacity this arena's line was created with: a virtual clone keeps its source's budget
  // even when it is wider. Workspace sizes that kernels may take (cuBLAS's workspace, cuDNN's
  // limit) are fractions of it, so a dry run on a wide clone chooses as the real step does.
  std::size_t budget() const { return budget_; }
  ArenaStats stats() const;
  std::size_t free_bytes() const { return capacity_ - static_cast<std::size_t>(total_.current); }
  std::size_t largest_free_block() const;
  // A fingerprint of the arena's layout: its base, capacity and every block's offset, size and
  // state. Equal layouts give equal fingerprints; the same requests on equal layouts get the same
  // offsets (the algorithm above), which is what replaying recorded device work relies on
  // (core/graphs.h).
  std::uint64_t layout_hash() const;
  // Peak of every category and of the total set back to their current values.
  // The high-water mark goes back to the current extent (the end of the last used block).
  void reset_peak();
  // The peaks reset_peak() sets back, and each raised to at least another set of them: a replay of
  // recorded device work (core/graphs.h) allocates nothing, yet reaches the peaks its recording
  // reached.
  struct Peaks {
    std::array<std::int64_t, kNumCategories> by_category{};
    std::int64_t total = 0;
    std::size_t high_water = 0;
  };
  Peaks peaks() const;
  void raise_peaks(const Peaks& at_least);
  // The allocate() and free() calls counted per category: what a replayed recording of some work
  // (core/graphs.h) adds as a run of the work would, allocating nothing. The fault-injection
  // countdown below counts them too; fault_within(n): whether it fires within the next n allocations
  // (a replay of n must then run the work instead, so the fault comes where it would).
  struct Counts {
    std::array<std::int64_t, kNumCategories> allocations{}, frees{};
  };
  Counts counts() const;
  void count_replayed(const Counts& c);
  bool fault_within(std::uint64_t n) const { return fail_countdown_ > 0 && fail_countdown_ <= n; }

  // Trace of every allocation and free since tracing was switched on. Switching it on (or
  // clearing it) records the live bytes per category at that moment, the trace's starting point.
  void set_tracing(bool on);
  bool tracing() const { return tracing_; }
  const std::vector<TraceEvent>& trace() const { return trace_; }
  void clear_trace();
  // Live bytes per category when the trace started.
  const std::array<std::int64_t, kNumCategories>& trace_base() const { return trace_base_; }
  // A labelled instant in the trace (the MBP executor marks micro-batch boundaries).
  struct TraceMark {
    double time_us;
    std::size_t event_index;  // number of trace events before the mark
    std::string label;
  };
  void mark(std::string label);
  const std::vector<TraceMark>& marks() const { return marks_; }
  // Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one instant event per
  // allocation and free (args: offset, size, category, op), the marks as global instants, and a
  // counter track of live bytes per category starting from trace_base().
  std::string trace_json() const;

  // Fault injection for tests of out-of-memory recovery: the n-th allocate() from now (1 = the
  // next) throws OutOfMemory as if the arena were full. 0 switches it off.
  void fail_allocation_after(std::uint64_t n) {
    fail_countdown_ = n;
    fail_action_ = nullptr;
  }
  // The same countdown running `action` instead (tests that kill a process inside a step); when
  // the action returns, the allocation goes on.
  void at_allocation(std::uint64_t n, std::function<void()> action) {
    fail_countdown_ = n;
    fail_action_ = std::move(action);
  }

  // A debugging aid: a freed block of a host arena is filled with 0xFF bytes (a NaN in every
  // floating type), so that a read of a tensor after its memory was handed back shows at once.
  // On from the start where the environment has TALLY_ARENA_POISON=1; device arenas are left as
  // they are.
  void set_poison_freed(bool on) { poison_freed_ = on; }
  bool poison_freed() const { return poison_freed_; }

  // The live allocation that starts at `offset` (for tests and diagnostics).
  struct LiveInfo {
    std::size_t requested, rounded;
    Category category;
    std::string op;
  };
  std::vector<std::pair<std::size_t, LiveInfo>> live_blocks() const;

 private:
  struct Node {
    std::size_t size;  // rounded size of the block
    bool used;
    std::size_t requested;
    Category category;
    std::string op;
    std::string module;  // the allocation site, kept while tracing (TraceEvent)
    Phase phase = Phase::other;
  };
  enum class Reserve { none, ordinary, pinned };
  Arena(Device device, std::size_t capacity, Reserve reserve);
  [[noreturn]] void throw_oom(std::size_t requested, std::size_t rounded, Category category,
                              const std::string& op, bool injected) const;
  void record(bool is_alloc, std::size_t offset, const Node& n);

  Device device_;
  std::size_t capacity_;
  std::size_t budget_;
  void* base_ = nullptr;
  std::map<std::size_t, Node> blocks_;                        // offset -> block, tiles [0, cap)
  std::set<std::pair<std::size_t, std::size_t>> free_set_;   // (size, offset) of free blocks
  std::array<MemoryStat, kNumCategories> cat_{};
  MemoryStat total_{};
  bool tracing_ = false;
  std::vector<TraceEvent> trace_;
  std::vector<TraceMark> marks_;
  std::array<std::int64_t, kNumCategories> trace_base_{};
  std::chrono::steady_clock::time_point t0_;
  std::uint64_t fail_countdown_ = 0;
  std::function<void()> fail_action_;  // at_allocation's, else the countdown throws
  std::size_t high_water_ = 0;
  bool poison_freed_ = false;
  bool pinned_ = false;
};

// Parses a size such as "48MiB", "2GiB", "512KiB", "1.5GB", "4096" (bytes); throws tally::Error
// naming the accepted forms.
std::size_t parse_size(const std::string& s);
std::string format_bytes(std::size_t bytes);  // "47.9 MiB"

}  // namespace tally
