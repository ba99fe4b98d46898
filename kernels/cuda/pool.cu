// kernels/cuda/pool.cu — NCHW pooling on the GPU with PyTorch's semantics (floor mode): max
// pooling (int32 argmax), average pooling (count_include_pad either way), adaptive average
// pooling; the CUDA twin of kernels/cpu/pool.cpp.
//
// Forward: one thread per output element, its window summed in the CPU's order (rows, then
// columns) in double. Backward: one thread per *input* element, which gathers the gradient of
// every output whose window holds it, in increasing output order — the order in which the CPU's
// scatter adds them — so overlapping windows need no atomics and the sums match the CPU's.
// bf16: the same, each window's comparisons and each gradient's sum in float32 (compute_t<T>, the
// CPU's P<T>), rounded once to bf16 as the CPU's float32 gradient plane is.
// Max pooling also runs channels-last (Pool2dShape::channels_last: x, y, argmax, dx, dy stored
// (N, H, W, C) / (N, P, Q, C), the argmax still h * W + w): the same threads, indexed so that a
// warp's lanes are neighbouring channels of one position.
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {
using detail::grid_for;
using detail::kThreads;

__device__ __forceinline__ i64 imin(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 imax(i64 a, i64 b) { return a > b ? a : b; }

// Outputs o in [*lo, *hi] (inclusive; empty when *lo > *hi) whose window
// [o * stride - pad, o * stride - pad + k) holds input coordinate h, o in [0, n_out).
__device__ __forceinline__ void windows_holding(i64 h, i64 k, i64 stride, i64 pad, i64 n_out, i64* lo, i64* hi) {
  const i64 num = h + pad - k + 1;  // o * stride >= num
  *lo = num <= 0 ? 0 : (num + stride - 1) / stride;
  *hi = imin(n_out - 1, (h + pad) / stride);  // o * stride <= h + pad
}

// Average-pooling window of output (p, q) as the CPU's avg_window.
struct AvgWindow {
  i64 h0, h1, w0, w1, divisor;
};
__device__ __forceinline__ AvgWindow avg_window(const Pool2dShape& s, bool count_include_pad, i64 p, i64 q) {
  i64 h0 = p * s.stride_h - s.pad_h, w0 = q * s.stride_w - s.pad_w;
  i64 h1 = imin(h0 + s.kh, s.H + s.pad_h), w1 = imin(w0 + s.kw, s.W + s.pad_w);
  const i64 padded_size = (h1 - h0) * (w1 - w0);
  h0 = imax(h0, 0);
  w0 = imax(w0, 0);
  h1 = imin(h1, s.H);
  w1 = imin(w1, s.W);
  const i64 divisor = count_include_pad ? padded_size : (h1 - h0) * (w1 - w0);
  return {h0, h1, w0, w1, divisor};
}

__device__ __forceinline__ i64 adaptive_start(i64 i, i64 n, i64 out) { return (i * n) / out; }
__device__ __forceinline__ i64 adaptive_end(i64 i, i64 n, i64 out) { return ((i + 1) * n + out - 1) / out; }

// ---- CUDA kernels ------------------------------------------------------------------------------

// Element i of an (N, C, A, B) tensor stored row-major or channels-last: its (plane = n * C + c, a, b),
// and the offset of (a', b') of the same plane in a tensor of A' x B' positions: `base + (a' * B' + b') * step`.
struct PlaneIndex {
  i64 a, b, base, step;
};
__device__ __forceinline__ PlaneIndex plane_index(i64 i, i64 C, i64 A, i64 B, i64 A2, i64 B2, bool channels_last) {
  if (channels_last) {  // i = ((n * A + a) * B + b) * C + c
    const i64 c = i % C, b = (i / C) % B, a = (i / (C * B)) % A, n = i / (C * B * A);
    return {a, b, n * A2 * B2 * C + c, C};
  }
  const i64 b = i % B, a = (i / B) % A, plane = i / (A * B);
  return {a, b, plane * A2 * B2, 1};
}

template <class T>
__global__ void max_pool2d_forward_kernel(Pool2dShape s, i64 P, i64 Q, const T* __restrict__ x, T* __restrict__ y,
                                          std::int32_t* __restrict__ argmax) {
  const i64 total = s.N * s.C * P * Q;
  TALLY_GRID_LOOP(i, total) {
    const PlaneIndex at = plane_index(i, s.C, P, Q, s.H, s.W, s.channels_last);
    const i64 p = at.a, q = at.b, step = at.step;
    const T* xp = x + at.base;  // (H, W), `step` apart
    const i64 h0 = imax(p * s.stride_h - s.pad_h, 0), h1 = imin(p * s.stride_h - s.pad_h + s.kh, s.H);
    const i64 w0 = imax(q * s.stride_w - s.pad_w, 0), w1 = imin(q * s.stride_w - s.pad_w + s.kw, s.W);
    // As the CPU (and PyTorch): start at -inf; a NaN always replaces the current max.
    using M = compute_t<T>;
    M best = -INFINITY;
    i64 best_i = (h0 < h1 && w0 < w1) ? h0 * s.W + w0 : -1;
    for (i64 h = h0; h < h1; ++h) {
      for (i64 w = w0; w < w1; ++w) {
        const M v = M(xp[(h * s.W + w) * step]);
        if (v > best || v != v) {
          best = v;
          best_i = h * s.W + w;
        }
      }
    }
    y[i] = static_cast<T>(best);
    argmax[i] = static_cast<std::int32_t>(best_i);
  }
}

template <class T>
__global__ void max_pool2d_backward_kernel(Pool2dShape s, i64 P, i64 Q, const T* __restrict__ dy,
                                           const std::int32_t* __restrict__ argmax, T* __restrict__ dx,
                                           compute_t<T> beta) {
  using M = compute_t<T>;
  const i64 total = s.N * s.C * s.H * s.W;
  TALLY_GRID_LOOP(i, total) {
    const PlaneIndex at = plane_index(i, s.C, s.H, s.W, P, Q, s.channels_last);
    const i64 h = at.a, w = at.b, step = at.step;
    const std::int32_t me = static_cast<std::int32_t>(h * s.W + w);
    const T* dyp = dy + at.base;                // (P, Q), `step` apart
    const std::int32_t* ap = argmax + at.base;  // (P, Q), `step` apart
    i64 p_lo, p_hi, q_lo, q_hi;
    windows_holding(h, s.kh, s.stride_h, s.pad_h, P, &p_lo, &p_hi);
    windows_holding(w, s.kw, s.stride_w, s.pad_w, Q, &q_lo, &q_hi);
    M acc = beta == M(0) ? M(0) : beta * M(dx[i]);
    for (i64 p = p_lo; p <= p_hi; ++p)
      for (i64 q = q_lo; q <= q_hi; ++q)
        if (ap[(p * Q + q) * step] == me) acc += M(dyp[(p * Q + q) * step]);
    dx[i] = static_cast<T>(acc);
  }
}

template <class T>
__global__ void avg_pool2d_forward_kernel(Pool2dShape s, i64 P, i64 Q, bool count_include_pad,
                                          const T* __restrict__ x, T* __restrict__ y) {
  const i64 total = s.N * s.C * P * Q;
  TALLY_GRID_LOOP(i, total) {
    const i64 q = i % Q, p = (i / Q) % P, plane = i / (P * Q);
    const T* xp = x + plane * s.H * s.W;
    const AvgWindow win = avg_window(s, count_include_pad, p, q);
    double acc = 0.0;
    for (i64 h = win.h0; h < win.h1; ++h)
      for (i64 w = win.w0; w < win.w1; ++w) acc += static_cast<double>(xp[h * s.W + w]);
    y[i] = win.divisor > 0 ? static_cast<T>(acc / static_cast<double>(win.divisor)) : T(0);
  }
}

template <class T>
__global__ void avg_pool2d_backward_kernel(Pool2dShape s, i64 P, i64 Q, bool count_include_pad,
                                           const T* __restrict__ dy, T* __restrict__ dx, compute_t<T> beta) {
  using M = compute_t<T>;
  const i64 total = s.N * s.C * s.H * s.W;
  TALLY_GRID_LOOP(i, total) {
    const i64 w = i % s.W, h = (i / s.W) % s.H, plane = i / (s.H * s.W);
    const T* dyp = dy + plane * P * Q;
    i64 p_lo, p_hi, q_lo, q_hi;
    windows_holding(h, s.kh, s.stride_h, s.pad_h, P, &p_lo, &p_hi);
    windows_holding(w, s.kw, s.stride_w, s.pad_w, Q, &q_lo, &q_hi);
    M acc = beta == M(0) ? M(0) : beta * M(dx[i]);
    for (i64 p = p_lo; p <= p_hi; ++p) {
      for (i64 q = q_lo; q <= q_hi; ++q) {
        // The window clipped to the image holds (h, w) exactly when the unclipped one does.
        const AvgWindow win = avg_window(s, count_include_pad, p, q);
        if (win.divisor <= 0) continue;
        acc += M(dyp[p * Q + q]) / static_cast<M>(win.divisor);
      }
    }
    dx[i] = static_cast<T>(acc);
  }
}

template <class T>
__global__ void adaptive_avg_pool2d_forward_kernel(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW,
                                                   const T* __restrict__ x, T* __restrict__ y) {
  const i64 total = N * C * OH * OW;
  TALLY_GRID_LOOP(idx, total) {
    const i64 j = idx % OW, i = (idx / OW) % OH, plane = idx / (OH * OW);
    const T* xp = x + plane * H * W;
    const i64 h0 = adaptive_start(i, H, OH), h1 = adaptive_end(i, H, OH);
    const i64 w0 = adaptive_start(j, W, OW), w1 = adaptive_end(j, W, OW);
    double acc = 0.0;
    for (i64 h = h0; h < h1; ++h)
      for (i64 w = w0; w < w1; ++w) acc += static_cast<double>(xp[h * W + w]);
    const i64 count = (h1 - h0) * (w1 - w0);
    y[idx] = count > 0 ? static_cast<T>(acc / static_cast<double>(count)) : T(0);
  }
}

// Outputs i whose adaptive window [start(i), end(i)) holds h: from floor(h*OH/H) to
// ceil((h+1)*OH/H) - 1; one more on each side is tested explicitly, so rounding cannot drop one.
__device__ __forceinline__ void adaptive_holding(i64 h, i64 n, i64 out, i64* lo, i64* hi) {
  *lo = imax(0, (h * out) / n - 1);
  *hi = imin(out - 1, ((h + 1) * out + n - 1) / n);
}

template <class T>
__global__ void adaptive_avg_pool2d_backward_kernel(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW,
                                                    const T* __restrict__ dy, T* __restrict__ dx,
                                                    compute_t<T> beta) {
  using M = compute_t<T>;
  const i64 total = N * C * H * W;
  TALLY_GRID_LOOP(idx, total) {
    const i64 w = idx % W, h = (idx / W) % H, plane = idx / (H * W);
    const T* dyp = dy + plane * OH * OW;
    i64 i_lo, i_hi, j_lo, j_hi;
    adaptive_holding(h, H, OH, &i_lo, &i_hi);
    adaptive_holding(w, W, OW, &j_lo, &j_hi);
    M acc = beta == M(0) ? M(0) : beta * M(dx[idx]);
    for (i64 i = i_lo; i <= i_hi; ++i) {
      const i64 h0 = adaptive_start(i, H, OH), h1 = adaptive_end(i, H, OH);
      if (h < h0 || h >= h1) continue;
      for (i64 j = j_lo; j <= j_hi; ++j) {
        const i64 w0 = adaptive_start(j, W, OW), w1 = adaptive_end(j, W, OW);
        if (w < w0 || w >= w1) continue;
        const i64 count = (h1 - h0) * (w1 - w0);
        acc += M(dyp[i * OW + j]) / static_cast<M>(count);
      }
    }
    dx[idx] = static_cast<T>(acc);
  }
}

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

template <class T>
void max_pool2d_forward(const Pool2dShape& s,
                        const T* x,              // (N, C, H, W)
                        T* y,                    // (N, C, P, Q)
                        std::int32_t* argmax) {  // (N, C, P, Q)
  const i64 P = s.P(), Q = s.Q(), total = s.N * s.C * P * Q;
  if (P <= 0 || Q <= 0 || total <= 0) return;
  max_pool2d_forward_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(s, P, Q, x, y, argmax);
  TALLY_LAUNCH_CHECK("max_pool2d_forward");
}

template <class T>
void max_pool2d_backward(const Pool2dShape& s,
                         const T* dy,                 // (N, C, P, Q)
                         const std::int32_t* argmax,  // (N, C, P, Q)
                         T* dx,                       // (N, C, H, W)
                         P<T> beta) {
  const i64 total = s.N * s.C * s.H * s.W;
  if (total <= 0) return;
  max_pool2d_backward_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(s, s.P(), s.Q(), dy, argmax, dx,
                                                                                  beta);
  TALLY_LAUNCH_CHECK("max_pool2d_backward");
}

template <class T>
void avg_pool2d_forward(const Pool2dShape& s, bool count_include_pad,
                        const T* x,  // (N, C, H, W)
                        T* y) {      // (N, C, P, Q)
  const i64 P = s.P(), Q = s.Q(), total = s.N * s.C * P * Q;
  if (P <= 0 || Q <= 0 || total <= 0) return;
  avg_pool2d_forward_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(s, P, Q, count_include_pad, x, y);
  TALLY_LAUNCH_CHECK("avg_pool2d_forward");
}

template <class T>
void avg_pool2d_backward(const Pool2dShape& s, bool count_include_pad,
                         const T* dy,  // (N, C, P, Q)
                         T* dx,        // (N, C, H, W)
                         P<T> beta) {
  const i64 total = s.N * s.C * s.H * s.W;
  if (total <= 0) return;
  avg_pool2d_backward_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(s, s.P(), s.Q(), count_include_pad,
                                                                                  dy, dx, beta);
  TALLY_LAUNCH_CHECK("avg_pool2d_backward");
}

template <class T>
void adaptive_avg_pool2d_forward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW,
                                 const T* x,  // (N, C, H, W)
                                 T* y) {      // (N, C, OH, OW)
  const i64 total = N * C * OH * OW;
  if (total <= 0) return;
  adaptive_avg_pool2d_forward_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(N, C, H, W, OH, OW, x, y);
  TALLY_LAUNCH_CHECK("adaptive_avg_pool2d_forward");
}

template <class T>
void adaptive_avg_pool2d_backward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW,
                                  const T* dy,  // (N, C, OH, OW)
                                  T* dx,        // (N, C, H, W)
                                  P<T> beta) {
  const i64 total = N * C * H * W;
  if (total <= 0 || OH <= 0 || OW <= 0) return;
  adaptive_avg_pool2d_backward_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(N, C, H, W, OH, OW, dy, dx,
                                                                                           beta);
  TALLY_LAUNCH_CHECK("adaptive_avg_pool2d_backward");
}

TALLY_INSTANTIATE_POOL(float)
TALLY_INSTANTIATE_POOL(bf16)

}  // namespace tally::kernels::cuda
