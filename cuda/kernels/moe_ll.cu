// MoE dispatch and combine for decode (low latency), DeepEP's low-latency semantics: fixed
// worst-case buffers sized from max tokens per rank, a per-expert layout (one row per selected
// (token, expert)), counts only on the device, no count exchange before rows move, CUDA-graph
// capturable, and send and receive halves that can be called separately so other work overlaps
// the transfer. Over NVLink a row crosses once per destination rank (see moe.cuh).
//
// Layout on every rank: [2 halves][local expert][source rank][max_tokens] rows (collective_args.cuh
// lists the sections). The half is the parity of the dispatch epoch, so a dispatch never
// overwrites rows the previous one delivered (two results may be alive at once, as with DeepEP).
//
// dispatch send (moe_ll_send, one kernel): a warp per (token, destination rank) reserves a slot
// of each selected expert there (an atomic on my own counter), writes the row once and the
// selections' metadata (moe_ll::put). The last block to finish (a counter after a system fence in
// every block) publishes, for every expert, `epoch << 32 | rows` into the owner's count word after
// a system fence (no semaphores; the epoch tells a fresh count from last call's), zeroes the
// counters and stores the epoch.
// dispatch receive (moe_ll_recv): every block waits (bounded) for every count word of this epoch,
// then copies each carried row into the slots of the pair's other selections; block 0 writes the
// rows per (expert, source) and per expert. moe_ll_dispatch does both halves in one kernel.
// combine send (moe_ll_combine_send): a warp per carrier row sends its pair's weighted partial sum
// to the token's rank (moe_ll::send_partial); the last block signals every peer.
// combine receive (moe_ll_combine_recv): waits for every peer's signal of this call, then adds
// each token's partial sums (moe_ll::combine_chunk). moe_ll_combine does both in one kernel.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;
constexpr uint32_t kMaxPairs = 8192;  // local experts x ranks (1024 x 8), checked on the host

// The largest of `n[0..count)`, computed by the whole block.
__device__ uint32_t block_max(const uint32_t* n, uint32_t count) {
  __shared__ uint32_t best;
  if (threadIdx.x == 0) best = 0;
  __syncthreads();
  uint32_t m = 0;
  for (uint32_t q = threadIdx.x; q < count; q += blockDim.x) m = max(m, n[q]);
  atomicMax(&best, m);
  __syncthreads();
  return best;
}

// The send half: a warp per (token, destination rank). Neighbouring warps take one token to
// different ranks, so its row is read from L2 once.
__device__ void dispatch_send(const MoeLlArgs& a) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t items = a.num_tokens * a.world;
  for (uint32_t item = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; item < items; item += warps) {
    const uint32_t t = item / a.world;
    moe_ll::put(a, t, item % a.world, a.x + uint64_t(t) * a.hidden, lane);
  }
  moe_ll::finish_send(a);
}

// The receive half of dispatch `epoch`: every block waits for every count word, block 0 writes
// the counts, and all copy carried rows into the other selections' slots. Positions run
// slot-major (slot i of every pair, then i + 1) so the few filled slots of each pair spread over
// all warps.
__device__ void dispatch_recv(const MoeLlArgs& a, uint64_t epoch) {
  __shared__ uint32_t rows_of[kMaxPairs];
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t pairs = a.experts_per_rank * a.world;
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) {
    const uint32_t le = q / a.world, src = q % a.world;
    const uint64_t* word = moe_ll::count_word(a, a.rank, half, le, src);
    uint64_t got = 0;
    spin_until(moe_ll::site(a, src), kWaitPacket, epoch, [&](uint64_t& seen) {
      got = load_acquire_sys(word);
      seen = got >> 32;
      return seen == epoch;
    });
    rows_of[q] = uint32_t(got);
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) a.layout[q] = rows_of[q];
    for (uint32_t le = threadIdx.x; le < a.experts_per_rank; le += blockDim.x) {
      uint32_t n = 0;
      for (uint32_t src = 0; src < a.world; ++src) n += rows_of[le * a.world + src];
      a.recv_count[le] = n;
    }
  }
  const uint32_t deepest = block_max(rows_of, pairs);
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t positions = uint64_t(deepest) * pairs;
  const int32_t* from = moe_ll::section<int32_t>(a, a.rank, a.off_from);
  int4* rows = reinterpret_cast<int4*>(a.area[a.rank]);
  const uint32_t words = a.hidden / 8;
  for (uint64_t p = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; p < positions; p += warps) {
    const uint32_t i = uint32_t(p / pairs), q = uint32_t(p % pairs);
    if (i >= rows_of[q]) continue;
    const uint64_t at = moe_ll::row_index(a, half, q / a.world, q % a.world, i);
    const int32_t f = from[at];
    if (f >= 0) copy_words<int4, 8>(rows + at * words, rows + uint64_t(f) * words, words, lane, kWarp);
  }
}

