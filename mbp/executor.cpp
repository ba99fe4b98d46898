// mbp/executor.cpp — micro-batch execution with exact loss normalization; see mbp/executor.h.
#include "mbp/executor.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/cuda_runtime.h"
#include "core/memory.h"

namespace tally::mbp {

namespace {

// The input tensors of one micro-batch (category input), filled from host data unless this is a
// dry run. Images arrive as float32 and are converted to the model's dtype on the host.
struct Inputs {
  Tensor x, y;
};

Inputs upload(const float* images, const std::int64_t* labels, std::int64_t offset, std::int64_t n,
              const Shape& sample_shape, std::int64_t sample_numel, DType dtype, Device device) {
  Shape xs{n};
  xs.insert(xs.end(), sample_shape.begin(), sample_shape.end());
  Inputs in{Tensor::empty(xs, dtype, device, Category::input, "input"),
            Tensor::empty({n}, DType::Int64, device, Category::input, "labels")};
  if (is_dry_run()) return in;
  const float* src = images + offset * sample_numel;
  const std::size_t count = static_cast<std::size_t>(n * sample_numel);
  const std::int64_t* lab = labels + offset;
  if (device.is_cpu()) {
    if (dtype == DType::Float32) std::copy(src, src + count, in.x.data<float>());
    else std::copy(src, src + count, in.x.data<double>());
    std::copy(lab, lab + n, in.y.data<std::int64_t>());
  } else {
    if (dtype != DType::Float32)
      throw Error(fmt::format("MBP executor: inputs on {} must be float32, the model is {}", device.str(), dtype_name(dtype)));
    cuda_rt::memcpy_h2d(in.x.raw_data(), src, count * sizeof(float));
    cuda_rt::memcpy_h2d(in.y.raw_data(), lab, static_cast<std::size_t>(n) * sizeof(std::int64_t));
  }
  return in;
}

Tensor first_parameter(const nn::Module& m) {
  const auto ps = m.parameters();
  if (ps.empty()) throw Error("MBP executor: the model has no parameters");
  return ps.front();
}

}  // namespace

Executor::Executor(nn::Module& model, optim::Optimizer& optimizer, ExecutorOptions options)
    : model_(model),
      optimizer_(optimizer),
      opt_(std::move(options)),
      device_(first_parameter(model).device()),
      dtype_(first_parameter(model).dtype()),
      arena_(current_arena(device_)),
      planner_(arena_, [this](const std::vector<std::int64_t>& sizes) { run_step(nullptr, nullptr, sizes, nullptr); }),
      bns_(nn::batch_norm_layers(model)),
      moments_(bns_.size()) {
  if (opt_.sample_shape.empty())
    throw Error("MBP executor: the sample shape is empty (expected e.g. {3, 32, 32})");
  for (std::int64_t d : opt_.sample_shape) {
    if (d < 1) throw Error(fmt::format("MBP executor: sample shape dimensions must be >= 1, found {}", shape_str(opt_.sample_shape)));
    sample_numel_ *= d;
  }
  if (opt_.micro_batch && *opt_.micro_batch < 1)
    throw Error(fmt::format("--micro-batch must be >= 1, found {}", *opt_.micro_batch));
  if (opt_.max_oom_retries < 0) throw Error("MBP executor: max_oom_retries must be >= 0");
  for (const Tensor& p : model.parameters())
    if (!p.grad().defined())
      throw Error(fmt::format("MBP executor: parameter {} has no gradient buffer; the planner counts gradients, so "
                              "they must exist before planning (Module::zero_grad allocates them)", p.str()));
}

const Plan& Executor::plan(std::int64_t batch) {
  ArenaScope scope(arena_);
  std::optional<std::int64_t> fixed;
  if (opt_.micro_batch) fixed = std::min({*opt_.micro_batch, limit_, batch});
  return planner_.plan(batch, fixed, limit_);
}

double Executor::accumulate(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes) {
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
  if (!dry) {
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

  EnableGradGuard grad_on;  // the step records its tape even if the caller is in a NoGradGuard
  const auto& arena = current_arena(device_);
  const bool prefetch = device_.is_cuda();  // next inputs allocated before the current micro-batch computes
  const auto k = sizes.size();
  double total = 0;
  std::int64_t offset = 0;
  Inputs next;
  if (prefetch) next = upload(images, labels, 0, sizes[0], opt_.sample_shape, sample_numel_, dtype_, device_);
  for (std::size_t i = 0; i < k; ++i) {
    arena->mark(fmt::format("micro-batch {}/{} ({} samples)", i + 1, k, sizes[i]));
    Inputs cur;
    if (prefetch) {
      cur = std::move(next);
      next = Inputs{};
      if (i + 1 < k)
        next = upload(images, labels, offset + sizes[i], sizes[i + 1], opt_.sample_shape, sample_numel_, dtype_, device_);
    } else {
      cur = upload(images, labels, offset, sizes[i], opt_.sample_shape, sample_numel_, dtype_, device_);
    }
    CrossEntropyOptions co = opt_.loss;
    co.divisor = divisor;  // sum_i w_i loss_i / D: the full batch's mean, split
    Tensor loss = cross_entropy(model_(cur.x), cur.y, co);
    loss.backward();
    if (!dry) total += loss.item();
    offset += sizes[i];
  }
  return total;
}

void Executor::run_step(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
                        double* loss) {
  const double l = accumulate(images, labels, sizes);
  if (loss) *loss = l;
  current_arena(device_)->mark("optimizer step");
  if (!is_dry_run())
    for (std::size_t i = 0; i < bns_.size(); ++i) bns_[i]->apply_moments(moments_[i]);
  NoGradGuard ng;
  optimizer_.step();
  optimizer_.zero_grad();
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
  for (;;) {
    const Plan& p = plan(batch);
    arena_->reset_peak();
    try {
      run_step(images, labels, p.sizes, &r.loss);
      r.micro_batch = p.micro_batch;
      r.micro_batches = p.micro_batches;
      r.predicted_peak = p.predicted_peak;
      r.peak = static_cast<std::size_t>(arena_->stats().total.peak);
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
