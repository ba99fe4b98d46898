// data/gzip.h — gzip data inflated from bytes in memory (zlib): what the data set readers do to a
// file whose content is gzip, and what the fuzz harnesses call directly (see data/formats.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tally::data {

using Bytes = std::span<const std::uint8_t>;

// Whether `bytes` start with gzip's magic (1f 8b).
bool is_gzip(Bytes bytes);

// Inflates gzip data: one member or several concatenated (as `cat a.gz b.gz` makes). Corrupt data
// (a bad header, a bad deflate block, a CRC or length mismatch in a trailer) and a stream that
// stops before its trailer are FormatErrors naming `name`, the compressed offset and what was
// expected. Inflating stops with a FormatError as soon as the output passes `limit` bytes (the
// size the file's header declares: read_file's callers pass it).
std::vector<std::uint8_t> gunzip(Bytes bytes, const std::string& name, std::uint64_t limit = UINT64_MAX);
// The first n bytes gzip data inflates to (fewer when it holds fewer), the rest not inflated: a
// header, read before anything is allocated for the body.
std::vector<std::uint8_t> gunzip_head(Bytes bytes, const std::string& name, std::size_t n);

}  // namespace tally::data
