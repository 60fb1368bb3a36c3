// doorbell device API, coll tier: call agreement, on by default, at one store and one load per
// peer and call.
//
// Every collective call carries a 64-bit call word that names it: call index, collective, element
// type, algorithm, operation and count (made by src/host/gpu/signature.rs; bit 63 marks a word as
// written, so a zeroed slot reads as "nothing yet"). Each rank has an inbox of kInboxWords words in
// its collective's scratch (zeroed at allocation): [kSlotRing][kMaxRanks] slots its peers write,
// mapped by them, then two rows of counters only this rank touches: for each peer p, how many
// calls it announced to p and how many it checked against p. The callers are doorbell's collective
// kernels and the MoE calls of this tier (finish_send announces, the receive half checks); the
// host makes the word and reads the report.
//
// Who: block 0's thread p announces (block 0 is scheduled first, so a peer sees the word even
// where the grids of ranks sharing a GPU cannot all be resident); the last `world` threads of the
// last block check, thread p for peer p (the "checker" threads): small messages give them no
// data to move, so their check runs beside the data path instead of after it, and large ones
// hide its one load in their length.
//
// Protocol (for each peer p != rank), n = this call's ordinal among the object's checked calls:
//   start of the kernel, block 0's thread p: store my word into peer p's inbox slot [n % 4][rank]
//     (relaxed; the reader only compares it, nothing is read under its protection).
//   end of the kernel, checker thread p, after its own share of the work: wait (bounded,
//     abort-aware) until my inbox slot [n % 4][p] holds a word with this call's key (index and
//     graph bit), and compare it with mine. A different word is reported as a mismatch (WaitReport's mismatch
//     record) and aborts the communicator, so the host call returns Error::ArgumentMismatch
//     naming both calls. A peer that skipped or repeated a call never shows this key: its waits
//     and this one give up at the budget (Error::Timeout naming it).
// Pair counts (alltoallv): blocks differ by pair, so the word carries no count; instead the
// announcing thread first stores, into peer p's inbox, the bytes it sends p and the bytes it
// expects from p ([2 parities][kMaxRanks][2] words after the counters, same parity), then the word
// with a release store. The checker reads them after the word with this call's key (acquire) and
// compares both directions; either pair disagreeing is reported with all four numbers on both
// ranks (each checks the pair from its side). The word's index is the device's call count
// (device_indexed), so graph replays are told apart too, and every call waits for every peer's word
// of that same call: a rank never runs a call ahead of any peer, which is what lets alltoallv reuse
// per-pair packet areas.
// Why four slots, and why n is counted on the device: above check_slot below.
// Cost: the store is fire-and-forget and the load at the end normally finds the word already there
// (the peer's data arrived, so the peer had started): nothing on the critical path; the counters
// are one load and one store of this rank's memory each.
#pragma once

#include "../core/wait.cuh"

