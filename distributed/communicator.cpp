// distributed/communicator.cpp — the local backend and the choice of backend; see distributed/communicator.h.
#include "distributed/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/error.h"
#include "core/memory.h"
#include "distributed/backends.h"
#include "distributed/staged.h"
#include "tally/config.h"

namespace tally::distributed {

namespace detail {

void check_collective_tensor(const Tensor& t, const char* what) {
  if (!t.defined()) throw Error(fmt::format("{}: expected a tensor, found none", what));
  if (!t.is_contiguous()) throw Error(fmt::format("{}: expected a contiguous tensor, found {}", what, t.str()));
  if (t.dtype() != DType::Float32 && t.dtype() != DType::Float64)
    throw Error(fmt::format("{}: expected a float32 or float64 tensor, found {}", what, t.str()));
}

}  // namespace detail

namespace {

class Local final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "local"; }
  void all_reduce_sum(double*, std::size_t) override {}
  void broadcast(void*, std::size_t, int root) override { check_root(root); }
  void all_reduce_sum(Tensor& t) override { detail::check_collective_tensor(t, "all_reduce_sum"); }
  void broadcast(Tensor& t, int root) override {
    detail::check_collective_tensor(t, "broadcast");
    check_root(root);
  }
  void barrier() override {}
  void abort(int) override {}
  bool serves(Device) const override { return true; }

 private:
  static void check_root(int root) {
    if (root != 0) throw Error(fmt::format("broadcast: root {} is not a rank of a world of 1", root));
  }
};

}  // namespace

std::size_t Communicator::send(const Tensor& t, int peer) {
  if (skip_side_effects()) return 0;
  throw Error(fmt::format("send of {} to rank {}: the {} communicator has no point-to-point messages (pipeline stages "
                          "need MPI ranks: on GPUs, through host memory, --collectives mpi)", t.str(), peer, backend()));
}
void Communicator::wait_send(std::size_t) {}
void Communicator::recv(Tensor& t, int peer) {
  if (skip_side_effects()) return;
  throw Error(fmt::format("recv of {} from rank {}: the {} communicator has no point-to-point messages (pipeline "
                          "stages need MPI ranks: on GPUs, through host memory, --collectives mpi)", t.str(), peer,
                          backend()));
}

std::shared_ptr<Communicator> local() {
  static const std::shared_ptr<Communicator> c = std::make_shared<Local>();
  return c;
}

std::vector<std::string> all_gather_text(Communicator& world, const std::string& mine) {
  std::vector<std::string> texts(static_cast<std::size_t>(world.size()));
  for (int r = 0; r < world.size(); ++r) {
    std::string& text = texts[static_cast<std::size_t>(r)];
    if (r == world.rank()) text = mine;
    std::uint64_t n = text.size();
    world.broadcast(&n, sizeof n, r);
    text.resize(n);
    if (n > 0) world.broadcast(text.data(), n, r);
  }
  return texts;
}

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

Neighbours neighbours(const std::vector<std::pair<std::string, std::string>>& ranks, int rank) {
  if (rank < 0 || static_cast<std::size_t>(rank) >= ranks.size())
    throw Error(fmt::format("distributed::neighbours: rank {} of a world of {}", rank, ranks.size()));
  const auto& [host, gpu] = ranks[static_cast<std::size_t>(rank)];
  Neighbours n{0, 0, 0, 0};
  std::set<std::string> gpus;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].first != host) continue;
    ++n.local_size;
    n.local_rank += static_cast<int>(r) < rank ? 1 : 0;
    if (!ranks[r].second.empty()) gpus.insert(ranks[r].second);
    n.sharing_gpu += !gpu.empty() && ranks[r].second == gpu ? 1 : 0;
  }
  n.local_gpus = static_cast<int>(gpus.size());
  n.sharing_gpu = std::max(1, n.sharing_gpu);
  return n;
}

