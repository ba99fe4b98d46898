// examples/arena_demo.cpp — the arena in a few lines: reserve a budget, allocate tensors by
// category, watch the statistics, and export the allocation trace for Perfetto.
#include <fstream>

#include <fmt/format.h>

#include "core/memory.h"
#include "core/tensor.h"

int main() {
  using namespace tally;
  configure_arena(Device::cpu(), 64 << 20);  // the memory budget: 64 MiB
  auto arena = default_arena(Device::cpu());
  arena->set_tracing(true);
  Tensor w = Tensor::zeros({64, 64, 3, 3}, DType::Float32, Device::cpu(), Category::parameter, "conv.weight");
  {
    Tensor act = Tensor::empty({32, 64, 32, 32}, DType::Float32, Device::cpu(), Category::activation, "conv");
    fmt::print("live: {}  peak: {}\n", format_bytes(arena->stats().total.current), format_bytes(arena->stats().total.peak));
  }
  fmt::print("after the activation is freed: {} live, largest free block {}\n",
             format_bytes(arena->stats().total.current), format_bytes(arena->largest_free_block()));
  std::ofstream("arena_trace.json") << arena->trace_json();
  fmt::print("wrote arena_trace.json (open it in https://ui.perfetto.dev)\n");
}
