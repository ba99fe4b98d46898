// core/pending.h — a step's scalar result read without the host waiting for the device.
//
// A training step ends with one value the host wants, its loss. Reading it at once makes the host
// wait for the whole step on a GPU, and the device then waits for the host to prepare the next
// step (docs/mbp.md, "The loss, a step late"). PendingScalar::read enqueues the scalar's copy into
// page-locked memory after the work enqueued so far and returns at once; get() waits for that copy
// the first time (the step's one host wait, counted by kernels::cuda::host_sync_count) and returns
// the value. On the CPU the value is there when read() returns.
//
// The page-locked slots come from a small pool kept for the life of the process (allocating and
// freeing page-locked memory per step would itself wait for the device); a slot returns to the
// pool when the last copy of its PendingScalar is gone.
#pragma once
#include <memory>

#include "core/tensor.h"

namespace tally {

class PendingScalar {
 public:
  PendingScalar() = default;  // ready, 0
  explicit PendingScalar(double value) : value_(value) {}
  // One element of float32, float64 or bf16, on any device; the tensor may be freed at once (the
  // device's later work waits for the copy, not the host).
  static PendingScalar read(const Tensor& scalar);
  // The value; on a GPU the first call waits for its copy.
  double get();
  // Whether get() would return without waiting.
  bool ready() const;

  // Tests: CPU reads stay pending until get() (ready() false), so that a caller's deferred path —
  // tally train's bookkeeping a step late — runs on the CPU too. Also switched on by
  // TALLY_TEST_DEFER_READS=1 in the environment.
  static void defer_cpu_reads_for_tests(bool on);

  struct Slot;

 private:
  std::shared_ptr<Slot> slot_;  // a GPU's copy (or a deferred CPU read) not yet taken by get()
  double value_ = 0;
};

}  // namespace tally
