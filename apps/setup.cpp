// apps/setup.cpp — see apps/setup.h.
#include "apps/setup.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cctype>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <cmath>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "core/error.h"
#include "core/files.h"
#include "core/machine.h"
#include "core/memory.h"
#include "nn/state_dict.h"

namespace tally::app {

std::optional<std::int64_t> parse_positive_integer(const std::string& s) {
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  try {
    const long long v = std::stoll(s);
    if (v < 1) return std::nullopt;
    return v;
  } catch (const std::exception&) {
    return std::nullopt;  // out of range
  }
}

std::string rule_text(const NumberRule& rule) {
  if (rule.whole && rule.max) return fmt::format("a whole number from {} to {}", rule.min, *rule.max);
  if (rule.whole) return rule.min >= 1 ? "a positive whole number" : "a non-negative whole number";
  if (rule.max) return fmt::format("a number in [{}, {}]", rule.min, *rule.max);
  return rule.min > 0 ? "a positive number" : "a non-negative number";
}

std::string number_error(const NumberRule& rule, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(value.c_str(), &end);
  const bool whole_text = !value.empty() && end == value.c_str() + value.size() && !std::isspace(value[0]);
  if (whole_text && errno == ERANGE)  // a number, but none a double holds
    return fmt::format("must be {}, found {} ({} a double holds)", rule_text(rule), value,
                       std::isinf(v) ? "beyond the largest number" : "below the smallest non-zero number");
  const bool ok = whole_text && std::isfinite(v) && v >= rule.min && (!rule.max || v <= *rule.max) &&
                  (!rule.whole || v == std::floor(v));
  if (ok) return "";
  return fmt::format("must be {}, found {}", rule_text(rule), value.empty() ? "an empty value" : value);
}

void check_number(const std::string& flag, const NumberRule& rule, double value) {
  const std::string error = number_error(rule, fmt::format("{}", value));
  if (!error.empty()) throw Error(fmt::format("{}: {}", flag, error));
}


Shape parse_input(const std::string& s) {
  Shape shape;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, 'x')) {
    const auto v = parse_positive_integer(part);
    if (!v) throw Error(fmt::format("--input '{}': expected CxHxW with positive integers, e.g. 3x224x224", s));
    shape.push_back(*v);
  }
  if (shape.size() != 3) throw Error(fmt::format("--input '{}': expected CxHxW (3 numbers), e.g. 3x224x224", s));
  if (const std::string e = sample_shape_error(shape); !e.empty()) throw Error(fmt::format("--input {}: {}", s, e));
  return shape;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

bool lists_auto(const std::string& memory_limit) {
  const std::vector<std::string> limits = split_list(memory_limit);
  return std::find(limits.begin(), limits.end(), "auto") != limits.end();
}

void check_gpu_index(const std::string& given, Device dev) {
  if (dev.is_cuda() && dev.index >= cuda_device_count())
    throw Error(fmt::format("--device {}: this machine has {} GPU{} (cuda:0 to cuda:{})", given, cuda_device_count(),
                            cuda_device_count() == 1 ? "" : "s", cuda_device_count() - 1));
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  // Through a temporary and a rename (core/files.h): a process killed while writing leaves the old
  // file or the new one, never half of one (a resumed sweep reads its runs' rows back); a failure
  // leaves no temporary and names the system's reason.
  write_file(path, text, "output file");
}

namespace {

// Creates `probe` and removes it: "" or the system's reason it could not.
std::string try_create(const std::filesystem::path& probe) {
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

std::filesystem::path probe_in(const std::filesystem::path& dir) {
  return dir / fmt::format(".tally-write-check-{}", ::getpid());
}

}  // namespace

void check_writable_file(const std::string& flag, const std::string& path) {
  const std::filesystem::path p(path);
  std::error_code ec;
  const auto status = std::filesystem::status(p, ec);
  if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
    throw Error(fmt::format("{} {}: expected a file to write, found {}", flag, path,
                            std::filesystem::is_directory(status) ? "a folder" : "no regular file (a FIFO or a device)"));
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  if (!std::filesystem::is_directory(dir, ec))
    throw Error(fmt::format("{} {}: expected its folder {} to exist, found none", flag, path, dir.string()));
  const std::string why = try_create(probe_in(dir));
  if (!why.empty()) throw Error(fmt::format("{} {}: cannot create a file in {}: {}", flag, path, dir.string(), why));
}

void check_writable_folder(const std::string& flag, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("{} {}: cannot create the folder: {}", flag, dir, ec.message()));
  if (!std::filesystem::is_directory(dir, ec))
    throw Error(fmt::format("{} {}: expected a folder, found a file", flag, dir));
  const std::string why = try_create(probe_in(dir));
  if (!why.empty()) throw Error(fmt::format("{} {}: cannot create files in it: {}", flag, dir, why));
}

