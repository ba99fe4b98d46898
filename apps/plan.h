// apps/plan.h — `tally plan`: the memory plan of a training step, without training.
//
// Builds the model and optimizer on a virtual arena of the budget's size (no memory is touched
// and nothing is computed), prints the per-layer table (report/layer_table.h) at the planned
// micro-batch size and the plan (mbp/planner.h): B, m, k, predicted peak against the budget
// and what is live at the peak. ResNet-50 at 3x224x224, batch 4096, plans in seconds on a CPU.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

#include "apps/options.h"
#include "mbp/planner.h"

namespace tally::app {

// The options of `tally plan`: a step's (apps/options.h), with plan's defaults, and one sample's
// shape instead of a data set.
struct PlanOptions : StepOptions {
  PlanOptions() {
    model = "resnet50";
    batch_size = 256;
    device = "cpu";
  }
  std::string input = "3x224x224";  // C x H x W of one sample
  bool layers = true;               // print the per-layer table
  // The memory report (report/memory_html.h): the plan's traced dry run as one HTML page,
  // written here when set.
  std::string report;
  // A GPU's description saved by `tally device --save` (core/device_file.h): the plan of --device
  // cuda is that GPU's, made without it (docs/gpu.md, "Plans without the GPU"). Needs --memory-limit
  // as a size, and the cost model's rates given where a host tier needs them.
  std::string device_file;
};

// Prints the table and the plan to `out`; returns the plan. Bad options and budgets that cannot
// hold one sample are tally::Error / OutOfMemory with the bytes needed.
// With pipeline stages: the last stage's plan (every stage's is printed).
mbp::Plan plan(const PlanOptions& opt, std::ostream& out);

}  // namespace tally::app
