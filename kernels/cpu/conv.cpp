// kernels/cpu/conv.cpp — 2-D convolution (cross-correlation, as PyTorch), NCHW, on the CPU:
// forward, backward data, backward filter and backward bias. Two algorithms:
//   onednn     float32 and bf16 on oneDNN (conv_onednn.cpp: its blocked layouts, every byte in
//              the workspace), the default where the build has oneDNN and oneDNN takes the shape;
//   reference  im2col / col2im + GEMM, one image and one group at a time, float32 and float64 —
//              what the fast path and the CUDA kernels are tested against (TALLY_CPU_CONV=
//              reference or set_conv_algorithm choose it for float32 too).
// A bf16 convolution that oneDNN does not run (no AVX-512, the reference chosen, a shape it
// refuses) is widened: chunks of samples converted to float32 in the workspace, the weights
// rounded to bf16 there, and the float32 convolution run on them (namespace widened below).
// Stride, padding, dilation and groups are supported by both.
//
// Column matrix of one image and one group: col ((C/g) * R * S, P * Q); row (c * R + r) * S + s,
// column p * Q + q holds x[c][p * stride_h - pad_h + r * dil_h][q * stride_w - pad_w + s * dil_w]
// (0 outside the image). A 1x1 kernel with stride 1 and no padding needs no columns: the input
// block x_n,g ((C/g), H * W) already is the column matrix.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"
#if TALLY_HAVE_ONEDNN
#include "kernels/cpu/onednn.h"
#endif

