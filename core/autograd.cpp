// core/autograd.cpp — the backward engine; see core/autograd.h.
#include "core/autograd.h"

#include <map>
#include <queue>
#include <unordered_map>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/memory.h"
#include "core/ops.h"

namespace tally {
namespace {
thread_local bool tl_grad_enabled = true;
thread_local std::uint64_t tl_sequence = 0;

bool tensor_requires_grad(const Tensor& t) {
  return t.defined() && (t.requires_grad() || t.grad_fn() != nullptr);
}
}  // namespace

Node::Node() : sequence(tl_sequence++), module(allocation_site().module) {}

bool grad_enabled() { return tl_grad_enabled; }
NoGradGuard::NoGradGuard() : previous_(tl_grad_enabled) { tl_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { tl_grad_enabled = previous_; }
EnableGradGuard::EnableGradGuard() : previous_(tl_grad_enabled) { tl_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { tl_grad_enabled = previous_; }

bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  if (!tl_grad_enabled) return false;
  for (const Tensor* t : inputs)
    if (t && tensor_requires_grad(*t)) return true;
  return false;
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!tl_grad_enabled) return false;
  for (const Tensor& t : inputs)
    if (tensor_requires_grad(t)) return true;
  return false;
}

namespace {
Edge edge_to(const Tensor* t) {
  Edge e;
  if (t && tensor_requires_grad(*t)) {
    if (t->grad_fn()) e.node = t->grad_fn();
    else e.leaf = t->impl_ptr();
  }
  return e;
}
}  // namespace

void set_history(Tensor& out, const std::shared_ptr<Node>& node, std::initializer_list<const Tensor*> inputs) {
  for (const Tensor* t : inputs) node->next.push_back(edge_to(t));
  out.impl().grad_fn = node;
}

void set_history(Tensor& out, const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs) {
  for (const Tensor& t : inputs) node->next.push_back(edge_to(&t));
  out.impl().grad_fn = node;
}

Tensor& grad_target(GradSlot& slot, const Shape& shape, DType dtype, Device device, double& beta, const char* op,
                    MemoryFormat format) {
  Category category = slot.category;
  if (slot.buffer.defined()) {
    if (slot.buffer.shape() != shape || slot.buffer.dtype() != dtype || slot.buffer.device() != device)
      throw ShapeError(fmt::format("{} backward: gradient buffer {} does not match input {}{} on {}", op,
                                   slot.buffer.str(), dtype_name(dtype), shape_str(shape), device.str()));
    if (slot.buffer.is_contiguous(format)) {
      beta = 1.0;
      return slot.buffer;
    }
    slot.pending = std::move(slot.buffer);  // added in by the engine after this op's backward
    category = Category::temporary;
  }
  slot.buffer = Tensor::empty(shape, dtype, device, category, fmt::format("{}_backward", op), format);
  beta = 0.0;
  return slot.buffer;
}

Tensor& grad_target(GradSlot& slot, const Tensor& like, double& beta, const char* op) {
  return grad_target(slot, like.shape(), like.dtype(), like.device(), beta, op, like.suggest_memory_format());
}

namespace {
thread_local bool tl_in_backward = false;
}  // namespace

bool in_backward() { return tl_in_backward; }

namespace {
thread_local GradientReadyHook tl_gradient_ready;
}  // namespace
GradientReadyScope::GradientReadyScope(GradientReadyHook hook) : previous_(std::move(tl_gradient_ready)) {
  tl_gradient_ready = std::move(hook);
}
GradientReadyScope::~GradientReadyScope() { tl_gradient_ready = std::move(previous_); }

thread_local GradientSlotHook tl_gradient_slot;
GradientSlotScope::GradientSlotScope(GradientSlotHook hook) : previous_(std::move(tl_gradient_slot)) {
  tl_gradient_slot = std::move(hook);
}
GradientSlotScope::~GradientSlotScope() { tl_gradient_slot = std::move(previous_); }

void run_backward(const Tensor& root) {
  if (root.numel() != 1)
    throw ShapeError(fmt::format("backward: expected a scalar (one-element) tensor, found {}", root.str()));
  run_backward(root, Tensor());
}

void run_backward(const Tensor& root, const Tensor& seed) {
  if (seed.defined() && seed.shape() != root.shape())
    throw ShapeError(fmt::format("backward: the gradient {} does not match the tensor {}", seed.str(), root.str()));
  if (root.is_leaf()) {
    if (!root.requires_grad()) throw Error("backward: the tensor does not require grad and has no history");
    Tensor r = root;
    if (seed.defined()) {
      if (!root.grad().defined()) r.impl().grad = seed.clone(root.impl().grad_category).impl_ptr();
      else { Tensor g = r.grad(); add_into(g, seed); }
    } else if (!root.grad().defined()) {
      r.impl().grad = Tensor::full(root.shape(), 1.0, root.dtype(), root.device(), Category::gradient, "grad").impl_ptr();
    } else if (!skip_side_effects()) {
      r.grad().fill_(r.grad().item() + 1.0);
    }
    return;
  }

  backward_from(root.grad_fn(), seed.defined() ? seed
                                               : Tensor::full(root.shape(), 1.0, root.dtype(), root.device(),
                                                              Category::temporary, "grad_seed"));
}

namespace {
// For every node reachable from `root`, how many edges lead to it; with `leaves`, also for every
// leaf.
std::unordered_map<Node*, int> count_dependencies(Node* root, std::unordered_map<TensorImpl*, int>* leaves = nullptr) {
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack{root};
  dependencies[root] = 0;
  std::unordered_map<Node*, bool> seen{{root, true}};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next) {
      if (e.leaf && leaves) ++(*leaves)[e.leaf.get()];
      if (!e.node) continue;
      dependencies[e.node.get()]++;
      if (!seen[e.node.get()]) {
        seen[e.node.get()] = true;
        stack.push_back(e.node.get());
      }
    }
  }
  return dependencies;
}

