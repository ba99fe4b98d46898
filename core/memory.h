// core/memory.h — which arena a new tensor's bytes come from (the dry-run switch is core/dry_run.h).
//
// Each device has a default arena, created on first use with a documented capacity (CPU: 8 GiB
// of address space, reserved with MAP_NORESERVE so untouched bytes cost nothing; CUDA: the free
// device memory less a margin of max(1 GiB, 1/32 of the device)) or with the capacity given to configure_arena().
// An ArenaScope makes another arena (typically a virtual clone for a dry run) the current one
// for its device on this thread until the scope ends. The current arenas, the host tier and the
// dry-run switch are the one ambient context of a thread (core/ambient.h).
#pragma once
#include <cstddef>
#include <memory>

#include "core/arena.h"

namespace tally {

// CPU: the default arena ("--memory-limit auto") is 8 GiB of address space, or 3/4 of the memory
// this process may still use (core/machine.h: MemAvailable, the cgroup's limit, RLIMIT_AS) when
// that is less, in 64 MiB steps — the rest is the process's own (the data set, the libraries).
inline constexpr std::size_t kDefaultCpuArenaBytes = std::size_t(8) << 30;
// CUDA: the default arena leaves this much of the free memory (or 1/32 of the device, if more)
// to what is loaded after it is reserved: cuBLASLt's and cuDNN's kernel images, loaded lazily on
// first use (docs/gpu.md).
inline constexpr std::size_t kCudaArenaMarginBytes = std::size_t(1) << 30;
std::size_t cuda_arena_margin(std::size_t device_total_bytes);

// The arena new allocations on `device` come from on this thread.
const std::shared_ptr<Arena>& current_arena(Device device);
// A labelled instant in the trace of that arena (Arena::mark): where a step's phases begin, in a
// real run and in the planner's dry run alike.
void mark_trace(Device device, std::string label);
// The default arena of `device` (created on first use).
const std::shared_ptr<Arena>& default_arena(Device device);
// Replaces the default arena of `device` by a fresh one of `capacity` bytes. Tensors still
// alive in the old arena keep it alive until they are freed.
void configure_arena(Device device, std::size_t capacity);
// Gives the default arena of `device` back when nothing but the registry holds it, so that its
// reservation is free for an arena the caller builds itself (a later default_arena() creates a
// fresh one). Returns whether it did.
bool release_default_arena(Device device);
// A new arena of `capacity` bytes on `device` that is virtual when `like` is: the arena a setup
// builds beside the budget it was given, in a dry run as in a real one.
std::shared_ptr<Arena> arena_like(const Arena& like, Device device, std::size_t capacity);
// Default capacity for `device` when none was configured (above; CUDA: the free memory less the
// margin).
std::size_t default_arena_capacity(Device device);

// The host tier's arena on this thread (docs/host-tier.md): where state placed in host memory and
// the staging buffers of its copies are allocated; null when the step has no host tier. Kept
// apart from current_arena(Device::cpu()), which on the CPU device is the device's own budget.
const std::shared_ptr<Arena>& current_host_arena();
// Whether an offloaded segment's storages come back as soon as the backward of the segment after
// it begins (core/offload.h, "Prefetch"): always on a GPU; on the CPU when the host tier's scope
// asks for it.
bool offload_prefetches(Device device);
// Makes `host` (a CPU arena, or null) the host tier's arena on this thread for its lifetime; with
// `offload_prefetch_on_cpu`, offloaded segments on the CPU prefetch in the GPU's order (tests: the
// same values, the same exact peaks in both arenas; ExecutorOptions::offload_prefetch_on_cpu).
class HostArenaScope {
 public:
  explicit HostArenaScope(std::shared_ptr<Arena> host, bool offload_prefetch_on_cpu = false);
  ~HostArenaScope();
  HostArenaScope(const HostArenaScope&) = delete;
  HostArenaScope& operator=(const HostArenaScope&) = delete;

 private:
  std::shared_ptr<Arena> previous_;
  bool previous_prefetch_;
};

class ArenaScope {
 public:
  explicit ArenaScope(std::shared_ptr<Arena> arena);
  ~ArenaScope();
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  std::shared_ptr<Arena> arena_, previous_;
};

}  // namespace tally