namespace tally::kernels::cpu {

namespace {

// True when the convolution is a plain GEMM on the input (no im2col needed). Dilation has no
// effect on a 1x1 kernel, so it is not tested.
bool is_plain_gemm(const Conv2dShape& s) {
  return s.R == 1 && s.S == 1 && s.stride_h == 1 && s.stride_w == 1 && s.pad_h == 0 && s.pad_w == 0;
}

// Output positions o in [0, n_out) whose input coordinate o * stride + off lies in [0, limit):
// returns them as the half-open range [*lo, *hi) (empty when *lo == *hi).
void valid_range(i64 off, i64 stride, i64 limit, i64 n_out, i64* lo, i64* hi) {
  i64 l = off >= 0 ? 0 : (-off + stride - 1) / stride;
  i64 h = (limit - 1 - off) < 0 ? 0 : (limit - 1 - off) / stride + 1;
  h = std::min(h, n_out);
  l = std::min(l, h);
  *lo = l;
  *hi = h;
}

// col ((Cg * R * S), P * Q) = im2col of x ((Cg), H, W), one image and one group.
template <class T>
void im2col(const Conv2dShape& s, i64 Cg, i64 P, i64 Q,
            const T* x,  // (Cg, H, W)
            T* col) {    // (Cg * R * S, P * Q)
  const i64 rows = Cg * s.R * s.S;
  // Each row of col is written by exactly one iteration: race-free.
#pragma omp parallel for schedule(static) if (rows * P * Q > 32768)
  for (i64 row = 0; row < rows; ++row) {
    const i64 c = row / (s.R * s.S);
    const i64 r = (row / s.S) % s.R;
    const i64 sx = row % s.S;
    const T* xc = x + c * s.H * s.W;  // (H, W)
    T* crow = col + row * P * Q;      // (P, Q)
    i64 p_lo, p_hi, q_lo, q_hi;
    const i64 off_h = r * s.dil_h - s.pad_h;
    const i64 off_w = sx * s.dil_w - s.pad_w;
    valid_range(off_h, s.stride_h, s.H, P, &p_lo, &p_hi);
    valid_range(off_w, s.stride_w, s.W, Q, &q_lo, &q_hi);
    for (i64 p = 0; p < P; ++p) {
      T* out = crow + p * Q;  // (Q)
      if (p < p_lo || p >= p_hi) {
        for (i64 q = 0; q < Q; ++q) out[q] = T(0);
        continue;
      }
      const T* xr = xc + (p * s.stride_h + off_h) * s.W;  // (W)
      for (i64 q = 0; q < q_lo; ++q) out[q] = T(0);
      if (s.stride_w == 1) {
        std::memcpy(out + q_lo, xr + q_lo + off_w,
                    sizeof(T) * static_cast<std::size_t>(q_hi - q_lo));
      } else {
        for (i64 q = q_lo; q < q_hi; ++q) out[q] = xr[q * s.stride_w + off_w];
      }
      for (i64 q = q_hi; q < Q; ++q) out[q] = T(0);
    }
  }
}

// dx ((Cg), H, W) += col2im of col ((Cg * R * S), P * Q), one image and one group.
template <class T>
void col2im_add(const Conv2dShape& s, i64 Cg, i64 P, i64 Q,
                const T* col,  // (Cg * R * S, P * Q)
                T* dx) {       // (Cg, H, W)
  // Rows of one channel c all land in dx channel c, and one thread owns the whole channel:
  // race-free, and the summation order inside a channel is fixed (r, s, p, q ascending).
#pragma omp parallel for schedule(static) if (Cg * s.R * s.S * P * Q > 32768)
  for (i64 c = 0; c < Cg; ++c) {
    T* dxc = dx + c * s.H * s.W;  // (H, W)
    for (i64 r = 0; r < s.R; ++r) {
      for (i64 sx = 0; sx < s.S; ++sx) {
        const T* crow = col + ((c * s.R + r) * s.S + sx) * P * Q;  // (P, Q)
        i64 p_lo, p_hi, q_lo, q_hi;
        const i64 off_h = r * s.dil_h - s.pad_h;
        const i64 off_w = sx * s.dil_w - s.pad_w;
        valid_range(off_h, s.stride_h, s.H, P, &p_lo, &p_hi);
        valid_range(off_w, s.stride_w, s.W, Q, &q_lo, &q_hi);
        for (i64 p = p_lo; p < p_hi; ++p) {
          const T* in = crow + p * Q;                    // (Q)
          T* dr = dxc + (p * s.stride_h + off_h) * s.W;  // (W)
          for (i64 q = q_lo; q < q_hi; ++q) dr[q * s.stride_w + off_w] += in[q];
        }
      }
    }
  }
}

// y (N, K, P, Q) += bias (K) per channel.
template <class T>
void add_bias(const Conv2dShape& s, const P<T>* bias, T* y) {
  using M = P<T>;
  const i64 PQ = s.P() * s.Q();
#pragma omp parallel for collapse(2) schedule(static) if (s.N * s.K * PQ > 32768)
  for (i64 n = 0; n < s.N; ++n)
    for (i64 k = 0; k < s.K; ++k) {
      const M b = bias[k];
      T* yk = y + (n * s.K + k) * PQ;  // (P * Q)
      for (i64 i = 0; i < PQ; ++i) yk[i] = T(M(yk[i]) + b);
    }
}

// y (n elements) = beta * y, never reading y when beta == 0.
template <class T>
void scale_out(i64 n, T beta, T* y) {
  if (beta == T(0)) {
    std::fill(y, y + n, T(0));
  } else if (beta != T(1)) {
    for (i64 i = 0; i < n; ++i) y[i] *= beta;
  }
}

}  // namespace

// ---- the reference: im2col / col2im + GEMM ----------------------------------------------------
namespace reference {

template <class T>
std::size_t workspace_bytes(const Conv2dShape& s) {
  if (is_plain_gemm(s)) return 0;
  const i64 P = s.P(), Q = s.Q();
  if (P <= 0 || Q <= 0) return 0;
  const i64 elems = (s.C / s.groups) * s.R * s.S * P * Q;
  return static_cast<std::size_t>(elems) * sizeof(T);
}

template <class T>
void forward(const Conv2dShape& s,
                    const T* x,     // (N, C, H, W)
                    const T* w,     // (K, C/g, R, S)
                    const T* bias,  // (K) or null
                    T* y,           // (N, K, P, Q)
                    void* workspace) {
  const i64 P = s.P(), Q = s.Q(), PQ = P * Q, G = s.groups;
  const i64 Cg = s.C / G, Kg = s.K / G, CRS = Cg * s.R * s.S;
  if (s.N <= 0 || s.K <= 0 || PQ <= 0) return;
  const bool plain = is_plain_gemm(s);
  T* col = static_cast<T*>(workspace);  // (Cg * R * S, P * Q)
  for (i64 n = 0; n < s.N; ++n) {
    for (i64 g = 0; g < G; ++g) {
      const T* xg = x + (n * s.C + g * Cg) * s.H * s.W;  // (Cg, H, W)
      const T* wg = w + g * Kg * CRS;                    // (Kg, Cg * R * S)
      T* yg = y + (n * s.K + g * Kg) * PQ;               // (Kg, P * Q)
      const T* cols = xg;                                // (Cg * R * S, P * Q)
      if (!plain) {
        im2col(s, Cg, P, Q, xg, col);
        cols = col;
      }
      gemm<T>(false, false, Kg, PQ, CRS, T(1), wg, CRS, cols, PQ, T(0), yg, PQ);
    }
  }
  if (bias != nullptr) add_bias(s, bias, y);
}

template <class T>
void backward_data(const Conv2dShape& s,
                          const T* dy,  // (N, K, P, Q)
                          const T* w,   // (K, C/g, R, S)
                          T* dx,        // (N, C, H, W)
                          T beta, void* workspace) {
  const i64 P = s.P(), Q = s.Q(), PQ = P * Q, G = s.groups;
  const i64 Cg = s.C / G, Kg = s.K / G, CRS = Cg * s.R * s.S, HW = s.H * s.W;
  if (s.N <= 0 || s.C <= 0 || HW <= 0) return;
  const bool plain = is_plain_gemm(s);
  T* col = static_cast<T*>(workspace);  // (Cg * R * S, P * Q)
  for (i64 n = 0; n < s.N; ++n) {
    T* dxn = dx + n * s.C * HW;  // (C, H, W)
    if (plain) {
      // dx_n,g (Cg, H*W) (=|+=) W_g^T (Cg, Kg) * dy_n,g (Kg, H*W), straight into dx.
      for (i64 g = 0; g < G; ++g) {
        const T* wg = w + g * Kg * CRS;               // (Kg, Cg)
        const T* dyg = dy + (n * s.K + g * Kg) * PQ;  // (Kg, H*W)
        gemm<T>(true, false, Cg, PQ, Kg, T(1), wg, CRS, dyg, PQ, beta, dxn + g * Cg * HW, PQ);
      }
      continue;
    }
    scale_out(s.C * HW, beta, dxn);
    if (PQ <= 0) continue;
    for (i64 g = 0; g < G; ++g) {
      const T* wg = w + g * Kg * CRS;               // (Kg, Cg * R * S)
      const T* dyg = dy + (n * s.K + g * Kg) * PQ;  // (Kg, P * Q)
      // col (Cg*R*S, P*Q) = W_g^T * dy_n,g, then scattered back (added) into dx_n,g.
      gemm<T>(true, false, CRS, PQ, Kg, T(1), wg, CRS, dyg, PQ, T(0), col, PQ);
      col2im_add(s, Cg, P, Q, col, dxn + g * Cg * HW);
    }
  }
}

template <class T>
void backward_filter(const Conv2dShape& s,
                            const T* x,   // (N, C, H, W)
                            const T* dy,  // (N, K, P, Q)
                            T* dw,        // (K, C/g, R, S)
                            T beta, void* workspace) {
  const i64 P = s.P(), Q = s.Q(), PQ = P * Q, G = s.groups;
  const i64 Cg = s.C / G, Kg = s.K / G, CRS = Cg * s.R * s.S;
  if (s.N <= 0 || PQ <= 0) {  // empty sum: dw = beta * dw
    scale_out(s.K * CRS, beta, dw);
    return;
  }
  const bool plain = is_plain_gemm(s);
  T* col = static_cast<T*>(workspace);  // (Cg * R * S, P * Q)
  for (i64 n = 0; n < s.N; ++n) {
    const T b = n == 0 ? beta : T(1);
    for (i64 g = 0; g < G; ++g) {
      const T* xg = x + (n * s.C + g * Cg) * s.H * s.W;  // (Cg, H, W)
      const T* dyg = dy + (n * s.K + g * Kg) * PQ;       // (Kg, P * Q)
      T* dwg = dw + g * Kg * CRS;                        // (Kg, Cg * R * S)
      const T* cols = xg;                                // (Cg * R * S, P * Q)
      if (!plain) {
        im2col(s, Cg, P, Q, xg, col);
        cols = col;
      }
      // dw_g (Kg, CRS) (=|+=) dy_n,g (Kg, PQ) * col^T (PQ, CRS)
      gemm<T>(false, true, Kg, CRS, PQ, T(1), dyg, PQ, cols, PQ, b, dwg, CRS);
    }
  }
}

}  // namespace reference

// ---- the choice: oneDNN for float32 where it takes the shape, else the reference ---------------
namespace {

ConvAlgorithm initial_algorithm() {
  const char* e = std::getenv("TALLY_CPU_CONV");
  if (e != nullptr && std::string(e) == "reference") return ConvAlgorithm::reference;
  return have_onednn() ? ConvAlgorithm::onednn : ConvAlgorithm::reference;
}
std::atomic<ConvAlgorithm> g_algorithm{initial_algorithm()};

template <class T>
bool use_onednn([[maybe_unused]] const Conv2dShape& s, [[maybe_unused]] ConvPass pass) {
#if TALLY_HAVE_ONEDNN
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    const auto elem = std::is_same_v<T, bf16> ? onednn::Elem::bf16 : onednn::Elem::f32;
    if (elem == onednn::Elem::bf16 && pass == ConvPass::forward && s.bias) return false;  // see Conv2dShape::bias
    return g_algorithm.load() == ConvAlgorithm::onednn && s.N > 0 && s.P() > 0 && s.Q() > 0 &&
           onednn::supports(s, pass, elem);
  }
#endif
  return false;
}

#if TALLY_HAVE_ONEDNN
template <class T>
constexpr onednn::Elem elem_of() {
  return std::is_same_v<T, bf16> ? onednn::Elem::bf16 : onednn::Elem::f32;
}
#endif

}  // namespace

