// Elementwise work beside the collectives, on one GPU's memory: the maximum or minimum over
// slices that an all-gather put side by side (NCCL's max and min where doorbell runs them, by
// gathering first), and a scaling in place (NCCL's average: the sum times 1 / ranks).
// src/host/collectives/elementwise.rs launches them on the caller's stream. Values are compared and
// scaled in f32; a maximum or minimum returns one of its inputs exactly (bf16 and f16 widen to
// f32 without loss), a NaN input loses to a number as with fmaxf/fminf (NCCL's choice).
#include <doorbell/core/reduce.cuh>

using namespace doorbell;

// dst[i] = max (or min) over s < slices of src[s * count + i].
template <typename T, bool kMax>
__device__ __forceinline__ void reduce_slices_impl(const T* src, uint64_t count, uint32_t slices, T* dst) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    float acc = to_f32(src[i]);
    for (uint32_t s = 1; s < slices; ++s) {
      const float v = to_f32(src[uint64_t(s) * count + i]);
      acc = kMax ? fmaxf(acc, v) : fminf(acc, v);
    }
    dst[i] = from_f32<T>(acc);
  }
}

// x[i] = x[i] * factor, rounded once.
template <typename T>
__device__ __forceinline__ void scale_impl(T* x, uint64_t count, float factor) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += stride)
    x[i] = from_f32<T>(to_f32(x[i]) * factor);
}

#define DOORBELL_ELEMENTWISE(NAME, T)                                                                      \
  extern "C" __global__ void elementwise_max_##NAME(const T* src, uint64_t count, uint32_t slices, T* dst) { \
    reduce_slices_impl<T, true>(src, count, slices, dst);                                                  \
  }                                                                                                        \
  extern "C" __global__ void elementwise_min_##NAME(const T* src, uint64_t count, uint32_t slices, T* dst) { \
    reduce_slices_impl<T, false>(src, count, slices, dst);                                                 \
  }                                                                                                        \
  extern "C" __global__ void elementwise_scale_##NAME(T* x, uint64_t count, float factor) {                \
    scale_impl<T>(x, count, factor);                                                                       \
  }

DOORBELL_ELEMENTWISE(bf16, __nv_bfloat16)
DOORBELL_ELEMENTWISE(f16, __half)
DOORBELL_ELEMENTWISE(f32, float)
