// mbp/checkpoint.cpp — training-state checkpoints; see mbp/checkpoint.h.
#include "mbp/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "nn/state_dict.h"

namespace tally::mbp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kFormat = "tally-training-state";
constexpr int kVersion = 1;
constexpr const char* kManifest = "state.json";
constexpr const char* kTensors = "state.safetensors";
constexpr const char* kPrefix = "checkpoint-";

std::uint32_t crc32_of(std::span<const std::byte> bytes) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  std::size_t n = bytes.size();
  while (n > 0) {  // zlib takes a uInt length
    const uInt chunk = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// Writes `bytes` to `path` and fsyncs it; tally::Error naming the path on failure.
void write_durably(const fs::path& path, std::span<const std::byte> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) throw Error(fmt::format("checkpoint: cannot create '{}': {}", path.string(), std::strerror(errno)));
  try {
    write_all(fd, bytes.data(), bytes.size(), "checkpoint", path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0)
    throw Error(fmt::format("checkpoint: cannot write '{}': fsync or close failed: {}", path.string(),
                            std::strerror(errno)));
}

std::vector<std::byte> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError(fmt::format("checkpoint: cannot read '{}': {}", path.string(), std::strerror(errno)));
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw FormatError(fmt::format("checkpoint: cannot read '{}'", path.string()));
  std::vector<std::byte> out(raw.size());
  if (!raw.empty()) std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

// "checkpoint-<digits>" -> the step; anything else -> nullopt.
std::optional<std::int64_t> step_of(const std::string& name) {
  const std::string prefix = kPrefix;
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 18) return std::nullopt;
  std::int64_t step = 0;
  for (std::size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// A file name kept in a checkpoint: a plain name, not one of the checkpoint's own.
bool plain_file_name(const std::string& name) {
  if (name.empty() || name.size() > 255 || name == "." || name == ".." || name == kManifest || name == kTensors)
    return false;
  return std::none_of(name.begin(), name.end(), [](char c) { return c == '/' || c == '\0'; });
}

json file_record(std::span<const std::byte> bytes) {
  return json{{"bytes", bytes.size()}, {"crc32", crc32_of(bytes)}};
}

// The manifest's field `key` of `obj`, checked to be of the kind `is`; FormatError otherwise.
template <class Check>
const json& field(const json& obj, const char* key, Check is, const char* expected, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end())
    throw FormatError(fmt::format("{}/{}: expected a field \"{}\" ({}), found none", where, kManifest, key, expected));
  if (!is(*it))
    throw FormatError(fmt::format("{}/{}: expected \"{}\" to be {}, found {}", where, kManifest, key, expected,
                                  it->dump().substr(0, 80)));
  return *it;
}

bool is_count(const json& j) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX);
  return j.is_number_integer() && j.get<std::int64_t>() >= 0;
}

// Checks `bytes` against the manifest's record {"bytes", "crc32"} of file `name`.
void check_file(const json& record, const std::string& name, std::span<const std::byte> bytes, const std::string& where) {
  const std::string what = fmt::format("files[\"{}\"]", name);
  if (!record.is_object())
    throw FormatError(fmt::format("{}/{}: expected {} to be an object, found {}", where, kManifest, what,
                                  record.dump().substr(0, 80)));
  const auto size = field(record, "bytes", is_count, "a byte count", where).get<std::uint64_t>();
  const auto crc = field(record, "crc32", is_count, "a CRC-32", where).get<std::uint64_t>();
  if (size != bytes.size())
    throw FormatError(fmt::format("{}/{}: expected {} bytes (as state.json records), found {} — the file is "
                                  "truncated or was changed", where, name, size, bytes.size()));
  if (crc != crc32_of(bytes))
    throw FormatError(fmt::format("{}/{}: expected CRC-32 {:08x} (as state.json records), found {:08x} — the file "
                                  "is damaged", where, name, crc, crc32_of(bytes)));
}

}  // namespace