// ---- bf16 where oneDNN does not run it: float32 convolutions on widened chunks ----------------
namespace widened {

Conv2dShape with_samples(Conv2dShape s, i64 n) {
  s.N = n;
  return s;
}
std::size_t aligned(std::size_t n) { return (n + 63) / 64 * 64; }

// Samples per chunk: as many as keep the widened activations of a pass (x or dx, and y or dy,
// float32) within the shape's workspace limit; at least one.
i64 chunk(const Conv2dShape& s) {
  const auto per_sample = static_cast<std::size_t>(4 * (s.C * s.H * s.W + s.K * s.P() * s.Q()));
  return std::clamp<i64>(static_cast<i64>(s.workspace_limit / std::max<std::size_t>(per_sample, 1)), 1,
                         std::max<i64>(s.N, 1));
}

// [ weights, float32 (K, C/g, R, S) ][ x or dx (n, C, H, W) ][ y or dy (n, K, P, Q) ][ the float32
// convolution's own workspace for n samples ]
struct Layout {
  i64 n;
  std::size_t x_at, y_at, ws_at, bytes;
};
Layout layout(const Conv2dShape& s, ConvPass pass) {
  Layout l{};
  l.n = chunk(s);
  const std::size_t w = aligned(4 * static_cast<std::size_t>(s.K * (s.C / s.groups) * s.R * s.S));
  l.x_at = w;
  l.y_at = l.x_at + aligned(4 * static_cast<std::size_t>(l.n * s.C * s.H * s.W));
  l.ws_at = l.y_at + aligned(4 * static_cast<std::size_t>(l.n * s.K * s.P() * s.Q()));
  std::size_t inner = conv2d_workspace_bytes<float>(with_samples(s, l.n), pass);
  if (s.N % l.n != 0) inner = std::max(inner, conv2d_workspace_bytes<float>(with_samples(s, s.N % l.n), pass));
  l.bytes = l.ws_at + inner;
  return l;
}

void widen(i64 n, const bf16* x, float* y) {
#pragma omp parallel for schedule(static) if (n > 32768)
  for (i64 i = 0; i < n; ++i) y[i] = float(x[i]);
}
// The master weights as the bf16 convolution reads them: rounded to bf16, held in float32.
void round_weights(i64 n, const float* w, float* y) {
  for (i64 i = 0; i < n; ++i) y[i] = float(bf16(w[i]));
}

// The two passes that read the weights: forward (in = x, out = y = conv(x) + bias) and
// backward_data (in = dy, out = dx (=|+=) conv_transpose(dy)). The weights rounded once per call,
// then chunk by chunk: widen in, run the float32 pass, round out once.
void data_pass(const Conv2dShape& s, ConvPass pass, const bf16* in, const float* w, const float* bias, bf16* out,
               float beta, void* workspace) {
  const bool fwd = pass == ConvPass::forward;
  const Layout l = layout(s, pass);
  char* base = static_cast<char*>(workspace);
  auto* wf = reinterpret_cast<float*>(base);
  auto* xf = reinterpret_cast<float*>(base + l.x_at);
  auto* yf = reinterpret_cast<float*>(base + l.y_at);
  float *in_f = fwd ? xf : yf, *out_f = fwd ? yf : xf;
  round_weights(s.K * (s.C / s.groups) * s.R * s.S, w, wf);
  const i64 xs = s.C * s.H * s.W, ys = s.K * s.P() * s.Q();
  const i64 in_sample = fwd ? xs : ys, out_sample = fwd ? ys : xs;
  for (i64 start = 0; start < s.N; start += l.n) {
    const i64 len = std::min(l.n, s.N - start);
    widen(len * in_sample, in + start * in_sample, in_f);
    if (fwd)
      conv2d_forward<float>(with_samples(s, len), xf, wf, bias, yf, base + l.ws_at);
    else
      conv2d_backward_data<float>(with_samples(s, len), yf, wf, xf, 0.f, base + l.ws_at);
    bf16* o = out + start * out_sample;
    if (beta == 0.f) {
      for (i64 i = 0; i < len * out_sample; ++i) o[i] = bf16(out_f[i]);
    } else {
      for (i64 i = 0; i < len * out_sample; ++i) o[i] = bf16(beta * float(o[i]) + out_f[i]);
    }
  }
}

void forward(const Conv2dShape& s, const bf16* x, const float* w, const float* bias, bf16* y, void* workspace) {
  data_pass(s, ConvPass::forward, x, w, bias, y, 0.f, workspace);
}
void backward_data(const Conv2dShape& s, const bf16* dy, const float* w, bf16* dx, float beta, void* workspace) {
  data_pass(s, ConvPass::backward_data, dy, w, nullptr, dx, beta, workspace);
}

void backward_filter(const Conv2dShape& s, const bf16* x, const bf16* dy, float* dw, float beta, void* workspace) {
  const Layout l = layout(s, ConvPass::backward_filter);
  char* base = static_cast<char*>(workspace);
  auto* xf = reinterpret_cast<float*>(base + l.x_at);
  auto* dyf = reinterpret_cast<float*>(base + l.y_at);
  const i64 xs = s.C * s.H * s.W, ys = s.K * s.P() * s.Q();
  if (s.N <= 0) return conv2d_backward_filter<float>(s, nullptr, nullptr, dw, beta, base + l.ws_at);
  for (i64 start = 0; start < s.N; start += l.n) {
    const i64 len = std::min(l.n, s.N - start);
    widen(len * xs, x + start * xs, xf);
    widen(len * ys, dy + start * ys, dyf);
    conv2d_backward_filter<float>(with_samples(s, len), xf, dyf, dw, start == 0 ? beta : 1.f, base + l.ws_at);
  }
}

}  // namespace widened

