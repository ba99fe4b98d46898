// examples/train_mbp.cpp — a batch larger than memory: ResNet-20 steps of batch 1024 inside a
// 48 MiB budget. The executor plans the micro-batches (mbp/planner.h) — recomputing residual blocks
// only if not even one sample fit (recompute "auto", nn/recompute.h) — runs them with the full
// batch's loss normalization, and reports the measured peak next to the predicted one.
#include <cstdio>

#include <fmt/format.h>

#include "core/memory.h"
#include "data/data.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "optim/optimizer.h"

int main() {
  using namespace tally;
  const data::Split ds = data::make_synthetic();                  // 10 classes of 3x32x32
  auto budget = std::make_shared<Arena>(Device::cpu(), 48 << 20);  // the budget: 48 MiB in all
  ArenaScope in_budget(budget);                                   // new tensors take their bytes from it
  auto model = nn::make_model({.name = "resnet20"});
  optim::SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});
  mbp::Executor executor(*model, sgd, budget, {.sample_shape = {3, 32, 32}, .recompute = "auto"});
  const mbp::Plan& plan = executor.plan(1024);                    // m, k, predicted peak, breakdown
  fmt::print("{}\nlive at the peak: {}\nrecompute: {}\n", plan.summary(), plan.at_peak.str(),
             executor.recompute_choice().summary(plan));
  data::Loader loader(ds.train, {.batch_size = 1024, .augment = true, .normalize = true});
  loader.start_epoch(0);
  for (int step = 0; step < 3; ++step) {
    const auto b = loader.next();
    const mbp::StepResult r = executor.step(b->images.data(), b->labels.data(), b->size);
    fmt::print("step {}: loss {:.4f} | {} micro-batches of <= {} | peak {} bytes, predicted {} bytes\n", step, r.loss,
               r.micro_batches, r.micro_batch, r.peak, r.predicted_peak);
  }
}
