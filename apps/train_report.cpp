// apps/train_report.cpp — what a run tells: the header and the plan, metrics.csv, the pipeline's
// schedule picture, the stop line, and the end (the ranks gathered, summary.json, the pictures).
#include <cerrno>
#include <cstring>

#include "apps/training_run.h"
#include "core/files.h"
#include "report/memory_html.h"

namespace tally::app {

namespace {
// The other stages' memory reports (apps/trainer.cpp), where their machine sees the run folder.
std::string stage_pages(const std::string& out, int stages) {
  return stages == 2 ? fmt::format("the other stage wrote {}/memory-stage1.html", out)
                     : fmt::format("the other stages wrote {0}/memory-stage1.html .. {0}/memory-stage{1}.html", out,
                                   stages - 1);
}
}  // namespace

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
                      {"placement", result.placement},
                      {"host_memory_limit_bytes", result.host_memory_limit_bytes},
                      {"host_peak_bytes", result.host_peak_bytes},
                      {"host_predicted_peak_bytes", result.host_predicted_peak_bytes},
                      {"micro_batch", result.micro_batch},
                      {"micro_batches_per_step", result.micro_batches_per_step},
                      {"oom_retries", result.oom_retries},
                      {"steps", result.steps},
                      {"device", result.device},
                      {"model", opt.model},
                      {"norm", name_of(opt.norm)},
                      {"batch_size", opt.batch_size},
                      {"loss_normalization", name_of(opt.loss_normalization)},
                      {"recompute", result.recompute},
                      {"precision", name_of(opt.precision)},
                      {"memory_format", result.memory_format},
                      {"data", opt.data},
                      {"world_size", result.world_size},
                      {"communication_library_bytes", result.communication_library_bytes},
                      {"cuda_graphs", {{"recorded", result.graphs_recorded}, {"replayed", result.graphs_replayed},
                                       {"device_bytes", result.graph_device_bytes}}},
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

void TrainingRun::print_header(const Setup& setup) const {
  const data::Dataset& t = split_.train;
  const Device dev = rank_.dev;
  fmt::print(log_, "{}\n", build_info());
  fmt::print(log_, "model {} (norm {}), {} parameters | data {}: {} train / {} test, {}x{}x{}, {} classes\n", rank_options_.model,
             name_of(rank_options_.norm), setup.parameters, t.name, t.size(), split_.test.size(), t.channels, t.height, t.width,
             t.num_classes);
  fmt::print(log_, "device {}{} | precision {} | memory format {} | batch {} | {} steps ({} per epoch) | {} lr {} schedule {} | augment {} shuffle {} normalize {}\n",
             dev.str(), dev.is_cuda() ? fmt::format(" (TF32 {}, deterministic {})", rank_options_.tf32 ? "on" : "off", name_of(rank_options_.deterministic)) : (rank_options_.tf32 ? " (--tf32: no effect on the CPU)" : ""),
             rank_options_.precision == mbp::Precision::bf16 ? "bf16 (bf16 activations, float32 weights, gradients and loss)" : "fp32",
             memory_format_name(executor_->memory_format()), rank_options_.batch_size, steps_.total, per_epoch_, name_of(rank_options_.optimizer), rank_options_.lr, rank_options_.schedule,
             augments(rank_options_, data_spec_) ? "on" : "off", rank_options_.shuffle ? "on" : "off", rank_options_.normalize ? "on" : "off");
  fmt::print(log_, "memory limit {}{}: {} allocated before planning{}\n", format_bytes(arena_->capacity()),
             rank_options_.memory_limit == "auto" ? " (auto)" : "", persistent_summary(*arena_, setup_.optimizer.get()),
             deferred_state_note(*setup_.optimizer));
  if (host_arena_)
    fmt::print(log_, "host memory limit {}{} ({}): the host tier, for the state a placement puts there\n",
               format_bytes(host_arena_->capacity()), rank_options_.host_memory_limit == "auto" ? " (auto)" : "",
               host_arena_->is_pinned() ? "pinned" : "pageable");
}

void TrainingRun::print_plan(const mbp::Plan& plan) const {
  fmt::print(log_, "plan: {}\n", plan.summary());
  fmt::print(log_, "      recompute: {}\n", executor_->recompute_choice().summary(plan));
  for (const std::string& line : executor_->recompute_choice().cost_lines(plan)) fmt::print(log_, "        {}\n", line);
  fmt::print(log_, "      live at the peak: {}\n", plan.at_peak.str());
  if (host_arena_) {
    const mbp::PlacementChoice& placed = executor_->placement_choice();
    fmt::print(log_, "      placement {}: {}\n", mbp::placement_name(placed.placement), placed.why);
    if (plan.host_predicted_peak > 0)  // state placed or activations offloaded there
      fmt::print(log_, "      host tier: predicted peak {} of {}; live at its peak: {}\n",
                 format_bytes(plan.host_predicted_peak), format_bytes(plan.host_budget), plan.host_at_peak.str());
  }
  fmt::print(log_, "      {} ({} dry runs, {:.0f} ms)\n",
             rank_options_.micro_batch ? fmt::format("--micro-batch {} checked", *rank_options_.micro_batch)
                              : std::string("largest micro-batch that fits, found"),
             plan.probes, plan.seconds * 1000.0);
  if (rank_options_.loss_normalization != mbp::LossNormalization::exact)
    fmt::print(log_, "      loss normalization per-micro-batch: each micro-batch's mean / {} (not the full batch's "
                     "mean when the micro-batches differ in size)\n", plan.micro_batches);
}

void TrainingRun::open_metrics() {
  if (rank_options_.out.empty()) return;
  // A resumed run starts from the rows of its checkpoint: rows written after it are dropped.
  if (metrics_text_.empty())
    metrics_text_ = "step,epoch,loss,lr,images_per_second,peak_bytes,predicted_peak_bytes,micro_batch,micro_batches\n";
  metrics_.open(std::filesystem::path(rank_options_.out) / "metrics.csv", std::ios::trunc);
  append_metrics(metrics_text_);
}

// A pipeline's traced step: every stage's timeline to rank 0 (a collective), which draws them into
// pipeline.svg, with the bubble the schedule implies for k micro-batches on S equal stages.
void TrainingRun::append_metrics(const std::string& text) {
  const std::filesystem::path path = std::filesystem::path(rank_options_.out) / "metrics.csv";
  if (const int injected = injected_write_error(path)) metrics_.setstate(std::ios::badbit), errno = injected;
  metrics_ << text << std::flush;
  if (!metrics_)  // a full disk: said now, with the last checkpoint intact, not found missing later
    throw Error(fmt::format("cannot write {}: {}", path.string(), std::strerror(errno != 0 ? errno : EIO)));
}

void TrainingRun::write_schedule(std::int64_t step, const mbp::StepResult& r) {
  const mbp::PipelineTrace& mine = executor_->stage()->trace();
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
      rank_options_.model, S, mbp::pipeline_schedule_name(setup_.stage->schedule), step + 1, r.micro_batches, r.micro_batch,
      100.0 * (stages - 1) / (k + stages - 1));
  write_text(std::filesystem::path(rank_options_.out) / "pipeline.svg", report::pipeline_svg(traces, title));
}

