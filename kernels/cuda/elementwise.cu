// kernels/cuda/elementwise.cu — elementwise maps (ReLU, sigmoid, ...), channel scaling, row-block
// copies (concatenation), strided gather, row broadcasts and reductions on the GPU; the CUDA twin
// of kernels/cpu/elementwise.cpp (same functions, same order, same formulas).
// See kernels/cuda/cuda_kernels.h for the contract and kernels/common.h for `beta`.
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {
using detail::grid_for;
using detail::kThreads;
constexpr int kMaxDims = 8;

// ---- CUDA kernels ------------------------------------------------------------------------------

template <class T>
__global__ void fill_kernel(i64 n, T value, T* __restrict__ y) {
  TALLY_GRID_LOOP(i, n) y[i] = value;
}

template <class T>
__global__ void copy_kernel(i64 n, const T* __restrict__ x, T* __restrict__ y) {
  TALLY_GRID_LOOP(i, n) y[i] = x[i];
}

// Each map computes in M = compute_t<T> (float for bf16: every operand widened, the result
// rounded once), as the CPU's.
template <class T>
__global__ void add_kernel(i64 n, const T* a, const T* b, compute_t<T> alpha, T* y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, n) y[i] = static_cast<T>(M(a[i]) + alpha * M(b[i]));
}

// y may alias x (scale in place); beta == 0 never reads y.
template <class T>
__global__ void axpby_kernel(i64 n, compute_t<T> alpha, const T* x, compute_t<T> beta, T* y) {
  using M = compute_t<T>;
  if (beta == M(0)) {
    TALLY_GRID_LOOP(i, n) y[i] = static_cast<T>(alpha * M(x[i]));
  } else {
    TALLY_GRID_LOOP(i, n) y[i] = static_cast<T>(beta * M(y[i]) + alpha * M(x[i]));
  }
}

template <class T>
__global__ void mul_kernel(i64 n, const T* a, const T* b, T* y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, n) y[i] = static_cast<T>(M(a[i]) * M(b[i]));
}

template <class T>
__global__ void mul_backward_kernel(i64 n, const T* dy, const T* b, T* da, compute_t<T> beta) {
  using M = compute_t<T>;
  if (beta == M(0)) {
    TALLY_GRID_LOOP(i, n) da[i] = static_cast<T>(M(dy[i]) * M(b[i]));
  } else {
    TALLY_GRID_LOOP(i, n) da[i] = static_cast<T>(beta * M(da[i]) + M(dy[i]) * M(b[i]));
  }
}

// NaN propagates (as torch.relu): test "x < 0", not "x > 0". The kept element is copied, not
// converted, so bf16 keeps its bits (as the CPU's bit masks do).
template <class T>
__global__ void relu_forward_kernel(i64 n, const T* x, T* y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, n) y[i] = M(x[i]) < M(0) ? T(0) : x[i];
}

// As torch's threshold_backward: masked where y <= 0 (a NaN y passes dy).
template <class T>
__global__ void relu_backward_kernel(i64 n, const T* dy, const T* y, T* dx, compute_t<T> beta) {
  using M = compute_t<T>;
  if (beta == M(0)) {
    TALLY_GRID_LOOP(i, n) dx[i] = M(y[i]) <= M(0) ? T(0) : dy[i];
  } else {
    TALLY_GRID_LOOP(i, n) dx[i] = static_cast<T>(beta * M(dx[i]) + (M(y[i]) <= M(0) ? M(0) : M(dy[i])));
  }
}

// The CPU's logistic: exp only of -|v|, so nothing overflows; NaN propagates.
__device__ __forceinline__ float logistic(float v) {
  const float e = expf(v < 0.f ? v : -v);
  return v < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
}

template <class T>
__global__ void sigmoid_forward_kernel(i64 n, const T* x, T* y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, n) y[i] = static_cast<T>(logistic(M(x[i])));
}

// PyTorch's order, as the CPU: (dy * (1 - y)) * y.
template <class T>
__global__ void sigmoid_backward_kernel(i64 n, const T* dy, const T* y, T* dx, compute_t<T> beta) {
  using M = compute_t<T>;
  if (beta == M(0)) {
    TALLY_GRID_LOOP(i, n) dx[i] = static_cast<T>(M(dy[i]) * (M(1) - M(y[i])) * M(y[i]));
  } else {
    TALLY_GRID_LOOP(i, n) dx[i] = static_cast<T>(beta * M(dx[i]) + M(dy[i]) * (M(1) - M(y[i])) * M(y[i]));
  }
}

