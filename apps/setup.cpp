// apps/setup.cpp — see apps/setup.h.
#include "apps/setup.h"

#include <algorithm>
#include <fstream>
#include <regex>

#include <fmt/format.h>

#include "core/error.h"
#include "core/memory.h"
#include "nn/state_dict.h"

namespace tally::app {

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

std::optional<std::int64_t> parse_micro_batch(const std::string& s) {
  if (s == "auto") return std::nullopt;
  const auto v = parse_positive_integer(s);
  if (!v) throw Error(fmt::format("--micro-batch '{}': expected a positive integer or auto", s));
  return v;
}

void check_choice(const std::string& flag, const std::string& value, const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return;
  throw Error(fmt::format("{} '{}' is not allowed: expected one of {}", flag, value, fmt::join(allowed, ", ")));
}

const std::vector<std::string>& norm_names() {
  static const std::vector<std::string> v{"batch", "group", "none"};
  return v;
}

const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> v{"sgd", "adamw"};
  return v;
}

std::string choices(const std::vector<std::string>& names) { return fmt::format("{}", fmt::join(names, "|")); }

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::size_t start = 0;
  for (;;) {
    const std::size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) return items;
    start = comma + 1;
  }
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) throw Error(fmt::format("cannot write {}", path.string()));
}

std::size_t parse_memory_limit(const std::string& text, Device dev) {
  if (text == "auto") return default_arena_capacity(dev);
  const std::size_t limit = parse_size(text);
  if (limit < Arena::kAlignment)
    throw Error(fmt::format("--memory-limit {} is below the arena's {}-byte granularity", text, Arena::kAlignment));
  return limit;
}

Setup build_setup(const std::shared_ptr<Arena>& arena, const nn::ModelConfig& model, const std::string& init,
                  const OptimizerConfig& optimizer, const std::string& limit_text) {
  check_choice("--optimizer", optimizer.name, optimizer_names());
  const Device dev = arena->device();
  ArenaScope scope(arena);
  Setup s;
  try {
    s.model = nn::make_model(model);
    if (!init.empty()) nn::load_state_dict(*s.model, init);
    if (!dev.is_cpu()) s.model->to(dev);
    s.model->train();
    if (optimizer.name == "sgd") {
      optim::SGDOptions so;
      so.lr = optimizer.lr, so.momentum = optimizer.momentum, so.weight_decay = optimizer.weight_decay;
      so.nesterov = optimizer.nesterov;
      s.optimizer = std::make_unique<optim::SGD>(s.model->parameters(), so);
    } else {
      optim::AdamWOptions ao;
      ao.lr = optimizer.lr, ao.weight_decay = optimizer.weight_decay;
      s.optimizer = std::make_unique<optim::AdamW>(s.model->parameters(), ao);
    }
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(fmt::format("--memory-limit {}: the {} model's parameters, gradients and {} state do not fit "
                                  "({})", limit_text, model.name, optimizer.name, e.what()),
                      e.requested());
  }
  for (const auto& p : s.model->parameters()) s.parameters += p.numel();
  return s;
}

std::string persistent_summary(const Arena& arena) {
  const ArenaStats s = arena.stats();
  return fmt::format("parameters {}, gradients {}, optimizer state {}",
                     format_bytes(static_cast<std::size_t>(s[Category::parameter].current)),
                     format_bytes(static_cast<std::size_t>(s[Category::gradient].current)),
                     format_bytes(static_cast<std::size_t>(s[Category::optimizer_state].current)));
}

const mbp::Plan& plan_step(mbp::Executor& executor, std::int64_t batch, std::optional<std::int64_t> micro_batch) {
  try {
    return executor.plan(batch);
  } catch (const OutOfMemory& e) {
    if (!micro_batch) throw;
    throw OutOfMemory(fmt::format("--micro-batch {}: {}", *micro_batch, e.what()), e.requested());
  }
}

const std::vector<std::string>& recompute_names() {
  static const std::vector<std::string> names{"auto", "none", "blocks", "all"};
  return names;
}

void check_recompute(const std::string& value) {
  static const std::regex level(R"(blocks\+layer[0-9]+(-layer[0-9]+)?)");
  const auto& names = recompute_names();
  if (std::find(names.begin(), names.end(), value) != names.end() || std::regex_match(value, level)) return;
  throw Error(fmt::format("--recompute '{}': expected {} or a level such as blocks+layer1 (tally plan prints them)",
                          value, choices(names)));
}

