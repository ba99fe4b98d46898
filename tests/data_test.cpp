// tests/data_test.cpp — data sets and the batch loader (data/data.h).
//
// File formats are tested on tiny MNIST / CIFAR-10 / CIFAR-100 files written here into a temporary
// directory: a clean set must read back exactly, and every kind of damage must throw
// tally::FormatError whose message names the file and says what was expected and found.
#include "data/data.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <sys/stat.h>

#include <gtest/gtest.h>
#include <zlib.h>

#include "core/error.h"

namespace tally::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::uint8_t>;

// ---- helpers ----------------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("tally_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

void write_file(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

void put_be32(Bytes& b, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<std::uint8_t>(v >> shift));
}

// A deterministic pixel byte for (sample, position), distinct across nearby samples.
std::uint8_t pixel(std::int64_t sample, std::int64_t p) {
  return static_cast<std::uint8_t>((sample * 37 + p * 7 + p / 5) % 256);
}

Bytes idx_images(std::int64_t n, std::int64_t rows, std::int64_t cols, std::int64_t first = 0) {
  Bytes b;
  put_be32(b, 0x00000803);
  put_be32(b, static_cast<std::uint32_t>(n));
  put_be32(b, static_cast<std::uint32_t>(rows));
  put_be32(b, static_cast<std::uint32_t>(cols));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t p = 0; p < rows * cols; ++p) b.push_back(pixel(first + i, p));
  return b;
}

Bytes idx_labels(const std::vector<std::uint8_t>& labels) {
  Bytes b;
  put_be32(b, 0x00000801);
  put_be32(b, static_cast<std::uint32_t>(labels.size()));
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

// CIFAR records: label bytes then 3072 pixels of sample `first + i`.
Bytes cifar_records(const std::vector<std::vector<std::uint8_t>>& labels, std::int64_t first) {
  Bytes b;
  for (std::size_t i = 0; i < labels.size(); ++i) {
    b.insert(b.end(), labels[i].begin(), labels[i].end());
    for (std::int64_t p = 0; p < 3072; ++p) b.push_back(pixel(first + std::int64_t(i), p));
  }
  return b;
}

// The message of the FormatError that f throws ("" and a failure if it throws none).
std::string format_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected tally::FormatError, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected tally::FormatError, nothing was thrown";
  return "";
}

