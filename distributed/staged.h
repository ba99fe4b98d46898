// distributed/staged.h — tensors of a device over the host's communicator (MPI), through a buffer of
// host memory: the transport where NCCL cannot run (two ranks sharing one GPU — NCCL refuses a
// second rank on a device — or a build without NCCL), as PyTorch's gloo backend stages CUDA tensors.
//
// Each collective on a tensor of `device` runs in chunks of at most the staging buffer's bytes: a
// chunk copied to the host buffer, the host communicator's collective on it, the result copied back
// (all_reduce_sum, broadcast). The buffer is an arena of its own (Arena::make_host: page-locked
// where a GPU is present, one reservation), outside the step's budget; `tally train` says its size.
// Chunking changes no value: a sum is element by element, in the host communicator's order for each
// element whatever the chunk. The copies are the Tensor API's (views and copy_), so the logic is
// device-neutral and runs on the CPU in tests with a CPU "device". Host buffers and tensors of
// other devices go straight to the host communicator. Pipeline messages (send, recv) are staged
// whole: a send's host copy stays in the staging arena until wait_send (sends never block), so the
// messages in flight must fit it together — a message that does not is an Error naming the bytes.
// A pipeline stage sizes it per plan before its step (reserve_message_bytes: the high-water mark of
// that step's messages, which the same best-fit arena lays out the same way every step): exactly
// that at the first reservation, in place of the initial chunk-sized buffer; larger only later.
#pragma once
#include <cstddef>
#include <memory>

#include "core/device.h"
#include "distributed/communicator.h"

namespace tally::distributed {

inline constexpr std::size_t kStagingBytes = std::size_t(64) << 20;

// The staged transport for tensors on `device` over `host` (its size, ranks and host collectives),
// with a staging buffer of `staging_bytes` (at least 256).
std::shared_ptr<Communicator> make_staged(std::shared_ptr<Communicator> host, Device device,
                                          std::size_t staging_bytes = kStagingBytes);
// The chunks a staged communicator has moved so far (each a copy out, a collective, a copy back),
// for tests; 0 for any other communicator.
std::size_t staged_chunks(const Communicator& c);
// A staged communicator's staging buffer: its bytes, and the highest offset its host copies have
// reached since it was made or last grown (tests compare it with the plan's message staging); 0
// for any other communicator.
std::size_t staging_capacity(const Communicator& c);
std::size_t staging_high_water(const Communicator& c);

}  // namespace tally::distributed
