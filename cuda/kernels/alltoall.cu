// All-to-all(v) inside a node over NVLink: every rank's block for peer p crosses into p's scratch
// ring with SM stores, and p's SMs copy it out into the caller's output. Buffers stay the
// caller's (nothing is registered per call); the scratch is allocated once per communicator.
//
// Grid: (world - 1) x lanes blocks for the peers, then own_lanes blocks for this rank's own block
// (a local copy); block (p, lane) owns the traffic between this rank and peer p in both
// directions for tiles lane, lane + lanes, ... of each block. Scratch layout on every rank:
// [source rank][lane][depth slots][tile].
//
// Protocol for one (p, lane) pair, i-th tile of this lane; some of the block's warps send while
// the others receive:
//   send: once i >= depth, wait for a credit from p (p emptied the slot used depth tiles ago);
//         copy the tile into p's slot i % depth; signal `data` (release: the stores land first).
//   recv: wait for `data` from p; copy slot i % depth out to the output; signal `credit` to p.
// At the end the sender waits for the credits it has not consumed yet, so every call consumes
// exactly what it signals: semaphores are monotonic and live in device memory, and replays of a
// captured graph need no reset. No deadlock: a send waits only for the peer's receiver, which
// waits only for our sender's earlier tiles.
// Counts and offsets come from device memory (alltoallv) or one equal size (alltoall), in bytes.
//
// alltoallv: ranks cannot agree on a kernel from their own counts (a rank knows only its pairs),
// so every alltoallv runs this kernel and each pair picks its protocol from its own byte count,
// which both sides of the pair read: up to `pair_ll_max` bytes go as LL16 packets (below), more
// as tiles. Before anything is written every block checks every range the counts name against
// the buffers; a range outside them is reported (kWaitBadCounts) and the call writes nothing.
// Each pair's two counts are compared by the call check (coll/call_check.cuh, pair counts).
#include <doorbell/coll/call_check.cuh>
#include <doorbell/detail/collective_args.cuh>
#include <doorbell/doorbell.cuh>

using namespace doorbell;

