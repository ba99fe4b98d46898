// mbp/planner.cpp — dry-run search for the largest micro-batch; see mbp/planner.h.
#include "mbp/planner.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/memory.h"

namespace tally::mbp {

std::size_t unbounded_capacity(const Arena& a) { return std::max<std::size_t>(a.capacity(), std::size_t(1) << 40) * 64; }

std::vector<std::int64_t> balanced_sizes(std::int64_t batch, std::int64_t k) {
  if (batch < 1 || k < 1 || k > batch)
    throw Error(fmt::format("balanced_sizes: expected 1 <= micro-batches <= batch, found {} micro-batches for batch {}",
                            k, batch));
  std::vector<std::int64_t> s(static_cast<std::size_t>(k), batch / k);
  for (std::int64_t i = 0; i < batch % k; ++i) ++s[static_cast<std::size_t>(i)];
  return s;
}

Split Split::of(std::int64_t batch, std::int64_t m) {
  if (batch < 1 || m < 1)
    throw Error(fmt::format("Split: expected a batch and a micro-batch size >= 1, found {} and {}", batch, m));
  const std::int64_t k = batch / m + (batch % m != 0);
  const std::int64_t base = batch / k, rem = batch % k;
  if (rem == 0) return {base, k, 0};
  return {base + 1, rem, k - rem};
}

std::vector<std::int64_t> Split::sizes() const {
  std::vector<std::int64_t> s(static_cast<std::size_t>(n_large), large);
  s.insert(s.end(), static_cast<std::size_t>(n_small), small());
  return s;
}

std::vector<std::int64_t> Split::shortened(std::size_t keep) const {
  const auto cut = [keep](std::int64_t n) { return static_cast<std::size_t>(std::min<std::uint64_t>(n, keep)); };
  std::vector<std::int64_t> s(cut(n_large), large);
  s.insert(s.end(), cut(n_small), small());
  return s;
}

std::int64_t Breakdown::total() const {
  std::int64_t t = 0;
  for (auto b : bytes) t += b;
  return t;
}

std::string Breakdown::str() const {
  std::string out;
  for (int c = 0; c < kNumCategories; ++c)
    if (bytes[c] > 0)
      out += fmt::format("{}{} {}", out.empty() ? "" : ", ", category_name(static_cast<Category>(c)),
                         format_bytes(static_cast<std::size_t>(bytes[c])));
  return out.empty() ? "nothing" : out;
}

std::string Plan::summary() const {
  std::string split;
  if (micro_batches == 1) {
    split = "1 micro-batch (the whole batch)";
  } else {
    const Split& s = this->split;
    split = s.n_small == 0 ? fmt::format("{} micro-batches of {}", micro_batches, s.large)
                           : fmt::format("{} micro-batches ({} of {}, {} of {})", micro_batches, s.n_large, s.large,
                                         s.n_small, s.small());
  }
  return fmt::format("batch {} = {} | predicted peak {} of {} ({:.1f}%)", batch_size, split,
                     format_bytes(predicted_peak), format_bytes(budget),
                     100.0 * static_cast<double>(predicted_peak) / static_cast<double>(budget));
}

void Planner::set_repeats(std::size_t repeats) {
  if (repeats < 2) throw Error(fmt::format("Planner: expected at least 2 repeats, found {}", repeats));
  if (repeats != repeats_) cache_.clear();
  repeats_ = repeats;
}

namespace {

// What is live per category at the first moment the trace reaches its highest total.
Breakdown live_at_peak(const Arena& a) {
  Breakdown cur, best;
  cur.bytes = a.trace_base();
  best = cur;
  std::int64_t best_total = cur.total(), total = best_total;
  for (const TraceEvent& e : a.trace()) {
    const auto d = static_cast<std::int64_t>(e.rounded) * (e.is_alloc ? 1 : -1);
    cur.bytes[static_cast<int>(e.category)] += d;
    total += d;
    if (total > best_total) best_total = total, best = cur;
  }
  return best;
}

}  // namespace

Planner::Planner(std::shared_ptr<Arena> arena, StepFn step) : arena_(std::move(arena)), step_(std::move(step)) {
  if (!arena_) throw Error("Planner: no arena");
}

Planner::Probe Planner::probe(const std::vector<std::int64_t>& sizes, bool detailed,
                              std::optional<std::size_t> capacity) {
  ++probes_;
  Probe p;
  const FlopCount before = flop_count();
  flop_count() = {};
  struct Restore {  // the caller's count goes on as if the dry run had not happened
    FlopCount saved;
    ~Restore() { flop_count() = saved; }
  } restore{before};
  std::shared_ptr<Arena> v, host;  // the dry run's arenas, read after it ends
  try {
    DryRun dry(*arena_, capacity);
    v = dry.arena_ptr();
    host = dry.host_arena();
    if (prepare_) prepare_(*v, host.get());
    v->reset_peak();
    v->set_tracing(detailed);
    if (host) {
      host->reset_peak();
      host->set_tracing(detailed);
    }
    step_(sizes);
  } catch (const OutOfMemory&) {
    return p;
  } catch (const ShapeError& e) {
    p.error = e.what();
    return p;
  }
  p.fits = true;
  p.flops = flop_count();
  p.peak = static_cast<std::size_t>(v->stats().total.peak);
  p.high_water = v->stats().high_water;
  if (detailed) p.at_peak = live_at_peak(*v);
  if (host) {
    p.host_peak = static_cast<std::size_t>(host->stats().total.peak);
    p.host_high_water = host->stats().high_water;
    p.host_capacity = host->capacity();
    if (detailed) p.host_at_peak = live_at_peak(*host);
  }
  return p;
}

std::shared_ptr<Arena> Planner::traced(const std::vector<std::int64_t>& sizes) {
  DryRun dry(*arena_);
  std::shared_ptr<Arena> v = dry.arena_ptr();
  if (prepare_) prepare_(*v, dry.host_arena().get());
  v->reset_peak();
  v->set_tracing(true);
  step_(sizes);
  v->set_tracing(false);
  return v;
}

void Planner::throw_too_small(std::int64_t batch, std::int64_t m, const std::string& why) {
  // Measure what the split would need on a clone with room to spare.
  const Probe need = probe(Split::of(batch, m).shortened(repeats_), true, unbounded_capacity(*arena_));
  if (!need.error.empty()) throw Error(fmt::format("micro-batches of {} cannot run: {}", m, need.error));
  const std::string needs =
      need.fits ? fmt::format("needs a memory limit of at least {} ({} bytes); live at its peak: {}",
                              format_bytes(need.high_water), need.high_water, need.at_peak.str())
                : std::string("needs more memory than can be measured");
  throw OutOfMemory(fmt::format("memory limit {} ({} bytes) is too small: {} — a training step with micro-batches of "
                                "{} {}",
                                format_bytes(arena_->capacity()), arena_->capacity(), why, m, needs),
                    need.high_water);
}

const Plan& Planner::plan(std::int64_t batch, std::optional<std::int64_t> micro_batch, std::int64_t max_micro_batch,
                          const std::string& variant) {
  if (batch < 1) throw Error(fmt::format("plan: batch size must be >= 1, found {}", batch));
  if (micro_batch && (*micro_batch < 1 || *micro_batch > batch))
    throw Error(fmt::format("plan: a fixed micro-batch size must be between 1 and the batch size {}, found {}", batch, *micro_batch));
  if (max_micro_batch < 1) throw Error(fmt::format("plan: upper limit on the micro-batch must be >= 1, found {}", max_micro_batch));
  const auto key =
      std::make_tuple(batch, arena_->capacity(), std::min(max_micro_batch, batch), micro_batch.value_or(0), variant);
  if (auto it = cache_.find(key); it != cache_.end()) return it->second;

  const auto t0 = std::chrono::steady_clock::now();
  const int probes0 = probes_;
  const std::int64_t hi_limit = std::min(max_micro_batch, batch);
  std::int64_t m = 0;
  if (micro_batch) {
    m = *micro_batch;
  } else {
    // Gallop: 1, 2, 4, ... while the split fits; sizes whose split cannot run at all are passed over.
    std::int64_t lo = 0, hi = 0;  // lo: largest size known to fit (0: none yet); hi (> 0): fails
    std::string cannot_run;
    for (std::int64_t next = 1;; next = std::min(next * 2, hi_limit)) {
      const Probe p = probe(Split::of(batch, next).shortened(repeats_), false);
      if (p.fits) {
        lo = next;
        if (next == hi_limit) break;
      } else if (!p.error.empty() && lo == 0) {
        cannot_run = p.error;
        if (next == hi_limit) throw Error(fmt::format("no micro-batch size can run: {}", cannot_run));
      } else {
        hi = next;
        break;
      }
    }
    if (lo == 0)
      throw_too_small(batch, hi, hi == 1 ? std::string("not even one sample fits")
                                         : fmt::format("the smallest micro-batch that can run ({} samples; fewer cannot: "
                                                       "{}) does not fit", hi, cannot_run));
    // Bisect (lo fits, hi does not).
    while (hi > 0 && hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      (probe(Split::of(batch, mid).shortened(repeats_), false).fits ? lo : hi) = mid;
    }
    m = lo;
  }
  // Verify the exact split with a traced dry run (every micro-batch up to kVerifyAll of them, else
  // the shortened split). A shortened probe that fit should not differ, but if it ever does, step
  // down until the verified split fits.
  Probe full;
  Split split;
  std::vector<std::int64_t> verified;
  for (;;) {
    split = Split::of(batch, m);
    verified = split.count() <= kVerifyAll ? split.sizes() : split.shortened(repeats_);
    full = probe(verified, true);
    if (full.fits) break;
    if (!full.error.empty()) throw Error(fmt::format("micro-batches of {} cannot run: {}", m, full.error));
    if (micro_batch) throw_too_small(batch, m, fmt::format("the fixed micro-batch of {} does not fit", m));
    if (m == 1) throw_too_small(batch, 1, "not even one sample fits");
    --m;
  }
  Plan p;
  p.batch_size = batch;
  p.split = split;
  p.micro_batches = split.count();
  p.micro_batch = split.large;
  p.predicted_peak = full.peak;
  p.budget = arena_->capacity();
  p.at_peak = full.at_peak;
  p.host_predicted_peak = full.host_peak;
  p.host_budget = full.host_capacity;
  p.host_at_peak = full.host_at_peak;
  p.flops = full.flops;
  if (const std::int64_t ran = std::accumulate(verified.begin(), verified.end(), std::int64_t(0)); ran != batch) {
    const double scale = static_cast<double>(batch) / static_cast<double>(ran);  // work is per sample
    p.flops.forward *= scale, p.flops.recompute *= scale, p.flops.backward *= scale;
  }
  p.probes = probes_ - probes0;
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return cache_.emplace(key, std::move(p)).first->second;
}

}  // namespace tally::mbp
