// kernels/cuda/check.h — checked CUDA, cuBLAS and cuDNN calls, and the current device's
// library handles. Internal to the CUDA backend (it includes the CUDA headers): core/ and the
// rest of tally see only kernels/cuda/context.h and kernels/cuda/cuda_kernels.h.
//
// Every call into CUDA, cuBLAS or cuDNN goes through one of the macros below. A failure throws
// tally::Error whose message names the call as written, file:line and the library's status
// string, e.g.
//   "cudnnConvolutionForward(...) failed at kernels/cuda/conv.cu:212: CUDNN_STATUS_BAD_PARAM (...)".
// The error type is core/error.h's (a header of the standard library alone, which kernels/ may
// include), so that errors from every layer share one type.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/cublas_library.h"
#include "tally/config.h"
#if TALLY_HAVE_CUDNN
#include <cudnn.h>
#endif

namespace tally::kernels::cuda::detail {

[[noreturn]] void throw_cuda(cudaError_t status, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t status, const char* call, const char* file, int line);
#if TALLY_HAVE_CUDNN
[[noreturn]] void throw_cudnn(cudnnStatus_t status, const char* call, const char* file, int line);
#endif
// Throws tally::Error(message): for the .cu files, which keep fmt and core/ headers out of nvcc.
[[noreturn]] void fail(const std::string& message);
// Checks cudaGetLastError after a kernel launch (a bad configuration, a missing kernel image).
void check_launch(const char* kernel, const char* file, int line);

// Waits for `s` on the host, counted by host_sync_count() (context.h): every host-blocking wait
// of kernels/cuda goes through it.
void host_wait(cudaStream_t s);

// The current device's compute stream and library handles (created on first use).
cudaStream_t stream();
cublasHandle_t cublas();
#if TALLY_HAVE_CUDNN
cudnnHandle_t cudnn();
#endif
// A small block of mapped, pinned host memory per device, written by reduction kernels whose
// result the host reads after synchronize() (sum_all). Host memory: it takes nothing from the
// device budget the arena owns. Returns the host address; *device_ptr receives the device alias.
double* result_slot(double** device_ptr);

}  // namespace tally::kernels::cuda::detail

#define TALLY_CUDA_CHECK(call)                                                        \
  do {                                                                                \
    const cudaError_t tally_status_ = (call);                                         \
    if (tally_status_ != cudaSuccess)                                                 \
      ::tally::kernels::cuda::detail::throw_cuda(tally_status_, #call, __FILE__, __LINE__); \
  } while (0)

#define TALLY_CUBLAS_CHECK(call)                                                        \
  do {                                                                                  \
    const cublasStatus_t tally_status_ = (call);                                        \
    if (tally_status_ != CUBLAS_STATUS_SUCCESS)                                         \
      ::tally::kernels::cuda::detail::throw_cublas(tally_status_, #call, __FILE__, __LINE__); \
  } while (0)

#define TALLY_CUDNN_CHECK(call)                                                        \
  do {                                                                                 \
    const cudnnStatus_t tally_status_ = (call);                                        \
    if (tally_status_ != CUDNN_STATUS_SUCCESS)                                         \
      ::tally::kernels::cuda::detail::throw_cudnn(tally_status_, #call, __FILE__, __LINE__); \
  } while (0)

// After every kernel launch: TALLY_LAUNCH_CHECK("relu_forward").
#define TALLY_LAUNCH_CHECK(kernel) ::tally::kernels::cuda::detail::check_launch(kernel, __FILE__, __LINE__)
