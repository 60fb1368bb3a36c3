// doorbell device API, core tier: elementwise sums over packed words, for reductions that move
// data as 32-bit words (LL packets) or 16-byte vectors.
//
// Sums accumulate in f32 and round once, and callers add contributions in rank order, so every
// rank that reduces the same inputs gets bit-identical results.
#pragma once

#include "common.cuh"

#if DOORBELL_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace doorbell {

// How many elements of T one 32-bit word holds, and how to widen and narrow them.
template <typename T>
struct Word32;

template <>
struct Word32<float> {
  static constexpr int kElems = 1;
  DOORBELL_DEVICE_INLINE static void widen(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
  DOORBELL_DEVICE_INLINE static uint32_t narrow(const float* f) { return __float_as_uint(f[0]); }
};

template <>
struct Word32<__nv_bfloat16> {
  static constexpr int kElems = 2;
  DOORBELL_DEVICE_INLINE static void widen(uint32_t w, float* f) {
    __nv_bfloat162 h;
    memcpy(&h, &w, 4);
    const float2 v = __bfloat1622float2(h);
    f[0] = v.x;
    f[1] = v.y;
  }
  DOORBELL_DEVICE_INLINE static uint32_t narrow(const float* f) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[0], f[1]);
    uint32_t w;
    memcpy(&w, &h, 4);
    return w;
  }
};

template <>
struct Word32<__half> {
  static constexpr int kElems = 2;
  DOORBELL_DEVICE_INLINE static void widen(uint32_t w, float* f) {
    __half2 h;
    memcpy(&h, &w, 4);
    const float2 v = __half22float2(h);
    f[0] = v.x;
    f[1] = v.y;
  }
  DOORBELL_DEVICE_INLINE static uint32_t narrow(const float* f) {
    const __half2 h = __floats2half2_rn(f[0], f[1]);
    uint32_t w;
    memcpy(&w, &h, 4);
    return w;
  }
};

// An f32 accumulator for W words of T.
template <typename T, int W>
struct WordSum {
  float v[W * Word32<T>::kElems];

  DOORBELL_DEVICE_INLINE void set(const uint32_t* w) {
#pragma unroll
    for (int i = 0; i < W; ++i) Word32<T>::widen(w[i], v + i * Word32<T>::kElems);
  }
  DOORBELL_DEVICE_INLINE void add(const uint32_t* w) {
    float f[Word32<T>::kElems];
#pragma unroll
    for (int i = 0; i < W; ++i) {
      Word32<T>::widen(w[i], f);
#pragma unroll
      for (int e = 0; e < Word32<T>::kElems; ++e) v[i * Word32<T>::kElems + e] += f[e];
    }
  }
  DOORBELL_DEVICE_INLINE void get(uint32_t* w) const {
#pragma unroll
    for (int i = 0; i < W; ++i) w[i] = Word32<T>::narrow(v + i * Word32<T>::kElems);
  }
};

// One element of T as f32 and back (for tails that are not a whole word).
template <typename T>
DOORBELL_DEVICE_INLINE float to_f32(T x) {
  return static_cast<float>(x);
}
template <typename T>
DOORBELL_DEVICE_INLINE T from_f32(float x) {
  return static_cast<T>(x);
}
template <>
DOORBELL_DEVICE_INLINE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
DOORBELL_DEVICE_INLINE __half from_f32<__half>(float x) {
  return __float2half_rn(x);
}

// Eight bf16 values in one 16-byte vector (the MoE kernels' rows), summed in f32:
// `acc += v`, `acc += w * v` (fused), and the eight sums rounded back into one vector.
DOORBELL_DEVICE_INLINE void add_bf16x8(float (&acc)[8], const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

DOORBELL_DEVICE_INLINE void fma_bf16x8(float (&acc)[8], float w, const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    acc[2 * q] = fmaf(w, f.x, acc[2 * q]);
    acc[2 * q + 1] = fmaf(w, f.y, acc[2 * q + 1]);
  }
}

DOORBELL_DEVICE_INLINE int4 to_bf16x8(const float (&acc)[8]) {
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return o;
}

}  // namespace doorbell
#endif  // DOORBELL_CUDA
