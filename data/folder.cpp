// data/folder.cpp — a folder of pictures as a data set; see data/folder.h.
#include "data/folder.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <zlib.h>

#include "core/error.h"
#include "core/option_names.h"
#include "data/resample.h"

namespace tally::data {

namespace {

namespace fs = std::filesystem;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_image_name(const fs::path& p) {
  const std::string e = lower(p.extension().string());
  return e == ".jpg" || e == ".jpeg" || e == ".png";
}

// The class folders of `root`, sorted by name.
std::vector<std::string> class_folders(const fs::path& root) {
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(root, fs::directory_options::follow_directory_symlink))
    if (e.is_directory()) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The images under `dir` in torchvision's order (os.walk sorted by folder, then the files of each
// sorted by name); every other entry but a folder counted in `skipped`: regular files by extension,
// broken links and special files (FIFOs, sockets, devices) by kind. A folder that cannot be listed
// (a symbolic link that leads back into the folder, no permission) is an error naming it.
std::vector<std::string> images_in(const fs::path& dir, std::map<std::string, std::int64_t>& skipped) {
  std::vector<std::pair<std::string, std::string>> found;  // (folder, name)
  std::set<fs::path> folders{fs::weakly_canonical(dir)};   // each folder listed once: a loop is found at its link
  try {
    for (const fs::directory_entry& e :
         fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink)) {
      std::error_code ec;
      const fs::file_status st = e.status(ec);  // what a link leads to
      if (ec && ec != std::errc::no_such_file_or_directory)  // (a link to nothing: counted below)
        throw fs::filesystem_error("status", e.path(), ec);
      if (fs::is_directory(st)) {
        const fs::path target = fs::weakly_canonical(e.path());
        if (!folders.insert(target).second)
          throw FormatError(fmt::format("{}: expected a folder of images, found a second way into {} ({} leads there: "
                                        "a symbolic link loop, or two links to one folder, whose images would count "
                                        "twice)", dir.string(), target.string(), e.path().string()));
        continue;
      }
      if (!fs::is_regular_file(st)) {
        ++skipped[e.is_symlink(ec) && !fs::exists(st) ? kBrokenLink : kSpecialFile];
        continue;
      }
      if (!is_image_name(e.path())) {
        ++skipped[lower(e.path().extension().string())];
        continue;
      }
      found.emplace_back(e.path().parent_path().string(), e.path().filename().string());
    }
  } catch (const fs::filesystem_error& e) {
    const bool loop = e.code() == std::errc::too_many_symbolic_link_levels;
    throw FormatError(fmt::format("{}: expected a folder of images that can be listed, found {}{}", dir.string(),
                                  e.path1().empty() ? std::string("an error") : e.path1().string() + ": ",
                                  loop ? "too many levels of symbolic links (a link that leads back into the folder?)"
                                       : e.code().message()));
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  for (const auto& [folder, name] : found) paths.push_back((fs::path(folder) / name).string());
  return paths;
}

struct Listing {
  std::vector<std::string> files;
  std::vector<std::int64_t> labels;
};

Listing list_split(const fs::path& root, const std::vector<std::string>& classes,
                   std::map<std::string, std::int64_t>& skipped) {
  Listing l;
  for (std::size_t c = 0; c < classes.size(); ++c) {
    const std::vector<std::string> files = images_in(root / classes[c], skipped);
    if (files.empty())
      throw FormatError(fmt::format("{}: expected JPEG or PNG images (.jpg, .jpeg, .png) in class folder '{}', found "
                                    "none", (root / classes[c]).string(), classes[c]));
    l.files.insert(l.files.end(), files.begin(), files.end());
    l.labels.insert(l.labels.end(), files.size(), static_cast<std::int64_t>(c));
  }
  return l;
}

// The file's bytes, in this thread's buffer (reused from image to image: no allocation each time).
const std::vector<std::uint8_t>& read_bytes(const std::string& path) {
  thread_local std::vector<std::uint8_t> bytes;
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw FormatError(fmt::format("{}: expected a readable image file, found none (it was listed)", path));
  const std::streamoff size = f.tellg();
  bytes.resize(static_cast<std::size_t>(std::max<std::streamoff>(size, 0)));
  f.seekg(0);
  if (!f.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size())))
    throw FormatError(fmt::format("{}: expected to read its {} bytes, found a read error", path, size));
  return bytes;
}

