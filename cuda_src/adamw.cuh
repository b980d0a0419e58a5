// AdamW element math and loop body (adamw.cu, adamw_table.cu), mirroring torch's single-tensor
// AdamW (decoupled weight decay) op for op in fp32. Host-precomputed scalars
// (all already rounded to fp32 exactly as torch rounds its Python scalars):
//   decay = 1 - lr*wd, w1 = 1 - beta1, beta2, c2 = 1 - beta2,
//   neg_step = -(lr / bias_correction1), bc2_sqrt = sqrt(bias_correction2), eps.
#pragma once
#include "common.cuh"

struct AdamWArgs {
  float grad_coef, decay, w1, beta2, c2, neg_step, bc2_sqrt, eps;
};

// One element. FMAs exactly where torch's vectorised CPU kernels use them:
// lerp = fmadd(coeff, end - start, base) and addcmul's self + (value*t1)*t2.
ZM_HD void adamw_elem(float& p, float& m, float& v, float graw, const AdamWArgs& a) {
  float g = zm_mul(graw, a.grad_coef);
  p = zm_mul(p, a.decay);
  float d = zm_sub(g, m);
  // torch lerp: |w| < 0.5 -> start + w*(end-start); else end - (1-w)*(end-start)
  bool small = (a.w1 < 0.5f && a.w1 > -0.5f);
  m = small ? zm_fma(a.w1, d, m) : zm_fma(zm_sub(a.w1, 1.0f), d, g);
  v = zm_mul(v, a.beta2);
  v = zm_fma(zm_mul(a.c2, g), g, v);
  float denom = zm_add(zm_div(zm_sqrt(v), a.bc2_sqrt), a.eps);
  p = zm_add(p, zm_div(zm_mul(a.neg_step, m), denom));
}

// Loop body shared by the kernels and the host test harness. Threads [start,
// start+stride) cover [0, n) grid-stride; vector path when phases agree.
template <typename G, typename O>
ZM_HD void adamw_range(float* master, float* exp_avg, float* exp_avg_sq,
                       const typename G::storage* grad, typename O::storage* out,
                       usize n, AdamWArgs a, usize start, usize stride) {
  const bool has_out = O::present;
  const u32 ph = zm_phase4(master);
  const bool same = zm_phase4(exp_avg) == ph && zm_phase4(exp_avg_sq) == ph &&
                    zm_phase4(grad) == ph && (!has_out || zm_phase4(out) == ph);
  const ZmSplit s = zm_split(n, same, ph);
  ZM_GRID_STRIDE(j, start, s.nvec, stride) {
    const usize i = s.head + 4 * j;
    float p[4], m[4], v[4];
    typename G::storage g[4];
    typename O::storage o[4];
    zm_load4(master + i, p); zm_load4(exp_avg + i, m); zm_load4(exp_avg_sq + i, v);
    zm_load4(grad + i, g);
    for (int k = 0; k < 4; ++k) {
      adamw_elem(p[k], m[k], v[k], G::load(g[k]), a);
      o[k] = O::store(p[k]);
    }
    zm_store4(master + i, p); zm_store4(exp_avg + i, m); zm_store4(exp_avg_sq + i, v);
    if (has_out) zm_store4(out + i, o);
  }
  // Scalar head and tail (the whole range when phases differ).
  const usize tail0 = s.head + 4 * s.nvec;
  const usize nscalar = s.head + (n - tail0);
  ZM_GRID_STRIDE(j, start, nscalar, stride) {
    const usize i = j < s.head ? j : tail0 + (j - s.head);
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_elem(p, m, v, G::load(grad[i]), a);
    master[i] = p; exp_avg[i] = m; exp_avg_sq[i] = v;
    if (has_out) out[i] = O::store(p);
  }
}

// Every (gradient, low-precision output) dtype pair the AdamW kernels are built for:
// X(PREFIX_<grad>_<out>, G, O), names as the Python launchers ask for them.
#define ZM_ADAMW_DTYPE_PAIRS(X, PREFIX)                                           \
  X(PREFIX##_f32_none, F32, NoOut) X(PREFIX##_f32_bf16, F32, BF16)                \
  X(PREFIX##_f32_f16, F32, F16) X(PREFIX##_bf16_none, BF16, NoOut)                \
  X(PREFIX##_bf16_bf16, BF16, BF16) X(PREFIX##_bf16_f16, BF16, F16)               \
  X(PREFIX##_f16_none, F16, NoOut) X(PREFIX##_f16_bf16, F16, BF16)                \
  X(PREFIX##_f16_f16, F16, F16)
