// data/data.cpp — see data/data.h.
//
// Note [Portable randomness]: the shuffles, the augmentation draws and the synthetic images
// use only a splitmix64-style integer hash and generator written here — never the <random>
// distributions, whose outputs differ between standard libraries — and the synthetic images are
// computed in integer pixel levels (0..255) before the single conversion to float, so no
// floating-point contraction or rounding difference can change them between machines.
#include "data/data.h"

#include <omp.h>
#include "data/formats.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <zlib.h>

#include "core/error.h"

namespace tally::data {

namespace fs = std::filesystem;

// ---- randomness (Note [Portable randomness]) --------------------------------------------------

namespace {

// splitmix64 finaliser: a bijective mix of all 64 bits.
std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A key derived from several integers, order-sensitive.
std::uint64_t key(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
  return mix64(mix64(mix64(a) ^ b) ^ c);
}

// Domain tags keep the streams for different purposes apart.
constexpr std::uint64_t kTagShuffle = 0x53485546464c45ULL;  // "SHUFFLE"
constexpr std::uint64_t kTagAugment = 0x4155474d454e54ULL;  // "AUGMENT"
constexpr std::uint64_t kTagSynth = 0x53594e5448ULL;        // "SYNTH"
constexpr std::uint64_t kTagLabels = 0x4c4142454c53ULL;     // "LABELS"

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return mix64(state_);
  }
  // Uniform in [0, n), n > 0 (multiply-shift; the bias is below n / 2^64).
  std::uint64_t below(std::uint64_t n) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
  // Uniform integer in [lo, hi].
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(below(static_cast<std::uint64_t>(hi - lo + 1)));
  }

 private:
  std::uint64_t state_;
};

// Fisher–Yates with Rng: the same permutation on every machine.
void shuffle(std::vector<std::int64_t>& v, Rng& rng) {
  for (std::size_t i = v.size(); i > 1; --i) {
    std::size_t j = static_cast<std::size_t>(rng.below(i));
    std::swap(v[i - 1], v[j]);
  }
}

// ---- bytes ------------------------------------------------------------------------------------

std::string show(const fs::path& p) { return p.string(); }

std::uint32_t be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

// The byte -> [0,1] table used by every loader.
const std::array<float, 256>& level_to_float() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(i) / 255.0f;
    return t;
  }();
  return table;
}

constexpr std::uint32_t kIdxImages = 0x00000803;  // 2051: unsigned bytes, 3 dimensions
constexpr std::uint32_t kIdxLabels = 0x00000801;  // 2049: unsigned bytes, 1 dimension
constexpr std::int64_t kCifarPixels = 3 * 32 * 32;

std::string magic_hint(std::uint32_t found) {
  if (found == kIdxImages) return " (an IDX images file: are the file names swapped?)";
  if (found == kIdxLabels) return " (an IDX labels file: are the file names swapped?)";
  if ((found >> 16) == 0x1f8b) return " (gzip data inside the gzip file)";
  return "";
}

std::string found_magic(Bytes b) {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < 4; ++i) m = (m << 8) | (i < b.size() ? b[i] : 0u);
  return fmt::format("0x{:08x}{}", m, magic_hint(m));
}

}  // namespace

// ---- public: formats from memory (data/formats.h) ----------------------------------------------

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

void check_declared_size(std::uint64_t declared, std::uint64_t file_bytes, bool gzip, const std::string& name,
                         const std::string& what) {
  const std::uint64_t most = gzip ? file_bytes * 1032 + 1024 : file_bytes;
  if (declared > most)
    throw FormatError(fmt::format("{}: its header declares {} ({} bytes), but {} {} bytes {}: truncated, or not what "
                                  "its header says", name, what, declared, gzip ? "a gzip file of" : "the file has",
                                  file_bytes, gzip ? fmt::format("inflates to at most {}", most) : "in all"));
}

namespace {

// The header of an IDX images file (magic 2051, count, rows, cols), its values checked.
IdxImagesHeader idx_images_header(Bytes b, const std::string& name) {
  if (b.size() >= 4 && be32(b.data()) != kIdxImages)
    throw FormatError(fmt::format("{}: expected magic 0x{:08x} (IDX images), found {}", name, kIdxImages,
                                  found_magic(b)));
  if (b.size() < 16)
    throw FormatError(fmt::format(
        "{}: truncated header: expected at least 16 bytes (magic, count, rows, cols), found {}", name, b.size()));
  const auto count = static_cast<std::int32_t>(be32(b.data() + 4));
  const auto rows = static_cast<std::int32_t>(be32(b.data() + 8));
  const auto cols = static_cast<std::int32_t>(be32(b.data() + 12));
  if (count <= 0) throw FormatError(fmt::format("{}: expected a positive image count, found {}", name, count));
  if (rows <= 0 || cols <= 0 || rows > 4096 || cols > 4096)
    throw FormatError(fmt::format("{}: expected rows and cols in 1..4096, found {}x{}", name, rows, cols));
  return {count, rows, cols};
}
std::uint64_t idx_images_bytes(const IdxImagesHeader& h) {
  return 16 + std::uint64_t(h.count) * std::uint64_t(h.rows) * std::uint64_t(h.cols);
}

// The label count of an IDX labels file's header (magic 2049, count), checked.
std::int64_t idx_labels_header(Bytes b, const std::string& name) {
  if (b.size() >= 4 && be32(b.data()) != kIdxLabels)
    throw FormatError(fmt::format("{}: expected magic 0x{:08x} (IDX labels), found {}", name, kIdxLabels,
                                  found_magic(b)));
  if (b.size() < 8)
    throw FormatError(
        fmt::format("{}: truncated header: expected at least 8 bytes (magic, count), found {}", name, b.size()));
  const auto count = static_cast<std::int32_t>(be32(b.data() + 4));
  if (count <= 0) throw FormatError(fmt::format("{}: expected a positive label count, found {}", name, count));
  return count;
}

}  // namespace

