// core/machine.cpp — see core/machine.h.
#include "core/machine.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

namespace tally {

int hardware_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 0;
}

namespace {

// "Key:   123 kB" from a /proc file, in bytes.
std::optional<std::uint64_t> proc_kb(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream ss(line.substr(key.size() + 1));
      std::uint64_t kb = 0;
      if (ss >> kb) return kb * 1024;
    }
  return std::nullopt;
}

// A file holding one number ("max" or a huge v1 value: no limit).
std::optional<std::uint64_t> number_in(const char* file) {
  std::ifstream in(file);
  std::string text;
  if (!(in >> text) || text == "max") return std::nullopt;
  try {
    const std::uint64_t v = std::stoull(text);
    if (v >= (std::uint64_t(1) << 60)) return std::nullopt;  // cgroup v1's "unlimited"
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

HostMemory usable_host_memory() {
  HostMemory m;
  auto consider = [&m](std::uint64_t bytes, const char* bound) {
    if (m.bound.empty() || bytes < m.bytes) m.bytes = static_cast<std::size_t>(bytes), m.bound = bound;
  };
  // Tests fake a machine of this many usable bytes, so that no test depends on the machine's size.
  if (const char* fake = std::getenv("TALLY_TEST_HOST_MEMORY"); fake && *fake) {
    consider(std::strtoull(fake, nullptr, 10), "TALLY_TEST_HOST_MEMORY");
    return m;
  }
  if (const auto available = proc_kb("/proc/meminfo", "MemAvailable")) consider(*available, "MemAvailable");
  const auto v2_max = number_in("/sys/fs/cgroup/memory.max"), v2_cur = number_in("/sys/fs/cgroup/memory.current");
  if (v2_max && v2_cur) consider(*v2_max > *v2_cur ? *v2_max - *v2_cur : 0, "the cgroup's memory.max");
  const auto v1_max = number_in("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  const auto v1_use = number_in("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  if (v1_max && v1_use) consider(*v1_max > *v1_use ? *v1_max - *v1_use : 0, "the cgroup's memory.limit_in_bytes");
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    const std::uint64_t used = proc_kb("/proc/self/status", "VmSize").value_or(0);
    consider(as.rlim_cur > used ? as.rlim_cur - used : 0, "RLIMIT_AS (ulimit -v)");
  }
  return m;
}

}  // namespace tally
