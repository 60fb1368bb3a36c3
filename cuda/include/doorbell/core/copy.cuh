// doorbell device API, core tier: cooperative copies.
//
// `copy` moves any number of bytes between any two addresses (local or a peer's, over NVLink)
// with `nthreads` cooperating threads, each calling it with its own `tid` in [0, nthreads). The
// widest access both addresses allow is used (16 bytes when their misalignment is the same modulo
// 16); the bytes before the first aligned word and after the last are copied one by one, so
// nothing is lost at either end.
#pragma once

#include "common.cuh"

#if DOORBELL_CUDA
namespace doorbell {

// kUnroll independent loads in flight per thread before their stores: NVLink stores are posted,
// so throughput is set by how many loads each thread keeps outstanding.
template <typename Word, uint32_t kUnroll = 4>
DOORBELL_DEVICE_INLINE void copy_words(Word* dst, const Word* src, uint64_t n, uint32_t tid, uint32_t nthreads) {
  uint64_t i = tid;
  const uint64_t stride = nthreads;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    Word v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// copy_words for short spans: every lane issues up to kUnroll loads (guarded, so no serial
// tail) before its stores, whatever n is.
template <typename Word, uint32_t kUnroll>
DOORBELL_DEVICE_INLINE void copy_words_batched(Word* dst, const Word* src, uint64_t n, uint32_t tid,
                                               uint32_t nthreads) {
  for (uint64_t base = 0; base < n; base += uint64_t(kUnroll) * nthreads) {
    Word v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + tid + u * nthreads;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint64_t i = base + tid + u * nthreads;
      if (i < n) dst[i] = v[u];
    }
  }
}

template <typename Word>
DOORBELL_DEVICE_INLINE void copy_aligned_as(char* dst, const char* src, uint64_t bytes, uint32_t tid,
                                            uint32_t nthreads) {
  constexpr uint64_t W = sizeof(Word);
  uint64_t head = (W - (reinterpret_cast<uintptr_t>(dst) & (W - 1))) & (W - 1);
  if (head > bytes) head = bytes;
  const uint64_t words = (bytes - head) / W;
  const uint64_t tail_start = head + words * W;
  for (uint64_t i = tid; i < head; i += nthreads) dst[i] = src[i];
  copy_words(reinterpret_cast<Word*>(dst + head), reinterpret_cast<const Word*>(src + head), words, tid, nthreads);
  for (uint64_t i = tail_start + tid; i < bytes; i += nthreads) dst[i] = src[i];
}

DOORBELL_DEVICE_INLINE void copy(void* dst, const void* src, uint64_t bytes, uint32_t tid, uint32_t nthreads) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const uintptr_t skew = (reinterpret_cast<uintptr_t>(d) ^ reinterpret_cast<uintptr_t>(s)) & 15;
  if (skew == 0) {
    copy_aligned_as<int4>(d, s, bytes, tid, nthreads);
  } else if ((skew & 7) == 0) {
    copy_aligned_as<uint2>(d, s, bytes, tid, nthreads);
  } else if ((skew & 3) == 0) {
    copy_aligned_as<uint32_t>(d, s, bytes, tid, nthreads);
  } else if ((skew & 1) == 0) {
    copy_aligned_as<uint16_t>(d, s, bytes, tid, nthreads);
  } else {
    for (uint64_t i = tid; i < bytes; i += nthreads) d[i] = s[i];
  }
}

// What an output cut short by a fault holds instead of stale bytes: all ones, a NaN in f32, f16
// and bf16 alike (packet.cuh's kMissingPayload on the packet paths), so it cannot pass for a
// result. Out of line: only the failure path calls it, and the kernels' bodies stay as compact.
static __noinline__ __device__ void mark_missing(void* dst, uint64_t bytes, uint32_t tid, uint32_t nthreads) {
  char* d = static_cast<char*>(dst);
  uint64_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
  if (head > bytes) head = bytes;
  const uint64_t vecs = (bytes - head) / 16;
  for (uint64_t i = tid; i < head; i += nthreads) d[i] = char(0xff);
  int4* v = reinterpret_cast<int4*>(d + head);
  for (uint64_t i = tid; i < vecs; i += nthreads) v[i] = make_int4(-1, -1, -1, -1);
  for (uint64_t i = head + vecs * 16 + tid; i < bytes; i += nthreads) d[i] = char(0xff);
}

}  // namespace doorbell
#endif  // DOORBELL_CUDA
