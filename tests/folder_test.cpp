// A folder of pictures as a data set (data/folder.h), checked against the IDX reader: the first
// 2,000 training and 500 test images of Fashion-MNIST are written as a folder of PNG files (one
// folder per class, DIR/train and DIR/val) and, in the folder's order, as IDX files; read back as
// folder:DIR (--input 1x28x28, --transform none, no normalisation) and as fashion-mnist:DIR they
// give the same batches bit for bit — shuffled and augmented as the loader does — and ResNet-20
// trained on each gives the same losses and weights bit for bit. Then the folder's own rules:
// class order, skipped files, the held-out share, and every bad layout an error naming it.
#include <gtest/gtest.h>
#include <png.h>
#include <sys/stat.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "data/data.h"
#include "data/folder.h"
#include "mbp/executor.h"
#include "tests/command_line.h"
#include "tests/model_common.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/tally-folder-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
};

void write_png(const fs::path& path, const std::uint8_t* grey, int w, int h) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_init_io(png, f);
  png_set_IHDR(png, info, static_cast<png_uint_32>(w), static_cast<png_uint_32>(h), 8, PNG_COLOR_TYPE_GRAY,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < h; ++y) png_write_row(png, grey + static_cast<std::ptrdiff_t>(y) * w);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  std::fclose(f);
}

