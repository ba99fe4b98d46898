// core/machine.cpp — see core/machine.h.
#include "core/machine.h"

#include <sched.h>
#include <unistd.h>

namespace tally {

int hardware_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 0;
}

}  // namespace tally
