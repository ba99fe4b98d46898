// core/offload.cpp — offloaded segments; see core/offload.h.
#include "core/offload.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "core/ambient.h"
#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/ops.h"
#include "core/option_names.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"

namespace tally {
namespace {


void host_copy(void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); }

// One segment's storages between its forward and its backward.
struct OffloadSet {
  std::string name;
  Device device;
  std::vector<std::shared_ptr<Storage>> storages;
  bool on_host = false;
  // A GPU's upload of the storages (move_back): the compute stream waits for it before the
  // segment's backward. Empty on the CPU and in dry runs.
  std::function<void()> wait_uploaded;
  // The segment whose output was this one's input: its backward comes right after this one's.
  std::shared_ptr<OffloadSet> previous;
};

bool dry(const Arena& a) { return a.is_virtual(); }

void move_out(OffloadSet& s, const std::shared_ptr<Arena>& host) {
  const std::shared_ptr<Arena>& device = current_arena(s.device);
  if (s.device.is_cpu() || dry(*device)) {
    for (const auto& st : s.storages) st->relocate(host, host_copy);
  } else if constexpr (kHaveCudaBackend) {
    namespace kcu = kernels::cuda;
    kcu::use_device(s.device.index);
    kcu::copy_wait(kcu::Event::record(kcu::compute_stream()));  // after the forward that wrote them
    kcu::Event last;
    for (const auto& st : s.storages)
      st->relocate(host, [&](void* dst, const void* src, std::size_t n) { last = kcu::download_async(dst, src, n); });
    kcu::compute_wait(last);  // the freed device blocks are reused only after the copies (one stream: the last)
  }
  s.on_host = true;
}

void move_back(OffloadSet& s) {
  const std::shared_ptr<Arena>& device = current_arena(s.device);
  if (s.device.is_cpu() || dry(*device)) {
    for (const auto& st : s.storages) st->relocate(device, host_copy);
  } else if constexpr (kHaveCudaBackend) {
    namespace kcu = kernels::cuda;
    kcu::use_device(s.device.index);
    // The blocks the arena hands out may still be read by compute work enqueued so far.
    kcu::copy_wait(kcu::Event::record(kcu::compute_stream()));
    auto last = std::make_shared<kcu::Event>();
    for (const auto& st : s.storages) {
      // relocate frees the host block once the copy is enqueued. The copy stream orders its reuse
      // by later copies; but a host arena that poisons freed blocks (TALLY_ARENA_POISON) writes
      // them from the CPU at once, so there the host waits for the copy first.
      const bool poisoned = st->arena()->poison_freed();
      st->relocate(device, [&](void* dst, const void* src, std::size_t n) {
        *last = kcu::upload_async(dst, src, n);
        if (poisoned) last->wait();
      });
    }
    const int index = s.device.index;
    s.wait_uploaded = [last, index] {
      kcu::use_device(index);
      kcu::compute_wait(*last);
    };
  }
  s.on_host = false;
}

// Between y and the last op of f: brings the segment's storages back before any of f's backward,
// and starts bringing the previous segment's (prefetch).
struct OffloadBackward final : Node {
  std::shared_ptr<OffloadSet> set;
  const char* name() const override { return "offload"; }
  void release() override { set.reset(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override { backward(Tensor(gy), g); }
  void backward(Tensor&& gy, std::vector<GradSlot>& g) override {
    if (!set) throw Error("offload backward: the segment's tensors were released (a second backward?)");
    if (set->on_host) move_back(*set);
    if (set->wait_uploaded) set->wait_uploaded();
    set->storages.clear();  // each is freed when its last op's backward is done with it
    if (offload_prefetches(set->device) && set->previous && set->previous->on_host) move_back(*set->previous);
    set.reset();
    if (g[0].needed) g[0].buffer = std::move(gy);
  }
};

bool moves(const Storage& s, const Arena& device) {
  return &*s.arena() == &device && (s.category() == Category::activation || s.category() == Category::input);
}

}  // namespace

void move_storage(Storage& s, std::shared_ptr<Arena> to) {
  const Device device = s.device().is_cuda() ? s.device() : to->device();
  if (device.is_cpu()) {
    s.relocate(std::move(to), host_copy);
  } else if constexpr (kHaveCudaBackend) {
    namespace kcu = kernels::cuda;
    kcu::use_device(device.index);
    const bool out = to->device().is_cpu();
    s.relocate(std::move(to), out ? kcu::copy_to_host : kcu::copy_from_host);
  } else {
    throw Error(fmt::format("move_storage: this build of tally has no CUDA backend for {}", device.str()));
  }
}

OffloadLog::OffloadLog() : outer_(detail::ambient().offload_log) { detail::ambient().offload_log = this; }
OffloadLog::~OffloadLog() { detail::ambient().offload_log = outer_; }
void OffloadLog::add(OffloadRecord r) {
  if (OffloadLog* log = detail::ambient().offload_log) log->records_.push_back(std::move(r));
}

Tensor offload(const std::function<Tensor(const Tensor&)>& f, const Tensor& x, const std::string& name) {
  if (!grad_enabled() || recomputing()) return f(x);
  const std::shared_ptr<Arena>& host = current_host_arena();
  if (!host)
    throw Error(fmt::format("offload of segment '{}': expected a host tier to move its activations to (a host "
                            "arena: {}), found none", name, option_name(Option::host_tier)));
  const double flops_before = flop_count().forward;
  Tensor y;
  auto set = std::make_shared<OffloadSet>();
  set->name = name;
  set->device = x.device();
  {
    StorageWatch watch;
    y = f(x);
    const Arena& device = *current_arena(set->device);
    const Storage* out = y.defined() ? y.impl().storage.get() : nullptr;
    for (const std::weak_ptr<Storage>& w : watch.made())
      if (std::shared_ptr<Storage> s = w.lock(); s && s.get() != out && moves(*s, device))
        set->storages.push_back(std::move(s));
    if (x.defined() && x.impl().storage.get() != out && moves(*x.impl().storage, device))
      set->storages.push_back(x.impl().storage);
  }
  if (!y.defined() || !y.grad_fn()) return y;  // nothing recorded: no backward to bring them back for
  OffloadRecord record{name, 0, flop_count().forward - flops_before};
  for (const auto& s : set->storages) record.bytes += s->nbytes();
  OffloadLog::add(std::move(record));
  if (const auto* before = dynamic_cast<const OffloadBackward*>(x.grad_fn().get())) set->previous = before->set;
  move_out(*set, host);
  auto n = std::make_shared<OffloadBackward>();
  n->set = std::move(set);
  Tensor out = y.detach();  // the same storage, with the offload node as its history
  set_history(out, n, {&y});
  return out;
}

}  // namespace tally
