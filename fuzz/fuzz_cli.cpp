// fuzz/fuzz_cli.cpp — libFuzzer harness for the command-line value parsers: parse_size
// (core/arena.h), parse_device (core/device.h), parse_positive_integer, parse_micro_batch and
// parse_memory_limit with its comma list per rank (apps/setup.h), parse_batch_sizes
// (apps/sweep.h), parse_checkpoint_every (apps/run_state.h).
//
// Input: the first byte picks the parser (its value modulo 7, in the order of the switch), the
// rest is the text. Besides "no exception but tally's", each accepted value is checked against
// what the parser promises (positive sizes and counts).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "apps/run_state.h"
#include "apps/setup.h"
#include "apps/sweep.h"
#include "core/arena.h"
#include "core/device.h"
#include "fuzz/harness.h"

namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::logic_error(what);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size < 1 || size > 4096) return 0;  // command-line values: a page is plenty
  const std::string s = fuzz::text(data + 1, size - 1);
  fuzz::expect_tally_errors_only([&] {
    switch (data[0] % 7) {
      case 0: {
        require(parse_size(s) >= 1, "parse_size returned 0");
        const std::string number = s.substr(0, s.find_first_not_of("0123456789."));
        require(std::count(number.begin(), number.end(), '.') <= 1, "parse_size accepted a number with two points");
        break;
      }
      case 1: (void)parse_device(s); break;
      case 2: {
        const auto v = app::parse_positive_integer(s);
        require(!v || *v >= 1, "parse_positive_integer returned a value below 1");
        break;
      }
      case 3: {
        const auto v = app::parse_micro_batch(s);
        require(!v || *v >= 1, "parse_micro_batch returned a value below 1");
        break;
      }
      case 4:  // --memory-limit: one size per rank, as the trainer reads it
        for (const std::string& item : app::split_list(s))
          require(app::parse_memory_limit(item, Device::cpu()) >= Arena::kAlignment, "memory limit below granularity");
        break;
      case 5:
        for (const std::int64_t b : app::parse_batch_sizes(s)) require(b >= 1, "parse_batch_sizes returned b < 1");
        break;
      case 6: {
        const app::CheckpointEvery every = app::parse_checkpoint_every(s);
        require(s.empty() || every.steps >= 1 || (every.seconds > 0 && std::isfinite(every.seconds)),
                "parse_checkpoint_every accepted a value that is neither steps >= 1 nor a positive time");
        break;
      }
    }
  });
  return 0;
}
