// nn/module.h — the Module base class, modelled on libtorch's frontend (torch::nn::Module).
//
// A Module owns named parameters (leaf tensors that require grad), named buffers (state that is
// saved but not trained: BatchNorm's running statistics) and named child modules, all kept in
// registration order. Names compose with dots, recursively, exactly like PyTorch's state-dict
// keys ("layer1.0.conv1.weight"), so checkpoints interchange with torchvision.
//
//   struct Net : Module {
//     Net() { fc = register_module("fc", std::make_shared<Linear>(4, 2)); }
//     Tensor forward(const Tensor& x) override { return (*fc)(x); }
//     std::shared_ptr<Linear> fc;
//   };
//
// Memory: parameters and buffers are category `parameter`; registering a parameter marks it
// requires_grad and allocates its persistent gradient buffer (category `gradient`) right away,
// so both are counted in the arena before the first step and backward accumulates into them
// with beta = 1 (core/autograd.h).
//
// Handles alias: a registered Tensor is a handle to one TensorImpl shared by the registry, the
// layer's member (`weight`) and any optimizer holding parameters(). to(Device) therefore moves
// each tensor *in place* (its impl gets the new storage), as PyTorch's Module.to does with
// param.data, and every holder sees the moved tensor.
#pragma once
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/autograd.h"
#include "core/tensor.h"

namespace tally::nn {

class Module;
// Watches every Module call on this thread (the MBP planner's per-layer table uses it to see
// each layer's output shape and the bytes it keeps). Install with ForwardObserverScope.
struct ForwardObserver {
  virtual ~ForwardObserver() = default;
  virtual void before(const Module& m) = 0;
  virtual void after(const Module& m, const Tensor& output) = 0;
};
ForwardObserver* forward_observer();
class ForwardObserverScope {
 public:
  explicit ForwardObserverScope(ForwardObserver* o);
  ~ForwardObserverScope();
  ForwardObserverScope(const ForwardObserverScope&) = delete;
  ForwardObserverScope& operator=(const ForwardObserverScope&) = delete;

 private:
  ForwardObserver* previous_;
};

// State a module gathers over the micro-batches of one MBP step and applies once, after the
// last (BatchNorm's running statistics: each micro-batch adds its moments; the step updates the
// statistics once, as one batch of all of them would). The MBP executor (mbp/executor.h) drives
// every such state of a model through this interface without knowing the module:
//   begin_step     a step begins: training forwards from now on contribute instead of updating;
//   (contribute)   the module's own forward, in training mode, outside a recomputation's re-run;
//   reducible      data parallelism: the float64 tensors the ranks sum (in place, after the last
//                  micro-batch), then scale_to_global(local batch, global batch) on every rank;
//   apply          the step's one update from what was contributed; ends the step;
//   discard        drops what was contributed (a step retried after running out of memory, or
//                  one that failed); ends the step. Does nothing outside a step.
class StepState {
 public:
  virtual ~StepState() = default;
  virtual void begin_step() = 0;
  virtual std::vector<Tensor> reducible() = 0;
  virtual void scale_to_global(std::int64_t local_batch, std::int64_t global_batch) = 0;
  virtual void apply() = 0;
  virtual void discard() = 0;
};

// How a segment of the forward keeps what its backward needs (nn/recompute.h): keep it on the
// device (a plain call); recompute it (core/autograd.h, recompute(): only its input is kept, the
// forward re-runs in backward); offload it (core/offload.h: moved to the host tier's memory after
// the forward, back before the backward; needs a host tier).
enum class SegmentMode : std::uint8_t { keep, recompute, offload };
const char* segment_mode_name(SegmentMode m);  // "keep", "recompute", "offload"

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  virtual Tensor forward(const Tensor& x) = 0;
  // forward(x), recomputed during backward instead of kept when set_recompute(true) is on and the
  // module is training with grad mode on (core/autograd.h, recompute()).
  Tensor operator()(const Tensor& x) {
    return observed([&] { return run_segment(segment_, [this](const Tensor& t) { return forward(t); }, x, path()); });
  }
  // fn() run as a call of this module, seen by the forward observer (the layer table) as
  // operator() is: for a module's other forwards (BatchNorm2d::forward_relu).
  template <class F>
  Tensor observed(F&& fn) {
    ForwardObserver* o = forward_observer();
    if (o) o->before(*this);
    // The arena's trace names this module as who allocates (a forward re-run in backward: phase
    // recompute; core/arena.h, AllocationSite).
    const AllocationSiteScope site({&path(), in_backward() ? Phase::recompute : Phase::forward});
    Tensor y = fn();
    if (o) o->after(*this, y);
    return y;
  }

  // This module's dotted path from the root it is registered under ("layer2.0.conv1"; "" for
  // the root), as named_parameters() names its parameters.
  const std::string& path() const;