// Where a leaf's gradient lives in this backward: the slot hook's, else the leaf's own.
std::shared_ptr<TensorImpl>& leaf_grad(TensorImpl* leaf, const GradientSlotHook& slot_hook) {
  if (slot_hook)
    if (std::shared_ptr<TensorImpl>* slot = slot_hook(leaf)) return *slot;
  return leaf->grad;
}

// The slots a node's backward writes its input gradients into: the buffer an input already has
// (a node's pending gradient, a leaf's persistent one) is accumulated into; else a fresh one of
// the input's category.
std::vector<GradSlot> slots_of(const Node& node, const std::unordered_map<Node*, Tensor>& grads,
                               const GradientSlotHook& slot_hook) {
  std::vector<GradSlot> slots(node.next.size());
  for (std::size_t i = 0; i < node.next.size(); ++i) {
    const Edge& e = node.next[i];
    GradSlot& s = slots[i];
    s.needed = e.defined();
    if (e.node) {
      auto it = grads.find(e.node.get());
      if (it != grads.end()) s.buffer = it->second;
      s.category = Category::temporary;
    } else if (e.leaf) {
      const std::shared_ptr<TensorImpl>& grad = leaf_grad(e.leaf.get(), slot_hook);
      if (grad) s.buffer = Tensor(grad);
      s.category = e.leaf->grad_category;
    }
  }
  return slots;
}
}  // namespace

