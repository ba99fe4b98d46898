// kernels/cuda/norm.cu — batch norm and group norm over x (N, C, HW) on the GPU, PyTorch
// semantics; the CUDA twin of kernels/cpu/norm.cpp (same functions, same order, same formulas).
//
// Work split: one thread block of kReduceThreads owns one reduction — a channel for batch norm
// (N * HW elements, strided by C * HW) and for the group-norm weight gradients, an (n, group) for
// group norm (Cg * HW contiguous elements) — and also writes that reduction's outputs, so every
// output has one writer and no atomics are needed.
// Statistics are accumulated in float with two passes (the mean first, then the sum of squared
// deviations from it), so a large mean does not cancel the variance away; each thread sums its
// strided share in order and the block adds the partial sums along a fixed tree (launch.cuh):
// deterministic, and well within 1e-4 of the CPU's double accumulation.
// Known limit: a layer with few channels runs few blocks (C blocks for batch norm); fine for
// correctness, slow on a large GPU — a two-phase reduction over several blocks per channel would
// need a workspace, which these kernels' signatures do not have yet.
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {
using detail::block_sum;
using detail::blocks_for;
using detail::grid_for;
using detail::kReduceThreads;
using detail::kThreads;

// beta == 0 overwrites (never reads out); otherwise out = beta * out + v.
template <class T>
__device__ __forceinline__ void store(T* out, T beta, T v) {
  *out = beta == T(0) ? v : beta * *out + v;
}

// Offset of element m of channel c in x (N, C, HW), m = n * HW + j.
__device__ __forceinline__ i64 channel_offset(i64 m, i64 c, i64 C, i64 HW) {
  const i64 n = m / HW, j = m - n * HW;
  return (n * C + c) * HW + j;
}

// ---- CUDA kernels: batch norm ------------------------------------------------------------------

template <class T>
__global__ void batch_norm_forward_train_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ x,
                                                const T* __restrict__ gamma, const T* __restrict__ beta_, T eps,
                                                T momentum, T* running_mean, T* running_var, T* __restrict__ y,
                                                T* save_mean, T* save_invstd) {
  const i64 M = N * HW;
  TALLY_BLOCK_LOOP(c, C) {
    T acc = 0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) acc += x[channel_offset(m, c, C, HW)];
    const T mean = M > 0 ? block_sum(acc) / static_cast<T>(M) : T(0);
    acc = 0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const T d = x[channel_offset(m, c, C, HW)] - mean;
      acc += d * d;
    }
    const T ssd = block_sum(acc);
    const T var = M > 0 ? ssd / static_cast<T>(M) : T(0);  // biased
    const T invstd = T(1) / sqrt(var + eps);
    const T scale = invstd * (gamma ? gamma[c] : T(1));
    const T shift = beta_ ? beta_[c] : T(0);
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 o = channel_offset(m, c, C, HW);
      y[o] = (x[o] - mean) * scale + shift;
    }
    if (threadIdx.x == 0) {
      if (save_mean) save_mean[c] = mean;
      if (save_invstd) save_invstd[c] = invstd;
      if (running_mean) running_mean[c] = (T(1) - momentum) * running_mean[c] + momentum * mean;
      // Unbiased variance, as PyTorch (M == 1 divides by zero, as on the CPU; core/ rejects it).
      if (running_var)
        running_var[c] = (T(1) - momentum) * running_var[c] + momentum * (ssd / static_cast<T>(M - 1));
    }
  }
}

template <class T>
__global__ void batch_norm_forward_eval_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ x,
                                               const T* __restrict__ gamma, const T* __restrict__ beta_,
                                               const T* __restrict__ running_mean,
                                               const T* __restrict__ running_var, T eps, T* __restrict__ y) {
  TALLY_GRID_LOOP(i, N * C * HW) {
    const i64 c = (i / HW) % C;
    const T invstd = T(1) / sqrt(running_var[c] + eps);
    const T scale = invstd * (gamma ? gamma[c] : T(1));
    y[i] = (x[i] - running_mean[c]) * scale + (beta_ ? beta_[c] : T(0));
  }
}

