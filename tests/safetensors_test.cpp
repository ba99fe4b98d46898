// tests/safetensors_test.cpp — core/safetensors: round trips, exact layout, every malformed
// header, truncation at every length, atomic writes.
#include "core/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"

namespace st = tally::safetensors;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<std::byte>;

constexpr const char* kSource = "bad.safetensors";

Bytes to_bytes(const std::string& s) {
  Bytes b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());
  return b;
}

void append_u64(Bytes& b, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}

// A file image: declared header length, header text, then `data_bytes` bytes of data.
Bytes image(const std::string& header, std::size_t data_bytes, std::uint64_t declared_len) {
  Bytes b;
  append_u64(b, declared_len);
  const Bytes h = to_bytes(header);
  b.insert(b.end(), h.begin(), h.end());
  for (std::size_t i = 0; i < data_bytes; ++i) b.push_back(static_cast<std::byte>(i * 37 + 1));
  return b;
}
Bytes image(const std::string& header, std::size_t data_bytes) {
  return image(header, data_bytes, header.size());
}

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return to_bytes(s);
}

void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Parses a copy of `b` held in a heap block of exactly its size (so ASan sees any overread) and
// expects a FormatError naming the source and containing `needle`.
void expect_format_error(const Bytes& b, const std::string& needle) {
  SCOPED_TRACE("expected message containing: " + needle);
  auto copy = std::make_unique<std::byte[]>(b.size() == 0 ? 1 : b.size());
  if (!b.empty()) std::memcpy(copy.get(), b.data(), b.size());
  try {
    (void)st::parse(copy.get(), b.size(), kSource);
    ADD_FAILURE() << "parse succeeded";
  } catch (const tally::FormatError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(kSource), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

// A fresh, empty directory under the system temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("tally_st_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

st::Entry raw_entry(std::string dtype, std::vector<std::int64_t> shape, std::size_t nbytes,
                unsigned seed) {
  st::Entry e;
  e.dtype = std::move(dtype);
  e.shape = std::move(shape);
  e.data.resize(nbytes);
  for (std::size_t i = 0; i < nbytes; ++i) e.data[i] = static_cast<std::byte>(i * 13 + seed);
  return e;
}

st::File sample_file() {
  st::File f;
  f.tensors["weight"] = st::make_f32({2, 3}, {1.f, -2.f, 3.5f, 0.f, -0.f, 1e-30f});
  f.tensors["double"] = st::make_f64({4}, {1.0, -1e300, 3.25, 0.1});
  f.tensors["labels"] = st::make_i64({3, 1}, {-1, 0, 1LL << 40});
  f.tensors["scalar"] = st::make_f32({}, {42.5f});
  f.tensors["empty"] = st::make_f32({0, 3}, {});
  f.tensors["half"] = raw_entry("F16", {5}, 10, 1);
  f.tensors["bf"] = raw_entry("BF16", {2, 2}, 8, 2);
  f.tensors["i32"] = raw_entry("I32", {3}, 12, 3);
  f.tensors["bytes"] = raw_entry("U8", {7}, 7, 4);
  f.tensors["flag"] = raw_entry("BOOL", {2}, 2, 5);
  f.metadata["format"] = "pt";
  f.metadata["note"] = "h\xc3\xa9llo \"quoted\"\n";
  return f;
}

void expect_same(const st::File& a, const st::File& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, e] : a.tensors) {
    SCOPED_TRACE(name);
    auto it = b.tensors.find(name);
    ASSERT_NE(it, b.tensors.end());
    EXPECT_EQ(e.dtype, it->second.dtype);
    EXPECT_EQ(e.shape, it->second.shape);
    EXPECT_EQ(e.data, it->second.data);
  }
}

}  // namespace

using st::Entry;

// ---------------------------------------------------------------------------------------------

TEST(Safetensors, DtypeSize) {
  EXPECT_EQ(st::dtype_size("F32"), 4u);
  EXPECT_EQ(st::dtype_size("F64"), 8u);
  EXPECT_EQ(st::dtype_size("I64"), 8u);
  EXPECT_EQ(st::dtype_size("I32"), 4u);
  EXPECT_EQ(st::dtype_size("F16"), 2u);
  EXPECT_EQ(st::dtype_size("BF16"), 2u);
  EXPECT_EQ(st::dtype_size("U8"), 1u);
  EXPECT_EQ(st::dtype_size("BOOL"), 1u);
  try {
    (void)st::dtype_size("F31");
    ADD_FAILURE() << "no throw";
  } catch (const tally::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("F31"), std::string::npos);
  }
  EXPECT_THROW((void)st::dtype_size("f32"), tally::FormatError);  // case matters
  EXPECT_THROW((void)st::dtype_size(""), tally::FormatError);
}

