// fuzz/harness.h — what every harness of fuzz/ shares: the input bound and the rule for outcomes.
//
// A harness hands its input to a parser of outside input (files, command-line values). Two
// outcomes are expected: the parser accepts the input, or it refuses it with one of tally's own
// exceptions (tally::Error and its subclasses FormatError, ShapeError, OutOfMemory), whose
// message names what was expected. Anything else is a finding: a crash, a sanitizer report, a
// hang, or any other exception (a std::out_of_range from a stray .at(), a std::bad_alloc from a
// size taken from a header on trust) — those escape the harness, and libFuzzer (or the replay
// driver, fuzz/replay_main.cpp) stops on them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/error.h"

namespace tally::fuzz {

// Inputs beyond this are skipped unread: every format here shows its bugs on small inputs, and
// a bound keeps a parser's legitimate allocations (which follow the input's size) small.
inline constexpr std::size_t kMaxInput = std::size_t(1) << 20;

// Runs `parse` and swallows tally's errors, the expected refusal of a malformed input.
template <class F>
void expect_tally_errors_only(F&& parse) {
  try {
    parse();
  } catch (const tally::Error&) {
  }
}

inline std::span<const std::uint8_t> bytes(const std::uint8_t* data, std::size_t size) { return {data, size}; }
inline std::string text(const std::uint8_t* data, std::size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

}  // namespace tally::fuzz