// Image `path` decoded as the options say (in this thread's buffer, valid until its next call);
// with transform none, checked against height x width.
const Image& decoded(const std::string& path, const FolderOptions& o) {
  DecodeOptions d;
  d.channels = static_cast<int>(o.channels);
  d.max_pixels = o.max_pixels;
  thread_local Image img;
  decode_image(read_bytes(path), path, d, img);
  if (o.transform == "none" && (img.height != o.height || img.width != o.width))
    throw FormatError(fmt::format("{}: expected an image {} wide and {} high ({} {}x{}x{}, channels x height x "
                                  "width, with {} none), found one {} wide and {} high",
                                  path, o.width, o.height, option_name(Option::image_size), o.channels, o.height,
                                  o.width, option_name(Option::transform), img.width, img.height));
  return img;
}

// HWC bytes to CHW floats in [0, 1], by the IDX and CIFAR readers' division; mirrored when `flip`.
void to_floats(const std::uint8_t* pixels, std::int64_t height, std::int64_t width, std::int64_t channels, bool flip,
               float* dst) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[static_cast<std::size_t>(i)] = static_cast<float>(i) / 255.0f;
    return t;
  }();
  const auto H = static_cast<std::size_t>(height), W = static_cast<std::size_t>(width), C = static_cast<std::size_t>(channels);
  for (std::size_t y = 0; y < H; ++y)
    for (std::size_t x = 0; x < W; ++x) {
      const std::uint8_t* p = pixels + (y * W + (flip ? W - 1 - x : x)) * C;
      for (std::size_t c = 0; c < C; ++c) dst[(c * H + y) * W + x] = table[p[c]];
    }
}

// A stream of uniform numbers from one draw (splitmix64).
struct Draws {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53; }
  int integer(int lo, int hi) {  // in [lo, hi]
    return lo + static_cast<int>(static_cast<double>(next() >> 11) * 0x1.0p-53 * (hi - lo + 1));
  }
};

// torchvision's RandomResizedCrop.get_params (scale 0.08-1, ratio 3/4-4/3): ten tries of an area
// and a log-uniform aspect ratio, then the whole image cut to the ratio's bounds, centred.
struct Region {
  int x, y, w, h;
};
Region random_resized_crop(int W, int H, Draws& d) {
  const double area = static_cast<double>(W) * H, lo = std::log(3.0 / 4.0), hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * d.uniform(0.08, 1.0), ratio = std::exp(d.uniform(lo, hi));
    const int w = static_cast<int>(std::nearbyint(std::sqrt(target * ratio)));
    const int h = static_cast<int>(std::nearbyint(std::sqrt(target / ratio)));
    if (w > 0 && w <= W && h > 0 && h <= H) {
      const int y = d.integer(0, H - h), x = d.integer(0, W - w);
      return {x, y, w, h};
    }
  }
  const double in_ratio = static_cast<double>(W) / H;
  int w = W, h = H;
  if (in_ratio < 3.0 / 4.0) h = static_cast<int>(std::nearbyint(W / (3.0 / 4.0)));
  else if (in_ratio > 4.0 / 3.0) w = static_cast<int>(std::nearbyint(H * (4.0 / 3.0)));
  return {(W - w) / 2, (H - h) / 2, w, h};
}

