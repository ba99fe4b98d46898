// apps/device.h — `tally device`: a GPU described, and saved for plans made without it
// (core/device_file.h; docs/gpu.md, "Plans without the GPU").
#pragma once
#include <ostream>
#include <string>

#include "apps/options.h"

namespace tally::app {

struct DeviceOptions : StepOptions {
  DeviceOptions() { device = "cuda"; }
  std::string save;  // the file to write (none: print only)
};

// Prints the GPU's description (name, compute capability, multiprocessors, memory, the cuDNN that
// described it) and writes it to options.save when given. An Error without a GPU.
void describe_device(const DeviceOptions& options, std::ostream& out);

}  // namespace tally::app
