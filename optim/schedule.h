// optim/schedule.h — learning-rate schedules as closed-form functions of the optimizer step.
//
// lr_at(s) is the learning rate for optimizer step s (0-based): the value PyTorch's scheduler
// leaves in the optimizer before the (s+1)-th optimizer.step() when scheduler.step() is called
// once after every optimizer step. Typical use:
//   for (s = 0; s < total_steps; ++s) { opt.set_lr(schedule.lr_at(s)); ...; opt.step(); }
// Closed forms instead of PyTorch's recursive updates: the same values (within 1e-12 relative,
// checked against PyTorch 1.13 by tests/gen_optim_fixtures.py), no state, any step on demand.
//
// Notation: b = base_lr, N = total_steps, W = warmup_steps, s = step, floor division.
//
//   Linear warm-up (constant, step, cosine; when W > 0):
//     s < W:   lr = b * (s + 1) / W                  (reaches b at s = W - 1)
//     s >= W:  the schedule below at the shifted step t = s - W
//     (PyTorch: SequentialLR([LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1), main],
//      milestones=[W]).) Without warm-up t = s.
//   constant:  lr = b
//   step:      lr = b * gamma^floor(t / step_size)                          (StepLR)
//              step_size = 0 means N / 3 (integer division; needs N >= 3).
//   cosine:    lr = eta_min + (b - eta_min) * (1 + cos(pi * t / T)) / 2,  T = N - W
//              (CosineAnnealingLR(T_max = T, eta_min) in closed form; needs N > W.
//              Past t = T the cosine continues, as PyTorch's closed form does.)
//   onecycle:  OneCycleLR(max_lr = b, total_steps = N, pct_start, anneal_strategy = 'cos',
//              div_factor, final_div_factor, three_phase = False); W is ignored.
//              initial = b / div_factor, final = initial / final_div_factor,
//              e1 = pct_start * N - 1, e2 = N - 1 (phase ends, as doubles),
//              anneal(a, z, p) = z + (a - z) / 2 * (cos(pi * p) + 1)
//              s <= e1:  lr = anneal(initial, b, s / e1)
//              else:     lr = anneal(b, final, (s - e1) / (e2 - e1))
//              Steps 0..N are allowed (PyTorch raises past N). Where PyTorch would divide by a
//              zero-length phase (pct_start * N == 1 at s = 0, pct_start == 1 at s = N) the
//              phase counts as finished: p = 1.
//
// The constructor validates the options and throws tally::Error naming the option, what was
// expected and what was found (an unknown kind lists constant|step|cosine|onecycle).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tally::optim {

// The schedule kinds, in the order the command line lists them: constant, step, cosine, onecycle.
const std::vector<std::string>& schedule_names();

struct ScheduleOptions {
  std::string kind = "constant";  // constant | step | cosine | onecycle
  double base_lr = 0.1;           // the peak (max_lr) for onecycle
  std::int64_t total_steps = 0;   // optimizer steps in the whole run (N)
  std::int64_t warmup_steps = 0;  // linear warm-up (W); not used by onecycle
  std::int64_t step_size = 0;     // step: decay every step_size steps; 0 = total_steps / 3
  double gamma = 0.1;             // step: decay factor
  double eta_min = 0;             // cosine: final learning rate
  double onecycle_pct_start = 0.3, onecycle_div_factor = 25, onecycle_final_div_factor = 1e4;
};

class LRSchedule {
 public:
  explicit LRSchedule(ScheduleOptions options);
  // The learning rate for optimizer step `step` (0-based); tally::Error if step < 0, or
  // step > total_steps for onecycle.
  double lr_at(std::int64_t step) const;
  const ScheduleOptions& options() const { return options_; }

 private:
  enum class Kind { constant, step, cosine, onecycle };
  ScheduleOptions options_;
  Kind kind_ = Kind::constant;
  std::int64_t step_size_ = 0;  // resolved (step)
};

}  // namespace tally::optim
