// MoE dispatch and combine for decode (low latency), DeepEP's low-latency semantics: fixed
// worst-case buffers sized from max tokens per rank, a per-expert layout (one row per selected
// (token, expert), no deduplication), counts only on the device, no count exchange before rows
// move, CUDA-graph capturable, and send and receive halves that can be called separately so other
// work overlaps the transfer.
//
// Layout on every rank: [2 halves][local expert][source rank][max_tokens] rows. The half is the
// parity of the dispatch epoch, so a dispatch never overwrites rows the previous one delivered
// (two results may be alive at once, as with DeepEP).
//
// dispatch send (moe_ll_begin + moe_ll_send): the epoch goes up by one and the per-expert fill
// counters are zeroed; a warp per (token, k) takes the next row of that expert from my source
// block (an atomic on my own counter), writes the row into the owner's half, and remembers the
// row for the combine. The last block to finish (a counter after a system fence in every block)
// publishes, for every expert, `epoch << 32 | rows` into the owner's count word with a release
// store: no semaphores, and the epoch tells a fresh count from last call's.
// dispatch receive (moe_ll_recv): one thread per (local expert, source) waits (bounded) for the
// count word of this epoch; rows per (expert, source) and per expert land in device memory.
// combine send (moe_ll_ready): every rank tells every peer its combine buffer (expert outputs in
// the receive layout, written there by the expert kernels) is filled.
// combine receive (moe_ll_combine): waits for every peer's signal of this call, then for each
// token sums w[t, k] x y[expert k][me][its row] over k in f32, reading the rows where they are.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;

DOORBELL_DEVICE_INLINE uint64_t ll_row(const MoeLlArgs& a, uint32_t half, uint32_t le, uint32_t src, uint32_t i) {
  return ((uint64_t(half) * a.experts_per_rank + le) * a.world + src) * a.max_tokens + i;
}

DOORBELL_DEVICE_INLINE uint64_t* ll_count(const MoeLlArgs& a, uint32_t owner, uint32_t half, uint32_t le,
                                          uint32_t src) {
  return reinterpret_cast<uint64_t*>(a.area[owner] + a.off_counts) +
         (uint64_t(half) * a.experts_per_rank + le) * a.world + src;
}

}  // namespace

extern "C" __global__ void moe_ll_begin(MoeLlArgs a) {
  const uint32_t experts = a.experts_per_rank * a.world;
  for (uint32_t e = threadIdx.x; e < experts; e += blockDim.x) a.fill[e] = 0;
  if (threadIdx.x == 0) a.epochs[0] += 1;
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_send(MoeLlArgs a) {
  const uint64_t epoch = a.epochs[0];
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t bytes = uint64_t(a.hidden) * 2;
  const uint32_t items = a.num_tokens * a.topk;
  for (uint32_t item = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; item < items; item += warps) {
    const uint32_t t = item / a.topk;
    const int32_t e = a.topk_idx[item];
    if (e < 0) {
      if (lane == 0) a.slots[item] = -1;
      continue;
    }
    const uint32_t r = uint32_t(e) / a.experts_per_rank, le = uint32_t(e) % a.experts_per_rank;
    uint32_t i = 0;
    if (lane == 0) i = atomicAdd(&a.fill[e], 1u);
    i = __shfl_sync(0xffffffffu, i, 0);
    const uint64_t row = ll_row(a, half, le, a.rank, i);
    uint16_t* dst = reinterpret_cast<uint16_t*>(a.area[r]) + row * a.hidden;
    const int4* s = reinterpret_cast<const int4*>(a.x + uint64_t(t) * a.hidden);
    int4* d = reinterpret_cast<int4*>(dst);
    for (uint64_t c = lane; c < bytes / 16; c += kWarp) d[c] = s[c];
    if (lane == 0) {
      reinterpret_cast<int32_t*>(a.area[r] + a.off_src)[row] = int32_t(t);
      a.slots[item] = int32_t(i);
    }
  }
  // The last block to finish publishes every expert's count (all rows of all blocks land first).
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(a.done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  const uint32_t experts = a.experts_per_rank * a.world;
  for (uint32_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const uint32_t r = e / a.experts_per_rank, le = e % a.experts_per_rank;
    const uint32_t n = *reinterpret_cast<volatile uint32_t*>(&a.fill[e]);
    store_release_sys(ll_count(a, r, half, le, a.rank), (epoch << 32) | n);
  }
  if (threadIdx.x == 0) *a.done = 0;
}

extern "C" __global__ void moe_ll_recv(MoeLlArgs a) {
  __shared__ uint32_t per_expert[1024];
  const uint64_t epoch = a.epochs[0];
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t pairs = a.experts_per_rank * a.world;
  for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) per_expert[e] = 0;
  __syncthreads();
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) {
    const uint32_t le = q / a.world, src = q % a.world;
    const uint64_t* word = ll_count(a, a.rank, half, le, src);
    const SemaphoreHandle& h = a.ready[src == a.rank ? (a.rank + 1) % a.world : src];
    uint64_t got = 0;
    spin_until(h.site, kWaitPacket, epoch, [&](uint64_t& seen) {
      got = load_acquire_sys(word);
      seen = got >> 32;
      return seen == epoch;
    });
    const uint32_t n = uint32_t(got);
    a.layout[q] = n;
    atomicAdd(&per_expert[le], n);
  }
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) a.recv_count[e] = per_expert[e];
}

extern "C" __global__ void moe_ll_ready(MoeLlArgs a) {
  if (threadIdx.x == 0) a.epochs[1] += 1;
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.ready[threadIdx.x].signal();
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine(MoeLlArgs a) {
  if (threadIdx.x < a.world && threadIdx.x != a.rank) {
    const SemaphoreHandle& h = a.ready[threadIdx.x];
    const uint64_t target = a.epochs[1];
    spin_until(h.site, kWaitSemaphore, target, [&](uint64_t& seen) {
      seen = load_acquire_sys(h.inbound_token);
      return seen >= target;
    });
  }
  __syncthreads();
  // A thread per (token, 16 bytes of the row): sum over k of w x y[row of (t, k)], in f32.
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += gridDim.x * blockDim.x) {
    const uint32_t t = i / chunks, c = i % chunks;
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
}