// The ImageNet recipe's training view of file `path`: the random resized crop to height x width
// and, half the time, a horizontal flip. The crop is drawn from the header's size, so that with
// dct_scaling a JPEG whose crop is at least twice the output each way is decoded at 1/2, 1/4 or
// 1/8 (the largest that keeps the crop at least the output's size) and the crop taken there.
void training_view(const std::string& path, std::uint64_t draw, const FolderOptions& o, float* dst) {
  const std::vector<std::uint8_t>& bytes = read_bytes(path);
  const ImageHeader h = image_header(bytes, path);
  Draws d{draw};
  Region r = random_resized_crop(static_cast<int>(h.width), static_cast<int>(h.height), d);
  const bool flip = (d.next() >> 63) != 0;
  DecodeOptions dopt;
  dopt.channels = static_cast<int>(o.channels);
  dopt.max_pixels = o.max_pixels;
  if (o.dct_scaling && h.format == ImageFormat::jpeg)
    for (const int s : {8, 4, 2})
      if (r.w / s >= o.width && r.h / s >= o.height) {
        dopt.scale_denominator = s;
        break;
      }
  thread_local Image img;
  decode_image(bytes, path, dopt, img);
  if (const int s = dopt.scale_denominator; s > 1) {
    if (o.dct_scaled) o.dct_scaled->fetch_add(1, std::memory_order_relaxed);
    r.x /= s, r.y /= s;
    r.w = std::min<int>(r.w / s, static_cast<int>(img.width) - r.x);
    r.h = std::min<int>(r.h / s, static_cast<int>(img.height) - r.y);
  }
  thread_local std::vector<std::uint8_t> out;
  resize_bilinear(img.pixels.data(), static_cast<int>(img.width), static_cast<int>(img.height), img.channels, r.x, r.y,
                  r.w, r.h, static_cast<int>(o.width), static_cast<int>(o.height), out);
  to_floats(out.data(), o.height, o.width, o.channels, flip, dst);
}

// Its evaluation view: the shorter side resized to max(height, width) / 0.875 (torchvision's
// Resize(int)), then the centre height x width (CenterCrop, its offsets rounded half to even as
// Python's round).
void evaluation_view(const Image& img, const FolderOptions& o, float* dst) {
  const auto side = static_cast<std::int64_t>(static_cast<double>(std::max(o.height, o.width)) / 0.875);
  std::int64_t ow = side, oh = side;
  if (img.width <= img.height) oh = side * img.height / img.width;
  else ow = side * img.width / img.height;
  thread_local std::vector<std::uint8_t> full;
  resize_bilinear(img.pixels.data(), static_cast<int>(img.width), static_cast<int>(img.height), img.channels, 0, 0,
                  static_cast<int>(img.width), static_cast<int>(img.height), static_cast<int>(ow), static_cast<int>(oh),
                  full);
  const auto top = static_cast<std::int64_t>(std::nearbyint(static_cast<double>(oh - o.height) / 2.0));
  const auto left = static_cast<std::int64_t>(std::nearbyint(static_cast<double>(ow - o.width) / 2.0));
  thread_local std::vector<std::uint8_t> crop;
  crop.resize(static_cast<std::size_t>(o.height * o.width * o.channels));
  for (std::int64_t y = 0; y < o.height; ++y)
    std::copy_n(&full[static_cast<std::size_t>(((top + y) * ow + left) * o.channels)], o.width * o.channels,
                &crop[static_cast<std::size_t>(y * o.width * o.channels)]);
  to_floats(crop.data(), o.height, o.width, o.channels, false, dst);
}

// Sample i's view by `make` (which decodes and transforms); with skip_bad_images, a file that
// fails is recorded and the next one of its class in the list is tried, wrapping around (the
// label stays right).
template <class F>
void with_good_image(const std::vector<std::string>& files, const std::vector<std::int64_t>& labels, std::int64_t i,
                     const FolderOptions& o, BadImages& bad, F&& make) {
  const std::size_t n = files.size();
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t j = (static_cast<std::size_t>(i) + k) % n;
    if (labels[j] != labels[static_cast<std::size_t>(i)]) continue;
    const std::string& path = files[j];
    try {
      make(path);
      return;
    } catch (const FormatError& e) {
      if (!o.skip_bad_images) throw;
      bad.add(path, e.what());
    }
  }
  throw FormatError(fmt::format("{}: expected at least one image of its class that decodes, found none ({})",
                                fs::path(files[static_cast<std::size_t>(i)]).parent_path().string(),
                                option_name(Option::skip_bad_images)));
}

