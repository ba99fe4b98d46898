// mbp/executor.cpp — micro-batch execution with exact loss normalization; see mbp/executor.h.
#include "mbp/executor.h"
#include "mbp/host_gradients.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <utility>

#include <fmt/ranges.h>

#include <fmt/format.h>

#include "core/autograd.h"
#include "core/conv_tuning.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/option_names.h"
#include "mbp/data_parallel.h"
#include "mbp/stage_runner.h"
#include "mbp/step_inputs.h"

namespace tally::mbp {

namespace detail {

// n samples of `sample` shape: {n, sample...}.
Shape batch_shape(std::int64_t n, const Shape& sample) {
  Shape shape{n};
  shape.insert(shape.end(), sample.begin(), sample.end());
  return shape;
}

// The sum of the micro-batch sizes, each checked (>= 1, at least one).
std::int64_t checked_batch(const std::vector<std::int64_t>& sizes) {
  if (sizes.empty()) throw Error("MBP executor: no micro-batches");
  std::int64_t batch = 0;
  for (std::int64_t n : sizes) {
    if (n < 1) throw Error(fmt::format("MBP executor: micro-batch sizes must be >= 1, found {}", n));
    batch += n;
  }
  return batch;
}

// The loss divisor D of a whole batch, counted on the host; an Error when it counts no target.
double batch_divisor(const std::int64_t* labels, std::int64_t batch, const CrossEntropyOptions& loss) {
  const double divisor = cross_entropy_divisor(labels, batch, loss);
  if (!(divisor > 0))
    throw Error(fmt::format("MBP executor: the batch of {} has no counted target (all ignore_index {} or zero class "
                            "weight), so its mean loss is undefined", batch, loss.ignore_index));
  return divisor;
}

// The bytes of staging `n` samples take: their images, then their labels.
std::size_t staging_bytes(std::int64_t n, std::int64_t sample_numel, DType dtype) {
  return static_cast<std::size_t>(n) *
         (static_cast<std::size_t>(sample_numel) * dtype_size(dtype) + sizeof(std::int64_t));
}

void reserve_staging(InputStager& stager, const std::vector<std::int64_t>& sizes, std::int64_t sample_numel,
                     DType dtype) {
  std::int64_t largest = 0, batch = 0;
  for (std::int64_t n : sizes) largest = std::max(largest, n), batch += n;
  stager.reserve(staging_bytes(largest, sample_numel, dtype), staging_bytes(batch, sample_numel, dtype));
}

// Stages images [offset, offset + n) of the host batch into `x` (float images converted to x's
// dtype, the activations', on their way into the staging, by the host's threads); returns the
// upload's ticket.
std::size_t stage_images(Tensor& x, InputStager& stager, const float* images, std::int64_t offset, std::int64_t n,
                         std::int64_t sample_numel, std::size_t after) {
  const float* src = images + offset * sample_numel;
  return stager.stage_floats(x, src, static_cast<std::size_t>(n * sample_numel), after);
}

// The labels [offset, offset + n) into `y`.
std::size_t stage_labels(Tensor& y, InputStager& stager, const std::int64_t* labels, std::int64_t offset,
                         std::int64_t n, std::size_t after) {
  return stager.stage(y, labels + offset, static_cast<std::size_t>(n) * sizeof(std::int64_t), after);
}

}  // namespace detail

namespace {

using namespace detail;

// The parts of the step under way, for its duration (Executor::step_parts_).
struct ActiveParts {
  std::vector<StepPart*>& slot;
  std::vector<StepPart*> previous;
  ActiveParts(std::vector<StepPart*>& s, std::vector<StepPart*> parts) : slot(s), previous(std::exchange(s, std::move(parts))) {}
  ~ActiveParts() { slot = std::move(previous); }
  ActiveParts(const ActiveParts&) = delete;
  ActiveParts& operator=(const ActiveParts&) = delete;
};

// The input tensors of one micro-batch (category input), in the arena — blocks of their own, or
// views of an input slot (`slot`, else -1) — and the ticket of their upload (core/staging.h: the
// device waits for it before the forward).
struct Inputs {
  Tensor x, y;
  std::size_t uploaded = 0;
  int slot = -1;
};

Inputs allocate_inputs(std::int64_t n, const Shape& sample_shape, DType dtype, Device device) {
  Inputs in;
  in.x = Tensor::empty(batch_shape(n, sample_shape), dtype, device, Category::input, "input");
  in.y = Tensor::empty({n}, DType::Int64, device, Category::input, "labels");
  return in;
}

// Both, for one micro-batch of the whole model; `after`: the fence the uploads wait for
// (InputStager::stage).
void fill_inputs(Inputs& in, InputStager& stager, const float* images, const std::int64_t* labels, std::int64_t offset,
                 std::int64_t n, std::int64_t sample_numel, std::size_t after = 0) {
  if (skip_side_effects()) return;
  stage_images(in.x, stager, images, offset, n, sample_numel, after);
  in.uploaded = stage_labels(in.y, stager, labels, offset, n, after);
}

// The inputs of a step's micro-batches, taken in order: with input slots (a GPU's), views of them,
// the next micro-batch's staged before the current one computes, after the fence of the work that
// last read its slot, and a fence recorded for the current one's slot when its work is enqueued
// (done); else blocks of their own, staged when taken. take() returns them uploaded, as far as the
// device's compute goes.
class MicroBatchInputs {
 public:
  MicroBatchInputs(InputStager& stager, InputSlots* slots, const float* images, const std::int64_t* labels,
                   const std::vector<std::int64_t>& sizes, const Shape& sample_shape, DType dtype, Device device)
      : stager_(stager), slots_(slots), images_(images), labels_(labels), sizes_(sizes), sample_shape_(sample_shape),
        sample_numel_(shape_numel(sample_shape)), dtype_(dtype), device_(device) {}
  Inputs take(std::size_t i, std::int64_t offset) {
    Inputs cur;
    if (slots_) {
      cur = i == 0 ? from_slot(0, sizes_[0]) : std::move(next_);
      next_ = i + 1 < sizes_.size() ? from_slot(offset + sizes_[i], sizes_[i + 1]) : Inputs{};
    } else {
      cur = allocate_inputs(sizes_[i], sample_shape_, dtype_, device_);
      fill_inputs(cur, stager_, images_, labels_, offset, sizes_[i], sample_numel_);
    }
    if (!skip_side_effects()) stager_.wait(cur.uploaded);
    return cur;
  }
  void done(const Inputs& cur) {
    if (cur.slot >= 0 && !skip_side_effects()) slots_->ready[cur.slot] = stager_.fence();
  }

