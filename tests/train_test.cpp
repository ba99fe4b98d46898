// `tally train` end to end: from PyTorch-made initial weights, two SGD steps (momentum and
// weight decay on; no shuffle, no augmentation, no normalization, constant schedule) must land on
// PyTorch's weights for norm batch, group and none (fixtures from tests/gen_train_fixtures.py):
// over all tensors ||tally - torch|| <= 1% of ||torch - init||, and no tensor off by more than 10%
// of its own update. Also: bad option values are errors that list the allowed values (the
// enumerations' are refused as they are parsed: tests/options_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "apps/run_state.h"
#include "apps/trainer.h"
#include "mbp/checkpoint.h"
#include "core/error.h"
#include "core/safetensors.h"

using namespace tally;

namespace {
const std::string kDir = std::string(TALLY_FIXTURES_DIR) + "/train";

std::map<std::string, std::vector<double>> floats(const std::string& path) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [k, e] : safetensors::read(path).tensors) {
    if (e.dtype != "F32") continue;
    const auto v = safetensors::as_f32(e);
    out[k] = std::vector<double>(v.begin(), v.end());
  }
  return out;
}
}  // namespace

class TrainMatchesPyTorch : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainMatchesPyTorch, WeightsAfterTwoSgdSteps) {
  const std::string norm = GetParam();
  const auto tmp = std::filesystem::temp_directory_path() / ("tally_train_test_" + norm);
  std::filesystem::remove_all(tmp);  // a finished run's folder is never written over
  std::filesystem::create_directories(tmp);
  app::TrainOptions o;
  o.model = "resnet20";
  o.norm = *app::enum_from<nn::Norm>(norm);
  o.data = "cifar10:" + kDir + "/tiny_cifar10";
  o.steps = 2;
  o.batch_size = 16;
  o.optimizer = app::OptimizerKind::sgd;
  o.lr = 0.01;
  o.momentum = 0.9;
  o.weight_decay = 5e-4;
  o.schedule = "constant";
  o.augment = false;
  o.shuffle = false;
  o.normalize = false;
  o.device = "cpu";
  o.memory_limit = "256MiB";  // every test states its budget: none depends on the machine
  o.init = kDir + "/init_" + norm + ".safetensors";
  o.save = (tmp / "final.safetensors").string();
  o.out = tmp.string();
  o.progress = false;
  std::ostringstream log;
  const app::TrainResult r = app::train(o, log);
  EXPECT_EQ(r.steps, 2);
  EXPECT_TRUE(std::filesystem::exists(tmp / "metrics.csv"));
  EXPECT_TRUE(std::filesystem::exists(tmp / "summary.json"));

  const auto init = floats(o.init), torch = floats(kDir + "/final_" + norm + ".safetensors"), ours = floats(o.save);
  ASSERT_EQ(ours.size(), torch.size());
  double diff2 = 0, upd2 = 0, worst = 0;
  std::string worst_name;
  for (const auto& [name, t] : torch) {
    ASSERT_TRUE(ours.count(name)) << name;
    const auto& a = ours.at(name);
    const auto& i0 = init.at(name);
    ASSERT_EQ(a.size(), t.size()) << name;
    double d = 0, u = 0;
    for (std::size_t k = 0; k < t.size(); ++k) {
      ASSERT_TRUE(std::isfinite(a[k])) << name;
      d += (a[k] - t[k]) * (a[k] - t[k]);
      u += (t[k] - i0[k]) * (t[k] - i0[k]);
    }
    diff2 += d;
    upd2 += u;
    if (u > 0) {
      const double rel = std::sqrt(d / u);
      if (rel > worst) worst = rel, worst_name = name;
      EXPECT_LE(rel, 0.10) << name << ": off by " << rel * 100 << "% of its own update";
    } else {
      EXPECT_EQ(d, 0.0) << name << " did not change in PyTorch but did here";
    }
  }
  ASSERT_GT(upd2, 0.0);
  const double total = std::sqrt(diff2 / upd2);
  EXPECT_LE(total, 0.01) << "||tally - torch|| / ||torch - init|| = " << total;
  std::cout << "[ norm " << norm << " ] ||tally - torch|| / ||torch - init|| = " << total << "; worst tensor "
            << worst_name << " at " << worst << " of its update\n";
}

