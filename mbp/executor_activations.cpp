// mbp/executor_activations.cpp — the executor's choice per segment between keeping, recomputing
// and offloading (mbp/activations.h): the cost model's rates and measures, the search of
// recompute "auto" with a host tier, and segments set by name.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/arena.h"
#include "core/memory.h"
#include "core/offload.h"
#include "mbp/executor.h"
#include "nn/recompute.h"

namespace tally::mbp {

namespace {

// "offloaded: stem, layer1.0; recomputed: layer2.0; 13 kept"
std::string describe(const std::vector<std::string>& names, const std::vector<nn::SegmentMode>& modes) {
  std::vector<std::string> off, re;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (modes[i] == nn::SegmentMode::offload) off.push_back(names[i]);
    else if (modes[i] == nn::SegmentMode::recompute) re.push_back(names[i]);
    else ++kept;
  }
  std::vector<std::string> parts;
  if (!off.empty()) parts.push_back(fmt::format("offloaded: {}", fmt::join(off, ", ")));
  if (!re.empty()) parts.push_back(fmt::format("recomputed: {}", fmt::join(re, ", ")));
  parts.push_back(fmt::format("{} kept", kept));
  return fmt::format("{}", fmt::join(parts, "; "));
}

}  // namespace

bool Executor::offloading() const { return nn::recompute_state(model_).find('2') != std::string::npos; }

const CostRates& Executor::cost_rates() {
  if (rates_) return *rates_;
  CostRates r = complete_cost_rates(opt_.cost_rates, device_, activation_dtype_);
  if (!std::isfinite(r.copy_bytes_per_second) || !std::isfinite(r.flops_per_second))
    throw Error(fmt::format("MBP executor: the cost model's rates must be finite, found {}", r.str()));
  if (data_parallel_) {  // measured rates differ between ranks: every rank takes rank 0's
    double v[2] = {r.copy_bytes_per_second, r.flops_per_second};
    opt_.communicator->broadcast(v, sizeof v, 0);
    r.copy_bytes_per_second = v[0];
    r.flops_per_second = v[1];
    if (r.source != "given") r.source += ", rank 0's";
  }
  rates_ = r;
  return *rates_;
}

// One dry run of one sample (two where BatchNorm needs them) with every segment offloaded: what
// each moves and computes per sample. The model's segments as they were afterwards.
const std::vector<ActivationCost>& Executor::segment_costs() {
  if (segment_costs_) return *segment_costs_;
  const std::vector<std::string> names = nn::segment_names(model_);
  const nn::RecomputeStateScope restore(model_);
  nn::set_segment_modes(model_, std::vector<nn::SegmentMode>(names.size(), nn::SegmentMode::offload));
  ArenaScope scope(arena_);
  HostArenaScope host(opt_.host_arena);
  std::string why;
  for (const std::int64_t n : {1, 2}) {
    OffloadLog log;
    const Planner::Probe p = planner_.probe({n}, false, unbounded_capacity(*arena_));
    if (!p.fits) {
      why = p.error.empty() ? "it ran out of memory" : p.error;
      continue;
    }
    std::vector<ActivationCost> costs;
    for (const std::string& name : names) {
      const auto r = std::find_if(log.records().begin(), log.records().end(),
                                  [&](const OffloadRecord& rec) { return rec.name == name; });
      if (r == log.records().end())
        throw Error(fmt::format("MBP executor: segment '{}' did not run as a segment in a dry run of the step", name));
      costs.push_back({name, nn::SegmentMode::keep, static_cast<double>(r->bytes) / static_cast<double>(n),
                       r->forward_flops / static_cast<double>(n)});
    }
    segment_costs_ = std::move(costs);
    return *segment_costs_;
  }
  throw Error(fmt::format("MBP executor: the segments' costs could not be measured: a dry run of one and of two samples "
                          "failed ({})", why));
}

RecomputeChoice Executor::segment_choice(const std::vector<nn::SegmentMode>& modes, const std::string& name) {
  const std::vector<std::string> names = nn::segment_names(model_);
  RecomputeChoice c;
  c.name = name;
  c.level = std::any_of(modes.begin(), modes.end(), [](nn::SegmentMode m) { return m != nn::SegmentMode::keep; });
  c.description = describe(names, modes);
  if (opt_.host_arena) {
    c.segments = segment_costs();
    for (std::size_t i = 0; i < modes.size(); ++i) c.segments[i].mode = modes[i];
    c.rates = cost_rates();
  } else {
    for (std::size_t i = 0; i < modes.size(); ++i) c.segments.push_back({names[i], modes[i], 0, 0});
  }
  return c;
}

