// fuzz/fuzz_cifar.cpp — libFuzzer harness for data::parse_cifar (data/formats.h).
//
// Input: the first byte picks the format — even: CIFAR-10 (1 label byte, 10 classes), odd:
// CIFAR-100 (2 label bytes, 100 classes) — and the rest is the file. A data set that already
// holds one record receives the file, as the second of CIFAR-10's train batches does.
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "data/formats.h"
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size < 1 || size > fuzz::kMaxInput) return 0;
  const int label_bytes = (data[0] & 1) ? 2 : 1;
  data::Dataset ds;
  ds.channels = 3, ds.height = 32, ds.width = 32;
  ds.num_classes = label_bytes == 1 ? 10 : 100;
  ds.labels.assign(1, 0);
  ds.images.assign(3 * 32 * 32, 0.0f);
  fuzz::expect_tally_errors_only([&] {
    data::parse_cifar(fuzz::bytes(data + 1, size - 1), "fuzz input", label_bytes, ds);
    if (ds.images.size() != ds.labels.size() * 3 * 32 * 32)
      throw std::logic_error("parse_cifar: images and labels disagree in count");
  });
  return 0;
}
