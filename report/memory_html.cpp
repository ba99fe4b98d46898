// report/memory_html.cpp — the memory report page; see report/memory_html.h.
//
// The C++ side pairs every allocation of the trace with its free (by offset: the arena never
// hands out a live block twice) and writes the pairs as one flat array; everything the page
// shows — the stacking, the peak and what is live there — is computed by the page's script from
// that array, so the figures and the picture cannot disagree.
#include "report/memory_html.h"

#include <map>
#include <set>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "report/assets.h"

namespace tally::report {

namespace {

// The template with its slots filled: each "{{name}}" replaced by the value of the slot `name`, in
// one pass (what a value holds is never read as a slot). A slot of the template without a value,
// or a value the template has no slot for, is an Error: report/assets/memory.html and this file
// disagree.
std::string fill(std::string_view page, const std::map<std::string_view, std::string_view>& slots) {
  std::size_t bytes = page.size();
  for (const auto& [name, value] : slots) bytes += value.size();
  std::string out;
  out.reserve(bytes);
  std::set<std::string_view> used;
  std::size_t at = 0;
  for (std::size_t open; (open = page.find("{{", at)) != std::string_view::npos;) {
    const std::size_t close = page.find("}}", open);
    const std::string_view name = page.substr(open + 2, close == std::string_view::npos ? 0 : close - open - 2);
    const auto slot = slots.find(name);
    if (close == std::string_view::npos || slot == slots.end())
      throw Error(fmt::format("the memory report's template has a slot {{{{{}}}}} without a value", name));
    out.append(page.substr(at, open - at)).append(slot->second);
    used.insert(name);
    at = close + 2;
  }
  if (used.size() != slots.size()) throw Error("the memory report's template lacks a slot the page fills");
  out.append(page.substr(at));
  return out;
}

// Indexes of `s` in `table`, added when new.
int intern(std::map<std::string, int>& index, std::vector<std::string>& table, const std::string& s) {
  const auto [it, added] = index.emplace(s, static_cast<int>(table.size()));
  if (added) table.push_back(s);
  return it->second;
}

}  // namespace

std::string memory_html(const Arena& traced, const MemoryPage& page) {
  using nlohmann::json;
  const std::vector<TraceEvent>& trace = traced.trace();
  std::vector<std::string> modules, ops;
  std::map<std::string, int> module_index, op_index;
  json allocs = json::array(), base_frees = json::array(), times = json::array();
  std::map<std::size_t, std::size_t> live;  // offset -> index of its allocation in `allocs` / 8
  std::int64_t trace_peak = 0;
  for (int c = 0; c < kNumCategories; ++c) trace_peak += traced.trace_base()[static_cast<std::size_t>(c)];
  for (std::size_t e = 0; e < trace.size(); ++e) {
    const TraceEvent& t = trace[e];
    times.push_back(std::round(t.time_us * 10) / 10);
    trace_peak = std::max(trace_peak, t.total_after);
    if (t.is_alloc) {
      live[t.offset] = allocs.size() / 8;
      for (const json& v : {json(e), json(-1), json(t.rounded), json(t.requested), json(static_cast<int>(t.category)),
                           json(intern(module_index, modules, t.module)), json(intern(op_index, ops, t.op)),
                           json(static_cast<int>(t.phase))})
        allocs.push_back(v);
    } else if (const auto it = live.find(t.offset); it != live.end()) {
      allocs[it->second * 8 + 1] = e;
      live.erase(it);
    } else {  // a block live before the trace began
      base_frees.push_back({e, static_cast<int>(t.category), t.rounded});
    }
  }
  json marks = json::array();
  for (const Arena::TraceMark& m : traced.marks()) marks.push_back({m.event_index, m.label});
  json categories = json::array(), base = json::array();
  for (int c = 0; c < kNumCategories; ++c) {
    categories.push_back(category_name(static_cast<Category>(c)));
    base.push_back(traced.trace_base()[static_cast<std::size_t>(c)]);
  }
  json plan = json::array();
  for (const auto& [k, v] : page.plan) plan.push_back({k, v});
  json layers = json::array();
  const auto per_sample = [&](std::int64_t b) { return page.layer_batch > 0 ? b / page.layer_batch : b; };
  for (const LayerRow& r : page.layers)
    layers.push_back({r.name, r.type, r.depth, shape_str(r.output), r.parameters, per_sample(r.kept_bytes),
                      r.workspace_bytes});
  const json data = {{"title", page.title},
                     {"source", page.source},
                     {"budget", page.budget},
                     {"predicted", page.predicted_peak ? json(*page.predicted_peak) : json(nullptr)},
                     {"tracePeak", trace_peak},
                     {"microBatches", page.micro_batches},
                     {"categories", categories},
                     {"base", base},
                     {"baseFrees", base_frees},
                     {"modules", modules},
                     {"ops", ops},
                     {"phases", {"other", "forward", "backward", "recompute"}},
                     {"events", trace.size()},
                     {"t", times},
                     {"allocs", allocs},
                     {"marks", marks},
                     {"plan", plan},
                     {"layers", layers},
                     {"layerBatch", page.layer_batch}};
  // "</" would end the script element early: JSON lets it be written "<\/".
  std::string text = data.dump();
  for (std::size_t p = 0; (p = text.find("</", p)) != std::string::npos; p += 3) text.replace(p, 2, "<\\/");
  return fill(assets::memory_html, {{"memory.css", assets::memory_css}, {"data", text}, {"memory.js", assets::memory_js}});
}

}  // namespace tally::report
