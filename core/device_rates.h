// core/device_rates.h — a small benchmark of a device, for the cost model that chooses between
// recomputing and offloading a segment (mbp/activations.h, measure_cost_rates).
#pragma once
#include "core/tensor.h"

namespace tally {

// What moving and recomputing cost on `device`, measured (mbp/activations.h, measure_cost_rates):
// the best of four copies of 32 MiB each way between a device block and a host block (pinned where
// a GPU is present), and the best rate of a block's forward in miniature — a 3x3 convolution of 64
// channels on 4x56x56 in `dtype`, its batch norm and ReLU — counting the convolution's FLOPs only
// (as the planner counts a step's), after one untimed call. In arenas of its own, freed before it
// returns; not in a dry run.
struct DeviceRates {
  double copy_bytes_per_second = 0;  // each way, both directions averaged
  double flops_per_second = 0;
};
DeviceRates measure_device_rates(Device device, DType dtype);

}  // namespace tally
