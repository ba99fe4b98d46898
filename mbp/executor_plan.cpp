// mbp/executor_plan.cpp — the executor's plans (mbp/executor.h): the recomputation policy applied
// (ExecutorOptions::recompute; "auto" climbs the model's ladder to the first level on which the
// plan fits) and the planner (mbp/planner.h) asked. A pipeline stage's agreement on the
// micro-batch is its own (mbp/pipeline_executor.cpp).
//
// Why "auto" takes the first level on which the plan fits: once one sample fits, MBP already
// runs any batch exactly, and every level of recomputation costs step time; whoever wants larger
// micro-batches for speed asks for a level.
#include <algorithm>

#include <fmt/format.h>

#include "core/arena.h"
#include "core/memory.h"
#include "mbp/executor.h"
#include "mbp/recompute.h"
#include "nn/recompute.h"

namespace tally::mbp {

const Plan& Executor::plan(std::int64_t batch) { return plan_by_policy(batch); }

int Executor::top_level() { return nn::recompute_levels(model_) - 1; }

const Plan& Executor::plan_by_policy(std::int64_t batch) {
  const std::string& policy = opt_.recompute;
  if (policy == "none") {
    const std::string state = nn::recompute_state(model_);
    choice_ = {0, "none", "nothing recomputed", ""};
    if (state.find('1') != std::string::npos) choice_ = {0, "as marked", "the segments marked on the model", ""};
    try {
      return plan_as_set(batch, std::nullopt);
    } catch (const OutOfMemory& without) {
      throw_none_too_small(without, batch);
    }
  }
  if (policy == "auto") return plan_auto(batch);
  choice_ = set_recompute_choice(model_, recompute_policy_level(model_, policy));
  return plan_as_set(batch, std::nullopt);
}

const Plan& Executor::plan_as_set(std::int64_t batch, std::optional<std::int64_t> micro_batch) {
  if (!micro_batch && opt_.micro_batch) micro_batch = std::min({*opt_.micro_batch, limit_, batch});
  ArenaScope scope(arena_);
  return planner_.plan(batch, micro_batch, limit_, nn::recompute_state(model_));
}

// The ladder from none: the first level on which the plan fits, remembered per batch size.
const Plan& Executor::plan_auto(std::int64_t batch) {
  if (const auto it = auto_choices_.find(batch); it != auto_choices_.end()) {
    choice_ = it->second;
    nn::set_recompute_level(model_, choice_.level);
    return plan_as_set(batch, std::nullopt);
  }
  const int all = top_level();
  choice_ = set_recompute_choice(model_, 0);
  try {
    const Plan& p = plan_as_set(batch, std::nullopt);
    choice_.why = "a micro-batch fits without recomputation";
    auto_choices_[batch] = choice_;
    return p;
  } catch (const OutOfMemory& without) {
    for (int level = 1; level <= all; ++level) {
      choice_ = set_recompute_choice(model_, level);
      try {
        const Plan& p = plan_as_set(batch, std::nullopt);
        choice_.why = fmt::format("without recomputation {}{}",
                                  opt_.micro_batch ? "the given micro-batch does not fit" : "not even one sample fits",
                                  level > 1 ? fmt::format(", nor with {}", nn::recompute_level_name(model_, level - 1)) : "");
        auto_choices_[batch] = choice_;
        return p;
      } catch (const OutOfMemory& e) {
        if (level < all) continue;
        nn::set_recompute_level(model_, 0);
        throw OutOfMemory(fmt::format("{} (with --recompute {}, the most recomputation there is: {}; without "
                                      "recomputation at least {})",
                                      e.what(), nn::recompute_level_name(model_, all), choice_.description, format_bytes(without.requested())),
                          e.requested());
      }
    }
    throw;  // nothing to recompute in this model
  }
}

// A budget too small without recomputation: the error also says what recomputing the most would
// need (measured with the model's segments as they were put back afterwards).
void Executor::throw_none_too_small(const OutOfMemory& without, std::int64_t batch) {
  const int all = top_level();
  std::string with;
  if (all > 0) {
    const std::string description = nn::recompute_level_description(model_, all);
    try {
      const Plan p = plan_at_level(batch, std::nullopt, all);
      with = fmt::format("; --recompute {} ({}) fits micro-batches of {} (predicted peak {})",
                         nn::recompute_level_name(model_, all), description,
                         p.micro_batch, format_bytes(p.predicted_peak));
    } catch (const OutOfMemory& e) {
      with = fmt::format("; with --recompute {} ({}) it needs at least {}", nn::recompute_level_name(model_, all),
                         description, format_bytes(e.requested()));
    }
  }
  throw OutOfMemory(fmt::format("{}{}", without.what(), with), without.requested());
}

Plan Executor::plan_at_level(std::int64_t batch, std::optional<std::int64_t> micro_batch, int level) {
  const std::string state = nn::recompute_state(model_);
  struct Restore {
    nn::Module& model;
    const std::string& state;
    ~Restore() { nn::set_recompute_state(model, state); }
  } restore{model_, state};
  nn::set_recompute_level(model_, level);
  return plan_as_set(batch, micro_batch);
}

}  // namespace tally::mbp