// A file's bytes ("" when it cannot be read).
std::string file_text(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// DIR/train/only/<name>: a one-image folder of fixture `fixture` (tests/fixtures/images).
void one_image_folder(const fs::path& dir, const std::string& fixture, const std::string& name) {
  fs::create_directories(dir / "train" / "only");
  fs::copy_file(std::string(TALLY_FIXTURES_DIR) + "/images/" + fixture, dir / "train" / "only" / name);
}

void write_file(const fs::path& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::uint8_t> be32(std::uint32_t v) {
  return {static_cast<std::uint8_t>(v >> 24), static_cast<std::uint8_t>(v >> 16), static_cast<std::uint8_t>(v >> 8),
          static_cast<std::uint8_t>(v)};
}

// Writes `n` samples of `set` (from Fashion-MNIST, floats k/255) as DIR/<part>/<class>/<index>.png
// and returns the IDX images and labels of the same samples in the folder's order (by class, then
// by file name).
std::pair<std::vector<std::uint8_t>, std::vector<std::uint8_t>> write_part(const data::Dataset& set, std::int64_t n,
                                                                           const fs::path& dir) {
  std::vector<std::vector<std::int64_t>> by_class(10);
  for (std::int64_t i = 0; i < n; ++i) by_class[static_cast<std::size_t>(set.labels[static_cast<std::size_t>(i)])].push_back(i);
  std::vector<std::uint8_t> images = be32(2051), labels = be32(2049);
  for (const auto& v : {be32(static_cast<std::uint32_t>(n)), be32(28), be32(28)}) images.insert(images.end(), v.begin(), v.end());
  const auto count = be32(static_cast<std::uint32_t>(n));
  labels.insert(labels.end(), count.begin(), count.end());
  for (std::size_t c = 0; c < 10; ++c) {
    fs::create_directories(dir / fmt::format("class{}", c));
    for (const std::int64_t i : by_class[c]) {
      std::vector<std::uint8_t> grey(28 * 28);
      for (std::size_t p = 0; p < grey.size(); ++p)
        grey[p] = static_cast<std::uint8_t>(std::lround(set.images[static_cast<std::size_t>(i) * 784 + p] * 255.0f));
      write_png(dir / fmt::format("class{}", c) / fmt::format("{:05}.png", i), grey.data(), 28, 28);
      images.insert(images.end(), grey.begin(), grey.end());
      labels.push_back(static_cast<std::uint8_t>(c));
    }
  }
  return {images, labels};
}

// The folder and the IDX files of the same Fashion-MNIST samples, once per test program.
struct Twins {
  TempDir pngs, idx;
  Twins() {
    const data::Split f = data::load_fashion_mnist(data::kFashionMnistDir);
    auto [tri, trl] = write_part(f.train, 2000, pngs.path / "train");
    auto [tei, tel] = write_part(f.test, 500, pngs.path / "val");
    write_file(idx.path / "train-images-idx3-ubyte", tri);
    write_file(idx.path / "train-labels-idx1-ubyte", trl);
    write_file(idx.path / "t10k-images-idx3-ubyte", tei);
    write_file(idx.path / "t10k-labels-idx1-ubyte", tel);
  }
};
const Twins& twins() {
  static const Twins t;
  return t;
}

data::FolderOptions grey28() {
  data::FolderOptions o;
  o.channels = 1, o.height = 28, o.width = 28;
  o.transform = "none";
  return o;
}

std::string error_of(const fs::path& dir, const data::FolderOptions& o) {
  try {
    (void)data::load_folder(dir.string(), o);
  } catch (const Error& e) {
    return e.what();
  }
  return "loaded";
}

}  // namespace

TEST(Folder, PngFolderGivesTheIdxFilesBatchesBitForBit) {
  const data::FolderSet folder = data::load_folder(twins().pngs.path.string(), grey28());
  const data::Split idx = data::load_fashion_mnist(twins().idx.path.string());
  ASSERT_EQ(folder.split.train.size(), 2000);
  ASSERT_EQ(folder.split.test.size(), 500);
  EXPECT_EQ(folder.split.train.labels, idx.train.labels);
  EXPECT_EQ(folder.split.test.labels, idx.test.labels);
  EXPECT_EQ(folder.classes.front(), "class0");
  EXPECT_NE(folder.statistics.find("over 512 training images"), std::string::npos) << folder.statistics;
  for (const bool augment : {false, true}) {
    data::LoaderOptions lo;
    lo.batch_size = 64;
    lo.seed = 7;
    lo.augment = augment;
    data::Loader a(folder.split.train, lo), b(idx.train, lo);
    for (const std::int64_t epoch : {0, 3}) {
      a.start_epoch(epoch);
      b.start_epoch(epoch);
      for (int k = 0; k < 5; ++k) {
        const auto x = a.next(), y = b.next();
        ASSERT_TRUE(x && y);
        EXPECT_EQ(x->labels, y->labels);
        ASSERT_EQ(x->images.size(), y->images.size());
        EXPECT_EQ(std::memcmp(x->images.data(), y->images.data(), x->images.size() * sizeof(float)), 0)
            << "epoch " << epoch << " batch " << k << (augment ? " augmented" : "");
      }
    }
  }
}

TEST(Folder, ResNet20TrainsOnThePngFolderWithTheIdxLossesBitForBit) {
  const data::FolderSet folder = data::load_folder(twins().pngs.path.string(), grey28());
  const data::Split idx = data::load_fashion_mnist(twins().idx.path.string());
  std::vector<std::vector<double>> losses(2);
  std::vector<std::vector<std::vector<double>>> weights;
  for (int which = 0; which < 2; ++which) {
    const data::Dataset& set = which == 0 ? folder.split.train : idx.train;
    const auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(256) << 20);
    std::shared_ptr<nn::Module> m;
    std::unique_ptr<optim::SGD> opt;
    {
      ArenaScope in_budget(budget);
      nn::manual_seed(3);
      nn::ModelConfig mc;
      mc.name = "resnet20";
      mc.in_channels = 1;
      m = nn::make_model(mc);
      m->train();
      opt = test::sgd(*m);
    }
    mbp::ExecutorOptions eo;
    eo.sample_shape = {1, 28, 28};
    eo.micro_batch = 16;
    mbp::Executor ex(*m, *opt, budget, eo);
    data::LoaderOptions lo;
    lo.batch_size = 32;
    lo.seed = 11;
    data::Loader loader(set, lo);
    loader.start_epoch(0);
    for (int step = 0; step < 4; ++step) {
      const auto batch = loader.next();
      ASSERT_TRUE(batch);
      losses[static_cast<std::size_t>(which)].push_back(ex.step(batch->images.data(), batch->labels.data(), batch->size).loss);
    }
    weights.push_back(test::values<float>(*m));
  }
  EXPECT_EQ(losses[0], losses[1]);
  for (const double l : losses[0]) EXPECT_TRUE(std::isfinite(l));
  EXPECT_TRUE(test::bitwise_equal(weights[0], weights[1]));
}