void expect_contains(const std::string& msg, std::initializer_list<const char*> parts) {
  for (const char* part : parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "message lacks \"" << part << "\": " << msg;
}

// `b` as one gzip member (zlib's deflate with the gzip wrapper, as the gzip tool writes it).
Bytes gzip(const Bytes& b) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  Bytes out(deflateBound(&z, static_cast<uLong>(b.size())) + 64);
  z.next_in = const_cast<Bytef*>(b.data());
  z.avail_in = static_cast<uInt>(b.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// ---- MNIST ------------------------------------------------------------------------------------

constexpr std::int64_t kMnistTrain = 3, kMnistTest = 2;

void write_mnist(const TempDir& dir) {
  write_file(dir / "train-images-idx3-ubyte", idx_images(kMnistTrain, 28, 28, 0));
  write_file(dir / "train-labels-idx1-ubyte", idx_labels({7, 0, 9}));
  write_file(dir / "t10k-images-idx3-ubyte", idx_images(kMnistTest, 28, 28, 100));
  write_file(dir / "t10k-labels-idx1-ubyte", idx_labels({3, 5}));
}

TEST(Mnist, ReadsBackExactly) {
  TempDir dir;
  write_mnist(dir);
  const Split s = load_mnist(dir.str());
  for (const Dataset* d : {&s.train, &s.test}) {
    EXPECT_EQ(d->name, "mnist");
    EXPECT_EQ(d->channels, 1);
    EXPECT_EQ(d->height, 28);
    EXPECT_EQ(d->width, 28);
    EXPECT_EQ(d->num_classes, 10);
    EXPECT_FLOAT_EQ(d->mean[0], 0.1307f);
    EXPECT_FLOAT_EQ(d->stddev[0], 0.3081f);
  }
  ASSERT_EQ(s.train.size(), kMnistTrain);
  ASSERT_EQ(s.test.size(), kMnistTest);
  EXPECT_EQ(s.train.labels, (std::vector<std::int64_t>{7, 0, 9}));
  EXPECT_EQ(s.test.labels, (std::vector<std::int64_t>{3, 5}));
  ASSERT_EQ(s.train.images.size(), std::size_t(kMnistTrain * 784));
  ASSERT_EQ(s.test.images.size(), std::size_t(kMnistTest * 784));
  for (std::int64_t i = 0; i < kMnistTrain; ++i)
    for (std::int64_t p = 0; p < 784; ++p)
      ASSERT_EQ(s.train.images[i * 784 + p], float(pixel(i, p)) / 255.0f) << i << " " << p;
  for (std::int64_t i = 0; i < kMnistTest; ++i)
    for (std::int64_t p = 0; p < 784; ++p)
      ASSERT_EQ(s.test.images[i * 784 + p], float(pixel(100 + i, p)) / 255.0f);
  // Through load_dataset too.
  const Split t = load_dataset("mnist:" + dir.str());
  EXPECT_EQ(t.train.images, s.train.images);
  EXPECT_EQ(t.test.labels, s.test.labels);
}

// A FIFO where a data file should be is an error, not a read that waits for a writer forever.
TEST(Mnist, AFifoIsNoDataFile) {
  TempDir dir;
  write_mnist(dir);
  fs::remove(dir / "train-images-idx3-ubyte");
  ASSERT_EQ(::mkfifo((dir / "train-images-idx3-ubyte").c_str(), 0600), 0);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte", "expected a regular file, found a FIFO"});
}

TEST(Mnist, MissingFile) {
  TempDir dir;
  write_mnist(dir);
  fs::remove(dir / "t10k-labels-idx1-ubyte");
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-labels-idx1-ubyte", "expected a file", "found nothing"});
}

const char* const kMnistFiles[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                                    "t10k-labels-idx1-ubyte"};

// The four files as name.gz only, as Debian's dataset packages ship them.
void gzip_mnist(const TempDir& dir) {
  for (const char* f : kMnistFiles) {
    write_file(dir / (std::string(f) + ".gz"), gzip(read_bytes(dir / f)));
    fs::remove(dir / f);
  }
}

TEST(Gzip, GzippedFilesReadAsThePlainOnes) {
  TempDir plain, packed;
  write_mnist(plain);
  write_mnist(packed);
  gzip_mnist(packed);
  ASSERT_FALSE(fs::exists(packed / "train-images-idx3-ubyte"));
  const Split a = load_mnist(plain.str()), b = load_mnist(packed.str());
  EXPECT_EQ(a.train.images, b.train.images);
  EXPECT_EQ(a.train.labels, b.train.labels);
  EXPECT_EQ(a.test.images, b.test.images);
  EXPECT_EQ(a.test.labels, b.test.labels);
  // gzip content under the plain name is recognised by its magic bytes too.
  write_file(packed / "train-images-idx3-ubyte", read_bytes(packed / "train-images-idx3-ubyte.gz"));
  EXPECT_EQ(load_mnist(packed.str()).train.images, a.train.images);
}

TEST(Gzip, ConcatenatedMembersReadAsOneFile) {
  TempDir dir;
  write_mnist(dir);
  const Bytes whole = read_bytes(dir / "train-images-idx3-ubyte");
  const Bytes head(whole.begin(), whole.begin() + 100), tail(whole.begin() + 100, whole.end());
  Bytes two = gzip(head);
  const Bytes second = gzip(tail);
  two.insert(two.end(), second.begin(), second.end());
  const Split plain = load_mnist(dir.str());
  fs::remove(dir / "train-images-idx3-ubyte");
  write_file(dir / "train-images-idx3-ubyte.gz", two);
  EXPECT_EQ(load_mnist(dir.str()).train.images, plain.train.images);
}

TEST(Gzip, TruncatedStreamIsAnError) {
  TempDir dir;
  write_mnist(dir);
  gzip_mnist(dir);
  const Bytes full = read_bytes(dir / "train-images-idx3-ubyte.gz");
  for (std::size_t keep : {std::size_t{5}, full.size() / 2, full.size() - 4}) {  // header, body, trailer
    write_file(dir / "train-images-idx3-ubyte.gz", Bytes(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(keep)));
    expect_contains(format_error([&] { load_mnist(dir.str()); }),
                    {"train-images-idx3-ubyte.gz", "truncated gzip file", "expected", "trailer",
                     std::to_string(keep).c_str()});
  }
}

TEST(Gzip, CorruptStreamIsAnError) {
  TempDir dir;
  write_mnist(dir);
  gzip_mnist(dir);
  const Bytes full = read_bytes(dir / "t10k-labels-idx1-ubyte.gz");
  Bytes bad_method = full;
  bad_method[2] = 0x07;  // compression method other than deflate
  write_file(dir / "t10k-labels-idx1-ubyte.gz", bad_method);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-labels-idx1-ubyte.gz", "corrupt gzip data", "expected a valid gzip stream"});
  Bytes bad_crc = full;
  bad_crc[bad_crc.size() - 8] ^= 0xff;  // the trailer's CRC-32
  write_file(dir / "t10k-labels-idx1-ubyte.gz", bad_crc);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-labels-idx1-ubyte.gz", "corrupt gzip data", "incorrect data check"});
  Bytes bad_block = full;
  for (std::size_t i = 10; i < bad_block.size() - 8; ++i) bad_block[i] = 0xff;  // no valid deflate block
  write_file(dir / "t10k-labels-idx1-ubyte.gz", bad_block);
  expect_contains(format_error([&] { load_mnist(dir.str()); }), {"t10k-labels-idx1-ubyte.gz", "corrupt gzip data"});
}

TEST(Gzip, WrongMagicInsideTheGzip) {
  TempDir dir;
  write_mnist(dir);
  write_file(dir / "train-images-idx3-ubyte", idx_labels({1, 2, 3}));  // a labels file, then gzipped
  gzip_mnist(dir);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte.gz (decompressed)", "expected magic 0x00000803", "found 0x00000801",
                   "swapped"});
  write_mnist(dir);
  Bytes b = idx_images(kMnistTrain, 28, 28, 0);
  b.resize(b.size() - 28);  // a truncated image inside an intact gzip stream
  write_file(dir / "train-images-idx3-ubyte", b);
  gzip_mnist(dir);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte.gz (decompressed)", "truncated pixel data"});
}

// A header's declared size is checked against the file before anything is inflated: 2 MB of gzip
// whose header declared 2^31 - 1 images was inflated to 2.26 GB before its size was checked. And
// inflating stops as soon as it passes the declared size.
TEST(Gzip, AHeaderDeclaringMoreThanTheFileCanHoldIsRefusedBeforeInflating) {
  TempDir dir;
  write_mnist(dir);
  Bytes huge = idx_images(1, 28, 28, 0);
  const std::uint32_t count = 0x7fffffff;
  for (int i = 0; i < 4; ++i) huge[4 + i] = static_cast<std::uint8_t>(count >> (24 - 8 * i));
  huge.resize(huge.size() + (std::size_t(1) << 20), 0);  // 1 MiB of zeros: a few KB of gzip
  write_file(dir / "train-images-idx3-ubyte", huge);
  gzip_mnist(dir);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte.gz", "declares an IDX file (1683627179264 bytes)", "inflates to at most"});
  write_mnist(dir);
  Bytes trailing = idx_images(kMnistTrain, 28, 28, 0);
  trailing.resize(trailing.size() + (std::size_t(8) << 20), 0);  // 8 MiB past the declared images
  write_file(dir / "train-images-idx3-ubyte", trailing);
  gzip_mnist(dir);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte.gz: expected 2368 bytes once decompressed", "found more"});
}

TEST(FashionMnist, TheDebianPackageReadsInPlace) {
  // make test installs dataset-fashion-mnist (Makefile's Debian packages).
  const Split s = load_dataset("fashion-mnist");
  EXPECT_EQ(s.train.name, "fashion-mnist");
  EXPECT_EQ(s.train.size(), 60000);
  EXPECT_EQ(s.test.size(), 10000);
  for (const Dataset* d : {&s.train, &s.test}) {
    EXPECT_EQ(d->channels, 1);
    EXPECT_EQ(d->height, 28);
    EXPECT_EQ(d->width, 28);
    EXPECT_EQ(d->num_classes, 10);
    std::vector<std::int64_t> per_class(10, 0);
    for (auto l : d->labels) ++per_class[static_cast<std::size_t>(l)];
    for (auto c : per_class) EXPECT_EQ(c, d->size() / 10);  // both splits are balanced
  }
  // The stated normalisation constants are the training set's pixel statistics.
  double sum = 0, sq = 0;
  for (float v : s.train.images) sum += v, sq += double(v) * v;
  const double n = static_cast<double>(s.train.images.size()), mean = sum / n;
  EXPECT_NEAR(mean, s.train.mean[0], 1e-4);
  EXPECT_NEAR(std::sqrt(sq / n - mean * mean), s.train.stddev[0], 1e-4);
  // The same files through fashion-mnist:DIR.
  EXPECT_EQ(load_dataset(std::string("fashion-mnist:") + kFashionMnistDir).test.labels, s.test.labels);
}

