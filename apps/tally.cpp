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
#include <map>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/plan.h"
#include "apps/run_state.h"
#include "apps/setup.h"
#include "apps/sweep.h"
#include "apps/trainer.h"
#include "core/device.h"
#include "distributed/communicator.h"
#include "nn/resnet.h"
#include "optim/schedule.h"

using namespace tally;

namespace {

// --recompute: mbp::check_recompute_policy's rule, as a command-line check.
CLI::Validator recompute_validator() {
  return CLI::Validator(
      [](std::string& value) {
        try {
          mbp::check_recompute_policy(value);
        } catch (const Error& e) {
          const std::string what = e.what(), flag = "--recompute ";
          return what.rfind(flag, 0) == 0 ? what.substr(flag.size()) : what;  // CLI11 names the flag itself
        }
        return std::string();
      },
      "", "recompute");
}

// A number option, checked by its rule (apps/setup.h: the same rule and words as the C++ entry
// points; CLI11's own NonNegativeNumber names its range's upper end, DBL_MAX, in 300 digits).
CLI::Validator number(const app::NumberRule& rule, const std::string& what) {
  return CLI::Validator([rule](std::string& value) { return app::number_error(rule, value); }, what, what);
}
CLI::Validator non_negative() { return number(app::kNonNegative, "NUMBER >= 0"); }
CLI::Validator positive_whole() { return number(app::kPositiveWhole, "INTEGER >= 1"); }

// The step's options that `train` (and `sweep`) and `plan` take with one meaning: registered here,
// once, into the command's own fields.
void add_step_options(CLI::App* cmd, std::string& recompute, std::string& precision, std::string& memory_format) {
  cmd->add_option("--recompute", recompute,
                  "auto (the least recomputation with which one sample fits) | none | blocks (the residual blocks and the stem: about one more forward) | all (the stages around the blocks too: the least memory, about two more forwards)")
      ->check(recompute_validator())->capture_default_str();
  cmd->add_option("--precision", precision,
                  "fp32 | bf16 (mixed precision: bf16 activations, float32 weights, gradients, optimizer state and loss)")
      ->check(CLI::IsMember(mbp::precision_names()))->capture_default_str();
  cmd->add_option("--memory-format", memory_format,
                  "auto | contiguous | channels_last (the activations' layout: channels_last runs the CPU's "
                  "convolutions and batch norms on NHWC, with no reorder around each convolution; auto: "
                  "channels_last on a CPU with oneDNN, else contiguous)")
      ->check(CLI::IsMember(mbp::memory_format_names()))->capture_default_str();
}

// The options of `tally train`, registered on `cmd` (also for `tally sweep`, which sets the batch
// size, the output files and the weights per run itself: `sweep` leaves those flags out).
struct TrainFlags {
  app::TrainOptions to;
  std::int64_t classes = 0, steps = 0;
  bool augment = false, no_augment = false, shuffle = false, no_shuffle = false, normalize = false,
       no_normalize = false;
  std::string micro = "auto";

