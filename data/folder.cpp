// data/folder.cpp — a folder of pictures as a data set; see data/folder.h.
#include "data/folder.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"

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
// sorted by name); other files counted in `skipped` by extension.
std::vector<std::string> images_in(const fs::path& dir, std::map<std::string, std::int64_t>& skipped) {
  std::vector<std::pair<std::string, std::string>> found;  // (folder, name)
  for (const fs::directory_entry& e :
       fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink)) {
    if (!e.is_regular_file()) continue;
    if (!is_image_name(e.path())) {
      ++skipped[lower(e.path().extension().string())];
      continue;
    }
    found.emplace_back(e.path().parent_path().string(), e.path().filename().string());
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

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FormatError(fmt::format("{}: expected a readable image file, found none (it was listed)", path));
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw FormatError(fmt::format("{}: expected to read the whole file, found a read error", path));
  return bytes;
}

// Image `path` decoded as the options say, checked against height x width (transform none).
Image decoded(const std::string& path, const FolderOptions& o) {
  DecodeOptions d;
  d.channels = static_cast<int>(o.channels);
  d.max_pixels = o.max_pixels;
  Image img = decode_image(read_bytes(path), path, d);
  if (img.height != o.height || img.width != o.width)
    throw FormatError(fmt::format("{}: expected a {}x{} image (--input {}x{}x{} with --transform none), found {}x{}",
                                  path, o.height, o.width, o.channels, o.height, o.width, img.height, img.width));
  return img;
}

// HWC bytes to CHW floats in [0, 1], by the IDX and CIFAR readers' division.
void to_floats(const Image& img, float* dst) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[static_cast<std::size_t>(i)] = static_cast<float>(i) / 255.0f;
    return t;
  }();
  const std::size_t plane = static_cast<std::size_t>(img.height * img.width), C = static_cast<std::size_t>(img.channels);
  for (std::size_t p = 0; p < plane; ++p)
    for (std::size_t c = 0; c < C; ++c) dst[c * plane + p] = table[img.pixels[p * C + c]];
}

Dataset folder_dataset(const std::string& name, const std::vector<std::string>& files,
                       const std::vector<std::int64_t>& labels, std::int64_t classes, const FolderOptions& o) {
  Dataset ds;
  ds.name = name;
  ds.channels = o.channels, ds.height = o.height, ds.width = o.width, ds.num_classes = classes;
  ds.labels = labels;
  auto list = std::make_shared<const std::vector<std::string>>(files);
  ds.generate = [list, o](std::int64_t i, float* dst) { to_floats(decoded((*list)[static_cast<std::size_t>(i)], o), dst); };
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

FolderSet load_folder(const std::string& dir, const FolderOptions& o) {
  if (o.channels != 1 && o.channels != 3)
    throw Error(fmt::format("folder:{}: expected 1 or 3 channels (--input 1xHxW or 3xHxW), found {}", dir, o.channels));
  if (o.height < 1 || o.width < 1)
    throw Error(fmt::format("folder:{}: expected an image size (--input CxHxW), found {}x{}", dir, o.height, o.width));
  if (o.transform != "none")
    throw Error(fmt::format("folder:{}: expected --transform none, found '{}'", dir, o.transform));
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
      throw Error(fmt::format("folder:{}: --val-fraction splits the training images when there is no {}, found one",
                              dir, val.string()));
  } else if (o.val_fraction) {
    const double f = *o.val_fraction;
    if (!(f > 0 && f < 1)) throw Error(fmt::format("--val-fraction: expected a number in (0, 1), found {}", f));
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
  out.split.train = folder_dataset(fmt::format("folder:{} (train)", dir), tr.files, tr.labels, classes, o);
  out.split.test = folder_dataset(fmt::format("folder:{} (val)", dir), te.files, te.labels, classes, o);
  out.statistics = measure_statistics(out.split.train, tr.files);
  out.split.test.mean = out.split.train.mean;
  out.split.test.stddev = out.split.train.stddev;
  out.train_files = std::move(tr.files);
  out.test_files = std::move(te.files);
  return out;
}

}  // namespace tally::data
