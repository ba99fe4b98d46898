// core/profiler.cpp — the Profiler of core/profiler.h over the backends' profiler functions (the
// backend contract, kernels/backend.inc), and the table both print.
#include "core/profiler.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"

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

namespace {

// The table, largest first: op, calls, total ms, mean us, share of the time of all ops.
std::string format_profile(const std::string& title, const std::string& what, const kernels::ProfileTable& table) {
  std::vector<std::pair<std::string, kernels::ProfileRow>> rows(table.begin(), table.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0;
  for (const auto& r : rows) total += r.second.ms;
  std::string out =
      fmt::format("{}\n{:<34} {:>8} {:>11} {:>10} {:>7}\n", title, what, "calls", "total ms", "mean us", "share");
  for (const auto& [name, r] : rows)
    out += fmt::format("{:<34} {:>8} {:>11.2f} {:>10.1f} {:>6.1f}%\n", name, r.calls, r.ms,
                       r.calls ? 1000.0 * r.ms / static_cast<double>(r.calls) : 0.0,
                       total > 0 ? 100.0 * r.ms / total : 0.0);
  out += fmt::format("{:<34} {:>8} {:>11.2f}\n", "all ops", "", total);
  return out;
}

}  // namespace

std::string Profiler::report(const std::string& what, std::int64_t steps, double wall_ms_per_step) const {
  kernels::ProfileTable table;
  TALLY_ON_PROFILER(table = kp::profile_table());
  if (!on_) return "";
  std::string out = device_.is_cpu()
                        ? format_profile("host time per op " + what, "op (host time of its kernels)", table)
                        : format_profile("GPU time per op " + what, "op (GPU time between its events)", table);
  if (steps > 0 && wall_ms_per_step > 0) {
    double ops = 0;
    for (const auto& [name, row] : table) ops += row.ms;
    ops /= static_cast<double>(steps);
    out += fmt::format("per step: {:.1f} ms of wall time, {:.1f} ms in ops, {:.1f} ms outside them{}\n",
                       wall_ms_per_step, ops, std::max(0.0, wall_ms_per_step - ops),
                       device_.is_cpu() ? "" : " (the GPU idle)");
  }
  return out;
}

#undef TALLY_ON_PROFILER

}  // namespace tally
