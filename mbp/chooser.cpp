// mbp/chooser.cpp — the step's configuration chosen by dry runs alone; see mbp/chooser.h.
#include "mbp/chooser.h"

#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/arena.h"
#include "core/conv_tuning.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/offload.h"
#include "core/option_names.h"
#include "mbp/executor.h"
#include "nn/recompute.h"
#include "optim/optimizer.h"

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

Chooser::Chooser(nn::Module& model, const optim::Optimizer& optimizer, std::shared_ptr<Arena> arena,
                 const ExecutorOptions& options, bool data_parallel, DType activation_dtype, DryStep step)
    : model_(model),
      optimizer_(optimizer),
      arena_(std::move(arena)),
      opt_(options),
      data_parallel_(data_parallel),
      activation_dtype_(activation_dtype),
      planner_(arena_, [this, step = std::move(step)](const std::vector<std::int64_t>& sizes) {
        step(measuring_.value_or(now_.placed), sizes);
      }),
      top_level_(nn::recompute_levels(model) - 1) {}

bool Chooser::offloading() const { return nn::recompute_state(model_).offloads(); }

std::shared_ptr<Arena> Chooser::host_arena_for(Placement p) const {
  return p == Placement::device && !offloading() ? nullptr : opt_.host_arena;
}

StepConfig Chooser::config(const Plan& plan) {
  // With a host tier, every choice carries the cost model's rates: the plan states its estimate.
  if (opt_.host_arena && !choice_.rates) choice_.rates = cost_rates();
  return {plan, choice_, placement_, nn::recompute_state(model_)};
}

// The convolutions' tuning table (core/conv_tuning.h) or a GPU switch (TF32, determinism, the
// convolution API) changed: every choice made under the old kernels is made again (the plans
// themselves are keyed by them, measure()) — other engines take other workspaces.
void Chooser::kernels_changed() {
  const std::pair<std::uint64_t, std::uint64_t> now = kernel_choices();
  if (kernels_ == now) return;
  kernels_ = now;
  auto_choices_.clear();
  placement_choices_.clear();
}

StepConfig Chooser::choose(std::int64_t batch, std::int64_t limit, const StateLayout& now) {
  kernels_changed();
  const nn::RecomputeStateScope restore(model_);
  limit_ = limit, now_ = now;
  return config(by_policy(batch));
}

StepConfig Chooser::choose_with(std::int64_t batch, std::int64_t micro_batch, std::int64_t limit,
                                const StateLayout& now) {
  kernels_changed();
  const nn::RecomputeStateScope restore(model_);
  limit_ = limit, now_ = now;
  (void)by_policy(batch);  // the recomputation of this batch, set on the model
  return config(as_set(batch, micro_batch));
}

Plan Chooser::at_level(std::int64_t batch, std::optional<std::int64_t> micro_batch, int level, std::int64_t limit,
                       const StateLayout& now) {
  kernels_changed();
  const nn::RecomputeStateScope restore(model_);
  limit_ = limit, now_ = now;
  const RecomputeChoice choice = choice_;  // what the last choose() said stays said
  const PlacementChoice placement = placement_;
  nn::set_recompute_level(model_, level);
  Plan p = as_set(batch, micro_batch);
  choice_ = choice, placement_ = placement;
  return p;
}

const Plan& Chooser::by_policy(std::int64_t batch) {
  const std::string& policy = opt_.recompute;
  if (policy == "none") {
    const nn::RecomputeState state = nn::recompute_state(model_);
    choice_ = RecomputeChoice{0, "none", "nothing recomputed", "", {}, {}};
    if (state.recomputes()) choice_ = RecomputeChoice{0, "as marked", "the segments marked on the model", "", {}, {}};
    try {
      return as_set(batch, std::nullopt);
    } catch (const OutOfMemory& without) {
      throw_none_too_small(without, batch);
    }
  }
  if (policy == "auto") return ladder(batch);
  if (is_segment_policy(policy)) return named_segments(batch);
  choice_ = set_recompute_choice(model_, recompute_policy_level(model_, policy));
  return as_set(batch, std::nullopt);
}

