// All-gather driven only through PortChannels: one GPU thread pushes triggers, the proxy's copy
// engines move every byte. The ring (each rank sends only to rank + 1) because copy engines
// sending to every peer at once collapse to about half their rate while receiving at the same
// time (measured on 4 x H200, docs/performance.md "Copy-engine patterns"), whereas one peer per
// GPU keeps about 384 GB/s each way.
//
// Layout: the registered buffer holds world shards of `shard_bytes`, rank k's at k * shard_bytes,
// on every rank, and each shard arrives at the same offset it left from.
//
// Protocol, per call (one thread):
//   1. left.signal(): my buffer may be written (everything earlier on my stream has finished, so
//      nobody still reads the previous result); right.wait(): right's buffer may be written.
//   2. Step s = 0 .. world-2 forwards shard (rank - s) to the right, in pieces: at s = 0 my own,
//      read straight from the caller's input (`input_mem` names device addresses; the host
//      copies the input into my slot meanwhile, on another stream), later the pieces the left
//      neighbour put into my buffer, each after its signal.
//   3. Wait for the last shard's pieces ((rank + 1) % world), then flush the right channel so no
//      copy still reads my buffer when the kernel ends.
// Signal counts balance per call (each channel carries one ready signal and (world-1) * pieces
// data signals the other way), so replays of a captured graph stay in step with no host reset.
#include <doorbell/doorbell.cuh>

using namespace doorbell;

extern "C" __global__ void allgather_ring_port(PortChannelHandle right, PortChannelHandle left, uint32_t rank,
                                               uint32_t world, uint64_t shard_bytes, uint64_t piece_bytes,
                                               uint32_t input_mem, uint64_t input) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  left.signal();
  right.wait();
  const uint64_t pieces = (shard_bytes + piece_bytes - 1) / piece_bytes;
  for (uint32_t s = 0; s + 1 < world; ++s) {
    const uint64_t base = uint64_t((rank + world - s) % world) * shard_bytes;
    for (uint64_t p = 0; p < pieces; ++p) {
      const uint64_t off = p * piece_bytes;
      const uint64_t n = shard_bytes - off < piece_bytes ? shard_bytes - off : piece_bytes;
      if (s > 0) {
        left.wait();
        right.put_with_signal(base + off, base + off, n);
      } else {
        right.fifo.push(kTriggerData | kTriggerFlag, right.semaphore, input_mem, input + off, right.dst_mem, base + off,
                        n);
      }
    }
  }
  left.wait(pieces);
  right.flush();
}
