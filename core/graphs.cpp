// core/graphs.cpp — recorded device work and its replay; see core/graphs.h.
#include "core/graphs.h"

#include <utility>

#include <fmt/format.h>

#include "core/arena.h"
#include "core/error.h"
#include "core/ops.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally {

namespace {

// What the recording on this thread has gathered so far (null: none under way).
struct Recording {
  std::vector<std::function<void()>> effects;
  std::string why_not;
};
thread_local Recording* g_recording = nullptr;

// The backend's side, a template so that a build without CUDA never needs its definitions (the
// branch that names it is discarded there: core/staging.cpp does the same).
template <class Graph = kernels::cuda::Graph>
struct CudaCapture {
  bool open = false;
  void begin(int device) {
    kernels::cuda::use_device(device);
    kernels::cuda::begin_capture();
    open = true;
  }
  std::shared_ptr<Graph> end() {
    open = false;
    return std::make_shared<Graph>(kernels::cuda::end_capture());
  }
  ~CudaCapture() {
    if (open) kernels::cuda::abandon_capture();
  }
};

FlopCount minus(const FlopCount& a, const FlopCount& b) {
  return {a.forward - b.forward, a.recompute - b.recompute, a.backward - b.backward};
}

}  // namespace

void on_replay(std::function<void()> effect) {
  if (g_recording) g_recording->effects.push_back(std::move(effect));
}

void not_replayable(const std::string& why) {
  if (g_recording && g_recording->why_not.empty()) g_recording->why_not = why;
}

bool recording_device_work() { return g_recording != nullptr; }

DeviceGraph record_device_work(Device device, Arena& arena, const std::function<void()>& work) {
  if (!device.is_cuda())
    throw Error(fmt::format("record_device_work: device work is recorded on a GPU, found {}", device.str()));
  if (g_recording) throw Error("record_device_work: a recording is already under way on this thread");
  DeviceGraph g;
  if constexpr (kHaveCudaBackend) {
    if (kernels::cuda::profiling())  // CUDA refuses to read an event recorded in a capture
      throw Error("record_device_work: ops are being timed (a Profiler is on), and the events that time them "
                  "cannot be read once recorded in a graph");
    const std::uint64_t before = arena.layout_hash();
    const FlopCount flops = flop_count();
    // From here the arena's peaks are the work's own, which each replay reaches again.
    const Arena::Peaks earlier = arena.peaks();
    const Arena::Counts counted = arena.counts();
    arena.reset_peak();
    Recording rec;
    CudaCapture<> capture;
    capture.begin(device.index);
    g_recording = &rec;
    try {
      work();
    } catch (...) {
      g_recording = nullptr;
      arena.raise_peaks(earlier);
      throw;  // the capture is abandoned on the way out
    }
    g_recording = nullptr;
    const Arena::Peaks reached = arena.peaks();
    arena.raise_peaks(earlier);
    auto graph = capture.end();
    if (arena.layout_hash() != before)
      throw Error("record_device_work: the recorded work left the arena's layout other than it found it (it "
                  "allocated what it did not free), so a replay, which allocates nothing, would not match a run");
    const FlopCount added = minus(flop_count(), flops);
    Arena::Counts calls = arena.counts();
    for (int k = 0; k < kNumCategories; ++k)
      calls.allocations[k] -= counted.allocations[k], calls.frees[k] -= counted.frees[k];
    for (const std::int64_t n : calls.allocations) g.allocations_ += static_cast<std::uint64_t>(n);
    rec.effects.push_back([added, reached, calls, a = &arena] {
      FlopCount& f = flop_count();
      f.forward += added.forward, f.recompute += added.recompute, f.backward += added.backward;
      a->raise_peaks(reached);
      a->count_replayed(calls);
    });
    g.nodes_ = graph->nodes();
    g.device_bytes_ = graph->device_bytes();
    g.launch_ = [graph, index = device.index] {
      kernels::cuda::use_device(index);
      graph->launch();
    };
    g.graph_ = graph;
    g.effects_ = std::move(rec.effects);
    g.why_not_ = std::move(rec.why_not);
    graph->launch();  // the recording is the micro-batch's run
    return g;
  } else {
    (void)arena, (void)work;
    throw Error(fmt::format("record_device_work on {}: this build of tally has no CUDA backend", device.str()));
  }
}

void DeviceGraph::replay() const {
  if (!replayable()) throw Error(fmt::format("DeviceGraph: this recording may not be replayed ({})", why_not_));
  launch_();
  for (const auto& effect : effects_) effect();
}

}  // namespace tally
