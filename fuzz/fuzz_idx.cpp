// fuzz/fuzz_idx.cpp — libFuzzer harness for the MNIST formats of data/formats.h: gunzip,
// parse_idx_images, parse_idx_labels and parse_idx_pair.
//
// Input: gzip data (it starts with 1f 8b) is inflated first, as the loaders do, and what it held
// is then treated like plain input. Plain input is parsed as an images file and as a labels file;
// where it holds the labels magic (00 00 08 01) after its first 16 bytes, it is also cut there
// into an images file and a labels file for parse_idx_pair, so a seed of the two files
// concatenated reaches the pairing checks (counts, label range).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "data/formats.h"
#include "fuzz/harness.h"

namespace {

void parse_plain(tally::data::Bytes b) {
  using namespace tally;
  fuzz::expect_tally_errors_only([&] { (void)data::parse_idx_images(b, "images"); });
  fuzz::expect_tally_errors_only([&] { (void)data::parse_idx_labels(b, "labels"); });
  constexpr std::array<std::uint8_t, 4> kLabelsMagic = {0x00, 0x00, 0x08, 0x01};
  if (b.size() < 16) return;
  const auto cut = std::search(b.begin() + 16, b.end(), kLabelsMagic.begin(), kLabelsMagic.end());
  if (cut == b.end()) return;
  const auto at = static_cast<std::size_t>(cut - b.begin());
  fuzz::expect_tally_errors_only([&] {
    const data::Dataset ds = data::parse_idx_pair({b.first(at), "images"}, {b.subspan(at), "labels"}, "fuzz", 0.5f,
                                                  0.25f);
    if (ds.images.size() != static_cast<std::size_t>(ds.size() * ds.sample_numel()))
      throw std::logic_error("parse_idx_pair: image bytes do not match count x rows x cols");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size > fuzz::kMaxInput) return 0;
  const data::Bytes b = fuzz::bytes(data, size);
  if (!data::is_gzip(b)) {
    parse_plain(b);
    return 0;
  }
  fuzz::expect_tally_errors_only([&] {
    const std::vector<std::uint8_t> inflated = data::gunzip(b, "fuzz input");
    parse_plain(inflated);
  });
  return 0;
}
