// data/synthetic.h — procedural synthetic images as a data set: the same bytes on every machine.
//
// 10 classes of 3x32x32 images, each class a shape drawn in a class colour on a random dark
// background with pixel noise (see data/synthetic.cpp for the classes). Every value comes from
// integer arithmetic on a counter-based generator (Note [Portable randomness], data/random.h), so
// the images and their statistics are bit-identical on every machine for a given seed. Any other
// shape CxHxW ("synthetic:3x224x224") and class count is *procedural*: no image is held in memory,
// each is drawn when a batch needs it (the 32x32 drawing scaled to HxW by nearest neighbour,
// channel c from colour channel c mod 3); classes beyond 10 repeat the 10 shapes with the class
// colour's channels permuted (distinct up to 60 classes).
#pragma once
#include <cstdint>

#include "data/dataset.h"

namespace tally::data {

// Deterministic in `seed`; train and test are independent draws from the same distribution.
// mean/stddev of both are the per-channel statistics of the train set (of its first 2000
// drawings at 32x32 for a procedural set).
struct SyntheticOptions {
  std::int64_t n_train = 10000, n_test = 2000;
  std::uint64_t seed = 0;
  std::int64_t channels = 3, height = 32, width = 32, num_classes = 10;
};
Split make_synthetic(const SyntheticOptions& o);
Split make_synthetic(std::int64_t n_train = 10000, std::int64_t n_test = 2000, std::uint64_t seed = 0);

}  // namespace tally::data
