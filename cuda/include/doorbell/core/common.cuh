// doorbell device API, core tier: common macros and types.
//
// Every header of the device API can be included from a host-only translation unit (g++,
// clang, or nvcc's host pass): structs are plain data there, and the device functions exist only
// when a CUDA compiler is compiling (__CUDACC__).
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define DOORBELL_CUDA 1
#define DOORBELL_DEVICE_INLINE __forceinline__ __device__
#define DOORBELL_HOST_DEVICE_INLINE __forceinline__ __host__ __device__
#else
#define DOORBELL_CUDA 0
#endif

namespace doorbell {

// Pins a struct's size at compile time on the C++ side; the Rust mirror pins the same numbers.
#define DOORBELL_CHECK_SIZE(T, n) static_assert(sizeof(T) == (n), #T " changed size: update its Rust mirror")

#if DOORBELL_CUDA
// Programmatic dependent launch (sm_90 and later): a kernel the host launched with the
// programmatic-serialization attribute (`gpu::cuda::launch`, `overlap`) may be scheduled while
// the kernel before it in the stream is still finishing, which hides part of the launch. This
// waits until that kernel has completed and its memory is visible: called first, before any
// memory access, the kernel sees plain stream order. It returns at once for a kernel launched
// without the attribute; below sm_90 it is nothing.
DOORBELL_DEVICE_INLINE void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
#endif

}  // namespace doorbell
