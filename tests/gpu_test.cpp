// GPU tests (ctest label `gpu`): the arena and tensors on a GPU. Each one skips with a visible
// message when no GPU is present. The kernels are tested in gpu_kernels_test.cpp, the ops, models
// and the accounting of a GPU step in gpu_ops_test.cpp.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <random>
#include <string>

#include "core/arena.h"
#include "core/device_file.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "tally/config.h"
#include "tests/gpu_common.h"
#include "tests/pending_check.h"
#include "tests/staging_check.h"
#if TALLY_HAVE_CUDNN
#include "kernels/cuda/context.h"
#include "kernels/cuda/cuda_kernels.h"
#endif

using namespace tally;

TEST(Gpu, ArenaReservesDeviceMemoryAndAllocatesDeterministically) {
  REQUIRE_GPU();
  // 2000 random requests, two allocations to one free, fill the 64 MiB arena: out-of-memory
  // must strike both arenas at the same request and leave both as they were.
  Arena real(Device::cuda(0), 64 << 20);
  auto virt = Arena::make_virtual(Device::cuda(0), 64 << 20);
  std::mt19937 rng(3);
  std::vector<std::size_t> live;
  int ooms = 0;
  for (int i = 0; i < 2000; ++i) {
    if (live.empty() || rng() % 3) {
      const std::size_t n = 1 + rng() % 200000;
      bool real_oom = false, virt_oom = false;
      Block a;
      try {
        a = real.allocate(n, Category::activation, "x");
      } catch (const OutOfMemory&) {
        real_oom = true;
      }
      try {
        const Block v = virt->allocate(n, Category::activation, "x");
        ASSERT_EQ(v.offset, a.offset);
      } catch (const OutOfMemory&) {
        virt_oom = true;
      }
      ASSERT_EQ(real_oom, virt_oom) << "request " << i << " of " << n << " bytes";
      if (real_oom) {
        ++ooms;
        continue;
      }
      ASSERT_NE(a.ptr, nullptr);
      live.push_back(a.offset);
    } else {
      const std::size_t k = rng() % live.size();
      real.free(live[k]);
      virt->free(live[k]);
      live.erase(live.begin() + static_cast<long>(k));
    }
  }
  EXPECT_EQ(real.stats().total.peak, virt->stats().total.peak);
  EXPECT_EQ(real.stats().total.current, virt->stats().total.current);
  EXPECT_GT(ooms, 0) << "the sequence should reach the capacity";
}

TEST(Gpu, TensorRoundTripThroughDevice) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(1000);
  for (auto& x : v) x = u(rng);
  Tensor h = Tensor::from_vector(v, {10, 100});
  Tensor d = h.to(Device::cuda(0));
  EXPECT_EQ(d.device(), Device::cuda(0));
  EXPECT_EQ(d.to_vector<float>(), v);
  Tensor d2 = Tensor::from_vector(v, {1000}, Device::cuda(0));
  EXPECT_EQ(d2.to(Device::cpu()).to_vector<float>(), v);
}

// core/staging.h on a GPU: floats converted on their way into pinned memory, uploaded on the copy
// stream, arrive as the host's conversions; labels as they were (tensor_test: the same on the CPU).
TEST(Gpu, StagedInputsArriveConverted) {
  REQUIRE_GPU();
  test::check_input_staging(Device::cuda(0), test::fresh_seed());
}

// core/pending.h on a GPU: a value read without the host waiting, its tensor freed and its block
// written over at once, arrives as it was (the device's later work waited for the copy); the first
// get() is the one host wait (tensor_test: the same body on the CPU).
TEST(Gpu, AValueReadWithoutWaitingArrivesAsItWas) {
  REQUIRE_GPU();
  test::check_pending_scalar(Device::cuda(0), test::fresh_seed());
#if TALLY_HAVE_CUDA  // the host-wait counter is the CUDA context's
  const Tensor x = Tensor::full({1}, 7.5, DType::Float32, Device::cuda(0));
  synchronize(Device::cuda(0));
  const std::uint64_t before = kernels::cuda::host_sync_count();
  PendingScalar p = PendingScalar::read(x);
  EXPECT_EQ(kernels::cuda::host_sync_count(), before) << "read() must not wait for the device";
  EXPECT_EQ(p.get(), 7.5);
  EXPECT_LE(kernels::cuda::host_sync_count(), before + 1) << "get() waits at most once";
  EXPECT_EQ(p.get(), 7.5);
  EXPECT_LE(kernels::cuda::host_sync_count(), before + 1) << "a second get() must not wait";
#endif
}