std::uint64_t idx_declared_size(Bytes head, const std::string& name) {
  if (head.size() >= 4 && be32(head.data()) == kIdxLabels) return 8 + std::uint64_t(idx_labels_header(head, name));
  if (head.size() >= 4 && be32(head.data()) != kIdxImages)
    throw FormatError(fmt::format("{}: expected magic 0x{:08x} (IDX images) or 0x{:08x} (IDX labels), found {}", name,
                                  kIdxImages, kIdxLabels, found_magic(head)));
  return idx_images_bytes(idx_images_header(head, name));
}

IdxImagesHeader parse_idx_images(Bytes b, const std::string& name) {
  const IdxImagesHeader h = idx_images_header(b, name);
  const std::uint64_t want = idx_images_bytes(h);
  if (b.size() != want)
    throw FormatError(fmt::format("{}: expected 16 + {} x {} x {} = {} bytes, found {} ({})", name, h.count, h.rows,
                                  h.cols, want, b.size(), b.size() < want ? "truncated pixel data" : "trailing bytes"));
  return h;
}

std::int64_t parse_idx_labels(Bytes b, const std::string& name) {
  const std::int64_t count = idx_labels_header(b, name);
  const std::uint64_t want = 8 + std::uint64_t(count);
  if (b.size() != want)
    throw FormatError(fmt::format("{}: expected 8 + {} = {} bytes, found {} ({})", name, count, want, b.size(),
                                  b.size() < want ? "truncated label data" : "trailing bytes"));
  return count;
}

Dataset parse_idx_pair(const NamedBytes& images, const NamedBytes& labels, const char* set_name, float mean,
                       float stddev) {
  const IdxImagesHeader img = parse_idx_images(images.bytes, images.name);
  const std::int64_t n_labels = parse_idx_labels(labels.bytes, labels.name);
  if (n_labels != img.count)
    throw FormatError(fmt::format("{} has {} labels but {} has {} images: expected the same count in both files",
                                  labels.name, n_labels, images.name, img.count));
  Dataset ds;
  ds.name = set_name;
  ds.channels = 1;
  ds.height = img.rows;
  ds.width = img.cols;
  ds.num_classes = 10;
  ds.mean = {mean, 0.0f, 0.0f};
  ds.stddev = {stddev, 0.0f, 0.0f};
  ds.labels.resize(static_cast<std::size_t>(img.count));
  for (std::int64_t i = 0; i < img.count; ++i) {
    const std::uint8_t l = labels.bytes[8 + static_cast<std::size_t>(i)];
    if (l >= ds.num_classes)
      throw FormatError(fmt::format("{}: label {} at index {} is out of range: expected 0..{}", labels.name, l, i,
                                    ds.num_classes - 1));
    ds.labels[static_cast<std::size_t>(i)] = l;
  }
  const auto& lut = level_to_float();
  ds.images.resize(images.bytes.size() - 16);
  std::transform(images.bytes.begin() + 16, images.bytes.end(), ds.images.begin(),
                 [&](std::uint8_t v) { return lut[v]; });
  return ds;
}

void parse_cifar(Bytes b, const std::string& name, int label_bytes, Dataset& ds) {
  if (label_bytes != 1 && label_bytes != 2)
    throw Error(fmt::format("{}: CIFAR records have 1 or 2 label bytes, asked for {}", name, label_bytes));
  const std::int64_t record = label_bytes + kCifarPixels;
  const auto size = static_cast<std::int64_t>(b.size());
  const char* what = label_bytes == 1 ? "label byte" : "coarse and fine label bytes";
  if (size == 0)
    throw FormatError(fmt::format("{}: expected at least one {}-byte record ({} + {} pixel bytes), "
                                  "found an empty file",
                                  name, record, what, kCifarPixels));
  if (size % record != 0)
    throw FormatError(fmt::format(
        "{}: size {} is not a multiple of the {}-byte record ({} + {} pixel bytes): found {} "
        "whole records and {} bytes more (truncated or not a CIFAR binary file?)",
        name, size, record, what, kCifarPixels, size / record, size % record));
  const std::int64_t n = size / record;
  const auto& lut = level_to_float();
  const std::size_t old_n = ds.labels.size();
  ds.labels.resize(old_n + static_cast<std::size_t>(n));
  ds.images.resize((old_n + static_cast<std::size_t>(n)) * kCifarPixels);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint8_t* r = b.data() + i * record;
    if (label_bytes == 2 && r[0] >= 20)
      throw FormatError(fmt::format("{}: record {} has coarse label {}: expected 0..19", name, i, r[0]));
    const std::uint8_t label = r[label_bytes - 1];
    if (label >= ds.num_classes)
      throw FormatError(fmt::format("{}: record {} has {}label {}: expected 0..{}", name, i,
                                    label_bytes == 2 ? "fine " : "", label, ds.num_classes - 1));
    ds.labels[old_n + static_cast<std::size_t>(i)] = label;
    float* dst = ds.images.data() + (old_n + static_cast<std::size_t>(i)) * kCifarPixels;
    for (std::int64_t p = 0; p < kCifarPixels; ++p) dst[p] = lut[r[label_bytes + p]];
  }
}

