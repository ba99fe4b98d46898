// core/arena.cpp — best-fit arena with splitting and coalescing; see core/arena.h for the design.
#include "core/arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/device.h"

namespace tally {

const char* category_name(Category c) {
  switch (c) {
    case Category::parameter: return "parameter";
    case Category::gradient: return "gradient";
    case Category::optimizer_state: return "optimizer_state";
    case Category::activation: return "activation";
    case Category::workspace: return "workspace";
    case Category::input: return "input";
    case Category::temporary: return "temporary";
  }
  return "?";
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::other: return "other";
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::recompute: return "recompute";
  }
  return "?";
}

namespace {
thread_local AllocationSite tl_site;
}  // namespace
const AllocationSite& allocation_site() { return tl_site; }
AllocationSiteScope::AllocationSiteScope(AllocationSite site) : previous_(tl_site) { tl_site = site; }
AllocationSiteScope::~AllocationSiteScope() { tl_site = previous_; }

Arena::Arena(Device device, std::size_t capacity) : Arena(device, capacity, Reserve::ordinary) {}

Arena::Arena(Device device, std::size_t capacity, Reserve reserve)
    : device_(device),
      capacity_(capacity / kAlignment * kAlignment),
      budget_(capacity_),
      t0_(std::chrono::steady_clock::now()) {
  static const bool poison_from_env = [] {  // read once: the planner makes many virtual clones
    const char* v = std::getenv("TALLY_ARENA_POISON");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  poison_freed_ = poison_from_env;
  if (capacity_ == 0)
    throw Error(fmt::format("arena on {}: capacity {} bytes is below the {}-byte alignment",
                            device.str(), capacity, kAlignment));
  if (reserve == Reserve::pinned) {
    base_ = cuda_host_reserve(capacity_);
    pinned_ = true;
  } else if (reserve == Reserve::ordinary) {
    if (device.is_cpu()) {
      void* p = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED)
        throw Error(fmt::format("arena on cpu: mmap of {} ({} bytes) failed: {}",
                                format_bytes(capacity_), capacity_, std::strerror(errno)));
      base_ = p;
    } else {
      base_ = cuda_reserve(device.index, capacity_);
    }
  }
  blocks_.emplace(0, Node{capacity_, false, 0, Category::temporary, {}, {}, Phase::other});
  free_set_.emplace(capacity_, 0);
}

std::shared_ptr<Arena> Arena::make_virtual(Device device, std::size_t capacity) {
  return std::shared_ptr<Arena>(new Arena(device, capacity, Reserve::none));
}

std::shared_ptr<Arena> Arena::make_host(std::size_t capacity) {
  return std::shared_ptr<Arena>(
      new Arena(Device::cpu(), capacity, cuda_available() ? Reserve::pinned : Reserve::ordinary));
}

std::shared_ptr<Arena> Arena::virtual_clone() const {
  auto v = std::shared_ptr<Arena>(new Arena(device_, capacity_, Reserve::none));
  v->budget_ = budget_;
  v->blocks_ = blocks_;
  v->free_set_ = free_set_;
  v->cat_ = cat_;
  v->total_ = total_;
  v->high_water_ = high_water_;
  v->tracing_ = tracing_;
  for (int c = 0; c < kNumCategories; ++c) v->trace_base_[c] = cat_[c].current;
  v->t0_ = t0_;
  return v;
}

std::shared_ptr<Arena> Arena::virtual_clone(std::size_t capacity) const {
  capacity = capacity / kAlignment * kAlignment;
  if (capacity < capacity_)
    throw Error(fmt::format("arena on {}: a virtual clone cannot shrink the capacity from {} to {} bytes",
                            device_.str(), capacity_, capacity));
  auto v = virtual_clone();
  if (capacity == capacity_) return v;
  const std::size_t extra = capacity - capacity_;
  v->capacity_ = capacity;
  auto last = std::prev(v->blocks_.end());
  if (!last->second.used) {  // grow the free tail
    v->free_set_.erase({last->second.size, last->first});
    last->second.size += extra;
    v->free_set_.emplace(last->second.size, last->first);
  } else {
    v->blocks_.emplace(capacity_, Node{extra, false, 0, Category::temporary, {}, {}, Phase::other});
    v->free_set_.emplace(extra, capacity_);
  }
  return v;
}

void Arena::set_tracing(bool on) {
  if (on && !tracing_) clear_trace();
  tracing_ = on;
}

void Arena::clear_trace() {
  trace_.clear();
  marks_.clear();
  for (int c = 0; c < kNumCategories; ++c) trace_base_[c] = cat_[c].current;
}

void Arena::mark(std::string label) {
  if (!tracing_) return;
  const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
  marks_.push_back(TraceMark{t, trace_.size(), std::move(label)});
}

Arena::~Arena() {
  if (!base_) return;
  if (pinned_)
    cuda_host_release(base_);
  else if (device_.is_cpu())
    ::munmap(base_, capacity_);
  else
    cuda_release(base_);
}

