// core/files.h — durable writes, shared by the safetensors writer and training checkpoints.
//
// A file that must survive a crash is written whole, fsynced, and renamed into place; the rename
// becomes durable when its folder is fsynced. These are the two steps both writers take.
#pragma once
#include <cstddef>
#include <filesystem>
#include <string_view>

namespace tally {

// Writes n bytes at src to the open descriptor fd, retrying short writes and EINTR. On failure a
// tally::Error "<what>: cannot write '<path>': <reason>".
// Tests (docs/testing.md): TALLY_TEST_WRITE_FAIL=<file name>:<ENOSPC|EIO> makes every write to a
// file of that name (its last path component; a temporary "<name>.tmp.<pid>" counts as <name>)
// fail with that error — the disk full or failing at a named point.
void write_all(int fd, const void* src, std::size_t n, std::string_view what, const std::filesystem::path& path);

// The error TALLY_TEST_WRITE_FAIL injects into writes to `path` (0: none); write_all asks it, and so
// does every writer that does not go through write_all (metrics.csv's stream).
int injected_write_error(const std::filesystem::path& path);

// Writes `bytes` as the file `path`, whole or not at all: into "<path>.tmp.<pid>" first, fsynced, then
// renamed over `path` (a crash leaves the old file or the new one). On any failure the temporary
// is removed and a tally::Error "<what>: cannot write '<path>': <the system's reason>" is thrown
// (e.g. "No space left on device"; TALLY_TEST_WRITE_FAIL injects one, as for write_all).
void write_file(const std::filesystem::path& path, std::string_view bytes, std::string_view what);

// Makes a folder's entries (a rename into it, a new file) durable. Best effort: some file systems
// refuse fsync on folders, and a failure here loses nothing that was not already at risk.
void sync_folder(const std::filesystem::path& dir);

}  // namespace tally
