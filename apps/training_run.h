// apps/training_run.h — what the files of `tally train`'s run share (apps/trainer.cpp: the loop;
// apps/evaluation.cpp; apps/train_checkpoint.cpp; apps/train_report.cpp): this rank's setup, the
// step meter, the evaluation's result, the progress line and the run itself. Not installed.
#pragma once
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <nlohmann/json.hpp>

#include "apps/run_state.h"
#include "apps/setup.h"
#include "apps/trainer.h"
#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "data/data.h"
#include "data/folder.h"
#include "distributed/communicator.h"
#include "distributed/replicas.h"
#include "mbp/checkpoint.h"
#include "mbp/executor.h"
#include "mbp/stage_runner.h"
#include "report/schedule.h"
#include "report/timeline.h"
#include "nn/init.h"
#include "nn/resnet.h"
#include "nn/state_dict.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace tally::app {

// This process's part of the run: its rank, its options (its own --memory-limit of a list, the
// run folder and progress on rank 0 only), its device and where it speaks.
struct RankSetup {
  std::shared_ptr<distributed::Communicator> world;
  int rank = 0, ranks = 1;
  int local_ranks = 1;  // the ranks of this machine, this one included (distributed::neighbours)
  TrainOptions opt;
  Device dev;
  std::ofstream silent;  // the log of ranks other than 0
  std::ostream* log = nullptr;
  std::optional<RunFolderLock> lock;  // rank 0's, on the run folder, for the whole run
};

// Crop + flip for CIFAR and synthetic images, not for the 28x28 grey ones, unless --augment says.
inline bool augments(const TrainOptions& opt, const data::DataSpec& spec) {
  const bool grey_28 = spec.kind == data::DataSpec::Kind::mnist || spec.kind == data::DataSpec::Kind::fashion_mnist;
  return opt.augment.value_or(!grey_28);
}

// The steps' measurements: the steady-state rate (steps after the first this process ran: the
// first warms caches up), the collectives' share, the peaks against the predictions, into the
// run's result. `steps` counts the run's steps (a resumed run's from its checkpoint on).
struct StepMeter {
  double steady_seconds = 0, first_seconds = 0, steady_communication = 0;
  std::int64_t steady_images = 0, first_images = 0, steps = 0, measured = 0, mismatches = 0;

  // A step of `images` that took `seconds`; returns the images per second to show.
  double add(const mbp::StepResult& r, std::int64_t images, double seconds, TrainResult& result) {
    if (measured > 0) {
      steady_seconds += seconds;
      steady_images += images;
      steady_communication += r.communication_seconds;
    } else {
      first_seconds = seconds;
      first_images = images;
    }
    ++steps, ++measured;
    result.peak_bytes = std::max(result.peak_bytes, static_cast<std::int64_t>(r.peak));
    result.predicted_peak_bytes = std::max(result.predicted_peak_bytes, static_cast<std::int64_t>(r.predicted_peak));
    result.host_peak_bytes = std::max(result.host_peak_bytes, static_cast<std::int64_t>(r.host_peak));
    result.host_predicted_peak_bytes =
        std::max(result.host_predicted_peak_bytes, static_cast<std::int64_t>(r.host_predicted_peak));
    result.micro_batch = r.micro_batch;
    result.micro_batches_per_step = r.micro_batches;
    result.oom_retries += r.oom_retries;
    if ((r.peak != r.predicted_peak || r.host_peak != r.host_predicted_peak) && r.oom_retries == 0) ++mismatches;
    return steady_seconds > 0 ? static_cast<double>(steady_images) / steady_seconds
                              : static_cast<double>(images) / seconds;
  }
  // Steps after the first; a run of one step has only the first to report.
  double images_per_second() const {
    return steady_seconds > 0  ? static_cast<double>(steady_images) / steady_seconds
           : first_seconds > 0 ? static_cast<double>(first_images) / first_seconds
                               : 0;
  }
};