// The combine's send half: a warp per carrier row of the last dispatch sends its pair's partial
// sum; the last block to finish signals every peer and stores `call` as the combine count.
// `layout` must have been written by a kernel before this one.
__device__ void combine_send(const MoeLlArgs& a, uint64_t call) {
  __shared__ bool last;
  const uint32_t half = uint32_t(a.epochs[0] & 1);
  const uint32_t pairs = a.experts_per_rank * a.world;
  const uint32_t deepest = block_max(a.layout, pairs);
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t positions = uint64_t(deepest) * pairs;
  const int32_t* from = moe_ll::section<int32_t>(a, a.rank, a.off_from);
  for (uint64_t p = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; p < positions; p += warps) {
    const uint32_t i = uint32_t(p / pairs), q = uint32_t(p % pairs);
    if (i >= a.layout[q]) continue;
    const uint64_t at = moe_ll::row_index(a, half, q / a.world, q % a.world, i);
    if (from[at] < 0) moe_ll::send_partial(a, at, lane);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&a.done[1], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.ready[threadIdx.x].signal();
  if (threadIdx.x == 0) {
    a.epochs[1] = call;
    a.done[1] = 0;
  }
}

// The combine's receive half: waits until every peer signalled combine `call`, then a thread per
// (token, 16 bytes of the row) adds the partial sums.
__device__ void combine_recv(const MoeLlArgs& a, uint64_t call) {
  if (threadIdx.x < a.world && threadIdx.x != a.rank) {
    const SemaphoreHandle& h = a.ready[threadIdx.x];
    spin_until(h.site, kWaitSemaphore, call, [&](uint64_t& seen) {
      seen = load_acquire_sys(h.inbound_token);
      return seen >= call;
    });
  }
  __syncthreads();
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += gridDim.x * blockDim.x) {
    moe_ll::combine_chunk(a, i / chunks, i % chunks);
  }
}

}  // namespace

// Each half alone, and both in one kernel (one launch and one kernel boundary less). The fused
// kernels spin on peers after their own send: their grids are at most one block per SM, all
// resident at once. Epochs are read at kernel start, before the last block stores the new ones.
extern "C" __global__ void __launch_bounds__(512) moe_ll_send(MoeLlArgs a) { dispatch_send(a); }

extern "C" __global__ void __launch_bounds__(512) moe_ll_recv(MoeLlArgs a) { dispatch_recv(a, a.epochs[0]); }

extern "C" __global__ void __launch_bounds__(512) moe_ll_dispatch(MoeLlArgs a) {
  const uint64_t epoch = moe_ll::send_epoch(a);
  dispatch_send(a);
  dispatch_recv(a, epoch);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine_send(MoeLlArgs a) { combine_send(a, a.epochs[1] + 1); }

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine_recv(MoeLlArgs a) { combine_recv(a, a.epochs[1]); }

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine(MoeLlArgs a) {
  const uint64_t call = a.epochs[1] + 1;
  combine_send(a, call);
  combine_recv(a, call);
}


// The fused-dispatch path of the tests: the row is made in shared memory by the kernel itself
// (as an expert or attention kernel would have it) and sent with moe_ll::put_token. Row values
// follow the tests' rule ((rank * 31 + t * 7 + h) % 64 - 32, exact in bf16).
extern "C" __global__ void moe_ll_test_fused_send(MoeLlArgs a) {
  extern __shared__ int4 rows[];
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(rows + uint64_t(warp) * (a.hidden / 8));
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + warp; t < a.num_tokens; t += warps) {
    for (uint32_t h = lane; h < a.hidden; h += kWarp) {
      row[h] = __float2bfloat16(float(int((a.rank * 31 + t * 7 + h) % 64) - 32));
    }
    __syncwarp();
    moe_ll::put_token(a, t, row, lane);
    __syncwarp();
  }
  moe_ll::finish_send(a);
}

