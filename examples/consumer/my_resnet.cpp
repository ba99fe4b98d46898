// examples/consumer/my_resnet.cpp — docs/models.md's example: a residual block of one's own and a
// small ResNet made of it (small_resnet.h), its plan in a memory budget, a few steps through MBP's
// executor, the memory report of one step and the weights saved. Built in tally's tree (examples/, run by the
// test example.my_resnet) and, as a user builds it, against the installed package
// (examples/consumer, tests/consumer_test.sh). Exits non-zero unless every step's peak is the
// plan's to the byte and the loss stays finite.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "core/memory.h"
#include "core/ops.h"
#include "data/data.h"
#include "mbp/executor.h"
#include "nn/init.h"
#include "nn/modules.h"
#include "nn/recompute.h"
#include "nn/state_dict.h"
#include "optim/optimizer.h"
#include "report/memory_html.h"
#include "small_resnet.h"

using namespace tally;

int main() {
  // 1. The budget: every byte of the model, its gradients, its optimizer state and each step's
  //    work comes from this arena (24 MiB on the CPU).
  auto budget = std::make_shared<Arena>(Device::cpu(), std::size_t(24) << 20);
  ArenaScope in_budget(budget);
  nn::manual_seed(0);
  auto model = std::make_shared<my::SmallResNet>(/*blocks=*/2, /*classes=*/10);
  model->train();
  optim::SGD sgd(model->parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 5e-4});

  // 2. What recomputation the model offers, read from its module tree.
  std::int64_t parameters = 0;
  for (const Tensor& p : model->parameters()) parameters += p.numel();
  const int levels = nn::recompute_levels(*model);
  fmt::print("the model: {} parameters; recomputation levels:", parameters);
  for (int level = 0; level < levels; ++level) fmt::print(" {}", nn::recompute_level_name(*model, level));
  fmt::print("\n");

  // 3. The plan of a batch of 512 in the budget: micro-batches and the predicted peak, by dry runs.
  const std::int64_t batch = 512;
  mbp::Executor executor(*model, sgd, budget, {.sample_shape = {3, 32, 32}, .recompute = "auto"});
  const mbp::Plan& plan = executor.plan(batch);
  fmt::print("plan: {}\n      live at the peak: {}\n      recompute: {}\n", plan.summary(), plan.at_peak.str(),
             executor.recompute_choice().summary(plan));
  const mbp::Plan all = executor.at_level(batch, std::nullopt, levels - 1);
  fmt::print("      with every level of recomputation the micro-batches would be of {}\n", all.micro_batch);

  // 4. Steps through the executor; the second one traced for the memory report.
  const data::Split ds = data::make_synthetic(2 * batch, 64);
  data::Loader loader(ds.train, {.batch_size = batch, .augment = true, .normalize = true});
  loader.start_epoch(0);
  bool exact = true, finite = true;
  for (int step = 0; step < 2; ++step) {
    const auto b = loader.next();
    if (step == 1) budget->set_tracing(true);
    const mbp::StepResult r = executor.step(b->images.data(), b->labels.data(), b->size);
    if (step == 1) budget->set_tracing(false);
    exact = exact && r.peak == r.predicted_peak;
    finite = finite && std::isfinite(r.loss);
    fmt::print("step {}: loss {:.4f} | {} micro-batches | peak {} bytes, predicted {} bytes\n", step, r.loss,
               r.micro_batches, r.peak, r.predicted_peak);
  }

  // 5. The traced step as the memory report (every allocation a band, the peak explained), and the
  //    weights as safetensors.
  report::MemoryPage page;
  page.title = fmt::format("my_resnet: SmallResNet, batch {} in {}", batch, format_bytes(budget->capacity()));
  page.source = "the second training step, traced";
  page.budget = budget->capacity();
  page.predicted_peak = plan.predicted_peak;
  page.micro_batches = plan.micro_batches;
  page.plan = {{"plan", plan.summary()}, {"recompute", executor.recompute_choice().summary(plan)}};
  std::ofstream("my_resnet_memory.html") << report::memory_html(*budget, page);
  nn::save_state_dict(*model, "my_resnet.safetensors");
  fmt::print("wrote my_resnet_memory.html and my_resnet.safetensors; {}\n",
             !exact   ? "FAILED: a step's measured peak differs from the plan's"
             : !finite ? "FAILED: a loss is not finite"
                       : "every step exact: measured peak == predicted");
  return exact && finite ? 0 : 1;
}
