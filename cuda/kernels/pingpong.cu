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
