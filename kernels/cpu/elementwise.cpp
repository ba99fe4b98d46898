// kernels/cpu/elementwise.cpp — elementwise maps (ReLU, sigmoid, ...), channel scaling, row-block copies
// (concatenation), strided gather, row broadcasts and reductions.
// See kernels/cpu/cpu_kernels.h for the contract of each function and kernels/common.h for the
// `beta` convention (beta == 0 never reads the output).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/instantiate.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace tally::kernels::cpu {
namespace {

// Below this many elements the OpenMP fork/join costs more than it saves.
constexpr i64 kElementwiseParallelThreshold = i64{1} << 15;

// Fixed block size for deterministic reductions: partial sums are formed per block (independent
// of the thread count) and then added in block order, so results never depend on OMP_NUM_THREADS.
constexpr i64 kReduceBlock = i64{1} << 14;

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace

template <class T>
void fill(i64 n, T value, T* y) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) y[i] = value;
}

template <class T>
void copy(i64 n, const T* x, T* y) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) y[i] = x[i];
}

// Each map computes in P<T> (float for bf16: every operand widened, the result rounded once).
template <class T>
void add(i64 n, const T* a, const T* b, P<T> alpha, T* y) {
  using M = P<T>;
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) y[i] = T(M(a[i]) + alpha * M(b[i]));
}

template <class T>
void axpby(i64 n, P<T> alpha, const T* x, P<T> beta, T* y) {
  using M = P<T>;
  if constexpr (std::is_same_v<T, bf16>) {
    if (beta == 0.f && alpha == 1.f) return copy(n, x, y);  // add's backward: exact, no conversions
  }
  if (beta == M(0)) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) y[i] = T(alpha * M(x[i]));
  } else {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) y[i] = T(beta * M(y[i]) + alpha * M(x[i]));
  }
}

template <class T>
void mul(i64 n, const T* a, const T* b, T* y) {
  using M = P<T>;
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) y[i] = T(M(a[i]) * M(b[i]));
}

template <class T>
void mul_backward(i64 n, const T* dy, const T* b, T* da, P<T> beta) {
  using M = P<T>;
  if (beta == M(0)) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) da[i] = T(M(dy[i]) * M(b[i]));
  } else {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) da[i] = T(beta * M(da[i]) + M(dy[i]) * M(b[i]));
  }
}

// bf16 ReLU on the bits, with integer masks rather than conditions (which the compiler turns into
// branches: 10x slower on random signs, measured), so the loops vectorize with SSE2 alone.
//   x < 0   <=> sign set, magnitude in (0, Inf]       (-0 and NaN are not below 0)
//   y <= 0  <=> not NaN, and sign set or magnitude 0
namespace {
std::uint16_t mask_unless(bool drop) { return static_cast<std::uint16_t>(static_cast<int>(drop) - 1); }
bool below_zero(std::uint16_t b) {
  return ((b & 0x8000u) != 0) & (static_cast<std::uint16_t>((b & 0x7fffu) - 1u) < 0x7f80u);
}
bool at_most_zero(std::uint16_t b) {
  const std::uint16_t mag = b & 0x7fffu;
  return (mag <= 0x7f80u) & (((b & 0x8000u) != 0) | (mag == 0));
}
}  // namespace

template <class T>
void relu_forward(i64 n, const T* x, T* y) {
  using M = P<T>;
  if constexpr (std::is_same_v<T, bf16>) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) y[i] = bf16::from_bits(x[i].bits & mask_unless(below_zero(x[i].bits)));
    return;
  }
  // NaN propagates (as torch.relu): NaN > 0 is false, so test "x < 0" instead.
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) {
    const M v = M(x[i]);
    y[i] = T(v < M(0) ? M(0) : v);  // a select of floats (bf16: exact), which vectorizes
  }
}

// As torch's threshold_backward: the gradient is masked where y <= 0 (a NaN y passes dy).
template <class T>
void relu_backward(i64 n, const T* dy, const T* y, T* dx, P<T> beta) {
  using M = P<T>;
  // dy[i] is loaded whether or not it is kept: a load under the condition is not if-converted,
  // and the loop would branch per element (27x slower on random signs, measured).
  if (beta == M(0)) {
    if constexpr (std::is_same_v<T, bf16>) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
      for (i64 i = 0; i < n; ++i) dx[i] = bf16::from_bits(dy[i].bits & mask_unless(at_most_zero(y[i].bits)));
      return;
    }
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) {
      const M g = M(dy[i]);
      dx[i] = T(M(y[i]) <= M(0) ? M(0) : g);
    }
  } else {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) {
      const M g = M(dy[i]);
      dx[i] = T(beta * M(dx[i]) + (M(y[i]) <= M(0) ? M(0) : g));
    }
  }
}

