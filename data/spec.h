// data/spec.h — a data set named in one string (`tally train --data`), loaded.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "data/dataset.h"

namespace tally::data {

// "synthetic" | "synthetic:CxHxW" | "mnist:DIR" | "fashion-mnist" (kFashionMnistDir) |
// "fashion-mnist:DIR" | "cifar10:DIR" | "cifar100:DIR"; anything else
// throws tally::Error. num_classes applies to synthetic data only (default: 10 below 64 pixels,
// else 1000, as `tally plan`); given for another data set it must equal that set's classes.
Split load_dataset(const std::string& spec, std::optional<std::int64_t> num_classes = std::nullopt);
// Whether `spec` names the synthetic data ("synthetic" or "synthetic:CxHxW"), whose class count is chosen.
bool is_synthetic(const std::string& spec);

}  // namespace tally::data
