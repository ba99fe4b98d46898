// examples/consumer/main.cpp — README's first C++ example, compiled against the installed
// package (find_package(tally), tally::tally): a ResNet-20 trained for a few steps on synthetic
// data and saved as safetensors. Exits non-zero if the loss is not finite or does not fall.
#include <cmath>
#include <cstdio>

#include "core/ops.h"
#include "data/data.h"
#include "nn/state_dict.h"
#include "nn/resnet.h"
#include "optim/optimizer.h"

int main() {
  using namespace tally;
  const data::Split ds = data::make_synthetic(512, 64);          // 10 classes of 3x32x32
  auto model = nn::make_model({.name = "resnet20", .in_channels = 3, .num_classes = 10});
  optim::SGD sgd(model->parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4});
  data::Loader loader(ds.train, {.batch_size = 64, .augment = true, .normalize = true});
  double first = 0, last = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch);
    while (auto b = loader.next()) {
      Tensor x = Tensor::from_vector(b->images, {b->size, 3, 32, 32});
      Tensor y = Tensor::from_vector(b->labels, {b->size});
      Tensor loss = cross_entropy((*model)(x), y);
      loss.backward();                                             // grads land in persistent buffers
      sgd.step();
      sgd.zero_grad();
      last = loss.item();
      if (epoch == 0 && b->index == 0) first = last;
    }
  }
  nn::save_state_dict(*model, "resnet20_consumer.safetensors");
  std::printf("consumer: loss %.4f -> %.4f; saved resnet20_consumer.safetensors\n", first, last);
  return std::isfinite(last) && last < first ? 0 : 1;
}
