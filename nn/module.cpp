// nn/module.cpp — registration, recursive traversal, train/eval, zero_grad, to(Device).
#include "nn/module.h"

#include <algorithm>

#include "core/offload.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/memory.h"
#include "nn/modules.h"

namespace tally::nn {

namespace {

// Replaces a tensor's storage in place by that of `f(t)` (a dense copy on another device or of
// another dtype), and its gradient's likewise: the impl keeps its identity, so every handle and
// every optimizer that holds it sees the change.
template <class F>
void replace_in_place(const Tensor& t, F f) {
  Tensor moved = f(t);
  TensorImpl& impl = t.impl();
  impl.storage = moved.impl().storage;
  impl.offset = moved.offset();
  impl.strides = moved.strides();
  impl.device = moved.device();
  impl.dtype = moved.dtype();
  if (impl.grad) impl.grad = f(Tensor(impl.grad)).impl_ptr();
}

void move_in_place(const Tensor& t, Device device) {
  if (!t.defined() || t.device() == device) return;
  replace_in_place(t, [&](const Tensor& x) { return x.to(device); });  // same category, dense
}

void convert_in_place(const Tensor& t, DType dtype) {
  if (!t.defined() || t.dtype() == dtype || !is_floating(t.dtype())) return;
  replace_in_place(t, [&](const Tensor& x) { return x.to(dtype); });
}

thread_local ForwardObserver* t_observer = nullptr;

}  // namespace

ForwardObserver* forward_observer() { return t_observer; }
ForwardObserverScope::ForwardObserverScope(ForwardObserver* o) : previous_(t_observer) { t_observer = o; }
ForwardObserverScope::~ForwardObserverScope() { t_observer = previous_; }

void Module::check_new_name(const std::string& name, const char* what) const {
  if (name.empty() || name.find('.') != std::string::npos)
    throw Error(fmt::format("register_{}: name '{}' must be non-empty and contain no '.'", what, name));
  auto taken = [&](const auto& list) {
    for (const auto& e : list)
      if (e.first == name) return true;
    return false;
  };
  if (taken(parameters_) || taken(buffers_) || taken(children_))
    throw Error(fmt::format("register_{}: name '{}' is already registered in this module", what, name));
}

Tensor& Module::register_parameter(const std::string& name, Tensor t) {
  check_new_name(name, "parameter");
  if (!t.defined()) throw Error(fmt::format("register_parameter: '{}' is an undefined tensor", name));
  t.set_requires_grad(true);
  t.allocate_grad();
  parameters_.emplace_back(name, std::move(t));
  return parameters_.back().second;
}

Tensor& Module::register_buffer(const std::string& name, Tensor t) {
  check_new_name(name, "buffer");
  if (!t.defined()) throw Error(fmt::format("register_buffer: '{}' is an undefined tensor", name));
  buffers_.emplace_back(name, std::move(t));
  return buffers_.back().second;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> module) {
  check_new_name(name, "module");
  if (!module) throw Error(fmt::format("register_module: '{}' is null", name));
  if (!module->parent_) {  // a module registered twice keeps its first place as its path
    module->parent_ = this;
    module->name_ = name;
  }
  children_.emplace_back(name, std::move(module));
}

const char* segment_mode_name(SegmentMode m) {
  switch (m) {
    case SegmentMode::keep: return "keep";
    case SegmentMode::recompute: return "recompute";
    case SegmentMode::offload: return "offload";
  }
  return "?";
}

Tensor Module::run_segment(SegmentMode mode, const std::function<Tensor(const Tensor&)>& f, const Tensor& x,
                           const std::string& name) const {
  if (mode == SegmentMode::keep || !training_ || !grad_enabled()) return f(x);
  if (mode == SegmentMode::recompute) return tally::recompute(f, x, "recompute");
  return tally::offload(f, x, name);
}

const std::string& Module::path() const {
  if (!path_) {
    if (!parent_) {
      path_ = "";
    } else {
      const std::string& up = parent_->path();
      path_ = up.empty() ? name_ : up + "." + name_;
    }
  }
  return *path_;
}

void Module::collect(const std::string& prefix, bool buffers,
                     std::vector<std::pair<std::string, Tensor>>& out) const {
  for (const auto& [name, t] : buffers ? buffers_ : parameters_) out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", buffers, out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", false, out);
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::named_buffers() const {
  std::vector<std::pair<std::string, Tensor>> out;
  collect("", true, out);
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const { return children_; }

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::zero_grad() {
  for (auto& [name, t] : named_parameters()) {
    if (t.grad().defined()) t.zero_grad();
    else if (t.requires_grad()) t.allocate_grad();  // allocated zero-filled
  }
}

void Module::to(Device device) {
  for (auto& [name, t] : parameters_) move_in_place(t, device);
  for (auto& [name, t] : buffers_)
    if (is_floating(t.dtype())) move_in_place(t, device);  // integer counters stay on the host
  for (auto& [name, child] : children_) child->to(device);
}

void Module::to(DType dtype) {
  if (!is_floating(dtype)) throw Error(fmt::format("Module::to: expected a floating dtype, found {}", dtype_name(dtype)));
  for (auto& [name, t] : parameters_) convert_in_place(t, dtype);
  for (auto& [name, t] : buffers_) convert_in_place(t, dtype);
  for (auto& [name, child] : children_) child->to(dtype);
}

std::vector<StepState*> step_states(Module& root) {
  std::vector<StepState*> out;
  if (StepState* s = root.step_state()) out.push_back(s);
  for (auto& [name, child] : root.named_children())
    for (StepState* s : step_states(*child)) out.push_back(s);
  return out;
}

std::vector<Tensor> parameters_of(const std::vector<Module*>& modules) {
  std::vector<Tensor> out;
  for (Module* m : modules)
    for (Tensor& p : m->parameters()) out.push_back(std::move(p));
  return out;
}

std::vector<StepState*> step_states_of(const std::vector<Module*>& modules) {
  std::vector<StepState*> out;
  for (Module* m : modules)
    for (StepState* s : step_states(*m)) out.push_back(s);
  return out;
}

void move_to_arena(Module& module, const std::shared_ptr<Arena>& arena) {
  ArenaScope scope(arena);
  const Device dev = arena->device();
  // Onto the arena's device where it is another (a GPU stage from the host), as Module::to moves.
  auto into = [&](const Tensor& x) { return x.device() == dev ? x.clone(x.storage()->category()) : x.to(dev); };
  for (auto& [name, t] : module.named_parameters())
    if (t.storage()->arena() != arena) replace_in_place(t, into);
  for (auto& [name, t] : module.named_buffers())
    if (t.storage()->arena() != arena && (is_floating(t.dtype()) || t.device() == dev))  // counters stay on the host
      replace_in_place(t, into);
}

namespace {
// The stages under `m` (m itself not included) and their blocks, as Module::recompute_parts says.
void find_stages(Module& m, Module::RecomputeParts& parts) {
  for (const auto& [name, child] : m.named_children()) {
    const auto kids = child->named_children();
    const auto composite = [](const auto& k) { return !k.second->named_children().empty(); };
    const bool stage = dynamic_cast<Sequential*>(child.get()) != nullptr && !kids.empty() &&
                       std::all_of(kids.begin(), kids.end(), composite);
    if (!stage) {
      find_stages(*child, parts);
      continue;
    }
    parts.stages.emplace_back(child->path(), child.get());
    for (const auto& [index, block] : kids) parts.blocks.push_back(block.get());
  }
}
}  // namespace

Module::RecomputeParts Module::recompute_parts() {
  RecomputeParts parts;
  parts.block_noun = "block";
  find_stages(*this, parts);
  return parts;
}

}  // namespace tally::nn