// Synchronizes the `count` threads (a multiple of 32) that use barrier `id` (1..15; 0 is
// __syncthreads).
DOORBELL_DEVICE_INLINE void named_barrier(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// The tile for a block of `bytes` between two ranks: small blocks are cut finer so every lane has
// a share (at least 4 KiB each), large ones use the full tile. Sender and receiver compute it from
// the same byte count, so they agree.
DOORBELL_DEVICE_INLINE uint64_t pair_tile(uint64_t bytes, uint64_t max_tile, uint32_t lanes) {
  uint64_t t = (bytes + lanes - 1) / lanes;
  t = (t + 15) / 16 * 16;
  if (t < 4096) t = 4096;
  return t < max_tile ? t : max_tile;
}

DOORBELL_DEVICE_INLINE uint64_t lane_tiles(uint64_t bytes, uint64_t tile, uint32_t lane, uint32_t lanes) {
  const uint64_t tiles = (bytes + tile - 1) / tile;
  return tiles > lane ? (tiles - lane + lanes - 1) / lanes : 0;
}

// The packet area of alltoallv's small pairs: after the equal blocks' LL area, the same shape
// ([2 halves][source][ll_slot_bytes]), its own epochs.
DOORBELL_DEVICE_INLINE uint64_t pair_ll_offset(const AllToAllArgs& a) {
  return a.ll_offset + 2ull * a.world * a.ll_slot_bytes;
}

// Every range of alltoallv's counts inside its buffer, and the own block sent and received at one
// size; else reports the first bad one (block 0) and returns false in every block, before any
// block has written anything. One barrier.
DOORBELL_DEVICE_INLINE bool counts_in_range(const AllToAllArgs& a) {
  const uint32_t w = a.world, i = threadIdx.x;
  bool bad = false;
  uint32_t channel = 0;
  uint64_t limit = 0, end = 0;
  if (i < 2 * w) {
    const uint32_t side = i / w, p = i % w;
    const uint64_t n = a.counts[2 * side * w + p], off = a.counts[(2 * side + 1) * w + p];
    limit = side ? a.output_bytes : a.input_bytes;
    bad = off > limit || n > limit - off;
    end = off + n < off ? ~0ull : off + n;
    channel = side << 8 | p;
  } else if (i == 2 * w) {
    limit = a.counts[2 * w + a.rank];
    end = a.counts[a.rank];
    bad = limit != end;
    channel = 2u << 8 | a.rank;
  }
  if (!__syncthreads_or(bad)) return true;
  if (bad && blockIdx.x == 0) {
    WaitSite site = a.data[a.rank].site;  // lane 0's own entry: a site, no semaphore
    site.peer = -1;
    site.channel = channel;
    report_failure(site, kWaitBadCounts, limit, end, 0);
  }
  return false;
}

// One direction of a small alltoallv pair as LL16 packets, this lane's share: packet i goes from
// lane i / team % lanes (the receiving side may split them otherwise, its team being another
// size). Each (direction, peer, lane) keeps its epoch in `pair_epochs`, and every lane of the pair
// bumps it in every call in which the pair goes as packets (both sides see the same count, so all
// of them agree on every epoch); the halves alternate by epoch. Reuse is safe because every
// alltoallv waits for every peer's call word (coll/call_check.cuh), so a rank starts call n+1 only
// after each peer started call n, that is, finished call n-1 and read its packets.
DOORBELL_DEVICE_INLINE void pair_packets(const AllToAllArgs& a, bool send, uint32_t p, uint32_t lane,
                                         uint64_t bytes, uint64_t off, uint32_t t, uint32_t team,
                                         uint32_t bar) {
  const uint32_t w = a.world;
  uint32_t* epochs = a.pair_epochs + (uint64_t(send ? 0 : w) + p) * a.lanes + lane;
  const uint32_t epoch = *epochs + 1;
  const uint64_t half = uint64_t(epoch & 1) * w * a.ll_slot_bytes;
  const uint32_t first = lane * team + t, stride = a.lanes * team;
  if (send) {
    LL16Packet* slot = reinterpret_cast<LL16Packet*>(a.scratch[p] + pair_ll_offset(a) + half +
                                                     uint64_t(a.rank) * a.ll_slot_bytes);
    copy_to_packets(slot, a.input + off, bytes, epoch, first, stride);
  } else {
    const LL16Packet* slot = reinterpret_cast<const LL16Packet*>(a.scratch[a.rank] + pair_ll_offset(a) + half +
                                                                 uint64_t(p) * a.ll_slot_bytes);
    copy_from_packets(a.output + off, slot, bytes, epoch, first, stride, a.data[uint64_t(lane) * w + p].site);
  }
  // Every thread of the team has read the epoch before it moves on.
  named_barrier(bar, team);
  if (t == 0) *epochs = epoch;
}

// kV: alltoallv (counts in device memory, checked; small pairs as packets). Equal blocks compile
// without either: on 2 x H200 one kernel for both made equal blocks of 4-16 MiB 4-9% slower
// (more registers in the copy loop).
template <bool kV>
DOORBELL_DEVICE_INLINE void tiles(const AllToAllArgs& a) {
  const uint32_t w = a.world;
  if (kV && !counts_in_range(a)) return;
  // Blocks [0, (w - 1) x lanes) serve the peers in rank order, `lanes` each; the rest of the
  // grid copies this rank's own block (a local copy needs fewer SMs than an NVLink stream).
  const uint32_t remote_blocks = (w - 1) * a.lanes;
  const bool own = blockIdx.x >= remote_blocks;
  const uint32_t k = blockIdx.x / a.lanes;
  const uint32_t p = own ? a.rank : (k < a.rank ? k : k + 1);
  const uint32_t lane = own ? blockIdx.x - remote_blocks : blockIdx.x % a.lanes;
  const uint32_t tid = threadIdx.x, nthreads = blockDim.x;
  const uint64_t send_bytes = kV ? a.counts[p] : a.equal_bytes;
  const uint64_t send_off = kV ? a.counts[w + p] : p * a.equal_bytes;
  const uint64_t recv_bytes = kV ? a.counts[2 * w + p] : a.equal_bytes;
  const uint64_t recv_off = kV ? a.counts[3 * w + p] : p * a.equal_bytes;
  if (own) {
    const uint32_t own_lanes = gridDim.x - remote_blocks;
    const uint64_t n = send_bytes < recv_bytes ? send_bytes : recv_bytes;
    const uint64_t tile = pair_tile(n, a.tile, own_lanes);
    for (uint64_t i = lane; i * tile < n; i += own_lanes) {
      const uint64_t off = i * tile;
      copy(a.output + recv_off + off, a.input + send_off + off, n - off < tile ? n - off : tile, tid, nthreads);
    }
    return;
  }
  const SemaphoreHandle& data = a.data[uint64_t(lane) * w + p];
  const SemaphoreHandle& credit = a.credit[uint64_t(lane) * w + p];
  char* remote_ring = a.scratch[p] + (uint64_t(a.rank) * a.lanes + lane) * a.depth * a.tile;
  const char* local_ring = a.scratch[a.rank] + (uint64_t(p) * a.lanes + lane) * a.depth * a.tile;
  // The two directions run side by side: the first send_threads threads send, the others
  // receive, each team synchronizing on its own named barrier, so NVLink stores and the local
  // copy-out overlap instead of taking turns.
  const uint32_t senders = a.send_threads;
  const bool sender = tid < senders;
  const uint32_t t = sender ? tid : tid - senders;
  const uint32_t team = sender ? senders : nthreads - senders;
  const uint32_t bar = sender ? 1 : 2;
  // alltoallv's small pairs go as packets (equal blocks that small took the LL kernel).
  if (kV && sender && send_bytes > 0 && send_bytes <= a.pair_ll_max) {
    pair_packets(a, true, p, lane, send_bytes, send_off, t, team, bar);
  } else if (kV && !sender && recv_bytes > 0 && recv_bytes <= a.pair_ll_max) {
    pair_packets(a, false, p, lane, recv_bytes, recv_off, t, team, bar);
  } else if (sender) {
    // A credit wait that gives up ends the sending: the slot may still hold a tile the peer has
    // not copied out, and without this tile's signal the peer's wait gives up and marks its output.
    __shared__ bool send_cut;
    const uint64_t tile = pair_tile(send_bytes, a.tile, a.lanes);
    const uint64_t n_send = lane_tiles(send_bytes, tile, lane, a.lanes);
    for (uint64_t i = 0; i < n_send; ++i) {
      const uint64_t off = (lane + i * a.lanes) * tile;
      if (i >= a.depth) {
        if (t == 0) send_cut = !credit.wait();
        named_barrier(bar, team);
        if (send_cut) return;
      }
      const uint64_t bytes = send_bytes - off < tile ? send_bytes - off : tile;
      copy(remote_ring + (i % a.depth) * a.tile, a.input + send_off + off, bytes, t, team);
      named_barrier(bar, team);
      if (t == 0) data.signal();
    }
    if (t == 0 && n_send > 0) credit.wait(n_send < a.depth ? n_send : a.depth);
  } else {
    // A data wait that gives up (the communicator aborted) marks this lane's tiles from then on
    // (all ones: NaN in f32, f16 and bf16) instead of copying ring slots the peer never filled.
    __shared__ bool cut;
    bool ok = true;
    const uint64_t tile = pair_tile(recv_bytes, a.tile, a.lanes);
    const uint64_t n_recv = lane_tiles(recv_bytes, tile, lane, a.lanes);
    for (uint64_t i = 0; i < n_recv; ++i) {
      const uint64_t off = (lane + i * a.lanes) * tile;
      if (t == 0) {
        ok = data.wait() && ok;
        cut = !ok;
      }
      named_barrier(bar, team);
      const uint64_t bytes = recv_bytes - off < tile ? recv_bytes - off : tile;
      if (cut) {
        mark_missing(a.output + recv_off + off, bytes, t, team);
      } else {
        copy(a.output + recv_off + off, local_ring + (i % a.depth) * a.tile, bytes, t, team);
      }
      named_barrier(bar, team);
      if (t == 0) credit.signal();
    }
  }
}

// Tiny equal blocks: one LL16 packet per 8 bytes, written straight into the receiver's packet area
// and read there once its flag shows this call's epoch: no semaphores, one NVLink crossing. The
// grid is fixed (the caller always launches the same number of blocks) and packet i always belongs
// to the same block, whose epoch, kept in device memory and bumped every call, is the flag; the two
// halves of the area alternate by epoch, so a call never overwrites packets a slow peer has not
// read yet (to start call N+2 a rank needs the peer's packets of N+1, sent after the peer had
// read everything of N). Equal blocks only: every rank knows every pair's size.
DOORBELL_DEVICE_INLINE void ll16(const AllToAllArgs& a) {
  const uint32_t w = a.world;
  const uint64_t bytes = a.equal_bytes;
  const uint32_t epoch = a.epochs[blockIdx.x] + 1;
  const uint64_t half = uint64_t(epoch & 1) * w * a.ll_slot_bytes;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint32_t p = 0; p < w; ++p) {
    const char* src = a.input + p * bytes;
    if (p == a.rank) {
      char* dst = a.output + p * bytes;
      for (uint64_t i = first; i < bytes; i += stride) dst[i] = src[i];
      continue;
    }
    LL16Packet* slot =
        reinterpret_cast<LL16Packet*>(a.scratch[p] + a.ll_offset + half + uint64_t(a.rank) * a.ll_slot_bytes);
    for (uint64_t i = first; i * 8 < bytes; i += stride) {
      uint32_t lo, hi;
      const uint64_t n = bytes - i * 8;
      load_payload(src + i * 8, n < 8 ? uint32_t(n) : 8, lo, hi);
      slot[i].write(lo, hi, epoch);
    }
  }
  for (uint32_t p = 0; p < w; ++p) {
    if (p == a.rank) continue;
    char* dst = a.output + p * bytes;
    const LL16Packet* slot =
        reinterpret_cast<const LL16Packet*>(a.scratch[a.rank] + a.ll_offset + half + uint64_t(p) * a.ll_slot_bytes);
    const WaitSite& site = a.data[p].site;
    for (uint64_t i = first; i * 8 < bytes; i += stride) {
      uint32_t lo = 0, hi = 0;
      if (!spin_until_packet(site, kWaitPacket, epoch,
                             [&](uint64_t& seen) { return slot[i].try_read(lo, hi, epoch, seen); })) {
        lo = hi = kMissingPayload;  // marked, not stale bytes
      }
      const uint64_t n = bytes - i * 8;
      store_payload(dst + i * 8, n < 8 ? uint32_t(n) : 8, lo, hi);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) a.epochs[blockIdx.x] = epoch;
}

// All three kernels run between the call check's announce and check (coll/call_check.cuh): a rank
// that makes another call (equal blocks of another size, alltoallv against alltoall, other pair
// counts) is named on every rank. The checker threads sit in the last block, which copies the own
// block and never waits, so a check runs even when a mismatch leaves data waits hanging; its report
// aborts them. (Written out, not through a lambda: the launch arguments must stay in parameter
// space.)
extern "C" __global__ void __launch_bounds__(512) alltoall_tiles(AllToAllArgs a) {
  announce_call(a.call, a.rank, a.world);
  tiles<false>(a);
  check_call(a.call, a.rank, a.world, a.data[checked_peer(a.world) % a.world].site);
}

extern "C" __global__ void __launch_bounds__(512) alltoallv_tiles(AllToAllArgs a) {
  announce_call_counts(a.call, a.rank, a.world, a.counts);
  tiles<true>(a);
  check_call_counts(a.call, a.rank, a.world, a.data[checked_peer(a.world) % a.world].site, a.counts);
}

extern "C" __global__ void __launch_bounds__(512) alltoall_ll16(AllToAllArgs a) {
  announce_call(a.call, a.rank, a.world);
  ll16(a);
  check_call(a.call, a.rank, a.world, a.data[checked_peer(a.world) % a.world].site);
}