// ---- files: read whole, then parsed by the functions above -------------------------------------

namespace {

// A file's bytes, decompressed when it is gzip, and the name errors should show: the path read,
// with " (decompressed)" when the bytes are what its gzip stream held.
struct FileBytes {
  std::vector<std::uint8_t> bytes;
  std::string name;
};

std::vector<std::uint8_t> read_plain(const fs::path& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in)
    throw FormatError(fmt::format("{}: expected a readable file, found one that cannot be opened",
                                  show(path)));
  const std::streamoff size = in.tellg();
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size))
    throw FormatError(fmt::format("{}: expected {} bytes, found a read error after {}", show(path),
                                  size, static_cast<std::int64_t>(in.gcount())));
  return bytes;
}

// An IDX file's bytes (read_file), its header's declared size checked against the file before
// anything is inflated (check_declared_size), and inflated no further than that size.
FileBytes read_idx_file(const fs::path& path);

// `path`, or `path`.gz when only that exists; gzip content (by its magic bytes) is decompressed.
FileBytes read_file(const fs::path& path, bool idx = false) {
  std::error_code ec;
  fs::path p = path;
  if (!fs::exists(p, ec)) {
    fs::path gz = path;
    gz += ".gz";
    if (!fs::exists(gz, ec))
      throw FormatError(fmt::format("{}: expected a file (or {}), found nothing at that path", show(path),
                                    show(gz.filename())));
    p = gz;
  }
  if (fs::is_directory(p, ec))
    throw FormatError(fmt::format("{}: expected a file, found a directory", show(p)));
  if (!fs::is_regular_file(p, ec))  // reading a FIFO would wait for a writer forever
    throw FormatError(fmt::format("{}: expected a regular file, found a FIFO, a socket or a device", show(p)));
  std::vector<std::uint8_t> bytes = read_plain(p);
  const bool gz = is_gzip(bytes);
  std::uint64_t limit = UINT64_MAX;
  if (idx && gz) {  // the header's size against the file, before anything is inflated (a plain
                    // file's is checked exactly by its parser, which allocates nothing more)
    // (A stream too short to hold a header is left to gunzip, which names how it ends.)
    const std::vector<std::uint8_t> head = gunzip_head(bytes, show(p), 16);
    if (head.size() == 16 || (head.size() >= 8 && be32(head.data()) == kIdxLabels)) {
      limit = idx_declared_size(head, show(p) + " (decompressed)");
      check_declared_size(limit, bytes.size(), true, show(p), "an IDX file");
    }
  }
  if (gz) return {gunzip(bytes, show(p), limit), show(p) + " (decompressed)"};
  return {std::move(bytes), show(p)};
}

FileBytes read_idx_file(const fs::path& path) { return read_file(path, true); }

// An IDX images file and its labels (MNIST's layout); `name`, mean and stddev describe the set.
Dataset read_idx_pair(const fs::path& images_path, const fs::path& labels_path, const char* set_name, float mean,
                      float stddev) {
  const FileBytes images = read_idx_file(images_path);
  parse_idx_images(images.bytes, images.name);  // the images file's errors before the labels file is read
  const FileBytes labels = read_idx_file(labels_path);
  return parse_idx_pair({images.bytes, images.name}, {labels.bytes, labels.name}, set_name, mean, stddev);
}

// Appends the records of one CIFAR file (see parse_cifar).
void append_cifar(const fs::path& path, int label_bytes, Dataset& ds) {
  const FileBytes f = read_file(path);
  parse_cifar(f.bytes, f.name, label_bytes, ds);
}

Dataset cifar_shell(const char* name, std::int64_t classes, std::array<float, 3> mean,
                    std::array<float, 3> stddev) {
  Dataset ds;
  ds.name = name;
  ds.channels = 3;
  ds.height = 32;
  ds.width = 32;
  ds.num_classes = classes;
  ds.mean = mean;
  ds.stddev = stddev;
  return ds;
}

// ---- synthetic --------------------------------------------------------------------------------
//
// Classes (shape, colour): 0 filled square red, 1 disk green, 2 horizontal stripes blue,
// 3 vertical stripes yellow, 4 diagonal stripes magenta, 5 cross cyan, 6 ring orange,
// 7 triangle white, 8 checkerboard violet, 9 two dots pink. Per image: half-size 6..10 px,
// centre anywhere that keeps the shape inside, stripe/checker phase and dot direction random,
// colour jittered by +-20 levels per channel, background a random dark colour (0..100 levels
// per channel), and noise of about 18 levels (0.07) standard deviation on every value (sum of
// four random bytes, an Irwin–Hall approximation of a gaussian). Coordinates are integers in
// 1/8-pixel units; all arithmetic is on integers.

