// data/spec.cpp — a data set named in one string, parsed once into a value and loaded; see
// data/spec.h.
#include "data/spec.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"
#include "core/tensor.h"
#include "data/readers.h"
#include "data/synthetic.h"

namespace tally::data {

namespace {

// "3x224x224" -> {3, 224, 224}; nullopt if it is not three positive integers.
std::optional<std::array<std::int64_t, 3>> parse_chw(const std::string& t) {
  std::array<std::int64_t, 3> v{};
  std::size_t pos = 0;
  for (int i = 0; i < 3; ++i) {
    std::size_t end = pos;
    while (end < t.size() && t[end] >= '0' && t[end] <= '9') ++end;
    if (end == pos || end - pos > 6) return std::nullopt;
    v[static_cast<std::size_t>(i)] = std::stoll(t.substr(pos, end - pos));
    if (v[static_cast<std::size_t>(i)] < 1) return std::nullopt;
    if (i < 2) {
      if (end >= t.size() || t[end] != 'x') return std::nullopt;
      pos = end + 1;
    } else if (end != t.size()) {
      return std::nullopt;
    }
  }
  return v;
}

// A spec that names none of the data sets load_dataset reads.
Error unknown_spec(const std::string& spec) {
  return Error(fmt::format("load_dataset: unknown data set '{}': expected one of synthetic, synthetic:CxHxW, "
                           "mnist:DIR, fashion-mnist, fashion-mnist:DIR, cifar10:DIR, cifar100:DIR, folder:DIR",
                           spec));
}

void check_class_count(std::optional<std::int64_t> num_classes) {
  if (num_classes && *num_classes < 1)
    throw Error(fmt::format("load_dataset: the class count must be >= 1, found {}", *num_classes));
}

}  // namespace

bool is_synthetic(const std::string& spec) { return spec == "synthetic" || spec.rfind("synthetic:", 0) == 0; }

DataSpec parse_data_spec(const std::string& spec) {
  DataSpec d;
  d.text = spec;
  if (is_synthetic(spec)) {
    d.kind = DataSpec::Kind::synthetic;
    if (spec != "synthetic") {
      const auto chw = parse_chw(spec.substr(10));
      if (!chw)
        throw Error(fmt::format("data set '{}': expected synthetic:CxHxW with three positive integers, e.g. "
                                "synthetic:3x224x224", spec));
      if (const std::string e = sample_shape_error({(*chw)[0], (*chw)[1], (*chw)[2]}); !e.empty())
        throw Error(fmt::format("data set '{}': {}", spec, e));
      d.shape = *chw;
    }
    return d;
  }
  if (spec.rfind("folder:", 0) == 0) {
    d.kind = DataSpec::Kind::folder;
    d.dir = spec.substr(7);
    return d;
  }
  if (spec == "fashion-mnist") {
    d.kind = DataSpec::Kind::fashion_mnist;
    return d;
  }
  const auto colon = spec.find(':');
  if (colon != std::string::npos && colon + 1 < spec.size()) {
    const std::string kind = spec.substr(0, colon);
    d.dir = spec.substr(colon + 1);
    if (kind == "mnist") d.kind = DataSpec::Kind::mnist;
    else if (kind == "fashion-mnist") d.kind = DataSpec::Kind::fashion_mnist;
    else if (kind == "cifar10") d.kind = DataSpec::Kind::cifar10;
    else if (kind == "cifar100") d.kind = DataSpec::Kind::cifar100;
    else throw unknown_spec(spec);
    return d;
  }
  throw unknown_spec(spec);
}

Split load_dataset(const DataSpec& spec, std::optional<std::int64_t> num_classes) {
  check_class_count(num_classes);
  Split s;
  switch (spec.kind) {
    case DataSpec::Kind::synthetic: {
      SyntheticOptions o;
      if (spec.shape) o.channels = (*spec.shape)[0], o.height = (*spec.shape)[1], o.width = (*spec.shape)[2];
      o.num_classes = num_classes.value_or(std::min(o.height, o.width) >= 64 ? 1000 : 10);
      return make_synthetic(o);
    }
    case DataSpec::Kind::mnist: s = load_mnist(spec.dir); break;
    case DataSpec::Kind::fashion_mnist:
      if (spec.dir.empty()) {
        std::error_code ec;
        if (!std::filesystem::is_directory(kFashionMnistDir, ec))
          throw FormatError(fmt::format("fashion-mnist: expected the data set in {} (Debian's dataset-fashion-mnist "
                                        "package: apt-get install dataset-fashion-mnist), found no such folder; or "
                                        "give its folder as fashion-mnist:DIR", kFashionMnistDir));
        s = load_fashion_mnist(kFashionMnistDir);
      } else {
        s = load_fashion_mnist(spec.dir);
      }
      break;
    case DataSpec::Kind::cifar10: s = load_cifar10(spec.dir); break;
    case DataSpec::Kind::cifar100: s = load_cifar100(spec.dir); break;
    case DataSpec::Kind::folder: throw unknown_spec(spec.text);  // load_folder's (data/folder.h)
  }
  if (num_classes && *num_classes != s.train.num_classes)
    throw Error(fmt::format("load_dataset: {} classes asked for, but {} has {} classes (a class count is chosen "
                            "for synthetic data only)", *num_classes, spec.text, s.train.num_classes));
  return s;
}

Split load_dataset(const std::string& spec, std::optional<std::int64_t> num_classes) {
  check_class_count(num_classes);  // before the spec's errors, as ever
  return load_dataset(parse_data_spec(spec), num_classes);
}

}  // namespace tally::data
