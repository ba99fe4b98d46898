// apps/setup.h — what `tally train` and `tally plan` build alike, written once.
//
// The memory budget travels as an object, not through a global: the app turns --memory-limit
// into an arena (a real one for `train`, a virtual one for `plan`), builds the model and the
// optimizer inside it, and hands it to the MBP executor, whose planner dry-runs on clones of it:
//
//   --memory-limit  ->  Arena  ->  build_setup (model, optimizer)  ->  mbp::Executor  ->  Planner
//
// The options themselves, their flags and rules, are apps/options.h's table.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "apps/options.h"
#include "core/device.h"
#include "core/dry_run.h"
#include "nn/module.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "optim/optimizer.h"

namespace tally::app {

// "12" -> 12; anything but a whole positive number (a sign, a suffix, empty) -> nullopt.
std::optional<std::int64_t> parse_positive_integer(const std::string& s);

// The rule of a number option: the smallest value it takes, the largest if any, and whether it
// must be whole. One rule per flag, used by the command line's validators (apps/command_line.cpp) and by
// the checks of the C++ entry points (check_train_options, plan), so both say the same thing:
// "--lr: must be a non-negative number, found -1".
struct NumberRule {
  double min = 0;
  std::optional<double> max;
  bool whole = false;
};
inline const NumberRule kNonNegative{0, std::nullopt, false};
inline const NumberRule kPositiveWhole{1, std::nullopt, true};
inline const NumberRule kNonNegativeWhole{0, std::nullopt, true};
inline const NumberRule kFraction{0, 1, false};
// A learning rate: a schedule multiplies it by up to 2 (cosine: lr (1 + cos) / 2), so a bound far
// below the largest double keeps every step's rate finite (1e308 became inf after planning).
inline const NumberRule kLearningRate{0, 1e6, false};
// The cost model's rates as given (--copy-bandwidth in GB/s, --compute-rate in GFLOP/s): positive,
// and within what a machine could have, so that their products and quotients stay finite.
inline const NumberRule kCopyBandwidth{1e-6, 1e6, false};
inline const NumberRule kComputeRate{1e-6, 1e9, false};
// What a value of `rule` must be: "a positive whole number", "a number in [0, 1]".
std::string rule_text(const NumberRule& rule);
// "" when the text `value` is a finite number that keeps `rule`, else what it must be ("must be a
// non-negative number, found -1").
std::string number_error(const NumberRule& rule, const std::string& value);
// Throws an Error "<flag>: must be ..., found <value>" unless `value` keeps `rule`.
void check_number(const std::string& flag, const NumberRule& rule, double value);

// "3x224x224" -> {3, 224, 224}: one sample's shape (--input); an Error naming --input otherwise.
Shape parse_input(const std::string& s);

// "a,b,c" -> {"a", "b", "c"}; "a" -> {"a"} (empty items stay, for the caller to refuse).
std::vector<std::string> split_list(const std::string& text);
// Whether a --memory-limit (one size, or one per rank or stage) asks for `auto` anywhere.
bool lists_auto(const std::string& memory_limit);

// --device `given` names `dev`: an Error naming the machine's GPUs when it is a GPU this machine
// does not have (cuda:N past the last one).
void check_gpu_index(const std::string& given, Device dev);

// Writes `text` to `path` (through a temporary and a rename: never half a file); an Error naming the
// path when it cannot.
void write_text(const std::filesystem::path& path, const std::string& text);

// Whether a run can write where its flag says, tried before the run (as root too: permission bits
// prove nothing, so a file is created and removed): `path` a file this process can create (its
// folder must exist), `dir` a folder it can create files in (made when missing). An Error naming
// the flag, the path and the system's reason otherwise; a path that exists and is no regular file
// (a folder, a FIFO, a device) is an error too.
void check_writable_file(const std::string& flag, const std::string& path);
void check_writable_folder(const std::string& flag, const std::string& dir);

// --memory-limit: a size ("48MiB", "2GiB") or "auto" (core/memory.h's default capacity for the device).
std::size_t parse_memory_limit(const std::string& text, Device dev);

// A warning on `log` when `bytes` of host memory (`flag` given as `text`) is more than this process
// can use now (core/machine.h): a step that needs more would fail with the system's out-of-memory,
// not with tally's plan; `planning` (tally plan): the plan may be meant for another machine.
void warn_beyond_host_memory(const std::string& flag, const std::string& text, std::size_t bytes, bool planning,
                             std::ostream& log);

// --host-memory-limit (docs/host-tier.md): null for "none"; else the host tier's arena — a size, or
// "auto": 3/4 of what this process may use (core/machine.h; the rest is its own, as for the CPU's
// --memory-limit auto), less `device_limit` when the device is the CPU (both arenas are host
// memory), divided among this machine's `local_ranks` (distributed::neighbours' local_size: the
// ranks that gathered their host names, whatever launched them), in 64 MiB steps. Virtual (offsets
// only) from `dry` when given (`tally plan`); else reserved (Arena::make_host: pinned where a GPU is
// present). `log` gets one line saying what auto measured.
std::shared_ptr<Arena> make_host_arena(const std::string& text, Device dev, std::size_t device_limit,
                                       const DryRun* dry, std::ostream* log = nullptr, int local_ranks = 1);

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::sgd;
  double lr = 0.1, momentum = 0.9, weight_decay = 5e-4;
  bool nesterov = false;
  // With a host tier, the state is created where the executor's plan places it (never on the
  // device first: optim::StateCreation::when_placed); else beside the parameters, at once.
  bool state_when_placed = false;
};

