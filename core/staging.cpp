// core/staging.cpp — the input stager of core/staging.h: a copy on the CPU, pinned staging and
// uploads on the copy stream on a GPU.
#include "core/staging.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/dispatch.h"

namespace tally {

struct InputStager::Impl {
  virtual ~Impl() = default;
  virtual void reserve(std::size_t capacity) = 0;
  virtual std::size_t fence() = 0;
  // Fills dst's `bytes` of staging by calling write(where) once, then uploads them after the
  // compute work up to fence `after` (0: all of it).
  virtual std::size_t stage(const Tensor& dst, std::size_t bytes, std::size_t after,
                            const std::function<void(void*)>& write) = 0;
  virtual void wait(std::size_t ticket) = 0;
  virtual void wait_all() = 0;
};

namespace {

// Staging is handed out in 256-byte aligned parts (the converting writes' vectors stay aligned).
std::size_t aligned(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// `count` floats converted to `dtype` at `dst`, in parallel over the host's threads (kernels/cpu's
// convert; a plain parallel copy for float32).
void write_converted(void* dst, const float* src, std::size_t count, DType dtype) {
  namespace kc = kernels::cpu;
  const auto n = static_cast<std::int64_t>(count);
  switch (dtype) {
    case DType::Float32: return kc::convert(n, src, static_cast<float*>(dst));
    case DType::BFloat16: return kc::convert(n, src, static_cast<kernels::bf16*>(dst));
    case DType::Float64: return kc::convert(n, src, static_cast<double*>(dst));
    default: break;
  }
  throw Error(fmt::format("input staging: floats cannot become {} values (expected float32, bf16 or float64)",
                          dtype_name(dtype)));
}

// The same for row-major (N, C, H, W) floats written channels-last, as `like` (a 4-d channels-last
// tensor of their dtype and shape) stores them.
void write_channels_last(void* dst, const float* src, const Tensor& like) {
  namespace kc = kernels::cpu;
  const std::int64_t n = like.size(0), c = like.size(1), hw = like.size(2) * like.size(3);
  switch (like.dtype()) {
    case DType::Float32: return kc::convert_channels_last(n, c, hw, src, static_cast<float*>(dst));
    case DType::BFloat16: return kc::convert_channels_last(n, c, hw, src, static_cast<kernels::bf16*>(dst));
    case DType::Float64: return kc::convert_channels_last(n, c, hw, src, static_cast<double*>(dst));
    default: break;
  }
  write_converted(dst, src, 0, like.dtype());  // its error
}

// The CPU: the inputs are copied when stage() is called; nothing to wait for.
struct HostStager final : InputStager::Impl {
  void reserve(std::size_t) override {}
  std::size_t fence() override { return 0; }
  std::size_t stage(const Tensor& dst, std::size_t, std::size_t, const std::function<void(void*)>& write) override {
    TALLY_DISPATCH("stage", dst, ANY, write(dst.raw_data()));  // timed by the profiler as "stage"
    return 0;
  }
  void wait(std::size_t) override {}
  void wait_all() override {}
};

// A GPU: a ring of pinned staging and uploads on the copy stream (core/staging.h). A template on
// the CUDA context's types, so that a build without the CUDA backend, which creates none, never
// instantiates it.
template <class PinnedBuffer = kernels::cuda::PinnedBuffer, class Event = kernels::cuda::Event>
struct GpuStager final : InputStager::Impl {
  explicit GpuStager(int device) : device(device) {}
  // The pinned ring goes after the uploads that read it (a run that ends on an error may leave
  // the next step's uploads in flight).
  ~GpuStager() override {
    try {
      kernels::cuda::use_device(device);
      while (!inflight.empty()) retire();
    } catch (...) {  // a device that failed: its error was reported where it happened
    }
  }
  void reserve(std::size_t capacity) override {
    if (buffer.size() >= capacity) return;
    kernels::cuda::use_device(device);
    while (!inflight.empty()) retire();  // every upload from the old ring done before it goes
    buffer = PinnedBuffer();  // the old block first: both at once may not fit
    buffer = PinnedBuffer(capacity);
    head = 0;
  }
  std::size_t fence() override {
    kernels::cuda::use_device(device);
    fences.push_back({next_fence, Event::record(kernels::cuda::compute_stream())});
    if (fences.size() > InputStager::kFences) fences.pop_front();
    return next_fence++;
  }
  std::size_t stage(const Tensor& dst, std::size_t bytes, std::size_t after,
                    const std::function<void(void*)>& write) override {
    // Nothing to copy, nothing in flight: an empty range in the ring would stop the retiring below
    // (it overlaps nothing) with younger uploads behind it. Ticket 0 is waited for by no one.
    if (bytes == 0) return 0;
    const std::size_t size = aligned(bytes);
    if (size > buffer.size())
      throw Error(fmt::format("input staging: {} bytes at once, more than the {} reserved (reserve)", bytes,
                              buffer.size()));
    namespace kcu = kernels::cuda;
    kcu::use_device(device);
    // The bytes [head, head + size), after the tail the ring skips when it wraps: the uploads still
    // reading them are the oldest in flight (handed out in ring order), waited for and retired.
    const std::size_t skip_from = head;
    if (head + size > buffer.size()) head = 0;
    while (!inflight.empty()) {
      const Upload& u = inflight.front();
      const bool in_skipped = head == 0 && skip_from > 0 && u.start >= skip_from;
      if (!in_skipped && !(u.start < head + size && head < u.end)) break;
      retire();
    }
    void* slot = static_cast<char*>(buffer.data()) + head;
    write(slot);
    const auto kept = std::find_if(fences.begin(), fences.end(), [after](const auto& f) { return f.first == after; });
    if (after != 0 && kept != fences.end())
      kcu::copy_wait(kept->second);
    else
      kcu::copy_wait(Event::record(kcu::compute_stream()));
    inflight.push_back({next_ticket, head, head + size, kcu::upload_async(dst.raw_data(), slot, bytes)});
    head += size;
    return next_ticket++;
  }
  void wait(std::size_t ticket) override {
    for (const Upload& u : inflight)
      if (u.ticket == ticket) {
        kernels::cuda::use_device(device);
        kernels::cuda::compute_wait(u.done);
        return;
      }
    // Retired: the host waited for it when its bytes were handed out again.
  }
  void wait_all() override {
    // Everything on the copy stream so far: these uploads, and an offloaded segment's copies back
    // into device blocks a failed step frees too (core/offload.h), which share the stream.
    kernels::cuda::use_device(device);
    kernels::cuda::compute_wait(Event::record(kernels::cuda::copy_stream()));
  }
  void retire() {
    const Upload& u = inflight.front();
    if (!u.done.done()) u.done.wait();
    inflight.pop_front();
  }
  struct Upload {
    std::size_t ticket, start, end;
    Event done;
  };
  int device;
  PinnedBuffer buffer;
  std::size_t head = 0;         // where the next bytes begin
  std::size_t next_ticket = 0;
  std::deque<Upload> inflight;  // in ring order, oldest first
  std::size_t next_fence = 1;
  std::deque<std::pair<std::size_t, Event>> fences;  // the last kFences, oldest first
};

}  // namespace

InputStager::InputStager(Device device) : device_(device) {
  if (device.is_cpu()) {
    impl_ = std::make_unique<HostStager>();
  } else if constexpr (kHaveCudaBackend) {
    impl_ = std::make_unique<GpuStager<>>(device.index);
  } else {
    throw Error(fmt::format("input staging on {}: this build of tally has no CUDA backend", device.str()));
  }
}

InputStager::~InputStager() = default;

std::size_t InputStager::staging_capacity(std::size_t micro_batch_bytes, std::size_t step_bytes) {
  return std::max(std::min(2 * aligned(step_bytes), kStagingBudget), 3 * aligned(micro_batch_bytes));
}

void InputStager::reserve(std::size_t micro_batch_bytes, std::size_t step_bytes) {
  impl_->reserve(staging_capacity(micro_batch_bytes, step_bytes));
}
namespace {
void check_fills(const Tensor& dst, std::size_t bytes, Device device, bool channels_last = false) {
  if (dst.device() != device || dst.nbytes() != bytes || !(dst.is_contiguous() || channels_last))
    throw ShapeError(fmt::format("input staging on {}: {} bytes cannot fill {} (a dense tensor of that size on the "
                                 "stager's device)", device.str(), bytes, dst.str()));
}
}  // namespace

std::size_t InputStager::fence() { return impl_->fence(); }

std::size_t InputStager::stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t after) {
  check_fills(dst, bytes, device_);
  return impl_->stage(dst, bytes, after, [&](void* to) {
    if (bytes > 0) std::memcpy(to, src, bytes);
  });
}
std::size_t InputStager::stage_floats(const Tensor& dst, const float* src, std::size_t count, std::size_t after) {
  const bool channels_last = dst.defined() && dst.suggest_memory_format() == MemoryFormat::ChannelsLast;
  check_fills(dst, count * dtype_size(dst.dtype()), device_, channels_last);
  return impl_->stage(dst, count * dtype_size(dst.dtype()), after, [&](void* to) {
    if (channels_last)
      write_channels_last(to, src, dst);
    else
      write_converted(to, src, count, dst.dtype());
  });
}
void InputStager::wait(std::size_t ticket) { impl_->wait(ticket); }

void InputStager::wait_all() { impl_->wait_all(); }

}  // namespace tally
