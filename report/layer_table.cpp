// report/layer_table.cpp — per-layer costs from one observed dry forward; see report/layer_table.h.
#include "report/layer_table.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <typeinfo>

#include <fmt/format.h>

#include "core/dry_run.h"
#include "core/memory.h"
#include "mbp/planner.h"

namespace tally::report {

namespace {

std::string type_of(const nn::Module& m) {
  const char* raw = typeid(m).name();
  int status = 0;
  char* d = abi::__cxa_demangle(raw, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : raw;
  std::free(d);
  const auto colon = s.rfind("::");
  return colon == std::string::npos ? s : s.substr(colon + 2);
}

struct Info {
  std::string name;
  int depth = 0;
  bool leaf = true;
  std::int64_t own_params = 0;
};

void index(const nn::Module& m, const std::string& name, int depth, std::map<const nn::Module*, Info>& out) {
  Info i;
  i.name = name;
  i.depth = depth;
  const auto children = m.named_children();
  i.leaf = children.empty();
  std::int64_t all = 0, in_children = 0;
  for (const auto& [n, p] : m.named_parameters()) all += p.numel();
  for (const auto& [n, c] : children)
    for (const auto& [pn, p] : c->named_parameters()) in_children += p.numel();
  i.own_params = all - in_children;
  out[&m] = i;
  for (const auto& [n, c] : children) index(*c, name.empty() ? n : name + "." + n, depth + 1, out);
}

class Observer : public nn::ForwardObserver {
 public:
  Observer(const std::map<const nn::Module*, Info>& info, Arena& arena) : info_(info), arena_(arena) {}
  void before(const nn::Module& m) override {
    const ArenaStats s = arena_.stats();
    arena_.reset_peak();
    stack_.push_back(Frame{&m, s[Category::activation].current, s[Category::workspace].current, 0});
  }
  void after(const nn::Module& m, const Tensor& y) override {
    const Frame f = stack_.back();
    stack_.pop_back();
    const ArenaStats s = arena_.stats();
    const std::int64_t kept_total = s[Category::activation].current - f.act_before;
    if (!stack_.empty()) stack_.back().children_kept += kept_total;
    LayerRow r;
    auto it = info_.find(&m);
    if (it != info_.end()) {
      r.name = it->second.name.empty() ? "(model)" : it->second.name;
      r.depth = it->second.depth;
      r.leaf = it->second.leaf;
      r.parameters = it->second.own_params;
    } else {
      r.name = "(unregistered)";
    }
    r.type = type_of(m);
    if (y.defined() && y.dim() >= 1) r.output.assign(y.shape().begin() + 1, y.shape().end());
    r.kept_bytes = kept_total - f.children_kept;
    r.workspace_bytes = r.leaf ? s[Category::workspace].peak - f.ws_before : 0;
    if (r.leaf || r.kept_bytes != 0 || r.parameters != 0) rows.push_back(r);
  }
  std::vector<LayerRow> rows;

 private:
  struct Frame {
    const nn::Module* m;
    std::int64_t act_before, ws_before, children_kept;
  };
  const std::map<const nn::Module*, Info>& info_;
  Arena& arena_;
  std::vector<Frame> stack_;
};

}  // namespace

std::vector<LayerRow> layer_table(nn::Module& model, const Arena& arena, const Shape& sample_shape, std::int64_t batch,
                                  std::optional<DType> input, MemoryFormat format) {
  const auto params = model.parameters();
  if (params.empty()) throw Error("layer_table: the model has no parameters");
  if (batch < 1) throw Error(fmt::format("layer_table: batch must be >= 1, found {}", batch));
  const Device dev = params.front().device();
  std::map<const nn::Module*, Info> info;
  index(model, "", 0, info);
  if (arena.device() != dev)
    throw Error(fmt::format("layer_table: the arena is on {} but the model is on {}", arena.device().str(), dev.str()));
  const DryRun dry(arena, mbp::unbounded_capacity(arena));
  Observer obs(info, dry.arena());
  {
    nn::ForwardObserverScope watch(&obs);
    Shape xs{batch};
    xs.insert(xs.end(), sample_shape.begin(), sample_shape.end());
    Tensor x = Tensor::empty(xs, input.value_or(params.front().dtype()), dev, Category::input, "input");
    x = x.contiguous(format);  // as the step converts its staged input
    Tensor y = model(x);
  }
  return obs.rows;
}

// Bytes with a sign: a container's own ops can free more than they keep (a child's temporary
// output released when the container's code drops it).
std::string signed_bytes(std::int64_t b) {
  // (fmt, not "-" + string: GCC 12's -Wrestrict misreads the inlined insert of the latter)
  return b < 0 ? fmt::format("-{}", format_bytes(static_cast<std::size_t>(-b))) : format_bytes(static_cast<std::size_t>(b));
}

std::string format_layer_table(const std::vector<LayerRow>& rows, std::int64_t batch) {
  std::string s = fmt::format("{:<34} {:<22} {:<16} {:>11} {:>16} {:>12}\n", "layer", "type", "output", "parameters",
                              "kept per sample", "workspace");
  std::int64_t params = 0, kept = 0, ws = 0;
  for (const LayerRow& r : rows) {
    const std::string name = std::string(static_cast<std::size_t>(std::max(0, r.depth - 1)) * 2, ' ') + r.name;
    std::string out = r.output.empty() ? "" : shape_str(r.output);
    const std::string type = r.leaf ? r.type : r.type + " (own ops)";
    s += fmt::format("{:<34} {:<22} {:<16} {:>11} {:>16} {:>12}\n", name, type, out, r.parameters,
                     signed_bytes(r.kept_bytes / batch),
                     r.workspace_bytes > 0 ? format_bytes(static_cast<std::size_t>(r.workspace_bytes)) : "-");
    params += r.parameters;
    kept += r.kept_bytes;
    ws = std::max(ws, r.workspace_bytes);
  }
  s += fmt::format("{:<34} {:<22} {:<16} {:>11} {:>16} {:>12}\n", "total", "", "", params,
                   signed_bytes(kept / batch),
                   ws > 0 ? format_bytes(static_cast<std::size_t>(ws)) + " max" : "-");
  // The columns, explained where they are shown (tally plan --report's page says the same).
  s += "kept per sample: activation bytes still held when the call returns (its output and what it saved for the "
       "backward), per sample, less what its children's rows count: a container's row holds what its own code "
       "changed, negative when it freed more than it kept (children's outputs it consumed). workspace: the largest "
       "scratch a kernel of the call took, for the whole micro-batch.\n";
  return s;
}

}  // namespace tally::report
