// core/conv_tuning.cpp — convolution engines chosen by measurement; see core/conv_tuning.h.
#include "core/conv_tuning.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/device_file.h"
#include "core/error.h"
#include "core/files.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally {
namespace {

constexpr const char* kTuningFormat = "tally convolution tuning";
constexpr int kTuningVersion = 1;
std::atomic<std::uint64_t> g_tuning_version{0};

using tuning_json = nlohmann::ordered_json;

tuning_json entry_json(const kernels::TunedConvPass& e) {
  return tuning_json{{"rank", e.rank},
              {"engine", e.engine},
              {"workspace", e.workspace},
              {"ms", e.ms},
              {"within_rank", e.within_rank},
              {"within_engine", e.within_engine},
              {"within_workspace", e.within_workspace},
              {"within_ms", e.within_ms},
              {"heuristic_rank", e.heuristic_rank},
              {"heuristic_engine", e.heuristic_engine},
              {"heuristic_workspace", e.heuristic_workspace},
              {"heuristic_ms", e.heuristic_ms},
              {"candidates", e.candidates}};
}

// One entry read back; `where` names it in errors (the file and the pass).
kernels::TunedConvPass entry_from_json(const tuning_json& j, const std::string& where) {
  if (!j.is_object()) throw Error(fmt::format("{}: expected an object, found {}", where, j.dump()));
  kernels::TunedConvPass e;
  const auto integer = [&](const char* name, auto& to) {
    if (!j.contains(name) || !j[name].is_number_integer())
      throw Error(fmt::format("{}: expected an integer \"{}\", found {}", where, name,
                              j.contains(name) ? j[name].dump() : std::string("none")));
    to = j[name].get<std::remove_reference_t<decltype(to)>>();
  };
  const auto number = [&](const char* name, double& to) {
    if (!j.contains(name) || !j[name].is_number() || j[name].get<double>() < 0)
      throw Error(fmt::format("{}: expected a time in milliseconds \"{}\", found {}", where, name,
                              j.contains(name) ? j[name].dump() : std::string("none")));
    to = j[name].get<double>();
  };
  integer("rank", e.rank), integer("engine", e.engine), integer("workspace", e.workspace), number("ms", e.ms);
  integer("within_rank", e.within_rank), integer("within_engine", e.within_engine);
  integer("within_workspace", e.within_workspace), number("within_ms", e.within_ms);
  integer("heuristic_rank", e.heuristic_rank), integer("heuristic_engine", e.heuristic_engine);
  integer("heuristic_workspace", e.heuristic_workspace), number("heuristic_ms", e.heuristic_ms);
  integer("candidates", e.candidates);
  if (e.rank < -1 || e.within_rank < -1 || e.heuristic_rank < -1)
    throw Error(fmt::format("{}: expected ranks of -1 or more, found {}", where, j.dump()));
  return e;
}

ConvTuning::Table table_from_json(const tuning_json& j, const std::string& where) {
  if (!j.is_object()) throw Error(fmt::format("{}: expected an object of passes, found {}", where, j.dump()));
  ConvTuning::Table t;
  for (const auto& [key, entry] : j.items())
    t.emplace(key, entry_from_json(entry, fmt::format("{}, pass '{}'", where, key)));
  return t;
}

const char* use_name(ConvTuning::Use u) {
  return u == ConvTuning::Use::fastest ? "fastest" : u == ConvTuning::Use::within ? "within" : "none";
}

// The bytes of one operand of a pass: x (N, C, H, W), w (K, C/g, R, S) and y (N, K, P, Q) in the
// pass's data type.
struct PassBytes {
  std::size_t x, w, y;
};
PassBytes pass_bytes(const kernels::ConvPassKey& p) {
  const kernels::Conv2dShape& s = p.shape;
  const std::size_t e = p.bf16 ? 2 : 4;
  return {static_cast<std::size_t>(s.N * s.C * s.H * s.W) * e,
          static_cast<std::size_t>(s.K * (s.C / s.groups) * s.R * s.S) * e,
          static_cast<std::size_t>(s.N * s.K * s.P() * s.Q()) * e};
}

// Blocks of an arena taken for a measurement and given back, last first, however it ends.
class Borrowed {
 public:
  explicit Borrowed(Arena& arena) : arena_(arena) {}
  ~Borrowed() {
    for (auto it = offsets_.rbegin(); it != offsets_.rend(); ++it) arena_.free(*it);
  }
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  void* take(std::size_t bytes) {
    const Block b = arena_.allocate(bytes, Category::workspace, "convolution tuning");
    offsets_.push_back(b.offset);
    return b.ptr;
  }

