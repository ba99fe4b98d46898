// data/images.cpp — JPEG (TurboJPEG) and PNG (libpng) decoding; see data/images.h.
#include "data/images.h"

#include <png.h>
#include <turbojpeg.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "core/error.h"
#include "core/option_names.h"

namespace tally::data {

namespace {

using Bytes = std::span<const std::uint8_t>;

constexpr std::uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};

bool is_jpeg(Bytes b) { return b.size() >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff; }
bool is_png(Bytes b) { return b.size() >= 8 && std::memcmp(b.data(), kPngSignature, 8) == 0; }

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw FormatError(fmt::format("{}: {}", name, what));
}

void check_size(const ImageHeader& h, const std::string& name, std::int64_t max_pixels) {
  if (h.width < 1 || h.height < 1)
    fail(name, fmt::format("expected an image of at least 1 pixel, found {} wide and {} high", h.width, h.height));
  if (h.width > max_pixels / h.height)  // width * height > max_pixels, without overflow
    fail(name, fmt::format("the {} header declares {} wide x {} high = {} pixels, more than the bound of {} (a "
                           "decompression bomb? {} raises the bound)",
                           image_format_name(h.format), h.width, h.height, h.width * h.height, max_pixels,
                           option_name(Option::max_image_pixels)));
}

// ---- conversions, as PIL's Image.convert --------------------------------------------------------
std::uint8_t luma(std::uint32_t r, std::uint32_t g, std::uint32_t b) {
  return static_cast<std::uint8_t>((r * 19595u + g * 38470u + b * 7471u + 0x8000u) >> 16);
}
std::uint8_t muldiv255(std::uint32_t a, std::uint32_t b) {
  const std::uint32_t t = a * b + 128;
  return static_cast<std::uint8_t>(((t >> 8) + t) >> 8);
}

// `in`: n pixels of `from` channels (1 grey, 2 grey + alpha, 3 RGB, 4 RGBA, or CMYK when `cmyk`).
void convert(const std::uint8_t* in, int from, bool cmyk, std::size_t n, int to, std::uint8_t* out) {
  for (std::size_t i = 0; i < n; ++i, in += from, out += to) {
    std::uint8_t r, g, b;
    if (from <= 2) {
      if (to == 1) {
        out[0] = in[0];
        continue;
      }
      r = g = b = in[0];
    } else if (cmyk) {  // stored inverted (Adobe's convention, which PIL assumes for every CMYK JPEG)
      const std::uint32_t nk = in[3];
      r = static_cast<std::uint8_t>(nk - muldiv255(255u - in[0], nk));
      g = static_cast<std::uint8_t>(nk - muldiv255(255u - in[1], nk));
      b = static_cast<std::uint8_t>(nk - muldiv255(255u - in[2], nk));
    } else {
      r = in[0], g = in[1], b = in[2];
    }
    if (to == 1) {
      out[0] = luma(r, g, b);
    } else {
      out[0] = r, out[1] = g, out[2] = b;
    }
  }
}

// ---- JPEG ---------------------------------------------------------------------------------------
struct TjHandle {
  tjhandle h = tjInitDecompress();
  ~TjHandle() {
    if (h) tjDestroy(h);
  }
};
tjhandle tj(const std::string& name) {
  thread_local TjHandle handle;
  if (!handle.h) fail(name, "the JPEG decoder could not be created");
  return handle.h;
}

ImageHeader jpeg_header(Bytes b, const std::string& name) {
  int w = 0, h = 0, subsamp = 0, colorspace = 0;
  tjhandle d = tj(name);
  if (tjDecompressHeader3(d, b.data(), static_cast<unsigned long>(b.size()), &w, &h, &subsamp, &colorspace) != 0)
    fail(name, fmt::format("expected a JPEG header, found one libjpeg-turbo cannot read ({})", tjGetErrorStr2(d)));
  if (w < 1 || h < 1)  // libjpeg-turbo ends a stream cut before its frame header as if it were empty
    fail(name, "expected a JPEG header with the image's size (a SOF marker), found none before the file ends");
  ImageHeader out{ImageFormat::jpeg, w, h, 3};
  if (colorspace == TJCS_GRAY) out.channels = 1;
  if (colorspace == TJCS_CMYK || colorspace == TJCS_YCCK) out.channels = 4;
  return out;
}

