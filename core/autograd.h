// core/autograd.h — reverse-mode automatic differentiation.
//
// The tape: every differentiable op run with grad mode on creates a Node that holds what its
// backward needs (saved tensors, category activation) and an Edge to the Node of each input
// (or to the leaf itself). Nodes carry a sequence number; backward() runs them in decreasing
// sequence order — the reverse of the forward order, deterministically — starting from a scalar
// loss with gradient 1.
//
// Where gradients go (the property MBP rests on, see docs/autograd.md):
//   * A Node's backward receives, for each input, a GradSlot. If the slot already holds a buffer
//     the kernel *accumulates* into it (beta = 1); otherwise the op allocates one and writes
//     (beta = 0). A leaf's slot is its persistent gradient buffer (category gradient): for
//     parameters it exists from the start, so weight-gradient kernels write with beta = 1
//     straight into it and gradient accumulation over micro-batches costs no memory.
//   * Gradients of intermediate tensors are category temporary and are freed as soon as the
//     Node that consumes them has run.
//   * A Node's saved tensors are released the moment its backward has run; after backward the
//     graph's edges are cut, so the tape is released with the last handle to it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally {

struct Node;

struct Edge {
  std::shared_ptr<Node> node;          // the producer of the input, or null for a leaf
  std::shared_ptr<TensorImpl> leaf;    // the leaf that requires grad (when node is null)
  bool defined() const { return node || leaf; }
};

// Where one input's gradient goes.
struct GradSlot {
  bool needed = false;
  Tensor buffer;  // undefined: allocate and write (beta 0); defined: accumulate (beta 1)
  Category category = Category::temporary;
  // An accumulation target in another memory format than the op writes (grad_target): the op
  // writes a fresh buffer, which the engine adds into this one after the op's backward.
  Tensor pending;
};

struct Node {
  Node();
  virtual ~Node() = default;
  virtual const char* name() const = 0;
  // grad_out: gradient of this node's output. Fill each needed slot (see GradSlot).
  virtual void backward(const Tensor& grad_out, std::vector<GradSlot>& grad_in) = 0;
  // The engine's entry: the node owns grad_out and may free it before it returns (a recomputed
  // segment hands it to the backward of its re-run, which frees it after the first node there).
  virtual void backward(Tensor&& grad_out, std::vector<GradSlot>& grad_in) {
    backward(static_cast<const Tensor&>(grad_out), grad_in);
  }
  // Drops saved tensors.
  virtual void release() {}

  std::vector<Edge> next;  // one per input, in the op's input order
  std::uint64_t sequence;
  // The module whose forward recorded this node (allocation_site() at its creation; core/arena.h):
  // its backward's allocations are traced under that module, phase backward.
  const std::string* module = nullptr;
};

// Grad mode (on by default), per thread.
bool grad_enabled();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Grad mode on for a scope whatever the caller set (torch.enable_grad): a training step that
// must record its tape even when called from inside a NoGradGuard.
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

// True if grad mode is on and any of the tensors requires grad (directly or via history).
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);
bool any_requires_grad(const std::vector<Tensor>& inputs);  // a list of any length (concat's)
// Connects `out` to `node`, whose edges point at `inputs` (undefined tensors get no edge).
void set_history(Tensor& out, const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs);
void set_history(Tensor& out, const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs);

// Returns the buffer to write an input's gradient into and sets `beta` (0 or 1): an existing
// buffer (accumulate) or a new one of `like`'s shape, dtype, device and memory format
// (like.suggest_memory_format(): the layout the op's kernel writes). An existing buffer in the
// other memory format is not written by a kernel of this layout: a new buffer is (beta 0), and
// the engine adds it into the existing one afterwards (GradSlot::pending).
Tensor& grad_target(GradSlot& slot, const Tensor& like, double& beta, const char* op);
Tensor& grad_target(GradSlot& slot, const Shape& shape, DType dtype, Device device, double& beta, const char* op,
                    MemoryFormat format = MemoryFormat::Contiguous);

// A leaf's gradient is complete for a backward when every node of that backward's tape that
// writes into it has run: the hook in scope on this thread is called then, once per leaf and
// backward, in backward order (the order an overlapped reduction or a copy to host memory wants),
// with the leaf's gradient buffer — in dry runs too. A recomputed segment's backward is a backward
// of its own: a leaf used only inside it is reported from there. No hook in scope: nothing counted.
using GradientReadyHook = std::function<void(TensorImpl* leaf)>;
class GradientReadyScope {
 public:
  explicit GradientReadyScope(GradientReadyHook hook);
  ~GradientReadyScope();
  GradientReadyScope(const GradientReadyScope&) = delete;
  GradientReadyScope& operator=(const GradientReadyScope&) = delete;

 private:
  GradientReadyHook previous_;
};

// Where a leaf's gradient lives during a backward: the hook in scope on this thread may return a
// slot of its own for the leaf (filled as it likes before it returns: a buffer there is
// accumulated into with beta = 1, as a persistent buffer is; an empty slot gets the fresh buffer
// the first writer makes) instead of the leaf's own `grad`; null: the leaf's own. Asked for every
// edge into the leaf, so it must return the same slot within a backward. In dry runs too. The host
// tier's gradient accumulators hang here (mbp/host_gradients.h): a transient device buffer loaded
// from the host before the first writer and read back when the gradient is ready — held by the
// step, so that a dry run of that placement (the chooser's, mbp/chooser.h) never touches the
// parameters' own buffers.
using GradientSlotHook = std::function<std::shared_ptr<TensorImpl>*(TensorImpl* leaf)>;
class GradientSlotScope {
 public:
  explicit GradientSlotScope(GradientSlotHook hook);
  ~GradientSlotScope();
  GradientSlotScope(const GradientSlotScope&) = delete;
  GradientSlotScope& operator=(const GradientSlotScope&) = delete;

 private:
  GradientSlotHook previous_;
};

void run_backward(const Tensor& root);
// Backward from `root` of any shape, with `seed` (root's shape) as its gradient.
void run_backward(const Tensor& root, const Tensor& seed);
// The engine itself: backward from the node that produced a tensor, with `seed` as that tensor's
// gradient, holding neither the tensor nor (after the first node) the seed.
void backward_from(std::shared_ptr<Node> root_fn, Tensor seed);

// ---- recomputation (gradient checkpointing) ----------------------------------------------------
// y = f(x), keeping only x for backward: f runs with recording off (no saved tensor of f lives
// past its op), and backward re-runs f on x with recording on and back-propagates through it —
// parameters' gradients accumulate into their persistent buffers exactly as in a plain run, and
// x's gradient goes where x's consumers put it. So the gradients are bit for bit those of the
// plain run when f is deterministic (tally's CPU kernels are). While f re-runs, recomputing() is
// true: BatchNorm then normalizes with the batch's statistics as the first run did, and neither
// updates running statistics nor adds MBP moments a second time. A dry run re-runs f as a dry
// run: the recomputation's allocations are in the plan.
Tensor recompute(const std::function<Tensor(const Tensor&)>& f, const Tensor& x, const char* name = "recompute");
bool recomputing();
// True on this thread while run_backward executes nodes (profiles tell forward from backward).
bool in_backward();

}  // namespace tally
