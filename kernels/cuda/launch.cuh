// kernels/cuda/launch.cuh — launch shapes, grid-stride loops and deterministic block/warp
// reductions shared by the .cu files of kernels/cuda. Internal to the CUDA backend.
//
// Reductions: every sum is formed per thread in a fixed order, then over the warp with a
// butterfly (__shfl_xor_sync: every lane ends with the bitwise same total, since IEEE addition is
// commutative), then over the warps' partials in shared memory, again by a butterfly. For a fixed
// block size the tree is fixed, so repeated runs give bitwise identical results — no atomics.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common.h"
#include "kernels/cuda/check.h"

namespace tally::kernels::cuda::detail {

constexpr int kThreads = 256;            // threads of an elementwise block
constexpr int kReduceThreads = 512;      // threads of a block that owns one reduction
constexpr i64 kMaxBlocks = i64{1} << 16;  // grid-stride loops cover the rest

// Blocks for n elements, one per `threads` elements, at least 1 and at most kMaxBlocks.
inline unsigned grid_for(i64 n, int threads = kThreads) {
  const i64 b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<i64>(b, 1, kMaxBlocks));
}
// Blocks for `count` independent items handled one per block (channels, rows, groups).
inline unsigned blocks_for(i64 count) { return static_cast<unsigned>(std::clamp<i64>(count, 1, kMaxBlocks)); }

// Grid-stride loop over [0, n) with 64-bit indices.
#define TALLY_GRID_LOOP(i, n)                                                            \
  for (::tally::kernels::i64 i = static_cast<::tally::kernels::i64>(blockIdx.x) * blockDim.x + threadIdx.x; \
       i < (n); i += static_cast<::tally::kernels::i64>(blockDim.x) * gridDim.x)

// Block-stride loop over items [0, count) handled one per block.
#define TALLY_BLOCK_LOOP(b, count) \
  for (::tally::kernels::i64 b = blockIdx.x; b < (count); b += gridDim.x)

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <class T>
__device__ __forceinline__ T warp_max(T v) {
  // NaN wins, as in the CPU's row maximum: fmax would drop it.
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, m);
    v = (o > v || o != o) ? o : v;
  }
  return v;
}

// Sum of v over the block, returned to every thread. blockDim.x must be a multiple of 32 (at most
// 1024) and every thread of the block must call it (it has barriers).
template <class T>
__device__ T block_sum(T v) {
  __shared__ T partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call's readers are done with `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < nwarps ? partial[lane] : T(0);
  return warp_sum(v);  // every warp forms the same total
}

}  // namespace tally::kernels::cuda::detail
