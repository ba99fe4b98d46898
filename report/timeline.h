// report/timeline.h — a picture of memory over one training step.
//
// memory_svg() draws an arena trace (Arena::set_tracing) as a stacked area chart: bytes in use
// over time, one band per category (persistent state at the bottom: parameters, gradients,
// optimizer state; then inputs, workspace, temporaries and activations), the trace's marks (the
// executor marks each micro-batch and the optimizer step) as vertical lines, and the budget and
// the peak (with the planner's prediction) as horizontal lines. The result is a self-contained
// SVG file that any browser shows.
#pragma once
#include <cstddef>
#include <optional>
#include <string>

#include "core/arena.h"

namespace tally::report {

struct TimelineOptions {
  std::string title;
  std::optional<std::size_t> budget;          // drawn when set (the arena's capacity)
  std::optional<std::size_t> predicted_peak;  // the planner's prediction, shown with the peak
  int width = 1000, height = 440;             // pixels
};

// The chart of `arena`'s current trace.
std::string memory_svg(const Arena& arena, const TimelineOptions& options);

// Two tiers in one picture: the device arena's chart above the host tier's (docs/host-tier.md),
// each with its own budget, peak and time axis (each trace is timed by its own arena).
std::string memory_svg(const Arena& device, const TimelineOptions& device_options, const Arena& host,
                       const TimelineOptions& host_options);

}  // namespace tally::report