const Plan& Chooser::as_set(std::int64_t batch, std::optional<std::int64_t> micro_batch) {
  if (!micro_batch && opt_.micro_batch) micro_batch = std::min({*opt_.micro_batch, limit_, batch});
  if (!opt_.host_arena) {
    placement_ = {Placement::device, "no host tier"};
    return measure(batch, micro_batch, Placement::device);
  }
  if (opt_.placement) {
    check_host_holds(*opt_.placement, now_);
    placement_ = {*opt_.placement, "as given"};
    return measure(batch, micro_batch, *opt_.placement);
  }
  // The executor's choice: the largest micro-batch, ties to the fewest bytes moved — device, then
  // the optimizer on the host, then the gradients too (not with data parallelism). Each measured
  // by dry runs that simulate it: nothing moves until plan() applies the choice.
  const auto key = std::make_pair(batch, nn::recompute_state(model_).str());
  if (const auto it = placement_choices_.find(key); it != placement_choices_.end()) {
    placement_ = it->second;
    return measure(batch, micro_batch, placement_.placement);
  }
  std::vector<Placement> candidates{Placement::device, Placement::optimizer};
  if (!data_parallel_) candidates.push_back(Placement::gradients);
  struct Tried {
    Placement placement;
    std::optional<std::int64_t> micro_batch;  // unset: does not fit
    std::string error;
    std::size_t requested = 0;  // what it would need, when it does not fit
  };
  std::vector<Tried> tried;
  std::optional<std::size_t> best;
  for (const Placement c : candidates) {
    Tried t{c, std::nullopt, "", 0};
    try {
      check_host_holds(c, now_);
      t.micro_batch = measure(batch, micro_batch, c).micro_batch;
    } catch (const OutOfMemory& e) {
      t.error = e.what();
      t.requested = e.requested();
    }
    tried.push_back(t);
    if (t.micro_batch && (!best || *t.micro_batch > *tried[*best].micro_batch)) best = tried.size() - 1;
    // Nothing later can do better: the whole batch (or the given micro-batch) fits.
    if (t.micro_batch && (*t.micro_batch == batch || micro_batch)) break;
  }
  if (!best) {
    std::string all;
    for (std::size_t i = 1; i < tried.size(); ++i)
      all += fmt::format(" (with placement {}: {})", placement_name(tried[i].placement), tried[i].error);
    throw OutOfMemory(tried[0].error + all, tried[0].requested);  // the device's need, as without a host tier
  }
  const Tried& chosen = tried[*best];
  std::string why;
  if (*best == 0) {
    why = micro_batch ? fmt::format("the micro-batch of {} fits on the device", *chosen.micro_batch)
          : *chosen.micro_batch == batch
              ? "the whole batch fits on the device at once"
              : fmt::format("no placement on the host gives a larger micro-batch ({} either way)", *chosen.micro_batch);
  } else {
    std::vector<std::string> others;
    for (std::size_t i = 0; i < *best; ++i)
      others.push_back(tried[i].micro_batch ? fmt::format("{} with placement {}", *tried[i].micro_batch,
                                                          placement_name(tried[i].placement))
                                            : fmt::format("not one sample with placement {}",
                                                          placement_name(tried[i].placement)));
    why = fmt::format("micro-batches of {} instead of {}", *chosen.micro_batch, fmt::join(others, ", "));
  }
  placement_ = placement_choices_[key] = {chosen.placement, std::move(why)};
  return measure(batch, micro_batch, chosen.placement);
}

