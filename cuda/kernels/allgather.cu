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
// The call check rides on the ready signal: it is a put of my call word (`word`, 0 with the
// check off) from my word slot (`word_off` in the buffer) into the left neighbour's slot for me
// (`slots_off + 8 * rank`), so after right.wait() the right neighbour's word is in my slot for
// it; a different word is reported as a mismatch and nothing is sent. Every rank checks its right
// neighbour, so the odd rank and its left neighbour both name the difference (the others get the
// abort). Reuse is safe: the left neighbour reads my word before it sends me anything, and my
// call ends only after its data came.
#include <doorbell/doorbell.cuh>

using namespace doorbell;

extern "C" __global__ void allgather_ring_port(PortChannelHandle right, PortChannelHandle left, uint32_t rank,
                                               uint32_t world, uint64_t shard_bytes, uint64_t piece_bytes,
                                               uint32_t input_mem, uint64_t input, uint64_t word, uint64_t* words,
                                               uint64_t word_off, uint64_t slots_off) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (word == 0) {
    left.signal();
    right.wait();
  } else {
    // words: my buffer at word_off (my slot, then every rank's at slots_off).
    words[0] = word;
    __threadfence_system();
    left.put_with_signal(slots_off + 8ull * rank, word_off, 8);
    right.wait();
    const uint32_t r = (rank + 1) % world;
    const uint64_t theirs = load_relaxed_sys(words + (slots_off - word_off) / 8 + r);
    if (theirs != word) {
      report_mismatch(right.fifo.site, static_cast<int32_t>(r), word, theirs);
      return;
    }
  }
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