 private:
  Arena& arena_;
  std::vector<std::size_t> offsets_;
};

}  // namespace

std::uint64_t conv_tuning_version() { return g_tuning_version.load(); }

std::pair<std::uint64_t, std::uint64_t> kernel_choices() { return {conv_tuning_version(), cuda_kernel_switches()}; }

std::filesystem::path ConvTuning::default_path() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && x[0] == '/')
    return std::filesystem::path(x) / "tally" / "conv-tuning.json";
  if (const char* h = std::getenv("HOME"); h != nullptr && h[0] == '/')
    return std::filesystem::path(h) / ".cache" / "tally" / "conv-tuning.json";
  return {};
}

namespace {

// The entries of a tuning file by device; a file that is not one: an Error naming it, what was
// expected, and the way out.
std::map<std::string, ConvTuning::Table> read_tuning_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("tuning file '{}': cannot read it: {}", path.string(), std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  const std::string where = fmt::format("tuning file '{}'", path.string());
  const std::string fix = " (delete it to tune again, or run with --tuning-file none)";
  tuning_json j;
  try {
    j = tuning_json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error(
        fmt::format("{}: expected JSON written by tally, found text that is not JSON ({}){}", where, e.what(), fix));
  }
  if (!j.is_object() || !j.contains("format") || j["format"] != kTuningFormat)
    throw Error(fmt::format("{}: expected \"format\": \"{}\", found {}{}", where, kTuningFormat,
                            j.is_object() && j.contains("format") ? j["format"].dump() : std::string("none"), fix));
  if (!j.contains("version") || j["version"] != kTuningVersion)
    throw Error(fmt::format("{}: expected version {}, found {}{}", where, kTuningVersion,
                            j.contains("version") ? j["version"].dump() : std::string("none"), fix));
  if (!j.contains("devices") || !j["devices"].is_object())
    throw Error(fmt::format("{}: expected an object \"devices\", found {}{}", where,
                            j.contains("devices") ? j["devices"].dump() : std::string("none"), fix));
  std::map<std::string, ConvTuning::Table> devices;
  try {
    for (const auto& [device, passes] : j["devices"].items())
      devices[device] = table_from_json(passes, fmt::format("{}, device '{}'", where, device));
  } catch (const Error& e) {
    throw Error(e.what() + fix);
  }
  return devices;
}

}  // namespace

ConvTuning::ConvTuning(std::filesystem::path path, double seconds) : path_(std::move(path)), seconds_(seconds) {
  if (!(seconds_ >= 0))
    throw Error(fmt::format("convolution tuning: expected a cap of 0 seconds or more, found {}", seconds_));
  if (path_.empty() || !std::filesystem::exists(path_)) return;
  devices_ = read_tuning_file(path_);
}

