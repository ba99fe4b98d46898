// data/loader.cpp — the batch loader and its background thread; see data/loader.h.
#include "data/loader.h"

#include <omp.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "data/random.h"

namespace tally::data {

// ---- samples ------------------------------------------------------------------------------------

namespace {

void check_dataset(const Dataset& ds, bool normalize, const char* who) {
  if (ds.channels <= 0 || ds.height <= 0 || ds.width <= 0 || ds.num_classes <= 0)
    throw Error(fmt::format("{}: data set '{}' has shape C={} H={} W={} and {} classes: expected "
                            "all positive",
                            who, ds.name, ds.channels, ds.height, ds.width, ds.num_classes));
  const auto want = ds.generate ? std::size_t{0} : static_cast<std::size_t>(ds.size() * ds.sample_numel());
  if (ds.images.size() != want)
    throw Error(fmt::format("{}: data set '{}' has {} labels of {}x{}x{} images: expected {} "
                            "image values, found {}",
                            who, ds.name, ds.size(), ds.channels, ds.height, ds.width, want,
                            ds.images.size()));
  if (normalize) {
    if (ds.channels > 3)
      throw Error(fmt::format("{}: normalize needs at most 3 channels (mean/stddev), found {}",
                              who, ds.channels));
    for (std::int64_t c = 0; c < ds.channels; ++c)
      if (!(ds.stddev[c] > 0.0f))
        throw Error(fmt::format("{}: normalize needs stddev > 0, found stddev[{}] = {} in '{}'",
                                who, c, ds.stddev[c], ds.name));
  }
}

// Writes sample `idx` of ds into dst (C, H, W), augmented with the draw `aug` when augment.
void copy_sample(const Dataset& ds, std::int64_t idx, bool augment, std::uint64_t aug,
                 bool normalize, float* dst) {
  const std::int64_t label = ds.labels[static_cast<std::size_t>(idx)];
  if (label < 0 || label >= ds.num_classes)
    throw Error(fmt::format("data set '{}': sample {} has label {}: expected 0..{}", ds.name, idx,
                            label, ds.num_classes - 1));
  const std::int64_t C = ds.channels, H = ds.height, W = ds.width, plane = H * W;
  const float* src = nullptr;
  thread_local std::vector<float> drawn;  // a procedural sample, before augmentation
  if (augment && ds.generate_augmented) {  // the data set augments itself
    ds.generate_augmented(idx, aug, dst);
    src = dst;
    augment = false;
  } else if (ds.generate) {
    if (!augment) {
      ds.generate(idx, dst);
      src = dst;
    } else {
      drawn.resize(static_cast<std::size_t>(C * plane));
      ds.generate(idx, drawn.data());
      src = drawn.data();
    }
  } else {
    src = ds.images.data() + idx * C * plane;
  }
  if (!augment) {
    if (src != dst) std::copy(src, src + C * plane, dst);
  } else {
    // Crop offset (oy, ox) in 0..8 of the image padded by 4 zeros per side, then maybe a flip:
    // out(y, x) = in(y + oy - 4, flip ? W-1-x + ox - 4 : x + ox - 4), zero outside.
    const std::int64_t oy = static_cast<std::int64_t>(aug % 9) - 4;
    const std::int64_t ox = static_cast<std::int64_t>((aug >> 8) % 9) - 4;
    const bool flip = ((aug >> 16) & 1) != 0;
    for (std::int64_t c = 0; c < C; ++c) {
      const float* s = src + c * plane;
      float* d = dst + c * plane;
      for (std::int64_t y = 0; y < H; ++y) {
        const std::int64_t sy = y + oy;
        for (std::int64_t x = 0; x < W; ++x) {
          const std::int64_t sx = (flip ? W - 1 - x : x) + ox;
          d[y * W + x] = (sy >= 0 && sy < H && sx >= 0 && sx < W) ? s[sy * W + sx] : 0.0f;
        }
      }
    }
  }
  if (normalize) {
    for (std::int64_t c = 0; c < C; ++c) {
      const float m = ds.mean[static_cast<std::size_t>(c)];
      const float inv = 1.0f / ds.stddev[static_cast<std::size_t>(c)];
      float* d = dst + c * plane;
      for (std::int64_t i = 0; i < plane; ++i) d[i] = (d[i] - m) * inv;
    }
  }
}

}  // namespace

// ---- public: loader -----------------------------------------------------------------------------

Batch batch_at(const Dataset& ds, std::int64_t k, std::int64_t batch_size, bool normalize) {
  check_dataset(ds, normalize, "batch_at");
  if (batch_size <= 0 || k < 0 || ds.size() == 0)
    throw Error(fmt::format("batch_at: expected k >= 0, batch_size > 0 and a non-empty data set, "
                            "found k={}, batch_size={}, {} samples",
                            k, batch_size, ds.size()));
  const std::int64_t n = ds.size(), numel = ds.sample_numel();
  Batch b;
  b.size = batch_size;
  b.index = k;
  b.images.resize(static_cast<std::size_t>(batch_size * numel));
  b.labels.resize(static_cast<std::size_t>(batch_size));
  const std::int64_t first = static_cast<std::int64_t>(
      (static_cast<unsigned __int128>(k) * static_cast<std::uint64_t>(batch_size)) %
      static_cast<std::uint64_t>(n));
  for (std::int64_t j = 0; j < batch_size; ++j) {
    const std::int64_t idx = (first + j) % n;
    copy_sample(ds, idx, false, 0, normalize, b.images.data() + j * numel);
    b.labels[static_cast<std::size_t>(j)] = ds.labels[static_cast<std::size_t>(idx)];
  }
  return b;
}

// The worker and the caller share this state under `mu`. The worker builds batch `produce`
// of generation `generation` outside the lock and publishes it in `ready` only if no
// start_epoch has happened meanwhile; next() takes `ready` and lets the worker go on.
struct Loader::State {
  const Dataset& ds;
  LoaderOptions opt;
  std::int64_t batches = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool started = false;
  std::uint64_t generation = 0;
  std::int64_t epoch = 0;
  std::shared_ptr<const std::vector<std::int64_t>> order;  // sample indices of this epoch
  std::int64_t produce = 0;  // next batch the worker builds
  std::int64_t consume = 0;  // next batch next() returns
  std::optional<Batch> ready;
  std::vector<float> spare;  // a given-back batch's images buffer (give_back), for the next build
  std::exception_ptr error;
  std::thread worker;

