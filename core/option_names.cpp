// core/option_names.cpp — the two names of each option (core/option_names.h).
#include "core/option_names.h"

#include <atomic>

namespace tally {
namespace {

struct Names {
  const char* cxx;   // what a C++ caller set
  const char* flag;  // what a `tally` user typed
};

// In the order of enum class Option.
constexpr Names kNames[] = {
    {"ExecutorOptions::recompute", "--recompute"},
    {"ExecutorOptions::cost_rates", "--copy-bandwidth, --compute-rate"},
    {"ExecutorOptions::host_arena", "--host-memory-limit"},
    {"mbp::parse_memory_format", "--memory-format"},
    {"mbp::parse_precision", "--precision"},
    {"mbp::parse_pipeline_schedule", "--pipeline-schedule"},
    {"the pipeline's stage count", "--pipeline-stages"},
    {"mbp::parse_pipeline_split", "--pipeline-split"},
    {"FolderOptions::channels, height, width", "--input"},
    {"FolderOptions::transform", "--transform"},
    {"FolderOptions::skip_bad_images", "--skip-bad-images"},
    {"FolderOptions::val_fraction", "--val-fraction"},
    {"FolderOptions::max_pixels", "--max-image-pixels"},
    {"the step's batch", "--batch-size"},
};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<std::size_t>(Option::batch_size) + 1,
              "one pair of names per Option");

std::atomic<bool> g_flags{false};

}  // namespace

std::string option_name(Option o) {
  const Names& n = kNames[static_cast<std::size_t>(o)];
  return g_flags.load(std::memory_order_relaxed) ? n.flag : n.cxx;
}
void name_options_as_flags(bool on) { g_flags = on; }
bool options_named_as_flags() { return g_flags.load(std::memory_order_relaxed); }

}  // namespace tally
