// kernels/cpu/profile.cpp — per-op host time on the CPU (`tally train --profile`), and the table
// both backends print. With profiling on, every op dispatched to the CPU (core/dispatch.h) is
// timed with a steady clock around its kernel calls; ops run one after another on the host, so
// the times add up to the step's compute (the rest of a step: the loader, the autograd engine,
// allocation).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kernels/cpu/cpu_kernels.h"

namespace tally::kernels::cpu {

namespace {
std::atomic<bool> g_profiling{false};
struct State {
  std::mutex mu;
  std::map<std::string, ProfileRow> table;
};
State& state() {
  static auto* s = new State;  // never destroyed: timers may run during static destruction
  return *s;
}
}  // namespace

void set_profiling(bool on) { g_profiling = on; }
bool profiling() { return g_profiling; }

OpTimer::OpTimer(const char* op, bool backward) {
  if (!g_profiling) return;
  op_ = op;
  backward_ = backward;
  start_ = std::chrono::steady_clock::now();
}

OpTimer::~OpTimer() {
  if (op_ == nullptr) return;
  const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - start_;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ProfileRow& r = s.table[std::string(op_) + (backward_ ? " (backward)" : "")];
  ++r.calls;
  r.ms += took.count();
}

std::string profile_report(const std::string& title) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return format_profile(title, "op (host time of its kernels)", s.table);
}

void profile_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.table.clear();
}

std::string format_profile(const std::string& title, const std::string& what,
                           const std::map<std::string, ProfileRow>& table) {
  std::vector<std::pair<std::string, ProfileRow>> rows(table.begin(), table.end());
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

}  // namespace tally::kernels::cpu