  State(const Dataset& d, LoaderOptions o) : ds(d), opt(o) {}

  Batch build(std::int64_t k, const std::vector<std::int64_t>& ord, std::int64_t ep) {
    const std::int64_t start = k * opt.batch_size;
    const std::int64_t size = std::min(opt.batch_size, ds.size() - start);
    const std::int64_t numel = ds.sample_numel();
    Batch b;
    b.size = size;
    b.index = k;
    {
      std::lock_guard<std::mutex> lock(mu);
      b.images = std::move(spare);  // reused: no new pages to map and zero
    }
    b.images.resize(static_cast<std::size_t>(size * numel));
    b.labels.resize(static_cast<std::size_t>(size));
    const std::uint64_t aug_key = key(opt.seed, kTagAugment, static_cast<std::uint64_t>(ep));
    // Drawing procedural samples (large synthetic images) is the expensive part: spread it over
    // the cores. Every sample depends only on its position, so the batch is the same either way.
    std::exception_ptr err;
    const int threads = opt.workers > 0 ? opt.workers : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (ds.generate && size > 1)
    for (std::int64_t j = 0; j < size; ++j) {
      try {
        const std::int64_t pos = start + j, idx = ord[static_cast<std::size_t>(pos)];
        const std::uint64_t draw = opt.augment ? mix64(aug_key ^ static_cast<std::uint64_t>(pos)) : 0;
        copy_sample(ds, idx, opt.augment, draw, opt.normalize, b.images.data() + j * numel);
        b.labels[static_cast<std::size_t>(j)] = ds.labels[static_cast<std::size_t>(idx)];
      } catch (...) {
#pragma omp critical(tally_loader_error)
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return b;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || (started && !ready && !error && produce < batches); });
      if (stop) return;
      const std::int64_t k = produce++;
      const std::uint64_t gen = generation;
      const std::int64_t ep = epoch;
      const auto ord = order;
      lock.unlock();
      std::optional<Batch> built;
      std::exception_ptr err;
      try {
        built = build(k, *ord, ep);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      if (gen != generation) continue;  // start_epoch came meanwhile: drop it
      if (err)
        error = err;
      else
        ready = std::move(built);
      cv.notify_all();
    }
  }
};

Loader::Loader(const Dataset& ds, LoaderOptions opt) : state_(std::make_unique<State>(ds, opt)) {
  check_dataset(ds, opt.normalize, "Loader");
  if (opt.batch_size <= 0)
    throw Error(fmt::format("Loader: expected batch_size > 0, found {}", opt.batch_size));
  if (opt.workers < 0 || opt.workers > kMaxWorkers)
    throw Error(fmt::format("Loader: expected 0 to {} workers, found {}", kMaxWorkers, opt.workers));
  const std::int64_t n = ds.size();
  state_->batches = opt.drop_last ? n / opt.batch_size : (n + opt.batch_size - 1) / opt.batch_size;
  state_->worker = std::thread([s = state_.get()] { s->run(); });
}

Loader::~Loader() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
}

std::int64_t Loader::batches_per_epoch() const { return state_->batches; }

void Loader::start_epoch(std::int64_t epoch, std::int64_t first_batch) {
  if (first_batch < 0 || first_batch > state_->batches)
    throw Error(fmt::format("Loader::start_epoch: expected a first batch in [0, {}], found {}", state_->batches,
                            first_batch));
  auto ord = std::make_shared<std::vector<std::int64_t>>(static_cast<std::size_t>(state_->ds.size()));
  for (std::size_t i = 0; i < ord->size(); ++i) (*ord)[i] = static_cast<std::int64_t>(i);
  if (state_->opt.shuffle) {
    Rng rng(key(state_->opt.seed, kTagShuffle, static_cast<std::uint64_t>(epoch)));
    shuffle(*ord, rng);
  }
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->generation;
    state_->started = true;
    state_->epoch = epoch;
    state_->order = std::move(ord);
    state_->produce = first_batch;
    state_->consume = first_batch;
    state_->ready.reset();
    state_->error = nullptr;
  }
  state_->cv.notify_all();
}

void Loader::give_back(Batch&& batch) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (batch.images.capacity() > state_->spare.capacity()) state_->spare = std::move(batch.images);
}

std::optional<Batch> Loader::next() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.started) throw Error("Loader::next: expected start_epoch(epoch) to be called first");
  if (s.consume >= s.batches) return std::nullopt;
  s.cv.wait(lock, [&] { return s.ready.has_value() || s.error; });
  if (s.error) std::rethrow_exception(s.error);  // stays set: every later next() rethrows it
  std::optional<Batch> b = std::move(s.ready);
  s.ready.reset();
  ++s.consume;
  lock.unlock();
  s.cv.notify_all();
  return b;
}

}  // namespace tally::data
