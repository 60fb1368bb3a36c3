// MoE expert dispatch and combine inside a node over NVLink (high-throughput layout: a token goes
// to each destination rank once, however many of that rank's experts it selected).
//
// Dispatch, four kernels on the caller's stream:
//   moe_dispatch_layout (one block per destination rank r): the positions of the tokens bound for
//     r (a block-wide scan) and their count.
//   moe_dispatch_counts (one thread per peer): my counts go into row `me` of every rank's count
//     matrix, and a signal each way with every peer. Receiving a peer's signal also means its
//     results area is free again (the peer's stream has finished everything before this call,
//     the readers of its previous results included).
//   moe_dispatch_send (B blocks): with the whole count matrix known, each sender knows where its
//     rows start in each receiver's results (after the rows of lower ranks); a warp per (token,
//     segment of its row) loads the row once and stores it, with the top-k ids rebased to the
//     receiver's local ids (-1 elsewhere), the weights and (source rank, token), straight into
//     the final place of every rank it goes to; every block then signals every peer once
//     (release: its rows land first). Nothing is copied twice.
//   moe_dispatch_finish (B blocks): waits until every peer's B signals of this call arrived (the
//     monotonic token reaches calls x B; waiting consumes nothing, so every block may wait), then
//     counts rows per local expert.
// Combine pulls: every rank's expert outputs sit in its combine buffer (registered, mapped by every
// peer; the caller's rows are copied in first unless it wrote them there itself), and each source
// rank reads the rows of its own tokens straight from the ranks they went to:
//   moe_combine_free (one thread per peer): a signal each way: the peer has finished reading my
//     combine buffer in its previous combine (its stream reached this one), so I may refill it.
//   moe_combine_copy_in (B blocks, skipped when the caller wrote the buffer): num_recv rows of y.
//   moe_combine_ready (one thread per peer): a signal each way: every buffer is filled.
//   moe_combine_reduce (B blocks): for each token, the rows of the ranks it went to, at (rows of
//     lower source ranks on that rank, from the count matrix) + the token's position there, summed
//     in f32 in rank order into out. No intermediate copy; loads over NVLink.
// Every count lives in device memory and every call consumes what it signals: CUDA-graph
// capturable, replays need no reset.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;
constexpr uint32_t kMaxLocalExperts = 2048;  // MoeDispatcher::new checks experts_per_rank

DOORBELL_DEVICE_INLINE uint32_t* count_matrix(const MoeArgs& a, uint32_t owner) {
  return reinterpret_cast<uint32_t*>(a.land[owner] + a.off_matrix);
}

// Copies `bytes` (a multiple of 16, both ends 16-byte aligned) with one warp.
DOORBELL_DEVICE_INLINE void warp_copy16(void* dst, const void* src, uint64_t bytes, uint32_t lane) {
  int4* d = static_cast<int4*>(dst);
  const int4* s = static_cast<const int4*>(src);
  const uint64_t n = bytes / 16;
  uint64_t i = lane;
  for (; i + 3 * kWarp < n; i += 4 * kWarp) {
    const int4 v0 = s[i], v1 = s[i + kWarp], v2 = s[i + 2 * kWarp], v3 = s[i + 3 * kWarp];
    d[i] = v0;
    d[i + kWarp] = v1;
    d[i + 2 * kWarp] = v2;
    d[i + 3 * kWarp] = v3;
  }
  for (; i < n; i += kWarp) d[i] = s[i];
}

// Waits (bounded) until every peer's `set` token reached calls x blocks: all of this call's
// signals from every peer arrived. Any number of threads may wait; nothing is consumed.
DOORBELL_DEVICE_INLINE void wait_all_peers(const MoeArgs& a, uint32_t set, uint64_t calls) {
  const uint64_t target = calls * a.blocks;
  for (uint32_t r = 0; r < a.world; ++r) {
    if (r == a.rank) continue;
    const SemaphoreHandle& h = a.sems[set * a.world + r];
    spin_until(h.site, kWaitSemaphore, target, [&](uint64_t& seen) {
      seen = load_acquire_sys(h.inbound_token);
      return seen >= target;
    });
  }
}

