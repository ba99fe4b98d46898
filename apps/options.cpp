// apps/options.cpp — the table of every option, and what is derived from it; see apps/options.h.
#include "apps/options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "apps/device.h"
#include "apps/plan.h"
#include "apps/setup.h"
#include "apps/sweep.h"
#include "apps/trainer.h"
#include "core/conv_tuning.h"
#include "core/device_file.h"
#include "core/error.h"
#include "data/folder.h"
#include "data/loader.h"
#include "optim/schedule.h"

namespace tally::app {

// ---- the names of the enumerations ------------------------------------------------------------

namespace {

// A library's list of names and its parser, as pairs (the list stays the library's).
template <class E, class Parse>
EnumNames<E> from_library(const std::vector<std::string>& names, Parse parse) {
  EnumNames<E> out;
  for (const std::string& n : names) out.emplace_back(parse(n), n);
  return out;
}

}  // namespace

const EnumNames<nn::Norm>& enum_names(nn::Norm) {
  static const EnumNames<nn::Norm> v = [] {
    EnumNames<nn::Norm> out;
    for (const nn::Norm n : {nn::Norm::Batch, nn::Norm::Group, nn::Norm::None}) out.emplace_back(n, nn::norm_name(n));
    return out;
  }();
  return v;
}
const EnumNames<distributed::Collectives>& enum_names(distributed::Collectives) {
  using C = distributed::Collectives;
  static const EnumNames<C> v{{C::automatic, "auto"}, {C::nccl, "nccl"}, {C::mpi, "mpi"}};
  return v;
}
const EnumNames<OnOff>& enum_names(OnOff) {
  static const EnumNames<OnOff> v{{OnOff::on, "on"}, {OnOff::off, "off"}};
  return v;
}
const EnumNames<OptimizerKind>& enum_names(OptimizerKind) {
  static const EnumNames<OptimizerKind> v{{OptimizerKind::sgd, "sgd"}, {OptimizerKind::adamw, "adamw"}};
  return v;
}
const EnumNames<mbp::Precision>& enum_names(mbp::Precision) {
  static const auto v = from_library<mbp::Precision>(mbp::precision_names(), mbp::parse_precision);
  return v;
}
const EnumNames<MemoryFormat>& enum_names(MemoryFormat) {
  static const EnumNames<MemoryFormat> v = [] {
    EnumNames<MemoryFormat> out;
    for (const MemoryFormat f : {MemoryFormat::Contiguous, MemoryFormat::ChannelsLast})
      out.emplace_back(f, memory_format_name(f));
    return out;
  }();
  return v;
}
const EnumNames<mbp::LossNormalization>& enum_names(mbp::LossNormalization) {
  static const EnumNames<mbp::LossNormalization> v{{mbp::LossNormalization::exact, "exact"},
                                                   {mbp::LossNormalization::per_micro_batch, "per-micro-batch"}};
  return v;
}
const EnumNames<mbp::PipelineSchedule>& enum_names(mbp::PipelineSchedule) {
  static const auto v = from_library<mbp::PipelineSchedule>(mbp::pipeline_schedule_names(), mbp::parse_pipeline_schedule);
  return v;
}
const EnumNames<mbp::Placement>& enum_names(mbp::Placement) {
  static const EnumNames<mbp::Placement> v = [] {
    EnumNames<mbp::Placement> out;
    for (const mbp::Placement p : {mbp::Placement::device, mbp::Placement::optimizer, mbp::Placement::gradients})
      out.emplace_back(p, mbp::placement_name(p));
    return out;
  }();
  return v;
}
const EnumNames<LrScaling>& enum_names(LrScaling) {
  static const EnumNames<LrScaling> v{{LrScaling::linear, "linear"}, {LrScaling::sqrt, "sqrt"}};
  return v;
}

std::string memory_format_text(const std::optional<MemoryFormat>& f) { return f ? name_of(*f) : "auto"; }

void check_step_options(const StepOptions& o) {
  const std::vector<std::string>& models = nn::model_names();
  if (std::find(models.begin(), models.end(), o.model) == models.end())
    throw Error(fmt::format("--model: expected one of {}, found {}", fmt::join(models, ", "), o.model));
  check_number("--batch-size", kPositiveWhole, static_cast<double>(o.batch_size));
  if (o.num_classes) check_number("--num-classes", kPositiveWhole, static_cast<double>(*o.num_classes));
  if (o.micro_batch && (*o.micro_batch < 1 || *o.micro_batch > o.batch_size))
    throw Error(fmt::format("--micro-batch must be between 1 and --batch-size {}, found {}", o.batch_size, *o.micro_batch));
  check_number("--momentum", kNonNegative, o.momentum);
  mbp::check_recompute_policy(o.recompute);
  check_number("--pipeline-stages", kPositiveWhole, o.pipeline_stages);
  if (o.pipeline_stages == 1 && !o.pipeline_split.empty())
    throw Error(fmt::format("--pipeline-split {}: there is one stage (give --pipeline-stages)", o.pipeline_split));
  if (o.host_memory_limit != "none" && o.host_memory_limit != "auto") try {
      parse_size(o.host_memory_limit);
    } catch (const Error& e) {
      throw Error(fmt::format("--host-memory-limit: expected a size, auto or none; {}", e.what()));
    }
  if (o.placement && *o.placement != mbp::Placement::device && o.host_memory_limit == "none")
    throw Error(fmt::format("--placement {} puts state in host memory: give --host-memory-limit (a size or auto)",
                            name_of(*o.placement)));
  for (const auto& [flag, value, rule, unit] :
       {std::tuple<const char*, const std::string&, const NumberRule&, const char*>{"--copy-bandwidth", o.copy_bandwidth,
                                                                                  kCopyBandwidth, "GB/s"},
        {"--compute-rate", o.compute_rate, kComputeRate, "GFLOP/s"}})
    if (value != "measure") {
      const std::string why = number_error(rule, value);
      if (!why.empty()) throw Error(fmt::format("{}: expected measure or a rate in {}; it {}", flag, unit, why));
    }
  if (o.host_memory_limit != "none" && o.pipeline_stages > 1)
    throw Error(fmt::format("--host-memory-limit {}: the host tier is not available to pipeline stages",
                            o.host_memory_limit));
  if (o.tuning_file.empty())
    throw Error("--tuning-file: expected a file, default or none, found an empty value");
}

std::optional<mbp::CostRates> given_cost_rates(const StepOptions& o) {
  if (o.copy_bandwidth == "measure" && o.compute_rate == "measure") return std::nullopt;
  mbp::CostRates r;
  if (o.copy_bandwidth != "measure") r.copy_bytes_per_second = std::strtod(o.copy_bandwidth.c_str(), nullptr) * 1e9;
  if (o.compute_rate != "measure") r.flops_per_second = std::strtod(o.compute_rate.c_str(), nullptr) * 1e9;
  return r;
}

mbp::ExecutorOptions executor_options(const StepOptions& o, const Shape& sample_shape, Device device,
                                      bool pipeline_stage) {
  mbp::ExecutorOptions eo;
  eo.sample_shape = sample_shape;
  eo.micro_batch = o.micro_batch;
  eo.recompute = o.recompute;
  eo.placement = o.placement;
  eo.cost_rates = given_cost_rates(o);
  eo.precision = o.precision;
  // "auto": the device's layout for this precision; a pipeline stage's activations travel between
  // ranks contiguous.
  const bool tensor_cores = o.precision == mbp::Precision::bf16 || o.tf32;
  eo.memory_format = o.memory_format.value_or(pipeline_stage ? MemoryFormat::Contiguous
                                                             : preferred_memory_format(device, tensor_cores));
  if (device.is_cuda() && !pipeline_stage) eo.conv_tuning = conv_tuning(o.tuning_file, !gpu_described(), o.tuning_seconds);
  eo.cuda_graphs = device.is_cuda() && o.cuda_graphs == OnOff::on;
  return eo;
}

std::shared_ptr<ConvTuning> conv_tuning(const std::string& file, bool measure, double seconds) {
  if (file == "none") return nullptr;
  const std::filesystem::path path = file == "default" ? ConvTuning::default_path() : std::filesystem::path(file);
  // One per file and process: a sweep's runs share what the first measured.
  static std::map<std::tuple<std::string, bool, double>, std::shared_ptr<ConvTuning>> made;
  std::shared_ptr<ConvTuning>& t = made[{path.string(), measure, seconds}];
  if (!t) t = std::make_shared<ConvTuning>(path, measure ? seconds : 0.0);
  return t;
}

// ---- one option's value, as text --------------------------------------------------------------

namespace {

std::string found(const std::string& text) { return text.empty() ? "an empty value" : text; }

// Each type's text (state.json, the help's defaults) and its reading; a reading returns "" or what
// was wrong ("must be a positive whole number, found 0").
std::string show(const std::string& v) { return v; }
std::string show(bool v) { return v ? "true" : "false"; }
std::string show(double v) { return fmt::format("{}", v); }  // the shortest text that reads back exactly
template <std::integral I>
std::string show(I v) { return std::to_string(v); }
std::string show(const std::optional<std::int64_t>& v) { return v ? std::to_string(*v) : "auto"; }
std::string show(const std::optional<bool>& v) { return v ? (*v ? "on" : "off") : "default"; }
template <class E>
  requires std::is_enum_v<E>
std::string show(const std::optional<E>& v) { return v ? name_of(*v) : "auto"; }
template <class E>
  requires std::is_enum_v<E>
std::string show(E v) { return name_of(v); }

std::string read(std::string& v, const std::string& text, const NumberRule&) {
  v = text;
  return "";
}
std::string read(bool& v, const std::string& text, const NumberRule&) {
  if (text != "true" && text != "false") return fmt::format("expected true or false, found {}", found(text));
  v = text == "true";
  return "";
}
std::string read(double& v, const std::string& text, const NumberRule& rule) {
  const std::string error = number_error(rule, text);
  if (error.empty()) v = std::stod(text);
  return error;
}
// Whole numbers: every digit read (no sign for an unsigned type, no "1e3"), inside the type's range
// and the rule's.
template <std::integral I>
std::string read(I& v, const std::string& text, const NumberRule& rule) {
  I x{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
  if (ec == std::errc::result_out_of_range)
    return fmt::format("must be a whole number in [{}, {}], found {}",
                       std::max<double>(rule.min, static_cast<double>(std::numeric_limits<I>::lowest())),
                       std::numeric_limits<I>::max(), text);
  const double d = static_cast<double>(x);
  if (ec != std::errc() || end != text.data() + text.size() || d < rule.min || (rule.max && d > *rule.max))
    return fmt::format("must be {}, found {}", rule_text(rule), found(text));
  v = x;
  return "";
}
std::string read(std::optional<std::int64_t>& v, const std::string& text, const NumberRule& rule) {
  if (text == "auto") {
    v.reset();
    return "";
  }
  std::int64_t x = 0;
  if (!read(x, text, rule).empty()) return fmt::format("must be {} or auto, found {}", rule_text(rule), found(text));
  v = x;
  return "";
}
std::string read(std::optional<bool>& v, const std::string& text, const NumberRule&) {
  if (text == "on" || text == "off")
    v = text == "on";
  else if (text == "default")
    v.reset();
  else
    return fmt::format("expected on, off or default, found {}", found(text));
  return "";
}
template <class E>
  requires std::is_enum_v<E>
std::string read(E& v, const std::string& text, const NumberRule&) {
  const std::optional<E> e = enum_from<E>(text);
  if (!e) return fmt::format("expected one of {}, found {}", names_list(E{}), found(text));
  v = *e;
  return "";
}
// An enumeration or "auto" (unset).
template <class E>
  requires std::is_enum_v<E>
std::string read(std::optional<E>& v, const std::string& text, const NumberRule&) {
  if (text == "auto") {
    v.reset();
    return "";
  }
  const std::optional<E> f = enum_from<E>(text);
  if (!f) return fmt::format("expected one of auto, {}, found {}", names_list(E{}), found(text));
  v = *f;
  return "";
}

// How the help names a value of each type.
template <class T>
std::string type_name(const NumberRule& rule) {
  if constexpr (std::is_same_v<T, double>) return rule.max ? "NUMBER" : rule.min > 0 ? "NUMBER > 0" : "NUMBER >= 0";
  else if constexpr (std::is_integral_v<T>)
    return rule.max ? fmt::format("INT {}..{}", rule.min, *rule.max) : rule.min >= 1 ? "INT >= 1" : "INT >= 0";
  else if constexpr (std::is_same_v<T, std::optional<std::int64_t>>) return "INT|auto";
  else if constexpr (std::is_enum_v<T>) {
    std::string s;
    for (const auto& [v, n] : enum_names(T{})) s += (s.empty() ? "" : "|") + n;
    return s;
  }
  else if constexpr (std::is_same_v<T, std::optional<MemoryFormat>>) return "auto|contiguous|channels_last";
  else if constexpr (std::is_same_v<T, std::optional<mbp::Placement>>) return "auto|device|optimizer|gradients";
  else return "TEXT";
}

// ---- the table ----------------------------------------------------------------------------------

enum : unsigned { kTrain = 1, kSweep = 2, kPlan = 4, kDevice = 8, kRun = kTrain | kSweep, kAll = kRun | kPlan };

// Where one command line's values go: the parts of the command's options.
struct Targets {
  StepOptions* step = nullptr;
  TrainOptions* train = nullptr;
  PlanOptions* plan = nullptr;
  SweepOptions* sweep = nullptr;
  DeviceOptions* device = nullptr;
};

template <class C>
C& part(const Targets& t, const std::string& name) {
  C* p = nullptr;
  if constexpr (std::is_same_v<C, StepOptions>) p = t.step;
  else if constexpr (std::is_same_v<C, TrainOptions>) p = t.train;
  else if constexpr (std::is_same_v<C, PlanOptions>) p = t.plan;
  else if constexpr (std::is_same_v<C, DeviceOptions>) p = t.device;
  else p = t.sweep;
  if (!p) throw std::logic_error("apps/options.cpp: option " + name + " of a command whose options lack its field");
  return *p;
}

// One option's field, reached through a command's targets and read and written as text.
struct Field {
  std::function<std::string(const Targets&, const std::string& name)> text;
  std::function<std::string(const Targets&, const std::string& name, const std::string& value)> read;
  std::string type;
  std::function<std::string()> type_of;  // the type, asked when the command line is made (a choice's names)
  std::string on = "true", off = "false";  // a flag's values (augment: on and off)
};

template <class C, class T>
Field field(T C::*member, NumberRule rule = kNonNegative) {
  Field f;
  f.text = [member](const Targets& t, const std::string& name) { return show(part<C>(t, name).*member); };
  f.read = [member, rule](const Targets& t, const std::string& name, const std::string& value) {
    return read(part<C>(t, name).*member, value, rule);
  };
  f.type = type_name<T>(rule);
  if constexpr (std::is_same_v<T, std::optional<bool>>) f.on = "on", f.off = "off";
  return f;
}

// --save: tally train's weights file, or tally device's description file (one flag, two commands).
Field save_field() {
  Field f = field(&TrainOptions::save);
  const auto text = f.text;
  const auto read = f.read;
  f.text = [text](const Targets& t, const std::string& name) { return t.device ? t.device->save : text(t, name); };
  f.read = [read](const Targets& t, const std::string& name, const std::string& value) {
    if (!t.device) return read(t, name, value);
    t.device->save = value;
    return std::string();
  };
  return f;
}

// A text that must be one of a library's names (--model: nn::model_names(), --schedule).
template <class C>
Field choice(std::string C::*member, const std::vector<std::string>& (*names)()) {
  Field f = field(member);
  f.read = [member, names](const Targets& t, const std::string& name, const std::string& value) {
    const std::vector<std::string>& allowed = names();
    if (std::find(allowed.begin(), allowed.end(), value) == allowed.end())
      return fmt::format("expected one of {}, found {}", fmt::join(allowed, ", "), found(value));
    part<C>(t, name).*member = value;
    return std::string();
  };
  // Asked when a command line is made, not when this table is: nn::register_model may add --model's.
  f.type_of = [names] { return fmt::format("{}", fmt::join(names(), "|")); };
  return f;
}

// How an option appears on the command line.
enum class Form {
  value,   // --name VALUE
  on,      // --name: true
  off,     // --no-name: false (the field is true by default)
  on_off,  // --name and --no-name, each excluding the other
};

struct Option {
  std::string name;  // the flag without "--" (without "--no-" for Form::off) and its key in state.json
  Field field;
  unsigned commands;  // kTrain | kSweep | kPlan
  std::string help;
  std::vector<std::pair<unsigned, std::string>> help_for{};  // a command's own help
  Form form = Form::value;
  std::string off_help{};      // Form::on_off: the --no- flag's
  bool changeable = false;     // a resumed run may change it (it does not change the run's results)
  const char* change_note = "";  // where that holds only in part: when it may (the resume lists say so)
  bool stored = true;          // in a checkpoint's options (not --resume itself)
  bool show_default = true;    // the help shows the command's default
  std::string excludes{};      // an option it cannot be given with
  const char* absent = nullptr;  // its value in checkpoints older than the option (else: required)

  std::string help_of(unsigned command) const {
    for (const auto& [c, h] : help_for)
      if (c & command) return h;
    return help;
  }
  std::vector<std::string> flags() const {
    switch (form) {
      case Form::off: return {"no-" + name};
      case Form::on_off: return {name, "no-" + name};
      default: return {name};
    }
  }
};

// Every option, in the order of the help and of state.json's list. The defaults are the commands'
// options structs' (apps/options.h).
const std::vector<Option> kTable = {
    {.name = "model", .field = choice(&StepOptions::model, nn::model_names), .commands = kAll, .help = "the network"},
    {.name = "norm", .field = field(&StepOptions::norm), .commands = kAll, .help = "normalization layers"},
    {.name = "data", .field = field(&TrainOptions::data), .commands = kRun,
     .help = "synthetic|synthetic:CxHxW|mnist:DIR|fashion-mnist|fashion-mnist:DIR|cifar10:DIR|cifar100:DIR|folder:DIR "
             "(DIR/train/<class>/*.jpg|png, DIR/val/<class>/... optional; with --input)"},
    {.name = "input", .field = field(&PlanOptions::input), .commands = kPlan, .help = "one sample's shape CxHxW"},
    {.name = "input", .field = field(&TrainOptions::input), .commands = kRun,
     .help = "one sample's shape CxHxW for --data folder:DIR, which needs it (C 3: RGB, 1: grey; with --transform none "
             "every image must be HxW); other data sets have their own",
     .absent = "auto"},
    {.name = "transform", .field = choice(&TrainOptions::transform, data::folder_transform_names), .commands = kRun,
     .help = "--data folder:DIR: imagenet (training: random resized crop and flip; evaluation: resize to --input / "
             "0.875 and centre crop; PIL's bilinear resize) | none (each image must be the --input size)",
     .absent = "imagenet"},
    {.name = "skip-bad-images", .field = field(&TrainOptions::skip_bad_images), .commands = kRun,
     .help = "--data folder:DIR: a corrupt, truncated or oversized image is skipped (the next one of its list taken "
             "instead), counted and listed at the end, instead of an error",
     .form = Form::on, .absent = "false"},
    {.name = "workers", .field = field(&TrainOptions::workers, NumberRule{0, data::kMaxWorkers, true}), .commands = kRun,
     .help = "threads that read and decode a folder's images (and draw procedural synthetic ones) for the next "
             "batch: 0 (the default) is OpenMP's thread count; batches are the same for any count",
     .changeable = true, .absent = "0"},
    {.name = "val-fraction", .field = field(&TrainOptions::val_fraction), .commands = kRun,
     .help = "--data folder:DIR without DIR/val: the share of the training images held out for evaluation, chosen "
             "by --seed (none: no evaluation)",
     .absent = "none"},
    {.name = "max-image-pixels", .field = field(&TrainOptions::max_image_pixels, kPositiveWhole), .commands = kRun,
     .help = "--data folder:DIR: an image whose header declares more pixels is refused before it is decoded "
             "(PIL's bound by default)",
     .absent = "89478485"},
    {.name = "num-classes", .field = field(&StepOptions::num_classes, kPositiveWhole), .commands = kAll,
     .help = "classes of synthetic data (default 1000 for images >= 64 pixels, else 10)",
     .help_for = {{kPlan, "classes (default 1000 for inputs >= 64 pixels, else 10)"}}, .show_default = false},
    {.name = "epochs", .field = field(&TrainOptions::epochs, kPositiveWhole), .commands = kRun,
     .help = "epochs to train", .help_for = {{kSweep, "epochs per batch size"}}},
    {.name = "steps", .field = field(&TrainOptions::steps, kPositiveWhole), .commands = kRun,
     .help = "optimizer steps to train (instead of --epochs)", .show_default = false, .excludes = "epochs"},
    {.name = "batch-size", .field = field(&StepOptions::batch_size, kPositiveWhole), .commands = kTrain | kPlan,
     .help = "samples per optimizer step"},
    {.name = "batch-sizes", .field = field(&SweepOptions::batch_sizes), .commands = kSweep,
     .help = "comma-separated batch sizes, e.g. 128,256,512,1024"},
    {.name = "optimizer", .field = field(&StepOptions::optimizer), .commands = kAll, .help = "the optimizer"},
    {.name = "lr", .field = field(&TrainOptions::lr), .commands = kRun, .help = "learning rate",
     .help_for = {{kSweep, "learning rate of the first batch size of the list"}}},
    {.name = "lr-scaling", .field = field(&SweepOptions::lr_scaling), .commands = kSweep,
     .help = "linear (lr * B / B0) | sqrt (lr * sqrt(B / B0))"},
    {.name = "momentum", .field = field(&StepOptions::momentum), .commands = kAll, .help = "SGD momentum",
     .help_for = {{kPlan, "SGD momentum (0: no momentum buffer)"}}},
    {.name = "weight-decay", .field = field(&TrainOptions::weight_decay), .commands = kRun, .help = "weight decay"},
    {.name = "nesterov", .field = field(&TrainOptions::nesterov), .commands = kRun, .help = "Nesterov momentum",
     .form = Form::on},
    {.name = "schedule", .field = choice(&TrainOptions::schedule, optim::schedule_names), .commands = kRun,
     .help = "learning-rate schedule"},
    {.name = "warmup-epochs", .field = field(&TrainOptions::warmup_epochs), .commands = kRun,
     .help = "linear warm-up, in epochs"},
    {.name = "label-smoothing", .field = field(&TrainOptions::label_smoothing, kFraction), .commands = kRun,
     .help = "label smoothing in [0, 1]"},
    {.name = "augment", .field = field(&TrainOptions::augment), .commands = kRun,
     .help = "random crop (pad 4) + horizontal flip (default: on, off for MNIST and Fashion-MNIST)",
     .form = Form::on_off, .off_help = "no augmentation"},
    {.name = "shuffle", .field = field(&TrainOptions::shuffle), .commands = kRun,
     .help = "shuffle the training set every epoch (default)", .form = Form::on_off,
     .off_help = "file order: step k uses samples [kB, (k+1)B)"},
    {.name = "normalize", .field = field(&TrainOptions::normalize), .commands = kRun,
     .help = "per-channel mean/std normalization (default)", .form = Form::on_off, .off_help = "pixels in [0, 1]"},
    {.name = "seed", .field = field(&TrainOptions::seed, kNonNegativeWhole), .commands = kRun,
     .help = "seed for initialization, shuffling and augmentation"},
    {.name = "device", .field = field(&StepOptions::device), .commands = kAll | kDevice,
     .help = "cpu|cuda|cuda:N|auto (auto: the GPU when there is one)",
     .help_for = {{kPlan, "cpu|cuda|cuda:N"}, {kDevice, "the GPU to describe: cuda|cuda:N"}}},
    {.name = "threads", .field = field(&TrainOptions::threads, kNonNegativeWhole), .commands = kRun,
     .help = "CPU threads (0: default; a CPU run resumes bit for bit only with the count it ran with)",
     .changeable = true, .change_note = "a CUDA run's; a CPU run keeps its count", .show_default = false},
    {.name = "tf32", .field = field(&StepOptions::tf32), .commands = kAll,
     .help = "CUDA: let float32 GEMMs and convolutions use TF32 tensor cores (off by default)", .form = Form::on},
    {.name = "deterministic", .field = field(&StepOptions::deterministic), .commands = kAll,
     .help = "CUDA: cuDNN's deterministic convolution algorithms only (on: bit-for-bit resume; off: its others "
             "too, as PyTorch's default)",
     .absent = "on"},
    {.name = "tuning-file", .field = field(&StepOptions::tuning_file), .commands = kAll,
     .help = "CUDA: the convolutions' engines chosen by measurement, kept in this file (default: the user's cache "
             "folder, ~/.cache/tally/conv-tuning.json; none: cuDNN's heuristics alone)",
     .help_for = {{kPlan, "CUDA: plan with the engines this tuning file chose (default: the user's cache folder's; "
                          "none: cuDNN's heuristics alone); nothing is measured"}},
     .changeable = true, .change_note = "a resumed run replays its checkpoint's engines", .absent = "none"},
    {.name = "tuning-seconds", .field = field(&StepOptions::tuning_seconds, kNonNegative), .commands = kRun,
     .help = "CUDA: the most seconds spent measuring convolution engines each time a plan is tuned (the passes left "
             "keep cuDNN's heuristics' choice, and a later run measures them; 0: the file's alone)",
     .changeable = true, .absent = "60"},
    {.name = "collectives", .field = field(&StepOptions::collectives), .commands = kRun,
     .help = "CUDA under mpirun: how tensors travel between ranks: auto (NCCL where every rank of every machine has "
             "a GPU of its own, else MPI through host memory) | nccl | mpi (through host memory: ranks may share a GPU)",
     .changeable = true, .absent = "auto"},
    {.name = "cuda-graphs", .field = field(&StepOptions::cuda_graphs), .commands = kRun,
     .help = "CUDA: record each micro-batch's forward and backward after a step's first as a CUDA graph and replay "
             "it where the arena's layout repeats (the same bits; off: launched op by op)",
     .changeable = true, .absent = "off"},
    {.name = "profile", .field = field(&TrainOptions::profile), .commands = kTrain,
     .help = "time per op (GPU time on CUDA, host time on the CPU) over the steps after the first, printed and "
             "written to profile.txt",
     .form = Form::on, .changeable = true},
    {.name = "init", .field = field(&TrainOptions::init), .commands = kTrain,
     .help = "initial weights (safetensors, torchvision names)"},
    {.name = "save", .field = save_field(), .commands = kTrain | kDevice,
     .help = "write the trained weights (safetensors)",
     .help_for = {{kDevice, "write the GPU's description here (JSON), for plans made without it (docs/gpu.md)"}},
     .changeable = true},
    // A resumed run's folder is where it is now (resume_options sets it); --out itself is refused
    // with --resume.
    {.name = "out", .field = field(&TrainOptions::out), .commands = kRun,
     .help = "write metrics.csv and summary.json into this directory",
     .help_for = {{kSweep, "folder for sweep.csv, sweep.svg and one folder per run"}}, .changeable = true},
    {.name = "resume", .field = field(&TrainOptions::resume), .commands = kRun,
     .help = "continue the run in this folder from its newest checkpoint, bit for bit (its options are kept: a "
             "flag given again must have the run's value, but for {changeable}, which do not change its results)",
     .help_for = {{kSweep, "continue the sweep in this folder: finished runs are kept, the interrupted one "
                           "resumes from its checkpoint"}},
     .stored = false, .excludes = "out"},
    {.name = "progress", .field = field(&TrainOptions::progress), .commands = kRun, .help = "no progress bar",
     .help_for = {{kSweep, "no progress bar of the running run (a line per run stays)"}}, .form = Form::off,
     .changeable = true},
    {.name = "eval", .field = field(&TrainOptions::evaluate), .commands = kRun,
     .help = "skip the test set after each epoch (timing runs; summary.json's test fields are null)",
     .form = Form::off},
    {.name = "memory-limit", .field = field(&StepOptions::memory_limit), .commands = kAll,
     .help = "memory budget: a size (48MiB, 2GiB) or auto; under mpirun one per rank (48MiB,24MiB)",
     .help_for = {{kPlan, "memory budget: a size (8GiB) or auto; with --pipeline-stages one per stage"}}},
    {.name = "host-memory-limit", .field = field(&StepOptions::host_memory_limit), .commands = kAll,
     .help = "the host tier, beside the device's budget: a size (2GiB), auto (3/4 of what this process may use, less "
             "the device's arena when it is host memory too, divided among this machine's ranks; pinned on a GPU "
             "machine) or none (everything on the device)",
     .changeable = true, .absent = "none"},
    {.name = "placement", .field = field(&StepOptions::placement), .commands = kAll,
     .help = "where the step's state lives: device | optimizer (the optimizer's state and update in the host tier) | "
             "gradients (the gradients accumulated there too; not with data parallelism) | auto (with a host tier, "
             "the placement that allows the largest micro-batch, ties to the fewest bytes moved)",
     .changeable = true, .absent = "auto"},
    {.name = "copy-bandwidth", .field = field(&StepOptions::copy_bandwidth), .commands = kAll,
     .help = "the cost model's copy bandwidth between the device and the host tier, GB/s each way, for choosing "
             "between recomputing and offloading a segment: a number or measure (once, at start-up)",
     .changeable = true, .absent = "measure"},
    {.name = "compute-rate", .field = field(&StepOptions::compute_rate), .commands = kAll,
     .help = "the cost model's compute rate of the device, GFLOP/s: a number or measure (once, at start-up)",
     .changeable = true, .absent = "measure"},
    {.name = "micro-batch", .field = field(&StepOptions::micro_batch, kPositiveWhole), .commands = kAll,
     .help = "samples per micro-batch: M or auto (the largest that fits)",
     .help_for = {{kPlan, "check this micro-batch size instead of searching (auto: the largest that fits)"}}},
    {.name = "loss-normalization", .field = field(&TrainOptions::loss_normalization), .commands = kRun,
     .help = "exact (the full batch's mean for any split) | per-micro-batch (each micro-batch's mean / k, as the "
             "MBP paper's code)"},
    {.name = "recompute", .field = field(&StepOptions::recompute), .commands = kAll,
     .help = "auto (the least recomputation with which one sample fits; with a host tier, each segment kept, "
             "recomputed or offloaded by a cost model) | none | blocks (the residual blocks and the stem: about one "
             "more forward) | all (the stages around the blocks too: the least memory, about two more forwards) | "
             "blocks+layerK[-layerL] (a level between) | offload (every segment's activations to the host tier) | "
             "segments and modes: stem=offload,layer1.0=recompute (the others kept)"},
    {.name = "precision", .field = field(&StepOptions::precision), .commands = kAll,
     .help = "fp32 | bf16 (mixed precision: bf16 activations, float32 weights, gradients, optimizer state and loss)"},
    {.name = "memory-format", .field = field(&StepOptions::memory_format), .commands = kAll,
     .help = "the activations' layout: channels_last runs the convolutions, batch norms and max pooling on NHWC "
             "(CPU: oneDNN with no reorder around each convolution; CUDA: cuDNN's NHWC engines through its graph "
             "API); auto: channels_last on a CPU with oneDNN, else contiguous",
     .absent = "contiguous"},
    {.name = "checkpoint-every", .field = field(&TrainOptions::checkpoint_every), .commands = kRun,
     .help = "write a training-state checkpoint into the run folder every N steps (500) or after a time (90s, 10m, "
             "2h); also at the run's end and when SIGINT/SIGTERM (SIGUSR1 under mpirun) stops it",
     .changeable = true},
    {.name = "pipeline-stages", .field = field(&StepOptions::pipeline_stages, kPositiveWhole),
     .commands = kTrain | kPlan,
     .help = "cut the model into S stages, one per rank (mpirun -np S), fed by the micro-batches (on GPUs their "
             "messages go through host memory)",
     .help_for = {{kPlan, "plan S pipeline stages (memory limits: one, or one per stage)"}}, .absent = "1"},
    {.name = "pipeline-split", .field = field(&StepOptions::pipeline_split), .commands = kTrain | kPlan,
     .help = "memory (default: the largest micro-batch that fits, then the smallest largest stage) | work (the "
             "stages' forward FLOPs balanced) | where stages 2..S begin, by segment name (layer3.0; tally plan "
             "--pipeline-stages lists them)",
     .absent = ""},
    {.name = "pipeline-schedule", .field = field(&StepOptions::pipeline_schedule), .commands = kTrain | kPlan,
     .help = "1f1b (stage s holds at most S - s micro-batches) | gpipe (all forwards, then all backwards)",
     .absent = "1f1b"},
    {.name = "report", .field = field(&PlanOptions::report), .commands = kPlan,
     .help = "write the memory report of the plan's step to this file: one HTML page, every allocation a band, "
             "the peak explained, the plan and the per-layer table (docs/memory-report.md)"},
    {.name = "layers", .field = field(&PlanOptions::layers), .commands = kPlan, .help = "skip the per-layer table",
     .form = Form::off},
    {.name = "device-file", .field = field(&PlanOptions::device_file), .commands = kPlan,
     .help = "plan --device cuda for the GPU this file describes (written by tally device --save on it), on any "
             "machine with the CUDA build: convolutions through cuDNN's graph API, --memory-limit as a size "
             "(docs/gpu.md, \"Plans without the GPU\")"},
};

const std::vector<Option>& table() { return kTable; }

const Option* find(const std::string& name) {
  for (const Option& o : table())
    if (o.name == name) return &o;
  return nullptr;
}

// ---- the command line ---------------------------------------------------------------------------

std::string changeable_flags();

void register_options(CLI::App& cli, const Targets& t, unsigned command) {
  for (const Option& o : table()) {
    if (!(o.commands & command)) continue;
    std::string help = o.help_of(command);
    if (const auto at = help.find("{changeable}"); at != std::string::npos)
      help.replace(at, std::string("{changeable}").size(), changeable_flags());
    // Each flag sets its text through the field's reading: a bad value is tally's error, named by the flag.
    auto set = [&o, t](const std::string& flag, const std::string& value) {
      const std::string error = o.field.read(t, o.name, value);
      if (!error.empty()) throw CLI::ValidationError(flag, error);
    };
    switch (o.form) {
      case Form::value: {
        const std::string flag = "--" + o.name;
        // An empty value is never a choice: the default is the flag left out ("--resume ''" would
        // otherwise start a fresh run, "--save ''" save nothing).
        // A flag given twice is one value too many, said in tally's words.
        auto set_given = [set, flag](const CLI::results_t& given) {
          if (given.size() > 1)
            throw CLI::ValidationError(flag, fmt::format("expected one value, found {} ({}): give the flag once",
                                                         given.size(), fmt::join(given, ", ")));
          const std::string& v = given.front();
          if (v.empty())
            throw CLI::ValidationError(flag, "expected a value, found an empty one (leave the flag out for its default)");
          set(flag, v);
          return true;
        };
        CLI::Option* opt = cli.add_option(flag, CLI::callback_t(set_given), help);
        opt->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
        opt->type_name(o.field.type_of ? o.field.type_of() : o.field.type);
        if (o.show_default) opt->default_str(o.field.text(t, o.name));
        break;
      }
      case Form::on:
        cli.add_flag_callback("--" + o.name, [set, &o] { set("--" + o.name, o.field.on); }, help);
        break;
      case Form::off:
        cli.add_flag_callback("--no-" + o.name, [set, &o] { set("--no-" + o.name, o.field.off); }, help);
        break;
      case Form::on_off: {
        CLI::Option* on = cli.add_flag_callback("--" + o.name, [set, &o] { set("--" + o.name, o.field.on); }, help);
        cli.add_flag_callback("--no-" + o.name, [set, &o] { set("--no-" + o.name, o.field.off); }, o.off_help)
            ->excludes(on);
        break;
      }
    }
  }
  for (const Option& o : table())
    if ((o.commands & command) && !o.excludes.empty())
      if (CLI::Option* other = cli.get_option_no_throw("--" + o.excludes))
        cli.get_option("--" + o.name)->excludes(other);
}

}  // namespace

void add_options(CLI::App& cli, TrainOptions& options) { register_options(cli, {&options, &options}, kTrain); }
void add_options(CLI::App& cli, SweepOptions& options) {
  register_options(cli, {&options.train, &options.train, nullptr, &options}, kSweep);
}
void add_options(CLI::App& cli, PlanOptions& options) { register_options(cli, {&options, nullptr, &options}, kPlan); }
void add_options(CLI::App& cli, DeviceOptions& options) {
  register_options(cli, {&options, nullptr, nullptr, nullptr, &options}, kDevice);
}

std::vector<std::string> given_options(const CLI::App& cli) {
  std::vector<std::string> names;
  for (const CLI::Option* given : cli.get_options()) {
    if (given->count() == 0 || given->get_lnames().empty()) continue;
    const std::string& flag = given->get_lnames().front();
    for (const Option& o : table()) {
      const std::vector<std::string> flags = o.flags();
      if (std::find(flags.begin(), flags.end(), flag) != flags.end()) names.push_back(o.name);
    }
  }
  return names;
}

// ---- options as text: checkpoints and --resume --------------------------------------------------

std::vector<std::pair<std::string, std::string>> option_values(const TrainOptions& o) {
  TrainOptions copy = o;
  const Targets t{&copy, &copy};
  std::vector<std::pair<std::string, std::string>> values;
  for (const Option& opt : table())
    if ((opt.commands & kTrain) && opt.stored) values.emplace_back(opt.name, opt.field.text(t, opt.name));
  return values;
}

TrainOptions options_from_values(const std::map<std::string, std::string>& values, const std::string& where) {
  TrainOptions o;
  const Targets t{&o, &o};
  for (const Option& opt : table()) {
    if (!(opt.commands & kTrain) || !opt.stored) continue;
    const auto it = values.find(opt.name);
    if (it == values.end() && !opt.absent)
      throw FormatError(fmt::format("{}: expected the option \"{}\", found none", where, opt.name));
    const std::string& text = it == values.end() ? std::string(opt.absent) : it->second;
    const std::string error = opt.field.read(t, opt.name, text);
    if (!error.empty()) throw FormatError(fmt::format("{}: option \"{}\": {}", where, opt.name, error));
  }
  return o;
}

const std::vector<std::string>& options_changeable_on_resume() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const Option& o : table())
      if (o.changeable) v.push_back(o.name);
    return v;
  }();
  return names;
}

