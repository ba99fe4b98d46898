// Plans for a GPU on a machine without one (core/device_file.h, kernels/cuda/cuda_kernels.h:
// conv2d_plan_offline; docs/gpu.md, "Plans without the GPU"): cuDNN finalizes every convolution
// pass of ResNet-50 and ResNet-20 from a saved device description alone, in both memory formats
// and three precisions; a damaged or foreign device file is a clear error. Built with the CUDA
// backend and cuDNN only; runs on any machine (no GPU, driver or handle is touched). The device
// files are tests/fixtures/devices/*.json; the tests skip only while that folder holds none,
// naming it.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "core/arena.h"
#include "core/conv_tuning.h"
#include "core/device_file.h"
#include "core/error.h"
#include "kernels/cuda/context.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "kernels/cuda/cuda_kernels.h"
#include "apps/setup.h"
#include "mbp/executor.h"
#include "nn/modules.h"
#include "tests/model_common.h"

using namespace tally;
namespace kc = tally::kernels::cuda;

namespace {

const std::filesystem::path kDevices = std::filesystem::path(TALLY_FIXTURES_DIR) / "devices";

std::vector<std::filesystem::path> device_files() {
  std::vector<std::filesystem::path> files;
  if (std::filesystem::is_directory(kDevices))
    for (const auto& e : std::filesystem::directory_iterator(kDevices))
      if (e.path().extension() == ".json") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

#define REQUIRE_DEVICE_FILES(files)                                                                               \
  if ((files).empty()) GTEST_SKIP() << "no device file in " << kDevices.string()                                  \
                                    << ": save one on a GPU with `tally device --save` (docs/gpu.md)";

using Weight = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>;  // K, C, R, S

// Every convolution of a ResNet at batch n and input size hw, in the order the model runs them
// (tally's ResNets: nn/resnet.cpp — v1.5 bottlenecks, stride on the 3x3; 1x1 projections).
std::vector<kernels::Conv2dShape> resnet_convolutions(const std::string& name, std::int64_t n, std::int64_t hw) {
  std::vector<kernels::Conv2dShape> out;
  const auto conv = [&](std::int64_t c, std::int64_t k, std::int64_t r, std::int64_t stride, std::int64_t h) {
    kernels::Conv2dShape s{n, c, h, h, k, r, r};
    s.stride_h = s.stride_w = stride;
    s.pad_h = s.pad_w = r / 2;
    s.workspace_limit = std::size_t(1) << 30;
    out.push_back(s);
    return s.P();
  };
  if (name == "resnet20") {
    std::int64_t h = hw, in = 16;
    conv(3, 16, 3, 1, h);
    for (std::int64_t width : {16, 32, 64})
      for (int b = 0; b < 3; ++b) {
        const std::int64_t stride = b == 0 && width != 16 ? 2 : 1;
        if (in != width || stride != 1) conv(in, width, 1, stride, h);
        const std::int64_t p = conv(in, width, 3, stride, h);
        conv(width, width, 3, 1, p);
        in = width, h = p;
      }
    return out;
  }
  std::int64_t h = conv(3, 64, 7, 2, hw);  // the stem; then max pooling 3x3/2
  h = (h + 2 - 3) / 2 + 1;
  std::int64_t in = 64;
  const std::int64_t widths[4] = {64, 128, 256, 512}, blocks[4] = {3, 4, 6, 3};
  for (int st = 0; st < 4; ++st)
    for (int b = 0; b < blocks[st]; ++b) {
      const std::int64_t w = widths[st], stride = b == 0 && st > 0 ? 2 : 1;
      conv(in, w, 1, 1, h);
      const std::int64_t p = conv(w, w, 3, stride, h);
      conv(w, 4 * w, 1, 1, p);
      if (b == 0) conv(in, 4 * w, 1, stride, h);
      in = 4 * w, h = p;
    }
  return out;
}

// The weights of the model's convolutions, as a multiset: what resnet_convolutions must match.
std::multiset<Weight> model_weights(const std::string& name) {
  std::multiset<Weight> w;
  for (const auto& [pname, p] : test::model(name, "batch")->named_parameters())
    if (p.dim() == 4) w.insert({p.size(0), p.size(1), p.size(2), p.size(3)});
  return w;
}

std::string key(const kernels::Conv2dShape& s) {
  return fmt::format("{}x{}x{}x{} k{} r{} s{}", s.N, s.C, s.H, s.W, s.K, s.R, s.stride_h);
}

struct Switches {  // allow_tf32 for the scope, restored after
  bool before = kc::allow_tf32();
  explicit Switches(bool tf32) { kc::set_allow_tf32(tf32); }
  ~Switches() { kc::set_allow_tf32(before); }
};

}  // namespace

TEST(Deviceless, TheShapesAreTheModelsConvolutions) {
  for (const std::string name : {"resnet50", "resnet20"}) {
    std::multiset<Weight> listed;
    for (const auto& s : resnet_convolutions(name, 2, name == "resnet50" ? 224 : 32)) listed.insert({s.K, s.C, s.R, s.S});
    EXPECT_EQ(listed, model_weights(name)) << name;
  }
}

TEST(Deviceless, EveryResNetConvolutionPassFinalizesFromTheDeviceFile) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  for (const auto& path : files) {
    const DeviceFile device = load_device_file(path);
    SCOPED_TRACE(path.filename().string() + ": " + device.name);
    for (const auto& [name, n, hw] : {std::tuple{"resnet50", 64, 224}, std::tuple{"resnet20", 128, 32}}) {
      std::map<std::string, kernels::Conv2dShape> unique;
      for (const auto& s : resnet_convolutions(name, n, hw)) unique.emplace(key(s), s);
      for (const bool channels_last : {false, true})
        for (const char* precision : {"fp32", "tf32", "bf16"}) {
          const bool bf16 = std::string(precision) == "bf16";
          const Switches tf32(std::string(precision) == "tf32");
          std::set<std::int64_t> engines;
          for (auto [k, s] : unique) {
            s.channels_last = channels_last;
            for (const auto pass : {kernels::ConvPass::forward, kernels::ConvPass::backward_data,
                                    kernels::ConvPass::backward_filter})
              for (const float beta : {0.f, 1.f}) {
                if (beta == 1.f && (pass == kernels::ConvPass::forward || bf16)) continue;  // what tally runs
                SCOPED_TRACE(fmt::format("{} {} {} {} beta {}", name, k, channels_last ? "channels_last" : "contiguous",
                                         precision, beta));
                const kc::OfflineConvPlan p = kc::conv2d_plan_offline(s, bf16, pass, beta, device.cudnn_properties);
                EXPECT_GE(p.engine, 0);
                EXPECT_LE(p.workspace, s.workspace_limit);
                EXPECT_NE(p.description.find("graph API"), std::string::npos) << p.description;
                engines.insert(p.engine);
              }
          }
          EXPECT_FALSE(engines.empty());
        }
    }
  }
}

