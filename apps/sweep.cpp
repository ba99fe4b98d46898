// apps/sweep.cpp — `tally sweep`; see apps/sweep.h.
#include "apps/sweep.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <nlohmann/json.hpp>

#include "apps/plan.h"
#include "apps/run_state.h"
#include "apps/setup.h"
#include "distributed/communicator.h"
#include "core/arena.h"
#include "core/error.h"
#include "mbp/checkpoint.h"
#include "report/sweep.h"

namespace tally::app {

std::vector<std::int64_t> parse_batch_sizes(const std::string& list) {
  std::vector<std::int64_t> sizes;
  std::set<std::int64_t> seen;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto v = parse_positive_integer(item);
    if (!v)
      throw Error(fmt::format("--batch-sizes '{}': expected a comma-separated list of positive integers (e.g. "
                              "128,256,512), found '{}'", list, item));
    if (!seen.insert(*v).second) throw Error(fmt::format("--batch-sizes '{}': batch size {} is listed twice", list, *v));
    sizes.push_back(*v);
  }
  if (sizes.empty() || (!list.empty() && list.back() == ','))
    throw Error(fmt::format("--batch-sizes '{}': expected a comma-separated list of positive integers (e.g. "
                            "128,256,512)", list));
  return sizes;
}

double scaled_lr(double lr, std::int64_t b, std::int64_t b0, LrScaling rule) {
  const double r = static_cast<double>(b) / static_cast<double>(b0);
  return rule == LrScaling::sqrt ? lr * std::sqrt(r) : lr * r;
}

namespace {

const char* kHeader =
    "batch_size,micro_batch,micro_batches_per_step,steps,lr,train_loss,test_accuracy,images_per_second,"
    "predicted_peak_bytes,peak_bytes,wall_seconds\n";

// "1 epoch", "3 epochs", "50 steps": a run's budget.
std::string budget_text(const TrainOptions& t) {
  const std::int64_t n = t.steps ? *t.steps : t.epochs;
  return fmt::format("{} {}{}", n, t.steps ? "step" : "epoch", n == 1 ? "" : "s");
}

std::string csv(const std::vector<SweepRow>& rows) {
  std::string s = kHeader;
  for (const SweepRow& r : rows)
    s += fmt::format("{},{},{},{},{:.6g},{:.6f},{},{:.2f},{},{},{:.2f}\n", r.batch_size, r.micro_batch,
                     r.micro_batches_per_step, r.steps, r.lr, r.train_loss,
                     r.test_accuracy ? fmt::format("{:.6f}", *r.test_accuracy) : "",  // empty: --no-eval
                     r.images_per_second, r.predicted_peak_bytes, r.peak_bytes, r.wall_seconds);
  return s;
}

}  // namespace

