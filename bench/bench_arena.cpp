// bench/bench_arena.cpp — arena allocate/free throughput against malloc/free (and cudaMalloc/
// cudaFree when a GPU is present), on the same pseudo-random size sequence.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <random>

#include "core/arena.h"
#include "core/device.h"

using namespace tally;

namespace {
// A pattern like a training step: allocate a window of 64 live blocks, free the oldest.
std::vector<std::size_t> sizes(std::size_t n) {
  std::mt19937 rng(1);
  std::vector<std::size_t> s(n);
  for (auto& x : s) x = 256 + rng() % (1 << 20);
  return s;
}
constexpr int kWindow = 64;

void BM_ArenaAllocFree(benchmark::State& st) {
  Arena a(Device::cpu(), std::size_t(1) << 30);
  const auto sz = sizes(4096);
  std::vector<std::size_t> ring(kWindow, SIZE_MAX);
  std::size_t i = 0;
  for (auto _ : st) {
    auto& slot = ring[i % kWindow];
    if (slot != SIZE_MAX) a.free(slot);
    slot = a.allocate(sz[i % sz.size()], Category::activation, "bench").offset;
    ++i;
  }
  for (auto s : ring) if (s != SIZE_MAX) a.free(s);
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()));
}
BENCHMARK(BM_ArenaAllocFree);

void BM_VirtualArenaAllocFree(benchmark::State& st) {
  auto a = Arena::make_virtual(Device::cpu(), std::size_t(1) << 30);
  const auto sz = sizes(4096);
  std::vector<std::size_t> ring(kWindow, SIZE_MAX);
  std::size_t i = 0;
  for (auto _ : st) {
    auto& slot = ring[i % kWindow];
    if (slot != SIZE_MAX) a->free(slot);
    slot = a->allocate(sz[i % sz.size()], Category::activation, "bench").offset;
    ++i;
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()));
}
BENCHMARK(BM_VirtualArenaAllocFree);

void BM_MallocFree(benchmark::State& st) {
  const auto sz = sizes(4096);
  std::vector<void*> ring(kWindow, nullptr);
  std::size_t i = 0;
  for (auto _ : st) {
    auto& slot = ring[i % kWindow];
    std::free(slot);
    slot = std::malloc(sz[i % sz.size()]);
    benchmark::DoNotOptimize(slot);
    ++i;
  }
  for (auto p : ring) std::free(p);
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()));
}
BENCHMARK(BM_MallocFree);

void BM_CudaMallocFree(benchmark::State& st) {
  if (cuda_device_count() == 0) {
    st.SkipWithError("no GPU present");
    return;
  }
  const auto sz = sizes(4096);
  std::vector<void*> ring(kWindow, nullptr);
  std::size_t i = 0;
  for (auto _ : st) {
    auto& slot = ring[i % kWindow];
    if (slot) cuda_release(slot);
    slot = cuda_reserve(0, sz[i % sz.size()]);
    ++i;
  }
  for (auto p : ring) if (p) cuda_release(p);
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()));
}
BENCHMARK(BM_CudaMallocFree);

void BM_CudaArenaAllocFree(benchmark::State& st) {
  if (cuda_device_count() == 0) {
    st.SkipWithError("no GPU present");
    return;
  }
  Arena a(Device::cuda(0), std::size_t(1) << 30);
  const auto sz = sizes(4096);
  std::vector<std::size_t> ring(kWindow, SIZE_MAX);
  std::size_t i = 0;
  for (auto _ : st) {
    auto& slot = ring[i % kWindow];
    if (slot != SIZE_MAX) a.free(slot);
    slot = a.allocate(sz[i % sz.size()], Category::activation, "bench").offset;
    ++i;
  }
  st.SetItemsProcessed(static_cast<std::int64_t>(st.iterations()));
}
BENCHMARK(BM_CudaArenaAllocFree);
}  // namespace

BENCHMARK_MAIN();
