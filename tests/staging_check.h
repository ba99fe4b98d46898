// tests/staging_check.h — one test body for core/staging.h's InputStager on any device: floats
// staged into float32, bf16 and float64 tensors (converted on their way) and int64 labels arrive
// as the host's own conversions (into channels-last tensors permuted on their way), through a
// ring of staging that wraps, each upload after all
// the work so far or after a fence (kept or not); a size that does not
// fill the tensor is a clear error. tensor_test runs it on the CPU, gpu_test on a GPU.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/staging.h"
#include "core/tensor.h"
#include "kernels/common.h"

namespace tally::test {

inline void check_input_staging(Device device, std::uint32_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " on " + device.str());
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  const std::size_t count = 3 * 1000 + 7;  // not a multiple of any vector width
  std::vector<float> images(count);
  for (auto& v : images) v = u(rng);
  std::vector<std::int64_t> labels(5);
  for (auto& l : labels) l = static_cast<std::int64_t>(rng() % 1000) - 7;

  InputStager stager(device);
  // The ring's size: two steps up to the budget, three micro-batches at least.
  constexpr std::size_t MiB = std::size_t(1) << 20;
  EXPECT_EQ(InputStager::staging_capacity(MiB, 100 * MiB), 200 * MiB);
  EXPECT_EQ(InputStager::staging_capacity(MiB, 1024 * MiB), InputStager::kStagingBudget);
  EXPECT_EQ(InputStager::staging_capacity(100 * MiB, 1024 * MiB), 300 * MiB);
  // A ring of three float64 stagings: the float32, bf16 and float64 images and the labels, four
  // rounds, so the ring wraps and each stage waits for the upload that last read its bytes (on a GPU).
  const std::size_t largest = count * 8;
  stager.reserve(largest, largest);
  // Fences: 0 on the CPU (nothing to wait for), numbered from 1 on a GPU. Uploads after a kept
  // fence and after one no longer kept (taken as "all work so far") arrive alike.
  const std::size_t oldest = stager.fence();
  EXPECT_EQ(oldest == 0, device.is_cpu()) << "fence " << oldest;
  for (std::size_t f = 0; f < InputStager::kFences; ++f) stager.fence();
  std::vector<Tensor> staged;
  Tensor y;
  for (int round = 0; round < 4; ++round) {
    staged.clear();
    std::size_t last = 0;
    const std::size_t after[3] = {0, stager.fence(), oldest};
    int i = 0;
    for (DType t : {DType::Float32, DType::BFloat16, DType::Float64}) {
      staged.push_back(Tensor::empty({static_cast<std::int64_t>(count)}, t, device, Category::input, "input"));
      last = stager.stage_floats(staged.back(), images.data(), count, after[(round + i++) % 3]);
    }
    y = Tensor::empty({static_cast<std::int64_t>(labels.size())}, DType::Int64, device, Category::input, "labels");
    last = stager.stage(y, labels.data(), labels.size() * sizeof(std::int64_t), after[round % 3]);
    stager.wait(last);  // every upload staged before it too
  }
  synchronize(device);

  const std::vector<float> as_f32 = staged[0].to(Device::cpu()).to_vector<float>();
  const std::vector<float> from_bf16 = staged[1].to(Device::cpu()).to(DType::Float32).to_vector<float>();
  const std::vector<double> as_f64 = staged[2].to(Device::cpu()).to_vector<double>();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const float rounded = static_cast<float>(kernels::bf16(images[i]));
    wrong += as_f32[i] != images[i] || from_bf16[i] != rounded || as_f64[i] != static_cast<double>(images[i]);
  }
  EXPECT_EQ(wrong, 0u) << "of " << count << " staged values";
  EXPECT_EQ(y.to(Device::cpu()).to_vector<std::int64_t>(), labels);

  // Row-major images into channels-last tensors: permuted on their way, the same values.
  const Shape images_shape{7, 3, 11, 13};
  for (DType t : {DType::Float32, DType::BFloat16}) {
    Tensor x = Tensor::empty(images_shape, t, device, Category::input, "input", MemoryFormat::ChannelsLast);
    stager.wait(stager.stage_floats(x, images.data(), static_cast<std::size_t>(shape_numel(images_shape))));
    synchronize(device);
    ASSERT_EQ(x.suggest_memory_format(), MemoryFormat::ChannelsLast);
    const std::vector<float> got = x.to(Device::cpu()).contiguous().to(DType::Float32).to_vector<float>();
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      differ += got[i] != (t == DType::Float32 ? images[i] : static_cast<float>(kernels::bf16(images[i])));
    EXPECT_EQ(differ, 0u) << "of " << got.size() << " channels-last " << dtype_name(t) << " values";
  }

  // A count that does not fill the tensor: an error naming both, nothing written.
  try {
    stager.stage_floats(staged[0], images.data(), count - 1);
    ADD_FAILURE() << "staging too few floats was accepted";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot fill"), std::string::npos) << e.what();
  }
}

}  // namespace tally::test
