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
//   * Transform "none" (the only one so far): an image as it is, which must be height x width
//     (`FolderOptions`); converted to `channels` (3: RGB, 1: grey, as PIL's convert) and to
//     floats in [0, 1] by the same division by 255 as the IDX and CIFAR readers, so that a folder of
//     PNG files written from an IDX file gives the same floats.
//   * Without DIR/val, `val_fraction` (0 < f < 1) sets aside that share of the training files for
//     evaluation, chosen by `seed` (a permutation of the file list; the rest keep their order);
//     without it the test set is empty (no evaluation).
//   * The normalisation constants are measured once, on up to 512 training images spread evenly
//     over the list (per channel, over every pixel), and stated in FolderSet::statistics.
//   * Errors, each a FormatError naming the folder or file: no DIR/train; a train folder without
//     class folders; an empty class folder; no image at all; a val class that is not a train class;
//     an image that cannot be decoded, is larger than `max_pixels`, or not height x width.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "data/data.h"
#include "data/images.h"

namespace tally::data {

struct FolderOptions {
  std::int64_t channels = 3, height = 0, width = 0;  // one sample's shape (--input)
  std::string transform = "none";
  std::int64_t max_pixels = kDefaultMaxImagePixels;
  std::optional<double> val_fraction;  // only without DIR/val
  std::uint64_t seed = 0;
};

struct FolderSet {
  Split split;
  std::vector<std::string> classes;
  std::vector<std::string> train_files, test_files;  // in sample order
  std::map<std::string, std::int64_t> skipped;       // files skipped, by extension ("" : none)
  std::string statistics;                            // "mean 0.2860 0.2860 0.2860, std ... over 512 images"
};
FolderSet load_folder(const std::string& dir, const FolderOptions& options);

}  // namespace tally::data
