// apps/command_line.cpp — the tally command line (apps/command_line.h); `tally` is apps/main.cpp.
//   tally --version        build configuration (CUDA, cuDNN), whether a GPU is present, how OpenMP waits
//   tally train [options]  train a ResNet (see apps/trainer.h and README.md for the options)
//   tally plan [options]   the memory plan of a training step: per-layer table, micro-batch
//                          size, predicted peak (see apps/plan.h); nothing is computed
//   tally sweep [options]  the batch-size experiment: a run per batch size (see apps/sweep.h)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/command_line.h"
#include "apps/device.h"
#include "apps/options.h"
#include "apps/plan.h"
#include "apps/run_state.h"
#include "apps/sweep.h"
#include "apps/trainer.h"
#include "core/device.h"
#include "core/option_names.h"
#include "distributed/communicator.h"

using namespace tally;

namespace {

// An error ends the run with a non-zero exit. Under mpirun it ends every rank: the others would
// otherwise wait in their next collective for this one forever.
int fail(const std::exception& e) {
  if (tally::distributed::launched_by_mpi() && tally::distributed::have_mpi()) {
    std::shared_ptr<tally::distributed::Communicator> world;
    try {
      world = tally::distributed::mpi_world();
    } catch (const std::exception&) {
    }
    if (world && world->size() > 1) {
      fmt::print(stderr, "tally: error on rank {} of {}: {}\n", world->rank(), world->size(), e.what());
      std::fflush(stderr);
      world->abort(1);
    }
  }
  fmt::print(stderr, "tally: error: {}\n", e.what());
  return 1;
}

// A sweep's options once parsed: whether --warmup-epochs was given, and with --resume the sweep's
// saved options, checked against the given ones (`names`).
void complete_sweep_options(app::SweepOptions& so, const std::vector<std::string>& names) {
  so.warmup_given = std::find(names.begin(), names.end(), "warmup-epochs") != names.end();
  if (so.train.resume.empty()) return;
  app::SweepOptions saved = app::sweep_resume_options(so.train.resume);
  so.resume = so.train.resume;
  app::check_sweep_resume(saved, so, names);
  saved.train = app::resumed_options(saved.train, so.train, names);
  so = saved;
}

// The cores' worth of CPU time others used over 40 ms, 20 ms from now (/proc/stat's "cpu" line:
// the time not idle, over the elapsed time, times the cores); negative when it cannot be read.
double busy_cores() {
  auto sample = [](double* busy, double* total) {
    std::ifstream in("/proc/stat");
    std::string cpu;
    double v[8] = {};
    if (!(in >> cpu) || cpu != "cpu") return false;
    for (double& x : v) in >> x;  // user nice system idle iowait irq softirq steal
    *total = 0;
    for (const double x : v) *total += x;
    *busy = *total - v[3] - v[4];
    // Less this process's own time (its threads, started by the libraries): fields 14 and 15 of
    // /proc/self/stat, after the command's name in parentheses.
    std::ifstream self("/proc/self/stat");
    std::string line;
    std::getline(self, line);
    const std::size_t close = line.rfind(')');
    if (close == std::string::npos) return false;
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    double utime = 0, stime = 0;
    for (int k = 3; k <= 15 && rest >> field; ++k) {
      if (k == 14) utime = std::atof(field.c_str());
      if (k == 15) stime = std::atof(field.c_str());
    }
    *busy -= utime + stime;
    return static_cast<bool>(in);
  };
  double b0 = 0, t0 = 0, b1 = 0, t1 = 0;
  // The kernel books a core's busy time when it next goes idle: this process's own start (loading
  // its libraries) would land in a window that begins at once. So the window begins 20 ms later.
  ::usleep(20000);
  if (!sample(&b0, &t0)) return -1;
  ::usleep(40000);
  if (!sample(&b1, &t1) || t1 <= t0) return -1;
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
  return (b1 - b0) / (t1 - t0) * static_cast<double>(cores > 0 ? cores : 1);
}

// OpenMP's threads spin a while when they wait for work (libgomp's default), which is ~10-15%
// faster on an idle machine (ResNet-20 batch 128 on 2 cores: 325 against 277 images/s, medians of
// 3) but on a loaded or oversubscribed one takes the cores the other threads need — the decoding
// workers and the other processes: ResNet-20 batch 64, 3 steps, beside two busy loops on 2 cores
// took 11.5 s against 2.0 s with passive waiting (1.2 s idle; bench/RESULTS.md, "OpenMP's
// waiting"). So when others keep half a core or more busy at the start (over 40 ms), tally makes
// its threads wait passively. libgomp reads the policy when it loads, before main: tally sets it
// and runs itself again, once — unless the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set), or
// /proc/self/exe cannot be run (then it carries on as it is). A load that begins later is not seen.
void wait_passively_if_loaded(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) return;
  const char* fake = std::getenv("TALLY_TEST_BUSY_CORES");  // tests fake the machine's load
  const double busy = fake != nullptr ? std::atof(fake) : busy_cores();
  if (busy < 0.5) return;  // half a core's worth or more in use by others: loaded
  const std::string why = fmt::format("{:.1f}", busy);
  if (::setenv("OMP_WAIT_POLICY", "passive", 1) != 0 || ::setenv("TALLY_SET_OMP_WAIT_POLICY", why.c_str(), 1) != 0)
    return;
  ::execv("/proc/self/exe", argv);  // returns only if it failed
  ::unsetenv("TALLY_SET_OMP_WAIT_POLICY");
  ::unsetenv("OMP_WAIT_POLICY");
}