void TrainingRun::report_stop() const {
  const std::string how = rank_.ranks > 1 ? fmt::format("mpirun -np {} tally train", rank_.ranks) : "tally train";
  fmt::print(log_, "\nstopped by {} after step {} of {}: {}\n", StopSignals::name(stopped_), meter_.steps,
             steps_.total,
             run_options_.out.empty() ? std::string("no run folder (--out), so no checkpoint")
                                  : fmt::format("checkpoint {} written; continue with: {} --resume {}",
                                                result_.checkpoint, how, run_options_.out));
  log_.flush();
}

// The result, the ranks' agreement, the memory and profile reports, and the files.
namespace {
// A folder's images skipped as bad (--skip-bad-images), each with its error.
void print_bad_images(const std::shared_ptr<data::BadImages>& bad_images, std::ostream& log) {
  if (!bad_images) return;
  const auto bad = bad_images->list();
  if (bad.empty()) return;
  fmt::print(log, "skipped {} bad image{} (--skip-bad-images), each replaced by the next one of its class:\n",
             bad.size(), bad.size() == 1 ? "" : "s");
  for (const auto& [file, why] : bad) fmt::print(log, "  {}\n", why);
}
}  // namespace

// --profile: the table of the steps after the first, with each step's wall time split into the ops'
// and the rest; printed and written to profile.txt.
void TrainingRun::write_profile(std::int64_t step) {
  const StepMeter& meter = meter_;
  const double wall_ms =
      meter.steady_images > 0 ? 1000.0 * meter.steady_seconds / static_cast<double>(meter.measured - 1) : 0.0;
  const std::string report = profiler_.report(
      fmt::format("over steps 2..{} ({:.1f} ms of wall time per step, data included)", step, wall_ms),
      meter.measured - 1, wall_ms);
  fmt::print(log_, "{}", report);
  if (!rank_options_.out.empty()) write_text(std::filesystem::path(rank_options_.out) / "profile.txt", report);
  profiler_.pause();
}

