// Training-state checkpoints (mbp/checkpoint.h) and what resuming needs besides them
// (apps/run_state.h, the loader's seek). The killed-and-resumed runs of `tally train` are
// tests/resume_test.sh; here, the C++ API:
//   * save and load restore parameters, buffers, optimizer state and step count bit for bit;
//   * a checkpoint of another model or optimizer, a truncated, damaged or missing file: an error
//     naming the file and what was wrong, and nothing copied;
//   * a new checkpoint replaces the old one only once it is complete;
//   * the options survive their text form; --checkpoint-every's forms; Loader::start_epoch(e, k).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>

#include "apps/run_state.h"
#include "core/memory.h"
#include "data/data.h"
#include "mbp/checkpoint.h"
#include "nn/state_dict.h"
#include "optim/optimizer.h"
#include "tests/model_common.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {

// Fresh random values in every float tensor (momentum buffers included), so a test never passes on zeros.
void randomize(const std::vector<std::pair<std::string, Tensor>>& tensors, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  for (const auto& [name, t] : tensors) {
    if (t.dtype() != DType::Float32) continue;
    std::vector<float> v(static_cast<std::size_t>(t.numel()));
    for (float& x : v) x = n(rng);
    Tensor dst = t;
    dst.copy_(Tensor::from_vector(v, t.shape(), Device::cpu(), Category::temporary));
  }
}

std::vector<std::pair<std::string, Tensor>> everything(const nn::Module& m, const optim::Optimizer& o) {
  auto all = nn::state_dict(m);
  for (const auto& e : o.named_state()) all.push_back(e);
  return all;
}

// The bytes of every tensor, in order: equal bytes = bit-identical state.
std::vector<std::vector<char>> bytes_of(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<std::vector<char>> out;
  for (const auto& [name, t] : tensors) {
    const Tensor c = t.contiguous();
    const auto* p = static_cast<const char*>(c.raw_data());
    out.emplace_back(p, p + c.nbytes());
  }
  return out;
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    configure_arena(Device::cpu(), kDefaultCpuArenaBytes);
    dir = fs::temp_directory_path() / fmt::format("tally-checkpoint-test-{}-{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }

  // A ResNet-20 and its SGD, every value random, the optimizer 7 steps in.
  std::pair<std::shared_ptr<nn::Module>, std::unique_ptr<optim::SGD>> trained(std::uint64_t seed) {
    auto m = test::model("resnet20", "batch", seed);
    auto o = test::sgd(*m);
    randomize(everything(*m, *o), seed);
    o->set_steps(7);
    return {m, std::move(o)};
  }
  fs::path save(std::int64_t step, const nn::Module& m, const optim::Optimizer& o) {
    mbp::TrainingState st;
    st.step = step;
    st.state = R"({"note": "caller's"})";
    st.files["metrics.csv"] = "step,loss\n1,2.5\n";
    return mbp::save_training_state(dir, m, o, st);
  }
  fs::path dir;
};

}  // namespace

TEST_F(Checkpoint, RestoresModelAndOptimizerBitForBit) {
  auto [a, oa] = trained(1);
  const fs::path ck = save(12, *a, *oa);
  EXPECT_EQ(ck, dir / "checkpoint-12");
  auto [b, ob] = trained(2);
  ASSERT_TRUE(bytes_of(everything(*a, *oa)) != bytes_of(everything(*b, *ob)));
  ob->set_steps(0);
  const mbp::TrainingState st = mbp::load_training_state(ck, *b, *ob);
  EXPECT_TRUE(bytes_of(everything(*a, *oa)) == bytes_of(everything(*b, *ob))) << "restored state differs";
  EXPECT_EQ(ob->steps(), 7);
  EXPECT_EQ(st.step, 12);
  EXPECT_EQ(st.state, R"({"note":"caller's"})");
  EXPECT_EQ(st.files.at("metrics.csv"), "step,loss\n1,2.5\n");
  // BatchNorm's running statistics and num_batches_tracked travel with the model.
  bool buffers = false;
  for (const auto& [name, t] : b->named_buffers()) buffers = buffers || name.find("running_var") != std::string::npos;
  EXPECT_TRUE(buffers);
}

TEST_F(Checkpoint, AnotherModelOrOptimizerIsAnErrorAndNothingIsCopied) {
  auto [a, oa] = trained(1);
  const fs::path ck = save(3, *a, *oa);
  auto other = test::model("resnet32", "batch", 3);
  auto oo = test::sgd(*other);
  const auto before = bytes_of(everything(*other, *oo));
  try {
    mbp::load_training_state(ck, *other, *oo);
    FAIL() << "a resnet20 checkpoint loaded into a resnet32";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("checkpoint-3/state.safetensors does not match this run's model and optimizer"), std::string::npos) << what;
    EXPECT_NE(what.find("missing keys"), std::string::npos) << what;
  }
  EXPECT_TRUE(before == bytes_of(everything(*other, *oo))) << "the failed load changed the model or optimizer";

  auto same = test::model("resnet20", "batch", 4);
  optim::AdamW adamw(same->parameters(), {});
  try {
    mbp::load_training_state(ck, *same, adamw);
    FAIL() << "an SGD checkpoint loaded into AdamW";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected a checkpoint of optimizer AdamW (this run's), found SGD"),
              std::string::npos) << e.what();
  }
}

