// data/readers.h — the data sets read from their files: MNIST, Fashion-MNIST, CIFAR-10, CIFAR-100.
//
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
// Any file whose content is gzip (by its magic bytes) is decompressed after it is read (zlib).
// Any file that is missing, truncated or malformed — a corrupt or truncated gzip stream too —
// throws tally::FormatError naming the file, what was expected and what was found. The formats
// themselves are parsed from bytes in memory by data/formats.h, the one implementation the
// loaders and the fuzz harnesses share. Train and test sets carry the data set's usual
// normalisation constants.
#pragma once
#include <string>

#include "data/dataset.h"

namespace tally::data {

// Each reads the named files from `dir`; see the top of this file for the formats.
Split load_mnist(const std::string& dir);     // train-images-idx3-ubyte, train-labels-idx1-ubyte,
                                              // t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (or .gz)
Split load_fashion_mnist(const std::string& dir);  // the same four names
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
Split load_cifar10(const std::string& dir);   // data_batch_1..5.bin, test_batch.bin
Split load_cifar100(const std::string& dir);  // train.bin, test.bin

}  // namespace tally::data
