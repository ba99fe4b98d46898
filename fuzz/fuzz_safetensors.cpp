// fuzz/fuzz_safetensors.cpp — libFuzzer harness for safetensors::parse (core/safetensors.h): the
// whole input is a file image (8-byte header length, JSON header, data). Every tensor it accepts
// is then read back through the typed view of its dtype, so entries whose bytes disagree with
// their shape show up there too.
#include <cstddef>
#include <cstdint>

#include "core/safetensors.h"
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size > fuzz::kMaxInput) return 0;
  fuzz::expect_tally_errors_only([&] {
    const safetensors::File file = safetensors::parse(reinterpret_cast<const std::byte*>(data), size, "fuzz input");
    for (const auto& named : file.tensors) {
      const safetensors::Entry& entry = named.second;  // not a structured binding: clang cannot capture one
      (void)safetensors::dtype_size(entry.dtype);  // parse accepted it: must be known
      fuzz::expect_tally_errors_only([&] {
        if (entry.dtype == "F32") (void)safetensors::as_f32(entry);
        else if (entry.dtype == "F64") (void)safetensors::as_f64(entry);
        else if (entry.dtype == "I64") (void)safetensors::as_i64(entry);
        else if (entry.dtype == "BF16") (void)safetensors::as_bf16_bits(entry);
        else (void)safetensors::as_f32(entry);  // the wrong-dtype refusal
      });
    }
  });
  return 0;
}
