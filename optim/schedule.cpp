// optim/schedule.cpp — the closed forms documented in optim/schedule.h, written in the same
// order of operations as PyTorch 1.13's lr_scheduler.py so that results agree to the last bits.
#include "optim/schedule.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace tally::optim {

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"constant", "step", "cosine", "onecycle"};
  return names;
}

namespace {

[[noreturn]] void bad(const std::string& option, const std::string& expected, const std::string& found) {
  throw Error(fmt::format("LRSchedule: {} must be {}, found {}", option, expected, found));
}

void require(bool ok, const char* option, const char* expected, double found) {
  if (!ok) bad(option, expected, fmt::format("{}", found));
}

// OneCycleLR's _annealing_cos: from `start` at pct 0 to `end` at pct 1.
double anneal_cos(double start, double end, double pct) {
  const double cos_out = std::cos(std::numbers::pi * pct) + 1.0;
  return end + (start - end) / 2.0 * cos_out;
}

}  // namespace

LRSchedule::LRSchedule(ScheduleOptions options) : options_(std::move(options)) {
  const ScheduleOptions& o = options_;
  if (o.kind == "constant") kind_ = Kind::constant;
  else if (o.kind == "step") kind_ = Kind::step;
  else if (o.kind == "cosine") kind_ = Kind::cosine;
  else if (o.kind == "onecycle") kind_ = Kind::onecycle;
  else bad("kind", "one of " + fmt::format("{}", fmt::join(schedule_names(), "|")), "'" + o.kind + "'");

  require(std::isfinite(o.base_lr) && o.base_lr >= 0, "base_lr", ">= 0 and finite", o.base_lr);
  if (o.total_steps < 0) bad("total_steps", ">= 0", std::to_string(o.total_steps));
  if (o.warmup_steps < 0) bad("warmup_steps", ">= 0", std::to_string(o.warmup_steps));
  switch (kind_) {
    case Kind::constant: break;
    case Kind::step:
      require(std::isfinite(o.gamma) && o.gamma >= 0, "gamma", ">= 0 and finite", o.gamma);
      if (o.step_size < 0) bad("step_size", ">= 1, or 0 for total_steps / 3", std::to_string(o.step_size));
      step_size_ = o.step_size > 0 ? o.step_size : o.total_steps / 3;
      if (step_size_ == 0)
        bad("total_steps", ">= 3 when step_size is 0 (step_size = total_steps / 3)", std::to_string(o.total_steps));
      break;
    case Kind::cosine:
      require(std::isfinite(o.eta_min) && o.eta_min >= 0, "eta_min", ">= 0 and finite", o.eta_min);
      if (o.total_steps <= o.warmup_steps)
        bad("total_steps", fmt::format("> warmup_steps ({}) for the cosine schedule", o.warmup_steps),
            std::to_string(o.total_steps));
      break;
    case Kind::onecycle:
      if (o.total_steps <= 0) bad("total_steps", "> 0 for the onecycle schedule", std::to_string(o.total_steps));
      require(o.onecycle_pct_start >= 0 && o.onecycle_pct_start <= 1, "onecycle_pct_start", "in [0, 1]",
              o.onecycle_pct_start);
      require(std::isfinite(o.onecycle_div_factor) && o.onecycle_div_factor > 0, "onecycle_div_factor", "> 0",
              o.onecycle_div_factor);
      require(std::isfinite(o.onecycle_final_div_factor) && o.onecycle_final_div_factor > 0,
              "onecycle_final_div_factor", "> 0", o.onecycle_final_div_factor);
      break;
  }
}

double LRSchedule::lr_at(std::int64_t step) const {
  const ScheduleOptions& o = options_;
  if (step < 0) throw Error(fmt::format("LRSchedule::lr_at: step must be >= 0, found {}", step));
  const double b = o.base_lr;

  if (kind_ == Kind::onecycle) {
    if (step > o.total_steps)
      throw Error(fmt::format("LRSchedule::lr_at: step must be <= total_steps ({}) for the onecycle schedule, "
                              "found {}", o.total_steps, step));
    const double initial = b / o.onecycle_div_factor;
    const double final_lr = initial / o.onecycle_final_div_factor;
    const double end1 = o.onecycle_pct_start * static_cast<double>(o.total_steps) - 1.0;
    const double end2 = static_cast<double>(o.total_steps - 1);
    const double s = static_cast<double>(step);
    // pct within a phase; a zero-length phase counts as finished (PyTorch divides by zero).
    auto pct = [](double from, double to, double at) { return to == from ? 1.0 : (at - from) / (to - from); };
    if (s <= end1) return anneal_cos(initial, b, pct(0.0, end1, s));
    return anneal_cos(b, final_lr, pct(end1, end2, s));
  }

  const std::int64_t w = o.warmup_steps;
  if (step < w) return b * static_cast<double>(step + 1) / static_cast<double>(w);
  const std::int64_t t = step - w;
  switch (kind_) {
    case Kind::constant: return b;
    case Kind::step: return b * std::pow(o.gamma, static_cast<double>(t / step_size_));
    case Kind::cosine: {
      const double T = static_cast<double>(o.total_steps - w);
      return o.eta_min + (b - o.eta_min) * (1.0 + std::cos(std::numbers::pi * static_cast<double>(t) / T)) / 2.0;
    }
    case Kind::onecycle: break;
  }
  return b;  // unreachable
}

}  // namespace tally::optim
