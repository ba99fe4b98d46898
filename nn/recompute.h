// nn/recompute.h — the recomputation ladder of a model: which of its parts run as recomputed
// segments (gradient checkpointing, core/autograd.h), from the cheapest level to the most
// aggressive. The parts come from Module::recompute_parts() (the ResNets of nn/resnet.h offer
// theirs); MBP's executor climbs the ladder when asked to (mbp/executor.h, recompute "auto"):
//   level 0        none;
//   level 1        "blocks": every block (a ResNet's residual blocks; ResNet-9's six units) but the
//                  last a recomputed segment, and the stem where the model has one (an ImageNet
//                  ResNet's, whose full-resolution activations are the largest): each segment
//                  keeps only its input and runs its forward once more in backward (the last
//                  block's backward begins where its forward ended: re-running it would save
//                  nothing at the peak);
//   level 1 + k    blocks, and the first k stages (layer1 .. layerk) as segments around them
//                  (nested: a stage keeps only its input; in backward it re-runs, keeping its
//                  blocks' inputs, and each block re-runs again) — Chen et al.'s recursion, the
//                  blocks of those stages run forward three times; the first stages come first
//                  because their activations are the largest;
//   the last level "all": blocks and every stage but the last (for the same reason).
// Gradients are bit for bit those of a plain run at every level.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "nn/module.h"

namespace tally::nn {

int recompute_levels(Module& model);  // the number of levels, none included (1: nothing to recompute)
// Sets `level` (0 <= level < recompute_levels); returns the number of recomputed segments.
std::int64_t set_recompute_level(Module& model, int level);
// "none", "blocks", "blocks + layer1", "blocks + layer1-layer2", ..., "all".
std::string recompute_level_name(Module& model, int level);
// What the level recomputes, e.g. "16 segments: the stem and every residual block but the last"
// or "19 segments: the stem and every residual block but the last, and layer1-layer3 around their
// blocks".
std::string recompute_level_description(Module& model, int level);
// The segment modes of every part the model offers (the stem, or keep where it has none; the blocks;
// the stages; the last ones too), in that order: whatever set them, this is what a step will
// recompute and offload. Kept and restored by MBP's chooser around what it measures, carried by a
// step's configuration (mbp/chooser.h) and part of its plans' key.
struct RecomputeState {
  std::vector<SegmentMode> parts;
  bool recomputes() const;  // some part is recomputed
  bool offloads() const;    // some part is offloaded
  // One character per part, '0' keep, '1' recompute, '2' offload: "0200010000000".
  std::string str() const;
  bool operator==(const RecomputeState&) const = default;
};
RecomputeState recompute_state(Module& model);
void set_recompute_state(Module& model, const RecomputeState& state);
// Keeps the model's segment modes (recompute_state) and sets them back when it ends, however the
// scope is left: for a plan or a measure made at other modes.
class RecomputeStateScope {
 public:
  explicit RecomputeStateScope(Module& model) : model_(model), state_(recompute_state(model)) {}
  ~RecomputeStateScope() { set_recompute_state(model_, state_); }
  RecomputeStateScope(const RecomputeStateScope&) = delete;
  RecomputeStateScope& operator=(const RecomputeStateScope&) = delete;

 private:
  Module& model_;
  RecomputeState state_;
};

// The segments that can each be kept, recomputed or offloaded on their own (mbp/activations.h):
// level 1's — the stem, where the model has one, then every block but the last — named "stem" and
// by their paths ("layer1.0"); their modes in that order; and all of them set at once (every stage
// kept: the ladder's levels above 1 are recomputation only).
std::vector<std::string> segment_names(Module& model);
std::vector<SegmentMode> segment_modes(Module& model);
void set_segment_modes(Module& model, const std::vector<SegmentMode>& modes);
// Level 1 (on) or 0 (off); returns the number of segments.
std::int64_t set_recompute_blocks(Module& model, bool on);

}  // namespace tally::nn