std::size_t parse_memory_limit(const std::string& text, Device dev) {
  if (text == "auto") return default_arena_capacity(dev);
  std::size_t limit = 0;
  try {
    limit = parse_size(text);
  } catch (const Error& e) {
    throw Error(fmt::format("--memory-limit {}: {}", text, e.what()));
  }
  if (limit < Arena::kAlignment)
    throw Error(fmt::format("--memory-limit {} is below the arena's {}-byte granularity", text, Arena::kAlignment));
  return limit;
}

void warn_beyond_host_memory(const std::string& flag, const std::string& text, std::size_t bytes, bool planning,
                             std::ostream& log) {
  const HostMemory usable = usable_host_memory();
  if (usable.bound.empty() || bytes <= usable.bytes) return;
  fmt::print(log, "warning: {} {} is more than {} now ({}, {}){}\n", flag, text,
             planning ? "this machine can give" : "this process can use", format_bytes(usable.bytes), usable.bound,
             planning ? ": a plan for another machine? Here a step that needs more would fail with the system's "
                        "out-of-memory"
                      : ": a step that needs more fails with the system's out-of-memory, not with tally's plan");
}

std::shared_ptr<Arena> make_host_arena(const std::string& text, Device dev, std::size_t device_limit,
                                       const DryRun* dry, std::ostream* log, int local_ranks) {
  if (text == "none") return nullptr;
  std::size_t bytes = 0;
  if (text == "auto") {
    const HostMemory usable = usable_host_memory();
    if (usable.bound.empty())
      throw Error("--host-memory-limit auto: this machine states no limit on host memory (no MemAvailable, cgroup "
                  "limit or RLIMIT_AS); give a size");
    // 3/4 of what is usable, as the CPU device's auto budget takes (core/memory.h): the rest is the
    // process's own (the data set, the libraries).
    std::size_t left = usable.bytes / 4 * 3;
    if (dev.is_cpu()) left = left > device_limit ? left - device_limit : 0;
    const int ranks = std::max(1, local_ranks);
    bytes = left / static_cast<std::size_t>(ranks) / (std::size_t(64) << 20) * (std::size_t(64) << 20);
    if (bytes == 0)
      throw Error(fmt::format("--host-memory-limit auto: nothing is left for the host tier ({} usable ({}){}, {} "
                              "rank{} on this machine)",
                              format_bytes(usable.bytes), usable.bound,
                              dev.is_cpu() ? fmt::format(", less the device's arena of {}", format_bytes(device_limit)) : "",
                              ranks, ranks == 1 ? "" : "s"));
    if (log)
      fmt::print(*log, "host memory limit auto: {} (3/4 of {} usable ({}){}{})\n", format_bytes(bytes), format_bytes(usable.bytes),
                 usable.bound, dev.is_cpu() ? fmt::format(", less the device's arena of {}", format_bytes(device_limit)) : "",
                 ranks > 1 ? fmt::format(", shared by {} ranks", ranks) : "");
  } else {
    bytes = parse_size(text);
    if (bytes < Arena::kAlignment)
      throw Error(fmt::format("--host-memory-limit {} is below the arena's {}-byte granularity", text, Arena::kAlignment));
    // A reservation the system refuses is an error naming the flag (below).
    if (log) warn_beyond_host_memory("--host-memory-limit", text, bytes, dry != nullptr, *log);
  }
  if (dry) return dry->virtual_arena(Device::cpu(), bytes);
  try {
    return Arena::make_host(bytes);
  } catch (const Error& e) {
    throw Error(fmt::format("--host-memory-limit {}: this machine refused to reserve {} for the host tier ({}); give "
                            "less, or auto", text, format_bytes(bytes), e.what()));
  }
}

