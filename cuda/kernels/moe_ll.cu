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
// The per-row and per-chunk work is the device API of cuda/include/doorbell/moe.cuh (moe_ll::put,
// finish_send, combine_chunk), which users call from their own kernels to fuse the exchange.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;

}  // namespace

extern "C" __global__ void moe_ll_begin(MoeLlArgs a) {
  const uint32_t experts = a.experts_per_rank * a.world;
  for (uint32_t e = threadIdx.x; e < experts; e += blockDim.x) a.fill[e] = 0;
  if (threadIdx.x == 0) a.epochs[0] += 1;
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_send(MoeLlArgs a) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t items = a.num_tokens * a.topk;
  for (uint32_t item = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; item < items; item += warps) {
    const uint32_t t = item / a.topk;
    moe_ll::put(a, t, item % a.topk, a.x + uint64_t(t) * a.hidden, lane);
  }
  moe_ll::finish_send(a);
}

// The fused-dispatch path of the tests: the row is made in shared memory by the kernel itself
// (as an expert or attention kernel would have it) and sent with moe_ll::put. Row values follow
// the tests' rule ((rank * 31 + t * 7 + h) % 64 - 32, exact in bf16).
extern "C" __global__ void moe_ll_test_fused_send(MoeLlArgs a) {
  extern __shared__ int4 rows[];
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(rows + uint64_t(warp) * (a.hidden / 8));
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t items = a.num_tokens * a.topk;
  for (uint32_t item = blockIdx.x * (blockDim.x / kWarp) + warp; item < items; item += warps) {
    const uint32_t t = item / a.topk;
    for (uint32_t h = lane; h < a.hidden; h += kWarp) {
      row[h] = __float2bfloat16(float(int((a.rank * 31 + t * 7 + h) % 64) - 32));
    }
    __syncwarp();
    moe_ll::put(a, t, item % a.topk, row, lane);
    __syncwarp();
  }
  moe_ll::finish_send(a);
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
    const uint64_t* word = moe_ll::count_word(a, a.rank, half, le, src);
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
  // A thread per (token, 16 bytes of the row).
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += gridDim.x * blockDim.x) {
    moe_ll::combine_chunk(a, i / chunks, i % chunks);
  }
}