  void add(CLI::App* cmd, bool sweep) {
    const auto& models = nn::model_names();
    cmd->add_option("--model", to.model, app::choices(models))->check(CLI::IsMember(models))->capture_default_str();
    cmd->add_option("--norm", to.norm, app::choices(app::norm_names()))->check(CLI::IsMember(app::norm_names()))
        ->capture_default_str();
    cmd->add_option("--data", to.data,
                    "synthetic|synthetic:CxHxW|mnist:DIR|fashion-mnist|fashion-mnist:DIR|cifar10:DIR|cifar100:DIR")
        ->capture_default_str();
    cmd->add_option("--num-classes", classes, "classes of synthetic data (default 1000 for images >= 64 pixels, else 10)")
        ->check(positive_whole());
    auto* epochs = cmd->add_option("--epochs", to.epochs, sweep ? "epochs per batch size" : "epochs to train")
                       ->check(positive_whole())->capture_default_str();
    cmd->add_option("--steps", steps, "optimizer steps to train (instead of --epochs)")->check(positive_whole())
        ->excludes(epochs);
    if (!sweep)
      cmd->add_option("--batch-size", to.batch_size, "samples per optimizer step")->check(positive_whole())
          ->capture_default_str();
    cmd->add_option("--optimizer", to.optimizer, app::choices(app::optimizer_names()))
        ->check(CLI::IsMember(app::optimizer_names()))->capture_default_str();
    cmd->add_option("--lr", to.lr, sweep ? "learning rate of the first batch size of the list" : "learning rate")
        ->check(non_negative())->capture_default_str();
    cmd->add_option("--momentum", to.momentum, "SGD momentum")->check(non_negative())->capture_default_str();
    cmd->add_flag("--nesterov", to.nesterov, "Nesterov momentum");
    cmd->add_option("--weight-decay", to.weight_decay, "weight decay")->check(non_negative())->capture_default_str();
    cmd->add_option("--schedule", to.schedule, app::choices(optim::schedule_names()))
        ->check(CLI::IsMember(optim::schedule_names()))->capture_default_str();
    cmd->add_option("--warmup-epochs", to.warmup_epochs, "linear warm-up, in epochs")->check(non_negative())
        ->capture_default_str();
    cmd->add_option("--label-smoothing", to.label_smoothing, "label smoothing in [0, 1]")->check(number(app::kFraction, "NUMBER in [0, 1]"))
        ->capture_default_str();
    auto* aug = cmd->add_flag("--augment", augment,
                              "random crop (pad 4) + horizontal flip (default: on, off for MNIST and Fashion-MNIST)");
    cmd->add_flag("--no-augment", no_augment, "no augmentation")->excludes(aug);
    auto* shf = cmd->add_flag("--shuffle", shuffle, "shuffle the training set every epoch (default)");
    cmd->add_flag("--no-shuffle", no_shuffle, "file order: step k uses samples [kB, (k+1)B)")->excludes(shf);
    auto* nrm = cmd->add_flag("--normalize", normalize, "per-channel mean/std normalization (default)");
    cmd->add_flag("--no-normalize", no_normalize, "pixels in [0, 1]")->excludes(nrm);
    cmd->add_option("--seed", to.seed, "seed for initialization, shuffling and augmentation")->capture_default_str();
    cmd->add_option("--device", to.device, "cpu|cuda|cuda:N|auto (auto: the GPU when there is one)")->capture_default_str();
    cmd->add_option("--threads", to.threads, "CPU threads (0: default)")->check(number(app::kNonNegativeWhole, "INTEGER >= 0"));
    cmd->add_flag("--tf32", to.tf32, "CUDA: let float32 GEMMs and convolutions use TF32 tensor cores (off by default)");
    cmd->add_option("--checkpoint-every", to.checkpoint_every,
                    "write a training-state checkpoint into the run folder every N steps (500) or after a time "
                    "(90s, 10m, 2h); also at the run's end and when SIGINT/SIGTERM (SIGUSR1 under mpirun) stops it");
    if (!sweep) {
      cmd->add_flag("--profile", to.profile, "time per op (GPU time on CUDA, host time on the CPU) over the steps after the first, printed and written to profile.txt");
      cmd->add_option("--init", to.init, "initial weights (safetensors, torchvision names)");
      cmd->add_option("--save", to.save, "write the trained weights (safetensors)");
      auto* out = cmd->add_option("--out", to.out, "write metrics.csv and summary.json into this directory");
      cmd->add_option("--resume", to.resume,
                      "continue the run in this folder from its newest checkpoint, bit for bit (its options are "
                      "kept: a flag given again must have the run's value, but for --save, --checkpoint-every, "
                      "--threads, --profile, --no-progress)")
          ->excludes(out);
      cmd->add_flag("!--no-progress", to.progress, "no progress bar");
      cmd->add_flag("!--no-eval", to.evaluate, "skip the test set after each epoch (timing runs; summary.json's test fields are null)");
      cmd->add_option("--pipeline-stages", to.pipeline_stages,
                      "cut the model into S stages, one per rank (mpirun -np S), fed by the micro-batches (CPU)")
          ->check(positive_whole())->capture_default_str();
      cmd->add_option("--pipeline-split", to.pipeline_split,
                      "memory (default: the largest micro-batch that fits, then the smallest largest stage) | work "
                      "(the stages' forward FLOPs balanced) | where stages 2..S begin, by segment name (layer3.0; "
                      "tally plan --pipeline-stages lists them)");
      cmd->add_option("--pipeline-schedule", to.pipeline_schedule,
                      "1f1b (stage s holds at most S - s micro-batches) | gpipe (all forwards, then all backwards)")
          ->check(CLI::IsMember(mbp::pipeline_schedule_names()))->capture_default_str();
    } else {
      auto* out = cmd->add_option("--out", to.out, "folder for sweep.csv, sweep.svg and one folder per run");
      cmd->add_option("--resume", to.resume, "continue the sweep in this folder: finished runs are kept, the "
                                             "interrupted one resumes from its checkpoint")
          ->excludes(out);
    }
    cmd->add_option("--memory-limit", to.memory_limit, "memory budget: a size (48MiB, 2GiB) or auto; under mpirun one per rank (48MiB,24MiB)")->capture_default_str();
    cmd->add_option("--loss-normalization", to.loss_normalization,
                    "exact (the full batch's mean for any split) | per-micro-batch (each micro-batch's mean / k, "
                    "as the MBP paper's code)")
        ->check(CLI::IsMember(app::loss_normalization_names()))->capture_default_str();
    cmd->add_option("--micro-batch", micro, "samples per micro-batch: M or auto (the largest that fits)")
        ->capture_default_str();
    add_step_options(cmd, to.recompute, to.precision, to.memory_format);
  }