namespace {

// Everything checked and planned before any training: the batch sizes, the device, and each
// run's warm-up (the default shortened where a run is too short for it, with a note) and plan.
struct Prepared {
  std::vector<std::int64_t> sizes;
  std::string device;
  std::vector<double> warmups;
  std::vector<std::string> plans, notes;
};

PlanOptions plan_options(const SweepOptions& opt, const DataInfo& data, const std::string& device, std::int64_t b) {
  PlanOptions po;
  static_cast<StepOptions&>(po) = opt.train;  // the step's options are the runs'
  po.input = fmt::format("{}x{}x{}", data.channels, data.height, data.width);
  po.num_classes = data.num_classes;
  po.batch_size = b;
  if (opt.train.micro_batch) po.micro_batch = std::min(*opt.train.micro_batch, b);
  po.device = device;
  po.layers = false;
  return po;
}

Prepared prepare(const SweepOptions& opt) {
  if (opt.train.out.empty()) throw Error("tally sweep needs --out DIR for sweep.csv, sweep.svg and the runs");
  std::error_code ec;
  if (opt.resume.empty() && std::filesystem::exists(std::filesystem::path(opt.train.out) / "sweep.json", ec))
    throw Error(fmt::format("--out {}: it holds a sweep already; continue it with tally sweep --resume {}, or choose "
                            "another folder", opt.train.out, opt.train.out));
  if (distributed::launched_by_mpi())
    throw Error("tally sweep runs in one process; under mpirun, run `tally train` once per batch size instead");
  Prepared p;
  p.sizes = parse_batch_sizes(opt.batch_sizes);
  TrainOptions largest = opt.train;  // --batch-size is the sweep's list: --micro-batch is checked against its largest
  largest.batch_size = *std::max_element(p.sizes.begin(), p.sizes.end());
  p.device = check_train_options(largest);
  const DataInfo data = describe_data(opt.train);
  p.warmups.assign(p.sizes.size(), opt.train.warmup_epochs);
  for (std::size_t i = 0; i < p.sizes.size(); ++i) {
    const std::int64_t b = p.sizes[i];
    if (b > data.train_size)
      throw Error(fmt::format("--batch-sizes: batch size {} is larger than the {} training samples of {}", b,
                              data.train_size, opt.train.data));
    // Each run's learning rate, scaled from the first batch size's, within --lr's bound: checked here,
    // before the first run, rather than when the run that exceeds it starts.
    const double lr = scaled_lr(opt.train.lr, b, p.sizes.front(), opt.lr_scaling);
    if (const std::string why = number_error(kLearningRate, fmt::format("{}", lr)); !why.empty())
      throw Error(fmt::format("batch size {}: its learning rate, --lr {} scaled {} from batch size {}, {}", b,
                              opt.train.lr, name_of(opt.lr_scaling), p.sizes.front(), why));
    const std::int64_t per_epoch = data.train_size / b;  // the loader drops the last partial batch
    const RunSteps run = run_steps(opt.train, per_epoch);
    if (run.warmup > 0 && run.warmup >= run.total) {
      if (opt.warmup_given)
        throw Error(fmt::format("batch size {}: the warm-up of {} epochs ({} steps) is not shorter than the run's {} "
                                "steps: give a smaller --warmup-epochs (0 for none) or more --epochs",
                                b, opt.train.warmup_epochs, run.warmup, run.total));
      p.warmups[i] = static_cast<double>(run.total / 2) / static_cast<double>(per_epoch);
      p.notes.push_back(fmt::format("batch {}: the default warm-up of {} epochs ({} steps) is not shorter than the "
                                    "run's {} steps, so it warms up over {} steps", b, opt.train.warmup_epochs,
                                    run.warmup, run.total, run.total / 2));
    }
    std::ostringstream quiet;
    try {
      p.plans.push_back(plan(plan_options(opt, data, p.device, b), quiet).summary());
    } catch (const OutOfMemory& e) {
      throw OutOfMemory(fmt::format("batch size {}: {}", b, e.what()), e.requested());
    }
  }
  return p;
}

nlohmann::json row_json(const SweepRow& r, std::int64_t limit_bytes) {
  return {{"batch_size", r.batch_size}, {"micro_batch", r.micro_batch}, {"micro_batches_per_step", r.micro_batches_per_step},
          {"steps", r.steps}, {"lr", r.lr}, {"train_loss", r.train_loss},
          {"test_accuracy", r.test_accuracy ? nlohmann::json(*r.test_accuracy) : nlohmann::json(nullptr)},
          {"images_per_second", r.images_per_second}, {"predicted_peak_bytes", r.predicted_peak_bytes},
          {"peak_bytes", r.peak_bytes}, {"wall_seconds", r.wall_seconds}, {"memory_limit_bytes", limit_bytes}};
}

// A finished run's row (its folder's sweep_row.json), nullopt if the run did not finish.
std::optional<SweepRow> finished_row(const std::filesystem::path& dir, std::int64_t* limit_bytes) {
  std::error_code ec;
  const std::filesystem::path file = dir / "sweep_row.json";
  if (!std::filesystem::exists(file, ec)) return std::nullopt;
  std::ifstream in(file);
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    SweepRow r;
    r.batch_size = j.at("batch_size"), r.micro_batch = j.at("micro_batch");
    r.micro_batches_per_step = j.at("micro_batches_per_step"), r.steps = j.at("steps"), r.lr = j.at("lr");
    r.train_loss = j.at("train_loss");
    if (!j.at("test_accuracy").is_null()) r.test_accuracy = j.at("test_accuracy").get<double>();
    r.images_per_second = j.at("images_per_second"), r.predicted_peak_bytes = j.at("predicted_peak_bytes");
    r.peak_bytes = j.at("peak_bytes"), r.wall_seconds = j.at("wall_seconds");
    *limit_bytes = j.at("memory_limit_bytes");
    return r;
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: expected a finished run's row, found: {}", file.string(), e.what()));
  }
}

