// distributed/communicator.h — the collectives of data-parallel training, on an existing engine.
//
// A Communicator joins the ranks (processes) of one job. tally needs three collectives, all of
// them blocking from the caller's point of view and called by every rank in the same order:
//
//   all_reduce_sum   in place: every rank ends with the element-wise sum over all ranks
//   broadcast        in place: every rank ends with `root`'s bytes
//   barrier
//
// and, for the stages of a pipeline, point-to-point messages between two ranks:
//
//   send / wait_send   starts sending a contiguous tensor to `peer` and returns at once with a
//                      ticket; the tensor must stay alive (and unchanged) until wait_send(ticket)
//   recv               blocks until the next tensor `peer` sent this rank arrives, into `t` (of the
//                      same shape and dtype); messages between two ranks arrive in the order sent
//
// Sends never block, so two stages that each send before they receive (1F1B's steady state: an
// activation forward, a gradient back) cannot wait on each other.
//
// Backends:
//   local  one process, world size 1: every collective leaves the data as it is.
//   mpi    Open MPI (or any MPI): processes on one machine or many, started by `mpirun`. Host
//          buffers and CPU tensors travel over MPI; CUDA tensors through host memory when wrapped
//          by the staged transport (distributed/staged.h), else an error.
//   nccl   CUDA tensors over NCCL on the compute stream (no host wait), bootstrapped through MPI
//          (rank 0 makes the unique id, MPI broadcasts it); host buffers still travel over MPI.
//          NCCL's own internal buffers are outside tally's arena: docs/distributed.md.
//
// The buffers a collective touches are the caller's: in training, tensors of tally's arena (the
// gradient buckets and the BatchNorm moments are allocated there, so the planner counts them).
// MPI is initialized on the first call of mpi_world() and finalized at exit; nothing starts MPI
// unless the process was launched by an MPI launcher (launched_by_mpi()).
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"

namespace tally::distributed {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "local", "mpi" or "nccl"

  // Host memory.
  virtual void all_reduce_sum(double* data, std::size_t count) = 0;
  virtual void broadcast(void* data, std::size_t bytes, int root) = 0;
  // A contiguous float32 or float64 tensor on a device this backend serves (a no-op in a dry run:
  // a tensor of a dry run has no values).
  virtual void all_reduce_sum(Tensor& t) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // Point-to-point (see above); no-ops in a dry run. The local world and NCCL have none: an Error
  // outside a dry run.
  virtual std::size_t send(const Tensor& t, int peer);
  virtual void wait_send(std::size_t ticket);
  virtual void recv(Tensor& t, int peer);
  // Where messages travel through host memory (the staged transport): makes room for host copies
  // of up to `bytes` in flight together (a pipeline stage's messages of one step, laid out as that
  // step allocates them: mbp::message_staging_bytes), growing the staging buffer between steps.
  // A no-op where messages are not staged.
  virtual void reserve_message_bytes(std::size_t bytes) { (void)bytes; }
  // Ends every rank of the job with `code` (after an error on this one: the others would wait in
  // their next collective forever). Returns only for a world of one.
  virtual void abort(int code) = 0;
  // Whether tensors on `device` can travel through this communicator.
  virtual bool serves(Device device) const = 0;
  // The device memory this communicator's library took outside tally's arena, measured when it was
  // made (NCCL: the device's free memory before and after ncclCommInitRank); 0 for the others.
  virtual std::size_t library_bytes() const { return 0; }
};

// World size 1: the single-process run, and what every test compares with.
std::shared_ptr<Communicator> local();

// Every rank's `mine`, indexed by rank, on every rank (a collective: two broadcasts per rank, its
// length and its bytes; texts of any length, and of different lengths on each rank).
std::vector<std::string> all_gather_text(Communicator& world, const std::string& mine);

// Whether this process was started by mpirun / mpiexec (Open MPI, MPICH or a PMIx launcher).
bool launched_by_mpi();

// Where a rank runs among the job's ranks, learned from all of them rather than from the launcher's
// environment (which Open MPI, Slurm's PMI2 and others fill differently, or not at all): the ranks of
// its machine (the same host name) and of its GPU (the same machine and PCI bus id — one physical
// GPU, whatever index each rank knows it by). So ranks that CUDA_VISIBLE_DEVICES gives a GPU each,
// every one its own cuda:0, are told apart from ranks that share one. A MIG instance counts as its
// whole GPU (one bus id; NCCL refuses two of them as it refuses two ranks on one GPU).
struct Neighbours {
  int local_rank = 0;   // this rank's place among its machine's ranks, in world order
  int local_size = 1;   // the ranks of its machine
  int local_gpus = 0;   // the GPUs its machine's ranks run on
  int sharing_gpu = 1;  // the ranks on this rank's GPU, itself included (1 for a rank on the CPU)
};
// Each rank's host name and GPU bus id ("" on the CPU), indexed by rank: what rank `rank` learns.
Neighbours neighbours(const std::vector<std::pair<std::string, std::string>>& ranks, int rank);
// The same gathered from `world` (a collective: every rank calls it, whatever its device), this
// rank's GPU given by its bus id ("" on the CPU; core/device.h: cuda_device_bus_id).
Neighbours neighbours(Communicator& world, const std::string& gpu_bus_id);
// Whether this build has the MPI and NCCL backends.
bool have_mpi();
bool have_nccl();

// The job's MPI world (initializes MPI on the first call). Without MPI in this build: an Error
// that says so.
std::shared_ptr<Communicator> mpi_world();

// How CUDA tensors travel between ranks (--collectives): NCCL (each rank on a GPU of its own: NCCL
// refuses two ranks on one device), MPI through host memory (distributed/staged.h: ranks may share a
// GPU), or automatic: NCCL where this build has it and every rank of every machine has a GPU of its
// own, the staged transport otherwise — agreed by all ranks (for_device is a collective under mpirun).
enum class Collectives { automatic, nccl, mpi };
// The communicator for tensors on `device`: `host` itself for the CPU; for a CUDA device NCCL
// (bootstrapped through `host`, which also carries its host buffers) or the staged transport, as
// `collectives` says. `why`, if given, receives the choice in words ("nccl: each of the 2 ranks of
// this machine on a GPU of its own").
std::shared_ptr<Communicator> for_device(const std::shared_ptr<Communicator>& host, Device device,
                                         Collectives collectives = Collectives::automatic, std::string* why = nullptr);
// The communicator of a `tally` process: the MPI world when launched by mpirun (and the build has
// MPI), else local(). Launched by mpirun without MPI in the build: an Error.
std::shared_ptr<Communicator> process_world();

}  // namespace tally::distributed
