// bench/bench_kernels.cpp — micro-benchmarks of the kernels every training step runs: GEMM,
// convolution forward / backward-data / backward-filter, batch norm and group norm forward and
// backward, ReLU, residual add, softmax cross-entropy, and the fused SGD / AdamW updates.
//
// Each benchmark runs on the CPU kernels (kernels/cpu) and, when a GPU is present, on the CUDA
// kernels (kernels/cuda) with the same shapes, so the two read side by side. Counters:
//   FLOP/s  for GEMM and convolutions (2 * multiply-adds of the mathematical operation),
//   bytes/s for memory-bound kernels (bytes that must be read and written at least once).
// On CUDA also: the fused batch norm + residual add + ReLU at ResNet-50's norm shapes in both memory
// formats and both activation types, against a device-to-device copy measured in the same process
// (counter of_copy: the norm's bytes/s over the copy's; the memory-bound issue's goal is >= 0.7).
// Inputs are fresh random numbers; kRotate independent input sets are cycled so that repeated
// iterations do not find their operands in cache. CUDA iterations end with a device
// synchronization (the time includes it; a launch is ~5 us, negligible at these sizes).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"
#include "tally/config.h"

namespace {

using tally::kernels::i64;
namespace kc = tally::kernels::cpu;
constexpr int kRotate = 4;

// `bytes` of host memory copied to fresh memory on GPU 0 (outside any arena: kernels alone).
void* device_copy(const void* host, std::size_t bytes) {
  void* p = tally::cuda_reserve(0, bytes);
#if TALLY_HAVE_CUDA
  tally::kernels::cuda::copy_from_host(p, host, bytes);
#else
  (void)host;
#endif
  return p;
}

// A float buffer on the host or on the GPU, filled with N(0, 1) numbers (labels: [0, classes)).
struct Buffer {
  bool cuda = false;
  std::size_t n = 0;
  float* p = nullptr;
  Buffer(bool on_cuda, std::size_t count, std::uint32_t seed, float scale = 1.f) : cuda(on_cuda), n(count) {
    std::vector<float> h(n);
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.f, scale);
    for (auto& x : h) x = d(rng);
    alloc_and_copy(h.data(), n * sizeof(float));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (cuda) tally::cuda_release(p);
    else std::free(p);
  }
  void alloc_and_copy(const void* h, std::size_t bytes) {
    if (cuda) {
      p = static_cast<float*>(device_copy(h, bytes));
    } else {
      p = static_cast<float*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
      std::memcpy(p, h, bytes);
    }
  }
};

struct Labels {
  bool cuda;
  i64* p = nullptr;
  Labels(bool on_cuda, i64 n, i64 classes) : cuda(on_cuda) {
    std::vector<i64> h(static_cast<std::size_t>(n));
    std::mt19937 rng(3);
    for (auto& x : h) x = static_cast<i64>(rng() % static_cast<std::uint32_t>(classes));
    const std::size_t bytes = h.size() * sizeof(i64);
    if (cuda) {
      p = static_cast<i64*>(device_copy(h.data(), bytes));
    } else {
      p = static_cast<i64*>(std::malloc(bytes));
      std::memcpy(p, h.data(), bytes);
    }
  }
  ~Labels() {
    if (cuda) tally::cuda_release(p);
    else std::free(p);
  }
};

