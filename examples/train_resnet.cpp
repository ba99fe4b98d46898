// examples/train_resnet.cpp — build a ResNet through the C++ API, train it on the built-in
// synthetic data for one epoch, and save it as safetensors (torchvision names).
#include <cstdio>

#include "core/ops.h"
#include "nn/state_dict.h"
#include "data/data.h"
#include "nn/resnet.h"
#include "optim/optimizer.h"

int main() {
  using namespace tally;
  const data::Split ds = data::make_synthetic();                  // 10 classes of 3x32x32
  auto model = nn::make_model({.name = "resnet20", .in_channels = 3, .num_classes = 10});
  optim::SGD sgd(model->parameters(), {.lr = 0.05, .momentum = 0.9, .weight_decay = 5e-4});
  data::Loader loader(ds.train, {.batch_size = 128, .augment = true, .normalize = true});
  loader.start_epoch(0);
  while (auto b = loader.next()) {
    Tensor x = Tensor::from_vector(b->images, {b->size, 3, 32, 32});
    Tensor y = Tensor::from_vector(b->labels, {b->size});
    Tensor loss = cross_entropy((*model)(x), y);
    loss.backward();                                               // grads land in persistent buffers
    sgd.step();
    sgd.zero_grad();
    if (b->index % 10 == 0) std::printf("step %lld loss %.4f\n", static_cast<long long>(b->index), loss.item());
  }
  nn::save_state_dict(*model, "resnet20_synthetic.safetensors");
  std::printf("saved resnet20_synthetic.safetensors\n");
}
