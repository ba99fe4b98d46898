// core/cuda_runtime.h — the few CUDA runtime calls core/ needs (device memory for the arena,
// copies, device queries), behind plain functions so that core/ compiles without CUDA headers.
// In a CPU-only build device_count() is 0 and every other call throws tally::Error.
// Every CUDA call is checked; a failure throws with the call and the CUDA status string.
// Copies are enqueued on the current device's compute stream, after every kernel enqueued before
// them; memcpy_h2d and memcpy_d2h return once the copy is done, memcpy_d2d without waiting.
#pragma once
#include <cstddef>
#include <string>

namespace tally::cuda_rt {

int device_count();                       // 0 when no backend or no GPU (never throws)
std::string device_name(int device);
void set_device(int device);
void* malloc(std::size_t bytes);          // throws OutOfMemory-style tally::Error with free/total
void free(void* p) noexcept;
void memcpy_h2d(void* dst, const void* src, std::size_t bytes);
void memcpy_d2h(void* dst, const void* src, std::size_t bytes);
void memcpy_d2d(void* dst, const void* src, std::size_t bytes);
void mem_get_info(std::size_t* free_bytes, std::size_t* total_bytes);
void synchronize();
// Creates the current device's streams and cuBLAS/cuDNN handles (kernels/cuda/context.h).
void initialize_context();

}  // namespace tally::cuda_rt