TEST_F(Checkpoint, DamagedFilesAreNamedAndNothingIsCopied) {
  auto [a, oa] = trained(1);
  const fs::path ck = save(5, *a, *oa);
  auto [b, ob] = trained(2);
  const auto before = bytes_of(everything(*b, *ob));
  auto expect = [&](const std::string& needle) {
    try {
      mbp::load_training_state(ck, *b, *ob);
      ADD_FAILURE() << "loaded a damaged checkpoint; expected: " << needle;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_TRUE(before == bytes_of(everything(*b, *ob))) << "the failed load changed the model or optimizer";
  };
  const fs::path tensors = ck / "state.safetensors";
  const auto size = fs::file_size(tensors);
  fs::copy_file(tensors, dir / "good");
  fs::resize_file(tensors, size / 2);
  expect(fmt::format("checkpoint-5/state.safetensors: expected {} bytes (as state.json records), found {}", size, size / 2));
  fs::copy_file(dir / "good", tensors, fs::copy_options::overwrite_existing);
  {
    std::fstream f(tensors, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 3));
    const char c = static_cast<char>(f.get() ^ 0x5a);  // one byte of the last tensor, flipped
    f.seekp(static_cast<std::streamoff>(size - 3));
    f.put(c);
  }
  expect("the file is damaged");
  fs::copy_file(dir / "good", tensors, fs::copy_options::overwrite_existing);
  { std::ofstream(ck / "metrics.csv") << "step,loss\n1,9.9\n"; }  // same size, other bytes
  expect("checkpoint-5/metrics.csv: expected CRC-32");
  fs::remove(ck / "state.json");
  expect("checkpoint-5/state.json: expected the checkpoint's manifest, found no such file");
}

// The disk full or failing at a named point (TALLY_TEST_WRITE_FAIL, core/files.h): the checkpoint's
// tensors, its manifest, its copy of metrics.csv. Each is an error naming the file and the reason,
// and the last good checkpoint stays the newest, whole.
TEST_F(Checkpoint, AWriteThatFailsLeavesTheLastGoodCheckpoint) {
  auto [a, oa] = trained(1);
  save(5, *a, *oa);
  const auto good = fs::file_size(dir / "checkpoint-5" / "state.safetensors");
  mbp::TrainingState st;
  st.step = 10;
  st.files["metrics.csv"] = "step,loss\n1,2.5\n";
  for (const char* fault : {"state.safetensors:ENOSPC", "state.json:EIO", "metrics.csv:ENOSPC"}) {
    SCOPED_TRACE(fault);
    ASSERT_EQ(::setenv("TALLY_TEST_WRITE_FAIL", fault, 1), 0);
    std::string message;
    try {
      mbp::save_training_state(dir, *a, *oa, st);
    } catch (const Error& e) {
      message = e.what();
    }
    ::unsetenv("TALLY_TEST_WRITE_FAIL");
    const std::string file = std::string(fault).substr(0, std::string(fault).find(':'));
    EXPECT_NE(message.find(file), std::string::npos) << message;
    EXPECT_NE(message.find(std::string(fault).ends_with("ENOSPC") ? "No space left on device" : "Input/output error"),
              std::string::npos)
        << message;
    EXPECT_EQ(mbp::latest_checkpoint(dir), dir / "checkpoint-5");
    EXPECT_EQ(fs::file_size(dir / "checkpoint-5" / "state.safetensors"), good);
    auto [b, ob] = trained(2);
    EXPECT_EQ(mbp::load_training_state(dir / "checkpoint-5", *b, *ob).step, 5);
  }
  mbp::save_training_state(dir, *a, *oa, st);  // the fault gone, the next save completes
  EXPECT_EQ(mbp::latest_checkpoint(dir), dir / "checkpoint-10");
}

