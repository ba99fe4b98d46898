// nn/init.h — parameter initialization with PyTorch's formulas (torch.nn.init).
//
// Values are drawn on the host from one global generator (std::mt19937_64, seed 0 until
// manual_seed) and copied into the tensor, whatever its device. The formulas match PyTorch;
// the random streams do not (PyTorch uses its own generator).
//
//   fan_in  = size(1) * receptive field,  fan_out = size(0) * receptive field
//             (receptive field = product of the dims after the first two; 1 for a matrix)
//   gain(nonlinearity, a): linear 1, relu sqrt(2), leaky_relu sqrt(2 / (1 + a^2))
//   kaiming_uniform_: U(-b, b), b = gain * sqrt(3 / fan)
//   kaiming_normal_:  N(0, std^2), std = gain / sqrt(fan)
//
// PyTorch's default for Conv2d and Linear is kaiming_uniform_(weight, a = sqrt(5)), i.e.
// b = 1 / sqrt(fan_in), and the bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
//
// The generator is shared mutable state and not thread-safe: build models on one thread.
// In a dry run (core/memory.h) tensors have no data; the functions then do nothing.
#pragma once
#include <cstdint>
#include <random>
#include <utility>

#include "core/tensor.h"

namespace tally::nn {

std::mt19937_64& default_generator();
void manual_seed(std::uint64_t seed);

enum class FanMode { FanIn, FanOut };
enum class Nonlinearity { Linear, ReLU, LeakyReLU };

// (fan_in, fan_out) of a weight with at least 2 dimensions (ShapeError otherwise).
std::pair<std::int64_t, std::int64_t> fan_in_and_fan_out(const Tensor& t);
double calculate_gain(Nonlinearity nonlinearity, double a = 0.0);

// Each fills the (floating, contiguous) tensor in place; the handle is taken by value.
void uniform_(Tensor t, double lo, double hi);
void normal_(Tensor t, double mean, double std);
void constant_(Tensor t, double value);
void kaiming_uniform_(Tensor t, double a = 0.0, FanMode mode = FanMode::FanIn,
                      Nonlinearity nonlinearity = Nonlinearity::LeakyReLU);
void kaiming_normal_(Tensor t, double a = 0.0, FanMode mode = FanMode::FanIn,
                     Nonlinearity nonlinearity = Nonlinearity::LeakyReLU);

}  // namespace tally::nn