// The same pass planned twice from the same file: the same engine and workspace (what makes a plan
// made without the GPU a plan the GPU can run exactly).
TEST(Deviceless, APlanFromTheFileIsTheSameEveryTime) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  const DeviceFile device = load_device_file(files.front());
  kernels::Conv2dShape s{32, 256, 14, 14, 256, 3, 3};
  s.pad_h = s.pad_w = 1;
  s.workspace_limit = std::size_t(256) << 20;
  for (const bool bf16 : {false, true}) {
    const kc::OfflineConvPlan a = kc::conv2d_plan_offline(s, bf16, kernels::ConvPass::backward_filter, 0.f, device.cudnn_properties);
    const kc::OfflineConvPlan b = kc::conv2d_plan_offline(s, bf16, kernels::ConvPass::backward_filter, 0.f, device.cudnn_properties);
    EXPECT_EQ(a.engine, b.engine);
    EXPECT_EQ(a.workspace, b.workspace);
    EXPECT_EQ(a.description, b.description);
  }
}

TEST(Deviceless, ADamagedOrForeignDeviceFileIsAClearError) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("tally-device-{}", ::getpid());
  std::filesystem::create_directories(dir);
  std::ifstream in(files.front());
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return dir / name;
  };
  const auto expect_error = [&](const std::filesystem::path& p, const std::string& words) {
    try {
      (void)load_device_file(p);
      ADD_FAILURE() << p << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << "the path is named: " << e.what();
    }
  };
  const auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    const auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? t : t.replace(at, from.size(), to);
  };
  expect_error(dir / "absent.json", "cannot read it");
  expect_error(write("truncated.json", good.substr(0, good.size() / 2)), "not JSON");
  expect_error(write("other.json", "{\"format\": \"safetensors\"}"), "expected \"format\": \"tally device file\"");
  expect_error(write("nocudnn.json", replaced("\"cudnn_properties\"", "\"cudnn_props\"")),
               "expected a field \"cudnn_properties\", found none");
  expect_error(write("cc.json", replaced("\"compute_capability\": \"9.0\"", "\"compute_capability\": \"Hopper\"")),
               "expected a compute capability such as \"9.0\"");
  expect_error(write("foreign.json", replaced(fmt::format("\"cudnn_version\": {}", loaded_cudnn_version()),
                                              "\"cudnn_version\": 90800")),
               "saved by cuDNN 9.8.0, but this build loads cuDNN");
  // A description cuDNN itself refuses (a field of it missing): cuDNN's reason, named.
  const DeviceFile broken = load_device_file(write("props.json", replaced("\"maxGridSize\"", "\"gridSize\"")));
  kernels::Conv2dShape s{8, 16, 8, 8, 16, 3, 3};
  s.pad_h = s.pad_w = 1;
  try {
    (void)kc::conv2d_plan_offline(s, false, kernels::ConvPass::forward, 0.f, broken.cudnn_properties);
    ADD_FAILURE() << "cuDNN accepted a description without maxGridSize";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("refused the saved device properties"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("maxGridSize"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// ---- convolution engines chosen by measurement (core/conv_tuning.h) --------------------------------

namespace {

struct NoTuning {  // the convolutions' tuning table emptied when the test ends, however it ends
  ~NoTuning() { kc::set_conv_tuning({}); }
};

std::filesystem::path scratch(const std::string& what) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / fmt::format("tally-tuning-{}-{}", what, ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

// The name a tuning file keys the described GPU's entries by (core/conv_tuning.h).
std::string tuning_device_name(const DeviceFile& device) {
  return fmt::format("{}, compute capability {}.{}, cuDNN {}", device.name, device.compute_major, device.compute_minor,
                     cudnn_version_text(loaded_cudnn_version()));
}

// A tuning file's entry for a pass, as ConvTuning writes it.
std::string entry_text(const kernels::TunedConvPass& e) {
  return fmt::format("{{\"rank\": {}, \"engine\": {}, \"workspace\": {}, \"ms\": {}, \"within_rank\": {}, "
                     "\"within_engine\": {}, \"within_workspace\": {}, \"within_ms\": {}, \"heuristic_rank\": {}, "
                     "\"heuristic_engine\": {}, \"heuristic_workspace\": {}, \"heuristic_ms\": {}, \"candidates\": {}}}",
                     e.rank, e.engine, e.workspace, e.ms, e.within_rank, e.within_engine, e.within_workspace,
                     e.within_ms, e.heuristic_rank, e.heuristic_engine, e.heuristic_workspace, e.heuristic_ms,
                     e.candidates);
}

}  // namespace

// A GPU convolution's input that is a view starting off a 16-byte boundary (a batch of 3x7x7
// float32 samples sliced from its second sample: 588 bytes in) is copied to a block of its own
// first — the graph API promises cuDNN that alignment — and a dry run, planned from the described
// GPU, makes the copy exactly where the step would; an aligned view is taken as it is.
TEST(Deviceless, AConvolutionOfAMisalignedViewTakesAnAlignedCopyInThePlanToo) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  const DeviceFile device = load_device_file(files.front());
  DescribedGpuScope gpu(device);
  const Device cuda = Device::cuda(0);
  DryRun dry(cuda, std::size_t(64) << 20);
  const Tensor x = Tensor::empty({5, 3, 7, 7}, DType::Float32, cuda, Category::activation, "x");
  const Tensor w = Tensor::empty({8, 3, 3, 3}, DType::Float32, cuda, Category::parameter, "w");
  const Arena& arena = *current_arena(cuda);
  ASSERT_TRUE(arena.is_virtual());
  const auto made = [&](const Tensor& view) {
    const ArenaStats before = arena.stats();
    const Tensor y = conv2d(view, w);
    EXPECT_EQ(y.shape(), (Shape{view.size(0), 8, 5, 5}));
    const ArenaStats after = arena.stats();
    return std::pair{after.total.allocations - before.total.allocations,
                     after[Category::activation].allocations - before[Category::activation].allocations};
  };
  const auto aligned = made(x.narrow(0, 0, 4)), misaligned = made(x.narrow(0, 1, 4));
  EXPECT_EQ(misaligned.first, aligned.first + 1) << "one copy more";
  EXPECT_EQ(misaligned.second, aligned.second + 1) << "the copy is in the input's category";
  EXPECT_EQ(made(x.narrow(0, 4, 1)).first, made(x.narrow(0, 0, 1)).first) << "4 samples in: 2352 bytes, 16 x 147";
}

// A tuning entry names a configuration of the heuristics' list by rank and engine: a plan takes it
// where the list holds that engine at that rank, the rules allow it and it fits the shape's limit
// — and says so — and the heuristics' choice anywhere else, saying why. Planned from the H200's
// description, so it runs here.
TEST(Tuning, ATunedEngineIsReplayedWhereTheHeuristicsOfferItAndOnlyThere) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  const DeviceFile device = load_device_file(files.front());
  DescribedGpuScope gpu(device);
  NoTuning reset;
  kernels::Conv2dShape s{32, 64, 56, 56, 64, 3, 3};  // ResNet-50 layer1's 3x3, channels-last
  s.pad_h = s.pad_w = 1;
  s.channels_last = true;
  s.workspace_limit = std::size_t(256) << 20;
  const auto pass = kernels::ConvPass::forward;
  const std::string key = kc::conv2d_tuning_key(s, true, pass, 0.f);
  const auto plan = [&](const kernels::Conv2dShape& shape) {
    return kc::conv2d_plan_offline(shape, true, pass, 0.f, device.cudnn_properties);
  };
  const kc::OfflineConvPlan untuned = plan(s);
  const std::vector<std::int64_t> engines = kc::conv2d_graph_engines(s, true, pass, 0.f);
  ASSERT_GE(engines.size(), 2u) << "the heuristics list one configuration: nothing to tune";
  bool replayed = false;
  for (std::size_t r = 0; r < engines.size() && !replayed; ++r) {
    if (engines[r] == untuned.engine) continue;
    kernels::TunedConvPass e;
    e.rank = static_cast<std::int64_t>(r), e.engine = engines[r];
    kc::set_conv_tuning({{key, e}});
    const kc::OfflineConvPlan tuned = plan(s);
    if (tuned.engine != engines[r]) {  // a configuration the rules refuse: the heuristics' choice, and why
      EXPECT_EQ(tuned.engine, untuned.engine);
      EXPECT_NE(tuned.description.find("not usable"), std::string::npos) << tuned.description;
      continue;
    }
    replayed = true;
    EXPECT_NE(tuned.description.find("tuned: the fastest measured"), std::string::npos) << tuned.description;
    // Another engine at that rank (another cuDNN, another GPU): the heuristics' choice, said.
    kernels::TunedConvPass other = e;
    other.engine = engines[r] + 100000;
    kc::set_conv_tuning({{key, other}});
    const kc::OfflineConvPlan wrong = plan(s);
    EXPECT_EQ(wrong.engine, untuned.engine);
    EXPECT_EQ(wrong.workspace, untuned.workspace);
    EXPECT_NE(wrong.description.find("tuned engine"), std::string::npos) << wrong.description;
    // "within" in use and no within choice measured: the heuristics' choice.
    kernels::TunedConvPass unmeasured = e;
    unmeasured.use_within = true;
    kc::set_conv_tuning({{key, unmeasured}});
    EXPECT_EQ(plan(s).engine, untuned.engine);
    // An entry installed at its "within" level (use_within) whose within choice is that engine:
    // taken, and said to be the within choice.
    kernels::TunedConvPass w = e;
    w.within_rank = e.rank, w.within_engine = e.engine, w.use_within = true;
    kc::set_conv_tuning({{key, w}});
    const kc::OfflineConvPlan within = plan(s);
    EXPECT_EQ(within.engine, engines[r]);
    EXPECT_NE(within.description.find("tuned: the fastest measured within the heuristics' workspace"),
              std::string::npos) << within.description;
    // A limit below the tuned workspace: not that engine.
    if (tuned.workspace > 0) {
      kc::set_conv_tuning({{key, e}});
      kernels::Conv2dShape tight = s;
      tight.workspace_limit = tuned.workspace - 1;
      EXPECT_EQ(plan(tight).description.find("tuned: the fastest"), std::string::npos);
    }
  }
  EXPECT_TRUE(replayed) << "no configuration other than the heuristics' choice could be replayed";
  kc::set_conv_tuning({});
  EXPECT_EQ(plan(s).engine, untuned.engine);
  EXPECT_EQ(plan(s).description, untuned.description);
}

// The tuning file of a described GPU is read under that GPU's name: `tally plan --device-file` replays
// what a run on it measured. install() reports whether the table in use changed.
TEST(Tuning, ATuningFileIsReadForTheGpuItWasMeasuredOn) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  const DeviceFile device = load_device_file(files.front());
  DescribedGpuScope gpu(device);
  NoTuning reset;
  kernels::Conv2dShape s{16, 128, 28, 28, 128, 3, 3};
  s.pad_h = s.pad_w = 1;
  s.channels_last = true;
  s.workspace_limit = std::size_t(256) << 20;
  const auto pass = kernels::ConvPass::backward_data;
  const std::vector<std::int64_t> engines = kc::conv2d_graph_engines(s, true, pass, 1.f);
  ASSERT_FALSE(engines.empty());
  const std::string name = tuning_device_name(device);
  const std::filesystem::path dir = scratch("file");
  kernels::TunedConvPass e;
  e.rank = e.within_rank = e.heuristic_rank = 0;
  e.engine = e.within_engine = e.heuristic_engine = engines[0];
  e.ms = e.within_ms = e.heuristic_ms = 1.5;
  e.candidates = 3;
  const std::string entry = entry_text(e);
  write_text(dir / "tuning.json", fmt::format("{{\"format\": \"tally convolution tuning\", \"version\": 1, \"devices\": "
                                              "{{\"{}\": {{\"{}\": {}}}, \"another GPU\": {{}}}}}}",
                                              name, kc::conv2d_tuning_key(s, true, pass, 1.f), entry));
  ConvTuning t(dir / "tuning.json", 0);
  ASSERT_EQ(t.table().size(), 1u);
  EXPECT_EQ(t.table().begin()->second.engine, engines[0]);
  EXPECT_EQ(t.table().begin()->second.candidates, 3);
  EXPECT_TRUE(t.install(ConvTuning::Use::fastest));
  EXPECT_FALSE(t.install(ConvTuning::Use::fastest)) << "the same table again changes nothing";
  const std::uint64_t version = conv_tuning_version();
  const kc::OfflineConvPlan p = kc::conv2d_plan_offline(s, true, pass, 1.f, device.cudnn_properties);
  EXPECT_NE(p.description.find("tuned: the fastest measured"), std::string::npos) << p.description;
  EXPECT_TRUE(t.install(ConvTuning::Use::none));
  EXPECT_GT(conv_tuning_version(), version);
  std::filesystem::remove_all(dir);
}

// A damaged tuning file stops the run with its name, what was expected, and the way out; a record
// a checkpoint keeps reads back as it was written, and a damaged one is named too.
TEST(Tuning, ADamagedFileOrRecordIsAClearErrorAndARecordReadsBackAsWritten) {
  const std::filesystem::path dir = scratch("damaged");
  const auto expect_error = [&](const std::string& name, const std::string& text, const std::string& words) {
    write_text(dir / name, text);
    try {
      ConvTuning t(dir / name);
      ADD_FAILURE() << name << " was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(words), std::string::npos) << what;
      EXPECT_NE(what.find((dir / name).string()), std::string::npos) << "the path is named: " << what;
      EXPECT_NE(what.find("--tuning-file none"), std::string::npos) << "the way out is named: " << what;
    }
  };
  expect_error("cut.json", "{\"format\": \"tally convolution tun", "not JSON");
  expect_error("other.json", "{\"format\": \"tally device file\", \"version\": 1}",
               "expected \"format\": \"tally convolution tuning\"");
  expect_error("version.json", "{\"format\": \"tally convolution tuning\", \"version\": 7, \"devices\": {}}",
               "expected version 1, found 7");
  expect_error("devices.json", "{\"format\": \"tally convolution tuning\", \"version\": 1, \"devices\": []}",
               "expected an object \"devices\"");
  expect_error("entry.json",
               "{\"format\": \"tally convolution tuning\", \"version\": 1, \"devices\": {\"GPU\": {\"pass\": "
               "{\"rank\": \"first\"}}}}",
               "expected an integer \"rank\", found \"first\"");
  EXPECT_NO_THROW(ConvTuning(dir / "absent.json")) << "no file yet: an empty table";
  EXPECT_THROW(ConvTuning(dir / "absent.json", -1), Error);

  const std::string record =
      "{\"device\":\"NVIDIA H200, compute capability 9.0, cuDNN 9.19.0\",\"use\":\"within\",\"passes\":{\"bf16 nhwc "
      "forward beta 0: n 8\":{\"rank\":3,\"engine\":61,\"workspace\":4096,\"ms\":0.25,\"within_rank\":1,"
      "\"within_engine\":7,\"within_workspace\":0,\"within_ms\":0.5,\"heuristic_rank\":0,\"heuristic_engine\":5,"
      "\"heuristic_workspace\":0,\"heuristic_ms\":0.75,\"candidates\":9}}}";
  const std::shared_ptr<ConvTuning> replay = ConvTuning::replaying(record, "state.json");
  EXPECT_EQ(replay->record(), record);
  EXPECT_EQ(replay->in_use(), ConvTuning::Use::within);
  ASSERT_EQ(replay->table().size(), 1u);
  EXPECT_EQ(replay->table().begin()->second.within_engine, 7);
  // Passes at levels of their own: "use" is the first pass's, "uses" names the others at another.
  const std::string entry =
      "{\"rank\":3,\"engine\":61,\"workspace\":4096,\"ms\":0.25,\"within_rank\":1,\"within_engine\":7,"
      "\"within_workspace\":0,\"within_ms\":0.5,\"heuristic_rank\":0,\"heuristic_engine\":5,"
      "\"heuristic_workspace\":0,\"heuristic_ms\":0.75,\"candidates\":9}";
  const std::string a = "bf16 nhwc forward beta 0: n 8", b = "bf16 nhwc forward beta 0: n 16";
  const std::string mixed = fmt::format("{{\"device\":\"GPU\",\"use\":\"within\",\"passes\":{{\"{}\":{},\"{}\":{}}},"
                                        "\"uses\":{{\"{}\":\"fastest\"}}}}", a, entry, b, entry, b);
  EXPECT_EQ(ConvTuning::replaying(mixed, "state.json")->record(),
            fmt::format("{{\"device\":\"GPU\",\"use\":\"fastest\",\"passes\":{{\"{}\":{},\"{}\":{}}},"
                        "\"uses\":{{\"{}\":\"within\"}}}}", b, entry, a, entry, a));
  const std::string one_pass = fmt::format("{{\"device\": \"GPU\", \"use\": \"none\", \"passes\": {{\"p\": {}}}", entry);
  for (const auto& [bad, words] : std::vector<std::pair<std::string, std::string>>{
           {"[1, 2]", "expected a record with \"device\", \"use\" and \"passes\""},
           {"{\"device\": \"GPU\", \"use\": \"fast\", \"passes\": {}}", "expected \"use\" fastest, within or none"},
           {"{\"device\": \"GPU\", \"use\": \"none\", \"passes\": {\"p\": {\"rank\": 1}}}", "expected an integer \"engine\""},
           {one_pass + ", \"uses\": []}", "expected \"uses\" to be an object of passes' levels"},
           {one_pass + ", \"uses\": {\"q\": \"within\"}}", "expected \"uses\" to name passes of \"passes\", found 'q'"},
           {one_pass + ", \"uses\": {\"p\": 2}}", "expected pass 'p' at fastest, within or none, found 2"},
       }) {
    try {
      (void)ConvTuning::replaying(bad, "run/checkpoint-5/state.json");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("run/checkpoint-5/state.json"), std::string::npos) << e.what();
    }
  }
  std::filesystem::remove_all(dir);
}

