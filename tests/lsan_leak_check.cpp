// tests/lsan_leak_check.cpp — the sanitizer build's proof that its Open MPI suppressions hide only
// Open MPI: this program starts and ends MPI (whose own allocations at finalize LeakSanitizer would
// report without cmake/lsan_openmpi.cpp) and leaks one block of its own. The test passes when
// LeakSanitizer names that block's function and no Open MPI frame (tests/CMakeLists.txt,
// sanitize.leak_outside_openmpi_is_reported).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace {
void* volatile g_kept = nullptr;

[[gnu::noinline]] void tally_deliberate_leak() {
  g_kept = std::malloc(4096);
  g_kept = nullptr;  // the only pointer to the block is gone: a leak
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  tally_deliberate_leak();
  MPI_Finalize();
  std::puts("leaked 4096 bytes on purpose");
  return 0;
}
