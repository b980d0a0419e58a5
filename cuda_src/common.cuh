// Shared helpers for zerompi kernels.
// Self-contained on purpose: no cuda_fp16.h / cuda_bf16.h / libc headers, so the
// same text compiles under NVRTC (loaded by CuPy), nvcc, and as host code
// (the tests call the ZM_HD bodies from a CPU harness to check them bit-exactly).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define ZM_HD __host__ __device__ __forceinline__
#else
#define ZM_HD inline
#endif

typedef decltype(sizeof(0)) usize;  // size_t without <cstddef>
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Global thread id / thread count for grid-stride loops (64-bit: n may exceed 2^31).
#define ZM_TID ((usize)blockIdx.x * blockDim.x + threadIdx.x)
#define ZM_NTHREADS ((usize)blockDim.x * gridDim.x)
#define ZM_GRID_STRIDE(i, start, end, stride) \
  for (usize i = (start); i < (end); i += (stride))

// ---- bit casts ------------------------------------------------------------
ZM_HD u32 zm_f2u(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  u32 u; __builtin_memcpy(&u, &x, 4); return u;
#endif
}
ZM_HD float zm_u2f(u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x; __builtin_memcpy(&x, &u, 4); return x;
#endif
}

ZM_HD double zm_u2d(u64 u) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double((long long)u);
#else
  double x; __builtin_memcpy(&x, &u, 8); return x;
#endif
}

// ---- explicitly rounded fp32 ops -------------------------------------------
// Inline PTX, not intrinsics or operators: CuPy appends -ftz=true to every NVRTC
// compile, which would flush subnormals in C++ float ops; literal PTX without
// .ftz keeps IEEE subnormals, and is never contracted into FMAs. FMAs appear only
// where torch's vectorised CPU path uses one (lerp, addcmul). Host builds (tests)
// must use -ffp-contract=off.
#ifdef __CUDA_ARCH__
#define ZM_PTX2(NAME, OP)                                                   \
  ZM_HD float NAME(float a, float b) {                                      \
    float r; asm(OP " %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;  \
  }
ZM_PTX2(zm_add, "add.rn.f32")
ZM_PTX2(zm_sub, "sub.rn.f32")
ZM_PTX2(zm_mul, "mul.rn.f32")
ZM_PTX2(zm_div, "div.rn.f32")
#undef ZM_PTX2
ZM_HD float zm_sqrt(float a) {
  float r; asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a)); return r;
}
ZM_HD float zm_fma(float a, float b, float c) {
  float r; asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c)); return r;
}
ZM_HD double zm_f2d(float a) {  // cvt without .ftz keeps subnormal inputs
  double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a)); return r;
}
#else
ZM_HD float zm_add(float a, float b) { return a + b; }
ZM_HD float zm_sub(float a, float b) { return a - b; }
ZM_HD float zm_mul(float a, float b) { return a * b; }
ZM_HD float zm_div(float a, float b) { return a / b; }
ZM_HD float zm_sqrt(float a) { return __builtin_sqrtf(a); }
ZM_HD float zm_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
ZM_HD double zm_f2d(float a) { return (double)a; }
#endif

ZM_HD bool zm_isfinite_bits(u32 u) { return (u & 0x7f800000u) != 0x7f800000u; }

// ---- bf16 <-> fp32 (bit patterns in u16) -----------------------------------
ZM_HD float bf16_to_f32(u16 h) { return zm_u2f((u32)h << 16); }
ZM_HD u16 f32_to_bf16(float f) {
  u32 u = zm_f2u(f);
  // NaN: keep sign and top payload, set the quiet bit so truncation cannot give inf.
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; carries into inf correctly
  return (u16)(u >> 16);
}

// ---- fp16 <-> fp32 (bit patterns in u16) -----------------------------------
ZM_HD float f16_to_f32(u16 h) {
  u32 sign = (u32)(h & 0x8000u) << 16;
  u32 e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return zm_u2f(sign | 0x7f800000u | (m << 13));  // inf / NaN
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    float v = zm_mul((float)m, 5.9604644775390625e-8f);
    return zm_u2f(zm_f2u(v) | sign);
  }
  return zm_u2f(sign | ((e + 112u) << 23) | (m << 13));
}
ZM_HD u16 f32_to_f16(float f) {
  u32 u = zm_f2u(f);
  u32 sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // >= 65520 rounds to inf (RNE)
  if (a >= 0x38800000u) {  // normal half: rebias exponent, RNE on the 13 dropped bits
    u32 r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return (u16)(sign | (r >> 13));
  }
  // Subnormal half: ulp(0.5) = 2^-24 = the fp16 subnormal step, so the fp32 add
  // rounds |f| to it RNE, and the low bits of the sum are the fp16 mantissa.
  float t = zm_add(zm_u2f(a), 0.5f);
  return (u16)(sign | (zm_f2u(t) - 0x3f000000u));
}

// ---- element type tags -------------------------------------------------------
struct F32 {
  typedef float storage;
  static const bool present = true;
  ZM_HD static float load(float x) { return x; }
  ZM_HD static float store(float x) { return x; }
};
struct BF16 {
  typedef u16 storage;
  static const bool present = true;
  ZM_HD static float load(u16 x) { return bf16_to_f32(x); }
  ZM_HD static u16 store(float x) { return f32_to_bf16(x); }
};
struct F16 {
  typedef u16 storage;
  static const bool present = true;
  ZM_HD static float load(u16 x) { return f16_to_f32(x); }
  ZM_HD static u16 store(float x) { return f32_to_f16(x); }
};
struct NoOut {  // "no low-precision output" marker
  typedef u16 storage;
  static const bool present = false;
  ZM_HD static u16 store(float) { return 0; }
};

// ---- vectorised access: 4 elements per load (16 B fp32, 8 B 16-bit) ----------
// Element phase of a pointer modulo 4; vector loads are legal once every stream
// has the same phase and the first (4 - phase) % 4 elements are peeled off.
template <typename S>
ZM_HD u32 zm_phase4(const S* p) {
  return (u32)((reinterpret_cast<u64>(p) / sizeof(S)) & 3u);
}
ZM_HD void zm_load4(const float* p, float v[4]) {
  float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
}
ZM_HD void zm_store4(float* p, const float v[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
ZM_HD void zm_load4(const u16* p, u16 v[4]) {
  uint2 t = *reinterpret_cast<const uint2*>(p);  // little-endian: low half first
  v[0] = (u16)(t.x & 0xffffu); v[1] = (u16)(t.x >> 16);
  v[2] = (u16)(t.y & 0xffffu); v[3] = (u16)(t.y >> 16);
}
ZM_HD void zm_store4(u16* p, const u16 v[4]) {
  *reinterpret_cast<uint2*>(p) =
      make_uint2((u32)v[0] | ((u32)v[1] << 16), (u32)v[2] | ((u32)v[3] << 16));
}

// Splits [0, n) into scalar head [0, head), vector body [head, head + 4*nvec),
// scalar tail; nvec == 0 when the streams' phases differ (pure scalar loop).
struct ZmSplit { usize head, nvec; };
ZM_HD ZmSplit zm_split(usize n, bool same_phase, u32 phase) {
  ZmSplit s;
  if (!same_phase) { s.head = n; s.nvec = 0; return s; }
  s.head = (4u - phase) & 3u;
  if (s.head > n) s.head = n;
  s.nvec = (n - s.head) / 4;
  return s;
}
