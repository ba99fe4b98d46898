// kernels/cpu/pool.cpp — NCHW pooling on the CPU with PyTorch's semantics (floor mode):
// max pooling (with int32 argmax), average pooling (count_include_pad either way) and
// adaptive average pooling, forward and backward. Each (n, c) plane is independent: OpenMP
// runs over the N*C planes, one thread per plane, so every sum has a fixed order.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"

namespace tally::kernels::cpu {

namespace {

// plane (n elements) = beta * plane, never reading it when beta == 0.
template <class T>
void scale_plane(i64 n, T beta, T* y) {
  if (beta == T(0)) {
    std::fill(y, y + n, T(0));
  } else if (beta != T(1)) {
    for (i64 i = 0; i < n; ++i) y[i] *= beta;
  }
}

// The plane a backward pass accumulates into, in P<T>: dx itself for float and double; for bf16 a
// float32 copy of beta * dx that finish() stores back, rounded once, so that the overlapping
// windows' contributions add in float32.
template <class T>
class GradPlane {
 public:
  using M = P<T>;
  GradPlane(i64 n, M beta, T* dx) : n_(n), dx_(dx) {
    if constexpr (std::is_same_v<T, M>) {
      acc_ = dx;
      scale_plane(n, beta, dx);
    } else {
      buf_.resize(static_cast<std::size_t>(n));
      acc_ = buf_.data();
      for (i64 i = 0; i < n; ++i) acc_[i] = beta == M(0) ? M(0) : beta * M(dx[i]);
    }
  }
  M* data() { return acc_; }
  void finish() {
    if constexpr (!std::is_same_v<T, M>)
      for (i64 i = 0; i < n_; ++i) dx_[i] = T(acc_[i]);
  }

