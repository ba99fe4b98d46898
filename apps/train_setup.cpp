// apps/train_setup.cpp — a `tally train` run's pieces made from its options (apps/trainer.h,
// apps/training_run.h): the options checked before any work, this rank's setup, the data, the
// arena, the model and optimizer, the executor's options, the schedule. The loop that uses them
// is apps/trainer.cpp.
#include "apps/training_run.h"

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
namespace {

Device choose_device(const std::string& d) {
  if (d == "cpu") return Device::cpu();
  if (d == "cuda" || d.rfind("cuda:", 0) == 0) {
    const Device dev = parse_device(d);
    if (!cuda_available())
      throw Error(fmt::format("--device {}: no GPU is present ({})", d, build_info()));
    check_gpu_index(d, dev);
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
  check_number("--lr", kLearningRate, opt.lr);
  check_number("--weight-decay", kNonNegative, opt.weight_decay);
  check_number("--warmup-epochs", kNonNegative, opt.warmup_epochs);
  check_number("--label-smoothing", kFraction, opt.label_smoothing);
  check_number("--threads", kNonNegativeWhole, opt.threads);
  if (opt.cuda_graphs == OnOff::on && opt.profile)
    throw Error("--cuda-graphs on with --profile: a replayed micro-batch runs no op's host code, so its ops cannot be "
                "timed one by one; profile with --cuda-graphs off");
  if (opt.pipeline_stages > 1) {
    if (opt.collectives == distributed::Collectives::nccl)
      throw Error(fmt::format("--pipeline-stages {} with --collectives nccl: stages exchange their messages point to "
                              "point, which tally runs over MPI through host memory (--collectives mpi or auto); NCCL "
                              "send/recv between stages needs one GPU per rank, which no machine tally is tested on "
                              "has, so it is refused rather than untested", opt.pipeline_stages));
    if (!opt.checkpoint_every.empty() || !opt.resume.empty())
      throw Error(fmt::format("--pipeline-stages {} with {}: a pipeline run writes no training-state checkpoints yet",
                              opt.pipeline_stages, opt.resume.empty() ? "--checkpoint-every" : "--resume"));
    if (opt.loss_normalization != mbp::LossNormalization::exact)
      throw Error("--loss-normalization per-micro-batch is for one process; a pipeline uses exact");
  }
  const Device dev = choose_device(opt.device);
  if (opt.cuda_graphs == OnOff::on && !dev.is_cuda())
    throw Error(fmt::format("--cuda-graphs on: CUDA graphs record a GPU's work; expected --device cuda (or auto on a "
                            "machine with a GPU), found --device {}{}", opt.device,
                            opt.device == "cpu" ? "" : " (no GPU here)"));
  for (const std::string& limit : split_list(opt.memory_limit))  // a bad size fails before any work
    if (limit != "auto") (void)parse_memory_limit(limit, dev);
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

}  // namespace

// The data set of --data; --num-classes chooses the class count of synthetic data and must agree
// with a real data set's.
// A folder of pictures (data/folder.h) needs --input; --val-fraction and --max-image-pixels are its.
static data::Split load_folder_data(const TrainOptions& opt, const data::DataSpec& spec, std::ostream& log,
                                    BadImageLists* bad) {
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
  fo.fingerprint = !opt.out.empty() || !opt.resume.empty();  // what checkpoints record and resumes check
  if (opt.val_fraction != "none") {
    if (!number_error(kFraction, opt.val_fraction).empty() || std::strtod(opt.val_fraction.c_str(), nullptr) <= 0 ||
        std::strtod(opt.val_fraction.c_str(), nullptr) >= 1)
      throw Error(fmt::format("--val-fraction: expected none or a number in (0, 1), found {}", opt.val_fraction));
    fo.val_fraction = std::strtod(opt.val_fraction.c_str(), nullptr);
  }
  data::FolderSet set = data::load_folder(spec.dir, fo);
  if (opt.num_classes && *opt.num_classes != static_cast<std::int64_t>(set.classes.size()))
    throw Error(fmt::format("--num-classes {} does not match {}, which has {} classes, one per folder of {}/train "
                            "(--num-classes is for synthetic data)", *opt.num_classes, opt.data, set.classes.size(),
                            spec.dir));
  if (bad) *bad = {set.bad_images, set.bad_val_images};
  std::string skipped = data::skipped_text(set.skipped);
  const std::size_t prefetch = static_cast<std::size_t>(opt.batch_size * chw[0] * chw[1] * chw[2]) * sizeof(float);
  fmt::print(log, "data {}: {} classes, {} training images, {} for evaluation{}, read by {} workers{} into the next "
                  "batch while a step runs ({} of host memory a batch), transform {}; {}; {}\n",
             opt.data, set.classes.size(), set.train_files.size(), set.test_files.size(),
             opt.val_fraction != "none" ? fmt::format(" (--val-fraction {})", opt.val_fraction) : "",
             opt.workers > 0 ? opt.workers : omp_get_max_threads(), opt.workers > 0 ? "" : " (--workers 0: OpenMP's count)",
             format_bytes(prefetch), opt.transform, skipped.empty() ? "no other files" : "skipped: " + skipped, set.statistics);
  return std::move(set.split);
}

data::Split load_data(const TrainOptions& opt, const data::DataSpec& spec, std::ostream& log,
                      BadImageLists* bad) {
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
    warn_beyond_host_memory("--memory-limit", opt.memory_limit, limit, false, log);
  release_default_arena(dev);
  return std::make_shared<Arena>(dev, limit);
}


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

// Ranks on one GPU (fewer GPUs than ranks, or --device cuda:K pinning them all to GPU K; not ranks
// that CUDA_VISIBLE_DEVICES gives a GPU each): NCCL refuses them, so auto collectives take the staged
// transport (distributed::for_device) and nccl with a pin is an error naming it; `auto` memory is an
// error (each would take what the others left free). A collective: every rank asks, whatever its device.
void check_shared_gpu(RankSetup& r) {
  const std::string bus = r.dev.is_cuda() ? cuda_device_bus_id(r.dev.index) : std::string();
  const distributed::Neighbours n = distributed::neighbours(*r.world, bus);
  if (!r.dev.is_cuda() || n.sharing_gpu < 2) return;
  const bool pinned = r.opt.device != "auto" && r.opt.device != "cuda";
  if (pinned && r.opt.collectives == distributed::Collectives::nccl)
    throw Error(fmt::format("--collectives nccl with --device {}: {} ranks of this machine would run on GPU {}, and "
                            "NCCL needs a GPU for each rank (give --device cuda, which gives each rank its own where "
                            "there are enough, or --collectives mpi)", r.opt.device, n.sharing_gpu, r.dev.index));
  if (lists_auto(r.opt.memory_limit))
    throw Error(fmt::format("--memory-limit {}: {} ranks of this machine share GPU {} ({}{}), and each would take "
                            "what the others left free; give each rank its slice (--memory-limit SIZE, or one size "
                            "per rank)", r.opt.memory_limit, n.sharing_gpu, r.dev.index, bus,
                            pinned ? fmt::format(", --device {}", r.opt.device)
                                   : fmt::format("; {} rank{} on {} GPU{}", n.local_size, n.local_size == 1 ? "" : "s",
                                                 n.local_gpus, n.local_gpus == 1 ? "" : "s")));
}

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
  // Each rank of a machine takes the next GPU, sharing them in turn where there are fewer (its place
  // among its machine's ranks asked of all ranks: a collective, whatever the device).
  const distributed::Neighbours here = r.ranks > 1 ? distributed::neighbours(*r.world, "") : distributed::Neighbours{};
  const int local_rank = here.local_rank;
  r.local_ranks = here.local_size;
  if (r.dev.is_cuda() && (r.opt.device == "auto" || r.opt.device == "cuda"))
    r.dev = Device::cuda(local_rank % std::max(1, cuda_device_count()));
  check_shared_gpu(r);
  // Rank 0 speaks and writes the run folder; the others train silently.
  r.log = r.rank == 0 ? &all_log : &r.silent;
  if (r.rank != 0) r.opt.out.clear(), r.opt.save.clear(), r.opt.progress = false;
  if (r.opt.threads > 0) omp_set_num_threads(r.opt.threads);  // OpenBLAS stays single-threaded (kernels/cpu/gemm.cpp)
  if (!r.opt.out.empty()) {
    std::filesystem::create_directories(r.opt.out);
    r.lock.emplace(r.opt.out, r.opt.resume.empty() ? "--out" : "--resume");
  }
  if (r.dev.is_cuda()) set_allow_tf32(r.opt.tf32), set_deterministic(r.opt.deterministic == OnOff::on);
}

}  // namespace

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

