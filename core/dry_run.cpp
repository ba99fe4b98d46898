// core/dry_run.cpp — the per-thread dry-run switch; see core/dry_run.h.
#include "core/dry_run.h"

namespace tally {
namespace {
thread_local bool tl_dry = false;
}  // namespace

bool is_dry_run() { return tl_dry; }
DryRunGuard::DryRunGuard() : previous_(tl_dry) { tl_dry = true; }
DryRunGuard::~DryRunGuard() { tl_dry = previous_; }

}  // namespace tally