// --cuda-graphs on: what was recorded and replayed, in the log and the summary.
void TrainingRun::report_graphs() {
  const mbp::Executor::GraphStats& g = executor_->graph_stats();
  if (!g.failed.empty()) fmt::print(log_, "cuda graphs: off since a recording failed: {}\n", g.failed);
  if (g.recorded == 0 && g.failed.empty() && rank_options_.cuda_graphs == OnOff::on && rank_.dev.is_cuda())
    fmt::print(log_, "cuda graphs: on, but no micro-batch was recorded — graphs take a step's second and later "
                     "micro-batches where the model's ops run alone: not with data parallelism, pipeline stages, the "
                     "host tier's placements or offloaded segments\n");
  if (g.recorded == 0) return;
  result_.graphs_recorded = g.recorded, result_.graphs_replayed = g.replayed;
  result_.graph_device_bytes = static_cast<std::int64_t>(g.device_bytes);
  fmt::print(log_, "cuda graphs: {} micro-batches recorded ({} graphs kept, {} nodes, {} of device memory outside "
             "the arena), {} replayed{}\n", g.recorded, g.graphs, g.nodes, format_bytes(g.device_bytes), g.replayed,
             g.unreplayable > 0 ? fmt::format(", {} not replayable", g.unreplayable) : std::string());
  if (g.over_cap > 0)
    fmt::print(log_, "cuda graphs: {} micro-batches ran without, past the {} recordings kept per plan\n", g.over_cap,
               mbp::Executor::kMaxGraphs);
}

void TrainingRun::finish() {
  print_bad_images(bad_images_.train, log_);
  const StepMeter& meter = meter_;
  const std::int64_t step = meter.steps;
  const int ranks = rank_.ranks;
  result_.test_accuracy = eval_.accuracy;
  result_.test_loss = eval_.loss;
  result_.evaluated = rank_options_.evaluate;
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
  report_graphs();
  if (host_arena_ && result_.host_peak_bytes > 0)  // state placed or activations offloaded there
    fmt::print(log_, "host tier: measured step peak {} ({} bytes), predicted {} ({} bytes){}, limit {}\n",
               format_bytes(static_cast<std::size_t>(result_.host_peak_bytes)), result_.host_peak_bytes,
               format_bytes(static_cast<std::size_t>(result_.host_predicted_peak_bytes)), result_.host_predicted_peak_bytes,
               meter.mismatches == 0 ? " — exact" : "", format_bytes(host_arena_->capacity()));
  if (profiler_.on()) write_profile(step);
  if (!rank_options_.save.empty()) {
    nn::save_state_dict(*setup_.model, rank_options_.save);
    fmt::print(log_, "saved {}\n", rank_options_.save);
  }
  if (!rank_options_.out.empty()) {
    write_summary(rank_options_, result_);
    fmt::print(log_, "wrote {0}/metrics.csv, {0}/summary.json, {0}/memory_trace.json{1}, {0}/memory.svg and {0}/memory.html\n", rank_options_.out,
               setup_.stage && steps_.total > 1 ? fmt::format(", {}/pipeline.svg", rank_options_.out) : std::string());
    if (setup_.stage) fmt::print(log_, "{}\n", stage_pages(rank_options_.out, setup_.stage->stages));
  }
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

}  // namespace tally::app
