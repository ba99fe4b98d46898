// core/device.cpp — device names, dtype sizes, run-time GPU detection, and GPU memory for the
// arena: with core/dispatch.h, the code of core/ that reaches a backend (kernels/cuda/context.h
// here, behind `if constexpr (kHaveCudaBackend)`).
#include "core/device.h"

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(fmt::format("{}: this build of tally has no CUDA backend", what));
}
}  // namespace

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    const std::string idx = s.substr(5);
    if (!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos && idx.size() < 4)
      return Device::cuda(std::stoi(idx));
  }
  throw Error(fmt::format("unknown device '{}': expected cpu, cuda or cuda:N", s));
}

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::BFloat16: return 2;
    case DType::Float16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
  }
  return "?";
}

bool is_floating(DType t) { return t != DType::Int32 && t != DType::Int64; }
DType param_dtype(DType t) { return t == DType::BFloat16 ? DType::Float32 : t; }

int cuda_device_count() {
  if constexpr (kHaveCudaBackend) return kernels::cuda::device_count();
  return 0;
}
bool cuda_available() { return cuda_device_count() > 0; }

std::string cuda_device_bus_id(int device) {
  if constexpr (kHaveCudaBackend) {
    return kernels::cuda::device_info(device).bus_id;
  } else {
    no_cuda("cudaDeviceGetPCIBusId");
  }
}

void* cuda_reserve(int device, std::size_t bytes) {
  if constexpr (kHaveCudaBackend) {
    kernels::cuda::use_device(device);
    return kernels::cuda::device_allocate(bytes);
  } else {
    no_cuda("cudaMalloc");
  }
}

void cuda_release(void* p) noexcept {
  if constexpr (kHaveCudaBackend) kernels::cuda::device_free(p);
}

void* cuda_host_reserve(std::size_t bytes) {
  if constexpr (kHaveCudaBackend) {
    return kernels::cuda::pinned_allocate(bytes);
  } else {
    no_cuda("cudaHostAlloc");
  }
}

void cuda_host_release(void* p) noexcept {
  if constexpr (kHaveCudaBackend) kernels::cuda::pinned_free(p);
}

void cuda_memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) {
  if constexpr (kHaveCudaBackend) {
    kernels::cuda::use_device(device);
    kernels::cuda::initialize();  // the context's own memory is taken first
    kernels::cuda::memory_info(free_bytes, total_bytes);
  } else {
    no_cuda("cudaMemGetInfo");
  }
}

void use_cuda_device(int device) {
  if constexpr (kHaveCudaBackend) {
    kernels::cuda::use_device(device);
  } else {
    no_cuda("cudaSetDevice");
  }
}

void set_allow_tf32(bool on) {
  if constexpr (kHaveCudaBackend) kernels::cuda::set_allow_tf32(on);
}
void set_deterministic(bool on) {
  if constexpr (kHaveCudaBackend) kernels::cuda::set_deterministic(on);
}

std::uint64_t cuda_kernel_switches() {
  if constexpr (kHaveCudaBackend)
    return (kernels::cuda::allow_tf32() ? 1u : 0u) | (kernels::cuda::deterministic() ? 2u : 0u) |
           static_cast<std::uint64_t>(kernels::cuda::cudnn_conv_api()) << 2;
  return 0;
}

void synchronize(Device device) {
  if (device.is_cpu()) return;
  if constexpr (kHaveCudaBackend) {
    kernels::cuda::use_device(device.index);
    kernels::cuda::synchronize_device();
  } else {
    no_cuda("synchronize");
  }
}

bool cpu_convolutions_use_onednn() { return kernels::cpu::conv_algorithm() == kernels::cpu::ConvAlgorithm::onednn; }

std::string build_info() {
  std::string s = fmt::format("tally {}", TALLY_VERSION);
  s += cpu_convolutions_use_onednn() ? " | CPU conv: oneDNN" : " | CPU conv: im2col reference";
  s += TALLY_HAVE_MPI ? (TALLY_HAVE_NCCL ? " | MPI, NCCL" : " | MPI") : "";
  if constexpr (kHaveCudaBackend) {
    s += fmt::format(" | CUDA {} (sm {})", TALLY_CUDA_VERSION, TALLY_CUDA_ARCHITECTURES);
    s += TALLY_HAVE_CUDNN ? fmt::format(", cuDNN {}", TALLY_CUDNN_VERSION)
                          : std::string(", cuDNN not built");
    const int n = cuda_device_count();
    s += n > 0 ? fmt::format(" | GPU: {} ({} device{})", kernels::cuda::device_name(0), n, n > 1 ? "s" : "")
               : std::string(" | GPU: none detected");
    if (n > 0) s += " | loaded: " + kernels::cuda::runtime_versions();
  } else {
    s += " | CPU-only build (no CUDA backend)";
  }
  return s;
}

}  // namespace tally
