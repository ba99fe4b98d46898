// mbp/pipeline.cpp — the stages' order, the cut and the gathering of a pipeline; see mbp/pipeline.h.
#include "mbp/pipeline.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/option_names.h"
#include "mbp/planner.h"

namespace tally::mbp {

const std::vector<std::string>& pipeline_schedule_names() {
  static const std::vector<std::string> names{"1f1b", "gpipe"};
  return names;
}

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  if (name == "1f1b") return PipelineSchedule::one_f_one_b;
  if (name == "gpipe") return PipelineSchedule::gpipe;
  throw Error(fmt::format("{} '{}': expected {}", option_name(Option::pipeline_schedule), name,
                          fmt::join(pipeline_schedule_names(), "|")));
}

const char* pipeline_schedule_name(PipelineSchedule s) { return s == PipelineSchedule::gpipe ? "gpipe" : "1f1b"; }

std::int64_t PipelineStage::in_flight(std::int64_t micro_batches) const {
  if (stage == stages - 1) return std::min<std::int64_t>(1, micro_batches);
  if (schedule == PipelineSchedule::gpipe) return micro_batches;
  return std::min<std::int64_t>(stages - stage, micro_batches);
}

std::vector<PipelineOp> pipeline_order(PipelineSchedule schedule, int stage, int stages, std::int64_t k) {
  if (stages < 1 || stage < 0 || stage >= stages || k < 1)
    throw Error(fmt::format("pipeline_order: expected 0 <= stage < stages and k >= 1, found stage {} of {}, k {}", stage,
                            stages, k));
  std::vector<PipelineOp> order;
  if (stage == stages - 1) {
    for (std::int64_t i = 0; i < k; ++i) order.push_back({true, i});
    return order;
  }
  // Forwards before the first backward: all of them (GPipe), or as many as the stages after this
  // one need to fill the pipeline (1F1B) — then one forward and one backward in turn.
  const std::int64_t warm = schedule == PipelineSchedule::gpipe ? k : std::min<std::int64_t>(stages - stage - 1, k);
  for (std::int64_t i = 0; i < warm; ++i) order.push_back({true, i});
  for (std::int64_t i = warm; i < k; ++i) {
    order.push_back({true, i});
    order.push_back({false, i - warm});
  }
  for (std::int64_t i = k - warm; i < k; ++i) order.push_back({false, i});
  return order;
}

std::size_t message_staging_bytes(const PipelineStage& stage, const std::vector<std::int64_t>& sizes,
                                  std::size_t input_bytes, std::size_t output_bytes) {
  const bool first = stage.stage == 0, last = stage.stage + 1 == stage.stages;
  const DryRun dry;  // nothing runs: the arena's algorithm alone
  const auto arena = dry.virtual_arena(Device::cpu(), std::size_t(1) << 46);
  const auto bytes = [&](std::size_t per_sample, std::size_t i) { return per_sample * static_cast<std::size_t>(sizes[i]); };
  const auto receive = [&](std::size_t n) { arena->free(arena->allocate(n, Category::temporary, "recv").offset); };
  std::vector<std::size_t> sent(sizes.size());  // each activation sent on, until its gradient is back
  std::optional<std::size_t> sent_back;         // the last gradient sent back
  const auto send_back = [&](std::size_t i) {
    if (first) return;
    if (sent_back) arena->free(*sent_back);
    sent_back = arena->allocate(bytes(input_bytes, i), Category::temporary, "send").offset;
  };
  for (const PipelineOp& op : pipeline_order(stage.schedule, stage.stage, stage.stages,
                                             static_cast<std::int64_t>(sizes.size()))) {
    const auto i = static_cast<std::size_t>(op.index);
    if (op.forward) {
      if (!first) receive(bytes(input_bytes, i));
      if (!last) sent[i] = arena->allocate(bytes(output_bytes, i), Category::temporary, "send").offset;
      if (last) send_back(i);
    } else {
      receive(bytes(output_bytes, i));
      arena->free(sent[i]);
      send_back(i);
    }
  }
  return arena->stats().high_water;
}

