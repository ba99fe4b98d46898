// core/profiler.h — time per op (`tally train --profile`), one interface for both backends.
//
// While a Profiler is on, every kernel dispatch (core/dispatch.h) on its device is timed under the
// op's name, forward and backward apart: the host time of its kernels on the CPU
// (kernels/cpu/profile.cpp), the GPU time between a pair of events around its launches on a GPU
// (kernels/cuda/context.cpp, read without waiting once the step has waited for its device).
// The table is per process: one Profiler at a time.
#pragma once
#include <string>

#include "core/device.h"

namespace tally {

class Profiler {
 public:
  // `on`: profile (else every call is a no-op). Timing starts at once.
  Profiler(Device device, bool on);
  ~Profiler();  // timing stops
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Off while doing what the profile is not about (evaluation), on again after.
  void pause() const;
  void resume() const;
  // After a step is enqueued: its ops' times join the table as their events complete (on a GPU a
  // step still running is counted at a later call, or by report()); `restart` empties the table
  // and drops what is still running (the first step warms caches up).
  void step_done(bool restart) const;
  // The table, largest first: "GPU time per op <what>" or "host time per op <what>".
  // With `steps` > 0 (the steps the table covers) and their wall time per step, a last line splits
  // each step's wall time into the ops' and the rest — on a GPU, the time the device sat idle
  // (waiting for the host: its data, its enqueueing, its reads).
  std::string report(const std::string& what, std::int64_t steps = 0, double wall_ms_per_step = 0) const;
  bool on() const { return on_; }

 private:
  Device device_;
  bool on_;
};

}  // namespace tally