constexpr int kSynSide = 32;
constexpr int kSynClasses = 10;
constexpr std::array<std::array<int, 3>, kSynClasses> kPalette = {{
    {230, 51, 51},    // red
    {51, 217, 64},    // green
    {64, 89, 242},    // blue
    {242, 230, 51},   // yellow
    {230, 64, 217},   // magenta
    {51, 217, 230},   // cyan
    {250, 140, 38},   // orange
    {235, 235, 235},  // white
    {153, 77, 242},   // violet
    {250, 153, 178},  // pink
}};

struct ShapeParams {
  int cls;
  std::int64_t cx, cy, s;  // centre and half-size, 1/8-pixel units
  std::int64_t phase;      // stripe / checker phase
  std::int64_t dx, dy;     // two-dots offset of each dot from the centre
};

bool inside(const ShapeParams& p, std::int64_t u, std::int64_t v) {
  const std::int64_t s = p.s;
  const bool box = std::abs(u) <= s && std::abs(v) <= s;
  switch (p.cls) {
    case 0: return box;
    case 1: return u * u + v * v <= s * s;
    case 2: return box && ((v + s + p.phase) / 16) % 2 == 0;
    case 3: return box && ((u + s + p.phase) / 16) % 2 == 0;
    case 4: return box && ((u + v + 2 * s + p.phase) / 24) % 2 == 0;
    case 5: {
      const std::int64_t t = s / 4;
      return (std::abs(u) <= t && std::abs(v) <= s) || (std::abs(v) <= t && std::abs(u) <= s);
    }
    case 6: {
      const std::int64_t r2 = u * u + v * v, in = s * 11 / 20;
      return r2 <= s * s && r2 >= in * in;
    }
    case 7: return std::abs(v) <= s && 2 * std::abs(u) <= v + s;
    case 8: return box && (((u + s + p.phase) / 24) + ((v + s + p.phase) / 24)) % 2 == 0;
    case 9: {
      const std::int64_t r = s * 2 / 5, a = u - p.dx, b = v - p.dy, c = u + p.dx, d = v + p.dy;
      return a * a + b * b <= r * r || c * c + d * d <= r * r;
    }
    default: return false;
  }
}

// The six orders of three colour channels: classes 10k..10k+9 use order k mod 6.
constexpr std::array<std::array<int, 3>, 6> kChannelOrders = {{{0, 1, 2}, {1, 2, 0}, {2, 0, 1}, {0, 2, 1}, {2, 1, 0}, {1, 0, 2}}};

// Draws one 3x32x32 image of class `cls` as levels 0..255 into q (3*32*32).
void draw_synthetic(int cls, std::uint64_t image_key, std::uint8_t* q) {
  Rng rng(image_key);
  ShapeParams p{};
  p.cls = cls % kSynClasses;
  const auto& order = kChannelOrders[static_cast<std::size_t>(cls / kSynClasses) % kChannelOrders.size()];
  p.s = rng.between(48, 80);
  p.cx = rng.between(p.s, kSynSide * 8 - p.s);
  p.cy = rng.between(p.s, kSynSide * 8 - p.s);
  p.phase = rng.between(0, 47);
  const std::int64_t axis = p.s * 3 / 5, diag = p.s * 53 / 125;  // 0.6 s and 0.6 s / sqrt(2)
  switch (rng.below(4)) {
    case 0: p.dx = axis, p.dy = 0; break;
    case 1: p.dx = 0, p.dy = axis; break;
    case 2: p.dx = diag, p.dy = diag; break;
    default: p.dx = diag, p.dy = -diag; break;
  }
  int fg[3], bg[3];
  for (int c = 0; c < 3; ++c)
    fg[c] = std::clamp(kPalette[static_cast<std::size_t>(p.cls)][static_cast<std::size_t>(order[c])] +
                           static_cast<int>(rng.between(-20, 20)),
                       0, 255);
  for (int c = 0; c < 3; ++c) bg[c] = static_cast<int>(rng.between(0, 100));

  constexpr int kPlane = kSynSide * kSynSide;
  std::uint8_t mask[kPlane];
  for (int y = 0; y < kSynSide; ++y)
    for (int x = 0; x < kSynSide; ++x)
      mask[y * kSynSide + x] = inside(p, 8 * x + 4 - p.cx, 8 * y + 4 - p.cy) ? 1 : 0;

  // Noise: each 64-bit draw gives two values, each (sum of four bytes - 510) / 8.
  std::uint64_t bits = 0;
  for (int c = 0; c < 3; ++c) {
    for (int i = 0; i < kPlane; ++i) {
      if ((i & 1) == 0) bits = rng.next();
      const int sum = int(bits & 0xff) + int((bits >> 8) & 0xff) + int((bits >> 16) & 0xff) +
                      int((bits >> 24) & 0xff);
      bits >>= 32;
      const int noise = (sum - 510) >> 3;  // arithmetic shift: floor division by 8
      const int base = mask[i] ? fg[c] : bg[c];
      q[c * kPlane + i] = static_cast<std::uint8_t>(std::clamp(base + noise, 0, 255));
    }
  }
}