namespace {
// The logistic function without overflow: exp only of -|v| (at most 1), so neither exp(-v) for a
// large negative v (Inf) nor 1 + exp(-v) can overflow; tiny results keep their precision
// (e / (1 + e) rather than 1 - 1 / (1 + e)). A NaN gives NaN (exp(NaN) is NaN).
template <class M>
M logistic(M v) {
  const M e = std::exp(v < M(0) ? v : -v);
  return v < M(0) ? e / (M(1) + e) : M(1) / (M(1) + e);
}
}  // namespace

template <class T>
void sigmoid_forward(i64 n, const T* x, T* y) {
  using M = P<T>;
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) y[i] = T(logistic(M(x[i])));
}

// PyTorch's order: (dy * (1 - y)) * y.
template <class T>
void sigmoid_backward(i64 n, const T* dy, const T* y, T* dx, P<T> beta) {
  using M = P<T>;
  if (beta == M(0)) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) {
      const M v = M(y[i]);
      dx[i] = T(M(dy[i]) * (M(1) - v) * v);
    }
  } else {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
    for (i64 i = 0; i < n; ++i) {
      const M v = M(y[i]);
      dx[i] = T(beta * M(dx[i]) + M(dy[i]) * (M(1) - v) * v);
    }
  }
}

// Dropout: each element's logical index e = c * HW + hw, whatever the layout, so both layouts keep
// the same elements. y = x * m with m the scale or 0, as PyTorch multiplies by its mask (a NaN
// stays NaN where it is dropped). The forward is the backward's map at beta 0 (below).
template <class T>
void dropout_backward(i64 N, i64 C, i64 HW, bool channels_last, const DropoutKey& key, const T* dy, T* dx,
                      P<T> beta) {
  using M = P<T>;
  const i64 F = C * HW;
#pragma omp parallel for schedule(static) if (N * F > kElementwiseParallelThreshold)
  for (i64 n = 0; n < N; ++n)
    for (i64 i = 0; i < F; ++i) {
      const i64 e = channels_last ? (i % C) * HW + i / C : i;
      const M g = M(dy[n * F + i]) * (dropout_keeps(key, n, e) ? M(key.scale) : M(0));
      dx[n * F + i] = beta == M(0) ? T(g) : T(beta * M(dx[n * F + i]) + g);
    }
}

template <class T>
void dropout_forward(i64 N, i64 C, i64 HW, bool channels_last, const DropoutKey& key, const T* x, T* y) {
  dropout_backward<T>(N, C, HW, channels_last, key, x, y, P<T>(0));
}

// Row-major: one factor per row of HW values; channels-last: a row of C factors per (n, hw) row.
// The same product per element in both layouts, so the two give the same bits.
template <class T>
void scale_channels(i64 N, i64 C, i64 HW, bool channels_last, const T* x, const T* s, T* y, P<T> beta) {
  using M = P<T>;
  const i64 total = N * C * HW;
  const i64 rows = channels_last ? N * HW : N * C, cols = channels_last ? C : HW;
#pragma omp parallel for schedule(static) if (total > kElementwiseParallelThreshold && rows > 1)
  for (i64 r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;  // (cols)
    T* yr = y + r * cols;
    const T* sr = channels_last ? s + (r / HW) * C : s + r;  // (C) of sample n, or the row's one factor
    if (beta == M(0)) {
      for (i64 j = 0; j < cols; ++j) yr[j] = T(M(xr[j]) * M(sr[channels_last ? j : 0]));
    } else {
      for (i64 j = 0; j < cols; ++j) yr[j] = T(beta * M(yr[j]) + M(xr[j]) * M(sr[channels_last ? j : 0]));
    }
  }
}

namespace {
// ds[n, c] from its double sum: beta 0 rounds the sum once; beta 1 adds the old value first.
template <class T>
T scale_gradient(double sum, const T& old, compute_t<T> beta) {
  return beta == compute_t<T>(0) ? static_cast<T>(sum) : static_cast<T>(static_cast<double>(old) * beta + sum);
}
constexpr i64 kChannelBlock = 64;  // channels-last: channels summed together by one thread
}  // namespace

