// Collectives between ranks of different nodes, every byte through PortChannels (copy engines,
// Ethernet, or RDMA over the Ib transport in any posting mode): the direct algorithms of
// src/collectives/net.rs. One block; thread p < world drives the channel to rank p.
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

// out[i] = recv[0][i] + recv[1][i] + ... in rank order (every rank sums in the same order, so
// every rank gets the same bits), accumulating in f32.
template <typename T>
__device__ void reduce_slots(const T* recv, T* out, uint32_t world, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (uint32_t r = 0; r < world; ++r) {
      if constexpr (sizeof(T) == 2) {
        acc += __bfloat162float(recv[uint64_t(r) * n + i]);
      } else {
        acc += recv[uint64_t(r) * n + i];
      }
    }
    if constexpr (sizeof(T) == 2) {
      out[i] = __float2bfloat16(acc);
    } else {
      out[i] = acc;
    }
  }
}

extern "C" __global__ void net_reduce_f32(const float* recv, float* out, uint32_t world, uint64_t n) {
  reduce_slots(recv, out, world, n);
}

extern "C" __global__ void net_reduce_bf16(const __nv_bfloat16* recv, __nv_bfloat16* out, uint32_t world, uint64_t n) {
  reduce_slots(recv, out, world, n);
}
