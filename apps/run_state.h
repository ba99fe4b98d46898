// apps/run_state.h — what a resumable `tally train` needs beside the tensors of a checkpoint
// (mbp/checkpoint.h; docs/checkpoints.md): the run's saved options (as text: apps/options.h),
// --checkpoint-every, the stop signals, and the kill points the resumption tests use.
#pragma once
#include <csignal>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apps/trainer.h"

namespace tally::app {

// The options of run_dir's run, as saved with its newest checkpoint, with `resume` and `out` set
// to run_dir; tally::Error if run_dir has no checkpoint.
TrainOptions resume_options(const std::string& run_dir);

// What a run writes at its end, checked before it starts: --out a folder this process can write
// that holds no earlier run (its checkpoints: --resume; a finished run's summary.json or
// metrics.csv: never written over), --save a file it can create — tried, not read from permission
// bits. The weights of a long run are never lost to a typo. Nothing to check for a resumed run.
void check_run_folder(const TrainOptions& opt);

// --checkpoint-every: "" (off), "N" (every N steps) or a time "90s", "10m", "2h" (at the first step
// boundary after that long since the last checkpoint); anything else is an Error naming the flag.
struct CheckpointEvery {
  std::int64_t steps = 0;  // 0: not by steps
  double seconds = 0;      // 0: not by time
  bool on() const { return steps > 0 || seconds > 0; }
};
CheckpointEvery parse_checkpoint_every(const std::string& text);

// While alive, this process holds the lock of the run folder `dir` (an flock on dir/.lock, with its
// pid written in): a second tally on the same folder — two resumes of one run, or a new run started
// while one is going — is an Error naming `flag`, the folder and the first one's pid. The lock ends
// with the process, however it ends; a process that ends normally also removes dir/.lock.
class RunFolderLock {
 public:
  RunFolderLock(const std::string& dir, const std::string& flag);
  ~RunFolderLock();
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

 private:
  int fd_ = -1;
  std::string path_;
};
// If another process holds the lock of run folder `dir` now: an Error as RunFolderLock's, naming
// `flag` (checked before anything else looks at the folder's files).
void check_run_folder_free(const std::string& dir, const std::string& flag);

// While alive, SIGINT and SIGTERM (one process) or SIGUSR1 (every run; the one mpirun forwards to
// its ranks) set a flag instead of ending the process; a second signal of the same kind ends it
// as usual. The previous handlers come back at destruction.
class StopSignals {
 public:
  explicit StopSignals(bool one_process);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int pending() const;  // the signal received, 0 if none
  static std::string name(int signal);  // "SIGINT"
};

// Tests of resumption (docs/testing.md): TALLY_TEST_SIGKILL=<where>:<step>[:<n>] makes the
// process SIGKILL itself at a chosen point — "after-step:K" once step K (1-based) is done and
// recorded, "in-step:K:N" at the N-th arena allocation of step K, "in-checkpoint:K" in the middle
// of writing the checkpoint of step K (its tensors written, its manifest not).
struct KillPoint {
  std::string where;  // "" when unset
  std::int64_t step = 0;
  std::uint64_t allocation = 0;
  bool at(const char* w, std::int64_t s) const { return where == w && step == s; }
};
// TALLY_TEST_SIGKILL_RANK=R limits it to rank R of an mpirun (a rank dying in the middle of a
// data-parallel or pipeline step: the others must end within seconds, naming it).
KillPoint kill_point_from_environment(int rank = 0);
// And TALLY_TEST_OOM=K:N: the N-th arena allocation of step K (0-based) fails once, as
// TrainOptions::inject_oom (a test of a resumed run's micro-batch limit after a retry).
std::optional<std::pair<std::int64_t, std::uint64_t>> oom_injection_from_environment();
[[noreturn]] void kill_self();
// The faults a test asks of a run (the three above), in one place; the loop only says where it is.
struct TestFaults {
  KillPoint kill;
  std::optional<std::pair<std::int64_t, std::uint64_t>> oom;  // (step, allocation)
  // From the environment of rank `rank`; `inject_oom` (TrainOptions::inject_oom) before TALLY_TEST_OOM.
  static TestFaults from_environment(int rank, std::optional<std::pair<std::int64_t, std::uint64_t>> inject_oom);
  // Before step `step` (0-based) runs on `arena`: its injected allocation failure, or its SIGKILL
  // at the N-th allocation.
  void before_step(std::int64_t step, Arena& arena) const;
  // Once step `done` (1-based) is done and recorded.
  void after_step(std::int64_t done) const;
  // Whether the checkpoint of step `step` dies halfway.
  bool in_checkpoint(std::int64_t step) const { return kill.at("in-checkpoint", step); }
};

}  // namespace tally::app
