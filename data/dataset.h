// data/dataset.h — a data set in host memory, the type every reader, generator and the loader share.
//
// All images are float in [0,1], layout (N, C, H, W); labels int64 in [0, classes). A data set holds
// its images, or draws each when it is needed (`generate`), and carries its usual per-channel
// normalisation constants.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tally::data {

struct Dataset {  // images in [0,1] float, CHW; labels int64
  std::int64_t channels = 0, height = 0, width = 0, num_classes = 0;
  std::vector<float> images;              // (N, C, H, W); empty when `generate` is set
  std::vector<std::int64_t> labels;       // (N)
  // A procedural data set draws sample i into dst (C*H*W values) when it is needed; it must be
  // safe to call from several threads at once.
  std::function<void(std::int64_t i, float* dst)> generate;
  // A generated data set with an augmentation of its own (a folder's random resized crop and
  // flip, data/folder.h): sample i drawn with the loader's per-sample draw (of (seed, epoch,
  // position)) when augmenting, instead of the loader's pad-crop-flip. Unset: the loader's.
  std::function<void(std::int64_t i, std::uint64_t draw, float* dst)> generate_augmented;
  std::array<float, 3> mean{}, stddev{};  // usual per-channel normalisation (first `channels` used)
  std::string name;
  // What a resumed run checks the data set against (docs/checkpoints.md): a folder's files (their
  // paths within it, sizes and content, data/folder.h, when FolderOptions::fingerprint asks for
  // them); empty where the data set has none.
  std::string fingerprint;

  std::int64_t size() const { return static_cast<std::int64_t>(labels.size()); }
  std::int64_t sample_numel() const { return channels * height * width; }  // C*H*W
};

struct Split {
  Dataset train, test;
};

}  // namespace tally::data
