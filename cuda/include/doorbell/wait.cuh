// doorbell device API: bounded waits and the abort word.
//
// No spin loop in doorbell is unbounded, and none outlives a failed job. Each one polls a
// condition; after the first miss it starts a clock (the GPU's global timer, nanoseconds) and, every
// 64 polls, looks at the clock and, about every 65 us of waiting, at the communicator's abort word.
// Two things end a wait early:
//   - the abort word is set: the host's watchdog sets it when a peer died, stopped answering, or
//     relayed its own failure, or the user called Communicator::abort(). A wait reads it once it
//     has waited 33 us, then every 66 us (a host-memory read costs a PCIe round trip, which
//     healthy short waits must not pay), and returns with its condition unmet; it also copies it
//     into the claim word in device memory, which every wait reads beside its first poll, so
//     every later wait of the communicator (queued kernels and graph replays too) leaves at its
//     first miss. The kernel runs on to its end. Results are garbage and the host call that
//     follows returns Error::PeerFailed.
//   - the budget runs out: the first waiter of the communicator to give up claims its WaitReport,
//     writes who waited (rank, peer, channel, block, thread) for what (kind, expected and last seen
//     value, time waited), then sets the abort word itself, so every other wait of the
//     communicator leaves too, and returns. The host reads the report and returns Error::Timeout
//     with those fields; its watchdog relays the report to the other ranks, whose waits leave in
//     turn and whose calls name this rank and its report.
// Nothing traps: the CUDA context stays usable, so survivors can drop the communicator and build a
// new one (Communicator::shrink) in the same process.
//
// Protocol of the report (one per communicator, host-mapped):
//   claim word (device memory): bit 0 clear = free; the giver-up sets it with atomicOr, so exactly
//   one writes (bit 1 claims the mismatch record, bit 2 is the device's copy of the abort word).
//   fields written with plain stores, then __threadfence_system(), then `valid` = 1 with a release
//   store. The host trusts the fields only when `valid` == 1.
//   mismatch record: the same, claimed by bit 1 of the claim word, so a call found to differ is
//   named even after a wait of the same call timed out (a mismatch often makes waits time out).
//   `abort`: 0 while the job is healthy; nonzero once anyone (host or device) gave up. Written by
//   the host with a plain store, or by a device giver-up after `valid`; read here with an acquire
//   load. Never cleared: an aborted communicator is dropped, not reused.
#pragma once

#include "atomics.cuh"

