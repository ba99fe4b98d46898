// core/device.cpp — device names, dtype sizes, run-time GPU detection.
#include "core/device.h"

#include "kernels/cpu/cpu_kernels.h"

#include <fmt/format.h>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "tally/config.h"
#if TALLY_HAVE_CUDA
#include "kernels/cuda/context.h"
#endif

namespace tally {

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

int cuda_device_count() { return cuda_rt::device_count(); }
bool cuda_available() { return cuda_device_count() > 0; }

std::string build_info() {
  std::string s = fmt::format("tally {}", TALLY_VERSION);
  s += kernels::cpu::conv_algorithm() == kernels::cpu::ConvAlgorithm::onednn ? " | CPU conv: oneDNN"
                                                                              : " | CPU conv: im2col reference";
  s += TALLY_HAVE_MPI ? (TALLY_HAVE_NCCL ? " | MPI, NCCL" : " | MPI") : "";
  if (TALLY_HAVE_CUDA) {
    s += fmt::format(" | CUDA {} (sm {})", TALLY_CUDA_VERSION, TALLY_CUDA_ARCHITECTURES);
    s += TALLY_HAVE_CUDNN ? fmt::format(", cuDNN {}", TALLY_CUDNN_VERSION)
                          : std::string(", cuDNN not built");
    const int n = cuda_device_count();
    s += n > 0 ? fmt::format(" | GPU: {} ({} device{})", cuda_rt::device_name(0), n, n > 1 ? "s" : "")
               : std::string(" | GPU: none detected");
#if TALLY_HAVE_CUDA
    if (n > 0) s += " | loaded: " + kernels::cuda::runtime_versions();
#endif
  } else {
    s += " | CPU-only build (no CUDA backend)";
  }
  return s;
}

}  // namespace tally
