// core/safetensors.cpp — see core/safetensors.h.
#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <set>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"

namespace tally::safetensors {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; tally assumes a little-endian host");

namespace {

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we (reader and writer).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// Nesting deeper than this is never a safetensors header; refusing it bounds parser work.
constexpr int kMaxJsonDepth = 64;
constexpr std::string_view kMetadataKey = "__metadata__";

struct DtypeInfo {
  std::string_view name;
  std::size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
    {"U16", 2},  {"I16", 2}, {"F16", 2}, {"BF16", 2},    {"U32", 4},
    {"I32", 4},  {"F32", 4}, {"U64", 8}, {"I64", 8},     {"F64", 8},
};

// 0 for an unknown dtype.
std::size_t lookup_dtype(std::string_view dtype) {
  for (const auto& d : kDtypes)
    if (d.name == dtype) return d.size;
  return 0;
}

std::string known_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// A string shown in a message: JSON-escaped and cut short, so that garbage stays readable.
std::string show(const std::string& s) {
  std::string out = json(s).dump(-1, ' ', false, json::error_handler_t::replace);
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out;
}

// product(shape) * elem_size; false if a dim is negative or the result overflows 64 bits.
bool byte_count(const std::vector<std::int64_t>& shape, std::size_t elem_size,
                std::uint64_t& out) {
  std::uint64_t n = elem_size;
  for (std::int64_t d : shape) {
    if (d < 0) return false;
    if (__builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return false;
  }
  out = n;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Header parsing, shared by parse() (memory) and read() (file).

struct Pending {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

struct Header {
  std::vector<Pending> tensors;  // sorted by data offset
  std::map<std::string, std::string> metadata;
};

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw FormatError(fmt::format("safetensors file '{}': {}", source, what));
}

// The 8-byte prefix: returns N after checking it against the total size of the file.
std::uint64_t check_prefix(const unsigned char* prefix, std::uint64_t file_size,
                           const std::string& source) {
  if (file_size < 8)
    fail(source, fmt::format("expected at least 8 bytes (the header length prefix), found a "
                             "file of {} bytes",
                             file_size));
  std::uint64_t n = 0;
  std::memcpy(&n, prefix, 8);
  if (n > kMaxHeaderBytes)
    fail(source, fmt::format("header length prefix is {} bytes, absurdly large (limit {}); "
                             "not a safetensors file?",
                             n, kMaxHeaderBytes));
  if (n > file_size - 8)
    fail(source, fmt::format("header length prefix says {} bytes of JSON, but only {} bytes "
                             "follow the prefix (file truncated?)",
                             n, file_size - 8));
  if (n == 0) fail(source, "header length is 0, expected a JSON object");
  return n;
}

struct JsonProblem {
  std::string what;
};

json parse_json(const char* text, std::size_t n, const std::string& source) {
  // Rejects duplicate keys (nlohmann would silently keep the last) and absurd nesting.
  std::vector<std::set<std::string>> keys;
  auto callback = [&keys](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (depth > kMaxJsonDepth)
      throw JsonProblem{fmt::format("JSON nested deeper than {} levels", kMaxJsonDepth)};
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() &&
            !keys.back().insert(parsed.get_ref<const std::string&>()).second)
          throw JsonProblem{fmt::format("duplicate key {} in a JSON object",
                                        show(parsed.get_ref<const std::string&>()))};
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, text + n, callback, /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const JsonProblem& e) {
    fail(source, fmt::format("header is not a valid safetensors JSON header: {}", e.what));
  } catch (const json::exception& e) {
    fail(source, fmt::format("header ({} bytes) is not valid UTF-8 JSON: {}", n, e.what()));
  }
}

std::int64_t parse_dim(const json& v, const std::string& source, const std::string& name) {
  if (!v.is_number_integer())
    fail(source, fmt::format("tensor {}: expected \"shape\" to hold non-negative integers, "
                             "found {} {}",
                             show(name), v.type_name(), v.dump()));
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail(source, fmt::format("tensor {}: dimension {} does not fit in int64", show(name), u));
    return static_cast<std::int64_t>(u);
  }
  const auto d = v.get<std::int64_t>();
  if (d < 0)
    fail(source, fmt::format("tensor {}: expected non-negative dimensions, found {} in shape {}",
                             show(name), d, v.dump()));
  return d;
}

std::uint64_t parse_offset(const json& v, const std::string& source, const std::string& name) {
  if (!v.is_number_integer())
    fail(source, fmt::format("tensor {}: expected \"data_offsets\" to hold two non-negative "
                             "integers, found {} {}",
                             show(name), v.type_name(), v.dump()));
  if (!v.is_number_unsigned())
    fail(source, fmt::format("tensor {}: expected non-negative data offsets, found {}",
                             show(name), v.dump()));
  return v.get<std::uint64_t>();
}

Pending parse_entry(const std::string& name, const json& v, std::uint64_t data_size,
                    const std::string& source) {
  Pending p;
  p.name = name;
  if (!v.is_object())
    fail(source, fmt::format("tensor {}: expected an object with \"dtype\", \"shape\" and "
                             "\"data_offsets\", found {}",
                             show(name), v.type_name()));

  const auto dt = v.find("dtype");
  if (dt == v.end())
    fail(source, fmt::format("tensor {}: missing \"dtype\" (expected a string such as \"F32\")",
                             show(name)));
  if (!dt->is_string())
    fail(source, fmt::format("tensor {}: expected \"dtype\" to be a string, found {}",
                             show(name), dt->type_name()));
  p.dtype = dt->get<std::string>();
  const std::size_t elem = lookup_dtype(p.dtype);
  if (elem == 0)
    fail(source, fmt::format("tensor {}: unknown dtype {} (expected one of {})", show(name),
                             show(p.dtype), known_dtypes()));

  const auto sh = v.find("shape");
  if (sh == v.end())
    fail(source, fmt::format("tensor {}: missing \"shape\" (expected an array of integers)",
                             show(name)));
  if (!sh->is_array())
    fail(source, fmt::format("tensor {}: expected \"shape\" to be an array, found {}",
                             show(name), sh->type_name()));
  p.shape.reserve(sh->size());
  for (const auto& d : *sh) p.shape.push_back(parse_dim(d, source, name));

  const auto off = v.find("data_offsets");
  if (off == v.end())
    fail(source, fmt::format("tensor {}: missing \"data_offsets\" (expected [begin, end])",
                             show(name)));
  if (!off->is_array() || off->size() != 2)
    fail(source, fmt::format("tensor {}: expected \"data_offsets\" to be an array [begin, end], "
                             "found {}",
                             show(name), off->dump()));
  p.begin = parse_offset((*off)[0], source, name);
  p.end = parse_offset((*off)[1], source, name);
  if (p.begin > p.end)
    fail(source, fmt::format("tensor {}: data_offsets [{}, {}] have begin > end", show(name),
                             p.begin, p.end));
  if (p.end > data_size)
    fail(source, fmt::format("tensor {}: data_offsets [{}, {}] end past the data section of {} "
                             "bytes (file truncated?)",
                             show(name), p.begin, p.end, data_size));

  std::uint64_t expected = 0;
  if (!byte_count(p.shape, elem, expected))
    fail(source, fmt::format("tensor {}: shape {} of {} is too large (byte count overflows)",
                             show(name), shape_str(p.shape), p.dtype));
  if (expected != p.end - p.begin)
    fail(source, fmt::format("tensor {} ({}, shape {}) needs {} bytes, but data_offsets "
                             "[{}, {}] span {} bytes",
                             show(name), p.dtype, shape_str(p.shape), expected, p.begin, p.end,
                             p.end - p.begin));
  return p;
}

Header parse_header(const char* text, std::size_t n, std::uint64_t data_size,
                    const std::string& source) {
  const json j = parse_json(text, n, source);
  if (!j.is_object())
    fail(source, fmt::format("expected the header to be a JSON object, found {}", j.type_name()));

  Header h;
  for (const auto& [key, value] : j.items()) {
    if (key == kMetadataKey) {
      if (value.is_null()) continue;
      if (!value.is_object())
        fail(source, fmt::format("expected \"__metadata__\" to be an object of strings, found {}",
                                 value.type_name()));
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          fail(source, fmt::format("\"__metadata__\" value for key {} must be a string, found "
                                   "{} {}",
                                   show(mk), mv.type_name(), mv.dump()));
        h.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(key, value, data_size, source));
  }

  // The tensors must tile the data section exactly: no overlap, no hole, no trailing bytes.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const Pending& a, const Pending& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t pos = 0;
  const Pending* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.begin < pos)
      fail(source, fmt::format("tensors {} (data_offsets [{}, {}]) and {} (data_offsets [{}, {}]) "
                               "overlap",
                               show(prev->name), prev->begin, prev->end, show(t.name),
                               t.begin, t.end));
    if (t.begin > pos)
      fail(source, fmt::format("expected tensor {} to start at data offset {} (end of the "
                               "previous tensor), found a hole: it starts at {}",
                               show(t.name), pos, t.begin));
    pos = t.end;
    prev = &t;
  }
  if (pos != data_size)
    fail(source, fmt::format("data section has {} bytes but the tensors cover only {} "
                             "(trailing bytes)",
                             data_size, pos));
  return h;
}

