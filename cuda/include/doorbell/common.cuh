// doorbell device API: common macros and types.
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

}  // namespace doorbell