namespace {

std::int64_t rounded(std::size_t bytes) {
  return static_cast<std::int64_t>((bytes + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment);
}

// The best partition of segments [0, n) into S contiguous non-empty stages, by dynamic programming
// over (stages used, segments covered): `value(s, a, b)` rates stage s running segments [a, b)
// (nullopt: it may not), and the partition's rating is its stages' smallest value (`widest`: made as
// large as possible) or largest (made as small as possible). nullopt when no partition is allowed.
template <class T, class Value>
std::optional<std::vector<std::size_t>> best_partition(std::size_t n, std::size_t S, Value value, bool widest) {
  std::vector<std::vector<T>> best(S + 1, std::vector<T>(n + 1, T{}));
  std::vector<std::vector<std::size_t>> from(S + 1, std::vector<std::size_t>(n + 1, 0));
  std::vector<std::vector<bool>> reached(S + 1, std::vector<bool>(n + 1, false));
  reached[0][0] = true;
  best[0][0] = widest ? std::numeric_limits<T>::max() : std::numeric_limits<T>::lowest();
  for (std::size_t s = 1; s <= S; ++s)
    for (std::size_t b = s; b <= n; ++b)
      for (std::size_t a = s - 1; a < b; ++a) {
        if (!reached[s - 1][a]) continue;
        const std::optional<T> v = value(s - 1, a, b);
        if (!v) continue;
        const T c = widest ? std::min(best[s - 1][a], *v) : std::max(best[s - 1][a], *v);
        if (!reached[s][b] || (widest ? c > best[s][b] : c < best[s][b]))
          best[s][b] = c, from[s][b] = a, reached[s][b] = true;
      }
  if (!reached[S][n]) return std::nullopt;
  std::vector<std::size_t> bounds(S + 1, n);
  for (std::size_t s = S; s > 0; --s) bounds[s - 1] = from[s][bounds[s]];
  return bounds;
}

}  // namespace

std::vector<SegmentCost> segment_costs(nn::Module& model, const Shape& sample_shape, DType activation_dtype,
                                       int state_per_parameter) {
  std::vector<nn::Module::Segment> segments = model.segments();
  if (segments.empty()) throw Error("pipeline: the model offers no segments to cut (Module::segments)");
  std::vector<SegmentCost> costs;
  for (const auto& s : segments) {
    SegmentCost c;
    c.name = s.name;
    for (const Tensor& p : nn::parameters_of(s.modules)) {
      c.parameters += p.numel();
      c.persistent_bytes += rounded(p.nbytes()) * (2 + state_per_parameter);
    }
    for (nn::Module* m : s.modules)
      for (const auto& [name, b] : m->named_buffers()) c.persistent_bytes += rounded(b.nbytes());
    costs.push_back(c);
  }
  // The activations: a training forward of two samples through every segment in turn on a virtual
  // arena with room to spare (dry: nothing computed), what each keeps counted as it runs.
  const DryRun dry(Device::cpu(), std::size_t(1) << 46);
  EnableGradGuard grad;
  const std::vector<nn::StepState*> states = nn::step_states(model);
  for (nn::StepState* s : states) s->begin_step();
  struct Discard {
    const std::vector<nn::StepState*>& states;
    ~Discard() {
      for (nn::StepState* s : states) s->discard();
    }
  } discard{states};
  constexpr std::int64_t kSamples = 2;
  Shape shape{kSamples};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  std::vector<Tensor> kept;  // every output, as the stages' in-flight micro-batches keep them
  Tensor x = Tensor::empty(shape, activation_dtype, model.parameters().front().device(), Category::input, "input");
  const FlopCount flops_before = flop_count();
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const std::int64_t before = dry.arena().stats().total.current;
    const double work_before = flop_count().forward;
    Tensor y = segments[i].forward(i == 0 ? x : kept.back());
    kept.push_back(y);
    costs[i].activation_bytes = (dry.arena().stats().total.current - before) / kSamples;
    costs[i].flops = (flop_count().forward - work_before) / kSamples;
  }
  flop_count() = flops_before;  // a measurement, not work of the caller's
  return costs;
}

namespace {

// At least one stage, and no more than segments.
void check_stage_count(const std::vector<SegmentCost>& costs, int stages) {
  const std::size_t n = costs.size();
  if (stages < 1)
    throw Error(fmt::format("{}: expected at least 1, found {}", option_name(Option::pipeline_stages), stages));
  if (static_cast<std::size_t>(stages) > n) {
    std::vector<std::string> names;
    for (const auto& c : costs) names.push_back(c.name);
    throw Error(fmt::format("{} {}: the model has {} segments to cut between ({}), so at most {} stages",
                            option_name(Option::pipeline_stages), stages, n, fmt::join(names, ", "), n));
  }
}

}  // namespace