// Dropout, one thread per element, the CPU's mask and formula (kernels/common.h: dropout_keeps): dx
// (=|+=) dy * m; the forward is this map at beta 0, y = x * m.
template <class T>
__global__ void dropout_backward_kernel(i64 N, i64 C, i64 HW, bool channels_last, DropoutKey key, const T* dy, T* dx,
                                        compute_t<T> beta) {
  using M = compute_t<T>;
  const i64 F = C * HW;
  TALLY_GRID_LOOP(j, N * F) {
    const i64 n = j / F, i = j - n * F, e = channels_last ? (i % C) * HW + i / C : i;
    const M g = M(dy[j]) * (dropout_keeps(key, n, e) ? M(key.scale) : M(0));
    dx[j] = beta == M(0) ? static_cast<T>(g) : static_cast<T>(beta * M(dx[j]) + g);
  }
}

// y (N, C, HW) or channels-last (N, HW, C) (=|+=) x * s[n, c], s (N, C): one thread per element.
template <class T>
__global__ void scale_channels_kernel(i64 N, i64 C, i64 HW, bool channels_last, const T* x, const T* s, T* y,
                                      compute_t<T> beta) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, N * C * HW) {
    const i64 k = channels_last ? (i / (HW * C)) * C + i % C : i / HW;  // index of s[n, c]
    const M v = M(x[i]) * M(s[k]);
    y[i] = beta == M(0) ? static_cast<T>(v) : static_cast<T>(beta * M(y[i]) + v);
  }
}

// ds (N, C) (=|+=) sum over HW of dy * x, row-major: one block per (n, c), each thread summing a
// strided part of the row in double, then the block's fixed tree (detail::block_sum).
template <class T>
__global__ void scale_channels_backward_scale_rows_kernel(i64 NC, i64 HW, const T* __restrict__ dy,
                                                          const T* __restrict__ x, T* ds, compute_t<T> beta) {
  using M = compute_t<T>;
  TALLY_BLOCK_LOOP(r, NC) {
    double acc = 0.0;
    for (i64 j = threadIdx.x; j < HW; j += blockDim.x)
      acc += static_cast<double>(dy[r * HW + j]) * static_cast<double>(x[r * HW + j]);
    acc = detail::block_sum(acc);
    if (threadIdx.x == 0)
      ds[r] = beta == M(0) ? static_cast<T>(acc) : static_cast<T>(static_cast<double>(ds[r]) * beta + acc);
  }
}

// The same, channels-last (N, HW, C): one thread per (n, c) walking the rows of sample n in HW
// order (the CPU's order), a warp reading 32 neighbouring channels of a row at once.
template <class T>
__global__ void scale_channels_backward_scale_nhwc_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ dy,
                                                          const T* __restrict__ x, T* ds, compute_t<T> beta) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(k, N * C) {
    const i64 n = k / C, c = k % C;
    double acc = 0.0;
    for (i64 j = 0; j < HW; ++j) {
      const i64 e = (n * HW + j) * C + c;
      acc += static_cast<double>(dy[e]) * static_cast<double>(x[e]);
    }
    ds[k] = beta == M(0) ? static_cast<T>(acc) : static_cast<T>(static_cast<double>(ds[k]) * beta + acc);
  }
}

// y[r * ldy + c] (=|+=) x[r * ldx + c]; beta 0 copies (bf16 keeps its bits).
template <class T>
__global__ void copy_rows_kernel(i64 rows, i64 cols, const T* __restrict__ x, i64 ldx, T* __restrict__ y, i64 ldy,
                                 compute_t<T> beta) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, rows * cols) {
    const i64 r = i / cols, c = i % cols;
    y[r * ldy + c] = beta == M(0) ? x[r * ldx + c] : static_cast<T>(beta * M(y[r * ldy + c]) + M(x[r * ldx + c]));
  }
}