Block Arena::allocate(std::size_t bytes, Category category, const std::string& op) {
  const std::size_t rounded = round_up(bytes);
  if (bytes > capacity_) throw_oom(bytes, rounded, category, op, false);
  if (fail_countdown_ > 0 && --fail_countdown_ == 0) {
    if (!fail_action_) throw_oom(bytes, rounded, category, op, true);
    std::function<void()> action = std::move(fail_action_);
    fail_action_ = nullptr;
    action();
  }
  auto it = free_set_.lower_bound({rounded, 0});
  if (it == free_set_.end()) throw_oom(bytes, rounded, category, op, false);
  if (it->first + it->second == capacity_) {  // the tail: only if no other free block fits
    auto other = std::next(it);
    if (other != free_set_.end()) it = other;
  }
  const auto [size, offset] = *it;
  free_set_.erase(it);
  Node& n = blocks_.at(offset);
  if (size > rounded) {  // split: the tail stays free
    blocks_.emplace(offset + rounded, Node{size - rounded, false, 0, Category::temporary, {}, {}, Phase::other});
    free_set_.emplace(size - rounded, offset + rounded);
  }
  n = Node{rounded, true, bytes, category, op, {}, Phase::other};
  if (tracing_) {
    const AllocationSite& site = allocation_site();
    if (site.module) n.module = *site.module;
    n.phase = site.phase;
  }
  high_water_ = std::max(high_water_, offset + rounded);
  const auto r = static_cast<std::int64_t>(rounded);
  for (MemoryStat* s : {&cat_[static_cast<int>(category)], &total_}) {
    s->current += r;
    s->peak = std::max(s->peak, s->current);
    s->allocations++;
  }
  if (tracing_) record(true, offset, n);
  return {offset, base_ ? static_cast<char*>(base_) + offset : nullptr};
}

