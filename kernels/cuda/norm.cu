// kernels/cuda/norm.cu — batch norm and group norm over x (N, C, HW) on the GPU, PyTorch
// semantics; the CUDA twin of kernels/cpu/norm.cpp (same functions, same formulas, and like the
// CPU, every sum and every per-element formula in double, rounded to float once at the end: the
// backward's dy - mean(dy) - xhat * mean(dy * xhat) cancels, and in float it lost up to 1e-3 of
// the gradient, which a ResNet compounds).
//
// Batch norm runs in three deterministic launches, so that a layer with few channels still fills
// the GPU:
//   1. partial sums: grid of C x P blocks; block (c, p) sums channel c over its chunk of rows
//      (images n) in a fixed order, then along the block tree (launch.cuh), into the workspace;
//   2. finalize: one thread per channel adds its P partials in order and writes the statistics
//      (save_mean/invstd, running stats; dgamma/dbeta in the backward) and the per-channel
//      coefficients of step 3 (double, in the workspace);
//   3. elementwise: y (or dx) for every element, over the flat index (PlaneCursor, below; the
//      evaluation passes: one plane (n, c) per block row).
// P = batch_norm_chunks(N, C, HW) depends only on the shape, so a dry run sizes the workspace as
// the real run does. Forward sums are taken about a pivot (the channel's first element): the
// shifted sum of squares keeps the variance exact when the mean is large.
// Channels-last (NormAct::channels_last: x, y, dy, dx and the residual stored (N, HW, C)): the same
// three launches and formulas over M = N * HW rows of C channels; a partial-sum block takes a tile of
// 32 channels (a warp's lanes: one coalesced read of each row's tile) by 8 row lanes over its chunk
// of rows, 4 rows' loads in flight at once, and adds its 8 lanes in order; the elementwise passes
// give each thread 4 adjacent channels (their coefficients in registers, one vector load per array
// and row) where C is a multiple of 4, else run over the elements (c = index % C).
// The partial sums keep the row-major layout (2, C, P), so the finalize kernels are shared.
// Group norm: one block per (n, group) and per channel for the weight gradients, in double.
// bf16 (x, y, dy, dx): the same launches and double formulas on widened values; gamma, beta, the
// running and saved statistics and dgamma/dbeta are float32 (S below: compute_t<T>, the CPU's
// P<T>); each bf16 element stored is rounded once, from double.
#include <atomic>
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {
using detail::block_sum;
using detail::blocks_for;
using detail::grid_for;
using detail::kReduceThreads;
using detail::kThreads;

constexpr int kNormThreads = 256;
constexpr i64 kTargetBlocks = 1024;  // partial-sum blocks to aim for (several waves on 132 SMs)
constexpr i64 kMinChunk = 4096;      // elements a partial-sum block should have at least
constexpr int kUnroll = 4;           // elements (or rows) a partial-sum thread loads before it adds them

// The type of the parameters and statistics beside T's activations (kernels/common.h).
template <class T>
using S = compute_t<T>;

// beta == 0 overwrites (never reads out); otherwise out = beta * out + v, rounded once.
template <class T, class B>
__device__ __forceinline__ void store(T* out, B beta, double v) {
  *out = beta == B(0) ? static_cast<T>(v) : static_cast<T>(static_cast<double>(beta) * static_cast<double>(*out) + v);
}

// dy masked by a fused ReLU as relu_backward masks it: 0 where y <= 0 (a NaN y passes dy).
template <class T>
__device__ __forceinline__ double masked_dy(const T* dy, const T* __restrict__ y, i64 o) {
  const double d = static_cast<double>(dy[o]);
  return y && static_cast<S<T>>(y[o]) <= S<T>(0) ? 0.0 : d;
}

// Chunks per channel: rows of x (images) are split into P contiguous groups.
i64 batch_norm_chunks(i64 N, i64 C, i64 HW) {
  const i64 M = N * HW;
  const i64 by_size = std::max<i64>(1, M / kMinChunk);
  const i64 by_grid = std::max<i64>(1, (kTargetBlocks + C - 1) / std::max<i64>(C, 1));
  const i64 by_index = (M + (i64{1} << 30) - 1) >> 30;  // a block's element count fits 32 bits
  return std::min(N, std::max({i64{1}, std::min(by_size, by_grid), by_index}));
}

// Workspace layout (doubles): partial sums (2, C, P); the elementwise pass's coefficients (3, C);
// the backward's statistics in double (2, C).
struct BnWorkspace {
  double* part;   // (2, C, P)
  double* coef;   // (3, C), then (2, C) of statistics
  static std::size_t doubles(i64 C, i64 P) { return static_cast<std::size_t>(2 * C * P + 5 * C); }
};

// Channels-last: row chunks per channel, from the shape alone. A block covers a tile of kTileC
// channels by kTileRows row lanes; each chunk has at least kMinChunkRows rows.
constexpr int kTileC = 32, kTileRows = kNormThreads / kTileC;
constexpr i64 kMinChunkRows = kMinChunk / kTileC;
i64 batch_norm_chunks_nhwc(i64 N, i64 C, i64 HW) {
  const i64 M = N * HW, tiles = (C + kTileC - 1) / kTileC;
  const i64 by_size = std::max<i64>(1, M / kMinChunkRows);
  const i64 by_grid = std::max<i64>(1, (kTargetBlocks + tiles - 1) / std::max<i64>(tiles, 1));
  return std::min<i64>(65535, std::max<i64>(1, std::min(by_size, by_grid)));
}
i64 chunks_for(i64 N, i64 C, i64 HW, bool channels_last) {
  return channels_last ? batch_norm_chunks_nhwc(N, C, HW) : batch_norm_chunks(N, C, HW);
}

// Rows [n0, n1) of channel c of block p.
__device__ __forceinline__ void chunk_rows(i64 N, i64 P, i64 p, i64* n0, i64* n1) {
  *n0 = p * N / P;
  *n1 = (p + 1) * N / P;
}

// ---- batch norm: partial sums ---------------------------------------------------------------------

// Forward: s1 = sum (x - K), s2 = sum (x - K)^2 over the chunk, K = the channel's first element.
template <class T>
__global__ void bn_forward_partial_kernel(i64 N, i64 C, i64 HW, i64 P, const T* __restrict__ x, double* part) {
  const i64 c = blockIdx.x / P, p = blockIdx.x % P;
  i64 n0, n1;
  chunk_rows(N, P, p, &n0, &n1);
  const double K = static_cast<double>(x[c * HW]);
  const unsigned count = static_cast<unsigned>((n1 - n0) * HW), hw = static_cast<unsigned>(HW);
  const auto at = [&](unsigned i) {  // element i of the chunk: row n0 + i / HW, column i % HW
    const unsigned r = i / hw, j = i - r * hw;
    return ((n0 + r) * C + c) * HW + j;
  };
  double s1 = 0, s2 = 0;
  unsigned i = threadIdx.x;
  // kUnroll elements loaded before any is added (their loads in flight together), added in order.
  for (; i + (kUnroll - 1) * blockDim.x < count; i += kUnroll * blockDim.x) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = x[at(i + u * blockDim.x)];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const double d = static_cast<double>(v[u]) - K;
      s1 += d;
      s2 += d * d;
    }
  }
  for (; i < count; i += blockDim.x) {
    const double d = static_cast<double>(x[at(i)]) - K;
    s1 += d;
    s2 += d * d;
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) {
    part[c * P + p] = s1;
    part[(C + c) * P + p] = s2;
  }
}

