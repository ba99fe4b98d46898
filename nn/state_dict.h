// nn/state_dict.h — a Module's state dict as a safetensors file.
//
// The state dict is every parameter and buffer under its dotted name (torchvision's names for
// the ResNets), float tensors as F32 (F64 for a float64 model) and BatchNorm's
// num_batches_tracked as I64 with shape [], exactly what
// `safetensors.torch.save_file(model.state_dict(), path)` writes — so files move both ways
// between tally and PyTorch.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "nn/module.h"

namespace tally::nn {

// Writes the state dict atomically (core/safetensors.h: temporary file, fsync, rename).
void save_state_dict(const Module& module, const std::string& path);

// Reads `path` and copies every tensor into the module's existing parameters and buffers
// (whatever their device). Nothing is copied unless the file matches the module exactly: one
// tally::Error lists *all* problems at once — missing keys, unexpected keys, shape mismatches
// and dtype mismatches (expected vs found). A malformed file throws the tally::FormatError of
// safetensors::read, which names the file.
void load_state_dict(Module& module, const std::string& path);

// The pieces, for other files of tensors (training-state checkpoints, mbp/checkpoint.h):
// every parameter and buffer under its name;
std::vector<std::pair<std::string, Tensor>> state_dict(const Module& module);
// one tensor as a safetensors entry (F32, F64, I64, BF16);
safetensors::Entry to_entry(const std::string& name, const Tensor& t);
// and copying a file's tensors into `expected` (name -> existing tensor): nothing is copied
// unless the names, shapes and dtypes match exactly; else one tally::Error, starting with
// `what`, lists every problem.
void copy_matching(const std::vector<std::pair<std::string, Tensor>>& expected, const safetensors::File& file,
                   const std::string& what);

}  // namespace tally::nn
