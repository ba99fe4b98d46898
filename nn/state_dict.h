// nn/state_dict.h — a Module's state dict as a safetensors file.
//
// The state dict is every parameter and buffer under its dotted name (torchvision's names for
// the ResNets), float tensors as F32 (F64 for a float64 model) and BatchNorm's
// num_batches_tracked as I64 with shape [], exactly what
// `safetensors.torch.save_file(model.state_dict(), path)` writes — so files move both ways
// between tally and PyTorch.
#pragma once
#include <string>

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

}  // namespace tally::nn