  // After parsing: the flags that fill optional fields.
  void finish() {
    if (steps > 0) to.steps = steps;
    if (classes > 0) to.num_classes = classes;
    if (augment) to.augment = true;
    if (no_augment) to.augment = false;
    if (no_shuffle) to.shuffle = false;
    if (no_normalize) to.normalize = false;
    to.micro_batch = app::parse_micro_batch(micro);
  }
};

}  // namespace

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

// The flags given on a command line, by the names of apps/run_state.h's option_values (a "--no-"
// flag by its option's name: --no-augment is "augment").
std::vector<std::string> given_names(const CLI::App* cmd) {
  std::vector<std::string> names;
  for (const CLI::Option* o : cmd->get_options()) {
    if (o->count() == 0 || o->get_lnames().empty()) continue;
    std::string n = o->get_lnames().front();
    if (n.rfind("no-", 0) == 0) n = n.substr(3);
    names.push_back(n);
  }
  return names;
}

// `tally train --resume DIR [flags]`: the run's saved options; a flag given again must keep the
// run's value, except the few that may change (apps/run_state.h), which are taken.
app::TrainOptions resumed(const app::TrainOptions& saved, const app::TrainOptions& given,
                          const std::vector<std::string>& names) {
  app::check_resume_options(saved, given, names);
  auto listed = [](const std::vector<std::string>& list, const std::string& n) {
    return std::find(list.begin(), list.end(), n) != list.end();
  };
  std::map<std::string, std::string> values;
  for (const auto& [name, value] : app::option_values(saved)) values[name] = value;
  for (const auto& [name, value] : app::option_values(given))
    if (listed(names, name) && listed(app::options_changeable_on_resume(), name)) values[name] = value;
  app::TrainOptions o = app::options_from_values(values, "--resume " + saved.resume);
  o.resume = saved.resume;
  return o;
}

// `tally plan`'s flags.
struct PlanFlags {
  app::PlanOptions po;
  std::int64_t classes = 0;
  std::string micro = "auto";
  bool no_layers = false;

  void add(CLI::App* cmd) {
    const auto& models = nn::model_names();
    cmd->add_option("--model", po.model, app::choices(models))->check(CLI::IsMember(models))->capture_default_str();
    cmd->add_option("--norm", po.norm, app::choices(app::norm_names()))->check(CLI::IsMember(app::norm_names()))->capture_default_str();
    cmd->add_option("--input", po.input, "one sample's shape CxHxW")->capture_default_str();
    cmd->add_option("--num-classes", classes, "classes (default 1000 for inputs >= 64 pixels, else 10)")->check(positive_whole());
    cmd->add_option("--batch-size", po.batch_size, "samples per optimizer step")->check(positive_whole())->capture_default_str();
    cmd->add_option("--memory-limit", po.memory_limit, "memory budget: a size (8GiB) or auto")->capture_default_str();
    cmd->add_option("--micro-batch", micro, "check this micro-batch size instead of searching")->capture_default_str();
    cmd->add_option("--optimizer", po.optimizer, app::choices(app::optimizer_names()))->check(CLI::IsMember(app::optimizer_names()))->capture_default_str();
    cmd->add_option("--momentum", po.momentum, "SGD momentum (0: no momentum buffer)")->check(non_negative())->capture_default_str();
    cmd->add_option("--device", po.device, "cpu|cuda|cuda:N")->capture_default_str();
    add_step_options(cmd, po.recompute, po.precision, po.memory_format);
    cmd->add_option("--pipeline-stages", po.pipeline_stages, "plan S pipeline stages (memory limits: one, or one per stage)")
        ->check(positive_whole())->capture_default_str();
    cmd->add_option("--pipeline-split", po.pipeline_split, "memory (default) | work | where stages 2..S begin, by segment name");
    cmd->add_option("--pipeline-schedule", po.pipeline_schedule, "1f1b | gpipe")
        ->check(CLI::IsMember(mbp::pipeline_schedule_names()))->capture_default_str();
    cmd->add_flag("--no-layers", no_layers, "skip the per-layer table");
  }
  void finish() {
    if (classes > 0) po.num_classes = classes;
    po.micro_batch = app::parse_micro_batch(micro);
    po.layers = !no_layers;
  }
};