namespace {

// --init's tensors must be finite: a NaN among them surfaced as a loss of nan "at step 0", blamed
// on the learning rate.
template <class T>
std::int64_t non_finite(const Tensor& t) {
  std::int64_t n = 0;
  for (const T v : t.to_vector<T>()) n += !std::isfinite(static_cast<double>(v));
  return n;
}
void check_finite_weights(const nn::Module& model, const std::string& init) {
  auto check = [&init](const std::string& name, const Tensor& t) {
    const std::int64_t bad = t.dtype() == DType::Float32   ? non_finite<float>(t)
                             : t.dtype() == DType::Float64 ? non_finite<double>(t)
                                                           : 0;
    if (bad > 0)
      throw Error(fmt::format("--init {}: expected finite weights, found {} NaN or infinite value{} of {} in '{}'", init,
                              bad, bad == 1 ? "" : "s", t.numel(), name));
  };
  for (const auto& [name, t] : model.named_parameters()) check(name, t);
  for (const auto& [name, t] : model.named_buffers()) check(name, t);
}

std::unique_ptr<optim::Optimizer> make_optimizer(std::vector<Tensor> params, const OptimizerConfig& optimizer) {
  const auto when = optimizer.state_when_placed ? optim::StateCreation::when_placed : optim::StateCreation::now;
  if (optimizer.kind == OptimizerKind::sgd) {
    optim::SGDOptions so;
    so.lr = optimizer.lr, so.momentum = optimizer.momentum, so.weight_decay = optimizer.weight_decay;
    so.nesterov = optimizer.nesterov;
    return std::make_unique<optim::SGD>(std::move(params), so, when);
  }
  optim::AdamWOptions ao;
  ao.lr = optimizer.lr, ao.weight_decay = optimizer.weight_decay;
  return std::make_unique<optim::AdamW>(std::move(params), ao, when);
}

// The model's copies of its optimizer state per parameter (for the pipeline's cut).
int state_per_parameter(const OptimizerConfig& optimizer) {
  if (optimizer.kind == OptimizerKind::adamw) return 2;
  return optimizer.momentum > 0 ? 1 : 0;
}

}  // namespace

PipelineConfig pipeline_config(const StepOptions& options, const Shape& sample_shape, std::int64_t batch,
                               const std::string& memory_limits, Device device) {
  const int stages = options.pipeline_stages;
  PipelineConfig pc;
  pc.stages = stages;
  pc.split = options.pipeline_split;
  pc.schedule = options.pipeline_schedule;
  pc.sample_shape = sample_shape;
  pc.activation_dtype = options.precision == mbp::Precision::bf16 ? DType::BFloat16 : DType::Float32;
  pc.batch = batch;
  const std::vector<std::string> limits = split_list(memory_limits);
  if (limits.size() != 1 && limits.size() != static_cast<std::size_t>(stages))
    throw Error(fmt::format("--memory-limit {} lists {} sizes; expected one, or one per stage ({})", memory_limits,
                            limits.size(), stages));
  for (int s = 0; s < stages; ++s)
    pc.limits.push_back(static_cast<std::int64_t>(
        parse_memory_limit(limits.size() == 1 ? limits[0] : limits[static_cast<std::size_t>(s)], device)));
  return pc;
}