namespace {
// "re-runs 3.6 GFLOP of forward per step: +33% of the step's 10.9 GFLOP without it".
std::string recompute_cost(const mbp::Plan& plan) {
  const FlopCount& f = plan.flops;
  const double step = f.total();
  if (step <= 0) return "no work counted";
  const auto flops = [](double v) {
    return v >= 1e15 ? fmt::format("{:.1f} PFLOP", v / 1e15)
           : v >= 1e12 ? fmt::format("{:.1f} TFLOP", v / 1e12)
                       : fmt::format("{:.1f} GFLOP", v / 1e9);
  };
  return fmt::format("re-runs {} of forward per step: +{:.0f}% of the step's {} without it", flops(f.recompute),
                     100.0 * f.recompute / (step - f.recompute), flops(step - f.recompute));
}

}  // namespace

std::string recompute_summary(const RecomputedPlan& chosen) {
  const std::string why = chosen.why.empty() ? "" : fmt::format(" (auto: {})", chosen.why);
  if (chosen.level == 0) return chosen.policy + why;
  return fmt::format("{} ({}){} — {}", chosen.policy, chosen.description, why, recompute_cost(*chosen.plan));
}

namespace {
// The level --recompute names: none, blocks, all, or an intermediate level as printed without
// spaces ("blocks+layer1", "blocks+layer1-layer2"); -1 for auto.
int recompute_level(nn::Module& model, const std::string& recompute) {
  const int levels = nn::recompute_levels(model);
  if (recompute == "auto") return -1;
  if (recompute == "none") return 0;
  if (recompute == "all") return levels - 1;
  if (recompute == "blocks") return std::min(1, levels - 1);
  std::string names;
  for (int level = 0; level < levels; ++level) {
    std::string name = nn::recompute_level_name(model, level);
    name.erase(std::remove(name.begin(), name.end(), ' '), name.end());
    if (name == recompute) return level;
    names += (names.empty() ? "" : "|") + name;
  }
  throw Error(fmt::format("--recompute '{}': expected auto or one of this model's levels {}", recompute, names));
}
}  // namespace

RecomputedPlan plan_with_recompute(mbp::Executor& executor, nn::Module& model, std::int64_t batch,
                                   std::optional<std::int64_t> micro_batch, const std::string& recompute) {
  const int levels = nn::recompute_levels(model), all = levels - 1;
  const int asked = recompute_level(model, recompute);
  RecomputedPlan r;
  auto set = [&](int level) {
    nn::set_recompute_level(model, level);
    executor.planner().forget();
    r.level = level;
    r.policy = nn::recompute_level_name(model, level);
    r.description = nn::recompute_level_description(model, level);
  };
  if (asked > 0) {
    set(asked);
    r.plan = &plan_step(executor, batch, micro_batch);
    return r;
  }
  set(0);
  try {
    r.plan = &plan_step(executor, batch, micro_batch);
    if (recompute == "auto") r.why = "a micro-batch fits without recomputation";
    return r;
  } catch (const OutOfMemory& without) {
    if (recompute == "auto") {
      for (int level = 1; level <= all; ++level) {
        set(level);
        try {
          r.plan = &plan_step(executor, batch, micro_batch);
        } catch (const OutOfMemory& e) {
          if (level < all) continue;
          throw OutOfMemory(fmt::format("{} (with --recompute all, the most recomputation there is: {}; without "
                                        "recomputation at least {})",
                                        e.what(), r.description, format_bytes(without.requested())),
                            e.requested());
        }
        r.why = fmt::format("without recomputation {}{}",
                            micro_batch ? "the given micro-batch does not fit" : "not even one sample fits",
                            level > 1 ? fmt::format(", nor with {}", nn::recompute_level_name(model, level - 1)) : "");
        return r;
      }
      throw;  // nothing to recompute in this model
    }
    // none: say what recomputing the most would need, then leave the model as it was.
    std::string with;
    if (all > 0) {
      set(all);
      try {
        const mbp::Plan& p = plan_step(executor, batch, micro_batch);
        with = fmt::format("; --recompute all ({}) fits micro-batches of {} (predicted peak {})", r.description,
                           p.micro_batch, format_bytes(p.predicted_peak));
      } catch (const OutOfMemory& e) {
        with = fmt::format("; with --recompute all ({}) it needs at least {}", r.description,
                           format_bytes(e.requested()));
      }
      set(0);
    }
    throw OutOfMemory(fmt::format("{}{}", without.what(), with), without.requested());
  }
}

}  // namespace tally::app
