// data/formats.cpp — the data set file formats (IDX, CIFAR) parsed from bytes in memory; see
// data/formats.h.
#include "data/formats.h"

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "core/error.h"

namespace tally::data {

// ---- bytes --------------------------------------------------------------------------------------

namespace {

std::uint32_t be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
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

// ---- public: formats from memory ----------------------------------------------------------------

const std::array<float, 256>& level_to_float() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(i) / 255.0f;
    return t;
  }();
  return table;
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

bool idx_head_complete(Bytes head) {
  return head.size() >= 16 || (head.size() >= 8 && be32(head.data()) == kIdxLabels);
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

}  // namespace tally::data
