// mbp/stage_runner.cpp — one pipeline stage's micro-batch loop; see mbp/stage_runner.h.
#include "mbp/stage_runner.h"

#include <algorithm>
#include <chrono>
#include <deque>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/autograd.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "core/option_names.h"
#include "mbp/executor.h"
#include "mbp/step_inputs.h"
#include "nn/recompute.h"

namespace tally::mbp {

using namespace detail;

StageRunner::StageRunner(nn::Module& model, const ExecutorOptions& options, std::shared_ptr<Arena> arena,
                         DType activation_dtype, InputStager& stager, Chooser& chooser)
    : stage_(options.pipeline.value()),
      comm_(options.communicator ? options.communicator : distributed::local()),
      loss_(options.loss),
      arena_(std::move(arena)),
      device_(arena_->device()),
      dtype_(model.parameters().front().dtype()),
      activation_dtype_(activation_dtype),
      stager_(stager),
      segments_(model.segments()),
      model_sample_shape_(options.sample_shape) {
  const PipelineStage& st = stage_;
  if (options.memory_format != MemoryFormat::Contiguous)
    throw Error(fmt::format("MBP executor: pipeline stages exchange row-major activations; the memory format must be "
                            "contiguous, found {}", memory_format_name(options.memory_format)));
  if (segments_.empty()) throw Error("MBP executor: a pipeline stage needs a model that offers segments (Module::segments)");
  if (st.stages < 1 || st.stage < 0 || st.stage >= st.stages || st.bounds.size() != static_cast<std::size_t>(st.stages) + 1 ||
      st.bounds.front() != 0 || st.bounds.back() != segments_.size() ||
      !std::is_sorted(st.bounds.begin(), st.bounds.end()) ||
      std::adjacent_find(st.bounds.begin(), st.bounds.end()) != st.bounds.end())
    throw Error(fmt::format("MBP executor: pipeline stage {} of {} with bounds [{}]: expected S + 1 increasing segment "
                            "indices from 0 to {}", st.stage, st.stages, fmt::join(st.bounds, ", "), segments_.size()));
  if (comm_->size() > 1 && comm_->size() != st.stages)
    throw Error(fmt::format("MBP executor: a pipeline of {} stages runs on as many ranks, found {} (pipeline stages "
                            "and data parallelism together are not supported)", st.stages, comm_->size()));
  if (comm_->size() > 1 && comm_->rank() != st.stage)
    throw Error(fmt::format("MBP executor: rank {} must run stage {}, found stage {}", comm_->rank(), comm_->rank(),
                            st.stage));
  if (options.normalization != LossNormalization::exact)
    throw Error("MBP executor: a pipeline uses the exact loss normalization");
  if (options.recompute != "none" && options.recompute != "auto" && options.recompute != "blocks")
    throw Error(fmt::format("{} {}: a pipeline stage recomputes its residual blocks at most (none|blocks|auto)",
                            option_name(Option::recompute), options.recompute));
  if (options.host_arena)
    throw Error("MBP executor: the host tier is not available to pipeline stages (each stage's state stays on its "
                "device)");
  check_segments_cover(model, segments_);
  states_ = nn::step_states_of(stage_modules(segments_, st.bounds, st.stage));
  for (std::int64_t d : model_sample_shape_) model_sample_numel_ *= d;
  chooser.set_top_level(std::min(1, nn::recompute_levels(model) - 1));  // a stage's segments are blocks: no stage around them
  chooser.planner().set_repeats(st.schedule == PipelineSchedule::gpipe ? std::size_t(1) << 40
                                                                       : static_cast<std::size_t>(st.stages) + 1);
  // The stage's input and output per sample: gradient-free dry runs of the segments before it (where
  // their parameters are: the host, where the trainer keeps the other stages) and of its own.
  const bool training = model.is_training();
  model.eval();
  sample_shape_ = probe(model_sample_shape_, 0, st.first());
  output_sample_shape_ = probe(sample_shape_, st.first(), st.last());
  model.train(training);
}

Shape StageRunner::probe(const Shape& sample, std::size_t from, std::size_t to) const {
  if (from == to) return sample;
  Device where = device_;
  for (std::size_t i = from; i < to && where == device_; ++i)
    for (const Tensor& p : nn::parameters_of(segments_[i].modules)) where = p.device();
  const DryRun dry(where, std::size_t(1) << 46);
  NoGradGuard no_grad;
  Tensor y = Tensor::empty(batch_shape(1, sample), activation_dtype_, where, Category::input, "input");
  for (std::size_t i = from; i < to; ++i) y = segments_[i].forward(y);
  return Shape(y.shape().begin() + 1, y.shape().end());
}

std::size_t StageRunner::message_staging_bytes(const std::vector<std::int64_t>& sizes) const {
  const auto per_sample = [this](const Shape& s) {
    return static_cast<std::size_t>(shape_numel(s)) * dtype_size(activation_dtype_);
  };
  return mbp::message_staging_bytes(stage_, sizes, per_sample(sample_shape_), per_sample(output_sample_shape_));
}

std::vector<Tensor> StageRunner::trained() const {
  return nn::parameters_of(stage_modules(segments_, stage_.bounds, stage_.stage));
}

Shape StageRunner::input_shape(std::int64_t n) const { return batch_shape(n, sample_shape_); }

Tensor StageRunner::run_segments(Tensor x) {
  for (std::size_t s = stage_.first(); s < stage_.last(); ++s) x = segments_[s].forward(x);
  return x;
}

// One step of a pipeline stage under way: what its forwards and backwards share.
struct StageRunner::Run {
  Run(const float* i, const std::int64_t* l, const std::vector<std::int64_t>& s) : images(i), labels(l), sizes(s) {}
  const float* images;
  const std::int64_t* labels;
  const std::vector<std::int64_t>& sizes;
  std::vector<std::int64_t> offsets{0};
  std::int64_t batch = 0;
  double divisor = 1.0;
  std::uint64_t step = 0;  // the training step (SampleScope)
  bool dry = false, first = false, last = false, targets_checked = false;
  Tensor total;  // the loss, summed (the last stage)
  // A micro-batch between its forward and its backward: its input (a leaf whose gradient goes
  // back) and its output (sent on, kept for backward) with the ticket of that send.
  struct InFlight {
    Tensor x, out;
    std::size_t sent = 0;
  };
  std::deque<InFlight> in_flight;
  // The gradient last sent back, kept until that send is done (waited for before the next one).
  Tensor sent_back;
  std::size_t sent_back_ticket = 0;
  // The step's timeline and its waits (a real step's: a dry run neither waits nor takes time).
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  PipelineTrace trace;
  double since() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
  // Runs a wait (a receive, or a send to be taken), counted as idle; a receive an operation starts
  // with moves the operation's start to its end, so the picture shows the wait as a gap.
  double op_start = 0;
  template <class F>
  void waiting(F&& f, bool starts_op = false) {
    const double a = since();
    f();
    const double b = since();
    trace.idle_seconds += b - a;
    if (starts_op) op_start = b;
  }
};

std::optional<std::int64_t> StageRunner::staged_sample_numel() const {
  if (stage_.stage == 0) return model_sample_numel_;
  if (stage_.stage + 1 == stage_.stages) return 0;
  return std::nullopt;
}

Tensor StageRunner::run(const float* images, const std::int64_t* labels, const std::vector<std::int64_t>& sizes,
                        std::uint64_t step) {
  const PipelineStage& st = stage_;
  Run r(images, labels, sizes);
  r.step = step;
  r.dry = skip_side_effects(), r.first = st.stage == 0, r.last = st.stage + 1 == st.stages;
  r.batch = checked_batch(sizes);
  for (std::int64_t n : sizes) r.offsets.push_back(r.offsets.back() + n);
  if (r.last && !r.dry) r.divisor = batch_divisor(labels, r.batch, loss_);  // on the stage that has the targets
  for (nn::StepState* s : states_) s->begin_step();
  if (const auto numel = staged_sample_numel(); numel && !r.dry)
    reserve_staging(stager_, sizes, *numel, activation_dtype_);
  if (!r.dry) comm_->reserve_message_bytes(message_staging_bytes(sizes));  // where messages go through the host
  EnableGradGuard grad_on;
  if (r.last) r.total = Tensor::zeros({}, dtype_, device_, Category::temporary, "step_loss");
  const auto k = static_cast<std::int64_t>(sizes.size());
  for (const PipelineOp& op : pipeline_order(st.schedule, st.stage, st.stages, k)) {
    r.op_start = r.since();
    if (op.forward)
      forward(r, static_cast<std::size_t>(op.index));
    else
      backward(r, static_cast<std::size_t>(op.index));
    r.trace.events.push_back({op.forward, op.index, r.op_start, r.since()});
  }
  r.waiting([&] { comm_->wait_send(r.sent_back_ticket); });
  if (!r.dry) {
    r.trace.seconds = r.since();
    trace_ = std::move(r.trace);
  }
  return r.total;
}

// Sends the gradient of a micro-batch's input back to the stage before (after the last one sent
// is taken: one such buffer lives at a time).
void StageRunner::send_back(Run& r, const Tensor& x) {
  if (r.first) return;
  distributed::Communicator& comm = *comm_;
  r.waiting([&] { comm.wait_send(r.sent_back_ticket); });
  r.sent_back = Tensor();
  r.sent_back = x.grad();
  r.sent_back_ticket = comm.send(r.sent_back, stage_.stage - 1);
}

void StageRunner::forward(Run& r, std::size_t i) {
  distributed::Communicator& comm = *comm_;
  const int stage = stage_.stage;
  const std::int64_t n = r.sizes[i];
  mark_trace(device_, fmt::format("micro-batch {}/{} ({} samples) forward", i + 1, r.sizes.size(), n));
  const SampleScope samples({r.step, r.offsets[i]});  // every stage draws micro-batch i's samples alike
  Tensor x;
  if (r.first) {
    x = Tensor::empty(batch_shape(n, model_sample_shape_), activation_dtype_, device_, Category::input, "input");
    if (!r.dry) stager_.wait(stage_images(x, stager_, r.images, r.offsets[i], n, model_sample_numel_));
  } else {
    x = Tensor::empty(input_shape(n), activation_dtype_, device_, Category::input, "stage_input");
    r.waiting([&] { comm.recv(x, stage - 1); }, true);
    x.impl().grad_category = Category::temporary;
    x.set_requires_grad(true);
  }
  Tensor out = run_segments(x);
  if (!r.last) {
    const std::size_t ticket = comm.send(out, stage + 1);
    r.in_flight.push_back({std::move(x), std::move(out), ticket});
    return;
  }
  // The last stage: the loss with the whole batch's divisor, and its backward at once.
  Tensor y = Tensor::empty({n}, DType::Int64, device_, Category::input, "labels");
  if (!r.dry) {
    stager_.wait(stage_labels(y, stager_, r.labels, r.offsets[i], n));
    if (!r.targets_checked) {
      check_cross_entropy_targets(r.labels, r.batch, out.size(1), loss_.ignore_index);
      r.targets_checked = true;
    }
  }
  CrossEntropyOptions co = loss_;
  co.divisor = r.divisor;
  co.targets_checked = !r.dry;
  Tensor loss = cross_entropy(out, y, co);
  out = Tensor();
  y = Tensor();
  loss.backward();
  add_into(r.total, loss);
  send_back(r, x);
}

void StageRunner::backward(Run& r, std::size_t i) {
  distributed::Communicator& comm = *comm_;
  mark_trace(device_, fmt::format("micro-batch {}/{} backward", i + 1, r.sizes.size()));
  const SampleScope samples({r.step, r.offsets[i]});  // a recomputed segment draws the forward's mask
  Run::InFlight f = std::move(r.in_flight.front());
  r.in_flight.pop_front();
  Tensor g = Tensor::empty(f.out.shape(), f.out.dtype(), device_, Category::temporary, "stage_output_grad");
  r.waiting(
      [&] {
        comm.recv(g, stage_.stage + 1);
        comm.wait_send(f.sent);  // the next stage has it: it sent this gradient back
      },
      true);
  run_backward(f.out, g);
  f.out = Tensor();
  g = Tensor();
  send_back(r, f.x);
}

Tensor StageRunner::forward_through_stages(const Tensor& x, std::int64_t n) {
  const PipelineStage& st = stage_;
  distributed::Communicator& comm = *comm_;
  ArenaScope scope(arena_);
  if (!skip_side_effects()) comm_->reserve_message_bytes(message_staging_bytes({n}));
  Tensor y = x;
  if (st.stage > 0) {
    y = Tensor::empty(input_shape(n), activation_dtype_, device_, Category::input, "stage_input");
    comm.recv(y, st.stage - 1);
  } else if (!y.defined() || y.size(0) != n) {
    throw Error(fmt::format("forward_through_stages: stage 0 expected {} samples, found {}", n,
                            y.defined() ? y.str() : std::string("none")));
  }
  y = run_segments(std::move(y));
  if (st.stage + 1 == st.stages) return y;
  comm.wait_send(comm.send(y, st.stage + 1));
  return {};
}


StepConfig StageRunner::choose(Chooser& chooser, std::int64_t batch, std::int64_t limit, const StateLayout& layout) {
  StepConfig mine;
  try {
    mine = chooser.choose(batch, limit, layout);
  } catch (const OutOfMemory& e) {
    if (stage_.stages == 1) throw;
    throw OutOfMemory(fmt::format("pipeline stage {} of {} ({}), memory limit {}: {}", stage_.stage, stage_.stages,
                                  segment_range(segments_, stage_.first(), stage_.last()), format_bytes(arena_->capacity()),
                                  e.what()),
                      e.requested());
  }
  if (agrees_across_stages()) {
    // Every stage runs the same micro-batches: the smallest of the stages' largest (each rank fills
    // its own slot of a sum). Agreed once per batch size, in the same order on every rank.
    auto it = agreed_.find(batch);
    if (it == agreed_.end()) {
      std::vector<double> largest(static_cast<std::size_t>(comm_->size()), 0.0);
      largest[static_cast<std::size_t>(comm_->rank())] = static_cast<double>(mine.plan.micro_batch);
      comm_->all_reduce_sum(largest.data(), largest.size());
      it = agreed_.emplace(batch, static_cast<std::int64_t>(*std::min_element(largest.begin(), largest.end()))).first;
    }
    if (it->second != mine.plan.micro_batch) return choose_with(chooser, batch, it->second, limit, layout);
  }
  describe(mine);
  return mine;
}

StepConfig StageRunner::choose_with(Chooser& chooser, std::int64_t batch, std::int64_t micro_batch, std::int64_t limit,
                                    const StateLayout& layout) const {
  StepConfig c = chooser.choose_with(batch, micro_batch, limit, layout);
  describe(c);
  return c;
}

void StageRunner::describe(StepConfig& c) const {
  if (stage_.stages > 1 && c.recompute.level > 0)  // the ladder's words are the model's
    c.recompute.description = "this stage's residual blocks, the model's last excepted, and the stem where the stage has it";
}

void StageRunner::check_step_data(const float* images, const std::int64_t* labels) const {
  const PipelineStage& st = stage_;  // the images on the first stage, the labels on the last
  if ((st.stage == 0 && images == nullptr) || (st.stage + 1 == st.stages && labels == nullptr))
    throw Error(fmt::format("MBP executor: pipeline stage {} of {} needs {}", st.stage, st.stages,
                            images == nullptr ? "the images" : "the labels"));
}

void StageRunner::finish_step(StepResult& r) const {
  r.communication_seconds = trace_.idle_seconds;  // waiting for the other stages
  if (agrees_across_stages()) comm_->all_reduce_sum(&r.loss, 1);  // the last stage's, to every rank
}

void StageRunner::before_retry(const OutOfMemory& e, std::int64_t batch, const Plan& p) const {
  const PipelineStage& st = stage_;
  if (st.stages > 1)
    throw OutOfMemory(fmt::format("training step of batch {} on pipeline stage {} of {} ran out of memory with "
                                  "micro-batches of {} (predicted peak {}); a pipeline does not retry: {}", batch,
                                  st.stage, st.stages, p.micro_batch, format_bytes(p.predicted_peak), e.what()),
                      e.requested());
}

}  // namespace tally::mbp