std::shared_ptr<ConvTuning> ConvTuning::replaying(const std::string& record, const std::string& where) {
  std::shared_ptr<ConvTuning> t(new ConvTuning());
  t->replay_only_ = true;
  tuning_json j;
  try {
    j = tuning_json::parse(record);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: expected the convolution tuning's record (JSON), found text that is not JSON ({})",
                            where, e.what()));
  }
  if (!j.is_object() || !j.contains("device") || !j["device"].is_string() || !j.contains("use") ||
      !j["use"].is_string() || !j.contains("passes"))
    throw Error(
        fmt::format("{}: expected a record with \"device\", \"use\" and \"passes\", found {}", where, j.dump()));
  const auto level_of = [&](const tuning_json& v, const std::string& what) {
    const std::string use = v.is_string() ? v.get<std::string>() : v.dump();
    if (use != "fastest" && use != "within" && use != "none")
      throw Error(fmt::format("{}: expected {} fastest, within or none, found {}", where, what,
                              v.is_string() ? "\"" + use + "\"" : use));
    return use == "fastest" ? Use::fastest : use == "within" ? Use::within : Use::none;
  };
  t->use_ = level_of(j["use"], "\"use\"");
  const std::string device = j["device"].get<std::string>();
  t->devices_[device] = table_from_json(j["passes"], where);
  // Every pass at the record's level: "use", or its own in "uses" (a record written before passes
  // had levels of their own has none).
  const tuning_json uses = j.contains("uses") ? j["uses"] : tuning_json::object();
  if (!uses.is_object())
    throw Error(fmt::format("{}: expected \"uses\" to be an object of passes' levels, found {}", where, uses.dump()));
  for (const auto& [key, v] : uses.items())
    if (!t->devices_[device].contains(key))
      throw Error(fmt::format("{}: expected \"uses\" to name passes of \"passes\", found '{}'", where, key));
  for (const auto& [key, entry] : t->devices_[device]) {
    t->seen_.insert(key);
    t->pinned_[key] = uses.contains(key) ? level_of(uses[key], fmt::format("pass '{}' at", key)) : t->use_;
  }
  t->report_ = fmt::format("tuning: {} passes replayed from the checkpoint ({})", t->seen_.size(),
                           uses.empty() ? use_name(t->use_) : "levels of their own");
  return t;
}

std::string ConvTuning::device_key() const {
  if constexpr (kHaveCudaBackend) {
    if (const kernels::cuda::DescribedDevice* d = kernels::cuda::described_device())
      return fmt::format("{}, compute capability {}.{}, cuDNN {}", d->name, d->compute_major, d->compute_minor,
                         cudnn_version_text(loaded_cudnn_version()));
    if (kernels::cuda::device_count() > 0) {
      const kernels::cuda::DeviceInfo info = kernels::cuda::device_info(std::max(0, kernels::cuda::current_device()));
      return fmt::format("{}, compute capability {}.{}, cuDNN {}", info.name, info.compute_major, info.compute_minor,
                         cudnn_version_text(loaded_cudnn_version()));
    }
  }
  return "no GPU";
}

std::string ConvTuning::table_key() const {
  return replay_only_ ? devices_.begin()->first : device_key();  // a record's device, whatever this one is
}

const ConvTuning::Table& ConvTuning::table() { return devices_[table_key()]; }

ConvTuning::Use ConvTuning::level(const std::string& key) const {
  const auto it = pinned_.find(key);
  return it == pinned_.end() ? use_ : it->second;
}

// Each entry resolved to its pass's level: the fastest, or its within_* choice (use_within), or
// none (left out) — what the kernels replay. `unpinned`: the
// level of the passes not pinned; `last`: that of the last tune()'s among them instead.
bool ConvTuning::put_levels(Use unpinned, std::optional<Use> last) {
  Table resolved;
  for (const auto& [key, e] : table()) {
    const auto pin = pinned_.find(key);
    const Use at = pin != pinned_.end() ? pin->second : last && last_.contains(key) ? *last : unpinned;
    if (at == Use::none) continue;
    kernels::TunedConvPass r = e;
    r.use_within = at == Use::within;
    resolved.emplace(key, r);
  }
  return put(resolved);
}

bool ConvTuning::install(Use use) {
  use_ = use;
  return put_levels(use, std::nullopt);
}

bool ConvTuning::trial(Use use) { return put_levels(use_, use); }

