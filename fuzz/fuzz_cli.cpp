// fuzz/fuzz_cli.cpp — libFuzzer harness for the command-line value parsers: parse_size
// (core/arena.h), parse_device (core/device.h), parse_positive_integer and parse_memory_limit with
// its comma list per rank (apps/setup.h), every option's reading from text (apps/options.h), parse_batch_sizes
// (apps/sweep.h), parse_checkpoint_every (apps/run_state.h), parse_pipeline_split (mbp/pipeline.h)
// against ResNet-20's segments.
//
// Input: the first byte picks the parser (its value modulo 8, in the order of the switch), the
// rest is the text. Besides "no exception but tally's", each accepted value is checked against
// what the parser promises (positive sizes and counts).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "apps/options.h"
#include "apps/run_state.h"
#include "apps/setup.h"
#include "apps/sweep.h"
#include "core/arena.h"
#include "core/device.h"
#include "fuzz/harness.h"
#include "mbp/pipeline.h"
#include "nn/resnet.h"

namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::logic_error(what);
}

// ResNet-20's segments (stem, layer1.0 .. layer3.2, head), built once.
const std::vector<tally::nn::Module::Segment>& resnet20_segments() {
  static const auto model = tally::nn::make_model({"resnet20", 3, 10, tally::nn::Norm::Batch});
  static const auto segments = model->segments();
  return segments;
}

// A split's bounds: S + 1 strictly increasing segment indices from 0 to the segment count.
void check_bounds(const std::vector<std::size_t>& b, int stages, std::size_t segments) {
  require(b.size() == static_cast<std::size_t>(stages) + 1 && b.front() == 0 && b.back() == segments,
          "parse_pipeline_split returned bounds of the wrong length or ends");
  for (std::size_t i = 1; i < b.size(); ++i) require(b[i - 1] < b[i], "parse_pipeline_split returned an empty stage");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size < 1 || size > 4096) return 0;  // command-line values: a page is plenty
  const std::string s = fuzz::text(data + 1, size - 1);
  fuzz::expect_tally_errors_only([&] {
    switch (data[0] % 8) {
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
      case 3: {  // an option's value as text (apps/options.h): "name=value" into a run's saved options
        const std::size_t eq = s.find('=');
        std::map<std::string, std::string> values;
        for (const auto& [name, value] : app::option_values(app::TrainOptions{})) values[name] = value;
        values[s.substr(0, eq)] = eq == std::string::npos ? "" : s.substr(eq + 1);
        const app::TrainOptions o = app::options_from_values(values, "fuzz");
        std::map<std::string, std::string> again;
        for (const auto& [name, value] : app::option_values(o)) again[name] = value;
        require(app::option_values(app::options_from_values(again, "fuzz")) == app::option_values(o),
                "an option's text did not read back as itself");
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
      case 7: {  // --pipeline-split: as many stages as the text names cut points, and three
        const auto& segments = resnet20_segments();
        const int stages = 1 + static_cast<int>(std::count(s.begin(), s.end(), ',')) + 1;
        check_bounds(mbp::parse_pipeline_split(s, segments, stages), stages, segments.size());
        check_bounds(mbp::parse_pipeline_split(s, segments, 3), 3, segments.size());
        break;
      }
    }
  });
  return 0;
}