TEST(Folder, LayoutRulesAndErrorsNameWhatWasWrong) {
  TempDir t;
  const fs::path root = t.path;
  EXPECT_NE(error_of(root, grey28()).find("expected " + (root / "train").string() + " with one folder of images per class"),
            std::string::npos);
  fs::create_directories(root / "train");
  EXPECT_NE(error_of(root, grey28()).find("found no folder in it"), std::string::npos);
  std::vector<std::uint8_t> grey(28 * 28);
  for (std::size_t i = 0; i < grey.size(); ++i) grey[i] = static_cast<std::uint8_t>(i * 7);
  fs::create_directories(root / "train" / "b");
  fs::create_directories(root / "train" / "a" / "sub");
  write_png(root / "train" / "b" / "x.png", grey.data(), 28, 28);
  write_png(root / "train" / "a" / "z.PNG", grey.data(), 28, 28);
  write_png(root / "train" / "a" / "sub" / "y.png", grey.data(), 28, 28);
  write_file(root / "train" / "a" / "notes.txt", {'h', 'i'});
  write_file(root / "train" / "a" / "README", {'h', 'i'});
  fs::create_directories(root / "train" / "c");
  EXPECT_NE(error_of(root, grey28()).find("in class folder 'c', found none"), std::string::npos) << error_of(root, grey28());
  fs::remove(root / "train" / "c");
  data::FolderSet s = data::load_folder(root.string(), grey28());
  EXPECT_EQ(s.classes, (std::vector<std::string>{"a", "b"}));
  ASSERT_EQ(s.train_files.size(), 3u);
  EXPECT_EQ(fs::path(s.train_files[0]).filename(), "z.PNG") << "a's own files before its subfolder's, as os.walk";
  EXPECT_EQ(fs::path(s.train_files[1]).filename(), "y.png");
  EXPECT_EQ(s.split.train.labels, (std::vector<std::int64_t>{0, 0, 1}));
  EXPECT_EQ(s.skipped.at(".txt"), 1);
  EXPECT_EQ(s.skipped.at(""), 1);
  EXPECT_EQ(s.split.test.size(), 0) << "no val folder, no fraction: no evaluation";
  // Entries that are not regular files are counted and said, not passed over in silence: a link
  // to nothing, a FIFO; a link that leads back into the folder is an error naming it.
  fs::create_symlink(root / "nowhere.png", root / "train" / "a" / "gone.png");
  ASSERT_EQ(::mkfifo((root / "train" / "a" / "pipe.png").c_str(), 0600), 0);
  s = data::load_folder(root.string(), grey28());
  EXPECT_EQ(s.train_files.size(), 3u);
  EXPECT_EQ(s.skipped.at(data::kBrokenLink), 1);
  EXPECT_EQ(s.skipped.at(data::kSpecialFile), 1);
  EXPECT_EQ(data::skipped_text(s.skipped), "2 not .jpg, .jpeg or .png (1 without an extension, 1 .txt), 1 broken "
                                           "symbolic link, 1 not a regular file (FIFOs, sockets or devices)");
  fs::remove(root / "train" / "a" / "gone.png");
  fs::remove(root / "train" / "a" / "pipe.png");
  fs::create_directory_symlink(root / "train" / "a", root / "train" / "a" / "sub" / "loop");
  const std::string looped = error_of(root, grey28());
  EXPECT_NE(looped.find(fmt::format("{}: expected a folder of images, found a second way into {} ({} leads there",
                                    (root / "train" / "a").string(), fs::weakly_canonical(root / "train" / "a").string(),
                                    (root / "train" / "a" / "sub" / "loop").string())),
            std::string::npos) << looped;
  fs::remove(root / "train" / "a" / "sub" / "loop");
  // A held-out share, by the seed.
  data::FolderOptions o = grey28();
  o.val_fraction = 0.34;
  s = data::load_folder(root.string(), o);
  EXPECT_EQ(s.split.train.size() + s.split.test.size(), 3);
  EXPECT_EQ(s.split.test.size(), 1);
  o.val_fraction = 1.5;
  // A C++ caller set FolderOptions::val_fraction; `tally` names its flag (core/option_names.h).
  EXPECT_NE(error_of(root, o).find("FolderOptions::val_fraction: expected a number in (0, 1), found 1.5"),
            std::string::npos)
      << error_of(root, o);
  // val as a file, or an empty val folder: errors, not a silent "no evaluation".
  write_file(root / "val", {'x'});
  EXPECT_NE(error_of(root, grey28()).find("/val: expected the evaluation set, a folder of class folders of images, found "
                                          "something else (a file?)"), std::string::npos) << error_of(root, grey28());
  fs::remove(root / "val");
  fs::create_directories(root / "val" / "a");
  EXPECT_NE(error_of(root, grey28()).find("/val: expected the evaluation set's images in class folders, found none"),
            std::string::npos) << error_of(root, grey28());
  fs::remove_all(root / "val");
  // A val class that train lacks; a wrong size; a file that is not an image.
  fs::create_directories(root / "val" / "zebra");
  EXPECT_NE(error_of(root, grey28()).find("class folder 'zebra' is not a class of"), std::string::npos);
  fs::remove_all(root / "val");
  data::FolderOptions big = grey28();
  big.height = 32;
  EXPECT_NE(error_of(root, big).find("expected an image 28 wide and 32 high (FolderOptions::channels, height, width "
                                     "1x32x28, channels x height x width, with FolderOptions::transform none), found "
                                     "one 28 wide and 28 high"),
            std::string::npos)
      << error_of(root, big);
  // A file that is not what its name says: an error naming it when it is read (here, already while
  // the statistics are measured).
  write_file(root / "train" / "b" / "broken.png", {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0});
  EXPECT_NE(error_of(root, grey28()).find("broken.png: expected a PNG header"), std::string::npos)
      << error_of(root, grey28());
}

