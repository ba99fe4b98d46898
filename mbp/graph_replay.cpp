// mbp/graph_replay.cpp — whether micro-batches allocate alike; see mbp/graph_replay.h.
#include "mbp/graph_replay.h"

#include <cstdio>
#include <tuple>

#include <fmt/format.h>

namespace tally::mbp {

namespace {

using Event = std::tuple<bool, std::size_t, std::size_t>;  // allocation, offset, bytes

}  // namespace

ReplayCheck check_replay(const Arena& traced) {
  ReplayCheck r;
  const std::vector<TraceEvent>& events = traced.trace();
  // The micro-batches' marks ("micro-batch i/k (n samples)") and where each one's events end: the
  // next mark of any kind (the optimizer step, an all-reduce) or the trace's end.
  struct Span {
    std::size_t begin, end;
    std::int64_t samples;
  };
  std::vector<Span> spans;
  const auto& marks = traced.marks();
  for (std::size_t m = 0; m < marks.size(); ++m) {
    int i = 0, k = 0;
    long long n = 0;
    if (std::sscanf(marks[m].label.c_str(), "micro-batch %d/%d (%lld samples)", &i, &k, &n) != 3) continue;
    const std::size_t end = m + 1 < marks.size() ? marks[m + 1].event_index : events.size();
    spans.push_back({marks[m].event_index, end, n});
  }
  std::vector<std::vector<Event>> seen;
  for (const Span& s : spans) {
    std::vector<Event> mine;
    for (std::size_t e = s.begin; e < s.end; ++e)
      mine.emplace_back(events[e].is_alloc, events[e].offset, events[e].rounded);
    r.events += mine.size();
    std::size_t same = seen.size();
    for (std::size_t j = 0; j < seen.size(); ++j)
      if (seen[j] == mine) {
        same = j;
        break;
      }
    r.samples.push_back(s.samples);
    r.same_as.push_back(same);
    seen.push_back(std::move(mine));
  }
  return r;
}

std::string ReplayCheck::summary() const {
  if (same_as.empty()) return "no micro-batch marks in the trace";
  std::size_t patterns = 0;
  std::string parts;
  for (std::size_t i = 0; i < same_as.size(); ++i) {
    if (same_as[i] != i) continue;
    ++patterns;
    std::vector<std::size_t> members;
    for (std::size_t j = i; j < same_as.size(); ++j)
      if (same_as[j] == i) members.push_back(j + 1);
    const bool run = members.back() - members.front() + 1 == members.size();
    std::string who = members.size() == 1 ? fmt::format("{}", members[0])
                      : run ? fmt::format("{}-{}", members.front(), members.back())
                            : fmt::format("{} others", members.size());
    parts += fmt::format("{}{} ({} samples)", parts.empty() ? "" : "; ", who, samples[i]);
  }
  return fmt::format("{} micro-batches allocate in {} pattern{}: {}", same_as.size(), patterns,
                     patterns == 1 ? "" : "s", parts);
}

}  // namespace tally::mbp