template <class T>
__global__ void batch_norm_backward_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ dy, const T* __restrict__ x,
                                           const T* __restrict__ gamma, const T* __restrict__ save_mean,
                                           const T* __restrict__ save_invstd, T* dx, T beta_dx, T* dgamma, T* dbeta,
                                           T beta_param) {
  const i64 M = N * HW;
  TALLY_BLOCK_LOOP(c, C) {
    const T mean = save_mean[c], invstd = save_invstd[c];
    T a_dy = 0, a_dy_xhat = 0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 o = channel_offset(m, c, C, HW);
      a_dy += dy[o];
      a_dy_xhat += dy[o] * ((x[o] - mean) * invstd);
    }
    const T sum_dy = block_sum(a_dy);
    const T sum_dy_xhat = block_sum(a_dy_xhat);
    if (threadIdx.x == 0) {
      if (dgamma) store(dgamma + c, beta_param, sum_dy_xhat);
      if (dbeta) store(dbeta + c, beta_param, sum_dy);
    }
    if (dx && M > 0) {
      const T k = (gamma ? gamma[c] : T(1)) * invstd;
      const T mean_dy = sum_dy / static_cast<T>(M), mean_dy_xhat = sum_dy_xhat / static_cast<T>(M);
      for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
        const i64 o = channel_offset(m, c, C, HW);
        const T xhat = (x[o] - mean) * invstd;
        store(dx + o, beta_dx, k * (dy[o] - mean_dy - xhat * mean_dy_xhat));
      }
    }
  }
}

template <class T>
__global__ void batch_norm_backward_eval_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ dy,
                                                const T* __restrict__ x, const T* __restrict__ gamma,
                                                const T* __restrict__ running_mean, const T* __restrict__ running_var,
                                                T eps, T* dx, T beta_dx, T* dgamma, T* dbeta, T beta_param) {
  const i64 M = N * HW;
  TALLY_BLOCK_LOOP(c, C) {
    const T mean = running_mean[c];
    const T invstd = T(1) / sqrt(running_var[c] + eps);
    const T k = (gamma ? gamma[c] : T(1)) * invstd;
    T a_dy = 0, a_dy_xhat = 0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 o = channel_offset(m, c, C, HW);
      const T d = dy[o];
      a_dy += d;
      a_dy_xhat += d * ((x[o] - mean) * invstd);
      if (dx) store(dx + o, beta_dx, d * k);
    }
    const T sum_dy = block_sum(a_dy);
    const T sum_dy_xhat = block_sum(a_dy_xhat);
    if (threadIdx.x == 0) {
      if (dgamma) store(dgamma + c, beta_param, sum_dy_xhat);
      if (dbeta) store(dbeta + c, beta_param, sum_dy);
    }
  }
}

// ---- CUDA kernels: group norm. x (N, C, HW) viewed as (N * G, Cg * HW): each (n, g) contiguous.

template <class T>
__global__ void group_norm_forward_kernel(i64 N, i64 C, i64 HW, i64 G, const T* __restrict__ x,
                                          const T* __restrict__ gamma, const T* __restrict__ beta_, T eps,
                                          T* __restrict__ y, T* save_mean, T* save_invstd) {
  const i64 Cg = C / G, M = Cg * HW;
  TALLY_BLOCK_LOOP(ng, N * G) {
    const i64 g = ng % G;
    const T* xp = x + ng * M;
    T* yp = y + ng * M;
    T acc = 0;
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) acc += xp[i];
    const T mean = M > 0 ? block_sum(acc) / static_cast<T>(M) : T(0);
    acc = 0;
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const T d = xp[i] - mean;
      acc += d * d;
    }
    const T ssd = block_sum(acc);
    const T var = M > 0 ? ssd / static_cast<T>(M) : T(0);  // biased
    const T invstd = T(1) / sqrt(var + eps);
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const i64 c = g * Cg + i / HW;
      const T scale = invstd * (gamma ? gamma[c] : T(1));
      yp[i] = (xp[i] - mean) * scale + (beta_ ? beta_[c] : T(0));
    }
    if (threadIdx.x == 0) {
      if (save_mean) save_mean[ng] = mean;
      if (save_invstd) save_invstd[ng] = invstd;
    }
  }
}