 private:
  i64 n_;
  T* dx_;
  M* acc_ = nullptr;
  std::vector<M> buf_;
};

// Average-pooling window of output (p, q), as PyTorch's avg_pool2d (ceil_mode = false):
// the window is first clipped to the padded bounds (its size there is the divisor when
// count_include_pad), then to the image (its size there is the divisor otherwise).
struct AvgWindow {
  i64 h0, h1, w0, w1;  // in-bounds rows [h0, h1), columns [w0, w1)
  i64 divisor;
};

AvgWindow avg_window(const Pool2dShape& s, bool count_include_pad, i64 p, i64 q) {
  i64 h0 = p * s.stride_h - s.pad_h, w0 = q * s.stride_w - s.pad_w;
  i64 h1 = std::min(h0 + s.kh, s.H + s.pad_h), w1 = std::min(w0 + s.kw, s.W + s.pad_w);
  const i64 padded_size = (h1 - h0) * (w1 - w0);
  h0 = std::max<i64>(h0, 0);
  w0 = std::max<i64>(w0, 0);
  h1 = std::min(h1, s.H);
  w1 = std::min(w1, s.W);
  const i64 divisor = count_include_pad ? padded_size : (h1 - h0) * (w1 - w0);
  return {h0, h1, w0, w1, divisor};
}

// Adaptive window [start, end) of output i over an input extent n split into out parts.
inline i64 adaptive_start(i64 i, i64 n, i64 out) { return (i * n) / out; }
inline i64 adaptive_end(i64 i, i64 n, i64 out) { return ((i + 1) * n + out - 1) / out; }

}  // namespace

// Channels-last max pooling: every output pixel's channels at once, in blocks of 64 held in float32
// (P<T>) registers, the window visited in the row-major kernel's order with its rules (-inf start,
// a NaN replaces the max: the comparison as a select, so the channel loop vectorizes), so each
// channel's result and argmax are the row-major kernel's.
template <class T>
void max_pool2d_forward_nhwc(const Pool2dShape& s, const T* x, T* y, std::int32_t* argmax) {
  using M = cpu::P<T>;
  constexpr i64 kBlock = 64;
  const i64 P = s.P(), Q = s.Q(), C = s.C;
#pragma omp parallel for schedule(static) if (s.N * C * P * Q > 16384)
  for (i64 np = 0; np < s.N * P; ++np) {
    const i64 n = np / P, p = np % P;
    const i64 h0 = std::max<i64>(p * s.stride_h - s.pad_h, 0);
    const i64 h1 = std::min(p * s.stride_h - s.pad_h + s.kh, s.H);
    M best[kBlock];
    std::int32_t at[kBlock];
    for (i64 q = 0; q < Q; ++q) {
      const i64 w0 = std::max<i64>(q * s.stride_w - s.pad_w, 0);
      const i64 w1 = std::min(q * s.stride_w - s.pad_w + s.kw, s.W);
      const auto first = static_cast<std::int32_t>((h0 < h1 && w0 < w1) ? h0 * s.W + w0 : -1);
      for (i64 c0 = 0; c0 < C; c0 += kBlock) {
        const i64 cn = std::min(kBlock, C - c0);
        for (i64 c = 0; c < cn; ++c) best[c] = -std::numeric_limits<M>::infinity(), at[c] = first;
        for (i64 h = h0; h < h1; ++h)
          for (i64 w = w0; w < w1; ++w) {
            const T* xp = x + ((n * s.H + h) * s.W + w) * C + c0;
            const auto here = static_cast<std::int32_t>(h * s.W + w);
            for (i64 c = 0; c < cn; ++c) {
              const M v = M(xp[c]);
              const bool take = v > best[c] || v != v;  // v != v: NaN
              best[c] = take ? v : best[c];
              at[c] = take ? here : at[c];
            }
          }
        T* yp = y + ((n * P + p) * Q + q) * C + c0;
        std::int32_t* ap = argmax + ((n * P + p) * Q + q) * C + c0;
        for (i64 c = 0; c < cn; ++c) yp[c] = T(best[c]), ap[c] = at[c];
      }
    }
  }
}

template <class T>
void max_pool2d_forward(const Pool2dShape& s,
                        const T* x,              // (N, C, H, W)
                        T* y,                    // (N, C, P, Q)
                        std::int32_t* argmax) {  // (N, C, P, Q)
  const i64 P = s.P(), Q = s.Q(), HW = s.H * s.W, planes = s.N * s.C;
  if (s.channels_last) return max_pool2d_forward_nhwc(s, x, y, argmax);
#pragma omp parallel for schedule(static) if (planes * P * Q > 16384)
  for (i64 pl = 0; pl < planes; ++pl) {
    const T* xp = x + pl * HW;               // (H, W)
    T* yp = y + pl * P * Q;                  // (P, Q)
    std::int32_t* ap = argmax + pl * P * Q;  // (P, Q)
    for (i64 p = 0; p < P; ++p) {
      const i64 h0 = std::max<i64>(p * s.stride_h - s.pad_h, 0);
      const i64 h1 = std::min(p * s.stride_h - s.pad_h + s.kh, s.H);
      for (i64 q = 0; q < Q; ++q) {
        const i64 w0 = std::max<i64>(q * s.stride_w - s.pad_w, 0);
        const i64 w1 = std::min(q * s.stride_w - s.pad_w + s.kw, s.W);
        // PyTorch: start from -inf at the first in-bounds element; a NaN always replaces
        // the current max (so the last NaN of the window wins and the output is NaN).
        using M = cpu::P<T>;
        M best = -std::numeric_limits<M>::infinity();
        i64 best_i = (h0 < h1 && w0 < w1) ? h0 * s.W + w0 : -1;
        for (i64 h = h0; h < h1; ++h) {
          for (i64 w = w0; w < w1; ++w) {
            const M v = M(xp[h * s.W + w]);
            if (v > best || std::isnan(v)) {
              best = v;
              best_i = h * s.W + w;
            }
          }
        }
        yp[p * Q + q] = T(best);
        ap[p * Q + q] = static_cast<std::int32_t>(best_i);
      }
    }
  }
}

template <class T>
void max_pool2d_backward(const Pool2dShape& s,
                         const T* dy,                 // (N, C, P, Q)
                         const std::int32_t* argmax,  // (N, C, P, Q)
                         T* dx,                       // (N, C, H, W)
                         P<T> beta) {
  const i64 PQ = s.P() * s.Q(), HW = s.H * s.W, planes = s.N * s.C;
  if (s.channels_last) {
    // Per image: the windows in the same order as the row-major loop, each adding its channels.
    const i64 C = s.C;
#pragma omp parallel for schedule(static) if (planes * HW > 16384)
    for (i64 n = 0; n < s.N; ++n) {
      const T* dyp = dy + n * PQ * C;                // (P, Q, C)
      const std::int32_t* ap = argmax + n * PQ * C;  // (P, Q, C)
      GradPlane<T> image(HW * C, beta, dx + n * HW * C);  // (H, W, C)
      auto* dxp = image.data();
      for (i64 i = 0; i < PQ; ++i)
        for (i64 c = 0; c < C; ++c)
          if (ap[i * C + c] >= 0) dxp[ap[i * C + c] * C + c] += P<T>(dyp[i * C + c]);
      image.finish();
    }
    return;
  }
#pragma omp parallel for schedule(static) if (planes * HW > 16384)
  for (i64 pl = 0; pl < planes; ++pl) {
    const T* dyp = dy + pl * PQ;                // (P, Q)
    const std::int32_t* ap = argmax + pl * PQ;  // (P, Q)
    GradPlane<T> plane(HW, beta, dx + pl * HW);  // (H, W)
    auto* dxp = plane.data();
    for (i64 i = 0; i < PQ; ++i) {
      if (ap[i] >= 0) dxp[ap[i]] += P<T>(dyp[i]);  // -1 only for an all-padding window
    }
    plane.finish();
  }
}

template <class T>
void avg_pool2d_forward(const Pool2dShape& s, bool count_include_pad,
                        const T* x,  // (N, C, H, W)
                        T* y) {      // (N, C, P, Q)
  const i64 P = s.P(), Q = s.Q(), HW = s.H * s.W, planes = s.N * s.C;
#pragma omp parallel for schedule(static) if (planes * P * Q > 16384)
  for (i64 pl = 0; pl < planes; ++pl) {
    const T* xp = x + pl * HW;  // (H, W)
    T* yp = y + pl * P * Q;     // (P, Q)
    for (i64 p = 0; p < P; ++p) {
      for (i64 q = 0; q < Q; ++q) {
        const AvgWindow win = avg_window(s, count_include_pad, p, q);
        double acc = 0.0;
        for (i64 h = win.h0; h < win.h1; ++h)
          for (i64 w = win.w0; w < win.w1; ++w) acc += static_cast<double>(xp[h * s.W + w]);
        yp[p * Q + q] =
            win.divisor > 0 ? static_cast<T>(acc / static_cast<double>(win.divisor)) : T(0);
      }
    }
  }
}

template <class T>
void avg_pool2d_backward(const Pool2dShape& s, bool count_include_pad,
                         const T* dy,  // (N, C, P, Q)
                         T* dx,        // (N, C, H, W)
                         P<T> beta) {
  using M = cpu::P<T>;
  const i64 P = s.P(), Q = s.Q(), HW = s.H * s.W, planes = s.N * s.C;
#pragma omp parallel for schedule(static) if (planes * HW > 16384)
  for (i64 pl = 0; pl < planes; ++pl) {
    const T* dyp = dy + pl * P * Q;  // (P, Q)
    GradPlane<T> plane(HW, beta, dx + pl * HW);  // (H, W)
    M* dxp = plane.data();
    for (i64 p = 0; p < P; ++p) {
      for (i64 q = 0; q < Q; ++q) {
        const AvgWindow win = avg_window(s, count_include_pad, p, q);
        if (win.divisor <= 0) continue;
        const M g = M(dyp[p * Q + q]) / static_cast<M>(win.divisor);
        for (i64 h = win.h0; h < win.h1; ++h)
          for (i64 w = win.w0; w < win.w1; ++w) dxp[h * s.W + w] += g;
      }
    }
    plane.finish();
  }
}

template <class T>
void adaptive_avg_pool2d_forward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW,
                                 const T* x,  // (N, C, H, W)
                                 T* y) {      // (N, C, OH, OW)
  const i64 HW = H * W, planes = N * C;
#pragma omp parallel for schedule(static) if (planes * HW > 16384)
  for (i64 pl = 0; pl < planes; ++pl) {
    const T* xp = x + pl * HW;  // (H, W)
    T* yp = y + pl * OH * OW;   // (OH, OW)
    for (i64 i = 0; i < OH; ++i) {
      const i64 h0 = adaptive_start(i, H, OH), h1 = adaptive_end(i, H, OH);
      for (i64 j = 0; j < OW; ++j) {
        const i64 w0 = adaptive_start(j, W, OW), w1 = adaptive_end(j, W, OW);
        double acc = 0.0;
        for (i64 h = h0; h < h1; ++h)
          for (i64 w = w0; w < w1; ++w) acc += static_cast<double>(xp[h * W + w]);
        const i64 count = (h1 - h0) * (w1 - w0);
        yp[i * OW + j] = count > 0 ? static_cast<T>(acc / static_cast<double>(count)) : T(0);
      }
    }
  }
}

