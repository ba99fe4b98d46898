// mbp/activations.cpp — the cost model of keeping, recomputing or offloading each segment; see
// mbp/activations.h. The search that uses it is the chooser's (mbp/chooser.cpp).
#include "mbp/activations.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <regex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/device_rates.h"
#include "core/dry_run.h"
#include "core/error.h"
#include "core/offload.h"
#include "core/option_names.h"
#include "nn/recompute.h"

namespace tally::mbp {

std::string CostRates::str() const {
  return fmt::format("copies {:.2f} GB/s, compute {:.1f} GFLOP/s ({})", copy_bytes_per_second / 1e9,
                     flops_per_second / 1e9, source);
}

CostRates measure_cost_rates(Device device, DType dtype) {
  if (skip_side_effects())
    throw Error("measure_cost_rates: not in a dry run, where nothing runs — measure before it, or give the rates "
                "(" + option_name(Option::cost_rates) + ")");
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, CostRates> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device.str(), static_cast<int>(dtype));
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  const DeviceRates m = measure_device_rates(device, dtype);
  return cache[key] = CostRates{m.copy_bytes_per_second, m.flops_per_second, "measured"};
}

CostRates complete_cost_rates(const std::optional<CostRates>& given, Device device, DType dtype) {
  CostRates r = given.value_or(CostRates{});
  const bool copies = r.copy_bytes_per_second > 0, compute = r.flops_per_second > 0;
  if (copies && compute) {
    if (r.source.empty()) r.source = "given";
    return r;
  }
  const CostRates m = measure_cost_rates(device, dtype);
  if (!copies) r.copy_bytes_per_second = m.copy_bytes_per_second;
  if (!compute) r.flops_per_second = m.flops_per_second;
  r.source = copies ? "copies given, compute measured" : compute ? "copies measured, compute given" : "measured";
  return r;
}

double ActivationCost::offload_seconds(const CostRates& r, double samples) const {
  return 2.0 * bytes * samples / r.copy_bytes_per_second;
}
double ActivationCost::recompute_seconds(const CostRates& r, double samples) const {
  return flops * samples / r.flops_per_second;
}
double ActivationCost::seconds(const CostRates& r, double samples) const {
  return mode == nn::SegmentMode::offload     ? offload_seconds(r, samples)
         : mode == nn::SegmentMode::recompute ? recompute_seconds(r, samples)
                                              : 0.0;
}

StepEstimate estimate_step(const Plan& plan, const std::vector<ActivationCost>& segments, const CostRates& r) {
  StepEstimate e;
  e.compute = (plan.flops.forward + plan.flops.backward) / r.flops_per_second;
  e.recompute = plan.flops.recompute / r.flops_per_second;
  for (const ActivationCost& s : segments)
    if (s.mode == nn::SegmentMode::offload) e.copies += s.offload_seconds(r, static_cast<double>(plan.batch_size));
  return e;
}

std::vector<ActivationCost> cost_order(std::vector<ActivationCost> segments, const CostRates& r, bool can_offload) {
  for (ActivationCost& s : segments)
    s.mode = can_offload && s.offload_seconds(r, 1) < s.recompute_seconds(r, 1) ? nn::SegmentMode::offload
                                                                                  : nn::SegmentMode::recompute;
  // Bytes freed per second of cost; a segment that costs nothing (no work, no bytes) first.
  const auto ratio = [&](const ActivationCost& s) {
    const double t = s.seconds(r, 1);
    return t > 0 ? s.bytes / t : 1e300;
  };
  std::stable_sort(segments.begin(), segments.end(),
                   [&](const ActivationCost& a, const ActivationCost& b) { return ratio(a) > ratio(b); });
  return segments;
}

bool is_segment_policy(const std::string& policy) {
  static const std::regex list(R"([A-Za-z0-9_.]+=(keep|recompute|offload)(,[A-Za-z0-9_.]+=(keep|recompute|offload))*)");
  return policy == "offload" || std::regex_match(policy, list);
}

std::vector<nn::SegmentMode> segment_policy_modes(nn::Module& model, const std::string& policy) {
  const std::vector<std::string> names = nn::segment_names(model);
  if (names.empty())
    throw Error(fmt::format("{} {}: this model has no segments to keep, recompute or offload",
                            option_name(Option::recompute), policy));
  if (policy == "offload") return std::vector<nn::SegmentMode>(names.size(), nn::SegmentMode::offload);
  std::vector<nn::SegmentMode> modes(names.size(), nn::SegmentMode::keep);
  std::vector<bool> named(names.size(), false);
  std::size_t start = 0;
  while (start <= policy.size()) {
    const std::size_t comma = std::min(policy.find(',', start), policy.size());
    const std::string item = policy.substr(start, comma - start);
    const std::size_t eq = item.find('=');
    const std::string name = item.substr(0, eq), mode = item.substr(eq + 1);
    const auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end())
      throw Error(fmt::format("{} {}: '{}' is not a segment of this model; expected one of {}",
                              option_name(Option::recompute), policy, name, fmt::join(names, ", ")));
    const std::size_t i = static_cast<std::size_t>(it - names.begin());
    if (named[i])
      throw Error(fmt::format("{} {}: segment '{}' is named twice", option_name(Option::recompute), policy, name));
    named[i] = true;
    modes[i] = mode == "offload" ? nn::SegmentMode::offload
               : mode == "recompute" ? nn::SegmentMode::recompute
                                     : nn::SegmentMode::keep;
    start = comma + 1;
  }
  return modes;
}

}  // namespace tally::mbp
