// data/data.h — data sets in host memory and a batch loader with one batch of prefetch.
//
// Data sets (all images are float in [0,1], layout (N, C, H, W); labels int64 in [0, classes)):
//   * MNIST and Fashion-MNIST: the four IDX files, plain or gzipped (`name` or `name.gz`). Header
//     big-endian int32: magic (2051 images, 2049 labels), count, and for images rows, cols.
//     Pixels are bytes, divided by 255. Fashion-MNIST (Zalando: 10 classes of 28x28 grey
//     clothing images, 60,000 train, 10,000 test) is read from Debian's dataset-fashion-mnist
//     (/usr/share/datasets/fashion-mnist) in place.
//   * CIFAR-10: data_batch_1..5.bin (train, in that order) and test_batch.bin; each a sequence of
//     3073-byte records: label byte, then 3072 pixel bytes (1024 R, 1024 G, 1024 B, row-major —
//     already CHW).
//   * CIFAR-100: train.bin and test.bin; 3074-byte records: coarse label, fine label (the one
//     used, 100 classes), 3072 pixel bytes.
//   * Synthetic: 10 classes of 3x32x32 images, each class a shape drawn in a class colour on a
//     random dark background with pixel noise (see data.cpp for the classes). Every value comes
//     from integer arithmetic on a counter-based generator, so the images and their statistics
//     are bit-identical on every machine for a given seed. Any other shape CxHxW ("synthetic:
//     3x224x224") and class count is *procedural*: no image is held in memory, each is drawn
//     when a batch needs it (the 32x32 drawing scaled to HxW by nearest neighbour, channel c from
//     colour channel c mod 3); classes beyond 10 repeat the 10 shapes with the class colour's
//     channels permuted (distinct up to 60 classes).
// Any file whose content is gzip (by its magic bytes) is decompressed after it is read (zlib).
// Any file that is missing, truncated or malformed — a corrupt or truncated gzip stream too —
// throws tally::FormatError naming the file, what was expected and what was found. The formats
// themselves are parsed from bytes in memory by data/formats.h, the one implementation the
// loaders and the fuzz harnesses share. Train and test sets carry the data set's usual
// normalisation constants.
//
// Loader: the samples of an epoch are visited in an order fixed by start_epoch(epoch) — a
// permutation drawn from (seed, epoch) when shuffle is on, file order otherwise — and cut into
// batches of batch_size (the last, short batch dropped when drop_last). A background thread
// builds batch k+1 while the caller holds batch k (one slot, a condition variable). Building a
// batch copies the samples and, per options, augments them (random crop from the image padded by
// 4 zero pixels on each side, then a random horizontal flip; the draw for a sample depends only on
// (seed, epoch, position in the epoch)) and normalises them ((x - mean[c]) / stddev[c], after the
// augmentation, so padding pixels become -mean/stddev as in the usual torchvision pipeline).
// Batches therefore depend only on the options, never on timing. An exception thrown while a
// batch is built is rethrown by next(). The destructor stops the thread at any point in an epoch.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace tally::data {

struct Dataset {  // images in [0,1] float, CHW; labels int64
  std::int64_t channels = 0, height = 0, width = 0, num_classes = 0;
  std::vector<float> images;              // (N, C, H, W); empty when `generate` is set
  std::vector<std::int64_t> labels;       // (N)
  // A procedural data set draws sample i into dst (C*H*W values) when it is needed; it must be
  // safe to call from several threads at once.
  std::function<void(std::int64_t i, float* dst)> generate;
  // A generated data set with an augmentation of its own (a folder's random resized crop and
  // flip, data/folder.h): sample i drawn with the loader's per-sample draw (of (seed, epoch,
  // position)) when augmenting, instead of the loader's pad-crop-flip. Unset: the loader's.
  std::function<void(std::int64_t i, std::uint64_t draw, float* dst)> generate_augmented;
  std::array<float, 3> mean{}, stddev{};  // usual per-channel normalisation (first `channels` used)
  std::string name;

  std::int64_t size() const { return static_cast<std::int64_t>(labels.size()); }
  std::int64_t sample_numel() const { return channels * height * width; }  // C*H*W
};

struct Split {
  Dataset train, test;
};

// Each reads the named files from `dir`; see the top of this file for the formats.
Split load_mnist(const std::string& dir);     // train-images-idx3-ubyte, train-labels-idx1-ubyte,
                                              // t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (or .gz)
Split load_fashion_mnist(const std::string& dir);  // the same four names
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
Split load_cifar10(const std::string& dir);   // data_batch_1..5.bin, test_batch.bin
Split load_cifar100(const std::string& dir);  // train.bin, test.bin
// Deterministic in `seed`; train and test are independent draws from the same distribution.
// mean/stddev of both are the per-channel statistics of the train set (of its first 2000
// drawings at 32x32 for a procedural set).
struct SyntheticOptions {
  std::int64_t n_train = 10000, n_test = 2000;
  std::uint64_t seed = 0;
  std::int64_t channels = 3, height = 32, width = 32, num_classes = 10;
};
Split make_synthetic(const SyntheticOptions& o);
Split make_synthetic(std::int64_t n_train = 10000, std::int64_t n_test = 2000, std::uint64_t seed = 0);
// "synthetic" | "synthetic:CxHxW" | "mnist:DIR" | "fashion-mnist" (kFashionMnistDir) |
// "fashion-mnist:DIR" | "cifar10:DIR" | "cifar100:DIR"; anything else
// throws tally::Error. num_classes applies to synthetic data only (default: 10 below 64 pixels,
// else 1000, as `tally plan`); given for another data set it must equal that set's classes.
Split load_dataset(const std::string& spec, std::optional<std::int64_t> num_classes = std::nullopt);
// Whether `spec` names the synthetic data ("synthetic" or "synthetic:CxHxW"), whose class count is chosen.
bool is_synthetic(const std::string& spec);

struct LoaderOptions {
  std::int64_t batch_size = 128;
  bool shuffle = true, augment = false, normalize = false, drop_last = true;
  std::uint64_t seed = 0;
  // The threads that draw or decode a batch's samples when the data set generates them (a folder
  // of pictures, procedural synthetic images): 0, OpenMP's default. Batches are the same for any
  // count (each sample depends only on its position).
  int workers = 0;
};

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
