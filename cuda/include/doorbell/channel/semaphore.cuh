// doorbell device API, channel tier: device-to-device semaphores.
//
// Protocol (tokens are monotonic 64-bit counters, never reset, so CUDA-graph replays stay right):
//   - Each side owns an inbound token in its own GPU memory. The peer signals by adding 1 to it
//     over NVLink with a release reduction (red.release.sys), which orders every write the
//     signalling thread made before it.
//   - The owner keeps a private count of signals it has consumed (`expected_inbound`, device
//     memory of the owner, touched by no one else). wait() takes the next number from it and spins
//     with acquire loads until the inbound token reaches it; data the peer wrote before signalling
//     is then visible to the waiting thread.
//   - A thread that signals orders only its own earlier writes. When many threads wrote the data,
//     synchronize them first (__syncthreads, or a grid barrier) and signal from one thread.
#pragma once

#include "../core/wait.cuh"

namespace doorbell {

struct SemaphoreHandle {
  uint64_t* inbound_token;         // mine: the peer adds to it
  uint64_t* expected_inbound;      // mine, private: signals consumed so far
  uint64_t* remote_inbound_token;  // the peer's inbound token for me, mapped into my address space
  WaitSite site;

#if DOORBELL_CUDA
  // Tells the peer that this thread's earlier writes are done.
  DOORBELL_DEVICE_INLINE void signal() const { red_add_release_sys(remote_inbound_token, 1); }

  // Counts a signal without ordering any data (execution synchronization only).
  DOORBELL_DEVICE_INLINE void relaxed_signal() const { red_add_relaxed_sys(remote_inbound_token, 1); }

  // True if a signal not yet consumed has arrived; consumes it.
  DOORBELL_DEVICE_INLINE bool poll() const {
    const uint64_t next = *expected_inbound + 1;
    if (load_acquire_sys(inbound_token) < next) return false;
    *expected_inbound = next;
    return true;
  }

  // Waits for the next `count` signals (bounded; see core/wait.cuh). Several threads may wait at
  // once; each consumes the signals it asked for. False when the wait gave up (the communicator
  // aborted, or the budget ran out and was reported): what the signals guard never came, and an
  // output that depends on it is to be marked (core/copy.cuh's mark_missing).
  DOORBELL_DEVICE_INLINE bool wait(uint64_t count = 1) const {
    const uint64_t expected = fetch_add_relaxed_gpu(expected_inbound, count) + count;
    return spin_until(site, kWaitSemaphore, expected, [&](uint64_t& seen) {
      seen = load_acquire_sys(inbound_token);
      return seen >= expected;
    });
  }
#endif
};
DOORBELL_CHECK_SIZE(SemaphoreHandle, 64);

}  // namespace doorbell
