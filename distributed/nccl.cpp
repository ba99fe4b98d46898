// distributed/nccl.cpp — the NCCL backend: CUDA tensors over NCCL, each rank on its own GPU.
//
// Bootstrap: rank 0 asks NCCL for a unique id, the host communicator (MPI; or none in a world of
// one) broadcasts it, and every rank joins with ncclCommInitRank. Collectives are enqueued on
// tally's compute stream, after the kernels that wrote the buffer and before those that read it,
// so nothing waits on the host. Host buffers and CPU tensors go through the host communicator.
// NCCL allocates its own device buffers (outside tally's arena; sized by NCCL_BUFFSIZE, see
// docs/distributed.md), measured when the communicator is made (library_bytes()).
#include <nccl.h>

#include <cstdlib>

#include <fmt/format.h>

#include "core/error.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "distributed/backends.h"
#include "kernels/cuda/context.h"

namespace tally::distributed::detail {

namespace {

void check(ncclResult_t rc, const char* call) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  throw Error(fmt::format("{} failed: {} ({})", call, ncclGetErrorString(rc), ncclGetLastError(nullptr)));
}

ncclDataType_t nccl_type(DType d) { return d == DType::Float64 ? ncclFloat64 : ncclFloat32; }

class Nccl final : public Communicator {
 public:
  // NCCL connects its peers when the communicator is made (NCCL_RUNTIME_CONNECT=0, unless the
  // environment says otherwise), so that the device memory it takes is there to be measured at once:
  // the device's free memory before and after, library_bytes().
  Nccl(std::shared_ptr<Communicator> host, Device device) : host_(std::move(host)), device_(device) {
    kernels::cuda::use_device(device.index);
    ::setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    ncclUniqueId id{};
    if (host_->rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    host_->broadcast(&id, sizeof id, 0);
    std::size_t before = 0, after = 0, total = 0;
    cuda_memory_info(device.index, &before, &total);
    check(ncclCommInitRank(&comm_, host_->size(), id, host_->rank()), "ncclCommInitRank");
    cuda_memory_info(device.index, &after, &total);
    library_bytes_ = before > after ? before - after : 0;
  }
  std::size_t library_bytes() const override { return library_bytes_; }
  ~Nccl() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string backend() const override { return "nccl"; }

  void all_reduce_sum(double* data, std::size_t count) override { host_->all_reduce_sum(data, count); }
  void broadcast(void* data, std::size_t bytes, int root) override { host_->broadcast(data, bytes, root); }
  void all_reduce_sum(Tensor& t) override {
    if (t.defined() && t.device().is_cpu()) return host_->all_reduce_sum(t);
    check_tensor(t, "all_reduce_sum");
    if (skip_side_effects() || t.numel() == 0) return;
    check(ncclAllReduce(t.raw_data(), t.raw_data(), static_cast<std::size_t>(t.numel()), nccl_type(t.dtype()), ncclSum,
                        comm_, reinterpret_cast<cudaStream_t>(kernels::cuda::compute_stream())),
          "ncclAllReduce");
  }
  void broadcast(Tensor& t, int root) override {
    if (t.defined() && t.device().is_cpu()) return host_->broadcast(t, root);
    check_tensor(t, "broadcast");
    if (root < 0 || root >= size()) throw Error(fmt::format("broadcast: root {} is not a rank of a world of {}", root, size()));
    if (skip_side_effects() || t.numel() == 0) return;
    check(ncclBroadcast(t.raw_data(), t.raw_data(), static_cast<std::size_t>(t.numel()), nccl_type(t.dtype()), root,
                        comm_, reinterpret_cast<cudaStream_t>(kernels::cuda::compute_stream())),
          "ncclBroadcast");
  }
  void barrier() override { host_->barrier(); }
  void abort(int code) override {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    host_->abort(code);
  }
  bool serves(Device device) const override { return device.is_cpu() || device == device_; }

 private:
  void check_tensor(const Tensor& t, const char* what) const {
    check_collective_tensor(t, what);
    if (t.device() != device_)
      throw Error(fmt::format("{} over NCCL: expected a tensor on {}, found {}", what, device_.str(), t.str()));
  }

  std::shared_ptr<Communicator> host_;
  std::size_t library_bytes_ = 0;
  Device device_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl(const std::shared_ptr<Communicator>& host, Device device) {
  return std::make_shared<Nccl>(host, device);
}

}  // namespace tally::distributed::detail
