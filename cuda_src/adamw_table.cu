// The optimizer's whole segment table in one launch per shard: fused AdamW, and the
// fused overflow check + weighted sum of squares of the gradients.
//
// Tables (host-built, zerompi/kernels/adamw_table.py), int64 rows:
//   segs [nseg][5]:  length, master offset, grad offset, moment offset, out offset
//                    (element offsets into the four base buffers: which buffer a
//                    segment indexes by shard or flat offset is the host's business)
//   tiles[ntile][3]: segment, start within it, length (<= the host's tile size)
// Per step, fp32 rows [nseg][9]: the eight AdamWArgs scalars, then 1 (update) or 0
// (skip: a parameter that got no gradient this step).
// coef (nullable, 2 fp32 on the device): the step's gradient coefficient and an overflow
// flag, computed on the device from the gradient norm (zerompi/zero/step_coef.py). When
// given, it replaces every row's grad_coef, and a nonzero flag skips the whole update
// (as torch's fused AdamW with found_inf), so the host need not read the norm first.
// One block per tile, grid-stride over tiles: any number and size of segments is
// balanced, and no grid limit bites. Tile starts are multiples of 4, so a tile keeps
// its segment's vector phase.
#include "adamw.cuh"
#include "grad_stats.cuh"

#define ZM_SEG_COLS 5
#define ZM_TILE_COLS 3
#define ZM_ROW_COLS 9

// Loop body for one tile, shared by the kernels and the host test harness.
template <typename G, typename O>
ZM_HD void adamw_tile(float* master, float* exp_avg, float* exp_avg_sq,
                      const typename G::storage* grad, typename O::storage* out,
                      const long long* segs, const long long* tiles, const float* rows,
                      const float* coef, usize tile, usize thread, usize nthreads) {
  const long long* t = tiles + ZM_TILE_COLS * tile;
  const usize s = (usize)t[0], lo = (usize)t[1], n = (usize)t[2];
  const float* r = rows + ZM_ROW_COLS * s;
  if (r[8] == 0.0f) return;  // uniform over the block: no divergence
  if (coef && coef[1] != 0.0f) return;  // overflow: the step is skipped (uniform too)
  const long long* sg = segs + ZM_SEG_COLS * s;
  const AdamWArgs a = {coef ? coef[0] : r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
  const usize mo = (usize)sg[3] + lo;
  adamw_range<G, O>(master + ((usize)sg[1] + lo), exp_avg + mo, exp_avg_sq + mo,
                    grad + ((usize)sg[2] + lo),
                    O::present ? out + ((usize)sg[4] + lo) : out, n, a, thread, nthreads);
}

// adamw_table_<grad dtype>_<out dtype>; any block size. For *_none pass out = 0.
#define ZM_ADAMW_TABLE_KERNEL(NAME, G, O)                                            \
  extern "C" __global__ void NAME(                                                   \
      float* master, float* exp_avg, float* exp_avg_sq, const G::storage* grad,      \
      O::storage* out, const long long* segs, const long long* tiles,                \
      long long ntiles, const float* rows, const float* coef) {                      \
    for (usize t = blockIdx.x; t < (usize)ntiles; t += gridDim.x)                    \
      adamw_tile<G, O>(master, exp_avg, exp_avg_sq, grad, out, segs, tiles, rows,    \
                       coef, t, threadIdx.x, blockDim.x);                            \
  }

ZM_ADAMW_DTYPE_PAIRS(ZM_ADAMW_TABLE_KERNEL, adamw_table)

// ---- overflow + weighted sum of squares ---------------------------------------
// Pass 1 (<<<B, 256>>>): per tile, thread t sums g*g over tile elements t, t+256, ...
// (fp64, exact squares), a fixed tree sums the threads, and the tile's partial is
// that sum times its segment's fp64 weight (tp replicas count 1/tp). Pass 2
// (<<<1, 256>>>): thread t sums partials t, t+256, ... in order, then the same tree.
// The order depends only on the table, never on B or the GPU: bitwise reproducible.

template <typename G>
ZM_HD void stats_tile_thread(const typename G::storage* grad, const long long* segs,
                             const long long* tiles, usize tile, usize thread,
                             double& acc, int& bad) {
  const long long* t = tiles + ZM_TILE_COLS * tile;
  const typename G::storage* g = grad + ((usize)segs[ZM_SEG_COLS * t[0] + 2] + (usize)t[1]);
  stats_thread<G>(g, (usize)t[2], thread, ZM_STATS_THREADS, acc, bad);
}

ZM_HD double stats_tile_part(double tree_sum, const long long* tiles, const double* weights,
                             usize tile) {
  return tree_sum * weights[tiles[ZM_TILE_COLS * tile]];
}

ZM_HD void stats_finish_thread(const double* part_sum, const int* part_flag, usize nparts,
                               usize thread, double& acc, int& bad) {
  ZM_GRID_STRIDE(i, thread, nparts, (usize)ZM_STATS_THREADS) {
    acc += part_sum[i];
    bad |= part_flag[i];
  }
}

// The sum the optimizer reports: +inf on overflow (whatever inf*0 or nan gave).
ZM_HD double stats_result(double sum, int bad) {
  return bad ? zm_u2d(0x7ff0000000000000ull) : sum;
}

#define ZM_STATS_TABLE_KERNEL(NAME, G)                                                \
  extern "C" __global__ void NAME(const G::storage* grad, const long long* segs,      \
                                  const long long* tiles, long long ntiles,           \
                                  const double* weights, double* part_sum,            \
                                  int* part_flag) {                                   \
    __shared__ double sh[ZM_STATS_THREADS];                                           \
    for (usize t = blockIdx.x; t < (usize)ntiles; t += gridDim.x) {                   \
      double acc = 0.0;                                                               \
      int bad = 0;                                                                    \
      stats_tile_thread<G>(grad, segs, tiles, t, threadIdx.x, acc, bad);              \
      bad = __syncthreads_or(bad);                                                    \
      const double s = zm_block_sum(acc, sh);                                         \
      if (threadIdx.x == 0) {                                                         \
        part_sum[t] = stats_tile_part(s, tiles, weights, t);                          \
        part_flag[t] = bad != 0;                                                      \
      }                                                                               \
      __syncthreads(); /* every thread has read sh[0] before the next tile */        \
    }                                                                                 \
  }
ZM_STATS_TABLE_KERNEL(grad_stats_table_f32, F32)
ZM_STATS_TABLE_KERNEL(grad_stats_table_bf16, BF16)
ZM_STATS_TABLE_KERNEL(grad_stats_table_f16, F16)

extern "C" __global__ void grad_stats_table_finish(const double* part_sum, const int* part_flag,
                                                   long long nparts, double* out_sumsq,
                                                   int* out_flag) {
  __shared__ double sh[ZM_STATS_THREADS];
  double acc = 0.0;
  int bad = 0;
  stats_finish_thread(part_sum, part_flag, (usize)nparts, threadIdx.x, acc, bad);
  bad = __syncthreads_or(bad);
  const double s = zm_block_sum(acc, sh);
  if (threadIdx.x == 0) {
    *out_sumsq = stats_result(s, bad);
    *out_flag = bad != 0;
  }
}
