// data/images.h — JPEG and PNG files decoded to 8-bit pixels: the image reader of a folder of
// pictures as a data set (torchvision's ImageFolder layout). Like data/formats.h, it parses bytes
// in memory, for the loaders and the fuzz harness alike (fuzz/fuzz_image.cpp).
//
//   * The format is told by the magic bytes, not the file's name: JPEG (FF D8 FF) through
//     libjpeg-turbo's TurboJPEG API, PNG (89 50 4E 47 0D 0A 1A 0A) through libpng.
//   * The header is read first; an image that declares more than `max_pixels` pixels (width x
//     height; default PIL's Image.MAX_IMAGE_PIXELS, 89,478,485) is refused before one pixel is
//     decoded, as is a zero-sized one.
//   * Pixels are converted as torchvision's loader converts them (PIL's Image.convert), so that the
//     same file gives the same bytes:
//       3 channels, RGB: grey replicated; a palette expanded (its transparency ignored); alpha
//         dropped, not composited; CMYK (JPEG) as PIL 9's cmyk2rgb, R = (255 - K) - (C (255 - K)
//         + 128) / 255 rounded as PIL's MULDIV255;
//       1 channel, grey: a grey image as it is; colour as PIL's convert("L"), the ITU-R 601-2
//         luma L = (19595 R + 38470 G + 7471 B + 32768) >> 16 (of the RGB above);
//       16-bit PNG samples: RGB and RGBA keep their high byte (PIL's "RGB;16B"), grey is clipped
//         to 255 (PIL's "I" mode converted to "L").
//     JPEG decoding uses libjpeg-turbo's defaults, as PIL does (the accurate integer DCT, fancy
//     upsampling): the same pixels as PIL at full scale.
//   * DCT scaling: a JPEG may be decoded at 1/2, 1/4 or 1/8 of its size (`scale_denominator`),
//     the decoder's IDCT doing the reduction; PNG decodes at full size only.
//   * Anything malformed — a bad signature, a truncated file, corrupt data, a decoder's warning
//     (libjpeg-turbo fills a truncated scan with grey and warns: that is an error here, as PIL
//     raises "image file is truncated") — throws tally::FormatError naming `name`, what was
//     expected and what was found. Nothing reads outside the given bytes.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tally::data {

enum class ImageFormat { jpeg, png };
const char* image_format_name(ImageFormat f);  // "JPEG", "PNG"

// PIL's Image.MAX_IMAGE_PIXELS: beyond it PIL warns of a decompression bomb (and refuses twice it).
inline constexpr std::int64_t kDefaultMaxImagePixels = 89478485;

// What a file's header declares, read without decoding.
struct ImageHeader {
  ImageFormat format = ImageFormat::jpeg;
  std::int64_t width = 0, height = 0;
  int channels = 0;  // as stored: 1 grey, 2 grey + alpha, 3 colour, 4 RGBA or CMYK
};
// Whether the bytes start like a JPEG or a PNG file.
bool is_image(std::span<const std::uint8_t> bytes);
ImageHeader image_header(std::span<const std::uint8_t> bytes, const std::string& name);

struct DecodeOptions {
  int channels = 3;                                  // 3: RGB, 1: grey (above)
  std::int64_t max_pixels = kDefaultMaxImagePixels;  // of the header's width x height
  int scale_denominator = 1;                         // JPEG: 1, 2, 4 or 8; PNG: 1
};

// 8-bit pixels, height x width x channels (row-major, interleaved).
struct Image {
  std::int64_t width = 0, height = 0;
  int channels = 0;
  std::vector<std::uint8_t> pixels;
};
Image decode_image(std::span<const std::uint8_t> bytes, const std::string& name, const DecodeOptions& options = {});
// The same into `into`, whose pixel buffer is reused (a loader's thread decodes image after image
// without allocating).
void decode_image(std::span<const std::uint8_t> bytes, const std::string& name, const DecodeOptions& options,
                  Image& into);

}  // namespace tally::data