TEST(Mnist, WrongMagic) {
  TempDir dir;
  write_mnist(dir);
  write_file(dir / "train-images-idx3-ubyte", idx_labels({1, 2, 3}));  // a labels file
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte", "expected magic 0x00000803", "found 0x00000801"});
  write_mnist(dir);
  Bytes b = idx_labels({1, 2});
  b[3] = 0x42;
  write_file(dir / "t10k-labels-idx1-ubyte", b);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-labels-idx1-ubyte", "expected magic 0x00000801", "found 0x00000842"});
}

TEST(Mnist, GzipMagicWithNothingBehindIt) {
  TempDir dir;
  write_mnist(dir);
  write_file(dir / "train-images-idx3-ubyte", Bytes{0x1f, 0x8b, 0x08, 0x08, 0x12, 0x34, 0, 0, 0});
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte", "truncated gzip file"});
  write_mnist(dir);
  write_file(dir / "train-labels-idx1-ubyte", Bytes{0x1f, 0x8b});
  expect_contains(format_error([&] { load_mnist(dir.str()); }), {"train-labels-idx1-ubyte", "gzip"});
}

TEST(Mnist, TruncatedHeader) {
  TempDir dir;
  write_mnist(dir);
  Bytes b = idx_images(kMnistTrain, 28, 28);
  b.resize(10);
  write_file(dir / "train-images-idx3-ubyte", b);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte", "truncated header", "expected at least 16 bytes",
                   "found 10"});
  write_mnist(dir);
  b = idx_labels({3, 5});
  b.resize(6);
  write_file(dir / "t10k-labels-idx1-ubyte", b);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-labels-idx1-ubyte", "truncated header", "expected at least 8 bytes",
                   "found 6"});
  write_mnist(dir);
  write_file(dir / "t10k-images-idx3-ubyte", Bytes{});  // empty file
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-images-idx3-ubyte", "truncated header", "found 0"});
}

TEST(Mnist, TruncatedData) {
  TempDir dir;
  write_mnist(dir);
  Bytes b = idx_images(kMnistTrain, 28, 28);
  b.resize(b.size() - 100);
  write_file(dir / "train-images-idx3-ubyte", b);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-images-idx3-ubyte", "expected 16 + 3 x 28 x 28 = 2368 bytes",
                   "found 2268", "truncated pixel data"});
  write_mnist(dir);
  b = idx_labels({3, 5});
  b.pop_back();
  write_file(dir / "t10k-labels-idx1-ubyte", b);
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"t10k-labels-idx1-ubyte", "expected 8 + 2 = 10 bytes", "found 9", "truncated"});
}

TEST(Mnist, CountMismatch) {
  TempDir dir;
  write_mnist(dir);
  write_file(dir / "train-labels-idx1-ubyte", idx_labels({1, 2}));
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-labels-idx1-ubyte has 2 labels but", "train-images-idx3-ubyte has 3 images",
                   "expected"});
}

TEST(Mnist, LabelOutOfRange) {
  TempDir dir;
  write_mnist(dir);
  write_file(dir / "train-labels-idx1-ubyte", idx_labels({1, 10, 2}));
  expect_contains(format_error([&] { load_mnist(dir.str()); }),
                  {"train-labels-idx1-ubyte", "label 10 at index 1", "expected 0..9"});
}

// ---- CIFAR ------------------------------------------------------------------------------------

void write_cifar10(const TempDir& dir) {
  for (int f = 1; f <= 5; ++f) {
    const std::uint8_t a = std::uint8_t((2 * f) % 10), b = std::uint8_t((2 * f + 1) % 10);
    write_file(dir / ("data_batch_" + std::to_string(f) + ".bin"),
               cifar_records({{a}, {b}}, 2 * (f - 1)));
  }
  write_file(dir / "test_batch.bin", cifar_records({{9}, {0}, {4}}, 100));
}

TEST(Cifar10, ReadsBackExactly) {
  TempDir dir;
  write_cifar10(dir);
  const Split s = load_cifar10(dir.str());
  for (const Dataset* d : {&s.train, &s.test}) {
    EXPECT_EQ(d->name, "cifar10");
    EXPECT_EQ(d->channels, 3);
    EXPECT_EQ(d->height, 32);
    EXPECT_EQ(d->width, 32);
    EXPECT_EQ(d->num_classes, 10);
    EXPECT_FLOAT_EQ(d->mean[0], 0.4914f);
    EXPECT_FLOAT_EQ(d->mean[2], 0.4465f);
    EXPECT_FLOAT_EQ(d->stddev[1], 0.2435f);
  }
  ASSERT_EQ(s.train.size(), 10);
  ASSERT_EQ(s.test.size(), 3);
  // data_batch_1..5 in order.
  EXPECT_EQ(s.train.labels, (std::vector<std::int64_t>{2, 3, 4, 5, 6, 7, 8, 9, 0, 1}));
  EXPECT_EQ(s.test.labels, (std::vector<std::int64_t>{9, 0, 4}));
  for (std::int64_t i = 0; i < 10; ++i)
    for (std::int64_t p = 0; p < 3072; ++p)
      ASSERT_EQ(s.train.images[i * 3072 + p], float(pixel(i, p)) / 255.0f) << i << " " << p;
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t p = 0; p < 3072; ++p)
      ASSERT_EQ(s.test.images[i * 3072 + p], float(pixel(100 + i, p)) / 255.0f);
  EXPECT_EQ(load_dataset("cifar10:" + dir.str()).train.images, s.train.images);
}