INSTANTIATE_TEST_SUITE_P(Norms, TrainMatchesPyTorch, ::testing::Values("batch", "group", "none"),
                         [](const auto& i) { return i.param; });

TEST(Train, BadOptionValuesListTheAllowedValues) {
  std::ostringstream log;
  auto expect_error = [&](app::TrainOptions o, const std::string& needle) {
    o.progress = false;
    try {
      app::train(o, log);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  app::TrainOptions o;
  o.model = "resnet99";
  expect_error(o, "resnet20, resnet32");
  o = {};
  o.schedule = "linear";
  expect_error(o, "constant, step, cosine, onecycle");
  o = {};
  o.device = "tpu";
  expect_error(o, "cpu, cuda");
  o = {};
  o.data = "imagenet:/x";
  expect_error(o, "synthetic");
  o = {};
  o.data = "cifar10:/nonexistent/dir";
  expect_error(o, "/nonexistent/dir");
  o = {};
  o.init = "/nonexistent/init.safetensors";
  expect_error(o, "/nonexistent/init.safetensors");
  o = {};
  o.batch_size = 0;
  expect_error(o, "--batch-size: must be a positive whole number, found 0");
  // The C++ entry point and the command line (cli.negative_lr) check numbers by the same rule,
  // in the same words; NaN is no number.
  o = {};
  o.lr = -1;
  expect_error(o, "--lr: must be a number in [0, 1000000], found -1");
  o = {};
  o.label_smoothing = std::nan("");
  expect_error(o, "--label-smoothing: must be a number in [0, 1], found nan");
  o = {};
  o.micro_batch = 600;
  expect_error(o, "--micro-batch must be between 1 and --batch-size 128, found 600");
  o = {};
  o.threads = 100000;  // libgomp crashed or hung on it
  expect_error(o, "--threads 100000: this machine runs");
}

// The disk full at --save or at metrics.csv (TALLY_TEST_WRITE_FAIL, core/files.h): an error naming
// the file, and the run's last checkpoint intact.
TEST(Train, AFailingWriteNamesItsFileAndKeepsTheCheckpoint) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_train_write_faults";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ostringstream log;
  app::TrainOptions o;
  o.data = "synthetic:3x16x16", o.steps = 2, o.batch_size = 16, o.progress = false, o.evaluate = false;
  o.device = "cpu", o.memory_limit = "64MiB", o.checkpoint_every = "1";
  for (const char* fault : {"w.safetensors:ENOSPC", "metrics.csv:EIO"}) {
    SCOPED_TRACE(fault);
    const std::string run = (dir / (fault[0] == 'w' ? "save" : "metrics")).string();
    app::TrainOptions t = o;
    t.out = run, t.save = (dir / "w.safetensors").string();
    ASSERT_EQ(::setenv("TALLY_TEST_WRITE_FAIL", fault, 1), 0);
    std::string message;
    try {
      app::train(t, log);
    } catch (const Error& e) {
      message = e.what();
    }
    ::unsetenv("TALLY_TEST_WRITE_FAIL");
    const std::string file = std::string(fault).substr(0, std::string(fault).find(':'));
    EXPECT_NE(message.find(file), std::string::npos) << message;
    EXPECT_NE(message.find(fault[0] == 'w' ? "No space left on device" : "Input/output error"), std::string::npos)
        << message;
    if (fault[0] == 'w') {  // after training: the final checkpoint is whole, and the run resumes from it
      EXPECT_EQ(mbp::latest_checkpoint(run), std::filesystem::path(run) / "checkpoint-2");
      EXPECT_FALSE(std::filesystem::exists(dir / "w.safetensors"));
    }
  }
}

// A loss that is not finite says what may have caused it, and weights that hold a NaN are refused
// when they are loaded: both ended as "loss is nan (try a smaller --lr)".
TEST(Train, ANonFiniteLossNamesItsLikelyCause) {
  std::ostringstream log;
  auto error_of = [&](const app::TrainOptions& o) {
    try {
      app::train(o, log);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  app::TrainOptions o;
  o.data = "synthetic:3x16x16", o.steps = 3, o.batch_size = 16, o.progress = false, o.evaluate = false;
  o.device = "cpu", o.memory_limit = "64MiB";
  app::TrainOptions wd = o;
  wd.weight_decay = 1e30;
  EXPECT_NE(error_of(wd).find("--lr x --weight-decay = "), std::string::npos) << error_of(wd);
  // The PyTorch-made ResNet-20 weights with one NaN in conv1.weight.
  auto f = safetensors::read(kDir + "/init_batch.safetensors");
  auto& conv1 = f.tensors.at("conv1.weight");
  const float nan = std::nanf("");
  std::memcpy(conv1.data.data() + 4 * 7, &nan, 4);
  const auto path = std::filesystem::temp_directory_path() / "tally_nan_init.safetensors";
  safetensors::write(path.string(), f);
  app::TrainOptions init = o;
  init.data = "cifar10:" + kDir + "/tiny_cifar10";
  init.init = path.string();
  EXPECT_NE(error_of(init).find("expected finite weights, found 1 NaN or infinite value of 432 in 'conv1.weight'"),
            std::string::npos)
      << error_of(init);
}

// What a run writes at its end is checked before it starts: the trained weights are never lost to
// a --save that cannot be written, and a finished run's files are never overwritten.
TEST(Train, WhatARunWritesAtItsEndIsCheckedFirst) {
  const auto dir = std::filesystem::temp_directory_path() / "tally_train_writes";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "finished");
  std::ofstream(dir / "finished" / "summary.json") << "{}\n";
  std::ostringstream log;
  auto expect_error = [&](app::TrainOptions o, const std::string& needle) {
    o.progress = false, o.steps = 1, o.device = "cpu", o.memory_limit = "64MiB";
    try {
      app::train(o, log);
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  app::TrainOptions o;
  o.save = "/proc/tally.safetensors";  // as root too: /proc takes no new files
  expect_error(o, "--save /proc/tally.safetensors: cannot create a file in /proc");
  o = {};
  o.save = (dir / "missing" / "w.safetensors").string();
  expect_error(o, "/missing to exist, found none");
  o = {};
  o.save = dir.string();
  expect_error(o, "expected a file to write, found a folder");
  o = {};
  o.out = (dir / "finished").string();
  expect_error(o, "holds the summary.json of an earlier run");
  EXPECT_TRUE(std::filesystem::exists(dir / "finished" / "summary.json"));
  o = {};
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);  // reading it would wait for a writer forever
  o.init = (dir / "fifo").string();
  expect_error(o, "expected a regular file, found a FIFO, a socket or a device");
  o.init = "/dev/zero";
  expect_error(o, "--init /dev/zero: expected a regular file");
  o = {};
  o.save = (dir / "fifo").string();
  expect_error(o, "expected a file to write, found no regular file (a FIFO or a device)");
  o = {};
  o.out = "/proc/tally_run";
  expect_error(o, "--out /proc/tally_run: cannot create the folder");
  {  // a run folder in use by another process (two resumes of one run): refused, naming its pid
    std::filesystem::create_directories(dir / "busy");
    const app::RunFolderLock held((dir / "busy").string(), "--out");
    o = {};
    o.out = (dir / "busy").string();
    expect_error(o, fmt::format("--out {}: another tally process (pid {}) is using this run folder", o.out, ::getpid()));
  }
  {
    const app::RunFolderLock free_again((dir / "busy").string(), "--out");  // released with its holder
  }
  EXPECT_EQ(log.str().find("step 1"), std::string::npos) << "a run started: " << log.str();
}