struct LevelStats {
  std::array<std::uint64_t, 3> sum{}, sumsq{};
  std::uint64_t per_channel = 0;  // values counted per channel
};

Dataset make_synthetic_set(std::int64_t n, std::uint64_t seed, std::uint64_t split,
                           LevelStats* stats) {
  Dataset ds;
  ds.name = "synthetic";
  ds.channels = 3;
  ds.height = kSynSide;
  ds.width = kSynSide;
  ds.num_classes = kSynClasses;
  // Balanced labels (i mod 10) in a random order.
  ds.labels.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ds.labels[static_cast<std::size_t>(i)] = i % kSynClasses;
  Rng label_rng(key(seed, kTagLabels, split));
  shuffle(ds.labels, label_rng);

  constexpr std::int64_t numel = 3 * kSynSide * kSynSide;
  ds.images.resize(static_cast<std::size_t>(n * numel));
  const auto& lut = level_to_float();
  std::uint8_t q[numel];
  for (std::int64_t i = 0; i < n; ++i) {
    draw_synthetic(static_cast<int>(ds.labels[static_cast<std::size_t>(i)]),
                   key(key(seed, kTagSynth, split), static_cast<std::uint64_t>(i)), q);
    float* dst = ds.images.data() + i * numel;
    for (std::int64_t j = 0; j < numel; ++j) dst[j] = lut[q[j]];
    if (stats) {
      for (int c = 0; c < 3; ++c) {
        std::uint64_t s = 0, ss = 0;
        for (int j = 0; j < kSynSide * kSynSide; ++j) {
          const std::uint64_t v = q[c * kSynSide * kSynSide + j];
          s += v;
          ss += v * v;
        }
        stats->sum[c] += s;
        stats->sumsq[c] += ss;
      }
      stats->per_channel += kSynSide * kSynSide;
    }
  }
  return ds;
}

// ---- loader -----------------------------------------------------------------------------------

void check_dataset(const Dataset& ds, bool normalize, const char* who) {
  if (ds.channels <= 0 || ds.height <= 0 || ds.width <= 0 || ds.num_classes <= 0)
    throw Error(fmt::format("{}: data set '{}' has shape C={} H={} W={} and {} classes: expected "
                            "all positive",
                            who, ds.name, ds.channels, ds.height, ds.width, ds.num_classes));
  const auto want = ds.generate ? std::size_t{0} : static_cast<std::size_t>(ds.size() * ds.sample_numel());
  if (ds.images.size() != want)
    throw Error(fmt::format("{}: data set '{}' has {} labels of {}x{}x{} images: expected {} "
                            "image values, found {}",
                            who, ds.name, ds.size(), ds.channels, ds.height, ds.width, want,
                            ds.images.size()));
  if (normalize) {
    if (ds.channels > 3)
      throw Error(fmt::format("{}: normalize needs at most 3 channels (mean/stddev), found {}",
                              who, ds.channels));
    for (std::int64_t c = 0; c < ds.channels; ++c)
      if (!(ds.stddev[c] > 0.0f))
        throw Error(fmt::format("{}: normalize needs stddev > 0, found stddev[{}] = {} in '{}'",
                                who, c, ds.stddev[c], ds.name));
  }
}

// Writes sample `idx` of ds into dst (C, H, W), augmented with the draw `aug` when augment.
void copy_sample(const Dataset& ds, std::int64_t idx, bool augment, std::uint64_t aug,
                 bool normalize, float* dst) {
  const std::int64_t label = ds.labels[static_cast<std::size_t>(idx)];
  if (label < 0 || label >= ds.num_classes)
    throw Error(fmt::format("data set '{}': sample {} has label {}: expected 0..{}", ds.name, idx,
                            label, ds.num_classes - 1));
  const std::int64_t C = ds.channels, H = ds.height, W = ds.width, plane = H * W;
  const float* src = nullptr;
  thread_local std::vector<float> drawn;  // a procedural sample, before augmentation
  if (augment && ds.generate_augmented) {  // the data set augments itself
    ds.generate_augmented(idx, aug, dst);
    src = dst;
    augment = false;
  } else if (ds.generate) {
    if (!augment) {
      ds.generate(idx, dst);
      src = dst;
    } else {
      drawn.resize(static_cast<std::size_t>(C * plane));
      ds.generate(idx, drawn.data());
      src = drawn.data();
    }
  } else {
    src = ds.images.data() + idx * C * plane;
  }
  if (!augment) {
    if (src != dst) std::copy(src, src + C * plane, dst);
  } else {
    // Crop offset (oy, ox) in 0..8 of the image padded by 4 zeros per side, then maybe a flip:
    // out(y, x) = in(y + oy - 4, flip ? W-1-x + ox - 4 : x + ox - 4), zero outside.
    const std::int64_t oy = static_cast<std::int64_t>(aug % 9) - 4;
    const std::int64_t ox = static_cast<std::int64_t>((aug >> 8) % 9) - 4;
    const bool flip = ((aug >> 16) & 1) != 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const float* s = src + c * plane;
      float* d = dst + c * plane;
      for (std::int64_t y = 0; y < H; ++y) {
        const std::int64_t sy = y + oy;
        for (std::int64_t x = 0; x < W; ++x) {
          const std::int64_t sx = (flip ? W - 1 - x : x) + ox;
          d[y * W + x] = (sy >= 0 && sy < H && sx >= 0 && sx < W) ? s[sy * W + sx] : 0.0f;
        }
      }
    }
  }
  if (normalize) {
    for (std::int64_t c = 0; c < C; ++c) {
      const float m = ds.mean[static_cast<std::size_t>(c)];
      const float inv = 1.0f / ds.stddev[static_cast<std::size_t>(c)];
      float* d = dst + c * plane;
      for (std::int64_t i = 0; i < plane; ++i) d[i] = (d[i] - m) * inv;
    }
  }
}

}  // namespace

