// doorbell device API, core tier: memory-model leaves.
//
// The only place with inline PTX for loads, stores and atomics that synchronize between GPUs
// (and between GPU and host). Each wrapper names its order and scope: `acquire`/`release`/`relaxed`
// and `sys` (other GPUs, the host, NICs) or `gpu` (this GPU only). Everything above these leaves
// speaks in these names, so a reader can check a protocol without reading PTX.
#pragma once

#include "common.cuh"

#if DOORBELL_CUDA
namespace doorbell {

DOORBELL_DEVICE_INLINE uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

DOORBELL_DEVICE_INLINE uint64_t load_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

DOORBELL_DEVICE_INLINE uint64_t load_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

DOORBELL_DEVICE_INLINE uint32_t load_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

DOORBELL_DEVICE_INLINE uint64_t load_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

DOORBELL_DEVICE_INLINE uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

DOORBELL_DEVICE_INLINE void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

DOORBELL_DEVICE_INLINE void store_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

DOORBELL_DEVICE_INLINE void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Two 64-bit words in one 16-byte store (p 16-byte aligned).
DOORBELL_DEVICE_INLINE void store_relaxed_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

DOORBELL_DEVICE_INLINE void store_release_sys_v2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

// Fire-and-forget remote add that orders this thread's earlier writes before it (release, sys).
DOORBELL_DEVICE_INLINE void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

DOORBELL_DEVICE_INLINE void red_add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Returns the old value; this GPU's threads only (gpu scope), no ordering.
DOORBELL_DEVICE_INLINE uint64_t fetch_add_relaxed_gpu(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.relaxed.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

DOORBELL_DEVICE_INLINE uint32_t cas_relaxed_gpu(uint32_t* p, uint32_t expected, uint32_t desired) {
  uint32_t old;
  asm volatile("atom.relaxed.gpu.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(p), "r"(expected), "r"(desired)
               : "memory");
  return old;
}

// Returns the old value; this GPU's threads only, no ordering.
DOORBELL_DEVICE_INLINE uint64_t cas_relaxed_gpu(uint64_t* p, uint64_t expected, uint64_t desired) {
  uint64_t old;
  asm volatile("atom.relaxed.gpu.global.cas.b64 %0, [%1], %2, %3;"
               : "=l"(old)
               : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old;
}

// Returns the old value; this GPU's threads only, acquire on success or failure.
DOORBELL_DEVICE_INLINE uint64_t cas_acquire_gpu(uint64_t* p, uint64_t expected, uint64_t desired) {
  uint64_t old;
  asm volatile("atom.acquire.gpu.global.cas.b64 %0, [%1], %2, %3;"
               : "=l"(old)
               : "l"(p), "l"(expected), "l"(desired)
               : "memory");
  return old;
}

DOORBELL_DEVICE_INLINE void store_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

DOORBELL_DEVICE_INLINE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Nanoseconds from the GPU's global timer (wall clock, unlike clock64 which follows SM clocks).
DOORBELL_DEVICE_INLINE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Volatile vector accesses for LL packets: one instruction moves data and flag together, so a
// reader that sees the flag sees the data written by the same store.
DOORBELL_DEVICE_INLINE void store_volatile_v4(uint32_t* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

DOORBELL_DEVICE_INLINE void load_volatile_v4(const uint32_t* p, uint32_t& a, uint32_t& b, uint32_t& c, uint32_t& d) {
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
               : "l"(p)
               : "memory");
}

DOORBELL_DEVICE_INLINE void store_volatile_v2(uint32_t* p, uint32_t a, uint32_t b) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

DOORBELL_DEVICE_INLINE void load_volatile_v2(const uint32_t* p, uint32_t& a, uint32_t& b) {
  asm volatile("ld.volatile.global.v2.u32 {%0,%1}, [%2];" : "=r"(a), "=r"(b) : "l"(p) : "memory");
}

}  // namespace doorbell
#endif  // DOORBELL_CUDA
