// report/layer_table.h — what each layer of a model costs: the table `tally plan` prints.
//
// One dry forward in training mode at a given batch size, on a virtual arena with room to spare
// (nothing is computed), watched by a ForwardObserver: for each Module call, its output shape,
// its own parameters, the activation bytes still held when it returns (its output and what it
// saved for the backward), and the largest workspace it took. A container's row holds only what
// its own code kept beyond its children (a residual block's add and ReLU).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace tally::report {

struct LayerRow {
  std::string name;   // dotted, as in the state dict ("layer1.0.conv1"); "(model)" for the root
  std::string type;   // "Conv2d"
  int depth = 0;      // nesting depth (root = 0)
  bool leaf = true;   // no child modules
  Shape output;       // output shape without the batch dimension
  std::int64_t parameters = 0;      // this module's own parameters (not its children's)
  std::int64_t kept_bytes = 0;      // activation bytes held after the call, for the whole batch
  std::int64_t workspace_bytes = 0; // largest workspace during the call
};

// Rows in call order for a batch of `batch` samples of `sample_shape`; `arena` holds the model
// (the dry forward runs on an unbounded virtual clone of it, and of the host tier's arena when one
// is current: offloaded segments, core/offload.h, need it, and their rows then show what stays on
// the device).
// `input` is the dtype of the input (and so of the activations): bfloat16 for a bf16 mixed-precision
// step, the model's dtype if left out; `format` the activations' layout, as the step's (a
// convolution's workspace depends on it).
std::vector<LayerRow> layer_table(nn::Module& model, const Arena& arena, const Shape& sample_shape, std::int64_t batch,
                                  std::optional<DType> input = std::nullopt,
                                  MemoryFormat format = MemoryFormat::Contiguous);

// A fixed-width text table (kept bytes shown per sample) with totals.
std::string format_layer_table(const std::vector<LayerRow>& rows, std::int64_t batch);

}  // namespace tally::report
