// apps/run_state.cpp — options as text, --checkpoint-every, stop signals, kill points; see apps/run_state.h.
#include "apps/run_state.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "apps/setup.h"
#include "core/error.h"
#include "mbp/checkpoint.h"

namespace tally::app {

TrainOptions resume_options(const std::string& run_dir) {
  std::error_code ec;
  if (std::filesystem::is_directory(run_dir, ec)) check_run_folder_free(run_dir, "--resume");  // a run going there
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

void check_run_folder(const TrainOptions& opt) {
  std::error_code ec;
  const std::string& dir = opt.resume.empty() ? opt.out : opt.resume;
  if (!dir.empty() && std::filesystem::is_directory(dir, ec))  // a run going there: say so first
    check_run_folder_free(dir, opt.resume.empty() ? "--out" : "--resume");
  if (!opt.resume.empty()) return;  // a resumed run continues in its own folder
  if (!opt.out.empty() && std::filesystem::is_directory(opt.out, ec)) {
    if (const auto old = mbp::latest_checkpoint(opt.out))
      throw Error(fmt::format("--out {}: it holds {} of an earlier run; continue that run with --resume {}, or choose "
                              "another folder", opt.out, old->filename().string(), opt.out));
    for (const char* finished : {"summary.json", "metrics.csv"})
      if (std::filesystem::exists(std::filesystem::path(opt.out) / finished, ec))
        throw Error(fmt::format("--out {}: it holds the {} of an earlier run, which this run would overwrite; choose "
                                "another folder (or remove that run)", opt.out, finished));
  }
  if (!opt.out.empty()) check_writable_folder("--out", opt.out);
  if (!opt.save.empty()) check_writable_file("--save", opt.save);
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
// The pid the holder of a lock file wrote in it ("" when none).
std::string lock_holder(int fd) {
  char pid[32] = {};
  const ssize_t n = ::pread(fd, pid, sizeof(pid) - 1, 0);
  std::string holder(pid, n > 0 ? static_cast<std::size_t>(n) : 0);
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
  return holder;
}

// Takes the lock of `path` without waiting: its descriptor, or -1 with the holder's pid text (maybe
// empty) when another process holds it. A lock taken on a file that was removed meanwhile (its
// holder ending) is let go and taken again on the path's new file.
int take_lock(const std::string& path, const std::string& flag, const std::string& dir, std::string* holder) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) throw Error(fmt::format("{} {}: cannot create its lock {}: {}", flag, dir, path, std::strerror(errno)));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      *holder = lock_holder(fd);
      ::close(fd);
      return -1;
    }
    struct stat mine {}, named {};
    if (::fstat(fd, &mine) == 0 && ::stat(path.c_str(), &named) == 0 && mine.st_ino == named.st_ino &&
        mine.st_dev == named.st_dev)
      return fd;
    ::close(fd);  // removed under us by the holder that just ended: again, on the new file
  }
  throw Error(fmt::format("{} {}: its lock {} kept changing under this process; is another tally starting there?", flag,
                          dir, path));
}

[[noreturn]] void folder_in_use(const std::string& flag, const std::string& dir, const std::string& path,
                                const std::string& holder) {
  throw Error(fmt::format("{} {}: another tally process{} is using this run folder (it holds {}); wait for it to "
                          "end, or give another folder", flag, dir, holder.empty() ? "" : " (pid " + holder + ")", path));
}
}  // namespace

RunFolderLock::RunFolderLock(const std::string& dir, const std::string& flag)
    : path_((std::filesystem::path(dir) / ".lock").string()) {
  std::string holder;
  fd_ = take_lock(path_, flag, dir, &holder);
  if (fd_ < 0) folder_in_use(flag, dir, path_, holder);
  const std::string mine = fmt::format("{}\n", ::getpid());
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, mine.data(), mine.size(), 0) < 0) {
    // The lock holds without the pid in it; a second process is refused all the same.
  }
}

RunFolderLock::~RunFolderLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while still held: a process that opened it meanwhile finds it removed (take_lock)
  ::close(fd_);             // closing releases the flock
}

void check_run_folder_free(const std::string& dir, const std::string& flag) {
  const std::string path = (std::filesystem::path(dir) / ".lock").string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;  // gone meanwhile
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    const std::string holder = lock_holder(fd);
    ::close(fd);
    folder_in_use(flag, dir, path, holder);
  }
  ::close(fd);
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

KillPoint kill_point_from_environment(int rank) {
  KillPoint k;
  const char* env = std::getenv("TALLY_TEST_SIGKILL");
  if (!env || !*env) return k;
  if (const char* only = std::getenv("TALLY_TEST_SIGKILL_RANK"); only && *only && std::string(only) != std::to_string(rank))
    return k;
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

TestFaults TestFaults::from_environment(int rank, std::optional<std::pair<std::int64_t, std::uint64_t>> inject_oom) {
  TestFaults f;
  f.kill = kill_point_from_environment(rank);
  f.oom = inject_oom ? inject_oom : oom_injection_from_environment();
  return f;
}

void TestFaults::before_step(std::int64_t step, Arena& arena) const {
  if (oom && oom->first == step) arena.fail_allocation_after(oom->second);
  if (kill.at("in-step", step + 1)) arena.at_allocation(kill.allocation, kill_self);
}

void TestFaults::after_step(std::int64_t done) const {
  if (kill.at("after-step", done)) kill_self();
}

void kill_self() {
  std::fflush(nullptr);
  ::kill(::getpid(), SIGKILL);
  std::abort();  // not reached
}

}  // namespace tally::app
