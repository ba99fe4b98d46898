// core/files.cpp — durable writes; see core/files.h.
#include "core/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"

namespace tally {

void write_all(int fd, const void* src, std::size_t n, std::string_view what, const std::filesystem::path& path) {
  const auto* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("{}: cannot write '{}': {}", what, path.string(),
                              std::error_code(errno, std::generic_category()).message()));
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void sync_folder(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace tally
