// core/device_file.h — what a plan needs of a GPU, saved on that GPU and read on any machine with
// the CUDA build, GPU or not (docs/gpu.md, "Plans without the GPU"): `tally device --save FILE`
// writes one; the deviceless convolution plans (kernels/cuda/cuda_kernels.h, conv2d_plan_offline)
// are made from it.
//
// The file is JSON: {"format": "tally device file", "version": 1, "name", "compute_capability"
// ("9.0"), "multiprocessors", "total_memory" (bytes), "cudnn_version" (major*10000 + minor*100 +
// patch of the cuDNN that described it), "cudnn_properties" (cuDNN's own description, an object)}.
// cuDNN reads only its own version's description, so a file saved by another cuDNN is refused with
// both versions named.
#pragma once
#include <cstddef>
#include <filesystem>
#include <string>

#include "core/device.h"

namespace tally {

struct DeviceFile {
  std::string name;
  int compute_major = 0, compute_minor = 0, multiprocessors = 0;
  std::size_t total_memory = 0;
  std::size_t cudnn_version = 0;
  std::string cudnn_properties;  // JSON text, as cuDNN reads it
};

// The description of GPU `device` (on it). An Error when it is not a GPU of this build.
DeviceFile describe_device(Device device);
// Written whole, then renamed into place (an Error naming the path and the reason).
void save_device_file(const DeviceFile& file, const std::filesystem::path& path);
// Read and checked: an Error naming the path and what was expected and found — unreadable, not
// JSON, another format, a missing or mistyped field, saved by another cuDNN than this build's.
DeviceFile load_device_file(const std::filesystem::path& path);
// The GPU a file describes, made the CUDA device of this process's plans for the scope's lifetime
// (`tally plan --device-file`): a dry run's questions of the GPU — the convolutions' workspaces
// (through cuDNN's graph API, from cuDNN's description), cuBLAS's workspace — are answered from the
// file and no CUDA call is made (kernels/cuda/context.h: set_described_device). Only dry runs may
// run under it; one scope at a time (an Error otherwise, as in a build without the CUDA backend).
class DescribedGpuScope {
 public:
  explicit DescribedGpuScope(const DeviceFile& file);
  ~DescribedGpuScope();
  DescribedGpuScope(const DescribedGpuScope&) = delete;
  DescribedGpuScope& operator=(const DescribedGpuScope&) = delete;
};
// Whether a DescribedGpuScope is open.
bool gpu_described();

// The cuDNN version this build loads (0 without cuDNN), and a version number as text ("9.19.0").
std::size_t loaded_cudnn_version();
std::string cudnn_version_text(std::size_t version);

}  // namespace tally
