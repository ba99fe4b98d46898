// apps/plan.h — `tally plan`: the memory plan of a training step, without training.
//
// Builds the model and optimizer on a virtual arena of the budget's size (no memory is touched
// and nothing is computed), prints the per-layer table (mbp/report/layer_table.h) at the planned
// micro-batch size and the plan (mbp/planner.h): B, m, k, predicted peak against the budget
// and what is live at the peak. ResNet-50 at 3x224x224, batch 4096, plans in seconds on a CPU.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

#include "mbp/planner.h"

namespace tally::app {

struct PlanOptions {
  std::string model = "resnet50";
  std::string norm = "batch";
  std::string input = "3x224x224";           // C x H x W of one sample
  std::optional<std::int64_t> num_classes;   // default: 1000 for inputs of 64 pixels and more, else 10
  std::int64_t batch_size = 256;
  std::string memory_limit = "auto";
  std::optional<std::int64_t> micro_batch;   // check this m instead of searching
  std::string optimizer = "sgd";
  double momentum = 0.9;                     // SGD momentum (0: no momentum buffer)
  std::string device = "cpu";
  bool layers = true;                        // print the per-layer table
  std::string recompute = "auto";            // auto | none | blocks | blocks+layerK[-layerL] | all (mbp/executor.h)
  std::string precision = "fp32";            // fp32 | bf16 (mbp::Precision)
  std::string memory_format = "auto";  // auto | contiguous | channels_last (ExecutorOptions::memory_format)
  // Pipeline stages (mbp/pipeline.h): every stage planned in this process, each on its own limit
  // (--memory-limit: one size, or one per stage), at the micro-batch they all fit.
  int pipeline_stages = 1;
  std::string pipeline_split;
  std::string pipeline_schedule = "1f1b";
};

// Prints the table and the plan to `out`; returns the plan. Bad options and budgets that cannot
// hold one sample are tally::Error / OutOfMemory with the bytes needed.
// With pipeline stages: the last stage's plan (every stage's is printed).
mbp::Plan plan(const PlanOptions& opt, std::ostream& out);

}  // namespace tally::app
