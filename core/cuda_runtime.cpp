// core/cuda_runtime.cpp — CUDA runtime calls for core/, or CPU-only stand-ins.
#include "core/cuda_runtime.h"

#include <fmt/format.h>

#include "core/error.h"
#include "tally/config.h"

#if TALLY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace tally::cuda_rt {

#if TALLY_HAVE_CUDA

namespace {
void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess)
    throw Error(fmt::format("{} failed: {} ({})", call, cudaGetErrorString(e), cudaGetErrorName(e)));
}
}  // namespace
#define TALLY_CUDA_CHECK(call) check((call), #call)

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
    (void)cudaGetLastError();
    std::size_t fr = 0, tot = 0;
    (void)cudaMemGetInfo(&fr, &tot);
    throw Error(fmt::format(
        "cudaMalloc of {} bytes ({:.1f} MiB) for the arena failed: {}; the device has {} bytes "
        "({:.1f} MiB) free of {} bytes — choose a smaller --memory-limit",
        bytes, bytes / 1048576.0, cudaGetErrorString(e), fr, fr / 1048576.0, tot));
  }
  return p;
}

void free(void* p) noexcept { (void)cudaFree(p); }
void memcpy_h2d(void* d, const void* s, std::size_t n) {
  TALLY_CUDA_CHECK(cudaMemcpy(d, s, n, cudaMemcpyHostToDevice));
}
void memcpy_d2h(void* d, const void* s, std::size_t n) {
  TALLY_CUDA_CHECK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost));
}
void memcpy_d2d(void* d, const void* s, std::size_t n) {
  TALLY_CUDA_CHECK(cudaMemcpy(d, s, n, cudaMemcpyDeviceToDevice));
}
void mem_get_info(std::size_t* f, std::size_t* t) { TALLY_CUDA_CHECK(cudaMemGetInfo(f, t)); }
void synchronize() { TALLY_CUDA_CHECK(cudaDeviceSynchronize()); }

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

#endif

}  // namespace tally::cuda_rt