// Backward (training or eval statistics): s1 = sum dz, s2 = sum dz * (x - mean) * invstd, with dz = dy
// masked by a fused ReLU's output y (when y is given); dz is also stored into dres (=|+= by
// beta_res) when given: the fused residual's gradient, each element by the one thread that reads it.
template <class T>
__global__ void bn_backward_partial_kernel(i64 N, i64 C, i64 HW, i64 P, const T* dy,  // dres may be dy
                                           const T* __restrict__ y, const T* __restrict__ x,
                                           const double* __restrict__ mean, const double* __restrict__ invstd,
                                           T* dres, S<T> beta_res, double* part) {
  const i64 c = blockIdx.x / P, p = blockIdx.x % P;
  i64 n0, n1;
  chunk_rows(N, P, p, &n0, &n1);
  const double mu = mean[c], is = invstd[c];
  const unsigned count = static_cast<unsigned>((n1 - n0) * HW), hw = static_cast<unsigned>(HW);
  const auto at = [&](unsigned i) {
    const unsigned r = i / hw, j = i - r * hw;
    return ((n0 + r) * C + c) * HW + j;
  };
  double s1 = 0, s2 = 0;
  unsigned i = threadIdx.x;
  // As the forward (dres, which may be dy, written only after its element was read, by this thread).
  for (; i + (kUnroll - 1) * blockDim.x < count; i += kUnroll * blockDim.x) {
    i64 o[kUnroll];
    double d[kUnroll], xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      o[u] = at(i + u * blockDim.x);
      d[u] = masked_dy(dy, y, o[u]);
      xv[u] = static_cast<double>(x[o[u]]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (dres) store(dres + o[u], beta_res, d[u]);
      s1 += d[u];
      s2 += d[u] * ((xv[u] - mu) * is);
    }
  }
  for (; i < count; i += blockDim.x) {
    const i64 o = at(i);
    const double d = masked_dy(dy, y, o);
    if (dres) store(dres + o, beta_res, d);
    s1 += d;
    s2 += d * ((static_cast<double>(x[o]) - mu) * is);
  }
  s1 = block_sum(s1);
  s2 = block_sum(s2);
  if (threadIdx.x == 0) {
    part[c * P + p] = s1;
    part[(C + c) * P + p] = s2;
  }
}

// Channels-last partial sums: block (tile, p) sums channels [tile * 32, tile * 32 + 32) over rows
// [p M / P, (p + 1) M / P) of x (M, C); lane c of row lane k takes rows k, k + 8, ...; the 8 row
// lanes are then added in order. Written to part (2, C, P) as the row-major kernels write it.
__device__ __forceinline__ void tile_store(double s1, double s2, i64 c, i64 C, i64 P, i64 p, double* part) {
  __shared__ double sh[2][kTileRows][kTileC + 1];
  const int lane = static_cast<int>(threadIdx.x % kTileC), row = static_cast<int>(threadIdx.x / kTileC);
  sh[0][row][lane] = s1;
  sh[1][row][lane] = s2;
  __syncthreads();
  if (row == 0 && c < C) {
    double a = 0, b = 0;
    for (int k = 0; k < kTileRows; ++k) {
      a += sh[0][k][lane];
      b += sh[1][k][lane];
    }
    part[c * P + p] = a;
    part[(C + c) * P + p] = b;
  }
}

// Forward: s1 = sum (x - K), s2 = sum (x - K)^2, K = the channel's first element x[c].
template <class T>
__global__ void bn_forward_partial_nhwc_kernel(i64 M, i64 C, i64 P, const T* __restrict__ x, double* part) {
  const i64 c = static_cast<i64>(blockIdx.x) * kTileC + threadIdx.x % kTileC, p = blockIdx.y;
  const i64 r0 = p * M / P, r1 = (p + 1) * M / P;
  double s1 = 0, s2 = 0;
  if (c < C) {
    const double K = static_cast<double>(x[c]);
    i64 r = r0 + threadIdx.x / kTileC;
    // kUnroll rows loaded before any is added (their loads in flight together), added in row order.
    for (; r + (kUnroll - 1) * kTileRows < r1; r += kUnroll * kTileRows) {
      T v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = x[(r + u * kTileRows) * C + c];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const double d = static_cast<double>(v[u]) - K;
        s1 += d;
        s2 += d * d;
      }
    }
    for (; r < r1; r += kTileRows) {
      const double d = static_cast<double>(x[r * C + c]) - K;
      s1 += d;
      s2 += d * d;
    }
  }
  tile_store(s1, s2, c, C, P, p, part);
}