Neighbours neighbours(Communicator& world, const std::string& gpu_bus_id) {
  char host[256] = {};  // a failure leaves every rank's name empty: one machine
  if (gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::vector<std::pair<std::string, std::string>> ranks;
  for (const std::string& text : all_gather_text(world, std::string(host) + '\n' + gpu_bus_id)) {
    const std::size_t cut = text.find('\n');  // a host name has no line break
    ranks.emplace_back(text.substr(0, cut), cut == std::string::npos ? std::string() : text.substr(cut + 1));
  }
  return neighbours(ranks, world.rank());
}

bool have_mpi() { return TALLY_HAVE_MPI; }
bool have_nccl() { return TALLY_HAVE_NCCL; }

std::shared_ptr<Communicator> mpi_world() {
#if TALLY_HAVE_MPI
  static const std::shared_ptr<Communicator> world = detail::make_mpi_world();
  return world;
#else
  throw Error("this build of tally has no MPI backend (configure with Open MPI installed: libopenmpi-dev)");
#endif
}

std::shared_ptr<Communicator> for_device(const std::shared_ptr<Communicator>& host, Device device,
                                         Collectives collectives, std::string* why) {
  if (!host) throw Error("distributed::for_device: expected a host communicator, found none");
  const std::string bus = device.is_cpu() ? std::string() : cuda_device_bus_id(device.index);
  const Neighbours n = neighbours(*host, bus);
  const int ranks = n.local_size, gpus = n.local_gpus;
  const bool own_gpu = n.sharing_gpu == 1;  // always in a world of one
  // One transport for all ranks (NCCL's setup and the staged broadcasts do not match each other):
  // auto takes NCCL only where every rank would — each rank on a GPU of its own, none on the CPU or
  // told to stage (--collectives mpi). Every rank votes, whatever its device and setting, so that
  // the collective is everyone's.
  const bool wants_nccl =
      !device.is_cpu() && (collectives == Collectives::nccl ||
                           (collectives == Collectives::automatic && have_nccl() && own_gpu));
  double tally[2] = {wants_nccl ? 1.0 : 0.0, device.is_cpu() ? 1.0 : 0.0};  // the votes, the ranks on the CPU
  if (host->size() > 1) host->all_reduce_sum(tally, 2);
  const double votes = tally[0];
  // Ranks on both kinds of device (--device auto where one machine has no GPU): the GPU ranks' NCCL
  // set-up, which the CPU ranks never join, would hang them all. Every rank says so. (Told to stage
  // — a pipeline's stages are — the GPU ranks' messages are host bytes, as the CPU ranks' are.)
  if (tally[1] > 0 && tally[1] < host->size() && collectives != Collectives::mpi)
    throw Error(fmt::format("--collectives {} over ranks on different devices: {} of {} ranks run on the CPU, the "
                            "others on GPUs (this rank on {}); give every rank the same kind of device (--device cpu, "
                            "or cuda on machines that each have a GPU), or --collectives mpi",
                            collectives == Collectives::nccl ? "nccl" : "auto", static_cast<int>(tally[1]),
                            host->size(), device.str()));
  if (device.is_cpu()) return host;
  bool elsewhere = false;  // auto here, but another rank stages: so does this one
  if (collectives == Collectives::automatic) {
    collectives = votes == host->size() ? Collectives::nccl : Collectives::mpi;
    elsewhere = wants_nccl && collectives == Collectives::mpi;
  }
  if (collectives == Collectives::mpi) {
    if (why)
      *why = fmt::format("mpi through host memory: {} MiB of staging, a pipeline stage's set to its messages ({} "
                         "rank{} of this machine on {} GPU{}{})",
                         kStagingBytes >> 20, ranks, ranks == 1 ? "" : "s", gpus, gpus == 1 ? "" : "s",
                         elsewhere ? "; another rank stages, so every rank does" : "");
    return make_staged(host, device);
  }
#if TALLY_HAVE_NCCL
  if (!own_gpu)
    throw Error(fmt::format("--collectives nccl: NCCL needs a GPU for each rank, but {} ranks run on this rank's GPU "
                            "({}; this machine has {} rank{} on {} GPU{}) (give --collectives mpi, or auto, to stage "
                            "through host memory)", n.sharing_gpu, bus, ranks,
                            ranks == 1 ? "" : "s", gpus, gpus == 1 ? "" : "s"));
  if (why)
    *why = fmt::format("nccl ({} rank{} of this machine, each on a GPU of its own)", ranks, ranks == 1 ? "" : "s");
  return detail::make_nccl(host, device);
#else
  if (host->size() == 1) return host;  // nothing travels in a world of one
  throw Error(fmt::format("--collectives nccl: data parallelism on {} through NCCL needs the NCCL backend, which this "
                          "build lacks (configure with the CUDA toolkit's NCCL: nccl.h and libnccl; or give "
                          "--collectives mpi)", device.str()));
#endif
}

std::shared_ptr<Communicator> process_world() {
  if (!launched_by_mpi()) return local();
  if (!have_mpi())
    throw Error("tally was started by mpirun, but this build has no MPI backend (configure with Open MPI installed: "
                "libopenmpi-dev), so its ranks could not work together");
  return mpi_world();
}

}  // namespace tally::distributed
