// data/readers.cpp — MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100 read from their files: each file
// read whole (and inflated when it is gzip), then parsed by data/formats.h; see data/readers.h.
#include "data/readers.h"

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "data/formats.h"

namespace tally::data {

namespace fs = std::filesystem;

// ---- files: read whole, then parsed by data/formats.h -------------------------------------------

namespace {

std::string show(const fs::path& p) { return p.string(); }

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
    if (idx_head_complete(head)) {
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

// ---- public: data sets --------------------------------------------------------------------------

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

}  // namespace tally::data