template <class T>
void adaptive_avg_pool2d_backward(i64 N, i64 C, i64 H, i64 W, i64 OH, i64 OW,
                                  const T* dy,  // (N, C, OH, OW)
                                  T* dx,        // (N, C, H, W)
                                  P<T> beta) {
  using M = P<T>;
  const i64 HW = H * W, planes = N * C;
#pragma omp parallel for schedule(static) if (planes * HW > 16384)
  for (i64 pl = 0; pl < planes; ++pl) {
    const T* dyp = dy + pl * OH * OW;  // (OH, OW)
    GradPlane<T> plane(HW, beta, dx + pl * HW);  // (H, W)
    M* dxp = plane.data();
    for (i64 i = 0; i < OH; ++i) {
      const i64 h0 = adaptive_start(i, H, OH), h1 = adaptive_end(i, H, OH);
      for (i64 j = 0; j < OW; ++j) {
        const i64 w0 = adaptive_start(j, W, OW), w1 = adaptive_end(j, W, OW);
        const i64 count = (h1 - h0) * (w1 - w0);
        if (count <= 0) continue;
        const M g = M(dyp[i * OW + j]) / static_cast<M>(count);
        for (i64 h = h0; h < h1; ++h)
          for (i64 w = w0; w < w1; ++w) dxp[h * W + w] += g;
      }
    }
    plane.finish();
  }
}

TALLY_INSTANTIATE_POOL(float)
TALLY_INSTANTIATE_POOL(double)
TALLY_INSTANTIATE_POOL(bf16)

}  // namespace tally::kernels::cpu
