// kernels/cpu/norm.cpp — batch norm and group norm over x (N, C, HW), PyTorch semantics.
// Statistics are accumulated in double with two passes (mean, then sum of squared deviations),
// so float inputs with a large mean do not lose the variance to cancellation.
// Parallelism: batch norm over channels, group norm over (n, g) for dx and over channels for
// dgamma / dbeta; every output element has exactly one writer and every sum is formed in a fixed
// order, so results do not depend on the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"

namespace tally::kernels::cpu {
namespace {

constexpr i64 kNormParallelThreshold = i64{1} << 14;

// beta == 0 overwrites (never reads out); otherwise out = beta * out + v, in P<T>.
template <class T>
inline void store(T* out, P<T> beta, double v) {
  using M = P<T>;
  if (beta == M(0)) {
    *out = static_cast<T>(v);
  } else {
    *out = T(beta * M(*out) + static_cast<M>(v));
  }
}

// y = (x - mean) * scale + b [+ r] [then max(0, .)] over one channel of (N, C, HW) (at x + c * HW,
// y + c * HW, r + c * HW): in double, or for a bf16 y in float32 (its one rounding to bf16
// dominates), so that the loop vectorizes. The residual is added to the normalized value rounded
// to T and the ReLU taken after, as the unfused ops would (bit for bit the same). R and A select
// the loop at compile time: one branch-free loop per combination.
template <bool R, bool A, class T>
void normalize_rows(i64 N, i64 CHW, i64 HW, const T* xc, const T* rc, T* yc, double mean, double scale, double b) {
  for (i64 n = 0; n < N; ++n) {
    const T* xp = xc + n * CHW;
    const T* rp = R ? rc + n * CHW : nullptr;
    T* yp = yc + n * CHW;
    if constexpr (std::is_same_v<T, bf16>) {
      const float sf = static_cast<float>(scale), bf = static_cast<float>(b - mean * scale);
      for (i64 i = 0; i < HW; ++i) {
        float v = float(bf16(float(xp[i]) * sf + bf));
        if constexpr (R) v = float(bf16(v + float(rp[i])));
        if constexpr (A) v = v < 0.f ? 0.f : v;  // relu_forward's: NaN and -0 pass
        yp[i] = bf16(v);
      }
    } else {
      for (i64 i = 0; i < HW; ++i) {
        T v = static_cast<T>((static_cast<double>(xp[i]) - mean) * scale + b);
        if constexpr (R) v = v + rp[i];
        if constexpr (A) v = v < T(0) ? T(0) : v;
        yp[i] = v;
      }
    }
  }
}

template <class T>
void normalize_channel(i64 N, i64 CHW, i64 HW, const T* xc, const T* rc, bool relu, T* yc, double mean, double scale,
                       double b) {
  if (rc && relu) normalize_rows<true, true>(N, CHW, HW, xc, rc, yc, mean, scale, b);
  else if (rc) normalize_rows<true, false>(N, CHW, HW, xc, rc, yc, mean, scale, b);
  else if (relu) normalize_rows<false, true>(N, CHW, HW, xc, rc, yc, mean, scale, b);
  else normalize_rows<false, false>(N, CHW, HW, xc, rc, yc, mean, scale, b);
}

// Per-channel sums over the N images of a (N, C, HW) tensor, in double: eight interleaved
// accumulators per sum (lane i % 8), added pairwise at the end. The order is fixed (the same for
// any thread count), and there is no single chain of dependent additions, so the loop runs at
// memory speed instead of one addition's latency per element.
struct Lanes {
  double v[8] = {};
  double total() const { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
};

// sum over n, i of x[n][c][i] (x: (N, C, HW), this channel c at `xc` = x + c * HW).
template <class T>
double channel_sum(i64 N, i64 CHW, i64 HW, const T* xc) {
  Lanes a;
  for (i64 n = 0; n < N; ++n) {
    const T* xp = xc + n * CHW;
    i64 i = 0;
    for (; i + 8 <= HW; i += 8)
      for (int j = 0; j < 8; ++j) a.v[j] += static_cast<double>(xp[i + j]);
    for (; i < HW; ++i) a.v[i % 8] += static_cast<double>(xp[i]);
  }
  return a.total();
}

// sum over n, i of (x - mean)^2.
template <class T>
double channel_ssd(i64 N, i64 CHW, i64 HW, const T* xc, double mean) {
  Lanes a;
  for (i64 n = 0; n < N; ++n) {
    const T* xp = xc + n * CHW;
    i64 i = 0;
    for (; i + 8 <= HW; i += 8)
      for (int j = 0; j < 8; ++j) {
        const double d = static_cast<double>(xp[i + j]) - mean;
        a.v[j] += d * d;
      }
    for (; i < HW; ++i) {
      const double d = static_cast<double>(xp[i]) - mean;
      a.v[i % 8] += d * d;
    }
  }
  return a.total();
}

// dy masked by a fused ReLU as relu_backward masks it: +0 where y <= 0, else dy (a NaN y passes
// dy). By a bit mask from the comparison, not a conditional: both loads happen and the loop has
// no branch per element (a branch on random signs made the fused backward 4x slower, measured).
template <bool A, class T>
inline T masked(const T* dyp, const T* yp, i64 i) {
  const T d = dyp[i];
  if constexpr (!A) {
    return d;
  } else if constexpr (std::is_same_v<T, bf16>) {
    const std::uint16_t keep = static_cast<std::uint16_t>(0u - static_cast<unsigned>(!(float(yp[i]) <= 0.f)));
    return bf16::from_bits(d.bits & keep);
  } else {
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    U b;
    std::memcpy(&b, &d, sizeof b);
    b &= U(0) - static_cast<U>(!(yp[i] <= T(0)));
    T r;
    std::memcpy(&r, &b, sizeof r);
    return r;
  }
}

// sum of dz and of dz * (x - mean), over n, i, where dz = dy (masked by y > 0 when A); with
// D = 1 dz is also stored into dr, with D = 2 added to it, with D = 3 stored over dy itself (dr is
// dy): the residual's gradient, in the same pass. Plain loops over the lanes through one pointer
// per array, no call per element: they vectorize (two names for one array would fail the
// compiler's overlap check and run the scalar loop).
template <bool A, int D, class T>
void channel_dy_sums(i64 N, i64 CHW, i64 HW, const T* dyc, const T* yc, const T* xc, double mean, T* drc,
                     double* sum_dy, double* sum_dy_xmu) {
  Lanes a, b;
  for (i64 n = 0; n < N; ++n) {
    const T* xp = xc + n * CHW;
    const T* dyp = D == 3 ? nullptr : dyc + n * CHW;
    const T* yp = A ? yc + n * CHW : nullptr;
    T* drp = D ? drc + n * CHW : nullptr;
    const T* src = D == 3 ? drp : dyp;
    auto one = [&](i64 i, int lane) __attribute__((always_inline)) {
      const T dz = masked<A>(src, yp, i);
      if constexpr (D == 1 || D == 3) drp[i] = dz;
      if constexpr (D == 2) drp[i] = T(P<T>(drp[i]) + P<T>(dz));
      const double d = static_cast<double>(dz);
      a.v[lane] += d;
      b.v[lane] += d * (static_cast<double>(xp[i]) - mean);
    };
    i64 i = 0;
    for (; i + 8 <= HW; i += 8)
      for (int j = 0; j < 8; ++j) one(i + j, j);
    for (; i < HW; ++i) one(i, static_cast<int>(i % 8));
  }
  *sum_dy = a.total();
  *sum_dy_xmu = b.total();
}

// *p = v; a bf16 by its bits: GCC's vectorizer does not take the struct's assignment (an aggregate
// copy), and the channels-last bf16 loops ran scalar with it (2.5 ms against float32's 1.1 ms).
template <class T>
inline void put(T* p, T v) {
  if constexpr (std::is_same_v<T, bf16>) p->bits = v.bits;
  else *p = v;
}

// f(A, D) with the fused ReLU's flag and the residual-gradient mode d (0..3, channel_dy_sums') as
// compile-time constants (std::bool_constant, std::integral_constant): one loop per combination.
template <class F>
void with_mask_and_residual(bool relu, int d, F f) {
  auto with_d = [&](auto a_tag) {
    switch (d) {
      case 0: f(a_tag, std::integral_constant<int, 0>{}); break;
      case 1: f(a_tag, std::integral_constant<int, 1>{}); break;
      case 2: f(a_tag, std::integral_constant<int, 2>{}); break;
      default: f(a_tag, std::integral_constant<int, 3>{}); break;
    }
  };
  if (relu) with_d(std::true_type{});
  else with_d(std::false_type{});
}

template <class T>
void channel_dy_sums(const NormActGrad<T>& act, i64 N, i64 CHW, i64 HW, i64 c, const T* dy, const T* x, double mean,
                     double* sum_dy, double* sum_dy_xmu) {
  const i64 o = c * HW;
  const T* y = act.relu ? act.y + o : nullptr;
  T* dr = act.dresidual ? act.dresidual + o : nullptr;
  const int d = !dr ? 0 : dr == dy + o ? 3 : act.beta_residual == P<T>(0) ? 1 : 2;
  with_mask_and_residual(act.relu, d, [&](auto a_tag, auto d_tag) {
    channel_dy_sums<decltype(a_tag)::value, decltype(d_tag)::value>(N, CHW, HW, dy + o, y, x + o, mean, dr, sum_dy,
                                                                    sum_dy_xmu);
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Batch norm.

// ---- channels-last: x (N, HW, C), rows of C channels --------------------------------------------
// Per-channel sums run over fixed chunks of rows (the count depends only on the shape), each into
// its own partial sums in the workspace, which are then added in chunk order: the same bits for
// any thread count. The per-element formulas are normalize_rows', masked's and DxRows' own, so a
// channels-last tensor is normalized exactly as its row-major twin (its sums may differ in the
// last bit of double: they are added in another order).
namespace {

// At most 256 chunks: enough to share among the threads, and partial sums of 4 KiB per channel
// at most (ResNet-50's stem at 293 samples would otherwise keep 15 MB of them at a backward's peak).
i64 nhwc_chunks(i64 rows, i64 /*C*/) { return std::min<i64>(rows, 256); }
i64 nhwc_rows_per_chunk(i64 rows, i64 C) {
  const i64 k = std::max<i64>(nhwc_chunks(rows, C), 1);
  return (rows + k - 1) / k;
}

namespace nhwc_base {
#include "kernels/cpu/norm_nhwc.inc"
}  // namespace nhwc_base

// The same kernels for CPUs with AVX-512 (16 float32 or 8 double lanes where the baseline x86-64
// build has SSE2's 4 / 2): about 1.4x on ResNet-20's batch norms. GCC only (the fuzz build's clang
// runs the baseline copy).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define TALLY_NHWC_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
// The target pragma resets -ffp-contract=off to GCC's default (fast): this copy's loops were
// contracted into FMAs, and on an AVX-512 CPU its float64 outputs differed from the baseline's in
// the last bits (MemoryFormatTest.Avx512AndBaselineBatchNormsGiveTheSameBits). Off again, here.
#pragma GCC optimize("fp-contract=off")
namespace nhwc_avx512 {
#include "kernels/cpu/norm_nhwc.inc"
}  // namespace nhwc_avx512
#pragma GCC pop_options
#else
#define TALLY_NHWC_AVX512 0
#endif

bool cpu_has_avx512() {
#if TALLY_NHWC_AVX512
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}
// On where the CPU has it, unless TALLY_CPU_ISA=baseline; set_avx512_kernels() changes it.
std::atomic<bool> g_avx512{[] {
  const char* isa = std::getenv("TALLY_CPU_ISA");
  return cpu_has_avx512() && !(isa != nullptr && std::string(isa) == "baseline");
}()};
bool nhwc_avx512_runs() { return g_avx512.load(std::memory_order_relaxed); }

template <class T>
void nhwc_forward_train(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_, P<T> eps,
                        P<T> momentum, P<T>* running_mean, P<T>* running_var, T* y, P<T>* save_mean,
                        P<T>* save_invstd, void* workspace, const NormAct<T>& act) {
#if TALLY_NHWC_AVX512
  if (nhwc_avx512_runs())
    return nhwc_avx512::nhwc_forward_train(N, C, HW, x, gamma, beta_, eps, momentum, running_mean, running_var, y,
                                           save_mean, save_invstd, workspace, act);
#endif
  nhwc_base::nhwc_forward_train(N, C, HW, x, gamma, beta_, eps, momentum, running_mean, running_var, y, save_mean,
                                save_invstd, workspace, act);
}

template <class T>
void nhwc_backward(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma, const P<T>* save_mean,
                   const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma, P<T>* dbeta, P<T> beta_param,
                   void* workspace, const NormActGrad<T>& act) {
#if TALLY_NHWC_AVX512
  if (nhwc_avx512_runs())
    return nhwc_avx512::nhwc_backward(N, C, HW, dy, x, gamma, save_mean, save_invstd, dx, beta_dx, dgamma, dbeta,
                                      beta_param, workspace, act);
#endif
  nhwc_base::nhwc_backward(N, C, HW, dy, x, gamma, save_mean, save_invstd, dx, beta_dx, dgamma, dbeta, beta_param,
                           workspace, act);
}

}  // namespace

bool set_avx512_kernels(bool on) {
  g_avx512 = on && cpu_has_avx512();
  return g_avx512;
}
bool avx512_kernels() { return nhwc_avx512_runs(); }

// Row-major: none. Channels-last: the partial sums of its chunks, (chunks, 2, C) doubles, seven
// per-channel rows of statistics and coefficients, and room for rows of float32 (a bf16
// forward's scale and shift; the backward's dx coefficients were float32 once, and the size is
// kept so that plans stay as they were).
std::size_t batch_norm_workspace_bytes(i64 N, i64 C, i64 HW, bool channels_last) {
  if (!channels_last || N <= 0 || C <= 0 || HW <= 0) return 0;
  return static_cast<std::size_t>(nhwc_chunks(N * HW, C) * 2 * C + 9 * C) * sizeof(double);
}

template <class T>
void batch_norm_forward_train(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                              P<T> eps, P<T> momentum, P<T>* running_mean, P<T>* running_var, T* y,
                              P<T>* save_mean, P<T>* save_invstd, void* workspace, NormAct<T> act) {
  using M_ = P<T>;
  const i64 M = N * HW;
  const i64 CHW = C * HW;
  if (act.channels_last) {
    if (C > 0 && M > 0)
      nhwc_forward_train(N, C, HW, x, gamma, beta_, eps, momentum, running_mean, running_var, y, save_mean, save_invstd,
                         workspace, act);
    return;
  }
#pragma omp parallel for schedule(static) if (N * C * HW > kNormParallelThreshold && C > 1)
  for (i64 c = 0; c < C; ++c) {
    const double sum = channel_sum(N, CHW, HW, x + c * HW);
    const double mean = M > 0 ? sum / static_cast<double>(M) : 0.0;
    const double ssd = channel_ssd(N, CHW, HW, x + c * HW, mean);
    const double var = M > 0 ? ssd / static_cast<double>(M) : 0.0;  // biased
    const double invstd = 1.0 / std::sqrt(var + static_cast<double>(eps));
    const double g = gamma ? static_cast<double>(gamma[c]) : 1.0;
    const double b = beta_ ? static_cast<double>(beta_[c]) : 0.0;
    const double scale = invstd * g;
    normalize_channel(N, CHW, HW, x + c * HW, act.residual ? act.residual + c * HW : nullptr, act.relu, y + c * HW,
                      mean, scale, b);
    if (save_mean) save_mean[c] = static_cast<M_>(mean);
    if (save_invstd) save_invstd[c] = static_cast<M_>(invstd);
    const double mom = static_cast<double>(momentum);
    if (running_mean) {
      running_mean[c] =
          static_cast<M_>((1.0 - mom) * static_cast<double>(running_mean[c]) + mom * mean);
    }
    if (running_var) {
      // Unbiased variance, as PyTorch. M == 1 divides by zero (PyTorch refuses to train with one
      // value per channel; core/ is expected to reject it before calling).
      const double unbiased = ssd / static_cast<double>(M - 1);
      running_var[c] =
          static_cast<M_>((1.0 - mom) * static_cast<double>(running_var[c]) + mom * unbiased);
    }
  }
}

template <class T>
void batch_norm_forward_eval(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                             const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* y) {
  const i64 CHW = C * HW;
#pragma omp parallel for schedule(static) if (N * C * HW > kNormParallelThreshold && C > 1)
  for (i64 c = 0; c < C; ++c) {
    const double mean = static_cast<double>(running_mean[c]);
    const double invstd =
        1.0 / std::sqrt(static_cast<double>(running_var[c]) + static_cast<double>(eps));
    const double g = gamma ? static_cast<double>(gamma[c]) : 1.0;
    const double b = beta_ ? static_cast<double>(beta_[c]) : 0.0;
    const double scale = invstd * g;
    normalize_channel(N, CHW, HW, x + c * HW, static_cast<const T*>(nullptr), false, y + c * HW, mean, scale, b);
  }
}

namespace {

// The dx pass of one channel of a training batch norm's backward, dz = dy (masked by y > 0 when A):
// dx = k (dz - mean_dz - xhat mean_dz_xhat).
template <class T>
struct DxRows {
  i64 N, CHW, HW;
  double mean, invstd, k, mean_dy, mean_dy_xhat;
  P<T> beta_dx;

  // dx over dy itself (In): read and written through one pointer, so the loops vectorize.
  template <bool A, bool In>
  void run(const T* dyc, const T* yc, const T* xc, T* dxc) const {
    using M_ = P<T>;
    // Locals, not members: a store through dxp could alias a member as far as the compiler knows,
    // and reloading them every element keeps the loops from vectorizing.
    const i64 N = this->N, CHW = this->CHW, HW = this->HW;
    const double mean = this->mean, invstd = this->invstd, k = this->k, mean_dy = this->mean_dy,
                 mean_dy_xhat = this->mean_dy_xhat;
    const P<T> beta_dx = this->beta_dx;
    for (i64 n = 0; n < N; ++n) {
      const T* xp = xc + n * CHW;
      T* dxp = dxc + n * CHW;
      const T* dyp = In ? dxp : dyc + n * CHW;
      const T* yp = A ? yc + n * CHW : nullptr;
      // Two loops rather than a test of beta per element: each vectorizes. In double for a bf16 dx
      // too, as the CUDA kernel computes it: the three terms cancel (with few values per channel,
      // to a small part of each), and float32 math here once parted from the GPU's double by 3
      // bf16 ulps (2 values per channel, on an H100).
      if (beta_dx == M_(0)) {
        for (i64 i = 0; i < HW; ++i) {
          const double xhat = (static_cast<double>(xp[i]) - mean) * invstd;
          dxp[i] = static_cast<T>(k * (static_cast<double>(masked<A>(dyp, yp, i)) - mean_dy - xhat * mean_dy_xhat));
        }
      } else {
        for (i64 i = 0; i < HW; ++i) {
          const double xhat = (static_cast<double>(xp[i]) - mean) * invstd;
          dxp[i] = T(beta_dx * M_(dxp[i]) +
                     static_cast<M_>(k * (static_cast<double>(masked<A>(dyp, yp, i)) - mean_dy - xhat * mean_dy_xhat)));
        }
      }
    }
  }
};

}  // namespace

template <class T>
void batch_norm_backward(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                         const P<T>* save_mean, const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma,
                         P<T>* dbeta, P<T> beta_param, void* workspace, NormActGrad<T> act) {
  using M_ = P<T>;
  const i64 M = N * HW;
  const i64 CHW = C * HW;
  if (act.channels_last) {
    if (C > 0 && M > 0)
      nhwc_backward(N, C, HW, dy, x, gamma, save_mean, save_invstd, dx, beta_dx, dgamma, dbeta, beta_param, workspace, act);
    return;
  }
#pragma omp parallel for schedule(static) if (N * C * HW > kNormParallelThreshold && C > 1)
  for (i64 c = 0; c < C; ++c) {
    const double mean = static_cast<double>(save_mean[c]);
    const double invstd = static_cast<double>(save_invstd[c]);
    double sum_dy = 0.0, sum_dy_xmu = 0.0;
    if (act.sums_in) sum_dy = act.sums_in[c], sum_dy_xmu = act.sums_in[C + c];
    else channel_dy_sums(act, N, CHW, HW, c, dy, x, mean, &sum_dy, &sum_dy_xmu);
    if (act.sums_out) act.sums_out[c] = sum_dy, act.sums_out[C + c] = sum_dy_xmu;
    const double sum_dy_xhat = sum_dy_xmu * invstd;
    if (dgamma) store<M_>(dgamma + c, beta_param, sum_dy_xhat);
    if (dbeta) store<M_>(dbeta + c, beta_param, sum_dy);
    if (dx && M > 0) {
      const double g = gamma ? static_cast<double>(gamma[c]) : 1.0;
      const double mean_dy = sum_dy / static_cast<double>(M);
      const double mean_dy_xhat = sum_dy_xhat / static_cast<double>(M);
      const double k = g * invstd;
      const DxRows<T> rows{N, CHW, HW, mean, invstd, k, mean_dy, mean_dy_xhat, beta_dx};
      const i64 o = c * HW;
      const bool in = dx == dy;  // dx over dy (the caller's choice: it owns dy)
      if (act.relu && in) rows.template run<true, true>(dy + o, act.y + o, x + o, dx + o);
      else if (act.relu) rows.template run<true, false>(dy + o, act.y + o, x + o, dx + o);
      else if (in) rows.template run<false, true>(dy + o, nullptr, x + o, dx + o);
      else rows.template run<false, false>(dy + o, nullptr, x + o, dx + o);
    }
  }
}

template <class T>
void batch_norm_backward_eval(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                              const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* dx,
                              P<T> beta_dx, P<T>* dgamma, P<T>* dbeta, P<T> beta_param, void* /*workspace*/) {
  const i64 CHW = C * HW;
#pragma omp parallel for schedule(static) if (N * C * HW > kNormParallelThreshold && C > 1)
  for (i64 c = 0; c < C; ++c) {
    const double mean = static_cast<double>(running_mean[c]);
    const double invstd =
        1.0 / std::sqrt(static_cast<double>(running_var[c]) + static_cast<double>(eps));
    const double g = gamma ? static_cast<double>(gamma[c]) : 1.0;
    const double k = g * invstd;
    double sum_dy = 0.0, sum_dy_xhat = 0.0;
    for (i64 n = 0; n < N; ++n) {
      const T* xp = x + n * CHW + c * HW;
      const T* dyp = dy + n * CHW + c * HW;
      T* dxp = dx ? dx + n * CHW + c * HW : nullptr;
      for (i64 i = 0; i < HW; ++i) {
        const double d = static_cast<double>(dyp[i]);
        sum_dy += d;
        sum_dy_xhat += d * (static_cast<double>(xp[i]) - mean) * invstd;
        if (dxp) store<T>(dxp + i, beta_dx, d * k);
      }
    }
    if (dgamma) store<P<T>>(dgamma + c, beta_param, sum_dy_xhat);
    if (dbeta) store<P<T>>(dbeta + c, beta_param, sum_dy);
  }
}

// ---------------------------------------------------------------------------------------------
// Group norm. x (N, C, HW) viewed as (N, G, C/G * HW): each (n, g) is one contiguous block.

template <class T>
void batch_norm_accumulate_moments(i64 C, i64 M, T eps, const T* save_mean, const T* save_invstd, double* sum,
                                   double* sum_sq) {
  const double m = static_cast<double>(M);
  for (i64 c = 0; c < C; ++c) {
    const double mean = static_cast<double>(save_mean[c]), invstd = static_cast<double>(save_invstd[c]);
    const double var = 1.0 / (invstd * invstd) - static_cast<double>(eps);
    sum[c] += m * mean;
    sum_sq[c] += m * (var + mean * mean);
  }
}

template <class T>
void batch_norm_apply_moments(i64 C, i64 count, T momentum, const double* sum, const double* sum_sq, T* running_mean,
                              T* running_var) {
  const double n = static_cast<double>(count), mom = static_cast<double>(momentum);
  for (i64 c = 0; c < C; ++c) {
    const double mean = sum[c] / n;
    const double var = std::max(0.0, sum_sq[c] / n - mean * mean);  // biased
    running_mean[c] = static_cast<T>((1.0 - mom) * static_cast<double>(running_mean[c]) + mom * mean);
    running_var[c] = static_cast<T>((1.0 - mom) * static_cast<double>(running_var[c]) + mom * var * n / (n - 1.0));
  }
}

template <class T>
void group_norm_forward(i64 N, i64 C, i64 HW, i64 G, const T* x, const P<T>* gamma, const P<T>* beta_,
                        P<T> eps, T* y, P<T>* save_mean, P<T>* save_invstd, NormAct<T> act) {
  using M_ = P<T>;
  if (act.channels_last) throw std::invalid_argument("group_norm_forward: channels_last is not supported");
  const i64 Cg = C / G;
  const i64 M = Cg * HW;  // elements per group
  const i64 NG = N * G;
#pragma omp parallel for schedule(static) if (N * C * HW > kNormParallelThreshold && NG > 1)
  for (i64 ng = 0; ng < NG; ++ng) {
    const i64 g = ng % G;
    const T* xp = x + ng * M;
    T* yp = y + ng * M;
    double sum = 0.0;
    for (i64 i = 0; i < M; ++i) sum += static_cast<double>(xp[i]);
    const double mean = M > 0 ? sum / static_cast<double>(M) : 0.0;
    double ssd = 0.0;
    for (i64 i = 0; i < M; ++i) {
      const double d = static_cast<double>(xp[i]) - mean;
      ssd += d * d;
    }
    const double var = M > 0 ? ssd / static_cast<double>(M) : 0.0;  // biased
    const double invstd = 1.0 / std::sqrt(var + static_cast<double>(eps));
    for (i64 cc = 0; cc < Cg; ++cc) {
      const i64 c = g * Cg + cc;
      const double gm = gamma ? static_cast<double>(gamma[c]) : 1.0;
      const double b = beta_ ? static_cast<double>(beta_[c]) : 0.0;
      const double scale = invstd * gm;
      const T* xc = xp + cc * HW;
      T* yc = yp + cc * HW;
      const T* rc = act.residual ? act.residual + ng * M + cc * HW : nullptr;
      if (!rc && !act.relu) {
        for (i64 i = 0; i < HW; ++i) yc[i] = static_cast<T>((static_cast<double>(xc[i]) - mean) * scale + b);
        continue;
      }
      // Fused (NormAct): the residual added to the rounded value as add() adds, then relu()'s ReLU.
      for (i64 i = 0; i < HW; ++i) {
        T v = static_cast<T>((static_cast<double>(xc[i]) - mean) * scale + b);
        if (rc) v = T(M_(v) + M_(1) * M_(rc[i]));
        if (act.relu) v = M_(v) < M_(0) ? T(M_(0)) : v;
        yc[i] = v;
      }
    }
    if (save_mean) save_mean[ng] = static_cast<M_>(mean);
    if (save_invstd) save_invstd[ng] = static_cast<M_>(invstd);
  }
}

template <class T>
void group_norm_backward(i64 N, i64 C, i64 HW, i64 G, const T* dy, const T* x, const P<T>* gamma,
                         const P<T>* save_mean, const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma,
                         P<T>* dbeta, P<T> beta_param, NormActGrad<T> act) {
  const i64 Cg = C / G;
  const i64 M = Cg * HW;
  const i64 NG = N * G;
  const i64 CHW = C * HW;
  const bool par = N * C * HW > kNormParallelThreshold;
  if (act.channels_last) throw std::invalid_argument("group_norm_backward: channels_last is not supported");
  // Fused (NormActGrad): dz = dy masked by y > 0 where dy is read; the residual's gradient dz is
  // written in the dx pass. dgamma and dbeta are summed first (they only read), so that dx or the
  // residual's gradient may be written over dy.
  const T* y = act.relu ? act.y : nullptr;
  auto dz = [&](const T* d, i64 i) {
    if (y) return masked<true>(d, y + (d - dy), i);
    return d[i];
  };
  // dgamma, dbeta: per channel, summed over n and HW.
  if (dgamma || dbeta) {
#pragma omp parallel for schedule(static) if (par && C > 1)
    for (i64 c = 0; c < C; ++c) {
      const i64 g = c / Cg;
      double sdy = 0.0, sdy_xhat = 0.0;
      for (i64 n = 0; n < N; ++n) {
        const double mean = static_cast<double>(save_mean[n * G + g]);
        const double invstd = static_cast<double>(save_invstd[n * G + g]);
        const T* xp = x + n * CHW + c * HW;
        const T* dyp = dy + n * CHW + c * HW;
        for (i64 i = 0; i < HW; ++i) {
          const double d = static_cast<double>(dz(dyp, i));
          sdy += d;
          sdy_xhat += d * (static_cast<double>(xp[i]) - mean) * invstd;
        }
      }
      if (dgamma) store<P<T>>(dgamma + c, beta_param, sdy_xhat);
      if (dbeta) store<P<T>>(dbeta + c, beta_param, sdy);
    }
  }
  T* dr = act.dresidual;
  if (dr && !dx) {  // the residual's gradient alone
#pragma omp parallel for schedule(static) if (par)
    for (i64 i = 0; i < N * CHW; ++i) store<T>(dr + i, act.beta_residual, static_cast<double>(dz(dy, i)));
  }

  // dx: per (n, g), with dxhat = dy * gamma[c]:
  //   dx = invstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) over the group.
  if (dx && M > 0) {
#pragma omp parallel for schedule(static) if (par && NG > 1)
    for (i64 ng = 0; ng < NG; ++ng) {
      const i64 g = ng % G;
      const double mean = static_cast<double>(save_mean[ng]);
      const double invstd = static_cast<double>(save_invstd[ng]);
      const T* xp = x + ng * M;
      const T* dyp = dy + ng * M;
      T* dxp = dx + ng * M;
      T* drp = dr ? dr + ng * M : nullptr;
      double s1 = 0.0, s2 = 0.0;
      for (i64 cc = 0; cc < Cg; ++cc) {
        const double gm = gamma ? static_cast<double>(gamma[g * Cg + cc]) : 1.0;
        for (i64 i = cc * HW; i < (cc + 1) * HW; ++i) {
          const T d = dz(dyp, i);
          if (drp) store<T>(drp + i, act.beta_residual, static_cast<double>(d));  // may be dy itself: read first
          const double dxh = static_cast<double>(d) * gm;
          s1 += dxh;
          s2 += dxh * (static_cast<double>(xp[i]) - mean) * invstd;
        }
      }
      const double m1 = s1 / static_cast<double>(M);
      const double m2 = s2 / static_cast<double>(M);
      for (i64 cc = 0; cc < Cg; ++cc) {
        const double gm = gamma ? static_cast<double>(gamma[g * Cg + cc]) : 1.0;
        for (i64 i = cc * HW; i < (cc + 1) * HW; ++i) {
          const double xhat = (static_cast<double>(xp[i]) - mean) * invstd;
          const double dxh = static_cast<double>(dz(dyp, i)) * gm;  // dz again: dy may be dz by now
          store<T>(dxp + i, beta_dx, invstd * (dxh - m1 - xhat * m2));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations.
TALLY_INSTANTIATE_NORM(float)
TALLY_INSTANTIATE_NORM(double)
TALLY_INSTANTIATE_NORM(bf16)
TALLY_INSTANTIATE_MOMENTS(float)
TALLY_INSTANTIATE_MOMENTS(double)

}  // namespace tally::kernels::cpu
