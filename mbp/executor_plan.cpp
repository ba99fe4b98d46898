// mbp/executor_plan.cpp — the executor's configuration applied (mbp/executor.h): the chooser
// (mbp/chooser.h) asked, and its answer made real once — the segment modes set, the state moved
// or created where the placement puts it. A pipeline stage's agreement on the micro-batch is its
// runner's (mbp/stage_runner.cpp).
#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/arena.h"
#include "core/conv_tuning.h"
#include "core/memory.h"
#include "core/offload.h"
#include "mbp/host_gradients.h"
#include "optim/optimizer.h"
#include "mbp/executor.h"
#include "mbp/recompute.h"
#include "mbp/stage_runner.h"
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
  apply(choose(batch));  // measured: nothing moved until here
  if (opt_.conv_tuning && device_.is_cuda() && !stage_) tune(batch);
  return config_.plan;
}

Executor::TunedKey Executor::tuned_key(std::int64_t batch) const {
  return {batch, config_.plan.micro_batch, config_.plan.micro_batches, config_.plan.predicted_peak, layout_};
}

void Executor::set_conv_tuning(std::shared_ptr<ConvTuning> tuning) {
  opt_.conv_tuning = std::move(tuning);
  if (!opt_.conv_tuning) ConvTuning::install_none();  // the kernels' table is the process's: none now
  tuned_.clear();
  drop_graphs();  // recorded with the engines before
}

void Executor::tune(std::int64_t batch) {
  if (!tuned_.insert(tuned_key(batch)).second) return;
  ConvTuning& t = *opt_.conv_tuning;
  const std::uint64_t before = conv_tuning_version();
  (void)t.tune(device_, *arena_, [&] {
    ArenaScope scope(arena_);
    HostArenaScope host(placed_host_arena(), opt_.offload_prefetch_on_cpu);
    (void)chooser_.planner().probe(config_.plan.split.shortened(1), false, unbounded_capacity(*arena_));
  });
  if (opt_.log && !t.report().empty()) opt_.log(t.report());
  if (t.undecided()) {
    // This plan's passes not pinned by an earlier plan get a level: the fastest engines, unless the
    // plan made again under them has a smaller micro-batch than without them (this plan's, made
    // with them at none); then those within the heuristics' workspaces; then none.
    const std::int64_t untuned = choose(batch).plan.micro_batch;
    ConvTuning::Use level = ConvTuning::Use::none;
    for (const ConvTuning::Use use : {ConvTuning::Use::fastest, ConvTuning::Use::within}) {
      t.trial(use);
      try {
        if (choose(batch).plan.micro_batch < untuned) continue;
      } catch (const OutOfMemory&) {  // a fixed micro-batch, or none recomputed, the larger workspaces do not fit
        continue;
      }
      level = use;
      break;
    }
    if (level != ConvTuning::Use::fastest && opt_.log)
      opt_.log(fmt::format("tuning: the fastest engines would lower the micro-batch below {}: {} for this plan's "
                           "passes", untuned,
                           level == ConvTuning::Use::within ? "those within the heuristics' workspaces" : "none"));
    t.pin(level);
  }
  if (conv_tuning_version() == before) return;
  drop_graphs();  // recorded with the engines before
  apply(choose(batch));  // under the engines now installed (the loop's last choice: the chooser's cache)
  tuned_.insert(tuned_key(batch));
}

StepConfig Executor::choose(std::int64_t batch) {
  return stage_ ? stage_->choose(chooser_, batch, limit_, layout()) : chooser_.choose(batch, limit_, layout());
}

StepConfig Executor::choose_with(std::int64_t batch, std::int64_t micro_batch) {
  return stage_ ? stage_->choose_with(chooser_, batch, micro_batch, limit_, layout())
                : chooser_.choose_with(batch, micro_batch, limit_, layout());
}

void Executor::apply(const StepConfig& config) {
  nn::set_recompute_state(model_, config.segments);
  apply_placement(config.placement.placement);
  // Recorded micro-batches are of one configuration: another plan runs other host code.
  const Plan &a = config.plan, &b = config_.plan;
  if (a.batch_size != b.batch_size || a.micro_batch != b.micro_batch || a.predicted_peak != b.predicted_peak ||
      !(config.segments == config_.segments) || config.placement.placement != config_.placement.placement)
    drop_graphs();
  config_ = config;
}

std::shared_ptr<Arena> Executor::traced_dry_step(const Plan& p, bool* all) {
  const bool every = p.micro_batches <= Planner::kVerifyAll;
  if (all) *all = every;
  ArenaScope scope(arena_);
  HostArenaScope host(placed_host_arena(), opt_.offload_prefetch_on_cpu);
  return chooser_.planner().traced(every ? p.sizes() : p.split.shortened(2));
}

void Executor::apply_placement(Placement p) {
  if (p == placed_ && optimizer_.state_created()) return;
  chooser_.check_host_holds(p, layout());
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

}  // namespace tally::mbp