// Rolling progress line: step, loss, images/s, arena peak.
class Progress {
 public:
  // `label`: the epoch's, "epoch 2/5" (TrainingRun::epoch_label).
  Progress(std::ostream& os, bool on, std::int64_t total, std::string label)
      : os_(os), on_(on), total_(total), label_(std::move(label)),
        // Under mpirun a terminal is shared with the other ranks' lines: whole lines only there.
        tty_(isatty(STDOUT_FILENO) && !distributed::launched_by_mpi()) {}
  void update(std::int64_t step, double loss, double ips, std::int64_t peak, bool last) {
    if (!on_) return;
    if (!tty_ && !last && step % std::max<std::int64_t>(1, total_ / 10) != 0) return;
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * step / total_) : width;
    fmt::print(os_, "{}{} [{}{}] {}/{} loss {:.4f} | {:.1f} img/s | peak {}{}", tty_ ? "\r" : "", label_,
               std::string(filled, '#'), std::string(width - filled, '.'), step, total_, loss, ips,
               format_bytes(static_cast<std::size_t>(peak)), tty_ && !last ? "" : "\n");
    os_.flush();
  }

 private:
  std::ostream& os_;
  bool on_;
  std::int64_t total_;
  std::string label_;
  bool tty_;
};

struct Eval {
  double loss = 0, accuracy = 0;
};
// The test set's mean loss and accuracy (apps/evaluation.cpp): in batches of at most `max_batch`
// in the activations' dtype `act`; a pipeline's, every rank running its stage on every batch.
Eval evaluate(nn::Module& model, const data::Dataset& ds, bool normalize, Device dev, DType act, std::int64_t max_batch);
Eval evaluate_stages(mbp::StageRunner& executor, nn::Module& model, const data::Dataset& ds, bool normalize,
                     distributed::Communicator& comm, std::int64_t max_batch);
// Every rank's result on rank 0 (a collective), and the run's summary.json (apps/train_report.cpp).
std::vector<RankResult> gather_ranks(distributed::Communicator& comm, const TrainResult& mine);
void write_summary(const TrainOptions& opt, const TrainResult& result);

// One `tally train` run on this rank: everything before the first step is built by the
// constructor (ranks, device, data, the budget with the model and optimizer inside it, the
// executor and its plan, printed; a resumed run's state from its checkpoint); run() trains the
// epochs and reports. Between two steps (boundary, act) it writes the checkpoints that are due and
// stops when a signal asked it to.
// apps/train_setup.cpp: a run's pieces from its options (checked before any work).
const RankSetup& rank_setup(RankSetup& r, const TrainOptions& options, std::ostream& all_log);
// A folder's images found bad as they were read: the training set's (with --skip-bad-images) and
// the evaluation set's (always skipped, data/folder.h: FolderSet::bad_val_images).
struct BadImageLists {
  std::shared_ptr<data::BadImages> train, val;
};
data::Split load_data(const TrainOptions& opt, const data::DataSpec& spec, std::ostream& log,
                      BadImageLists* bad = nullptr);
data::LoaderOptions loader_options(const TrainOptions& opt, bool augment);
std::int64_t checked_per_epoch(const data::Loader& loader, const TrainOptions& opt, const data::Dataset& train_set);
std::shared_ptr<Arena> make_arena(const TrainOptions& opt, Device dev, std::ostream& log);
Setup model_setup(const TrainOptions& opt, const data::Dataset& train_set, const std::shared_ptr<Arena>& arena,
                  const std::string& all_limits);
mbp::ExecutorOptions executor_options(const TrainOptions& opt, const data::Dataset& train_set, const Setup& setup,
                                      Device device, std::shared_ptr<distributed::Communicator> comm,
                                      std::shared_ptr<Arena> host_arena, std::ostream& log);
optim::ScheduleOptions schedule_options(const TrainOptions& opt, const RunSteps& steps);
// apps/train_report.cpp: the traced step as the memory report (memory.html, or a pipeline stage's
// memory-stage{s}.html), and with its timeline (memory_trace.json, memory.svg).
void write_memory_page(const std::filesystem::path& file, const TrainOptions& opt, const Arena& arena, Device dev,
                       std::int64_t step, const mbp::StepResult& r, std::int64_t batch,
                       const mbp::Executor& executor);
void write_timeline(const TrainOptions& opt, Arena& arena, Arena* host, Device dev, std::int64_t step,
                    const mbp::StepResult& r, std::int64_t batch, const mbp::Executor& executor);

class TrainingRun {
 public:
  TrainingRun(const TrainOptions& options, std::ostream& all_log, std::ostream* progress);
  TrainResult run();

