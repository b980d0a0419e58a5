// Precision casts and scaled fp32 copies (filling fp32 communication buckets
// from low-precision gradients). Rounding: RNE, NaN stays NaN, fp16 overflow -> inf.
#include "common.cuh"

// out[i] = O(I(in[i])); with Scaled: out[i] = in*scale (+ out[i] if accumulate).
// mul and add are separately rounded (no FMA) so numpy can reproduce them.
template <typename I, bool Scaled>
ZM_HD float cast_value(typename I::storage x, float scale, bool acc, float prev) {
  float y = I::load(x);
  if (Scaled) {
    y = zm_mul(y, scale);
    if (acc) y = zm_add(prev, y);
  }
  return y;
}

template <typename I, typename O, bool Scaled>
ZM_HD void cast_range(const typename I::storage* in, typename O::storage* out, usize n,
                      float scale, bool acc, usize start, usize stride) {
  const u32 ph = zm_phase4(in);
  const ZmSplit s = zm_split(n, zm_phase4(out) == ph, ph);
  ZM_GRID_STRIDE(j, start, s.nvec, stride) {
    const usize i = s.head + 4 * j;
    typename I::storage x[4];
    typename O::storage y[4];
    float prev[4] = {0.f, 0.f, 0.f, 0.f};
    zm_load4(in + i, x);
    if (Scaled && acc) zm_load4(reinterpret_cast<const float*>(out + i), prev);
    for (int k = 0; k < 4; ++k)
      y[k] = O::store(cast_value<I, Scaled>(x[k], scale, acc, prev[k]));
    zm_store4(out + i, y);
  }
  const usize tail0 = s.head + 4 * s.nvec;
  const usize nscalar = s.head + (n - tail0);
  ZM_GRID_STRIDE(j, start, nscalar, stride) {
    const usize i = j < s.head ? j : tail0 + (j - s.head);
    float prev = (Scaled && acc) ? O::load(out[i]) : 0.f;
    out[i] = O::store(cast_value<I, Scaled>(in[i], scale, acc, prev));
  }
}

#define ZM_CAST_KERNEL(NAME, I, O)                                                  \
  extern "C" __global__ void NAME(const I::storage* in, O::storage* out, long long n) { \
    cast_range<I, O, false>(in, out, (usize)n, 1.0f, false, ZM_TID, ZM_NTHREADS);   \
  }
ZM_CAST_KERNEL(cast_f32_bf16, F32, BF16)
ZM_CAST_KERNEL(cast_f32_f16, F32, F16)
ZM_CAST_KERNEL(cast_bf16_f32, BF16, F32)
ZM_CAST_KERNEL(cast_f16_f32, F16, F32)

// scaled_copy_<src dtype>: fp32 out = in*scale, or out += in*scale if accumulate != 0.
#define ZM_SCALED_KERNEL(NAME, I)                                                   \
  extern "C" __global__ void NAME(const I::storage* in, float* out, long long n,    \
                                  float scale, int accumulate) {                    \
    cast_range<I, F32, true>(in, out, (usize)n, scale, accumulate != 0, ZM_TID,     \
                             ZM_NTHREADS);                                          \
  }
ZM_SCALED_KERNEL(scaled_copy_f32, F32)
ZM_SCALED_KERNEL(scaled_copy_bf16, BF16)
ZM_SCALED_KERNEL(scaled_copy_f16, F16)
