// core/staging.h — a step's inputs, from host memory into tensors on the step's device.
//
// The MBP executor copies each micro-batch's samples from the loader's host batch into input
// tensors in the arena. On the CPU that is a plain copy, done when stage() returns. On a GPU the
// samples are copied into page-locked (pinned) host memory and uploaded from there on the
// device's copy stream, after the compute work enqueued so far (the arena may have handed the
// input's blocks over from tensors that work still reads) or, for a destination the caller knows
// to be free earlier, after a fence of that work; the compute stream waits for an
// upload only when wait() is called for it, and the host only when the ring below needs its bytes
// again. So the upload of
// micro-batch i+1 overlaps the compute of micro-batch i when the caller stages one ahead
// (overlaps() says whether that pays). The pinned memory is a ring the stager hands out in order:
// each stage() takes the next bytes and, before it writes them, waits for the uploads that last
// read them — so a step may be staged while the one before still computes (its loss read a step
// late, core/pending.h), and the host runs at most a ring ahead of the device. The ring holds two
// whole steps where they are small, else kStagingBudget bytes, and never fewer than three of the
// largest micro-batches (the one computing, the next uploading, one more being written):
// staging_capacity() says how much, and `tally plan` shows it.
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

  // The most pinned memory a ring takes when its steps are larger than two of them fit: 256 MiB.
  static constexpr std::size_t kStagingBudget = std::size_t(256) << 20;
  // The ring's size for steps of `step_bytes` staged in micro-batches of at most
  // `micro_batch_bytes` (a GPU's; the CPU stages nothing): 2 x step_bytes up to kStagingBudget,
  // and at least 3 x micro_batch_bytes (256-byte aligned parts).
  static std::size_t staging_capacity(std::size_t micro_batch_bytes, std::size_t step_bytes);
  // A step's staging needs: a GPU's ring grows to staging_capacity (after the uploads that read the
  // old one are done); nothing on the CPU.
  void reserve(std::size_t micro_batch_bytes, std::size_t step_bytes);
  // A point in the device's compute work: everything enqueued on it so far (a GPU: an event on
  // the compute stream; the CPU: 0, nothing to wait for). Fences are numbered from 1; the last
  // kFences are kept.
  static constexpr std::size_t kFences = 4;
  std::size_t fence();
  // Copies `bytes` from host memory at `src` into the dense tensor `dst` (on this stager's device)
  // through the ring's next bytes; returns the ticket of this upload. The upload waits for the
  // compute work enqueued so far (`after` 0: dst's blocks may have been handed over from tensors
  // that work still reads), or only for the work up to fence `after` — for a dst that nothing
  // enqueued after that fence reads or writes (the executor's input slots, mbp/executor.h). A fence
  // no longer kept counts as 0.
  std::size_t stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t after = 0);
  // The same for `count` float32 values at `src` converted to dst's dtype (float32, bf16 or
  // float64) on their way: written straight into the staging bytes (a GPU's pinned memory, the
  // CPU's tensor itself) by the host's threads, with no converted copy in between. Row-major
  // (N, C, H, W) images for a channels-last dst (dense in that format) are written channels-last
  // on the way too: the device converts nothing.
  std::size_t stage_floats(const Tensor& dst, const float* src, std::size_t count, std::size_t after = 0);
  // Work enqueued on the device from now on sees the upload `ticket` and every upload staged
  // before it (they share one copy stream); no host wait. A ticket whose bytes the ring has
  // handed out again was waited for then: nothing to do.
  void wait(std::size_t ticket);
  // The same for every copy on the device's copy stream so far — the uploads staged so far, and
  // an offloaded segment's copies (core/offload.h), which share that stream: what a step that ends
  // on an exception calls, since the blocks it frees may still be written by them (mbp/executor.cpp).
  void wait_all();
  // Whether staging runs beside compute (a GPU), so that staging one micro-batch ahead pays.
  bool overlaps() const { return device_.is_cuda(); }

  struct Impl;

 private:
  Device device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tally