// Every (n, c) is summed by one thread in HW order: row-major along its row, channels-last in a
// block of kChannelBlock channels walking the rows of sample n — the same order, so the same bits.
template <class T>
void scale_channels_backward_scale(i64 N, i64 C, i64 HW, bool channels_last, const T* dy, const T* x, T* ds,
                                   P<T> beta) {
  const i64 total = N * C * HW;
  if (!channels_last) {
#pragma omp parallel for schedule(static) if (total > kElementwiseParallelThreshold && N * C > 1)
    for (i64 r = 0; r < N * C; ++r) {
      const T* dyr = dy + r * HW;  // (HW)
      const T* xr = x + r * HW;
      double acc = 0.0;
      for (i64 j = 0; j < HW; ++j) acc += static_cast<double>(dyr[j]) * static_cast<double>(xr[j]);
      ds[r] = scale_gradient(acc, ds[r], beta);
    }
    return;
  }
  const i64 blocks = (C + kChannelBlock - 1) / kChannelBlock;
#pragma omp parallel for schedule(static) if (total > kElementwiseParallelThreshold && N * blocks > 1)
  for (i64 task = 0; task < N * blocks; ++task) {
    const i64 n = task / blocks, c0 = (task % blocks) * kChannelBlock, cn = std::min(kChannelBlock, C - c0);
    double acc[kChannelBlock] = {};
    for (i64 j = 0; j < HW; ++j) {
      const T* dyr = dy + (n * HW + j) * C + c0;  // (cn) channels of row (n, j)
      const T* xr = x + (n * HW + j) * C + c0;
      for (i64 c = 0; c < cn; ++c) acc[c] += static_cast<double>(dyr[c]) * static_cast<double>(xr[c]);
    }
    for (i64 c = 0; c < cn; ++c) ds[n * C + c0 + c] = scale_gradient(acc[c], ds[n * C + c0 + c], beta);
  }
}

template <class T>
void copy_rows(i64 rows, i64 cols, const T* x, i64 ldx, T* y, i64 ldy, P<T> beta) {
  using M = P<T>;
#pragma omp parallel for schedule(static) if (rows * cols > kElementwiseParallelThreshold && rows > 1)
  for (i64 r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;  // (cols)
    T* yr = y + r * ldy;
    if (beta == M(0)) {
      for (i64 c = 0; c < cols; ++c) yr[c] = xr[c];
    } else {
      for (i64 c = 0; c < cols; ++c) yr[c] = T(beta * M(yr[c]) + M(xr[c]));
    }
  }
}

template <class T>
void strided_copy(int ndim, const i64* shape, const i64* strides, const T* x, T* y) {
  if (ndim <= 0) {  // a scalar view
    y[0] = x[0];
    return;
  }
  i64 total = 1;
  for (int k = 0; k < ndim; ++k) total *= shape[k];
  if (total <= 0) return;

  const i64 inner = shape[ndim - 1];
  const i64 inner_stride = strides[ndim - 1];
  const i64 outer = total / inner;  // number of innermost rows
  const int odims = ndim - 1;       // dimensions of the outer "odometer"

  // Each thread handles a contiguous range of rows; its starting multi-index is decoded once and
  // then advanced like an odometer. Every output element has exactly one writer.
#pragma omp parallel if (total > kElementwiseParallelThreshold && outer > 1)
  {
    i64 r_begin = 0, r_end = outer;
#ifdef _OPENMP
    const i64 nt = omp_get_num_threads(), tid = omp_get_thread_num();
    r_begin = outer * tid / nt;
    r_end = outer * (tid + 1) / nt;
#endif
    if (r_begin < r_end) {
      i64 idx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      i64 off = 0;
      i64 rem = r_begin;
      for (int k = odims - 1; k >= 0; --k) {
        idx[k] = rem % shape[k];
        rem /= shape[k];
        off += idx[k] * strides[k];
      }
      for (i64 r = r_begin; r < r_end; ++r) {
        T* out = y + r * inner;
        const T* in = x + off;
        if (inner_stride == 1) {
          for (i64 j = 0; j < inner; ++j) out[j] = in[j];
        } else {
          for (i64 j = 0; j < inner; ++j) out[j] = in[j * inner_stride];
        }
        // Advance the outer odometer by one row.
        for (int k = odims - 1; k >= 0; --k) {
          ++idx[k];
          off += strides[k];
          if (idx[k] < shape[k]) break;
          off -= idx[k] * strides[k];
          idx[k] = 0;
        }
      }
    }
  }
}

template <class T>
void add_bias_rows(i64 rows, i64 cols, const T* x, const P<T>* bias, T* y) {
  using M = P<T>;
#pragma omp parallel for schedule(static) if (rows * cols > kElementwiseParallelThreshold && rows > 1)
  for (i64 r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    for (i64 c = 0; c < cols; ++c) yr[c] = T(M(xr[c]) + bias[c]);
  }
}