TEST(Cifar10, MissingFile) {
  TempDir dir;
  write_cifar10(dir);
  fs::remove(dir / "data_batch_4.bin");
  expect_contains(format_error([&] { load_cifar10(dir.str()); }),
                  {"data_batch_4.bin", "expected a file", "found nothing"});
}

TEST(Cifar10, SizeNotAMultipleOfTheRecord) {
  TempDir dir;
  write_cifar10(dir);
  Bytes b = cifar_records({{1}, {2}}, 0);
  b.pop_back();  // 6145 bytes
  write_file(dir / "data_batch_3.bin", b);
  expect_contains(format_error([&] { load_cifar10(dir.str()); }),
                  {"data_batch_3.bin: size 6145 is not a multiple of the 3073-byte record",
                   "found 1 whole records and 3072 bytes more"});
  write_cifar10(dir);
  write_file(dir / "test_batch.bin", Bytes{});
  expect_contains(format_error([&] { load_cifar10(dir.str()); }),
                  {"test_batch.bin", "expected at least one 3073-byte record", "found an empty file"});
}

TEST(Cifar10, GzipFile) {
  TempDir dir;
  write_cifar10(dir);
  Bytes b(3073, 0);
  b[0] = 0x1f;
  b[1] = 0x8b;
  write_file(dir / "data_batch_2.bin", b);
  expect_contains(format_error([&] { load_cifar10(dir.str()); }),
                  {"data_batch_2.bin", "corrupt gzip data", "expected a valid gzip stream"});
}

TEST(Cifar10, LabelOutOfRange) {
  TempDir dir;
  write_cifar10(dir);
  write_file(dir / "test_batch.bin", cifar_records({{9}, {10}}, 0));
  expect_contains(format_error([&] { load_cifar10(dir.str()); }),
                  {"test_batch.bin", "record 1 has label 10", "expected 0..9"});
}

void write_cifar100(const TempDir& dir) {
  write_file(dir / "train.bin", cifar_records({{0, 99}, {19, 42}, {5, 0}}, 0));
  write_file(dir / "test.bin", cifar_records({{3, 17}, {11, 63}}, 50));
}

TEST(Cifar100, ReadsBackExactlyWithFineLabels) {
  TempDir dir;
  write_cifar100(dir);
  const Split s = load_cifar100(dir.str());
  for (const Dataset* d : {&s.train, &s.test}) {
    EXPECT_EQ(d->name, "cifar100");
    EXPECT_EQ(d->channels, 3);
    EXPECT_EQ(d->num_classes, 100);
    EXPECT_FLOAT_EQ(d->mean[1], 0.4865f);
    EXPECT_FLOAT_EQ(d->stddev[2], 0.2762f);
  }
  EXPECT_EQ(s.train.labels, (std::vector<std::int64_t>{99, 42, 0}));
  EXPECT_EQ(s.test.labels, (std::vector<std::int64_t>{17, 63}));
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t p = 0; p < 3072; ++p)
      ASSERT_EQ(s.train.images[i * 3072 + p], float(pixel(i, p)) / 255.0f);
  for (std::int64_t i = 0; i < 2; ++i)
    for (std::int64_t p = 0; p < 3072; ++p)
      ASSERT_EQ(s.test.images[i * 3072 + p], float(pixel(50 + i, p)) / 255.0f);
  EXPECT_EQ(load_dataset("cifar100:" + dir.str()).test.images, s.test.images);
}

TEST(Cifar100, Corruption) {
  TempDir dir;
  write_cifar100(dir);
  fs::remove(dir / "test.bin");
  expect_contains(format_error([&] { load_cifar100(dir.str()); }),
                  {"test.bin", "expected a file", "found nothing"});

  write_cifar100(dir);
  Bytes b = cifar_records({{1, 2}, {3, 4}}, 0);
  b.resize(b.size() - 10);  // 6138 bytes
  write_file(dir / "train.bin", b);
  expect_contains(format_error([&] { load_cifar100(dir.str()); }),
                  {"train.bin: size 6138 is not a multiple of the 3074-byte record"});

  write_cifar100(dir);
  write_file(dir / "train.bin", cifar_records({{1, 2}, {3, 100}}, 0));
  expect_contains(format_error([&] { load_cifar100(dir.str()); }),
                  {"train.bin", "record 1 has fine label 100", "expected 0..99"});

  write_cifar100(dir);
  write_file(dir / "test.bin", cifar_records({{20, 2}}, 0));
  expect_contains(format_error([&] { load_cifar100(dir.str()); }),
                  {"test.bin", "record 0 has coarse label 20", "expected 0..19"});
}

// ---- load_dataset -----------------------------------------------------------------------------

TEST(LoadDataset, BadSpecListsTheAllowedForms) {
  for (const char* spec : {"imagenet:/data", "mnist", "mnist:", "cifar", "", "Synthetic"}) {
    try {
      load_dataset(spec);
      ADD_FAILURE() << "no exception for '" << spec << "'";
    } catch (const FormatError& e) {
      ADD_FAILURE() << "a bad spec is not a file error: " << e.what();
    } catch (const Error& e) {
      expect_contains(e.what(), {"synthetic", "mnist:DIR", "cifar10:DIR", "cifar100:DIR"});
      EXPECT_NE(std::string(e.what()).find("'" + std::string(spec) + "'"), std::string::npos)
          << e.what();
    }
  }
}

// The spec is parsed once into a value; what it names is asked of the value, never of the string.
TEST(LoadDataset, SpecParsedIntoAValue) {
  using Kind = DataSpec::Kind;
  const DataSpec plain = parse_data_spec("synthetic");
  EXPECT_EQ(plain.kind, Kind::synthetic);
  EXPECT_FALSE(plain.shape.has_value());
  const DataSpec shaped = parse_data_spec("synthetic:3x64x48");
  EXPECT_EQ(shaped.kind, Kind::synthetic);
  ASSERT_TRUE(shaped.shape.has_value());
  EXPECT_EQ(*shaped.shape, (std::array<std::int64_t, 3>{3, 64, 48}));
  const std::vector<std::tuple<std::string, Kind, std::string>> forms = {
      {"mnist:/d", Kind::mnist, "/d"},
      {"fashion-mnist", Kind::fashion_mnist, ""},  // kFashionMnistDir
      {"fashion-mnist:a:b", Kind::fashion_mnist, "a:b"},
      {"cifar10:x", Kind::cifar10, "x"},
      {"cifar100:/y/", Kind::cifar100, "/y/"},
      {"folder:/pics", Kind::folder, "/pics"}};
  for (const auto& [text, kind, dir] : forms) {
    const DataSpec d = parse_data_spec(text);
    EXPECT_EQ(d.kind, kind) << text;
    EXPECT_EQ(d.dir, dir) << text;
    EXPECT_EQ(d.text, text);
    EXPECT_FALSE(d.shape.has_value()) << text;
  }
  // A folder is load_folder's (data/folder.h): load_dataset refuses it.
  EXPECT_THROW(load_dataset(parse_data_spec("folder:/pics")), Error);
  // The value loads what the string loads.
  EXPECT_EQ(load_dataset(parse_data_spec("synthetic:1x20x20"), 3).train.labels,
            load_dataset("synthetic:1x20x20", 3).train.labels);
}

