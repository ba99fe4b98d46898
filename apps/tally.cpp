// apps/tally.cpp — the tally command line.
//   tally --version        build configuration (CUDA, cuDNN) and whether a GPU is present
//   tally train [options]  train a ResNet (see apps/trainer.h and README.md for the options)
//   tally plan [options]   the memory plan of a training step: per-layer table, micro-batch
//                          size, predicted peak (see apps/plan.h); nothing is computed
//   tally sweep [options]  the batch-size experiment: a run per batch size (see apps/sweep.h)
#include <cstdio>
#include <algorithm>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/device.h"
#include "apps/options.h"
#include "apps/plan.h"
#include "apps/run_state.h"
#include "apps/sweep.h"
#include "apps/trainer.h"
#include "core/device.h"
#include "distributed/communicator.h"

using namespace tally;

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

int main(int argc, char** argv) {
  // Line by line into a file or a pipe too: a run's log (its checkpoints above all) is there when
  // the run is killed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
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
      fmt::print("{}\n", build_info());
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
