// core/staging.cpp — the input stager of core/staging.h: a copy on the CPU, pinned staging and
// uploads on the copy stream on a GPU.
#include "core/staging.h"

#include <cstring>
#include <functional>
#include <vector>

#include <fmt/format.h>

#include "core/dispatch.h"

namespace tally {

struct InputStager::Impl {
  virtual ~Impl() = default;
  virtual void begin_step(std::size_t bytes) = 0;
  // Fills dst's `bytes` of staging at `offset` by calling write(where) once, then uploads them.
  virtual std::size_t stage(const Tensor& dst, std::size_t bytes, std::size_t offset,
                            const std::function<void(void*)>& write) = 0;
  virtual void wait(std::size_t ticket) = 0;
};

namespace {

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

// The CPU: the inputs are copied when stage() is called; nothing to wait for.
struct HostStager final : InputStager::Impl {
  void begin_step(std::size_t) override {}
  std::size_t stage(const Tensor& dst, std::size_t, std::size_t, const std::function<void(void*)>& write) override {
    TALLY_DISPATCH("stage", dst, ANY, write(dst.raw_data()));  // timed by the profiler as "stage"
    return 0;
  }
  void wait(std::size_t) override {}
};

// A GPU: pinned staging and uploads on the copy stream. A template on the CUDA context's types,
// so that a build without the CUDA backend, which creates none, never instantiates it.
template <class PinnedBuffer = kernels::cuda::PinnedBuffer, class Event = kernels::cuda::Event>
struct GpuStager final : InputStager::Impl {
  explicit GpuStager(int device) : device(device) {}
  // Two buffers, one step each in turn: a step may begin while the last one's uploads are still
  // in flight (its loss read a step late, core/pending.h), never while the one before it is.
  void begin_step(std::size_t bytes) override {
    kernels::cuda::use_device(device);
    current = 1 - current;
    std::vector<Event>& mine = uploads[current];
    if (!mine.empty() && !mine.back().done()) mine.back().wait();  // one copy stream: the last one says all
    mine.clear();
    PinnedBuffer& buffer = buffers[current];
    if (buffer.size() < bytes) {
      buffer = PinnedBuffer();  // the old block first: both at once may not fit
      buffer = PinnedBuffer(bytes);
    }
  }
  std::size_t stage(const Tensor& dst, std::size_t bytes, std::size_t offset,
                    const std::function<void(void*)>& write) override {
    const PinnedBuffer& buffer = buffers[current];
    if (offset + bytes > buffer.size())
      throw Error(fmt::format("input staging: bytes [{}, {}) are outside the step's {} staged bytes (begin_step)",
                              offset, offset + bytes, buffer.size()));
    namespace kcu = kernels::cuda;
    kcu::use_device(device);
    void* slot = static_cast<char*>(buffer.data()) + offset;
    write(slot);
    kcu::copy_wait(Event::record(kcu::compute_stream()));
    uploads[current].push_back(kcu::upload_async(dst.raw_data(), slot, bytes));
    return uploads[current].size() - 1;
  }
  void wait(std::size_t ticket) override {
    kernels::cuda::use_device(device);
    kernels::cuda::compute_wait(uploads[current].at(ticket));
  }
  int device;
  int current = 1;  // the buffer of the step under way (begin_step turns to the other)
  PinnedBuffer buffers[2];
  std::vector<Event> uploads[2];
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

void InputStager::begin_step(std::size_t bytes) { impl_->begin_step(bytes); }
namespace {
void check_fills(const Tensor& dst, std::size_t bytes, Device device) {
  if (dst.device() != device || dst.nbytes() != bytes || !dst.is_contiguous())
    throw ShapeError(fmt::format("input staging on {}: {} bytes cannot fill {} (a dense tensor of that size on the "
                                 "stager's device)", device.str(), bytes, dst.str()));
}
}  // namespace

std::size_t InputStager::stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t offset) {
  check_fills(dst, bytes, device_);
  return impl_->stage(dst, bytes, offset, [&](void* to) {
    if (bytes > 0) std::memcpy(to, src, bytes);
  });
}
std::size_t InputStager::stage_floats(const Tensor& dst, const float* src, std::size_t count, std::size_t offset) {
  check_fills(dst, count * dtype_size(dst.dtype()), device_);
  return impl_->stage(dst, count * dtype_size(dst.dtype()), offset,
                      [&](void* to) { write_converted(to, src, count, dst.dtype()); });
}
void InputStager::wait(std::size_t ticket) { impl_->wait(ticket); }

}  // namespace tally
