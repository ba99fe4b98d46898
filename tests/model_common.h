// tests/model_common.h — what the MBP and data-parallel tests share: seeded random batches,
// seeded ResNets, SGD with momentum, parameter snapshots and the comparisons (a NaN never passes).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/tensor.h"
#include "nn/init.h"
#include "nn/resnet.h"
#include "optim/optimizer.h"

namespace tally::test {

struct Data {
  std::vector<float> images;
  std::vector<std::int64_t> labels;
};

inline Data make_data(std::int64_t batch, const Shape& sample, std::uint32_t seed, std::int64_t classes = 10) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::uniform_int_distribution<std::int64_t> c(0, classes - 1);
  Data d;
  d.images.resize(static_cast<std::size_t>(batch * shape_numel(sample)));
  for (auto& x : d.images) x = n(rng);
  d.labels.resize(static_cast<std::size_t>(batch));
  for (auto& l : d.labels) l = c(rng);
  return d;
}

inline std::shared_ptr<nn::Module> model(const std::string& name, const std::string& norm, std::uint64_t seed = 1,
                                  DType dtype = DType::Float32) {
  nn::manual_seed(seed);
  nn::ModelConfig mc;
  mc.name = name;
  mc.norm = nn::parse_norm(norm);
  auto m = nn::make_model(mc);
  if (dtype != DType::Float32) m->to(dtype);
  m->train();
  return m;
}

inline std::unique_ptr<optim::SGD> sgd(nn::Module& m, double lr = 0.05) {
  optim::SGDOptions so;
  so.lr = lr;
  so.momentum = 0.9;
  so.weight_decay = 5e-4;
  return std::make_unique<optim::SGD>(m.parameters(), so);
}

template <class T>
Tensor input_tensor(const Data& d, std::int64_t batch, const Shape& sample) {
  Shape s{batch};
  s.insert(s.end(), sample.begin(), sample.end());
  return Tensor::from_vector(std::vector<T>(d.images.begin(), d.images.end()), s, Device::cpu(), Category::input);
}

// The reference: one plain full-batch forward and backward with the mean loss.
template <class T>
double full_batch_backward(nn::Module& m, const Data& d, std::int64_t batch, const Shape& sample) {
  Tensor x = input_tensor<T>(d, batch, sample);
  Tensor y = Tensor::from_vector(d.labels, {batch});
  Tensor loss = cross_entropy(m(x), y);
  loss.backward();
  return loss.item();
}

template <class T>
std::vector<std::vector<double>> grads(const nn::Module& m) {
  std::vector<std::vector<double>> out;
  for (const auto& p : m.parameters()) {
    const auto g = p.grad().to_vector<T>();
    out.emplace_back(g.begin(), g.end());
  }
  return out;
}

template <class T>
std::vector<std::vector<double>> values(const nn::Module& m, bool buffers = false) {
  std::vector<std::vector<double>> out;
  for (const auto& [name, t] : buffers ? m.named_buffers() : m.named_parameters()) {
    if (!is_floating(t.dtype())) continue;
    const auto v = t.to(Device::cpu()).template to_vector<T>();  // from any device
    out.emplace_back(v.begin(), v.end());
  }
  return out;
}

// The relative error of float tensors a against b (shapes must agree; a non-finite value in a is
// infinitely far: a NaN never passes): ||a - b|| / ||b||, or ||a - b|| when b is 0.
inline double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape()) << a.str() << " vs " << b.str();
  if (a.shape() != b.shape()) return INFINITY;
  const auto x = a.to_vector<float>(), y = b.to_vector<float>();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (double(x[i]) - y[i]) * (double(x[i]) - y[i]);
    den += double(y[i]) * y[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// ||a - b|| / ||b||, with a NaN anywhere reported as infinity so it never passes.
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline bool bitwise_equal(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

}  // namespace tally::test