TEST(Safetensors, TypedViewsAndBuilders) {
  const Entry f = st::make_f32({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(f.dtype, "F32");
  EXPECT_EQ(f.data.size(), 16u);
  EXPECT_EQ(st::as_f32(f), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(st::as_f64(st::make_f64({2}, {0.5, -7})), (std::vector<double>{0.5, -7}));
  EXPECT_EQ(st::as_i64(st::make_i64({}, {-9})), (std::vector<std::int64_t>{-9}));
  EXPECT_TRUE(st::as_f32(st::make_f32({3, 0}, {})).empty());

  EXPECT_THROW((void)st::make_f32({2, 3}, {1, 2}), tally::ShapeError);
  EXPECT_THROW((void)st::make_i64({-1}, {}), tally::ShapeError);
  EXPECT_THROW((void)st::as_f64(f), tally::FormatError);  // no silent conversion
  EXPECT_THROW((void)st::as_i64(f), tally::FormatError);
  Entry broken = f;
  broken.data.pop_back();
  EXPECT_THROW((void)st::as_f32(broken), tally::FormatError);
}

TEST(Safetensors, RoundTripFileAndMemory) {
  TempDir dir;
  const st::File f = sample_file();
  const fs::path p = dir.path() / "model.safetensors";
  st::write(p.string(), f);
  EXPECT_EQ(listing(dir.path()), std::vector<std::string>{"model.safetensors"});

  expect_same(f, st::read(p.string()));

  const Bytes b = read_bytes(p);
  ASSERT_GE(b.size(), 8u);
  std::uint64_t n = 0;
  std::memcpy(&n, b.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "header must be padded to a multiple of 8";
  const char last = static_cast<char>(b[8 + n - 1]);
  EXPECT_TRUE(last == ' ' || last == '}') << "header must end in '}' or padding";
  expect_same(f, st::parse(b.data(), b.size(), p.string()));

  // Values survive exactly.
  const st::File g = st::read(p.string());
  EXPECT_EQ(st::as_f32(g.tensors.at("scalar")), std::vector<float>{42.5f});
  EXPECT_TRUE(g.tensors.at("scalar").shape.empty());
  EXPECT_EQ(g.tensors.at("empty").shape, (std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(g.tensors.at("empty").data.empty());
  EXPECT_EQ(st::as_i64(g.tensors.at("labels"))[2], 1LL << 40);

  // Deterministic: writing what was read gives the same bytes.
  const fs::path p2 = dir.path() / "again.safetensors";
  st::write(p2.string(), g);
  EXPECT_EQ(read_bytes(p2), b);

  // Overwriting an existing file replaces it.
  st::File small;
  small.tensors["x"] = st::make_f32({1}, {3.f});
  st::write(p.string(), small);
  expect_same(small, st::read(p.string()));
  EXPECT_EQ(listing(dir.path()), (std::vector<std::string>{"again.safetensors", "model.safetensors"}));
}

TEST(Safetensors, EmptyFile) {
  TempDir dir;
  const fs::path p = dir.path() / "empty.safetensors";
  st::write(p.string(), st::File{});
  const Bytes b = read_bytes(p);
  Bytes expected;
  append_u64(expected, 8);
  const Bytes h = to_bytes("{}      ");
  expected.insert(expected.end(), h.begin(), h.end());
  EXPECT_EQ(b, expected);
  const st::File g = st::read(p.string());
  EXPECT_TRUE(g.tensors.empty());
  EXPECT_TRUE(g.metadata.empty());
}

TEST(Safetensors, ExactByteLayout) {
  st::File f;
  f.tensors["b"] = st::make_i64({}, {7});
  f.tensors["a"] = st::make_f32({2}, {1.0f, -2.0f});
  f.metadata["k"] = "v";

  // Hand-built: 132 bytes of JSON + 4 spaces = 136 = 0x88.
  const std::string header =
      "{\"__metadata__\":{\"k\":\"v\"},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]}}"
      "    ";
  ASSERT_EQ(header.size(), 136u);
  Bytes expected = {std::byte{0x88}, std::byte{0}, std::byte{0}, std::byte{0},
                    std::byte{0},    std::byte{0}, std::byte{0}, std::byte{0}};
  const Bytes h = to_bytes(header);
  expected.insert(expected.end(), h.begin(), h.end());
  const unsigned char data[] = {
      0x00, 0x00, 0x80, 0x3f,                          // 1.0f
      0x00, 0x00, 0x00, 0xc0,                          // -2.0f
      0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // int64 7
  };
  for (unsigned char c : data) expected.push_back(static_cast<std::byte>(c));

  TempDir dir;
  const fs::path p = dir.path() / "tiny.safetensors";
  st::write(p.string(), f);
  EXPECT_EQ(read_bytes(p), expected);

  const st::File g = st::parse(expected.data(), expected.size(), "tiny");
  expect_same(f, g);
}

TEST(Safetensors, AcceptsForeignButValidLayouts) {
  // Reference-style files may order entries differently, omit padding, or use null metadata.
  const std::string h =
      "{\"z\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
      "\"a\":{\"shape\":[1],\"data_offsets\":[2,3],\"dtype\":\"U8\"},\"__metadata__\":null}";
  const Bytes b = image(h, 3);
  const st::File f = st::parse(b.data(), b.size(), "foreign");
  EXPECT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors.at("a").data.size(), 1u);
  EXPECT_TRUE(f.metadata.empty());
  // Zero-size tensors sit anywhere on the offset line; whitespace around the JSON is fine.
  const std::string h2 =
      "  {\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
      "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}\n\t ";
  const Bytes b2 = image(h2, 4);
  EXPECT_EQ(st::parse(b2.data(), b2.size(), "ws").tensors.size(), 2u);
}

TEST(Safetensors, MalformedInputsThrowInformativeFormatErrors) {
  const auto ok_entry = [](const std::string& offsets) {
    return "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":" + offsets + "}";
  };

  // Too short for the length prefix.
  expect_format_error(Bytes{}, "file of 0 bytes");
  expect_format_error(Bytes(7, std::byte{0}), "file of 7 bytes");
  // Header length past the end of the file / absurd.
  expect_format_error(image("{}", 0, 1000), "only 2 bytes follow");
  expect_format_error(image("{}", 0, 200'000'000), "absurdly large");
  expect_format_error(image("{}", 0, ~0ULL), "absurdly large");
  expect_format_error(image("", 0), "header length is 0");
  // Not JSON / not UTF-8 / not an object / too deep / duplicate keys.
  expect_format_error(image("{\"a\":", 0), "not valid UTF-8 JSON");
  expect_format_error(image("{\"\xff\xfe\":{}}", 0), "not valid UTF-8 JSON");
  expect_format_error(image("{} x", 0), "not valid UTF-8 JSON");
  expect_format_error(image("[1,2]", 0), "found array");
  expect_format_error(image("\"str\"", 0), "found string");
  expect_format_error(image(std::string(100, '[') + std::string(100, ']'), 0), "nested deeper");
  expect_format_error(image("{\"a\":" + ok_entry("[0,8]") + ",\"a\":" + ok_entry("[0,8]") + "}", 8),
                      "duplicate key \"a\"");
  expect_format_error(
      image("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
            8),
      "duplicate key \"dtype\"");
  // Entry not an object / missing or ill-typed fields.
  expect_format_error(image("{\"w\":5}", 0), "tensor \"w\": expected an object");
  expect_format_error(image("{\"w\":[]}", 0), "found array");
  expect_format_error(image("{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
                      "missing \"dtype\"");
  expect_format_error(image("{\"w\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
                      "\"dtype\" to be a string, found number");
  expect_format_error(image("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8),
                      "missing \"shape\"");
  expect_format_error(image("{\"w\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8),
                      "\"shape\" to be an array, found number");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8),
      "non-negative integers, found number 2.0");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8),
      "found string");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[18446744073709551615],\"data_offsets\":[0,8]}}",
            8),
      "does not fit in int64");
  expect_format_error(image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8),
                      "missing \"data_offsets\"");
  expect_format_error(image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8]}}", 8),
                      "[begin, end], found [8]");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,9]}}", 9),
      "[begin, end], found [0,8,9]");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":{\"a\":1}}}", 8),
      "[begin, end]");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,\"8\"]}}", 8),
      "found string");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8),
      "non-negative data offsets, found -8");
  // Unknown dtype.
  expect_format_error(image("{\"w\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8),
                      "unknown dtype \"F31\"");
  // Negative dims.
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,8]}}", 8),
      "non-negative dimensions, found -1");
  // begin > end.
  expect_format_error(image("{\"w\":" + ok_entry("[8,0]") + "}", 8), "begin > end");
  // end past the data section.
  expect_format_error(image("{\"w\":" + ok_entry("[0,8]") + "}", 7),
                      "end past the data section of 7 bytes");
  expect_format_error(image("{\"w\":" + ok_entry("[0,18446744073709551615]") + "}", 8),
                      "end past the data section");
  // Byte size != product(shape) * dtype_size.
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8),
      "tensor \"w\" (F32, shape [3]) needs 12 bytes, but data_offsets [0, 8] span 8 bytes");
  expect_format_error(
      image("{\"w\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,8]}}",
            8),
      "byte count overflows");
  // Overlapping tensors, holes and trailing bytes.
  expect_format_error(
      image("{\"a\":" + ok_entry("[0,8]") + ",\"b\":" + ok_entry("[4,12]") + "}", 12),
      "tensors \"a\" (data_offsets [0, 8]) and \"b\" (data_offsets [4, 12]) overlap");
  expect_format_error(
      image("{\"a\":" + ok_entry("[0,8]") + ",\"b\":" + ok_entry("[0,8]") + "}", 8), "overlap");
  expect_format_error(
      image("{\"a\":" + ok_entry("[0,8]") + ",\"b\":" + ok_entry("[12,20]") + "}", 20),
      "found a hole");
  expect_format_error(image("{\"a\":" + ok_entry("[0,8]") + "}", 9), "trailing bytes");
  // Metadata.
  expect_format_error(image("{\"__metadata__\":[\"a\"]}", 0),
                      "\"__metadata__\" to be an object of strings, found array");
  expect_format_error(image("{\"__metadata__\":{\"stride\":2}}", 0),
                      "value for key \"stride\" must be a string, found number 2");
  expect_format_error(image("{\"__metadata__\":{\"o\":{}}}", 0), "found object");
}

