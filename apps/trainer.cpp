// apps/trainer.cpp — the training loop of `tally train`; see apps/trainer.h.
#include "apps/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <ostream>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <nlohmann/json.hpp>

#include "apps/setup.h"
#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "nn/state_dict.h"
#include "data/data.h"
#include "distributed/communicator.h"
#include "distributed/data_parallel.h"
#include "nn/init.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "mbp/report/timeline.h"
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

// Rolling progress line: step, loss, images/s, arena peak.
class Progress {
 public:
  Progress(std::ostream& os, bool on, std::int64_t total, std::int64_t epoch, std::int64_t epochs)
      : os_(os), on_(on), total_(total), epoch_(epoch), epochs_(epochs), tty_(isatty(STDOUT_FILENO)) {}
  void update(std::int64_t step, double loss, double ips, std::int64_t peak, bool last) {
    if (!on_) return;
    if (!tty_ && !last && step % std::max<std::int64_t>(1, total_ / 10) != 0) return;
    const int width = 24;
    const int filled = total_ > 0 ? static_cast<int>(width * step / total_) : width;
    fmt::print(os_, "{}epoch {}/{} [{}{}] {}/{} loss {:.4f} | {:.1f} img/s | peak {}{}", tty_ ? "\r" : "",
               epoch_ + 1, epochs_, std::string(filled, '#'), std::string(width - filled, '.'), step, total_, loss, ips,
               format_bytes(static_cast<std::size_t>(peak)), tty_ && !last ? "" : "\n");
    os_.flush();
  }

 private:
  std::ostream& os_;
  bool on_;
  std::int64_t total_, epoch_, epochs_;
  bool tty_;
};

struct Eval {
  double loss = 0, accuracy = 0;
};

Eval evaluate_with(nn::Module& model, const data::Dataset& ds, bool normalize, Device dev, DType act, std::int64_t B) {
  NoGradGuard ng;
  model.eval();
  struct Train {  // back to training mode however this ends
    nn::Module& m;
    ~Train() { m.train(); }
  } back{model};
  double loss_sum = 0;
  std::int64_t correct = 0;
  const std::int64_t n = ds.size();
  data::LoaderOptions lo;
  lo.batch_size = B;
  lo.shuffle = false;
  lo.augment = false;
  lo.normalize = normalize;
  lo.drop_last = false;
  data::Loader loader(ds, lo);
  loader.start_epoch(0);
  while (auto b = loader.next()) {
    // In the training steps' precision: bf16 activations under --precision bf16.
    Tensor x = Tensor::from_vector(b->images, {b->size, ds.channels, ds.height, ds.width}, dev, Category::input).to(act);
    Tensor y = Tensor::from_vector(b->labels, {b->size}, dev, Category::input);
    Tensor logits = model(x);
    CrossEntropyOptions co;
    co.reduction = Reduction::Sum;
    loss_sum += cross_entropy(logits, y, co).item();
    const auto l = logits.to(DType::Float32).to_vector<float>();
    const std::int64_t C = logits.size(1);
    for (std::int64_t i = 0; i < b->size; ++i) {
      const float* row = l.data() + i * C;
      const std::int64_t pred = std::max_element(row, row + C) - row;
      correct += pred == b->labels[static_cast<std::size_t>(i)];
    }
  }
  return {loss_sum / static_cast<double>(n), static_cast<double>(correct) / static_cast<double>(n)};
}

// Evaluation runs in the same arena as training, in batches of at most the planned micro-batch
// (a no-grad forward keeps less than a training step of the same size); should it still run
// out of memory, the batch halves.
Eval evaluate(nn::Module& model, const data::Dataset& ds, bool normalize, Device dev, DType act, std::int64_t max_batch) {
  std::int64_t B = std::max<std::int64_t>(1, std::min<std::int64_t>(256, max_batch));
  for (;;) {
    try {
      return evaluate_with(model, ds, normalize, dev, act, B);
    } catch (const OutOfMemory&) {
      if (B == 1) throw;
      B /= 2;
    }
  }
}