  // Recomputation (gradient checkpointing) of this module as one segment: its forward keeps only
  // its input; backward re-runs it. Gradients are bit for bit those of a plain run.
  void set_recompute(bool on) { segment_ = on ? SegmentMode::recompute : SegmentMode::keep; }
  bool recompute() const { return segment_ == SegmentMode::recompute; }
  // This module as a segment: kept (a plain call), recomputed, or offloaded to the host tier
  // (core/offload.h); the same gradients bit for bit in every mode.
  void set_segment_mode(SegmentMode m) { segment_ = m; }
  SegmentMode segment_mode() const { return segment_; }

  // The parts of this model that recomputation may turn into segments, for the ladder of levels
  // of nn/recompute.h: its repeated blocks in forward order, the stages that group them (named,
  // in forward order), and a switch for a part of its forward that is not a module of its own (an
  // ImageNet ResNet's stem). A model may override it (the zoo's do); the default reads them from
  // the module tree, so a model that says nothing still takes part in MBP's recomputation and
  // per-segment offload: a stage is a Sequential whose children are all composite modules (each
  // with children of its own: blocks, not single layers), named by its path ("layer2"); its
  // children are the blocks. Stages are found outermost first, in registration order, taken to
  // be the order forward() runs them; a stage's blocks are not searched further. A tree without
  // one offers nothing (its only level is none). Each block must be called as a module
  // ((*block)(x), not block->forward(x)) for its segment mode to apply.
  struct RecomputeParts {
    std::vector<Module*> blocks;
    std::vector<std::pair<std::string, Module*>> stages;
    SegmentMode* stem = nullptr;  // the mode of a non-module part run as one segment; null: none
    std::string block_noun = "residual block";  // "every residual block but the last"
  };
  virtual RecomputeParts recompute_parts();

  // The model as a chain of segments whose composition, in order, is forward(): the cut points a
  // pipeline of stages may split it at (mbp/pipeline.h). A ResNet offers its stem, each residual
  // block and its head (pool, flatten, fully connected layer); each segment names the modules whose
  // parameters and buffers it uses. The default offers none (the model cannot be split).
  struct Segment {
    std::string name;                            // "stem", "layer2.1", "head"
    std::vector<Module*> modules;                // the modules it runs (their parameters and buffers)
    std::function<Tensor(const Tensor&)> forward;
  };
  virtual std::vector<Segment> segments() { return {}; }

  // This module's state across the micro-batches of a step, if it has one (BatchNorm2d).
  virtual StepState* step_state() { return nullptr; }

  // Dotted names, registration order, this module's own entries before its children's.
  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, Tensor>> named_buffers() const;
  // Direct children only, in registration order.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;

  // Training / evaluation mode, set recursively (BatchNorm uses batch or running statistics).
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Fills every parameter's persistent gradient buffer with zeros (allocating it if missing).
  void zero_grad();

  // Moves parameters (with their gradient buffers) and buffers to `device`, recursively, in
  // place. Integer buffers (BatchNorm's num_batches_tracked) are host-side counters and stay on
  // the CPU.
  void to(Device device);
  // Converts floating parameters (with their gradients) and floating buffers to `dtype`
  // (float32 <-> float64), recursively, in place. Gradient checks and the MBP equivalence
  // tests run whole models in float64 this way.
  void to(DType dtype);

 protected:
  // f(x) as a segment of mode `mode` (named `name`) when this module is training with grad mode
  // on, else a plain call (a part of a forward that is not a module of its own, e.g. a ResNet's
  // stem, uses it directly).
  Tensor run_segment(SegmentMode mode, const std::function<Tensor(const Tensor&)>& f, const Tensor& x,
                     const std::string& name) const;
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    add_child(name, module);
    return module;
  }
  // Marks `t` requires_grad and allocates its gradient buffer; returns the registered handle.
  Tensor& register_parameter(const std::string& name, Tensor t);
  Tensor& register_buffer(const std::string& name, Tensor t);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> module);
  void check_new_name(const std::string& name, const char* what) const;
  void collect(const std::string& prefix, bool buffers, std::vector<std::pair<std::string, Tensor>>& out) const;

  // std::deque: push_back keeps references to earlier elements valid (register_* returns one).
  std::deque<std::pair<std::string, Tensor>> parameters_, buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  const Module* parent_ = nullptr;  // the module this one is registered under (the first, if several)
  std::string name_;                // its name there
  mutable std::optional<std::string> path_;  // path(), computed on first use
  bool training_ = true;
  SegmentMode segment_ = SegmentMode::keep;
};

// The step states (Module::step_state) of `root` and its descendants, in registration order.
std::vector<StepState*> step_states(Module& root);

// The parameters (in registration order, module by module) and the step states of `modules`.
std::vector<Tensor> parameters_of(const std::vector<Module*>& modules);
std::vector<StepState*> step_states_of(const std::vector<Module*>& modules);
// Moves every parameter (with its gradient buffer) and buffer of `module` into `arena`, onto its
// device, in place as Module::to does (integer counters stay on the host): a pipeline stage's share
// of a model built elsewhere moves into its rank's budget, on its GPU where it has one.
void move_to_arena(Module& module, const std::shared_ptr<Arena>& arena);

}  // namespace tally::nn
