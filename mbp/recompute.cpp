// mbp/recompute.cpp — the recomputation ladder as the executor uses it (mbp/recompute.h): the
// policies by name, the level a policy names, a level's choice set on the model, and what a
// choice costs. The ladder "auto" climbs is choosing, in mbp/chooser.cpp.
#include <algorithm>
#include <regex>

#include <fmt/format.h>

#include "core/arena.h"
#include "core/memory.h"
#include "core/option_names.h"
#include "mbp/recompute.h"
#include "nn/recompute.h"

namespace tally::mbp {

const std::vector<std::string>& recompute_policy_names() {
  static const std::vector<std::string> names{"auto", "none", "blocks", "all"};
  return names;
}

namespace {
// What is wrong with a list of segments and modes ("stem=offload,layer1.0=recompute"): the first bad
// entry and why; "" if none is.
std::string segment_list_error(const std::string& value) {
  static const std::regex name(R"([A-Za-z0-9_.]+)");
  std::size_t start = 0;
  for (int k = 1;; ++k) {
    const std::size_t comma = std::min(value.find(',', start), value.size());
    const std::string item = value.substr(start, comma - start);
    const std::size_t eq = item.find('=');
    const std::string seg = item.substr(0, eq), mode = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (item.empty())
      return fmt::format("entry {} is empty (two commas in a row, or one at the start or the end)", k);
    if (eq == std::string::npos)
      return fmt::format("entry {} '{}' has no mode: expected SEGMENT=keep|recompute|offload", k, item);
    if (!std::regex_match(seg, name))
      return fmt::format("entry {} '{}': expected a segment's name (letters, digits, '_' and '.', no spaces) before "
                         "'=', found '{}'", k, item, seg);
    if (mode != "keep" && mode != "recompute" && mode != "offload")
      return fmt::format("entry {} '{}': expected the mode keep, recompute or offload after '=', found '{}'", k, item, mode);
    if (comma == value.size()) return "";
    start = comma + 1;
  }
}
}  // namespace

void check_recompute_policy(const std::string& value) {
  static const std::regex level(R"(blocks\+layer[0-9]+(-layer[0-9]+)?)");
  const auto& names = recompute_policy_names();
  if (std::find(names.begin(), names.end(), value) != names.end() || std::regex_match(value, level) ||
      is_segment_policy(value))
    return;
  if (value.find_first_of("=,") != std::string::npos) {  // meant as a list of segments and modes
    const std::string why = segment_list_error(value);
    if (!why.empty())
      throw Error(fmt::format("{} '{}': {} (segments and modes such as stem=offload,layer1.0=recompute; tally "
                              "plan prints the segments)", option_name(Option::recompute), value, why));
  }
  throw Error(fmt::format("{} '{}': expected {}|offload, a level such as blocks+layer1, or segments and modes "
                          "such as stem=offload,layer1.0=recompute (tally plan prints them)",
                          option_name(Option::recompute), value, fmt::join(names, "|")));
}

// The level a policy names on `model`'s ladder: none, blocks, all, or an intermediate level as
// printed without spaces ("blocks+layer1", "blocks+layer1-layer2"); -1 for auto.
int recompute_policy_level(nn::Module& model, const std::string& policy) {
  const int levels = nn::recompute_levels(model);
  if (policy == "auto") return -1;
  if (policy == "none") return 0;
  if (policy == "all") return levels - 1;
  if (policy == "blocks") return std::min(1, levels - 1);
  std::string names;
  for (int level = 0; level < levels; ++level) {
    std::string name = nn::recompute_level_name(model, level);
    name.erase(std::remove(name.begin(), name.end(), ' '), name.end());
    if (name == policy) return level;
    names += (names.empty() ? "" : "|") + name;
  }
  throw Error(fmt::format("{} '{}': expected auto or one of this model's levels {}", option_name(Option::recompute),
                          policy, names));
}

RecomputeChoice set_recompute_choice(nn::Module& model, int level) {
  nn::set_recompute_level(model, level);
  return {level, nn::recompute_level_name(model, level), nn::recompute_level_description(model, level), "", {}, {}};
}

namespace {

// "re-runs 3.6 GFLOP of forward per step: +33% of the step's 10.9 GFLOP without it".
std::string recompute_cost(const Plan& plan) {
  const FlopCount& f = plan.flops;
  const double step = f.total();
  if (step <= 0) return "no work counted";
  const auto flops = [](double v) {
    return v >= 1e15 ? fmt::format("{:.1f} PFLOP", v / 1e15)
           : v >= 1e12 ? fmt::format("{:.1f} TFLOP", v / 1e12)
                       : fmt::format("{:.1f} GFLOP", v / 1e9);
  };
  return fmt::format("re-runs {} of forward per step: +{:.0f}% of the step's {} without it", flops(f.recompute),
                     100.0 * f.recompute / (step - f.recompute), flops(step - f.recompute));
}

}  // namespace

std::string RecomputeChoice::summary(const Plan& plan) const {
  const std::string because = why.empty() ? "" : fmt::format(" (auto: {})", why);
  if (!segments.empty()) {
    std::string estimate;
    if (rates) {
      const StepEstimate e = estimate_step(plan, segments, *rates);
      estimate = fmt::format(" — estimated step {:.3g} s against {:.3g} s keeping everything", e.total(), e.compute);
    }
    return fmt::format("{} ({}){}{}", name, description, because, estimate);
  }
  // With the cost model's rates (a host tier): the step's estimate, as for a choice per segment.
  const std::string estimate =
      rates ? fmt::format(" — estimated step {:.3g} s at {}", estimate_step(plan, {}, *rates).total(), rates->str()) : "";
  if (level == 0) return name + because + estimate;
  return fmt::format("{} ({}){} — {}{}", name, description, because, recompute_cost(plan), estimate);
}

std::vector<std::string> RecomputeChoice::cost_lines(const Plan& plan) const {
  std::vector<std::string> lines;
  if (segments.empty() || !rates) return lines;
  const double n = static_cast<double>(plan.batch_size);
  lines.push_back(fmt::format("cost model: {}; a step of {} samples; copies counted in full", rates->str(),
                              plan.batch_size));
  lines.push_back(fmt::format("{:<12} {:<10} {:>14} {:>16} {:>12} {:>12}", "segment", "mode", "bytes/sample",
                              "forward/sample", "offload s", "recompute s"));
  for (const ActivationCost& s : segments)
    lines.push_back(fmt::format("{:<12} {:<10} {:>14} {:>10.3f} GFLOP {:>12.4f} {:>12.4f}", s.name,
                                nn::segment_mode_name(s.mode), format_bytes(static_cast<std::size_t>(s.bytes)),
                                s.flops / 1e9, s.offload_seconds(*rates, n), s.recompute_seconds(*rates, n)));
  const StepEstimate e = estimate_step(plan, segments, *rates);
  lines.push_back(fmt::format("estimated step {:.3f} s: compute {:.3f} s, recomputation {:.3f} s, copies {:.3f} s; "
                              "keeping everything {:.3f} s (+{:.1f}%)",
                              e.total(), e.compute, e.recompute, e.copies, e.compute,
                              e.compute > 0 ? 100.0 * (e.total() - e.compute) / e.compute : 0.0));
  return lines;
}

}  // namespace tally::mbp
