// data/resample.h — PIL's bilinear resize of 8-bit images, byte for byte: what torchvision 0.14's
// transforms (Resize, RandomResizedCrop: PIL's Image.resize with BILINEAR, after a crop) compute on
// a PIL image, so that a folder of pictures gives tally the pixels it gives torchvision.
//
// The algorithm is Pillow's ImagingResample (libImaging/Resample.c), for the triangle filter:
//   * per axis, scale = in / out and filterscale = max(scale, 1) (a reduction widens the filter:
//     antialiasing); output pixel x takes the input pixels within support = filterscale of its
//     centre (x + 0.5) * scale, weighted 1 - |d| / filterscale and normalised to sum 1;
//   * the weights as integers of 22 fractional bits, each output the rounded, clipped sum;
//   * two passes, horizontal first (only the rows the vertical pass needs), each rounded to 8 bits;
//     an axis whose size does not change is not resampled.
#pragma once
#include <cstdint>
#include <vector>

namespace tally::data {

// Resizes the region [x0, x0 + cw) x [y0, y0 + ch) of `src` (sw x sh pixels of `channels`
// interleaved bytes, row-major) to dw x dh pixels, treating the region as the whole image (as
// PIL's crop followed by resize does): the result, dw x dh x channels bytes.
std::vector<std::uint8_t> resize_bilinear(const std::uint8_t* src, int sw, int sh, int channels, int x0, int y0, int cw,
                                          int ch, int dw, int dh);
// The same into `out` (resized; its buffer reused, as the pass's own scratch is per thread).
void resize_bilinear(const std::uint8_t* src, int sw, int sh, int channels, int x0, int y0, int cw, int ch, int dw,
                     int dh, std::vector<std::uint8_t>& out);

}  // namespace tally::data
