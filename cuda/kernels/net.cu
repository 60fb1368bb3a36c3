// Collectives between ranks of different nodes, every byte through PortChannels (copy engines,
// Ethernet, or RDMA over the Ib transport in any posting mode): the direct algorithms of
// src/host/collectives/net.rs. One block; thread p < world drives the channel to rank p (net_exchange),
// or thread i the i-th peer of a phase (net_phase, the hierarchical allreduce).
//
// Per call and peer: signal "ready" and wait for the peer's (so nobody writes a receive slot the
// peer may still be reading from the last call), put my block into the peer's receive slot for
// me with a signal, wait for the peer's data signal, flush (my send buffer is reusable after the
// call). Signals are counted, so each call consumes exactly the two it causes per peer.
//
// The call check rides on the ready handshake (ranks on other nodes map no inbox of each other, so
// coll/call_check.cuh's stores cannot reach them): the ready signal is a put of my call word (made
// by src/host/gpu/signature.rs, 0 with the check off) into the peer's word slot for me, and after the
// peer's ready signal its word is in my slot for it. A different word is reported as a mismatch
// (the communicator aborts; both ranks see it, each from its side) and the thread sends no data.
// Slot reuse is safe for the reason the handshake exists: a peer puts its next word only after this
// call's data signal from me, which I send after reading its word.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

// Where the call words live: `word` (0: no check), my send buffer's word slot (`mine`, at
// `mine_off` in the channels' source memory) and my receive buffer's slots (`slots`, at
// `slots_off` in the channels' destination memory; slot r holds rank r's word).
struct NetWord {
  uint64_t word;
  uint64_t* mine;
  uint64_t mine_off;
  uint64_t slots_off;
  const uint64_t* slots;
};

// Thread 0 stores my word where the channels read it; every thread of the block calls this.
DOORBELL_DEVICE_INLINE void publish_word(const NetWord& w) {
  if (w.word != 0 && threadIdx.x == 0) {
    *w.mine = w.word;
    __threadfence_system();
  }
  __syncthreads();
}

// The ready handshake with `peer` over `c`, carrying my call word; false (after reporting the
// mismatch) when the peer's word differs.
DOORBELL_DEVICE_INLINE bool ready(const PortChannelHandle& c, uint32_t peer, uint32_t rank, const NetWord& w) {
  if (w.word == 0) {
    c.signal();
    c.wait();
    return true;
  }
  c.put_with_signal(w.slots_off + 8ull * rank, w.mine_off, 8);
  c.wait();
  const uint64_t theirs = load_relaxed_sys(w.slots + peer);
  if (theirs == w.word) return true;
  report_mismatch(c.fifo.site, static_cast<int32_t>(peer), w.word, theirs);
  return false;
}

// `ch` holds the channels to every other rank in rank order (the one to `rank` omitted).
// alltoall: my block p (at src_stride * p) goes to slot `rank` of peer p's receive buffer;
// allreduce (src_stride 0): my whole input goes to every peer. Every thread then copies my own
// block into my slot `rank`.
extern "C" __global__ void net_exchange(const PortChannelHandle* ch, uint32_t world, uint32_t rank, uint64_t bytes,
                                        uint64_t src_stride, const uint8_t* send, uint8_t* recv, NetWord w) {
  const uint32_t p = threadIdx.x;
  publish_word(w);
  if (p < world && p != rank) {
    const PortChannelHandle& c = ch[p < rank ? p : p - 1];
    if (!ready(c, p, rank, w)) return;
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

// ---- The hierarchical allreduce (nodes of L ranks, N nodes; see src/host/collectives/net.rs) ----
//
// One phase: thread i < n drives the channel ch[peers[i]] (keys[i] is that peer's local index or
// node; the peer's rank follows from the channel index, channels being in rank order without
// mine): ready handshake with the call word, then a put of `bytes` (or, with per_peer_shard, the shard keys[i] of
// `total` bytes cut in `shard` pieces) from my send buffer at src_step * keys[i] into
// the peer's receive buffer at dst_off, with a signal; then the peer's data signal, then a flush
// (my send buffer is reusable after the phase).
extern "C" __global__ void net_phase(const PortChannelHandle* ch, const uint32_t* peers, const uint32_t* keys,
                                     uint32_t n, uint64_t dst_off, uint64_t src_step,
                                     uint64_t bytes, uint32_t per_peer_shard, uint64_t shard, uint64_t total,
                                     uint32_t rank, NetWord w) {
  const uint32_t i = threadIdx.x;
  publish_word(w);
  if (i >= n) return;
  const uint32_t channel = peers[i], peer = channel < rank ? channel : channel + 1;
  const PortChannelHandle& c = ch[channel];
  const uint64_t k = keys[i];
  uint64_t len = bytes;
  if (per_peer_shard != 0) {
    const uint64_t start = k * shard < total ? k * shard : total;
    len = total - start < shard ? total - start : shard;
  }
  // A phase sends what the earlier phases of this call made: after a mismatch found in one of
  // them (this rank and a peer made different calls), it sends nothing, so no rank completes the
  // call with sums of the other call's data (a rank of another node that checks only its rail peer
  // would otherwise return them as its result); the peers waiting for it learn why from the abort.
  if (failed(c.fifo.site) || !ready(c, peer, rank, w)) return;
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
