// report/sweep.h — the picture of a batch-size sweep (`tally sweep`'s sweep.svg, apps/sweep.h): test
// accuracy and training images/s against batch size on a log axis, each run a dot, filled where
// the batch ran as micro-batches, hollow where it ran in one piece; the memory limit stated.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tally::report {

// One run of the sweep, as the picture shows it.
struct SweepPoint {
  std::int64_t batch_size = 0;
  std::int64_t micro_batch = 0, micro_batches_per_step = 0;  // the plan: micro-batches of at most micro_batch
  double images_per_second = 0;
  std::optional<double> test_accuracy;  // none: not measured (--no-eval, or no test set)
};

// The picture of `points` (in any order), under a memory limit of `memory_limit_bytes`.
std::string sweep_svg(const std::vector<SweepPoint>& points, std::int64_t memory_limit_bytes, const std::string& title);

}  // namespace tally::report