// dx per (n, g), with dxhat = dy * gamma[c]:
//   dx = invstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) over the group.
template <class T>
__global__ void group_norm_backward_dx_kernel(i64 N, i64 C, i64 HW, i64 G, const T* __restrict__ dy,
                                              const T* __restrict__ x, const T* __restrict__ gamma,
                                              const T* __restrict__ save_mean, const T* __restrict__ save_invstd,
                                              T* dx, T beta_dx) {
  const i64 Cg = C / G, M = Cg * HW;
  TALLY_BLOCK_LOOP(ng, N * G) {
    const i64 g = ng % G;
    const T mean = save_mean[ng], invstd = save_invstd[ng];
    const T* xp = x + ng * M;
    const T* dyp = dy + ng * M;
    T* dxp = dx + ng * M;
    T a1 = 0, a2 = 0;
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const T dxh = dyp[i] * (gamma ? gamma[g * Cg + i / HW] : T(1));
      a1 += dxh;
      a2 += dxh * ((xp[i] - mean) * invstd);
    }
    const T m1 = block_sum(a1) / static_cast<T>(M);
    const T m2 = block_sum(a2) / static_cast<T>(M);
    for (i64 i = threadIdx.x; i < M; i += blockDim.x) {
      const T xhat = (xp[i] - mean) * invstd;
      const T dxh = dyp[i] * (gamma ? gamma[g * Cg + i / HW] : T(1));
      store(dxp + i, beta_dx, invstd * (dxh - m1 - xhat * m2));
    }
  }
}

// dgamma, dbeta per channel, summed over n and HW (each n with its own group statistics).
template <class T>
__global__ void group_norm_backward_param_kernel(i64 N, i64 C, i64 HW, i64 G, const T* __restrict__ dy,
                                                 const T* __restrict__ x, const T* __restrict__ save_mean,
                                                 const T* __restrict__ save_invstd, T* dgamma, T* dbeta,
                                                 T beta_param) {
  const i64 Cg = C / G, M = N * HW;
  TALLY_BLOCK_LOOP(c, C) {
    const i64 g = c / Cg;
    T a_dy = 0, a_dy_xhat = 0;
    for (i64 m = threadIdx.x; m < M; m += blockDim.x) {
      const i64 n = m / HW;
      const i64 o = channel_offset(m, c, C, HW);
      const T d = dy[o];
      a_dy += d;
      a_dy_xhat += d * ((x[o] - save_mean[n * G + g]) * save_invstd[n * G + g]);
    }
    const T sdy = block_sum(a_dy);
    const T sdy_xhat = block_sum(a_dy_xhat);
    if (threadIdx.x == 0) {
      if (dgamma) store(dgamma + c, beta_param, sdy_xhat);
      if (dbeta) store(dbeta + c, beta_param, sdy);
    }
  }
}

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

template <class T>
void batch_norm_forward_train(i64 N, i64 C, i64 HW, const T* x, const T* gamma, const T* beta_, T eps, T momentum,
                              T* running_mean, T* running_var, T* y, T* save_mean, T* save_invstd) {
  if (C <= 0) return;
  batch_norm_forward_train_kernel<<<blocks_for(C), kReduceThreads, 0, detail::stream()>>>(
      N, C, HW, x, gamma, beta_, eps, momentum, running_mean, running_var, y, save_mean, save_invstd);
  TALLY_LAUNCH_CHECK("batch_norm_forward_train");
}

template <class T>
void batch_norm_forward_eval(i64 N, i64 C, i64 HW, const T* x, const T* gamma, const T* beta_,
                             const T* running_mean, const T* running_var, T eps, T* y) {
  const i64 total = N * C * HW;
  if (total <= 0) return;
  batch_norm_forward_eval_kernel<<<grid_for(total), kThreads, 0, detail::stream()>>>(N, C, HW, x, gamma, beta_,
                                                                                      running_mean, running_var, eps, y);
  TALLY_LAUNCH_CHECK("batch_norm_forward_eval");
}