namespace doorbell {

// What a wait was waiting for; mirrored by WaitKind in src/error.rs.
enum WaitKindCode : uint32_t {
  kWaitSemaphore = 1,
  kWaitPacket = 2,
  kWaitFifoSlot = 3,
  kWaitFlush = 4,
  kWaitProxyStopped = 5,  // the proxy service stopped while a kernel depended on it
  kWaitBadTrigger = 6,    // a trigger field out of range (not a wait: reported the same way)
  kWaitBadInput = 7,      // a kernel input out of range: expected = the limit, seen = the value
  kWaitIbProgress = 8,    // a queue pair's progress: room in its send queue, in-order publishing, CQEs
  kWaitIbError = 9,       // an error CQE (not a wait): expected = the WQE's index, seen = the syndrome
  kWaitArgMismatch = 10,  // a peer made another call (not a wait): expected = my call word, seen = the peer's
};

// Written once, by the first waiter of the process that gives up. Lives in host-mapped pinned memory.
struct WaitReport {
  uint32_t valid;  // 1 once every other field is written
  uint32_t what;   // WaitKindCode
  int32_t rank;
  int32_t peer;
  uint32_t channel;
  uint32_t block;
  uint32_t thread;
  uint32_t reserved;
  uint64_t expected;
  uint64_t seen;
  uint64_t waited_ns;
  uint32_t abort;             // nonzero: leave every wait (see the protocol above)
  int32_t mismatch_peer;      // the first peer found making another call (see call_check.cuh)
  uint64_t mismatch_mine;     // this rank's call word
  uint64_t mismatch_theirs;   // that peer's call word
  uint32_t mismatch_valid;    // 1 once the three fields above are written
  uint32_t mismatch_reserved;
};
DOORBELL_CHECK_SIZE(WaitReport, 88);

// Who is waiting: copied into every handle that can wait, so a report names its wait site.
struct WaitSite {
  WaitReport* report;   // host-mapped, device pointer
  uint32_t* claim;      // device memory, 0 until someone gives up
  uint64_t budget_ns;   // how long one wait may spin
  int32_t rank;         // the waiting rank
  int32_t peer;         // who it waits for (-1: not one peer)
  uint32_t channel;     // channel or semaphore id
  uint32_t reserved;
};
DOORBELL_CHECK_SIZE(WaitSite, 40);

#if DOORBELL_CUDA

// Bits of the claim word (device memory): the report's claim, the mismatch record's claim, and
// the device's copy of the abort word, which every wait reads at its first miss (an L2 read,
// issued beside the first poll) so that once one wait has seen the abort, every later wait of the
// communicator, in this kernel or in kernels queued behind it, leaves at once.
constexpr uint32_t kClaimReport = 1u;
constexpr uint32_t kClaimMismatch = 2u;
constexpr uint32_t kClaimAborted = 4u;

// True once the communicator of `site` aborted. A PCIe read: call it rarely.
DOORBELL_DEVICE_INLINE bool aborted(const WaitSite& site) {
  return site.report != nullptr && load_acquire_sys(const_cast<const uint32_t*>(&site.report->abort)) != 0u;
}

// Records a failure (if this thread is the first to give up in the communicator) and sets the
// abort word, so every other wait of the communicator leaves. Returns.
static __noinline__ __device__ void report_failure(const WaitSite& site, uint32_t what, uint64_t expected, uint64_t seen,
                                                   uint64_t waited_ns) {
  if (site.report == nullptr) return;
  if (site.claim != nullptr && (atomicOr(site.claim, kClaimReport | kClaimAborted) & kClaimReport) == 0u) {
    volatile WaitReport* r = site.report;
    r->what = what;
    r->rank = site.rank;
    r->peer = site.peer;
    r->channel = site.channel;
    r->block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    r->thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    r->reserved = 0;
    r->expected = expected;
    r->seen = seen;
    r->waited_ns = waited_ns;
    __threadfence_system();
    store_release_sys(const_cast<uint32_t*>(&site.report->valid), 1u);
  }
  store_release_sys(const_cast<uint32_t*>(&site.report->abort), 1u);
  __threadfence_system();
}

// Records that `peer` made another call than this rank (the first such finding of the
// communicator) and aborts, like report_failure.
static __noinline__ __device__ void report_mismatch(const WaitSite& site, int32_t peer, uint64_t mine,
                                                    uint64_t theirs) {
  if (site.report == nullptr) return;
  if (site.claim != nullptr && (atomicOr(site.claim, kClaimMismatch | kClaimAborted) & kClaimMismatch) == 0u) {
    volatile WaitReport* r = site.report;
    r->mismatch_peer = peer;
    r->mismatch_mine = mine;
    r->mismatch_theirs = theirs;
    __threadfence_system();
    store_release_sys(const_cast<uint32_t*>(&site.report->mismatch_valid), 1u);
  }
  store_release_sys(const_cast<uint32_t*>(&site.report->abort), 1u);
  __threadfence_system();
}

// For checks after which the thread cannot go on (an index out of range, an error completion):
// reports as above and ends this thread. Other threads of the block are not held up: a thread
// that exits counts as arrived at every later __syncthreads. Nothing traps.
static __noinline__ __device__ void wait_gave_up(const WaitSite& site, uint32_t what, uint64_t expected, uint64_t seen,
                                                 uint64_t waited_ns) {
  report_failure(site, what, expected, seen, waited_ns);
  asm volatile("exit;");
}

// A wait reads the abort word after this long, then every kAbortCheckPeriodNs.
constexpr uint64_t kFirstAbortCheckNs = uint64_t(1) << 15;  // 33 us
constexpr uint64_t kAbortCheckPeriodNs = uint64_t(1) << 16; // 66 us

// Spins until `poll(seen)` returns true, and returns true; returns false when the wait gave up (its
// budget ran out, reported) or the communicator aborted. `poll` writes the last value it saw into
// `seen`, which goes into the report. The clock starts after the first miss, so a wait that is
// already satisfied costs one poll. Callers may ignore the result: after a false return the kernel
// only has to reach its end without touching memory out of range, and every later wait returns
// within 64 polls.
template <typename Poll>
DOORBELL_DEVICE_INLINE bool spin_until(const WaitSite& site, uint32_t what, uint64_t expected, Poll poll) {
  uint64_t seen = 0;
  // Issued before the first poll and used only after a miss: a satisfied wait never waits for it.
  const uint32_t claim = site.claim != nullptr ? load_relaxed_gpu(site.claim) : 0u;
  if (poll(seen)) return true;
  if (claim & kClaimAborted) return false;
  const uint64_t start = global_timer_ns();
  // The abort word is in host memory: a read costs a PCIe round trip (1-2 us) during which the
  // thread does not see its condition come true, so healthy short waits never read it.
  uint64_t next_abort_check = kFirstAbortCheckNs;
  for (uint32_t i = 1;; ++i) {
    if (poll(seen)) return true;
    if ((i & 63) == 0) {
      const uint64_t waited = global_timer_ns() - start;
      if (waited >= next_abort_check) {
        next_abort_check = waited + kAbortCheckPeriodNs;
        if (aborted(site)) {
          if (site.claim != nullptr) atomicOr(site.claim, kClaimAborted);
          return false;
        }
      }
      if (waited > site.budget_ns) {
        report_failure(site, what, expected, seen, waited);
        return false;
      }
    }
  }
}

#endif  // DOORBELL_CUDA
}  // namespace doorbell
