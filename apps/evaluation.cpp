// apps/evaluation.cpp — the test set's loss and accuracy during `tally train` (apps/training_run.h).
#include "apps/training_run.h"

namespace tally::app {
namespace {

// One batch of evaluation: its summed loss and its correct predictions, added to `sums`.
void count_batch(const Tensor& logits, const data::Batch& b, Device dev, double sums[2]) {
  Tensor y = Tensor::from_vector(b.labels, {b.size}, dev, Category::input);
  CrossEntropyOptions co;
  co.reduction = Reduction::Sum;
  sums[0] += cross_entropy(logits, y, co).item();
  const auto l = logits.to(DType::Float32).to_vector<float>();
  const std::int64_t C = logits.size(1);
  for (std::int64_t i = 0; i < b.size; ++i) {
    const float* row = l.data() + i * C;
    sums[1] += static_cast<double>(std::max_element(row, row + C) - row == b.labels[static_cast<std::size_t>(i)]);
  }
}

Eval evaluate_with(nn::Module& model, const data::Dataset& ds, bool normalize, Device dev, DType act, std::int64_t B) {
  NoGradGuard ng;
  model.eval();
  struct Train {  // back to training mode however this ends
    nn::Module& m;
    ~Train() { m.train(); }
  } back{model};
  double sums[2] = {0, 0};  // loss, correct
  const std::int64_t n = ds.size();
  data::LoaderOptions lo;
  lo.batch_size = B;
  lo.shuffle = false;
  lo.augment = false;
  lo.normalize = normalize;
  lo.drop_last = false;
  data::Loader loader(ds, lo);
  loader.start_epoch(0);
  while (auto b = loader.next()) {
    // In the training steps' precision: bf16 activations under --precision bf16.
    Tensor x = Tensor::from_vector(b->images, {b->size, ds.channels, ds.height, ds.width}, dev, Category::input).to(act);
    count_batch(model(x), *b, dev, sums);
  }
  return {sums[0] / static_cast<double>(n), sums[1] / static_cast<double>(n)};
}

}  // namespace

// Evaluation runs in the same arena as training, in batches of at most the planned micro-batch
// (a no-grad forward keeps less than a training step of the same size); should it still run
// out of memory, the batch halves.
Eval evaluate(nn::Module& model, const data::Dataset& ds, bool normalize, Device dev, DType act, std::int64_t max_batch) {
  std::int64_t B = std::max<std::int64_t>(1, std::min<std::int64_t>(256, max_batch));
  for (;;) {
    try {
      return evaluate_with(model, ds, normalize, dev, act, B);
    } catch (const OutOfMemory&) {
      if (B == 1) throw;
      B /= 2;
    }
  }
}

// A pipeline's evaluation: every rank runs its stage on every batch of the test set (batches of at
// most the planned micro-batch, as above), the last stage counts; the counts go to every rank.
Eval evaluate_stages(mbp::StageRunner& executor, nn::Module& model, const data::Dataset& ds, bool normalize,
                     distributed::Communicator& comm, std::int64_t max_batch) {
  NoGradGuard ng;
  model.eval();
  struct Train {
    nn::Module& m;
    ~Train() { m.train(); }
  } back{model};
  data::LoaderOptions lo;
  lo.batch_size = std::max<std::int64_t>(1, std::min<std::int64_t>(256, max_batch));
  lo.shuffle = false, lo.augment = false, lo.normalize = normalize, lo.drop_last = false;
  data::Loader loader(ds, lo);
  loader.start_epoch(0);
  const bool first = executor.stage().stage == 0;
  double sums[2] = {0, 0};  // loss, correct
  while (auto b = loader.next()) {
    Tensor x;
    if (first)
      x = Tensor::from_vector(b->images, {b->size, ds.channels, ds.height, ds.width}, executor.device(), Category::input)
              .to(executor.activation_dtype());
    const Tensor logits = executor.forward_through_stages(x, b->size);
    if (logits.defined()) count_batch(logits, *b, executor.device(), sums);  // the last stage
  }
  comm.all_reduce_sum(sums, 2);
  const auto n = static_cast<double>(ds.size());
  return {sums[0] / n, sums[1] / n};
}

}  // namespace tally::app