// ---- public: data sets ------------------------------------------------------------------------

namespace {

// MNIST's file layout (four IDX files, plain or .gz) for MNIST and Fashion-MNIST alike.
Split load_idx_set(const std::string& dir, const char* name, float mean, float stddev) {
  const fs::path d(dir);
  Split s;
  s.train = read_idx_pair(d / "train-images-idx3-ubyte", d / "train-labels-idx1-ubyte", name, mean, stddev);
  s.test = read_idx_pair(d / "t10k-images-idx3-ubyte", d / "t10k-labels-idx1-ubyte", name, mean, stddev);
  if (s.test.height != s.train.height || s.test.width != s.train.width)
    throw FormatError(fmt::format("{}: expected {}x{} images like the train set, found {}x{}",
                                  show(d / "t10k-images-idx3-ubyte"), s.train.height, s.train.width, s.test.height,
                                  s.test.width));
  return s;
}

}  // namespace

Split load_mnist(const std::string& dir) { return load_idx_set(dir, "mnist", 0.1307f, 0.3081f); }

Split load_fashion_mnist(const std::string& dir) {
  return load_idx_set(dir, "fashion-mnist", 0.2860f, 0.3530f);  // the training set's pixel mean and std
}

Split load_cifar10(const std::string& dir) {
  const fs::path d(dir);
  const std::array<float, 3> mean = {0.4914f, 0.4822f, 0.4465f};
  const std::array<float, 3> stddev = {0.2470f, 0.2435f, 0.2616f};
  Split s{cifar_shell("cifar10", 10, mean, stddev), cifar_shell("cifar10", 10, mean, stddev)};
  for (int i = 1; i <= 5; ++i)
    append_cifar(d / fmt::format("data_batch_{}.bin", i), 1, s.train);
  append_cifar(d / "test_batch.bin", 1, s.test);
  return s;
}

Split load_cifar100(const std::string& dir) {
  const fs::path d(dir);
  const std::array<float, 3> mean = {0.5071f, 0.4865f, 0.4409f};
  const std::array<float, 3> stddev = {0.2673f, 0.2564f, 0.2762f};
  Split s{cifar_shell("cifar100", 100, mean, stddev), cifar_shell("cifar100", 100, mean, stddev)};
  append_cifar(d / "train.bin", 2, s.train);
  append_cifar(d / "test.bin", 2, s.test);
  return s;
}

namespace {

// The procedural synthetic set of `o`'s shape: labels now, images drawn on demand.
Dataset procedural_synthetic_set(const SyntheticOptions& o, std::int64_t n, std::uint64_t split) {
  Dataset ds;
  ds.name = fmt::format("synthetic:{}x{}x{}", o.channels, o.height, o.width);
  ds.channels = o.channels;
  ds.height = o.height;
  ds.width = o.width;
  ds.num_classes = o.num_classes;
  ds.labels.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ds.labels[static_cast<std::size_t>(i)] = i % o.num_classes;
  Rng label_rng(key(o.seed, kTagLabels, split));
  shuffle(ds.labels, label_rng);
  const std::uint64_t image_key = key(o.seed, kTagSynth, split);
  const auto labels = std::make_shared<const std::vector<std::int64_t>>(ds.labels);
  const std::int64_t C = o.channels, H = o.height, W = o.width;
  ds.generate = [labels, image_key, C, H, W](std::int64_t i, float* dst) {
    std::uint8_t q[3 * kSynSide * kSynSide];
    draw_synthetic(static_cast<int>((*labels)[static_cast<std::size_t>(i)]), key(image_key, static_cast<std::uint64_t>(i)), q);
    const auto& lut = level_to_float();
    // Nearest neighbour: output pixel (y, x) takes drawing pixel (y * 32 / H, x * 32 / W).
    std::vector<int> xs(static_cast<std::size_t>(W));
    for (std::int64_t x = 0; x < W; ++x) xs[static_cast<std::size_t>(x)] = static_cast<int>(x * kSynSide / W);
    for (std::int64_t c = 0; c < C; ++c) {
      const std::uint8_t* plane = q + (c % 3) * kSynSide * kSynSide;
      for (std::int64_t y = 0; y < H; ++y) {
        const std::uint8_t* row = plane + (y * kSynSide / H) * kSynSide;
        float* out = dst + (c * H + y) * W;
        for (std::int64_t x = 0; x < W; ++x) out[x] = lut[row[xs[static_cast<std::size_t>(x)]]];
      }
    }
  };
  return ds;
}

}  // namespace