bool have_onednn() { return TALLY_HAVE_ONEDNN; }
void set_conv_algorithm(ConvAlgorithm a) {
  if (a == ConvAlgorithm::onednn && !have_onednn()) a = ConvAlgorithm::reference;
  g_algorithm.store(a);
}
ConvAlgorithm conv_algorithm() { return g_algorithm.load(); }
std::size_t conv_workspace_limit(std::size_t budget) { return std::max(budget / 32, std::size_t(64) << 20); }

bool conv2d_on_onednn(const Conv2dShape& s, ConvPass pass, bool bf16_activations) {
  return bf16_activations ? use_onednn<bf16>(s, pass) : use_onednn<float>(s, pass);
}

template <class T>
bool conv2d_takes_channels_last(const Conv2dShape& shape) {
  Conv2dShape s = shape;
  s.channels_last = true;
  if (s.bias) return false;  // add_bias and conv2d_backward_bias index NCHW
  for (ConvPass pass : {ConvPass::forward, ConvPass::backward_data, ConvPass::backward_filter})
    if (!use_onednn<T>(s, pass)) return false;  // float64 never: oneDNN has no float64 convolutions
  return true;
}
template bool conv2d_takes_channels_last<float>(const Conv2dShape&);
template bool conv2d_takes_channels_last<double>(const Conv2dShape&);
template bool conv2d_takes_channels_last<bf16>(const Conv2dShape&);

