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

#include "apps/run_state.h"
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
#include "mbp/checkpoint.h"
#include "mbp/executor.h"
#include "mbp/pipeline_executor.h"
#include "mbp/report/schedule.h"
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

// One batch of evaluation: its summed loss and its correct predictions, added to `sums`.
void count_batch(const Tensor& logits, const data::Batch& b, Device dev, double sums[2]) {
  Tensor y = Tensor::from_vector(b.labels, {b.size}, dev, Category::input);
  CrossEntropyOptions co;
  co.reduction = Reduction::Sum;
  sums[0] += cross_entropy(logits, y, co).item();
  const auto l = logits.to(DType::Float32).to_vector<float>();
  const std::int64_t C = logits.size(1);
  for (std::int64_t i = 0; i < b.size; ++i) {
    const float* row = l.data() + i * C;
    sums[1] += static_cast<double>(std::max_element(row, row + C) - row == b.labels[static_cast<std::size_t>(i)]);
  }
}

Eval evaluate_with(nn::Module& model, const data::Dataset& ds, bool normalize, Device dev, DType act, std::int64_t B) {
  NoGradGuard ng;
  model.eval();
  struct Train {  // back to training mode however this ends
    nn::Module& m;
    ~Train() { m.train(); }
  } back{model};
  double sums[2] = {0, 0};  // loss, correct
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
    count_batch(model(x), *b, dev, sums);
  }
  return {sums[0] / static_cast<double>(n), sums[1] / static_cast<double>(n)};
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

// A pipeline's evaluation: every rank runs its stage on every batch of the test set (batches of at
// most the planned micro-batch, as above), the last stage counts; the counts go to every rank.
Eval evaluate_stages(mbp::PipelineExecutor& executor, nn::Module& model, const data::Dataset& ds, bool normalize,
                     distributed::Communicator& comm, std::int64_t max_batch) {
  NoGradGuard ng;
  model.eval();
  struct Train {
    nn::Module& m;
    ~Train() { m.train(); }
  } back{model};
  data::LoaderOptions lo;
  lo.batch_size = std::max<std::int64_t>(1, std::min<std::int64_t>(256, max_batch));
  lo.shuffle = false, lo.augment = false, lo.normalize = normalize, lo.drop_last = false;
  data::Loader loader(ds, lo);
  loader.start_epoch(0);
  const bool first = executor.stage().stage == 0;
  double sums[2] = {0, 0};  // loss, correct
  while (auto b = loader.next()) {
    Tensor x;
    if (first)
      x = Tensor::from_vector(b->images, {b->size, ds.channels, ds.height, ds.width}, executor.device(), Category::input)
              .to(executor.activation_dtype());
    const Tensor logits = executor.forward_through_stages(x, b->size);
    if (logits.defined()) count_batch(logits, *b, executor.device(), sums);  // the last stage
  }
  comm.all_reduce_sum(sums, 2);
  const auto n = static_cast<double>(ds.size());
  return {sums[0] / n, sums[1] / n};
}