Split make_synthetic(const SyntheticOptions& o) {
  if (o.n_train <= 0 || o.n_test < 0)
    throw Error(fmt::format("make_synthetic: expected n_train > 0 and n_test >= 0, found {} and {}", o.n_train,
                            o.n_test));
  if (o.channels < 1 || o.height < 1 || o.width < 1 || o.num_classes < 1)
    throw Error(fmt::format("synthetic data: expected a shape CxHxW and a class count of at least 1 each, found "
                            "{}x{}x{} and {} classes", o.channels, o.height, o.width, o.num_classes));
  if (o.channels == 3 && o.height == kSynSide && o.width == kSynSide && o.num_classes == kSynClasses)
    return make_synthetic(o.n_train, o.n_test, o.seed);
  Split s;
  s.train = procedural_synthetic_set(o, o.n_train, 0);
  s.test = procedural_synthetic_set(o, o.n_test, 1);
  // Normalisation constants: per colour channel over the first drawings of the train set.
  LevelStats st;
  const std::int64_t probe = std::min<std::int64_t>(o.n_train, 2000);
  std::uint8_t q[3 * kSynSide * kSynSide];
  for (std::int64_t i = 0; i < probe; ++i) {
    draw_synthetic(static_cast<int>(s.train.labels[static_cast<std::size_t>(i)]),
                   key(key(o.seed, kTagSynth, 0), static_cast<std::uint64_t>(i)), q);
    for (int c = 0; c < 3; ++c)
      for (int j = 0; j < kSynSide * kSynSide; ++j) {
        const std::uint64_t v = q[c * kSynSide * kSynSide + j];
        st.sum[c] += v;
        st.sumsq[c] += v * v;
      }
    st.per_channel += kSynSide * kSynSide;
  }
  for (std::int64_t c = 0; c < std::min<std::int64_t>(o.channels, 3); ++c) {
    const double n = static_cast<double>(st.per_channel), sum = static_cast<double>(st.sum[c % 3]);
    const double mean = sum / n, var = static_cast<double>(st.sumsq[c % 3]) / n - mean * mean;
    s.train.mean[static_cast<std::size_t>(c)] = static_cast<float>(mean / 255.0);
    s.train.stddev[static_cast<std::size_t>(c)] = static_cast<float>(std::sqrt(std::max(var, 0.0)) / 255.0);
  }
  s.test.mean = s.train.mean;
  s.test.stddev = s.train.stddev;
  return s;
}

Split make_synthetic(std::int64_t n_train, std::int64_t n_test, std::uint64_t seed) {
  if (n_train <= 0 || n_test < 0)
    throw Error(fmt::format("make_synthetic: expected n_train > 0 and n_test >= 0, found {} and {}",
                            n_train, n_test));
  LevelStats st;
  Split s;
  s.train = make_synthetic_set(n_train, seed, 0, &st);
  s.test = make_synthetic_set(n_test, seed, 1, nullptr);
  // mean = sum / (n 255); var = (n sumsq - sum^2) / (n^2 255^2), the numerator exact in 128 bits.
  const auto n = static_cast<unsigned __int128>(st.per_channel);
  for (int c = 0; c < 3; ++c) {
    const unsigned __int128 num = n * st.sumsq[c] - static_cast<unsigned __int128>(st.sum[c]) *
                                                        st.sum[c];
    const double mean = static_cast<double>(st.sum[c]) / (static_cast<double>(n) * 255.0);
    const double var =
        static_cast<double>(num) / (static_cast<double>(n) * static_cast<double>(n) * 65025.0);
    s.train.mean[c] = static_cast<float>(mean);
    s.train.stddev[c] = static_cast<float>(std::sqrt(var));
  }
  s.test.mean = s.train.mean;
  s.test.stddev = s.train.stddev;
  return s;
}

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

// ---- public: loader ---------------------------------------------------------------------------

Batch batch_at(const Dataset& ds, std::int64_t k, std::int64_t batch_size, bool normalize) {
  check_dataset(ds, normalize, "batch_at");
  if (batch_size <= 0 || k < 0 || ds.size() == 0)
    throw Error(fmt::format("batch_at: expected k >= 0, batch_size > 0 and a non-empty data set, "
                            "found k={}, batch_size={}, {} samples",
                            k, batch_size, ds.size()));
  const std::int64_t n = ds.size(), numel = ds.sample_numel();
  Batch b;
  b.size = batch_size;
  b.index = k;
  b.images.resize(static_cast<std::size_t>(batch_size * numel));
  b.labels.resize(static_cast<std::size_t>(batch_size));
  const std::int64_t first = static_cast<std::int64_t>(
      (static_cast<unsigned __int128>(k) * static_cast<std::uint64_t>(batch_size)) %
      static_cast<std::uint64_t>(n));
  for (std::int64_t j = 0; j < batch_size; ++j) {
    const std::int64_t idx = (first + j) % n;
    copy_sample(ds, idx, false, 0, normalize, b.images.data() + j * numel);
    b.labels[static_cast<std::size_t>(j)] = ds.labels[static_cast<std::size_t>(idx)];
  }
  return b;
}