int main(int argc, char** argv) {
  CLI::App app{"tally — deep learning with micro-batch processing and exact memory accounting"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "print the build configuration and whether a GPU is present");
  TrainFlags train_flags;
  auto* train_cmd = app.add_subcommand("train", "train a ResNet on a data set");
  train_flags.add(train_cmd, false);
  TrainFlags sweep_flags;
  app::SweepOptions so;
  auto* sweep_cmd = app.add_subcommand("sweep", "train each batch size of a list from the same weights: accuracy, "
                                                "speed and memory per batch size (sweep.csv, sweep.svg)");
  sweep_flags.to.warmup_epochs = 0.5;  // linear scaling comes with a warm-up (Goyal et al. 2017)
  sweep_flags.add(sweep_cmd, true);
  sweep_cmd->add_option("--batch-sizes", so.batch_sizes, "comma-separated batch sizes, e.g. 128,256,512,1024")
      ->capture_default_str();
  sweep_cmd->add_option("--lr-scaling", so.lr_scaling, "linear (lr * B / B0) | sqrt (lr * sqrt(B / B0))")
      ->check(CLI::IsMember({"linear", "sqrt"}))->capture_default_str();

  PlanFlags plan_flags;
  auto* plan_cmd = app.add_subcommand("plan", "print the memory plan of a training step (nothing is computed)");
  plan_flags.add(plan_cmd);
  try {
    app.parse(argc, argv);
    if (train_cmd->parsed()) {
      train_flags.finish();
      if (!train_flags.to.resume.empty())
        train_flags.to = resumed(app::resume_options(train_flags.to.resume), train_flags.to, given_names(train_cmd));
    }
    if (sweep_cmd->parsed()) {
      sweep_flags.finish();
      so.train = sweep_flags.to;
      so.warmup_given = sweep_cmd->get_option("--warmup-epochs")->count() > 0;
      if (!so.train.resume.empty()) {
        const std::vector<std::string> names = given_names(sweep_cmd);
        app::SweepOptions saved = app::sweep_resume_options(so.train.resume);
        so.resume = so.train.resume;
        app::check_sweep_resume(saved, so, names);
        saved.train = resumed(saved.train, so.train, names);
        so = saved;
      }
    }
    if (plan_cmd->parsed()) plan_flags.finish();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tally: error: {}\n", e.what());
    return 1;
  }
  try {
    if (version || app.get_subcommands().empty()) {
      fmt::print("{}\n", build_info());
      return 0;
    }
    // A run stopped by a signal has written its checkpoint and said how to resume: 128 + signal,
    // the shell's status for a process ended by that signal.
    if (train_cmd->parsed()) {
      const app::TrainResult r = app::train(train_flags.to, std::cout);
      return r.stop_signal ? 128 + r.stop_signal : 0;
    }
    if (sweep_cmd->parsed()) {
      int stopped = 0;
      app::sweep(so, std::cout, &stopped);
      return stopped ? 128 + stopped : 0;
    }
    if (plan_cmd->parsed()) {
      // Under mpirun every rank plans every stage alike; rank 0 speaks.
      std::ofstream silent;
      const bool quiet = tally::distributed::launched_by_mpi() && tally::distributed::have_mpi() &&
                         tally::distributed::process_world()->rank() != 0;
      app::plan(plan_flags.po, quiet ? static_cast<std::ostream&>(silent) : std::cout);
      return 0;
    }
  } catch (const std::exception& e) {
    return fail(e);
  }
  return 0;
}
