// Kernels behind examples/pingpong: semaphore round-trip latency and put bandwidth between two
// ranks over one MemoryChannel.
#include <doorbell/doorbell.cuh>

using namespace doorbell;

// One thread. The initiator signals and waits `iters` times; the responder waits and signals.
// The initiator's kernel time over iters is one signal+wait round trip.
extern "C" __global__ void pingpong_latency(MemoryChannelHandle ch, uint32_t iters, uint32_t initiator) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (uint32_t i = 0; i < iters; ++i) {
    if (initiator) {
      ch.signal();
      ch.wait();
    } else {
      ch.wait();
      ch.signal();
    }
  }
}

// All threads of the grid put `bytes` from my buffer to the peer's; each block signals when its
// share is issued, so the receiver knows all data arrived after gridDim.x signals.
extern "C" __global__ void pingpong_put(MemoryChannelHandle ch, uint64_t bytes) {
  ch.put(0, 0, bytes, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) ch.signal();
}

// One thread waits for `count` signals, then acknowledges once.
extern "C" __global__ void pingpong_drain(MemoryChannelHandle ch, uint64_t count, uint32_t ack) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  ch.wait(count);
  if (ack) ch.signal();
}

// Put through the TMA bulk-copy unit instead of SM stores: one thread per block moves the block's
// contiguous share in chunks, global -> shared (bulk load, completion counted on an mbarrier) ->
// peer (bulk store), double-buffered so the store of chunk i overlaps the load of chunk i + 1.
// Before signalling it waits until its stores have reached the peer. Dynamic shared memory:
// 2 x chunk bytes of buffers followed by two 8-byte mbarriers. sm_90 and newer only.
extern "C" __global__ void pingpong_put_bulk(MemoryChannelHandle ch, uint64_t bytes, uint32_t chunk) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char smem[];
  if (threadIdx.x == 0) {
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + 2 * uint64_t(chunk));
    const uint32_t bar_addr[2] = {static_cast<uint32_t>(__cvta_generic_to_shared(&bars[0])),
                                  static_cast<uint32_t>(__cvta_generic_to_shared(&bars[1]))};
    const uint32_t buf_addr[2] = {static_cast<uint32_t>(__cvta_generic_to_shared(smem)),
                                  static_cast<uint32_t>(__cvta_generic_to_shared(smem + chunk))};
    for (int b = 0; b < 2; ++b) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr[b]));
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    // This block's share, in 16-byte units.
    const uint64_t units = bytes / 16;
    const uint64_t per = (units + gridDim.x - 1) / gridDim.x;
    const uint64_t begin = min(units, per * blockIdx.x) * 16;
    const uint64_t end = min(units, per * (blockIdx.x + 1)) * 16;
    const char* src = static_cast<const char*>(ch.src);
    char* dst = static_cast<char*>(ch.dst);
    uint32_t phase[2] = {0, 0};
    uint32_t i = 0;
    for (uint64_t off = begin; off < end; off += chunk, ++i) {
      const uint32_t b = i & 1;
      const uint32_t n = static_cast<uint32_t>(min(uint64_t(chunk), end - off));
      // Buffer b was last read by the store of chunk i - 2: at most one group may still read.
      if (i >= 2) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr[b]), "r"(n) : "memory");
      asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       buf_addr[b]),
                   "l"(src + off), "r"(n), "r"(bar_addr[b])
                   : "memory");
      uint32_t done = 0;
      while (!done) {
        asm volatile("{.reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p;}"
                     : "=r"(done)
                     : "r"(bar_addr[b]), "r"(phase[b])
                     : "memory");
      }
      phase[b] ^= 1;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + off), "r"(buf_addr[b]),
                   "r"(n)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // every store reached the peer
    ch.signal();
  }
#else
  __trap();  // bulk copies need sm_90
#endif
}
