// Kernels the GPU test suite drives: MemoryChannel put/get/signal/wait between ranks, LL packet
// round trips, and a wait that is made to time out. Payloads are derived from (rank, peer, round,
// byte index) so a wrong byte says who sent it; src/testing.rs holds the host twin of `pattern`.
#include <doorbell/doorbell.cuh>

using namespace doorbell;

// Byte j of the message `from` sends to `to` in `round`. Keep in step with testing::pattern.
__device__ __forceinline__ uint8_t pattern(uint32_t from, uint32_t to, uint32_t round, uint64_t j) {
  const uint32_t h = static_cast<uint32_t>(j) * 2654435761u + static_cast<uint32_t>(j >> 32) * 40503u;
  return static_cast<uint8_t>((h >> 11) ^ (from * 37u + to * 11u + round * 101u + 1u));
}

// Fills buf[off, off + bytes) with pattern(from, to, round, .).
extern "C" __global__ void selftest_fill(uint8_t* buf, uint64_t off, uint64_t bytes, uint32_t from, uint32_t to,
                                         uint32_t round) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; j < bytes; j += stride)
    buf[off + j] = pattern(from, to, round, j);
}

// Counts bytes of buf[off, off + bytes) that differ from pattern(from, to, round, .).
extern "C" __global__ void selftest_count_wrong(const uint8_t* buf, uint64_t off, uint64_t bytes, uint32_t from,
                                                uint32_t to, uint32_t round, unsigned long long* wrong) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long mine = 0;
  for (uint64_t j = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; j < bytes; j += stride)
    mine += buf[off + j] != pattern(from, to, round, j);
  if (mine) atomicAdd(wrong, mine);
}

// Layout of every rank's test buffer (bytes): [outbox: one slot per peer][inbox: one slot per peer].
struct ExchangeArgs {
  const MemoryChannelHandle* channels;  // one per peer, in peer order (my own rank skipped)
  uint32_t rank;
  uint32_t world;
  uint64_t slot;       // bytes per slot
  uint64_t bytes;      // bytes moved per peer
  uint64_t src_skew;   // offset inside the source slot
  uint64_t dst_skew;   // offset inside the destination slot
  uint32_t blocks_per_peer;
  uint32_t use_get;    // 0: push with put; 1: pull with get
};

__device__ __forceinline__ uint32_t peer_of(uint32_t index, uint32_t rank) { return index < rank ? index : index + 1; }

// Each rank moves `bytes` to (put) or from (get) every peer, blocks_per_peer blocks per peer.
// put: I write my outbox slot for peer p into p's inbox slot for me. Each block signals p when its
//      share is issued; block 0 of each peer waits for all of p's blocks, so when the kernel ends my
//      inbox holds everything.
// get: I read p's outbox slot for me into my inbox slot for p (the host ran selftest_handshake
//      first, so p's outbox is filled). Each block signals p "done reading"; block 0 waits for p's
//      blocks, so no one rewrites an outbox a peer is still reading.
extern "C" __global__ void selftest_exchange(ExchangeArgs a) {
  const uint32_t npeers = a.world - 1;
  const uint32_t index = blockIdx.x % npeers;
  const uint32_t part = blockIdx.x / npeers;
  const uint32_t peer = peer_of(index, a.rank);
  const MemoryChannelHandle& ch = a.channels[index];
  const uint64_t inbox = uint64_t(a.world) * a.slot;
  const uint32_t tid = part * blockDim.x + threadIdx.x;
  const uint32_t nthreads = a.blocks_per_peer * blockDim.x;
  if (a.use_get) {
    ch.get(a.rank * a.slot + a.src_skew, inbox + peer * a.slot + a.dst_skew, a.bytes, tid, nthreads);
  } else {
    ch.put(inbox + a.rank * a.slot + a.dst_skew, peer * a.slot + a.src_skew, a.bytes, tid, nthreads);
  }
  __syncthreads();  // every access of this block is done before the signal below
  if (threadIdx.x == 0) {
    ch.signal();
    if (part == 0) ch.wait(a.blocks_per_peer);
  }
}

// Thread i signals peer i and waits for its signal: after this kernel, everything each peer's
// stream did before its own handshake is visible here.
extern "C" __global__ void selftest_handshake(const MemoryChannelHandle* channels, uint32_t npeers) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < npeers) {
    channels[i].signal();
    channels[i].wait();
  }
}

struct PacketArgs {
  const MemoryChannelHandle* channels;
  uint32_t rank;
  uint32_t world;
  uint64_t slot;          // bytes per data slot (outbox/inbox layout as in ExchangeArgs)
  uint64_t packet_slot;   // bytes of packet buffer per sender
  uint64_t bytes;
  uint64_t src_skew;
  uint64_t dst_skew;
  uint32_t flag;
  uint32_t ll16;          // 1: LL16 packets, 0: LL8
};

// Each rank sends `bytes` to every peer as LL packets into the peer's packet buffer (slot of the
// sender) and unpacks what every peer sent it into its inbox. One block per peer.
extern "C" __global__ void selftest_packets(PacketArgs a) {
  const uint32_t index = blockIdx.x;
  const uint32_t peer = peer_of(index, a.rank);
  const MemoryChannelHandle& ch = a.channels[index];
  const uint64_t inbox = uint64_t(a.world) * a.slot;
  if (a.ll16) {
    ch.put_packets<LL16Packet>(a.rank * a.packet_slot, peer * a.slot + a.src_skew, a.bytes, a.flag, threadIdx.x,
                               blockDim.x);
    ch.unpack_packets<LL16Packet>(inbox + peer * a.slot + a.dst_skew, peer * a.packet_slot, a.bytes, a.flag,
                                  threadIdx.x, blockDim.x);
  } else {
    ch.put_packets<LL8Packet>(a.rank * a.packet_slot, peer * a.slot + a.src_skew, a.bytes, a.flag, threadIdx.x,
                              blockDim.x);
    ch.unpack_packets<LL8Packet>(inbox + peer * a.slot + a.dst_skew, peer * a.packet_slot, a.bytes, a.flag,
                                 threadIdx.x, blockDim.x);
  }
}

// Waits for a signal that never comes (nobody signals this channel): the bounded wait must give
// up, write the report and leave (the host reports Error::Timeout).
extern "C" __global__ void selftest_wait_forever(MemoryChannelHandle ch) {
  if (threadIdx.x == 0 && blockIdx.x == 0) ch.wait();
}

// Waits for a packet flag that never comes.
extern "C" __global__ void selftest_packet_wait_forever(MemoryChannelHandle ch, uint32_t flag) {
  copy_from_packets(ch.src, static_cast<const LL16Packet*>(ch.packet_buffer), 16, flag, threadIdx.x, blockDim.x,
                    ch.semaphore.site);
}
