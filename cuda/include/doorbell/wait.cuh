// doorbell device API: bounded waits.
//
// No spin loop in doorbell is unbounded. Each one polls a condition, and after the first miss
// starts a clock (the GPU's global timer, nanoseconds). When the budget runs out, the first waiter
// of the process to give up claims the process's WaitReport, writes who waited (rank, peer,
// channel, block, thread) for what (kind, expected and last seen value, time waited) into
// host-mapped memory, fences, and traps. The trap ends every kernel of the context; the host sees
// the launch fail, reads the report (host memory stays readable after a trap) and returns
// Error::Timeout with those fields. Peers that were waiting on this rank time out in turn and report
// their own side, so every rank of a broken job says what it was stuck on.
//
// Protocol of the report (one per process):
//   claim word (device memory): 0 = free; the giver-up CASes it 0 -> 1, so exactly one writes.
//   WaitReport (host-mapped): fields written with plain stores, then __threadfence_system(), then
//   `valid` = 1 with a release store. The host trusts the fields only when `valid` == 1.
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
};
DOORBELL_CHECK_SIZE(WaitReport, 56);

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

// Records the failed wait (if this thread is the first to give up in the process) and traps.
static __noinline__ __device__ void wait_gave_up(const WaitSite& site, uint32_t what, uint64_t expected, uint64_t seen,
                                          uint64_t waited_ns) {
  if (site.claim != nullptr && site.report != nullptr && cas_relaxed_gpu(site.claim, 0u, 1u) == 0u) {
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
    __threadfence_system();
  }
  __trap();
}

// Spins until `poll(seen)` returns true. `poll` writes the last value it saw into `seen`, which
// goes into the report if the budget runs out. The clock starts after the first miss, so a wait
// that is already satisfied costs one poll.
template <typename Poll>
DOORBELL_DEVICE_INLINE void spin_until(const WaitSite& site, uint32_t what, uint64_t expected, Poll poll) {
  uint64_t seen = 0;
  if (poll(seen)) return;
  const uint64_t start = global_timer_ns();
  for (uint32_t i = 1;; ++i) {
    if (poll(seen)) return;
    if ((i & 63) == 0) {
      const uint64_t waited = global_timer_ns() - start;
      if (waited > site.budget_ns) wait_gave_up(site, what, expected, seen, waited);
    }
  }
}

#endif  // DOORBELL_CUDA
}  // namespace doorbell
