// core/profiler.cpp — the Profiler of core/profiler.h over the backends' identical profiler
// functions (kernels/cpu/cpu_kernels.h, kernels/cuda/context.h).
#include "core/profiler.h"

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/context.h"

namespace tally {

// The body with `kp` naming the profiler functions of `device_`'s backend.
#define TALLY_ON_PROFILER(...)                   \
  do {                                           \
    if (!on_) break;                             \
    if (device_.is_cpu()) {                      \
      namespace kp = kernels::cpu;               \
      __VA_ARGS__;                               \
    } else if constexpr (kHaveCudaBackend) {     \
      namespace kp = kernels::cuda;              \
      __VA_ARGS__;                               \
    }                                            \
  } while (0)

Profiler::Profiler(Device device, bool on) : device_(device), on_(on) { resume(); }
Profiler::~Profiler() { pause(); }

void Profiler::pause() const { TALLY_ON_PROFILER(kp::set_profiling(false)); }
void Profiler::resume() const { TALLY_ON_PROFILER(kp::set_profiling(true)); }

void Profiler::step_done(bool restart) const {
  TALLY_ON_PROFILER({
    kp::profile_collect();
    if (restart) kp::profile_reset();
  });
}

std::string Profiler::report(const std::string& what) const {
  std::string out;
  TALLY_ON_PROFILER(out = kp::profile_report((device_.is_cpu() ? "host time per op " : "GPU time per op ") + what));
  return out;
}

#undef TALLY_ON_PROFILER

}  // namespace tally