// Every option, checked before any work: a bad value is an Error naming the flag, the value found
// and what is allowed. Returns the device the run uses.
Device validate(const TrainOptions& opt) {
  check_model_options(opt.model, opt.norm, opt.optimizer, opt.batch_size, opt.micro_batch);
  check_choice("--schedule", opt.schedule, optim::schedule_names());
  check_choice("--loss-normalization", opt.loss_normalization, loss_normalization_names());
  mbp::check_recompute_policy(opt.recompute);
  check_choice("--precision", opt.precision, mbp::precision_names());
  if (!opt.steps) check_number("--epochs", kPositiveWhole, static_cast<double>(opt.epochs));
  if (opt.steps) check_number("--steps", kPositiveWhole, static_cast<double>(*opt.steps));
  if (opt.num_classes) check_number("--num-classes", kPositiveWhole, static_cast<double>(*opt.num_classes));
  check_number("--lr", kNonNegative, opt.lr);
  check_number("--momentum", kNonNegative, opt.momentum);
  check_number("--weight-decay", kNonNegative, opt.weight_decay);
  check_number("--warmup-epochs", kNonNegative, opt.warmup_epochs);
  check_number("--label-smoothing", kFraction, opt.label_smoothing);
  check_number("--threads", kNonNegativeWhole, opt.threads);
  const Device dev = choose_device(opt.device);
  for (const std::string& limit : split_list(opt.memory_limit))  // a bad size fails before any work
    if (limit != "auto") (void)parse_size(limit);
  if (!opt.init.empty() && !std::filesystem::exists(opt.init))
    throw Error(fmt::format("--init {}: no such file", opt.init));
  return dev;
}

// Every option as "name value" lines: what the ranks of a data-parallel run compare.
std::string options_text(const TrainOptions& o) {
  auto opt_int = [](const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : std::string("auto"); };
  std::string t;
  auto line = [&t](const char* name, const auto& value) { t += fmt::format("--{} {}\n", name, value); };
  line("model", o.model), line("norm", o.norm), line("data", o.data), line("num-classes", opt_int(o.num_classes));
  line("epochs", o.epochs), line("steps", opt_int(o.steps)), line("batch-size", o.batch_size);
  line("optimizer", o.optimizer), line("lr", o.lr), line("momentum", o.momentum), line("weight-decay", o.weight_decay);
  line("nesterov", o.nesterov), line("schedule", o.schedule), line("warmup-epochs", o.warmup_epochs);
  line("label-smoothing", o.label_smoothing), line("augment", o.augment ? (*o.augment ? "on" : "off") : "default");
  line("shuffle", o.shuffle), line("normalize", o.normalize), line("seed", o.seed), line("device", o.device);
  line("threads", o.threads), line("tf32", o.tf32), line("profile", o.profile), line("init", o.init);
  line("save", o.save), line("out", o.out), line("memory-limit", o.memory_limit);
  line("micro-batch", opt_int(o.micro_batch)), line("loss-normalization", o.loss_normalization);
  line("recompute", o.recompute), line("precision", o.precision);
  return t;
}

// The data set of --data; --num-classes chooses the class count of synthetic data and must agree
// with a real data set's.
data::Split load_data(const TrainOptions& opt) {
  const bool synthetic = data::is_synthetic(opt.data);
  data::Split split = data::load_dataset(opt.data, synthetic ? opt.num_classes : std::nullopt);
  if (!synthetic && opt.num_classes && *opt.num_classes != split.train.num_classes)
    throw Error(fmt::format("--num-classes {} does not match {}, which has {} classes (--num-classes is for "
                            "synthetic data)", *opt.num_classes, opt.data, split.train.num_classes));
  return split;
}

// The run's arena: --memory-limit bytes on `dev`, owned by the run. A default arena that nothing
// else holds is given back first, so that "auto" (measured with it counted as free) fits.
std::shared_ptr<Arena> make_arena(const TrainOptions& opt, Device dev) {
  const std::size_t limit = parse_memory_limit(opt.memory_limit, dev);
  release_default_arena(dev);
  return std::make_shared<Arena>(dev, limit);
}