TEST(LoadDataset, MissingDirectoryIsAFormatError) {
  TempDir dir;
  expect_contains(format_error([&] { load_dataset("cifar10:" + (dir / "nowhere").string()); }),
                  {"data_batch_1.bin", "found nothing"});
}

// ---- synthetic --------------------------------------------------------------------------------

TEST(Synthetic, DeterministicAndSeedDependent) {
  const Split a = make_synthetic(300, 100, 7), b = make_synthetic(300, 100, 7);
  EXPECT_EQ(a.train.images, b.train.images);
  EXPECT_EQ(a.train.labels, b.train.labels);
  EXPECT_EQ(a.test.images, b.test.images);
  EXPECT_EQ(a.test.labels, b.test.labels);
  EXPECT_EQ(a.train.mean, b.train.mean);
  EXPECT_EQ(a.train.stddev, b.train.stddev);
  const Split c = make_synthetic(300, 100, 8);
  EXPECT_NE(a.train.images, c.train.images);
  // Train and test are different draws.
  EXPECT_FALSE(std::equal(a.test.images.begin(), a.test.images.end(), a.train.images.begin()));
  // Each image depends on the seed, the split and its index only.
  const Split d = make_synthetic(400, 100, 7);
  EXPECT_EQ(d.test.images, a.test.images) << "the test set does not depend on n_train";
}

// synthetic:CxHxW — drawn when a batch needs it, deterministic, any shape and class count.
TEST(Synthetic, AnyShapeIsDrawnOnDemand) {
  const Split s = load_dataset("synthetic:3x64x48", 20);
  EXPECT_EQ(s.train.name, "synthetic:3x64x48");
  EXPECT_EQ(s.train.size(), 10000);
  EXPECT_EQ(s.test.size(), 2000);
  EXPECT_EQ(s.train.channels, 3);
  EXPECT_EQ(s.train.height, 64);
  EXPECT_EQ(s.train.width, 48);
  EXPECT_EQ(s.train.num_classes, 20);
  EXPECT_TRUE(s.train.images.empty()) << "no image is held in memory";
  ASSERT_TRUE(s.train.generate);
  std::vector<std::int64_t> per_class(20, 0);
  for (std::int64_t l : s.train.labels) {
    ASSERT_GE(l, 0);
    ASSERT_LT(l, 20);
    ++per_class[static_cast<std::size_t>(l)];
  }
  for (std::int64_t n : per_class) EXPECT_EQ(n, 500) << "balanced classes";
  for (int c = 0; c < 3; ++c) {
    EXPECT_GT(s.train.mean[static_cast<std::size_t>(c)], 0.05f);
    EXPECT_GT(s.train.stddev[static_cast<std::size_t>(c)], 0.05f);
  }
  // The same sample twice, from another split object too: identical; values are pixel levels.
  std::vector<float> a(64 * 48 * 3), b(a.size());
  s.train.generate(17, a.data());
  load_dataset("synthetic:3x64x48", 20).train.generate(17, b.data());
  EXPECT_EQ(a, b);
  for (float v : a) {
    ASSERT_GE(v, 0.f);
    ASSERT_LE(v, 1.f);
  }
  s.train.generate(18, b.data());
  EXPECT_NE(a, b);
  // The loader builds batches from the drawings, in parallel, the same as batch_at.
  Loader l(s.train, {.batch_size = 16, .shuffle = false, .normalize = true});
  l.start_epoch(0);
  const auto first = l.next();
  ASSERT_TRUE(first.has_value());
  const Batch ref = batch_at(s.train, 0, 16, true);
  EXPECT_EQ(first->images, ref.images);
  EXPECT_EQ(first->labels, ref.labels);
  // 1 channel and the default class count: 10 below 64 pixels, 1000 from 64 up.
  EXPECT_EQ(load_dataset("synthetic:1x28x28").train.num_classes, 10);
  EXPECT_EQ(load_dataset("synthetic:3x224x224").train.num_classes, 1000);
  // synthetic:3x32x32 with 10 classes is the in-memory set itself.
  EXPECT_EQ(load_dataset("synthetic:3x32x32").train.images, make_synthetic().train.images);
}

TEST(Synthetic, BadShapesAndClassCountsAreClearErrors) {
  for (const char* spec : {"synthetic:3x64", "synthetic:0x32x32", "synthetic:3x32x32x1", "synthetic:axbxc",
                           "synthetic:", "synthetic:3x-2x4"}) {
    try {
      load_dataset(spec);
      ADD_FAILURE() << "no exception for '" << spec << "'";
    } catch (const Error& e) {
      expect_contains(e.what(), {"CxHxW", spec});
    }
  }
  try {
    load_dataset("synthetic", 0);
    ADD_FAILURE() << "a class count of 0 accepted";
  } catch (const Error& e) {
    expect_contains(e.what(), {"class count", "0"});
  }
}

TEST(LoadDataset, NumClassesMustMatchARealDataSet) {
  TempDir dir;
  write_cifar10(dir);
  EXPECT_EQ(load_dataset("cifar10:" + dir.path().string(), 10).train.num_classes, 10);
  try {
    load_dataset("cifar10:" + dir.path().string(), 7);
    ADD_FAILURE() << "a class count that contradicts the data set was accepted";
  } catch (const Error& e) {
    expect_contains(e.what(), {"7 classes asked for", "10 classes"});
  }
}

