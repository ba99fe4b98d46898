// Arena tests: a randomized sequence of >= 100k allocations and frees checked step by step against
// a deliberately simple reference model (a linear list of blocks), plus OOM, trace and stats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "core/arena.h"
#include "core/error.h"
#include "core/graphs.h"
#include "core/memory.h"
#include "core/tensor.h"

using namespace tally;

namespace {

// Reference: blocks in offset order in a plain vector; best fit = smallest free block that fits,
// lowest offset among equals, the tail (the free block ending at the capacity) only when no other
// fits; split front; coalesce neighbours on free.
struct RefArena {
  struct B { std::size_t off, size; bool used; };
  std::vector<B> blocks;
  explicit RefArena(std::size_t cap) { blocks.push_back({0, cap, false}); }
  std::optional<std::size_t> alloc(std::size_t rounded) {
    int best = -1;
    const int n = static_cast<int>(blocks.size());
    const bool has_tail = !blocks[n - 1].used;
    for (int i = 0; i < n - (has_tail ? 1 : 0); ++i)
      if (!blocks[i].used && blocks[i].size >= rounded && (best < 0 || blocks[i].size < blocks[best].size)) best = i;
    if (best < 0 && has_tail && blocks[n - 1].size >= rounded) best = n - 1;
    if (best < 0) return std::nullopt;
    B b = blocks[best];
    blocks[best] = {b.off, rounded, true};
    if (b.size > rounded) blocks.insert(blocks.begin() + best + 1, {b.off + rounded, b.size - rounded, false});
    return b.off;
  }
  void free(std::size_t off) {
    auto it = std::find_if(blocks.begin(), blocks.end(), [&](const B& b) { return b.off == off; });
    ASSERT_TRUE(it != blocks.end() && it->used);
    it->used = false;
    if (it + 1 != blocks.end() && !(it + 1)->used) { it->size += (it + 1)->size; blocks.erase(it + 1); }
    if (it != blocks.begin() && !(it - 1)->used) { (it - 1)->size += it->size; blocks.erase(it); }
  }
  std::size_t largest_free() const {
    std::size_t m = 0;
    for (auto& b : blocks) if (!b.used) m = std::max(m, b.size);
    return m;
  }
};

}  // namespace

