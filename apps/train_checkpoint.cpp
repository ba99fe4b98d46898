// apps/train_checkpoint.cpp — a run's training-state checkpoints: what one holds, writing it, and
// restoring a run from it (`tally train --resume`; apps/run_state.h has the files' format).
#include <omp.h>

#include <cmath>

#include "apps/training_run.h"
#include "core/conv_tuning.h"

namespace tally::app {

nlohmann::json TrainingRun::checkpoint_state(const std::vector<double>& limits,
                                             const std::vector<std::string>& tuning) const {
  nlohmann::json options = nlohmann::json::object();
  for (const auto& [name, value] : option_values(run_options_)) options[name] = value;
  nlohmann::json per_rank;  // null for one rank
  if (tuning.size() > 1)
    for (const std::string& record : tuning) per_rank.push_back(nlohmann::json::parse(record));
  return {{"options", options},
          {"threads", omp_get_max_threads()},
          {"world_size", rank_.ranks},
          {"micro_batch_limits", limits},  // per rank; 0: no out-of-memory retry lowered it
          {"steps_per_epoch", per_epoch_},
          {"data_fingerprint", {{"train", split_.train.fingerprint}, {"val", split_.test.fingerprint}}},
          {"total_steps", steps_.total},
          {"epoch_loss", epoch_loss_},
          {"epoch_steps", epoch_steps_},
          {"last_loss", last_loss_},
          {"train_loss", result_.train_loss},
          {"eval", {{"loss", eval_.loss}, {"accuracy", eval_.accuracy}}},
          {"meter", {{"peak_bytes", result_.peak_bytes}, {"predicted_peak_bytes", result_.predicted_peak_bytes},
                     {"oom_retries", result_.oom_retries}, {"mismatches", meter_.mismatches},
                     {"micro_batch", result_.micro_batch}, {"micro_batches_per_step", result_.micro_batches_per_step}}},
          {"lr", setup_.optimizer->lr()},
          // The convolution engines the run used (core/conv_tuning.h): a resumed run replays them.
          // Rank 0's, and with several ranks each rank's: each tuned on its own GPU (timing picks
          // its engines, and a rank of another memory limit runs other micro-batch sizes).
          {"conv_tuning", tuning.empty() ? nlohmann::json() : nlohmann::json::parse(tuning[0])},
          {"conv_tuning_ranks", per_rank}};
}

// Each rank's record of its convolution engines, to every rank (a collective where there are
// several). None where the run does not tune (the same on every rank: the same options).
std::vector<std::string> TrainingRun::tuning_records() const {
  if (!executor_->conv_tuning()) return {};
  const std::string mine = executor_->conv_tuning()->record();
  return rank_.ranks > 1 ? distributed::all_gather_text(*rank_.world, mine) : std::vector<std::string>{mine};
}

// Every rank's micro-batch limit and engine record to rank 0 (collectives), which writes the checkpoint.
void TrainingRun::write_checkpoint() {
  std::vector<double> limits(static_cast<std::size_t>(rank_.ranks), 0.0);
  const std::int64_t mine = executor_->micro_batch_limit();
  limits[static_cast<std::size_t>(rank_.rank)] = mine == INT64_MAX ? 0.0 : static_cast<double>(mine);
  if (rank_.ranks > 1) rank_.world->all_reduce_sum(limits.data(), limits.size());
  const std::vector<std::string> tuning = tuning_records();
  last_checkpoint_ = std::chrono::steady_clock::now();
  if (rank_.rank != 0 || rank_options_.out.empty()) return;
  mbp::TrainingState st;
  st.step = meter_.steps;
  st.state = checkpoint_state(limits, tuning).dump();
  st.files["metrics.csv"] = metrics_text_;
  const auto t0 = std::chrono::steady_clock::now();
  std::function<void()> halfway;
  if (faults_.in_checkpoint(meter_.steps)) halfway = kill_self;
  const auto path = mbp::save_training_state(rank_options_.out, *setup_.model, *setup_.optimizer, st, halfway);
  result_.checkpoint = path.string();
  fmt::print(log_, "{}checkpoint: step {} -> {} ({:.0f} ms)\n", rank_options_.progress ? "\n" : "", st.step, path.string(),
               1000.0 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// The data set's files against the checkpoint's record of them (data/folder.h: files_fingerprint):
// another set of files is an error; a checkpoint written before the record existed resumes with a
// note that the data could not be checked.
void TrainingRun::check_data_fingerprint(const nlohmann::json& s) const {
  const bool ours = !split_.train.fingerprint.empty() || !split_.test.fingerprint.empty();
  if (!s.contains("data_fingerprint")) {
    if (ours)
      fmt::print(log_, "note: --resume {}: the checkpoint records no fingerprint of the data set's files (written by an "
                       "earlier tally): the folder could not be checked against it\n", rank_options_.resume);
    return;
  }
  const nlohmann::json& was = s.at("data_fingerprint");
  for (const auto& [split, now] : {std::pair<const char*, const std::string&>{"train", split_.train.fingerprint},
                                   std::pair<const char*, const std::string&>{"val", split_.test.fingerprint}}) {
    const std::string then = was.at(split).get<std::string>();
    if (then != now)
      throw Error(fmt::format("--resume {}: the data set changed since the run began: its {} files were {}, found {} "
                              "(a run resumes bit for bit only on the same files; start a new run to train on these)",
                              rank_options_.resume, split, then.empty() ? "not recorded" : then,
                              now.empty() ? "none recorded" : now));
  }
}

// A resumed GPU run plans with the convolution engines its checkpoint records (core/conv_tuning.h),
// whatever the tuning file holds now: the same engines, the same bits. A checkpoint of a run without
// tuning (or from before the record) resumes without it.
void TrainingRun::replay_conv_tuning(const std::filesystem::path& dir) {
  if (!executor_->conv_tuning()) return;
  const std::string where = fmt::format("{}/state.json", dir.string());
  const nlohmann::json s = nlohmann::json::parse(mbp::peek_training_state(dir).state, nullptr, false);
  // A rank's own record where the checkpoint keeps one per rank (written by several ranks).
  const auto ranks = s.is_discarded() ? nlohmann::json() : s.value("conv_tuning_ranks", nlohmann::json());
  if (ranks.is_array() && ranks.size() == static_cast<std::size_t>(rank_.ranks)) {
    executor_->set_conv_tuning(ConvTuning::replaying(ranks[static_cast<std::size_t>(rank_.rank)].dump(), where));
    return;
  }
  if (s.is_discarded() || !s.contains("conv_tuning") || s["conv_tuning"].is_null()) {
    executor_->set_conv_tuning(nullptr);
    fmt::print(log_, "note: --resume {}: the checkpoint records no convolution tuning: resumed with cuDNN's "
                     "heuristics' engines\n", rank_options_.resume);
    return;
  }
  executor_->set_conv_tuning(ConvTuning::replaying(s["conv_tuning"].dump(), where));
}

// A resumed run: the newest checkpoint of the run folder into the model, the optimizer, the
// executor's micro-batch limit and the run's counters, after checking that it belongs to this run.
void TrainingRun::restore() {
  const auto dir = mbp::latest_checkpoint(rank_options_.resume);
  if (!dir) throw Error(fmt::format("--resume {}: no checkpoint in it", rank_options_.resume));
  replay_conv_tuning(*dir);
  // State created where the plan places it is created by the plan: the checkpoint's values go there.
  if (!setup_.optimizer->state_created()) (void)executor_->plan(share_.size);
  const mbp::TrainingState st = mbp::load_training_state(*dir, *setup_.model, *setup_.optimizer);
  const std::string where = fmt::format("{}/state.json", dir->string());
  try {
    const nlohmann::json s = nlohmann::json::parse(st.state);
    const int ranks = s.at("world_size").get<int>(), threads = s.at("threads").get<int>();
    if (ranks != rank_.ranks)
      throw Error(fmt::format("--resume {}: the run was started on {} rank{} and resumes on as many (mpirun -np {}), "
                              "found {}", rank_options_.resume, ranks, ranks == 1 ? "" : "s", ranks, rank_.ranks));
    if (rank_.dev.is_cpu() && threads != omp_get_max_threads())
      throw Error(fmt::format("--resume {}: the run used {} CPU threads and this process has {}; a CPU run resumes bit "
                              "for bit only with as many (give --threads {})", rank_options_.resume, threads,
                              omp_get_max_threads(), threads));
    check_data_fingerprint(s);  // before the step counts: it names what changed
    if (s.at("steps_per_epoch").get<std::int64_t>() != per_epoch_ || s.at("total_steps").get<std::int64_t>() != steps_.total)
      throw Error(fmt::format("--resume {}: the run had {} steps of which {} per epoch, this one has {} and {} (has "
                              "the data set changed?)", rank_options_.resume, s.at("total_steps").dump(),
                              s.at("steps_per_epoch").dump(), steps_.total, per_epoch_));
    if (st.step > steps_.total)
      throw FormatError(fmt::format("{}: expected a step <= {}, found {}", where, steps_.total, st.step));
    const auto limits = s.at("micro_batch_limits").get<std::vector<double>>();
    if (limits.size() != static_cast<std::size_t>(ranks))
      throw FormatError(fmt::format("{}: expected {} micro-batch limits, found {}", where, ranks, limits.size()));
    for (const double limit : limits)  // 0 (no retry lowered it) or a micro-batch size the batch holds
      if (!(limit == 0 || (limit >= 1 && limit <= static_cast<double>(share_.size) && limit == std::floor(limit))))
        throw FormatError(fmt::format("{}: expected each micro-batch limit to be 0 or a whole number in [1, {}] (the "
                                      "rank's batch), found {}", where, share_.size, limit));
    const double mine = limits[static_cast<std::size_t>(rank_.rank)];
    if (mine >= 1) executor_->set_micro_batch_limit(static_cast<std::int64_t>(mine));
    const nlohmann::json& m = s.at("meter");
    result_.peak_bytes = m.at("peak_bytes").get<std::int64_t>();
    result_.predicted_peak_bytes = m.at("predicted_peak_bytes").get<std::int64_t>();
    result_.oom_retries = m.at("oom_retries").get<std::int64_t>();
    result_.micro_batch = m.at("micro_batch").get<std::int64_t>();
    result_.micro_batches_per_step = m.at("micro_batches_per_step").get<std::int64_t>();
    meter_.mismatches = m.at("mismatches").get<std::int64_t>();
    meter_.steps = st.step;
    epoch_loss_ = s.at("epoch_loss").get<double>(), epoch_steps_ = s.at("epoch_steps").get<std::int64_t>();
    last_loss_ = s.at("last_loss").get<double>(), result_.train_loss = s.at("train_loss").get<double>();
    eval_ = {s.at("eval").at("loss").get<double>(), s.at("eval").at("accuracy").get<double>()};
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(fmt::format("{}: {}", where, e.what()));
  }
  // Steps into the epoch of the last step done (all of them when it ended the epoch).
  const std::int64_t into_epoch = st.step == 0 ? 0 : st.step - (st.step - 1) / per_epoch_ * per_epoch_;
  if (epoch_steps_ != into_epoch)
    throw FormatError(fmt::format("{}: expected {} steps into the epoch at step {}, found {}", where, into_epoch, st.step,
                                  epoch_steps_));
  if (const auto it = st.files.find("metrics.csv"); it != st.files.end()) metrics_text_ = it->second;
  epoch_end_pending_ = st.step > 0 && (st.step % per_epoch_ == 0 || st.step == steps_.total);
  result_.resumed_from = st.step;
  result_.checkpoint = dir->string();
  fmt::print(log_, "resumed from {}: {} of {} steps done (epoch {}, step {} of {}){}\n", dir->string(), st.step,
             steps_.total, (st.step - (epoch_end_pending_ ? 1 : 0)) / per_epoch_ + 1, epoch_steps_, per_epoch_,
             executor_->micro_batch_limit() == INT64_MAX
                 ? ""
                 : fmt::format(", micro-batches of at most {} after out-of-memory retries", executor_->micro_batch_limit()));
}

}  // namespace tally::app
