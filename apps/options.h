// apps/options.h — every option of `tally train`, `tally sweep` and `tally plan`, declared once.
//
// One table (apps/options.cpp) holds each option: its flag, the field it fills, its type and
// allowed values, its help (per command where they differ), the commands that take it, and
// whether a resumed run may change it. Everything else is derived from that table:
//
//   the command line      add_options(cli, TrainOptions&) etc.: each command's flags, parsed
//                         straight into the fields (enumerations into enums) with tally's words
//                         for a bad value ("--precision: expected one of fp32, bf16, found fp16")
//   state.json            option_values / options_from_values: every option as text, the
//                         same strings as the command line takes
//   --resume              options_changeable_on_resume, check_resume_options
//   the executor          executor_options(StepOptions, ...)
//
// A command's defaults are its options struct's initial values (TrainOptions, PlanOptions,
// SweepOptions): the C++ API and the command line start from the same ones, and the help shows
// them. Adding an option: a field in its struct, one entry in the table, and its use.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/conv_tuning.h"
#include "core/device.h"
#include "core/tensor.h"
#include "mbp/executor.h"
#include "mbp/pipeline.h"
#include "nn/resnet.h"

namespace CLI {
class App;
}

namespace tally::app {

enum class OptimizerKind { sgd, adamw };
enum class LrScaling { linear, sqrt };  // tally sweep's learning rate per batch size (apps/sweep.h)
enum class OnOff { off, on };

// The names of an enumeration's values on the command line, in state.json and summary.json (each
// list in its library where it has one: nn::norm_name, mbp::precision_names, ...), in the order the
// help lists them.
template <class E>
using EnumNames = std::vector<std::pair<E, std::string>>;
const EnumNames<nn::Norm>& enum_names(nn::Norm);
const EnumNames<OptimizerKind>& enum_names(OptimizerKind);
const EnumNames<mbp::Precision>& enum_names(mbp::Precision);
const EnumNames<MemoryFormat>& enum_names(MemoryFormat);
const EnumNames<mbp::LossNormalization>& enum_names(mbp::LossNormalization);
const EnumNames<mbp::PipelineSchedule>& enum_names(mbp::PipelineSchedule);
const EnumNames<LrScaling>& enum_names(LrScaling);
const EnumNames<mbp::Placement>& enum_names(mbp::Placement);
const EnumNames<OnOff>& enum_names(OnOff);
const EnumNames<distributed::Collectives>& enum_names(distributed::Collectives);

template <class E>
std::string name_of(E value) {
  for (const auto& [v, n] : enum_names(value))
    if (v == value) return n;
  return "?";
}
// "sgd, adamw": the allowed names, for messages and the help.
template <class E>
std::string names_list(E any) {
  std::string s;
  for (const auto& [v, n] : enum_names(any)) s += (s.empty() ? "" : ", ") + n;
  return s;
}
// The value named `name`, nullopt when no value has that name.
template <class E>
std::optional<E> enum_from(const std::string& name) {
  for (const auto& [v, n] : enum_names(E{}))
    if (n == name) return v;
  return std::nullopt;
}
// --memory-format's value: nullopt is "auto".
std::string memory_format_text(const std::optional<MemoryFormat>& f);

// The options of one training step, which `train` (and `sweep`) and `plan` take with one meaning.
// TrainOptions (apps/trainer.h) and PlanOptions (apps/plan.h) are made of them and their own.
struct StepOptions {
  std::string model = "resnet20";  // nn::model_names()
  nn::Norm norm = nn::Norm::Batch;
  std::optional<std::int64_t> num_classes;  // default: 1000 for images of 64 pixels and more, else 10
  std::int64_t batch_size = 128;
  OptimizerKind optimizer = OptimizerKind::sgd;
  double momentum = 0.9;  // SGD momentum (0: no momentum buffer)
  std::string device = "auto";  // cpu | cuda | cuda:N | auto (the GPU when there is one)
  // Arena capacity: a size ("48MiB", "2GiB") or "auto", or a comma list with one per rank under
  // mpirun ("48MiB,24MiB") or one per pipeline stage (CPU: 8 GiB of address space; CUDA: free
  // device memory less a margin of max(1 GiB, 1/32 of the device)).
  std::string memory_limit = "auto";
  // The host tier (docs/host-tier.md): "none" (the default: everything on the device, nothing
  // changes), a size of host memory ("2GiB"), or "auto" (3/4 of what this process may use, less
  // the device's arena when that is host memory too, divided among this machine's ranks).
  std::string host_memory_limit = "none";
  // Where the step's state lives (mbp::Placement); unset ("auto"): the executor's choice.
  std::optional<mbp::Placement> placement;
  // The cost model's rates (mbp/activations.h): "measure" (once, at start-up) or a number, in GB/s
  // for the copies between the tiers and GFLOP/s for the device's compute.
  std::string copy_bandwidth = "measure";
  std::string compute_rate = "measure";
  std::optional<std::int64_t> micro_batch;  // unset: the largest that fits ("auto")
  // auto | none | blocks | all | a level: recomputation (ExecutorOptions::recompute, mbp/executor.h).
  std::string recompute = "auto";
  // fp32 | bf16: bf16 mixed precision (mbp::Precision, docs/precision.md): bf16 activations,
  // float32 master weights, gradients, optimizer state and loss. Evaluation too.
  mbp::Precision precision = mbp::Precision::fp32;
  // CUDA (docs/gpu.md, "Numerics"): float32 GEMMs and convolutions may use TF32 tensor cores; cuDNN
  // takes deterministic convolution algorithms only (on: bit-for-bit resume and "MBP equals the full
  // batch" on a GPU rest on it; off: its other algorithms too, as PyTorch's default). No effect on
  // the CPU, whose kernels are deterministic.
  bool tf32 = false;
  OnOff deterministic = OnOff::on;
  // CUDA: convolution engines chosen by measurement (core/conv_tuning.h, docs/gpu.md "Tuning"), kept
  // in this file: "default" (ConvTuning::default_path(), the user's cache folder), a path, or "none"
  // (the heuristics' choices). tally plan replays the file and measures nothing.
  std::string tuning_file = "default";
  // The cap on measuring in one process, seconds (passes past it keep the heuristics' choice and are
  // measured by a later run).
  double tuning_seconds = ConvTuning::kDefaultSeconds;
  // CUDA under mpirun: how tensors travel between ranks (distributed::Collectives): auto (NCCL where
  // every rank of every machine has a GPU of its own, else MPI through host memory), nccl or mpi.
  distributed::Collectives collectives = distributed::Collectives::automatic;
  // CUDA: micro-batches after a step's first recorded as CUDA graphs and replayed
  // (ExecutorOptions::cuda_graphs, docs/gpu.md "CUDA graphs"). Off until a GPU run measures it.
  OnOff cuda_graphs = OnOff::off;
  // The activations' layout (ExecutorOptions::memory_format, docs/memory-format.md); unset ("auto"):
  // channels_last on a CPU with oneDNN and on CUDA in bf16 or with TF32, contiguous for plain float32
  // on CUDA and for pipeline stages.
  std::optional<MemoryFormat> memory_format;
  // Pipeline stages (mbp/pipeline.h; docs/distributed.md): 1 (the whole model on every rank), or S
  // with mpirun -np S: rank s runs stage s, a contiguous part of the model's segments (stem, residual
  // blocks, head), on its own --memory-limit. pipeline_split names the segments where stages 2..S
  // begin ("layer3.0"), or "memory" / "" (the largest micro-batch, then the smallest largest stage)
  // or "work" (the forward FLOPs balanced). CPU only.
  int pipeline_stages = 1;
  std::string pipeline_split;
  mbp::PipelineSchedule pipeline_schedule = mbp::PipelineSchedule::one_f_one_b;
};

// The rules of a step's options that their types do not keep: --model among nn::model_names(),
// --batch-size, --num-classes and --pipeline-stages >= 1, --micro-batch between 1 and --batch-size,
// --momentum >= 0, --recompute's policy, --pipeline-split only with stages. An Error naming the flag,
// what it must be and what was found; for the C++ entry points (the command line checks as it parses).
void check_step_options(const StepOptions& options);

// The cost model's rates as given (0 where "measure"), unset when both are measured.
std::optional<mbp::CostRates> given_cost_rates(const StepOptions& options);
// The executor's options that a step's options decide (the caller adds the loss, the log, the
// communicator and the pipeline stage): the sample's shape, the micro-batch, recomputation,
// precision and the memory format resolved for `device` ("auto": contiguous for a pipeline stage).
// The convolution tuning of a --tuning-file value (StepOptions::tuning_file): null for "none", else
// one per file and process; `measure`: false replays the file only (tally plan, a described GPU);
// `seconds`: the cap on measuring.
std::shared_ptr<ConvTuning> conv_tuning(const std::string& file, bool measure, double seconds);
mbp::ExecutorOptions executor_options(const StepOptions& options, const Shape& sample_shape, Device device,
                                      bool pipeline_stage);

struct TrainOptions;
struct PlanOptions;
struct SweepOptions;
struct DeviceOptions;

// Each command's flags from the table, registered on `cli` and parsed into `options` (the command's
// defaults: their initial values). A bad value is a CLI::ValidationError in tally's words.
void add_options(CLI::App& cli, TrainOptions& options);
void add_options(CLI::App& cli, SweepOptions& options);
void add_options(CLI::App& cli, PlanOptions& options);
void add_options(CLI::App& cli, DeviceOptions& options);
// The options given on a parsed command line, by their names in the table ("augment" for --augment
// and --no-augment, "progress" for --no-progress).
std::vector<std::string> given_options(const CLI::App& cli);

// Every stored option of a run as (name, value as text), in the table's order: the one list the
// checkpoint's options (state.json), the ranks' agreement and the resume check are made of.
// A flag and its "--no-" form share a name ("augment": on|off|default, "shuffle", "eval", ...).
std::vector<std::pair<std::string, std::string>> option_values(const TrainOptions& o);
// The inverse, for the values a checkpoint saved; FormatError naming `where` and the option when
// one is missing or does not parse (an option newer than the checkpoint keeps its default).
TrainOptions options_from_values(const std::map<std::string, std::string>& values, const std::string& where);
// The options a resumed run may change, by name (they do not change its results).
const std::vector<std::string>& options_changeable_on_resume();
// Throws one tally::Error listing every option (of `names`, or of all when empty) that differs
// between the run's saved options and `given` — both values named — except the changeable ones.
void check_resume_options(const TrainOptions& saved, const TrainOptions& given, const std::vector<std::string>& names);
// `--resume DIR [flags]`: the run's saved options; a flag given again (`names`) must keep the run's
// value (checked as above), except the changeable ones, which are taken from `given`.
TrainOptions resumed_options(const TrainOptions& saved, const TrainOptions& given, const std::vector<std::string>& names);
// The same check for a sweep's own options (--batch-sizes, --lr-scaling), then its runs' (the above).
void check_sweep_resume(const SweepOptions& saved, const SweepOptions& given, const std::vector<std::string>& names);

}  // namespace tally::app
