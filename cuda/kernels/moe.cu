// MoE expert dispatch and combine inside a node over NVLink (high-throughput layout: a token goes
// to each destination rank once, however many of that rank's experts it selected).
//
// Dispatch, three kernels on the caller's stream:
//   moe_dispatch_prepare (one block per destination rank r): positions of the tokens bound for r
//     (a block-wide scan), their count; then the "free" handshake with r: my landing area may be
//     written again (every earlier kernel on my stream, the previous compaction included, is done)
//     and r's may be written by me.
//   moe_dispatch_send (B blocks): a warp per token writes its row (hidden bf16 values, the top-k
//     expert ids rebased to r's local ids or -1, the weights, the source token) straight into r's
//     landing area at [me][position]; block 0 also writes my per-destination counts there; every
//     block then signals every peer once (release: its rows land first).
//   moe_dispatch_recv (B blocks): each block waits until every peer's B signals of this call have
//     arrived (the monotonic token reaches calls x B; waiting does not consume, so all blocks may
//     wait), then a warp per received row copies it out, in source-rank order, into recv_x /
//     recv_idx / recv_weights / recv_src and counts rows per local expert.
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

DOORBELL_DEVICE_INLINE char* dispatch_row(const MoeArgs& a, uint32_t owner, uint32_t source, uint32_t index) {
  return a.recv_buf[owner] + (uint64_t(source) * a.max_tokens + index) * a.row_bytes;
}

DOORBELL_DEVICE_INLINE uint32_t* dispatch_counts(const MoeArgs& a, uint32_t owner) {
  return reinterpret_cast<uint32_t*>(a.recv_buf[owner] + uint64_t(a.world) * a.max_tokens * a.row_bytes);
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

extern "C" __global__ void __launch_bounds__(1024) moe_dispatch_prepare(MoeArgs a) {
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
  if (tid == 0) free_handshake(a, 0, r);
}

extern "C" __global__ void __launch_bounds__(512) moe_dispatch_send(MoeArgs a) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t payload = uint64_t(a.hidden) * 2;
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < a.num_tokens; t += warps) {
    for (uint32_t r = 0; r < a.world; ++r) {
      const int32_t p = a.pos[uint64_t(t) * a.world + r];
      if (p < 0) continue;
      char* row = dispatch_row(a, r, a.rank, uint32_t(p));
      warp_copy16(row, a.x + uint64_t(t) * a.hidden, payload, lane);
      int32_t* ids = reinterpret_cast<int32_t*>(row + payload);
      float* weights = reinterpret_cast<float*>(ids + a.topk);
      for (uint32_t k = lane; k < a.topk; k += kWarp) {
        const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
        const bool here = e >= 0 && uint32_t(e) / a.experts_per_rank == r;
        ids[k] = here ? int32_t(uint32_t(e) % a.experts_per_rank) : -1;
        weights[k] = a.topk_weights[uint64_t(t) * a.topk + k];
      }
      if (lane == 0) reinterpret_cast<int32_t*>(weights + a.topk)[0] = int32_t(t);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < a.world) {
    dispatch_counts(a, threadIdx.x)[a.rank] = a.send_counts[threadIdx.x];
  }
  __syncthreads();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[1 * a.world + threadIdx.x].signal();
}

extern "C" __global__ void __launch_bounds__(512) moe_dispatch_recv(MoeArgs a) {
  __shared__ uint32_t base[kMaxRanks + 1];
  if (threadIdx.x == 0) {
    wait_all_peers(a, 1, a.calls[0]);
    const uint32_t* counts = dispatch_counts(a, a.rank);
    base[0] = 0;
    for (uint32_t s = 0; s < a.world; ++s) base[s + 1] = base[s] + load_acquire_sys(&counts[s]);
    if (blockIdx.x == 0) *a.num_recv = base[a.world];
  }
  __syncthreads();
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t payload = uint64_t(a.hidden) * 2;
  const uint32_t total = base[a.world];
  for (uint32_t j = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; j < total; j += warps) {
    uint32_t s = 0;
    while (j >= base[s + 1]) ++s;
    const char* row = dispatch_row(a, a.rank, s, j - base[s]);
    warp_copy16(a.recv_x + uint64_t(j) * a.hidden, row, payload, lane);
    const int32_t* ids = reinterpret_cast<const int32_t*>(row + payload);
    const float* weights = reinterpret_cast<const float*>(ids + a.topk);
    for (uint32_t k = lane; k < a.topk; k += kWarp) {
      const int32_t e = ids[k];
      a.recv_idx[uint64_t(j) * a.topk + k] = e;
      a.recv_weights[uint64_t(j) * a.topk + k] = weights[k];
      if (e >= 0) atomicAdd(&a.expert_counts[e], 1u);
    }
    if (lane == 0) {
      a.recv_src[2 * uint64_t(j)] = int32_t(s);
      a.recv_src[2 * uint64_t(j) + 1] = reinterpret_cast<const int32_t*>(weights + a.topk)[0];
    }
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
  for (uint32_t j = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; j < total; j += warps) {
    const uint32_t s = uint32_t(a.recv_src[2 * uint64_t(j)]);
    const uint32_t t = uint32_t(a.recv_src[2 * uint64_t(j) + 1]);
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