// One run of the sweep (its log in its folder's train.log, appended to when it resumes), as a row.
// The run's progress bar goes to the sweep's log.
SweepRow run_one(const TrainOptions& t, std::ostream& log, std::int64_t* limit_bytes, int* stop_signal) {
  std::ofstream run_log(std::filesystem::path(t.out) / "train.log", t.resume.empty() ? std::ios::trunc : std::ios::app);
  const auto t0 = std::chrono::steady_clock::now();
  const TrainResult r = train(t, run_log, &log);
  *stop_signal = r.stop_signal;
  SweepRow row;
  row.batch_size = t.batch_size;
  row.micro_batch = r.micro_batch;
  row.micro_batches_per_step = r.micro_batches_per_step;
  row.steps = r.steps;
  row.lr = t.lr;
  row.train_loss = r.train_loss;
  if (t.evaluate && r.evaluated) row.test_accuracy = r.test_accuracy;
  row.images_per_second = r.images_per_second;
  row.predicted_peak_bytes = r.predicted_peak_bytes;
  row.peak_bytes = r.peak_bytes;
  row.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *limit_bytes = r.memory_limit_bytes;
  if (r.stop_signal == 0) write_text(std::filesystem::path(t.out) / "sweep_row.json", row_json(row, *limit_bytes).dump(1) + "\n");
  return row;
}

// sweep.svg's picture of the rows.
std::string picture(const std::vector<SweepRow>& rows, std::int64_t limit_bytes, const std::string& title) {
  std::vector<report::SweepPoint> points;
  for (const SweepRow& r : rows)
    points.push_back({r.batch_size, r.micro_batch, r.micro_batches_per_step, r.images_per_second, r.test_accuracy});
  return report::sweep_svg(points, limit_bytes, title);
}

void write_sweep_json(const SweepOptions& opt) {
  nlohmann::json options = nlohmann::json::object();
  for (const auto& [name, value] : option_values(opt.train)) options[name] = value;
  const nlohmann::json j = {{"batch_sizes", opt.batch_sizes}, {"lr_scaling", name_of(opt.lr_scaling)},
                            {"warmup_given", opt.warmup_given}, {"options", options}};
  write_text(std::filesystem::path(opt.train.out) / "sweep.json", j.dump(1) + "\n");
}

}  // namespace