// The worker and the caller share this state under `mu`. The worker builds batch `produce`
// of generation `generation` outside the lock and publishes it in `ready` only if no
// start_epoch has happened meanwhile; next() takes `ready` and lets the worker go on.
struct Loader::State {
  const Dataset& ds;
  LoaderOptions opt;
  std::int64_t batches = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool started = false;
  std::uint64_t generation = 0;
  std::int64_t epoch = 0;
  std::shared_ptr<const std::vector<std::int64_t>> order;  // sample indices of this epoch
  std::int64_t produce = 0;  // next batch the worker builds
  std::int64_t consume = 0;  // next batch next() returns
  std::optional<Batch> ready;
  std::vector<float> spare;  // a given-back batch's images buffer (give_back), for the next build
  std::exception_ptr error;
  std::thread worker;

  State(const Dataset& d, LoaderOptions o) : ds(d), opt(o) {}

  Batch build(std::int64_t k, const std::vector<std::int64_t>& ord, std::int64_t ep) {
    const std::int64_t start = k * opt.batch_size;
    const std::int64_t size = std::min(opt.batch_size, ds.size() - start);
    const std::int64_t numel = ds.sample_numel();
    Batch b;
    b.size = size;
    b.index = k;
    {
      std::lock_guard<std::mutex> lock(mu);
      b.images = std::move(spare);  // reused: no new pages to map and zero
    }
    b.images.resize(static_cast<std::size_t>(size * numel));
    b.labels.resize(static_cast<std::size_t>(size));
    const std::uint64_t aug_key = key(opt.seed, kTagAugment, static_cast<std::uint64_t>(ep));
    // Drawing procedural samples (large synthetic images) is the expensive part: spread it over
    // the cores. Every sample depends only on its position, so the batch is the same either way.
    std::exception_ptr err;
    const int threads = opt.workers > 0 ? opt.workers : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ds.generate && size > 1)
    for (std::int64_t j = 0; j < size; ++j) {
      try {
        const std::int64_t pos = start + j, idx = ord[static_cast<std::size_t>(pos)];
        const std::uint64_t draw = opt.augment ? mix64(aug_key ^ static_cast<std::uint64_t>(pos)) : 0;
        copy_sample(ds, idx, opt.augment, draw, opt.normalize, b.images.data() + j * numel);
        b.labels[static_cast<std::size_t>(j)] = ds.labels[static_cast<std::size_t>(idx)];
      } catch (...) {
#pragma omp critical(tally_loader_error)
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return b;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || (started && !ready && !error && produce < batches); });
      if (stop) return;
      const std::int64_t k = produce++;
      const std::uint64_t gen = generation;
      const std::int64_t ep = epoch;
      const auto ord = order;
      lock.unlock();
      std::optional<Batch> built;
      std::exception_ptr err;
      try {
        built = build(k, *ord, ep);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      if (gen != generation) continue;  // start_epoch came meanwhile: drop it
      if (err)
        error = err;
      else
        ready = std::move(built);
      cv.notify_all();
    }
  }
};

Loader::Loader(const Dataset& ds, LoaderOptions opt) : state_(std::make_unique<State>(ds, opt)) {
  check_dataset(ds, opt.normalize, "Loader");
  if (opt.batch_size <= 0)
    throw Error(fmt::format("Loader: expected batch_size > 0, found {}", opt.batch_size));
  const std::int64_t n = ds.size();
  state_->batches = opt.drop_last ? n / opt.batch_size : (n + opt.batch_size - 1) / opt.batch_size;
  state_->worker = std::thread([s = state_.get()] { s->run(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
}

std::int64_t Loader::batches_per_epoch() const { return state_->batches; }

void Loader::start_epoch(std::int64_t epoch, std::int64_t first_batch) {
  if (first_batch < 0 || first_batch > state_->batches)
    throw Error(fmt::format("Loader::start_epoch: expected a first batch in [0, {}], found {}", state_->batches,
                            first_batch));
  auto ord = std::make_shared<std::vector<std::int64_t>>(static_cast<std::size_t>(state_->ds.size()));
  for (std::size_t i = 0; i < ord->size(); ++i) (*ord)[i] = static_cast<std::int64_t>(i);
  if (state_->opt.shuffle) {
    Rng rng(key(state_->opt.seed, kTagShuffle, static_cast<std::uint64_t>(epoch)));
    shuffle(*ord, rng);
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->generation;
    state_->started = true;
    state_->epoch = epoch;
    state_->order = std::move(ord);
    state_->produce = first_batch;
    state_->consume = first_batch;
    state_->ready.reset();
    state_->error = nullptr;
  }
  state_->cv.notify_all();
}

void Loader::give_back(Batch&& batch) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (batch.images.capacity() > state_->spare.capacity()) state_->spare = std::move(batch.images);
}

std::optional<Batch> Loader::next() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.started) throw Error("Loader::next: expected start_epoch(epoch) to be called first");
  if (s.consume >= s.batches) return std::nullopt;
  s.cv.wait(lock, [&] { return s.ready.has_value() || s.error; });
  if (s.error) std::rethrow_exception(s.error);  // stays set: every later next() rethrows it
  std::optional<Batch> b = std::move(s.ready);
  s.ready.reset();
  ++s.consume;
  lock.unlock();
  s.cv.notify_all();
  return b;
}

}  // namespace tally::data
