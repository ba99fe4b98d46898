// tests/options_test.cpp — the table of options (apps/options.h): each command's flags parsed into
// their fields (enumerations into enums), bad values refused in tally's words, each command's
// defaults, the names of the flags given, and the text form that checkpoints and --resume use.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "apps/options.h"
#include "apps/plan.h"
#include "apps/sweep.h"
#include "apps/trainer.h"
#include "core/error.h"

namespace tally::app {
namespace {

// Parses `args` as the flags of a command whose options are `options`; "" or the error's text.
template <class Options>
std::string parse(Options& options, std::vector<std::string> args, std::vector<std::string>* given = nullptr) {
  CLI::App cli("test");
  add_options(cli, options);
  std::reverse(args.begin(), args.end());  // CLI11 takes them last first
  try {
    cli.parse(args);
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  if (given) *given = given_options(cli);
  return "";
}

TEST(Options, EachCommandsFlagsAreParsedIntoTheirFields) {
  TrainOptions t;
  ASSERT_EQ(parse(t, {"--precision", "bf16", "--memory-format", "channels_last", "--norm", "group", "--optimizer",
                      "adamw", "--loss-normalization", "per-micro-batch", "--pipeline-schedule", "gpipe",
                      "--no-augment", "--seed", "18446744073709551615", "--micro-batch", "8", "--steps", "3",
                      "--lr", "0.25", "--no-progress", "--nesterov", "--recompute", "blocks"}),
            "");
  EXPECT_EQ(t.precision, mbp::Precision::bf16);
  EXPECT_EQ(t.memory_format, MemoryFormat::ChannelsLast);
  EXPECT_EQ(t.norm, nn::Norm::Group);
  EXPECT_EQ(t.optimizer, OptimizerKind::adamw);
  EXPECT_EQ(t.loss_normalization, mbp::LossNormalization::per_micro_batch);
  EXPECT_EQ(t.pipeline_schedule, mbp::PipelineSchedule::gpipe);
  EXPECT_EQ(t.augment, std::optional<bool>(false));
  EXPECT_EQ(t.seed, 18446744073709551615ull);
  EXPECT_EQ(t.micro_batch, std::optional<std::int64_t>(8));
  EXPECT_EQ(t.steps, std::optional<std::int64_t>(3));
  EXPECT_EQ(t.lr, 0.25);
  EXPECT_FALSE(t.progress);
  EXPECT_TRUE(t.nesterov);
  EXPECT_EQ(t.recompute, "blocks");

  PlanOptions p;
  ASSERT_EQ(parse(p, {"--precision", "bf16", "--memory-format", "contiguous", "--input", "3x32x32", "--no-layers"}), "");
  EXPECT_EQ(p.precision, mbp::Precision::bf16);
  EXPECT_EQ(p.memory_format, MemoryFormat::Contiguous);
  EXPECT_EQ(p.input, "3x32x32");
  EXPECT_FALSE(p.layers);

  SweepOptions s;
  ASSERT_EQ(parse(s, {"--lr-scaling", "sqrt", "--no-eval", "--no-progress", "--batch-sizes", "8,16", "--precision",
                      "bf16"}),
            "");
  EXPECT_EQ(s.lr_scaling, LrScaling::sqrt);
  EXPECT_FALSE(s.train.evaluate);
  EXPECT_FALSE(s.train.progress);
  EXPECT_EQ(s.batch_sizes, "8,16");
  EXPECT_EQ(s.train.precision, mbp::Precision::bf16);
}

TEST(Options, BadValuesAreRefusedInTallysWords) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> train_cases = {
      {{"--precision", "fp16"}, "--precision: expected one of fp32, bf16, found fp16"},
      {{"--norm", "layer"}, "--norm: expected one of batch, group, none, found layer"},
      {{"--optimizer", "lbfgs"}, "--optimizer: expected one of sgd, adamw, found lbfgs"},
      {{"--memory-format", "nhwc"}, "--memory-format: expected one of auto, contiguous, channels_last, found nhwc"},
      {{"--loss-normalization", "mean"}, "--loss-normalization: expected one of exact, per-micro-batch, found mean"},
      {{"--pipeline-schedule", "zb"}, "--pipeline-schedule: expected one of 1f1b, gpipe, found zb"},
      {{"--model", "resnet99"}, "--model: expected one of resnet20, resnet32"},
      {{"--schedule", "linear"}, "--schedule: expected one of constant, step, cosine, onecycle, found linear"},
      {{"--seed", "-1"}, "--seed: must be a non-negative whole number, found -1"},
      {{"--seed", "18446744073709551616"}, "--seed: must be a whole number in [0, 18446744073709551615], found "
                                           "18446744073709551616"},
      {{"--lr", "-1"}, "--lr: must be a non-negative number, found -1"},
      {{"--lr", "inf"}, "--lr: must be a non-negative number, found inf"},
      {{"--lr", "1e-400"}, "--lr: must be a non-negative number, found 1e-400 (below the smallest non-zero number a "
                           "double holds)"},
      {{"--warmup-epochs", "1e400"}, "--warmup-epochs: must be a non-negative number, found 1e400 (beyond the "
                                     "largest number a double holds)"},
      {{"--batch-size", "1e30"}, "--batch-size: must be a positive whole number, found 1e30"},
      {{"--batch-size", "0"}, "--batch-size: must be a positive whole number, found 0"},
      {{"--batch-size", "2.5"}, "--batch-size: must be a positive whole number, found 2.5"},
      {{"--micro-batch", "lots"}, "--micro-batch: must be a positive whole number or auto, found lots"},
      {{"--label-smoothing", "2"}, "--label-smoothing: must be a number in [0, 1], found 2"},
  };
  for (const Case& c : train_cases) {
    TrainOptions t;
    EXPECT_NE(parse(t, c.args).find(c.message), std::string::npos) << c.args[0] << " " << c.args[1] << ": "
                                                                     << parse(t, c.args);
  }
  // An empty value is refused whatever the flag: it would otherwise mean "the default" silently
  // (--resume '' a fresh run, --save '' no weights).
  for (const char* flag : {"--resume", "--save", "--out", "--init", "--pipeline-split", "--checkpoint-every",
                           "--precision", "--data", "--memory-limit"}) {
    TrainOptions t;
    EXPECT_EQ(parse(t, {flag, ""}),
              std::string(flag) + ": expected a value, found an empty one (leave the flag out for its default)");
  }
  {
    TrainOptions t;  // CLI11 said "--data: At Most 1 required but received 2"
    EXPECT_EQ(parse(t, {"--data", "synthetic", "--data", "mnist:x"}),
              "--data: expected one value, found 2 (synthetic, mnist:x): give the flag once");
  }
  SweepOptions s;
  EXPECT_EQ(parse(s, {"--lr-scaling", "cubic"}), "--lr-scaling: expected one of linear, sqrt, found cubic");
  PlanOptions p;
  EXPECT_EQ(parse(p, {"--precision", "fp8"}), "--precision: expected one of fp32, bf16, found fp8");
  // Flags a command does not take are unknown to it; --steps and --epochs exclude each other.
  EXPECT_NE(parse(p, {"--lr", "0.1"}), "");
  EXPECT_NE(parse(s, {"--batch-size", "64"}), "");
  TrainOptions t;
  EXPECT_NE(parse(t, {"--steps", "3", "--epochs", "2"}).find("excludes"), std::string::npos);
  EXPECT_NE(parse(t, {"--augment", "--no-augment"}).find("excludes"), std::string::npos);
  EXPECT_NE(parse(t, {"--resume", "r", "--out", "o"}).find("excludes"), std::string::npos);
}

TEST(Options, EachCommandStartsFromItsOwnDefaults) {
  TrainOptions t;
  PlanOptions p;
  SweepOptions s;
  ASSERT_EQ(parse(t, {}), "");
  ASSERT_EQ(parse(p, {}), "");
  ASSERT_EQ(parse(s, {}), "");
  EXPECT_EQ(t.model, "resnet20");
  EXPECT_EQ(p.model, "resnet50");
  EXPECT_EQ(p.device, "cpu");
  EXPECT_EQ(t.device, "auto");
  EXPECT_EQ(t.warmup_epochs, 0);
  EXPECT_EQ(s.train.warmup_epochs, 0.5);  // the sweep's warm-up
  // The help shows each command's default, and the enumerations' names.
  CLI::App train_cli("train"), plan_cli("plan"), sweep_cli("sweep");
  add_options(train_cli, t);
  add_options(plan_cli, p);
  add_options(sweep_cli, s);
  EXPECT_NE(train_cli.help().find("=resnet20"), std::string::npos);
  EXPECT_NE(plan_cli.help().find("=resnet50"), std::string::npos);
  EXPECT_NE(sweep_cli.help().find("NUMBER >= 0=0.5"), std::string::npos);
  EXPECT_NE(plan_cli.help().find("fp32|bf16"), std::string::npos);
  // --resume's help names the flags that may change, from the table.
  EXPECT_NE(train_cli.help().find("--workers, --threads (a CUDA run's; a CPU run keeps its count), --tuning-file (a resumed run replays its "
                                 "checkpoint's engines), --tuning-seconds, --collectives, --cuda-graphs, --profile, --save, "
                                   "--no-progress, --host-memory-limit, "
                                   "--placement, --copy-bandwidth, --compute-rate, --checkpoint-every"),
            std::string::npos)
      << train_cli.help();
  EXPECT_NE(plan_cli.help().find("auto|device|optimizer|gradients"), std::string::npos);
}

TEST(Options, TheFlagsGivenAreNamedAsTheirOptions) {
  TrainOptions t;
  std::vector<std::string> given;
  ASSERT_EQ(parse(t, {"--no-augment", "--lr", "0.2", "--no-progress", "--precision", "bf16"}, &given), "");
  std::sort(given.begin(), given.end());
  EXPECT_EQ(given, (std::vector<std::string>{"augment", "lr", "precision", "progress"}));
}

TEST(Options, TheTextFormKeepsEveryOptionAndTheSameStrings) {
  TrainOptions o;
  o.precision = mbp::Precision::bf16, o.memory_format = MemoryFormat::ChannelsLast, o.norm = nn::Norm::None;
  o.optimizer = OptimizerKind::adamw, o.loss_normalization = mbp::LossNormalization::per_micro_batch;
  std::map<std::string, std::string> values;
  for (const auto& [k, v] : option_values(o)) values[k] = v;
  // The strings state.json has always held (checkpoints written before the table resume).
  EXPECT_EQ(values.at("precision"), "bf16");
  EXPECT_EQ(values.at("memory-format"), "channels_last");
  EXPECT_EQ(values.at("norm"), "none");
  EXPECT_EQ(values.at("optimizer"), "adamw");
  EXPECT_EQ(values.at("loss-normalization"), "per-micro-batch");
  EXPECT_EQ(values.at("pipeline-schedule"), "1f1b");
  EXPECT_EQ(values.at("augment"), "default");
  EXPECT_EQ(values.at("eval"), "true");
  EXPECT_EQ(values.at("host-memory-limit"), "none");
  EXPECT_EQ(values.at("placement"), "auto");
  EXPECT_EQ(values.at("copy-bandwidth"), "measure");
  EXPECT_EQ(values.at("input"), "auto");
  EXPECT_EQ(values.at("max-image-pixels"), "89478485");
  EXPECT_EQ(values.at("workers"), "0");
  EXPECT_EQ(values.at("transform"), "imagenet");
  EXPECT_EQ(values.at("skip-bad-images"), "false");
  EXPECT_EQ(values.at("deterministic"), "on");
  EXPECT_EQ(values.size(), 53u);
  EXPECT_EQ(values.count("resume"), 0u);
  EXPECT_EQ(option_values(options_from_values(values, "test")), option_values(o));
  // A checkpoint from before --memory-format ran contiguous; one from before the pipeline had one
  // stage; one from before the host tier had none.
  for (const char* newer : {"memory-format", "pipeline-stages", "pipeline-split", "pipeline-schedule",
                            "host-memory-limit", "placement", "copy-bandwidth", "compute-rate", "input",
                            "transform", "skip-bad-images", "workers", "val-fraction", "max-image-pixels",
                            "deterministic"})
    values.erase(newer);
  const TrainOptions old = options_from_values(values, "test");
  EXPECT_EQ(old.memory_format, MemoryFormat::Contiguous);
  EXPECT_EQ(old.pipeline_stages, 1);
  EXPECT_EQ(old.host_memory_limit, "none");
  EXPECT_FALSE(old.placement.has_value());
  EXPECT_EQ(old.copy_bandwidth, "measure");
  EXPECT_EQ(old.input, "auto");
  EXPECT_EQ(old.max_image_pixels, 89478485);
  EXPECT_EQ(old.deterministic, OnOff::on) << "a checkpoint from before --deterministic ran deterministic";
  values["precision"] = "fp16";
  try {
    (void)options_from_values(values, "state.json");
    ADD_FAILURE() << "fp16 was read";
  } catch (const FormatError& e) {
    EXPECT_STREQ(e.what(), "state.json: option \"precision\": expected one of fp32, bf16, found fp16");
  }
}

TEST(Options, AResumedRunTakesOnlyTheChangeableFlags) {
  TrainOptions saved;
  saved.resume = "run", saved.out = "run", saved.threads = 2, saved.lr = 0.3;
  TrainOptions given = saved;
  given.threads = 1, given.progress = false, given.save = "w.safetensors";
  const TrainOptions o = resumed_options(saved, given, {"threads", "no-such", "progress", "save"});
  EXPECT_EQ(o.threads, 1);
  EXPECT_FALSE(o.progress);
  EXPECT_EQ(o.save, "w.safetensors");
  given.lr = 0.1;
  try {
    (void)resumed_options(saved, given, {"lr"});
    ADD_FAILURE() << "a changed --lr was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--lr: the run has 0.3, given 0.1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("only --workers, --threads (a CUDA run's; a CPU run keeps its count), --tuning-file (a resumed run replays "
                      "its checkpoint's engines), --tuning-seconds, --collectives, --cuda-graphs, --profile, --save, --no-progress, "
                                         "--host-memory-limit, --placement, --copy-bandwidth, --compute-rate, "
                                         "--checkpoint-every may change"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(options_changeable_on_resume(),
            (std::vector<std::string>{"workers", "threads", "tuning-file", "tuning-seconds", "collectives", "cuda-graphs", "profile", "save", "out", "progress", "host-memory-limit",
                                      "placement", "copy-bandwidth", "compute-rate", "checkpoint-every"}));
}

}  // namespace
}  // namespace tally::app
