// apps/device.cpp — `tally device`; see apps/device.h.
#include "apps/device.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "core/arena.h"
#include "core/device.h"
#include "core/device_file.h"
#include "core/error.h"

namespace tally::app {

void describe_device(const DeviceOptions& options, std::ostream& out) {
  const Device device = parse_device(options.device);
  if (!device.is_cuda())
    throw Error(fmt::format("tally device: --device expected a GPU (cuda or cuda:N), found {}", options.device));
  const DeviceFile f = tally::describe_device(device);
  fmt::print(out, "{}: {}, compute capability {}.{}, {} multiprocessors, {} of memory\n", device.str(), f.name,
             f.compute_major, f.compute_minor, f.multiprocessors, format_bytes(f.total_memory));
  fmt::print(out, "cuDNN {}'s description of it: {} bytes\n", cudnn_version_text(f.cudnn_version),
             f.cudnn_properties.size());
  if (options.save.empty()) return;
  save_device_file(f, options.save);
  fmt::print(out, "saved {}: what plans for this GPU need of it, on a machine without it (docs/gpu.md)\n", options.save);
}

}  // namespace tally::app