TEST(Safetensors, TruncationAtEveryLengthThrows) {
  st::File f;
  f.tensors["a"] = st::make_f32({2, 2}, {1, 2, 3, 4});
  f.tensors["b"] = st::make_i64({3}, {5, 6, 7});
  f.tensors["c"] = st::make_f32({}, {9});
  f.metadata["m"] = "x";
  TempDir dir;
  const fs::path p = dir.path() / "full.safetensors";
  st::write(p.string(), f);
  const Bytes full = read_bytes(p);
  ASSERT_GT(full.size(), 60u);

  const fs::path cut = dir.path() / "cut.safetensors";
  for (std::size_t len = 0; len < full.size(); ++len) {
    SCOPED_TRACE("length " + std::to_string(len));
    const Bytes part(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(len));
    auto exact = std::make_unique<std::byte[]>(len == 0 ? 1 : len);
    if (len) std::memcpy(exact.get(), part.data(), len);
    EXPECT_THROW((void)st::parse(exact.get(), len, "cut"), tally::FormatError);
    write_bytes(cut, part);
    try {
      (void)st::read(cut.string());
      ADD_FAILURE() << "read succeeded";
    } catch (const tally::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(cut.string()), std::string::npos) << e.what();
    }
  }
  // Extra bytes at the end are rejected too.
  Bytes longer = full;
  longer.push_back(std::byte{0});
  EXPECT_THROW((void)st::parse(longer.data(), longer.size(), "long"), tally::FormatError);
  expect_same(f, st::parse(full.data(), full.size(), "full"));
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  const st::File f = sample_file();
  TempDir dir;
  const fs::path p = dir.path() / "f.safetensors";
  st::write(p.string(), f);
  const Bytes full = read_bytes(p);
  std::mt19937 rng(1234);
  int failures = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    Bytes b = full;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      // Mostly hit the prefix and header, where the structure lives.
      const std::size_t limit = (rng() % 4 == 0) ? b.size() : std::min<std::size_t>(b.size(), 400);
      b[rng() % limit] = static_cast<std::byte>(rng() & 0xff);
    }
    auto exact = std::make_unique<std::byte[]>(b.size());
    std::memcpy(exact.get(), b.data(), b.size());
    try {
      (void)st::parse(exact.get(), b.size(), "fuzz");
    } catch (const tally::FormatError& e) {
      ++failures;
      EXPECT_NE(std::string(e.what()).find("fuzz"), std::string::npos);
    }
  }
  EXPECT_GT(failures, 100);
}