// ---------------------------------------------------------------------------------------------
// File helpers.

std::string errno_str(int err) { return std::error_code(err, std::generic_category()).message(); }

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

void read_exact(std::FILE* f, void* dst, std::size_t n, std::uint64_t offset,
                const std::string& path) {
  if (n == 0) return;
  if (fseeko(f, static_cast<off_t>(offset), SEEK_SET) != 0)
    throw Error(fmt::format("safetensors: cannot seek in '{}': {}", path, errno_str(errno)));
  const std::size_t got = std::fread(dst, 1, n, f);
  if (got == n) return;
  if (std::ferror(f))
    throw Error(fmt::format("safetensors: cannot read '{}': {}", path, errno_str(errno)));
  fail(path, fmt::format("unexpected end of file at byte {} (expected {} more bytes; file "
                         "changed while reading?)",
                         offset + got, n - got));
}

// The serialized header (padded) for file; validates every entry.
std::string build_header(const File& file, const std::string& path) {
  std::string h = "{";
  try {
    if (!file.metadata.empty()) {
      h += "\"__metadata__\":";
      h += json(file.metadata).dump();
    }
    std::uint64_t offset = 0;
    for (const auto& [name, e] : file.tensors) {
      if (name == kMetadataKey)
        throw FormatError(fmt::format("safetensors: cannot write '{}': \"__metadata__\" is "
                                      "reserved and cannot name a tensor",
                                      path));
      const std::size_t elem = lookup_dtype(e.dtype);
      if (elem == 0)
        throw FormatError(fmt::format("safetensors: cannot write '{}': tensor {} has unknown "
                                      "dtype {} (expected one of {})",
                                      path, show(name), show(e.dtype), known_dtypes()));
      std::uint64_t expected = 0;
      if (!byte_count(e.shape, elem, expected))
        throw FormatError(fmt::format("safetensors: cannot write '{}': tensor {} has invalid "
                                      "shape {} (negative or overflowing)",
                                      path, show(name), shape_str(e.shape)));
      if (expected != e.data.size())
        throw FormatError(fmt::format("safetensors: cannot write '{}': tensor {} ({} {}) needs "
                                      "{} bytes, found {}",
                                      path, show(name), e.dtype, shape_str(e.shape), expected,
                                      e.data.size()));
      if (h.size() > 1) h += ',';
      h += json(name).dump();
      h += fmt::format(":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}", e.dtype,
                       fmt::join(e.shape, ","), offset, offset + expected);
      offset += expected;
    }
  } catch (const json::exception& e) {  // invalid UTF-8 in a name or metadata string
    throw FormatError(fmt::format("safetensors: cannot write '{}': a tensor name or metadata "
                                  "string is not valid UTF-8 ({})",
                                  path, e.what()));
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > kMaxHeaderBytes)
    throw FormatError(fmt::format("safetensors: cannot write '{}': header of {} bytes exceeds "
                                  "the {} byte limit readers accept",
                                  path, h.size(), kMaxHeaderBytes));
  return h;
}