TEST(Synthetic, ShapeRangeBalanceAndStatistics) {
  const Split s = make_synthetic(1000, 500, 3);
  for (const Dataset* d : {&s.train, &s.test}) {
    EXPECT_EQ(d->name, "synthetic");
    EXPECT_EQ(d->channels, 3);
    EXPECT_EQ(d->height, 32);
    EXPECT_EQ(d->width, 32);
    EXPECT_EQ(d->num_classes, 10);
    ASSERT_EQ(d->images.size(), std::size_t(d->size() * 3072));
    const auto [lo, hi] = std::minmax_element(d->images.begin(), d->images.end());
    EXPECT_GE(*lo, 0.0f);
    EXPECT_LE(*hi, 1.0f);
    EXPECT_LT(*lo, 0.05f);
    EXPECT_GT(*hi, 0.95f);
    std::vector<std::int64_t> count(10, 0);
    for (std::int64_t l : d->labels) {
      ASSERT_GE(l, 0);
      ASSERT_LT(l, 10);
      ++count[std::size_t(l)];
    }
    for (std::int64_t c : count) EXPECT_NEAR(double(c), double(d->size()) / 10, 1.0);
    // No image is constant.
    for (std::int64_t i = 0; i < d->size(); ++i) {
      const auto first = d->images.begin() + i * 3072;
      const auto [a, b] = std::minmax_element(first, first + 3072);
      ASSERT_GT(*b - *a, 0.2f) << "image " << i;
    }
  }
  // mean/stddev are the per-channel statistics of the train set; the test set carries the same.
  for (int c = 0; c < 3; ++c) {
    double sum = 0, sumsq = 0;
    for (std::int64_t i = 0; i < s.train.size(); ++i)
      for (int p = 0; p < 1024; ++p) {
        const double v = s.train.images[std::size_t(i * 3072 + c * 1024 + p)];
        sum += v;
        sumsq += v * v;
      }
    const double n = double(s.train.size()) * 1024, mean = sum / n;
    EXPECT_NEAR(s.train.mean[c], mean, 1e-5);
    EXPECT_NEAR(s.train.stddev[c], std::sqrt(sumsq / n - mean * mean), 1e-5);
    EXPECT_EQ(s.test.mean[c], s.train.mean[c]);
    EXPECT_EQ(s.test.stddev[c], s.train.stddev[c]);
  }
}

TEST(Synthetic, ClassMeansDiffer) {
  const Split s = make_synthetic(1000, 10, 1);
  // Mean image per class (3x32x32): every pair must be clearly apart.
  std::vector<std::vector<double>> mean(10, std::vector<double>(3072, 0.0));
  std::vector<double> count(10, 0.0);
  for (std::int64_t i = 0; i < s.train.size(); ++i) {
    const auto l = std::size_t(s.train.labels[std::size_t(i)]);
    count[l] += 1;
    for (int p = 0; p < 3072; ++p) mean[l][std::size_t(p)] += s.train.images[std::size_t(i * 3072 + p)];
  }
  for (std::size_t l = 0; l < 10; ++l)
    for (double& v : mean[l]) v /= count[l];
  for (std::size_t a = 0; a < 10; ++a)
    for (std::size_t b = a + 1; b < 10; ++b) {
      double d2 = 0;
      for (std::size_t p = 0; p < 3072; ++p) d2 += (mean[a][p] - mean[b][p]) * (mean[a][p] - mean[b][p]);
      EXPECT_GT(std::sqrt(d2 / 3072), 0.03) << "classes " << a << " and " << b;
    }
}

// ---- loader -----------------------------------------------------------------------------------

// n samples of 1x2x3; value of pixel p of sample i is (i * 6 + p + 1) / 1000, so a value tells
// the sample it came from; label i % classes.
Dataset numbered(std::int64_t n, std::int64_t classes = 10, std::int64_t h = 2, std::int64_t w = 3) {
  Dataset ds;
  ds.name = "numbered";
  ds.channels = 1;
  ds.height = h;
  ds.width = w;
  ds.num_classes = classes;
  ds.mean = {0.25f, 0, 0};
  ds.stddev = {0.5f, 0, 0};
  for (std::int64_t i = 0; i < n; ++i) {
    ds.labels.push_back(i % classes);
    for (std::int64_t p = 0; p < h * w; ++p) ds.images.push_back(float(i * h * w + p + 1) / 1000.0f);
  }
  return ds;
}

// The sample a batch row came from (un-augmented, un-normalised rows only).
std::int64_t sample_of(const Batch& b, std::int64_t row, std::int64_t numel) {
  return std::lround(b.images[std::size_t(row * numel)] * 1000.0f - 1.0f) / numel;
}

std::vector<Batch> epoch(Loader& loader, std::int64_t e) {
  loader.start_epoch(e);
  std::vector<Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  EXPECT_FALSE(loader.next().has_value()) << "next() after the end must stay nullopt";
  return out;
}

std::vector<std::int64_t> order_of(const std::vector<Batch>& batches, std::int64_t numel) {
  std::vector<std::int64_t> order;
  for (const Batch& b : batches)
    for (std::int64_t r = 0; r < b.size; ++r) order.push_back(sample_of(b, r, numel));
  return order;
}

TEST(Loader, BatchCountWithAndWithoutDropLast) {
  const Dataset ds = numbered(10);
  {
    Loader l(ds, {.batch_size = 4, .shuffle = false, .drop_last = true});
    EXPECT_EQ(l.batches_per_epoch(), 2);
    const auto bs = epoch(l, 0);
    ASSERT_EQ(bs.size(), 2u);
    for (std::size_t k = 0; k < bs.size(); ++k) {
      EXPECT_EQ(bs[k].size, 4);
      EXPECT_EQ(bs[k].index, std::int64_t(k));
      EXPECT_EQ(bs[k].images.size(), 4u * 6u);
      EXPECT_EQ(bs[k].labels.size(), 4u);
    }
  }
  {
    Loader l(ds, {.batch_size = 4, .shuffle = true, .drop_last = false});
    EXPECT_EQ(l.batches_per_epoch(), 3);
    const auto bs = epoch(l, 0);
    ASSERT_EQ(bs.size(), 3u);
    EXPECT_EQ(bs[2].size, 2);
    EXPECT_EQ(bs[2].images.size(), 2u * 6u);
    EXPECT_EQ(bs[2].labels.size(), 2u);
  }
  {
    Loader exact(ds, {.batch_size = 5});
    EXPECT_EQ(exact.batches_per_epoch(), 2);
    Loader too_big(ds, {.batch_size = 11, .drop_last = true});
    EXPECT_EQ(too_big.batches_per_epoch(), 0);
    EXPECT_TRUE(epoch(too_big, 0).empty());
    Loader one(ds, {.batch_size = 11, .drop_last = false});
    EXPECT_EQ(one.batches_per_epoch(), 1);
  }
  EXPECT_THROW(Loader(ds, {.batch_size = 0}), Error);
}

