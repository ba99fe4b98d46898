// distributed/backends.h — the factories of the MPI and NCCL backends (compiled where the libraries
// exist); private to distributed/.
#pragma once
#include <memory>

#include "distributed/communicator.h"

namespace tally::distributed::detail {

std::shared_ptr<Communicator> make_mpi_world();  // distributed/mpi.cpp
std::shared_ptr<Communicator> make_nccl(const std::shared_ptr<Communicator>& host, Device device);  // distributed/nccl.cpp

// Checks that a collective may take `t`: contiguous, float32 or float64. `what` names the caller.
void check_collective_tensor(const Tensor& t, const char* what);

}  // namespace tally::distributed::detail