// Backward, as bn_backward_partial_kernel: s1 = sum dz, s2 = sum dz (x - mean) invstd; dz stored into
// dres when given, by the thread that reads it.
template <class T>
__global__ void bn_backward_partial_nhwc_kernel(i64 M, i64 C, i64 P, const T* dy, const T* __restrict__ y,
                                                const T* __restrict__ x, const double* __restrict__ mean,
                                                const double* __restrict__ invstd, T* dres, S<T> beta_res,
                                                double* part) {
  const i64 c = static_cast<i64>(blockIdx.x) * kTileC + threadIdx.x % kTileC, p = blockIdx.y;
  const i64 r0 = p * M / P, r1 = (p + 1) * M / P;
  double s1 = 0, s2 = 0;
  if (c < C) {
    const double mu = mean[c], is = invstd[c];
    i64 r = r0 + threadIdx.x / kTileC;
    // As the forward: kUnroll rows' dy, y and x loaded first, then taken in row order (dres, which may
    // be dy, is written only after its element was read, by this thread).
    for (; r + (kUnroll - 1) * kTileRows < r1; r += kUnroll * kTileRows) {
      double d[kUnroll], xv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const i64 o = (r + u * kTileRows) * C + c;
        d[u] = masked_dy(dy, y, o);
        xv[u] = static_cast<double>(x[o]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (dres) store(dres + (r + u * kTileRows) * C + c, beta_res, d[u]);
        s1 += d[u];
        s2 += d[u] * ((xv[u] - mu) * is);
      }
    }
    for (; r < r1; r += kTileRows) {
      const i64 o = r * C + c;
      const double d = masked_dy(dy, y, o);
      if (dres) store(dres + o, beta_res, d);
      s1 += d;
      s2 += d * ((static_cast<double>(x[o]) - mu) * is);
    }
  }
  tile_store(s1, s2, c, C, P, p, part);
}

dim3 nhwc_partial_grid(i64 C, i64 P) {
  return dim3(static_cast<unsigned>((C + kTileC - 1) / kTileC), static_cast<unsigned>(P));
}

// ---- batch norm: per-channel finalize ------------------------------------------------------------

// Statistics of the forward: coef = (mean, scale, shift) for the elementwise pass.
template <class T>
__global__ void bn_forward_finalize_kernel(i64 N, i64 C, i64 HW, i64 P, i64 pivot_stride, const T* __restrict__ x,
                                           const S<T>* __restrict__ gamma, const S<T>* __restrict__ beta_, double eps,
                                           double momentum, S<T>* running_mean, S<T>* running_var, S<T>* save_mean,
                                           S<T>* save_invstd, const double* __restrict__ part, double* coef) {
  const i64 c = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double s1 = 0, s2 = 0;
  for (i64 p = 0; p < P; ++p) {
    s1 += part[c * P + p];
    s2 += part[(C + c) * P + p];
  }
  const double M = static_cast<double>(N * HW);
  const double K = static_cast<double>(x[c * pivot_stride]);  // the partial sums' pivot
  const double mean = K + s1 / M;
  const double ssd = s2 - s1 * s1 / M > 0 ? s2 - s1 * s1 / M : 0.0;  // sum of squared deviations
  const double var = ssd / M;                                          // biased
  const double invstd = 1.0 / sqrt(var + eps);
  const double scale = invstd * (gamma ? static_cast<double>(gamma[c]) : 1.0);
  coef[c] = mean;
  coef[C + c] = scale;
  coef[2 * C + c] = beta_ ? static_cast<double>(beta_[c]) : 0.0;
  using St = S<T>;
  if (save_mean) save_mean[c] = static_cast<St>(mean);
  if (save_invstd) save_invstd[c] = static_cast<St>(invstd);
  if (running_mean) running_mean[c] = static_cast<St>((1.0 - momentum) * static_cast<double>(running_mean[c]) + momentum * mean);
  // Unbiased variance, as PyTorch (M == 1 divides by zero, as on the CPU; core/ rejects it).
  if (running_var)
    running_var[c] = static_cast<St>((1.0 - momentum) * static_cast<double>(running_var[c]) + momentum * (ssd / (M - 1.0)));
}

// The statistics a backward uses, in double: saved (training) or running (eval) ones (float32 beside
// bf16 activations: T here is the statistics' type).
template <class T>
__global__ void bn_backward_stats_kernel(i64 C, const T* __restrict__ mean, const T* __restrict__ invstd_or_var,
                                         bool is_var, double eps, double* out_mean, double* out_invstd) {
  const i64 c = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  out_mean[c] = static_cast<double>(mean[c]);
  const double v = static_cast<double>(invstd_or_var[c]);
  out_invstd[c] = is_var ? 1.0 / sqrt(v + eps) : v;
}

// dgamma/dbeta from the sums, and coef = (k, mean_dy, mean_dy_xhat) for dx (training) or k alone
// (eval: dx = k dy). T here is the parameters' type (float32 beside bf16 activations).
template <class T>
__global__ void bn_backward_finalize_kernel(i64 N, i64 C, i64 HW, i64 P, const T* __restrict__ gamma,
                                            const double* __restrict__ invstd, const double* __restrict__ part,
                                            T* dgamma, T* dbeta, T beta_param, double* coef) {
  const i64 c = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double s1 = 0, s2 = 0;
  for (i64 p = 0; p < P; ++p) {
    s1 += part[c * P + p];
    s2 += part[(C + c) * P + p];
  }
  if (dgamma) store(dgamma + c, beta_param, s2);
  if (dbeta) store(dbeta + c, beta_param, s1);
  const double M = static_cast<double>(N * HW);
  coef[c] = (gamma ? static_cast<double>(gamma[c]) : 1.0) * invstd[c];
  coef[C + c] = M > 0 ? s1 / M : 0.0;
  coef[2 * C + c] = M > 0 ? s2 / M : 0.0;
}

// ---- batch norm: elementwise ------------------------------------------------------------------------

// Planes (n, c) of HW elements: blockIdx.y strides over planes, x-blocks over the plane.
#define TALLY_PLANE_LOOP(plane, j, planes, HW)                                                            \
  for (i64 plane = blockIdx.y; plane < (planes); plane += gridDim.y)                                      \
    for (i64 j = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; j < (HW); j += static_cast<i64>(blockDim.x) * gridDim.x)

