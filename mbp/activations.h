// mbp/activations.h — each segment's activations kept, recomputed or offloaded, chosen by a cost
// the plan prints (docs/activations.md).
//
// The segments are the recomputation ladder's level-1 segments (nn/recompute.h, segment_names):
// the stem where the model has one, then every block but the last. Each can be
//   keep       its saved activations stay on the device until its backward (a plain forward);
//   recompute  only its input is kept; backward re-runs its forward (core/autograd.h);
//   offload    its saved activations and its input move to the host tier's arena after its
//              forward and come back before its backward (core/offload.h; needs a host tier).
// Both recompute and offload take the segment's bytes off the device between its forward and its
// backward; they differ in what they cost. The cost model:
//   * per segment s, measured by one dry run of one sample with every segment offloaded (an
//     OffloadLog): B_s, the bytes offloading it moves each way, and F_s, its forward's work
//     (what recomputing re-runs), both per sample;
//   * two rates: W, the copy bandwidth between the tiers (bytes/s, each way), and R, the device's
//     compute rate (FLOP/s) — measured once per process (measure_cost_rates) or given
//     (ExecutorOptions::cost_rates; --copy-bandwidth, --compute-rate); with data parallelism every
//     rank uses rank 0's, so that all choose alike;
//   * for a step of N samples, offloading s costs 2 B_s N / W seconds, recomputing it F_s N / R.
//     Copies are counted in full, not as hidden behind compute (a GPU's prefetch hides part of
//     them): the estimate is an upper bound of what they add.
// The search (recompute "auto" with a host tier, where nothing fits one sample as the segments
// are): each segment takes its cheaper mode; segments are ordered by bytes freed per second of
// cost (greedy: the best ratio first, ties in forward order), and the fewest of that order that
// fit are found by bisection — at most ceil(log2(S)) + 1 plans of S segments (each the planner's
// usual search), where climbing the ladder took up to S. If all S still do not fit, the ladder's
// higher levels follow (stages recomputed around recomputed blocks), as without a host tier.
// Given the rates, the choice is deterministic.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "mbp/planner.h"
#include "nn/module.h"

namespace tally::mbp {

// The cost model's rates.
struct CostRates {
  double copy_bytes_per_second = 0;  // W: between the device's memory and the host tier, each way (0: measure)
  double flops_per_second = 0;       // R: the device's forward compute (0: measure)
  std::string source;                // "measured", "given"
  // "copies 9.81 GB/s, compute 85.3 GFLOP/s (measured)"
  std::string str() const;
};
// Measures both rates on `device` for activations of `dtype`: the best of several copies of 32 MiB
// each way between a device block and a host block (pinned where a GPU is present), and the best
// rate of a 3x3 convolution (64 channels, 56x56) — in arenas of their own, freed before it returns.
// Not in a dry run (an Error: nothing would run); cached per (device, dtype) for the process.
CostRates measure_cost_rates(Device device, DType dtype);
// `given` with each rate it leaves at 0 measured (measure_cost_rates; nothing measured when both
// are given), its source saying which is which.
CostRates complete_cost_rates(const std::optional<CostRates>& given, Device device, DType dtype);

// One segment in the cost model, and its mode.
struct ActivationCost {
  std::string name;                     // "stem", "layer1.0"
  nn::SegmentMode mode = nn::SegmentMode::keep;
  double bytes = 0;                     // B_s per sample, each way
  double flops = 0;                     // F_s per sample
  double offload_seconds(const CostRates& r, double samples) const;
  double recompute_seconds(const CostRates& r, double samples) const;
  double seconds(const CostRates& r, double samples) const;  // of its mode (0: keep)
};

// The step's estimated time for `plan` with `segments` as chosen: its counted work at R, and the
// offloaded segments' copies at W.
struct StepEstimate {
  double compute = 0;    // forward and backward work (Plan::flops)
  double recompute = 0;  // re-run forward work
  double copies = 0;     // offloaded bytes, out and back
  double total() const { return compute + recompute + copies; }
};
StepEstimate estimate_step(const Plan& plan, const std::vector<ActivationCost>& segments, const CostRates& r);

// The order the search takes segments in: each with its cheaper mode (offload only when
// `can_offload`), by bytes freed per second of cost, best first, ties in forward order.
std::vector<ActivationCost> cost_order(std::vector<ActivationCost> segments, const CostRates& r, bool can_offload);

// --recompute values that name modes per segment: "offload" (every segment), or a list such as
// "stem=offload,layer1.0=recompute" (the others kept); whether `policy` is one, and the modes it
// names on `model` (an Error naming the model's segments or the modes for a wrong name).
bool is_segment_policy(const std::string& policy);
std::vector<nn::SegmentMode> segment_policy_modes(nn::Module& model, const std::string& policy);

}  // namespace tally::mbp
