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
  // After a step whose device work has completed (on a GPU: after the step's one wait): its times
  // join the table; `restart` empties the table first (the first step warms caches up).
  void step_done(bool restart) const;
  // The table, largest first: "GPU time per op <what>" or "host time per op <what>".
  std::string report(const std::string& what) const;
  bool on() const { return on_; }

 private:
  Device device_;
  bool on_;
};

}  // namespace tally