dim3 plane_grid(i64 planes, i64 HW) {
  const i64 x = std::clamp<i64>((HW + kNormThreads - 1) / kNormThreads, 1, 64);
  const i64 y = std::clamp<i64>(planes, 1, 65535);
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

// The training passes below run over the flat index instead (a block over planes of 49 elements,
// ResNet-50's last stage, left 207 of its 256 lanes idle): element o is column o % HW of plane
// o / HW, of channel plane % C, kept along a thread's grid-stride loop by addition (PlaneCursor: four
// 64-bit divisions per thread, none per element). The same formulas, so the same values bit for bit.
struct PlaneCursor {
  i64 j, c;                 // the current element's column and channel
  i64 HW, C, step_j, step_c;  // the grid's stride as (planes, columns): step_c = its planes % C
  __device__ PlaneCursor(i64 HW_, i64 C_) : HW(HW_), C(C_) {
    const i64 o = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
    const i64 plane = o / HW;
    j = o - plane * HW;
    c = plane % C;
    const i64 stride = static_cast<i64>(blockDim.x) * gridDim.x, q = stride / HW;
    step_j = stride - q * HW;
    step_c = q % C;
  }
  __device__ void next() {  // the column and channel of o + the grid's stride
    j += step_j;
    c += step_c;
    if (j >= HW) j -= HW, ++c;
    if (c >= C) c -= C;  // c < 2C here: step_c < C and one plane carried
  }
};

// y = (x - mean) * scale + shift (coef = mean, scale, shift per channel).
template <class T>
__global__ void bn_normalize_kernel(i64 n, i64 C, i64 HW, const T* __restrict__ x, const double* __restrict__ coef,
                                    const T* __restrict__ residual, bool relu, T* __restrict__ y) {
  PlaneCursor at(HW, C);
  TALLY_GRID_LOOP(o, n) {
    const i64 c = at.c;
    at.next();
    T v = static_cast<T>((static_cast<double>(x[o]) - coef[c]) * coef[C + c] + coef[2 * C + c]);
    // Fused after it (NormAct): the residual added to the rounded value, then relu_forward's ReLU
    // (NaN and -0 pass) — what the unfused add and relu kernels compute.
    if (residual) v = static_cast<T>(static_cast<S<T>>(v) + static_cast<S<T>>(residual[o]));
    if (relu && static_cast<S<T>>(v) < S<T>(0)) v = static_cast<T>(S<T>(0));
    y[o] = v;
  }
}


// Training: dx = k (dy - mean_dy - xhat mean_dy_xhat), xhat = (x - mean) invstd.
template <class T>
__global__ void bn_backward_dx_kernel(i64 n, i64 C, i64 HW, const T* dy /* dx may be dy */, const T* __restrict__ y,
                                      const T* __restrict__ x, const double* __restrict__ mean,
                                      const double* __restrict__ invstd, const double* __restrict__ coef, T* dx,
                                      S<T> beta_dx) {
  PlaneCursor at(HW, C);
  TALLY_GRID_LOOP(o, n) {
    const i64 c = at.c;
    at.next();
    const double xhat = (static_cast<double>(x[o]) - mean[c]) * invstd[c];
    store(dx + o, beta_dx, coef[c] * (masked_dy(dy, y, o) - coef[C + c] - xhat * coef[2 * C + c]));
  }
}

// Channels-last twins of the two above: element o of (M, C) is channel o % C. Along a thread's
// grid-stride loop the channel is kept by addition (ChannelCursor): one 64-bit remainder per
// thread instead of one per element (a 64-bit remainder is a software routine on the GPU, tens of
// instructions, in a loop that otherwise moves a few bytes an element). The same values, bit for bit.
struct ChannelCursor {
  i64 c, step, C;
  __device__ ChannelCursor(i64 C_)
      : c((static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) % C_),
        step((static_cast<i64>(blockDim.x) * gridDim.x) % C_),
        C(C_) {}
  __device__ void next() {  // the channel of o + the grid's stride
    c += step;
    if (c >= C) c -= C;
  }
};

template <class T>
__global__ void bn_normalize_nhwc_kernel(i64 n, i64 C, const T* __restrict__ x, const double* __restrict__ coef,
                                         const T* __restrict__ residual, bool relu, T* __restrict__ y) {
  ChannelCursor ch(C);
  TALLY_GRID_LOOP(o, n) {
    const i64 c = ch.c;
    ch.next();
    T v = static_cast<T>((static_cast<double>(x[o]) - coef[c]) * coef[C + c] + coef[2 * C + c]);
    if (residual) v = static_cast<T>(static_cast<S<T>>(v) + static_cast<S<T>>(residual[o]));
    if (relu && static_cast<S<T>>(v) < S<T>(0)) v = static_cast<T>(S<T>(0));
    y[o] = v;
  }
}

template <class T>
__global__ void bn_backward_dx_nhwc_kernel(i64 n, i64 C, const T* dy /* dx may be dy */, const T* __restrict__ y,
                                           const T* __restrict__ x, const double* __restrict__ mean,
                                           const double* __restrict__ invstd, const double* __restrict__ coef, T* dx,
                                           S<T> beta_dx) {
  ChannelCursor ch(C);
  TALLY_GRID_LOOP(o, n) {
    const i64 c = ch.c;
    ch.next();
    const double xhat = (static_cast<double>(x[o]) - mean[c]) * invstd[c];
    store(dx + o, beta_dx, coef[c] * (masked_dy(dy, y, o) - coef[C + c] - xhat * coef[2 * C + c]));
  }
}

// Channels-last, vectorized: a thread owns kVec adjacent channels — their coefficients loaded once,
// into registers — and steps over rows, one aligned kVec-element load per array and row (8 bytes of
// bf16, 16 of float); x lanes of a block take a row's channel vectors, y lanes rows. Each element's
// formula is the scalar kernel's above, term for term, so the values are the same bit for bit
// (GpuKernels.BatchNormVectorizedPassesGiveTheScalarBits); the scalar kernels remain for a C that
// is not a multiple of kVec and for arrays not aligned to a vector.
constexpr int kVec = 4;
template <class T>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};
template <class T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}
template <class T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<Vec<T>*>(p) = v;
}

#define TALLY_VEC_ROW_LOOP(r, M)                                                       \
  for (i64 r = static_cast<i64>(blockIdx.y) * blockDim.y + threadIdx.y; r < (M); \
       r += static_cast<i64>(blockDim.y) * gridDim.y)

