// core/device.h — where a tensor lives, and what the element type is.
//
// Devices are CPU and CUDA(n). A CUDA device exists at run time only if the build has the CUDA
// backend *and* the driver reports a GPU: on a machine without one, cuda_device_count() is 0 and
// the CUDA device is simply absent (tests labelled `gpu` skip, `--device auto` picks the CPU).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "tally/config.h"

namespace tally {

// Whether this build has the CUDA backend: the condition of the `if constexpr` branches that
// reach it (core/dispatch.h, core/device.cpp).
inline constexpr bool kHaveCudaBackend = TALLY_HAVE_CUDA != 0;

enum class DeviceType : std::uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  friend bool operator==(const Device&, const Device&) = default;
  std::string str() const;  // "cpu", "cuda:0"
};

// Parses "cpu", "cuda", "cuda:N"; throws tally::Error listing the allowed forms otherwise.
Device parse_device(const std::string& s);

// Element types. float64 exists on the CPU for gradient checks; int32/int64 hold indices and
// labels. bf16/fp16 have names reserved so that adding them touches no other enum.
enum class DType : std::uint8_t { Float32, Float64, Int32, Int64, BFloat16, Float16 };

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "float32", ...
bool is_floating(DType t);
// The dtype of the parameters, normalization statistics and scalars an op on activations of dtype
// t takes: float32 for bfloat16 (mixed precision keeps master weights in float32), t otherwise.
DType param_dtype(DType t);

// Number of usable CUDA devices at run time (0 without the CUDA backend or without a GPU).
int cuda_device_count();
bool cuda_available();
// GPU `device`'s PCI bus id ("0000:41:00.0"): the same physical GPU whatever index a process knows
// it by (CUDA_VISIBLE_DEVICES renumbers them). Without the CUDA backend: a tally::Error.
std::string cuda_device_bus_id(int device);

// Device memory of a GPU for its arena (core/arena.cpp, core/memory.cpp): a reservation of `bytes`
// on `device` (a failure throws tally::Error naming the bytes asked and what the device has
// free), its release, and the device's free and total memory measured after its context (streams,
// cuBLAS and cuDNN handles, which take memory outside the arena) exists. In a build without the
// CUDA backend each throws tally::Error saying so (release does nothing).
void* cuda_reserve(int device, std::size_t bytes);
void cuda_release(void* p) noexcept;
// Page-locked host memory for the host tier's arena (Arena::make_host): one cudaHostAlloc of
// `bytes`, a failure a tally::Error naming the bytes; its release.
void* cuda_host_reserve(std::size_t bytes);
void cuda_host_release(void* p) noexcept;
void cuda_memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes);
// Makes GPU `device` this thread's current one (cudaSetDevice), before work that takes the current
// device's context without naming a device — page-locked host memory: otherwise GPU 0's context
// is made for it, outside every budget, on a rank that runs on another GPU.
void use_cuda_device(int device);

// Whether float32 GEMMs and convolutions on GPUs may use TF32 tensor cores (default false; as
// torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 together). The CPU's
// kernels are not affected.
void set_allow_tf32(bool on);
// Whether cuDNN may only take convolution algorithms it reports deterministic (default true; as
// torch.backends.cudnn.deterministic): bit-for-bit resume and "MBP equals the full batch" on a GPU
// rest on it. The CPU's kernels are deterministic either way.
void set_deterministic(bool on);
// The switches above and the cuDNN convolution API (TALLY_CUDNN_CONV_API) as one number, which
// changes whenever one of them does: what chooses the GPU's kernels for given shapes, so what a
// recorded CUDA graph is keyed by (0 in a build without CUDA).
std::uint64_t cuda_kernel_switches();

// Waits until everything enqueued on `device` has finished (torch.cuda.synchronize); nothing to
// wait for on the CPU, whose kernels return when done.
void synchronize(Device device);

// Whether the CPU's convolutions run on oneDNN (else the im2col reference): the CPU then prefers
// channels-last activations (core/tensor.h: preferred_memory_format).
bool cpu_convolutions_use_onednn();

// One line on how this build was configured and what the machine has, e.g.
// "tally 0.1.0 | CUDA 13.0.88 (sm 80 90), cuDNN 9.19.0 | GPU: none detected".
std::string build_info();

}  // namespace tally