Dataset folder_dataset(const std::string& name, const std::vector<std::string>& files,
                       const std::vector<std::int64_t>& labels, std::int64_t classes, const FolderOptions& o,
                       const std::shared_ptr<BadImages>& bad) {
  Dataset ds;
  ds.name = name;
  ds.channels = o.channels, ds.height = o.height, ds.width = o.width, ds.num_classes = classes;
  ds.labels = labels;
  auto list = std::make_shared<const std::vector<std::string>>(files);
  auto classes_of = std::make_shared<const std::vector<std::int64_t>>(labels);
  if (o.transform == "none") {
    ds.generate = [list, classes_of, o, bad](std::int64_t i, float* dst) {
      with_good_image(*list, *classes_of, i, o, *bad, [&](const std::string& path) {
        const Image& img = decoded(path, o);
        to_floats(img.pixels.data(), img.height, img.width, img.channels, false, dst);
      });
    };
    return ds;
  }
  ds.generate = [list, classes_of, o, bad](std::int64_t i, float* dst) {
    with_good_image(*list, *classes_of, i, o, *bad, [&](const std::string& path) { evaluation_view(decoded(path, o), o, dst); });
  };
  ds.generate_augmented = [list, classes_of, o, bad](std::int64_t i, std::uint64_t draw, float* dst) {
    with_good_image(*list, *classes_of, i, o, *bad, [&](const std::string& path) { training_view(path, draw, o, dst); });
  };
  return ds;
}

// Per-channel mean and standard deviation over up to 512 images spread evenly over `files`.
std::string measure_statistics(Dataset& ds, const std::vector<std::string>& files) {
  const std::size_t n = std::min<std::size_t>(files.size(), 512), plane = static_cast<std::size_t>(ds.height * ds.width);
  std::vector<float> sample(static_cast<std::size_t>(ds.sample_numel()));
  std::array<double, 3> sum{}, sum_sq{};
  for (std::size_t k = 0; k < n; ++k) {
    ds.generate(static_cast<std::int64_t>(k * files.size() / n), sample.data());
    for (std::size_t c = 0; c < static_cast<std::size_t>(ds.channels); ++c)
      for (std::size_t p = 0; p < plane; ++p) {
        const double v = sample[c * plane + p];
        sum[c] += v;
        sum_sq[c] += v * v;
      }
  }
  const double count = static_cast<double>(n * plane);
  std::string means, stds;
  for (std::size_t c = 0; c < 3; ++c) {
    const std::size_t from = std::min<std::size_t>(c, static_cast<std::size_t>(ds.channels) - 1);
    const double m = sum[from] / count, var = std::max(0.0, sum_sq[from] / count - m * m);
    ds.mean[c] = static_cast<float>(m);
    ds.stddev[c] = static_cast<float>(std::sqrt(var));
    if (c < static_cast<std::size_t>(ds.channels)) {
      means += fmt::format(" {:.4f}", m);
      stds += fmt::format(" {:.4f}", std::sqrt(var));
    }
  }
  return fmt::format("mean{}, std{} (measured over {} training images)", means, stds, n);
}

}  // namespace

void BadImages::add(const std::string& path, const std::string& why) {
  const std::lock_guard<std::mutex> lock(mutex_);
  bad_.emplace(path, why);
}

std::map<std::string, std::string> BadImages::list() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return bad_;
}

const std::vector<std::string>& folder_transform_names() {
  static const std::vector<std::string> names{"imagenet", "none"};
  return names;
}