// The command line: `tally train --data folder:DIR --input 1x28x28 --no-normalize` and `--data
// fashion-mnist:DIR --no-normalize` (both --no-augment) on the twins give the same losses (metrics.csv) and the same
// weights (--save) bit for bit, evaluation included (DIR/val against the t10k files).
TEST(Folder, TheCommandLineTrainsOnTheFolderAsOnTheIdxFiles) {
  const fs::path out = test::fresh_dir("tally-folder-cli");
  // --no-augment: augmentation is on by default, but for MNIST and Fashion-MNIST.
  const std::string common = "--model resnet20 --batch-size 64 --steps 6 --no-normalize --no-augment --threads 2 "
                             "--no-progress --memory-limit 256MiB";
  for (const auto& [name, data] : {std::pair<std::string, std::string>{"png", fmt::format("folder:{} --input 1x28x28 --transform none",
                                                                                          twins().pngs.path.string())},
                                   {"idx", fmt::format("fashion-mnist:{}", twins().idx.path.string())}})
    ASSERT_EQ(test::run_command(fmt::format("{} train --data {} {} --out {} --save {}.safetensors > {}.log 2>&1", TALLY_EXE,
                                            data, common, (out / name).string(), (out / name).string(),
                                            (out / name).string())),
              0)
        << name;
  const std::string a = file_text(out / "png" / "metrics.csv"), b = file_text(out / "idx" / "metrics.csv");
  // step, epoch, loss and lr: the same; the memory and speed columns are the runs' own.
  const auto losses = [](const std::string& csv) {
    std::string keep, line;
    std::istringstream in(csv);
    while (std::getline(in, line)) {
      std::size_t cut = 0;
      for (int i = 0; i < 4 && cut != std::string::npos; ++i) cut = line.find(',', cut + 1);
      keep += line.substr(0, cut) + "\n";
    }
    return keep;
  };
  EXPECT_EQ(losses(a), losses(b));
  EXPECT_TRUE(file_text(out / "png.safetensors") == file_text(out / "idx.safetensors")) << "the trained weights differ";
  const std::string log = file_text(out / "png.log");
  EXPECT_NE(log.find("10 classes, 2000 training images, 500 for evaluation"), std::string::npos) << log;
  EXPECT_NE(file_text(out / "png" / "summary.json").find("\"test_accuracy\": "), std::string::npos);
  fs::remove_all(out);
}