template <class T>
void sum_rows(i64 rows, i64 cols, const T* dy, P<T>* db, P<T> beta) {
  using M = P<T>;
  if (cols <= 0) return;
  // Columns are split into contiguous blocks, one per thread; each block is accumulated in
  // double over all rows in row order (cache-friendly and deterministic).
  std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
  const bool par = rows * cols > kElementwiseParallelThreshold && cols >= 64;
  const int nt = par ? std::max(1, max_threads()) : 1;
#pragma omp parallel num_threads(nt) if (par)
  {
    i64 c_begin = 0, c_end = cols;
#ifdef _OPENMP
    const i64 tid = omp_get_thread_num(), nth = omp_get_num_threads();
    c_begin = cols * tid / nth;
    c_end = cols * (tid + 1) / nth;
#endif
    double* a = acc.data();
    for (i64 r = 0; r < rows; ++r) {
      const T* row = dy + r * cols;
      for (i64 c = c_begin; c < c_end; ++c) a[c] += static_cast<double>(row[c]);
    }
    if (beta == M(0)) {
      for (i64 c = c_begin; c < c_end; ++c) db[c] = static_cast<M>(a[c]);
    } else {
      for (i64 c = c_begin; c < c_end; ++c) db[c] = beta * db[c] + static_cast<M>(a[c]);
    }
  }
}

namespace {
// The sum of x in double: fixed blocks of kReduceBlock (each summed in order), then the blocks in
// order — the same result at any thread count.
template <class T>
double sum_in_double(i64 n, const T* x) {
  if (n <= 0) return 0.0;
  const i64 nblocks = (n + kReduceBlock - 1) / kReduceBlock;
  if (nblocks == 1) {
    double s = 0.0;
    for (i64 i = 0; i < n; ++i) s += static_cast<double>(x[i]);
    return s;
  }
  std::vector<double> partial(static_cast<std::size_t>(nblocks), 0.0);
#pragma omp parallel for schedule(static)
  for (i64 b = 0; b < nblocks; ++b) {
    const i64 lo = b * kReduceBlock, hi = std::min(n, lo + kReduceBlock);
    double s = 0.0;
    for (i64 i = lo; i < hi; ++i) s += static_cast<double>(x[i]);
    partial[static_cast<std::size_t>(b)] = s;
  }
  double s = 0.0;
  for (double p : partial) s += p;
  return s;
}
}  // namespace

template <class T>
T sum_all(i64 n, const T* x) {
  return static_cast<T>(sum_in_double(n, x));
}

// factor * sum, rounded to T once (as the CUDA kernel does): rounding the sum to T first and then
// the product would round a bf16 mean twice.
template <class T>
void sum_to(i64 n, const T* x, P<T> factor, T* y) {
  y[0] = static_cast<T>(sum_in_double(n, x) * static_cast<double>(factor));
}

template <class T>
void broadcast_scalar(i64 n, const T* s, P<T> factor, T* y, P<T> beta) {
  using M = P<T>;
  const M v = static_cast<M>(static_cast<double>(s[0]) * static_cast<double>(factor));
  for (i64 i = 0; i < n; ++i) y[i] = beta == M(0) ? T(v) : T(beta * M(y[i]) + v);
}

template <class T>
void fill_product(i64 n, const T* a, const T* b, T* y) {
  const T v = T(P<T>(a[0]) * P<T>(b[0]));
  for (i64 i = 0; i < n; ++i) y[i] = v;
}

template <class S, class D>
void convert(i64 n, const S* x, D* y) {
#pragma omp parallel for schedule(static) if (n > kElementwiseParallelThreshold)
  for (i64 i = 0; i < n; ++i) y[i] = static_cast<D>(x[i]);
}

template <class D>
void convert_channels_last(i64 n, i64 c, i64 hw, const float* x, D* y) {
#pragma omp parallel for schedule(static) if (n * c * hw > kElementwiseParallelThreshold)
  for (i64 row = 0; row < n * hw; ++row) {  // an image's position: its c values, one plane apart
    const float* from = x + (row / hw) * c * hw + row % hw;
    D* to = y + row * c;
    for (i64 k = 0; k < c; ++k) to[k] = static_cast<D>(from[k * hw]);
  }
}
template void convert_channels_last<float>(i64, i64, i64, const float*, float*);
template void convert_channels_last<double>(i64, i64, i64, const float*, double*);
template void convert_channels_last<bf16>(i64, i64, i64, const float*, bf16*);

void copy_from_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}
void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}
void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations.
TALLY_INSTANTIATE_ELEMENTWISE(float)
TALLY_INSTANTIATE_ELEMENTWISE(double)
TALLY_INSTANTIATE_ELEMENTWISE(bf16)
TALLY_INSTANTIATE_MEMORY(float)
TALLY_INSTANTIATE_MEMORY(double)
TALLY_INSTANTIATE_MEMORY(std::int32_t)
TALLY_INSTANTIATE_MEMORY(std::int64_t)
TALLY_INSTANTIATE_MEMORY(bf16)
TALLY_INSTANTIATE_CONVERT(float)
TALLY_INSTANTIATE_CONVERT(double)
TALLY_INSTANTIATE_CONVERT(bf16)

}  // namespace tally::kernels::cpu