// Shape and strides of a strided view, passed by value (kernel parameter space).
struct StridedView {
  int ndim;
  i64 shape[kMaxDims];
  i64 strides[kMaxDims];
};

// y (total, dense row-major over v.shape) = x[sum_k i_k * strides[k]]: each output element is
// decoded from its linear index, so every one has exactly one writer.
template <class T>
__global__ void strided_copy_kernel(StridedView v, i64 total, const T* __restrict__ x, T* __restrict__ y) {
  TALLY_GRID_LOOP(i, total) {
    i64 rem = i, off = 0;
    for (int k = v.ndim - 1; k >= 0; --k) {
      const i64 idx = rem % v.shape[k];
      rem /= v.shape[k];
      off += idx * v.strides[k];
    }
    y[i] = x[off];
  }
}

template <class T>
__global__ void add_bias_rows_kernel(i64 rows, i64 cols, const T* x, const compute_t<T>* bias, T* y) {
  using M = compute_t<T>;
  TALLY_GRID_LOOP(i, rows * cols) y[i] = static_cast<T>(M(x[i]) + bias[i % cols]);
}

// db (cols) (=|+=) sum over rows of dy (rows, cols). Block (32, 8): threadIdx.x picks one of 32
// consecutive columns (coalesced reads), threadIdx.y one of 8 row phases. Each thread sums its
// rows in order (in double, as the CPU), then the 8 phases are added in a fixed order.
constexpr int kColTile = 32, kRowPhases = 8;
template <class T>
__global__ void sum_rows_kernel(i64 rows, i64 cols, const T* __restrict__ dy, compute_t<T>* __restrict__ db,
                                compute_t<T> beta) {
  using M = compute_t<T>;
  __shared__ double part[kRowPhases][kColTile];
  const i64 ntiles = (cols + kColTile - 1) / kColTile;
  for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const i64 c = tile * kColTile + threadIdx.x;
    double acc = 0.0;
    if (c < cols)
      for (i64 r = threadIdx.y; r < rows; r += kRowPhases) acc += static_cast<double>(dy[r * cols + c]);
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
      double s = 0.0;
      for (int k = 0; k < kRowPhases; ++k) s += part[k][threadIdx.x];
      db[c] = beta == M(0) ? static_cast<M>(s) : beta * db[c] + static_cast<M>(s);
    }
    __syncthreads();  // `part` is reused by the next tile
  }
}

// One block: each thread sums a strided subset in double, then the block tree; the result goes
// to mapped host memory, read by the host after synchronizing.
template <class T>
__global__ void sum_all_kernel(i64 n, const T* __restrict__ x, double* __restrict__ out) {
  double acc = 0.0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc += static_cast<double>(x[i]);
  acc = detail::block_sum(acc);
  if (threadIdx.x == 0) *out = acc;
}

// y[0] = factor * sum x (one block, double, fixed tree), rounded once: a device scalar, nobody
// waits.
template <class T>
__global__ void sum_to_kernel(i64 n, const T* __restrict__ x, double factor, T* __restrict__ y) {
  double acc = 0.0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc += static_cast<double>(x[i]);
  acc = detail::block_sum(acc);
  if (threadIdx.x == 0) y[0] = static_cast<T>(acc * factor);
}

template <class T>
__global__ void broadcast_scalar_kernel(i64 n, const T* __restrict__ s, double factor, T* y, compute_t<T> beta) {
  using M = compute_t<T>;
  const M v = static_cast<M>(static_cast<double>(s[0]) * factor);
  TALLY_GRID_LOOP(i, n) y[i] = beta == M(0) ? static_cast<T>(v) : static_cast<T>(beta * M(y[i]) + v);
}

template <class T>
__global__ void fill_product_kernel(i64 n, const T* __restrict__ a, const T* __restrict__ b, T* y) {
  using M = compute_t<T>;
  const T v = static_cast<T>(M(a[0]) * M(b[0]));
  TALLY_GRID_LOOP(i, n) y[i] = v;
}

template <class S, class D>
__global__ void convert_kernel(i64 n, const S* __restrict__ x, D* __restrict__ y) {
  TALLY_GRID_LOOP(i, n) y[i] = static_cast<D>(x[i]);
}

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