 private:
  Inputs from_slot(std::int64_t at, std::int64_t n) {
    const int s = slots_->next;
    slots_->next ^= 1;
    Inputs in{slots_->x[s].narrow(0, 0, n), slots_->y[s].narrow(0, 0, n), 0, s};
    fill_inputs(in, stager_, images_, labels_, at, n, sample_numel_, slots_->ready[s]);
    return in;
  }
  InputStager& stager_;
  InputSlots* slots_;
  const float* images_;
  const std::int64_t* labels_;
  const std::vector<std::int64_t>& sizes_;
  const Shape& sample_shape_;
  std::int64_t sample_numel_;
  DType dtype_;
  Device device_;
  Inputs next_;
};

// A step that ends on an exception (an out-of-memory retry, a failed recording) may leave uploads
// on the copy stream writing input blocks that are freed next (the retry's new plan makes its input
// slots again), or an offloaded segment's copies back into blocks its unwinding frees: the compute
// stream waits for everything on the copy stream first, so the work that takes those blocks again
// comes after them. And the other way round: the micro-batch that threw may have
// enqueued work reading its slot without recording its fence (done), so the slots' fences are
// forgotten — the next upload into either slot waits for all the compute work enqueued before it.
class UploadsEndFirst {
 public:
  UploadsEndFirst(InputStager& stager, InputSlots* slots, bool dry) : stager_(stager), slots_(slots), dry_(dry) {}
  ~UploadsEndFirst() {
    if (dry_ || std::uncaught_exceptions() == exceptions_) return;
    if (slots_) slots_->ready[0] = slots_->ready[1] = 0;
    try {
      stager_.wait_all();
    } catch (...) {  // the exception under way says what failed
    }
  }
  UploadsEndFirst(const UploadsEndFirst&) = delete;
  UploadsEndFirst& operator=(const UploadsEndFirst&) = delete;