// The handshake before writing into peers' landing areas (set `free_set`): one thread per peer.
DOORBELL_DEVICE_INLINE void free_handshake(const MoeArgs& a, uint32_t free_set, uint32_t r) {
  if (r == a.rank || r >= a.world) return;
  const SemaphoreHandle& h = a.sems[free_set * a.world + r];
  h.signal();
  h.wait();
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) moe_dispatch_layout(MoeArgs a) {
  const uint32_t r = blockIdx.x;
  const uint32_t tid = threadIdx.x;
  __shared__ uint32_t warp_sums[32];
  __shared__ uint32_t base;
  if (tid == 0) base = 0;
  if (r == a.rank) {
    for (uint32_t e = tid; e < a.experts_per_rank; e += blockDim.x) a.expert_counts[e] = 0;
    if (tid == 0) a.calls[0] += 1;
  }
  __syncthreads();
  const uint32_t lane = tid % kWarp, warp = tid / kWarp, warps = blockDim.x / kWarp;
  for (uint32_t start = 0; start < a.num_tokens; start += blockDim.x) {
    const uint32_t t = start + tid;
    uint32_t flag = 0;
    if (t < a.num_tokens) {
      for (uint32_t k = 0; k < a.topk; ++k) {
        const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
        if (e >= 0 && uint32_t(e) / a.experts_per_rank == r) flag = 1;
      }
    }
    // Block-wide exclusive scan of the flags.
    const uint32_t ballot = __ballot_sync(0xffffffffu, flag);
    const uint32_t in_warp = __popc(ballot & ((1u << lane) - 1));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    uint32_t before = 0, total = 0;
    for (uint32_t w = 0; w < warps; ++w) {
      if (w < warp) before += warp_sums[w];
      total += warp_sums[w];
    }
    if (t < a.num_tokens) a.pos[uint64_t(t) * a.world + r] = flag ? int32_t(base + before + in_warp) : -1;
    __syncthreads();
    if (tid == 0) base += total;
    __syncthreads();
  }
  if (tid == 0) a.send_counts[r] = base;
}

// The call check (call_check.cuh): the counts kernel and the combine's free handshake announce
// the call, the last kernel of each checks every peer made the same one.
DOORBELL_DEVICE_INLINE void check_moe_call(const MoeArgs& a) {
  check_call(a.call, a.rank, a.world, a.sems[checked_peer(a.world) % a.world].site);
}

extern "C" __global__ void moe_dispatch_counts(MoeArgs a) {
  announce_call(a.call, a.rank, a.world);
  const uint32_t r = threadIdx.x;
  if (r >= a.world) return;
  uint32_t* row = count_matrix(a, r) + uint64_t(a.rank) * a.world;
  for (uint32_t q = 0; q < a.world; ++q) row[q] = a.send_counts[q];
  if (r == a.rank) return;
  const SemaphoreHandle& h = a.sems[0 * a.world + r];
  h.signal();
  h.wait();
}