// The traced step's memory timeline: memory_trace.json (Perfetto) and memory.svg.
void write_timeline(const TrainOptions& opt, Arena& arena, Device dev, std::int64_t step, const mbp::StepResult& r,
                    std::int64_t batch) {
  const std::filesystem::path dir(opt.out);
  write_text(dir / "memory_trace.json", arena.trace_json());
  report::TimelineOptions to;
  to.title = fmt::format("{} (norm {}) on {}: step {}, batch {} as {} micro-batches of <= {}", opt.model, opt.norm,
                         dev.str(), step + 1, batch, r.micro_batches, r.micro_batch);
  to.budget = arena.capacity();
  to.predicted_peak = r.predicted_peak;
  write_text(dir / "memory.svg", report::memory_svg(arena, to));
  arena.clear_trace();
}

// Every rank's memory plan and peaks, known to all (a sum where each rank fills its own row).
std::vector<RankResult> gather_ranks(distributed::Communicator& comm, const TrainResult& mine) {
  constexpr std::size_t kFields = 5;
  std::vector<double> rows(kFields * static_cast<std::size_t>(comm.size()), 0.0);
  double* row = rows.data() + kFields * static_cast<std::size_t>(comm.rank());
  row[0] = static_cast<double>(mine.memory_limit_bytes), row[1] = static_cast<double>(mine.micro_batch);
  row[2] = static_cast<double>(mine.micro_batches_per_step), row[3] = static_cast<double>(mine.predicted_peak_bytes);
  row[4] = static_cast<double>(mine.peak_bytes);
  comm.all_reduce_sum(rows.data(), rows.size());  // byte counts < 2^53: exact in a double
  std::vector<RankResult> out;
  for (int r = 0; r < comm.size(); ++r) {
    const double* v = rows.data() + kFields * static_cast<std::size_t>(r);
    out.push_back({r, static_cast<std::int64_t>(v[0]), static_cast<std::int64_t>(v[1]), static_cast<std::int64_t>(v[2]),
                   static_cast<std::int64_t>(v[3]), static_cast<std::int64_t>(v[4])});
  }
  return out;
}

void write_summary(const TrainOptions& opt, const TrainResult& result) {
  const nlohmann::json none;  // null: the test set was not evaluated (--no-eval)
  nlohmann::json j = {{"test_accuracy", opt.evaluate ? nlohmann::json(result.test_accuracy) : none},
                      {"test_loss", opt.evaluate ? nlohmann::json(result.test_loss) : none},
                      {"train_loss", result.train_loss},
                      {"images_per_second", result.images_per_second},
                      {"peak_bytes", result.peak_bytes},
                      {"predicted_peak_bytes", result.predicted_peak_bytes},
                      {"memory_limit_bytes", result.memory_limit_bytes},
                      {"micro_batch", result.micro_batch},
                      {"micro_batches_per_step", result.micro_batches_per_step},
                      {"oom_retries", result.oom_retries},
                      {"steps", result.steps},
                      {"device", result.device},
                      {"model", opt.model},
                      {"norm", opt.norm},
                      {"batch_size", opt.batch_size},
                      {"loss_normalization", opt.loss_normalization},
                      {"recompute", result.recompute},
                      {"precision", opt.precision},
                      {"data", opt.data},
                      {"world_size", result.world_size},
                      {"communication_seconds_per_step", result.communication_seconds_per_step}};
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankResult& r : result.ranks)
    ranks.push_back({{"rank", r.rank},
                     {"memory_limit_bytes", r.memory_limit_bytes},
                     {"micro_batch", r.micro_batch},
                     {"micro_batches_per_step", r.micro_batches_per_step},
                     {"predicted_peak_bytes", r.predicted_peak_bytes},
                     {"peak_bytes", r.peak_bytes}});
  j["ranks"] = ranks;
  write_text(std::filesystem::path(opt.out) / "summary.json", j.dump(2) + "\n");
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
  const data::Split split = load_data(opt);
  const data::Dataset& t = split.train;
  return {t.channels, t.height, t.width, t.num_classes, t.size()};
}

