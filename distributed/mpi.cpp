// distributed/mpi.cpp — the MPI backend: host buffers and CPU tensors over MPI_COMM_WORLD.
//
// MPI starts on the first mpi_world() and is finalized at exit (std::atexit). Errors keep MPI's
// default handler (MPI_ERRORS_ARE_FATAL): a failed collective ends every rank with MPI's own
// message rather than leaving the others waiting. abort() is MPI_Abort on the world.
#include <mpi.h>

#include <cstdlib>
#include <map>

#include <fmt/format.h>

#include "core/error.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "distributed/backends.h"

namespace tally::distributed::detail {

namespace {

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(fmt::format("{} failed: {}", call, std::string(text, static_cast<std::size_t>(len))));
}

MPI_Datatype mpi_type(DType d) { return d == DType::Float64 ? MPI_DOUBLE : MPI_FLOAT; }

class Mpi final : public Communicator {
 public:
  Mpi() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      check(MPI_Init(nullptr, nullptr), "MPI_Init");
      std::atexit(finalize_at_exit);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  void all_reduce_sum(double* data, std::size_t count) override {
    if (count == 0) return;
    check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
          "MPI_Allreduce");
  }
  void broadcast(void* data, std::size_t bytes, int root) override {
    check_root(root);
    if (bytes == 0) return;
    check(MPI_Bcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
  }
  void all_reduce_sum(Tensor& t) override {
    check_tensor(t, "all_reduce_sum");
    if (skip_side_effects() || t.numel() == 0) return;
    check(MPI_Allreduce(MPI_IN_PLACE, t.raw_data(), static_cast<int>(t.numel()), mpi_type(t.dtype()), MPI_SUM,
                        MPI_COMM_WORLD),
          "MPI_Allreduce");
  }
  void broadcast(Tensor& t, int root) override {
    check_tensor(t, "broadcast");
    check_root(root);
    if (skip_side_effects() || t.numel() == 0) return;
    check(MPI_Bcast(t.raw_data(), static_cast<int>(t.numel()), mpi_type(t.dtype()), root, MPI_COMM_WORLD),
          "MPI_Bcast");
  }
  void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier"); }
  std::size_t send(const Tensor& t, int peer) override {
    check_message(t, peer, "send");
    if (skip_side_effects() || t.numel() == 0) return 0;
    MPI_Request request;
    check(MPI_Isend(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, peer, kMessageTag, MPI_COMM_WORLD, &request),
          "MPI_Isend");
    pending_[++tickets_] = request;
    return tickets_;
  }
  void wait_send(std::size_t ticket) override {
    const auto it = pending_.find(ticket);
    if (it == pending_.end()) return;
    MPI_Request request = it->second;
    pending_.erase(it);
    check(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait");
  }
  void recv(Tensor& t, int peer) override {
    check_message(t, peer, "recv");
    if (skip_side_effects() || t.numel() == 0) return;
    MPI_Status status;
    check(MPI_Recv(t.raw_data(), static_cast<int>(t.nbytes()), MPI_BYTE, peer, kMessageTag, MPI_COMM_WORLD, &status),
          "MPI_Recv");
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    if (static_cast<std::size_t>(count) != t.nbytes())
      throw Error(fmt::format("recv from rank {}: expected {} bytes ({}), found {}", peer, t.nbytes(), t.str(), count));
  }
  void abort(int code) override { MPI_Abort(MPI_COMM_WORLD, code); }
  bool serves(Device device) const override { return device.is_cpu(); }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= size_)
      throw Error(fmt::format("broadcast: root {} is not a rank of a world of {}", root, size_));
  }
  void check_tensor(const Tensor& t, const char* what) const {
    check_collective_tensor(t, what);
    if (!t.device().is_cpu())
      throw Error(fmt::format("{} over MPI: expected a CPU tensor, found {} (CUDA tensors travel over NCCL)", what,
                              t.str()));
    if (t.numel() > INT32_MAX) throw Error(fmt::format("{} over MPI: {} has more than 2^31 elements", what, t.str()));
  }

  void check_message(const Tensor& t, int peer, const char* what) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw Error(fmt::format("{}: rank {} is not another rank of a world of {}", what, peer, size_));
    if (!t.defined() || !t.is_contiguous() || !t.device().is_cpu())
      throw Error(fmt::format("{} over MPI: expected a contiguous CPU tensor, found {}", what,
                              t.defined() ? t.str() : std::string("none")));
    if (t.nbytes() > static_cast<std::size_t>(INT32_MAX))
      throw Error(fmt::format("{} over MPI: {} has more than 2^31 bytes", what, t.str()));
  }

  static constexpr int kMessageTag = 7;
  int rank_ = 0, size_ = 1;
  std::size_t tickets_ = 0;
  std::map<std::size_t, MPI_Request> pending_;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_world() { return std::make_shared<Mpi>(); }

}  // namespace tally::distributed::detail