void backward_from(std::shared_ptr<Node> root_fn, Tensor seed) {
  const GradientReadyHook ready_hook = tl_gradient_ready;  // this backward's (a recomputation's nested one sees it too)
  const GradientSlotHook slot_hook = tl_gradient_slot;
  std::unordered_map<TensorImpl*, int> leaf_writers;     // counted only for a hook
  std::unordered_map<Node*, int> dependencies = count_dependencies(root_fn.get(), ready_hook ? &leaf_writers : nullptr);
  auto later_first = [](const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) {
    return a->sequence < b->sequence;
  };
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, decltype(later_first)> ready(later_first);
  std::unordered_map<Node*, Tensor> grads;  // gradient of each pending node's output
  grads[root_fn.get()] = std::move(seed);
  ready.push(std::move(root_fn));
  std::vector<std::shared_ptr<Node>> done;
  struct InBackward {
    bool previous = tl_in_backward;
    InBackward() { tl_in_backward = true; }
    ~InBackward() { tl_in_backward = previous; }
  } in_backward_scope;

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    const AllocationSiteScope site({node->module, Phase::backward});  // for the arena's trace
    std::vector<GradSlot> slots = slots_of(*node, grads, slot_hook);
    {
      Tensor grad_out;
      if (auto it = grads.find(node.get()); it != grads.end()) {
        grad_out = std::move(it->second);
        grads.erase(it);
      }
      if (grad_out.defined()) node->backward(std::move(grad_out), slots);  // else no gradient reached it
      node->release();  // saved tensors go now, and grad_out at the end of this scope
    }
    for (GradSlot& s : slots)
      if (s.pending.defined()) {  // written in the other memory format: added into its target
        add_into(s.pending, s.buffer);
        s.buffer = std::move(s.pending);
      }
    for (std::size_t i = 0; i < node->next.size(); ++i) {
      const Edge& e = node->next[i];
      Tensor& b = slots[i].buffer;
      if (e.leaf && b.defined()) {
        // The same leaf may sit behind two slots of one node (x * x): add, don't overwrite.
        std::shared_ptr<TensorImpl>& grad = leaf_grad(e.leaf.get(), slot_hook);
        if (!grad) grad = b.impl_ptr();
        else if (grad != b.impl_ptr()) { Tensor g(grad); add_into(g, b); }
      }
      if (e.leaf && ready_hook && --leaf_writers[e.leaf.get()] == 0) ready_hook(e.leaf.get());
      if (!e.node) continue;
      if (b.defined()) {
        auto it = grads.find(e.node.get());
        if (it == grads.end()) grads.emplace(e.node.get(), std::move(b));
        else if (!it->second.same(b)) add_into(it->second, b);  // same producer twice
      }
      if (--dependencies[e.node.get()] == 0) ready.push(e.node);
    }
    done.push_back(std::move(node));
  }
  // Release the tape: cut every processed node's edges.
  for (auto& n : done) n->next.clear();
}

// ---- recomputation -------------------------------------------------------------------------------
namespace {
thread_local bool tl_recomputing = false;

struct RecomputeBackward : Node {
  std::function<Tensor(const Tensor&)> f;
  Tensor x;  // the segment's input, the one tensor it keeps
  const char* label = "recompute";
  const char* name() const override { return label; }
  void release() override { x = Tensor(); }
  void backward(const Tensor& gy, std::vector<GradSlot>& g) override { backward(Tensor(gy), g); }
  void backward(Tensor&& gy, std::vector<GradSlot>& g) override {
    // The segment's input as a leaf of the recomputed graph; its gradient (category temporary:
    // an intermediate's, not a parameter's) accumulates where x's other consumers put theirs.
    Tensor xi = x.detach();
    if (g[0].needed) {
      xi.set_requires_grad(true);
      xi.impl().grad_category = Category::temporary;
      if (g[0].buffer.defined()) xi.impl().grad = g[0].buffer.impl_ptr();
    }
    Tensor y;
    {
      EnableGradGuard on;
      struct Recomputing {
        bool previous = tl_recomputing;
        Recomputing() { tl_recomputing = true; }
        ~Recomputing() { tl_recomputing = previous; }
      } scope;
      y = f(xi);
    }
    x = Tensor();  // the input is not needed any more
    if (!y.grad_fn()) {
      if (g[0].needed) g[0].buffer = gy;  // f was the identity on x: nothing recorded
      return;
    }
    // Neither the re-run's output nor the incoming gradient is held here while its backward runs:
    // each is freed as soon as that backward's first node (the segment's last op) is done with it.
    if (gy.shape() != y.shape())
      throw ShapeError(fmt::format("{} backward: the gradient {} does not match the segment's output {}", label,
                                   gy.str(), y.str()));
    std::shared_ptr<Node> fn = y.grad_fn();
    y = Tensor();
    Tensor seed = gy.contiguous(gy.suggest_memory_format());  // dense, in the layout it came in
    gy = Tensor();
    backward_from(std::move(fn), std::move(seed));
    if (g[0].needed && !g[0].buffer.defined()) g[0].buffer = xi.grad();
  }
};
}  // namespace

bool recomputing() { return tl_recomputing; }

Tensor recompute(const std::function<Tensor(const Tensor&)>& f, const Tensor& x, const char* name) {
  if (!grad_enabled()) return f(x);
  Tensor y;
  {
    NoGradGuard off;
    y = f(x);
  }
  auto n = std::make_shared<RecomputeBackward>();
  n->f = f;
  n->x = x;
  n->label = name;
  // Recorded even when x needs no gradient: the segment's parameters do.
  set_history(y, n, {&x});
  return y;
}

}  // namespace tally
