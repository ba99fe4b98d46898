// JPEG and PNG decoding (data/images.h) against PIL's pixels: the fixtures of
// tests/fixtures/images/ (make_images.py) are small textured files of every kind the reader takes —
// JPEG 4:2:0, 4:4:4, progressive, grey and CMYK; PNG RGB, RGBA, grey + alpha, palette with
// transparency, 1-bit, interlaced and 16-bit grey — each with the bytes Debian's PIL gives after
// convert("RGB") and convert("L") (and, for JPEG, at half scale through PIL's draft mode: the same
// DCT scaling). Every decode must equal them byte for byte. Then the bad files: each a FormatError
// naming the file and what was wrong.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/images.h"
#include "data/resample.h"

using namespace tally;

namespace {

const std::string kDir = std::string(TALLY_FIXTURES_DIR) + "/images/";

std::vector<std::uint8_t> read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("missing fixture " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::string error_of(const std::vector<std::uint8_t>& bytes, const data::DecodeOptions& o = {}) {
  try {
    (void)data::decode_image(bytes, "pic.bin", o);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "decoded";
}

}  // namespace

TEST(Images, EveryKindDecodesToPilsPixels) {
  for (const std::string name : {"rgb420.jpg", "rgb444.jpg", "progressive.jpg", "grey.jpg", "cmyk.jpg", "rgb.png",
                                 "rgba.png", "grey_alpha.png", "palette.png", "bilevel.png", "interlaced.png",
                                 "grey16.png"}) {
    SCOPED_TRACE(name);
    const std::vector<std::uint8_t> file = read(kDir + name);
    const std::string stem = kDir + name.substr(0, name.rfind('.'));
    const data::ImageHeader h = data::image_header(file, name);
    EXPECT_EQ(h.width, 37);
    EXPECT_EQ(h.height, 23);
    EXPECT_EQ(h.format, name.ends_with(".jpg") ? data::ImageFormat::jpeg : data::ImageFormat::png);
    for (const int channels : {3, 1}) {
      data::DecodeOptions o;
      o.channels = channels;
      const data::Image img = data::decode_image(file, name, o);
      EXPECT_EQ(img.width, 37);
      EXPECT_EQ(img.height, 23);
      EXPECT_EQ(img.channels, channels);
      const std::vector<std::uint8_t> want = read(stem + (channels == 3 ? ".rgb" : ".l"));
      ASSERT_EQ(img.pixels.size(), want.size());
      std::size_t differ = 0;
      for (std::size_t i = 0; i < want.size(); ++i) differ += img.pixels[i] != want[i];
      EXPECT_EQ(differ, 0u) << channels << " channels: " << differ << " of " << want.size() << " bytes differ from PIL's";
    }
    if (name.ends_with(".jpg")) {  // DCT scaling: PIL's draft mode at 1/2
      data::DecodeOptions o;
      o.scale_denominator = 2;
      const data::Image img = data::decode_image(file, name, o);
      EXPECT_EQ(img.width, 19);
      EXPECT_EQ(img.height, 12);
      EXPECT_EQ(img.pixels, read(stem + ".half.rgb")) << "at 1/2 scale";
    }
  }
}

TEST(Images, HeadersTellTheStoredChannels) {
  EXPECT_EQ(data::image_header(read(kDir + "grey.jpg"), "g").channels, 1);
  EXPECT_EQ(data::image_header(read(kDir + "cmyk.jpg"), "c").channels, 4);
  EXPECT_EQ(data::image_header(read(kDir + "rgba.png"), "a").channels, 4);
  EXPECT_EQ(data::image_header(read(kDir + "grey_alpha.png"), "la").channels, 2);
  EXPECT_TRUE(data::is_image(read(kDir + "rgb.png")));
  EXPECT_FALSE(data::is_image(std::vector<std::uint8_t>{'G', 'I', 'F', '8', '9', 'a'}));
}

TEST(Images, BadFilesAreErrorsNamingTheFileAndWhatWasWrong) {
  const std::vector<std::uint8_t> jpg = read(kDir + "rgb420.jpg"), png = read(kDir + "rgb.png");
  const auto expect = [](const std::string& error, const std::string& part) {
    EXPECT_NE(error.find(part), std::string::npos) << error;
    EXPECT_EQ(error.rfind("pic.bin: ", 0), 0u) << error;
  };
  expect(error_of({}), "expected a JPEG (ff d8 ff) or PNG (89 50 4e 47 0d 0a 1a 0a) file, found an empty file");
  expect(error_of({'G', 'I', 'F', '8', '9', 'a', 1, 0}), "found bytes 47 49 46 38 39 61 01 00");
  // Truncated: half of each file.
  expect(error_of({jpg.begin(), jpg.begin() + static_cast<std::ptrdiff_t>(jpg.size() / 2)}),
         "expected JPEG data that decodes whole, found corrupt or truncated data");
  expect(error_of({png.begin(), png.begin() + static_cast<std::ptrdiff_t>(png.size() / 2)}),
         "expected PNG data that decodes whole, found corrupt or truncated data");
  expect(error_of({jpg.begin(), jpg.begin() + 40}), "expected a JPEG header with the image's size");
  expect(error_of({png.begin(), png.begin() + 20}), "expected a PNG header");
  // A flipped byte in the PNG's image data: its CRC no longer matches.
  std::vector<std::uint8_t> bad = png;
  bad[bad.size() - 20] ^= 0x5a;
  expect(error_of(bad), "corrupt or truncated data");
  // The pixel bound, checked on the header before decoding; and the scale a PNG cannot take.
  data::DecodeOptions small;
  small.max_pixels = 37 * 23 - 1;
  expect(error_of(png, small), "the PNG header declares 37 wide x 23 high = 851 pixels, more than the bound of 850");
  expect(error_of(jpg, small), "the JPEG header declares 37 wide x 23 high = 851 pixels");
  small.max_pixels = 37 * 23;
  EXPECT_EQ(error_of(png, small), "decoded");
  data::DecodeOptions third;
  third.scale_denominator = 3;
  expect(error_of(jpg, third), "expected a JPEG scale of 1/1, 1/2, 1/4 or 1/8, found 1/3");
  third.scale_denominator = 2;
  expect(error_of(png, third), "expected a scale of 1/1 for a PNG file, found 1/2");
}

// A PNG whose header declares 100000 x 100000 pixels (10^10, a decompression bomb's signature) is
// refused from its header: nothing is allocated for it.
TEST(Images, ABombIsRefusedFromItsHeader) {
  std::vector<std::uint8_t> png = read(kDir + "rgb.png");
  // IHDR: length (4), "IHDR" (4), width (4), height (4), ...; then its CRC over type and data.
  const auto put32 = [&](std::size_t at, std::uint32_t v) {
    for (int i = 0; i < 4; ++i) png[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (24 - 8 * i));
  };
  put32(16, 100000);
  put32(20, 100000);
  std::uint32_t crc = 0xffffffffu;
  for (std::size_t i = 12; i < 29; ++i) {
    crc ^= png[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  put32(29, crc ^ 0xffffffffu);
  const data::ImageHeader h = data::image_header(png, "bomb.png");
  EXPECT_EQ(h.width, 100000);
  EXPECT_EQ(h.height, 100000);
  const std::string e = error_of(png);
  EXPECT_NE(e.find("declares 100000 wide x 100000 high = 10000000000 pixels, more than the bound of 89478485"), std::string::npos)
      << e;
}

// PIL's bilinear resize (data/resample.h) — torchvision's Resize and RandomResizedCrop on PIL
// images — byte for byte: reductions (antialiased), enlargements, one axis only, a crop then a
// resize, a 7x20 crop blown up to 224x224; RGB and grey.
TEST(Images, BilinearResizeIsPilsByteForByte) {
  const std::vector<std::uint8_t> file = read(kDir + "rgb.png");
  struct Case {
    int x, y, w, h, dw, dh;
  };
  for (const Case& c : {Case{0, 0, 37, 23, 20, 15}, Case{0, 0, 37, 23, 64, 50}, Case{0, 0, 37, 23, 37, 10},
                        Case{0, 0, 37, 23, 10, 23}, Case{3, 2, 30, 18, 16, 16}, Case{5, 1, 7, 20, 224, 224}})
    for (const int channels : {3, 1}) {
      const std::string name = fmt::format("rgb.resize-{}-{}-{}-{}-to-{}-{}.{}", c.x, c.y, c.w, c.h, c.dw, c.dh,
                                           channels == 3 ? "rgb" : "l");
      SCOPED_TRACE(name);
      data::DecodeOptions o;
      o.channels = channels;
      const data::Image img = data::decode_image(file, "rgb.png", o);
      const std::vector<std::uint8_t> got = data::resize_bilinear(img.pixels.data(), 37, 23, channels, c.x, c.y, c.w,
                                                                  c.h, c.dw, c.dh);
      const std::vector<std::uint8_t> want = read(kDir + name);
      ASSERT_EQ(got.size(), want.size());
      std::size_t differ = 0;
      for (std::size_t i = 0; i < want.size(); ++i) differ += got[i] != want[i];
      EXPECT_EQ(differ, 0u) << differ << " of " << want.size() << " bytes differ from PIL's";
    }
  EXPECT_THROW((void)data::resize_bilinear(file.data(), 37, 23, 3, 30, 0, 10, 23, 5, 5), Error) << "outside the image";
}
