// data/formats.h — the data set file formats parsed from bytes in memory: gzip (data/gzip.h), IDX
// (MNIST) and CIFAR binaries (layouts at the top of data/readers.h).
//
// These are the only parsers of data set files: load_mnist, load_cifar10 and the rest read a
// file's bytes and hand them here, and the fuzz harnesses (fuzz/) call them directly. Every
// function checks each size it reads from a header against the bytes actually present before it
// allocates or indexes, so a short input with a huge header count is refused, never allocated.
// Malformed input throws tally::FormatError naming `name` (the file, for errors only), what was
// expected and what was found; nothing reads outside the given bytes.
#pragma once
#include <array>
#include <cstdint>
#include <cstddef>
#include <string>

#include "data/dataset.h"
#include "data/gzip.h"

namespace tally::data {

// The byte -> [0,1] table used by every loader (level / 255): the IDX and CIFAR parsers here, the
// synthetic images (data/synthetic.h).
const std::array<float, 256>& level_to_float();

// The policy every reader of a data set file keeps: the size a header declares is checked against
// the bytes actually present before anything is allocated or inflated. A plain file must hold
// them; a gzip file of c bytes can inflate to at most 1032 c + 1024 bytes (deflate's largest
// ratio), so a header declaring more is a FormatError naming the file, the declared size and the
// most the file can hold — before one byte is inflated.
void check_declared_size(std::uint64_t declared, std::uint64_t file_bytes, bool gzip, const std::string& name,
                         const std::string& what);

// The size of a whole IDX file (images: 16 + count * rows * cols; labels: 8 + count) from its
// first 16 (images) or 8 (labels) bytes, with the header checks of parse_idx_images and
// parse_idx_labels.
std::uint64_t idx_declared_size(Bytes head, const std::string& name);
// Whether `head` (an IDX file's first bytes) holds enough of its header for idx_declared_size: 16
// bytes, or 8 that start with the labels magic.
bool idx_head_complete(Bytes head);

// The header of a whole IDX images file (magic 2051, count, rows, cols, then count*rows*cols
// pixel bytes), checked against the bytes present: count >= 1, rows and cols in 1..4096, no
// missing or trailing bytes.
struct IdxImagesHeader {
  std::int64_t count = 0, rows = 0, cols = 0;
};
IdxImagesHeader parse_idx_images(Bytes bytes, const std::string& name);

// The label count of a whole IDX labels file (magic 2049, count, then count label bytes).
std::int64_t parse_idx_labels(Bytes bytes, const std::string& name);

// An IDX images file and its labels (MNIST's layout) as a 10-class data set named `set_name`
// with the given normalisation constants: the counts must agree and every label be 0..9.
struct NamedBytes {
  Bytes bytes;
  std::string name;  // for errors
};
Dataset parse_idx_pair(const NamedBytes& images, const NamedBytes& labels, const char* set_name, float mean,
                       float stddev);

// Appends the records of one CIFAR binary file to `ds` (3x32x32, ds.num_classes already set).
// label_bytes is 1 (CIFAR-10: label) or 2 (CIFAR-100: coarse, fine); the last label byte is the
// one kept. The file must hold at least one whole record and nothing more than whole records.
void parse_cifar(Bytes bytes, const std::string& name, int label_bytes, Dataset& ds);

}  // namespace tally::data
