// data/spec.cpp — a data set named in one string, loaded; see data/spec.h.
#include "data/spec.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"
#include "data/readers.h"
#include "data/synthetic.h"

namespace tally::data {

namespace fs = std::filesystem;

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
}  // namespace

bool is_synthetic(const std::string& spec) { return spec == "synthetic" || spec.rfind("synthetic:", 0) == 0; }

Split load_dataset(const std::string& spec, std::optional<std::int64_t> num_classes) {
  if (num_classes && *num_classes < 1)
    throw Error(fmt::format("load_dataset: the class count must be >= 1, found {}", *num_classes));
  if (is_synthetic(spec)) {
    SyntheticOptions o;
    if (spec != "synthetic") {
      const auto chw = parse_chw(spec.substr(10));
      if (!chw)
        throw Error(fmt::format("data set '{}': expected synthetic:CxHxW with three positive integers, e.g. "
                                "synthetic:3x224x224", spec));
      o.channels = (*chw)[0], o.height = (*chw)[1], o.width = (*chw)[2];
    }
    o.num_classes = num_classes.value_or(std::min(o.height, o.width) >= 64 ? 1000 : 10);
    return make_synthetic(o);
  }
  Split s;
  bool known = false;
  const auto colon = spec.find(':');
  if (colon != std::string::npos && colon + 1 < spec.size()) {
    const std::string kind = spec.substr(0, colon), dir = spec.substr(colon + 1);
    known = true;
    if (kind == "mnist") s = load_mnist(dir);
    else if (kind == "fashion-mnist") s = load_fashion_mnist(dir);
    else if (kind == "cifar10") s = load_cifar10(dir);
    else if (kind == "cifar100") s = load_cifar100(dir);
    else known = false;
  }
  if (spec == "fashion-mnist") {
    std::error_code ec;
    if (!fs::is_directory(kFashionMnistDir, ec))
      throw FormatError(fmt::format("fashion-mnist: expected the data set in {} (Debian's dataset-fashion-mnist "
                                    "package: apt-get install dataset-fashion-mnist), found no such folder; or "
                                    "give its folder as fashion-mnist:DIR", kFashionMnistDir));
    s = load_fashion_mnist(kFashionMnistDir);
    known = true;
  }
  if (!known)
    throw Error(fmt::format("load_dataset: unknown data set '{}': expected one of synthetic, synthetic:CxHxW, "
                            "mnist:DIR, fashion-mnist, fashion-mnist:DIR, cifar10:DIR, cifar100:DIR",
                            spec));
  if (num_classes && *num_classes != s.train.num_classes)
    throw Error(fmt::format("load_dataset: {} classes asked for, but {} has {} classes (a class count is chosen "
                            "for synthetic data only)", *num_classes, spec, s.train.num_classes));
  return s;
}

}  // namespace tally::data
