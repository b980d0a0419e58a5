// Fused AdamW kernels over one flat fp32 shard (the element math and loop body are
// in adamw.cuh, shared with the segment-table kernels of adamw_table.cu).
#include "adamw.cuh"

// extern "C" entry points: adamw_<grad dtype>_<out dtype>. For *_none the
// out_param pointer is ignored (pass 0).
#define ZM_ADAMW_KERNEL(NAME, G, O)                                                  \
  extern "C" __global__ void NAME(                                                   \
      float* master, float* exp_avg, float* exp_avg_sq,                              \
      const G::storage* grad, O::storage* out_param, long long n,                    \
      float grad_coef, float decay, float w1, float beta2, float c2,                 \
      float neg_step, float bc2_sqrt, float eps) {                                   \
    AdamWArgs a = {grad_coef, decay, w1, beta2, c2, neg_step, bc2_sqrt, eps};        \
    adamw_range<G, O>(master, exp_avg, exp_avg_sq, grad, out_param, (usize)n, a,     \
                      ZM_TID, ZM_NTHREADS);                                          \
  }

ZM_ADAMW_DTYPE_PAIRS(ZM_ADAMW_KERNEL, adamw)
