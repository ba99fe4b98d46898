// core/conv_tuning.h — convolution engines chosen by measurement on a GPU, kept in a tuning file
// and replayed by every plan (docs/gpu.md, "Tuning").
//
// cuDNN's heuristics rank a pass's engine configurations without running them: their first choice
// is a good guess, not the fastest (PyTorch's cudnn.benchmark times them instead). A ConvTuning
// times them once per pass a step runs and remembers the fastest:
//   * which passes: those of the step a plan will run — a dry run of its micro-batch sizes (at most
//     two), recorded — not the sizes a search only tried; and only the graph API's (bf16,
//     channels-last, or TALLY_CUDNN_CONV_API=graph; kernels/cuda/cuda_kernels.h says why);
//   * measured on the device the step runs on, between steps, with buffers from its arena (freed
//     again before the step, leaving its layout as it was): every candidate the rules allow within
//     the workspace limit run once, then timed (kernels: conv2d_tune_pass); a pass whose buffers do
//     not fit the arena's free memory keeps the heuristics' choice, and the report says so;
//   * capped: past `seconds` of measuring in one call, the passes left (and one the cap cut short)
//     keep the heuristics' choice for the process, are kept by no file, and a later run measures them;
//   * kept in the tuning file, keyed by the device's name, compute capability and cuDNN version, so
//     the next run on such a device measures nothing;
//   * replayed: installed as the convolutions' table; plans made after it take the tuned engines
//     wherever the heuristics still offer them (else their own choice, said in the plan's words).
// Each pass keeps two choices: the fastest within the workspace limit, and the fastest within the
// heuristics' own choice's workspace ("within"), which can never make a step need more memory.
// The executor installs the fastest, plans again, and falls back to "within" (and then to none)
// if that plan's micro-batch would be smaller than the plan's without tuning (mbp/executor_plan.cpp).
// The level is a pass's own: once a plan of the run has taken a pass's engine, the pass keeps that
// level for the rest of the run (pin()) — a later plan that falls back changes its own passes only,
// never the engines of steps already run.
// A checkpoint records the passes its run used and each one's level (record()); a resumed run
// replays exactly those (replaying()): the same engines, so the same bits.
//
// The file is JSON: {"format": "tally convolution tuning", "version": 1, "devices": {DEVICE:
// {PASS: {"rank", "engine", "workspace", "ms", "within_rank", "within_engine", "within_workspace",
// "within_ms", "heuristic_rank", "heuristic_engine", "heuristic_workspace", "heuristic_ms",
// "candidates"}}}}, DEVICE as "NVIDIA H100 80GB HBM3, compute capability 9.0, cuDNN 9.19.0" and PASS
// as kernels/cuda/cuda_kernels.h's conv2d_tuning_key. Written whole and renamed into place. A
// damaged file is an Error naming it and what was expected (delete it, or --tuning-file none).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "core/arena.h"
#include "core/device.h"
#include "kernels/common.h"

namespace tally {

class ConvTuning {
 public:
  static constexpr double kDefaultSeconds = 60;
  using Table = std::map<std::string, kernels::TunedConvPass>;
  enum class Use { fastest, within, none };

  // `path`: the tuning file, read now if it exists (empty: none — measured choices kept in memory).
  // `seconds`: the cap on measuring in one tune().
  explicit ConvTuning(std::filesystem::path path, double seconds = kDefaultSeconds);
  // The default file: $XDG_CACHE_HOME/tally/conv-tuning.json, else ~/.cache/tally/conv-tuning.json
  // (empty when neither variable is set).
  static std::filesystem::path default_path();
  // A tuning that replays a checkpoint's record (record()): its passes and choice are the table;
  // nothing is measured, no file read or written. A record that is not one: an Error naming it.
  static std::shared_ptr<ConvTuning> replaying(const std::string& record, const std::string& where);

  // The passes `dry_run` (a dry run of the step a plan runs) plans through the graph API: each that
  // has no entry for `device` measured there with buffers from `arena` (the real arena of the
  // step, between steps), within the cap; the file written if anything was measured; the table
  // installed. Returns whether the installed table changed (plans made before must be made again).
  bool tune(Device device, Arena& arena, const std::function<void()>& dry_run);
  // Installs the table of the device this process plans for (a GPU, or the one a device file
  // describes: core/device_file.h): each pinned pass at its own level, the others as `use` says
  // (none until a caller says otherwise: a pass is tuned once a plan has chosen its level); returns
  // whether that changed the installed table.
  bool install(Use use);
  // The executor's choice for the plan it applies (mbp/executor_plan.cpp), made with these:
  // whether a pass the last tune() saw has an entry and no level yet (undecided), those passes at
  // `use` for a trial plan, the others as installed (trial), and then `use` kept by them from now
  // on, whatever a later install() says (pin; the table installed so).
  bool undecided() const;
  bool trial(Use use);
  void pin(Use use);
  // A new run in this process (a sweep's next): no pass keeps a level any more — but a replay's,
  // which are its record's.
  void unpin_all() {
    if (!replay_only_) pinned_.clear();
  }
  // No table installed (a run without tuning after one with it, in one process); returns whether
  // that changed anything.
  static bool install_none();
  Use in_use() const { return use_; }
  // What the last tune() did, in a line: "tuning: 24 passes measured in 8.1 s (cap 60 s), ...".
  const std::string& report() const { return report_; }
  // The passes this process's tune() calls saw, with their entries and each one's level: JSON
  // text, what a checkpoint keeps (replaying() reads it). {"device", "use": the first pass's level,
  // "passes", and "uses": {PASS: level} for those at another}.
  std::string record() const;
  const std::filesystem::path& path() const { return path_; }
  // The entries of the device this process plans for.
  const Table& table();

 private:
  ConvTuning() = default;
  std::string device_key() const;
  std::string table_key() const;  // the device whose entries are in use: a replayed record's, else this process's
  Use level(const std::string& key) const;  // a pass's level: its pin, else use_
  bool put_levels(Use unpinned, std::optional<Use> last);  // the table resolved by level, put
  static bool put(const Table& table);      // into the kernels; whether that changed them

  std::filesystem::path path_;
  double seconds_ = kDefaultSeconds;
  bool replay_only_ = false;
  std::map<std::string, Table> devices_;  // the file's entries, by device
  Use use_ = Use::none;                    // the level of the passes not pinned
  std::map<std::string, Use> pinned_;      // the passes a plan of this run took, at their level
  std::set<std::string> seen_;            // the passes tune() recorded, by key
  std::set<std::string> last_;            // those the last tune() recorded
  // Passes left to the heuristics past the cap: they keep them for the rest of the process, so
  // that a run's engines never change once it has run with them.
  std::set<std::string> declined_;
  std::string report_;
};

// Bumped at every change of the installed table: plans depend on it (mbp/chooser.cpp keys by it).
std::uint64_t conv_tuning_version();
// All that chooses a convolution's engines besides its shape: the installed table's version and the
// GPU's switches (core/device.h: cuda_kernel_switches). A plan, or a CUDA graph, made under one
// value holds under it only (mbp/chooser.cpp, mbp/executor.cpp).
std::pair<std::uint64_t, std::uint64_t> kernel_choices();

}  // namespace tally
