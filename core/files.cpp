// core/files.cpp — durable writes; see core/files.h.
#include "core/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"

namespace tally {

int injected_write_error(const std::filesystem::path& path) {
  const char* env = std::getenv("TALLY_TEST_WRITE_FAIL");
  if (env == nullptr || *env == '\0') return 0;
  const std::string spec(env);
  const auto colon = spec.rfind(':');
  const std::string name = spec.substr(0, colon), error = colon == std::string::npos ? "" : spec.substr(colon + 1);
  const int code = error == "ENOSPC" ? ENOSPC : error == "EIO" ? EIO : 0;
  if (code == 0 || name.empty())
    throw Error(fmt::format("TALLY_TEST_WRITE_FAIL={}: expected <file name>:ENOSPC or <file name>:EIO", spec));
  const std::string file = path.filename().string();
  return file == name || file.rfind(name + ".tmp", 0) == 0 ? code : 0;
}

void write_all(int fd, const void* src, std::size_t n, std::string_view what, const std::filesystem::path& path) {
  if (const int injected = injected_write_error(path); injected != 0 && n > 0)
    throw Error(fmt::format("{}: cannot write '{}': {}", what, path.string(),
                            std::error_code(injected, std::generic_category()).message()));
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

void write_file(const std::filesystem::path& path, std::string_view bytes, std::string_view what) {
  // A temporary of this process's own (as safetensors' writer): two processes writing one file at
  // once (the ranks of a run saving the shared tuning file) each rename a whole file into place.
  std::filesystem::path tmp = path;
  tmp += ".tmp." + std::to_string(static_cast<long>(::getpid()));
  const auto failed = [&](int error) {
    return Error(fmt::format("{}: cannot write '{}': {}", what, path.string(),
                             std::error_code(error, std::generic_category()).message()));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) throw failed(errno);
  try {
    write_all(fd, bytes.data(), bytes.size(), what, path);  // errors name `path`, as injections match it
    if (::fsync(fd) != 0) throw failed(errno);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    throw failed(error);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    ::unlink(tmp.c_str());
    throw Error(fmt::format("{}: cannot write '{}': {}", what, path.string(), ec.message()));
  }
  sync_folder(path.parent_path());
}

void sync_folder(const std::filesystem::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace tally
