// kernels/cpu/profile.cpp — per-op host time on the CPU (`tally train --profile`; core/profiler.h
// prints the table). With profiling on, every op dispatched to the CPU (core/dispatch.h) is timed
// with a steady clock around its kernel calls; ops run one after another on the host, so the times
// add up to the step's compute (the rest of a step: the loader, the autograd engine, allocation).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include "kernels/cpu/cpu_kernels.h"

namespace tally::kernels::cpu {

namespace {
std::atomic<bool> g_profiling{false};
struct State {
  std::mutex mu;
  ProfileTable table;
};
State& state() {
  static auto* s = new State;  // never destroyed: timers may run during static destruction
  return *s;
}
std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void set_profiling(bool on) { g_profiling = on; }
bool profiling() { return g_profiling; }

OpTimer::OpTimer(const char* op, bool backward) {
  if (!g_profiling) return;
  op_ = op;
  backward_ = backward;
  mark_ = now_ns();
}

OpTimer::~OpTimer() {
  if (op_ == nullptr) return;
  const double took_ms = static_cast<double>(now_ns() - mark_) / 1e6;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ProfileRow& r = s.table[std::string(op_) + (backward_ ? " (backward)" : "")];
  ++r.calls;
  r.ms += took_ms;
}

void profile_collect() {}  // host times are in the table as soon as an op returns

ProfileTable profile_table() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.table;
}

void profile_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.table.clear();
}

}  // namespace tally::kernels::cpu