template <class T>
void fill(i64 n, T value, T* y) {
  if (n <= 0) return;
  fill_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, value, y);
  TALLY_LAUNCH_CHECK("fill");
}

template <class T>
void copy(i64 n, const T* x, T* y) {
  if (n <= 0) return;
  copy_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, x, y);
  TALLY_LAUNCH_CHECK("copy");
}

template <class T>
void add(i64 n, const T* a, const T* b, P<T> alpha, T* y) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, a, b, alpha, y);
  TALLY_LAUNCH_CHECK("add");
}

template <class T>
void axpby(i64 n, P<T> alpha, const T* x, P<T> beta, T* y) {
  if (n <= 0) return;
  axpby_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, alpha, x, beta, y);
  TALLY_LAUNCH_CHECK("axpby");
}

template <class T>
void mul(i64 n, const T* a, const T* b, T* y) {
  if (n <= 0) return;
  mul_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, a, b, y);
  TALLY_LAUNCH_CHECK("mul");
}

template <class T>
void mul_backward(i64 n, const T* dy, const T* b, T* da, P<T> beta) {
  if (n <= 0) return;
  mul_backward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, dy, b, da, beta);
  TALLY_LAUNCH_CHECK("mul_backward");
}

template <class T>
void relu_forward(i64 n, const T* x, T* y) {
  if (n <= 0) return;
  relu_forward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, x, y);
  TALLY_LAUNCH_CHECK("relu_forward");
}

template <class T>
void relu_backward(i64 n, const T* dy, const T* y, T* dx, P<T> beta) {
  if (n <= 0) return;
  relu_backward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, dy, y, dx, beta);
  TALLY_LAUNCH_CHECK("relu_backward");
}

template <class T>
void dropout_forward(i64 N, i64 C, i64 HW, bool channels_last, const DropoutKey& key, const T* x, T* y) {
  const i64 n = N * C * HW;
  if (n <= 0) return;
  dropout_backward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(N, C, HW, channels_last, key, x, y, P<T>(0));
  TALLY_LAUNCH_CHECK("dropout_forward");
}

template <class T>
void dropout_backward(i64 N, i64 C, i64 HW, bool channels_last, const DropoutKey& key, const T* dy, T* dx,
                      P<T> beta) {
  const i64 n = N * C * HW;
  if (n <= 0) return;
  dropout_backward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(N, C, HW, channels_last, key, dy, dx,
                                                                          beta);
  TALLY_LAUNCH_CHECK("dropout_backward");
}

template <class T>
void sigmoid_forward(i64 n, const T* x, T* y) {
  if (n <= 0) return;
  sigmoid_forward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, x, y);
  TALLY_LAUNCH_CHECK("sigmoid_forward");
}

template <class T>
void sigmoid_backward(i64 n, const T* dy, const T* y, T* dx, P<T> beta) {
  if (n <= 0) return;
  sigmoid_backward_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, dy, y, dx, beta);
  TALLY_LAUNCH_CHECK("sigmoid_backward");
}

template <class T>
void scale_channels(i64 N, i64 C, i64 HW, bool channels_last, const T* x, const T* s, T* y, P<T> beta) {
  const i64 n = N * C * HW;
  if (n <= 0) return;
  scale_channels_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(N, C, HW, channels_last, x, s, y, beta);
  TALLY_LAUNCH_CHECK("scale_channels");
}

template <class T>
void scale_channels_backward_scale(i64 N, i64 C, i64 HW, bool channels_last, const T* dy, const T* x, T* ds,
                                   P<T> beta) {
  if (N * C <= 0) return;
  if (channels_last) {
    scale_channels_backward_scale_nhwc_kernel<<<grid_for(N * C), kThreads, 0, detail::stream()>>>(N, C, HW, dy, x, ds,
                                                                                                   beta);
  } else {
    scale_channels_backward_scale_rows_kernel<<<detail::blocks_for(N * C), kThreads, 0, detail::stream()>>>(
        N * C, HW, dy, x, ds, beta);
  }
  TALLY_LAUNCH_CHECK("scale_channels_backward_scale");
}