TEST_F(Checkpoint, ANewCheckpointReplacesTheOldOneOnlyWhenComplete) {
  auto [a, oa] = trained(1);
  save(5, *a, *oa);
  mbp::TrainingState st;
  st.step = 10;
  // A save that dies half-way (its tensors written, its manifest not): the old one stays the newest.
  EXPECT_THROW(mbp::save_training_state(dir, *a, *oa, st, [] { throw Error("died half-way"); }), Error);
  EXPECT_TRUE(fs::exists(dir / ".checkpoint-10.tmp"));
  EXPECT_EQ(mbp::latest_checkpoint(dir), dir / "checkpoint-5");
  auto [b, ob] = trained(2);
  EXPECT_EQ(mbp::load_training_state(*mbp::latest_checkpoint(dir), *b, *ob).step, 5);
  // The next complete save replaces it and clears the leftover.
  mbp::save_training_state(dir, *a, *oa, st);
  EXPECT_EQ(mbp::latest_checkpoint(dir), dir / "checkpoint-10");
  EXPECT_FALSE(fs::exists(dir / "checkpoint-5"));
  EXPECT_FALSE(fs::exists(dir / ".checkpoint-10.tmp"));
  // An empty newer folder (made by hand, a copy cut short) does not hide the complete one; alone, it
  // is the one whose reading fails.
  fs::create_directories(dir / "checkpoint-99");
  EXPECT_EQ(mbp::latest_checkpoint(dir), dir / "checkpoint-10");
  fs::create_directories(dir / "only_empty" / "checkpoint-3");
  EXPECT_EQ(mbp::latest_checkpoint(dir / "only_empty"), dir / "only_empty" / "checkpoint-3");
  fs::remove(dir / "checkpoint-99");
  // A folder without one; a path that is no folder.
  fs::create_directories(dir / "empty");
  EXPECT_EQ(mbp::latest_checkpoint(dir / "empty"), std::nullopt);
  EXPECT_THROW(mbp::latest_checkpoint(dir / "nowhere"), Error);
  // A folder named for another step than its manifest's.
  fs::rename(dir / "checkpoint-10", dir / "checkpoint-11");
  EXPECT_THROW(mbp::load_training_state(dir / "checkpoint-11", *b, *ob), FormatError);
}

TEST(CheckpointManifest, BadFieldsAreFormatErrors) {
  const std::vector<std::byte> none;
  auto refuses = [&](const std::string& manifest, const std::string& needle) {
    try {
      mbp::parse_checkpoint(manifest, none, {}, "ck");
      ADD_FAILURE() << "accepted " << manifest;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string head = R"({"format": "tally-training-state", "version": 1, )";
  refuses("[1, 2]", "expected a JSON object, found array");
  refuses(R"({"format": "zip"})", R"(expected format "tally-training-state", found "zip")");
  refuses(head + R"("step": -1})", R"(expected "step" to be a step count >= 0, found -1)");
  refuses(head + R"("step": 18446744073709551615})", "a step count >= 0");
  refuses(head + R"("step": 1, "optimizer": {"name": "SGD", "steps": 1}, "state": {}, "files": {}})",
          R"(expected files["state.safetensors"], found none)");
  refuses(head + R"("step": 1, "optimizer": {"name": "SGD", "steps": 1}, "state": {},
                    "files": {"state.safetensors": {"bytes": 0, "crc32": 0}, "../../etc/passwd": {"bytes": 0, "crc32": 0}}})",
          R"(expected plain file names in "files", found "../../etc/passwd")");
}

