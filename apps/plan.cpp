// apps/plan.cpp — `tally plan`; see apps/plan.h.
#include "apps/plan.h"

#include <algorithm>
#include <ostream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "core/memory.h"
#include "layers/resnet.h"
#include "mbp/executor.h"
#include "mbp/layer_table.h"
#include "optim/optimizer.h"

namespace tally::app {

namespace {

Shape parse_input(const std::string& s) {
  Shape shape;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, 'x')) {
    const auto v = parse_positive_integer(part);
    if (!v) throw Error(fmt::format("--input '{}': expected CxHxW with positive integers, e.g. 3x224x224", s));
    shape.push_back(*v);
  }
  if (shape.size() != 3) throw Error(fmt::format("--input '{}': expected CxHxW (3 numbers), e.g. 3x224x224", s));
  return shape;
}

}  // namespace

std::optional<std::int64_t> parse_positive_integer(const std::string& s) {
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  try {
    const long long v = std::stoll(s);
    if (v < 1) return std::nullopt;
    return v;
  } catch (const std::exception&) {
    return std::nullopt;  // out of range
  }
}

mbp::Plan plan(const PlanOptions& opt, std::ostream& out) {
  const auto names = nn::model_names();
  if (std::find(names.begin(), names.end(), opt.model) == names.end())
    throw Error(fmt::format("--model '{}' is not allowed: expected one of {}", opt.model, fmt::join(names, ", ")));
  if (opt.optimizer != "sgd" && opt.optimizer != "adamw")
    throw Error(fmt::format("--optimizer '{}' is not allowed: expected one of sgd, adamw", opt.optimizer));
  if (opt.batch_size < 1) throw Error(fmt::format("--batch-size must be >= 1, found {}", opt.batch_size));
  if (opt.micro_batch && (*opt.micro_batch < 1 || *opt.micro_batch > opt.batch_size))
    throw Error(fmt::format("--micro-batch must be between 1 and --batch-size {}, found {}", opt.batch_size,
                            *opt.micro_batch));
  const Shape sample = parse_input(opt.input);
  const Device dev = parse_device(opt.device);
  if (dev.is_cuda() && !cuda_available())
    throw Error(fmt::format("--device {}: no GPU is present (CUDA workspace sizes come from the GPU's libraries)",
                            opt.device));
  const std::size_t limit = opt.memory_limit == "auto" ? default_arena_capacity(dev) : parse_size(opt.memory_limit);
  nn::ModelConfig mc;
  mc.name = opt.model;
  mc.norm = nn::parse_norm(opt.norm);
  mc.in_channels = sample[0];
  mc.num_classes = opt.num_classes.value_or(sample[1] >= 64 ? 1000 : 10);
  if (mc.num_classes < 1) throw Error(fmt::format("--num-classes must be >= 1, found {}", mc.num_classes));

  // Everything lives on a virtual arena of the budget's size: offsets only, no memory, no compute.
  auto arena = Arena::make_virtual(dev, limit);
  ArenaScope scope(arena);
  DryRunGuard dry;
  std::shared_ptr<nn::Module> model;
  std::unique_ptr<optim::Optimizer> optimizer;
  try {
    model = nn::make_model(mc);
    if (!dev.is_cpu()) model->to(dev);
    model->train();
    if (opt.optimizer == "sgd") {
      optim::SGDOptions so;
      so.momentum = opt.momentum;
      optimizer = std::make_unique<optim::SGD>(model->parameters(), so);
    } else {
      optimizer = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{});
    }
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(fmt::format("--memory-limit {}: the {} model's parameters, gradients and {} state do not fit "
                                  "({})", format_bytes(limit), opt.model, opt.optimizer, e.what()),
                      e.requested());
  }
  std::int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const ArenaStats s0 = arena->stats();
  fmt::print(out, "model {} (norm {}), {} parameters, {} classes | input {} | batch {} | optimizer {} | device {}\n",
             opt.model, opt.norm, params, mc.num_classes, shape_str(sample), opt.batch_size, opt.optimizer, dev.str());
  fmt::print(out, "memory limit {} ({} bytes): parameters {}, gradients {}, optimizer state {} allocated first\n",
             format_bytes(limit), limit, format_bytes(static_cast<std::size_t>(s0[Category::parameter].current)),
             format_bytes(static_cast<std::size_t>(s0[Category::gradient].current)),
             format_bytes(static_cast<std::size_t>(s0[Category::optimizer_state].current)));

  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = opt.micro_batch;
  mbp::Executor executor(*model, *optimizer, eo);
  const mbp::Plan p = executor.plan(opt.batch_size);
  if (opt.layers) {
    fmt::print(out, "\nper layer, forward in training mode at the planned micro-batch of {}:\n", p.micro_batch);
    out << mbp::format_layer_table(mbp::layer_table(*model, sample, p.micro_batch), p.micro_batch);
  }
  fmt::print(out, "\nplan: {}\n", p.summary());
  fmt::print(out, "      live at the peak: {}\n", p.at_peak.str());
  fmt::print(out, "      {} dry runs in {:.2f} s; nothing was computed\n", p.probes, p.seconds);
  return p;
}

}  // namespace tally::app