template <class T>
__global__ void bn_normalize_nhwc_vec_kernel(i64 M, i64 C, const T* __restrict__ x, const double* __restrict__ coef,
                                             const T* __restrict__ residual, bool relu, T* __restrict__ y) {
  const i64 c0 = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (c0 >= C) return;
  double mean[kVec], scale[kVec], shift[kVec];
#pragma unroll
  for (int v = 0; v < kVec; ++v) mean[v] = coef[c0 + v], scale[v] = coef[C + c0 + v], shift[v] = coef[2 * C + c0 + v];
  TALLY_VEC_ROW_LOOP(r, M) {
    const i64 o = r * C + c0;
    const Vec<T> xv = load_vec(x + o);
    Vec<T> rv;
    if (residual) rv = load_vec(residual + o);
    Vec<T> out;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      T e = static_cast<T>((static_cast<double>(xv.v[v]) - mean[v]) * scale[v] + shift[v]);
      if (residual) e = static_cast<T>(static_cast<S<T>>(e) + static_cast<S<T>>(rv.v[v]));
      if (relu && static_cast<S<T>>(e) < S<T>(0)) e = static_cast<T>(S<T>(0));
      out.v[v] = e;
    }
    store_vec(y + o, out);
  }
}

template <class T>
__global__ void bn_backward_dx_nhwc_vec_kernel(i64 M, i64 C, const T* dy /* dx may be dy */, const T* __restrict__ y,
                                               const T* __restrict__ x, const double* __restrict__ mean_,
                                               const double* __restrict__ invstd_, const double* __restrict__ coef,
                                               T* dx, S<T> beta_dx) {
  const i64 c0 = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (c0 >= C) return;
  double mean[kVec], invstd[kVec], k[kVec], m1[kVec], m2[kVec];
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
    mean[v] = mean_[c0 + v], invstd[v] = invstd_[c0 + v];
    k[v] = coef[c0 + v], m1[v] = coef[C + c0 + v], m2[v] = coef[2 * C + c0 + v];
  }
  TALLY_VEC_ROW_LOOP(r, M) {
    const i64 o = r * C + c0;
    const Vec<T> xv = load_vec(x + o), dv = load_vec(dy + o);
    Vec<T> yv, out;
    if (y) yv = load_vec(y + o);
    if (beta_dx != S<T>(0)) out = load_vec(dx + o);
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const double xhat = (static_cast<double>(xv.v[v]) - mean[v]) * invstd[v];
      const double d = y && static_cast<S<T>>(yv.v[v]) <= S<T>(0) ? 0.0 : static_cast<double>(dv.v[v]);  // masked_dy
      const double e = k[v] * (d - m1[v] - xhat * m2[v]);
      out.v[v] = beta_dx == S<T>(0) ? static_cast<T>(e)  // store()
                                    : static_cast<T>(static_cast<double>(beta_dx) * static_cast<double>(out.v[v]) + e);
    }
    store_vec(dx + o, out);
  }
}

// The vectorized passes' launch shape for M rows of C channels: x lanes over the C / kVec channel
// vectors of a row (at most kNormThreads), y lanes over rows; about kVecBlocks blocks in all, so that
// each thread's coefficients serve many rows.
constexpr i64 kVecBlocks = 2048;
struct VecLaunch {
  dim3 grid, block;
};
VecLaunch vec_launch(i64 M, i64 C) {
  const i64 G = C / kVec;
  const i64 tx = std::min<i64>(G, kNormThreads), ty = std::max<i64>(1, kNormThreads / tx);
  const i64 gx = (G + tx - 1) / tx;
  const i64 gy = std::clamp<i64>((kVecBlocks + gx - 1) / gx, 1, std::min<i64>((M + ty - 1) / ty, 65535));
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

// Tests compare the vectorized passes with the scalar ones (set_batch_norm_vectorized).
std::atomic<bool> g_vectorized{true};

// Whether the vectorized passes take these arrays: C a multiple of kVec and each array (null: absent)
// aligned to a vector — arena blocks are 256-byte aligned, a view at an odd offset may not be.
template <class T>
bool vectorizable(i64 C, std::initializer_list<const T*> arrays) {
  if (!g_vectorized.load() || C % kVec != 0) return false;
  for (const T* a : arrays)
    if (a && reinterpret_cast<std::uintptr_t>(a) % sizeof(Vec<T>) != 0) return false;
  return true;
}

// Eval: dx = k dy.
template <class T>
__global__ void bn_backward_eval_dx_kernel(i64 planes, i64 C, i64 HW, const T* __restrict__ dy,
                                           const double* __restrict__ coef, T* dx, S<T> beta_dx) {
  TALLY_PLANE_LOOP(plane, j, planes, HW) {
    const i64 c = plane % C, o = plane * HW + j;
    store(dx + o, beta_dx, coef[c] * static_cast<double>(dy[o]));
  }
}

// Eval forward: y = (x - running_mean) / sqrt(running_var + eps) * gamma + beta.
template <class T>
__global__ void bn_forward_eval_kernel(i64 planes, i64 C, i64 HW, const T* __restrict__ x,
                                       const S<T>* __restrict__ gamma, const S<T>* __restrict__ beta_,
                                       const S<T>* __restrict__ running_mean, const S<T>* __restrict__ running_var,
                                       double eps, T* __restrict__ y) {
  TALLY_PLANE_LOOP(plane, j, planes, HW) {
    const i64 c = plane % C, o = plane * HW + j;
    const double invstd = 1.0 / sqrt(static_cast<double>(running_var[c]) + eps);
    const double scale = invstd * (gamma ? static_cast<double>(gamma[c]) : 1.0);
    y[o] = static_cast<T>((static_cast<double>(x[o]) - static_cast<double>(running_mean[c])) * scale +
                          (beta_ ? static_cast<double>(beta_[c]) : 0.0));
  }
}

// ---- batch norm: micro-batch moments (MBP) -------------------------------------------------------

template <class T>
__global__ void bn_accumulate_moments_kernel(i64 C, double M, double eps, const T* __restrict__ save_mean,
                                             const T* __restrict__ save_invstd, double* sum, double* sum_sq) {
  const i64 c = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double mean = static_cast<double>(save_mean[c]), invstd = static_cast<double>(save_invstd[c]);
  const double var = 1.0 / (invstd * invstd) - eps;
  sum[c] += M * mean;
  sum_sq[c] += M * (var + mean * mean);
}

template <class T>
__global__ void bn_apply_moments_kernel(i64 C, double n, double momentum, const double* __restrict__ sum,
                                        const double* __restrict__ sum_sq, T* running_mean, T* running_var) {
  const i64 c = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const double mean = sum[c] / n;
  const double v = sum_sq[c] / n - mean * mean;
  const double var = v > 0.0 ? v : 0.0;  // biased
  running_mean[c] = static_cast<T>((1.0 - momentum) * static_cast<double>(running_mean[c]) + momentum * mean);
  running_var[c] = static_cast<T>((1.0 - momentum) * static_cast<double>(running_var[c]) + momentum * var * n / (n - 1.0));
}

// ---- CUDA kernels: group norm. x (N, C, HW) viewed as (N * G, Cg * HW): each (n, g) contiguous.

template <class T>
__global__ void group_norm_forward_kernel(i64 N, i64 C, i64 HW, i64 G, const T* __restrict__ x,
                                          const S<T>* __restrict__ gamma, const S<T>* __restrict__ beta_, double eps,
                                          T* __restrict__ y, S<T>* save_mean, S<T>* save_invstd,
                                          const T* __restrict__ residual, bool relu) {
  const i64 Cg = C / G, M = Cg * HW;
  TALLY_BLOCK_LOOP(ng, N * G) {
    const i64 g = ng % G;
    const T* xp = x + ng * M;
    T* yp = y + ng * M;
    double acc = 0;
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) acc += static_cast<double>(xp[i]);
    const double mean = M > 0 ? block_sum(acc) / static_cast<double>(M) : 0.0;
    acc = 0;
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const double d = static_cast<double>(xp[i]) - mean;
      acc += d * d;
    }
    const double ssd = block_sum(acc);
    const double var = M > 0 ? ssd / static_cast<double>(M) : 0.0;  // biased
    const double invstd = 1.0 / sqrt(var + eps);
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const i64 c = g * Cg + i / HW;
      const double scale = invstd * (gamma ? static_cast<double>(gamma[c]) : 1.0);
      T v = static_cast<T>((static_cast<double>(xp[i]) - mean) * scale + (beta_ ? static_cast<double>(beta_[c]) : 0.0));
      // Fused (NormAct): the residual added to the rounded value as add() adds, then relu()'s ReLU.
      if (residual) v = static_cast<T>(static_cast<S<T>>(v) + S<T>(1) * static_cast<S<T>>(residual[ng * M + i]));
      if (relu && static_cast<S<T>>(v) < S<T>(0)) v = static_cast<T>(S<T>(0));
      yp[i] = v;
    }
    if (threadIdx.x == 0) {
      if (save_mean) save_mean[ng] = static_cast<S<T>>(mean);
      if (save_invstd) save_invstd[ng] = static_cast<S<T>>(invstd);
    }
  }
}