TEST(RunState, OptionsSurviveTheirTextForm) {
  app::TrainOptions o;
  o.model = "resnet32", o.lr = 0.1 + 0.2, o.weight_decay = 1e-4 / 3, o.steps = 77, o.augment = false;
  o.micro_batch = 12, o.seed = 18446744073709551615ull, o.precision = mbp::Precision::bf16, o.checkpoint_every = "10m";
  o.evaluate = false, o.num_classes = 100, o.warmup_epochs = 0.5;
  std::map<std::string, std::string> values;
  for (const auto& [k, v] : app::option_values(o)) values[k] = v;
  const app::TrainOptions back = app::options_from_values(values, "test");
  EXPECT_EQ(app::option_values(back), app::option_values(o));
  EXPECT_EQ(back.lr, o.lr);  // exactly: the text is the shortest that reads back
  EXPECT_EQ(back.weight_decay, o.weight_decay);
  values["lr"] = "fast";
  EXPECT_THROW(app::options_from_values(values, "test"), FormatError);
  values.erase("lr");
  EXPECT_THROW(app::options_from_values(values, "test"), FormatError);

  app::TrainOptions given = o;
  given.resume = "run";
  given.save = "elsewhere.safetensors", given.threads = 3;  // may change
  EXPECT_NO_THROW(app::check_resume_options(o, given, {}));
  given.model = "resnet20", given.batch_size = 64;
  try {
    app::check_resume_options(o, given, {});
    FAIL();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--model: the run has resnet32, given resnet20"), std::string::npos) << what;
    EXPECT_NE(what.find("--batch-size: the run has 128, given 64"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(app::check_resume_options(o, given, {"lr"}));  // only the flags given are compared
}

TEST(RunState, CheckpointEvery) {
  EXPECT_EQ(app::parse_checkpoint_every("").on(), false);
  EXPECT_EQ(app::parse_checkpoint_every("500").steps, 500);
  EXPECT_EQ(app::parse_checkpoint_every("90s").seconds, 90);
  EXPECT_EQ(app::parse_checkpoint_every("10m").seconds, 600);
  EXPECT_EQ(app::parse_checkpoint_every("1.5h").seconds, 5400);
  // "3E307h": a finite number of hours that is no finite number of seconds (found by fuzz_cli).
  for (const char* bad : {"0", "-5", "5x", "m", "10 m", "nan", "inf s", "-1h", "3E307h", "1e308m"})
    EXPECT_THROW(app::parse_checkpoint_every(bad), Error) << bad;
}

TEST(Loader, StartEpochAtABatchSeesTheBatchesItWouldHaveSeen) {
  const data::Split split = data::make_synthetic(300, 10, 5);
  data::LoaderOptions lo;
  lo.batch_size = 32, lo.shuffle = true, lo.augment = true, lo.normalize = true, lo.seed = 9;
  data::Loader whole(split.train, lo), seek(split.train, lo);
  whole.start_epoch(2);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(whole.next());
  seek.start_epoch(2, 3);
  for (int i = 3; i < whole.batches_per_epoch(); ++i) {
    const auto a = whole.next(), b = seek.next();
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->index, b->index);
    EXPECT_EQ(a->labels, b->labels);
    EXPECT_EQ(0, std::memcmp(a->images.data(), b->images.data(), a->images.size() * sizeof(float)));
  }
  EXPECT_FALSE(seek.next());
  seek.start_epoch(0, seek.batches_per_epoch());  // at the end: nothing left
  EXPECT_FALSE(seek.next());
  EXPECT_THROW(seek.start_epoch(0, -1), Error);
  EXPECT_THROW(seek.start_epoch(0, seek.batches_per_epoch() + 1), Error);
}

// The fuzz harness's seed of a valid checkpoint (fuzz/corpus/checkpoint, written by
// fuzz/make_seeds.py) passes every check, so fuzzing starts from inputs that reach them all.
TEST(CheckpointManifest, TheFuzzSeedOfAValidCheckpointPasses) {
  std::ifstream in(fs::path(TALLY_FIXTURES_DIR) / "../../fuzz/corpus/checkpoint/valid_crc_written_out", std::ios::binary);
  ASSERT_TRUE(in);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t nul = all.find('\0');
  ASSERT_NE(nul, std::string::npos);
  const std::span<const std::byte> tensors(reinterpret_cast<const std::byte*>(all.data()) + nul + 1, all.size() - nul - 1);
  const mbp::CheckpointContents c =
      mbp::parse_checkpoint(all.substr(0, nul), tensors, {{"metrics.csv", "step,loss\n1,2.302585\n"}}, "seed");
  EXPECT_EQ(c.state.step, 5);
  EXPECT_EQ(c.optimizer, "SGD");
  EXPECT_EQ(c.tensors.tensors.size(), 3u);
  EXPECT_EQ(c.state.files.at("metrics.csv"), "step,loss\n1,2.302585\n");
}
