// doorbell device API: call agreement, on by default, at one store and one load per peer and call.
//
// Every collective call carries a 64-bit call word that names it: call index, collective, element
// type, algorithm, operation and count (made by src/gpu/signature.rs; bit 63 marks a word as
// written, so a zeroed slot reads as "nothing yet"). Each rank has an inbox of
// [2 parities][kMaxRanks] words in its collective's scratch, mapped by its peers.
//
// Who: block 0's thread p announces (block 0 is scheduled first, so a peer sees the word even
// where the grids of ranks sharing a GPU cannot all be resident); the last `world` threads of the
// last block check, thread p for peer p (the "checker" threads): small messages give them no
// data to move, so their check runs beside the data path instead of after it, and large ones
// hide its one load in their length.
//
// Protocol (for each peer p != rank):
//   start of the kernel, block 0's thread p: store my word into peer p's inbox slot
//     [parity][rank] (relaxed; the reader only compares it, nothing is read under its protection).
//   end of the kernel, checker thread p, after its own share of the work: wait (bounded,
//     abort-aware) until my inbox slot [parity][p] holds a word with this call's key (index and
//     graph bit), and compare it with mine. A different word is reported as a mismatch (WaitReport's mismatch
//     record) and aborts the communicator, so the host call returns Error::ArgumentMismatch
//     naming both calls. A peer that skipped or repeated a call never shows this key: its waits
//     and this one give up at the budget (Error::Timeout naming it).
// Why two parities suffice: peer p writes call i+2's word into slot [parity][rank] only after it
// finished call i+1, which needs this rank's data of call i+1, which this rank sends only after this
// kernel (call i) ended. So while call i runs, the slot holds an older word (wait) or call i's.
// Graph replays reuse their captured words; a replayed slot already holding this call's word from
// the previous replay makes the check pass at once (the words were compared at the first replay).
// Cost: the store is fire-and-forget and the load at the end normally finds the word already there
// (the peer's data arrived, so the peer had started): nothing on the critical path.
#pragma once

#include "wait.cuh"

namespace doorbell {

// Most ranks a single-node collective kernel handles.
constexpr uint32_t kMaxRanks = 8;

// Launch-argument member of every checked collective.
struct CallCheck {
  uint64_t word;                // this call's word; 0: no check (the kernel runs unchecked)
  uint64_t* inbox[kMaxRanks];   // every rank's inbox ([2][kMaxRanks] words), mapped here (own at [rank])
};
DOORBELL_CHECK_SIZE(CallCheck, 72);

#if DOORBELL_CUDA

// A call's key: its index, whether it was captured in a graph (bit 62), and the written bit (63:
// an empty slot has no key). Replays reuse the indices they were captured with, so words are
// compared only when their keys are equal.
DOORBELL_DEVICE_INLINE uint64_t call_key(uint64_t word) { return word & (0xffffull | (3ull << 62)); }

// Whether this thread is a checker thread, and for which peer.
DOORBELL_DEVICE_INLINE bool call_checker(uint32_t world, uint32_t& p) {
  if (blockIdx.x != gridDim.x - 1 || threadIdx.x + world < blockDim.x) return false;
  p = threadIdx.x + world - blockDim.x;
  return true;
}

// The peer a checker thread checks (world: none), for picking a wait site before check_call.
DOORBELL_DEVICE_INLINE uint32_t checked_peer(uint32_t world) {
  uint32_t p;
  return call_checker(world, p) ? p : world;
}

// The slow halves live out of line and take scalars: every thread of every collective kernel
// runs the inline test below, but only the checker threads call these, and keeping their code (a
// bounded wait, a report) out of the kernel body keeps the body's instructions as compact as
// without the check (inlined, the check cost 1 us per small allreduce, measured). Passing the
// launch arguments by reference instead would make the compiler copy them to local memory.
static __noinline__ __device__ void announce_call_to(uint64_t* slot, uint64_t word) { store_relaxed_sys(slot, word); }

static __noinline__ __device__ void check_call_of(const uint64_t* slot, uint64_t word, uint32_t p, WaitSite site,
                                                  bool every_pair_exchanges) {
  site.peer = static_cast<int32_t>(p);
  uint64_t theirs = load_relaxed_sys(slot);
  if (every_pair_exchanges) {
    spin_until(site, kWaitArgMismatch, word, [&](uint64_t& seen) {
      seen = load_relaxed_sys(slot);
      theirs = seen;
      return call_key(seen) == call_key(word);
    });
  }
  if (call_key(theirs) == call_key(word) && theirs != word) {
    report_mismatch(site, static_cast<int32_t>(p), word, theirs);
  }
}

// Block 0's thread p tells peer p which call this is (block 0 runs first, even where the grids of
// ranks sharing a GPU cannot all be resident). Call at the kernel's start.
DOORBELL_DEVICE_INLINE void announce_call(const CallCheck& c, uint32_t rank, uint32_t world) {
  const uint32_t p = threadIdx.x;
  if (c.word != 0 && blockIdx.x == 0 && p < world && p != rank) {
    announce_call_to(c.inbox[p] + (c.word & 1) * kMaxRanks + rank, c.word);
  }
}

// Checker thread p checks that peer p makes the same call. Call at the kernel's end.
// `every_pair_exchanges`: every rank's call needs data from every other rank (allreduce, all-to-all
// of equal blocks), so peer p has announced this call by now and any other index is a mismatch.
// Otherwise (all-to-all of variable blocks, where a pair may exchange nothing and a rank may run
// calls ahead of a peer it does not depend on) the slot is only compared when it holds this call's
// key: the check never makes a rank wait for a peer it would not have waited for.
DOORBELL_DEVICE_INLINE void check_call(const CallCheck& c, uint32_t rank, uint32_t world, const WaitSite& site,
                                       bool every_pair_exchanges = true) {
  uint32_t p;
  if (c.word != 0 && call_checker(world, p) && p != rank) {
    check_call_of(c.inbox[rank] + (c.word & 1) * kMaxRanks + p, c.word, p, site, every_pair_exchanges);
  }
}

#endif  // DOORBELL_CUDA
}  // namespace doorbell