namespace {

// This process's part of the run: its rank, its options (its own --memory-limit of a list, the
// run folder and progress on rank 0 only), its device and where it speaks.
struct RankSetup {
  std::shared_ptr<distributed::Communicator> world;
  int rank = 0, ranks = 1;
  TrainOptions opt;
  Device dev;
  std::ofstream silent;  // the log of ranks other than 0
  std::ostream* log = nullptr;
};

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
  if (r.ranks > 1 && r.opt.loss_normalization != "exact")
    throw Error("--loss-normalization per-micro-batch is for one process; data parallelism uses exact");
  if (r.ranks > 1 && r.dev.is_cuda() && (r.opt.device == "auto" || r.opt.device == "cuda"))
    r.dev = Device::cuda(distributed::local_rank());  // each rank of a machine on its own GPU
  // Rank 0 speaks and writes the run folder; the others train silently.
  r.log = r.rank == 0 ? &all_log : &r.silent;
  if (r.rank != 0) r.opt.out.clear(), r.opt.save.clear(), r.opt.progress = false;
  if (r.opt.threads > 0) omp_set_num_threads(r.opt.threads);  // OpenBLAS stays single-threaded (kernels/cpu/gemm.cpp)
  if (!r.opt.out.empty()) std::filesystem::create_directories(r.opt.out);
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
  return lo;
}

// Crop + flip for CIFAR and synthetic images, not for the 28x28 grey ones, unless --augment says.
bool augments(const TrainOptions& opt) {
  const bool grey_28 = opt.data.rfind("mnist", 0) == 0 || opt.data.rfind("fashion-mnist", 0) == 0;
  return opt.augment.value_or(!grey_28);
}

// The model and optimizer of the options, every persistent byte in `arena`.
Setup model_setup(const TrainOptions& opt, const data::Dataset& train_set, const std::shared_ptr<Arena>& arena) {
  nn::manual_seed(opt.seed);
  nn::ModelConfig mc;
  mc.name = opt.model;
  mc.in_channels = train_set.channels;
  mc.num_classes = train_set.num_classes;
  mc.norm = nn::parse_norm(opt.norm);
  OptimizerConfig oc;
  oc.name = opt.optimizer;
  oc.lr = opt.lr, oc.momentum = opt.momentum, oc.weight_decay = opt.weight_decay, oc.nesterov = opt.nesterov;
  return build_setup(arena, mc, opt.init, oc, format_bytes(arena->capacity()));
}

mbp::ExecutorOptions executor_options(const TrainOptions& opt, const data::Dataset& train_set,
                                      std::shared_ptr<distributed::Communicator> comm, std::ostream& log) {
  mbp::ExecutorOptions eo;
  eo.sample_shape = {train_set.channels, train_set.height, train_set.width};
  eo.loss.label_smoothing = opt.label_smoothing;
  eo.micro_batch = opt.micro_batch;
  eo.normalization = opt.loss_normalization == "exact" ? mbp::LossNormalization::exact
                                                       : mbp::LossNormalization::per_micro_batch;
  eo.log = [&log](const std::string& line) { fmt::print(log, "\n{}\n", line); };
  eo.communicator = std::move(comm);
  eo.recompute = opt.recompute;
  eo.precision = mbp::parse_precision(opt.precision);
  return eo;
}

// The steps' measurements: the steady-state rate (steps after the first: the first warms caches
// up), the collectives' share, the peaks against the predictions, into the run's result.
struct StepMeter {
  double steady_seconds = 0, first_seconds = 0, steady_communication = 0;
  std::int64_t steady_images = 0, first_images = 0, steps = 0, mismatches = 0;