namespace {

// One 3x3 convolution of 3x32x32 images into 16 channels, then pooled and classified: a model
// whose peak is its convolution's, workspace included.
const std::string& conv_probe() {
  static const std::string name = [] {
    nn::register_model("tuning-probe", [](const nn::ModelConfig& c) -> std::shared_ptr<nn::Module> {
      return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
          std::make_shared<nn::Conv2d>(c.in_channels, 64, 3, 1, 1, 1, 1, false), std::make_shared<nn::AdaptiveAvgPool2d>(1, 1),
          std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(64, c.num_classes)});
    });
    return std::string("tuning-probe");
  }();
  return name;
}

// The probe's step (float32, channels-last) planned for the described GPU on a virtual arena of
// `limit` bytes — what `tally plan --device-file` does — with `tuning` (null: none); the
// executor's log kept.
struct PlannedRun {
  DryRun dry;
  std::shared_ptr<Arena> arena;
  app::Setup setup;
  std::vector<std::string> log;
  std::unique_ptr<mbp::Executor> executor;
  PlannedRun(std::size_t limit, std::shared_ptr<ConvTuning> tuning) {
    arena = dry.virtual_arena(Device::cuda(0), limit);
    nn::ModelConfig mc;
    mc.name = conv_probe();
    mc.in_channels = 16;
    setup = app::build_setup(arena, mc, "", app::OptimizerConfig{}, "the test's budget");
    mbp::ExecutorOptions eo;
    eo.sample_shape = {16, 32, 32};
    eo.precision = mbp::Precision::bf16;
    eo.memory_format = MemoryFormat::ChannelsLast;
    eo.conv_tuning = std::move(tuning);
    eo.log = [this](const std::string& line) { log.push_back(line); };
    executor = std::make_unique<mbp::Executor>(*setup.model, *setup.optimizer, arena, eo);
  }
  std::string said() const {
    std::string all;
    for (const std::string& line : log) all += line + "\n";
    return all;
  }
};