// Workers: the batches are the same with 1, 2 and 3 decoding threads (and with each batch's buffer
// given back for the next, Loader::give_back); a run killed after its
// fourth step and resumed with another count of workers ends with the uninterrupted run's
// weights, bit for bit.
TEST(Folder, WorkersChangeNoBatchAndAResumedRunNoBit) {
  const data::FolderSet folder = data::load_folder(twins().pngs.path.string(), grey28());
  std::vector<std::vector<float>> first;
  for (const int workers : {1, 2, 3}) {
    data::LoaderOptions lo;
    lo.batch_size = 50;
    lo.seed = 5;
    lo.augment = true;
    lo.workers = workers;
    data::Loader loader(folder.split.train, lo);
    loader.start_epoch(1);
    std::vector<float> all;
    for (int k = 0; k < 4; ++k) {
      auto b = loader.next();
      ASSERT_TRUE(b);
      all.insert(all.end(), b->images.begin(), b->images.end());
      if (workers == 2) loader.give_back(std::move(*b));  // a reused buffer changes nothing either
    }
    first.push_back(all);
  }
  EXPECT_TRUE(first[0] == first[1] && first[0] == first[2]) << "the worker count changed a batch";

  const fs::path out = test::fresh_dir("tally-folder-resume");
  const std::string args = fmt::format("{} train --data folder:{} --input 1x28x28 --model resnet20 --batch-size 50 --steps 8 "
                                       "--threads 2 --no-progress --no-eval --memory-limit 256MiB --checkpoint-every 2",
                                       TALLY_EXE, twins().pngs.path.string());
  const std::string whole = (out / "whole").string(), cut = (out / "cut").string();
  ASSERT_EQ(test::run_command(fmt::format("{} --workers 2 --out {} --save {}.safetensors > {}.log 2>&1", args, whole, whole, whole)), 0);
  const int killed = test::run_command(fmt::format("TALLY_TEST_SIGKILL=after-step:4 {} --workers 2 --out {} --save {}.safetensors "
                                                   "> {}.log 2>&1", args, cut, cut, cut));
  EXPECT_NE(killed, 0) << "the run was not killed";
  ASSERT_EQ(test::run_command(fmt::format("{} train --resume {} --workers 1 >> {}.log 2>&1", TALLY_EXE, cut, cut)), 0);
  const std::string a = file_text(whole + ".safetensors"), b = file_text(cut + ".safetensors");
  EXPECT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "resumed with another worker count, the weights differ";
  fs::remove_all(out);
}

