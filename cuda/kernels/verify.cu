// Inputs whose sums are exact, and the verification of results, for the collective tests and the
// benchmarks' --check. Values are small integers derived from (rank, index, seed): a sum over up
// to 8 ranks stays an integer in [-64, 64], exact in bf16, f16 and f32, so any wrong element is
// a real error and the expected value names every contribution. The host twin is
// `collectives::verify::value`.
#include <doorbell/core/atomics.cuh>
#include <doorbell/core/reduce.cuh>

using namespace doorbell;

__device__ __forceinline__ int verify_value(uint32_t rank, uint64_t i, uint32_t seed) {
  return static_cast<int>((i * 7 + rank * 13 + uint64_t(seed) * 5) % 17) - 8;
}

template <typename T>
__device__ __forceinline__ void fill_impl(T* x, uint64_t count, uint32_t rank, uint32_t seed) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += stride)
    x[i] = from_f32<T>(static_cast<float>(verify_value(rank, i, seed)));
}

// Counts elements of y that differ from the sum over `world` ranks.
template <typename T>
__device__ __forceinline__ void count_wrong_impl(const T* y, uint64_t count, uint32_t world, uint32_t seed,
                                                 unsigned long long* wrong) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long mine = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    int sum = 0;
    for (uint32_t r = 0; r < world; ++r) sum += verify_value(r, i, seed);
    mine += to_f32(y[i]) != static_cast<float>(sum);
  }
  if (mine) atomicAdd(wrong, mine);
}

// Pseudo-random values in [-1, 1) (rounding differs with summation order: a race shows up as
// differing hashes).
template <typename T>
__device__ __forceinline__ void fill_random_impl(T* x, uint64_t count, uint32_t rank, uint32_t seed) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t(rank) << 40) ^ (uint64_t(seed) << 20);
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    x[i] = from_f32<T>(static_cast<float>(h >> 40) / static_cast<float>(1ull << 23) - 1.0f);
  }
}

// Order-independent hash of the bytes of x (sum of mixed words), so every rank and every rerun
// can compare results exactly.
template <typename T>
__device__ __forceinline__ void hash_impl(const T* x, uint64_t count, unsigned long long* out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long mine = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < count; i += stride) {
    uint64_t bits = 0;
    memcpy(&bits, &x[i], sizeof(T));
    uint64_t h = (bits + 1) * 0x9E3779B97F4A7C15ull + i * 0xC2B2AE3D27D4EB4Full;
    h ^= h >> 33;
    mine += h;
  }
  atomicAdd(out, mine);
}

#define DOORBELL_CHECK_KERNELS(T, NAME)                                                                          \
  extern "C" __global__ void verify_fill_##NAME(T* x, uint64_t count, uint32_t rank, uint32_t seed) {            \
    fill_impl<T>(x, count, rank, seed);                                                                          \
  }                                                                                                              \
  extern "C" __global__ void verify_count_wrong_##NAME(const T* y, uint64_t count, uint32_t world, uint32_t seed, \
                                                      unsigned long long* wrong) {                               \
    count_wrong_impl<T>(y, count, world, seed, wrong);                                                           \
  }                                                                                                              \
  extern "C" __global__ void verify_fill_random_##NAME(T* x, uint64_t count, uint32_t rank, uint32_t seed) {     \
    fill_random_impl<T>(x, count, rank, seed);                                                                   \
  }                                                                                                              \
  extern "C" __global__ void verify_hash_##NAME(const T* x, uint64_t count, unsigned long long* out) {           \
    hash_impl<T>(x, count, out);                                                                                 \
  }

DOORBELL_CHECK_KERNELS(__nv_bfloat16, bf16)
DOORBELL_CHECK_KERNELS(__half, f16)
DOORBELL_CHECK_KERNELS(float, f32)

// Holds its stream for `ns` nanoseconds of wall clock (the GPU's global timer), so a test or a
// benchmark can make one rank late on purpose.
extern "C" __global__ void verify_delay(uint64_t ns) {
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < ns) __nanosleep(1000);
}

// Writes the GPU's global timer (ns) to `at`: between the calls of a CUDA graph, the benchmarks'
// per-call clock (an event node there costs several microseconds a call; a kernel node about
// half of one).
extern "C" __global__ void verify_stamp(uint64_t* at) { *at = global_timer_ns(); }
