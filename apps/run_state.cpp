// apps/run_state.cpp — options as text, --checkpoint-every, stop signals, kill points; see apps/run_state.h.
#include "apps/run_state.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "mbp/checkpoint.h"

namespace tally::app {

std::vector<std::pair<std::string, std::string>> option_values(const TrainOptions& o) {
  auto opt_int = [](const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : std::string("auto"); };
  auto yes = [](bool b) { return std::string(b ? "true" : "false"); };
  auto num = [](double d) { return fmt::format("{}", d); };  // shortest text that reads back exactly
  return {{"model", o.model},
          {"norm", o.norm},
          {"data", o.data},
          {"num-classes", opt_int(o.num_classes)},
          {"epochs", std::to_string(o.epochs)},
          {"steps", opt_int(o.steps)},
          {"batch-size", std::to_string(o.batch_size)},
          {"optimizer", o.optimizer},
          {"lr", num(o.lr)},
          {"momentum", num(o.momentum)},
          {"weight-decay", num(o.weight_decay)},
          {"nesterov", yes(o.nesterov)},
          {"schedule", o.schedule},
          {"warmup-epochs", num(o.warmup_epochs)},
          {"label-smoothing", num(o.label_smoothing)},
          {"augment", o.augment ? (*o.augment ? "on" : "off") : "default"},
          {"shuffle", yes(o.shuffle)},
          {"normalize", yes(o.normalize)},
          {"seed", std::to_string(o.seed)},
          {"device", o.device},
          {"threads", std::to_string(o.threads)},
          {"tf32", yes(o.tf32)},
          {"profile", yes(o.profile)},
          {"init", o.init},
          {"save", o.save},
          {"out", o.out},
          {"progress", yes(o.progress)},
          {"eval", yes(o.evaluate)},
          {"memory-limit", o.memory_limit},
          {"micro-batch", opt_int(o.micro_batch)},
          {"loss-normalization", o.loss_normalization},
          {"recompute", o.recompute},
          {"precision", o.precision},
          {"memory-format", o.memory_format},
          {"checkpoint-every", o.checkpoint_every},
          {"pipeline-stages", std::to_string(o.pipeline_stages)},
          {"pipeline-split", o.pipeline_split},
          {"pipeline-schedule", o.pipeline_schedule}};
}

namespace {

// Reads the values back: each getter names the option and `where` when it fails.
struct ValueReader {
  const std::map<std::string, std::string>& v;
  const std::string& where;