Setup build_setup(const std::shared_ptr<Arena>& arena, const nn::ModelConfig& model, const std::string& init,
                  const OptimizerConfig& optimizer, const std::string& limit_text, const PipelineConfig* pipeline) {
  const Device dev = arena->device();
  Setup s;
  if (pipeline && pipeline->stages > 1) {
    // The whole model, built in host memory the budget does not count; then this stage's part moves
    // into the budget (onto the stage's GPU where it has one).
    s.host = arena_like(*arena, Device::cpu(), default_arena_capacity(Device::cpu()));
    {
      ArenaScope on_host(s.host);
      s.model = nn::make_model(model);
      if (!init.empty()) nn::load_state_dict(*s.model, init), check_finite_weights(*s.model, init);
      s.model->train();
    }
    s.segments = s.model->segments();
    mbp::check_segments_cover(*s.model, s.segments);
    mbp::PipelineStage st;
    st.stage = pipeline->stage, st.stages = pipeline->stages, st.schedule = pipeline->schedule;
    s.segment_costs = mbp::segment_costs(*s.model, pipeline->sample_shape, pipeline->activation_dtype,
                                         state_per_parameter(optimizer));
    // --pipeline-split: "memory" (the default), "work", or the segments where stages 2..S begin.
    const std::string& split = pipeline->split;
    st.bounds = split.empty() || split == "memory"
                    ? mbp::balanced_cut(s.segment_costs, pipeline->stages, pipeline->limits, pipeline->batch)
                : split == "work" ? mbp::work_balanced_cut(s.segment_costs, pipeline->stages)
                                  : mbp::parse_pipeline_split(split, s.segments, pipeline->stages);
    s.stage = st;
    std::vector<Tensor> params = mbp::place_stage(s.segments, st.bounds, st.stage, arena);
    for (const auto& p : params) s.stage_parameters += p.numel();
    ArenaScope scope(arena);
    try {
      s.optimizer = make_optimizer(std::move(params), optimizer);
    } catch (const OutOfMemory& e) {
      throw OutOfMemory(fmt::format("--memory-limit {}: pipeline stage {}'s {} optimizer state does not fit ({})",
                                    limit_text, st.stage, name_of(optimizer.kind), e.what()),
                        e.requested());
    }
  } else {
    ArenaScope scope(arena);
    try {
      s.model = nn::make_model(model);
      if (!init.empty()) nn::load_state_dict(*s.model, init), check_finite_weights(*s.model, init);
      if (!dev.is_cpu()) s.model->to(dev);
      s.model->train();
      s.optimizer = make_optimizer(s.model->parameters(), optimizer);
    } catch (const OutOfMemory& e) {
      throw OutOfMemory(
          optimizer.state_when_placed
              ? fmt::format("--memory-limit {}: the {} model's parameters and gradients do not fit ({})", limit_text,
                            model.name, e.what())
              : fmt::format("--memory-limit {}: the {} model's parameters, gradients and {} state do not fit ({})",
                            limit_text, model.name, name_of(optimizer.kind), e.what()),
          e.requested());
    }
  }
  for (const auto& p : s.model->parameters()) s.parameters += p.numel();
  if (!s.stage) s.stage_parameters = s.parameters;
  return s;
}

std::string cut_description(const std::string& split) {
  if (split.empty() || split == "memory") return "balanced by memory (the largest micro-batch, then the smallest largest stage)";
  if (split == "work") return "balanced by work (the stages' forward FLOPs)";
  return "--pipeline-split " + split;
}

std::string work_line(const std::vector<mbp::SegmentCost>& costs, const std::vector<std::size_t>& bounds) {
  const int stages = static_cast<int>(bounds.size()) - 1;
  const std::vector<std::size_t> even = mbp::work_balanced_cut(costs, stages);
  return fmt::format("work per stage: {} of the forward FLOPs{}", mbp::work_shares(costs, bounds),
                     even == bounds ? " (balanced by work as well)"
                                    : fmt::format(" (balanced by work: --pipeline-split {}, {})",
                                                  mbp::split_text(costs, even), mbp::work_shares(costs, even)));
}

std::string persistent_summary(const Arena& arena, const optim::Optimizer* optimizer) {
  const ArenaStats s = arena.stats();
  const std::string both = fmt::format("parameters {}, gradients {}",
                                       format_bytes(static_cast<std::size_t>(s[Category::parameter].current)),
                                       format_bytes(static_cast<std::size_t>(s[Category::gradient].current)));
  if (optimizer && !optimizer->state_created()) return both;
  return fmt::format("{}, optimizer state {}", both,
                     format_bytes(static_cast<std::size_t>(s[Category::optimizer_state].current)));
}

std::string deferred_state_note(const optim::Optimizer& optimizer) {
  if (optimizer.state_created()) return "";
  return fmt::format("; the optimizer state ({}) is created where the plan places it",
                     format_bytes(optimizer.state_bytes()));
}

const mbp::Plan& plan_step(mbp::Executor& executor, std::int64_t batch, std::optional<std::int64_t> micro_batch) {
  try {
    return executor.plan(batch);
  } catch (const OutOfMemory& e) {
    if (!micro_batch) throw;
    throw OutOfMemory(fmt::format("--micro-batch {}: {}", *micro_batch, e.what()), e.requested());
  }
}

}  // namespace tally::app