template <class T>
std::vector<T> typed_view(const Entry& e, std::string_view want) {
  if (e.dtype != want)
    throw FormatError(fmt::format("safetensors: expected a {} tensor, found dtype {} (shape {})",
                                  want, show(e.dtype), shape_str(e.shape)));
  std::uint64_t expected = 0;
  if (!byte_count(e.shape, sizeof(T), expected) || expected != e.data.size())
    throw FormatError(fmt::format("safetensors: {} tensor of shape {} should hold {} bytes, "
                                  "found {}",
                                  want, shape_str(e.shape), expected, e.data.size()));
  std::vector<T> out(e.data.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), e.data.data(), e.data.size());
  return out;
}

template <class T>
Entry typed_entry(std::vector<std::int64_t> shape, const std::vector<T>& v, const char* dtype) {
  std::uint64_t bytes = 0;
  if (!byte_count(shape, sizeof(T), bytes))
    throw ShapeError(fmt::format("safetensors: cannot make a {} entry: invalid shape {} "
                                 "(negative or overflowing)",
                                 dtype, shape_str(shape)));
  if (bytes != v.size() * sizeof(T))
    throw ShapeError(fmt::format("safetensors: cannot make a {} entry: shape {} holds {} "
                                 "elements, found {} values",
                                 dtype, shape_str(shape), bytes / sizeof(T), v.size()));
  Entry e;
  e.dtype = dtype;
  e.shape = std::move(shape);
  e.data.resize(bytes);
  if (bytes != 0) std::memcpy(e.data.data(), v.data(), bytes);
  return e;
}

}  // namespace