TEST(Arena, RandomizedAgainstReferenceModel) {
  const std::size_t cap = 64 << 20;
  Arena real(Device::cpu(), cap);
  auto virt = Arena::make_virtual(Device::cpu(), cap);
  RefArena ref(cap);
  std::mt19937_64 rng(12345);
  struct Live { std::size_t off, requested, rounded; Category cat; void* ptr; };
  std::vector<Live> live;
  std::array<std::int64_t, kNumCategories> cur{}, peak{}, allocs{}, frees{};
  std::int64_t total = 0, total_peak = 0;
  std::size_t high_water = 0;
  int ooms = 0;
  const int kOps = 120000;
  for (int op = 0; op < kOps; ++op) {
    const bool do_alloc = live.empty() || (rng() % 100) < 55;
    if (do_alloc) {
      // sizes spanning 1 byte .. 4 MiB, skewed to small, sometimes exact multiples of 256
      std::size_t req = (rng() % 4 == 0) ? (1 + rng() % 64) * 256 : 1 + rng() % (std::size_t(1) << (rng() % 22 + 1));
      const auto cat = static_cast<Category>(rng() % kNumCategories);
      const std::size_t rounded = Arena::round_up(req);
      auto expect = ref.alloc(rounded);
      if (!expect) {
        const ArenaStats before = real.stats();
        EXPECT_THROW(real.allocate(req, cat, "test"), OutOfMemory);
        EXPECT_THROW(virt->allocate(req, cat, "test"), OutOfMemory);
        const ArenaStats after = real.stats();
        EXPECT_EQ(before.total.current, after.total.current);
        EXPECT_EQ(before.total.allocations, after.total.allocations);
        EXPECT_EQ(before.largest_free_block, after.largest_free_block);
        ++ooms;
        continue;
      }
      const Block b = real.allocate(req, cat, "test");
      const Block v = virt->allocate(req, cat, "test");
      ASSERT_EQ(b.offset, *expect) << "op " << op;
      ASSERT_EQ(v.offset, b.offset) << "virtual arena diverged at op " << op;
      ASSERT_EQ(v.ptr, nullptr);
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b.ptr) % Arena::kAlignment, 0u);
      ASSERT_EQ(b.offset % Arena::kAlignment, 0u);
      // touch first and last byte: the block really is ours and inside the mapping
      static_cast<char*>(b.ptr)[0] = 1;
      static_cast<char*>(b.ptr)[req - 1] = 2;
      live.push_back({b.offset, req, rounded, cat, b.ptr});
      const int c = static_cast<int>(cat);
      cur[c] += rounded; peak[c] = std::max(peak[c], cur[c]); allocs[c]++;
      total += rounded; total_peak = std::max(total_peak, total);
      high_water = std::max(high_water, b.offset + rounded);
      ASSERT_EQ(real.stats().high_water, high_water);
    } else {
      const std::size_t i = rng() % live.size();
      const Live l = live[i];
      live[i] = live.back();
      live.pop_back();
      real.free(l.off);
      virt->free(l.off);
      ref.free(l.off);
      const int c = static_cast<int>(l.cat);
      cur[c] -= l.rounded; frees[c]++;
      total -= l.rounded;
    }
    if (op % 997 == 0) {  // full invariant check now and then (it is O(n))
      const ArenaStats s = real.stats();
      ASSERT_EQ(s.total.current, total);
      ASSERT_EQ(s.total.peak, total_peak);
      for (int c = 0; c < kNumCategories; ++c) {
        ASSERT_EQ(s.by_category[c].current, cur[c]);
        ASSERT_EQ(s.by_category[c].peak, peak[c]);
        ASSERT_EQ(s.by_category[c].allocations, allocs[c]);
        ASSERT_EQ(s.by_category[c].frees, frees[c]);
      }
      ASSERT_EQ(s.free_bytes, cap - static_cast<std::size_t>(total));
      ASSERT_EQ(s.largest_free_block, ref.largest_free());
      // No overlaps: live blocks sorted by offset are disjoint and match our record.
      auto blocks = real.live_blocks();
      ASSERT_EQ(blocks.size(), live.size());
      for (std::size_t k = 1; k < blocks.size(); ++k)
        ASSERT_LE(blocks[k - 1].first + blocks[k - 1].second.rounded, blocks[k].first);
      // Coalescing: reference and arena agree block for block, so no two free blocks touch.
      std::size_t ref_used = 0;
      for (std::size_t k = 0; k < ref.blocks.size(); ++k) {
        if (k > 0) { ASSERT_FALSE(!ref.blocks[k].used && !ref.blocks[k - 1].used); }
        ref_used += ref.blocks[k].used;
      }
      ASSERT_EQ(ref_used, live.size());
      const ArenaStats vs = virt->stats();
      ASSERT_EQ(vs.total.peak, s.total.peak);
      ASSERT_EQ(vs.largest_free_block, s.largest_free_block);
    }
  }
  EXPECT_GT(ooms, 0) << "the sequence should have exercised out-of-memory";
  for (const Live& l : live) { real.free(l.off); virt->free(l.off); }
  EXPECT_EQ(real.stats().total.current, 0);
  EXPECT_EQ(real.largest_free_block(), real.capacity());  // fully coalesced again
}

TEST(Arena, SameSequenceSameOffsetsAndPeak) {
  auto run = [](Arena& a) {
    std::mt19937 rng(7);
    std::vector<std::size_t> live, offs;
    for (int i = 0; i < 5000; ++i) {
      if (live.empty() || rng() % 3) {
        auto b = a.allocate(1 + rng() % 100000, Category::activation, "x");
        live.push_back(b.offset);
        offs.push_back(b.offset);
      } else {
        const std::size_t k = rng() % live.size();
        a.free(live[k]);
        live.erase(live.begin() + static_cast<long>(k));
      }
    }
    return std::make_pair(offs, a.stats().total.peak);
  };
  Arena a(Device::cpu(), 256 << 20), b(Device::cpu(), 256 << 20);
  EXPECT_EQ(run(a), run(b));
}

