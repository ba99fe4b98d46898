// data/loader.h — the batch loader: a data set's samples cut into batches, shuffled, augmented and
// normalised, with one batch of prefetch on a background thread.
//
// The samples of an epoch are visited in an order fixed by start_epoch(epoch) — a permutation drawn
// from (seed, epoch) when shuffle is on, file order otherwise — and cut into batches of batch_size
// (the last, short batch dropped when drop_last). A background thread builds batch k+1 while the
// caller holds batch k (one slot, a condition variable). Building a batch copies the samples and,
// per options, augments them (random crop from the image padded by 4 zero pixels on each side, then
// a random horizontal flip; the draw for a sample depends only on (seed, epoch, position in the
// epoch)) and normalises them ((x - mean[c]) / stddev[c], after the augmentation, so padding pixels
// become -mean/stddev as in the usual torchvision pipeline). Batches therefore depend only on the
// options, never on timing. An exception thrown while a batch is built is rethrown by next(). The
// destructor stops the thread at any point in an epoch.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "data/dataset.h"

namespace tally::data {

struct LoaderOptions {
  std::int64_t batch_size = 128;
  bool shuffle = true, augment = false, normalize = false, drop_last = true;
  std::uint64_t seed = 0;
  // The threads that draw or decode a batch's samples when the data set generates them (a folder
  // of pictures, procedural synthetic images): 0, OpenMP's default. Batches are the same for any
  // count (each sample depends only on its position). At most kMaxWorkers: each is a thread with
  // its own stack, and decoding gains nothing from more threads than a large machine has cores.
  int workers = 0;
};
inline constexpr int kMaxWorkers = 256;

struct Batch {
  std::int64_t size = 0;             // B (the last batch may be short when drop_last is off)
  std::vector<float> images;         // (B, C, H, W)
  std::vector<std::int64_t> labels;  // (B)
  std::int64_t index = 0;            // batch number within the epoch
};

class Loader {
 public:
  Loader(const Dataset& ds, LoaderOptions opt);  // ds must outlive the loader
  ~Loader();                                     // stops and joins the background thread
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  std::int64_t batches_per_epoch() const;
  // Sets the order for this epoch (shuffled by (seed, epoch) when shuffle, else file order) and
  // starts preparing batch `first_batch` (0 <= first_batch <= batches_per_epoch(), else
  // tally::Error): a run resumed in the middle of an epoch sees the batches it would have seen.
  // May be called at any time; a partly consumed epoch is abandoned.
  void start_epoch(std::int64_t epoch, std::int64_t first_batch = 0);
  // The next batch of the epoch; nullopt at its end. Throws tally::Error before the first
  // start_epoch, and rethrows any exception raised while the batch was built.
  std::optional<Batch> next();
  // Hands a batch's buffer back for a later batch to reuse: a batch of large images is tens of MiB,
  // which a fresh allocation maps and zeroes page by page on one thread each time. Optional.
  void give_back(Batch&& batch);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Fixed-offset access used for exact reproduction: batch k of a no-shuffle, no-augment run =
// samples [kB, (k+1)B) taken modulo the size of the set (wrapping around its end).
Batch batch_at(const Dataset& ds, std::int64_t k, std::int64_t batch_size, bool normalize);

}  // namespace tally::data
