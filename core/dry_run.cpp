// core/dry_run.cpp — the per-thread dry-run switch; see core/dry_run.h.
#include "core/dry_run.h"

#include <fmt/format.h>

#include "core/ambient.h"
#include "core/error.h"
#include "core/tensor.h"

namespace tally {

bool is_dry_run() { return detail::ambient().dry_run; }
DryRunGuard::DryRunGuard() : previous_(detail::ambient().dry_run) { detail::ambient().dry_run = true; }
DryRunGuard::~DryRunGuard() { detail::ambient().dry_run = previous_; }

DryRun::DryRun() = default;
DryRun::DryRun(const Arena& real, std::optional<std::size_t> capacity)
    : arena_(capacity && *capacity > real.capacity() ? real.virtual_clone(*capacity) : real.virtual_clone()) {
  scope_.emplace(arena_);
  if (const std::shared_ptr<Arena>& host = current_host_arena()) {
    host_ = capacity && *capacity > host->capacity() ? host->virtual_clone(*capacity) : host->virtual_clone();
    host_scope_.emplace(host_, detail::ambient().offload_prefetch_on_cpu);
  }
}
DryRun::DryRun(Device device, std::size_t capacity) : arena_(Arena::make_virtual(device, capacity)) {
  scope_.emplace(arena_);
}
DryRun::~DryRun() = default;

Arena& DryRun::arena() const { return *arena_ptr(); }
const std::shared_ptr<Arena>& DryRun::arena_ptr() const {
  if (!arena_) throw Error("DryRun: this dry run was made without an arena (DryRun dry; use virtual_arena())");
  return arena_;
}
std::shared_ptr<Arena> DryRun::virtual_arena(Device device, std::size_t capacity) const {
  return Arena::make_virtual(device, capacity);
}

void free_in_dry_run(const Tensor& t) {
  if (!is_dry_run()) throw Error("free_in_dry_run: outside a dry run (a real tensor is freed by dropping it)");
  Arena& clone = *current_arena(t.device());
  if (!clone.is_virtual())
    throw Error(fmt::format("free_in_dry_run: the dry run's arena on {} is not virtual", t.device().str()));
  clone.free(t.storage()->offset());
}

}  // namespace tally
