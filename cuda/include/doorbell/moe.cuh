// doorbell device API: the low-latency MoE exchange as calls for your own kernels, so an expert
// or attention kernel can send its rows the moment it has them (fused dispatch) and reduce the
// combine inside its epilogue. The host side (`MoeLowLatency` in Rust) prepares each call and
// hands out the `MoeLlArgs` these take; `cuda/kernels/moe_ll.cu` is built from the same calls.
//
// Fused dispatch, per call:
//   host: args = begin_fused_send(stream, topk_idx, num_tokens)   (epoch + 1, counters zeroed)
//   your kernel, any grid: for each selection (t, k) you own, one warp calls
//       moe_ll::put(args, t, k, row, lane)     // row: hidden bf16, 16-byte aligned, any memory
//     and every block calls moe_ll::finish_send(args) once after its puts (all its threads).
//   host: dispatch_recv(stream)
// Fused combine: after combine_send and once every peer's buffer is ready (the receive half
// waits for that), moe_ll::combine_chunk(args, t, c) writes 16 bytes of token t's output.
#pragma once

#include "collective_args.cuh"

#if DOORBELL_CUDA
#include <cuda_bf16.h>

namespace doorbell {
namespace moe_ll {

// Row `i` of local expert `le` from `src` in half `half` of a receive area.
DOORBELL_DEVICE_INLINE uint64_t row_index(const MoeLlArgs& a, uint32_t half, uint32_t le, uint32_t src, uint32_t i) {
  return ((uint64_t(half) * a.experts_per_rank + le) * a.world + src) * a.max_tokens + i;
}

// The count word `owner` holds for (half, local expert, source).
DOORBELL_DEVICE_INLINE uint64_t* count_word(const MoeLlArgs& a, uint32_t owner, uint32_t half, uint32_t le,
                                            uint32_t src) {
  return reinterpret_cast<uint64_t*>(a.area[owner] + a.off_counts) +
         (uint64_t(half) * a.experts_per_rank + le) * a.world + src;
}

// Sends selection k of token t, whose row (hidden bf16, 16-byte aligned) is at `row`: one warp,
// every lane calling with its lane id. Reserves the next row of that expert from this rank,
// writes the row and the source token into the owner's receive area, remembers the row for the
// combine. A -1 selection only records that.
DOORBELL_DEVICE_INLINE void put(const MoeLlArgs& a, uint32_t t, uint32_t k, const void* row, uint32_t lane) {
  const uint64_t epoch = a.epochs[0];
  const uint32_t item = t * a.topk + k;
  const int32_t e = a.topk_idx[item];
  if (e < 0) {
    if (lane == 0) a.slots[item] = -1;
    return;
  }
  const uint32_t r = uint32_t(e) / a.experts_per_rank, le = uint32_t(e) % a.experts_per_rank;
  uint32_t i = 0;
  if (lane == 0) i = atomicAdd(&a.fill[e], 1u);
  i = __shfl_sync(0xffffffffu, i, 0);
  const uint64_t at = row_index(a, uint32_t(epoch & 1), le, a.rank, i);
  int4* d = reinterpret_cast<int4*>(a.area[r]) + at * (a.hidden / 8);
  const int4* s = static_cast<const int4*>(row);
  for (uint32_t c = lane; c < a.hidden / 8; c += 32) d[c] = s[c];
  if (lane == 0) {
    reinterpret_cast<int32_t*>(a.area[r] + a.off_src)[at] = int32_t(t);
    a.slots[item] = int32_t(i);
  }
}

// Every block of the sending grid calls this once, with all its threads, after its puts. The
// last block to arrive publishes every expert's count (`epoch << 32 | rows`) with a release
// store into its owner's count word, after a system fence in every block: a receiver that sees
// the count sees the rows.
DOORBELL_DEVICE_INLINE void finish_send(const MoeLlArgs& a) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(a.done, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  const uint64_t epoch = a.epochs[0];
  const uint32_t experts = a.experts_per_rank * a.world;
  for (uint32_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const uint32_t r = e / a.experts_per_rank, le = e % a.experts_per_rank;
    const uint32_t n = *reinterpret_cast<volatile uint32_t*>(&a.fill[e]);
    store_release_sys(count_word(a, r, uint32_t(epoch & 1), le, a.rank), (epoch << 32) | n);
  }
  if (threadIdx.x == 0) *a.done = 0;
}

// Combine: 16 bytes (eight values, chunk c) of token t's output: the sum over its selections of
// weight x the expert's output row, in f32, in top-k order. Every peer's combine buffer must be
// ready (see the receive half).
DOORBELL_DEVICE_INLINE void combine_chunk(const MoeLlArgs& a, uint32_t t, uint32_t c) {
  const uint32_t chunks = a.hidden / 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint32_t k = 0; k < a.topk; ++k) {
    const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
    const int32_t slot = a.slots[uint64_t(t) * a.topk + k];
    if (e < 0 || slot < 0) continue;
    const uint32_t r = uint32_t(e) / a.experts_per_rank, le = uint32_t(e) % a.experts_per_rank;
    const uint64_t row = (uint64_t(le) * a.world + a.rank) * a.max_tokens + uint32_t(slot);
    const int4 v = reinterpret_cast<const int4*>(a.comb[r])[row * chunks + c];
    const float w = a.topk_weights[uint64_t(t) * a.topk + k];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(h[q]);
      acc[2 * q] += w * f.x;
      acc[2 * q + 1] += w * f.y;
    }
  }
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  reinterpret_cast<int4*>(a.out)[uint64_t(t) * chunks + c] = o;
}

}  // namespace moe_ll
}  // namespace doorbell
#endif  // DOORBELL_CUDA