void Arena::free(std::size_t offset) {
  auto it = blocks_.find(offset);
  if (it == blocks_.end() || !it->second.used)
    throw Error(fmt::format("arena on {}: free of offset {} that is not a live allocation",
                            device_.str(), offset));
  Node& n = it->second;
  const auto r = static_cast<std::int64_t>(n.size);
  for (MemoryStat* s : {&cat_[static_cast<int>(n.category)], &total_}) {
    s->current -= r;
    s->frees++;
  }
  if (tracing_) record(false, offset, n);
  if (poison_freed_ && base_ && device_.is_cpu()) std::memset(static_cast<char*>(base_) + offset, 0xFF, n.size);
  n.used = false;
  n.requested = 0;
  n.op.clear();
  // Coalesce with the next block, then with the previous one.
  auto next = std::next(it);
  if (next != blocks_.end() && !next->second.used) {
    free_set_.erase({next->second.size, next->first});
    n.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (!prev->second.used) {
      free_set_.erase({prev->second.size, prev->first});
      prev->second.size += n.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  free_set_.emplace(it->second.size, it->first);
}

std::size_t Arena::largest_free_block() const {
  return free_set_.empty() ? 0 : free_set_.rbegin()->first;
}

std::uint64_t Arena::layout_hash() const {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a over the words below
  const auto mix = [&h](std::uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  };
  mix(reinterpret_cast<std::uintptr_t>(base_));
  mix(capacity_);
  for (const auto& [offset, n] : blocks_) {
    mix(offset);
    mix(n.size);
    mix(n.used ? 1 : 0);
  }
  return h;
}

ArenaStats Arena::stats() const {
  ArenaStats s;
  s.by_category = cat_;
  s.total = total_;
  s.capacity = capacity_;
  s.high_water = high_water_;
  s.free_bytes = free_bytes();
  s.largest_free_block = largest_free_block();
  return s;
}

void Arena::reset_peak() {
  for (auto& c : cat_) c.peak = c.current;
  total_.peak = total_.current;
  const auto last = std::prev(blocks_.end());
  high_water_ = last->second.used ? capacity_ : last->first;
}

Arena::Peaks Arena::peaks() const {
  Peaks p;
  for (int c = 0; c < kNumCategories; ++c) p.by_category[c] = cat_[c].peak;
  p.total = total_.peak;
  p.high_water = high_water_;
  return p;
}

void Arena::raise_peaks(const Peaks& at_least) {
  for (int c = 0; c < kNumCategories; ++c) cat_[c].peak = std::max(cat_[c].peak, at_least.by_category[c]);
  total_.peak = std::max(total_.peak, at_least.total);
  high_water_ = std::max(high_water_, at_least.high_water);
}

Arena::Counts Arena::counts() const {
  Counts c;
  for (int k = 0; k < kNumCategories; ++k) c.allocations[k] = cat_[k].allocations, c.frees[k] = cat_[k].frees;
  return c;
}

void Arena::count_replayed(const Counts& c) {
  std::int64_t allocations = 0;
  for (int k = 0; k < kNumCategories; ++k) {
    cat_[k].allocations += c.allocations[k], cat_[k].frees += c.frees[k];
    total_.allocations += c.allocations[k], total_.frees += c.frees[k];
    allocations += c.allocations[k];
  }
  // The caller ran the work instead where the countdown would fire in it (fault_within).
  if (fail_countdown_ > 0) fail_countdown_ -= std::min<std::uint64_t>(fail_countdown_ - 1, allocations);
}

std::vector<std::pair<std::size_t, Arena::LiveInfo>> Arena::live_blocks() const {
  std::vector<std::pair<std::size_t, LiveInfo>> out;
  for (const auto& [off, n] : blocks_)
    if (n.used) out.push_back({off, LiveInfo{n.requested, n.size, n.category, n.op}});
  return out;
}

void Arena::throw_oom(std::size_t requested, std::size_t rounded, Category category,
                      const std::string& op, bool injected) const {
  std::string live;
  for (int c = 0; c < kNumCategories; ++c)
    if (cat_[c].current > 0)
      live += fmt::format("{}{} {}", live.empty() ? "" : ", ", category_name(static_cast<Category>(c)),
                          format_bytes(static_cast<std::size_t>(cat_[c].current)));
  throw OutOfMemory(
      fmt::format("out of memory on {}{}: {} asked for {} bytes ({}, category {}, {} rounded); "
                  "capacity {}, free {}, largest free block {}; live: {}",
                  device_.str(), injected ? " (injected fault)" : "", op.empty() ? "an allocation" : op,
                  requested, format_bytes(requested), category_name(category), rounded,
                  format_bytes(capacity_), format_bytes(free_bytes()),
                  format_bytes(largest_free_block()), live.empty() ? "nothing" : live),
      requested);
}

void Arena::record(bool is_alloc, std::size_t offset, const Node& n) {
  const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
  trace_.push_back(TraceEvent{t, is_alloc, offset, n.requested, n.size, n.category, n.op,
                              total_.current, n.module, n.phase});
}

std::string Arena::trace_json() const {
  using nlohmann::json;
  json events = json::array();
  std::array<std::int64_t, kNumCategories> live = trace_base_;
  const int pid = 1;
  events.push_back({{"ph", "M"}, {"pid", pid}, {"name", "process_name"},
                    {"args", {{"name", fmt::format("tally arena {}", device_.str())}}}});
  for (const TraceEvent& e : trace_) {
    live[static_cast<int>(e.category)] += (e.is_alloc ? 1 : -1) * static_cast<std::int64_t>(e.rounded);
    events.push_back({{"ph", "i"}, {"s", "p"}, {"pid", pid}, {"tid", 1}, {"ts", e.time_us},
                      {"cat", e.is_alloc ? "alloc" : "free"},
                      {"name", fmt::format("{} {}", e.is_alloc ? "alloc" : "free", e.op)},
                      {"args", {{"offset", e.offset}, {"requested", e.requested}, {"size", e.rounded},
                                {"category", category_name(e.category)}, {"op", e.op},
                                {"module", e.module}, {"phase", phase_name(e.phase)},
                                {"total_after", e.total_after}}}});
    json counters = json::object();
    for (int c = 0; c < kNumCategories; ++c) counters[category_name(static_cast<Category>(c))] = live[c];
    events.push_back({{"ph", "C"}, {"pid", pid}, {"ts", e.time_us}, {"name", "live bytes"},
                      {"args", counters}});
  }
  for (const TraceMark& m : marks_)
    events.push_back({{"ph", "i"}, {"s", "g"}, {"pid", pid}, {"tid", 1}, {"ts", m.time_us}, {"cat", "mark"},
                      {"name", m.label}});
  json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  return doc.dump();
}

std::size_t parse_size(const std::string& s) {
  const auto bad = [&]() {
    return Error(fmt::format("invalid size '{}': expected a number with an optional unit "
                             "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (e.g. 48MiB, 2GiB)", s));
  };
  std::size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) throw bad();
  double v = 0;
  try {
    std::size_t used = 0;
    v = std::stod(s.substr(0, i), &used);
    if (used != i) throw bad();  // "1.2.3MiB": stod stops at the second point, the rest is no unit
  } catch (...) {
    throw bad();
  }
  std::string unit = s.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  static const std::pair<const char*, double> units[] = {
      {"", 1.0},        {"B", 1.0},           {"KiB", 1024.0},         {"MiB", 1048576.0},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6},
      {"GB", 1e9},      {"TB", 1e12},         {"K", 1024.0},           {"M", 1048576.0},
      {"G", 1073741824.0}};
  for (const auto& [name, mult] : units)
    if (unit == name) {
      const double bytes = v * mult;
      if (bytes < 1) throw Error(fmt::format("size '{}' is less than one byte: expected a size such as 48MiB or 2GiB", s));
      if (!std::isfinite(bytes) || bytes > 1.8e19)
        throw Error(fmt::format("size '{}' is beyond what 64 bits count (16 EiB): expected a size such as 48MiB or 2GiB", s));
      return static_cast<std::size_t>(bytes);
    }
  throw bad();
}

std::string format_bytes(std::size_t b) {
  const double d = static_cast<double>(b);
  if (b < 1024) return fmt::format("{} B", b);
  if (d < 1048576.0) return fmt::format("{:.1f} KiB", d / 1024.0);
  if (d < 1073741824.0) return fmt::format("{:.1f} MiB", d / 1048576.0);
  return fmt::format("{:.2f} GiB", d / 1073741824.0);
}

}  // namespace tally
