// Fused overflow check + sum of squares over a gradient shard, in two launches:
//   grad_stats_partial_<dtype><<<B, 256>>>: per block, fp64 sum of g*g and an
//     inf/nan flag;
//   grad_stats_finish<<<1, 256>>>: reduces the B partials.
// fp64 accumulation: each fp32 square is exact in fp64 and cannot overflow, so
// the norm is inf/nan only when an input is, and rounding error stays far below
// fp32 resolution for any shard size. Reduction order depends only on n and B
// (no float atomics), so results are bitwise reproducible.
#include "grad_stats.cuh"

template <typename G>
__device__ __forceinline__ void stats_partial(const typename G::storage* grad, usize n,
                                              double* part_sum, int* part_flag) {
  __shared__ double sh[ZM_STATS_THREADS];
  double acc = 0.0;
  int bad = 0;
  stats_thread<G>(grad, n, ZM_TID, ZM_NTHREADS, acc, bad);
  bad = __syncthreads_or(bad);
  const double s = zm_block_sum(acc, sh);
  if (threadIdx.x == 0) {
    part_sum[blockIdx.x] = s;
    part_flag[blockIdx.x] = bad != 0;
  }
}

#define ZM_STATS_KERNEL(NAME, G)                                                   \
  extern "C" __global__ void NAME(const G::storage* grad, long long n,             \
                                  double* part_sum, int* part_flag) {              \
    stats_partial<G>(grad, (usize)n, part_sum, part_flag);                         \
  }
ZM_STATS_KERNEL(grad_stats_partial_f32, F32)
ZM_STATS_KERNEL(grad_stats_partial_bf16, BF16)
ZM_STATS_KERNEL(grad_stats_partial_f16, F16)

// One block: thread t sums partials t, t+256, ... in order, then the same tree.
extern "C" __global__ void grad_stats_finish(const double* part_sum, const int* part_flag,
                                             int nparts, double* out_sumsq, int* out_flag) {
  __shared__ double sh[ZM_STATS_THREADS];
  double acc = 0.0;
  int bad = 0;
  for (int i = (int)threadIdx.x; i < nparts; i += ZM_STATS_THREADS) {
    acc += part_sum[i];
    bad |= part_flag[i];
  }
  bad = __syncthreads_or(bad);
  const double s = zm_block_sum(acc, sh);
  if (threadIdx.x == 0) {
    *out_sumsq = s;
    *out_flag = bad != 0;
  }
}