// set_poison_freed (TALLY_ARENA_POISON=1): a freed host block reads as 0xFF bytes — NaN as a
// float — so a tensor read after its memory was handed back cannot pass for a number; off, the
// bytes stay as they were written. Both arenas lay blocks out identically.
TEST(Arena, PoisonedFreesReadAsNaN) {
  for (bool poison : {false, true}) {
    SCOPED_TRACE(poison ? "poison on" : "poison off");
    Arena a(Device::cpu(), 1 << 20);
    a.set_poison_freed(poison);
    EXPECT_EQ(a.poison_freed(), poison);
    const Block keep = a.allocate(256, Category::activation, "keep");
    const Block b = a.allocate(1000, Category::activation, "freed");
    std::memset(keep.ptr, 0x11, 256);
    std::memset(b.ptr, 0x22, 1000);
    a.free(b.offset);
    const auto* bytes = static_cast<const unsigned char*>(b.ptr);
    EXPECT_EQ(std::count(bytes, bytes + 1000, poison ? 0xFF : 0x22), 1000);
    float f;
    std::memcpy(&f, b.ptr, sizeof f);
    EXPECT_EQ(std::isnan(f), poison);
    const auto* kept = static_cast<const unsigned char*>(keep.ptr);
    EXPECT_EQ(std::count(kept, kept + 256, 0x11), 256) << "a live neighbour is never touched";
  }
}

// A replayed recording's calls (core/graphs.h: a CUDA graph of a micro-batch, which allocates
// nothing when replayed): counted per category as if made, and the fault-injection countdown
// advanced by its allocations, so that the n-th allocation still fails where a run would have it;
// fault_within says when a replay would skip over it.
TEST(Arena, ReplayedCallsAreCountedAndAdvanceTheFaultCountdown) {
  Arena a(Device::cpu(), 1 << 20);
  const Block p = a.allocate(512, Category::parameter, "weight");
  a.free(a.allocate(256, Category::activation, "relu").offset);
  const Arena::Counts before = a.counts();
  EXPECT_EQ(before.allocations[static_cast<int>(Category::activation)], 1);
  EXPECT_EQ(before.frees[static_cast<int>(Category::activation)], 1);
  EXPECT_EQ(before.allocations[static_cast<int>(Category::parameter)], 1);
  a.fail_allocation_after(6);
  EXPECT_FALSE(a.fault_within(5));
  EXPECT_TRUE(a.fault_within(6));
  Arena::Counts replayed;
  replayed.allocations[static_cast<int>(Category::activation)] = 3;
  replayed.frees[static_cast<int>(Category::activation)] = 3;
  replayed.allocations[static_cast<int>(Category::workspace)] = 1;
  replayed.frees[static_cast<int>(Category::workspace)] = 1;
  a.count_replayed(replayed);
  const ArenaStats s = a.stats();
  EXPECT_EQ(s[Category::activation].allocations, 4);
  EXPECT_EQ(s[Category::activation].frees, 4);
  EXPECT_EQ(s[Category::workspace].allocations, 1);
  EXPECT_EQ(s.total.allocations, 6);
  EXPECT_EQ(s.total.frees, 5);
  EXPECT_EQ(s.total.current, 512) << "a replay leaves the arena as it found it";
  EXPECT_TRUE(a.fault_within(2));  // 6 - 4: the second allocation from here
  EXPECT_FALSE(a.fault_within(1));
  a.free(a.allocate(64, Category::activation, "first").offset);
  EXPECT_THROW(a.allocate(64, Category::activation, "second"), OutOfMemory);
  a.free(p.offset);
}