TEST(Safetensors, ReadErrorsNameThePath) {
  TempDir dir;
  const std::string missing = (dir.path() / "nope.safetensors").string();
  try {
    (void)st::read(missing);
    ADD_FAILURE() << "no throw";
  } catch (const tally::Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  try {
    (void)st::read(dir.path().string());
    ADD_FAILURE() << "no throw";
  } catch (const tally::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, WriteRejectsInconsistentEntries) {
  TempDir dir;
  const fs::path p = dir.path() / "w.safetensors";
  st::File good;
  good.tensors["x"] = st::make_f32({2}, {1, 2});
  st::write(p.string(), good);
  const Bytes before = read_bytes(p);

  auto expect_rejected = [&](const st::File& bad, const std::string& needle) {
    SCOPED_TRACE(needle);
    try {
      st::write(p.string(), bad);
      ADD_FAILURE() << "write succeeded";
    } catch (const tally::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(read_bytes(p), before) << "old file must be intact";
    EXPECT_EQ(listing(dir.path()), std::vector<std::string>{"w.safetensors"});
  };
  st::File bad = good;
  bad.tensors["x"].data.pop_back();
  expect_rejected(bad, "needs 8 bytes, found 7");
  bad = good;
  bad.tensors["x"].dtype = "F99";
  expect_rejected(bad, "unknown dtype");
  bad = good;
  bad.tensors["x"].shape = {-2};
  expect_rejected(bad, "invalid shape [-2]");
  bad = good;
  bad.tensors["__metadata__"] = st::make_f32({}, {1});
  expect_rejected(bad, "reserved");
  bad = good;
  bad.metadata["k"] = "\xff";
  expect_rejected(bad, "not valid UTF-8");
}

TEST(Safetensors, AtomicWriteLeavesNoTempFilesBehind) {
  TempDir dir;
  const fs::path p = dir.path() / "ckpt.safetensors";
  const st::File f = sample_file();
  st::write(p.string(), f);
  const Bytes before = read_bytes(p);

  // Non-existent directory: Error naming the path, nothing created anywhere.
  const fs::path missing_dir = dir.path() / "no_such_dir";
  const std::string target = (missing_dir / "ckpt.safetensors").string();
  try {
    st::write(target, f);
    ADD_FAILURE() << "write succeeded";
  } catch (const tally::Error& e) {
    EXPECT_NE(std::string(e.what()).find(target), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(missing_dir));
  EXPECT_EQ(listing(dir.path()), std::vector<std::string>{"ckpt.safetensors"});
  EXPECT_EQ(read_bytes(p), before);

  // Failure after the temporary was written (rename onto a non-empty directory): the
  // temporary is removed and the directory in the way is untouched.
  const fs::path blocker = dir.path() / "blocker";
  fs::create_directories(blocker / "inside");
  try {
    st::write(blocker.string(), f);
    ADD_FAILURE() << "write succeeded";
  } catch (const tally::Error& e) {
    EXPECT_NE(std::string(e.what()).find(blocker.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("renaming"), std::string::npos) << e.what();
  }
  EXPECT_EQ(listing(dir.path()), (std::vector<std::string>{"blocker", "ckpt.safetensors"}));
  EXPECT_TRUE(fs::is_directory(blocker / "inside"));
  EXPECT_EQ(read_bytes(p), before);
}

// A write whose temporary file cannot be created is a clear error naming the file, and the file
// already there is left as it was. (A read-only folder would prove nothing: tests run as root, which
// ignores permission bits. A folder standing where the writer puts its temporary file,
// "<path>.tmp.<pid>", fails the open for root too: EISDIR.)
TEST(Safetensors, UncreatableTemporaryFileIsAClearErrorAndChangesNothing) {
  TempDir dir;
  const fs::path p = dir.path() / "x.safetensors";
  st::File f;
  f.tensors["x"] = st::make_f32({1}, {1});
  st::write(p.string(), f);
  const Bytes before = read_bytes(p);
  const fs::path blocker = p.string() + ".tmp." + std::to_string(static_cast<long>(::getpid()));
  fs::create_directories(blocker);
  try {
    st::write(p.string(), st::File{});
    ADD_FAILURE() << "write succeeded";
  } catch (const tally::Error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_directory(blocker)) << "the writer removes only a temporary file of its own";
  fs::remove(blocker);
  EXPECT_EQ(listing(dir.path()), std::vector<std::string>{"x.safetensors"});
  EXPECT_EQ(read_bytes(p), before);
}