// dx per (n, g), with dxhat = dy * gamma[c]:
//   dx = invstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) over the group.
template <class T>
__global__ void group_norm_backward_dx_kernel(i64 N, i64 C, i64 HW, i64 G, const T* dy,
                                              const T* __restrict__ x, const S<T>* __restrict__ gamma,
                                              const S<T>* __restrict__ save_mean, const S<T>* __restrict__ save_invstd,
                                              T* dx, S<T> beta_dx, const T* __restrict__ y, T* dres, S<T> beta_res) {
  // dy may be dres or dx itself: each element is read, then written, by the one thread that owns it.
  const i64 Cg = C / G, M = Cg * HW;
  TALLY_BLOCK_LOOP(ng, N * G) {
    const i64 g = ng % G;
    const double mean = static_cast<double>(save_mean[ng]), invstd = static_cast<double>(save_invstd[ng]);
    const T* xp = x + ng * M;
    const T* dyp = dy + ng * M;
    const T* yp = y ? y + ng * M : nullptr;
    T* dxp = dx + ng * M;
    T* drp = dres ? dres + ng * M : nullptr;
    double a1 = 0, a2 = 0;
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const double d = masked_dy(dyp, yp, i);
      if (drp) store(drp + i, beta_res, d);
      const double dxh = d * (gamma ? static_cast<double>(gamma[g * Cg + i / HW]) : 1.0);
      a1 += dxh;
      a2 += dxh * ((static_cast<double>(xp[i]) - mean) * invstd);
    }
    const double m1 = block_sum(a1) / static_cast<double>(M);
    const double m2 = block_sum(a2) / static_cast<double>(M);
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const double xhat = (static_cast<double>(xp[i]) - mean) * invstd;
      const double dxh = masked_dy(dyp, yp, i) * (gamma ? static_cast<double>(gamma[g * Cg + i / HW]) : 1.0);
      store(dxp + i, beta_dx, invstd * (dxh - m1 - xhat * m2));
    }
  }
}

// Offset of element m of channel c in x (N, C, HW), m = n * HW + j.
__device__ __forceinline__ i64 channel_offset(i64 m, i64 c, i64 C, i64 HW) {
  const i64 n = m / HW, j = m - n * HW;
  return (n * C + c) * HW + j;
}

// dgamma, dbeta per channel, summed over n and HW (each n with its own group statistics).
template <class T>
__global__ void group_norm_backward_param_kernel(i64 N, i64 C, i64 HW, i64 G, const T* __restrict__ dy,
                                                 const T* __restrict__ x, const S<T>* __restrict__ save_mean,
                                                 const S<T>* __restrict__ save_invstd, S<T>* dgamma, S<T>* dbeta,
                                                 S<T> beta_param, const T* __restrict__ y) {
  const i64 Cg = C / G, M = N * HW;
  TALLY_BLOCK_LOOP(c, C) {
    const i64 g = c / Cg;
    double a_dy = 0, a_dy_xhat = 0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 n = m / HW;
      const i64 o = channel_offset(m, c, C, HW);
      const double d = masked_dy(dy, y, o);
      a_dy += d;
      a_dy_xhat += d * ((static_cast<double>(x[o]) - static_cast<double>(save_mean[n * G + g])) *
                        static_cast<double>(save_invstd[n * G + g]));
    }
    const double sdy = block_sum(a_dy);
    const double sdy_xhat = block_sum(a_dy_xhat);
    if (threadIdx.x == 0) {
      if (dgamma) store(dgamma + c, beta_param, sdy_xhat);
      if (dbeta) store(dbeta + c, beta_param, sdy);
    }
  }
}

// dres (=|+= by beta) dy masked by y > 0 (y null: dy): a fused group norm's residual gradient when
// its dx is not needed.
template <class T>
__global__ void masked_store_kernel(i64 n, const T* __restrict__ dy, const T* __restrict__ y, T* dres, S<T> beta) {
  TALLY_GRID_LOOP(i, n) store(dres + i, beta, masked_dy(dy, y, i));
}

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