// Tail last: a sequence laid out in a large arena, reaching at most offset H, lays out
// identically in an arena of capacity exactly H; one alignment unit less runs out of memory.
// This is what lets the planner state the smallest budget that runs a step.
TEST(Arena, LayoutIndependentOfCapacityDownToTheHighWaterMark) {
  auto run = [](Arena& a, std::vector<std::size_t>& offs) {
    std::mt19937 rng(21);
    std::vector<std::size_t> live;
    for (int i = 0; i < 20000; ++i) {
      if (live.empty() || rng() % 5 < 3) {
        const Block b = a.allocate(1 + rng() % 300000, static_cast<Category>(rng() % kNumCategories), "x");
        live.push_back(b.offset);
        offs.push_back(b.offset);
      } else {
        const std::size_t k = rng() % live.size();
        a.free(live[k]);
        live.erase(live.begin() + static_cast<long>(k));
      }
      if (live.size() > 200) {  // keep the live set bounded so fragmentation, not growth, decides
        a.free(live.front());
        live.erase(live.begin());
      }
    }
  };
  auto big = Arena::make_virtual(Device::cpu(), std::size_t(1) << 36);
  std::vector<std::size_t> ref;
  run(*big, ref);
  const std::size_t H = big->stats().high_water;
  ASSERT_GT(H, 0u);
  ASSERT_LT(H, std::size_t(1) << 36);
  EXPECT_GT(H, static_cast<std::size_t>(big->stats().total.peak)) << "fragmentation: extent above live peak";
  auto exact = Arena::make_virtual(Device::cpu(), H);
  std::vector<std::size_t> offs;
  run(*exact, offs);
  EXPECT_EQ(offs, ref);
  auto less = Arena::make_virtual(Device::cpu(), H - Arena::kAlignment);
  std::vector<std::size_t> ignored;
  EXPECT_THROW(run(*less, ignored), OutOfMemory);
  // A clone with a larger capacity continues with the same layout too.
  Arena a(Device::cpu(), 1 << 20);
  a.allocate(1000, Category::parameter, "w");
  auto wide = a.virtual_clone(std::size_t(1) << 30);
  EXPECT_EQ(wide->capacity(), std::size_t(1) << 30);
  EXPECT_EQ(wide->allocate(5000, Category::activation, "a").offset, a.allocate(5000, Category::activation, "a").offset);
  EXPECT_THROW(a.virtual_clone(1 << 10), Error);
}

TEST(Arena, VirtualCloneContinuesFromTheSameState) {
  Arena a(Device::cpu(), 1 << 20);
  const auto p = a.allocate(1000, Category::parameter, "w");
  const auto q = a.allocate(5000, Category::gradient, "g");
  a.free(p.offset);
  auto v = a.virtual_clone();
  EXPECT_TRUE(v->is_virtual());
  EXPECT_EQ(v->stats().total.current, a.stats().total.current);
  for (std::size_t n : {100u, 3000u, 70000u}) {
    EXPECT_EQ(v->allocate(n, Category::activation, "a").offset, a.allocate(n, Category::activation, "a").offset);
  }
  EXPECT_EQ(v->stats().total.peak, a.stats().total.peak);
  (void)q;
}

// Kernels size their workspaces from the budget (docs/gpu.md): a clone widened for the planner's
// search keeps the budget of the arena it was cloned from, so dry runs choose as the real step.
TEST(Arena, ClonesKeepTheBudgetTheirLineWasCreatedWith) {
  Arena a(Device::cpu(), (48 << 20) + 100);
  EXPECT_EQ(a.budget(), std::size_t(48) << 20);  // rounded down to the alignment, as the capacity
  EXPECT_EQ(a.virtual_clone()->budget(), a.budget());
  const auto wide = a.virtual_clone(std::size_t(48) << 26);
  EXPECT_EQ(wide->capacity(), std::size_t(48) << 26);
  EXPECT_EQ(wide->budget(), a.budget());
  EXPECT_EQ(wide->virtual_clone()->budget(), a.budget());
  EXPECT_EQ(Arena::make_virtual(Device::cpu(), 1 << 20)->budget(), std::size_t(1) << 20);
}

