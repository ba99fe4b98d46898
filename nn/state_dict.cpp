// nn/state_dict.cpp — save_state_dict / load_state_dict over core/safetensors.
#include "nn/state_dict.h"

#include <map>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/safetensors.h"

namespace tally::nn {

std::vector<std::pair<std::string, Tensor>> state_dict(const Module& m) {
  auto all = m.named_parameters();
  for (auto& e : m.named_buffers()) all.push_back(std::move(e));
  return all;
}

namespace {

const char* file_dtype(DType t) {
  switch (t) {
    case DType::Float32: return "F32";
    case DType::Float64: return "F64";
    case DType::Int64: return "I64";
    case DType::Int32: return "I32";
    case DType::BFloat16: return "BF16";
    case DType::Float16: return "F16";
  }
  return "?";
}

}  // namespace

safetensors::Entry to_entry(const std::string& name, const Tensor& t) {
  switch (t.dtype()) {
    case DType::Float32: return safetensors::make_f32(t.shape(), t.to_vector<float>());
    case DType::Float64: return safetensors::make_f64(t.shape(), t.to_vector<double>());
    case DType::Int64: return safetensors::make_i64(t.shape(), t.to_vector<std::int64_t>());
    case DType::BFloat16: {
      std::vector<std::uint16_t> bits;
      for (const kernels::bf16 v : t.to_vector<kernels::bf16>()) bits.push_back(v.bits);
      return safetensors::make_bf16(t.shape(), bits);
    }
    default: throw Error(fmt::format("save_state_dict: {} has unsupported dtype {}", name, dtype_name(t.dtype())));
  }
}

namespace {

Tensor from_entry(const safetensors::Entry& e) {
  if (e.dtype == "F32") return Tensor::from_vector(safetensors::as_f32(e), e.shape, Device::cpu(), Category::temporary);
  if (e.dtype == "F64") return Tensor::from_vector(safetensors::as_f64(e), e.shape, Device::cpu(), Category::temporary);
  if (e.dtype == "BF16") {
    std::vector<kernels::bf16> v;
    for (const std::uint16_t b : safetensors::as_bf16_bits(e)) v.push_back(kernels::bf16::from_bits(b));
    return Tensor::from_vector(v, e.shape, Device::cpu(), Category::temporary);
  }
  return Tensor::from_vector(safetensors::as_i64(e), e.shape, Device::cpu(), Category::temporary);  // I64 (checked)
}

}  // namespace

void save_state_dict(const Module& module, const std::string& path) {
  safetensors::File file;
  for (const auto& [name, t] : state_dict(module)) file.tensors.emplace(name, to_entry(name, t));
  safetensors::write(path, file);
}

void load_state_dict(Module& module, const std::string& path) {
  const safetensors::File file = safetensors::read(path);  // FormatError naming the file if malformed
  copy_matching(state_dict(module), file, fmt::format("load_state_dict: '{}' does not match the model", path));
}

void copy_matching(const std::vector<std::pair<std::string, Tensor>>& expected, const safetensors::File& file,
                   const std::string& what) {

  std::vector<std::string> missing, unexpected, mismatched;
  std::map<std::string, bool> known;
  for (const auto& [name, t] : expected) {
    known[name] = true;
    const auto it = file.tensors.find(name);
    if (it == file.tensors.end()) {
      missing.push_back(name);
      continue;
    }
    const auto& e = it->second;
    const bool shape_ok = e.shape == t.shape(), dtype_ok = e.dtype == file_dtype(t.dtype());
    if (!shape_ok || !dtype_ok)
      mismatched.push_back(fmt::format("{}: expected {} {}, found {} {}", name, file_dtype(t.dtype()), shape_str(t.shape()),
                                       e.dtype, shape_str(e.shape)));
  }
  for (const auto& [name, e] : file.tensors)
    if (!known.count(name)) unexpected.push_back(name);

  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = fmt::format("{} ({} tensors expected, {} in the file):", what, expected.size(), file.tensors.size());
    if (!missing.empty()) msg += fmt::format("\n  missing keys ({}): {}", missing.size(), fmt::join(missing, ", "));
    if (!unexpected.empty())
      msg += fmt::format("\n  unexpected keys ({}): {}", unexpected.size(), fmt::join(unexpected, ", "));
    if (!mismatched.empty()) {
      msg += fmt::format("\n  shape/dtype mismatches ({}):", mismatched.size());
      for (const auto& m : mismatched) msg += "\n    " + m;
    }
    throw Error(msg);
  }

  for (const auto& [name, t] : expected) {
    Tensor dst = t;
    dst.copy_(from_entry(file.tensors.at(name)));
  }
}

}  // namespace tally::nn