const Plan& Chooser::measure(std::int64_t batch, std::optional<std::int64_t> micro_batch, Placement p) {
  ArenaScope scope(arena_);
  HostArenaScope host(host_arena_for(p), opt_.offload_prefetch_on_cpu);
  // The state as it lies now, moved where `p` puts it: plans are keyed by the moves that made the
  // layout they start from (moving to where the state is already changes nothing).
  const bool there = p == now_.placed && optimizer_.state_created();
  const std::string layout = there ? now_.name : fmt::format("{}>{}", now_.name, placement_name(p));
  struct Measuring {  // the placement the planner's dry runs simulate, for this call
    Chooser& c;
    Measuring(Chooser& chooser, Placement p) : c(chooser) {
      c.measuring_ = p;
      c.planner_.set_prepare([&ch = c, p](Arena& device, Arena* host) { ch.simulate_placement(p, ch.now_, device, host); });
    }
    ~Measuring() {
      c.measuring_.reset();
      c.planner_.set_prepare({});
    }
  } measuring(*this, p);
  return planner_.plan(batch, micro_batch, limit_,
                       fmt::format("{}|{}|kernels {}.{}", nn::recompute_state(model_).str(), layout, kernels_.first,
                                   kernels_.second));
}

void Chooser::check_host_holds(Placement p, const StateLayout& now) const {
  if (p == Placement::device) return;
  if (!opt_.host_arena)
    throw Error(fmt::format("MBP chooser: placement {} needs a host tier ({}), found none",
                            placement_name(p), option_name(Option::host_tier)));
  if (p == Placement::gradients && data_parallel_)
    throw Error("MBP chooser: placement gradients is not available with data parallelism");
  // What the host tier must hold: the state (and the gradient accumulators), then one parameter's
  // staging during the update — its high-water mark, exact for a host arena that holds nothing else.
  const Arena& host = *opt_.host_arena;
  const bool with_grads = p == Placement::gradients, created = optimizer_.state_created();
  const optim::Optimizer::HostBytes want = optimizer_.host_bytes(with_grads);
  const std::size_t state = want.state, grads = optimizer_.host_bytes(true).gradients, staging = want.staging;
  const std::size_t ours_now = (now.placed != Placement::device && created ? state : 0) +
                               (now.placed == Placement::gradients ? grads : 0);
  const std::size_t need = static_cast<std::size_t>(host.stats().total.current) - ours_now + want.total();
  if (need <= host.capacity()) return;
  const std::size_t device_now = static_cast<std::size_t>(arena_->stats().total.current);
  const std::size_t on_device = device_now - (now.placed == Placement::device && created ? state : 0) -
                                (with_grads && now.placed != Placement::gradients ? grads : 0);
  throw OutOfMemory(
      fmt::format("host memory limit {} ({} bytes) is too small for placement {}: the host tier needs {} ({} bytes: "
                  "optimizer state {}{}, staging of the largest parameter {}); the device tier then holds {} of "
                  "persistent state before any micro-batch",
                  format_bytes(host.capacity()), host.capacity(), placement_name(p), format_bytes(need), need,
                  format_bytes(state), with_grads ? fmt::format(", gradient accumulators {}", format_bytes(grads)) : "",
                  format_bytes(staging), format_bytes(on_device)),
      need);
}

