// Pieces shared by the gradient-statistics kernels (grad_stats.cu, adamw_table.cu).
#pragma once
#include "common.cuh"

#define ZM_STATS_THREADS 256  // block size both kernels must be launched with

template <typename G>
ZM_HD void stats_thread(const typename G::storage* g, usize n, usize start, usize stride,
                        double& acc, int& bad) {
  ZM_GRID_STRIDE(i, start, n, stride) {
    const float x = G::load(g[i]);
    bad |= !zm_isfinite_bits(zm_f2u(x));
    const double d = zm_f2d(x);
    acc += d * d;  // d*d is exact, so FMA contraction cannot change the sum
  }
}

// Fixed-shape tree over the block; returns the total in thread 0.
__device__ __forceinline__ double zm_block_sum(double x, double* sh) {
  const unsigned t = threadIdx.x;
  sh[t] = x;
  __syncthreads();
  for (unsigned s = ZM_STATS_THREADS / 2; s > 0; s >>= 1) {
    if (t < s) sh[t] += sh[t + s];
    __syncthreads();
  }
  return sh[0];
}