namespace doorbell {

// Most ranks a single-node collective kernel handles.
constexpr uint32_t kMaxRanks = 8;

// Words of one rank's inbox: [kSlotRing][kMaxRanks] slots, then [kMaxRanks] counts of calls
// announced to each peer and [kMaxRanks] counts of calls checked against each peer, then
// [2][kMaxRanks][2] pair byte counts (send, receive) its peers write (signature::INBOX_BYTES).
constexpr uint32_t kSlotRing = 4;
constexpr uint32_t kInboxWords = 10 * kMaxRanks;
constexpr uint32_t kAnnouncedCounts = kSlotRing * kMaxRanks, kCheckedCounts = kAnnouncedCounts + kMaxRanks,
                   kPairCounts = kCheckedCounts + kMaxRanks;

// Launch-argument member of every checked collective.
struct CallCheck {
  uint64_t word;                // this call's word; 0: no check (the kernel runs unchecked)
  uint64_t* inbox[kMaxRanks];   // every rank's inbox (kInboxWords words), mapped here (own at [rank])
};
DOORBELL_CHECK_SIZE(CallCheck, 72);

#if DOORBELL_CUDA

// A call's key: its index, whether it was captured in a graph (bit 62), and the written bit (63:
// an empty slot has no key). Replays reuse the indices they were captured with, so words are
// compared only when their keys are equal.
DOORBELL_DEVICE_INLINE uint64_t call_key(uint64_t word) { return word & (0xffffull | (3ull << 62)); }

// A pair-count call's word carries the device's count of calls (announced to or checked against
// the peer; the two agree when the ranks made the same calls) instead of the host's index: graph
// replays reuse the captured index, so a slot still holding the word of the replay before last
// would pass for this one, with that replay's counts, which may have changed since.
DOORBELL_DEVICE_INLINE uint64_t device_indexed(uint64_t word, uint64_t n) {
  return (word & ~0xffffull) | (n & 0xffffull);
}

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
// `own`: this rank's inbox; `theirs`: peer p's, mapped here. Each count is read and advanced by
// one thread only (block 0's thread p, or checker thread p), once per call; the next kernel reads
// it after this one ended.
static __noinline__ __device__ void announce_call_to(uint64_t* own, uint64_t* theirs, uint32_t p, uint32_t rank,
                                                     uint64_t word, bool pair, uint64_t send, uint64_t recv) {
  const uint64_t n = own[kAnnouncedCounts + p];
  if (pair) {
    store_relaxed_sys_v2(theirs + kPairCounts + ((n & 1) * kMaxRanks + rank) * 2, send, recv);
    store_release_sys(theirs + (n % kSlotRing) * kMaxRanks + rank, device_indexed(word, n));
  } else {
    store_relaxed_sys(theirs + (n % kSlotRing) * kMaxRanks + rank, word);
  }
  own[kAnnouncedCounts + p] = n + 1;
}

// The slot is picked by n, counted on the device (each announcing and checking thread keeps its
// own count per peer, so no two threads share one), not by the host's call index: a CUDA graph
// replays the indices it captured, so unless a graph held a multiple of four calls the first call
// of a replay would share a slot with a call just before it, and a peer one call ahead would
// overwrite the slot this rank is about to check (the check then waited for a word that never
// came).
// Why four slots suffice: a call split into a send and a receive half (MoE low latency) is
// checked in its receive half, and up to two such calls may be in flight (two sends, then their
// receive halves in send order: DeepEP's double buffer; the host refuses a third, and receive
// halves out of order). Peer p writes call n+4's word into slot [n % 4][rank] only after its
// receive half of call n+2 passed, which needs this rank's word of call n+2, which this rank
// announces only after its receive half of call n (at most two in flight). So while call n's
// check runs, the slot holds call n-4's word (wait) or call n's. With one call in flight two
// slots would do (call n+2 needs this rank's data of n+1, sent after call n ended); with two in
// flight, two slots were measured to deadlock (2026-11-26, 2 x H100: a peer's call n+2 overwrote call n's
// word before this rank's receive half read it).
// Graph replays reuse their captured words; a slot already holding this call's key from an
// earlier replay (call n-4 captured as the same call) makes the check pass at once (the words
// were compared at the first replay).
//
// Checks call n (this rank's ordinal of it) against peer p's word in slot n. `later_passes`
// (device-indexed words only): a word of a later call in the slot means the peer passed call n
// and overwrote its word; the check then passes without comparing (the peer's own check of call
// n compares both words, so a mismatch is still reported there).
static __noinline__ __device__ void check_slot(uint64_t* own, uint64_t word, uint64_t n, uint32_t p, WaitSite site,
                                               bool pair, uint64_t send, uint64_t recv, bool later_passes) {
  site.peer = static_cast<int32_t>(p);
  const uint64_t* slot = own + (n % kSlotRing) * kMaxRanks + p;
  uint64_t theirs = 0;
  bool passed = false;
  spin_until(site, kWaitArgMismatch, word, [&](uint64_t& seen) {
    seen = load_relaxed_sys(slot);
    theirs = seen;
    if (call_key(seen) == call_key(word)) return true;
    passed = later_passes && (seen >> 63) != 0 && ((seen - n) & 0xffffull) - 1 < 0x7fffull;
    return passed;
  });
  if (passed || call_key(theirs) != call_key(word)) return;  // passed, gave up (reported) or aborted
  if (theirs != word) {
    report_mismatch(site, static_cast<int32_t>(p), word, theirs);
    return;
  }
  if (!pair) return;
  // The word came with a release store after the counts: acquire it, then read them.
  load_acquire_sys(slot);
  const uint64_t* counts = own + kPairCounts + ((n & 1) * kMaxRanks + p) * 2;
  const uint64_t their_send = load_relaxed_sys(counts), their_recv = load_relaxed_sys(counts + 1);
  if (their_send != recv || their_recv != send) {
    report_mismatch(site, static_cast<int32_t>(p), word, theirs, true, send, recv, their_send, their_recv);
  }
}

// The next call's check against peer p: its ordinal is this rank's count of calls checked.
static __noinline__ __device__ void check_call_of(uint64_t* own, uint64_t word, uint32_t p, WaitSite site,
                                                  bool pair, uint64_t send, uint64_t recv) {
  const uint64_t n = own[kCheckedCounts + p];
  own[kCheckedCounts + p] = n + 1;
  check_slot(own, pair ? device_indexed(word, n) : word, n, p, site, pair, send, recv, false);
}

// Block 0's thread p tells peer p which call this is (block 0 runs first, even where the grids of
// ranks sharing a GPU cannot all be resident). Call at the kernel's start, once per call (a second
// announce of the same call would count as the next one).
DOORBELL_DEVICE_INLINE void announce_call(const CallCheck& c, uint32_t rank, uint32_t world) {
  const uint32_t p = threadIdx.x;
  if (c.word != 0 && blockIdx.x == 0 && p < world && p != rank) {
    announce_call_to(c.inbox[rank], c.inbox[p], p, rank, c.word, false, 0, 0);
  }
}

// announce_call with the pair's byte counts: `counts` is alltoallv's [4][world] array (send
// counts, send offsets, receive counts, receive offsets).
DOORBELL_DEVICE_INLINE void announce_call_counts(const CallCheck& c, uint32_t rank, uint32_t world,
                                                 const uint64_t* counts) {
  const uint32_t p = threadIdx.x;
  if (c.word != 0 && blockIdx.x == 0 && p < world && p != rank) {
    announce_call_to(c.inbox[rank], c.inbox[p], p, rank, c.word, true, counts[p], counts[2 * world + p]);
  }
}

// Checker thread p waits (bounded) for peer p's word of this call and checks that it made the same
// call. Call at the kernel's end, once per call. Every checked collective waits so: in most, every
// rank's call needs data from every other rank anyway, so the word is there by then; in alltoallv,
// where a pair may exchange nothing, the wait is what keeps ranks in step (see the pair counts).
DOORBELL_DEVICE_INLINE void check_call(const CallCheck& c, uint32_t rank, uint32_t world, const WaitSite& site) {
  uint32_t p;
  if (c.word != 0 && call_checker(world, p) && p != rank) {
    check_call_of(c.inbox[rank], c.word, p, site, false, 0, 0);
  }
}

// check_call with the pair's byte counts (see announce_call_counts): always waits for peer p's
// word, then compares what each side sends with what the other expects.
DOORBELL_DEVICE_INLINE void check_call_counts(const CallCheck& c, uint32_t rank, uint32_t world, const WaitSite& site,
                                              const uint64_t* counts) {
  uint32_t p;
  if (c.word != 0 && call_checker(world, p) && p != rank) {
    check_call_of(c.inbox[rank], c.word, p, site, true, counts[p], counts[2 * world + p]);
  }
}

// Calls made of two kernels (MoE low latency: a send half, then a receive half; up to two calls
// in flight, their receive halves in any order). Their words carry the call's ordinal n (the
// device's count, device_indexed), as do the whole calls of the same object, so a rank that sends
// and receives in two kernels and a peer that runs both in one still agree.
// The send half's block 0 thread p announces call n, advances both counts (so the next whole
// call's checker, which reads the checked count, finds its own ordinal) and, for the first peer,
// leaves n in `keep` and `keep2` (either may be null: a ticket, the object's last-send word)
// where its receive half finds it. `masked` ([world], or null): a masked peer (MoE low latency's
// rank mask) is told nothing and not checked, but its counts advance like every peer's.
DOORBELL_DEVICE_INLINE void announce_split_call(const CallCheck& c, uint32_t rank, uint32_t world, uint64_t* keep,
                                                uint64_t* keep2, const uint32_t* masked = nullptr) {
  const uint32_t p = threadIdx.x;
  if (c.word == 0 || blockIdx.x != 0 || p >= world || p == rank) return;
  uint64_t* own = c.inbox[rank];
  const uint64_t n = own[kAnnouncedCounts + p];
  if (masked != nullptr && masked[p] != 0u) {
    own[kAnnouncedCounts + p] = n + 1;
  } else {
    announce_call_to(own, c.inbox[p], p, rank, device_indexed(c.word, n), false, 0, 0);
  }
  own[kCheckedCounts + p] = n + 1;
  if (p == (rank + 1) % world) {
    if (keep != nullptr) *keep = n;
    if (keep2 != nullptr) *keep2 = n;
  }
}

// A whole call of such an object (both halves in one kernel): block 0 announces ordinal n, the
// announced count; the checkers check n, the checked count (equal at every kernel boundary).
DOORBELL_DEVICE_INLINE void announce_indexed_call(const CallCheck& c, uint32_t rank, uint32_t world,
                                                  const uint32_t* masked = nullptr) {
  const uint32_t p = threadIdx.x;
  if (c.word == 0 || blockIdx.x != 0 || p >= world || p == rank) return;
  uint64_t* own = c.inbox[rank];
  if (masked != nullptr && masked[p] != 0u) {
    own[kAnnouncedCounts + p] += 1;
    return;
  }
  announce_call_to(own, c.inbox[p], p, rank, device_indexed(c.word, own[kAnnouncedCounts + p]), false, 0, 0);
}

// The check of a call announced by announce_split_call (`ordinal`: what the send half kept) or,
// with `ordinal` null, by announce_indexed_call. Checker threads only; the wait is bounded.
DOORBELL_DEVICE_INLINE void check_indexed_call(const CallCheck& c, uint32_t rank, uint32_t world, const WaitSite& site,
                                               const uint64_t* ordinal, const uint32_t* masked = nullptr) {
  uint32_t p;
  if (c.word == 0 || !call_checker(world, p) || p == rank) return;
  uint64_t* own = c.inbox[rank];
  uint64_t n;
  if (ordinal != nullptr) {
    n = *ordinal;
  } else {
    n = own[kCheckedCounts + p];
    own[kCheckedCounts + p] = n + 1;
  }
  if (masked != nullptr && masked[p] != 0u) return;
  check_slot(own, device_indexed(c.word, n), n, p, site, false, 0, 0, true);
}

#endif  // DOORBELL_CUDA
}  // namespace doorbell