fs::path save_training_state(const fs::path& run_dir, const nn::Module& model, const optim::Optimizer& optimizer,
                             const TrainingState& state, const std::function<void()>& after_tensors) {
  json caller;
  try {
    caller = json::parse(state.state);
  } catch (const json::exception& e) {
    throw Error(fmt::format("save_training_state: the caller's state is not JSON: {}", e.what()));
  }
  if (!caller.is_object()) throw Error("save_training_state: the caller's state must be a JSON object");
  for (const auto& [name, text] : state.files)
    if (!plain_file_name(name))
      throw Error(fmt::format("save_training_state: '{}' cannot be kept in a checkpoint (expected a plain file name "
                              "other than {} and {})", name, kManifest, kTensors));
  if (state.step < 0) throw Error(fmt::format("save_training_state: expected a step >= 0, found {}", state.step));

  safetensors::File tensors;
  for (const auto& [name, t] : nn::state_dict(model)) tensors.tensors.emplace("model." + name, nn::to_entry(name, t));
  for (const auto& [name, t] : optimizer.named_state())
    tensors.tensors.emplace("optimizer." + name, nn::to_entry(name, t));

  const std::string name = fmt::format("{}{}", kPrefix, state.step);
  const fs::path tmp = run_dir / fmt::format(".{}.tmp", name), final_dir = run_dir / name;
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) && ec)
    throw Error(fmt::format("checkpoint: cannot create '{}': {}", tmp.string(), ec.message()));

  safetensors::write((tmp / kTensors).string(), tensors);
  const std::vector<std::byte> tensor_bytes = read_bytes(tmp / kTensors);  // what is on disk is what is checked
  if (after_tensors) after_tensors();
  json files = json::object();
  files[kTensors] = file_record(tensor_bytes);
  for (const auto& [file, text] : state.files) {
    write_durably(tmp / file, as_bytes(text));
    files[file] = file_record(as_bytes(text));
  }
  json manifest = {{"format", kFormat},   {"version", kVersion},
                   {"step", state.step},  {"optimizer", {{"name", optimizer.name()}, {"steps", optimizer.steps()}}},
                   {"files", files},      {"state", caller}};
  write_durably(tmp / kManifest, as_bytes(manifest.dump(1) + "\n"));
  sync_folder(tmp);

  fs::remove_all(final_dir, ec);  // a checkpoint of this step from an earlier, abandoned attempt
  fs::rename(tmp, final_dir, ec);
  if (ec) throw Error(fmt::format("checkpoint: cannot rename '{}' to '{}': {}", tmp.string(), final_dir.string(), ec.message()));
  sync_folder(run_dir);
  // Older checkpoints, now that this one is complete, and the leftovers of interrupted saves.
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string other = entry.path().filename().string();
    const bool leftover = other.rfind(std::string(".") + kPrefix, 0) == 0 && other.ends_with(".tmp");
    if ((other != name && step_of(other)) || leftover) fs::remove_all(entry.path(), ec);
  }
  return final_dir;
}

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec))
    throw Error(fmt::format("'{}' is not a folder (expected a run folder with checkpoint-<step>/ in it)",
                            run_dir.string()));
  // The newest folder with a manifest (tally writes it last, into a folder renamed into place when
  // complete): a newer one without it (an empty checkpoint-99/ made by hand, a copy cut short) does
  // not hide it. With no manifest anywhere, the newest, whose reading says what it lacks.
  std::optional<std::int64_t> newest, newest_complete;
  for (const auto& entry : fs::directory_iterator(run_dir)) {
    const auto step = step_of(entry.path().filename().string());
    if (!step || !entry.is_directory()) continue;
    if (!newest || *step > *newest) newest = step;
    if (fs::exists(entry.path() / kManifest, ec) && (!newest_complete || *step > *newest_complete))
      newest_complete = step;
  }
  const std::optional<std::int64_t> chosen = newest_complete ? newest_complete : newest;
  if (!chosen) return std::nullopt;
  return run_dir / fmt::format("{}{}", kPrefix, *chosen);
}

namespace {

struct Manifest {
  TrainingState state;
  std::string optimizer;
  std::int64_t optimizer_steps = 0;
  json records;  // "files"
};

Manifest parse_manifest(const std::string& manifest_text, const std::string& where) {
  json m;
  try {
    m = json::parse(manifest_text);
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}/{}: expected JSON, found a parse error: {}", where, kManifest, e.what()));
  }
  if (!m.is_object())
    throw FormatError(fmt::format("{}/{}: expected a JSON object, found {}", where, kManifest, m.type_name()));
  const auto& format = field(m, "format", [](const json& j) { return j.is_string(); }, "a string", where);
  if (format != kFormat)
    throw FormatError(fmt::format("{}/{}: expected format \"{}\", found {}", where, kManifest, kFormat, format.dump()));
  const auto& version = field(m, "version", [](const json& j) { return j.is_number_integer(); }, "an integer", where);
  if (version != kVersion)
    throw FormatError(fmt::format("{}/{}: expected version {} (this build's), found {}", where, kManifest, kVersion,
                                  version.dump()));
  Manifest c;
  c.state.step = field(m, "step", is_count, "a step count >= 0", where).get<std::int64_t>();
  const auto& opt = field(m, "optimizer", [](const json& j) { return j.is_object(); }, "an object", where);
  c.optimizer = field(opt, "name", [](const json& j) { return j.is_string(); }, "a string", where).get<std::string>();
  c.optimizer_steps = field(opt, "steps", is_count, "a step count >= 0", where).get<std::int64_t>();
  c.state.state = field(m, "state", [](const json& j) { return j.is_object(); }, "an object", where).dump();
  c.records = field(m, "files", [](const json& j) { return j.is_object(); }, "an object", where);
  if (!c.records.contains(kTensors))
    throw FormatError(fmt::format("{}/{}: expected files[\"{}\"], found none", where, kManifest, kTensors));
  return c;
}

