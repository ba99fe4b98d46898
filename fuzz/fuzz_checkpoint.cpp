// fuzz/fuzz_checkpoint.cpp — libFuzzer harness for the checkpoint reader's checks on bytes in
// memory (mbp::parse_checkpoint, mbp/checkpoint.h): the manifest (state.json) with the byte
// counts and CRC-32s of the other files, then state.safetensors.
//
// Input: the manifest's text, a NUL byte, then the tensor file's bytes (no NUL: all manifest, no
// tensors). A kept file "metrics.csv" with fixed content is offered too. So that the fuzzer gets
// past the CRC check to what lies behind it, the harness writes the tensor part's true size and
// CRC-32 where the manifest says "@bytes" and "@crc" (quotes included); a manifest with numbers
// of its own is checked as written.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>

#include "fuzz/harness.h"
#include "mbp/checkpoint.h"

namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size > fuzz::kMaxInput) return 0;
  const auto* nul = static_cast<const std::uint8_t*>(std::memchr(data, 0, size));
  const std::size_t text_size = nul ? static_cast<std::size_t>(nul - data) : size;
  std::string manifest = fuzz::text(data, text_size);
  const std::span<const std::byte> tensors(reinterpret_cast<const std::byte*>(data) + (nul ? text_size + 1 : size),
                                           nul ? size - text_size - 1 : 0);
  const uLong crc = ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(tensors.data()),
                            static_cast<uInt>(tensors.size()));
  replace_all(manifest, "\"@bytes\"", std::to_string(tensors.size()));
  replace_all(manifest, "\"@crc\"", std::to_string(crc));
  const std::map<std::string, std::string> files = {{"metrics.csv", "step,loss\n1,2.302585\n"}};
  fuzz::expect_tally_errors_only([&] { (void)mbp::parse_checkpoint(manifest, tensors, files, "fuzz input"); });
  return 0;
}
