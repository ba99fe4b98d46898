// tests/sweep_test.cpp — `tally sweep` (apps/sweep.h): the list and the scaling rule, the errors
// raised before any training, and a small real sweep's files.
#include <cmath>
#include <functional>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "apps/sweep.h"
#include "core/arena.h"
#include "core/error.h"

namespace tally::app {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a tally::Error, nothing was thrown";
  return "";
}

TEST(Sweep, BatchSizeListsAreParsedOrRejectedByName) {
  EXPECT_EQ(parse_batch_sizes("128,256,512"), (std::vector<std::int64_t>{128, 256, 512}));
  EXPECT_EQ(parse_batch_sizes("7"), (std::vector<std::int64_t>{7}));
  for (const char* bad : {"", ",", "128,,256", "128,", "0,128", "-4", "12a", "1e3", "128,128", " 64"}) {
    const std::string e = error_of([&] { parse_batch_sizes(bad); });
    EXPECT_NE(e.find("--batch-sizes"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(error_of([] { parse_batch_sizes("64,32,64"); }).find("listed twice"), std::string::npos);
}

TEST(Sweep, LearningRateScalesLinearlyOrBySquareRoot) {
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, 512, 128, LrScaling::linear), 0.4);
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, 512, 128, LrScaling::sqrt), 0.2);
  EXPECT_DOUBLE_EQ(scaled_lr(0.1, 64, 128, LrScaling::linear), 0.05);
}

SweepOptions small(const std::string& dir) {
  SweepOptions o;
  o.train.data = "synthetic";
  o.train.device = "cpu";
  o.train.steps = 1;
  o.train.memory_limit = "24MiB";
  o.train.warmup_epochs = 0;
  o.train.out = dir;
  o.batch_sizes = "16,64";
  return o;
}

TEST(Sweep, BadInputsFailBeforeAnyTraining) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_sweep_bad";
  std::filesystem::remove_all(dir);
  std::ostringstream log;
  SweepOptions o = small(dir.string());
  o.batch_sizes = "16,20000";  // the synthetic set has 10,000 training samples
  EXPECT_NE(error_of([&] { sweep(o, log); }).find("larger than the 10000 training samples"), std::string::npos);
  o = small(dir.string());
  o.train.memory_limit = "2MiB";  // not even one sample
  try {
    sweep(o, log);
    ADD_FAILURE() << "a limit that cannot hold one sample was accepted";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("batch size 16"), std::string::npos) << e.what();
  }
  o = small(dir.string());
  o.train.steps.reset();
  o.train.epochs = 1;
  o.train.warmup_epochs = 2;
  o.warmup_given = true;  // the user's warm-up is kept, and is an error when it does not fit
  EXPECT_NE(error_of([&] { sweep(o, log); }).find("warm-up"), std::string::npos);
  o = small("");
  EXPECT_NE(error_of([&] { sweep(o, log); }).find("--out"), std::string::npos);
  o = small(dir.string());
  o.train.model = "resnet99";
  EXPECT_NE(error_of([&] { sweep(o, log); }).find("resnet20"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir / "b16")) << "a run started although the options were bad";
  EXPECT_EQ(log.str().find("[1/"), std::string::npos) << log.str();
}

TEST(Sweep, ASmallSweepWritesItsTableAndPicture) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_sweep_small";
  std::filesystem::remove_all(dir);
  std::ostringstream log;
  const SweepOptions o = small(dir.string());
  const auto rows = sweep(o, log);
  SCOPED_TRACE(log.str());
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].batch_size, 16);
  EXPECT_EQ(rows[1].batch_size, 64);
  EXPECT_DOUBLE_EQ(rows[1].lr, 4 * rows[0].lr);  // linear scaling from the first size
  EXPECT_GT(rows[1].micro_batches_per_step, 1) << "64 samples should not fit 24 MiB at once";
  for (const auto& r : rows) {
    EXPECT_EQ(r.steps, 1);
    EXPECT_EQ(r.peak_bytes, r.predicted_peak_bytes);
    EXPECT_LE(r.peak_bytes, 24 << 20);
    EXPECT_TRUE(std::isfinite(r.train_loss));
    EXPECT_GT(r.images_per_second, 0);
  }
  std::ifstream csv(dir / "sweep.csv");
  std::string header, line;
  std::getline(csv, header);
  EXPECT_EQ(header, "batch_size,micro_batch,micro_batches_per_step,steps,lr,train_loss,test_accuracy,images_per_second,"
                    "predicted_peak_bytes,peak_bytes,wall_seconds");
  int n = 0;
  while (std::getline(csv, line)) n += !line.empty();
  EXPECT_EQ(n, 2);
  std::ifstream svg_file(dir / "sweep.svg");
  const std::string svg((std::istreambuf_iterator<char>(svg_file)), std::istreambuf_iterator<char>());
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("memory limit 24.0 MiB"), std::string::npos);
  EXPECT_NE(svg.find("batch 64: "), std::string::npos);
  for (const char* f : {"b16/summary.json", "b64/summary.json", "b64/train.log", "b64/memory.svg"})
    EXPECT_TRUE(std::filesystem::exists(dir / f)) << f;
  // Each run's progress bar in the sweep's log, its other lines in its own train.log.
  EXPECT_NE(log.str().find("epoch 1/1 (1 of its 625 steps) ["), std::string::npos);
}

// --no-eval (timing sweeps): no test set, so no accuracy in the table, the picture or the log;
// --no-progress: the sweep's lines only.
TEST(Sweep, WithoutEvaluationNoAccuracyIsReported) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_sweep_no_eval";
  std::filesystem::remove_all(dir);
  std::ostringstream log;
  SweepOptions o = small(dir.string());
  o.batch_sizes = "16";
  o.train.evaluate = false;
  o.train.progress = false;
  const auto rows = sweep(o, log);
  SCOPED_TRACE(log.str());
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_FALSE(rows[0].test_accuracy.has_value());
  EXPECT_NE(log.str().find("test accuracy not measured (--no-eval, or no test set)"), std::string::npos);
  EXPECT_EQ(log.str().find("epoch 1/1 ("), std::string::npos);
  std::ifstream csv(dir / "sweep.csv");
  std::string header, line;
  std::getline(csv, header);
  std::getline(csv, line);
  EXPECT_NE(line.find(",,"), std::string::npos) << "the test_accuracy field should be empty: " << line;
  std::ifstream svg_file(dir / "sweep.svg");
  const std::string svg((std::istreambuf_iterator<char>(svg_file)), std::istreambuf_iterator<char>());
  EXPECT_NE(svg.find("test accuracy not measured (--no-eval)"), std::string::npos);
  std::ifstream row_file(dir / "b16" / "sweep_row.json");
  const std::string row((std::istreambuf_iterator<char>(row_file)), std::istreambuf_iterator<char>());
  EXPECT_NE(row.find("\"test_accuracy\": null"), std::string::npos) << row;
}

}  // namespace
}  // namespace tally::app
