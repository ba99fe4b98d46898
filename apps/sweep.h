// apps/sweep.h — `tally sweep`: the batch-size experiment as one command.
//
// For each batch size B of a list, one `tally train` run (apps/trainer.h) from the same initial
// weights (the same seed) and the same budget of epochs or steps, with the learning rate scaled
// from the first batch size B0 of the list: lr * B / B0 (linear, the default, with the warm-up
// the options give) or lr * sqrt(B / B0). Every batch runs through the micro-batches the planner
// picks for the memory limit, so batch sizes far beyond memory train as their full batch would.
// Before any training, every batch size is planned (a dry run, as `tally plan`): a bad list, a
// batch below 1 or above the training set, or a limit that cannot hold even one sample is an
// error. Results go to --out: sweep.csv (a row per batch size), sweep.svg (report/sweep.h: test
// accuracy and images/s against batch size on a log axis, the batches that needed micro-batches
// marked, the memory limit stated) and one folder per run (b<B>/: the run's log, metrics,
// summary, memory timeline). A line per run shows the sweep's progress, and the running run's
// progress bar the run's (--no-progress: the lines only); --no-eval skips the test set (timing
// sweeps: no accuracy).
#pragma once
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "apps/trainer.h"

namespace tally::app {

struct SweepOptions {
  // A warm-up of half an epoch by default: linear scaling comes with one (Goyal et al. 2017).
  SweepOptions() { train.warmup_epochs = 0.5; }
  TrainOptions train;  // batch_size, out, save and init are set per run
  std::string batch_sizes = "128,256,512,1024";
  LrScaling lr_scaling = LrScaling::linear;
  // Whether train.warmup_epochs is the user's. The sweep's default (half an epoch, which linear
  // scaling wants) adapts to a run shorter than that: it warms up over half the run's steps. A
  // warm-up the user gave that does not fit a run is an error.
  bool warmup_given = false;
  // A sweep folder to continue (--resume; docs/checkpoints.md): its finished runs are kept, the
  // interrupted one resumes from its newest checkpoint, the rest run. The options are the sweep's
  // (sweep_resume_options gives them); train.checkpoint_every may change.
  std::string resume;
};

struct SweepRow {
  std::int64_t batch_size = 0, micro_batch = 0, micro_batches_per_step = 0, steps = 0;
  double lr = 0, train_loss = 0, images_per_second = 0;
  std::optional<double> test_accuracy;  // none with --no-eval
  std::int64_t predicted_peak_bytes = 0, peak_bytes = 0;
  double wall_seconds = 0;
};

// "128,256,512" -> {128, 256, 512}; an empty item, a non-number, a value below 1 or a repeated
// size is an Error naming the item.
std::vector<std::int64_t> parse_batch_sizes(const std::string& list);

// The learning rate of batch b when `lr` is that of b0 (linear: lr*b/b0, sqrt: lr*sqrt(b/b0)).
double scaled_lr(double lr, std::int64_t b, std::int64_t b0, LrScaling rule);

// Every run of the sweep. When a run is stopped by a signal (apps/trainer.h), the sweep stops after
// it and sets *stop_signal (when given) to the signal; the rows are those finished.
std::vector<SweepRow> sweep(const SweepOptions& opt, std::ostream& log, int* stop_signal = nullptr);

// The options of the sweep in folder `dir` (its sweep.json), with resume = out = dir; tally::Error
// if there is none.
SweepOptions sweep_resume_options(const std::string& dir);

}  // namespace tally::app