 private:
  InputStager& stager_;
  InputSlots* slots_;
  bool dry_;
  int exceptions_ = std::uncaught_exceptions();
};

// Data parallelism: any communicator but the local one (an MPI or NCCL world of one too); a
// pipeline stage's communicator carries its messages instead.
bool is_data_parallel(const ExecutorOptions& o) {
  return !o.pipeline && o.communicator && o.communicator->backend() != "local";
}

const std::shared_ptr<Arena>& checked_arena(const std::shared_ptr<Arena>& arena) {
  if (!arena) throw Error("MBP executor: expected an arena to run on, found none");
  return arena;
}

Tensor first_parameter(const nn::Module& m) {
  const auto ps = m.parameters();
  if (ps.empty()) throw Error("MBP executor: the model has no parameters");
  return ps.front();
}

}  // namespace

const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names{"fp32", "bf16"};
  return names;
}
const std::vector<std::string>& memory_format_names() {
  static const std::vector<std::string> names{"auto", "contiguous", "channels_last"};
  return names;
}
MemoryFormat parse_memory_format(const std::string& name, Device device, bool pipeline, bool tensor_cores) {
  if (name == "auto") return pipeline ? MemoryFormat::Contiguous : preferred_memory_format(device, tensor_cores);
  if (name == "contiguous") return MemoryFormat::Contiguous;
  if (name == "channels_last") return MemoryFormat::ChannelsLast;
  throw Error(fmt::format("{} '{}': expected {}", option_name(Option::memory_format), name,
                          fmt::join(memory_format_names(), "|")));
}
const char* precision_name(Precision p) { return p == Precision::bf16 ? "bf16" : "fp32"; }
const char* placement_name(Placement p) {  // (mbp/chooser.h)
  switch (p) {
    case Placement::device: return "device";
    case Placement::optimizer: return "optimizer";
    case Placement::gradients: return "gradients";
  }
  return "?";
}
Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::fp32;
  if (name == "bf16") return Precision::bf16;
  throw Error(fmt::format("{} '{}': expected {}", option_name(Option::precision), name,
                          fmt::join(precision_names(), "|")));
}

Executor::Executor(nn::Module& model, optim::Optimizer& optimizer, ExecutorOptions options)
    : Executor(model, optimizer, first_parameter(model).storage()->arena(), std::move(options)) {}