TEST(Gpu, ReservingMoreThanTheDeviceHasIsAClearError) {
  REQUIRE_GPU();
  try {
    Arena huge(Device::cuda(0), std::size_t(1) << 50);
    FAIL() << "a 1 PiB arena should not fit";
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const char* needle : {"1125899906842624 bytes", "cuda:0", "free of"})  // asked for, where, what is free
      EXPECT_NE(m.find(needle), std::string::npos) << m;
  }
}

#if TALLY_HAVE_CUDNN
// The GPU's saved description (tally device --save) plans each pass of a convolution as the GPU
// itself does through the graph API — the same engine, workspace and candidates — so a plan made
// from the file on a machine without the GPU is the plan the GPU runs (docs/gpu.md, "Plans without
// the GPU"). Both memory formats of the deviceless plan are checked in tests/deviceless_test.cpp.
TEST(Gpu, ASavedDescriptionPlansConvolutionsAsTheDeviceDoes) {
  REQUIRE_GPU();
  namespace kg = tally::kernels::cuda;
  const DeviceFile mine = describe_device(Device::cuda(0));
  const std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("tally-device-" + std::to_string(::getpid()) + ".json");
  save_device_file(mine, path);
  const DeviceFile back = load_device_file(path);
  std::filesystem::remove(path);
  EXPECT_EQ(back.name, mine.name);
  EXPECT_EQ(back.compute_major, mine.compute_major);
  EXPECT_EQ(back.total_memory, mine.total_memory);
  struct Api {  // the graph API for the scope
    kg::CudnnConvApi before = kg::cudnn_conv_api();
    Api() { kg::set_cudnn_conv_api(kg::CudnnConvApi::graph); }
    ~Api() { kg::set_cudnn_conv_api(before); }
  } graph;
  // ResNet-50's kinds of convolution (a 3x3 of stride 2, a 1x1, a 1x1 projection of stride 2, the
  // 7x7 stem) in both layouts and both types: a whole plan made from the file (`tally plan
  // --device-file`) is the device's only where every one chooses alike. (On an H200 on 2026-11-28
  // a row-major bf16 1x1 forward took 8 KiB of workspace on the device, and 137 MiB as planned from
  // the file: that kind is printed when it differs, any other fails.)
  struct Case {
    kernels::Conv2dShape s;
    int stride, pad;
  };
  const Case cases[] = {{{32, 64, 28, 28, 128, 3, 3}, 2, 1},
                        {{32, 64, 56, 56, 64, 1, 1}, 1, 0},
                        {{32, 256, 56, 56, 512, 1, 1}, 2, 0},
                        {{8, 3, 224, 224, 64, 7, 7}, 2, 3}};
  for (const Case& c : cases) {
    for (const bool channels_last : {false, true}) {
      kernels::Conv2dShape s = c.s;
      s.stride_h = s.stride_w = c.stride, s.pad_h = s.pad_w = c.pad;
      s.workspace_limit = std::size_t(256) << 20;
      s.channels_last = channels_last;
      for (const bool bf16 : {false, true}) {
        const std::string on_device =
            bf16 ? kg::conv2d_plan_description<kernels::bf16>(s) : kg::conv2d_plan_description<float>(s);
        for (const auto pass :
             {kernels::ConvPass::forward, kernels::ConvPass::backward_data, kernels::ConvPass::backward_filter}) {
          const kg::OfflineConvPlan p = kg::conv2d_plan_offline(s, bf16, pass, 0.f, back.cudnn_properties);
          const bool same = on_device.find(p.description) != std::string::npos;
          const std::string what = std::string(bf16 ? "bf16 " : "float32 ") +
                                   (channels_last ? "channels-last " : "row-major ") + std::to_string(s.K) + "x" +
                                   std::to_string(s.C) + "x" + std::to_string(s.R) + "x" + std::to_string(s.S) +
                                   " from the file: " + p.description + "\non the device:\n" + on_device;
          // The one kind known to differ (H200, 2026-11-28: cuDNN's heuristics list another engine
          // first without the device): said, not failed — every other pass must choose alike.
          const bool known = bf16 && !channels_last && s.R == 1 && c.stride == 1 && pass == kernels::ConvPass::forward;
          if (known && !same) std::cout << "known to differ: " << what << "\n";
          if (!known) {
            EXPECT_TRUE(same) << what;
          }
        }
      }
    }
  }
}
#endif