const Plan& Executor::plan_named_segments(std::int64_t batch) {
  const std::vector<nn::SegmentMode> modes = segment_policy_modes(model_, opt_.recompute);
  if (!opt_.host_arena && std::count(modes.begin(), modes.end(), nn::SegmentMode::offload) > 0)
    throw Error(fmt::format("--recompute {}: offloading a segment needs a host tier to move its activations to "
                            "(--host-memory-limit; ExecutorOptions::host_arena), found none", opt_.recompute));
  choice_ = segment_choice(modes, "per segment");
  nn::set_segment_modes(model_, modes);
  return plan_as_set(batch, std::nullopt);
}

// The search of mbp/activations.h: the fewest segments in the cost model's order that make the
// step fit, each in its cheaper mode; if all of them do not, the fewest recomputed ones switched to
// offloading (which also moves their inputs off the device), the least extra cost first. Each by
// bisection: the more the device is relieved of, the less the step needs.
const Plan* Executor::plan_segments(std::int64_t batch) {
  const std::vector<std::string> names = nn::segment_names(model_);
  if (names.empty()) return nullptr;
  const CostRates& rates = cost_rates();
  std::vector<ActivationCost> order = cost_order(segment_costs(), rates, true);
  const auto index = [&](const std::string& name) {
    return static_cast<std::size_t>(std::find(names.begin(), names.end(), name) - names.begin());
  };
  // The modes with the first n of `order` as they are there, the others kept.
  const auto modes_for = [&](std::size_t n) {
    std::vector<nn::SegmentMode> modes(names.size(), nn::SegmentMode::keep);
    for (std::size_t i = 0; i < n; ++i) modes[index(order[i].name)] = order[i].mode;
    return modes;
  };
  const auto fits = [&](const std::vector<nn::SegmentMode>& modes) {
    nn::set_segment_modes(model_, modes);
    try {
      plan_as_set(batch, std::nullopt);
      return true;
    } catch (const OutOfMemory&) {
      return false;
    }
  };
  // The smallest n in (lo, hi] with fits(make(n)), given fits(make(hi)).
  const auto fewest = [&](std::size_t lo, std::size_t hi, const auto& make) {
    while (hi - lo > 1) {
      const std::size_t mid = lo + (hi - lo) / 2;
      (fits(make(mid)) ? hi : lo) = mid;
    }
    return hi;
  };
  std::string how;
  std::vector<nn::SegmentMode> modes;
  if (fits(modes_for(names.size()))) {
    const std::size_t n = fewest(0, names.size(), modes_for);
    modes = modes_for(n);
    how = fmt::format("the first {} of {} segments by bytes freed per second of cost fit", n, names.size());
  } else {
    // Every segment in its cheaper mode is not enough: recomputed ones to offloading.
    std::vector<std::size_t> switchable;  // positions in `order`, the least extra cost first
    for (std::size_t i = 0; i < order.size(); ++i)
      if (order[i].mode == nn::SegmentMode::recompute) switchable.push_back(i);
    std::stable_sort(switchable.begin(), switchable.end(), [&](std::size_t a, std::size_t b) {
      const auto extra = [&](std::size_t i) {
        return order[i].offload_seconds(rates, 1) - order[i].recompute_seconds(rates, 1);
      };
      return extra(a) < extra(b);
    });
    const auto switched = [&](std::size_t n) {
      std::vector<nn::SegmentMode> m = modes_for(names.size());
      for (std::size_t i = 0; i < n; ++i) m[index(order[switchable[i]].name)] = nn::SegmentMode::offload;
      return m;
    };
    if (switchable.empty() || !fits(switched(switchable.size()))) {
      nn::set_recompute_level(model_, 0);
      return nullptr;
    }
    const std::size_t n = fewest(0, switchable.size(), switched);
    modes = switched(n);
    how = fmt::format("every segment in its cheaper mode does not fit; {} of the {} recomputed ones offloaded instead, "
                      "the least extra cost first, do",
                      n, switchable.size());
  }
  choice_ = segment_choice(modes, "per segment");
  choice_.why = fmt::format("without recomputation or offloading {}; {}",
                            opt_.micro_batch ? "the given micro-batch does not fit" : "not even one sample fits", how);
  nn::set_segment_modes(model_, modes);
  return &plan_as_set(batch, std::nullopt);
}

}  // namespace tally::mbp
