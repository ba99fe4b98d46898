// layers/module.cpp — registration, recursive traversal, train/eval, zero_grad, to(Device).
#include "layers/module.h"

#include <fmt/format.h>

#include "core/error.h"

namespace tally::nn {

namespace {

// Moves one tensor to `device` in place: the impl keeps its identity (so every handle and every
// optimizer that holds it sees the move) and takes the storage of a copy on the new device.
void move_in_place(const Tensor& t, Device device) {
  if (!t.defined() || t.device() == device) return;
  Tensor moved = t.to(device);  // same category, dense
  TensorImpl& impl = t.impl();
  impl.storage = moved.impl().storage;
  impl.offset = moved.offset();
  impl.strides = moved.strides();
  impl.device = device;
  if (impl.grad) impl.grad = Tensor(impl.grad).to(device).impl_ptr();
}

}  // namespace

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
  children_.emplace_back(name, std::move(module));
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

}  // namespace tally::nn
