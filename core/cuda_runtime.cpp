// core/cuda_runtime.cpp — CUDA runtime calls for core/, or CPU-only stand-ins.
#include "core/cuda_runtime.h"

#include <fmt/format.h>

#include "core/error.h"
#include "tally/config.h"

#if TALLY_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/context.h"
#endif

namespace tally::cuda_rt {

#if TALLY_HAVE_CUDA

namespace {
// Copies go on the current device's compute stream (kernels/cuda/context.h), in order with every
// kernel enqueued before them; the host-facing ones then wait for it, so that the host buffer may
// be read (device to host) or reused (host to device) as soon as the call returns.
cudaStream_t stream() { return kernels::cuda::compute_stream(); }
}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver/no device" error
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  TALLY_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  return p.name;
}

void set_device(int device) { TALLY_CUDA_CHECK(cudaSetDevice(device)); }

void* malloc(std::size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it
    int dev = -1;
    (void)cudaGetDevice(&dev);
    std::size_t fr = 0, tot = 0;
    const bool known = cudaMemGetInfo(&fr, &tot) == cudaSuccess;
    if (!known) (void)cudaGetLastError();
    throw Error(fmt::format(
        "cudaMalloc of {} bytes ({:.1f} MiB) for the arena on cuda:{} failed: {} ({}); {} — reserve less "
        "(configure_arena(Device::cuda({}), bytes))",
        bytes, bytes / 1048576.0, dev, cudaGetErrorName(e), cudaGetErrorString(e),
        known ? fmt::format("the device has {} bytes ({:.1f} MiB) free of {} bytes ({:.1f} MiB)", fr, fr / 1048576.0,
                            tot, tot / 1048576.0)
              : std::string("the free device memory could not be read"),
        dev));
  }
  return p;
}

void free(void* p) noexcept { (void)cudaFree(p); }
void memcpy_h2d(void* d, const void* s, std::size_t n) {
  TALLY_CUDA_CHECK(cudaMemcpyAsync(d, s, n, cudaMemcpyHostToDevice, stream()));
  kernels::cuda::synchronize();
}
void memcpy_d2h(void* d, const void* s, std::size_t n) {
  TALLY_CUDA_CHECK(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToHost, stream()));
  kernels::cuda::synchronize();
}
void memcpy_d2d(void* d, const void* s, std::size_t n) {
  // Stream order suffices: no host buffer involved.
  TALLY_CUDA_CHECK(cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, stream()));
}
void mem_get_info(std::size_t* f, std::size_t* t) { TALLY_CUDA_CHECK(cudaMemGetInfo(f, t)); }
void synchronize() { kernels::cuda::synchronize_device(); }
void initialize_context() { kernels::cuda::initialize(); }

#else  // CPU-only build

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(fmt::format("{}: this build of tally has no CUDA backend", what));
}
}  // namespace
int device_count() { return 0; }
std::string device_name(int) { no_cuda("device_name"); }
void set_device(int) { no_cuda("set_device"); }
void* malloc(std::size_t) { no_cuda("cudaMalloc"); }
void free(void*) noexcept {}
void memcpy_h2d(void*, const void*, std::size_t) { no_cuda("memcpy_h2d"); }
void memcpy_d2h(void*, const void*, std::size_t) { no_cuda("memcpy_d2h"); }
void memcpy_d2d(void*, const void*, std::size_t) { no_cuda("memcpy_d2d"); }
void mem_get_info(std::size_t*, std::size_t*) { no_cuda("mem_get_info"); }
void synchronize() {}
void initialize_context() { no_cuda("initialize_context"); }

#endif

}  // namespace tally::cuda_rt
