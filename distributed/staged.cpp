// distributed/staged.cpp — device tensors over the host's communicator through host memory; see
// distributed/staged.h.
#include "distributed/staged.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "core/arena.h"
#include "core/dry_run.h"
#include "core/error.h"
#include "core/memory.h"

namespace tally::distributed {

namespace {

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::shared_ptr<Communicator> host, Device device, std::size_t bytes)
      : host_(std::move(host)), device_(device), staging_(make_staging(device, bytes)), chunk_bytes_(bytes) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string backend() const override { return host_->backend() + " (staged)"; }
  void all_reduce_sum(double* data, std::size_t count) override { host_->all_reduce_sum(data, count); }
  void broadcast(void* data, std::size_t bytes, int root) override { host_->broadcast(data, bytes, root); }
  void all_reduce_sum(Tensor& t) override {
    if (t.device() != device_) return host_->all_reduce_sum(t);
    staged(t, "all_reduce_sum", [this](Tensor& h) { host_->all_reduce_sum(h); });
  }
  void broadcast(Tensor& t, int root) override {
    if (t.device() != device_) return host_->broadcast(t, root);
    staged(t, "broadcast", [this, root](Tensor& h) { host_->broadcast(h, root); });
  }
  void barrier() override { host_->barrier(); }
  // A message is copied whole into the staging arena and stays there until its send is done
  // (sends never block: the peer may be sending too); a received one lands there and is copied out.
  // In a dry run (a plan's probe of the step) nothing travels, and the device's tensor never
  // reaches the host communicator, which takes host tensors only: an empty message neither.
  std::size_t send(const Tensor& t, int peer) override {
    if (t.device() != device_) return host_->send(t, peer);
    if (skip_side_effects() || t.numel() == 0) {
      check_peer(t, peer, "send");
      return 0;
    }
    Tensor host = staging_tensor(t, "send");
    host.copy_(t.reshape({t.numel()}));
    const std::size_t ticket = host_->send(host, peer);
    in_flight_[ticket] = std::move(host);
    return ticket;
  }
  void wait_send(std::size_t ticket) override {
    host_->wait_send(ticket);
    in_flight_.erase(ticket);
  }
  void recv(Tensor& t, int peer) override {
    if (t.device() != device_) return host_->recv(t, peer);
    if (skip_side_effects() || t.numel() == 0) {
      check_peer(t, peer, "recv");
      return;
    }
    Tensor host = staging_tensor(t, "recv");
    host_->recv(host, peer);
    Tensor flat = t.reshape({t.numel()});
    flat.copy_(host);
  }
  // The first reservation sets the buffer to exactly the stage's messages (it began at the chunk
  // size of collectives, which a stage's messages need not take: `tally plan` prints this size as
  // the page-locked memory they take); later ones only grow it (an evaluation's smaller messages
  // keep the training step's buffer).
  void reserve_message_bytes(std::size_t bytes) override {
    if (bytes == 0) return;
    const std::size_t want = Arena::round_up(bytes);
    const bool fits = sized_ ? want <= staging_->capacity() : want == staging_->capacity();
    sized_ = true;
    if (fits) return;
    if (!in_flight_.empty())
      throw Error(fmt::format("the staged transport: {} bytes of host staging asked for while {} message{} still in "
                              "flight (it grows between steps only)", bytes, in_flight_.size(),
                              in_flight_.size() == 1 ? " is" : "s are"));
    staging_.reset();  // one page-locked reservation at a time
    staging_ = Arena::make_host(want);
  }
  void abort(int code) override { host_->abort(code); }
  bool serves(Device device) const override { return device == device_ || host_->serves(device); }
  std::size_t library_bytes() const override { return host_->library_bytes(); }
  std::size_t chunks() const { return chunks_; }
  const Arena& staging() const { return *staging_; }