TEST(Arena, OutOfMemoryMessageAndStateUnchanged) {
  Arena a(Device::cpu(), 1 << 20);
  a.allocate(300 << 10, Category::parameter, "conv1.weight");
  auto mid = a.allocate(200 << 10, Category::activation, "relu");
  a.allocate(300 << 10, Category::gradient, "conv1.weight.grad");
  a.free(mid.offset);
  const ArenaStats before = a.stats();
  try {
    a.allocate(400 << 10, Category::activation, "conv2d");
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("conv2d"), std::string::npos) << m;
    EXPECT_NE(m.find("409600 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("largest free block"), std::string::npos) << m;
    EXPECT_NE(m.find("parameter 300.0 KiB"), std::string::npos) << m;
    EXPECT_NE(m.find("gradient 300.0 KiB"), std::string::npos) << m;
    EXPECT_EQ(e.requested(), 400u << 10);
  }
  const ArenaStats after = a.stats();
  EXPECT_EQ(before.total.current, after.total.current);
  EXPECT_EQ(before.total.allocations, after.total.allocations);
  EXPECT_EQ(before.free_bytes, after.free_bytes);
  EXPECT_EQ(before.largest_free_block, after.largest_free_block);
  // and the arena still works
  EXPECT_NO_THROW(a.allocate(100 << 10, Category::activation, "ok"));
}

TEST(Arena, InjectedFaultFailsTheNthAllocation) {
  Arena a(Device::cpu(), 1 << 20);
  a.fail_allocation_after(3);
  a.allocate(10, Category::activation, "1");
  a.allocate(10, Category::activation, "2");
  EXPECT_THROW(a.allocate(10, Category::activation, "3"), OutOfMemory);
  EXPECT_NO_THROW(a.allocate(10, Category::activation, "4"));
  EXPECT_EQ(a.stats().total.allocations, 3);
}

TEST(Arena, StatsResetPeakAndZeroSizedRequests) {
  Arena a(Device::cpu(), 1 << 20);
  auto x = a.allocate(0, Category::temporary, "empty");  // still a distinct block
  auto y = a.allocate(1, Category::temporary, "one");
  EXPECT_NE(x.offset, y.offset);
  EXPECT_EQ(a.stats()[Category::temporary].current, 512);
  a.free(x.offset);
  EXPECT_EQ(a.stats().total.peak, 512);
  a.reset_peak();
  EXPECT_EQ(a.stats().total.peak, 256);
  EXPECT_THROW(a.free(x.offset), Error);       // double free is an error, not a crash
  EXPECT_THROW(a.free(12345), Error);          // unknown offset
}

TEST(Arena, TraceExportsOneEventPerAllocationAndFree) {
  Arena a(Device::cpu(), 1 << 20);
  a.set_tracing(true);
  std::vector<std::size_t> offs;
  for (int i = 0; i < 10; ++i) offs.push_back(a.allocate(100 * (i + 1), static_cast<Category>(i % kNumCategories), "op" + std::to_string(i)).offset);
  for (int i = 0; i < 6; ++i) a.free(offs[i]);
  const auto doc = nlohmann::json::parse(a.trace_json());  // throws if not valid JSON
  int allocs = 0, frees = 0, counters = 0;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "i") {
      (e.at("cat") == "alloc" ? allocs : frees)++;
      EXPECT_TRUE(e.at("args").contains("offset"));
      EXPECT_TRUE(e.at("args").contains("category"));
      EXPECT_TRUE(e.at("args").contains("op"));
    }
    if (e.at("ph") == "C") counters++;
  }
  EXPECT_EQ(allocs, 10);
  EXPECT_EQ(frees, 6);
  EXPECT_EQ(counters, 16);
  EXPECT_EQ(a.trace().size(), 16u);
}

TEST(Arena, LargeCpuBudgetCostsNothingUntilTouched) {
  // 64 GiB of address space on a machine with far less memory: MAP_NORESERVE makes this free.
  Arena a(Device::cpu(), std::size_t(64) << 30);
  auto b = a.allocate(1 << 20, Category::activation, "x");
  static_cast<char*>(b.ptr)[0] = 1;
  EXPECT_EQ(a.capacity(), std::size_t(64) << 30);
}

TEST(Arena, ParseSize) {
  EXPECT_EQ(parse_size("48MiB"), 48u << 20);
  EXPECT_EQ(parse_size("2GiB"), std::size_t(2) << 30);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("1.5KiB"), 1536u);
  EXPECT_EQ(parse_size("1GB"), 1000000000u);
  for (const char* bad : {"", "MiB", "12 parsecs", "-5MiB", "1e400", "0", "1.2.3MiB", "."}) EXPECT_THROW(parse_size(bad), Error) << bad;
}