// Every option, checked before any work: a bad value is an Error naming the flag, the value found
// and what is allowed. Returns the device the run uses.
Device validate(const TrainOptions& opt) {
  check_model_options(opt.model, opt.norm, opt.optimizer, opt.batch_size, opt.micro_batch);
  check_choice("--schedule", opt.schedule, optim::schedule_names());
  check_choice("--loss-normalization", opt.loss_normalization, loss_normalization_names());
  mbp::check_recompute_policy(opt.recompute);
  check_choice("--precision", opt.precision, mbp::precision_names());
  check_choice("--memory-format", opt.memory_format, mbp::memory_format_names());
  if (!opt.steps) check_number("--epochs", kPositiveWhole, static_cast<double>(opt.epochs));
  if (opt.steps) check_number("--steps", kPositiveWhole, static_cast<double>(*opt.steps));
  if (opt.num_classes) check_number("--num-classes", kPositiveWhole, static_cast<double>(*opt.num_classes));
  check_number("--lr", kNonNegative, opt.lr);
  check_number("--momentum", kNonNegative, opt.momentum);
  check_number("--weight-decay", kNonNegative, opt.weight_decay);
  check_number("--warmup-epochs", kNonNegative, opt.warmup_epochs);
  check_number("--label-smoothing", kFraction, opt.label_smoothing);
  check_number("--threads", kNonNegativeWhole, opt.threads);
  check_number("--pipeline-stages", kPositiveWhole, opt.pipeline_stages);
  check_choice("--pipeline-schedule", opt.pipeline_schedule, mbp::pipeline_schedule_names());
  if (opt.pipeline_stages == 1 && !opt.pipeline_split.empty())
    throw Error(fmt::format("--pipeline-split {}: there is one stage (give --pipeline-stages)", opt.pipeline_split));
  if (opt.pipeline_stages > 1) {
    if (opt.device != "cpu" && opt.device != "auto")
      throw Error(fmt::format("--pipeline-stages {} with --device {}: pipeline stages run on the CPU, one MPI rank each "
                              "(a CUDA pipeline needs one GPU per rank and is not implemented)", opt.pipeline_stages,
                              opt.device));
    if (!opt.checkpoint_every.empty() || !opt.resume.empty())
      throw Error(fmt::format("--pipeline-stages {} with {}: a pipeline run writes no training-state checkpoints yet",
                              opt.pipeline_stages, opt.resume.empty() ? "--checkpoint-every" : "--resume"));
    if (opt.loss_normalization != "exact")
      throw Error("--loss-normalization per-micro-batch is for one process; a pipeline uses exact");
  }
  const Device dev = opt.pipeline_stages > 1 ? Device::cpu() : choose_device(opt.device);
  for (const std::string& limit : split_list(opt.memory_limit))  // a bad size fails before any work
    if (limit != "auto") (void)parse_size(limit);
  if (!opt.init.empty() && opt.resume.empty() && !std::filesystem::exists(opt.init))  // resumed: weights from the checkpoint
    throw Error(fmt::format("--init {}: no such file", opt.init));
  if (parse_checkpoint_every(opt.checkpoint_every).on() && opt.out.empty())
    throw Error(fmt::format("--checkpoint-every {}: checkpoints go into the run folder; give --out", opt.checkpoint_every));
  std::error_code ec;
  if (opt.resume.empty() && !opt.out.empty() && std::filesystem::is_directory(opt.out, ec))
    if (const auto old = mbp::latest_checkpoint(opt.out))
      throw Error(fmt::format("--out {}: it holds {} of an earlier run; continue that run with --resume {}, or choose "
                              "another folder", opt.out, old->filename().string(), opt.out));
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
  constexpr std::size_t kFields = 8;
  std::vector<double> rows(kFields * static_cast<std::size_t>(comm.size()), 0.0);
  double* row = rows.data() + kFields * static_cast<std::size_t>(comm.rank());
  row[0] = static_cast<double>(mine.memory_limit_bytes), row[1] = static_cast<double>(mine.micro_batch);
  row[2] = static_cast<double>(mine.micro_batches_per_step), row[3] = static_cast<double>(mine.predicted_peak_bytes);
  row[4] = static_cast<double>(mine.peak_bytes);
  row[5] = static_cast<double>(mine.parameters);
  row[6] = mine.seconds_per_step, row[7] = mine.communication_seconds_per_step;
  comm.all_reduce_sum(rows.data(), rows.size());  // byte counts < 2^53: exact in a double
  std::vector<RankResult> out;
  for (int r = 0; r < comm.size(); ++r) {
    const double* v = rows.data() + kFields * static_cast<std::size_t>(r);
    RankResult rr;
    rr.rank = r;
    rr.parameters = static_cast<std::int64_t>(v[5]);
    rr.memory_limit_bytes = static_cast<std::int64_t>(v[0]), rr.micro_batch = static_cast<std::int64_t>(v[1]);
    rr.micro_batches_per_step = static_cast<std::int64_t>(v[2]), rr.predicted_peak_bytes = static_cast<std::int64_t>(v[3]);
    rr.peak_bytes = static_cast<std::int64_t>(v[4]);
    rr.seconds_per_step = v[6], rr.communication_seconds_per_step = v[7];
    out.push_back(rr);
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
                      {"memory_format", result.memory_format},
                      {"data", opt.data},
                      {"world_size", result.world_size},
                      {"pipeline_stages", result.pipeline_stages},
                      {"communication_seconds_per_step", result.communication_seconds_per_step}};
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankResult& r : result.ranks)
    ranks.push_back({{"rank", r.rank},
                     {"segments", r.segments},
                     {"parameters", r.parameters},
                     {"memory_limit_bytes", r.memory_limit_bytes},
                     {"micro_batch", r.micro_batch},
                     {"micro_batches_per_step", r.micro_batches_per_step},
                     {"predicted_peak_bytes", r.predicted_peak_bytes},
                     {"peak_bytes", r.peak_bytes},
                     {"seconds_per_step", r.seconds_per_step},
                     {"communication_seconds_per_step", r.communication_seconds_per_step}});
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
  if (r.opt.pipeline_stages > 1 && r.ranks != r.opt.pipeline_stages)
    throw Error(fmt::format("--pipeline-stages {}: one rank per stage, so start it with mpirun -np {}; found {} rank{}{}",
                            r.opt.pipeline_stages, r.opt.pipeline_stages, r.ranks, r.ranks == 1 ? "" : "s",
                            r.ranks > r.opt.pipeline_stages ? " (pipeline stages and data parallelism together are not "
                                                              "supported)" : ""));
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
// `all_limits`: --memory-limit as given (one size, or one per rank), for a pipeline's cut.
Setup model_setup(const TrainOptions& opt, const data::Dataset& train_set, const std::shared_ptr<Arena>& arena,
                  const std::string& all_limits) {
  nn::manual_seed(opt.seed);
  nn::ModelConfig mc;
  mc.name = opt.model;
  mc.in_channels = train_set.channels;
  mc.num_classes = train_set.num_classes;
  mc.norm = nn::parse_norm(opt.norm);
  OptimizerConfig oc;
  oc.name = opt.optimizer;
  oc.lr = opt.lr, oc.momentum = opt.momentum, oc.weight_decay = opt.weight_decay, oc.nesterov = opt.nesterov;
  const std::string init = opt.resume.empty() ? opt.init : "";  // resumed: the checkpoint's weights
  if (opt.pipeline_stages == 1) return build_setup(arena, mc, init, oc, format_bytes(arena->capacity()));
  PipelineConfig pc = pipeline_config(opt.pipeline_stages, opt.pipeline_split, opt.pipeline_schedule,
                                      {train_set.channels, train_set.height, train_set.width}, opt.precision,
                                      opt.batch_size, all_limits);
  pc.stage = distributed::process_world()->rank();
  return build_setup(arena, mc, init, oc, format_bytes(arena->capacity()), &pc);
}

