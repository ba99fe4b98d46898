// mbp/checkpoint.h — training-state checkpoints: everything the next step depends on, written so
// that a process killed at any moment leaves the last complete checkpoint intact.
//
// A checkpoint is a folder `checkpoint-<step>` inside a run folder (docs/checkpoints.md):
//   state.safetensors  the model's parameters and buffers ("model.<name>", torchvision names, as
//                      nn/state_dict.h) and the optimizer's state ("optimizer.<what>.<i>",
//                      optim::Optimizer::named_state), bit for bit
//   <files>            small text files kept with it (the trainer's metrics.csv up to the step)
//   state.json         written last: format and version, the step, the optimizer's name and step
//                      count, the byte count and CRC-32 of every other file, and the caller's own
//                      state (an object: options, the data loader's position, ...)
// Writing (save_training_state): the files go into `.checkpoint-<step>.tmp/`, each fsynced; the
// folder is fsynced and renamed to `checkpoint-<step>`, the run folder fsynced; only then are older
// checkpoints removed. A crash at any point leaves either the old or the new checkpoint complete,
// and a leftover `.tmp` folder that the next save (or a resume) removes.
// Reading (load_training_state) checks everything before it copies anything: the manifest's
// fields and types, every file's size and CRC-32 (a truncated or damaged file is named, with what
// was expected and found), the tensors' names, shapes and dtypes against the model and optimizer
// (a checkpoint of another model lists every mismatch), and the optimizer's name. Errors are
// tally::FormatError (damaged files) or tally::Error (a mismatch), never a partial load.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>

#include "core/safetensors.h"
#include "nn/module.h"
#include "optim/optimizer.h"

namespace tally::mbp {

struct TrainingState {
  std::int64_t step = 0;                      // optimizer steps completed
  std::string state = "{}";                   // the caller's state: a JSON object, as text
  std::map<std::string, std::string> files;   // small text files kept with it, by file name
};

// Writes run_dir/checkpoint-<state.step>/ as above and returns its path; then removes every
// other checkpoint folder of run_dir. `after_tensors` (tests) runs once state.safetensors is
// written and before the manifest is. tally::Error naming the path on an I/O failure; the
// previous checkpoint is then still there.
std::filesystem::path save_training_state(const std::filesystem::path& run_dir, const nn::Module& model,
                                          const optim::Optimizer& optimizer, const TrainingState& state,
                                          const std::function<void()>& after_tensors = {});

// The newest complete checkpoint folder of run_dir (the highest step whose folder holds its
// manifest; an empty or cut-short newer folder does not hide it), else the newest folder (its
// reading names what it lacks), nullopt if there is none; tally::Error if run_dir is not a folder.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& run_dir);

// The step and the caller's state from a checkpoint folder's manifest alone (no tensors read or
// checked): what a resume needs before it builds the model. FormatError as below.
TrainingState peek_training_state(const std::filesystem::path& checkpoint_dir);

// Reads, checks and copies a checkpoint folder into the model and optimizer (parameters, buffers,
// optimizer state and step count); returns the rest. Nothing is copied unless everything checks.
TrainingState load_training_state(const std::filesystem::path& checkpoint_dir, nn::Module& model,
                                  optim::Optimizer& optimizer);

// The checks of load_training_state that need no model, on bytes in memory (fuzz harness):
// `manifest` is state.json's text, `tensors` state.safetensors' bytes, `files` the other files'
// contents; `where` names the folder in errors. Returns the state and the parsed tensors.
struct CheckpointContents {
  TrainingState state;
  std::string optimizer;            // the optimizer's name ("SGD", "AdamW")
  std::int64_t optimizer_steps = 0;
  safetensors::File tensors;
};
CheckpointContents parse_checkpoint(const std::string& manifest, std::span<const std::byte> tensors,
                                    const std::map<std::string, std::string>& files, const std::string& where);

}  // namespace tally::mbp