template <class T>
std::size_t conv2d_workspace_bytes(const Conv2dShape& s, ConvPass pass) {
#if TALLY_HAVE_ONEDNN
  if (use_onednn<T>(s, pass)) return onednn::conv_workspace_bytes(s, pass, elem_of<T>());
#endif
  if constexpr (std::is_same_v<T, bf16>) return widened::layout(s, pass).bytes;
  (void)pass;
  return reference::workspace_bytes<T>(s);
}

template <class T>
void conv2d_forward(const Conv2dShape& s, const T* x, const P<T>* w, const P<T>* bias, T* y, void* workspace) {
#if TALLY_HAVE_ONEDNN
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    if (use_onednn<T>(s, ConvPass::forward)) {
      onednn::conv_forward(s, elem_of<T>(), x, w, y, workspace);
      if (bias != nullptr) add_bias(s, bias, y);
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<T, bf16>)
    widened::forward(s, x, w, bias, y, workspace);
  else
    reference::forward<T>(s, x, w, bias, y, workspace);
}

template <class T>
void conv2d_backward_data(const Conv2dShape& s, const T* dy, const P<T>* w, T* dx, P<T> beta, void* workspace) {
#if TALLY_HAVE_ONEDNN
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    if ((beta == 0.f || beta == 1.f) && use_onednn<T>(s, ConvPass::backward_data))
      return onednn::conv_backward_data(s, elem_of<T>(), dy, w, dx, beta == 1.f, workspace);
  }
