// bench/bench_folder.cpp — images per second of a folder data set's input pipeline alone
// (data/folder.h): read, decode, the ImageNet recipe's training view (random resized crop to
// SIZE x SIZE with PIL's bilinear resize, flip) and normalisation, through data::Loader with N
// workers. bench/folder_pipeline.sh runs it beside torchvision's ImageFolder + DataLoader.
//   bench_folder DIR WORKERS [SIZE=224] [BATCH=64] [BATCHES=all] [dct]
// With "dct", JPEGs whose crop allows it are decoded at 1/2, 1/4 or 1/8 (not PIL's full-scale
// pixels). Prints one line: "tally workers=N images=M seconds=S images_per_second=R [dct_scaled=K]".
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "data/data.h"
#include "data/folder.h"

int main(int argc, char** argv) {
  using namespace tally;
  if (argc < 3) {
    std::fprintf(stderr, "usage: bench_folder DIR WORKERS [SIZE=224] [BATCH=64] [BATCHES=all] [dct]\n");
    return 2;
  }
  try {
    data::FolderOptions fo;
    fo.channels = 3;
    fo.height = fo.width = argc > 3 ? std::atoll(argv[3]) : 224;
    fo.dct_scaling = argc > 6 && std::string(argv[6]) == "dct";
    fo.dct_scaled = std::make_shared<std::atomic<std::int64_t>>(0);
    const data::FolderSet set = data::load_folder(argv[1], fo);
    data::LoaderOptions lo;
    lo.batch_size = argc > 4 ? std::atoll(argv[4]) : 64;
    lo.augment = true;
    lo.normalize = true;
    lo.workers = std::atoi(argv[2]);
    data::Loader loader(set.split.train, lo);
    const std::int64_t batches = argc > 5 ? std::min<std::int64_t>(std::atoll(argv[5]), loader.batches_per_epoch())
                                          : loader.batches_per_epoch();
    loader.start_epoch(0);
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t images = 0;
    for (std::int64_t k = 0; k < batches; ++k) {
      std::optional<data::Batch> b = loader.next();
      images += b->size;
      loader.give_back(std::move(*b));  // as tally train does
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("tally workers={} images={} seconds={:.3f} images_per_second={:.1f}{}\n", lo.workers, images, s,
               static_cast<double>(images) / s, fo.dct_scaling ? fmt::format(" dct_scaled={}", fo.dct_scaled->load()) : "");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_folder: %s\n", e.what());
    return 1;
  }
  return 0;
}
