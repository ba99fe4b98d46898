// core/pending.cpp — a scalar read a step late; see core/pending.h.
#include "core/pending.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/error.h"
#include "kernels/common.h"
#include "kernels/cuda/context.h"

namespace tally {

struct PendingScalar::Slot {
  virtual ~Slot() = default;
  virtual double take() = 0;       // the value, waiting for it if need be
  virtual bool done() const = 0;   // whether take() would not wait
};

namespace {

std::atomic<int> g_defer{-1};  // -1: not yet read from the environment
bool defer_cpu_reads() {
  int d = g_defer.load();
  if (d < 0) {
    const char* v = std::getenv("TALLY_TEST_DEFER_READS");
    d = v && std::strcmp(v, "1") == 0 ? 1 : 0;
    g_defer = d;
  }
  return d == 1;
}

// A CPU value held back until get() (tests only).
struct DeferredCpu final : PendingScalar::Slot {
  explicit DeferredCpu(double v) : value(v) {}
  double take() override { return value; }
  bool done() const override { return false; }
  double value;
};

// A GPU's copy into a page-locked slot of its device's pool. A template on the CUDA context's
// types, so that a build without the CUDA backend, which reads no GPU value, never instantiates it.
template <class PinnedBuffer = kernels::cuda::PinnedBuffer, class Event = kernels::cuda::Event>
struct GpuCopy final : PendingScalar::Slot {
  static constexpr std::size_t kSlotBytes = 64;

  explicit GpuCopy(const Tensor& t) : dtype(t.dtype()), device(t.device().index) {
    namespace kcu = kernels::cuda;
    kcu::use_device(device);
    buffer = acquire(device);
    // On the compute stream: after the work that computes the value, before the later work that
    // may be handed its block by the arena — and beside the copy stream, whose uploads of the next
    // step's inputs would otherwise queue behind it, that is behind this whole step.
    copied = kcu::download_on_compute(buffer.data(), t.raw_data(), dtype_size(dtype));
  }
  ~GpuCopy() override {
    // Back to its device's pool even if the copy is in flight: that device's copies share its
    // compute stream, so a later read's copy into this slot lands after it, and that read waits
    // for its own. (One pool for all devices would let device A's late copy land after device B's.)
    const std::lock_guard<std::mutex> lock(pool_mutex());
    pool()[device].push_back(std::move(buffer));
  }
  double take() override {
    copied.wait();
    const void* p = buffer.data();
    switch (dtype) {
      case DType::Float32: { float v; std::memcpy(&v, p, sizeof v); return v; }
      case DType::Float64: { double v; std::memcpy(&v, p, sizeof v); return v; }
      case DType::BFloat16: { kernels::bf16 v; std::memcpy(&v, p, sizeof v); return static_cast<float>(v); }
      default: break;
    }
    throw Error(fmt::format("PendingScalar: expected a float32, float64 or bf16 value, found {}", dtype_name(dtype)));
  }
  bool done() const override { return copied.done(); }

  static std::mutex& pool_mutex() {
    static std::mutex mu;
    return mu;
  }
  static std::map<int, std::vector<PinnedBuffer>>& pool() {
    static auto* slots = new std::map<int, std::vector<PinnedBuffer>>;  // never destroyed, as the CUDA context
    return *slots;
  }
  static PinnedBuffer acquire(int device) {
    const std::lock_guard<std::mutex> lock(pool_mutex());
    std::vector<PinnedBuffer>& free = pool()[device];
    if (free.empty()) return PinnedBuffer(kSlotBytes);
    PinnedBuffer b = std::move(free.back());
    free.pop_back();
    return b;
  }

  DType dtype;
  int device;
  PinnedBuffer buffer;
  Event copied;
};

}  // namespace

void PendingScalar::defer_cpu_reads_for_tests(bool on) { g_defer = on ? 1 : 0; }

PendingScalar PendingScalar::read(const Tensor& t) {
  if (t.numel() != 1) throw ShapeError(fmt::format("PendingScalar::read: expected one element, found {}", t.str()));
  if (t.dtype() != DType::Float32 && t.dtype() != DType::Float64 && t.dtype() != DType::BFloat16)
    throw ShapeError(fmt::format("PendingScalar::read: expected a float32, float64 or bf16 value, found {}", t.str()));
  if (is_dry_run()) throw Error("PendingScalar::read: a dry run has no values to read");
  PendingScalar p;
  if (t.device().is_cpu()) {
    p.value_ = t.item();
    if (defer_cpu_reads()) p.slot_ = std::make_shared<DeferredCpu>(p.value_);
    return p;
  }
  if constexpr (kHaveCudaBackend) {
    p.slot_ = std::make_shared<GpuCopy<>>(t);
    return p;
  } else {
    throw Error(fmt::format("PendingScalar::read on {}: this build of tally has no CUDA backend", t.device().str()));
  }
}

double PendingScalar::get() {
  if (slot_) {
    value_ = slot_->take();
    slot_.reset();
  }
  return value_;
}

bool PendingScalar::ready() const { return !slot_ || slot_->done(); }

}  // namespace tally
