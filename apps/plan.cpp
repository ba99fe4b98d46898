// apps/plan.cpp — `tally plan`; see apps/plan.h.
#include "apps/plan.h"

#include <algorithm>
#include <ostream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "apps/setup.h"
#include "core/dry_run.h"
#include "core/memory.h"
#include "nn/resnet.h"
#include "mbp/executor.h"
#include "mbp/report/layer_table.h"
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

mbp::Plan plan(const PlanOptions& opt, std::ostream& out) {
  check_model_options(opt.model, opt.norm, opt.optimizer, opt.batch_size, opt.micro_batch);
  mbp::check_recompute_policy(opt.recompute);
  const mbp::Precision precision = mbp::parse_precision(opt.precision);
  const Shape sample = parse_input(opt.input);
  const Device dev = parse_device(opt.device);
  if (dev.is_cuda() && !cuda_available())
    throw Error(fmt::format("--device {}: no GPU is present (CUDA workspace sizes come from the GPU's libraries)",
                            opt.device));
  const std::size_t limit = parse_memory_limit(opt.memory_limit, dev);
  nn::ModelConfig mc;
  mc.name = opt.model;
  mc.norm = nn::parse_norm(opt.norm);
  mc.in_channels = sample[0];
  mc.num_classes = opt.num_classes.value_or(sample[1] >= 64 ? 1000 : 10);
  check_number("--num-classes", kPositiveWhole, static_cast<double>(mc.num_classes));
  check_number("--momentum", kNonNegative, opt.momentum);

  // Everything lives on a virtual arena of the budget's size: offsets only, no memory, no compute.
  const auto arena = Arena::make_virtual(dev, limit);
  DryRunGuard dry;
  OptimizerConfig oc;
  oc.name = opt.optimizer;
  oc.momentum = opt.momentum;
  const Setup setup = build_setup(arena, mc, "", oc, format_bytes(limit));
  fmt::print(out, "model {} (norm {}), {} parameters, {} classes | input {} | batch {} | optimizer {} | device {} | "
                  "precision {}\n",
             opt.model, opt.norm, setup.parameters, mc.num_classes, shape_str(sample), opt.batch_size, opt.optimizer,
             dev.str(), opt.precision);
  fmt::print(out, "memory limit {} ({} bytes): {} allocated first\n", format_bytes(limit), limit,
             persistent_summary(*arena));

  mbp::ExecutorOptions eo;
  eo.sample_shape = sample;
  eo.micro_batch = opt.micro_batch;
  eo.recompute = opt.recompute;
  eo.precision = precision;
  mbp::Executor executor(*setup.model, *setup.optimizer, arena, eo);
  const mbp::Plan& p = plan_step(executor, opt.batch_size, opt.micro_batch);
  const mbp::RecomputeChoice& chosen = executor.recompute_choice();
  const std::string recompute = chosen.summary(p);
  if (opt.layers) {
    fmt::print(out, "\nper layer, forward in training mode at the planned micro-batch of {}:\n", p.micro_batch);
    out << report::format_layer_table(report::layer_table(*setup.model, *arena, sample, p.micro_batch, executor.activation_dtype()), p.micro_batch);
  }
  fmt::print(out, "\nplan: {}\n", p.summary());
  fmt::print(out, "      live at the peak: {}\n", p.at_peak.str());
  if (chosen.level > 0) {
    // What recomputation buys: the same micro-batch without it (a too-small error measures it on
    // a clone with room to spare).
    std::string without;
    try {
      const mbp::Plan q = executor.plan_at_level(p.micro_batch, p.micro_batch, 0);
      without = fmt::format("{} ({} bytes), so it saves {}", format_bytes(q.predicted_peak), q.predicted_peak,
                            format_bytes(q.predicted_peak - std::min(q.predicted_peak, p.predicted_peak)));
    } catch (const OutOfMemory& e) {
      without = fmt::format("more than the limit: at least {}", format_bytes(e.requested()));
    }
    fmt::print(out, "      recompute: {}; without recomputation a micro-batch of {} needs {}\n", recompute, p.micro_batch,
               without);
  } else {
    fmt::print(out, "      recompute: {}\n", recompute);
  }
  fmt::print(out, "      {} dry runs in {:.2f} s; nothing was computed\n", p.probes, p.seconds);
  return p;
}

}  // namespace tally::app