std::string files_fingerprint(const std::string& root, const std::vector<std::string>& files,
                              const std::vector<std::int64_t>& labels) {
  constexpr std::size_t kEdge = 16 * 1024;
  uLong crc = crc32(0L, Z_NULL, 0);
  auto fold = [&crc](const void* p, std::size_t n) { crc = crc32(crc, static_cast<const Bytef*>(p), static_cast<uInt>(n)); };
  std::uintmax_t total = 0;
  std::vector<char> buf(kEdge);
  for (std::size_t i = 0; i < files.size(); ++i) {
    const fs::path path(files[i]);
    const std::string rel = path.lexically_relative(root).generic_string();
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error(fmt::format("{}: cannot read it to check the data set ({})", files[i], std::strerror(errno)));
    in.seekg(0, std::ios::end);
    const auto size = static_cast<std::uintmax_t>(in.tellg());
    total += size;
    const std::int64_t label = i < labels.size() ? labels[i] : -1;
    fold(rel.data(), rel.size() + 1);  // with its terminating zero: "a" + "bc" differs from "ab" + "c"
    fold(&label, sizeof label);
    fold(&size, sizeof size);
    auto read_at = [&](std::uintmax_t at, std::uintmax_t n) {
      in.seekg(static_cast<std::streamoff>(at));
      in.read(buf.data(), static_cast<std::streamsize>(n));
      if (static_cast<std::uintmax_t>(in.gcount()) != n)
        throw Error(fmt::format("{}: expected {} bytes, read {} (the file changed while it was read?)", files[i], size,
                                at + static_cast<std::uintmax_t>(in.gcount())));
      fold(buf.data(), static_cast<std::size_t>(n));
    };
    read_at(0, std::min<std::uintmax_t>(size, kEdge));  // its start,
    if (size > kEdge) {                                // and the end that is not in the start
      const std::uintmax_t at = std::max<std::uintmax_t>(kEdge, size - kEdge);
      read_at(at, size - at);
    }
  }
  return fmt::format("{} files, {} bytes, crc32 {:08x}", files.size(), total, static_cast<std::uint32_t>(crc));
}

std::string skipped_text(const std::map<std::string, std::int64_t>& skipped) {
  std::string others;
  std::int64_t n_others = 0, broken = 0, special = 0;
  for (const auto& [key, n] : skipped) {
    if (key == kBrokenLink) {
      broken += n;
    } else if (key == kSpecialFile) {
      special += n;
    } else {
      n_others += n;
      others += fmt::format("{}{} {}", others.empty() ? "" : ", ", n, key.empty() ? "without an extension" : key);
    }
  }
  std::vector<std::string> parts;
  if (n_others > 0) parts.push_back(fmt::format("{} not .jpg, .jpeg or .png ({})", n_others, others));
  if (broken > 0) parts.push_back(fmt::format("{} broken symbolic link{}", broken, broken == 1 ? "" : "s"));
  if (special > 0)
    parts.push_back(fmt::format("{} not {} (FIFOs, sockets or devices)", special, special == 1 ? "a regular file" : "regular files"));
  return fmt::format("{}", fmt::join(parts, ", "));
}

