// core/option_names.h — how tally's errors name the options a user set.
//
// The library's messages speak to whoever set the option: by default a C++ caller, who set a
// member or called a function (`ExecutorOptions::recompute`, `mbp::parse_precision`); the `tally`
// command line, whose users set flags, switches the names to its flags once at start-up
// (name_options_as_flags), so the same message says `--recompute` there. One table
// (core/option_names.cpp) holds both names of each option, so that they never drift apart.
#pragma once
#include <string>

namespace tally {

enum class Option {
  recompute,          // ExecutorOptions::recompute                  --recompute
  cost_rates,         // ExecutorOptions::cost_rates                 --copy-bandwidth and --compute-rate
  host_tier,          // ExecutorOptions::host_arena                 --host-memory-limit
  memory_format,      // mbp::parse_memory_format                    --memory-format
  precision,          // mbp::parse_precision                        --precision
  pipeline_schedule,  // mbp::parse_pipeline_schedule                --pipeline-schedule
  pipeline_stages,    // the stage count given to the pipeline's cuts --pipeline-stages
  pipeline_split,     // mbp::parse_pipeline_split                   --pipeline-split
  image_size,         // data::FolderOptions::channels, height, width --input
  transform,          // data::FolderOptions::transform              --transform
  skip_bad_images,    // data::FolderOptions::skip_bad_images        --skip-bad-images
  val_fraction,       // data::FolderOptions::val_fraction           --val-fraction
  max_image_pixels,   // data::FolderOptions::max_pixels             --max-image-pixels
  batch_size,         // the batch given to a step                   --batch-size
};

// The option's name as the current caller set it (the flag once name_options_as_flags(true)).
std::string option_name(Option o);
// `tally` calls this with true before it parses its flags; a C++ program need not call it.
void name_options_as_flags(bool on);
bool options_named_as_flags();

}  // namespace tally
