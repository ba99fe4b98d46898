// apps/trainer.h — the training loop behind `tally train`, as a library so tests can run it.
//
// One run: load the data set, build the model (ResNet family, torchvision names), optionally
// load initial weights, plan the micro-batches that fit the memory limit (mbp/), train with SGD
// or AdamW under a learning-rate schedule, evaluate after every epoch, optionally save the
// weights, and write metrics.csv, summary.json, memory_trace.json, memory.svg and memory.html to --out.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apps/options.h"
#include "data/images.h"

namespace tally::app {

// The options of `tally train` (apps/options.h holds their flags, help and rules): the step's
// (StepOptions: model, batch, budget, micro-batch, recomputation, precision, pipeline) and the run's.
struct TrainOptions : StepOptions {
  std::string data = "synthetic";  // synthetic[:CxHxW] | mnist:DIR | fashion-mnist[:DIR] | cifar10:DIR | cifar100:DIR | folder:DIR
  // A folder of pictures (data/folder.h): one sample's shape CxHxW ("auto": none given; a folder
  // needs one), the share of the training images held out for evaluation without DIR/val ("none"
  // or a number in (0, 1)), and the pixel bound of an image's header.
  std::string input = "auto";
  std::string transform = "imagenet";
  bool skip_bad_images = false;  // a folder's bad image: skipped, counted and listed (else an error)  // a folder's: imagenet (random resized crop and flip; resize and centre crop) | none
  int workers = 0;  // the threads decoding a folder's images (0: OpenMP's default, printed)
  std::string val_fraction = "none";
  std::int64_t max_image_pixels = data::kDefaultMaxImagePixels;
  std::int64_t epochs = 2;
  std::optional<std::int64_t> steps;  // overrides epochs when set
  double lr = 0.1, weight_decay = 5e-4;
  bool nesterov = false;
  std::string schedule = "cosine";  // optim::schedule_names()
  double warmup_epochs = 0;
  double label_smoothing = 0;
  std::optional<bool> augment;  // default: on, except for MNIST and Fashion-MNIST
  bool shuffle = true, normalize = true;
  std::uint64_t seed = 0;
  int threads = 0;  // 0: leave the default
  bool profile = false;  // time per op over the steps after the first (GPU time on CUDA, host time on the CPU; profile.txt)
  std::string init, save, out;
  bool progress = true;  // progress bar on stdout
  bool evaluate = true;  // the test set after every epoch (off: training steps only, e.g. for timing)
  // exact (the full batch's mean for any split) or per_micro_batch (each micro-batch's mean divided
  // by their number, as the MBP paper's code: differs for uneven splits; for teaching).
  mbp::LossNormalization loss_normalization = mbp::LossNormalization::exact;
  // Training-state checkpoints into --out (docs/checkpoints.md; apps/run_state.h): "" (none), "N"
  // (every N steps) or a time ("90s", "10m", "2h"). With --out, a run also writes one when it is
  // stopped by a signal (SIGINT or SIGTERM in one process, SIGUSR1 under mpirun) and at its end.
  std::string checkpoint_every;
  // A run folder to continue from its newest checkpoint, bit for bit as if never interrupted. The
  // options must be the run's (resume_options(dir) gives them; options_changeable_on_resume() lists
  // the few that may change); the weights come from the checkpoint, not from --init.
  std::string resume;
  // Tests: fail the n-th arena allocation of this (0-based) step once, to exercise recovery.
  std::optional<std::pair<std::int64_t, std::uint64_t>> inject_oom;
};

// One rank's memory plan in a data-parallel run (summary.json's "ranks").
struct RankResult {
  int rank = 0;
  std::string segments;        // a pipeline stage's ("stem .. layer2.0"); empty otherwise
  std::int64_t parameters = 0;  // elements this rank trains (its stage's, or the whole model's)
  std::int64_t memory_limit_bytes = 0, micro_batch = 0, micro_batches_per_step = 0, predicted_peak_bytes = 0,
               peak_bytes = 0;
  // Steps after the first: seconds per step, and of those in collectives (a pipeline stage: waiting
  // for the other stages).
  double seconds_per_step = 0, communication_seconds_per_step = 0;
};

struct TrainResult {
  // images/s over the steps after the first (the first warms caches); of the first when it is the only one.
  double test_accuracy = 0, test_loss = 0, train_loss = 0, images_per_second = 0;
  bool evaluated = true;  // the test set was evaluated (not with --no-eval, nor for a folder without one)
  std::int64_t peak_bytes = 0;            // highest measured peak of a training step
  std::int64_t predicted_peak_bytes = 0;  // the planner's prediction for those steps
  std::int64_t memory_limit_bytes = 0, micro_batch = 0, micro_batches_per_step = 0;
  // The host tier (docs/host-tier.md; 0 and "device" without one): its capacity, its highest
  // measured step peak and the plan's prediction for it, and the placement the steps ran with.
  std::int64_t host_memory_limit_bytes = 0, host_peak_bytes = 0, host_predicted_peak_bytes = 0;
  std::string placement = "device";
  std::int64_t steps = 0, oom_retries = 0;
  std::string device;
  // Data parallelism: host seconds per step in collectives (steps after the first; rank 0's); a
  // pipeline: rank 0's waiting for the other stages. Per rank in `ranks`.
  double communication_seconds_per_step = 0, seconds_per_step = 0;
  std::string recompute = "none";   // the policy the run used
  std::string precision = "fp32";
  std::string memory_format = "contiguous";  // the activations' layout the run used (auto resolved)
  int world_size = 1;               // ranks of a data-parallel or pipeline run (mpirun -np N), else 1
  // Device memory the communication library (NCCL) took outside the arena on rank 0, measured at start.
  std::int64_t communication_library_bytes = 0;
  // --cuda-graphs on: micro-batches recorded as CUDA graphs and replayed (mbp::Executor::GraphStats),
  // and the device memory the graphs took outside the arena.
  std::int64_t graphs_recorded = 0, graphs_replayed = 0, graph_device_bytes = 0;
  int pipeline_stages = 1;
  std::int64_t parameters = 0;      // elements this rank trains (a pipeline stage's)
  std::vector<RankResult> ranks;    // one per rank
  // A run stopped by a signal before its end: the signal (SIGINT, SIGTERM, SIGUSR1), after a
  // checkpoint was written (the command line exits with 128 + signal); 0 for a finished run.
  int stop_signal = 0;
  std::string checkpoint;           // the last checkpoint written or resumed from ("" if none)
  std::int64_t resumed_from = -1;   // the step a resumed run continued after, else -1
};

// Validates every option first (a bad value is a tally::Error listing the allowed values). The
// progress bar (TrainOptions::progress) goes to `progress` when given, else to `log`.
TrainResult train(const TrainOptions& opt, std::ostream& log, std::ostream* progress = nullptr);

// The checks train() starts with, on their own: every option (not the data set's files); returns
// the device the run would use.
std::string check_train_options(const TrainOptions& opt);

// A run's steps when an epoch has `per_epoch` of them: in all (--steps, or --epochs epochs) and
// of warm-up (--warmup-epochs, rounded).
struct RunSteps {
  std::int64_t total = 0, warmup = 0;
};
RunSteps run_steps(const TrainOptions& opt, std::int64_t per_epoch);

// What --data holds: one sample's shape, the class count and the training set's size (loads it).
struct DataInfo {
  std::int64_t channels = 0, height = 0, width = 0, num_classes = 0, train_size = 0;
};
DataInfo describe_data(const TrainOptions& opt);

}  // namespace tally::app
