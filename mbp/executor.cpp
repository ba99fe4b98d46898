// mbp/executor.cpp — micro-batch execution with exact loss normalization; see mbp/executor.h.
#include "mbp/executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/cuda_runtime.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "tally/config.h"
#if TALLY_HAVE_CUDA
#include "kernels/cuda/context.h"
#endif

namespace tally::mbp {

namespace {

// The input tensors of one micro-batch (category input), allocated in the arena, and on CUDA the
// event that marks the end of their upload (the compute stream waits for it before the forward).
struct Inputs {
  Tensor x, y;
#if TALLY_HAVE_CUDA
  kernels::cuda::Event uploaded;
#endif
};

}  // namespace

// Pinned host memory for one step's inputs on CUDA: each micro-batch's samples are copied there
// by the host and uploaded from there on the copy stream, overlapping the previous micro-batch's
// compute. One slot per micro-batch, never reused within a step, so the host never waits for an
// upload; the next step reuses them after the step's one synchronization (reading the loss).
struct Executor::Staging {
#if TALLY_HAVE_CUDA
  kernels::cuda::PinnedBuffer buffer;
#endif
};

namespace {

Inputs allocate_inputs(std::int64_t n, const Shape& sample_shape, DType dtype, Device device) {
  Shape xs{n};
  xs.insert(xs.end(), sample_shape.begin(), sample_shape.end());
  Inputs in;
  in.x = Tensor::empty(xs, dtype, device, Category::input, "input");
  in.y = Tensor::empty({n}, DType::Int64, device, Category::input, "labels");
  return in;
}

// Fills `in` with samples [offset, offset + n) of the host batch. CPU: plain copies. CUDA: into
// the staging slot of these samples, then an upload on the copy stream after the compute work
// enqueued so far (the arena may have handed the blocks over from tensors it still reads).
void fill_inputs(Inputs& in, const float* images, const std::int64_t* labels, std::int64_t offset, std::int64_t n,
                 std::int64_t batch, std::int64_t sample_numel, DType dtype, Device device, void* staging) {
  if (is_dry_run()) return;
  const float* src = images + offset * sample_numel;
  const std::size_t count = static_cast<std::size_t>(n * sample_numel);
  const std::int64_t* lab = labels + offset;
  if (device.is_cpu()) {
    if (dtype == DType::Float32) std::copy(src, src + count, in.x.data<float>());
    else std::copy(src, src + count, in.x.data<double>());
    std::copy(lab, lab + n, in.y.data<std::int64_t>());
    return;
  }
#if TALLY_HAVE_CUDA
  if (dtype != DType::Float32)
    throw Error(fmt::format("MBP executor: inputs on {} must be float32, the model is {}", device.str(), dtype_name(dtype)));
  namespace kcu = kernels::cuda;
  kcu::use_device(device.index);
  // Staging layout: all images of the batch, then all labels.
  float* img_slot = static_cast<float*>(staging) + offset * sample_numel;
  auto* lab_slot = reinterpret_cast<std::int64_t*>(static_cast<float*>(staging) + batch * sample_numel) + offset;
  std::copy(src, src + count, img_slot);
  std::copy(lab, lab + n, lab_slot);
  kcu::copy_wait(kcu::Event::record(kcu::compute_stream()));
  (void)kcu::upload_async(in.x.raw_data(), img_slot, count * sizeof(float));
  in.uploaded = kcu::upload_async(in.y.raw_data(), lab_slot, static_cast<std::size_t>(n) * sizeof(std::int64_t));
#else
  (void)staging, (void)batch;
  throw Error("MBP executor: a CUDA device in a build without the CUDA backend");
#endif
}

// The compute stream waits for the inputs' upload (no host wait).
void ready(const Inputs& in) {
#if TALLY_HAVE_CUDA
  if (in.uploaded.valid()) kernels::cuda::compute_wait(in.uploaded);
#else
  (void)in;
#endif
}

Tensor first_parameter(const nn::Module& m) {
  const auto ps = m.parameters();
  if (ps.empty()) throw Error("MBP executor: the model has no parameters");
  return ps.front();
}

}  // namespace

Executor::Executor(nn::Module& model, optim::Optimizer& optimizer, ExecutorOptions options)
    : Executor(model, optimizer, current_arena(first_parameter(model).device()), std::move(options)) {}

Executor::Executor(nn::Module& model, optim::Optimizer& optimizer, std::shared_ptr<Arena> arena,
                   ExecutorOptions options)
    : model_(model),
      optimizer_(optimizer),
      opt_(std::move(options)),
      device_(first_parameter(model).device()),
      dtype_(first_parameter(model).dtype()),
      arena_(std::move(arena)),
      planner_(arena_, [this](const std::vector<std::int64_t>& sizes) { run_step(nullptr, nullptr, sizes, nullptr); }),
      bns_(nn::batch_norm_layers(model)),
      moments_(bns_.size()),
      staging_(std::make_unique<Staging>()) {
  if (opt_.sample_shape.empty())
    throw Error("MBP executor: the sample shape is empty (expected e.g. {3, 32, 32})");
  for (std::int64_t d : opt_.sample_shape) {
    if (d < 1) throw Error(fmt::format("MBP executor: sample shape dimensions must be >= 1, found {}", shape_str(opt_.sample_shape)));
    sample_numel_ *= d;
  }
  if (opt_.micro_batch && *opt_.micro_batch < 1)
    throw Error(fmt::format("MBP executor: the micro-batch size must be >= 1, found {}", *opt_.micro_batch));
  if (opt_.max_oom_retries < 0) throw Error("MBP executor: max_oom_retries must be >= 0");
  if (!arena_) throw Error("MBP executor: expected an arena to run on, found none");
  if (distributed()) {
    if (!opt_.communicator->serves(device_))
      throw Error(fmt::format("MBP executor: the {} communicator cannot carry tensors on {}",
                              opt_.communicator->backend(), device_.str()));
    if (opt_.normalization == LossNormalization::per_micro_batch)
      throw Error("MBP executor: per-micro-batch loss normalization is for one process; data parallelism uses the "
                  "exact normalization");
  }
  if (opt_.bucket_bytes < dtype_size(dtype_))
    throw Error(fmt::format("MBP executor: bucket_bytes must hold at least one element, found {}", opt_.bucket_bytes));
  if (arena_->device() != device_)
    throw Error(fmt::format("MBP executor: the arena is on {} but the model's parameters are on {}",
                            arena_->device().str(), device_.str()));
  for (const auto& [name, p] : model.named_parameters()) {
    if (!p.grad().defined())
      throw Error(fmt::format("MBP executor: parameter {} has no gradient buffer; the planner counts gradients, so "
                              "they must exist before planning (Module::zero_grad allocates them)", name));
    if (p.storage()->arena() != arena_ || p.grad().storage()->arena() != arena_)
      throw Error(fmt::format("MBP executor: parameter {} (or its gradient) lives in another arena than the one the "
                              "executor runs on; build the model inside an ArenaScope of that arena", name));
  }
}

Executor::~Executor() = default;

const Plan& Executor::plan(std::int64_t batch) {
  ArenaScope scope(arena_);
  std::optional<std::int64_t> fixed;
  if (opt_.micro_batch) fixed = std::min({*opt_.micro_batch, limit_, batch});
  return planner_.plan(batch, fixed, limit_);
}

double Executor::accumulate(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes) {
  const Tensor total = accumulate_loss(images, labels, sizes);
  return total.defined() && !is_dry_run() ? total.item() : 0.0;
}

Tensor Executor::accumulate_loss(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
                                 std::optional<double> given_divisor) {
  const bool dry = is_dry_run();
  if (!dry && (images == nullptr || labels == nullptr)) throw Error("MBP executor: no input data");
  std::int64_t batch = 0;
  for (std::int64_t n : sizes) {
    if (n < 1) throw Error(fmt::format("MBP executor: micro-batch sizes must be >= 1, found {}", n));
    batch += n;
  }
  if (sizes.empty()) throw Error("MBP executor: no micro-batches");
  // The whole batch's divisor (computed on the host before any micro-batch runs).
  double divisor = 1.0;
  if (given_divisor) {
    divisor = *given_divisor;
  } else if (!dry) {
    divisor = cross_entropy_divisor(labels, batch, opt_.loss);
    if (!(divisor > 0))
      throw Error(fmt::format("MBP executor: the batch of {} has no counted target (all ignore_index {} or zero "
                              "class weight), so its mean loss is undefined", batch, opt_.loss.ignore_index));
  }
  // BatchNorm layers add their micro-batch moments to moments_ instead of updating running stats.
  for (std::size_t i = 0; i < bns_.size(); ++i) {
    moments_[i] = BatchNormMoments{};
    bns_[i]->defer_running_stats(&moments_[i]);
  }
  struct Undefer {
    std::vector<nn::BatchNorm2d*>& bns;
    ~Undefer() {
      for (auto* b : bns) b->defer_running_stats(nullptr);
    }
  } undefer{bns_};

  // Pinned staging for the batch's samples (CUDA): grown when a larger batch comes.
  void* staging = nullptr;
#if TALLY_HAVE_CUDA
  if (device_.is_cuda() && !dry) {
    const std::size_t bytes = static_cast<std::size_t>(batch) * (static_cast<std::size_t>(sample_numel_) * sizeof(float) +
                                                                 sizeof(std::int64_t));
    if (staging_->buffer.size() < bytes) {
      staging_->buffer = kernels::cuda::PinnedBuffer();  // the last step's uploads are done: it synchronized
      staging_->buffer = kernels::cuda::PinnedBuffer(bytes);
    }
    staging = staging_->buffer.data();
  }
#endif

  EnableGradGuard grad_on;  // the step records its tape even if the caller is in a NoGradGuard
  // The arena in scope: arena_ in a real step, the planner's virtual clone of it in a dry run.
  const auto& arena = current_arena(device_);
  // The loss of the step, summed where it is computed: read once, after the optimizer step.
  Tensor total = Tensor::zeros({}, dtype_, device_, Category::temporary, "step_loss");
  const bool prefetch = device_.is_cuda();  // next inputs allocated and uploaded before the current micro-batch computes
  const auto k = sizes.size();
  std::int64_t offset = 0;
  bool targets_checked = false;
  Inputs next;
  if (prefetch) {
    next = allocate_inputs(sizes[0], opt_.sample_shape, dtype_, device_);
    fill_inputs(next, images, labels, 0, sizes[0], batch, sample_numel_, dtype_, device_, staging);
  }
  for (std::size_t i = 0; i < k; ++i) {
    arena->mark(fmt::format("micro-batch {}/{} ({} samples)", i + 1, k, sizes[i]));
    Inputs cur;
    if (prefetch) {
      cur = std::move(next);
      next = Inputs{};
      if (i + 1 < k) {
        next = allocate_inputs(sizes[i + 1], opt_.sample_shape, dtype_, device_);
        fill_inputs(next, images, labels, offset + sizes[i], sizes[i + 1], batch, sample_numel_, dtype_, device_, staging);
      }
    } else {
      cur = allocate_inputs(sizes[i], opt_.sample_shape, dtype_, device_);
      fill_inputs(cur, images, labels, offset, sizes[i], batch, sample_numel_, dtype_, device_, staging);
    }
    ready(cur);
    Tensor logits = model_(cur.x);
    if (!dry && !targets_checked) {  // every target of the batch, on the host, once the class count is known
      check_cross_entropy_targets(labels, batch, logits.size(1), opt_.loss.ignore_index);
      targets_checked = true;
    }
    CrossEntropyOptions co = opt_.loss;
    co.divisor = divisor;  // sum_i w_i loss_i / D: the full batch's mean, split
    if (opt_.normalization == LossNormalization::per_micro_batch && !dry) {
      // This micro-batch's own mean, divided by k: the mean of the micro-batch means.
      const double own = cross_entropy_divisor(labels + offset, sizes[i], opt_.loss);
      if (!(own > 0))
        throw Error(fmt::format("MBP executor: micro-batch {} of {} has no counted target, so its own mean loss "
                                "(per-micro-batch normalization) is undefined", i + 1, k));
      co.divisor = own * static_cast<double>(k);
    }
    co.targets_checked = !dry;
    Tensor loss = cross_entropy(logits, cur.y, co);
    logits = Tensor();
    loss.backward();
    add_into(total, loss);
    offset += sizes[i];
  }
  return total;
}

void Executor::run_step(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
                        double* loss) {
  Tensor total = accumulate_loss(images, labels, sizes, global_divisor_);
  if (distributed()) {
    const auto t0 = std::chrono::steady_clock::now();
    reduce_across_ranks(total);
    if (!is_dry_run())
      communication_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  current_arena(device_)->mark("optimizer step");
  if (!is_dry_run())
    for (std::size_t i = 0; i < bns_.size(); ++i) bns_[i]->apply_moments(moments_[i]);
  for (auto& m : moments_) m = BatchNormMoments{};
  NoGradGuard ng;
  optimizer_.step();
  optimizer_.zero_grad();
  // The step's one wait for the device: the loss value.
  if (loss) *loss = is_dry_run() ? 0.0 : total.item();
}

void Executor::reduce_across_ranks(Tensor& loss) {
  distributed::Communicator& comm = *opt_.communicator;
  const bool dry = is_dry_run();
  const auto& arena = current_arena(device_);
  arena->mark("all-reduce");
  // What is summed: every gradient, flattened, then the step's loss (one more element of the last
  // bucket); and the BatchNorm moments, float64.
  std::vector<Tensor> flat;
  std::int64_t n = 0;
  for (const Tensor& p : model_.parameters()) {
    flat.push_back(p.grad().view({-1}));
    n += flat.back().numel();
  }
  flat.push_back(loss.view({1}));
  n += 1;
  std::int64_t moment_count = 0;
  for (const auto& m : moments_)
    if (m.sum.defined()) moment_count += m.sum.numel() + m.sum_sq.numel();
  // Both buffers before the first collective (see step 6 in executor.h).
  const auto per_bucket = static_cast<std::int64_t>(opt_.bucket_bytes / dtype_size(dtype_));
  Tensor bucket = Tensor::empty({std::min(n, per_bucket)}, dtype_, device_, Category::temporary, "gradient_bucket");
  Tensor moments;
  if (moment_count > 0)
    moments = Tensor::empty({moment_count}, DType::Float64, device_, Category::temporary, "batch_norm_moments");

  // Gradients and loss: fill a bucket, sum it over the ranks, copy the sums back.
  std::vector<std::pair<Tensor, std::int64_t>> pieces;  // (a piece of a flat tensor, its offset in the bucket)
  std::int64_t used = 0;
  auto flush = [&] {
    Tensor filled = bucket.narrow(0, 0, used);
    comm.all_reduce_sum(filled);
    for (auto& [piece, at] : pieces) piece.copy_(bucket.narrow(0, at, piece.numel()));
    pieces.clear();
    used = 0;
  };
  for (const Tensor& t : flat) {
    for (std::int64_t start = 0; start < t.numel();) {
      const std::int64_t len = std::min(t.numel() - start, bucket.numel() - used);
      Tensor piece = t.narrow(0, start, len);
      bucket.narrow(0, used, len).copy_(piece);
      pieces.emplace_back(piece, used);
      used += len;
      start += len;
      if (used == bucket.numel()) flush();
    }
  }
  if (used > 0) flush();

  // BatchNorm moments: one buffer, one collective. The element count per channel scales with the
  // batch (every sample adds H*W), so the global count needs no collective.
  if (moments.defined()) {
    std::int64_t at = 0;
    auto each = [&](auto&& fn) {
      at = 0;
      for (auto& m : moments_) {
        if (!m.sum.defined()) continue;
        fn(m.sum);
        fn(m.sum_sq);
      }
    };
    each([&](Tensor& t) { moments.narrow(0, at, t.numel()).copy_(t), at += t.numel(); });
    comm.all_reduce_sum(moments);
    each([&](Tensor& t) { t.copy_(moments.narrow(0, at, t.numel())), at += t.numel(); });
  }
  if (!dry) {
    for (auto& m : moments_) {
      if (m.count == 0) continue;
      if (m.count % local_batch_ != 0)
        throw Error(fmt::format("MBP executor: BatchNorm saw {} values per channel for {} samples", m.count, local_batch_));
      m.count = m.count / local_batch_ * global_batch_;
    }
  }
}

void Executor::discard_partial_step() {
  optimizer_.zero_grad();
  for (auto& m : moments_) m = BatchNormMoments{};
  for (auto* b : bns_) b->defer_running_stats(nullptr);
}

StepResult Executor::step(const float* images, const std::int64_t* labels, std::int64_t batch) {
  if (images == nullptr || labels == nullptr) throw Error("MBP executor: step needs images and labels");
  ArenaScope scope(arena_);
  StepResult r;
  global_divisor_.reset();
  communication_seconds_ = 0;
  if (distributed()) {
    const auto t0 = std::chrono::steady_clock::now();
    // D and the batch size over every rank, before any micro-batch (and outside the retry loop:
    // a retry on this rank must not repeat a collective the others do not).
    double sums[2] = {cross_entropy_divisor(labels, batch, opt_.loss), static_cast<double>(batch)};
    opt_.communicator->all_reduce_sum(sums, 2);
    if (!(sums[0] > 0))
      throw Error(fmt::format("MBP executor: the global batch of {} has no counted target (all ignore_index {} or "
                              "zero class weight), so its mean loss is undefined", sums[1], opt_.loss.ignore_index));
    global_divisor_ = sums[0];
    local_batch_ = batch;
    global_batch_ = static_cast<std::int64_t>(sums[1]);
    communication_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  for (;;) {
    const Plan& p = plan(batch);
    arena_->reset_peak();
    try {
      run_step(images, labels, p.sizes, &r.loss);
      r.micro_batch = p.micro_batch;
      r.micro_batches = p.micro_batches;
      r.predicted_peak = p.predicted_peak;
      r.peak = static_cast<std::size_t>(arena_->stats().total.peak);
      r.communication_seconds = communication_seconds_;
      return r;
    } catch (const OutOfMemory& e) {
      discard_partial_step();
      if (p.micro_batch == 1 || r.oom_retries >= opt_.max_oom_retries)
        throw OutOfMemory(fmt::format("training step of batch {} ran out of memory with micro-batches of {} after {} "
                                      "retries; nothing was updated. {}", batch, p.micro_batch, r.oom_retries, e.what()),
                          e.requested());
      limit_ = std::max<std::int64_t>(1, p.micro_batch / 2);
      ++r.oom_retries;
      ++total_retries_;
      if (opt_.log)
        opt_.log(fmt::format("out of memory during a step with micro-batches of {} ({}); step discarded "
                             "(gradients zeroed, parameters and statistics untouched), retrying with at most {}",
                             p.micro_batch, e.what(), limit_));
    } catch (...) {
      discard_partial_step();
      throw;
    }
  }
}

}  // namespace tally::mbp
