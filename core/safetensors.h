// core/safetensors.h — format-level safetensors I/O (no Tensor, no arena).
//
// The huggingface/safetensors layout:
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  UTF-8 JSON object: name -> {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
//              plus an optional "__metadata__": {string: string}; offsets are relative to the
//              start of the data section; the writer pads the JSON with spaces to a multiple of 8
//   [rest]     the raw little-endian tensor bytes, covered exactly by the tensors' offsets
//
// The reader validates everything (sizes, types, offsets, overlaps, gaps, trailing bytes,
// duplicate keys) and throws tally::FormatError naming the source, what was expected and what
// was found; it never reads outside the given buffer or file. I/O failures throw tally::Error.
// The writer is deterministic (metadata first, then tensors in name order, data in name order)
// and atomic (temporary file in the same directory, fsync, rename).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tally::safetensors {

// One tensor: its dtype name as spelled in the file ("F32", "I64", ...), its shape ([] for a
// scalar) and its raw little-endian bytes (product(shape) * dtype_size(dtype) of them).
struct Entry {
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
};

struct File {
  std::map<std::string, Entry> tensors;         // ordered: output is deterministic
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// Bytes per element of a safetensors dtype: BOOL U8 I8 F8_E4M3 F8_E5M2 (1), U16 I16 F16 BF16 (2),
// U32 I32 F32 (4), U64 I64 F64 (8). Throws tally::FormatError for an unknown dtype.
std::size_t dtype_size(const std::string& dtype);

// Parses a whole file image held in memory; source_name is used in error messages only.
File parse(const std::byte* data, std::size_t size, const std::string& source_name);

// Reads and parses the file at path (tally::Error if it cannot be opened or read).
File read(const std::string& path);

// Writes file to path atomically: path + ".tmp.<pid>" is written, fsynced and renamed over path;
// on any failure the temporary is removed and the old file (if any) is left untouched.
// Throws tally::FormatError for an inconsistent File (unknown dtype, negative dim, byte count
// that does not match the shape, a tensor named "__metadata__") and tally::Error naming the path
// for I/O failures (directory missing or not writable, disk full, ...).
void write(const std::string& path, const File& file);

// Typed views: copy the bytes out as values. Throw tally::FormatError if the dtype differs
// (no conversion is done) or the byte count does not match the shape.
std::vector<float> as_f32(const Entry& entry);
std::vector<double> as_f64(const Entry& entry);
std::vector<std::int64_t> as_i64(const Entry& entry);
std::vector<std::uint16_t> as_bf16_bits(const Entry& entry);  // BF16: each element's 16 bits

// Builders. Throw tally::ShapeError if a dim is negative or product(shape) != v.size().
Entry make_f32(std::vector<std::int64_t> shape, const std::vector<float>& v);
Entry make_f64(std::vector<std::int64_t> shape, const std::vector<double>& v);
Entry make_i64(std::vector<std::int64_t> shape, const std::vector<std::int64_t>& v);
Entry make_bf16(std::vector<std::int64_t> shape, const std::vector<std::uint16_t>& bits);

}  // namespace tally::safetensors