// A bad image in val/ never stops a run after its training (it was found only by the first
// epoch's evaluation, and the run folder could then be neither resumed nor reused): the evaluation
// set skips it whatever --skip-bad-images says — replaced by the next image of its class, listed in
// FolderSet::bad_val_images — and `tally train` names it in a warning and finishes.
TEST(Folder, ABadEvaluationImageIsNamedAndSkipped) {
  TempDir t;
  std::vector<std::uint8_t> grey(28 * 28);
  for (const char* c : {"a", "b"}) {
    fs::create_directories(t.path / "train" / c);
    fs::create_directories(t.path / "val" / c);
    for (int i = 0; i < 3; ++i) {
      for (std::size_t k = 0; k < grey.size(); ++k) grey[k] = static_cast<std::uint8_t>(k * (i + 2) + c[0]);
      write_png(t.path / "train" / c / fmt::format("{}.png", i), grey.data(), 28, 28);
    }
    write_png(t.path / "val" / c / "1.png", grey.data(), 28, 28);
  }
  write_file(t.path / "val" / "a" / "2.png", {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0});
  const data::FolderSet s = data::load_folder(t.path.string(), grey28());  // skip_bad_images off
  ASSERT_EQ(s.split.test.size(), 3);
  std::vector<float> bad(784), good(784);
  s.split.test.generate(1, bad.data());  // val/a/2.png: the next image of class a, val/a/1.png
  s.split.test.generate(0, good.data());
  EXPECT_EQ(bad, good);
  const auto list = s.bad_val_images->list();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(fs::path(list.begin()->first).filename(), "2.png");
  EXPECT_TRUE(s.bad_images->list().empty()) << "the training set's list holds the training set's alone";

  const fs::path out = test::fresh_dir("tally-folder-bad-val");
  const std::string log = (out / "run.log").string();
  EXPECT_EQ(test::run_command(fmt::format("{} train --data folder:{} --input 1x28x28 --model resnet20 --batch-size 4 "
                                          "--steps 2 --threads 2 --no-progress --memory-limit 64MiB --out {} > {} 2>&1",
                                          TALLY_EXE, t.path.string(), (out / "run").string(), log)), 0)
      << file_text(log);
  const std::string said = file_text(log);
  EXPECT_NE(said.find("warning: 1 bad image in the evaluation set"), std::string::npos) << said;
  EXPECT_NE(said.find("2.png: expected a PNG header"), std::string::npos) << said;
  EXPECT_EQ(said.find("warning: 1 bad image in the evaluation set"), said.rfind("warning: 1 bad image in the evaluation set"))
      << "named once, not at every evaluation";
  // Without val/ the epochs' lines say why there is no test loss (not "--no-eval", which was not given).
  fs::remove_all(t.path / "val");
  EXPECT_EQ(test::run_command(fmt::format("{} train --data folder:{} --input 1x28x28 --model resnet20 --batch-size 4 "
                                          "--steps 1 --threads 2 --no-progress --memory-limit 64MiB --out {} > {} 2>&1",
                                          TALLY_EXE, t.path.string(), (out / "run2").string(), log)), 0)
      << file_text(log);
  EXPECT_NE(file_text(log).find("test set not evaluated (no evaluation set)"), std::string::npos) << file_text(log);
  // --num-classes that disagrees with the folder's classes: an error (it was ignored).
  EXPECT_NE(test::run_command(fmt::format("{} train --data folder:{} --input 1x28x28 --num-classes 5 --steps 1 > {} 2>&1",
                                          TALLY_EXE, t.path.string(), log)), 0);
  EXPECT_NE(file_text(log).find("--num-classes 5 does not match folder:" + t.path.string() + ", which has 2 classes"),
            std::string::npos) << file_text(log);
  fs::remove_all(out);
}

