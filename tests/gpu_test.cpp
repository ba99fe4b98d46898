// GPU tests (ctest label `gpu`): the arena and tensors on a GPU. Each one skips with a visible
// message when no GPU is present. The kernels are tested in gpu_kernels_test.cpp, the ops, models
// and the accounting of a GPU step in gpu_ops_test.cpp.
#include <gtest/gtest.h>

#include <random>

#include "core/arena.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "tests/gpu_common.h"

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