namespace {

// A GPU stage's `auto` limit is what its arena reserved: the GPU's free memory measured before the
// arena took it (pipeline_config measures after, and would see only the margin). Each rank has its
// own GPU there (ranks sharing one refuse `auto`), so each tells the others its own, and every
// rank cuts the model from the same limits, as `tally plan` on those GPUs does.
void stage_limits_as_reserved(PipelineConfig& pc, const std::string& all_limits, const Arena& arena) {
  const std::vector<std::string> limits = split_list(all_limits);
  const auto is_auto = [&](int s) { return limits[limits.size() == 1 ? 0 : static_cast<std::size_t>(s)] == "auto"; };
  bool any = false;
  for (int s = 0; s < pc.stages; ++s) any = any || is_auto(s);
  if (!any || !arena.device().is_cuda()) return;
  std::vector<double> reserved(static_cast<std::size_t>(pc.stages), 0.0);
  reserved[static_cast<std::size_t>(pc.stage)] = static_cast<double>(arena.capacity());
  distributed::process_world()->all_reduce_sum(reserved.data(), reserved.size());
  for (int s = 0; s < pc.stages; ++s) {
    const auto i = static_cast<std::size_t>(s);
    if (is_auto(s)) pc.limits[i] = static_cast<std::int64_t>(reserved[i]);
  }
}

}  // namespace

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
                                      all_limits, arena->device());
  pc.stage = distributed::process_world()->rank();
  stage_limits_as_reserved(pc, all_limits, *arena);
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
  // This rank's samples in the global batch (dropout's masks, as one process would draw them).
  if (comm && comm->size() > 1 && !setup.stage)
    eo.first_sample = distributed::shard(opt.batch_size, comm->size(), comm->rank()).offset;
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


}  // namespace tally::app
