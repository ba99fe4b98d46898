// core/machine.h — what the machine this process runs on can give it, in one place: the limits a
// run's options are checked against before any work (--threads, --memory-limit) and what
// `--memory-limit auto` means on the CPU.
#pragma once
#include <cstddef>
#include <string>

namespace tally {

// The hardware threads this process may run on at once (its CPU affinity mask, else the online
// processors); 0 when unknown.
int hardware_threads();

// The host memory this process may still use: the least of the kernel's estimate of memory
// available without swapping (MemAvailable), what its cgroup allows beyond what it uses
// (memory.max - memory.current, cgroup v2; v1's memory.limit_in_bytes - usage), and the address
// space left under RLIMIT_AS — each where the machine states it. `bound` names the smallest
// ("MemAvailable", "the cgroup's memory.max", "RLIMIT_AS (ulimit -v)"); bytes 0 when none is known.
// TALLY_TEST_HOST_MEMORY=BYTES in the environment stands for all of them (tests fake the machine).
struct HostMemory {
  std::size_t bytes = 0;
  std::string bound;
};
HostMemory usable_host_memory();

}  // namespace tally