template <class T>
void batch_norm_backward(i64 N, i64 C, i64 HW, const T* dy, const T* x, const T* gamma, const T* save_mean,
                         const T* save_invstd, T* dx, T beta_dx, T* dgamma, T* dbeta, T beta_param) {
  if (C <= 0) return;
  batch_norm_backward_kernel<<<blocks_for(C), kReduceThreads, 0, detail::stream()>>>(
      N, C, HW, dy, x, gamma, save_mean, save_invstd, dx, beta_dx, dgamma, dbeta, beta_param);
  TALLY_LAUNCH_CHECK("batch_norm_backward");
}

template <class T>
void batch_norm_backward_eval(i64 N, i64 C, i64 HW, const T* dy, const T* x, const T* gamma,
                              const T* running_mean, const T* running_var, T eps, T* dx, T beta_dx, T* dgamma,
                              T* dbeta, T beta_param) {
  if (C <= 0) return;
  batch_norm_backward_eval_kernel<<<blocks_for(C), kReduceThreads, 0, detail::stream()>>>(
      N, C, HW, dy, x, gamma, running_mean, running_var, eps, dx, beta_dx, dgamma, dbeta, beta_param);
  TALLY_LAUNCH_CHECK("batch_norm_backward_eval");
}

template <class T>
void group_norm_forward(i64 N, i64 C, i64 HW, i64 G, const T* x, const T* gamma, const T* beta_, T eps, T* y,
                        T* save_mean, T* save_invstd) {
  if (N * G <= 0) return;
  group_norm_forward_kernel<<<blocks_for(N * G), kReduceThreads, 0, detail::stream()>>>(
      N, C, HW, G, x, gamma, beta_, eps, y, save_mean, save_invstd);
  TALLY_LAUNCH_CHECK("group_norm_forward");
}

template <class T>
void group_norm_backward(i64 N, i64 C, i64 HW, i64 G, const T* dy, const T* x, const T* gamma, const T* save_mean,
                         const T* save_invstd, T* dx, T beta_dx, T* dgamma, T* dbeta, T beta_param) {
  if (G <= 0) return;
  const i64 M = (C / G) * HW;
  if (dx && M > 0 && N * G > 0) {
    group_norm_backward_dx_kernel<<<blocks_for(N * G), kReduceThreads, 0, detail::stream()>>>(
        N, C, HW, G, dy, x, gamma, save_mean, save_invstd, dx, beta_dx);
    TALLY_LAUNCH_CHECK("group_norm_backward.dx");
  }
  if ((dgamma || dbeta) && C > 0) {
    group_norm_backward_param_kernel<<<blocks_for(C), kReduceThreads, 0, detail::stream()>>>(
        N, C, HW, G, dy, x, save_mean, save_invstd, dgamma, dbeta, beta_param);
    TALLY_LAUNCH_CHECK("group_norm_backward.params");
  }
}

#define TALLY_INSTANTIATE_NORM(T)                                                                             \
  template void batch_norm_forward_train<T>(i64, i64, i64, const T*, const T*, const T*, T, T, T*, T*, T*, T*, \
                                            T*);                                                              \
  template void batch_norm_forward_eval<T>(i64, i64, i64, const T*, const T*, const T*, const T*, const T*, T, \
                                           T*);                                                               \
  template void batch_norm_backward<T>(i64, i64, i64, const T*, const T*, const T*, const T*, const T*, T*, T, \
                                       T*, T*, T);                                                            \
  template void batch_norm_backward_eval<T>(i64, i64, i64, const T*, const T*, const T*, const T*, const T*, T, \
                                            T*, T, T*, T*, T);                                                \
  template void group_norm_forward<T>(i64, i64, i64, i64, const T*, const T*, const T*, T, T*, T*, T*);       \
  template void group_norm_backward<T>(i64, i64, i64, i64, const T*, const T*, const T*, const T*, const T*,  \
                                       T*, T, T*, T*, T);

TALLY_INSTANTIATE_NORM(float)
#undef TALLY_INSTANTIATE_NORM

}  // namespace tally::kernels::cuda