namespace {

// "--threads, --profile, --save, --no-progress, --checkpoint-every": the flags a resumed run may be
// given with a new value (--out, refused with --resume, not among them).
std::string changeable_flags() {
  std::vector<std::string> flags;
  const std::string refused = find("resume")->excludes;
  for (const Option& o : table())
    if (o.changeable && o.name != refused && (o.commands & kTrain))
      flags.push_back("--" + o.flags().back() + (*o.change_note ? fmt::format(" ({})", o.change_note) : ""));
  return fmt::format("{}", fmt::join(flags, ", "));
}

std::string or_empty(const std::string& s) { return s.empty() ? "\"\"" : s; }

}  // namespace

void check_resume_options(const TrainOptions& saved, const TrainOptions& given, const std::vector<std::string>& names) {
  const auto a = option_values(saved), b = option_values(given);
  std::string differences;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const std::string& key = a[i].first;
    if (find(key)->changeable) continue;
    if (!names.empty() && std::find(names.begin(), names.end(), key) == names.end()) continue;
    if (a[i].second != b[i].second)
      differences += fmt::format("\n  --{}: the run has {}, given {}", key, or_empty(a[i].second), or_empty(b[i].second));
  }
  if (!differences.empty())
    throw Error(fmt::format("--resume {}: a resumed run keeps its options (only {} may change):{}", given.resume,
                            changeable_flags(), differences));
}