  const std::string& text(const std::string& key) const {
    const auto it = v.find(key);
    if (it == v.end()) throw FormatError(fmt::format("{}: expected the option \"{}\", found none", where, key));
    return it->second;
  }
  [[noreturn]] void bad(const std::string& key, const char* expected) const {
    throw FormatError(fmt::format("{}: expected option \"{}\" to be {}, found \"{}\"", where, key, expected, text(key)));
  }
  template <class Int>
  Int whole(const std::string& key) const {
    const std::string& t = text(key);
    Int out{};
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
    if (ec != std::errc() || end != t.data() + t.size()) bad(key, "a whole number");
    return out;
  }
  std::optional<std::int64_t> whole_or_auto(const std::string& key) const {
    if (text(key) == "auto") return std::nullopt;
    return whole<std::int64_t>(key);
  }
  double number(const std::string& key) const {
    const std::string& t = text(key);
    char* end = nullptr;
    errno = 0;
    const double d = std::strtod(t.c_str(), &end);
    if (t.empty() || end != t.c_str() + t.size() || errno == ERANGE || !std::isfinite(d)) bad(key, "a number");
    return d;
  }
  bool flag(const std::string& key) const {
    if (text(key) == "true") return true;
    if (text(key) == "false") return false;
    bad(key, "true or false");
  }
};

}  // namespace

TrainOptions options_from_values(const std::map<std::string, std::string>& values, const std::string& where) {
  const ValueReader r{values, where};
  TrainOptions o;
  o.model = r.text("model"), o.norm = r.text("norm"), o.data = r.text("data");
  o.num_classes = r.whole_or_auto("num-classes");
  o.epochs = r.whole<std::int64_t>("epochs");
  o.steps = r.whole_or_auto("steps");
  o.batch_size = r.whole<std::int64_t>("batch-size");
  o.optimizer = r.text("optimizer");
  o.lr = r.number("lr"), o.momentum = r.number("momentum"), o.weight_decay = r.number("weight-decay");
  o.nesterov = r.flag("nesterov");
  o.schedule = r.text("schedule");
  o.warmup_epochs = r.number("warmup-epochs"), o.label_smoothing = r.number("label-smoothing");
  const std::string& augment = r.text("augment");
  if (augment == "on" || augment == "off")
    o.augment = augment == "on";
  else if (augment != "default")
    r.bad("augment", "on, off or default");
  o.shuffle = r.flag("shuffle"), o.normalize = r.flag("normalize");
  o.seed = r.whole<std::uint64_t>("seed");
  o.device = r.text("device");
  o.threads = r.whole<int>("threads");
  o.tf32 = r.flag("tf32"), o.profile = r.flag("profile");
  o.init = r.text("init"), o.save = r.text("save"), o.out = r.text("out");
  o.progress = r.flag("progress"), o.evaluate = r.flag("eval");
  o.memory_limit = r.text("memory-limit");
  o.micro_batch = r.whole_or_auto("micro-batch");
  o.loss_normalization = r.text("loss-normalization"), o.recompute = r.text("recompute");
  o.precision = r.text("precision"), o.checkpoint_every = r.text("checkpoint-every");
  // Pipeline runs write no checkpoints; the keys are there to compare the ranks' options.
  // Checkpoints written before --memory-format existed ran contiguous.
  if (values.count("memory-format")) o.memory_format = r.text("memory-format");
  if (values.count("pipeline-stages")) o.pipeline_stages = r.whole<int>("pipeline-stages");
  if (values.count("pipeline-split")) o.pipeline_split = r.text("pipeline-split");
  if (values.count("pipeline-schedule")) o.pipeline_schedule = r.text("pipeline-schedule");
  return o;
}

const std::vector<std::string>& options_changeable_on_resume() {
  // threads: the thread count is checked itself (a CPU run resumes with as many threads as it ran).
  static const std::vector<std::string> names = {"out", "save", "checkpoint-every", "progress", "profile", "threads"};
  return names;
}

TrainOptions resume_options(const std::string& run_dir) {
  const auto dir = mbp::latest_checkpoint(run_dir);
  if (!dir)
    throw Error(fmt::format("--resume {}: no checkpoint in it (expected a folder checkpoint-<step>/, written by "
                            "--checkpoint-every or when a run with --out is stopped by SIGINT, SIGTERM or SIGUSR1)",
                            run_dir));
  const mbp::TrainingState st = mbp::peek_training_state(*dir);
  const std::string where = fmt::format("{}/state.json", dir->string());
  std::map<std::string, std::string> values;
  try {
    const auto state = nlohmann::json::parse(st.state);
    if (!state.contains("options") || !state["options"].is_object())
      throw FormatError(fmt::format("{}: expected \"state\".\"options\" (the run's options), found none", where));
    for (const auto& [key, value] : state["options"].items()) {
      if (!value.is_string())
        throw FormatError(fmt::format("{}: expected option \"{}\" as a string, found {}", where, key, value.dump()));
      values[key] = value.get<std::string>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", where, e.what()));
  }
  TrainOptions o = options_from_values(values, where);
  o.resume = run_dir;
  o.out = run_dir;
  return o;
}

void check_resume_options(const TrainOptions& saved, const TrainOptions& given, const std::vector<std::string>& names) {
  const auto& changeable = options_changeable_on_resume();
  const auto a = option_values(saved), b = option_values(given);
  std::string differences;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::string& key = a[i].first;
    if (std::find(changeable.begin(), changeable.end(), key) != changeable.end()) continue;
    if (!names.empty() && std::find(names.begin(), names.end(), key) == names.end()) continue;
    if (a[i].second != b[i].second)
      differences += fmt::format("\n  --{}: the run has {}, given {}", key, a[i].second.empty() ? "\"\"" : a[i].second,
                                 b[i].second.empty() ? "\"\"" : b[i].second);
  }
  if (!differences.empty())
    throw Error(fmt::format("--resume {}: a resumed run keeps its options (only --{} may change):{}", given.resume,
                            fmt::format("{}", fmt::join(changeable, ", --")), differences));
}

CheckpointEvery parse_checkpoint_every(const std::string& text) {
  CheckpointEvery every;
  if (text.empty()) return every;
  const char* end = text.data() + text.size();
  std::int64_t steps = 0;
  const auto [p, ec] = std::from_chars(text.data(), end, steps);
  if (ec == std::errc() && p == end && steps >= 1) {
    every.steps = steps;
    return every;
  }
  char* unit = nullptr;
  const double value = std::strtod(text.c_str(), &unit);
  const std::string u(unit ? unit : "");
  const double scale = u == "s" ? 1 : (u == "m" || u == "min") ? 60 : u == "h" ? 3600 : 0;
  const double seconds = value * scale;  // finite itself: "3E307h" is 1.08e311 s, no time at all
  if (unit == text.c_str() || scale == 0 || !std::isfinite(seconds) || seconds <= 0)
    throw Error(fmt::format("--checkpoint-every: expected a number of steps >= 1 (\"500\") or a time (\"90s\", \"10m\", "
                            "\"2h\"), found \"{}\"", text));
  every.seconds = seconds;
  return every;
}

namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int signal) { g_stop_signal.store(signal); }