TEST(Arena, TensorsComeFromTheCurrentArenaAndFreeOnDestruction) {
  auto arena = std::make_shared<Arena>(Device::cpu(), 1 << 20);
  ArenaScope scope(arena);
  {
    Tensor t = Tensor::empty({10, 10}, DType::Float32, Device::cpu(), Category::parameter, "w");
    EXPECT_EQ(arena->stats()[Category::parameter].current, 512);
    Tensor v = t.view({100});  // a view shares the storage
    EXPECT_EQ(arena->stats().total.allocations, 1);
  }
  EXPECT_EQ(arena->stats().total.current, 0);
}

// The layout fingerprint that CUDA graphs are keyed by (core/graphs.h): the same layout, the same
// fingerprint — also in another arena of the same capacity and base, as a virtual clone is — and
// any block that differs (used or free, where it ends) another one.
TEST(Arena, LayoutHashIsTheLayout) {
  const auto a = Arena::make_virtual(Device::cpu(), 1 << 20);
  const std::uint64_t empty = a->layout_hash();
  const Block x = a->allocate(1000, Category::activation, "x");
  const std::uint64_t one = a->layout_hash();
  EXPECT_NE(one, empty);
  const Block y = a->allocate(3000, Category::temporary, "y");
  EXPECT_NE(a->layout_hash(), one);
  a->free(y.offset);
  EXPECT_EQ(a->layout_hash(), one) << "what was allocated and freed leaves the layout as it was";
  EXPECT_EQ(a->virtual_clone()->layout_hash(), one);
  const Block z = a->allocate(5000, Category::temporary, "z");  // another size where y was
  a->free(x.offset);
  const std::uint64_t hole = a->layout_hash();
  EXPECT_NE(hole, empty) << "a free block before a used one is not the empty arena";
  a->free(z.offset);
  EXPECT_EQ(a->layout_hash(), empty);
  EXPECT_NE(Arena::make_virtual(Device::cpu(), 2 << 20)->layout_hash(), empty) << "another capacity";
}

// A replay of recorded device work allocates nothing, so it raises the arena's peaks to those its
// recording reached (core/graphs.h): peaks() reads them, raise_peaks() takes each at least to
// another set's, per category, in total and the high-water mark, and lowers none.
TEST(Arena, PeaksAreRaisedToThoseOfAnotherTime) {
  const auto a = Arena::make_virtual(Device::cpu(), 1 << 20);
  const Block w = a->allocate(1000, Category::parameter, "w");
  const Block t = a->allocate(3000, Category::temporary, "t");
  a->free(t.offset);
  const Arena::Peaks reached = a->peaks();
  EXPECT_EQ(reached.total, 1024 + 3072);
  EXPECT_EQ(reached.by_category[static_cast<int>(Category::temporary)], 3072);
  EXPECT_EQ(reached.high_water, 4096u);
  a->reset_peak();
  EXPECT_EQ(a->peaks().total, 1024);
  EXPECT_EQ(a->peaks().high_water, 1024u);
  const Block g = a->allocate(500, Category::gradient, "g");
  a->raise_peaks(reached);
  const ArenaStats s = a->stats();
  EXPECT_EQ(s.total.peak, 4096);
  EXPECT_EQ(s[Category::temporary].peak, 3072);
  EXPECT_EQ(s[Category::gradient].peak, 512) << "a peak reached since is kept";
  EXPECT_EQ(s.high_water, 4096u);
  a->raise_peaks(Arena::Peaks{});
  EXPECT_EQ(a->stats().total.peak, 4096) << "nothing lowered";
  a->free(g.offset);
  a->free(w.offset);
}

// Recording device work needs a GPU: on the CPU it is an error naming the device, and the hooks
// that ops call while work is recorded (on_replay, not_replayable) do nothing outside a recording.
TEST(Arena, DeviceWorkIsRecordedOnAGpuOnly) {
  const auto a = Arena::make_virtual(Device::cpu(), 1 << 20);
  bool ran = false;
  try {
    (void)record_device_work(Device::cpu(), *a, [&] { ran = true; });
    FAIL() << "recorded on the CPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("recorded on a GPU, found cpu"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(ran);
  EXPECT_FALSE(recording_device_work());
  int effects = 0;
  on_replay([&] { ++effects; });
  not_replayable("a test");
  EXPECT_EQ(effects, 0);
}