// The kernel families of one backend, under one name, so a benchmark body serves both.
#define TALLY_BACKEND(NAME, NS, IS_CUDA, SYNC)                                                   \
  struct NAME {                                                                                  \
    static constexpr bool cuda = IS_CUDA;                                                        \
    static void sync() { SYNC; }                                                                 \
    template <class... A> static void gemm(A... a) { NS::gemm<float>(a...); }                    \
    template <class... A> static void conv_fwd(A... a) { NS::conv2d_forward<float>(a...); }      \
    template <class... A> static void conv_bwd_data(A... a) { NS::conv2d_backward_data<float>(a...); } \
    template <class... A> static void conv_bwd_filter(A... a) { NS::conv2d_backward_filter<float>(a...); } \
    static std::size_t conv_ws(const tally::kernels::Conv2dShape& s, tally::kernels::ConvPass p) { return NS::conv2d_workspace_bytes<float>(s, p); } \
    template <class... A> static void bn_fwd(A... a) { NS::batch_norm_forward_train<float>(a...); } \
    static std::size_t bn_ws(i64 N, i64 C, i64 HW) { return NS::batch_norm_workspace_bytes(N, C, HW); } \
    template <class... A> static void bn_bwd(A... a) { NS::batch_norm_backward<float>(a...); }  \
    template <class... A> static void gn_fwd(A... a) { NS::group_norm_forward<float>(a...); }   \
    template <class... A> static void gn_bwd(A... a) { NS::group_norm_backward<float>(a...); }  \
    template <class... A> static void relu(A... a) { NS::relu_forward<float>(a...); }          \
    template <class... A> static void add(A... a) { NS::add<float>(a...); }                    \
    template <class... A> static i64 ce_fwd(A... a) { return NS::cross_entropy_forward<float>(a...); } \
    template <class... A> static void ce_bwd(A... a) { NS::cross_entropy_backward<float>(a...); } \
    template <class... A> static void sgd(A... a) { NS::sgd_update<float>(a...); }             \
    template <class... A> static void adamw(A... a) { NS::adamw_update<float>(a...); }         \
  };

TALLY_BACKEND(Cpu, tally::kernels::cpu, false, (void)0)
#if TALLY_HAVE_CUDA
TALLY_BACKEND(Cuda, tally::kernels::cuda, true, tally::synchronize(tally::Device::cuda(0)))
#endif

template <class B>
void BM_Gemm(benchmark::State& st) {
  const i64 n = st.range(0);
  std::vector<std::unique_ptr<Buffer>> a, b;
  for (int r = 0; r < kRotate; ++r) {
    a.push_back(std::make_unique<Buffer>(B::cuda, n * n, 10 + r));
    b.push_back(std::make_unique<Buffer>(B::cuda, n * n, 20 + r));
  }
  Buffer c(B::cuda, n * n, 30);
  int i = 0;
  for (auto _ : st) {
    B::gemm(false, false, n, n, n, 1.f, a[i % kRotate]->p, n, b[i % kRotate]->p, n, 0.f, c.p, n);
    B::sync();
    ++i;
  }
  st.counters["FLOP/s"] = benchmark::Counter(2.0 * n * n * n, benchmark::Counter::kIsIterationInvariantRate);
}

// ResNet layer shapes: {N, C, H, W, K, R, stride}.
tally::kernels::Conv2dShape conv_shape(const benchmark::State& st) {
  tally::kernels::Conv2dShape s;
  s.N = st.range(0), s.C = st.range(1), s.H = s.W = st.range(2), s.K = st.range(3), s.R = s.S = st.range(4);
  s.stride_h = s.stride_w = st.range(5);
  s.pad_h = s.pad_w = s.R / 2;
  return s;
}
double conv_flops(const tally::kernels::Conv2dShape& s) {
  return 2.0 * static_cast<double>(s.N * s.K * s.P() * s.Q()) * static_cast<double>(s.C * s.R * s.S / s.groups);
}

using tally::kernels::ConvPass;

template <class B, ConvPass pass>
void BM_Conv(benchmark::State& st) {
  const tally::kernels::Conv2dShape s = conv_shape(st);
  const std::size_t xs = s.N * s.C * s.H * s.W, ws = s.K * s.C * s.R * s.S, ys = s.N * s.K * s.P() * s.Q();
  std::vector<std::unique_ptr<Buffer>> x, dy;
  for (int r = 0; r < kRotate; ++r) {
    x.push_back(std::make_unique<Buffer>(B::cuda, xs, 40 + r));
    dy.push_back(std::make_unique<Buffer>(B::cuda, ys, 50 + r));
  }
  Buffer w(B::cuda, ws, 60, 0.05f), out_x(B::cuda, xs, 61), out_w(B::cuda, ws, 62), out_y(B::cuda, ys, 63);
  const std::size_t wsb = B::conv_ws(s, pass);
  Buffer work(B::cuda, wsb / sizeof(float) + 1, 64);
  int i = 0;
  for (auto _ : st) {
    const int r = i % kRotate;
    if constexpr (pass == ConvPass::forward) B::conv_fwd(s, x[r]->p, w.p, static_cast<const float*>(nullptr), out_y.p, static_cast<void*>(work.p));
    if constexpr (pass == ConvPass::backward_data) B::conv_bwd_data(s, dy[r]->p, w.p, out_x.p, 0.f, static_cast<void*>(work.p));
    if constexpr (pass == ConvPass::backward_filter) B::conv_bwd_filter(s, x[r]->p, dy[r]->p, out_w.p, 1.f, static_cast<void*>(work.p));
    B::sync();
    ++i;
  }
  st.counters["FLOP/s"] = benchmark::Counter(conv_flops(s), benchmark::Counter::kIsIterationInvariantRate);
}