struct Installed {
  int signal;
  struct sigaction previous;
};
std::vector<Installed> g_installed;

}  // namespace

StopSignals::StopSignals(bool one_process) {
  g_stop_signal.store(0);
  std::vector<int> signals = {SIGUSR1};
  if (one_process) signals.insert(signals.end(), {SIGINT, SIGTERM});
  for (const int s : signals) {
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND | SA_RESTART;  // a second signal: the default action
    Installed in{s, {}};
    if (::sigaction(s, &sa, &in.previous) == 0) g_installed.push_back(in);
  }
}

StopSignals::~StopSignals() {
  for (const Installed& in : g_installed) ::sigaction(in.signal, &in.previous, nullptr);
  g_installed.clear();
}

int StopSignals::pending() const { return g_stop_signal.load(); }

std::string StopSignals::name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return fmt::format("signal {}", signal);
  }
}

KillPoint kill_point_from_environment() {
  KillPoint k;
  const char* env = std::getenv("TALLY_TEST_SIGKILL");
  if (!env || !*env) return k;
  const std::string text(env);
  const auto colon = text.find(':');
  const auto colon2 = colon == std::string::npos ? colon : text.find(':', colon + 1);
  try {
    k.where = text.substr(0, colon);
    k.step = std::stoll(text.substr(colon + 1, colon2 == std::string::npos ? std::string::npos : colon2 - colon - 1));
    if (colon2 != std::string::npos) k.allocation = std::stoull(text.substr(colon2 + 1));
  } catch (const std::exception&) {
    k.where.clear();
  }
  if (colon == std::string::npos || (k.where != "after-step" && k.where != "in-step" && k.where != "in-checkpoint") ||
      (k.where == "in-step" && k.allocation == 0))
    throw Error(fmt::format("TALLY_TEST_SIGKILL={}: expected after-step:K, in-step:K:N or in-checkpoint:K", text));
  return k;
}

std::optional<std::pair<std::int64_t, std::uint64_t>> oom_injection_from_environment() {
  const char* env = std::getenv("TALLY_TEST_OOM");
  if (!env || !*env) return std::nullopt;
  const std::string text(env);
  const auto colon = text.find(':');
  try {
    if (colon != std::string::npos) {
      std::size_t a = 0, b = 0;
      const std::int64_t step = std::stoll(text.substr(0, colon), &a);
      const std::uint64_t n = std::stoull(text.substr(colon + 1), &b);
      if (a == colon && b == text.size() - colon - 1 && step >= 0 && n >= 1) return std::make_pair(step, n);
    }
  } catch (const std::exception&) {
  }
  throw Error(fmt::format("TALLY_TEST_OOM={}: expected K:N (fail the N-th allocation of step K)", text));
}

void kill_self() {
  std::fflush(nullptr);
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached
}

}  // namespace tally::app
