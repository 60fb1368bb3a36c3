// MoE expert dispatch and combine inside a node over NVLink (high-throughput layout: a token goes
// to each destination rank once, however many of that rank's experts it selected).
//
// Dispatch, four kernels on the caller's stream:
//   moe_dispatch_layout (one block per destination rank r): positions of the tokens bound for r
//     (a block-wide scan) and their count.
//   moe_dispatch_counts (one thread per peer): my counts for every rank go into row `me` of every
//     rank's count matrix, then a signal each way with every peer. Receiving a peer's signal also
//     means its landing area is free again (the peer's stream has finished everything before this
//     call, the readers of its previous results included).
//   moe_dispatch_send (B blocks): with the whole count matrix known, each sender knows where its
//     rows start in each receiver's results (after the rows of lower ranks); a warp per token
//     loads the row once and stores it, with the top-k ids rebased to the receiver's local ids
//     (-1 elsewhere), the weights and (source rank, token), straight into the final place of every
//     rank it goes to; every block then signals every peer once (release: its rows land first).
//   moe_dispatch_finish (B blocks): waits until every peer's B signals of this call arrived (the
//     monotonic token reaches calls x B; waiting does not consume, so all blocks may wait), then
//     counts rows per local expert. Nothing is copied twice.
// Combine, three kernels: moe_combine_prepare (the same handshake for the combine landing areas),
// moe_combine_send (a warp per received row writes y[row] to its source rank's area at
// [me][source token]; blocks signal), moe_combine_reduce (waits like dispatch_recv, then each
// token's rows from the ranks it went to are summed in f32, in rank order, into out).
// Every count lives in device memory and every call consumes what it signals: CUDA-graph
// capturable, replays need no reset.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;

DOORBELL_DEVICE_INLINE uint32_t* count_matrix(const MoeArgs& a, uint32_t owner) {
  return reinterpret_cast<uint32_t*>(a.land[owner] + a.off_matrix);
}

DOORBELL_DEVICE_INLINE uint16_t* combine_row(const MoeArgs& a, uint32_t owner, uint32_t source, uint32_t token) {
  return reinterpret_cast<uint16_t*>(a.comb_buf[owner]) + (uint64_t(source) * a.max_tokens + token) * a.hidden;
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

extern "C" __global__ void moe_dispatch_counts(MoeArgs a) {
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
  const uint64_t chunks = uint64_t(a.hidden) / 8;
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < a.num_tokens; t += warps) {
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
    uint64_t c = lane;
    for (; c + 3 * kWarp < chunks; c += 4 * kWarp) {  // four loads in flight before the stores
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = src[c + u * kWarp];
      for (uint32_t d = 0; d < n; ++d) {
#pragma unroll
        for (int u = 0; u < 4; ++u) dst[d][c + u * kWarp] = v[u];
      }
    }
    for (; c < chunks; c += kWarp) {
      const int4 v = src[c];
      for (uint32_t d = 0; d < n; ++d) dst[d][c] = v;
    }
    for (uint32_t d = 0; d < n; ++d) {
      const uint32_t r = uint32_t(row[d] >> 40);
      const uint64_t j = row[d] & ((uint64_t(1) << 40) - 1);
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
  __syncthreads();
  const int32_t* ids = reinterpret_cast<const int32_t*>(a.land[a.rank] + a.off_idx);
  const uint64_t n = uint64_t(total) * a.topk;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    if (e >= 0) atomicAdd(&a.expert_counts[e], 1u);
  }
}

extern "C" __global__ void moe_combine_prepare(MoeArgs a) {
  if (threadIdx.x == 0) a.calls[1] += 1;
  free_handshake(a, 2, threadIdx.x);
}

extern "C" __global__ void __launch_bounds__(512) moe_combine_send(MoeArgs a) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t total = *a.num_recv;
  const int32_t* recv_src = reinterpret_cast<const int32_t*>(a.land[a.rank] + a.off_src);
  for (uint32_t j = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; j < total; j += warps) {
    const uint32_t s = uint32_t(recv_src[2 * uint64_t(j)]);
    const uint32_t t = uint32_t(recv_src[2 * uint64_t(j) + 1]);
    warp_copy16(combine_row(a, s, a.rank, t), a.y + uint64_t(j) * a.hidden, uint64_t(a.hidden) * 2, lane);
  }
  __syncthreads();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[3 * a.world + threadIdx.x].signal();
}

extern "C" __global__ void __launch_bounds__(512) moe_combine_reduce(MoeArgs a) {
  if (threadIdx.x == 0) wait_all_peers(a, 3, a.calls[1]);
  __syncthreads();
  // Eight bf16 values (16 bytes) per step; every rank the token went to adds its row, in rank
  // order, in f32.
  const uint64_t chunks = uint64_t(a.hidden) / 8;
  const uint64_t n = uint64_t(a.num_tokens) * chunks;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t t = uint32_t(i / chunks);
    const uint64_t c = i % chunks;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t r = 0; r < a.world; ++r) {
      if (a.pos[uint64_t(t) * a.world + r] < 0) continue;
      const int4 v = reinterpret_cast<const int4*>(combine_row(a, a.rank, r, t))[c];
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
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
    reinterpret_cast<int4*>(a.out + uint64_t(t) * a.hidden)[c] = o;
  }
}