mbp::ExecutorOptions executor_options(const TrainOptions& opt, const data::Dataset& train_set, const Setup& setup,
                                      Device device, std::shared_ptr<distributed::Communicator> comm,
                                      std::ostream& log) {
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
  eo.memory_format = mbp::parse_memory_format(opt.memory_format, device, setup.stage.has_value());
  eo.pipeline = setup.stage;
  return eo;
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
// executor and its plan, printed; a resumed run's state from its checkpoint); run() trains the
// epochs and reports. Between two steps (step_boundary) it writes the checkpoints that are due and
// stops when a signal asked it to.
class TrainingRun {
 public:
  TrainingRun(const TrainOptions& options, std::ostream& all_log);
  TrainResult run();

 private:
  void print_header(const Setup& setup) const;
  void print_plan(const mbp::Plan& plan) const;
  void open_metrics();
  void train_epoch(std::int64_t epoch, std::int64_t epochs);
  void end_epoch(std::int64_t epoch, std::int64_t epochs);
  bool step_boundary();  // true: stop here
  void write_checkpoint();
  nlohmann::json checkpoint_state(const std::vector<double>& limits) const;
  void restore();
  void report_stop() const;
  void write_schedule(std::int64_t step, const mbp::StepResult& r);
  void finish();

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
  std::unique_ptr<mbp::Executor> executor_;  // make_executor: the plain step or a pipeline stage's
  distributed::Shard share_;  // this rank's share of every global batch (drop_last: always full)
  TrainResult result_;
  Eval eval_;
  StepMeter meter_;
  double last_loss_ = 0;                // of the last step run
  double epoch_loss_ = 0;               // the losses of this epoch's steps so far, summed
  std::int64_t epoch_steps_ = 0;
  bool epoch_end_pending_ = false;      // resumed right after an epoch's last step, before its evaluation
  std::ofstream metrics_;
  std::string metrics_text_;            // metrics.csv so far, kept with every checkpoint
  CheckpointEvery every_;
  std::optional<StopSignals> signals_;  // with a run folder: a signal stops the run at a step boundary
  KillPoint kill_;                      // tests (apps/run_state.h)
  std::optional<std::pair<std::int64_t, std::uint64_t>> inject_oom_;  // tests: TrainOptions::inject_oom, or TALLY_TEST_OOM
  std::chrono::steady_clock::time_point last_checkpoint_ = std::chrono::steady_clock::now();
  int stopped_ = 0;                     // the signal that stopped the run
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
      setup_(model_setup(opt_, split_.train, arena_, options.memory_limit)),
      comm_(distributed::for_device(rank_.world, rank_.dev)),
      schedule_(schedule_options(opt_, steps_)),
      executor_(make_executor(*setup_.model, *setup_.optimizer, arena_,
                              executor_options(opt_, split_.train, setup_, rank_.dev, comm_, log_))),
      // A pipeline's stages all see the whole batch (the first its images, the last its labels).
      share_(setup_.stage ? distributed::shard(opt_.batch_size, 1, 0)
                          : distributed::shard(opt_.batch_size, rank_.ranks, rank_.rank)),
      every_(parse_checkpoint_every(opt_.checkpoint_every)),
      kill_(kill_point_from_environment()),
      inject_oom_(opt_.inject_oom ? opt_.inject_oom : oom_injection_from_environment()) {
  // Every rank takes the same decision; a pipeline writes no checkpoints, so a signal just ends it.
  if (!options_.out.empty() && !setup_.stage) signals_.emplace(rank_.ranks == 1);
  print_header(setup_);
  if (!opt_.resume.empty()) restore();
  // Every rank starts from rank 0's weights (a pipeline's stages: the same seed built the same model).
  if (!setup_.stage) distributed::broadcast_parameters(*setup_.model, *comm_);
  if (setup_.stage) {
    const mbp::PipelineStage& st = *setup_.stage;
    fmt::print(log_, "pipeline: {} stages over {} ({}), schedule {}, cut {}\n", st.stages, comm_->backend(),
               options_.memory_limit, mbp::pipeline_schedule_name(st.schedule),
               cut_description(opt_.pipeline_split));
    for (int s = 0; s < st.stages; ++s) {
      const auto ss = static_cast<std::size_t>(s);
      fmt::print(log_, "  stage {} (rank {}): {}\n", s, s, mbp::segment_range(setup_.segments, st.bounds[ss], st.bounds[ss + 1]));
    }
    fmt::print(log_, "  {}\n", work_line(setup_.segment_costs, st.bounds));
  } else if (rank_.ranks > 1)
    fmt::print(log_, "data parallel: {} ranks over {} ({}), rank 0 takes {} of the {} samples of a step, each rank "
                     "plans its own micro-batches\n",
               rank_.ranks, comm_->backend(), options_.memory_limit, share_.size, opt_.batch_size);
  print_plan(plan_step(*executor_, share_.size, opt_.micro_batch));
  log_.flush();  // the plan is on screen before the first (possibly long) step
}

void TrainingRun::print_header(const Setup& setup) const {
  const data::Dataset& t = split_.train;
  const Device dev = rank_.dev;
  fmt::print(log_, "{}\n", build_info());
  fmt::print(log_, "model {} (norm {}), {} parameters | data {}: {} train / {} test, {}x{}x{}, {} classes\n", opt_.model,
             opt_.norm, setup.parameters, t.name, t.size(), split_.test.size(), t.channels, t.height, t.width,
             t.num_classes);
  fmt::print(log_, "device {}{} | precision {} | memory format {} | batch {} | {} steps ({} per epoch) | {} lr {} schedule {} | augment {} shuffle {} normalize {}\n",
             dev.str(), dev.is_cuda() ? (opt_.tf32 ? " (TF32 on)" : " (TF32 off)") : (opt_.tf32 ? " (--tf32: no effect on the CPU)" : ""),
             opt_.precision == "bf16" ? "bf16 (bf16 activations, float32 weights, gradients and loss)" : "fp32",
             memory_format_name(executor_->memory_format()), opt_.batch_size, steps_.total, per_epoch_, opt_.optimizer, opt_.lr, opt_.schedule,
             augments(opt_) ? "on" : "off", opt_.shuffle ? "on" : "off", opt_.normalize ? "on" : "off");
  fmt::print(log_, "memory limit {}{}: {} allocated before planning\n", format_bytes(arena_->capacity()),
             opt_.memory_limit == "auto" ? " (auto)" : "", persistent_summary(*arena_));
}

void TrainingRun::print_plan(const mbp::Plan& plan) const {
  fmt::print(log_, "plan: {}\n", plan.summary());
  fmt::print(log_, "      recompute: {}\n", executor_->recompute_choice().summary(plan));
  fmt::print(log_, "      live at the peak: {}\n", plan.at_peak.str());
  fmt::print(log_, "      {} ({} dry runs, {:.0f} ms)\n",
             opt_.micro_batch ? fmt::format("--micro-batch {} checked", *opt_.micro_batch)
                              : std::string("largest micro-batch that fits, found"),
             plan.probes, plan.seconds * 1000.0);
  if (opt_.loss_normalization != "exact")
    fmt::print(log_, "      loss normalization per-micro-batch: each micro-batch's mean / {} (not the full batch's "
                     "mean when the micro-batches differ in size)\n", plan.micro_batches);
}

void TrainingRun::open_metrics() {
  if (opt_.out.empty()) return;
  // A resumed run starts from the rows of its checkpoint: rows written after it are dropped.
  if (metrics_text_.empty())
    metrics_text_ = "step,epoch,loss,lr,images_per_second,peak_bytes,predicted_peak_bytes,micro_batch,micro_batches\n";
  metrics_.open(std::filesystem::path(opt_.out) / "metrics.csv", std::ios::trunc);
  metrics_ << metrics_text_ << std::flush;
}

TrainResult TrainingRun::run() {
  open_metrics();
  result_.device = rank_.dev.str();
  result_.recompute = executor_->recompute_choice().name;
  result_.precision = opt_.precision;
  result_.memory_format = memory_format_name(executor_->memory_format());
  result_.memory_limit_bytes = static_cast<std::int64_t>(arena_->capacity());
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
  Progress bar(log_, opt_.progress, in_epoch, epoch, epochs);
  while (meter_.steps < steps_.total && epoch_steps_ < in_epoch) {
    const std::int64_t step = meter_.steps;
    // A step's time runs from asking for its batch (a loader that cannot keep up counts) to the
    // end of its optimizer step; writing the traced step's files and checkpoints does not count.
    const auto t0 = clock::now();
    std::optional<data::Batch> b = loader_.next();
    if (!b) break;
    setup_.optimizer->set_lr(schedule_.lr_at(step));
    const bool trace = step == traced_step && !opt_.out.empty();
    if (trace) arena_->set_tracing(true);
    if (inject_oom_ && inject_oom_->first == step) arena_->fail_allocation_after(inject_oom_->second);
    if (kill_.at("in-step", step + 1)) arena_->at_allocation(kill_.allocation, kill_self);
    const mbp::StepResult r = executor_->step(b->images.data() + share_.offset * sample_numel,
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
    if (setup_.stage && step == traced_step && !options_.out.empty()) write_schedule(step, r);
    const double ips = meter_.add(r, b->size, std::chrono::duration<double>(t1 - t0).count(), result_);
    profiler_.step_done(meter_.measured == 1);
    ++epoch_steps_;
    epoch_loss_ += last_loss_;
    bar.update(epoch_steps_, last_loss_, ips, static_cast<std::int64_t>(r.peak), epoch_steps_ == in_epoch);
    if (metrics_.is_open()) {
      const std::string row = fmt::format("{},{},{:.6f},{:.6g},{:.2f},{},{},{},{}\n", step + 1, epoch, last_loss_,
                                          setup_.optimizer->lr(), ips, r.peak, r.predicted_peak, r.micro_batch,
                                          r.micro_batches);
      metrics_ << row << std::flush;  // an interrupted run keeps every step it measured
      metrics_text_ += row;
    }
    if (step_boundary()) return;  // stopped: this epoch's evaluation waits for the resumed run
  }
  end_epoch(epoch, epochs);
}

// The end of an epoch: the test set (rank 0) and the epoch's line.
void TrainingRun::end_epoch(std::int64_t epoch, std::int64_t epochs) {
  profiler_.pause();  // the profile is of training steps
  if (setup_.stage && opt_.evaluate)
    eval_ = evaluate_stages(mbp::as_stage(*executor_, "a pipeline's evaluation"), *setup_.model, split_.test,
                            opt_.normalize, *comm_, result_.micro_batch);
  else if (rank_.rank == 0 && opt_.evaluate)
    eval_ = evaluate(*setup_.model, split_.test, opt_.normalize, rank_.dev, executor_->activation_dtype(),
                     result_.micro_batch);
  profiler_.resume();
  result_.train_loss = epoch_steps_ > 0 ? epoch_loss_ / static_cast<double>(epoch_steps_) : last_loss_;
  if (opt_.evaluate)
    fmt::print(log_, "epoch {}/{}: train loss {:.4f} | test loss {:.4f} | test accuracy {:.2f}%\n", epoch + 1, epochs,
               result_.train_loss, eval_.loss, 100.0 * eval_.accuracy);
  else
    fmt::print(log_, "epoch {}/{}: train loss {:.4f} | test set not evaluated (--no-eval)\n", epoch + 1, epochs,
               result_.train_loss);
}

// After every step: a checkpoint when one is due (every N steps, after the time given, at the
// run's end, or when a signal asks the run to stop), then whether to stop. Under mpirun every
// rank takes the same decision: the flags are summed over the ranks first.
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
  if (stop && !options_.out.empty()) due = true;
  if (due) write_checkpoint();
  if (kill_.at("after-step", done)) kill_self();
  stopped_ = stop;
  return stop != 0;
}

nlohmann::json TrainingRun::checkpoint_state(const std::vector<double>& limits) const {
  nlohmann::json options = nlohmann::json::object();
  for (const auto& [name, value] : option_values(options_)) options[name] = value;
  return {{"options", options},
          {"threads", omp_get_max_threads()},
          {"world_size", rank_.ranks},
          {"micro_batch_limits", limits},  // per rank; 0: no out-of-memory retry lowered it
          {"steps_per_epoch", per_epoch_},
          {"total_steps", steps_.total},
          {"epoch_loss", epoch_loss_},
          {"epoch_steps", epoch_steps_},
          {"last_loss", last_loss_},
          {"train_loss", result_.train_loss},
          {"eval", {{"loss", eval_.loss}, {"accuracy", eval_.accuracy}}},
          {"meter", {{"peak_bytes", result_.peak_bytes}, {"predicted_peak_bytes", result_.predicted_peak_bytes},
                     {"oom_retries", result_.oom_retries}, {"mismatches", meter_.mismatches},
                     {"micro_batch", result_.micro_batch}, {"micro_batches_per_step", result_.micro_batches_per_step}}},
          {"lr", setup_.optimizer->lr()}};
}

// Every rank's micro-batch limit to rank 0 (a collective), which writes the checkpoint.
void TrainingRun::write_checkpoint() {
  std::vector<double> limits(static_cast<std::size_t>(rank_.ranks), 0.0);
  const std::int64_t mine = executor_->micro_batch_limit();
  limits[static_cast<std::size_t>(rank_.rank)] = mine == INT64_MAX ? 0.0 : static_cast<double>(mine);
  if (rank_.ranks > 1) rank_.world->all_reduce_sum(limits.data(), limits.size());
  last_checkpoint_ = std::chrono::steady_clock::now();
  if (rank_.rank != 0 || opt_.out.empty()) return;
  mbp::TrainingState st;
  st.step = meter_.steps;
  st.state = checkpoint_state(limits).dump();
  st.files["metrics.csv"] = metrics_text_;
  const auto t0 = std::chrono::steady_clock::now();
  std::function<void()> halfway;
  if (kill_.at("in-checkpoint", meter_.steps)) halfway = kill_self;
  const auto path = mbp::save_training_state(opt_.out, *setup_.model, *setup_.optimizer, st, halfway);
  result_.checkpoint = path.string();
  fmt::print(log_, "{}checkpoint: step {} -> {} ({:.0f} ms)\n", opt_.progress ? "\n" : "", st.step, path.string(),
               1000.0 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// A resumed run: the newest checkpoint of the run folder into the model, the optimizer, the
// executor's micro-batch limit and the run's counters, after checking that it belongs to this run.
void TrainingRun::restore() {
  const auto dir = mbp::latest_checkpoint(opt_.resume);
  if (!dir) throw Error(fmt::format("--resume {}: no checkpoint in it", opt_.resume));
  const mbp::TrainingState st = mbp::load_training_state(*dir, *setup_.model, *setup_.optimizer);
  const std::string where = fmt::format("{}/state.json", dir->string());
  try {
    const nlohmann::json s = nlohmann::json::parse(st.state);
    const int ranks = s.at("world_size").get<int>(), threads = s.at("threads").get<int>();
    if (ranks != rank_.ranks)
      throw Error(fmt::format("--resume {}: the run was started on {} rank{} and resumes on as many (mpirun -np {}), "
                              "found {}", opt_.resume, ranks, ranks == 1 ? "" : "s", ranks, rank_.ranks));
    if (rank_.dev.is_cpu() && threads != omp_get_max_threads())
      throw Error(fmt::format("--resume {}: the run used {} CPU threads and this process has {}; a CPU run resumes bit "
                              "for bit only with as many (give --threads {})", opt_.resume, threads,
                              omp_get_max_threads(), threads));
    if (s.at("steps_per_epoch").get<std::int64_t>() != per_epoch_ || s.at("total_steps").get<std::int64_t>() != steps_.total)
      throw Error(fmt::format("--resume {}: the run had {} steps of which {} per epoch, this one has {} and {} (has "
                              "the data set changed?)", opt_.resume, s.at("total_steps").dump(),
                              s.at("steps_per_epoch").dump(), steps_.total, per_epoch_));
    if (st.step > steps_.total)
      throw FormatError(fmt::format("{}: expected a step <= {}, found {}", where, steps_.total, st.step));
    const auto limits = s.at("micro_batch_limits").get<std::vector<double>>();
    if (limits.size() != static_cast<std::size_t>(ranks))
      throw FormatError(fmt::format("{}: expected {} micro-batch limits, found {}", where, ranks, limits.size()));
    const double mine = limits[static_cast<std::size_t>(rank_.rank)];
    if (mine >= 1) executor_->set_micro_batch_limit(static_cast<std::int64_t>(mine));
    const nlohmann::json& m = s.at("meter");
    result_.peak_bytes = m.at("peak_bytes").get<std::int64_t>();
    result_.predicted_peak_bytes = m.at("predicted_peak_bytes").get<std::int64_t>();
    result_.oom_retries = m.at("oom_retries").get<std::int64_t>();
    result_.micro_batch = m.at("micro_batch").get<std::int64_t>();
    result_.micro_batches_per_step = m.at("micro_batches_per_step").get<std::int64_t>();
    meter_.mismatches = m.at("mismatches").get<std::int64_t>();
    meter_.steps = st.step;
    epoch_loss_ = s.at("epoch_loss").get<double>(), epoch_steps_ = s.at("epoch_steps").get<std::int64_t>();
    last_loss_ = s.at("last_loss").get<double>(), result_.train_loss = s.at("train_loss").get<double>();
    eval_ = {s.at("eval").at("loss").get<double>(), s.at("eval").at("accuracy").get<double>()};
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", where, e.what()));
  }
  // Steps into the epoch of the last step done (all of them when it ended the epoch).
  const std::int64_t into_epoch = st.step == 0 ? 0 : st.step - (st.step - 1) / per_epoch_ * per_epoch_;
  if (epoch_steps_ != into_epoch)
    throw FormatError(fmt::format("{}: expected {} steps into the epoch at step {}, found {}", where, into_epoch, st.step,
                                  epoch_steps_));
  if (const auto it = st.files.find("metrics.csv"); it != st.files.end()) metrics_text_ = it->second;
  epoch_end_pending_ = st.step > 0 && (st.step % per_epoch_ == 0 || st.step == steps_.total);
  result_.resumed_from = st.step;
  result_.checkpoint = dir->string();
  fmt::print(log_, "resumed from {}: {} of {} steps done (epoch {}, step {} of {}){}\n", dir->string(), st.step,
             steps_.total, (st.step - (epoch_end_pending_ ? 1 : 0)) / per_epoch_ + 1, epoch_steps_, per_epoch_,
             executor_->micro_batch_limit() == INT64_MAX
                 ? ""
                 : fmt::format(", micro-batches of at most {} after out-of-memory retries", executor_->micro_batch_limit()));
}

// A pipeline's traced step: every stage's timeline to rank 0 (a collective), which draws them into
// pipeline.svg, with the bubble the schedule implies for k micro-batches on S equal stages.
void TrainingRun::write_schedule(std::int64_t step, const mbp::StepResult& r) {
  const mbp::PipelineTrace& mine = mbp::as_stage(*executor_, "the pipeline's schedule").trace();
  const auto S = static_cast<std::size_t>(rank_.ranks);
  const std::size_t slots = 2 * static_cast<std::size_t>(r.micro_batches), per_rank = 2 + 4 * slots;
  std::vector<double> all(S * per_rank, 0.0);
  double* row = all.data() + per_rank * static_cast<std::size_t>(rank_.rank);
  row[0] = mine.seconds, row[1] = mine.idle_seconds;
  for (std::size_t i = 0; i < std::min(slots, mine.events.size()); ++i) {
    const mbp::PipelineEvent& e = mine.events[i];
    double* ev = row + 2 + 4 * i;
    ev[0] = e.forward ? 1 : 2, ev[1] = static_cast<double>(e.index), ev[2] = e.start, ev[3] = e.end;
  }
  rank_.world->all_reduce_sum(all.data(), all.size());
  if (rank_.rank != 0) return;
  std::vector<mbp::PipelineTrace> traces(S);
  for (std::size_t s = 0; s < S; ++s) {
    const double* v = all.data() + per_rank * s;
    traces[s].seconds = v[0], traces[s].idle_seconds = v[1];
    for (std::size_t i = 0; i < slots; ++i) {
      const double* ev = v + 2 + 4 * i;
      if (ev[0] == 0) break;
      traces[s].events.push_back({ev[0] == 1, static_cast<std::int64_t>(ev[1]), ev[2], ev[3]});
    }
  }
  const double k = static_cast<double>(r.micro_batches), stages = static_cast<double>(S);
  const std::string title = fmt::format(
      "{} in {} stages ({}), step {}: {} micro-batches of {}; equal stages would wait {:.0f}% ((S-1)/(k+S-1))",
      opt_.model, S, mbp::pipeline_schedule_name(setup_.stage->schedule), step + 1, r.micro_batches, r.micro_batch,
      100.0 * (stages - 1) / (k + stages - 1));
  write_text(std::filesystem::path(opt_.out) / "pipeline.svg", report::pipeline_svg(traces, title));
}

void TrainingRun::report_stop() const {
  const std::string how = rank_.ranks > 1 ? fmt::format("mpirun -np {} tally train", rank_.ranks) : "tally train";
  fmt::print(log_, "\nstopped by {} after step {} of {}: {}\n", StopSignals::name(stopped_), meter_.steps,
             steps_.total,
             options_.out.empty() ? std::string("no run folder (--out), so no checkpoint")
                                  : fmt::format("checkpoint {} written; continue with: {} --resume {}",
                                                result_.checkpoint, how, options_.out));
  log_.flush();
}

// The result, the ranks' agreement, the memory and profile reports, and the files.
void TrainingRun::finish() {
  const StepMeter& meter = meter_;
  const std::int64_t step = meter.steps;
  const int ranks = rank_.ranks;
  result_.test_accuracy = eval_.accuracy;
  result_.test_loss = eval_.loss;
  result_.images_per_second = meter.images_per_second();
  result_.steps = step;
  result_.world_size = ranks;
  if (meter.measured > 1) {
    result_.communication_seconds_per_step = meter.steady_communication / static_cast<double>(meter.measured - 1);
    result_.seconds_per_step = meter.steady_seconds / static_cast<double>(meter.measured - 1);
  }
  result_.parameters = setup_.stage_parameters;
  result_.ranks = gather_ranks(*rank_.world, result_);
  if (setup_.stage) {
    // Every stage's parameters and buffers to every rank, through host memory: rank 0 saves them all.
    const mbp::PipelineStage& st = *setup_.stage;
    result_.pipeline_stages = st.stages;
    mbp::gather_stages(*setup_.model, setup_.segments, st.bounds, *comm_);
    for (RankResult& rr : result_.ranks) {
      const auto s = static_cast<std::size_t>(rr.rank);
      rr.segments = mbp::segment_range(setup_.segments, st.bounds[s], st.bounds[s + 1]);
    }
    fmt::print(log_, "pipeline: {} stages, the parameters of every stage gathered on rank 0\n", st.stages);
    for (const RankResult& rr : result_.ranks)
      fmt::print(log_, "stage {} ({}): {} parameters, memory limit {}, micro-batches of {} x {} per step, peak {} bytes, "
                       "predicted {}{}\n",
                 rr.rank, rr.segments, rr.parameters, format_bytes(static_cast<std::size_t>(rr.memory_limit_bytes)),
                 rr.micro_batch, rr.micro_batches_per_step, rr.peak_bytes, rr.predicted_peak_bytes,
                 rr.seconds_per_step > 0
                     ? fmt::format(", waits {:.1f} of {:.1f} ms per step ({:.1f}%)", 1000.0 * rr.communication_seconds_per_step,
                                   1000.0 * rr.seconds_per_step, 100.0 * rr.communication_seconds_per_step / rr.seconds_per_step)
                     : std::string());
  } else if (!distributed::parameters_identical(*setup_.model, *comm_)) {
    throw Error(fmt::format("after {} steps the ranks' parameters differ; a data-parallel run must keep them identical",
                            step));
  }
  if (ranks > 1 && !setup_.stage) {
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
        meter.steady_images > 0 ? 1000.0 * meter.steady_seconds / static_cast<double>(meter.measured - 1) : 0.0));
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
    fmt::print(log_, "wrote {0}/metrics.csv, {0}/summary.json, {0}/memory_trace.json{1} and {0}/memory.svg\n", opt_.out,
               setup_.stage && steps_.total > 1 ? fmt::format(", {}/pipeline.svg", opt_.out) : std::string());
  }
}

}  // namespace

TrainResult train(const TrainOptions& options, std::ostream& all_log) {
  if (options.resume.empty()) return TrainingRun(options, all_log).run();
  TrainOptions o = options;  // a resumed run: the saved options, but for the few that may change
  std::error_code ec;
  if (o.out.empty()) o.out = o.resume;
  if (!std::filesystem::equivalent(o.out, o.resume, ec))
    throw Error(fmt::format("--out {} with --resume {}: a resumed run continues in its own run folder", o.out, o.resume));
  check_resume_options(resume_options(o.resume), o, {});
  return TrainingRun(o, all_log).run();
}

}  // namespace tally::app
