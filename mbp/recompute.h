// mbp/recompute.h — the recomputation ladder (nn/recompute.h) as the executor uses it
// (ExecutorOptions::recompute, mbp/executor.h): the policies by name, the level a policy names on
// a model, a level's choice set on the model, and what a choice costs (mbp/recompute.cpp).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "mbp/activations.h"
#include "mbp/planner.h"
#include "nn/module.h"

namespace tally::mbp {

// The recomputation a plan runs with (Executor::recompute_choice).
struct RecomputeChoice {
  int level = 0;            // on the model's ladder (0: none)
  std::string name;         // "none", "blocks", "blocks + layer1", ..., "all"; "as marked" for hand-set segments
  std::string description;  // "16 segments: the stem and every residual block but the last"
  std::string why;          // auto: why this level
  // Per segment (mbp/activations.h; name "per segment"): each segment's mode and cost; empty for a
  // level of the ladder. With the rates they were estimated at (unset: no host tier, no estimate).
  std::vector<ActivationCost> segments;
  std::optional<CostRates> rates;
  // "blocks (16 segments: ...), as ... — re-runs 12.3 GFLOP of forward per step: +34% of ...";
  // per segment: what is offloaded and recomputed, and the step's estimated time.
  std::string summary(const Plan& plan) const;
  // Per segment, with rates: a line per segment (mode, bytes and work per sample, estimated
  // seconds per step of either mode), then the step's estimate against keeping everything.
  std::vector<std::string> cost_lines(const Plan& plan) const;
};

// The recomputation policies by name (auto, none, blocks, all; and levels blocks+layerK[-layerL]),
// and a check of a value: throws an Error naming --recompute and the allowed values.
const std::vector<std::string>& recompute_policy_names();
void check_recompute_policy(const std::string& value);

// The level `policy` names on `model`'s ladder (none 0, blocks, all, or a level as printed
// without spaces such as "blocks+layer1"); -1 for auto. An Error naming the model's levels otherwise.
int recompute_policy_level(nn::Module& model, const std::string& policy);
// Sets level `level` on the model and returns its choice (name and description; no reason yet).
RecomputeChoice set_recompute_choice(nn::Module& model, int level);

}  // namespace tally::mbp
