// The fused batch norm + residual add + ReLU (core/ops.h: BatchNormOptions::relu and the residual)
// against the unfused ops it replaces — relu(add(batch_norm(x), r)):
//   * outputs, running statistics and every gradient (x, weight, bias, residual) bit for bit, in
//     float64, float32 and bf16 activations with float32 parameters, with and without the
//     residual, through leaves (persistent gradient buffers: the fused backward adds into them)
//     and through intermediate tensors (fresh gradients: it reuses the incoming one in place);
//   * (its float64 gradients against finite differences: GradCheck.BatchNormFusedWithResidualAndRelu);
//   * an input given up without a gradient is overwritten, with the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/autograd.h"
#include "core/memory.h"
#include "core/ops.h"

using namespace tally;

namespace {

Tensor random_tensor(const Shape& s, DType dt, std::mt19937& rng, Category cat = Category::activation) {
  std::normal_distribution<double> n(0.2, 1.0);  // a mean off zero: the mask and the statistics both matter
  std::vector<double> v(static_cast<std::size_t>(shape_numel(s)));
  for (double& x : v) x = n(rng);
  Tensor t = Tensor::from_vector(v, s, Device::cpu(), cat);
  return dt == DType::Float64 ? t : t.to(dt);
}

std::vector<char> bytes(const Tensor& t) {
  const Tensor c = t.contiguous();
  const auto* p = static_cast<const char*>(c.raw_data());
  return std::vector<char>(p, p + c.nbytes());
}

struct Outcome {
  std::vector<std::vector<char>> all;  // y, running mean, running var, dx, dw, db, dr
};

// One forward and backward, fused or not. `through`: x and r reach the op through a scale by 1
// (intermediate tensors: their gradients are fresh), else they are the leaves themselves.
// `group`: group norm (3 groups of 2 channels) instead of batch norm; `relu_after`: the ReLU is
// part of the op (else the residual add alone); `x_grad`: x needs a gradient (else only r, w, b).
Outcome run(bool fused, bool residual, DType act, bool through, std::uint32_t seed, bool group = false,
            bool relu_after = true, bool x_grad = true) {
  std::mt19937 rng(seed);
  const Shape s = group ? Shape{3, 6, 4, 5} : Shape{3, 5, 4, 6};
  const std::int64_t C = s[1];
  const DType pdt = act == DType::BFloat16 ? DType::Float32 : act;
  Tensor x0 = random_tensor(s, act, rng), r0 = random_tensor(s, act, rng);
  Tensor w = random_tensor({C}, pdt, rng, Category::parameter), b = random_tensor({C}, pdt, rng, Category::parameter);
  Tensor rm = random_tensor({C}, pdt, rng, Category::parameter);
  Tensor rv = random_tensor({C}, pdt, rng, Category::parameter).to(DType::Float64);
  {  // a positive running variance
    std::vector<double> v = rv.to_vector<double>();
    for (double& e : v) e = std::abs(e) + 0.5;
    rv = Tensor::from_vector(v, {C}, Device::cpu(), Category::parameter).to(pdt);
  }
  const Tensor gy = random_tensor(s, act, rng);
  for (Tensor* t : {&r0, &w, &b}) t->set_requires_grad(true);
  x0.set_requires_grad(x_grad);
  Tensor x = through ? scale(x0, 1.0) : x0, r = through ? scale(r0, 1.0) : r0;
  BatchNormOptions o;
  Tensor y;
  if (fused && group) {
    y = group_norm(x, 3, w, b, 1e-5, relu_after, residual ? r : Tensor());
  } else if (fused) {
    o.relu = true;
    y = batch_norm(x, w, b, rm, rv, o, residual ? r : Tensor());
  } else {
    y = group ? group_norm(x, 3, w, b) : batch_norm(x, w, b, rm, rv, o);
    if (residual) y = add(y, r);
    if (relu_after) y = relu(y);
  }
  Outcome out;
  out.all = {bytes(y), bytes(rm), bytes(rv)};
  sum(mul(y, gy)).backward();
  if (x_grad) out.all.push_back(bytes(x0.grad()));
  out.all.push_back(bytes(w.grad()));
  out.all.push_back(bytes(b.grad()));
  if (residual) out.all.push_back(bytes(r0.grad()));
  return out;
}

class FusedBatchNorm : public ::testing::Test {
 protected:
  void SetUp() override { configure_arena(Device::cpu(), kDefaultCpuArenaBytes); }
};

}  // namespace

TEST_F(FusedBatchNorm, MatchesTheUnfusedOpsBitForBit) {
  const char* names[] = {"y", "running_mean", "running_var", "dx", "dweight", "dbias", "dresidual"};
  for (DType act : {DType::Float64, DType::Float32, DType::BFloat16})
    for (bool residual : {false, true})
      for (bool through : {false, true}) {
        const Outcome a = run(true, residual, act, through, 7), b = run(false, residual, act, through, 7);
        ASSERT_EQ(a.all.size(), b.all.size());
        for (std::size_t i = 0; i < a.all.size(); ++i)
          EXPECT_TRUE(a.all[i] == b.all[i]) << names[i] << " differs: " << dtype_name(act)
                                            << (residual ? ", with residual" : ", no residual")
                                            << (through ? ", intermediate inputs" : ", leaf inputs");
      }
}

// Group norm + residual add + ReLU (and + residual add alone) against the unfused ops, bit for bit,
// also where x needs no gradient (the residual's gradient written on its own).
TEST_F(FusedBatchNorm, GroupNormMatchesTheUnfusedOpsBitForBit) {
  for (DType act : {DType::Float64, DType::Float32, DType::BFloat16})
    for (int variant = 0; variant < 4; ++variant)
      for (bool through : {false, true})
        for (bool x_grad : {true, false}) {
          const bool residual = variant != 0, relu_after = variant != 2;
          if (!residual && !relu_after) continue;
          if (!x_grad && !residual) continue;
          const Outcome a = run(true, residual, act, through, 9, true, relu_after, x_grad);
          const Outcome b = run(false, residual, act, through, 9, true, relu_after, x_grad);
          ASSERT_EQ(a.all.size(), b.all.size());
          for (std::size_t i = 0; i < a.all.size(); ++i)
            EXPECT_TRUE(a.all[i] == b.all[i]) << "tensor " << i << " differs: " << dtype_name(act) << ", variant "
                                              << variant << (through ? ", intermediate inputs" : ", leaf inputs")
                                              << (x_grad ? "" : ", x without gradient");
        }
}

TEST_F(FusedBatchNorm, AGivenUpInputWithoutGradientIsOverwritten) {
  std::mt19937 rng(5);
  const Shape s{4, 3, 5, 5};
  Tensor x = random_tensor(s, DType::Float32, rng), r = random_tensor(s, DType::Float32, rng);
  Tensor w = random_tensor({3}, DType::Float32, rng, Category::parameter);
  Tensor b = random_tensor({3}, DType::Float32, rng, Category::parameter);
  BatchNormOptions o;
  o.relu = true;
  NoGradGuard ng;
  const Tensor kept = batch_norm(x, w, b, Tensor(), Tensor(), o, r);  // x stays
  Tensor given = x.clone(Category::activation);
  const void* buffer = given.raw_data();
  const Tensor y = batch_norm_with_stats(std::move(given), w, b, Tensor(), Tensor(), o, r).y;
  EXPECT_EQ(y.raw_data(), buffer) << "the given-up input's buffer was not reused";
  EXPECT_TRUE(bytes(y) == bytes(kept));
}