std::vector<std::size_t> balanced_cut(const std::vector<SegmentCost>& costs, int stages,
                                      const std::vector<std::int64_t>& limits, std::int64_t batch) {
  check_stage_count(costs, stages);
  const std::size_t n = costs.size();
  const auto S = static_cast<std::size_t>(stages);
  if (limits.size() != S) throw Error(fmt::format("balanced_cut: expected {} limits, found {}", S, limits.size()));
  std::vector<std::int64_t> persistent(n + 1, 0), activation(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    persistent[i + 1] = persistent[i] + costs[i].persistent_bytes;
    activation[i + 1] = activation[i] + costs[i].activation_bytes;
  }
  // Stage s running segments [a, b) holds the activations of S - s micro-batches under 1F1B (one
  // on the last stage): with micro-batches of m its bytes are P + m * held * A.
  auto held = [&](std::size_t s) { return s + 1 == S ? std::int64_t{1} : static_cast<std::int64_t>(S - s); };
  auto bytes = [&](std::size_t s, std::size_t a, std::size_t b, std::int64_t m) {
    return persistent[b] - persistent[a] + m * held(s) * (activation[b] - activation[a]);
  };
  auto largest_m = [&](std::size_t s, std::size_t a, std::size_t b) {  // the most samples stage s fits (<= batch)
    const std::int64_t room = limits[s] - (persistent[b] - persistent[a]);
    const std::int64_t per = held(s) * (activation[b] - activation[a]);
    if (room < per) return std::int64_t{0};
    return per <= 0 ? batch : std::min(batch, room / per);
  };
  // First the largest micro-batch every stage fits; then, at that micro-batch, the smallest largest stage.
  auto micro_batch_of = [&](const std::vector<std::size_t>& bounds) {
    std::int64_t m = batch;
    for (std::size_t s = 0; s < S; ++s) m = std::min(m, largest_m(s, bounds[s], bounds[s + 1]));
    return m;
  };
  const auto most = best_partition<std::int64_t>(
      n, S, [&](std::size_t s, std::size_t a, std::size_t b) { return std::optional<std::int64_t>(largest_m(s, a, b)); },
      true);
  const bool fits = most && micro_batch_of(*most) >= 1;  // else: the smallest largest stage at one sample
  const std::int64_t m = fits ? micro_batch_of(*most) : 1;
  const auto smallest = best_partition<std::int64_t>(
      n, S,
      [&](std::size_t s, std::size_t a, std::size_t b) -> std::optional<std::int64_t> {
        const std::int64_t v = bytes(s, a, b, m);
        if (fits && v > limits[s]) return std::nullopt;
        return v;
      },
      false);
  return smallest ? *smallest : *most;  // with no limit binding, the smallest is always found
}

std::vector<std::size_t> work_balanced_cut(const std::vector<SegmentCost>& costs, int stages) {
  check_stage_count(costs, stages);
  const std::size_t n = costs.size(), S = static_cast<std::size_t>(stages);
  std::vector<double> work(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) work[i + 1] = work[i] + costs[i].flops;
  return *best_partition<double>(
      n, S, [&](std::size_t, std::size_t a, std::size_t b) { return std::optional<double>(work[b] - work[a]); }, false);
}

std::string split_text(const std::vector<SegmentCost>& costs, const std::vector<std::size_t>& bounds) {
  std::vector<std::string> names;
  for (std::size_t s = 1; s + 1 < bounds.size(); ++s) names.push_back(costs.at(bounds[s]).name);
  return fmt::format("{}", fmt::join(names, ","));
}

std::string work_shares(const std::vector<SegmentCost>& costs, const std::vector<std::size_t>& bounds) {
  double all = 0;
  for (const auto& c : costs) all += c.flops;
  std::vector<std::string> shares;
  for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
    double w = 0;
    for (std::size_t i = bounds[s]; i < bounds[s + 1]; ++i) w += costs[i].flops;
    shares.push_back(fmt::format("{:.0f}%", all > 0 ? 100.0 * w / all : 0.0));
  }
  return fmt::format("{}", fmt::join(shares, " / "));
}