 private:
  // `collective` on t's bytes, a chunk at a time through the staging arena.
  template <class F>
  void staged(Tensor& t, const char* what, F&& collective) {
    check_contiguous(t, what);
    if (skip_side_effects() || t.numel() == 0) return;
    const std::int64_t n = t.numel();
    // Chunks of one size on every rank (a collective's counts must agree): the staging's size as
    // made, the same on every rank, whatever each holds now (a pipeline stage sizes its own to its
    // messages: reserve_message_bytes).
    const auto per = std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes_ / dtype_size(t.dtype())));
    Tensor flat = t.reshape({n});
    Tensor buffer;
    try {
      const ArenaScope scope(staging_);
      buffer = Tensor::empty({std::min(per, n)}, t.dtype(), Device::cpu(), Category::temporary, "staged collective");
    } catch (const OutOfMemory&) {  // not the device's: no micro-batch retry may take it for one
      throw Error(fmt::format("{} of {} bytes through the host: the staging buffer ({} free of {}) cannot hold a chunk "
                              "of {} bytes", what, t.nbytes(), staging_->free_bytes(), staging_->capacity(),
                              std::min(per, n) * static_cast<std::int64_t>(dtype_size(t.dtype()))));
    }
    for (std::int64_t at = 0; at < n; at += per) {
      const std::int64_t m = std::min(per, n - at);
      Tensor part = flat.narrow(0, at, m), host = buffer.narrow(0, 0, m);
      host.copy_(part);
      collective(host);
      part.copy_(host);
      ++chunks_;
    }
  }

  // The host communicator's checks of a message that does not travel (a dry run, an empty tensor).
  void check_peer(const Tensor& t, int peer, const char* what) const {
    if (peer < 0 || peer >= size() || peer == rank())
      throw Error(fmt::format("{}: rank {} is not another rank of a world of {}", what, peer, size()));
    check_contiguous(t, what);
  }

  static void check_contiguous(const Tensor& t, const char* what) {
    if (!t.is_contiguous())
      throw Error(
          fmt::format("{} through the staged transport: expected a contiguous tensor, found {}", what, t.str()));
  }

  // The staging buffer, page-locked under `device`'s context when it is a GPU (made current first:
  // a rank on GPU 1 would otherwise make GPU 0's context for it).
  static std::shared_ptr<Arena> make_staging(Device device, std::size_t bytes) {
    if (device.is_cuda() && cuda_available()) use_cuda_device(device.index);
    return Arena::make_host(bytes);
  }

  // A host tensor of t's elements in the staging arena; a message it cannot hold is an Error naming both.
  Tensor staging_tensor(const Tensor& t, const char* what) {
    check_contiguous(t, what);
    try {
      const ArenaScope scope(staging_);
      return Tensor::empty({t.numel()}, t.dtype(), Device::cpu(), Category::temporary, "staged message");
    } catch (const OutOfMemory&) {
      throw Error(fmt::format("{} through the staged transport: a message of {} bytes ({}) does not fit the {} bytes "
                              "of host staging left ({} messages in flight)", what, t.nbytes(), t.str(),
                              staging_->free_bytes(), in_flight_.size()));
    }
  }

  std::shared_ptr<Communicator> host_;
  Device device_;
  std::shared_ptr<Arena> staging_;
  std::size_t chunk_bytes_;  // a collective's chunk: the staging's size as made
  bool sized_ = false;  // by a reservation of messages (reserve_message_bytes)
  std::size_t chunks_ = 0;
  std::map<std::size_t, Tensor> in_flight_;  // the host copies of the sends not yet done, by ticket
};

}  // namespace

std::shared_ptr<Communicator> make_staged(std::shared_ptr<Communicator> host, Device device,
                                          std::size_t staging_bytes) {
  if (!host) throw Error("distributed::make_staged: expected a host communicator, found none");
  if (staging_bytes < Arena::kAlignment)
    throw Error(fmt::format("distributed::make_staged: expected a staging buffer of at least {} bytes, found {}",
                            Arena::kAlignment, staging_bytes));
  return std::make_shared<StagedCommunicator>(std::move(host), device, staging_bytes);
}

std::size_t staged_chunks(const Communicator& c) {
  const auto* s = dynamic_cast<const StagedCommunicator*>(&c);
  return s ? s->chunks() : 0;
}

std::size_t staging_capacity(const Communicator& c) {
  const auto* s = dynamic_cast<const StagedCommunicator*>(&c);
  return s ? s->staging().capacity() : 0;
}

std::size_t staging_high_water(const Communicator& c) {
  const auto* s = dynamic_cast<const StagedCommunicator*>(&c);
  return s ? s->staging().stats().high_water : 0;
}

}  // namespace tally::distributed