void decode_jpeg(Bytes b, const std::string& name, const ImageHeader& h, const DecodeOptions& o, Image& img) {
  int count = 0;
  const tjscalingfactor* factors = tjGetScalingFactors(&count);
  const tjscalingfactor* sf = nullptr;
  for (int i = 0; i < count; ++i)
    if (factors[i].num == 1 && factors[i].denom == o.scale_denominator) sf = &factors[i];
  if (!sf) fail(name, fmt::format("expected a JPEG scale of 1/1, 1/2, 1/4 or 1/8, found 1/{}", o.scale_denominator));
  const tjscalingfactor scale = *sf;
  const int w = TJSCALED(static_cast<int>(h.width), scale), ht = TJSCALED(static_cast<int>(h.height), scale);
  // As stored where that is what is wanted; colour through RGB; CMYK as it is, converted below.
  const int pf = h.channels == 4 ? TJPF_CMYK : (h.channels == 1 && o.channels == 1) ? TJPF_GRAY : TJPF_RGB;
  const int stored = tjPixelSize[pf];
  const bool direct = stored == o.channels && pf != TJPF_CMYK;  // decoded straight into the image
  thread_local std::vector<std::uint8_t> converted;
  std::vector<std::uint8_t>& raw = direct ? img.pixels : converted;
  raw.resize(static_cast<std::size_t>(w) * static_cast<std::size_t>(ht) * static_cast<std::size_t>(stored));
  tjhandle d = tj(name);
  // Warnings (a truncated or corrupt scan, which libjpeg-turbo would fill with grey) stop it; so
  // does a progressive file of more than 500 scans (a known way to make decoding slow).
  if (tjDecompress2(d, b.data(), static_cast<unsigned long>(b.size()), raw.data(), w, 0, ht, pf,
                    TJFLAG_STOPONWARNING | TJFLAG_LIMITSCANS) != 0)
    fail(name, fmt::format("expected JPEG data that decodes whole, found corrupt or truncated data ({})",
                           tjGetErrorStr2(d)));
  img.width = w, img.height = ht, img.channels = o.channels;
  if (!direct) {
    img.pixels.resize(static_cast<std::size_t>(w) * static_cast<std::size_t>(ht) * static_cast<std::size_t>(o.channels));
    convert(raw.data(), stored, pf == TJPF_CMYK, static_cast<std::size_t>(w) * static_cast<std::size_t>(ht), o.channels,
            img.pixels.data());
  }
}

// ---- PNG ----------------------------------------------------------------------------------------
// libpng reports errors by longjmp: the functions below that call it hold only plain data, and the
// C++ objects are made before and after.
struct PngRead {
  const std::uint8_t* data = nullptr;
  std::size_t size = 0, pos = 0;
  char error[256] = {};
  // What it found: the header, and the decoded rows (malloc'd) after the transforms below.
  std::uint32_t width = 0, height = 0;
  int color_type = 0, bit_depth = 0, channels = 0;
  std::size_t rowbytes = 0;
  std::uint8_t* rows = nullptr;
  png_bytep* pointers = nullptr;  // into rows, while libpng reads them
};

void png_read_bytes(png_structp png, png_bytep out, png_size_t n) {
  auto* r = static_cast<PngRead*>(png_get_io_ptr(png));
  if (n > r->size - r->pos) png_error(png, "the file ends before its image data does (truncated)");
  std::memcpy(out, r->data + r->pos, n);
  r->pos += n;
}
[[noreturn]] void png_fail(png_structp png, png_const_charp message) {
  auto* r = static_cast<PngRead*>(png_get_error_ptr(png));
  std::snprintf(r->error, sizeof r->error, "%s", message);
  png_longjmp(png, 1);
}
void png_warn(png_structp, png_const_charp) {}  // an ancillary chunk's bad CRC: libpng skips the chunk