std::vector<std::size_t> parse_pipeline_split(const std::string& text, const std::vector<nn::Module::Segment>& segments,
                                              int stages) {
  std::vector<std::string> names;
  for (const auto& s : segments) names.push_back(s.name);
  std::vector<std::string> items;
  for (std::size_t start = 0;;) {
    const std::size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (static_cast<int>(items.size()) != stages - 1)
    throw Error(fmt::format("{} {}: expected {} segment name{} (where each stage after the first begins) "
                            "for {} stages, found {}",
                            option_name(Option::pipeline_split), text, stages - 1, stages == 2 ? "" : "s", stages,
                            items.size()));
  std::vector<std::size_t> bounds{0};
  for (const std::string& item : items) {
    const auto it = std::find(names.begin(), names.end(), item);
    if (it == names.end())
      throw Error(fmt::format("{} {}: '{}' names no segment of the model; its segments are {}",
                              option_name(Option::pipeline_split), text, item,
                              fmt::join(names, ", ")));
    const auto at = static_cast<std::size_t>(it - names.begin());
    if (at <= bounds.back())
      throw Error(fmt::format("{} {}: '{}' does not come after the start of the stage before it (each "
                              "stage needs at least one segment, in the model's order: {})",
                              option_name(Option::pipeline_split), text, item,
                              fmt::join(names, ", ")));
    bounds.push_back(at);
  }
  bounds.push_back(segments.size());
  return bounds;
}

std::string segment_range(const std::vector<nn::Module::Segment>& segments, std::size_t first, std::size_t last) {
  if (last == first + 1) return segments.at(first).name;
  return fmt::format("{} .. {}", segments.at(first).name, segments.at(last - 1).name);
}

std::vector<nn::Module*> stage_modules(const std::vector<nn::Module::Segment>& segments,
                                       const std::vector<std::size_t>& bounds, int stage) {
  std::vector<nn::Module*> out;
  for (std::size_t i = bounds.at(static_cast<std::size_t>(stage)); i < bounds.at(static_cast<std::size_t>(stage) + 1); ++i)
    for (nn::Module* m : segments[i].modules) out.push_back(m);
  return out;
}

std::vector<Tensor> place_stage(const std::vector<nn::Module::Segment>& segments, const std::vector<std::size_t>& bounds,
                                int stage, const std::shared_ptr<Arena>& arena) {
  const std::vector<nn::Module*> modules = stage_modules(segments, bounds, stage);
  try {
    for (nn::Module* m : modules) nn::move_to_arena(*m, arena);
  } catch (const OutOfMemory& e) {
    std::int64_t bytes = 0;
    for (nn::Module* m : modules) {
      for (const auto& [name, t] : m->named_parameters()) bytes += 2 * rounded(t.nbytes());
      for (const auto& [name, t] : m->named_buffers()) bytes += rounded(t.nbytes());
    }
    const std::size_t s = static_cast<std::size_t>(stage);
    throw OutOfMemory(fmt::format("pipeline stage {} ({}): its parameters, gradients and buffers need {} and do not fit "
                                  "its memory limit of {} ({})", stage, segment_range(segments, bounds[s], bounds[s + 1]),
                                  format_bytes(static_cast<std::size_t>(bytes)), format_bytes(arena->capacity()), e.what()),
                      static_cast<std::size_t>(bytes));
  }
  return nn::parameters_of(modules);
}

namespace {

// The segment of every parameter and buffer (by its TensorImpl).
std::map<const TensorImpl*, std::size_t> owners(const std::vector<nn::Module::Segment>& segments) {
  std::map<const TensorImpl*, std::size_t> owner;
  for (std::size_t i = 0; i < segments.size(); ++i)
    for (nn::Module* m : segments[i].modules) {
      for (const auto& [name, t] : m->named_parameters()) owner.emplace(&t.impl(), i);
      for (const auto& [name, t] : m->named_buffers()) owner.emplace(&t.impl(), i);
    }
  return owner;
}

}  // namespace

void check_segments_cover(nn::Module& model, const std::vector<nn::Module::Segment>& segments) {
  std::map<const TensorImpl*, int> uses;
  for (const auto& s : segments)
    for (nn::Module* m : s.modules) {
      for (const auto& [name, t] : m->named_parameters()) ++uses[&t.impl()];
      for (const auto& [name, t] : m->named_buffers()) ++uses[&t.impl()];
    }
  auto check = [&](const std::vector<std::pair<std::string, Tensor>>& named) {
    for (const auto& [name, t] : named) {
      const int n = uses[&t.impl()];
      if (n != 1)
        throw Error(fmt::format("pipeline: {} is used by {} segments of the model, expected exactly 1", name, n));
    }
  };
  check(model.named_parameters());
  check(model.named_buffers());
}

void gather_stages(nn::Module& model, const std::vector<nn::Module::Segment>& segments,
                   const std::vector<std::size_t>& bounds, distributed::Communicator& comm) {
  const auto owner = owners(segments);
  auto stage_of = [&](const Tensor& t) {
    const std::size_t segment = owner.at(&t.impl());
    int s = 0;
    while (bounds[static_cast<std::size_t>(s) + 1] <= segment) ++s;
    return s;
  };
  auto share = [&](const std::vector<std::pair<std::string, Tensor>>& named) {
    for (const auto& [name, t] : named) {
      if (!t.is_contiguous()) throw Error(fmt::format("gather_stages: {} is not contiguous", name));
      if (t.device().is_cpu()) {
        comm.broadcast(t.raw_data(), t.nbytes(), stage_of(t));  // host memory
        continue;
      }
      // On a GPU: this rank's own stage (the others' parts stay on the host), sent from a host copy.
      const Tensor host = t.to(Device::cpu());
      comm.broadcast(host.raw_data(), host.nbytes(), stage_of(t));
    }
  };
  share(model.named_parameters());
  share(model.named_buffers());
}

}  // namespace tally::mbp