TEST(Loader, ShufflePermutesEverySampleOncePerEpoch) {
  const Dataset ds = numbered(103);
  const LoaderOptions opt{.batch_size = 10, .shuffle = true, .drop_last = false, .seed = 42};
  Loader l(ds, opt);
  const auto order0 = order_of(epoch(l, 0), 6), order1 = order_of(epoch(l, 1), 6);
  for (const auto* order : {&order0, &order1}) {
    ASSERT_EQ(order->size(), 103u);
    std::vector<std::int64_t> sorted = *order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> all(103);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all);
  }
  std::vector<std::int64_t> file_order(103);
  std::iota(file_order.begin(), file_order.end(), 0);
  EXPECT_NE(order0, file_order);
  EXPECT_NE(order0, order1) << "epochs must be shuffled differently";
  // Labels travel with their samples.
  l.start_epoch(0);
  while (auto b = l.next())
    for (std::int64_t r = 0; r < b->size; ++r) EXPECT_EQ(b->labels[std::size_t(r)], sample_of(*b, r, 6) % 10);

  // Same seed -> same order (a fresh loader, and epoch 0 revisited); another seed -> another.
  Loader same(ds, opt);
  EXPECT_EQ(order_of(epoch(same, 1), 6), order1);
  EXPECT_EQ(order_of(epoch(same, 0), 6), order0);
  LoaderOptions other = opt;
  other.seed = 43;
  Loader different(ds, other);
  EXPECT_NE(order_of(epoch(different, 0), 6), order0);
}

