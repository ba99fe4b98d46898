// apps/trainer.cpp — the training loop of `tally train` (apps/trainer.h): the options checked, the
// rank set up, the run built, its epochs and steps, and the boundaries between steps. Evaluation,
// checkpoints and reports are in apps/evaluation.cpp, apps/train_checkpoint.cpp and
// apps/train_report.cpp (apps/training_run.h holds what they share).
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
#include "distributed/data_parallel.h"
#include "nn/init.h"
#include "nn/resnet.h"
#include "mbp/checkpoint.h"
#include "mbp/executor.h"
#include "mbp/pipeline_executor.h"
#include "report/schedule.h"
#include "report/memory_html.h"
#include "report/timeline.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace tally::app {
namespace {

Device choose_device(const std::string& d) {
  if (d == "cpu") return Device::cpu();
  if (d == "cuda" || d.rfind("cuda:", 0) == 0) {
    const Device dev = parse_device(d);
    if (!cuda_available())
      throw Error(fmt::format("--device {}: no GPU is present ({})", d, build_info()));
    return dev;
  }
  if (d == "auto") return cuda_available() ? Device::cuda(0) : Device::cpu();  // the GPU when there is one
  throw Error(fmt::format("--device '{}' is not allowed: expected one of cpu, cuda, cuda:N, auto", d));
}

// Every option, checked before any work: a bad value is an Error naming the flag, the value found
// and what is allowed. Returns the device the run uses.
Device validate(const TrainOptions& opt) {
  check_step_options(opt);
  const std::vector<std::string>& schedules = optim::schedule_names();
  if (std::find(schedules.begin(), schedules.end(), opt.schedule) == schedules.end())
    throw Error(fmt::format("--schedule: expected one of {}, found {}", fmt::join(schedules, ", "), opt.schedule));
  if (!opt.steps) check_number("--epochs", kPositiveWhole, static_cast<double>(opt.epochs));
  if (opt.steps) check_number("--steps", kPositiveWhole, static_cast<double>(*opt.steps));
  check_number("--lr", kNonNegative, opt.lr);
  check_number("--weight-decay", kNonNegative, opt.weight_decay);
  check_number("--warmup-epochs", kNonNegative, opt.warmup_epochs);
  check_number("--label-smoothing", kFraction, opt.label_smoothing);
  check_number("--threads", kNonNegativeWhole, opt.threads);
  if (opt.pipeline_stages > 1) {
    if (opt.device != "cpu" && opt.device != "auto")
      throw Error(fmt::format("--pipeline-stages {} with --device {}: pipeline stages run on the CPU, one MPI rank each "
                              "(a CUDA pipeline needs one GPU per rank and is not implemented)", opt.pipeline_stages,
                              opt.device));
    if (!opt.checkpoint_every.empty() || !opt.resume.empty())
      throw Error(fmt::format("--pipeline-stages {} with {}: a pipeline run writes no training-state checkpoints yet",
                              opt.pipeline_stages, opt.resume.empty() ? "--checkpoint-every" : "--resume"));
    if (opt.loss_normalization != mbp::LossNormalization::exact)
      throw Error("--loss-normalization per-micro-batch is for one process; a pipeline uses exact");
  }
  const Device dev = opt.pipeline_stages > 1 ? Device::cpu() : choose_device(opt.device);
  for (const std::string& limit : split_list(opt.memory_limit))  // a bad size fails before any work
    if (limit != "auto") (void)parse_size(limit);
  if (!opt.init.empty() && opt.resume.empty()) {  // resumed: weights from the checkpoint
    std::error_code ec;
    const auto status = std::filesystem::status(opt.init, ec);
    if (!std::filesystem::exists(status)) throw Error(fmt::format("--init {}: no such file", opt.init));
    if (!std::filesystem::is_regular_file(status))  // a FIFO would wait for a writer forever
      throw Error(fmt::format("--init {}: expected a regular file, found {}", opt.init,
                              std::filesystem::is_directory(status) ? "a folder" : "a FIFO, a socket or a device"));
  }
  if (parse_checkpoint_every(opt.checkpoint_every).on() && opt.out.empty())
    throw Error(fmt::format("--checkpoint-every {}: checkpoints go into the run folder; give --out", opt.checkpoint_every));
  const int hardware = hardware_threads();
  if (hardware > 0 && opt.threads > hardware)
    throw Error(fmt::format("--threads {}: this machine runs {} hardware threads; give at most {} (0: the default)",
                            opt.threads, hardware, hardware));
  check_run_folder(opt);
  return dev;
}

// Every option as "--name value" lines: what the ranks of a data-parallel run compare.
std::string options_text(const TrainOptions& o) {
  std::string t;
  for (const auto& [name, value] : option_values(o)) t += fmt::format("--{} {}\n", name, value);
  return t + fmt::format("--resume {}\n", o.resume);
}

// The data set of --data; --num-classes chooses the class count of synthetic data and must agree
// with a real data set's.
// A folder of pictures (data/folder.h) needs --input; --val-fraction and --max-image-pixels are its.
data::Split load_folder_data(const TrainOptions& opt, const data::DataSpec& spec, std::ostream& log,
                             std::shared_ptr<data::BadImages>* bad) {
  if (opt.input == "auto")
    throw Error(fmt::format("--data {}: expected --input CxHxW (one sample's shape: 3x224x224 or 1x28x28), found none",
                            opt.data));
  const Shape chw = parse_input(opt.input);
  data::FolderOptions fo;
  fo.channels = chw[0], fo.height = chw[1], fo.width = chw[2];
  fo.max_pixels = opt.max_image_pixels;
  fo.transform = opt.transform;
  fo.skip_bad_images = opt.skip_bad_images;
  fo.seed = opt.seed;
  if (opt.val_fraction != "none") {
    if (!number_error(kFraction, opt.val_fraction).empty() || std::strtod(opt.val_fraction.c_str(), nullptr) <= 0 ||
        std::strtod(opt.val_fraction.c_str(), nullptr) >= 1)
      throw Error(fmt::format("--val-fraction: expected none or a number in (0, 1), found {}", opt.val_fraction));
    fo.val_fraction = std::strtod(opt.val_fraction.c_str(), nullptr);
  }
  data::FolderSet set = data::load_folder(spec.dir, fo);
  if (bad) *bad = set.bad_images;
  std::string skipped;
  for (const auto& [ext, n] : set.skipped) skipped += fmt::format("{}{} {}", skipped.empty() ? "" : ", ", n, ext.empty() ? "without an extension" : ext);
  const std::size_t prefetch = static_cast<std::size_t>(opt.batch_size * chw[0] * chw[1] * chw[2]) * sizeof(float);
  fmt::print(log, "data {}: {} classes, {} training images, {} for evaluation{}, read by {} workers{} into the next "
                  "batch while a step runs ({} of host memory a batch), transform {}; {}; {}\n",
             opt.data, set.classes.size(), set.train_files.size(), set.test_files.size(),
             opt.val_fraction != "none" ? fmt::format(" (--val-fraction {})", opt.val_fraction) : "",
             opt.workers > 0 ? opt.workers : omp_get_max_threads(), opt.workers > 0 ? "" : " (--workers 0: OpenMP's count)",
             format_bytes(prefetch), opt.transform, skipped.empty() ? "no other files" : "skipped (not .jpg, .jpeg or .png): " + skipped, set.statistics);
  return std::move(set.split);
}

data::Split load_data(const TrainOptions& opt, const data::DataSpec& spec, std::ostream& log,
                      std::shared_ptr<data::BadImages>* bad = nullptr) {
  if (spec.kind == data::DataSpec::Kind::folder) return load_folder_data(opt, spec, log, bad);
  if (opt.input != "auto" || opt.val_fraction != "none" || opt.transform != "imagenet" || opt.skip_bad_images)
    throw Error(fmt::format("--{}: for --data folder:DIR only, found --data {}",
                            opt.input != "auto"           ? "input"
                            : opt.val_fraction != "none"  ? "val-fraction"
                            : opt.transform != "imagenet" ? "transform"
                                                          : "skip-bad-images",
                            opt.data));
  const bool synthetic = spec.kind == data::DataSpec::Kind::synthetic;
  data::Split split = data::load_dataset(spec, synthetic ? opt.num_classes : std::nullopt);
  if (!synthetic && opt.num_classes && *opt.num_classes != split.train.num_classes)
    throw Error(fmt::format("--num-classes {} does not match {}, which has {} classes (--num-classes is for "
                            "synthetic data)", *opt.num_classes, opt.data, split.train.num_classes));
  return split;
}

// The run's arena: --memory-limit bytes on `dev`, owned by the run. A default arena that nothing
// else holds is given back first, so that "auto" (measured with it counted as free) fits.
std::shared_ptr<Arena> make_arena(const TrainOptions& opt, Device dev, std::ostream& log) {
  const std::size_t limit = parse_memory_limit(opt.memory_limit, dev);
  if (dev.is_cpu() && opt.memory_limit != "auto")
    if (const HostMemory usable = usable_host_memory(); !usable.bound.empty() && limit > usable.bytes)
      fmt::print(log, "warning: --memory-limit {} is more than this process can use now ({}, {}): a step that needs "
                      "more fails with the system's out-of-memory, not with tally's plan\n",
                 opt.memory_limit, format_bytes(usable.bytes), usable.bound);
  release_default_arena(dev);
  return std::make_shared<Arena>(dev, limit);
}

// The traced step as the memory report (report/memory_html.h): memory.html, or a pipeline
// stage's memory-stage{s}.html.
void write_memory_page(const std::filesystem::path& file, const TrainOptions& opt, const Arena& arena, Device dev,
                       std::int64_t step, const mbp::StepResult& r, std::int64_t batch,
                       const mbp::Executor& executor) {
  report::MemoryPage page;
  page.title = fmt::format("{} (norm {}) on {}: step {}, batch {} as {} micro-batches of <= {}{}", opt.model,
                           name_of(opt.norm), dev.str(), step + 1, batch, r.micro_batches, r.micro_batch,
                           executor.pipeline() ? fmt::format(", pipeline stage {} of {}", executor.pipeline()->stage,
                                                             executor.pipeline()->stages)
                                               : std::string());
  page.source = fmt::format("The measured step {} of the run (its allocations as they happened)", step + 1);
  page.budget = arena.capacity();
  page.predicted_peak = r.predicted_peak;
  page.micro_batches = r.micro_batches;
  page.plan = {{"micro-batches", fmt::format("{} of at most {} samples", r.micro_batches, r.micro_batch)},
               {"measured peak", fmt::format("{} bytes (predicted {})", r.peak, r.predicted_peak)},
               {"recompute", executor.recompute_choice().name},
               {"precision", mbp::precision_name(executor.options().precision)},
               {"memory format", memory_format_name(executor.memory_format())},
               {"placement", fmt::format("{}: {}", mbp::placement_name(executor.placement_choice().placement),
                                         executor.placement_choice().why)}};
  write_text(file, report::memory_html(arena, page));
}

// The traced step's memory timeline: memory_trace.json (Perfetto), memory.svg and memory.html.
void write_timeline(const TrainOptions& opt, Arena& arena, Arena* host, Device dev, std::int64_t step,
                    const mbp::StepResult& r, std::int64_t batch, const mbp::Executor& executor) {
  const std::filesystem::path dir(opt.out);
  write_memory_page(dir / "memory.html", opt, arena, dev, step, r, batch, executor);
  write_text(dir / "memory_trace.json", arena.trace_json());
  report::TimelineOptions to;
  to.title = fmt::format("{} (norm {}) on {}: step {}, batch {} as {} micro-batches of <= {}", opt.model, name_of(opt.norm),
                         dev.str(), step + 1, batch, r.micro_batches, r.micro_batch);
  to.budget = arena.capacity();
  to.predicted_peak = r.predicted_peak;
  if (host && r.host_peak > 0) {  // the host tier held part of the step: both tiers, one above the other
    report::TimelineOptions ho;
    ho.title = fmt::format("host tier ({}): the same step", host->is_pinned() ? "pinned" : "pageable");
    ho.budget = host->capacity();
    ho.predicted_peak = r.host_predicted_peak;
    ho.height = 300;
    write_text(dir / "memory.svg", report::memory_svg(arena, to, *host, ho));
  } else {
    write_text(dir / "memory.svg", report::memory_svg(arena, to));
  }
  arena.clear_trace();
  if (host) host->clear_trace();
}

}  // namespace

