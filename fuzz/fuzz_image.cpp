// fuzz/fuzz_image.cpp — libFuzzer harness for the image reader of data/images.h: image_header and
// decode_image (libjpeg-turbo's TurboJPEG API and libpng behind them).
//
// Every input is decoded to RGB and to grey, and a JPEG also at 1/2 and 1/8 scale, under a pixel
// bound of 2^22 (a header declaring more is refused before decoding, as the bound is meant to).
// Only tally's errors may come out; a decoded image must have the header's size (scaled) and
// exactly width x height x channels bytes.
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "data/images.h"
#include "fuzz/harness.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace tally;
  if (size > fuzz::kMaxInput) return 0;
  const auto b = fuzz::bytes(data, size);
  fuzz::expect_tally_errors_only([&] { (void)data::image_header(b, "fuzz input"); });
  for (const int channels : {3, 1})
    for (const int denominator : {1, 2, 8}) {
      fuzz::expect_tally_errors_only([&] {
        data::DecodeOptions o;
        o.channels = channels;
        o.max_pixels = std::int64_t(1) << 22;
        const data::ImageHeader h = data::image_header(b, "fuzz input");
        if (denominator != 1 && h.format != data::ImageFormat::jpeg) return;
        o.scale_denominator = denominator;
        const data::Image img = data::decode_image(b, "fuzz input", o);
        const std::int64_t w = (h.width + denominator - 1) / denominator, ht = (h.height + denominator - 1) / denominator;
        if (img.width != w || img.height != ht || img.channels != channels ||
            img.pixels.size() != static_cast<std::size_t>(w * ht * channels))
          throw std::logic_error("decode_image: the image does not have the header's size");
      });
    }
  return 0;
}