Executor::Executor(nn::Module& model, optim::Optimizer& optimizer, std::shared_ptr<Arena> arena,
                   ExecutorOptions options)
    : model_(model),
      optimizer_(optimizer),
      opt_(std::move(options)),
      // A pipeline stage's device is its budget's: the model's other stages may live on the host.
      device_(opt_.pipeline && arena ? arena->device() : first_parameter(model).device()),
      dtype_(first_parameter(model).dtype()),
      activation_dtype_(opt_.precision == Precision::bf16 ? DType::BFloat16 : dtype_),
      arena_(std::move(arena)),
      states_(nn::step_states(model)),
      stager_(std::make_unique<InputStager>(device_)),
      chooser_(model, optimizer, checked_arena(arena_), opt_, is_data_parallel(opt_), activation_dtype_,
               [this](Placement placement, const std::vector<std::int64_t>& sizes) {
                 run_step(placement, nullptr, nullptr, sizes, nullptr);
               }) {
  if (opt_.sample_shape.empty())
    throw Error("MBP executor: the sample shape is empty (expected e.g. {3, 32, 32})");
  if (const std::string e = sample_shape_error(opt_.sample_shape); !e.empty())
    throw Error(fmt::format("MBP executor: ExecutorOptions::sample_shape {}: {}", shape_str(opt_.sample_shape), e));
  sample_numel_ = shape_numel(opt_.sample_shape);
  if (opt_.micro_batch && *opt_.micro_batch < 1)
    throw Error(fmt::format("MBP executor: the micro-batch size must be >= 1, found {}", *opt_.micro_batch));
  if (opt_.max_oom_retries < 0) throw Error("MBP executor: max_oom_retries must be >= 0");
  // The trained parameters by their impl: the parts' hooks name them (gradient_ready, gradient_slot).
  for (const Tensor& p : model_.parameters()) trained_.emplace(p.impl_ptr().get(), p);
  if (!arena_) throw Error("MBP executor: expected an arena to run on, found none");
  if (opt_.memory_format == MemoryFormat::ChannelsLast && opt_.sample_shape.size() != 3)
    throw Error(fmt::format("MBP executor: channels_last is a layout of images (C, H, W); the sample shape is {}",
                            shape_str(opt_.sample_shape)));
  if (opt_.precision == Precision::bf16 && dtype_ != DType::Float32)
    throw Error(fmt::format("MBP executor: bf16 mixed precision keeps float32 master weights; the model is {}",
                            dtype_name(dtype_)));
  // Data parallelism: any communicator but the local one (an MPI or NCCL world of one too); a
  // pipeline stage's communicator carries its messages instead.
  const bool data_parallel = is_data_parallel(opt_);
  if (data_parallel) {
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
  if (opt_.host_arena && !opt_.host_arena->device().is_cpu())
    throw Error(fmt::format("MBP executor: the host tier's arena must be host memory (cpu), found one on {}",
                            opt_.host_arena->device().str()));
  if (opt_.host_arena && opt_.host_arena == arena_)
    throw Error("MBP executor: the host tier's arena must be an arena of its own, not the device's");
  if (opt_.placement && *opt_.placement != Placement::device && !opt_.host_arena)
    throw Error(fmt::format("MBP executor: placement {} needs a host tier ({}), found none",
                            placement_name(*opt_.placement), option_name(Option::host_tier)));
  if (data_parallel && opt_.placement == Placement::gradients)
    throw Error("MBP executor: placement gradients is not available with data parallelism (the gradients' all-reduce "
                "sums device buffers); placement optimizer is");
  // The passes' tuning levels are a run's own (core/conv_tuning.h): a sweep's next run starts anew.
  if (opt_.conv_tuning) opt_.conv_tuning->unpin_all();
  if (opt_.pipeline) {  // the stage's own loop, parameters and step states
    if (!opt_.communicator) opt_.communicator = distributed::local();
    stage_ = std::make_unique<StageRunner>(model, opt_, arena_, activation_dtype_, *stager_, chooser_);
    states_ = stage_->step_states();
    check_trained(model, stage_->trained());
    return;
  }
  if (data_parallel)
    parts_.push_back(std::make_unique<DataParallel>(opt_.communicator, model.parameters(), states_, opt_.bucket_bytes,
                                                    opt_.loss));
  check_trained(model, model.parameters());
}

void Executor::check_trained(const nn::Module& model, const std::vector<Tensor>& trained) const {
  if (trained.empty()) throw Error("MBP executor: the model (or its pipeline stage) has no parameters");
  for (const auto& [name, p] : model.named_parameters()) {
    const TensorImpl* impl = &p.impl();  // (clang 16 cannot capture a structured binding)
    if (std::none_of(trained.begin(), trained.end(), [impl](const Tensor& t) { return &t.impl() == impl; }))
      continue;  // another stage's
    if (!p.grad().defined())
      throw Error(fmt::format("MBP executor: parameter {} has no gradient buffer; the planner counts gradients, so "
                              "they must exist before planning (Module::zero_grad allocates them)", name));
    if (p.storage()->arena() != arena_ || p.grad().storage()->arena() != arena_)
      throw Error(fmt::format("MBP executor: parameter {} (or its gradient) lives in another arena than the one the "
                              "executor runs on; build the model inside an ArenaScope of that arena", name));
  }
}

Executor::~Executor() = default;

// The parts of a step under `placement`: the executor's, and the placement's — the real one in a
// real step; in a dry run one that simulates it (kept in `simulated`), so that measuring a
// placement touches no real state.
std::vector<StepPart*> Executor::parts_for(Placement placement, std::unique_ptr<HostGradients>& simulated) const {
  std::vector<StepPart*> parts;
  for (const auto& part : parts_) parts.push_back(part.get());
  if (placement != Placement::gradients) {
    if (skip_side_effects() && placed_ == Placement::gradients) {  // measured while the gradients are on the host
      simulated = HostGradients::standing_in(optimizer_.params());
      parts.push_back(simulated.get());
    }
    return parts;
  }
  if (skip_side_effects()) {
    simulated = HostGradients::simulated(optimizer_.params());
    parts.push_back(simulated.get());
  } else {
    if (!host_gradients_) throw Error("MBP executor: a real step with placement gradients before it was applied");
    parts.push_back(host_gradients_.get());
  }
  return parts;
}


double Executor::accumulate(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes) {
  std::unique_ptr<HostGradients> simulated;
  const ActiveParts active(step_parts_, parts_for(placed_, simulated));
  const Tensor total = accumulate_loss(images, labels, sizes);
  for (nn::StepState* s : states_) s->discard();  // no optimizer step follows: nothing to apply
  return total.defined() && !skip_side_effects() ? total.item() : 0.0;
}

Tensor Executor::accumulate_loss(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
                                 std::optional<double> given_divisor) {
  const bool dry = skip_side_effects();
  if (!dry && (images == nullptr || labels == nullptr)) throw Error("MBP executor: no input data");
  const std::int64_t batch = checked_batch(sizes);
  // The whole batch's divisor (computed on the host before any micro-batch runs).
  double divisor = 1.0;
  if (given_divisor) {
    divisor = *given_divisor;
  } else if (!dry) {
    divisor = batch_divisor(labels, batch, opt_.loss);
  }
  // State across micro-batches (BatchNorm's moments) gathers from here; run_step applies it.
  for (nn::StepState* s : states_) s->begin_step();

  if (!dry) reserve_staging(*stager_, sizes, sample_numel_, activation_dtype_);
  // On a GPU the inputs go through the input slots (executor.h), the next micro-batch's uploaded
  // before the current one computes; on the CPU each micro-batch's are copied into blocks of their own.
  InputSlots local;
  InputSlots* const slots = step_slots(sizes, local);
  MicroBatchInputs inputs(*stager_, slots, images, labels, sizes, opt_.sample_shape, activation_dtype_, device_);

  EnableGradGuard grad_on;  // the step records its tape even if the caller is in a NoGradGuard
  // The loss of the step, summed where it is computed: read once, after the optimizer step.
  Tensor total = Tensor::zeros({}, dtype_, device_, Category::temporary, "step_loss");
  const GradientReadyHook gradient_ready = gradient_ready_hook();
  const GradientSlotHook gradient_slot = gradient_slot_hook();
  const auto k = sizes.size();
  std::int64_t offset = 0;
  bool targets_checked = false;
  const UploadsEndFirst uploads_end_first(*stager_, slots, dry);
  for (std::size_t i = 0; i < k; ++i) {
    mark_trace(device_, fmt::format("micro-batch {}/{} ({} samples)", i + 1, k, sizes[i]));
    Inputs cur = inputs.take(i, offset);
    // A slot is in the step's format already; a row-major input of its own is freed when converted.
    cur.x = cur.x.contiguous(opt_.memory_format);
    const CrossEntropyOptions co = micro_batch_loss(labels, offset, sizes[i], i, k, divisor);
    // The micro-batch's forward and backward: all device work, recorded and replayed where it may be.
    const auto compute = [&] {
      // The micro-batch's samples in the step's whole batch (dropout's masks; its backward and a
      // recomputed segment draw the same).
      const SampleScope samples({static_cast<std::uint64_t>(optimizer_.steps()), opt_.first_sample + offset});
      Tensor logits = model_(cur.x);
      if (!dry && !targets_checked) {  // every target of the batch, on the host, once the class count is known
        check_cross_entropy_targets(labels, batch, logits.size(1), opt_.loss.ignore_index);
        targets_checked = true;
      }
      Tensor loss = cross_entropy(logits, cur.y, co);
      logits = Tensor();
      backward_watched(loss, gradient_ready, gradient_slot);
      add_into(total, loss);
    };
    if (graphs_for(i)) kernels_for_graphs();
    if (graphs_for(i) && warmed_sizes_.count(sizes[i])) {
      run_graphed({arena_->layout_hash(), sizes[i], co.divisor.value_or(0.0), cur.x.raw_data(), cur.y.raw_data(),
                   total.raw_data()},
                  compute);
    } else {
      compute();
      if (opt_.cuda_graphs && !dry) warmed_sizes_.insert(sizes[i]);
    }
    inputs.done(cur);  // its slot read by the work enqueued so far
    for (StepPart* part : step_parts_) part->after_micro_batch(i, k);
    offset += sizes[i];
  }
  return total;
}

Executor::InputSlots* Executor::step_slots(const std::vector<std::int64_t>& sizes, InputSlots& local) {
  // Not where a segment is offloaded: the first one's input moves to the host tier with its
  // activations (core/offload.h), which a slot that outlives the step must not.
  const bool slots = (stager_->overlaps() || opt_.input_slots_on_cpu) && !nn::recompute_state(model_).offloads();
  const std::int64_t need = slots ? *std::max_element(sizes.begin(), sizes.end()) : 0;
  const bool dry = skip_side_effects();
  if (slots_.capacity == need) {
    if (need == 0) return nullptr;
    if (!dry) return &slots_;
    local = slots_;  // the same blocks, in the virtual clone too; the real turns and fences untouched
    local.ready[0] = local.ready[1] = 0;
    return &local;
  }
  if (slots_.capacity != 0) {  // the old slots go first, x then y of each (one order in both runs)
    if (dry) {
      for (int s = 0; s < 2; ++s) free_in_dry_run(slots_.x[s]), free_in_dry_run(slots_.y[s]);
    } else {
      for (int s = 0; s < 2; ++s) slots_.x[s] = Tensor(), slots_.y[s] = Tensor();
      slots_.capacity = 0;
    }
  }
  if (need == 0) return nullptr;
  // Made whole or not at all: an out-of-memory on the third block frees the first two (its
  // unwinding) rather than leaving them in slots_ with no capacity, which the next plan's dry runs
  // would not see.
  InputSlots made;
  for (int s = 0; s < 2; ++s) {
    made.x[s] = Tensor::empty(batch_shape(need, opt_.sample_shape), activation_dtype_, device_, Category::input,
                              "input", opt_.memory_format);  // staged in the step's format: nothing converts it
    made.y[s] = Tensor::empty({need}, DType::Int64, device_, Category::input, "labels");
  }
  made.capacity = need;
  InputSlots& kept = dry ? local : slots_;
  kept = std::move(made);
  return &kept;
}

StateLayout Executor::layout() const {
  if (slots_.capacity == 0) return {placed_, layout_};
  return {placed_, fmt::format("{}|inputs {}@{}", layout_, slots_.capacity, slots_.x[0].storage()->offset())};
}

CrossEntropyOptions Executor::micro_batch_loss(const std::int64_t* labels, std::int64_t offset, std::int64_t n,
                                              std::size_t i, std::size_t k, double divisor) const {
  const bool dry = skip_side_effects();
  CrossEntropyOptions co = opt_.loss;
  co.divisor = divisor;  // sum_i w_i loss_i / D: the full batch's mean, split
  if (opt_.normalization == LossNormalization::per_micro_batch && !dry) {
    // This micro-batch's own mean, divided by k: the mean of the micro-batch means.
    const double own = cross_entropy_divisor(labels + offset, n, opt_.loss);
    if (!(own > 0))
      throw Error(fmt::format("MBP executor: micro-batch {} of {} has no counted target, so its own mean loss "
                              "(per-micro-batch normalization) is undefined", i + 1, k));
    co.divisor = own * static_cast<double>(k);
  }
  co.targets_checked = !dry;
  return co;
}

namespace {
// A micro-batch's recording failed (a call CUDA does not allow in a capture): its work was not done,
// so the step is run again from its start, without graphs (Executor::run).
struct RecordingFailed : Error {
  using Error::Error;
};
}  // namespace

bool Executor::graphs_for(std::size_t index) const {
  // After the step's first micro-batch (it allocates the step's moments: the layout differs after
  // it) and its targets' check; alone with the model's own ops (no part, no offload, no trace).
  return opt_.cuda_graphs && graph_stats_.failed.empty() && device_.is_cuda() && index > 0 && !skip_side_effects() &&
         step_parts_.empty() && !stage_ && placed_ == Placement::device && !config_.segments.offloads() &&
         !arena_->tracing();
}

void Executor::drop_graphs() {
  graphs_.clear();
  unreplayable_.clear();
  warmed_sizes_.clear();
  graph_stats_.graphs = graph_stats_.nodes = graph_stats_.device_bytes = 0;
}

void Executor::kernels_for_graphs() {
  const std::pair<std::uint64_t, std::uint64_t> now = kernel_choices();
  if (graph_kernels_ && *graph_kernels_ != now) drop_graphs();
  graph_kernels_ = now;
}

void Executor::run_graphed(const GraphKey& key, const std::function<void()>& compute) {
  if (const auto it = graphs_.find(key); it != graphs_.end()) {
    if (arena_->fault_within(it->second.allocations())) {  // an injected fault comes where a run has it
      compute();
      return;
    }
    it->second.replay();
    ++graph_stats_.replayed;
    return;
  }
  if (unreplayable_.count(key)) {
    compute();
    return;
  }
  if (graphs_.size() + unreplayable_.size() >= kMaxGraphs) {
    if (graph_stats_.over_cap++ == 0 && opt_.log)
      opt_.log(fmt::format("cuda graphs: {} recordings kept for this plan; micro-batches of other keys (a loss "
                           "divisor that changes from step to step?) run without", kMaxGraphs));
    compute();
    return;
  }
  DeviceGraph g;
  try {
    g = record_device_work(device_, *arena_, compute);  // runs the micro-batch
  } catch (const OutOfMemory&) {
    throw;  // the step's own retry (run)
  } catch (const Error& e) {
    graph_stats_.failed = e.what();  // graphs are off for the rest of the run, and their memory freed
    drop_graphs();
    throw RecordingFailed(e.what());
  }
  ++graph_stats_.recorded;
  if (!g.replayable()) {  // its executable goes at once
    ++graph_stats_.unreplayable;
    unreplayable_.insert(key);
    if (opt_.log && graph_stats_.unreplayable == 1)
      opt_.log(fmt::format("cuda graphs: a micro-batch cannot be replayed ({}); such micro-batches run without",
                           g.why_not()));
    return;
  }
  graph_stats_.nodes += g.nodes();
  graph_stats_.device_bytes += g.device_bytes();
  graph_stats_.graphs = graphs_.size() + 1;
  graphs_.emplace(key, std::move(g));
}

void Executor::run_step(Placement placement, const float* images, const std::int64_t* labels,
                        const std::vector<std::int64_t>& sizes, PendingScalar* loss) {
  struct EndStep {  // a step that fails leaves no state gathering (after apply(), a no-op)
    const std::vector<nn::StepState*>& states;
    ~EndStep() {
      for (nn::StepState* s : states) s->discard();
    }
  } end_step{states_};
  std::unique_ptr<HostGradients> simulated;
  const ActiveParts active(step_parts_, parts_for(placement, simulated));
  Tensor total;
  if (stage_) {
    total = stage_->run(images, labels, sizes, static_cast<std::uint64_t>(optimizer_.steps()));
  } else {
    std::optional<double> divisor;  // counted by a part (over every rank), else over this batch
    for (StepPart* part : step_parts_)
      if (const auto d = part->divisor()) divisor = d;
    total = accumulate_loss(images, labels, sizes, divisor);
  }
  for (StepPart* part : step_parts_) part->before_optimizer_step(total);
  mark_trace(device_, "optimizer step");
  for (nn::StepState* s : states_) s->apply();
  NoGradGuard ng;
  if (skip_side_effects()) optimizer_.dry_step({placement != Placement::device, placement == Placement::gradients});
  else optimizer_.step();
  optimizer_.zero_grad();
  // The loss value (a pipeline's: on its last stage), read without waiting: step() then waits for
  // it, the step's one wait for the device; step_enqueued() leaves that to its caller.
  if (loss) *loss = skip_side_effects() || !total.defined() ? PendingScalar(0.0) : PendingScalar::read(total);
}

// The parts that want each parameter's gradient as it completes, told through the engine's hook
// (none: no hook, and the engine counts nothing).
GradientReadyHook Executor::gradient_ready_hook() const {
  if (std::none_of(step_parts_.begin(), step_parts_.end(), [](StepPart* p) { return p->wants_gradient_ready(); }))
    return {};
  return [this](TensorImpl* leaf) {
    const auto it = trained_.find(leaf);
    if (it == trained_.end()) return;  // not a parameter (an input that requires grad)
    for (StepPart* part : step_parts_)
      if (part->wants_gradient_ready()) part->gradient_ready(it->second);
  };
}

GradientSlotHook Executor::gradient_slot_hook() const {
  if (std::none_of(step_parts_.begin(), step_parts_.end(), [](StepPart* p) { return p->wants_gradient_slot(); }))
    return {};
  return [this](TensorImpl* leaf) -> std::shared_ptr<TensorImpl>* {
    const auto it = trained_.find(leaf);
    if (it == trained_.end()) return nullptr;
    for (StepPart* part : step_parts_)
      if (part->wants_gradient_slot())
        if (std::shared_ptr<TensorImpl>* slot = part->gradient_slot(it->second)) return slot;
    return nullptr;
  };
}

void Executor::backward_watched(Tensor& loss, const GradientReadyHook& ready, const GradientSlotHook& slot) {
  if (!ready && !slot) return loss.backward();
  const GradientReadyScope watch(ready);
  const GradientSlotScope give(slot);
  loss.backward();
}

void Executor::add_part(std::unique_ptr<StepPart> part) {
  if (!part) throw Error("MBP executor: add_part expected a part, found none");
  parts_.push_back(std::move(part));
}

void Executor::discard_partial_step() {
  if (host_gradients_) host_gradients_->drop_transient();
  optimizer_.zero_grad();
  for (nn::StepState* s : states_) s->discard();
}

std::size_t Executor::input_staging_bytes(const Plan& plan) const {
  if (!stager_->overlaps()) return 0;
  std::int64_t numel = sample_numel_;
  if (stage_) {  // a pipeline stage stages what its step does (StageRunner::staged_sample_numel)
    const auto staged = stage_->staged_sample_numel();
    if (!staged) return 0;
    numel = *staged;
  }
  return InputStager::staging_capacity(staging_bytes(plan.micro_batch, numel, activation_dtype_),
                                       staging_bytes(plan.batch_size, numel, activation_dtype_));
}

std::size_t Executor::message_staging_bytes(const Plan& plan) const {
  if (!stage_) return 0;
  return stage_->message_staging_bytes(plan.sizes());
}

StepResult Executor::step(const float* images, const std::int64_t* labels, std::int64_t batch) {
  return run(images, labels, batch, true);
}

StepResult Executor::step_enqueued(const float* images, const std::int64_t* labels, std::int64_t batch) {
  return run(images, labels, batch, false);
}

StepResult Executor::run(const float* images, const std::int64_t* labels, std::int64_t batch, bool wait) {
  if (stage_)
    stage_->check_step_data(images, labels);
  else if (images == nullptr || labels == nullptr)
    throw Error("MBP executor: step needs images and labels");
  ArenaScope scope(arena_);
  StepResult r;
  for (const auto& part : parts_) part->begin_step(labels, batch);
  for (;;) {
    const Plan& p = plan(batch);
    arena_->reset_peak();
    // The host tier's arena for the optimizer's staging and offloaded segments, when the plan uses it.
    const bool on_host = placed_host_arena() != nullptr;
    HostArenaScope host(placed_host_arena(), opt_.offload_prefetch_on_cpu);
    if (on_host) opt_.host_arena->reset_peak();
    try {
      run_step(placed_, images, labels, p.sizes(), &r.pending_loss);
      // A pipeline's stages agree on the loss at once (finish_step); a value already there is taken.
      if (wait || stage_ || r.pending_loss.ready()) r.loss = r.pending_loss.get();
      if (on_host) {
        r.host_predicted_peak = p.host_predicted_peak;
        r.host_peak = static_cast<std::size_t>(opt_.host_arena->stats().total.peak);
      }
      for (const auto& part : parts_) r.communication_seconds += part->communication_seconds();
      r.micro_batch = p.micro_batch;
      r.micro_batches = p.micro_batches;
      r.predicted_peak = p.predicted_peak;
      r.peak = static_cast<std::size_t>(arena_->stats().total.peak);
      if (stage_) {
        stage_->finish_step(r);
        r.pending_loss = PendingScalar(r.loss);  // the stages' agreed loss
      }
      return r;
    } catch (const RecordingFailed& e) {
      // Nothing of the step is kept (gradients zeroed, moments dropped): it runs again, without graphs.
      discard_partial_step();
      if (opt_.log)
        opt_.log(fmt::format("cuda graphs: a micro-batch could not be recorded ({}); the step runs again and the "
                             "run goes on without graphs", e.what()));
    } catch (const OutOfMemory& e) {
      discard_partial_step();
      if (stage_) stage_->before_retry(e, batch, p);
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

void Executor::set_micro_batch_limit(std::int64_t limit) {
  if (limit < 1) throw Error(fmt::format("MBP executor: expected a micro-batch limit >= 1, found {}", limit));
  limit_ = limit;
}

}  // namespace tally::mbp