// Normalization over x (N, C, HW): forward reads x, writes y; backward reads dy, x, writes dx.
template <class B, bool group, bool backward>
void BM_Norm(benchmark::State& st) {
  const i64 N = st.range(0), C = st.range(1), HW = st.range(2) * st.range(2), G = 8;
  const std::size_t n = static_cast<std::size_t>(N * C * HW);
  std::vector<std::unique_ptr<Buffer>> x;
  for (int r = 0; r < kRotate; ++r) x.push_back(std::make_unique<Buffer>(B::cuda, n, 70 + r));
  Buffer y(B::cuda, n, 71), dy(B::cuda, n, 72), gamma(B::cuda, C, 73), beta(B::cuda, C, 74), dg(B::cuda, C, 75),
      db(B::cuda, C, 76);
  const i64 stats = group ? N * G : C;
  Buffer mean(B::cuda, stats, 77), invstd(B::cuda, stats, 78), rm(B::cuda, C, 79), rv(B::cuda, C, 80);
  Buffer work(B::cuda, B::bn_ws(N, C, HW) / sizeof(float) + 1, 81);
  void* ws = static_cast<void*>(work.p);
  // Saved statistics for the backward come from one real forward.
  if constexpr (group) B::gn_fwd(N, C, HW, G, x[0]->p, gamma.p, beta.p, 1e-5f, y.p, mean.p, invstd.p);
  else B::bn_fwd(N, C, HW, x[0]->p, gamma.p, beta.p, 1e-5f, 0.1f, static_cast<float*>(nullptr), static_cast<float*>(nullptr), y.p, mean.p, invstd.p, ws);
  int i = 0;
  for (auto _ : st) {
    const float* xr = x[i % kRotate]->p;
    if constexpr (!backward) {
      if constexpr (group) B::gn_fwd(N, C, HW, G, xr, gamma.p, beta.p, 1e-5f, y.p, mean.p, invstd.p);
      else B::bn_fwd(N, C, HW, xr, gamma.p, beta.p, 1e-5f, 0.1f, rm.p, rv.p, y.p, mean.p, invstd.p, ws);
    } else {
      if constexpr (group) B::gn_bwd(N, C, HW, G, dy.p, xr, gamma.p, mean.p, invstd.p, y.p, 0.f, dg.p, db.p, 1.f);
      else B::bn_bwd(N, C, HW, dy.p, xr, gamma.p, mean.p, invstd.p, y.p, 0.f, dg.p, db.p, 1.f, ws);
    }
    B::sync();
    ++i;
  }
  const double bytes = (backward ? 3.0 : 2.0) * static_cast<double>(n) * sizeof(float);
  st.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

template <class B, bool is_add>
void BM_Elementwise(benchmark::State& st) {
  const i64 n = st.range(0);
  std::vector<std::unique_ptr<Buffer>> a;
  for (int r = 0; r < kRotate; ++r) a.push_back(std::make_unique<Buffer>(B::cuda, n, 90 + r));
  Buffer b(B::cuda, n, 95), y(B::cuda, n, 96);
  int i = 0;
  for (auto _ : st) {
    if constexpr (is_add) B::add(n, a[i % kRotate]->p, b.p, 1.f, y.p);
    else B::relu(n, a[i % kRotate]->p, y.p);
    B::sync();
    ++i;
  }
  const double bytes = (is_add ? 3.0 : 2.0) * static_cast<double>(n) * sizeof(float);
  st.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
}

template <class B, bool backward>
void BM_CrossEntropy(benchmark::State& st) {
  const i64 N = st.range(0), C = st.range(1);
  Buffer logits(B::cuda, N * C, 100), loss(B::cuda, N, 101), w(B::cuda, N, 102), dloss(B::cuda, N, 103),
      dlogits(B::cuda, N * C, 104);
  Labels t(B::cuda, N, C);
  for (auto _ : st) {
    if constexpr (!backward) benchmark::DoNotOptimize(B::ce_fwd(N, C, logits.p, t.p, static_cast<const float*>(nullptr), i64{-100}, 0.f, loss.p, w.p));
    else B::ce_bwd(N, C, logits.p, t.p, static_cast<const float*>(nullptr), i64{-100}, 0.f, dloss.p, dlogits.p, 0.f);
    B::sync();
  }
  st.counters["bytes/s"] = benchmark::Counter((backward ? 2.0 : 1.0) * N * C * sizeof(float),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

template <class B, bool adamw>
void BM_Optimizer(benchmark::State& st) {
  const i64 n = st.range(0);
  Buffer p(B::cuda, n, 110), g(B::cuda, n, 111), m(B::cuda, n, 112), v(B::cuda, n, 113, 0.f);
  i64 step = 1;
  for (auto _ : st) {
    if constexpr (adamw) B::adamw(n, p.p, g.p, m.p, v.p, 1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, step++);
    else B::sgd(n, p.p, g.p, m.p, 0.1f, 0.9f, 0.f, 5e-4f, false, false);
    B::sync();
  }
  // SGD: read p, g, buf; write p, buf. AdamW: read p, g, m, v; write p, m, v.
  st.counters["bytes/s"] = benchmark::Counter((adamw ? 7.0 : 5.0) * n * sizeof(float),
                                              benchmark::Counter::kIsIterationInvariantRate);
}

// The CPU's channels-last fused batch norm + residual add + ReLU (what every ResNet block ends with),
// forward or backward (the residual's gradient written over dy, dx fresh), in float32 or bf16:
// x, y, r, dy, dx of (N, H, W, C). Bytes: forward reads x (twice: statistics, then normalizing)
// and r, writes y; backward reads dy, y, x twice and writes the residual's gradient and dx.
template <class T, bool backward>
void BM_NormNhwc(benchmark::State& st) {
  const i64 N = st.range(0), C = st.range(1), HW = st.range(2) * st.range(2);
  const std::size_t n = static_cast<std::size_t>(N * C * HW);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.2f, 1.f);
  auto fill = [&](std::size_t count) {
    std::vector<T> v(count);
    for (auto& e : v) e = T(d(rng));
    return v;
  };
  std::vector<T> x = fill(n), r = fill(n), y(n), dy = fill(n), dx(n);
  std::vector<float> gamma(static_cast<std::size_t>(C), 1.f), beta(static_cast<std::size_t>(C), 0.f),
      mean(static_cast<std::size_t>(C)), invstd(static_cast<std::size_t>(C)), dg(static_cast<std::size_t>(C)),
      db(static_cast<std::size_t>(C));
  std::vector<double> ws(kc::batch_norm_workspace_bytes(N, C, HW, true) / sizeof(double) + 1);
  tally::kernels::NormAct<T> act;
  act.residual = r.data(), act.relu = true, act.channels_last = true;
  kc::batch_norm_forward_train<T>(N, C, HW, x.data(), gamma.data(), beta.data(), 1e-5f, 0.1f, nullptr, nullptr,
                                  y.data(), mean.data(), invstd.data(), ws.data(), act);
  for (auto _ : st) {
    if constexpr (!backward) {
      kc::batch_norm_forward_train<T>(N, C, HW, x.data(), gamma.data(), beta.data(), 1e-5f, 0.1f, nullptr, nullptr,
                                      y.data(), mean.data(), invstd.data(), ws.data(), act);
    } else {
      tally::kernels::NormActGrad<T> g;
      g.y = y.data(), g.relu = true, g.dresidual = dy.data(), g.channels_last = true;  // dz over dy
      kc::batch_norm_backward<T>(N, C, HW, dy.data(), x.data(), gamma.data(), mean.data(), invstd.data(), dx.data(),
                                 0.f, dg.data(), db.data(), 0.f, ws.data(), g);
    }
    benchmark::ClobberMemory();
  }
  const double bytes = (backward ? 6.0 : 4.0) * static_cast<double>(n) * sizeof(T);
  st.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["avx512"] = kc::avx512_kernels() ? 1 : 0;
}

#if TALLY_HAVE_CUDA
namespace kg = tally::kernels::cuda;

// N(0.2, 1) numbers drawn once per process (the largest tensor's count and a margin), so that the
// many large buffers of the norm benchmarks cost a copy each rather than a draw each.
const std::vector<float>& random_pool(std::size_t n) {
  static std::vector<float> pool;
  if (pool.size() < n) {
    std::mt19937 rng(7);
    std::normal_distribution<float> d(0.2f, 1.f);
    pool.resize(n);
    for (auto& x : pool) x = d(rng);
  }
  return pool;
}

// n values of T on GPU 0 from the pool at `offset` (each buffer its own values; outside any
// arena: kernels alone).
template <class T>
struct DeviceValues {
  T* p = nullptr;
  DeviceValues(std::size_t n, std::size_t offset) {
    const std::vector<float>& pool = random_pool(n + 4096);
    std::vector<T> h(n);
    for (std::size_t i = 0; i < n; ++i) h[i] = T(pool[(i + offset) % pool.size()]);
    p = static_cast<T*>(device_copy(h.data(), n * sizeof(T)));
  }
  DeviceValues(const DeviceValues&) = delete;
  DeviceValues& operator=(const DeviceValues&) = delete;
  ~DeviceValues() { tally::cuda_release(p); }
};

// The ceiling: a device-to-device copy of 1 GiB (bytes read + bytes written per second), the best
// of 10 after a warm-up; measured once per process.
double device_copy_bandwidth() {
  static const double bandwidth = [] {
    const std::size_t bytes = std::size_t(1) << 30;
    void* a = tally::cuda_reserve(0, bytes);
    void* b = tally::cuda_reserve(0, bytes);
    kg::fill<float>(static_cast<i64>(bytes / sizeof(float)), 1.f, static_cast<float*>(a));
    kg::copy_bytes(b, a, bytes);
    tally::synchronize(tally::Device::cuda(0));
    double best = 0;
    for (int i = 0; i < 10; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      kg::copy_bytes(b, a, bytes);
      tally::synchronize(tally::Device::cuda(0));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * static_cast<double>(bytes) / s);
    }
    tally::cuda_release(a);
    tally::cuda_release(b);
    return best;
  }();
  return bandwidth;
}

void BM_CudaCopy(benchmark::State& st) {
  const std::size_t bytes = std::size_t(1) << 30;
  void* a = tally::cuda_reserve(0, bytes);
  void* b = tally::cuda_reserve(0, bytes);
  for (auto _ : st) {
    kg::copy_bytes(b, a, bytes);
    tally::synchronize(tally::Device::cuda(0));
  }
  st.counters["bytes/s"] = benchmark::Counter(2.0 * static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
  tally::cuda_release(a);
  tally::cuda_release(b);
}

// The fused batch norm + residual add + ReLU that ends every ResNet block, on CUDA: forward
// (x -> y with the residual) or backward (dx and the residual's gradient from dy and the mask y),
// NCHW or NHWC, float32 or bf16 activations. Bytes counted are the fewest that must move — each
// input read once, each output written once: forward x, r, y (3 n); backward dy, y, x, dx, dres
// (5 n) — so of_copy is the kernels' distance from the memory's limit, re-reads included.
// The activations of one size and type, made once and kept while the next benchmark takes the same
// (the registrations take each shape's variants in turn): filling seven buffers of up to 51 M values
// from the host took longer than the timing itself, again for each of Google Benchmark's trial runs.
template <class T>
struct NormValues {
  std::size_t n = 0;
  std::unique_ptr<DeviceValues<T>> x[2], res, y, dy, dx, dres;  // x: two inputs, taken in turn
};
template <class T>
NormValues<T>& norm_values(std::size_t n) {
  static auto* kept = new NormValues<T>();  // one per type: the float32 ones stay while bf16's are made
  if (kept->n != n) {
    *kept = NormValues<T>();  // the old buffers first
    for (std::size_t r = 0; r < 2; ++r) kept->x[r] = std::make_unique<DeviceValues<T>>(n, 1009 * r);
    kept->res = std::make_unique<DeviceValues<T>>(n, 2003);
    kept->y = std::make_unique<DeviceValues<T>>(n, 3001);
    kept->dy = std::make_unique<DeviceValues<T>>(n, 4001);
    kept->dx = std::make_unique<DeviceValues<T>>(n, 5003);
    kept->dres = std::make_unique<DeviceValues<T>>(n, 6007);
    kept->n = n;
  }
  return *kept;
}

template <class T, bool backward, bool nhwc>
void BM_CudaNormRelu(benchmark::State& st) {
  const i64 N = st.range(0), C = st.range(1), HW = st.range(2) * st.range(2);
  const std::size_t n = static_cast<std::size_t>(N * C * HW);
  NormValues<T>& v = norm_values<T>(n);
  DeviceValues<T> *x[2] = {v.x[0].get(), v.x[1].get()}, &res = *v.res, &y = *v.y, &dy = *v.dy, &dx = *v.dx,
                  &dres = *v.dres;
  Buffer gamma(true, C, 215), beta(true, C, 216), mean(true, C, 217), invstd(true, C, 218), dg(true, C, 219),
      db(true, C, 220);
  Buffer work(true, kg::batch_norm_workspace_bytes(N, C, HW, nhwc) / sizeof(float) + 1, 221);
  tally::kernels::NormAct<T> act;
  act.residual = res.p, act.relu = true, act.channels_last = nhwc;
  kg::batch_norm_forward_train<T>(N, C, HW, x[0]->p, gamma.p, beta.p, 1e-5f, 0.1f, nullptr, nullptr, y.p, mean.p,
                                  invstd.p, work.p, act);
  tally::kernels::NormActGrad<T> grad;
  grad.y = y.p, grad.relu = true, grad.dresidual = dres.p, grad.channels_last = nhwc;
  int i = 0;
  const double copy = device_copy_bandwidth();  // measured before the clock starts
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : st) {
    const T* xr = x[static_cast<std::size_t>(i++ % 2)]->p;
    if constexpr (!backward)
      kg::batch_norm_forward_train<T>(N, C, HW, xr, gamma.p, beta.p, 1e-5f, 0.1f, nullptr, nullptr, y.p, mean.p,
                                      invstd.p, work.p, act);
    else
      kg::batch_norm_backward<T>(N, C, HW, dy.p, xr, gamma.p, mean.p, invstd.p, dx.p, 0.f, dg.p, db.p, 0.f, work.p,
                                 grad);
    tally::synchronize(tally::Device::cuda(0));
  }
  const double bytes = (backward ? 5.0 : 3.0) * static_cast<double>(n) * sizeof(T);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.counters["bytes/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["of_copy"] = seconds > 0 ? bytes * static_cast<double>(st.iterations()) / seconds / copy : 0.0;
}

void register_cuda_norms() {
  benchmark::RegisterBenchmark("device_copy/cuda/1GiB", BM_CudaCopy)->UseRealTime();
  // ResNet-50's norm shapes at batch 64: the stem's 64x112², then each stage's widest (4x the
  // bottleneck's width) at its resolution; every tensor is several times the L2.
  const std::vector<std::vector<std::int64_t>> shapes = {{64, 64, 112}, {64, 256, 56}, {64, 512, 28},
                                                         {64, 1024, 14}, {64, 2048, 7}};
  using tally::kernels::bf16;
  for (const auto& a : shapes) {
    benchmark::RegisterBenchmark("batch_norm_relu_fwd/cuda/float32/nchw", BM_CudaNormRelu<float, false, false>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_bwd/cuda/float32/nchw", BM_CudaNormRelu<float, true, false>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_fwd/cuda/float32/nhwc", BM_CudaNormRelu<float, false, true>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_bwd/cuda/float32/nhwc", BM_CudaNormRelu<float, true, true>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_fwd/cuda/bf16/nchw", BM_CudaNormRelu<bf16, false, false>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_bwd/cuda/bf16/nchw", BM_CudaNormRelu<bf16, true, false>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_fwd/cuda/bf16/nhwc", BM_CudaNormRelu<bf16, false, true>)->Args(a)->UseRealTime();
    benchmark::RegisterBenchmark("batch_norm_relu_bwd/cuda/bf16/nhwc", BM_CudaNormRelu<bf16, true, true>)->Args(a)->UseRealTime();
  }
}
#endif

// Shapes: ResNet-20 (3x32x32) and ResNet-50 (224x224) layers at modest batch sizes.
template <class B>
void register_all(const std::string& dev) {
  auto name = [&](const char* what) { return std::string(what) + "/" + dev; };
  benchmark::RegisterBenchmark(name("gemm").c_str(), BM_Gemm<B>)->Arg(256)->Arg(1024);
  const std::vector<std::vector<std::int64_t>> convs = {
      {32, 16, 32, 16, 3, 1},   // ResNet-20 layer1
      {32, 64, 8, 64, 3, 1},    // ResNet-20 layer3
      {8, 64, 56, 64, 3, 1},    // ResNet-50 layer1 3x3
      {8, 256, 56, 64, 1, 1},   // ResNet-50 layer1 1x1 reduce
      {8, 256, 14, 256, 3, 1}}; // ResNet-50 layer3 3x3
  for (const auto& a : convs) {
    benchmark::RegisterBenchmark(name("conv_fwd").c_str(), BM_Conv<B, ConvPass::forward>)->Args(a);
    benchmark::RegisterBenchmark(name("conv_bwd_data").c_str(), BM_Conv<B, ConvPass::backward_data>)->Args(a);
    benchmark::RegisterBenchmark(name("conv_bwd_filter").c_str(), BM_Conv<B, ConvPass::backward_filter>)->Args(a);
  }
  for (const auto& a : std::vector<std::vector<std::int64_t>>{{32, 16, 32}, {8, 256, 56}}) {
    benchmark::RegisterBenchmark(name("batch_norm_fwd").c_str(), BM_Norm<B, false, false>)->Args(a);
    benchmark::RegisterBenchmark(name("batch_norm_bwd").c_str(), BM_Norm<B, false, true>)->Args(a);
    benchmark::RegisterBenchmark(name("group_norm_fwd").c_str(), BM_Norm<B, true, false>)->Args(a);
    benchmark::RegisterBenchmark(name("group_norm_bwd").c_str(), BM_Norm<B, true, true>)->Args(a);
  }
  benchmark::RegisterBenchmark(name("relu").c_str(), BM_Elementwise<B, false>)->Arg(1 << 20)->Arg(1 << 24);
  benchmark::RegisterBenchmark(name("add").c_str(), BM_Elementwise<B, true>)->Arg(1 << 20)->Arg(1 << 24);
  benchmark::RegisterBenchmark(name("cross_entropy_fwd").c_str(), BM_CrossEntropy<B, false>)->Args({256, 1000});
  benchmark::RegisterBenchmark(name("cross_entropy_bwd").c_str(), BM_CrossEntropy<B, true>)->Args({256, 1000});
  benchmark::RegisterBenchmark(name("sgd_update").c_str(), BM_Optimizer<B, false>)->Arg(25557032);
  benchmark::RegisterBenchmark(name("adamw_update").c_str(), BM_Optimizer<B, true>)->Arg(25557032);
}

}  // namespace

int main(int argc, char** argv) {
  register_all<Cpu>("cpu");
  for (const auto& a : std::vector<std::vector<std::int64_t>>{{128, 16, 32}, {16, 256, 56}}) {
    benchmark::RegisterBenchmark("batch_norm_relu_nhwc_fwd/cpu/float32", BM_NormNhwc<float, false>)->Args(a);
    benchmark::RegisterBenchmark("batch_norm_relu_nhwc_bwd/cpu/float32", BM_NormNhwc<float, true>)->Args(a);
    benchmark::RegisterBenchmark("batch_norm_relu_nhwc_fwd/cpu/bf16", BM_NormNhwc<tally::kernels::bf16, false>)->Args(a);
    benchmark::RegisterBenchmark("batch_norm_relu_nhwc_bwd/cpu/bf16", BM_NormNhwc<tally::kernels::bf16, true>)->Args(a);
  }
#if TALLY_HAVE_CUDA
  if (tally::cuda_device_count() > 0) {
    register_all<Cuda>("cuda");
    register_cuda_norms();
  } else {
    std::fprintf(stderr, "no GPU present: CUDA kernel benchmarks skipped\n");
  }
#else
  std::fprintf(stderr, "CUDA backend not built: CUDA kernel benchmarks skipped\n");
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
