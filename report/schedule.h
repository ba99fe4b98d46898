// report/schedule.h — a picture of a pipeline step: one row per stage, each forward and backward
// of a micro-batch as a box where it ran in time, the gaps between them the stage's idle time (the
// "bubble"), measured against the (S - 1) / (k + S - 1) the schedule implies for equal stages.
#pragma once
#include <string>
#include <vector>

#include "mbp/pipeline.h"

namespace tally::report {

// `stages[s]`: stage s's trace of one step (mbp::StageRunner::trace, gathered from its rank).
std::string pipeline_svg(const std::vector<mbp::PipelineTrace>& stages, const std::string& title, int width = 1000);

}  // namespace tally::report