std::size_t dtype_size(const std::string& dtype) {
  const std::size_t s = lookup_dtype(dtype);
  if (s == 0)
    throw FormatError(fmt::format("safetensors: unknown dtype {} (expected one of {})",
                                  show(dtype), known_dtypes()));
  return s;
}

File parse(const std::byte* data, std::size_t size, const std::string& source_name) {
  if (data == nullptr && size != 0)
    throw Error(fmt::format("safetensors::parse('{}'): null data with size {}", source_name, size));
  const auto* bytes = reinterpret_cast<const unsigned char*>(data);
  const std::uint64_t n = check_prefix(bytes, size, source_name);
  const std::uint64_t data_size = size - 8 - n;
  Header h = parse_header(reinterpret_cast<const char*>(bytes + 8), n, data_size, source_name);

  File f;
  f.metadata = std::move(h.metadata);
  const std::byte* base = data + 8 + n;
  for (auto& t : h.tensors) {
    Entry e;
    e.dtype = std::move(t.dtype);
    e.shape = std::move(t.shape);
    e.data.assign(base + t.begin, base + t.end);
    f.tensors.emplace(std::move(t.name), std::move(e));
  }
  return f;
}

File read(const std::string& path) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f)
    throw Error(fmt::format("safetensors: cannot open '{}' for reading: {}", path,
                            errno_str(errno)));
  struct stat st {};
  if (::fstat(fileno(f.get()), &st) != 0)
    throw Error(fmt::format("safetensors: cannot stat '{}': {}", path, errno_str(errno)));
  if (!S_ISREG(st.st_mode))
    throw Error(fmt::format("safetensors: cannot read '{}': not a regular file", path));
  const auto file_size = static_cast<std::uint64_t>(st.st_size);

  unsigned char prefix[8] = {};
  if (file_size >= 8) read_exact(f.get(), prefix, 8, 0, path);
  const std::uint64_t n = check_prefix(prefix, file_size, path);
  std::string text(n, '\0');
  read_exact(f.get(), text.data(), n, 8, path);
  Header h = parse_header(text.data(), n, file_size - 8 - n, path);
  text = std::string();

  File out;
  out.metadata = std::move(h.metadata);
  for (auto& t : h.tensors) {  // sorted by offset: reads go forward through the file
    Entry e;
    e.dtype = std::move(t.dtype);
    e.shape = std::move(t.shape);
    e.data.resize(t.end - t.begin);
    read_exact(f.get(), e.data.data(), e.data.size(), 8 + n + t.begin, path);
    out.tensors.emplace(std::move(t.name), std::move(e));
  }
  return out;
}