// apply_placement's moves on the dry run's virtual clones of the two tiers: each block allocated
// where it goes, then freed where it was, in the same order, so that the clones' layout is the one
// the real moves will make (offsets only; nothing is read or written). Without a clone of the host
// tier (a placement that does not use it: its side does not matter to the step), its side is skipped.
void Chooser::simulate_placement(Placement to, const StateLayout& now, Arena& device, Arena* host) const {
  if (to == now.placed && optimizer_.state_created()) return;
  std::map<const Storage*, std::pair<Arena*, std::size_t>> at;  // where a moved storage is in the clones
  const auto clone_of = [&](const Storage& s) -> std::pair<Arena*, std::size_t> {
    if (const auto it = at.find(&s); it != at.end()) return it->second;
    return {s.arena() == arena_ ? &device : host, s.offset()};
  };
  const auto move = [&](const Storage& s, Arena* dst, const std::string& op) {
    const auto [src, offset] = clone_of(s);
    std::size_t moved = 0;
    if (dst) moved = dst->allocate(s.nbytes(), s.category(), op).offset;
    if (src) src->free(offset);
    at[&s] = {dst, moved};
  };
  const std::vector<std::pair<std::string, Tensor>>& state = optimizer_.named_state();
  const bool created = optimizer_.state_created();
  if (!created) {
    Arena* where = to == Placement::device ? &device : host;
    if (where) {
      const std::vector<std::size_t> bytes = optimizer_.state_tensor_bytes();
      for (std::size_t i = 0; i < bytes.size(); ++i) where->allocate(bytes[i], Category::optimizer_state, "optimizer_state");
    }
  }
  const std::vector<Tensor>& params = optimizer_.params();
  if (now.placed == Placement::gradients && to != Placement::gradients)
    for (const Tensor& g : optimizer_.host_gradients()) move(*g.storage(), &device, "grad");
  const bool state_on_host = created && optimizer_.state_host() != nullptr;
  if (to == Placement::device) {
    if (state_on_host)
      for (const auto& [name, t] : state) move(*t.storage(), &device, optimizer_.name() + "." + name);
    return;
  }
  if (created && !state_on_host)
    for (const auto& [name, t] : state) move(*t.storage(), host, optimizer_.name() + "." + name);
  if (to != Placement::gradients || now.placed == Placement::gradients) return;
  for (std::size_t i = 0; i < params.size(); ++i)
    move(*params[i].grad().storage(), host, fmt::format("{}.host_gradient_accumulator.{}", optimizer_.name(), i));
  // pack_model_state, simulated.
  if (!host) return;
  std::vector<const Storage*> storages;
  std::size_t bytes = 0;
  const auto add = [&](const Tensor& t) {
    const Storage* s = t.impl().storage.get();
    if (clone_of(*s).first != &device || std::find(storages.begin(), storages.end(), s) != storages.end()) return;
    storages.push_back(s);
    bytes += Arena::round_up(s->nbytes());
  };
  for (const Tensor& p : model_.parameters()) add(p);
  for (const auto& [name, b] : model_.named_buffers()) add(b);
  if (host->largest_free_block() < bytes) return;
  for (const Storage* s : storages) move(*s, host, s->op());
  for (const Storage* s : storages) move(*s, &device, s->op());
}

// The ladder from none: the first level on which the plan fits, remembered per batch size.
const Plan& Chooser::ladder(std::int64_t batch) {
  if (const auto it = auto_choices_.find(batch); it != auto_choices_.end()) {
    choice_ = it->second;
    if (!choice_.segments.empty()) {
      std::vector<nn::SegmentMode> modes;
      for (const ActivationCost& s : choice_.segments) modes.push_back(s.mode);
      nn::set_segment_modes(model_, modes);
    } else {
      nn::set_recompute_level(model_, choice_.level);
    }
    return as_set(batch, std::nullopt);
  }
  const int all = top_level_;
  choice_ = set_recompute_choice(model_, 0);
  try {
    const Plan& p = as_set(batch, std::nullopt);
    choice_.why = "a micro-batch fits without recomputation";
    auto_choices_[batch] = choice_;
    return p;
  } catch (const OutOfMemory& without) {
    // With a host tier: each segment kept, recomputed or offloaded by the cost model first.
    if (opt_.host_arena && !opt_.pipeline) {
      if (const Plan* p = per_segment(batch)) {
        auto_choices_[batch] = choice_;
        return *p;
      }
    }
    for (int level = 1; level <= all; ++level) {
      choice_ = set_recompute_choice(model_, level);
      try {
        const Plan& p = as_set(batch, std::nullopt);
        choice_.why = fmt::format("without recomputation {}{}",
                                  opt_.micro_batch ? "the given micro-batch does not fit" : "not even one sample fits",
                                  level > 1 ? fmt::format(", nor with {}", nn::recompute_level_name(model_, level - 1)) : "");
        auto_choices_[batch] = choice_;
        return p;
      } catch (const OutOfMemory& e) {
        if (level < all) continue;
        nn::set_recompute_level(model_, 0);
        throw OutOfMemory(fmt::format("{} (with {} {}, the most recomputation there is: {}; without "
                                      "recomputation at least {})",
                                      e.what(), option_name(Option::recompute), nn::recompute_level_name(model_, all),
                                      choice_.description, format_bytes(without.requested())),
                          e.requested());
      }
    }
    throw;  // nothing to recompute in this model
  }
}