  // A step of `images` that took `seconds`; returns the images per second to show.
  double add(const mbp::StepResult& r, std::int64_t images, double seconds, TrainResult& result) {
    if (steps > 0) {
      steady_seconds += seconds;
      steady_images += images;
      steady_communication += r.communication_seconds;
    } else {
      first_seconds = seconds;
      first_images = images;
    }
    ++steps;
    result.peak_bytes = std::max(result.peak_bytes, static_cast<std::int64_t>(r.peak));
    result.predicted_peak_bytes = std::max(result.predicted_peak_bytes, static_cast<std::int64_t>(r.predicted_peak));
    result.micro_batch = r.micro_batch;
    result.micro_batches_per_step = r.micro_batches;
    result.oom_retries += r.oom_retries;
    if (r.peak != r.predicted_peak && r.oom_retries == 0) ++mismatches;
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

// One `tally train` run on this rank: everything before the first step is built by the
// constructor (ranks, device, data, the budget with the model and optimizer inside it, the
// executor and its plan, printed); run() trains the epochs and reports.
class TrainingRun {
 public:
  TrainingRun(const TrainOptions& options, std::ostream& all_log);
  TrainResult run();

 private:
  void print_header(const Setup& setup) const;
  void print_plan(const mbp::Plan& plan) const;
  void train_epoch(std::int64_t epoch, std::int64_t epochs, StepMeter& meter, std::ofstream& metrics);
  void finish(const StepMeter& meter);

  const TrainOptions& options_;
  RankSetup rank_;
  const TrainOptions& opt_;  // rank_.opt
  std::ostream& log_;
  Profiler profiler_;  // --profile: time per op over the steps after the first
  data::Split split_;
  data::Loader loader_;
  std::int64_t per_epoch_;
  RunSteps steps_;
  std::shared_ptr<Arena> arena_;
  ArenaScope in_budget_;  // every tensor of the run (evaluation too) comes from the budget
  Setup setup_;
  std::shared_ptr<distributed::Communicator> comm_;
  optim::LRSchedule schedule_;
  mbp::Executor executor_;
  distributed::Shard share_;  // this rank's share of every global batch (drop_last: always full)
  TrainResult result_;
  Eval eval_;
  double last_loss_ = 0;  // of the last step run
};

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

TrainingRun::TrainingRun(const TrainOptions& options, std::ostream& all_log)
    : options_(options),
      opt_(rank_setup(rank_, options, all_log).opt),
      log_(*rank_.log),
      profiler_(rank_.dev, opt_.profile),
      split_(load_data(opt_)),
      loader_(split_.train, loader_options(opt_, augments(opt_))),
      per_epoch_(checked_per_epoch(loader_, opt_, split_.train)),
      steps_(run_steps(opt_, per_epoch_)),
      arena_(make_arena(opt_, rank_.dev)),
      in_budget_(arena_),
      setup_(model_setup(opt_, split_.train, arena_)),
      comm_(distributed::for_device(rank_.world, rank_.dev)),
      schedule_(schedule_options(opt_, steps_)),
      executor_(*setup_.model, *setup_.optimizer, arena_, executor_options(opt_, split_.train, comm_, log_)),
      share_(distributed::shard(opt_.batch_size, rank_.ranks, rank_.rank)) {
  distributed::broadcast_parameters(*setup_.model, *comm_);  // every rank starts from rank 0's weights
  print_header(setup_);
  if (rank_.ranks > 1)
    fmt::print(log_, "data parallel: {} ranks over {} ({}), rank 0 takes {} of the {} samples of a step, each rank "
                     "plans its own micro-batches\n",
               rank_.ranks, comm_->backend(), options_.memory_limit, share_.size, opt_.batch_size);
  print_plan(plan_step(executor_, share_.size, opt_.micro_batch));
  log_.flush();  // the plan is on screen before the first (possibly long) step
}

void TrainingRun::print_header(const Setup& setup) const {
  const data::Dataset& t = split_.train;
  const Device dev = rank_.dev;
  fmt::print(log_, "{}\n", build_info());
  fmt::print(log_, "model {} (norm {}), {} parameters | data {}: {} train / {} test, {}x{}x{}, {} classes\n", opt_.model,
             opt_.norm, setup.parameters, t.name, t.size(), split_.test.size(), t.channels, t.height, t.width,
             t.num_classes);
  fmt::print(log_, "device {}{} | precision {} | batch {} | {} steps ({} per epoch) | {} lr {} schedule {} | augment {} shuffle {} normalize {}\n",
             dev.str(), dev.is_cuda() ? (opt_.tf32 ? " (TF32 on)" : " (TF32 off)") : (opt_.tf32 ? " (--tf32: no effect on the CPU)" : ""),
             opt_.precision == "bf16" ? "bf16 (bf16 activations, float32 weights, gradients and loss)" : "fp32",
             opt_.batch_size, steps_.total, per_epoch_, opt_.optimizer, opt_.lr, opt_.schedule,
             augments(opt_) ? "on" : "off", opt_.shuffle ? "on" : "off", opt_.normalize ? "on" : "off");
  fmt::print(log_, "memory limit {}{}: {} allocated before planning\n", format_bytes(arena_->capacity()),
             opt_.memory_limit == "auto" ? " (auto)" : "", persistent_summary(*arena_));
}

void TrainingRun::print_plan(const mbp::Plan& plan) const {
  fmt::print(log_, "plan: {}\n", plan.summary());
  fmt::print(log_, "      recompute: {}\n", executor_.recompute_choice().summary(plan));
  fmt::print(log_, "      live at the peak: {}\n", plan.at_peak.str());
  fmt::print(log_, "      {} ({} dry runs, {:.0f} ms)\n",
             opt_.micro_batch ? fmt::format("--micro-batch {} checked", *opt_.micro_batch)
                              : std::string("largest micro-batch that fits, found"),
             plan.probes, plan.seconds * 1000.0);
  if (opt_.loss_normalization != "exact")
    fmt::print(log_, "      loss normalization per-micro-batch: each micro-batch's mean / {} (not the full batch's "
                     "mean when the micro-batches differ in size)\n", plan.micro_batches);
}

TrainResult TrainingRun::run() {
  std::ofstream metrics;
  if (!opt_.out.empty()) {
    metrics.open(std::filesystem::path(opt_.out) / "metrics.csv");
    metrics << "step,epoch,loss,lr,images_per_second,peak_bytes,predicted_peak_bytes,micro_batch,micro_batches\n";
  }
  result_.device = rank_.dev.str();
  result_.recompute = executor_.recompute_choice().name;
  result_.precision = opt_.precision;
  result_.memory_limit_bytes = static_cast<std::int64_t>(arena_->capacity());
  StepMeter meter;
  const std::int64_t epochs = (steps_.total + per_epoch_ - 1) / per_epoch_;
  for (std::int64_t epoch = 0; epoch < epochs && meter.steps < steps_.total; ++epoch)
    train_epoch(epoch, epochs, meter, metrics);
  finish(meter);
  return result_;
}

void TrainingRun::train_epoch(std::int64_t epoch, std::int64_t epochs, StepMeter& meter, std::ofstream& metrics) {
  using clock = std::chrono::steady_clock;
  // The step whose memory timeline is written: the second (steady state) if there is one.
  const std::int64_t traced_step = steps_.total > 1 ? 1 : 0;
  const std::int64_t sample_numel = split_.train.channels * split_.train.height * split_.train.width;
  loader_.start_epoch(epoch);
  const std::int64_t in_epoch = std::min(per_epoch_, steps_.total - meter.steps);
  Progress bar(log_, opt_.progress, in_epoch, epoch, epochs);
  double epoch_loss = 0;
  std::int64_t epoch_steps = 0;
  while (meter.steps < steps_.total) {
    const std::int64_t step = meter.steps;
    // A step's time runs from asking for its batch (a loader that cannot keep up counts) to the
    // end of its optimizer step; writing the traced step's files does not count.
    const auto t0 = clock::now();
    std::optional<data::Batch> b = loader_.next();
    if (!b) break;
    setup_.optimizer->set_lr(schedule_.lr_at(step));
    const bool trace = step == traced_step && !opt_.out.empty();
    if (trace) arena_->set_tracing(true);
    if (opt_.inject_oom && opt_.inject_oom->first == step) arena_->fail_allocation_after(opt_.inject_oom->second);
    const mbp::StepResult r = executor_.step(b->images.data() + share_.offset * sample_numel,
                                             b->labels.data() + share_.offset, share_.size);
    arena_->fail_allocation_after(0);
    last_loss_ = r.loss;
    if (!std::isfinite(last_loss_))
      throw Error(fmt::format("training diverged at step {}: loss is {} (try a smaller --lr)", step, last_loss_));
    const auto t1 = clock::now();
    if (trace) {
      arena_->set_tracing(false);
      write_timeline(opt_, *arena_, rank_.dev, step, r, b->size);
    }
    const double ips = meter.add(r, b->size, std::chrono::duration<double>(t1 - t0).count(), result_);
    profiler_.step_done(step == 0);
    ++epoch_steps;
    epoch_loss += last_loss_;
    bar.update(epoch_steps, last_loss_, ips, static_cast<std::int64_t>(r.peak), epoch_steps == in_epoch);
    if (metrics.is_open())
      metrics << fmt::format("{},{},{:.6f},{:.6g},{:.2f},{},{},{},{}\n", step + 1, epoch, last_loss_,
                             setup_.optimizer->lr(), ips, r.peak, r.predicted_peak, r.micro_batch, r.micro_batches)
              << std::flush;  // an interrupted run keeps every step it measured
  }
  profiler_.pause();  // the profile is of training steps
  if (rank_.rank == 0 && opt_.evaluate)
    eval_ = evaluate(*setup_.model, split_.test, opt_.normalize, rank_.dev, executor_.activation_dtype(),
                     result_.micro_batch);
  profiler_.resume();
  result_.train_loss = epoch_steps > 0 ? epoch_loss / static_cast<double>(epoch_steps) : last_loss_;
  if (opt_.evaluate)
    fmt::print(log_, "epoch {}/{}: train loss {:.4f} | test loss {:.4f} | test accuracy {:.2f}%\n", epoch + 1, epochs,
               result_.train_loss, eval_.loss, 100.0 * eval_.accuracy);
  else
    fmt::print(log_, "epoch {}/{}: train loss {:.4f} | test set not evaluated (--no-eval)\n", epoch + 1, epochs,
               result_.train_loss);
}

// The result, the ranks' agreement, the memory and profile reports, and the files.
void TrainingRun::finish(const StepMeter& meter) {
  const std::int64_t step = meter.steps;
  const int ranks = rank_.ranks;
  result_.test_accuracy = eval_.accuracy;
  result_.test_loss = eval_.loss;
  result_.images_per_second = meter.images_per_second();
  result_.steps = step;
  result_.world_size = ranks;
  if (step > 1) result_.communication_seconds_per_step = meter.steady_communication / static_cast<double>(step - 1);
  result_.ranks = gather_ranks(*rank_.world, result_);
  if (!distributed::parameters_identical(*setup_.model, *comm_))
    throw Error(fmt::format("after {} steps the ranks' parameters differ; a data-parallel run must keep them identical",
                            step));
  if (ranks > 1) {
    fmt::print(log_, "parameters bit-identical on all {} ranks | collectives {:.1f} ms per step ({:.1f}% of the step, "
                     "rank 0, steps after the first)\n",
               ranks, 1000.0 * result_.communication_seconds_per_step,
               meter.steady_seconds > 0 ? 100.0 * meter.steady_communication / meter.steady_seconds : 0.0);
    for (const RankResult& rr : result_.ranks)
      fmt::print(log_, "rank {}: memory limit {}, micro-batches of {} x {} per step, peak {} bytes, predicted {}\n",
                 rr.rank, format_bytes(static_cast<std::size_t>(rr.memory_limit_bytes)), rr.micro_batch,
                 rr.micro_batches_per_step, rr.peak_bytes, rr.predicted_peak_bytes);
  }
  fmt::print(log_, "memory: measured step peak {} ({} bytes), predicted {} ({} bytes){}, limit {}; {} out-of-memory "
             "retries\n",
             format_bytes(static_cast<std::size_t>(result_.peak_bytes)), result_.peak_bytes,
             format_bytes(static_cast<std::size_t>(result_.predicted_peak_bytes)), result_.predicted_peak_bytes,
             meter.mismatches == 0 ? " — exact" : fmt::format(" — {} steps differed", meter.mismatches),
             format_bytes(arena_->capacity()), result_.oom_retries);
  if (profiler_.on()) {
    const std::string report = profiler_.report(fmt::format(
        "over steps 2..{} ({:.1f} ms of wall time per step, data included)", step,
        meter.steady_images > 0 ? 1000.0 * meter.steady_seconds / static_cast<double>(step - 1) : 0.0));
    fmt::print(log_, "{}", report);
    if (!opt_.out.empty()) write_text(std::filesystem::path(opt_.out) / "profile.txt", report);
    profiler_.pause();
  }
  if (!opt_.save.empty()) {
    nn::save_state_dict(*setup_.model, opt_.save);
    fmt::print(log_, "saved {}\n", opt_.save);
  }
  if (!opt_.out.empty()) {
    write_summary(opt_, result_);
    fmt::print(log_, "wrote {0}/metrics.csv, {0}/summary.json, {0}/memory_trace.json and {0}/memory.svg\n", opt_.out);
  }
}

}  // namespace

TrainResult train(const TrainOptions& options, std::ostream& all_log) { return TrainingRun(options, all_log).run(); }

}  // namespace tally::app
