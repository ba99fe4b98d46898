// fuzz/replay_main.cpp — a main for the harnesses of fuzz/ outside libFuzzer: it calls
// LLVMFuzzerTestOneInput once on every file named, and on every file inside every folder named
// (not recursively, in name order). Linked with each harness into replay_<name>, it is how the
// ordinary build and ctest replay the corpora of fuzz/corpus/ — seeds and regression inputs of
// past findings — with the normal compiler and no sanitizer runtime required.
//
// A finding shows as the process dying (an exception that is not tally's escapes the harness
// and ends in std::terminate, or a crash); the file being replayed is printed before each call,
// so the log names it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace fs = std::filesystem;

namespace {

std::vector<fs::path> inputs_of(const fs::path& arg) {
  std::vector<fs::path> files;
  if (fs::is_directory(arg)) {
    for (const auto& e : fs::directory_iterator(arg))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(arg);
  }
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  std::size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    if (!fs::exists(argv[i])) {
      std::fprintf(stderr, "%s: expected a corpus folder or file, found nothing at that path\n", argv[i]);
      return 2;
    }
    for (const fs::path& file : inputs_of(argv[i])) {
      std::ifstream in(file, std::ios::binary);
      const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      std::printf("replay %s (%zu bytes)\n", file.string().c_str(), bytes.size());
      std::fflush(stdout);
      // data() of an empty vector may be null; libFuzzer never passes null, so neither do we.
      static const std::uint8_t empty = 0;
      LLVMFuzzerTestOneInput(bytes.empty() ? &empty : reinterpret_cast<const std::uint8_t*>(bytes.data()),
                             bytes.size());
      ++replayed;
    }
  }
  std::printf("replayed %zu inputs\n", replayed);
  return replayed > 0 ? 0 : 1;
}