std::string read_text(const fs::path& path) {
  const std::vector<std::byte> bytes = read_bytes(path);
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

}  // namespace

TrainingState peek_training_state(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / kManifest, ec))
    throw FormatError(fmt::format("{}/{}: expected the checkpoint's manifest, found no such file (an incomplete "
                                  "checkpoint?)", dir.string(), kManifest));
  return parse_manifest(read_text(dir / kManifest), dir.string()).state;
}

namespace {

// The checks behind a parsed manifest: every file it records against its bytes (the tensor file's,
// and the others' by name from `files`), then the tensors parsed.
CheckpointContents check_contents(Manifest m, std::span<const std::byte> tensor_bytes,
                                  const std::map<std::string, std::string>& files, const std::string& where) {
  CheckpointContents c;
  c.state = std::move(m.state);
  c.optimizer = std::move(m.optimizer);
  c.optimizer_steps = m.optimizer_steps;
  for (const auto& [name, record] : m.records.items()) {
    if (name == kTensors) {
      check_file(record, name, tensor_bytes, where);
      continue;
    }
    if (!plain_file_name(name))
      throw FormatError(fmt::format("{}/{}: expected plain file names in \"files\", found \"{}\"", where, kManifest, name));
    const auto it = files.find(name);
    if (it == files.end()) throw FormatError(fmt::format("{}/{}: expected the file, found none", where, name));
    check_file(record, name, as_bytes(it->second), where);
    c.state.files[name] = it->second;
  }
  c.tensors = safetensors::parse(tensor_bytes.data(), tensor_bytes.size(), where + "/" + kTensors);
  return c;
}

}  // namespace

CheckpointContents parse_checkpoint(const std::string& manifest_text, std::span<const std::byte> tensor_bytes,
                                    const std::map<std::string, std::string>& files, const std::string& where) {
  return check_contents(parse_manifest(manifest_text, where), tensor_bytes, files, where);
}

TrainingState load_training_state(const fs::path& dir, nn::Module& model, optim::Optimizer& optimizer) {
  const std::string where = dir.string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(fmt::format("checkpoint '{}': no such folder", where));
  if (!fs::exists(dir / kManifest, ec))
    throw FormatError(fmt::format("{}/{}: expected the checkpoint's manifest, found no such file (an incomplete "
                                  "checkpoint?)", where, kManifest));
  Manifest m = parse_manifest(read_text(dir / kManifest), where);
  // The other files the manifest lists (check_contents names one that is missing or wrong).
  std::map<std::string, std::string> files;
  for (const auto& [name, record] : m.records.items())
    if (name != kTensors && plain_file_name(name) && fs::is_regular_file(dir / name, ec))
      files[name] = read_text(dir / name);
  if (!fs::exists(dir / kTensors, ec))
    throw FormatError(fmt::format("{}/{}: expected the checkpoint's tensors, found no such file", where, kTensors));
  const std::vector<std::byte> tensor_bytes = read_bytes(dir / kTensors);
  CheckpointContents c = check_contents(std::move(m), tensor_bytes, files, where);
  const fs::path folder = dir.has_filename() ? dir : dir.parent_path();  // "checkpoint-12/" too
  const auto named_step = step_of(folder.filename().string());
  if (named_step && *named_step != c.state.step)
    throw FormatError(fmt::format("{}/{}: expected step {} (the folder's name), found {}", where, kManifest, *named_step,
                                  c.state.step));

  if (c.optimizer != optimizer.name())
    throw Error(fmt::format("{}: expected a checkpoint of optimizer {} (this run's), found {}", where, optimizer.name(),
                            c.optimizer));
  std::vector<std::pair<std::string, Tensor>> expected;
  for (auto& [name, t] : nn::state_dict(model)) expected.emplace_back("model." + name, t);
  for (const auto& [name, t] : optimizer.named_state()) expected.emplace_back("optimizer." + name, t);
  nn::copy_matching(expected, c.tensors,
                    fmt::format("{}/{} does not match this run's model and optimizer", where, kTensors));
  optimizer.set_steps(c.optimizer_steps);
  return std::move(c.state);
}

}  // namespace tally::mbp
