// data/random.h — the portable randomness of the data sets: a splitmix64-style hash, keys made of
// several integers, a counter-based generator and a Fisher–Yates shuffle; what the loader's
// shuffles and augmentation draws and the synthetic images are drawn from. Internal to data/.
//
// Note [Portable randomness]: the shuffles, the augmentation draws and the synthetic images
// use only a splitmix64-style integer hash and generator written here — never the <random>
// distributions, whose outputs differ between standard libraries — and the synthetic images are
// computed in integer pixel levels (0..255) before the single conversion to float, so no
// floating-point contraction or rounding difference can change them between machines.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace tally::data {

// splitmix64 finaliser: a bijective mix of all 64 bits.
inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A key derived from several integers, order-sensitive.
inline std::uint64_t key(std::uint64_t a, std::uint64_t b, std::uint64_t c = 0) {
  return mix64(mix64(mix64(a) ^ b) ^ c);
}

// Domain tags keep the streams for different purposes apart.
constexpr std::uint64_t kTagShuffle = 0x53485546464c45ULL;  // "SHUFFLE"
constexpr std::uint64_t kTagAugment = 0x4155474d454e54ULL;  // "AUGMENT"
constexpr std::uint64_t kTagSynth = 0x53594e5448ULL;        // "SYNTH"
constexpr std::uint64_t kTagLabels = 0x4c4142454c53ULL;     // "LABELS"

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return mix64(state_);
  }
  // Uniform in [0, n), n > 0 (multiply-shift; the bias is below n / 2^64).
  std::uint64_t below(std::uint64_t n) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
  // Uniform integer in [lo, hi].
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(below(static_cast<std::uint64_t>(hi - lo + 1)));
  }

 private:
  std::uint64_t state_;
};

// Fisher–Yates with Rng: the same permutation on every machine.
inline void shuffle(std::vector<std::int64_t>& v, Rng& rng) {
  for (std::size_t i = v.size(); i > 1; --i) {
    std::size_t j = static_cast<std::size_t>(rng.below(i));
    std::swap(v[i - 1], v[j]);
  }
}

}  // namespace tally::data