std::string check_train_options(const TrainOptions& opt) { return validate(opt).str(); }

RunSteps run_steps(const TrainOptions& opt, std::int64_t per_epoch) {
  RunSteps r;
  r.total = opt.steps ? *opt.steps : opt.epochs * per_epoch;
  r.warmup = static_cast<std::int64_t>(std::llround(opt.warmup_epochs * static_cast<double>(per_epoch)));
  return r;
}

DataInfo describe_data(const TrainOptions& opt) {
  std::ostringstream quiet;  // a folder's line is the run's to print
  const data::Split split = load_data(opt, data::parse_data_spec(opt.data), quiet);
  const data::Dataset& t = split.train;
  return {t.channels, t.height, t.width, t.num_classes, t.size()};
}

namespace {

void set_up_rank(RankSetup& r, const TrainOptions& options, std::ostream& all_log) {
  // The ranks: this process alone, or one of mpirun's (docs/distributed.md).
  r.world = distributed::process_world();
  r.rank = r.world->rank(), r.ranks = r.world->size();
  r.opt = options;
  r.dev = validate(r.opt);
  // One --memory-limit for every rank, or a list with one per rank.
  const std::vector<std::string> limits = split_list(options.memory_limit);
  if (limits.size() != 1 && static_cast<int>(limits.size()) != r.ranks)
    throw Error(fmt::format("--memory-limit {} lists {} sizes, one per rank, but this run has {} rank{}{}",
                            options.memory_limit, limits.size(), r.ranks, r.ranks == 1 ? "" : "s",
                            r.ranks == 1 ? fmt::format(" (start it with mpirun -np {})", limits.size()) : ""));
  r.opt.memory_limit = limits.size() == 1 ? limits[0] : limits[static_cast<std::size_t>(r.rank)];
  distributed::check_same_text(options_text(options), *r.world, "options");
  if (r.opt.pipeline_stages > 1 && r.ranks != r.opt.pipeline_stages)
    throw Error(fmt::format("--pipeline-stages {}: one rank per stage, so start it with mpirun -np {}; found {} rank{}{}",
                            r.opt.pipeline_stages, r.opt.pipeline_stages, r.ranks, r.ranks == 1 ? "" : "s",
                            r.ranks > r.opt.pipeline_stages ? " (pipeline stages and data parallelism together are not "
                                                              "supported)" : ""));
  if (r.ranks > 1 && r.opt.loss_normalization != mbp::LossNormalization::exact)
    throw Error("--loss-normalization per-micro-batch is for one process; data parallelism uses exact");
  if (r.ranks > 1 && r.dev.is_cuda() && (r.opt.device == "auto" || r.opt.device == "cuda"))
    r.dev = Device::cuda(distributed::local_rank());  // each rank of a machine on its own GPU
  // Rank 0 speaks and writes the run folder; the others train silently.
  r.log = r.rank == 0 ? &all_log : &r.silent;
  if (r.rank != 0) r.opt.out.clear(), r.opt.save.clear(), r.opt.progress = false;
  if (r.opt.threads > 0) omp_set_num_threads(r.opt.threads);  // OpenBLAS stays single-threaded (kernels/cpu/gemm.cpp)
  if (!r.opt.out.empty()) {
    std::filesystem::create_directories(r.opt.out);
    r.lock.emplace(r.opt.out, r.opt.resume.empty() ? "--out" : "--resume");
  }
  if (r.dev.is_cuda()) set_allow_tf32(r.opt.tf32);
}

data::LoaderOptions loader_options(const TrainOptions& opt, bool augment) {
  data::LoaderOptions lo;
  lo.batch_size = opt.batch_size;
  lo.shuffle = opt.shuffle;
  lo.augment = augment;
  lo.normalize = opt.normalize;
  lo.drop_last = true;
  lo.seed = opt.seed;
  lo.workers = opt.workers;
  return lo;
}

// The model and optimizer of the options, every persistent byte in `arena`.
// `all_limits`: --memory-limit as given (one size, or one per rank), for a pipeline's cut.
Setup model_setup(const TrainOptions& opt, const data::Dataset& train_set, const std::shared_ptr<Arena>& arena,
                  const std::string& all_limits) {
  nn::manual_seed(opt.seed);
  nn::ModelConfig mc;
  mc.name = opt.model;
  mc.in_channels = train_set.channels;
  mc.num_classes = train_set.num_classes;
  mc.norm = opt.norm;
  OptimizerConfig oc;
  oc.kind = opt.optimizer;
  oc.lr = opt.lr, oc.momentum = opt.momentum, oc.weight_decay = opt.weight_decay, oc.nesterov = opt.nesterov;
  oc.state_when_placed = opt.host_memory_limit != "none" && opt.pipeline_stages == 1;
  const std::string init = opt.resume.empty() ? opt.init : "";  // resumed: the checkpoint's weights
  if (opt.pipeline_stages == 1) return build_setup(arena, mc, init, oc, format_bytes(arena->capacity()));
  PipelineConfig pc = pipeline_config(opt, {train_set.channels, train_set.height, train_set.width}, opt.batch_size,
                                      all_limits);
  pc.stage = distributed::process_world()->rank();
  return build_setup(arena, mc, init, oc, format_bytes(arena->capacity()), &pc);
}

mbp::ExecutorOptions executor_options(const TrainOptions& opt, const data::Dataset& train_set, const Setup& setup,
                                      Device device, std::shared_ptr<distributed::Communicator> comm,
                                      std::shared_ptr<Arena> host_arena, std::ostream& log) {
  mbp::ExecutorOptions eo = app::executor_options(opt, {train_set.channels, train_set.height, train_set.width}, device,
                                                  setup.stage.has_value());
  eo.loss.label_smoothing = opt.label_smoothing;
  eo.normalization = opt.loss_normalization;
  eo.log = [&log](const std::string& line) { fmt::print(log, "\n{}\n", line); };
  eo.communicator = std::move(comm);
  eo.pipeline = setup.stage;
  eo.host_arena = std::move(host_arena);
  return eo;
}

optim::ScheduleOptions schedule_options(const TrainOptions& opt, const RunSteps& steps) {
  optim::ScheduleOptions sched;
  sched.kind = opt.schedule;
  sched.base_lr = opt.lr;
  sched.total_steps = steps.total;
  sched.warmup_steps = steps.warmup;
  return sched;
}

std::int64_t checked_per_epoch(const data::Loader& loader, const TrainOptions& opt, const data::Dataset& train_set) {
  const std::int64_t per_epoch = loader.batches_per_epoch();
  if (per_epoch < 1)
    throw Error(fmt::format("--batch-size {} is larger than the {} training samples of {}", opt.batch_size,
                            train_set.size(), opt.data));
  return per_epoch;
}

const RankSetup& rank_setup(RankSetup& r, const TrainOptions& options, std::ostream& all_log) {
  set_up_rank(r, options, all_log);
  return r;
}

}  // namespace

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
      arena_(make_arena(rank_options_, rank_.dev, log_)),
      host_arena_(make_host_arena(rank_options_.host_memory_limit, rank_.dev, arena_->capacity(), nullptr, &log_)),
      in_budget_(arena_),
      setup_(model_setup(rank_options_, split_.train, arena_, options.memory_limit)),
      comm_(distributed::for_device(rank_.world, rank_.dev)),
      schedule_(schedule_options(rank_options_, steps_)),
      executor_(make_executor(*setup_.model, *setup_.optimizer, arena_,
                              executor_options(rank_options_, split_.train, setup_, rank_.dev, comm_, host_arena_,
                                               log_))),
      // A pipeline's stages all see the whole batch (the first its images, the last its labels).
      share_(setup_.stage ? distributed::shard(rank_options_.batch_size, 1, 0)
                          : distributed::shard(rank_options_.batch_size, rank_.ranks, rank_.rank)),
      every_(parse_checkpoint_every(rank_options_.checkpoint_every)),
      kill_(kill_point_from_environment(rank_.rank)),
      inject_oom_(rank_options_.inject_oom ? rank_options_.inject_oom : oom_injection_from_environment()) {
  // Every rank takes the same decision; a pipeline writes no checkpoints, so a signal just ends it.
  if (!run_options_.out.empty() && !setup_.stage) signals_.emplace(rank_.ranks == 1);
  if (split_.test.size() == 0 && rank_.opt.evaluate) {  // a folder with no val/ and no --val-fraction
    rank_.opt.evaluate = false;
    fmt::print(log_, "no evaluation: {} has no val folder and --val-fraction is none\n", rank_options_.data);
  }
  print_header(setup_);
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
  while (meter_.steps < steps_.total && epoch_steps_ < in_epoch) {
    const std::int64_t step = meter_.steps;
    // A step's time runs from asking for its batch (a loader that cannot keep up counts) to the
    // end of its optimizer step; writing the traced step's files and checkpoints does not count.
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
    if (inject_oom_ && inject_oom_->first == step) arena_->fail_allocation_after(inject_oom_->second);
    if (kill_.at("in-step", step + 1)) arena_->at_allocation(kill_.allocation, kill_self);
    const mbp::StepResult r = executor_->step(b->images.data() + share_.offset * sample_numel,
                                             b->labels.data() + share_.offset, share_.size);
    arena_->fail_allocation_after(0);
    result_.placement = mbp::placement_name(executor_->placement_choice().placement);
    last_loss_ = r.loss;
    if (!std::isfinite(last_loss_)) throw diverged(step);
    const auto t1 = clock::now();
    if (trace) {
      arena_->set_tracing(false);
      if (host_arena_) host_arena_->set_tracing(false);
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
    loader_.give_back(std::move(*b));  // its buffer for a later batch
    profiler_.step_done(meter_.measured == 1);
    ++epoch_steps_;
    epoch_loss_ += last_loss_;
    bar.update(epoch_steps_, last_loss_, ips, static_cast<std::int64_t>(r.peak), epoch_steps_ == in_epoch);
    if (metrics_.is_open()) {
      const std::string row = fmt::format("{},{},{:.6f},{:.6g},{:.2f},{},{},{},{}\n", step + 1, epoch, last_loss_,
                                          setup_.optimizer->lr(), ips, r.peak, r.predicted_peak, r.micro_batch,
                                          r.micro_batches);
      append_metrics(row);  // an interrupted run keeps every step it measured
      metrics_text_ += row;
    }
    if (step_boundary()) return;  // stopped: this epoch's evaluation waits for the resumed run
  }
  end_epoch(epoch, epochs);
}

// The end of an epoch: the test set (rank 0) and the epoch's line.
void TrainingRun::end_epoch(std::int64_t epoch, std::int64_t epochs) {
  profiler_.pause();  // the profile is of training steps
  if (setup_.stage && rank_options_.evaluate)
    eval_ = evaluate_stages(mbp::as_stage(*executor_, "a pipeline's evaluation"), *setup_.model, split_.test,
                            rank_options_.normalize, *comm_, result_.micro_batch);
  else if (rank_.rank == 0 && rank_options_.evaluate)
    eval_ = evaluate(*setup_.model, split_.test, rank_options_.normalize, rank_.dev, executor_->activation_dtype(),
                     result_.micro_batch);
  profiler_.resume();
  result_.train_loss = epoch_steps_ > 0 ? epoch_loss_ / static_cast<double>(epoch_steps_) : last_loss_;
  if (rank_options_.evaluate)
    fmt::print(log_, "{}: train loss {:.4f} | test loss {:.4f} | test accuracy {:.2f}%\n", epoch_label(epoch, epochs),
               result_.train_loss, eval_.loss, 100.0 * eval_.accuracy);
  else
    fmt::print(log_, "{}: train loss {:.4f} | test set not evaluated (--no-eval)\n", epoch_label(epoch, epochs),
               result_.train_loss);
}

std::string TrainingRun::epoch_label(std::int64_t epoch, std::int64_t epochs) const {
  const std::int64_t in_epoch = std::min(per_epoch_, steps_.total - epoch * per_epoch_);
  if (in_epoch >= per_epoch_) return fmt::format("epoch {}/{}", epoch + 1, epochs);
  return fmt::format("epoch {}/{} ({} of its {} steps)", epoch + 1, epochs, in_epoch, per_epoch_);
}

// After every step: a checkpoint when one is due (every N steps, after the time given, at the
// run's end, or when a signal asks the run to stop), then whether to stop. Under mpirun every
// rank takes the same decision: the flags are summed over the ranks first.
Error TrainingRun::diverged(std::int64_t step) const {
  const double lr = setup_.optimizer->lr(), wd = rank_options_.weight_decay;
  const std::string what = fmt::format("training diverged at step {}: the loss is {} (--lr {:.4g} at this step, "
                                       "--weight-decay {:.4g})", step, std::isnan(last_loss_) ? "NaN" : "infinite",
                                       lr, wd);
  if (lr * wd >= 1)
    return Error(fmt::format("{}: --lr x --weight-decay = {:.3g} >= 1 pushes every weight past zero each step; give a "
                             "smaller --weight-decay", what, lr * wd));
  return Error(fmt::format("{}: try a smaller --lr, or a warm-up (--warmup-epochs)", what));
}

bool TrainingRun::step_boundary() {
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
  if (due) write_checkpoint();
  if (kill_.at("after-step", done)) kill_self();
  stopped_ = stop;
  return stop != 0;
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