template <class T>
void copy_rows(i64 rows, i64 cols, const T* x, i64 ldx, T* y, i64 ldy, P<T> beta) {
  if (rows <= 0 || cols <= 0) return;
  copy_rows_kernel<<<grid_for(rows * cols), kThreads, 0, detail::stream()>>>(rows, cols, x, ldx, y, ldy, beta);
  TALLY_LAUNCH_CHECK("copy_rows");
}

template <class T>
void strided_copy(int ndim, const i64* shape, const i64* strides, const T* x, T* y) {
  if (ndim > kMaxDims)
    detail::fail("strided_copy: at most " + std::to_string(kMaxDims) + " dimensions, found " + std::to_string(ndim));
  StridedView v{};
  v.ndim = ndim < 0 ? 0 : ndim;
  i64 total = 1;  // a scalar view (ndim 0) is one element at offset 0
  for (int k = 0; k < v.ndim; ++k) {
    v.shape[k] = shape[k];
    v.strides[k] = strides[k];
    total *= shape[k];
  }
  if (total <= 0) return;
  strided_copy_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(v, total, x, y);
  TALLY_LAUNCH_CHECK("strided_copy");
}

template <class T>
void add_bias_rows(i64 rows, i64 cols, const T* x, const P<T>* bias, T* y) {
  if (rows <= 0 || cols <= 0) return;
  add_bias_rows_kernel<<<grid_for(rows * cols), kThreads, 0, detail::stream()>>>(rows, cols, x, bias, y);
  TALLY_LAUNCH_CHECK("add_bias_rows");
}

template <class T>
void sum_rows(i64 rows, i64 cols, const T* dy, P<T>* db, P<T> beta) {
  if (cols <= 0) return;
  const i64 ntiles = (cols + kColTile - 1) / kColTile;
  sum_rows_kernel<<<detail::blocks_for(ntiles), dim3(kColTile, kRowPhases), 0, detail::stream()>>>(rows, cols, dy,
                                                                                                    db, beta);
  TALLY_LAUNCH_CHECK("sum_rows");
}

template <class T>
T sum_all(i64 n, const T* x) {
  if (n <= 0) return T(0);
  double* slot_device = nullptr;
  volatile double* slot = detail::result_slot(&slot_device);
  sum_all_kernel<<<1, detail::kReduceThreads, 0, detail::stream()>>>(n, x, slot_device);
  TALLY_LAUNCH_CHECK("sum_all");
  detail::host_wait(detail::stream());
  return static_cast<T>(*slot);
}

template <class T>
void sum_to(i64 n, const T* x, P<T> factor, T* y) {
  sum_to_kernel<<<1, detail::kReduceThreads, 0, detail::stream()>>>(n, x, static_cast<double>(factor), y);
  TALLY_LAUNCH_CHECK("sum_to");
}

template <class T>
void broadcast_scalar(i64 n, const T* s, P<T> factor, T* y, P<T> beta) {
  if (n <= 0) return;
  broadcast_scalar_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, s, static_cast<double>(factor), y, beta);
  TALLY_LAUNCH_CHECK("broadcast_scalar");
}

template <class T>
void fill_product(i64 n, const T* a, const T* b, T* y) {
  if (n <= 0) return;
  fill_product_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, a, b, y);
  TALLY_LAUNCH_CHECK("fill_product");
}

template <class S, class D>
void convert(i64 n, const S* x, D* y) {
  if (n <= 0) return;
  convert_kernel<<<grid_for(n), kThreads, 0, detail::stream()>>>(n, x, y);
  TALLY_LAUNCH_CHECK("convert");
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations: float and bf16 for every function; the memory-only ones also for the
// other element types core/ moves around (tensor fills and copies of any dtype).
TALLY_INSTANTIATE_ELEMENTWISE(float)
TALLY_INSTANTIATE_ELEMENTWISE(bf16)
TALLY_INSTANTIATE_MEMORY(float)
TALLY_INSTANTIATE_MEMORY(double)
TALLY_INSTANTIATE_MEMORY(std::int32_t)
TALLY_INSTANTIATE_MEMORY(std::int64_t)
TALLY_INSTANTIATE_MEMORY(bf16)
TALLY_INSTANTIATE_CONVERT(float)
TALLY_INSTANTIATE_CONVERT(double)
TALLY_INSTANTIATE_CONVERT(bf16)

}  // namespace tally::kernels::cuda
