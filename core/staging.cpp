// core/staging.cpp — the input stager of core/staging.h: a copy on the CPU, pinned staging and
// uploads on the copy stream on a GPU.
#include "core/staging.h"

#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/dispatch.h"

namespace tally {

struct InputStager::Impl {
  virtual ~Impl() = default;
  virtual void begin_step(std::size_t bytes) = 0;
  virtual std::size_t stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t offset) = 0;
  virtual void wait(std::size_t ticket) = 0;
};

namespace {

// The CPU: the inputs are copied when stage() is called; nothing to wait for.
struct HostStager final : InputStager::Impl {
  void begin_step(std::size_t) override {}
  std::size_t stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t) override {
    TALLY_DISPATCH("stage", dst, ANY, kk::copy_from_host(dst.raw_data(), src, bytes));
    return 0;
  }
  void wait(std::size_t) override {}
};

// A GPU: pinned staging and uploads on the copy stream. A template on the CUDA context's types,
// so that a build without the CUDA backend, which creates none, never instantiates it.
template <class PinnedBuffer = kernels::cuda::PinnedBuffer, class Event = kernels::cuda::Event>
struct GpuStager final : InputStager::Impl {
  explicit GpuStager(int device) : device(device) {}
  void begin_step(std::size_t bytes) override {
    kernels::cuda::use_device(device);
    uploads.clear();
    if (buffer.size() < bytes) {
      buffer = PinnedBuffer();  // the old block first: both at once may not fit
      buffer = PinnedBuffer(bytes);
    }
  }
  std::size_t stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t offset) override {
    if (offset + bytes > buffer.size())
      throw Error(fmt::format("input staging: bytes [{}, {}) are outside the step's {} staged bytes (begin_step)",
                              offset, offset + bytes, buffer.size()));
    namespace kcu = kernels::cuda;
    kcu::use_device(device);
    void* slot = static_cast<char*>(buffer.data()) + offset;
    std::memcpy(slot, src, bytes);
    kcu::copy_wait(Event::record(kcu::compute_stream()));
    uploads.push_back(kcu::upload_async(dst.raw_data(), slot, bytes));
    return uploads.size() - 1;
  }
  void wait(std::size_t ticket) override {
    kernels::cuda::use_device(device);
    kernels::cuda::compute_wait(uploads.at(ticket));
  }
  int device;
  PinnedBuffer buffer;
  std::vector<Event> uploads;
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
std::size_t InputStager::stage(const Tensor& dst, const void* src, std::size_t bytes, std::size_t offset) {
  if (dst.device() != device_ || dst.nbytes() != bytes || !dst.is_contiguous())
    throw ShapeError(fmt::format("input staging on {}: {} bytes cannot fill {} (a dense tensor of that size on the "
                                 "stager's device)", device_.str(), bytes, dst.str()));
  return impl_->stage(dst, src, bytes, offset);
}
void InputStager::wait(std::size_t ticket) { impl_->wait(ticket); }

}  // namespace tally