TEST(Loader, NoShuffleIsFileOrderAndMatchesBatchAt) {
  const Dataset ds = numbered(10);
  Loader l(ds, {.batch_size = 4, .shuffle = false, .drop_last = false});
  for (std::int64_t e : {0, 5}) {
    const auto bs = epoch(l, e);
    std::vector<std::int64_t> file_order(10);
    std::iota(file_order.begin(), file_order.end(), 0);
    EXPECT_EQ(order_of(bs, 6), file_order);
    for (std::size_t k = 0; k < 2; ++k) {
      const Batch ref = batch_at(ds, std::int64_t(k), 4, false);
      EXPECT_EQ(bs[k].images, ref.images);
      EXPECT_EQ(bs[k].labels, ref.labels);
    }
  }
  // batch_at wraps around the end of the set.
  const Batch b2 = batch_at(ds, 2, 4, false);
  EXPECT_EQ(b2.size, 4);
  EXPECT_EQ(b2.index, 2);
  EXPECT_EQ(order_of({b2}, 6), (std::vector<std::int64_t>{8, 9, 0, 1}));
  EXPECT_EQ(b2.labels, (std::vector<std::int64_t>{8, 9, 0, 1}));
  EXPECT_EQ(order_of({batch_at(ds, 5, 4, false)}, 6), (std::vector<std::int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(order_of({batch_at(ds, 7, 3, false)}, 6), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_EQ(order_of({batch_at(ds, 0, 25, false)}, 6).size(), 25u);
  EXPECT_THROW(batch_at(ds, -1, 4, false), Error);
  EXPECT_THROW(batch_at(ds, 0, 0, false), Error);
}

TEST(Loader, AugmentationIsACropOfThePaddedImageMaybeFlipped) {
  const std::int64_t H = 8, W = 8, N = 64;
  const Dataset ds = numbered(N, 10, H, W);
  const LoaderOptions opt{.batch_size = 16, .shuffle = true, .augment = true, .seed = 5};
  Loader l(ds, opt);
  const auto bs = epoch(l, 0);
  ASSERT_EQ(bs.size(), 4u);
  std::int64_t changed = 0, flipped = 0;
  for (const Batch& b : bs) {
    ASSERT_EQ(b.images.size(), std::size_t(b.size * H * W));
    for (std::int64_t r = 0; r < b.size; ++r) {
      const float* out = b.images.data() + r * H * W;
      // Which sample? Any nonzero value identifies it.
      std::int64_t src = -1;
      for (std::int64_t p = 0; p < H * W && src < 0; ++p)
        if (out[p] != 0.0f) src = (std::lround(out[p] * 1000.0f) - 1) / (H * W);
      ASSERT_GE(src, 0) << "a crop shifted by at most 4 of an 8x8 image keeps some pixels";
      EXPECT_EQ(b.labels[std::size_t(r)], src % 10);
      const float* in = ds.images.data() + src * H * W;
      // Find the (oy, ox, flip) that reproduces the output exactly.
      bool found = false;
      for (int flip = 0; flip < 2 && !found; ++flip)
        for (int oy = -4; oy <= 4 && !found; ++oy)
          for (int ox = -4; ox <= 4 && !found; ++ox) {
            bool ok = true;
            for (std::int64_t y = 0; y < H && ok; ++y)
              for (std::int64_t x = 0; x < W && ok; ++x) {
                const std::int64_t sy = y + oy, sx = (flip ? W - 1 - x : x) + ox;
                const float want = (sy >= 0 && sy < H && sx >= 0 && sx < W) ? in[sy * W + sx] : 0.0f;
                ok = out[y * W + x] == want;
              }
            if (ok) {
              found = true;
              changed += (oy != 0 || ox != 0 || flip) ? 1 : 0;
              flipped += flip;
            }
          }
      EXPECT_TRUE(found) << "row " << r << " of batch " << b.index;
    }
  }
  EXPECT_GT(changed, N / 2);
  EXPECT_GT(flipped, N / 8);
  EXPECT_LT(flipped, N - N / 8);

  // Deterministic given (seed, epoch); different in another epoch.
  Loader again(ds, opt);
  const auto bs2 = epoch(again, 0);
  for (std::size_t k = 0; k < bs.size(); ++k) EXPECT_EQ(bs[k].images, bs2[k].images);
  LoaderOptions no_shuffle = opt;
  no_shuffle.shuffle = false;
  Loader fixed(ds, no_shuffle);
  const auto e0 = epoch(fixed, 0), e1 = epoch(fixed, 1);
  EXPECT_EQ(e0[0].labels, e1[0].labels);
  EXPECT_NE(e0[0].images, e1[0].images) << "augmentation draws must change with the epoch";
}

TEST(Loader, NormalizationMatchesTheFormula) {
  Dataset ds;  // 5 samples of 3x2x2
  ds.name = "rgb";
  ds.channels = 3;
  ds.height = 2;
  ds.width = 2;
  ds.num_classes = 4;
  ds.mean = {0.1f, 0.5f, 0.9f};
  ds.stddev = {0.2f, 0.25f, 0.5f};
  for (int i = 0; i < 5; ++i) {
    ds.labels.push_back(i % 4);
    for (int p = 0; p < 12; ++p) ds.images.push_back(float((i * 12 + p) % 17) / 16.0f);
  }
  Loader l(ds, {.batch_size = 5, .shuffle = false, .normalize = true});
  l.start_epoch(0);
  const auto b = l.next();
  ASSERT_TRUE(b.has_value());
  const Batch ref = batch_at(ds, 0, 5, true);
  EXPECT_EQ(b->images, ref.images);
  for (int i = 0; i < 5; ++i)
    for (int c = 0; c < 3; ++c)
      for (int p = 0; p < 4; ++p) {
        const std::size_t at = std::size_t(i * 12 + c * 4 + p);
        EXPECT_NEAR(b->images[at], (ds.images[at] - ds.mean[std::size_t(c)]) / ds.stddev[std::size_t(c)], 1e-6);
      }
  // Augmented and normalised: padding becomes -mean/stddev.
  Loader aug(ds, {.batch_size = 5, .shuffle = false, .augment = true, .normalize = true, .seed = 1});
  aug.start_epoch(0);
  const auto a = aug.next();
  ASSERT_TRUE(a.has_value());
  for (std::int64_t i = 0; i < 5; ++i)
    for (std::int64_t c = 0; c < 3; ++c)
      for (std::int64_t p = 0; p < 4; ++p) {
        const float v = a->images[std::size_t(i * 12 + c * 4 + p)];
        const float raw = v * ds.stddev[std::size_t(c)] + ds.mean[std::size_t(c)];
        // raw is 0 (padding) or a value of the source sample.
        bool ok = std::fabs(raw) < 1e-6f;
        for (std::int64_t q = 0; q < 4 && !ok; ++q)
          ok = std::fabs(raw - ds.images[std::size_t(i * 12 + c * 4 + q)]) < 1e-6f;
        EXPECT_TRUE(ok) << "sample " << i << " channel " << c << " pixel " << p;
      }
  // A zero stddev cannot normalise.
  ds.stddev[1] = 0.0f;
  EXPECT_THROW(Loader(ds, {.normalize = true}), Error);
}

TEST(Loader, SameBatchesRegardlessOfTiming) {
  const Split s = make_synthetic(300, 10, 2);
  const LoaderOptions opt{.batch_size = 32, .shuffle = true, .augment = true, .normalize = true,
                          .drop_last = false, .seed = 9};
  Loader fast(s.train, opt), slow(s.train, opt);
  for (std::int64_t e = 0; e < 2; ++e) {
    fast.start_epoch(e);
    slow.start_epoch(e);
    std::int64_t k = 0;
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(k % 3));
      auto a = fast.next();
      auto b = slow.next();
      ASSERT_EQ(a.has_value(), b.has_value());
      if (!a) break;
      EXPECT_EQ(a->index, k);
      EXPECT_EQ(a->images, b->images);
      EXPECT_EQ(a->labels, b->labels);
      ++k;
    }
    EXPECT_EQ(k, 10);
  }
}

TEST(Loader, RestartingAnEpochStartsOver) {
  const Dataset ds = numbered(40);
  Loader l(ds, {.batch_size = 4, .seed = 3});
  l.start_epoch(2);
  const auto first = l.next();
  (void)l.next();
  (void)l.next();
  l.start_epoch(2);
  const auto again = l.next();
  ASSERT_TRUE(first && again);
  EXPECT_EQ(again->index, 0);
  EXPECT_EQ(first->images, again->images);
}

TEST(Loader, NextBeforeStartEpochThrows) {
  const Dataset ds = numbered(8);
  Loader l(ds, {.batch_size = 4});
  EXPECT_THROW(l.next(), Error);
}

TEST(Loader, WorkerExceptionIsRethrownFromNext) {
  Dataset ds = numbered(12);
  ds.labels[5] = 99;  // batch 1 of a no-shuffle run with batch size 4
  Loader l(ds, {.batch_size = 4, .shuffle = false});
  l.start_epoch(0);
  EXPECT_TRUE(l.next().has_value());
  try {
    l.next();
    ADD_FAILURE() << "expected the worker's exception";
  } catch (const Error& e) {
    expect_contains(e.what(), {"sample 5", "label 99", "expected 0..9"});
  }
  EXPECT_THROW(l.next(), Error) << "the error stays until the next start_epoch";
  // A new epoch clears the error; batch 0 is fine again.
  l.start_epoch(1);
  EXPECT_TRUE(l.next().has_value());
}

TEST(Loader, DestructionMidEpochDoesNotHang) {
  const Split s = make_synthetic(600, 10, 4);
  for (int round = 0; round < 20; ++round) {
    Loader l(s.train, {.batch_size = 64, .augment = true, .normalize = true});
    if (round % 4 == 0) continue;  // never started
    l.start_epoch(round);
    if (round % 4 == 1) continue;  // started, nothing consumed: the worker is busy or waiting
    for (int k = 0; k < round % 5; ++k) ASSERT_TRUE(l.next().has_value());
  }
  SUCCEED();
}

TEST(Loader, EmptyOrInconsistentDataSet) {
  Dataset ds = numbered(5);
  ds.images.pop_back();
  EXPECT_THROW(Loader(ds, {}), Error);
  EXPECT_THROW(batch_at(ds, 0, 2, false), Error);
  const Dataset empty = numbered(0);
  Loader l(empty, {.batch_size = 4, .drop_last = false});
  EXPECT_EQ(l.batches_per_epoch(), 0);
  EXPECT_TRUE(epoch(l, 0).empty());
  EXPECT_THROW(batch_at(empty, 0, 4, false), Error);
}

}  // namespace
}  // namespace tally::data
