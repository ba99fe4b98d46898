// data/formats.h — the data set file formats parsed from bytes in memory: gzip, IDX (MNIST) and
// CIFAR binaries (layouts at the top of data/data.h).
//
// These are the only parsers of data set files: load_mnist, load_cifar10 and the rest read a
// file's bytes and hand them here, and the fuzz harnesses (fuzz/) call them directly. Every
// function checks each size it reads from a header against the bytes actually present before it
// allocates or indexes, so a short input with a huge header count is refused, never allocated.
// Malformed input throws tally::FormatError naming `name` (the file, for errors only), what was
// expected and what was found; nothing reads outside the given bytes.
#pragma once
#include <cstdint>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "data/data.h"

namespace tally::data {

using Bytes = std::span<const std::uint8_t>;

// Whether `bytes` start with gzip's magic (1f 8b).
bool is_gzip(Bytes bytes);

// Inflates gzip data: one member or several concatenated (as `cat a.gz b.gz` makes). Corrupt data
// (a bad header, a bad deflate block, a CRC or length mismatch in a trailer) and a stream that
// stops before its trailer are FormatErrors naming `name`, the compressed offset and what was
// expected. Inflating stops with a FormatError as soon as the output passes `limit` bytes (the
// size the file's header declares: read_file's callers pass it).
std::vector<std::uint8_t> gunzip(Bytes bytes, const std::string& name, std::uint64_t limit = UINT64_MAX);
// The first n bytes gzip data inflates to (fewer when it holds fewer), the rest not inflated: a
// header, read before anything is allocated for the body.
std::vector<std::uint8_t> gunzip_head(Bytes bytes, const std::string& name, std::size_t n);

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