void ConvTuning::pin(Use use) {
  const Table& t = table();
  for (const std::string& key : last_)
    if (t.contains(key)) pinned_.try_emplace(key, use);
  (void)put_levels(use_, std::nullopt);
}

bool ConvTuning::undecided() const {
  const auto it = devices_.find(table_key());
  if (it == devices_.end()) return false;
  return std::any_of(last_.begin(), last_.end(),
                     [&](const std::string& key) { return it->second.contains(key) && !pinned_.contains(key); });
}

bool ConvTuning::install_none() { return put({}); }

// What the kernels replay is the process's: compared there, with whatever was installed before —
// by another ConvTuning (a sweep's earlier run, a resumed run's record) or by none.
bool ConvTuning::put(const Table& table) {
  bool changed = false;
  if constexpr (kHaveCudaBackend) changed = kernels::cuda::set_conv_tuning(table);
  if (changed) ++g_tuning_version;
  return changed;
}

bool ConvTuning::tune(Device device, Arena& arena, const std::function<void()>& dry_run) {
  if (!device.is_cuda()) return false;
  std::vector<kernels::ConvPassKey> passes;
  if constexpr (kHaveCudaBackend) {
    kernels::cuda::conv2d_record_passes(true);
    try {
      dry_run();
    } catch (...) {
      kernels::cuda::conv2d_record_passes(false);
      throw;
    }
    kernels::cuda::conv2d_record_passes(false);
    passes = kernels::cuda::conv2d_recorded_passes();
  }
  Table& t = devices_[table_key()];
  last_.clear();
  // Measuring needs real buffers: none on a virtual arena (a plan), none with a cap of 0.
  const bool measuring = seconds_ > 0 && !arena.is_virtual();
  int measured = 0, faster = 0, no_room = 0, left = 0, untimed = 0, from_file = 0;
  std::string failed;  // why measuring stopped early
  double saved_ms = 0, heuristic_ms = 0;
  const auto began = std::chrono::steady_clock::now();
  for (const kernels::ConvPassKey& p : passes) {
    std::string key;
    if constexpr (kHaveCudaBackend) key = kernels::cuda::conv2d_tuning_key(p.shape, p.bf16, p.pass, p.beta);
    seen_.insert(key);
    last_.insert(key);
    if (t.contains(key) || replay_only_) {  // a replay measures nothing: what its record lacks stays untuned
      from_file += t.contains(key) ? 1 : 0;
      continue;
    }
    const double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    if (!failed.empty()) declined_.insert(key);  // measuring stopped (below): left to the heuristics
    if (!measuring || !failed.empty()) continue;
    if (spent >= seconds_ || declined_.contains(key)) {  // left to the heuristics for this process
      declined_.insert(key);
      ++left;
      continue;
    }
    const PassBytes b = pass_bytes(p);
    try {
      Borrowed buffers(arena);
      void* x = buffers.take(b.x);
      void* w = buffers.take(b.w);
      void* y = buffers.take(b.y);
      const std::size_t room = arena.largest_free_block() / Arena::kAlignment * Arena::kAlignment;
      const std::size_t ws_bytes = std::min(room, p.shape.workspace_limit);
      void* ws = ws_bytes > 0 ? buffers.take(ws_bytes) : nullptr;
      kernels::TunedConvPass e;
      if constexpr (kHaveCudaBackend) e = kernels::cuda::conv2d_tune_pass(p, x, w, y, ws, ws_bytes, seconds_ - spent);
      if (e.cut || e.rank < 0) {  // left to the heuristics for this process; a later run measures it
        declined_.insert(key);
        ++(!e.cut ? untimed : e.heuristic_workspace > std::min(ws_bytes, p.shape.workspace_limit) ? no_room : left);
        continue;
      }
      t[key] = e;
      ++measured;
      if (e.engine != e.heuristic_engine && e.heuristic_ms > 0) {
        ++faster;
        saved_ms += e.heuristic_ms - e.ms;
      }
      heuristic_ms += e.heuristic_ms;
    } catch (const OutOfMemory&) {  // left to the heuristics for this process, as above
      declined_.insert(key);
      ++no_room;
    } catch (const Error& e) {
      // cuDNN or CUDA refused something the step's own plan did not need (an engine's set-up, the
      // timing events): what was measured is kept and written, the rest left to the heuristics for
      // this process. A device lost on the way fails the step's own next call, with its own words.
      declined_.insert(key);
      failed = e.what();
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  std::string unsaved;
  if (measured > 0 && !path_.empty()) {
    // What others wrote since this process read the file (another rank of the machine, another
    // run) is kept beside what this one measured, not written over: the file is read again first.
    // (One that cannot be read now is a cache to write anew.)
    try {
      if (std::filesystem::exists(path_))
        for (auto& [dev, table] : read_tuning_file(path_))
          for (auto& [key, e] : table) devices_[dev].try_emplace(key, e);
    } catch (const Error&) {
    }
    tuning_json j{{"format", kTuningFormat}, {"version", kTuningVersion}, {"devices", tuning_json::object()}};
    for (const auto& [dev, table] : devices_) {
      tuning_json passes_json = tuning_json::object();
      for (const auto& [key, e] : table) passes_json[key] = entry_json(e);
      j["devices"][dev] = passes_json;
    }
    // A cache: a run goes on without it, saying so.
    try {
      if (path_.has_parent_path()) std::filesystem::create_directories(path_.parent_path());
      write_file(path_, j.dump(1) + "\n", "tuning file");
    } catch (const std::exception& e) {
      unsaved = fmt::format("; not saved: {}", e.what());
    }
  }
  if (!measuring && !replay_only_) {  // nothing said when nothing is tuned
    report_ = from_file == 0 ? std::string()
                             : fmt::format("tuning: {} of {} graph-API convolution passes with the engines measured in "
                                           "{}, the others with cuDNN's heuristics' choice (nothing measured)",
                                           from_file, passes.size(), path_.string());
    return install(use_);
  }
  report_ = fmt::format("tuning: {} graph-API convolution passes, {} measured in {:.1f} s (cap {:.0f} s){}, {} from {}",
                        passes.size(), measured, seconds, seconds_,
                        measured > 0 ? fmt::format(" — {} faster than the heuristics' choice, {:.2f} of {:.2f} ms "
                                                   "saved a run", faster, saved_ms, heuristic_ms)
                                     : std::string(),
                        from_file, replay_only_ ? "the checkpoint" : path_.empty() ? "this process" : path_.string());
  if (no_room > 0) report_ += fmt::format(", {} left to the heuristics (their buffers do not fit the arena)", no_room);
  if (left > 0) report_ += fmt::format(", {} left to the heuristics (past the cap: a later run measures them)", left);
  if (untimed > 0)
    report_ += fmt::format(", {} left to the heuristics (no engine the rules allow ran on them)", untimed);
  if (!failed.empty())
    report_ += fmt::format(", measuring stopped: {} (the passes not measured left to the heuristics)", failed);
  report_ += unsaved;
  return install(use_);
}

std::string ConvTuning::record() const {
  tuning_json passes = tuning_json::object();
  std::vector<std::string> keys;
  const auto it = devices_.find(table_key());
  if (it != devices_.end())
    for (const std::string& key : seen_)
      if (const auto e = it->second.find(key); e != it->second.end()) {
        passes[key] = entry_json(e->second);
        keys.push_back(key);
      }
  const Use first = keys.empty() ? use_ : level(keys.front());
  tuning_json j{{"device", table_key()}, {"use", use_name(first)}, {"passes", passes}};
  tuning_json uses = tuning_json::object();
  for (const std::string& key : keys)
    if (level(key) != first) uses[key] = use_name(level(key));
  if (!uses.empty()) j["uses"] = uses;
  return j.dump();
}

}  // namespace tally