// The data set's identity for resume (data/folder.h: files_fingerprint): the same files copied
// elsewhere give the same fingerprint; one image more, one changed byte, one renamed file each give
// another. A run resumed after its folder gained an image is an error naming the change (it was
// accepted silently, and the normalization re-measured on the new files).
TEST(Folder, ADataSetThatChangedIsRefusedOnResume) {
  const TempDir a, b;
  fs::copy(twins().pngs.path, a.path, fs::copy_options::recursive);
  fs::copy(twins().pngs.path, b.path, fs::copy_options::recursive);
  data::FolderOptions o = grey28();
  EXPECT_TRUE(data::load_folder(a.path.string(), o).split.train.fingerprint.empty()) << "not asked for: not read";
  o.fingerprint = true;
  const data::FolderSet fa = data::load_folder(a.path.string(), o), fb = data::load_folder(b.path.string(), o);
  EXPECT_FALSE(fa.split.train.fingerprint.empty());
  EXPECT_EQ(fa.split.train.fingerprint, fb.split.train.fingerprint) << "a copy elsewhere is the same data set";
  EXPECT_EQ(fa.split.test.fingerprint, fb.split.test.fingerprint);
  EXPECT_NE(fa.split.train.fingerprint, fa.split.test.fingerprint);
  const fs::path one = fa.train_files.at(7);
  auto changed = [&](const char* what) {
    SCOPED_TRACE(what);
    const data::FolderSet f = data::load_folder(b.path.string(), o);
    EXPECT_NE(f.split.train.fingerprint, fa.split.train.fingerprint);
  };
  const fs::path in_b = b.path / one.lexically_relative(a.path);
  {  // two images of one class with the same size swap contents: names and sizes unchanged
    std::map<std::uintmax_t, fs::path> by_size;
    fs::path p1, p2;
    for (const auto& e : fs::directory_iterator(in_b.parent_path())) {
      auto [it, fresh] = by_size.emplace(fs::file_size(e.path()), e.path());
      if (!fresh && file_text(it->second) != file_text(e.path())) {
        p1 = it->second, p2 = e.path();
        break;
      }
    }
    ASSERT_FALSE(p1.empty()) << "no two images of one size in " << in_b.parent_path();
    const std::string t1 = file_text(p1), t2 = file_text(p2);
    std::ofstream(p1, std::ios::binary | std::ios::trunc) << t2;
    std::ofstream(p2, std::ios::binary | std::ios::trunc) << t1;
    changed("two images' contents swapped");
    std::ofstream(p1, std::ios::binary | std::ios::trunc) << t1;
    std::ofstream(p2, std::ios::binary | std::ios::trunc) << t2;
  }
  fs::rename(in_b, in_b.parent_path() / ("renamed-" + in_b.filename().string()));
  changed("one image renamed");

  // The command line: a run killed after its checkpoint, one image more, --resume refused with the
  // reason; the image removed and the checkpoint's record deleted (as one written before it
  // existed): it resumes, with a note that the folder could not be checked.
  const fs::path out = test::fresh_dir("tally-folder-changed");
  const std::string run = (out / "run").string();
  EXPECT_NE(test::run_command(fmt::format("TALLY_TEST_SIGKILL=after-step:3 {} train --data folder:{} --input 1x28x28 "
                                          "--model resnet20 --batch-size 50 --steps 4 --threads 2 --no-progress --no-eval "
                                          "--memory-limit 256MiB --checkpoint-every 2 --out {} > {}.log 2>&1",
                                          TALLY_EXE, a.path.string(), run, run)), 0) << "the run was not killed";
  const fs::path extra = one.parent_path() / ("extra-" + one.filename().string());
  fs::copy_file(one, extra);
  const std::string log = run + "-resume.log";
  EXPECT_NE(test::run_command(fmt::format("{} train --resume {} > {} 2>&1", TALLY_EXE, run, log)), 0);
  std::string said = file_text(log);
  EXPECT_NE(said.find("the data set changed since the run began: its train files were 2000 files"), std::string::npos)
      << said;
  EXPECT_NE(said.find("found 2001 files"), std::string::npos) << said;
  fs::remove(extra);
  const fs::path manifest = out / "run" / "checkpoint-2" / "state.json";
  nlohmann::json state = nlohmann::json::parse(file_text(manifest));
  ASSERT_TRUE(state.at("state").contains("data_fingerprint"));
  state["state"].erase("data_fingerprint");
  std::ofstream(manifest, std::ios::trunc) << state.dump();
  EXPECT_EQ(test::run_command(fmt::format("{} train --resume {} > {} 2>&1", TALLY_EXE, run, log)), 0) << file_text(log);
  said = file_text(log);
  EXPECT_NE(said.find("the checkpoint records no fingerprint of the data set's files"), std::string::npos) << said;
  fs::remove_all(out);
}

// The ImageNet recipe (data/folder.h): the evaluation view is torchvision's Resize and CenterCrop
// on the PIL image byte for byte (fixture written by PIL); the training view is a function of the
// draw alone, in [0, 1], and the draws give different crops.
TEST(Folder, TheImagenetViewsAreTorchvisionsResizeAndCropAndTheDrawsCrops) {
  TempDir t;
  one_image_folder(t.path, "rgb.png", "a.png");
  data::FolderOptions o;
  o.channels = 3, o.height = 16, o.width = 16;
  const data::FolderSet s = data::load_folder(t.path.string(), o);
  std::vector<float> eval(3 * 16 * 16), a(eval.size()), b(eval.size()), c(eval.size());
  s.split.train.generate(0, eval.data());
  const std::string want = file_text(std::string(TALLY_FIXTURES_DIR) + "/images/rgb.eval-16x16.rgb");
  ASSERT_EQ(want.size(), eval.size());
  std::size_t differ = 0;
  for (std::size_t p = 0; p < 256; ++p)
    for (std::size_t ch = 0; ch < 3; ++ch) differ += eval[ch * 256 + p] != static_cast<float>(static_cast<std::uint8_t>(want[p * 3 + ch])) / 255.0f;
  EXPECT_EQ(differ, 0u) << "the evaluation view differs from torchvision's Resize + CenterCrop";
  ASSERT_TRUE(s.split.train.generate_augmented);
  s.split.train.generate_augmented(0, 12345, a.data());
  s.split.train.generate_augmented(0, 12345, b.data());
  s.split.train.generate_augmented(0, 99, c.data());
  EXPECT_EQ(a, b) << "the same draw must give the same view";
  EXPECT_NE(a, c) << "two draws gave the same view";
  for (const float v : a) ASSERT_TRUE(v >= 0.0f && v <= 1.0f);
}

