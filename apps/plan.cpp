// apps/plan.cpp — `tally plan`; see apps/plan.h.
#include "apps/plan.h"

#include <algorithm>
#include <ostream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include "apps/setup.h"
#include "core/device_file.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "mbp/stage_runner.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "report/layer_table.h"
#include "report/memory_html.h"
#include "optim/optimizer.h"

namespace tally::app {

namespace {

// `tally plan --pipeline-stages S`: every stage on its own virtual arena, each planned alone, then
// all at the smallest of their micro-batches (what the ranks of a run agree on).
mbp::Plan plan_stages(const PlanOptions& opt, const nn::ModelConfig& mc, const Shape& sample, Device dev,
                      std::ostream& out) {
  const int S = opt.pipeline_stages;
  OptimizerConfig oc;
  oc.kind = opt.optimizer;
  oc.momentum = opt.momentum;
  PipelineConfig pc = pipeline_config(opt, sample, opt.batch_size, opt.memory_limit, dev);
  const DryRun dry;  // each stage on a virtual arena of its own (build_setup scopes it)
  struct Stage {
    std::shared_ptr<Arena> arena;
    Setup setup;
    std::unique_ptr<mbp::Executor> executor;
  };
  std::vector<Stage> stages(static_cast<std::size_t>(S));
  std::int64_t m = INT64_MAX;
  int tightest = 0;
  for (int s = 0; s < S; ++s) {
    Stage& st = stages[static_cast<std::size_t>(s)];
    const std::size_t limit = static_cast<std::size_t>(pc.limits[static_cast<std::size_t>(s)]);
    st.arena = dry.virtual_arena(dev, limit);
    pc.stage = s;
    st.setup = build_setup(st.arena, mc, "", oc, format_bytes(limit), &pc);
    if (s == 0) {
      std::vector<std::string> names;
      for (const auto& seg : st.setup.segments) names.push_back(seg.name);
      fmt::print(out, "model {} (norm {}), {} parameters, {} classes | input {} | batch {} | optimizer {} | precision {}\n",
                 opt.model, name_of(opt.norm), st.setup.parameters, mc.num_classes, shape_str(sample), opt.batch_size,
                 name_of(opt.optimizer), name_of(opt.precision));
      fmt::print(out, "segments (cut points of --pipeline-split): {}\n", fmt::join(names, ", "));
      fmt::print(out, "pipeline: {} stages, schedule {}, cut {}\n", S, name_of(opt.pipeline_schedule),
                 cut_description(opt.pipeline_split));
    }
    mbp::ExecutorOptions eo = executor_options(opt, sample, dev, true);  // channels_last: the executor refuses it
    eo.pipeline = st.setup.stage;
    st.executor = std::make_unique<mbp::Executor>(*st.setup.model, *st.setup.optimizer, st.arena, eo);
    const mbp::Plan& p = plan_step(*st.executor, opt.batch_size, opt.micro_batch);  // an error names the stage
    if (p.micro_batch < m) m = p.micro_batch, tightest = s;
  }
  mbp::Plan last;
  for (int s = 0; s < S; ++s) {
    Stage& st = stages[static_cast<std::size_t>(s)];
    const mbp::PipelineStage& ps = *st.setup.stage;
    const mbp::Plan p = st.executor->choose_with(opt.batch_size, m).plan;
    fmt::print(out, "\nstage {} (rank {}): {} | {} parameters\n", s, s,
               mbp::segment_range(st.setup.segments, ps.first(), ps.last()), st.setup.stage_parameters);
    fmt::print(out, "  memory limit {}: {}\n", format_bytes(st.arena->capacity()), persistent_summary(*st.arena));
    fmt::print(out, "  plan: {} | holds up to {} micro-batch{} at once\n", p.summary(),
               ps.in_flight(p.micro_batches), ps.in_flight(p.micro_batches) == 1 ? "" : "es");
    fmt::print(out, "  live at the peak: {}\n", p.at_peak.str());
    fmt::print(out, "  recompute: {}\n", st.executor->recompute_choice().summary(p));
    if (const std::size_t staging = st.executor->message_staging_bytes(p); staging > 0 && dev.is_cuda())
      fmt::print(out, "  message staging: {} ({} bytes) of page-locked host memory outside the budget (its "
                      "activations and gradients in flight through the host at most)\n",
                 format_bytes(staging), staging);
    last = p;
  }
  fmt::print(out, "\nevery stage runs micro-batches of {}: the largest that fits stage {}, the tightest\n", m, tightest);
  const Setup& first = stages.front().setup;
  fmt::print(out, "{}\n", work_line(first.segment_costs, first.stage->bounds));
  return last;
}

// The host tier's lines of the plan: the placement and why, and the tier's predicted peak.
void print_placement(const mbp::Executor& executor, const mbp::Plan& p, std::ostream& out) {
  const mbp::PlacementChoice& placed = executor.placement_choice();
  fmt::print(out, "      placement {}: {}\n", mbp::placement_name(placed.placement), placed.why);
  if (p.host_predicted_peak > 0)  // state placed or activations offloaded there
    fmt::print(out, "      host tier: predicted peak {} ({} bytes) of {}; live at its peak: {}\n",
               format_bytes(p.host_predicted_peak), p.host_predicted_peak, format_bytes(p.host_budget),
               p.host_at_peak.str());
}

// The plan's recomputation (or segments' modes) and, when it recomputes or offloads, what the same
// micro-batch would need without (a too-small error measures it on a clone with room to spare);
// the cost model's lines where segments were chosen by it. Re-plans at another level: last.
void print_recompute(mbp::Executor& executor, const mbp::Plan& p, std::ostream& out) {
  const mbp::RecomputeChoice chosen = executor.recompute_choice();
  const std::string recompute = chosen.summary(p);
  if (chosen.level > 0) {
    std::string without;
    try {
      const mbp::Plan q = executor.at_level(p.micro_batch, p.micro_batch, 0);
      without = fmt::format("{} ({} bytes), so it saves {}", format_bytes(q.predicted_peak), q.predicted_peak,
                            format_bytes(q.predicted_peak - std::min(q.predicted_peak, p.predicted_peak)));
    } catch (const OutOfMemory& e) {
      without = fmt::format("more than the limit: at least {}", format_bytes(e.requested()));
    }
    fmt::print(out, "      recompute: {}; without {} a micro-batch of {} needs {}\n", recompute,
               chosen.segments.empty() ? "recomputation" : "recomputation or offloading", p.micro_batch, without);
  } else {
    fmt::print(out, "      recompute: {}\n", recompute);
  }
  for (const std::string& line : chosen.cost_lines(p)) fmt::print(out, "        {}\n", line);
}

// --report: the plan's step, traced in a dry run, as the memory report (report/memory_html.h).
void write_report(const PlanOptions& opt, mbp::Executor& executor, const mbp::Plan& p,
                  const std::vector<report::LayerRow>& rows, const Shape& sample, Device dev, std::size_t limit,
                  const mbp::ExecutorOptions& eo, std::ostream& out) {
  bool every = true;
  const std::shared_ptr<Arena> traced = executor.traced_dry_step(p, &every);
  report::MemoryPage page;
  page.title = fmt::format("tally plan: {} (norm {}), input {}, batch {} in {} on {}", opt.model, name_of(opt.norm),
                           shape_str(sample), opt.batch_size, format_bytes(limit), dev.str());
  page.source = every ? "A traced dry run of every micro-batch of the planned step (nothing computed)"
                      : fmt::format("A traced dry run of the planned step shortened to two micro-batches of each "
                                    "size (its {} micro-batches repeat the same allocations; nothing computed)",
                                    p.micro_batches);
  page.budget = limit;
  page.predicted_peak = p.predicted_peak;
  page.micro_batches = p.micro_batches;
  page.plan = {{"plan", p.summary()},
               {"live at the peak", p.at_peak.str()},
               {"recompute", executor.recompute_choice().summary(p)},
               {"precision", name_of(opt.precision)},
               {"memory format", memory_format_name(eo.memory_format)},
               {"optimizer", name_of(opt.optimizer)}};
  if (eo.host_arena)
    page.plan.emplace_back("placement", fmt::format("{}: {}", mbp::placement_name(executor.placement_choice().placement),
                                                    executor.placement_choice().why));
  page.layers = rows;
  page.layer_batch = p.micro_batch;
  write_text(opt.report, report::memory_html(*traced, page));
  fmt::print(out, "wrote the memory report {} ({} allocation and free events)\n", opt.report, traced->trace().size());
}

// --device-file: the described GPU, checked against the options a plan without it cannot honour;
// without one, --device cuda needs the GPU.
std::optional<DeviceFile> described_gpu(const PlanOptions& opt, Device dev) {
  if (opt.device_file.empty()) {
    if (dev.is_cuda() && !cuda_available())
      throw Error(fmt::format("--device {}: no GPU is present (CUDA workspace sizes come from the GPU's libraries; "
                              "--device-file plans a GPU that is not here)",
                              opt.device));
    check_gpu_index(opt.device, dev);
    return std::nullopt;
  }
  if (!kHaveCudaBackend)
    throw Error(fmt::format("--device-file {}: plans of a GPU need the CUDA build; this build of tally has no CUDA "
                            "backend", opt.device_file));
  if (!dev.is_cuda())
    throw Error(fmt::format("--device-file: expected --device cuda (the file describes a GPU), found --device {}",
                            opt.device));
  DeviceFile f = load_device_file(opt.device_file);
  if (lists_auto(opt.memory_limit))
    throw Error(fmt::format("--memory-limit {} with --device-file: expected sizes (auto is the free memory of a GPU "
                            "that is here; the {} of {} has {} in all)",
                            opt.memory_limit, f.name, opt.device_file, format_bytes(f.total_memory)));
  if (opt.host_memory_limit != "none" && (opt.copy_bandwidth == "measure" || opt.compute_rate == "measure"))
    throw Error(fmt::format("--host-memory-limit with --device-file: expected --copy-bandwidth and --compute-rate as "
                            "numbers (the rates of a GPU that is not here cannot be measured), found {} and {}",
                            opt.copy_bandwidth, opt.compute_rate));
  return f;
}

// The line that says whose plan this is when the GPU is not here.
void print_described(const DeviceFile& f, const PlanOptions& opt, const mbp::ExecutorOptions& eo, std::ostream& out) {
  fmt::print(out, "planned without the GPU, from {}: {} (compute capability {}.{}, {} multiprocessors, {}), cuDNN {}; "
                  "convolutions through cuDNN's graph API{}\n",
             opt.device_file, f.name, f.compute_major, f.compute_minor, f.multiprocessors, format_bytes(f.total_memory),
             cudnn_version_text(f.cudnn_version),
             opt.precision == mbp::Precision::fp32 && eo.memory_format == MemoryFormat::Contiguous
                 ? " (on the GPU, row-major float32 takes the legacy API unless TALLY_CUDNN_CONV_API=graph: this is "
                   "the plan of the graph API's choices)"
                 : "");
}

}  // namespace

namespace {

// The plan's lines: the split and its peak, what is live there, the input staging, the placement, the
// recomputation, the convolutions' tuning.
void print_plan(mbp::Executor& executor, const mbp::Plan& p, const mbp::ExecutorOptions& eo, std::ostream& out) {
  fmt::print(out, "\nplan: {}\n", p.summary());
  fmt::print(out, "      live at the peak: {}\n", p.at_peak.str());
  if (const std::size_t staging = executor.input_staging_bytes(p); staging > 0)
    fmt::print(out, "      input staging: {} of page-locked host memory outside the budget (a ring of the inputs as "
                    "{}: two steps, at most {}, at least three micro-batches)\n",
               format_bytes(staging), dtype_name(executor.activation_dtype()),
               format_bytes(InputStager::kStagingBudget));
  if (eo.host_arena) print_placement(executor, p, out);
  print_recompute(executor, p, out);
  if (eo.conv_tuning && !eo.conv_tuning->report().empty()) fmt::print(out, "      {}\n", eo.conv_tuning->report());
  fmt::print(out, "      {} dry runs in {:.2f} s; nothing was computed\n", p.probes, p.seconds);
}

}  // namespace

mbp::Plan plan(const PlanOptions& opt, std::ostream& out) {
  check_step_options(opt);
  const Shape sample = parse_input(opt.input);
  const Device dev = parse_device(opt.device);
  const std::optional<DeviceFile> described = described_gpu(opt, dev);
  std::optional<DescribedGpuScope> describing;
  if (described) describing.emplace(*described);
  if (dev.is_cuda()) set_allow_tf32(opt.tf32), set_deterministic(opt.deterministic == OnOff::on);
  nn::ModelConfig mc;
  mc.name = opt.model;
  mc.norm = opt.norm;
  mc.in_channels = sample[0];
  mc.num_classes = opt.num_classes.value_or(sample[1] >= 64 ? 1000 : 10);
  if (opt.pipeline_stages > 1) {
    if (!opt.report.empty())
      throw Error("--report: the memory report is of one process's step; with --pipeline-stages each stage has its "
                  "own (run tally train, which writes memory.html per stage)");
    return plan_stages(opt, mc, sample, dev, out);
  }
  if (!opt.report.empty()) check_writable_file("--report", opt.report);
  const std::size_t limit = parse_memory_limit(opt.memory_limit, dev);
  if (described && limit > described->total_memory)
    fmt::print(stderr, "tally plan: warning: --memory-limit {} is more than the {} has ({})\n", opt.memory_limit,
               described->name, format_bytes(described->total_memory));

  // The cost model's rates (mbp/activations.h), for a host tier's choice per segment, measured now:
  // in the dry run below nothing runs.
  std::optional<mbp::CostRates> rates;
  if (opt.host_memory_limit != "none")
    rates = mbp::complete_cost_rates(given_cost_rates(opt), dev,
                                     opt.precision == mbp::Precision::bf16 ? DType::BFloat16 : DType::Float32);

  // Everything lives on a virtual arena of the budget's size: offsets only, no memory, no compute.
  const DryRun dry;
  const auto arena = dry.virtual_arena(dev, limit);
  OptimizerConfig oc;
  oc.kind = opt.optimizer;
  oc.momentum = opt.momentum;
  oc.state_when_placed = opt.host_memory_limit != "none";
  const Setup setup = build_setup(arena, mc, "", oc, format_bytes(limit));
  mbp::ExecutorOptions eo = executor_options(opt, sample, dev, false);
  // A plan measures nothing: it replays the tuning file (docs/gpu.md, "Tuning").
  if (eo.conv_tuning) eo.conv_tuning = conv_tuning(opt.tuning_file, false, 0);
  eo.host_arena = make_host_arena(opt.host_memory_limit, dev, limit, &dry, &out);
  if (rates) eo.cost_rates = rates;
  fmt::print(out, "model {} (norm {}), {} parameters, {} classes | input {} | batch {} | optimizer {} | device {} | "
                  "precision {} | memory format {}\n",
             opt.model, name_of(opt.norm), setup.parameters, mc.num_classes, shape_str(sample), opt.batch_size,
             name_of(opt.optimizer), dev.str(), name_of(opt.precision), memory_format_name(eo.memory_format));
  fmt::print(out, "memory limit {} ({} bytes): {} allocated first{}\n", format_bytes(limit), limit,
             persistent_summary(*arena, setup.optimizer.get()), deferred_state_note(*setup.optimizer));
  if (described) print_described(*described, opt, eo, out);
  if (eo.host_arena)
    fmt::print(out, "host memory limit {} ({} bytes): the host tier, for the state a placement puts there\n",
               format_bytes(eo.host_arena->capacity()), eo.host_arena->capacity());

  mbp::Executor executor(*setup.model, *setup.optimizer, arena, eo);
  const mbp::Plan& p = plan_step(executor, opt.batch_size, opt.micro_batch);
  std::vector<report::LayerRow> rows;
  if (opt.layers || !opt.report.empty()) {
    const HostArenaScope host(eo.host_arena);  // offloaded segments move their activations there
    rows = report::layer_table(*setup.model, *arena, sample, p.micro_batch, executor.activation_dtype(),
                               eo.memory_format);
  }
  if (opt.layers) {
    fmt::print(out, "\nper layer, forward in training mode at the planned micro-batch of {}:\n", p.micro_batch);
    out << report::format_layer_table(rows, p.micro_batch);
  }
  // Before any comparison below re-plans at other levels: the trace is of the step as chosen.
  if (!opt.report.empty()) write_report(opt, executor, p, rows, sample, dev, limit, eo, out);
  print_plan(executor, p, eo, out);
  return p;
}

}  // namespace tally::app