// A budget too small without recomputation: the error also says what recomputing the most would
// need (measured with the model's segments as they were put back afterwards).
void Chooser::throw_none_too_small(const OutOfMemory& without, std::int64_t batch) {
  const int all = top_level_;
  std::string with;
  if (all > 0) {
    const std::string description = nn::recompute_level_description(model_, all);
    try {
      const nn::RecomputeStateScope restore(model_);
      nn::set_recompute_level(model_, all);
      const Plan p = as_set(batch, std::nullopt);
      with = fmt::format("; {} {} ({}) fits micro-batches of {} (predicted peak {})", option_name(Option::recompute),
                         nn::recompute_level_name(model_, all), description,
                         p.micro_batch, format_bytes(p.predicted_peak));
    } catch (const OutOfMemory& e) {
      with = fmt::format("; with {} {} ({}) it needs at least {}", option_name(Option::recompute),
                         nn::recompute_level_name(model_, all), description, format_bytes(e.requested()));
    }
  }
  throw OutOfMemory(fmt::format("{}{}", without.what(), with), without.requested());
}

const CostRates& Chooser::cost_rates() {
  if (rates_) return *rates_;
  CostRates r = complete_cost_rates(opt_.cost_rates, arena_->device(), activation_dtype_);
  if (!std::isfinite(r.copy_bytes_per_second) || !std::isfinite(r.flops_per_second))
    throw Error(fmt::format("MBP chooser: the cost model's rates must be finite, found {}", r.str()));
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
const std::vector<ActivationCost>& Chooser::segment_costs() {
  if (segment_costs_) return *segment_costs_;
  const std::vector<std::string> names = nn::segment_names(model_);
  const nn::RecomputeStateScope restore(model_);
  nn::set_segment_modes(model_, std::vector<nn::SegmentMode>(names.size(), nn::SegmentMode::offload));
  ArenaScope scope(arena_);
  HostArenaScope host(opt_.host_arena, opt_.offload_prefetch_on_cpu);
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
        throw Error(fmt::format("MBP chooser: segment '{}' did not run as a segment in a dry run of the step", name));
      costs.push_back({name, nn::SegmentMode::keep, static_cast<double>(r->bytes) / static_cast<double>(n),
                       r->forward_flops / static_cast<double>(n)});
    }
    segment_costs_ = std::move(costs);
    return *segment_costs_;
  }
  throw Error(fmt::format("MBP chooser: the segments' costs could not be measured: a dry run of one and of two samples "
                          "failed ({})", why));
}

RecomputeChoice Chooser::segment_choice(const std::vector<nn::SegmentMode>& modes, const std::string& name) {
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

const Plan& Chooser::named_segments(std::int64_t batch) {
  const std::vector<nn::SegmentMode> modes = segment_policy_modes(model_, opt_.recompute);
  if (!opt_.host_arena && std::count(modes.begin(), modes.end(), nn::SegmentMode::offload) > 0)
    throw Error(fmt::format("{} {}: offloading a segment needs a host tier to move its activations to ({}), found none",
                            option_name(Option::recompute), opt_.recompute, option_name(Option::host_tier)));
  choice_ = segment_choice(modes, "per segment");
  nn::set_segment_modes(model_, modes);
  return as_set(batch, std::nullopt);
}

// The search of mbp/activations.h: the fewest segments in the cost model's order that make the
// step fit, each in its cheaper mode; if all of them do not, the fewest recomputed ones switched to
// offloading (which also moves their inputs off the device), the least extra cost first. Each by
// bisection: the more the device is relieved of, the less the step needs.
const Plan* Chooser::per_segment(std::int64_t batch) {
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
      as_set(batch, std::nullopt);
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
  return &as_set(batch, std::nullopt);
}

}  // namespace tally::mbp
