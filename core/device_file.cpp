// core/device_file.cpp — a GPU's description for plans without it; see core/device_file.h.
#include "core/device_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally {
namespace {

constexpr const char* kFormat = "tally device file";
constexpr int kVersion = 1;

}  // namespace

std::string cudnn_version_text(std::size_t v) { return fmt::format("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100); }

std::size_t loaded_cudnn_version() {
  if constexpr (kHaveCudaBackend) return kernels::cuda::cudnn_version();
  return 0;
}

DeviceFile describe_device(Device device) {
  if (!device.is_cuda()) throw Error(fmt::format("tally device: expected a GPU (cuda:K), found {}", device.str()));
  if constexpr (kHaveCudaBackend) {
    const int n = kernels::cuda::device_count();
    if (device.index >= n)
      throw Error(fmt::format("tally device: expected a GPU to describe, found {} on this machine (asked for {})",
                              n == 0 ? std::string("none") : fmt::format("{}", n), device.str()));
    const kernels::cuda::DeviceInfo info = kernels::cuda::device_info(device.index);
    DeviceFile f;
    f.name = info.name;
    f.compute_major = info.compute_major, f.compute_minor = info.compute_minor;
    f.multiprocessors = info.multiprocessors;
    f.total_memory = info.total_memory;
    f.cudnn_version = loaded_cudnn_version();
    f.cudnn_properties = kernels::cuda::cudnn_device_properties(device.index);
    return f;
  } else {
    throw Error("tally device: this build of tally has no CUDA backend");
  }
}

void save_device_file(const DeviceFile& file, const std::filesystem::path& path) {
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["name"] = file.name;
  j["compute_capability"] = fmt::format("{}.{}", file.compute_major, file.compute_minor);
  j["multiprocessors"] = file.multiprocessors;
  j["total_memory"] = file.total_memory;
  j["cudnn_version"] = file.cudnn_version;
  try {
    j["cudnn_properties"] = nlohmann::ordered_json::parse(file.cudnn_properties);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("device file '{}': cuDNN's description is not JSON ({})", path.string(), e.what()));
  }
  write_file(path, j.dump(2) + "\n", "device file");
}

DescribedGpuScope::DescribedGpuScope(const DeviceFile& file) {
  if constexpr (kHaveCudaBackend) {
    if (kernels::cuda::described_device())
      throw Error(fmt::format("a plan without the GPU: expected one described GPU at a time, found {} described "
                              "already while {} was asked for", kernels::cuda::described_device()->name, file.name));
    kernels::cuda::set_described_device(
        kernels::cuda::DescribedDevice{file.name, file.compute_major, file.compute_minor, file.cudnn_properties});
  } else {
    throw Error(fmt::format("a plan of {} without the GPU: this build of tally has no CUDA backend", file.name));
  }
}

DescribedGpuScope::~DescribedGpuScope() {
  if constexpr (kHaveCudaBackend) kernels::cuda::set_described_device(std::nullopt);
}

bool gpu_described() {
  if constexpr (kHaveCudaBackend) return kernels::cuda::described_device() != nullptr;
  return false;
}

DeviceFile load_device_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw Error(fmt::format("device file '{}': cannot read it: {} (expected a file written by `tally device --save`)",
                            path.string(), std::strerror(errno ? errno : ENOENT)));
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("device file '{}': expected JSON written by `tally device --save`, found text that is not "
                            "JSON ({})", path.string(), e.what()));
  }
  if (!j.is_object() || !j.contains("format") || j["format"] != kFormat)
    throw Error(fmt::format("device file '{}': expected \"format\": \"{}\", found {}", path.string(), kFormat,
                            j.is_object() && j.contains("format") ? j["format"].dump() : std::string("none")));
  const auto field = [&](const char* name, nlohmann::json::value_t type) -> const nlohmann::json& {
    if (!j.contains(name)) throw Error(fmt::format("device file '{}': expected a field \"{}\", found none", path.string(), name));
    const nlohmann::json& v = j[name];
    const bool ok = type == nlohmann::json::value_t::number_unsigned ? v.is_number_unsigned() : v.type() == type;
    if (!ok) throw Error(fmt::format("device file '{}': field \"{}\" has the wrong type: {}", path.string(), name, v.dump()));
    return v;
  };
  using T = nlohmann::json::value_t;
  if (field("version", T::number_unsigned).get<int>() != kVersion)
    throw Error(fmt::format("device file '{}': expected version {}, found {}", path.string(), kVersion, j["version"].dump()));
  DeviceFile f;
  f.name = field("name", T::string).get<std::string>();
  const std::string cc = field("compute_capability", T::string).get<std::string>();
  if (std::sscanf(cc.c_str(), "%d.%d", &f.compute_major, &f.compute_minor) != 2 || f.compute_major < 1)
    throw Error(fmt::format("device file '{}': expected a compute capability such as \"9.0\", found \"{}\"", path.string(), cc));
  f.multiprocessors = field("multiprocessors", T::number_unsigned).get<int>();
  f.total_memory = field("total_memory", T::number_unsigned).get<std::size_t>();
  f.cudnn_version = field("cudnn_version", T::number_unsigned).get<std::size_t>();
  f.cudnn_properties = field("cudnn_properties", T::object).dump();
  const std::size_t mine = loaded_cudnn_version();
  if (mine == 0)
    throw Error(fmt::format("device file '{}': plans from a device file need a build with cuDNN; this one has none",
                            path.string()));
  if (f.cudnn_version != mine)
    throw Error(fmt::format("device file '{}': saved by cuDNN {}, but this build loads cuDNN {}: cuDNN reads only its "
                            "own version's device description (save the file again with this cuDNN on the GPU)",
                            path.string(), cudnn_version_text(f.cudnn_version), cudnn_version_text(mine)));
  return f;
}

}  // namespace tally
