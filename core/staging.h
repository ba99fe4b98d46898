// core/staging.h — a step's inputs, from host memory into tensors on the step's device.
//
// The MBP executor copies each micro-batch's samples from the loader's host batch into input
// tensors in the arena. On the CPU that is a plain copy, done when stage() returns. On a GPU the
// samples are copied into page-locked (pinned) host memory and uploaded from there on the
// device's copy stream, after the compute work enqueued so far (the arena may have handed the
// input's blocks over from tensors that work still reads); the compute stream waits for an
// upload only when wait() is called for it, and the host never waits for one. So the upload of
// micro-batch i+1 overlaps the compute of micro-batch i when the caller stages one ahead
// (overlaps() says whether that pays). The pinned memory holds the whole step's inputs, at
// offsets the caller chooses, never reused within a step; there are two such buffers, a step's
// each in turn, so that a step may be staged while the last one still computes (its loss read a
// step late: core/pending.h) — begin_step() waits only for the uploads of the step before that.
//
// Device-neutral: the executor writes one path for both; the GPU half lives in
// kernels/cuda/context.h (PinnedBuffer, Event, upload_async) and is compiled out of a build
// without the CUDA backend.
#pragma once
#include <cstddef>
#include <memory>

#include "core/device.h"
#include "core/tensor.h"

namespace tally {

class InputStager {
 public:
  explicit InputStager(Device device);
  ~InputStager();
  InputStager(const InputStager&) = delete;
  InputStager& operator=(const InputStager&) = delete;

  // A step of `bytes` of inputs begins: a GPU's other pinned buffer, once the uploads of the step
  // that last used it are done (the step before last: long done unless the host ran ahead),
  // grows to hold them.
  void begin_step(std::size_t bytes);
  // Copies `bytes` from host memory at `src` into the dense tensor `dst` (on this stager's device)
  // through staging bytes [offset, offset + bytes); returns the ticket of this upload.
  std::size_t stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t offset);
  // The same for `count` float32 values at `src` converted to dst's dtype (float32, bf16 or
  // float64) on their way: written straight into the staging bytes (a GPU's pinned memory, the
  // CPU's tensor itself) by the host's threads, with no converted copy in between.
  std::size_t stage_floats(const Tensor& dst, const float* src, std::size_t count, std::size_t offset);
  // Work enqueued on the device from now on sees the upload `ticket` and every upload staged
  // before it (they share one copy stream); no host wait.
  void wait(std::size_t ticket);
  // Whether staging runs beside compute (a GPU), so that staging one micro-batch ahead pays.
  bool overlaps() const { return device_.is_cuda(); }

  struct Impl;

 private:
  Device device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tally
