// apps/run_state.h — what a resumable `tally train` needs beside the tensors of a checkpoint
// (mbp/checkpoint.h; docs/checkpoints.md): the run's options as text (saved with every
// checkpoint, compared on resume and across the ranks), --checkpoint-every, the stop signals,
// and the kill points the resumption tests use.
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

// Every option of a run as (flag name without "--", value as text), in the command line's order:
// the one list the checkpoint's options, the ranks' agreement and the resume check are made of.
// A flag and its "--no-" form share a name ("augment": on|off|default, "shuffle", "eval", ...).
std::vector<std::pair<std::string, std::string>> option_values(const TrainOptions& o);
// The inverse, for the values a checkpoint saved; FormatError naming `where` and the option when
// one is missing or does not parse.
TrainOptions options_from_values(const std::map<std::string, std::string>& values, const std::string& where);

// The options a resumed run may change (they do not change its results): out (the run folder is
// where it is now), save, checkpoint-every, progress, profile, and threads (a CPU run must resume
// with the thread count it ran with — the resume checks the count itself, however it was set).
const std::vector<std::string>& options_changeable_on_resume();

// The options of run_dir's run, as saved with its newest checkpoint, with `resume` and `out` set
// to run_dir; tally::Error if run_dir has no checkpoint.
TrainOptions resume_options(const std::string& run_dir);
// Throws one tally::Error listing every option (of `names`, or of all when empty) that differs
// between the run's saved options and `given` — both values named — except the changeable ones.
void check_resume_options(const TrainOptions& saved, const TrainOptions& given, const std::vector<std::string>& names);

// --checkpoint-every: "" (off), "N" (every N steps) or a time "90s", "10m", "2h" (at the first step
// boundary after that long since the last checkpoint); anything else is an Error naming the flag.
struct CheckpointEvery {
  std::int64_t steps = 0;  // 0: not by steps
  double seconds = 0;      // 0: not by time
  bool on() const { return steps > 0 || seconds > 0; }
};
CheckpointEvery parse_checkpoint_every(const std::string& text);

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
KillPoint kill_point_from_environment();
// And TALLY_TEST_OOM=K:N: the N-th arena allocation of step K (0-based) fails once, as
// TrainOptions::inject_oom (a test of a resumed run's micro-batch limit after a retry).
std::optional<std::pair<std::int64_t, std::uint64_t>> oom_injection_from_environment();
[[noreturn]] void kill_self();

}  // namespace tally::app