// --skip-bad-images: a broken file is recorded and its sample is the next image of its class (here
// the one after it; the last of a class wraps to its class's first, never to another class).
TEST(Folder, BadImagesAreSkippedCountedAndListedWhenAsked) {
  TempDir t;
  fs::create_directories(t.path / "train" / "a");
  std::vector<std::uint8_t> grey(28 * 28);
  for (std::size_t i = 0; i < grey.size(); ++i) grey[i] = static_cast<std::uint8_t>(i * 3);
  write_png(t.path / "train" / "a" / "1.png", grey.data(), 28, 28);
  write_file(t.path / "train" / "a" / "2.png", {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0});
  grey[0] = 200;
  write_png(t.path / "train" / "a" / "3.png", grey.data(), 28, 28);
  data::FolderOptions o = grey28();
  EXPECT_NE(error_of(t.path, o).find("2.png: expected a PNG header"), std::string::npos);
  o.skip_bad_images = true;
  const data::FolderSet s = data::load_folder(t.path.string(), o);
  ASSERT_EQ(s.split.train.size(), 3);
  std::vector<float> bad(784), next(784);
  s.split.train.generate(1, bad.data());
  s.split.train.generate(2, next.data());
  EXPECT_EQ(bad, next) << "the bad sample is the next image of the list";
  EXPECT_FLOAT_EQ(next[0], 200.0f / 255.0f);
  const auto list = s.bad_images->list();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(fs::path(list.begin()->first).filename(), "2.png");
  EXPECT_NE(list.begin()->second.find("expected a PNG header"), std::string::npos);
  // The last file of class a broken too: its sample wraps to a's first image, not to class b's.
  fs::create_directories(t.path / "train" / "b");
  grey[0] = 77;
  write_png(t.path / "train" / "b" / "1.png", grey.data(), 28, 28);
  write_file(t.path / "train" / "a" / "4.png", {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0, 0});
  const data::FolderSet w = data::load_folder(t.path.string(), o);
  std::vector<float> first(784);
  w.split.train.generate(3, bad.data());  // a/4.png
  w.split.train.generate(0, first.data());
  EXPECT_EQ(bad, first) << "a bad last image of a class must wrap within its class";
  EXPECT_EQ(w.split.train.labels[3], 0);
}

// JPEG's DCT scaling in the training view: with crops at least twice the output, the decoder's
// reduced scale is taken (counted), and the views stay deterministic and in [0, 1].
TEST(Folder, DctScalingDecodesSmallerWhereTheCropAllows) {
  TempDir t;
  one_image_folder(t.path, "rgb444.jpg", "a.jpg");
  data::FolderOptions o;
  o.channels = 3, o.height = 4, o.width = 4;
  o.dct_scaling = true;
  o.dct_scaled = std::make_shared<std::atomic<std::int64_t>>(0);
  const data::FolderSet s = data::load_folder(t.path.string(), o);
  std::vector<float> a(48), b(48);
  for (std::uint64_t draw = 0; draw < 20; ++draw) {
    s.split.train.generate_augmented(0, draw, a.data());
    s.split.train.generate_augmented(0, draw, b.data());
    EXPECT_EQ(a, b);
    for (const float v : a) ASSERT_TRUE(v >= 0.0f && v <= 1.0f);
  }
  EXPECT_GT(o.dct_scaled->load(), 0) << "no crop of a 37x23 JPEG to 4x4 was decoded at a reduced scale";
  EXPECT_LE(o.dct_scaled->load(), 40);
}
