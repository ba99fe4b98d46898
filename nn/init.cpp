// nn/init.cpp — see init.h for the formulas.
#include "nn/init.h"

#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/dry_run.h"
#include "core/memory.h"

namespace tally::nn {

std::mt19937_64& default_generator() {
  static std::mt19937_64 gen(0);
  return gen;
}

void manual_seed(std::uint64_t seed) { default_generator().seed(seed); }

std::pair<std::int64_t, std::int64_t> fan_in_and_fan_out(const Tensor& t) {
  if (t.dim() < 2)
    throw ShapeError(fmt::format("fan_in_and_fan_out: expected a tensor with at least 2 dimensions, found {}", t.str()));
  std::int64_t receptive = 1;
  for (std::int64_t d = 2; d < t.dim(); ++d) receptive *= t.size(d);
  return {t.size(1) * receptive, t.size(0) * receptive};
}

double calculate_gain(Nonlinearity nonlinearity, double a) {
  switch (nonlinearity) {
    case Nonlinearity::Linear: return 1.0;
    case Nonlinearity::ReLU: return std::sqrt(2.0);
    case Nonlinearity::LeakyReLU: return std::sqrt(2.0 / (1.0 + a * a));
  }
  return 1.0;
}

namespace {

// Draws numel values from `draw` on the host and copies them into t.
template <class Draw>
void fill_with(Tensor& t, const char* op, Draw draw) {
  check_floating(op, t);
  if (skip_side_effects()) return;  // the generator draws nothing in a dry run
  const auto n = static_cast<std::size_t>(t.numel());
  if (t.dtype() == DType::Float64) {
    std::vector<double> v(n);
    for (auto& x : v) x = draw();
    t.copy_(Tensor::from_vector(v, t.shape(), Device::cpu(), Category::temporary));
  } else {
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(draw());
    t.copy_(Tensor::from_vector(v, t.shape(), Device::cpu(), Category::temporary));
  }
}

double kaiming_std(const Tensor& t, double a, FanMode mode, Nonlinearity nonlinearity) {
  const auto [fan_in, fan_out] = fan_in_and_fan_out(t);
  const std::int64_t fan = mode == FanMode::FanIn ? fan_in : fan_out;
  if (fan == 0) throw ShapeError(fmt::format("kaiming init: tensor {} has a zero fan", t.str()));
  return calculate_gain(nonlinearity, a) / std::sqrt(static_cast<double>(fan));
}

}  // namespace

void uniform_(Tensor t, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  fill_with(t, "uniform_", [&] { return dist(default_generator()); });
}

void normal_(Tensor t, double mean, double std) {
  std::normal_distribution<double> dist(mean, std);
  fill_with(t, "normal_", [&] { return dist(default_generator()); });
}

void constant_(Tensor t, double value) {
  check_floating("constant_", t);
  t.fill_(value);
}

void kaiming_uniform_(Tensor t, double a, FanMode mode, Nonlinearity nonlinearity) {
  const double bound = std::sqrt(3.0) * kaiming_std(t, a, mode, nonlinearity);
  uniform_(t, -bound, bound);
}

void kaiming_normal_(Tensor t, double a, FanMode mode, Nonlinearity nonlinearity) {
  normal_(t, 0.0, kaiming_std(t, a, mode, nonlinearity));
}

}  // namespace tally::nn
