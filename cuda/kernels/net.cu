// Collectives between ranks of different nodes, every byte through PortChannels (copy engines,
// Ethernet, or RDMA over the Ib transport in any posting mode): the direct algorithms of
// src/collectives/net.rs. One block; thread p < world drives the channel to rank p (net_exchange),
// or thread i the i-th peer of a phase (net_phase, the hierarchical allreduce).
//
// Per call and peer: signal "ready" and wait for the peer's (so nobody writes a receive slot the
// peer may still be reading from the last call), put my block into the peer's receive slot for
// me with a signal, wait for the peer's data signal, flush (my send buffer is reusable after the
// call). Signals are counted, so each call consumes exactly the two it causes per peer.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

// `ch` holds the channels to every other rank in rank order (the one to `rank` omitted).
// alltoall: my block p (at src_stride * p) goes to slot `rank` of peer p's receive buffer;
// allreduce (src_stride 0): my whole input goes to every peer. Every thread then copies my own
// block into my slot `rank`.
extern "C" __global__ void net_exchange(const PortChannelHandle* ch, uint32_t world, uint32_t rank, uint64_t bytes,
                                        uint64_t src_stride, const uint8_t* send, uint8_t* recv) {
  const uint32_t p = threadIdx.x;
  if (p < world && p != rank) {
    const PortChannelHandle& c = ch[p < rank ? p : p - 1];
    c.signal();
    c.wait();
    c.put_with_signal(uint64_t(rank) * bytes, uint64_t(p) * src_stride, bytes);
    c.wait();
    c.flush();
  }
  const uint8_t* mine = send + uint64_t(rank) * src_stride;
  uint8_t* slot = recv + uint64_t(rank) * bytes;
  for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) slot[i] = mine[i];
}

// dst1[i] (and dst2[i], when another place) = sum over s < nslots of slot s (base + s * stride, or `own` for slot
// own_slot), accumulated in f32 in slot order, for i < n.
template <typename T>
__device__ void sum_slots(const T* base, uint64_t stride, uint32_t nslots, uint32_t own_slot, const T* own, uint64_t n,
                          T* dst1, T* dst2) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (uint32_t s = 0; s < nslots; ++s) {
      const T v = s == own_slot ? own[i] : base[uint64_t(s) * stride + i];
      if constexpr (sizeof(T) == 2) {
        acc += __bfloat162float(v);
      } else {
        acc += v;
      }
    }
    T out;
    if constexpr (sizeof(T) == 2) {
      out = __float2bfloat16(acc);
    } else {
      out = acc;
    }
    dst1[i] = out;
    if (dst2 != dst1) dst2[i] = out;
  }
}

// The direct allreduce: out[i] = recv[0][i] + recv[1][i] + ... in rank order (every rank sums
// in the same order, so every rank gets the same bits), accumulating in f32.
extern "C" __global__ void net_reduce_f32(const float* recv, float* out, uint32_t world, uint64_t n) {
  sum_slots(recv, n, world, UINT32_MAX, recv, n, out, out);
}

extern "C" __global__ void net_reduce_bf16(const __nv_bfloat16* recv, __nv_bfloat16* out, uint32_t world, uint64_t n) {
  sum_slots(recv, n, world, UINT32_MAX, recv, n, out, out);
}

// ---- The hierarchical allreduce (nodes of L ranks, N nodes; see src/collectives/net.rs) ----
//
// One phase: thread i < n drives the channel ch[peers[i]] (keys[i] is that peer's local index or
// node): ready handshake, then a put of `bytes` (or, with per_peer_shard, the shard keys[i] of
// `total` bytes cut in `shard` pieces) from my send buffer at src_step * keys[i] into
// the peer's receive buffer at dst_off, with a signal; then the peer's data signal, then a flush
// (my send buffer is reusable after the phase).
extern "C" __global__ void net_phase(const PortChannelHandle* ch, const uint32_t* peers, const uint32_t* keys,
                                     uint32_t n, uint64_t dst_off, uint64_t src_step,
                                     uint64_t bytes, uint32_t per_peer_shard, uint64_t shard, uint64_t total) {
  const uint32_t i = threadIdx.x;
  if (i >= n) return;
  const PortChannelHandle& c = ch[peers[i]];
  const uint64_t k = keys[i];
  uint64_t len = bytes;
  if (per_peer_shard != 0) {
    const uint64_t start = k * shard < total ? k * shard : total;
    len = total - start < shard ? total - start : shard;
  }
  c.signal();
  c.wait();
  c.put_with_signal(dst_off, src_step * k, len);
  c.wait();
  c.flush();
}

extern "C" __global__ void net_sum_slots_f32(const float* base, uint64_t stride, uint32_t nslots, uint32_t own_slot,
                                             const float* own, uint64_t n, float* dst1, float* dst2) {
  sum_slots(base, stride, nslots, own_slot, own, n, dst1, dst2);
}

extern "C" __global__ void net_sum_slots_bf16(const __nv_bfloat16* base, uint64_t stride, uint32_t nslots,
                                              uint32_t own_slot, const __nv_bfloat16* own, uint64_t n,
                                              __nv_bfloat16* dst1, __nv_bfloat16* dst2) {
  sum_slots(base, stride, nslots, own_slot, own, n, dst1, dst2);
}

// out = the L shards in order: shard l from slot l of `slots` (stride bytes apart), mine from
// `own`; shard l holds min(shard, total - l * shard) bytes.
extern "C" __global__ void net_gather(const uint8_t* slots, uint64_t stride, uint32_t nslots, uint32_t own_slot,
                                      const uint8_t* own, uint64_t shard, uint64_t total, uint8_t* out) {
  for (uint64_t b = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; b < total; b += uint64_t(gridDim.x) * blockDim.x) {
    const uint64_t l = b / shard, i = b % shard;
    out[b] = l == own_slot ? own[i] : slots[l * stride + i];
  }
}