TrainOptions resumed_options(const TrainOptions& saved, const TrainOptions& given, const std::vector<std::string>& names) {
  check_resume_options(saved, given, names);
  TrainOptions o = saved, g = given;
  const Targets to{&o, &o}, tg{&g, &g};
  for (const std::string& name : names)
    if (const Option* opt = find(name); opt && opt->changeable && opt->stored)
      (void)opt->field.read(to, name, opt->field.text(tg, name));  // a value read from its own text
  return o;
}

void check_sweep_resume(const SweepOptions& saved, const SweepOptions& given, const std::vector<std::string>& names) {
  SweepOptions a = saved, b = given;
  const Targets ta{nullptr, nullptr, nullptr, &a}, tb{nullptr, nullptr, nullptr, &b};
  std::string differences;
  for (const Option& o : table()) {
    if (o.commands != kSweep || !o.stored) continue;  // the sweep's own; its runs' below
    if (!names.empty() && std::find(names.begin(), names.end(), o.name) == names.end()) continue;
    const std::string x = o.field.text(ta, o.name), y = o.field.text(tb, o.name);
    if (x != y) differences += fmt::format("\n  --{}: the sweep has {}, given {}", o.name, or_empty(x), or_empty(y));
  }
  if (!differences.empty())
    throw Error(fmt::format("--resume {}: a resumed sweep keeps its options:{}", given.resume, differences));
  TrainOptions t = given.train;
  t.resume = given.resume;
  check_resume_options(saved.train, t, names);
}

}  // namespace tally::app