 private:
  void print_header(const Setup& setup) const;
  void print_plan(const mbp::Plan& plan) const;
  void open_metrics();
  void append_metrics(const std::string& text);  // to metrics.csv; an Error naming it when the write fails
  void train_epoch(std::int64_t epoch, std::int64_t epochs);
  void end_epoch(std::int64_t epoch, std::int64_t epochs);
  // A step enqueued (mbp::Executor::step_enqueued) whose loss-dependent bookkeeping waits for its
  // loss — on a GPU until the next step is enqueued (docs/mbp.md, "The loss, a step late").
  struct EnqueuedStep {
    std::int64_t step = 0, epoch = 0, position = 0;  // position: the epoch's steps done with it
    mbp::StepResult result;
    double ips = 0, lr = 0;
    bool last = false;  // the epoch's last step
  };
  // Its loss (waiting for it if need be), then the divergence check, the epoch's loss, the progress
  // line and the metrics row.
  void finish_step(EnqueuedStep& s, Progress& bar);
  // Between steps: whether a checkpoint or a stop comes now (signals, the checkpoint schedule, and
  // under mpirun every rank's view, a collective), then doing it. Every rank decides every step.
  struct Boundary {
    int stop = 0;
    bool checkpoint = false;
    bool acts() const { return stop != 0 || checkpoint; }
  };
  Boundary boundary();
  bool act(const Boundary& b);  // true: stop here
  void write_checkpoint();
  nlohmann::json checkpoint_state(const std::vector<double>& limits, const std::vector<std::string>& tuning) const;
  std::vector<std::string> tuning_records() const;  // every rank's (a collective); none without tuning
  void restore();
  void replay_conv_tuning(const std::filesystem::path& checkpoint_dir);
  void check_data_fingerprint(const nlohmann::json& state) const;
  void report_stop() const;
  void write_schedule(std::int64_t step, const mbp::StepResult& r);
  void finish();
  void report_graphs();  // --cuda-graphs: recorded and replayed micro-batches (log, summary)
  void write_profile(std::int64_t step);
  Error diverged(std::int64_t step, double lr) const;
  // "epoch 2/5", or for an epoch --steps ends early "epoch 1/1 (3 of its 117 steps)".
  std::string epoch_label(std::int64_t epoch, std::int64_t epochs) const;  // a loss that is not finite, with what may have caused it

  const TrainOptions& run_options_;   // the run's, as given: the same on every rank (state.json, checks)
  RankSetup rank_;
  const TrainOptions& rank_options_;  // this rank's (rank_.opt): its --memory-limit of a list, output on rank 0 only
  std::ostream& log_;
  std::ostream& progress_;  // the progress bar's stream: log_, or the caller's (tally sweep: the terminal)
  Profiler profiler_;  // --profile: time per op over the steps after the first
  data::DataSpec data_spec_;  // --data, parsed
  BadImageLists bad_images_;  // a folder's images skipped as bad
  std::set<std::string> bad_val_named_;  // the evaluation set's bad images named so far
  std::string not_evaluated_ = "--no-eval";  // why the epochs' lines have no test loss
  data::Split split_;
  data::Loader loader_;
  std::int64_t per_epoch_;
  RunSteps steps_;
  std::string collectives_;  // how CUDA tensors travel between ranks, in words (filled when comm_ is made)
  // Made before the arena: NCCL's device buffers are then already taken when `--memory-limit auto`
  // measures the free memory (docs/distributed.md).
  std::shared_ptr<distributed::Communicator> comm_;
  std::shared_ptr<Arena> arena_;
  std::shared_ptr<Arena> host_arena_;  // the host tier (--host-memory-limit), or null
  ArenaScope in_budget_;  // every tensor of the run (evaluation too) comes from the budget
  Setup setup_;
  optim::LRSchedule schedule_;
  std::unique_ptr<mbp::Executor> executor_;  // the step (a pipeline stage's runs its micro-batches through a StageRunner)
  distributed::Shard share_;  // this rank's share of every global batch (drop_last: always full)
  TrainResult result_;
  Eval eval_;
  StepMeter meter_;
  double last_loss_ = 0;                // of the last step whose loss was read
  double epoch_loss_ = 0;               // the losses of this epoch's steps so far, summed
  std::int64_t epoch_steps_ = 0;
  bool epoch_end_pending_ = false;      // resumed right after an epoch's last step, before its evaluation
  std::ofstream metrics_;
  std::string metrics_text_;            // metrics.csv so far, kept with every checkpoint
  CheckpointEvery every_;
  std::optional<StopSignals> signals_;  // with a run folder: a signal stops the run at a step boundary
  TestFaults faults_;                   // tests (apps/run_state.h)
  std::chrono::steady_clock::time_point last_checkpoint_ = std::chrono::steady_clock::now();
  int stopped_ = 0;                     // the signal that stopped the run
};

}  // namespace tally::app
