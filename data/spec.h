// data/spec.h — a data set named in one string (`tally train --data`), parsed once into a value, and
// the data set it names loaded.
//
//   synthetic | synthetic:CxHxW | mnist:DIR | fashion-mnist (kFashionMnistDir) | fashion-mnist:DIR |
//   cifar10:DIR | cifar100:DIR | folder:DIR
//
// parse_data_spec is the one reader of these strings: load_dataset and the apps ask the value what
// it names, never the string. A folder of pictures is loaded by load_folder (data/folder.h), which
// needs options of its own; load_dataset loads the others.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "data/dataset.h"

namespace tally::data {

struct DataSpec {
  enum class Kind { synthetic, mnist, fashion_mnist, cifar10, cifar100, folder };
  Kind kind = Kind::synthetic;
  // The folder of mnist:, fashion-mnist:, cifar10:, cifar100: and folder: (as written after the
  // colon); empty for plain fashion-mnist, which is read from kFashionMnistDir.
  std::string dir;
  std::optional<std::array<std::int64_t, 3>> shape;  // synthetic:CxHxW's C, H, W; none: 3x32x32
  std::string text;  // the spec as written, for messages
};

// The spec's value. Anything that is none of the forms above throws tally::Error listing the forms
// load_dataset reads; a synthetic shape that is not three positive integers, one saying so.
DataSpec parse_data_spec(const std::string& spec);

// The data set `spec` names. num_classes applies to synthetic data only (default: 10 below 64
// pixels, else 1000, as `tally plan`); given for another data set it must equal that set's classes.
// A folder: spec throws tally::Error (load_folder reads folders).
Split load_dataset(const DataSpec& spec, std::optional<std::int64_t> num_classes = std::nullopt);
// load_dataset(parse_data_spec(spec), num_classes).
Split load_dataset(const std::string& spec, std::optional<std::int64_t> num_classes = std::nullopt);
// Whether `spec` names the synthetic data ("synthetic" or "synthetic:CxHxW"), whose class count is chosen.
bool is_synthetic(const std::string& spec);

}  // namespace tally::data