// A pipeline stage to build (mbp/pipeline.h): which of how many, where the stages begin (the
// --pipeline-split text: segment names; "work" for mbp::work_balanced_cut; empty or "memory" for
// mbp::balanced_cut), the schedule, and what the cut's dry run needs (one sample's shape, the
// activations' dtype).
struct PipelineConfig {
  int stages = 1, stage = 0;
  std::string split;
  mbp::PipelineSchedule schedule = mbp::PipelineSchedule::one_f_one_b;
  Shape sample_shape;
  DType activation_dtype = DType::Float32;
  std::vector<std::int64_t> limits;  // every stage's memory limit in bytes (one per stage)
  std::int64_t batch = 1;            // the batch the micro-batches split
};

// The pipeline of options.pipeline_stages stages (stage 0; the caller sets its own) for batches of
// `batch` samples of `sample_shape`: --pipeline-split, --pipeline-schedule, --precision (the
// activations' dtype); `memory_limits`: --memory-limit as given (one size, or one per stage; an Error
// otherwise; `auto` is `device`'s default).
PipelineConfig pipeline_config(const StepOptions& options, const Shape& sample_shape, std::int64_t batch,
                               const std::string& memory_limits, Device device);

struct Setup {
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::int64_t parameters = 0;  // elements, of the whole model
  // A pipeline stage: the whole model is built on `host` (outside the budget; the other stages'
  // tensors stay there), this stage's part moved into the budget; the optimizer holds its parameters.
  std::shared_ptr<Arena> host;
  std::optional<mbp::PipelineStage> stage;
  std::vector<nn::Module::Segment> segments;
  std::vector<mbp::SegmentCost> segment_costs;  // what the cut was chosen from (mbp::segment_costs)
  std::int64_t stage_parameters = 0;  // elements
};

// The model (from `init`'s safetensors weights if not empty, then on `arena`'s device, in training
// mode) and its optimizer, every persistent byte — parameters, gradients, optimizer state — in
// `arena`. When they do not fit, an OutOfMemory names the budget (`limit_text`, as the user wrote
// it), the model and the optimizer.
// With `pipeline` (stages > 1): stage `pipeline->stage`'s part of the model in `arena`, the rest on
// a host arena of its own (virtual when `arena` is: `tally plan`).
Setup build_setup(const std::shared_ptr<Arena>& arena, const nn::ModelConfig& model, const std::string& init,
                  const OptimizerConfig& optimizer, const std::string& limit_text,
                  const PipelineConfig* pipeline = nullptr);

// What --pipeline-split chose, in words: "balanced by memory (the planner's)", "balanced by work
// (forward FLOPs)" or "--pipeline-split layer2.1".
std::string cut_description(const std::string& split);

// A pipeline cut's forward work per stage, and the cut that would balance it: "work per stage:
// 13% / 87% of the forward FLOPs (balanced by work: --pipeline-split layer2.1, 45% / 55%)".
std::string work_line(const std::vector<mbp::SegmentCost>& costs, const std::vector<std::size_t>& bounds);

// "parameters 1.1 MiB, gradients 1.0 MiB, optimizer state 1.0 MiB": the persistent bytes in `arena`
// (without the state while `optimizer`'s is not created yet: optim::StateCreation::when_placed).
std::string persistent_summary(const Arena& arena, const optim::Optimizer* optimizer = nullptr);
// "; the optimizer state (195.0 MiB) is created where the plan places it" while it is not created
// yet, else empty.
std::string deferred_state_note(const optim::Optimizer& optimizer);

// executor.plan(batch), with an explicit micro-batch's failure named by its flag.
const mbp::Plan& plan_step(mbp::Executor& executor, std::int64_t batch, std::optional<std::int64_t> micro_batch);

}  // namespace tally::app
