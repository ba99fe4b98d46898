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
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "core/device_file.h"
#include "core/error.h"
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
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
