// apps/trainer.cpp — the training loop of `tally train` (apps/trainer.h): the run built from its
// pieces (apps/train_setup.cpp: the options checked, the rank, the data, the model), its epochs and
// steps, and the boundaries between steps. Evaluation, checkpoints and reports are in
// apps/evaluation.cpp, apps/train_checkpoint.cpp and apps/train_report.cpp (apps/training_run.h
// holds what they share).
#include "apps/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "apps/run_state.h"
#include "apps/setup.h"
#include "apps/training_run.h"
#include "core/autograd.h"
#include "core/machine.h"
#include "core/memory.h"
#include "data/folder.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "nn/state_dict.h"
#include "data/data.h"
#include "distributed/communicator.h"
#include "distributed/replicas.h"
#include "nn/init.h"
#include "nn/resnet.h"
#include "mbp/checkpoint.h"
#include "mbp/executor.h"
#include "mbp/stage_runner.h"
#include "report/schedule.h"
#include "report/memory_html.h"
#include "report/timeline.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"


namespace tally::app {


TrainingRun::TrainingRun(const TrainOptions& options, std::ostream& all_log, std::ostream* progress)
    : run_options_(options),
      rank_options_(rank_setup(rank_, options, all_log).opt),
      log_(*rank_.log),
      progress_(progress ? *progress : log_),
      profiler_(rank_.dev, rank_options_.profile),
      data_spec_(data::parse_data_spec(rank_options_.data)),
      split_(load_data(rank_options_, data_spec_, log_, &bad_images_)),
      loader_(split_.train, loader_options(rank_options_, augments(rank_options_, data_spec_))),
      per_epoch_(checked_per_epoch(loader_, rank_options_, split_.train)),
      steps_(run_steps(rank_options_, per_epoch_)),
      // A process mpirun did not start works alone: the local communicator on any device (no NCCL
      // communicator of one, whose buffers lie outside the arena and which made the run data-parallel,
      // refusing the host tier's gradients placement).
      comm_(rank_.world->backend() == "local" ? rank_.world
                                                : distributed::for_device(rank_.world, rank_.dev,
                                                                          rank_options_.pipeline_stages > 1
                                                                              ? distributed::Collectives::mpi
                                                                              : rank_options_.collectives,
                                                                          &collectives_)),
      arena_(make_arena(rank_options_, rank_.dev, log_)),
      host_arena_(make_host_arena(rank_options_.host_memory_limit, rank_.dev, arena_->capacity(), nullptr, &log_,
                                  rank_.local_ranks)),
      in_budget_(arena_),
      setup_(model_setup(rank_options_, split_.train, arena_, options.memory_limit)),
      schedule_(schedule_options(rank_options_, steps_)),
      executor_(std::make_unique<mbp::Executor>(
          *setup_.model, *setup_.optimizer, arena_,
          executor_options(rank_options_, split_.train, setup_, rank_.dev, comm_, host_arena_, log_))),
      // A pipeline's stages all see the whole batch (the first its images, the last its labels).
      share_(setup_.stage ? distributed::shard(rank_options_.batch_size, 1, 0)
                          : distributed::shard(rank_options_.batch_size, rank_.ranks, rank_.rank)),
      every_(parse_checkpoint_every(rank_options_.checkpoint_every)),
      faults_(TestFaults::from_environment(rank_.rank, rank_options_.inject_oom)) {
  // Every rank takes the same decision; a pipeline writes no checkpoints, so a signal just ends it.
  if (!run_options_.out.empty() && !setup_.stage) signals_.emplace(rank_.ranks == 1);
  if (split_.test.size() == 0 && rank_.opt.evaluate) {  // a folder with no val/ and no --val-fraction
    rank_.opt.evaluate = false;
    not_evaluated_ = "no evaluation set";
    fmt::print(log_, "no evaluation: {} has no val folder and --val-fraction is none\n", rank_options_.data);
  }
  print_header(setup_);
  if (!collectives_.empty()) fmt::print(log_, "collectives: {}\n", collectives_);
  result_.communication_library_bytes = static_cast<std::int64_t>(comm_->library_bytes());
  if (const std::size_t bytes = comm_->library_bytes(); bytes > 0)
    fmt::print(log_, "communication library, measured at start: {} of device memory outside the arena\n",
               format_bytes(bytes));
  if (!rank_options_.resume.empty()) restore();
  // Every rank starts from rank 0's weights (a pipeline's stages: the same seed built the same model).
  if (!setup_.stage) distributed::broadcast_parameters(*setup_.model, *comm_);
  if (setup_.stage) {
    const mbp::PipelineStage& st = *setup_.stage;
    fmt::print(log_, "pipeline: {} stages over {} ({}), schedule {}, cut {}\n", st.stages, comm_->backend(),
               run_options_.memory_limit, mbp::pipeline_schedule_name(st.schedule),
               cut_description(rank_options_.pipeline_split));
    for (int s = 0; s < st.stages; ++s) {
      const auto ss = static_cast<std::size_t>(s);
      fmt::print(log_, "  stage {} (rank {}): {}\n", s, s, mbp::segment_range(setup_.segments, st.bounds[ss], st.bounds[ss + 1]));
    }
    fmt::print(log_, "  {}\n", work_line(setup_.segment_costs, st.bounds));
  } else if (rank_.ranks > 1)
    fmt::print(log_, "data parallel: {} ranks over {} ({}), rank 0 takes {} of the {} samples of a step, each rank "
                     "plans its own micro-batches\n",
               rank_.ranks, comm_->backend(), run_options_.memory_limit, share_.size, rank_options_.batch_size);
  print_plan(plan_step(*executor_, share_.size, rank_options_.micro_batch));
  log_.flush();  // the plan is on screen before the first (possibly long) step
}

TrainResult TrainingRun::run() {
  open_metrics();
  result_.device = rank_.dev.str();
  result_.recompute = executor_->recompute_choice().name;
  result_.precision = name_of(rank_options_.precision);
  result_.memory_format = memory_format_name(executor_->memory_format());
  result_.memory_limit_bytes = static_cast<std::int64_t>(arena_->capacity());
  if (host_arena_) result_.host_memory_limit_bytes = static_cast<std::int64_t>(host_arena_->capacity());
  const std::int64_t epochs = (steps_.total + per_epoch_ - 1) / per_epoch_;
  if (epoch_end_pending_) end_epoch((meter_.steps - 1) / per_epoch_, epochs);
  for (std::int64_t epoch = meter_.steps / per_epoch_; epoch < epochs && meter_.steps < steps_.total && !stopped_; ++epoch)
    train_epoch(epoch, epochs);
  if (stopped_) {
    report_stop();
    result_.stop_signal = stopped_;
    return result_;
  }
  finish();
  return result_;
}

void TrainingRun::train_epoch(std::int64_t epoch, std::int64_t epochs) {
  using clock = std::chrono::steady_clock;
  // The step whose memory timeline is written: the second (steady state) if there is one.
  const std::int64_t traced_step = steps_.total > 1 ? 1 : 0;
  const std::int64_t sample_numel = split_.train.channels * split_.train.height * split_.train.width;
  const std::int64_t first_batch = meter_.steps - epoch * per_epoch_;  // > 0: resumed inside this epoch
  loader_.start_epoch(epoch, first_batch);
  if (first_batch == 0) epoch_loss_ = 0, epoch_steps_ = 0;
  const std::int64_t in_epoch = std::min(per_epoch_, steps_.total - epoch * per_epoch_);
  Progress bar(progress_, rank_options_.progress, in_epoch, epoch_label(epoch, epochs));
  std::optional<EnqueuedStep> enqueued;  // a step whose loss is still on its way
  while (meter_.steps < steps_.total && epoch_steps_ < in_epoch) {
    const std::int64_t step = meter_.steps;
    // A step's time runs from asking for its batch (a loader that cannot keep up counts) to the
    // bookkeeping of the step before it, whose loss — on a GPU read a step late — paces the loop:
    // in steady state, the device's time per step. Writing the traced step's files and checkpoints
    // does not count.
    const auto t0 = clock::now();
    std::optional<data::Batch> b = loader_.next();
    if (!b) break;
    setup_.optimizer->set_lr(schedule_.lr_at(step));
    // Rank 0 writes the run folder's timeline; a pipeline's other stages their own memory report.
    const bool stage_page = setup_.stage && rank_.rank > 0 && !run_options_.out.empty();
    const bool trace = step == traced_step && (!rank_options_.out.empty() || stage_page);
    if (trace) {
      arena_->set_tracing(true);
      if (host_arena_) host_arena_->set_tracing(true);
    }
    faults_.before_step(step, *arena_);
    mbp::StepResult r = executor_->step_enqueued(b->images.data() + share_.offset * sample_numel,
                                                 b->labels.data() + share_.offset, share_.size);
    arena_->fail_allocation_after(0);
    result_.placement = mbp::placement_name(executor_->placement_choice().placement);
    if (trace) {
      arena_->set_tracing(false);
      if (host_arena_) host_arena_->set_tracing(false);
    }
    // The last step's bookkeeping, now that this one is enqueued (its loss came while this computes).
    if (enqueued) finish_step(*enqueued, bar), enqueued.reset();
    // A step whose loss is taken at once below — the epoch's or the run's last, or one a checkpoint
    // every --checkpoint-every steps follows — has no later step to pace: its wait for the device is
    // its own time (else a run of one step timed only its enqueueing). Checkpoints by seconds and
    // signals are not known yet: the step before them is timed without its device's tail.
    const bool checkpoint_next = every_.steps > 0 && (step + 1) % every_.steps == 0;
    if (epoch_steps_ + 1 == in_epoch || step + 1 == steps_.total || checkpoint_next) (void)r.pending_loss.get();
    const auto t1 = clock::now();
    if (trace) {
      if (stage_page) {  // into rank 0's run folder where this machine sees it (ranks on one machine)
        const std::filesystem::path dir(run_options_.out);
        if (std::filesystem::is_directory(dir))
          write_memory_page(dir / fmt::format("memory-stage{}.html", rank_.rank), rank_options_, *arena_, rank_.dev,
                            step, r, b->size, *executor_);
      } else {
        write_timeline(rank_options_, *arena_, host_arena_.get(), rank_.dev, step, r, b->size, *executor_);
      }
    }
    if (setup_.stage && step == traced_step && !run_options_.out.empty()) write_schedule(step, r);
    const double ips = meter_.add(r, b->size, std::chrono::duration<double>(t1 - t0).count(), result_);
    loader_.give_back(std::move(*b));  // its buffer for a later batch (its images are staged)
    profiler_.step_done(meter_.measured == 1);
    ++epoch_steps_;
    enqueued = EnqueuedStep{step, epoch, epoch_steps_, std::move(r), ips, setup_.optimizer->lr(),
                            epoch_steps_ == in_epoch};
    // A checkpoint or a stop after this step, or the epoch's end, needs its loss first; a loss
    // already there (always on the CPU) is taken at once.
    const Boundary next = boundary();
    if (next.acts() || enqueued->last || enqueued->result.pending_loss.ready())
      finish_step(*enqueued, bar), enqueued.reset();
    if (act(next)) return;  // stopped: this epoch's evaluation waits for the resumed run
  }
  if (enqueued) finish_step(*enqueued, bar);  // the loader ran dry
  end_epoch(epoch, epochs);
}

void TrainingRun::finish_step(EnqueuedStep& s, Progress& bar) {
  s.result.loss = last_loss_ = s.result.pending_loss.get();
  if (!std::isfinite(last_loss_)) throw diverged(s.step, s.lr);
  epoch_loss_ += last_loss_;
  bar.update(s.position, last_loss_, s.ips, static_cast<std::int64_t>(s.result.peak), s.last);
  if (metrics_.is_open()) {
    const mbp::StepResult& r = s.result;
    const std::string row = fmt::format("{},{},{:.6f},{:.6g},{:.2f},{},{},{},{}\n", s.step + 1, s.epoch, last_loss_,
                                        s.lr, s.ips, r.peak, r.predicted_peak, r.micro_batch, r.micro_batches);
    append_metrics(row);  // an interrupted run keeps every step it measured
    metrics_text_ += row;
  }
}

// The end of an epoch: the test set (rank 0) and the epoch's line.
void TrainingRun::end_epoch(std::int64_t epoch, std::int64_t epochs) {
  profiler_.pause();  // the profile is of training steps
  if (setup_.stage && rank_options_.evaluate)
    eval_ = evaluate_stages(*executor_->stage(), *setup_.model, split_.test,
                            rank_options_.normalize, *comm_, result_.micro_batch);
  else if (rank_.rank == 0 && rank_options_.evaluate)
    eval_ = evaluate(*setup_.model, split_.test, rank_options_.normalize, rank_.dev, executor_->activation_dtype(),
                     result_.micro_batch);
  profiler_.resume();
  // Bad images of the evaluation set are skipped, never fatal (data/folder.h): each named once.
  if (bad_images_.val) {
    std::vector<std::string> fresh;
    for (const auto& [file, why] : bad_images_.val->list())
      if (bad_val_named_.insert(file).second) fresh.push_back(why);
    if (!fresh.empty()) {
      fmt::print(log_, "warning: {} bad image{} in the evaluation set, each replaced by the next one of its class "
                       "(the test loss and accuracy count that one twice):\n",
                 fresh.size(), fresh.size() == 1 ? "" : "s");
      for (const std::string& why : fresh) fmt::print(log_, "  {}\n", why);
    }
  }
  result_.train_loss = epoch_steps_ > 0 ? epoch_loss_ / static_cast<double>(epoch_steps_) : last_loss_;
  if (rank_options_.evaluate)
    fmt::print(log_, "{}: train loss {:.4f} | test loss {:.4f} | test accuracy {:.2f}%\n", epoch_label(epoch, epochs),
               result_.train_loss, eval_.loss, 100.0 * eval_.accuracy);
  else
    fmt::print(log_, "{}: train loss {:.4f} | test set not evaluated ({})\n", epoch_label(epoch, epochs),
               result_.train_loss, not_evaluated_);
}

std::string TrainingRun::epoch_label(std::int64_t epoch, std::int64_t epochs) const {
  const std::int64_t in_epoch = std::min(per_epoch_, steps_.total - epoch * per_epoch_);
  if (in_epoch >= per_epoch_) return fmt::format("epoch {}/{}", epoch + 1, epochs);
  return fmt::format("epoch {}/{} ({} of its {} steps)", epoch + 1, epochs, in_epoch, per_epoch_);
}

Error TrainingRun::diverged(std::int64_t step, double lr) const {
  const double wd = rank_options_.weight_decay;
  const std::string what = fmt::format("training diverged at step {}: the loss is {} (--lr {:.4g} at this step, "
                                       "--weight-decay {:.4g})", step, std::isnan(last_loss_) ? "NaN" : "infinite",
                                       lr, wd);
  if (lr * wd >= 1)
    return Error(fmt::format("{}: --lr x --weight-decay = {:.3g} >= 1 pushes every weight past zero each step; give a "
                             "smaller --weight-decay", what, lr * wd));
  return Error(fmt::format("{}: try a smaller --lr, or a warm-up (--warmup-epochs)", what));
}

// After every step: a checkpoint when one is due (every N steps, after the time given, at the
// run's end, or when a signal asks the run to stop), then whether to stop. Under mpirun every
// rank takes the same decision: the flags are summed over the ranks first.
TrainingRun::Boundary TrainingRun::boundary() {
  const std::int64_t done = meter_.steps;
  int stop = signals_ ? signals_->pending() : 0;
  bool due = (every_.steps > 0 && done % every_.steps == 0) || (every_.on() && done == steps_.total);
  if (every_.seconds > 0 && rank_.rank == 0 &&
      std::chrono::duration<double>(std::chrono::steady_clock::now() - last_checkpoint_).count() >= every_.seconds)
    due = true;
  if (rank_.ranks > 1 && signals_) {  // a collective every step, only in runs with a run folder
    double flags[2] = {stop ? 1.0 : 0.0, due ? 1.0 : 0.0};
    rank_.world->all_reduce_sum(flags, 2);
    if (flags[0] > 0 && !stop) stop = SIGUSR1;  // another rank received it
    due = flags[1] > 0;
  }
  if (stop && !run_options_.out.empty()) due = true;
  return {stop, due};
}

bool TrainingRun::act(const Boundary& b) {
  if (b.checkpoint) write_checkpoint();
  faults_.after_step(meter_.steps);
  stopped_ = b.stop;
  return b.stop != 0;
}

TrainResult train(const TrainOptions& options, std::ostream& all_log, std::ostream* progress) {
  if (options.resume.empty()) return TrainingRun(options, all_log, progress).run();
  TrainOptions o = options;  // a resumed run: the saved options, but for the few that may change
  std::error_code ec;
  if (o.out.empty()) o.out = o.resume;
  if (!std::filesystem::equivalent(o.out, o.resume, ec))
    throw Error(fmt::format("--out {} with --resume {}: a resumed run continues in its own run folder", o.out, o.resume));
  check_resume_options(resume_options(o.resume), o, {});
  return TrainingRun(o, all_log, progress).run();
}

}  // namespace tally::app