std::size_t batch_norm_workspace_bytes(i64 N, i64 C, i64 HW, bool channels_last) {
  if (N <= 0 || C <= 0 || HW <= 0) return 0;
  return BnWorkspace::doubles(C, chunks_for(N, C, HW, channels_last)) * sizeof(double);
}

namespace {
BnWorkspace bn_workspace(void* workspace, i64 N, i64 C, i64 HW, bool channels_last, const char* who) {
  if (!workspace) detail::fail(std::string(who) + ": the CUDA batch norm needs its workspace (batch_norm_workspace_bytes)");
  auto* d = static_cast<double*>(workspace);
  const i64 P = chunks_for(N, C, HW, channels_last);
  return {d, d + 2 * C * P};
}
// The group norm kernels index (N, C, HW): a channels-last group norm is made row-major by core/ first.
void refuse_channels_last(bool channels_last, const char* who) {
  if (channels_last)
    detail::fail(std::string(who) + ": expected x in (N, C, HW) layout, found channels_last (the CUDA group norm "
                 "runs on row-major tensors; core/ converts a channels-last input before calling it)");
}
unsigned per_channel_blocks(i64 C) { return static_cast<unsigned>((C + kNormThreads - 1) / kNormThreads); }

// The partial sums and finalize of a backward, leaving (k, mean_dy, mean_dy_xhat) in ws.coef.
template <class T>
void bn_backward_sums(i64 N, i64 C, i64 HW, const T* dy, const T* x, const S<T>* gamma, const S<T>* mean,
                      const S<T>* invstd_or_var, bool is_var, double eps, S<T>* dgamma, S<T>* dbeta, S<T> beta_param,
                      const BnWorkspace& ws, double* stats, const NormActGrad<T>& act = {}) {
  const i64 P = chunks_for(N, C, HW, act.channels_last);
  double* smean = stats;
  double* sinvstd = stats + C;
  bn_backward_stats_kernel<<<per_channel_blocks(C), kNormThreads, 0, detail::stream()>>>(C, mean, invstd_or_var, is_var,
                                                                                         eps, smean, sinvstd);
  TALLY_LAUNCH_CHECK("batch_norm_backward.stats");
  if (act.channels_last)
    bn_backward_partial_nhwc_kernel<<<nhwc_partial_grid(C, P), kNormThreads, 0, detail::stream()>>>(
        N * HW, C, P, dy, act.relu ? act.y : nullptr, x, smean, sinvstd, act.dresidual, act.beta_residual, ws.part);
  else
    bn_backward_partial_kernel<<<static_cast<unsigned>(C * P), kNormThreads, 0, detail::stream()>>>(
        N, C, HW, P, dy, act.relu ? act.y : nullptr, x, smean, sinvstd, act.dresidual, act.beta_residual, ws.part);
  TALLY_LAUNCH_CHECK("batch_norm_backward.partial");
  bn_backward_finalize_kernel<<<per_channel_blocks(C), kNormThreads, 0, detail::stream()>>>(
      N, C, HW, P, gamma, sinvstd, ws.part, dgamma, dbeta, beta_param, ws.coef);
  TALLY_LAUNCH_CHECK("batch_norm_backward.finalize");
}
}  // namespace

template <class T>
void batch_norm_forward_train(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_, P<T> eps,
                              P<T> momentum, P<T>* running_mean, P<T>* running_var, T* y, P<T>* save_mean,
                              P<T>* save_invstd, void* workspace, NormAct<T> act) {
  if (C <= 0 || N * HW <= 0) return;
  const bool nhwc = act.channels_last;
  const BnWorkspace ws = bn_workspace(workspace, N, C, HW, nhwc, "batch_norm_forward_train");
  const i64 P = chunks_for(N, C, HW, nhwc);
  if (nhwc)
    bn_forward_partial_nhwc_kernel<<<nhwc_partial_grid(C, P), kNormThreads, 0, detail::stream()>>>(N * HW, C, P, x,
                                                                                                  ws.part);
  else
    bn_forward_partial_kernel<<<static_cast<unsigned>(C * P), kNormThreads, 0, detail::stream()>>>(N, C, HW, P, x,
                                                                                                   ws.part);
  TALLY_LAUNCH_CHECK("batch_norm_forward_train.partial");
  bn_forward_finalize_kernel<<<per_channel_blocks(C), kNormThreads, 0, detail::stream()>>>(
      N, C, HW, P, nhwc ? 1 : HW, x, gamma, beta_, static_cast<double>(eps), static_cast<double>(momentum), running_mean,
      running_var, save_mean, save_invstd, ws.part, ws.coef);
  TALLY_LAUNCH_CHECK("batch_norm_forward_train.finalize");
  if (nhwc && vectorizable<T>(C, {x, act.residual, y})) {
    const VecLaunch l = vec_launch(N * HW, C);
    bn_normalize_nhwc_vec_kernel<<<l.grid, l.block, 0, detail::stream()>>>(N * HW, C, x, ws.coef, act.residual,
                                                                            act.relu, y);
  } else if (nhwc) {
    bn_normalize_nhwc_kernel<<<detail::grid_for(N * HW * C), kNormThreads, 0, detail::stream()>>>(
        N * HW * C, C, x, ws.coef, act.residual, act.relu, y);
  } else {
    bn_normalize_kernel<<<detail::grid_for(N * C * HW, kNormThreads), kNormThreads, 0, detail::stream()>>>(
        N * C * HW, C, HW, x, ws.coef, act.residual, act.relu, y);
  }
  TALLY_LAUNCH_CHECK("batch_norm_forward_train.normalize");
}

template <class T>
void batch_norm_forward_eval(i64 N, i64 C, i64 HW, const T* x, const P<T>* gamma, const P<T>* beta_,
                             const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* y) {
  if (N * C * HW <= 0) return;
  bn_forward_eval_kernel<<<plane_grid(N * C, HW), kNormThreads, 0, detail::stream()>>>(
      N * C, C, HW, x, gamma, beta_, running_mean, running_var, static_cast<double>(eps), y);
  TALLY_LAUNCH_CHECK("batch_norm_forward_eval");
}