// For --version: how this process's OpenMP threads wait, and who chose it.
std::string omp_waiting() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (const char* others = std::getenv("TALLY_SET_OMP_WAIT_POLICY"); others != nullptr && policy != nullptr)
    return fmt::format("OpenMP waiting: {} (set by tally: {} cores busy at the start; OMP_WAIT_POLICY or "
                       "GOMP_SPINCOUNT chooses)", policy, others);
  if (policy == nullptr && spin == nullptr)
    return "OpenMP waiting: libgomp's default, spinning a while (the machine was idle at the start)";
  return fmt::format("OpenMP waiting: the environment's ({}{}{})", policy ? fmt::format("OMP_WAIT_POLICY={}", policy) : "",
                     policy && spin ? ", " : "", spin ? fmt::format("GOMP_SPINCOUNT={}", spin) : "");
}
}  // namespace

namespace tally::app {

int command_line(int argc, char** argv) {
  wait_passively_if_loaded(argv);
  // Line by line into a file or a pipe too: a run's log (its checkpoints above all) is there when
  // the run is killed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  name_options_as_flags(true);  // the library's errors name what this program's users typed: its flags
  CLI::App app{"tally — deep learning with micro-batch processing and exact memory accounting"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "print the build configuration and whether a GPU is present");
  // Each command's flags come from one table (apps/options.h), parsed into its options.
  app::TrainOptions to;
  auto* train_cmd = app.add_subcommand("train", "train a ResNet on a data set");
  app::add_options(*train_cmd, to);
  app::SweepOptions so;
  auto* sweep_cmd = app.add_subcommand("sweep", "train each batch size of a list from the same weights: accuracy, "
                                                "speed and memory per batch size (sweep.csv, sweep.svg)");
  app::add_options(*sweep_cmd, so);
  app::PlanOptions po;
  auto* plan_cmd = app.add_subcommand("plan", "print the memory plan of a training step (nothing is computed)");
  app::add_options(*plan_cmd, po);
  app::DeviceOptions dvo;
  auto* device_cmd = app.add_subcommand("device", "describe a GPU and save the description, for plans made without it");
  app::add_options(*device_cmd, dvo);
  try {
    app.parse(argc, argv);
    if (train_cmd->parsed() && !to.resume.empty())
      to = app::resumed_options(app::resume_options(to.resume), to, app::given_options(*train_cmd));
    if (sweep_cmd->parsed()) complete_sweep_options(so, app::given_options(*sweep_cmd));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tally: error: {}\n", e.what());
    return 1;
  }
  try {
    if (version) {
      fmt::print("{}\n{}\n", build_info(), omp_waiting());
      return 0;
    }
    if (app.get_subcommands().empty()) {
      fmt::print(stderr, "{}\ntally: expected a command (train, sweep, plan or device) or --version, found none\n",
                 app.help());
      return 2;
    }
    // A run stopped by a signal has written its checkpoint and said how to resume: 128 + signal,
    // the shell's status for a process ended by that signal.
    if (train_cmd->parsed()) {
      const app::TrainResult r = app::train(to, std::cout);
      return r.stop_signal ? 128 + r.stop_signal : 0;
    }
    if (sweep_cmd->parsed()) {
      int stopped = 0;
      app::sweep(so, std::cout, &stopped);
      return stopped ? 128 + stopped : 0;
    }
    if (device_cmd->parsed()) {
      app::describe_device(dvo, std::cout);
      return 0;
    }
    if (plan_cmd->parsed()) {
      // Under mpirun every rank plans every stage alike; rank 0 speaks.
      std::ofstream silent;
      const bool quiet = tally::distributed::launched_by_mpi() && tally::distributed::have_mpi() &&
                         tally::distributed::process_world()->rank() != 0;
      app::plan(po, quiet ? static_cast<std::ostream&>(silent) : std::cout);
      return 0;
    }
  } catch (const std::exception& e) {
    return fail(e);
  }
  return 0;
}

}  // namespace tally::app
