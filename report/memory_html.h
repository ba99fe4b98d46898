// report/memory_html.h — one self-contained HTML page that shows every byte of a step
// (docs/memory-report.md): `tally plan --report FILE.html` and memory.html in a run folder.
//
// The page is built from an arena's trace (Arena::set_tracing) — the traced dry run of a plan or
// a measured step — and holds, with its scripts and styles inline (it opens from file:// with no
// network):
//   * the active-memory timeline: every allocation of the step a band, stacked as PyTorch's
//     memory_viz stacks them (each on top of those allocated before it that are still live), one
//     colour per category; the state that was live before the trace (parameters, gradients,
//     optimizer state) one band per category at the bottom; the budget line and the trace's
//     marks (micro-batches, the optimizer step); hovering a band names it — module path, op,
//     phase (forward, backward, recompute), category, requested and rounded bytes, when it was
//     allocated and freed, in which micro-batch — and a click keeps it; buttons zoom into one
//     micro-batch;
//   * the peak, explained: every byte live at the peak's first moment, by category and by module,
//     summing to the peak to the byte (computed by the page from the same data);
//   * the plan: what was chosen and why (label and value pairs from the caller), and the
//     per-layer table, sortable by any column, each column explained where it is shown.
// The allocations travel as one compact JSON array (string tables for modules and ops), so a
// ResNet-50 step of tens of thousands of allocations stays a few megabytes; the page draws on a
// canvas, a column of pixels at a time.
//
// The page's HTML, styles and script are files, report/assets/memory.html, memory.css and
// memory.js, compiled in (report/assets.h): memory_html() writes the data and fills the HTML's
// slots ({{memory.css}}, {{data}}, {{memory.js}}) with the three.
//
// A URL fragment "#select=MODULE" selects the first allocation of that module when the page
// loads (how the browser test stands for a click); script errors are written into the page
// (#errors) as well as to the console.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "report/layer_table.h"

namespace tally::report {

struct MemoryPage {
  std::string title;
  std::string source;  // what the trace is: "a traced dry run of every micro-batch of the step"
  std::size_t budget = 0;
  std::optional<std::size_t> predicted_peak;  // the plan's, shown beside the trace's own peak
  std::int64_t micro_batches = 0;             // of the step (the trace's marks show them)
  std::vector<std::pair<std::string, std::string>> plan;  // what was chosen, and why
  std::vector<LayerRow> layers;  // the per-layer table (empty: none)
  std::int64_t layer_batch = 1;  // the batch the table was measured at (its bytes shown per sample)
};

// The page for `traced`'s current trace.
std::string memory_html(const Arena& traced, const MemoryPage& page);

}  // namespace tally::report
