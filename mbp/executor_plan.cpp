// mbp/executor_plan.cpp — the executor's plans (mbp/executor.h): the recomputation policy applied
// (ExecutorOptions::recompute; "auto" climbs the model's ladder to the first level on which the
// plan fits) and the planner (mbp/planner.h) asked. A pipeline stage's agreement on the
// micro-batch is its own (mbp/pipeline_executor.cpp).
//
// Why "auto" takes the first level on which the plan fits: once one sample fits, MBP already
// runs any batch exactly, and every level of recomputation costs step time; whoever wants larger
// micro-batches for speed asks for a level.
#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/arena.h"
#include "core/memory.h"
#include "core/offload.h"
#include "mbp/host_gradients.h"
#include "optim/optimizer.h"
#include "mbp/executor.h"
#include "mbp/recompute.h"
#include "nn/recompute.h"

namespace tally::mbp {

namespace {

// Each parameter's gradient buffer was allocated beside it: with the gradients on the host, holes
// the size of a gradient would lie between the parameters, too small for a step's activations. So
// the model's tensors on the device — parameters and buffers — are moved to the host tier and
// back, in their order, and become one block, the free memory another. Only when the host tier
// has one free block for all of them; else they stay where they are (deterministic either way).
void pack_model_state(nn::Module& model, const std::shared_ptr<Arena>& device, const std::shared_ptr<Arena>& host) {
  std::vector<std::shared_ptr<Storage>> storages;
  std::size_t bytes = 0;
  const auto add = [&](const Tensor& t) {
    const std::shared_ptr<Storage>& s = t.impl().storage;
    if (s->arena() != device || std::find(storages.begin(), storages.end(), s) != storages.end()) return;
    storages.push_back(s);
    bytes += Arena::round_up(s->nbytes());
  };
  for (const Tensor& p : model.parameters()) add(p);
  for (const auto& [name, b] : model.named_buffers()) add(b);
  if (host->largest_free_block() < bytes) return;
  for (const auto& s : storages) move_storage(*s, host);
  for (const auto& s : storages) move_storage(*s, device);
}

}  // namespace

const Plan& Executor::plan(std::int64_t batch) {
  const Plan& p = plan_by_policy(batch);  // measured: nothing moved
  apply_placement(placement_.placement);  // the chosen placement, applied once (a no-op when there)
  // With a host tier, every choice carries the cost model's rates: the plan states its estimate.
  if (opt_.host_arena && !choice_.rates) choice_.rates = cost_rates();
  return p;
}

Executor::Choice Executor::choose(std::int64_t batch) {
  const nn::RecomputeStateScope restore(model_);
  const Plan& p = plan_by_policy(batch);
  return {p, choice_, placement_, nn::recompute_state(model_)};
}

int Executor::top_level() { return nn::recompute_levels(model_) - 1; }

const Plan& Executor::plan_by_policy(std::int64_t batch) {
  const std::string& policy = opt_.recompute;
  if (policy == "none") {
    const std::string state = nn::recompute_state(model_);
    choice_ = RecomputeChoice{0, "none", "nothing recomputed", "", {}, {}};
    if (state.find('1') != std::string::npos) choice_ = RecomputeChoice{0, "as marked", "the segments marked on the model", "", {}, {}};
    try {
      return plan_as_set(batch, std::nullopt);
    } catch (const OutOfMemory& without) {
      throw_none_too_small(without, batch);
    }
  }
  if (policy == "auto") return plan_auto(batch);
  if (is_segment_policy(policy)) return plan_named_segments(batch);
  choice_ = set_recompute_choice(model_, recompute_policy_level(model_, policy));
  return plan_as_set(batch, std::nullopt);
}

const Plan& Executor::plan_as_set(std::int64_t batch, std::optional<std::int64_t> micro_batch) {
  if (!micro_batch && opt_.micro_batch) micro_batch = std::min({*opt_.micro_batch, limit_, batch});
  if (!opt_.host_arena) {
    placement_ = {Placement::device, "no host tier"};
    return plan_placed(batch, micro_batch, Placement::device);
  }
  if (opt_.placement) {
    check_host_holds(*opt_.placement);
    placement_ = {*opt_.placement, "as given"};
    return plan_placed(batch, micro_batch, *opt_.placement);
  }
  // The executor's choice: the largest micro-batch, ties to the fewest bytes moved — device, then
  // the optimizer on the host, then the gradients too (not with data parallelism). Each measured
  // by dry runs that simulate it: nothing moves until plan() applies the choice.
  const auto key = std::make_pair(batch, nn::recompute_state(model_));
  if (const auto it = placement_choices_.find(key); it != placement_choices_.end()) {
    placement_ = it->second;
    return plan_placed(batch, micro_batch, placement_.placement);
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
      check_host_holds(c);
      t.micro_batch = plan_placed(batch, micro_batch, c).micro_batch;
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
  return plan_placed(batch, micro_batch, chosen.placement);
}

std::shared_ptr<Arena> Executor::traced_dry_step(const Plan& p, bool* all) {
  const bool every = p.micro_batches <= Planner::kVerifyAll;
  if (all) *all = every;
  ArenaScope scope(arena_);
  HostArenaScope host(placed_host_arena());
  return planner_.traced(every ? p.sizes() : p.split.shortened(2));
}

const Plan& Executor::plan_placed(std::int64_t batch, std::optional<std::int64_t> micro_batch, Placement p) {
  ArenaScope scope(arena_);
  HostArenaScope host(host_arena_for(p));
  // The state as it lies now, moved where `p` puts it: plans are keyed by the moves that made the
  // layout they start from (moving to where the state is already changes nothing).
  const bool there = p == placed_ && optimizer_.state_created();
  const std::string layout = there ? layout_ : fmt::format("{}>{}", layout_, placement_name(p));
  struct Measuring {  // the placement the planner's dry runs simulate, for this call
    Executor& e;
    Measuring(Executor& ex, Placement p) : e(ex) {
      e.measuring_ = p;
      e.planner_.set_prepare([&ex = e, p](Arena& device, Arena* host) { ex.simulate_placement(p, device, host); });
    }
    ~Measuring() {
      e.measuring_.reset();
      e.planner_.set_prepare({});
    }
  } measuring(*this, p);
  return planner_.plan(batch, micro_batch, limit_, fmt::format("{}|{}", nn::recompute_state(model_), layout));
}

void Executor::check_host_holds(Placement p) const {
  if (p == Placement::device) return;
  if (!opt_.host_arena)
    throw Error(fmt::format("MBP executor: placement {} needs a host tier (--host-memory-limit), found none",
                            placement_name(p)));
  if (p == Placement::gradients && data_parallel_)
    throw Error("MBP executor: placement gradients is not available with data parallelism");
  // What the host tier must hold: the state (and the gradient accumulators), then one parameter's
  // staging during the update — its high-water mark, exact for a host arena that holds nothing else.
  const Arena& host = *opt_.host_arena;
  const bool with_grads = p == Placement::gradients, created = optimizer_.state_created();
  const optim::Optimizer::HostBytes want = optimizer_.host_bytes(with_grads);
  const std::size_t state = want.state, grads = optimizer_.host_bytes(true).gradients, staging = want.staging;
  const std::size_t ours_now = (placed_ != Placement::device && created ? state : 0) +
                               (placed_ == Placement::gradients ? grads : 0);
  const std::size_t need = static_cast<std::size_t>(host.stats().total.current) - ours_now + want.total();
  if (need <= host.capacity()) return;
  const std::size_t device_now = static_cast<std::size_t>(arena_->stats().total.current);
  const std::size_t on_device = device_now - (placed_ == Placement::device && created ? state : 0) -
                                (with_grads && placed_ != Placement::gradients ? grads : 0);
  throw OutOfMemory(
      fmt::format("host memory limit {} ({} bytes) is too small for placement {}: the host tier needs {} ({} bytes: "
                  "optimizer state {}{}, staging of the largest parameter {}); the device tier then holds {} of "
                  "persistent state before any micro-batch",
                  format_bytes(host.capacity()), host.capacity(), placement_name(p), format_bytes(need), need,
                  format_bytes(state), with_grads ? fmt::format(", gradient accumulators {}", format_bytes(grads)) : "",
                  format_bytes(staging), format_bytes(on_device)),
      need);
}

void Executor::apply_placement(Placement p) {
  if (p == placed_ && optimizer_.state_created()) return;
  check_host_holds(p);
  ArenaScope scope(arena_);
  // The state is created where `p` puts it, never on the device first.
  if (!optimizer_.state_created()) optimizer_.create_state(p == Placement::device ? nullptr : opt_.host_arena);
  // Back first (the gradients, then the state, as far as `p` wants), then out.
  if (placed_ == Placement::gradients && p != Placement::gradients) {
    optimizer_.place_gradients(nullptr);
    host_gradients_.reset();
  }
  if (p == Placement::device) {
    optimizer_.place_state(nullptr);
  } else {
    optimizer_.place_state(opt_.host_arena);
    if (p == Placement::gradients && placed_ != Placement::gradients) {
      optimizer_.place_gradients(opt_.host_arena);
      host_gradients_ = std::make_unique<HostGradients>(optimizer_.params(), optimizer_.host_gradients());
      pack_model_state(model_, arena_, opt_.host_arena);
    }
  }
  layout_ = fmt::format("{}>{}", layout_, placement_name(p));
  placed_ = p;
}

// apply_placement's moves on the dry run's virtual clones of the two tiers: each block allocated
// where it goes, then freed where it was, in the same order, so that the clones' layout is the one
// the real moves will make (offsets only; nothing is read or written). Without a clone of the host
// tier (a placement that does not use it: its side does not matter to the step), its side is skipped.
void Executor::simulate_placement(Placement to, Arena& device, Arena* host) const {
  if (to == placed_ && optimizer_.state_created()) return;
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
  if (placed_ == Placement::gradients && to != Placement::gradients)
    for (const Tensor& g : optimizer_.host_gradients()) move(*g.storage(), &device, "grad");
  const bool state_on_host = created && optimizer_.state_host() != nullptr;
  if (to == Placement::device) {
    if (state_on_host)
      for (const auto& [name, t] : state) move(*t.storage(), &device, optimizer_.name() + "." + name);
    return;
  }
  if (created && !state_on_host)
    for (const auto& [name, t] : state) move(*t.storage(), host, optimizer_.name() + "." + name);
  if (to != Placement::gradients || placed_ == Placement::gradients) return;
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
const Plan& Executor::plan_auto(std::int64_t batch) {
  if (const auto it = auto_choices_.find(batch); it != auto_choices_.end()) {
    choice_ = it->second;
    if (!choice_.segments.empty()) {
      std::vector<nn::SegmentMode> modes;
      for (const ActivationCost& s : choice_.segments) modes.push_back(s.mode);
      nn::set_segment_modes(model_, modes);
    } else {
      nn::set_recompute_level(model_, choice_.level);
    }
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
    // With a host tier: each segment kept, recomputed or offloaded by the cost model first.
    if (opt_.host_arena && !opt_.pipeline) {
      if (const Plan* p = plan_segments(batch)) {
        auto_choices_[batch] = choice_;
        return *p;
      }
    }
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
  const nn::RecomputeStateScope restore(model_);
  nn::set_recompute_level(model_, level);
  return plan_as_set(batch, micro_batch);
}

}  // namespace tally::mbp