FolderSet load_folder(const std::string& dir, const FolderOptions& o) {
  if (o.channels != 1 && o.channels != 3)
    throw Error(fmt::format("folder:{}: expected 1 or 3 channels ({} 1xHxW or 3xHxW), found {}", dir,
                            option_name(Option::image_size), o.channels));
  if (o.height < 1 || o.width < 1)
    throw Error(fmt::format("folder:{}: expected an image size ({} CxHxW), found {}x{}", dir,
                            option_name(Option::image_size), o.height, o.width));
  if (o.transform != "none" && o.transform != "imagenet")
    throw Error(fmt::format("folder:{}: expected {} imagenet or none, found '{}'", dir, option_name(Option::transform),
                            o.transform));
  const fs::path root(dir), train = root / "train", val = root / "val";
  std::error_code ec;
  if (!fs::is_directory(train, ec))
    throw FormatError(fmt::format("folder:{}: expected {} with one folder of images per class, found no such folder",
                                  dir, train.string()));
  FolderSet out;
  out.classes = class_folders(train);
  if (out.classes.empty())
    throw FormatError(fmt::format("{}: expected one folder of images per class, found no folder in it", train.string()));
  Listing tr = list_split(train, out.classes, out.skipped), te;
  if (fs::exists(fs::symlink_status(val, ec)) && !fs::is_directory(val, ec))
    throw FormatError(fmt::format("{}: expected the evaluation set, a folder of class folders of images, found {}", val.string(),
                                  fs::is_symlink(fs::symlink_status(val, ec)) && !fs::exists(val, ec)
                                      ? "a broken symbolic link" : "something else (a file?)"));
  if (fs::is_directory(val, ec)) {
    for (const std::string& c : class_folders(val))
      if (!std::binary_search(out.classes.begin(), out.classes.end(), c))
        throw FormatError(fmt::format("{}: class folder '{}' is not a class of {} (its classes: {})", val.string(), c,
                                      train.string(), fmt::join(out.classes, ", ")));
    for (std::size_t c = 0; c < out.classes.size(); ++c) {
      if (!fs::is_directory(val / out.classes[c], ec)) continue;
      for (const std::string& f : images_in(val / out.classes[c], out.skipped)) {
        te.files.push_back(f);
        te.labels.push_back(static_cast<std::int64_t>(c));
      }
    }
    if (o.val_fraction)
      throw Error(fmt::format("folder:{}: {} splits the training images when there is no {}, found one",
                              dir, option_name(Option::val_fraction), val.string()));
    if (te.files.empty())
      throw FormatError(fmt::format("{}: expected the evaluation set's images in class folders, found none (remove the "
                                    "empty folder to train without evaluation, or to hold out training images with "
                                    "{})", val.string(), option_name(Option::val_fraction)));
  } else if (o.val_fraction) {
    const double f = *o.val_fraction;
    if (!(f > 0 && f < 1))
      throw Error(fmt::format("{}: expected a number in (0, 1), found {}", option_name(Option::val_fraction), f));
    // A permutation of the files by the seed (splitmix64 keys); its first share is held out.
    std::vector<std::size_t> order(tr.files.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::vector<std::uint64_t> keys(order.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      std::uint64_t z = o.seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      keys[i] = z ^ (z >> 31);
    }
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
    const std::size_t held = std::max<std::size_t>(1, static_cast<std::size_t>(f * static_cast<double>(order.size())));
    std::vector<bool> is_held(order.size(), false);
    for (std::size_t i = 0; i < held && i < order.size(); ++i) is_held[order[i]] = true;
    Listing kept;
    for (std::size_t i = 0; i < tr.files.size(); ++i) {
      Listing& to = is_held[i] ? te : kept;
      to.files.push_back(tr.files[i]);
      to.labels.push_back(tr.labels[i]);
    }
    tr = std::move(kept);
  }
  const auto classes = static_cast<std::int64_t>(out.classes.size());
  out.bad_images = std::make_shared<BadImages>();
  out.split.train = folder_dataset(fmt::format("folder:{} (train)", dir), tr.files, tr.labels, classes, o, out.bad_images);
  out.bad_val_images = std::make_shared<BadImages>();
  FolderOptions val_options = o;
  val_options.skip_bad_images = true;  // (FolderSet::bad_val_images says why)
  out.split.test = folder_dataset(fmt::format("folder:{} (val)", dir), te.files, te.labels, classes, val_options,
                                  out.bad_val_images);
  out.statistics = measure_statistics(out.split.train, tr.files);
  if (o.fingerprint) {
    out.split.train.fingerprint = files_fingerprint(dir, tr.files, tr.labels);
    out.split.test.fingerprint = files_fingerprint(dir, te.files, te.labels);
  }
  out.split.test.mean = out.split.train.mean;
  out.split.test.stddev = out.split.train.stddev;
  out.train_files = std::move(tr.files);
  out.test_files = std::move(te.files);
  return out;
}

}  // namespace tally::data