std::vector<SweepRow> sweep(const SweepOptions& opt, std::ostream& log, int* stop_signal) {
  const Prepared p = prepare(opt);  // every check before any training
  const std::vector<std::int64_t>& sizes = p.sizes;
  const std::filesystem::path out(opt.train.out);
  std::filesystem::create_directories(out);
  if (opt.resume.empty()) write_sweep_json(opt);
  fmt::print(log, "sweep: {} on {} ({}), {} batch sizes, lr {} at batch {} scaled {}, memory limit {}, {} per run\n",
             opt.train.model, opt.train.data, p.device, sizes.size(), opt.train.lr, sizes.front(), name_of(opt.lr_scaling),
             opt.train.memory_limit,
             budget_text(opt.train));
  for (const std::string& note : p.notes) fmt::print(log, "sweep: {}\n", note);
  const std::string title = fmt::format("{} on {}: {} per batch size, lr {} at batch {} ({} scaling)",
                                        opt.train.model, opt.train.data, budget_text(opt.train), opt.train.lr,
                                        sizes.front(), name_of(opt.lr_scaling));
  std::vector<SweepRow> rows;
  std::int64_t limit_bytes = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::int64_t b = sizes[i];
    TrainOptions t = opt.train;
    t.batch_size = b;
    if (t.micro_batch) t.micro_batch = std::min(*t.micro_batch, b);  // as planned (plan_options)
    t.lr = scaled_lr(opt.train.lr, b, sizes.front(), opt.lr_scaling);
    t.warmup_epochs = p.warmups[i];
    t.out = (out / fmt::format("b{}", b)).string();
    t.save.clear();
    std::filesystem::create_directories(t.out);
    std::optional<SweepRow> done = opt.resume.empty() ? std::nullopt : finished_row(t.out, &limit_bytes);
    if (done) {
      fmt::print(log, "[{}/{}] batch {}: finished before the sweep was resumed\n", i + 1, sizes.size(), b);
      rows.push_back(*done);
      write_text(out / "sweep.csv", csv(rows));
      write_text(out / "sweep.svg", picture(rows, limit_bytes, title));
      continue;
    }
    if (!opt.resume.empty() && mbp::latest_checkpoint(t.out)) t.resume = t.out;
    fmt::print(log, "[{}/{}] batch {} lr {:.4g} | plan: {}{}\n", i + 1, sizes.size(), b, t.lr, p.plans[i],
               t.resume.empty() ? "" : " | resumed from its checkpoint");
    log.flush();
    int stopped = 0;
    SweepRow one = run_one(t, log, &limit_bytes, &stopped);
    if (stopped) {
      fmt::print(log, "      stopped by {} (the run's checkpoint is in {}); continue the sweep with: tally sweep "
                      "--resume {}\n", StopSignals::name(stopped), t.out, out.string());
      if (stop_signal) *stop_signal = stopped;
      return rows;
    }
    const SweepRow& row = rows.emplace_back(one);
    fmt::print(log, "      {} steps | test accuracy {} | {:.1f} img/s | peak {} bytes, predicted {}{} | {:.0f} s\n",
               row.steps,
               row.test_accuracy ? fmt::format("{:.2f}%", 100.0 * *row.test_accuracy) : "not measured (--no-eval, or no test set)",
               row.images_per_second, row.peak_bytes, row.predicted_peak_bytes,
               row.peak_bytes == row.predicted_peak_bytes ? " (exact)" : "", row.wall_seconds);
    log.flush();
    // Written after every run, so an interrupted sweep leaves what it measured.
    write_text(out / "sweep.csv", csv(rows));
    write_text(out / "sweep.svg", picture(rows, limit_bytes, title));
  }
  fmt::print(log, "wrote {0}/sweep.csv and {0}/sweep.svg\n", out.string());
  return rows;
}

SweepOptions sweep_resume_options(const std::string& dir) {
  const std::filesystem::path file = std::filesystem::path(dir) / "sweep.json";
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw Error(fmt::format("--resume {}: no sweep in it (expected {}, written when a sweep starts)", dir, file.string()));
  std::ifstream in(file);
  SweepOptions o;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    std::map<std::string, std::string> values;
    for (const auto& [key, value] : j.at("options").items()) values[key] = value.get<std::string>();
    o.train = options_from_values(values, file.string());
    o.batch_sizes = j.at("batch_sizes").get<std::string>();
    const std::string scaling = j.at("lr_scaling").get<std::string>();
    const std::optional<LrScaling> rule = enum_from<LrScaling>(scaling);
    if (!rule)
      throw FormatError(fmt::format("{}: expected \"lr_scaling\" to be one of {}, found {}", file.string(),
                                    names_list(LrScaling{}), scaling));
    o.lr_scaling = *rule;
    o.warmup_given = j.at("warmup_given").get<bool>();
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: expected a sweep's options, found: {}", file.string(), e.what()));
  }
  o.train.out = dir;
  o.resume = dir;
  return o;
}

}  // namespace tally::app