#endif
  if constexpr (std::is_same_v<T, bf16>)
    widened::backward_data(s, dy, w, dx, beta, workspace);
  else
    reference::backward_data<T>(s, dy, w, dx, beta, workspace);
}

template <class T>
void conv2d_backward_filter(const Conv2dShape& s, const T* x, const T* dy, P<T>* dw, P<T> beta, void* workspace) {
#if TALLY_HAVE_ONEDNN
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    if ((beta == 0.f || beta == 1.f) && use_onednn<T>(s, ConvPass::backward_filter))
      return onednn::conv_backward_filter(s, elem_of<T>(), x, dy, dw, beta == 1.f, workspace);
  }
#endif
  if constexpr (std::is_same_v<T, bf16>)
    widened::backward_filter(s, x, dy, dw, beta, workspace);
  else
    reference::backward_filter<T>(s, x, dy, dw, beta, workspace);
}

template <class T>
void conv2d_backward_bias(const Conv2dShape& s,
                          const T* dy,  // (N, K, P, Q)
                          P<T>* db,     // (K)
                          P<T> beta) {
  const i64 PQ = s.P() * s.Q();
  // One thread per channel, fixed summation order (n, then p*Q+q), accumulated in double.
#pragma omp parallel for schedule(static) if (s.N * s.K * PQ > 32768)
  for (i64 k = 0; k < s.K; ++k) {
    double acc = 0.0;
    for (i64 n = 0; n < s.N; ++n) {
      const T* dyk = dy + (n * s.K + k) * PQ;  // (P * Q)
      for (i64 i = 0; i < PQ; ++i) acc += static_cast<double>(dyk[i]);
    }
    db[k] = beta == P<T>(0) ? static_cast<P<T>>(acc) : beta * db[k] + static_cast<P<T>>(acc);
  }
}

TALLY_INSTANTIATE_CONV(float)
TALLY_INSTANTIATE_CONV(double)
TALLY_INSTANTIATE_CONV(bf16)

}  // namespace tally::kernels::cpu
