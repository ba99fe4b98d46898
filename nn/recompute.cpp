// nn/recompute.cpp — the recomputation ladder of nn/recompute.h over Module::recompute_parts().
#include "nn/recompute.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace tally::nn {

namespace {
// The segments the recomputation levels use: the stem (ImageNet ResNets), the stages and the
// blocks — all but the last block and the last stage. Their backward begins where their forward
// ended (only the pooling, the classifier and the loss come between), so what a re-run would
// rebuild is live at that moment either way: recomputing them would save no byte at the peak and
// cost their forward.
using Segments = Module::RecomputeParts;
Segments segments_of(Module& model, bool drop_last = true) {
  Segments s = model.recompute_parts();
  if (drop_last && !s.blocks.empty()) s.blocks.pop_back();
  if (drop_last && !s.stages.empty()) s.stages.pop_back();
  return s;
}
void check_level(Module& model, int level) {
  const int n = recompute_levels(model);
  if (level < 0 || level >= n)
    throw Error(fmt::format("recomputation level {} is out of range: this model has levels 0 to {}", level, n - 1));
}
// Segments a level marks: the stem and the blocks from level 1, then one stage per level.
std::int64_t segment_count(const Segments& s, int level) {
  if (level == 0) return 0;
  return static_cast<std::int64_t>((s.stem ? 1 : 0) + s.blocks.size()) + (level - 1);
}
std::string stage_range(const Segments& s, int k) {
  return k == 1 ? s.stages[0].first : fmt::format("{}-{}", s.stages[0].first, s.stages[static_cast<std::size_t>(k - 1)].first);
}
}  // namespace

int recompute_levels(Module& model) {
  const Segments s = segments_of(model);
  if (s.blocks.empty() && !s.stem) return 1;
  return 2 + static_cast<int>(s.stages.size());
}

std::int64_t set_recompute_level(Module& model, int level) {
  check_level(model, level);
  // Everything off first (the last block and stage too, whoever set them), then the level's.
  const Segments every = segments_of(model, false);
  for (Module* b : every.blocks) b->set_segment_mode(SegmentMode::keep);
  for (auto& [name, stage] : every.stages) stage->set_segment_mode(SegmentMode::keep);
  const Segments s = segments_of(model);
  if (every.stem) *every.stem = SegmentMode::keep;
  if (s.stem && level >= 1) *s.stem = SegmentMode::recompute;
  for (Module* b : s.blocks) b->set_recompute(level >= 1);
  for (std::size_t i = 0; i < s.stages.size(); ++i) s.stages[i].second->set_recompute(level >= 2 + static_cast<int>(i));
  return segment_count(s, level);
}

std::string recompute_level_name(Module& model, int level) {
  check_level(model, level);
  if (level == 0) return "none";
  if (level == recompute_levels(model) - 1) return "all";
  if (level == 1) return "blocks";
  return fmt::format("blocks + {}", stage_range(segments_of(model), level - 1));
}

std::string recompute_level_description(Module& model, int level) {
  check_level(model, level);
  if (level == 0) return "nothing recomputed";
  const Segments s = segments_of(model);
  std::string what = fmt::format("every {} but the last", s.block_noun);
  if (s.stem) what = "the stem and " + what;
  if (level >= 2) what += fmt::format(", and {} around their blocks", stage_range(s, level - 1));
  return fmt::format("{} segments: {}", segment_count(s, level), what);
}

namespace {
char state_char(SegmentMode m) { return static_cast<char>('0' + static_cast<int>(m)); }
}  // namespace

bool RecomputeState::recomputes() const {
  return std::find(parts.begin(), parts.end(), SegmentMode::recompute) != parts.end();
}
bool RecomputeState::offloads() const {
  return std::find(parts.begin(), parts.end(), SegmentMode::offload) != parts.end();
}
std::string RecomputeState::str() const {
  std::string s;
  for (const SegmentMode m : parts) s += state_char(m);
  return s;
}

RecomputeState recompute_state(Module& model) {
  const Segments every = segments_of(model, false);
  RecomputeState state;
  state.parts.push_back(every.stem ? *every.stem : SegmentMode::keep);
  for (Module* b : every.blocks) state.parts.push_back(b->segment_mode());
  for (auto& [name, stage] : every.stages) state.parts.push_back(stage->segment_mode());
  return state;
}

void set_recompute_state(Module& model, const RecomputeState& state) {
  const Segments every = segments_of(model, false);
  if (state.parts.size() != 1 + every.blocks.size() + every.stages.size())
    throw Error(fmt::format("set_recompute_state: a state of {} parts for a model of {}", state.parts.size(),
                            1 + every.blocks.size() + every.stages.size()));
  std::size_t i = 0;
  if (every.stem) *every.stem = state.parts[i];
  ++i;
  for (Module* b : every.blocks) b->set_segment_mode(state.parts[i++]);
  for (auto& [name, stage] : every.stages) stage->set_segment_mode(state.parts[i++]);
}

std::vector<std::string> segment_names(Module& model) {
  const Segments s = segments_of(model);
  std::vector<std::string> names;
  if (s.stem) names.push_back("stem");
  for (Module* b : s.blocks) names.push_back(b->path());
  return names;
}

std::vector<SegmentMode> segment_modes(Module& model) {
  const Segments s = segments_of(model);
  std::vector<SegmentMode> modes;
  if (s.stem) modes.push_back(*s.stem);
  for (Module* b : s.blocks) modes.push_back(b->segment_mode());
  return modes;
}

void set_segment_modes(Module& model, const std::vector<SegmentMode>& modes) {
  const std::vector<std::string> names = segment_names(model);
  if (modes.size() != names.size())
    throw Error(fmt::format("set_segment_modes: expected {} modes (one per segment), found {}", names.size(),
                            modes.size()));
  set_recompute_level(model, 0);
  const Segments s = segments_of(model);
  std::size_t i = 0;
  if (s.stem) *s.stem = modes[i++];
  for (Module* b : s.blocks) b->set_segment_mode(modes[i++]);
}

std::int64_t set_recompute_blocks(Module& model, bool on) {
  return recompute_levels(model) > 1 ? set_recompute_level(model, on ? 1 : 0) : 0;
}

}  // namespace tally::nn
