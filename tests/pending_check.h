// tests/pending_check.h — one test body for core/pending.h's PendingScalar on any device: a value
// read and its tensor freed at once, its block handed to a new tensor and written over, still
// reads as it was (on a GPU: the device's later work waited for the copy, the host did not); a
// read waits at most once; a tensor of more than one element or of integers is a clear error.
// tensor_test runs it on the CPU (also with the CPU's reads held back, as tally train's deferred
// path sees them), gpu_test on a GPU.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/pending.h"
#include "core/tensor.h"

namespace tally::test {

inline void check_pending_scalar(Device device, std::uint32_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " on " + device.str());
  std::mt19937 rng(seed);
  std::vector<DType> types{DType::Float32, DType::BFloat16};
  if (device.is_cpu()) types.push_back(DType::Float64);
  for (DType t : types) {
    SCOPED_TRACE(dtype_name(t));
    // A value every type holds exactly, with the 2 added below (bf16: 8 significant bits): an odd
    // multiple of 1/8 in [-16, 16), never 0.
    const double value = (static_cast<double>(rng() % 128) - 64) / 4 + 0.125;
    std::vector<PendingScalar> reads;
    for (int i = 0; i < 3; ++i) {  // several in flight at once, each from its own freed tensor
      {
        const Tensor x = Tensor::full({1}, value + i, t, device);
        reads.push_back(PendingScalar::read(x));
      }  // x freed: its block goes to the next tensor, written at once
      Tensor y = Tensor::full({1}, -1000.0 - i, t, device);
      (void)y;
    }
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(reads[static_cast<std::size_t>(i)].get(), value + i) << "read " << i;
      EXPECT_TRUE(reads[static_cast<std::size_t>(i)].ready());
      EXPECT_EQ(reads[static_cast<std::size_t>(i)].get(), value + i) << "read " << i << " again";
    }
  }
  for (const Tensor& bad :
       {Tensor::full({2}, 1.0, DType::Float32, device), Tensor::full({1}, 1.0, DType::Int64, device)}) {
    try {
      (void)PendingScalar::read(bad);
      ADD_FAILURE() << "read of " << bad.str() << " was accepted";
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find("expected"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(PendingScalar(2.5).ready());
  EXPECT_EQ(PendingScalar(2.5).get(), 2.5);
}

}  // namespace tally::test