extern "C" __global__ void __launch_bounds__(512) moe_dispatch_send(MoeArgs a) {
  __shared__ uint32_t first[kMaxRanks];  // where my rows start in each rank's results
  if (threadIdx.x < a.world) {
    const uint32_t* m = count_matrix(a, a.rank);
    uint32_t before = 0;
    for (uint32_t s = 0; s < a.rank; ++s) before += m[uint64_t(s) * a.world + threadIdx.x];
    first[threadIdx.x] = before;
  }
  __syncthreads();
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  // bf16 rows are 2 x hidden bytes; FP8 rows hidden bytes plus hidden / 128 scales.
  const bool fp8 = a.scales != nullptr;
  const uint32_t chunks = fp8 ? a.hidden / 16 : a.hidden / 8;
  const uint32_t n_scales = a.hidden / 128;
  // Work items are (token, segment of its row): with few tokens (decode) the rows are split so
  // every warp has work; with many, one segment per token.
  uint32_t segs = a.num_tokens ? (warps + a.num_tokens - 1) / a.num_tokens : 1;
  const uint32_t max_segs = chunks / kWarp > 0 ? chunks / kWarp : 1;
  segs = segs < 1 ? 1 : (segs > max_segs ? max_segs : segs);
  const uint32_t items = a.num_tokens * segs;
  for (uint32_t item = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; item < items; item += warps) {
    const uint32_t t = item / segs, seg = item % segs;
    int4* dst[kMaxRanks];
    uint64_t row[kMaxRanks];
    uint32_t n = 0;
    for (uint32_t r = 0; r < a.world; ++r) {
      const int32_t p = a.pos[uint64_t(t) * a.world + r];
      if (p < 0) continue;
      row[n] = (uint64_t(r) << 40) | (first[r] + uint32_t(p));
      dst[n] = reinterpret_cast<int4*>(a.land[r]) + (first[r] + uint64_t(p)) * chunks;
      ++n;
    }
    if (n == 0) continue;
    // The row is read once and stored to every rank it goes to.
    const int4* src = reinterpret_cast<const int4*>(a.x) + uint64_t(t) * chunks;
    const uint32_t end = uint32_t(uint64_t(chunks) * (seg + 1) / segs);
    uint32_t c = uint32_t(uint64_t(chunks) * seg / segs) + lane;
    for (; c + 3 * kWarp < end; c += 4 * kWarp) {  // four loads in flight before the stores
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = src[c + u * kWarp];
      for (uint32_t d = 0; d < n; ++d) {
#pragma unroll
        for (int u = 0; u < 4; ++u) dst[d][c + u * kWarp] = v[u];
      }
    }
    for (; c < end; c += kWarp) {
      const int4 v = src[c];
      for (uint32_t d = 0; d < n; ++d) dst[d][c] = v;
    }
    if (seg != 0) continue;
    for (uint32_t d = 0; d < n; ++d) {
      const uint32_t r = uint32_t(row[d] >> 40);
      const uint64_t j = row[d] & ((uint64_t(1) << 40) - 1);
      if (fp8) {
        float* scales = reinterpret_cast<float*>(a.land[r] + a.off_scales) + j * n_scales;
        for (uint32_t q = lane; q < n_scales; q += kWarp) scales[q] = a.scales[uint64_t(t) * n_scales + q];
      }
      int32_t* ids = reinterpret_cast<int32_t*>(a.land[r] + a.off_idx) + j * a.topk;
      float* weights = reinterpret_cast<float*>(a.land[r] + a.off_weights) + j * a.topk;
      for (uint32_t k = lane; k < a.topk; k += kWarp) {
        const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
        const bool here = e >= 0 && uint32_t(e) / a.experts_per_rank == r;
        ids[k] = here ? int32_t(uint32_t(e) % a.experts_per_rank) : -1;
        weights[k] = a.topk_weights[uint64_t(t) * a.topk + k];
      }
      if (lane == 0) {
        int32_t* src_info = reinterpret_cast<int32_t*>(a.land[r] + a.off_src) + 2 * j;
        src_info[0] = int32_t(a.rank);
        src_info[1] = int32_t(t);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[1 * a.world + threadIdx.x].signal();
}

extern "C" __global__ void __launch_bounds__(512) moe_dispatch_finish(MoeArgs a) {
  __shared__ uint32_t total;
  if (threadIdx.x == 0) {
    wait_all_peers(a, 1, a.calls[0]);
    const uint32_t* m = count_matrix(a, a.rank);
    uint32_t n = 0;
    for (uint32_t s = 0; s < a.world; ++s) n += m[uint64_t(s) * a.world + a.rank];
    total = n;
    if (blockIdx.x == 0) *a.num_recv = n;
  }
  // Per-block histograms in shared memory, then one global add per expert and block: the same
  // few counters hit by every thread would serialize on global atomics.
  __shared__ uint32_t hist[kMaxLocalExperts];
  for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int32_t* ids = reinterpret_cast<const int32_t*>(a.land[a.rank] + a.off_idx);
  const uint64_t n = uint64_t(total) * a.topk;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    if (e >= 0) atomicAdd(&hist[e], 1u);
  }
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) {
    if (hist[e]) atomicAdd(&a.expert_counts[e], hist[e]);
  }
  check_moe_call(a);
}

extern "C" __global__ void moe_combine_free(MoeArgs a) {
  announce_call(a.call, a.rank, a.world);
  if (threadIdx.x == 0) a.calls[1] += 1;
  free_handshake(a, 2, threadIdx.x);
}

extern "C" __global__ void __launch_bounds__(512) moe_combine_copy_in(MoeArgs a) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t total = *a.num_recv;
  uint16_t* mine = reinterpret_cast<uint16_t*>(a.comb_buf[a.rank]);
  for (uint32_t j = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; j < total; j += warps) {
    warp_copy16(mine + uint64_t(j) * a.hidden, a.y + uint64_t(j) * a.hidden, uint64_t(a.hidden) * 2, lane);
  }
}

extern "C" __global__ void moe_combine_ready(MoeArgs a) { free_handshake(a, 3, threadIdx.x); }

extern "C" __global__ void __launch_bounds__(512) moe_combine_reduce(MoeArgs a) {
  __shared__ uint32_t first[kMaxRanks];  // where my tokens' rows start on each rank
  if (threadIdx.x < a.world) {
    const uint32_t* m = count_matrix(a, a.rank);
    uint32_t before = 0;
    for (uint32_t s = 0; s < a.rank; ++s) before += m[uint64_t(s) * a.world + threadIdx.x];
    first[threadIdx.x] = before;
  }
  __syncthreads();
  // A thread per (token, 16 bytes of its row): every rank the token went to adds its eight bf16
  // values, in rank order, in f32; all of a thread's loads are in flight before the sums, and
  // there are enough threads for a decode batch's few tokens as for prefill's many.
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;  // < 2^32, checked by the host
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += gridDim.x * blockDim.x) {
    const uint32_t t = i / chunks, c = i % chunks;
    int4 v[kMaxRanks];
    uint32_t n = 0;
    for (uint32_t r = 0; r < a.world; ++r) {
      const int32_t p = a.pos[uint64_t(t) * a.world + r];
      if (p >= 0) v[n++] = reinterpret_cast<const int4*>(a.comb_buf[r])[(first[r] + uint64_t(p)) * chunks + c];
    }
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t d = 0; d < n; ++d) {
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[d]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(h[q]);
        acc[2 * q] += f.x;
        acc[2 * q + 1] += f.y;
      }
    }
    int4 o;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    reinterpret_cast<int4*>(a.out)[uint64_t(t) * chunks + c] = o;
  }
  check_moe_call(a);
}