template <class T>
void batch_norm_backward(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma, const P<T>* save_mean,
                         const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma, P<T>* dbeta, P<T> beta_param,
                         void* workspace, NormActGrad<T> act) {
  if (C <= 0 || N * HW <= 0) return;
  const BnWorkspace ws = bn_workspace(workspace, N, C, HW, act.channels_last, "batch_norm_backward");
  bn_backward_sums(N, C, HW, dy, x, gamma, save_mean, save_invstd, false, 0.0, dgamma, dbeta, beta_param, ws,
                   ws.coef + 3 * C, act);
  if (dx) {
    const T* y = act.relu ? act.y : nullptr;
    if (act.channels_last && vectorizable<T>(C, {dy, y, x, dx})) {
      const VecLaunch l = vec_launch(N * HW, C);
      bn_backward_dx_nhwc_vec_kernel<<<l.grid, l.block, 0, detail::stream()>>>(
          N * HW, C, dy, y, x, ws.coef + 3 * C, ws.coef + 4 * C, ws.coef, dx, beta_dx);
    } else if (act.channels_last) {
      bn_backward_dx_nhwc_kernel<<<detail::grid_for(N * HW * C), kNormThreads, 0, detail::stream()>>>(
          N * HW * C, C, dy, y, x, ws.coef + 3 * C, ws.coef + 4 * C, ws.coef, dx, beta_dx);
    } else {
      bn_backward_dx_kernel<<<detail::grid_for(N * C * HW, kNormThreads), kNormThreads, 0, detail::stream()>>>(
          N * C * HW, C, HW, dy, y, x, ws.coef + 3 * C, ws.coef + 4 * C, ws.coef, dx, beta_dx);
    }
    TALLY_LAUNCH_CHECK("batch_norm_backward.dx");
  }
}

template <class T>
void batch_norm_backward_eval(i64 N, i64 C, i64 HW, const T* dy, const T* x, const P<T>* gamma,
                              const P<T>* running_mean, const P<T>* running_var, P<T> eps, T* dx, P<T> beta_dx,
                              P<T>* dgamma, P<T>* dbeta, P<T> beta_param, void* workspace) {
  if (C <= 0 || N * HW <= 0) return;
  const BnWorkspace ws = bn_workspace(workspace, N, C, HW, false, "batch_norm_backward_eval");
  bn_backward_sums(N, C, HW, dy, x, gamma, running_mean, running_var, true, static_cast<double>(eps), dgamma, dbeta,
                   beta_param, ws, ws.coef + 3 * C);
  if (dx) {
    bn_backward_eval_dx_kernel<<<plane_grid(N * C, HW), kNormThreads, 0, detail::stream()>>>(N * C, C, HW, dy, ws.coef,
                                                                                             dx, beta_dx);
    TALLY_LAUNCH_CHECK("batch_norm_backward_eval.dx");
  }
}

template <class T>
void batch_norm_accumulate_moments(i64 C, i64 M, T eps, const T* save_mean, const T* save_invstd, double* sum,
                                   double* sum_sq) {
  if (C <= 0) return;
  bn_accumulate_moments_kernel<<<per_channel_blocks(C), kNormThreads, 0, detail::stream()>>>(
      C, static_cast<double>(M), static_cast<double>(eps), save_mean, save_invstd, sum, sum_sq);
  TALLY_LAUNCH_CHECK("batch_norm_accumulate_moments");
}

template <class T>
void batch_norm_apply_moments(i64 C, i64 count, T momentum, const double* sum, const double* sum_sq, T* running_mean,
                              T* running_var) {
  if (C <= 0) return;
  bn_apply_moments_kernel<<<per_channel_blocks(C), kNormThreads, 0, detail::stream()>>>(
      C, static_cast<double>(count), static_cast<double>(momentum), sum, sum_sq, running_mean, running_var);
  TALLY_LAUNCH_CHECK("batch_norm_apply_moments");
}

template <class T>
void group_norm_forward(i64 N, i64 C, i64 HW, i64 G, const T* x, const P<T>* gamma, const P<T>* beta_, P<T> eps,
                        T* y, P<T>* save_mean, P<T>* save_invstd, NormAct<T> act) {
  if (N * G <= 0) return;
  refuse_channels_last(act.channels_last, "group_norm_forward");
  group_norm_forward_kernel<<<blocks_for(N * G), kReduceThreads, 0, detail::stream()>>>(
      N, C, HW, G, x, gamma, beta_, eps, y, save_mean, save_invstd, act.residual, act.relu);
  TALLY_LAUNCH_CHECK("group_norm_forward");
}

template <class T>
void group_norm_backward(i64 N, i64 C, i64 HW, i64 G, const T* dy, const T* x, const P<T>* gamma,
                         const P<T>* save_mean, const P<T>* save_invstd, T* dx, P<T> beta_dx, P<T>* dgamma,
                         P<T>* dbeta, P<T> beta_param, NormActGrad<T> act) {
  if (G <= 0) return;
  refuse_channels_last(act.channels_last, "group_norm_backward");
  const i64 M = (C / G) * HW;
  const T* y = act.relu ? act.y : nullptr;
  // dgamma and dbeta first (they only read): dx or the residual's gradient may then be written over dy.
  if ((dgamma || dbeta) && C > 0) {
    group_norm_backward_param_kernel<<<blocks_for(C), kReduceThreads, 0, detail::stream()>>>(
        N, C, HW, G, dy, x, save_mean, save_invstd, dgamma, dbeta, beta_param, y);
    TALLY_LAUNCH_CHECK("group_norm_backward.params");
  }
  if (dx && M > 0 && N * G > 0) {
    group_norm_backward_dx_kernel<<<blocks_for(N * G), kReduceThreads, 0, detail::stream()>>>(
        N, C, HW, G, dy, x, gamma, save_mean, save_invstd, dx, beta_dx, y, act.dresidual, act.beta_residual);
    TALLY_LAUNCH_CHECK("group_norm_backward.dx");
  } else if (act.dresidual && N * C * HW > 0) {
    const i64 n = N * C * HW;
    masked_store_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, dy, y, act.dresidual, act.beta_residual);
    TALLY_LAUNCH_CHECK("group_norm_backward.residual");
  }
}

void set_batch_norm_vectorized(bool on) { g_vectorized = on; }

TALLY_INSTANTIATE_NORM(float)
TALLY_INSTANTIATE_NORM(bf16)
TALLY_INSTANTIATE_MOMENTS(float)

}  // namespace tally::kernels::cuda
