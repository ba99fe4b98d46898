// kernels/cuda/loss.cu — softmax cross-entropy over logits (N, C), int64 targets (N), with
// class weights, ignore_index and label smoothing; the CUDA twin of kernels/cpu/loss.cpp (the
// formulas are written out there).
//
// One warp per row: the lanes stride over the row's C logits, the row maximum and the sum of
// exponentials are formed per lane and combined with a butterfly (launch.cuh), so every lane holds
// the same log-sum-exp. As on the CPU, exponentials, log-sum-exp and the loss are computed in
// double: the loss is a difference (lse - z_t) that float would lose for confident predictions.
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/instantiate.h"
#include "kernels/cuda/launch.cuh"

namespace tally::kernels::cuda {
namespace {
using detail::kThreads;
constexpr int kRowsPerBlock = kThreads / 32;

// log sum_c exp(z_c) of one row, in double, identical on every lane of the warp.
template <class T>
__device__ double warp_row_lse(i64 C, const T* __restrict__ z, int lane) {
  double zmax = -INFINITY;
  for (i64 c = lane; c < C; c += 32) {
    const double v = static_cast<double>(z[c]);
    if (v > zmax || v != v) zmax = v;
  }
  zmax = detail::warp_max(zmax);
  double s = 0.0;
  for (i64 c = lane; c < C; c += 32) s += exp(static_cast<double>(z[c]) - zmax);
  s = detail::warp_sum(s);
  return zmax + log(s);
}

// sum_c w[c] of the class weights (C when there are none), identical on every lane.
template <class T>
__device__ double warp_weight_sum(i64 C, const T* __restrict__ w, int lane) {
  if (!w) return static_cast<double>(C);
  double s = 0.0;
  for (i64 c = lane; c < C; c += 32) s += static_cast<double>(w[c]);
  return detail::warp_sum(s);
}

// ---- CUDA kernels ------------------------------------------------------------------------------

template <class T>
__global__ void cross_entropy_forward_kernel(i64 N, i64 C, const T* __restrict__ logits,
                                             const i64* __restrict__ targets, const T* __restrict__ class_weight,
                                             i64 ignore_index, double e, T* loss, T* sample_weight) {
  const int lane = threadIdx.x & 31;
  const i64 warps = static_cast<i64>(gridDim.x) * kRowsPerBlock;
  const double e_over_c = C > 0 ? e / static_cast<double>(C) : 0.0;
  // The whole warp takes the same branches (t is per row): the shuffles see all 32 lanes.
  for (i64 i = static_cast<i64>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5); i < N; i += warps) {
    const i64 t = targets[i];
    if (t == ignore_index || t < 0 || t >= C) {  // ignored, or invalid (reported by the launcher)
      if (lane == 0) {
        if (loss) loss[i] = T(0);
        if (sample_weight) sample_weight[i] = T(0);
      }
      continue;
    }
    const T* z = logits + i * C;
    const double lse = warp_row_lse(C, z, lane);
    const double wt = class_weight ? static_cast<double>(class_weight[t]) : 1.0;
    double l = (1.0 - e) * wt * (lse - static_cast<double>(z[t]));
    if (e != 0.0) {
      double smooth = 0.0;
      for (i64 c = lane; c < C; c += 32) {
        const double wc = class_weight ? static_cast<double>(class_weight[c]) : 1.0;
        smooth += wc * (lse - static_cast<double>(z[c]));
      }
      l += e_over_c * detail::warp_sum(smooth);
    }
    if (lane == 0) {
      if (loss) loss[i] = static_cast<T>(l);
      if (sample_weight) sample_weight[i] = static_cast<T>(wt);
    }
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(i64 N, i64 C, const T* __restrict__ logits,
                                              const i64* __restrict__ targets, const T* __restrict__ class_weight,
                                              i64 ignore_index, double e, const T* __restrict__ dloss, T* dlogits,
                                              T beta) {
  const int lane = threadIdx.x & 31;
  const i64 warps = static_cast<i64>(gridDim.x) * kRowsPerBlock;
  const double e_over_c = C > 0 ? e / static_cast<double>(C) : 0.0;
  const bool overwrite = beta == T(0);
  for (i64 i = static_cast<i64>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5); i < N; i += warps) {
    const i64 t = targets[i];
    T* g = dlogits + i * C;
    if (t == ignore_index || t < 0 || t >= C) {  // no gradient
      if (overwrite)
        for (i64 c = lane; c < C; c += 32) g[c] = T(0);
      continue;
    }
    const T* z = logits + i * C;
    const double lse = warp_row_lse(C, z, lane);
    const double wsum = warp_weight_sum(C, class_weight, lane);
    const double s = static_cast<double>(dloss[i]);
    const double wt = class_weight ? static_cast<double>(class_weight[t]) : 1.0;
    const double a = s * (1.0 - e) * wt;  // coefficient of (p_c - [c == t])
    const double b = s * e_over_c;        // coefficient of (W * p_c - w[c])
    for (i64 c = lane; c < C; c += 32) {
      const double p = exp(static_cast<double>(z[c]) - lse);
      const double wc = class_weight ? static_cast<double>(class_weight[c]) : 1.0;
      double v = a * (p - (c == t ? 1.0 : 0.0));
      if (e != 0.0) v += b * (wsum * p - wc);
      g[c] = overwrite ? static_cast<T>(v) : beta * g[c] + static_cast<T>(v);
    }
  }
}

unsigned row_blocks(i64 N) { return detail::blocks_for((N + kRowsPerBlock - 1) / kRowsPerBlock); }

// y[0] = scale * sum loss, scale = fixed (> 0) or 1 / sum sample_weight; one block, double.
template <class T>
__global__ void cross_entropy_reduce_kernel(i64 N, const T* __restrict__ loss, const T* __restrict__ sample_weight,
                                            double fixed_scale, T* y, T* scale) {
  double total = 0.0, wsum = 0.0;
  for (i64 i = threadIdx.x; i < N; i += blockDim.x) {
    total += static_cast<double>(loss[i]);
    wsum += static_cast<double>(sample_weight[i]);
  }
  total = detail::block_sum(total);
  wsum = detail::block_sum(wsum);
  if (threadIdx.x == 0) {
    const double sc = fixed_scale > 0.0 ? fixed_scale : 1.0 / wsum;
    scale[0] = static_cast<T>(sc);
    y[0] = static_cast<T>(total * sc);
  }
}

}  // namespace

// ---- kernel launchers ----------------------------------------------------------------------------

template <class T>
void cross_entropy_reduce(i64 N, const T* loss, const T* sample_weight, T fixed_scale, T* y, T* scale) {
  cross_entropy_reduce_kernel<<<1, detail::kReduceThreads, 0, detail::stream()>>>(
      N, loss, sample_weight, static_cast<double>(fixed_scale), y, scale);
  TALLY_LAUNCH_CHECK("cross_entropy_reduce");
}

template <class T>
i64 cross_entropy_forward(i64 N, i64 C, const T* logits, const i64* targets, const T* class_weight,
                          i64 ignore_index, T label_smoothing, T* loss, T* sample_weight, bool check_targets) {
  if (N <= 0) return -1;
  cross_entropy_forward_kernel<<<row_blocks(N), kThreads, 0, detail::stream()>>>(
      N, C, logits, targets, class_weight, ignore_index, static_cast<double>(label_smoothing), loss, sample_weight);
  TALLY_LAUNCH_CHECK("cross_entropy_forward");
  if (!check_targets) return -1;
  // The first invalid target, found as the CPU does (sequentially, so the answer is the same):
  // the targets are N int64 values, and the caller needs the answer on the host anyway.
  std::vector<i64> t(static_cast<std::size_t>(N));
  TALLY_CUDA_CHECK(cudaMemcpyAsync(t.data(), targets, t.size() * sizeof(i64), cudaMemcpyDeviceToHost,
                                   detail::stream()));
  detail::host_wait(detail::stream());
  for (i64 i = 0; i < N; ++i) {
    const i64 v = t[static_cast<std::size_t>(i)];
    if (v != ignore_index && (v < 0 || v >= C)) return i;
  }
  return -1;
}

template <class T>
void cross_entropy_backward(i64 N, i64 C, const T* logits, const i64* targets, const T* class_weight,
                            i64 ignore_index, T label_smoothing, const T* dloss, T* dlogits, T beta) {
  if (N <= 0 || C <= 0) return;
  cross_entropy_backward_kernel<<<row_blocks(N), kThreads, 0, detail::stream()>>>(
      N, C, logits, targets, class_weight, ignore_index, static_cast<double>(label_smoothing), dloss, dlogits, beta);
  TALLY_LAUNCH_CHECK("cross_entropy_backward");
}

TALLY_INSTANTIATE_LOSS(float)

}  // namespace tally::kernels::cuda