// A tuning entry for pass `p` whose fastest engine is the configuration among the heuristics' first
// six with the largest workspace above their own choice's, and whose "within" choice is their own
// choice; none where no configuration there needs more.
std::optional<kernels::TunedConvPass> greedier_entry(const kernels::ConvPassKey& p, const std::string& properties) {
  const std::string key = kc::conv2d_tuning_key(p.shape, p.bf16, p.pass, p.beta);
  const auto plan = [&] { return kc::conv2d_plan_offline(p.shape, p.bf16, p.pass, p.beta, properties); };
  kc::set_conv_tuning({});
  const kc::OfflineConvPlan own = plan();
  const std::vector<std::int64_t> engines = kc::conv2d_graph_engines(p.shape, p.bf16, p.pass, p.beta);
  const auto at = std::find(engines.begin(), engines.end(), own.engine);
  if (at == engines.end()) return std::nullopt;
  kernels::TunedConvPass e;
  e.within_rank = e.heuristic_rank = at - engines.begin();
  e.within_engine = e.heuristic_engine = own.engine;
  e.within_workspace = e.heuristic_workspace = own.workspace;
  e.ms = 1, e.within_ms = e.heuristic_ms = 2, e.candidates = 6;
  std::size_t most = own.workspace;
  for (std::size_t r = 0; r < std::min<std::size_t>(engines.size(), 6); ++r) {
    kernels::TunedConvPass t = e;
    t.rank = static_cast<std::int64_t>(r), t.engine = engines[r];
    kc::set_conv_tuning({{key, t}});
    const kc::OfflineConvPlan tuned = plan();
    if (tuned.engine == engines[r] && tuned.workspace > most) e.rank = t.rank, e.engine = t.engine, most = e.workspace = tuned.workspace;
  }
  kc::set_conv_tuning({});
  if (e.rank < 0) return std::nullopt;
  return e;
}


}  // namespace