// Reads the header, and the rows when `decode`: palettes expanded (their transparency ignored),
// grey of 1, 2 or 4 bits scaled to 8, colour of 16 bits cut to its high byte, grey of 16 bits kept
// (clipped by the caller). Returns false with r.error set on any failure.
bool png_run(PngRead& r, bool decode) {
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &r, png_fail, png_warn);
  if (!png) {
    std::snprintf(r.error, sizeof r.error, "libpng could not start");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (setjmp(png_jmpbuf(png))) {
    png_free(png, r.pointers);
    r.pointers = nullptr;
    png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
    std::free(r.rows);
    r.rows = nullptr;
    return false;
  }
  if (!info) png_error(png, "libpng could not start");
  png_set_read_fn(png, &r, png_read_bytes);
  png_set_user_limits(png, 0x7fffffff, 0x7fffffff);  // the caller's pixel bound decides
  png_read_info(png, info);
  r.width = png_get_image_width(png, info);
  r.height = png_get_image_height(png, info);
  r.color_type = png_get_color_type(png, info);
  r.bit_depth = png_get_bit_depth(png, info);
  if (decode) {
    if (r.color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
    if ((r.color_type & PNG_COLOR_MASK_COLOR) == 0 && r.bit_depth < 8) png_set_expand_gray_1_2_4_to_8(png);
    if ((r.color_type & PNG_COLOR_MASK_COLOR) != 0 && r.bit_depth == 16) png_set_strip_16(png);
    if (r.bit_depth == 16) png_set_swap(png);  // grey 16 in host order (little-endian machines)
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    r.channels = png_get_channels(png, info);
    r.rowbytes = png_get_rowbytes(png, info);
    r.rows = static_cast<std::uint8_t*>(std::malloc(r.rowbytes * r.height));
    if (!r.rows) png_error(png, "out of memory for the image");
    r.pointers = static_cast<png_bytep*>(png_malloc(png, sizeof(png_bytep) * r.height));
    for (std::uint32_t y = 0; y < r.height; ++y) r.pointers[y] = r.rows + r.rowbytes * y;
    png_read_image(png, r.pointers);
    png_free(png, r.pointers);
    r.pointers = nullptr;
    png_read_end(png, nullptr);
  }
  png_destroy_read_struct(&png, &info, nullptr);
  return true;
}

ImageHeader png_header(Bytes b, const std::string& name) {
  PngRead r;
  r.data = b.data();
  r.size = b.size();
  if (!png_run(r, false)) fail(name, fmt::format("expected a PNG header, found one libpng refuses ({})", r.error));
  const bool colour = (r.color_type & PNG_COLOR_MASK_COLOR) != 0, alpha = (r.color_type & PNG_COLOR_MASK_ALPHA) != 0;
  return {ImageFormat::png, r.width, r.height, (colour ? 3 : 1) + (alpha ? 1 : 0)};
}

void decode_png(Bytes b, const std::string& name, const DecodeOptions& o, Image& img) {
  if (o.scale_denominator != 1)
    fail(name, fmt::format("expected a scale of 1/1 for a PNG file, found 1/{}", o.scale_denominator));
  PngRead r;
  r.data = b.data();
  r.size = b.size();
  if (!png_run(r, true)) fail(name, fmt::format("expected PNG data that decodes whole, found corrupt or truncated data ({})", r.error));
  const std::unique_ptr<std::uint8_t, decltype(&std::free)> rows(r.rows, &std::free);
  img.width = r.width, img.height = r.height, img.channels = o.channels;
  const std::size_t n = std::size_t(r.width) * r.height;
  img.pixels.resize(n * static_cast<std::size_t>(o.channels));
  if (r.bit_depth == 16 && (r.color_type & PNG_COLOR_MASK_COLOR) == 0) {  // grey 16: clipped to 255, as PIL
    std::vector<std::uint8_t> grey(n * static_cast<std::size_t>(r.channels));
    for (std::uint32_t y = 0; y < r.height; ++y) {
      const auto* row = reinterpret_cast<const std::uint16_t*>(r.rows + r.rowbytes * y);
      for (std::size_t i = 0; i < std::size_t(r.width) * static_cast<std::size_t>(r.channels); ++i)
        grey[std::size_t(y) * r.width * static_cast<std::size_t>(r.channels) + i] =
            static_cast<std::uint8_t>(std::min<std::uint16_t>(row[i], 255));
    }
    convert(grey.data(), r.channels, false, n, o.channels, img.pixels.data());
    return;
  }
  for (std::uint32_t y = 0; y < r.height; ++y)
    convert(r.rows + r.rowbytes * y, r.channels, false, r.width, o.channels,
            img.pixels.data() + std::size_t(y) * r.width * static_cast<std::size_t>(o.channels));
}

}  // namespace

const char* image_format_name(ImageFormat f) { return f == ImageFormat::jpeg ? "JPEG" : "PNG"; }

bool is_image(Bytes bytes) { return is_jpeg(bytes) || is_png(bytes); }

ImageHeader image_header(Bytes bytes, const std::string& name) {
  if (is_jpeg(bytes)) return jpeg_header(bytes, name);
  if (is_png(bytes)) return png_header(bytes, name);
  const std::size_t n = std::min<std::size_t>(bytes.size(), 8);
  std::string found;
  for (std::size_t i = 0; i < n; ++i) found += fmt::format("{}{:02x}", i ? " " : "", bytes[i]);
  fail(name, fmt::format("expected a JPEG (ff d8 ff) or PNG (89 50 4e 47 0d 0a 1a 0a) file, found {}",
                         bytes.empty() ? std::string("an empty file") : "bytes " + found));
}

void decode_image(Bytes bytes, const std::string& name, const DecodeOptions& o, Image& into) {
  if (o.channels != 1 && o.channels != 3)
    throw Error(fmt::format("decode_image: expected 1 or 3 channels, found {}", o.channels));
  if (o.max_pixels < 1) throw Error(fmt::format("decode_image: expected a pixel bound >= 1, found {}", o.max_pixels));
  const ImageHeader h = image_header(bytes, name);
  check_size(h, name, o.max_pixels);
  if (h.format == ImageFormat::jpeg)
    decode_jpeg(bytes, name, h, o, into);
  else
    decode_png(bytes, name, o, into);
}

Image decode_image(Bytes bytes, const std::string& name, const DecodeOptions& o) {
  Image img;
  decode_image(bytes, name, o, img);
  return img;
}

}  // namespace tally::data
