// data/gzip.cpp — gzip data inflated from bytes in memory; see data/gzip.h.
#include "data/gzip.h"

#include <algorithm>

#include <fmt/format.h>
#include <zlib.h>

#include "core/error.h"

namespace tally::data {

namespace {

// A zlib inflate stream reading the gzip wrapper, ended when it goes.
struct GzipStream {
  z_stream z{};
  explicit GzipStream(const std::string& name) {
    if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK)  // 16: the gzip wrapper, not zlib's
      throw Error(fmt::format("{}: zlib could not start a gzip stream (inflateInit2 failed)", name));
  }
  ~GzipStream() { inflateEnd(&z); }
  GzipStream(const GzipStream&) = delete;
  GzipStream& operator=(const GzipStream&) = delete;
};

}  // namespace

bool is_gzip(Bytes bytes) { return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b; }

// zlib is fed in chunks of kChunk bytes (its avail_in is 32-bit) and writes kGrow bytes at a time.
std::vector<std::uint8_t> gunzip(Bytes bytes, const std::string& name, std::uint64_t limit) {
  GzipStream stream(name);
  z_stream& z = stream.z;
  constexpr std::size_t kChunk = std::size_t(1) << 18, kGrow = std::size_t(1) << 20;
  std::vector<std::uint8_t> out;
  std::uint64_t fed = 0;      // compressed bytes before this chunk
  bool member_done = false;   // the last member ended with its trailer
  while (fed < bytes.size()) {
    const std::size_t n = std::min<std::size_t>(kChunk, bytes.size() - fed);
    z.next_in = const_cast<Bytef*>(bytes.data() + fed);  // zlib's API is not const; it only reads
    z.avail_in = static_cast<uInt>(n);
    while (z.avail_in > 0) {
      if (member_done) {  // more bytes after a member: the next member of a concatenated file
        inflateReset(&z);
        member_done = false;
      }
      const std::size_t have = out.size();
      out.resize(have + kGrow);
      z.next_out = out.data() + have;
      z.avail_out = static_cast<uInt>(kGrow);
      const int ret = inflate(&z, Z_NO_FLUSH);
      out.resize(out.size() - z.avail_out);
      if (out.size() > limit)
        throw FormatError(fmt::format("{}: expected {} bytes once decompressed (the size its header declares), found "
                                      "more (trailing bytes)", name, limit));
      if (ret == Z_STREAM_END) {
        member_done = true;
      } else if (ret == Z_DATA_ERROR || ret == Z_NEED_DICT || ret == Z_STREAM_ERROR) {
        throw FormatError(fmt::format(
            "{}: corrupt gzip data near compressed byte {}: expected a valid gzip stream, found an error "
            "({}) after {} decompressed bytes",
            name, fed + (n - z.avail_in), z.msg ? z.msg : "data error", out.size()));
      } else if (ret == Z_MEM_ERROR) {
        throw Error(fmt::format("{}: zlib ran out of memory while decompressing", name));
      } else if (ret == Z_BUF_ERROR) {
        break;  // no progress without more input
      }
    }
    fed += n;
  }
  if (!member_done)
    throw FormatError(fmt::format(
        "{}: truncated gzip file: expected the compressed stream to end with its trailer, found the end of the "
        "file after {} compressed bytes ({} bytes decompressed)",
        name, fed, out.size()));
  return out;
}

std::vector<std::uint8_t> gunzip_head(Bytes bytes, const std::string& name, std::size_t n) {
  GzipStream stream(name);
  z_stream& z = stream.z;
  std::vector<std::uint8_t> out(n);
  z.next_in = const_cast<Bytef*>(bytes.data());
  z.avail_in = static_cast<uInt>(std::min<std::size_t>(bytes.size(), std::size_t(1) << 30));
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(n);
  while (z.avail_out > 0) {
    const int ret = inflate(&z, Z_NO_FLUSH);
    if (ret == Z_STREAM_END || ret == Z_BUF_ERROR) break;
    if (ret != Z_OK)
      throw FormatError(fmt::format("{}: corrupt gzip data in its first bytes: expected a valid gzip stream, found an "
                                    "error ({})", name, z.msg ? z.msg : "data error"));
  }
  out.resize(n - z.avail_out);
  return out;
}

}  // namespace tally::data