// The executor's promise (mbp/executor_plan.cpp): tuned engines never cost a micro-batch. A tuning
// file whose "fastest" engines need more workspace than the heuristics' would lower the probe's
// micro-batch (bf16, channels-last, on the described H200); a run planning a small batch first
// (the file's table installed by then) and the batch after it keeps the untuned micro-batch and
// peak, taking the "within" choices — and those passes keep them: a later trial of the fastest changes none of them, a checkpoint's record
// replays the same plan, and the next run of a sweep chooses alike.
TEST(Tuning, TheFastestEnginesNeverCostAMicroBatchWhicheverPlanComesFirstAndAPassKeepsItsLevel) {
  const auto files = device_files();
  REQUIRE_DEVICE_FILES(files);
  const DeviceFile device = load_device_file(files.front());
  DescribedGpuScope gpu(device);
  NoTuning reset;
  constexpr std::size_t kLimit = std::size_t(32) << 20;
  constexpr std::int64_t kBatch = 1024;
  std::int64_t untuned = 0;
  std::size_t untuned_peak = 0;
  std::vector<kernels::ConvPassKey> passes;  // those of the untuned plan's micro-batch size
  {
    PlannedRun run(kLimit, nullptr);
    kc::conv2d_record_passes(true);
    const mbp::Plan& p = run.executor->plan(kBatch);
    kc::conv2d_record_passes(false);
    untuned = p.micro_batch, untuned_peak = p.predicted_peak;
    for (const kernels::ConvPassKey& k : kc::conv2d_recorded_passes())
      if (k.shape.N == p.micro_batch) passes.push_back(k);
  }
  ASSERT_GT(untuned, 1);
  ASSERT_LT(untuned, kBatch) << "the budget must split the batch";
  ASSERT_FALSE(passes.empty());
  std::string entries;
  for (const kernels::ConvPassKey& p : passes)
    if (const auto e = greedier_entry(p, device.cudnn_properties))
      entries += fmt::format("{}\"{}\": {}", entries.empty() ? "" : ", ",
                             kc::conv2d_tuning_key(p.shape, p.bf16, p.pass, p.beta), entry_text(*e));
  ASSERT_FALSE(entries.empty()) << "no pass of the plan has a configuration needing more workspace";
  const std::filesystem::path dir = scratch("level");
  const std::string name = tuning_device_name(device);
  write_text(dir / "tuning.json", fmt::format("{{\"format\": \"tally convolution tuning\", \"version\": 1, "
                                              "\"devices\": {{\"{}\": {{{}}}}}}}", name, entries));
  {  // The file's fastest engines alone lower the micro-batch: what the executor must not let them do.
    ConvTuning t(dir / "tuning.json", 0);
    ASSERT_TRUE(t.install(ConvTuning::Use::fastest));
    PlannedRun run(kLimit, nullptr);
    ASSERT_LT(run.executor->plan(kBatch).micro_batch, untuned) << "the file's engines cost no micro-batch: the test "
                                                                  "would show nothing";
    ConvTuning::install_none();
  }
  const auto tuning = std::make_shared<ConvTuning>(dir / "tuning.json", 0);
  std::string record;
  {
    PlannedRun run(kLimit, tuning);
    EXPECT_EQ(run.executor->plan(8).micro_batch, 8);  // its passes have no entries: nothing to choose
    const mbp::Plan& p = run.executor->plan(kBatch);
    EXPECT_EQ(p.micro_batch, untuned) << run.said();
    EXPECT_EQ(p.predicted_peak, untuned_peak) << "the \"within\" choices are the heuristics' own here";
    EXPECT_NE(run.said().find("would lower the micro-batch below " + std::to_string(untuned) + ": those within"),
              std::string::npos) << run.said();
    EXPECT_FALSE(tuning->trial(ConvTuning::Use::fastest)) << "a pass a plan took keeps its level";
    EXPECT_EQ(run.executor->plan(kBatch).micro_batch, untuned);
    record = tuning->record();
    EXPECT_NE(record.find("\"use\":\"within\""), std::string::npos) << record;
  }
  {  // A resumed run replays the record: the same plan, nothing chosen again.
    PlannedRun run(kLimit, ConvTuning::replaying(record, "the test's checkpoint"));
    const mbp::Plan& p = run.executor->plan(kBatch);
    EXPECT_EQ(p.micro_batch, untuned) << run.said();
    EXPECT_EQ(p.predicted_peak, untuned_peak);
    EXPECT_EQ(run.said().find("would lower"), std::string::npos) << run.said();
  }
  {  // A new run with the same tuning (a sweep's next) chooses anew, and alike.
    PlannedRun run(kLimit, tuning);
    EXPECT_EQ(run.executor->plan(kBatch).micro_batch, untuned);
    EXPECT_NE(run.said().find("those within"), std::string::npos) << run.said();
  }
  std::filesystem::remove_all(dir);
}

// On the CPU there is nothing to tune: no dry run, no file, no table.
TEST(Tuning, OnTheCpuNothingIsMeasuredOrWritten) {
  const std::filesystem::path dir = scratch("cpu");
  ConvTuning t(dir / "tuning.json");
  Arena arena(Device::cpu(), std::size_t(1) << 20);
  bool ran = false;
  EXPECT_FALSE(t.tune(Device::cpu(), arena, [&] { ran = true; }));
  EXPECT_FALSE(ran);
  EXPECT_FALSE(std::filesystem::exists(dir / "tuning.json"));
  EXPECT_EQ(arena.stats().total.allocations, 0);
  std::filesystem::remove_all(dir);
}
