// core/memory.cpp — default arenas per device, and the ambient context's arena scopes (core/ambient.h).
#include "core/memory.h"

#include <algorithm>

#include <mutex>
#include <unordered_map>

#include <fmt/format.h>

#include "core/ambient.h"
#include "core/device.h"
#include "core/machine.h"

namespace tally {
namespace {

int key(Device d) { return d.is_cpu() ? -1 : d.index; }

struct Defaults {
  std::mutex mu;
  std::unordered_map<int, std::shared_ptr<Arena>> arenas;
};
Defaults& defaults() {
  static Defaults d;
  return d;
}

std::shared_ptr<Arena>& override_slot(Device d) {
  detail::AmbientContext& a = detail::ambient();
  return d.is_cpu() ? a.cpu_arena : a.cuda_arenas[d.index];
}

}  // namespace

detail::AmbientContext& detail::ambient() {
  thread_local AmbientContext context;
  return context;
}

std::size_t cuda_arena_margin(std::size_t total) { return std::max(kCudaArenaMarginBytes, total / 32); }

std::size_t default_arena_capacity(Device device) {
  if (device.is_cpu()) {
    const HostMemory usable = usable_host_memory();
    if (usable.bound.empty()) return kDefaultCpuArenaBytes;
    constexpr std::size_t kStep = std::size_t(64) << 20;
    const std::size_t share = usable.bytes / 4 * 3 / kStep * kStep;
    return std::clamp(share, kStep, kDefaultCpuArenaBytes);
  }
  // Measured after the context (streams, cuBLAS and cuDNN handles) took its device memory: what
  // is really left for the arena.
  std::size_t fr = 0, tot = 0;
  cuda_memory_info(device.index, &fr, &tot);
  {
    // A default arena that nothing but the registry holds is given back by configure_arena before
    // the new one is reserved: its bytes count as free.
    auto& d = defaults();
    std::lock_guard<std::mutex> lock(d.mu);
    const auto it = d.arenas.find(key(device));
    if (it != d.arenas.end() && it->second && it->second.use_count() == 1 && !it->second->is_virtual())
      fr += it->second->capacity();
  }
  const std::size_t margin = cuda_arena_margin(tot);
  return fr > margin * 2 ? fr - margin : fr / 2;
}

const std::shared_ptr<Arena>& default_arena(Device device) {
  auto& d = defaults();
  std::lock_guard<std::mutex> lock(d.mu);
  auto& slot = d.arenas[key(device)];
  if (!slot) slot = std::make_shared<Arena>(device, default_arena_capacity(device));
  return slot;
}

void configure_arena(Device device, std::size_t capacity) {
  auto& d = defaults();
  std::lock_guard<std::mutex> lock(d.mu);
  auto& slot = d.arenas[key(device)];
  slot.reset();  // give the old reservation back first when nothing else holds it
  slot = std::make_shared<Arena>(device, capacity);
}

bool release_default_arena(Device device) {
  auto& d = defaults();
  std::lock_guard<std::mutex> lock(d.mu);
  const auto it = d.arenas.find(key(device));
  if (it == d.arenas.end() || !it->second || it->second.use_count() != 1) return false;
  d.arenas.erase(it);
  return true;
}

const std::shared_ptr<Arena>& current_arena(Device device) {
  const auto& o = override_slot(device);
  if (o) return o;
  return default_arena(device);
}

std::shared_ptr<Arena> arena_like(const Arena& like, Device device, std::size_t capacity) {
  return like.is_virtual() ? Arena::make_virtual(device, capacity) : std::make_shared<Arena>(device, capacity);
}

void mark_trace(Device device, std::string label) { current_arena(device)->mark(std::move(label)); }

const std::shared_ptr<Arena>& current_host_arena() { return detail::ambient().host_tier; }
bool offload_prefetches(Device device) { return device.is_cuda() || detail::ambient().offload_prefetch_on_cpu; }

HostArenaScope::HostArenaScope(std::shared_ptr<Arena> host, bool offload_prefetch_on_cpu)
    : previous_(detail::ambient().host_tier), previous_prefetch_(detail::ambient().offload_prefetch_on_cpu) {
  if (host && !host->device().is_cpu())
    throw Error(fmt::format("HostArenaScope: expected an arena of host memory (cpu), found one on {}",
                            host->device().str()));
  detail::ambient().host_tier = std::move(host);
  detail::ambient().offload_prefetch_on_cpu = offload_prefetch_on_cpu;
}
HostArenaScope::~HostArenaScope() {
  detail::ambient().host_tier = std::move(previous_);
  detail::ambient().offload_prefetch_on_cpu = previous_prefetch_;
}

ArenaScope::ArenaScope(std::shared_ptr<Arena> arena) : arena_(std::move(arena)) {
  auto& slot = override_slot(arena_->device());
  previous_ = slot;
  slot = arena_;
}
ArenaScope::~ArenaScope() { override_slot(arena_->device()) = previous_; }

}  // namespace tally
