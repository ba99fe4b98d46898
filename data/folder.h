// data/folder.h — a folder of pictures as a data set, in the layout torchvision's ImageFolder reads:
//
//   DIR/train/<class>/<images>      the training set, one folder per class
//   DIR/val/<class>/<images>        the evaluation set (optional), the same classes
//
//   * Classes are the train folder's subfolders sorted by name (torchvision's class_to_idx); the
//     images of a class are found recursively and taken in torchvision's order (folders sorted by
//     path, the files of each sorted by name). Files ending in .jpg, .jpeg or .png (any case) are
//     images (decoded by data/images.h, told apart by their bytes); other files are skipped and
//     counted per extension (FolderSet::skipped), as torchvision's extension filter skips them.
//   * No pixels are held: the data set is the file list, and each image is read and decoded when a
//     batch needs it (Dataset::generate, on the loader's threads).
//   * Transforms, as torchvision's ImageNet recipe on PIL images (data/resample.h: PIL's bilinear
//     resize byte for byte): "imagenet" — for training (the loader's augmentation on) a random
//     resized crop (scale 0.08-1, aspect ratio 3/4-4/3, ten tries then the centre) to height x
//     width and a horizontal flip half the time, drawn from the loader's per-sample draw (seed,
//     epoch, position); for evaluation (and training without augmentation) the shorter side
//     resized to max(height, width) / 0.875 and the centre height x width. "none": an image as it
//     is, which must be height x width. Either way converted to `channels` (3: RGB, 1: grey, as
//     PIL's convert) and to floats in [0, 1] by the same division by 255 as the IDX and CIFAR
//     readers, so that a folder of PNG files written from an IDX file gives the same floats.
//   * Without DIR/val, `val_fraction` (0 < f < 1) sets aside that share of the training files for
//     evaluation, chosen by `seed` (a permutation of the file list; the rest keep their order);
//     without it the test set is empty (no evaluation).
//   * The normalisation constants are measured once, on up to 512 training images spread evenly
//     over the list (per channel, over every pixel), and stated in FolderSet::statistics.
//   * Errors, each a FormatError naming the folder or file (for an image, unless skip_bad_images): no DIR/train; a train folder without
//     class folders; an empty class folder; no image at all; a val class that is not a train class;
//     an image that cannot be decoded, is larger than `max_pixels`, or (transform none) not height x width.
#pragma once
#include <cstdint>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "data/data.h"
#include "data/images.h"

namespace tally::data {

struct FolderOptions {
  std::int64_t channels = 3, height = 0, width = 0;  // one sample's shape (--input)
  std::string transform = "imagenet";  // or "none"
  std::int64_t max_pixels = kDefaultMaxImagePixels;
  std::optional<double> val_fraction;  // only without DIR/val
  std::uint64_t seed = 0;
  // A corrupt, truncated, oversized or wrongly sized image: an error (false), or skipped (true) —
  // the sample then is the next image of its class in the list that decodes (wrapping around), so
  // batches stay full, rightly labelled and the same on every run; each bad file is recorded in
  // FolderSet::bad_images.
  bool skip_bad_images = false;
  // The training view of a JPEG decoded at 1/2, 1/4 or 1/8 where its crop allows (libjpeg-turbo's
  // DCT scaling; the pixels then are not PIL's full-scale ones); counted in *dct_scaled if set.
  bool dct_scaling = false;
  std::shared_ptr<std::atomic<std::int64_t>> dct_scaled;
  // Each split's Dataset::fingerprint (files_fingerprint, below): for a run that writes or resumes
  // checkpoints; it reads up to 32 KiB of every file, so a load that only counts does not.
  bool fingerprint = false;
};

// The files a data set skipped as bad (skip_bad_images), shared by the threads that decode.
class BadImages {
 public:
  void add(const std::string& path, const std::string& why);
  std::map<std::string, std::string> list() const;  // file -> the error
 private:
  mutable std::mutex mutex_;
  std::map<std::string, std::string> bad_;
};

// The identity of a split for resume: each file's path relative to `root`, its label, size and the
// CRC-32 of its first and last 16 KiB, in sample order, folded into one CRC-32 — "N files, B bytes,
// crc32 XXXXXXXX". It survives copying the folder elsewhere (modification times would not) and
// reads at most 32 KiB a file (10,000 files of 110 KB on average: 0.36 s from the page cache, 2.3 s
// with the cache dropped); a change inside a larger file's middle that keeps its size goes unseen.
std::string files_fingerprint(const std::string& root, const std::vector<std::string>& files,
                              const std::vector<std::int64_t>& labels);

// FolderSet::skipped's keys for entries that are not regular files: a symbolic link to nothing, and
// a FIFO, socket or device (or a link to one).
inline constexpr const char* kBrokenLink = "(broken symbolic link)";
inline constexpr const char* kSpecialFile = "(not a regular file)";

struct FolderSet {
  Split split;
  std::vector<std::string> classes;
  std::vector<std::string> train_files, test_files;  // in sample order
  // Entries skipped, by extension ("": none) for regular files that are not images, and under
  // kBrokenLink and kSpecialFile for the others.
  std::map<std::string, std::int64_t> skipped;
  std::string statistics;                            // "mean 0.2860 0.2860 0.2860, std ... over 512 images"
  std::shared_ptr<BadImages> bad_images;             // filled while samples are read (skip_bad_images)
  // The evaluation set's bad images, always skipped (each replaced by the next one of its class,
  // whatever skip_bad_images says) and recorded here: a bad val image found when a run evaluates,
  // after its training steps, must not cost the run.
  std::shared_ptr<BadImages> bad_val_images;
};
FolderSet load_folder(const std::string& dir, const FolderOptions& options);
// FolderSet::skipped in words: "3 not .jpg, .jpeg or .png (2 .txt, 1 without an extension), 1 broken
// symbolic link, 2 not regular files (FIFOs, sockets or devices)"; "" when nothing was skipped.
std::string skipped_text(const std::map<std::string, std::int64_t>& skipped);
// The transforms by name: imagenet, none.
const std::vector<std::string>& folder_transform_names();

}  // namespace tally::data