void write(const std::string& path, const File& file) {
  const std::string header = build_header(file, path);
  const std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(::getpid()));

  struct TempGuard {
    int fd = -1;
    const std::string& tmp;
    bool committed = false;
    ~TempGuard() {
      if (fd >= 0) ::close(fd);
      if (!committed) ::unlink(tmp.c_str());
    }
  };

  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
  if (fd < 0)
    throw Error(fmt::format("safetensors: cannot write '{}': cannot create temporary file "
                            "'{}': {}",
                            path, tmp, errno_str(errno)));
  TempGuard guard{fd, tmp};

  const std::uint64_t n = header.size();
  unsigned char prefix[8];
  std::memcpy(prefix, &n, 8);
  write_all(fd, prefix, 8, "safetensors", tmp);
  write_all(fd, header.data(), header.size(), "safetensors", tmp);
  for (const auto& [name, e] : file.tensors) write_all(fd, e.data.data(), e.data.size(), "safetensors", tmp);

  if (::fsync(fd) != 0)
    throw Error(fmt::format("safetensors: cannot write '{}': fsync of '{}' failed: {}", path, tmp,
                            errno_str(errno)));
  guard.fd = -1;
  if (::close(fd) != 0)
    throw Error(fmt::format("safetensors: cannot write '{}': closing '{}' failed: {}", path, tmp,
                            errno_str(errno)));

  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    throw Error(fmt::format("safetensors: cannot write '{}': renaming '{}' over it failed: {}",
                            path, tmp, ec.message()));
  guard.committed = true;

  sync_folder(std::filesystem::path(path).parent_path());  // the rename itself durable
}

std::vector<float> as_f32(const Entry& entry) { return typed_view<float>(entry, "F32"); }
std::vector<double> as_f64(const Entry& entry) { return typed_view<double>(entry, "F64"); }
std::vector<std::int64_t> as_i64(const Entry& entry) {
  return typed_view<std::int64_t>(entry, "I64");
}

std::vector<std::uint16_t> as_bf16_bits(const Entry& entry) { return typed_view<std::uint16_t>(entry, "BF16"); }

Entry make_f32(std::vector<std::int64_t> shape, const std::vector<float>& v) {
  return typed_entry(std::move(shape), v, "F32");
}
Entry make_f64(std::vector<std::int64_t> shape, const std::vector<double>& v) {
  return typed_entry(std::move(shape), v, "F64");
}
Entry make_i64(std::vector<std::int64_t> shape, const std::vector<std::int64_t>& v) {
  return typed_entry(std::move(shape), v, "I64");
}
Entry make_bf16(std::vector<std::int64_t> shape, const std::vector<std::uint16_t>& bits) {
  return typed_entry(std::move(shape), bits, "BF16");
}

}  // namespace tally::safetensors
