// mbp/step_inputs.h — the pieces of a step's input handling that the plain step (mbp/executor.cpp)
// and a pipeline stage's (mbp/stage_runner.cpp) share: batch shapes, the micro-batch sizes
// checked, the loss divisor, and the host batch staged onto the device (core/staging.h) in one
// layout — all images, then all labels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/ops.h"
#include "core/staging.h"
#include "core/tensor.h"

namespace tally::mbp::detail {

// n samples of `sample` shape: {n, sample...}.
Shape batch_shape(std::int64_t n, const Shape& sample);
// The sum of the micro-batch sizes, each checked (>= 1, at least one).
std::int64_t checked_batch(const std::vector<std::int64_t>& sizes);
// The loss divisor D of a whole batch, counted on the host; an Error when it counts no target.
double batch_divisor(const std::int64_t* labels, std::int64_t batch, const CrossEntropyOptions& loss);
// The bytes of staging `n` samples take: their images in `dtype`, then their labels.
std::size_t staging_bytes(std::int64_t n, std::int64_t sample_numel, DType dtype);
// The stager's needs for a step of micro-batches of `sizes` (InputStager::reserve).
void reserve_staging(InputStager& stager, const std::vector<std::int64_t>& sizes, std::int64_t sample_numel,
                     DType dtype);
// Stages images [offset, offset + n) of the host batch into `x` (converted to x's dtype, the
// activations'); returns the upload's ticket. `after`: InputStager::stage's.
std::size_t stage_images(Tensor& x, InputStager& stager, const float* images, std::int64_t offset, std::int64_t n,
                         std::int64_t sample_numel, std::size_t after = 0);
// The labels [offset, offset + n) into `y`.
std::size_t stage_labels(Tensor& y, InputStager& stager, const std::int64_t* labels, std::int64_t offset,
                         std::int64_t n, std::size_t after = 0);
// The input slots of a GPU's steps (mbp/executor.h, "Input slots"): two blocks of images and of
// labels for `capacity` samples, the stager's fence after the last work that read each (0: none),
// and the one the next micro-batch takes.
struct InputSlots {
  Tensor x[2], y[2];
  std::size_t ready[2] = {0, 0};
  std::int64_t capacity = 0;  // samples; 0: no slots
  int next = 0;
};

}  // namespace tally::mbp::detail
