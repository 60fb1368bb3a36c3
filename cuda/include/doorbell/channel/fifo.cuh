// doorbell device API, channel tier: the device-to-host trigger FIFO (PortChannel ->
// ProxyService).
//
// Layout: `triggers` is a ring of 2^size_log2 32-byte slots in pinned host memory the GPU maps;
// `head` (device memory) counts positions claimed by pushers; `tail` (pinned host memory) counts
// positions the proxy has consumed; `tail_cache` (device memory) is the pushers' last look at it.
//
// Protocol:
//   push: pos = atomic add on head. If pos >= tail_cache + size the ring is full: poll tail
//     (bounded, with a short sleep between reads so thousands of waiting pushers do not flood
//     PCIe) until pos < tail + size; a wait that gives up writes nothing. Then one system-scope fence orders everything this thread
//     wrote before (data the proxy will copy) ahead of the trigger, and the slot is written as
//     two 16-byte stores, each carrying the commit bit: bit 63 of dst_offset and bit 63 of meta.
//     The commit bit is the lap parity of pos (lap 0 writes 1, lap 1 writes 0, ...), so no field
//     needs a reserved "empty" value and zeros are fine everywhere; pinned memory starts zeroed,
//     which reads as "not committed" on lap 0. Fencing before the stores, instead of making the
//     second store a release, keeps the fence from waiting for the first store to cross PCIe.
//   pop (host): the slot at tail is committed when both halves carry the parity it expects (each
//     16-byte store lands whole); the proxy then performs the trigger and publishes tail + 1. A
//     pusher can only reuse a slot after that, so a slot is never overwritten while the proxy
//     reads it.
//   Pushers learn their position, which flush() waits on.
// Sizes and source offsets are full 64-bit values, destination offsets 63-bit (transfers and
// offsets of 4 GiB and more work); memory and semaphore ids, and destination offsets, are
// range-checked on every push and a bad one traps with a report instead of being truncated.
#pragma once

#include "../core/wait.cuh"

namespace doorbell {

enum TriggerType : uint32_t {
  kTriggerData = 1,   // copy `size` bytes: src memory + src_offset -> dst memory + dst_offset
  kTriggerFlag = 2,   // add 1 to the peer's semaphore token, after the data before it
  kTriggerFlush = 4,  // report completion of everything before it at this position
};

// One trigger. `meta` bits: [0, 3) type, [3, 19) semaphore id, [19, 34) src memory id,
// [34, 49) dst memory id, [49, 63) zero, 63 commit parity. Bit 63 of dst_offset repeats the
// commit parity (the offset itself is the low 63 bits).
struct alignas(32) ProxyTrigger {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t size;
  uint64_t meta;
};
DOORBELL_CHECK_SIZE(ProxyTrigger, 32);

constexpr uint64_t kTriggerSemaphoreBits = 16;
constexpr uint64_t kTriggerMemoryBits = 15;

struct FifoHandle {
  ProxyTrigger* triggers;   // host-pinned ring, device pointer
  uint64_t* head;           // device memory
  const uint64_t* tail;     // host-pinned, written by the proxy
  uint64_t* tail_cache;     // device memory
  const uint32_t* stopped;  // host-pinned: nonzero once the proxy stopped
  uint32_t size_log2;
  uint32_t reserved;
  WaitSite site;

#if DOORBELL_CUDA
  DOORBELL_DEVICE_INLINE uint64_t seen_tail() const { return *reinterpret_cast<volatile uint64_t*>(tail_cache); }

  // Pushes one trigger; returns its position. Any thread may push; pushes never block each other
  // except when the ring is full.
  DOORBELL_DEVICE_INLINE uint64_t push(uint32_t type, uint32_t semaphore, uint32_t src_mem, uint64_t src_offset,
                                       uint32_t dst_mem, uint64_t dst_offset, uint64_t size) const {
    if (semaphore >> kTriggerSemaphoreBits || src_mem >> kTriggerMemoryBits || dst_mem >> kTriggerMemoryBits ||
        dst_offset >> 63) {
      wait_gave_up(site, kWaitBadTrigger, 0, (uint64_t(src_mem) << 32) | dst_mem, 0);
    }
    // The cached tail is loaded before the position is claimed so both trips to L2 overlap.
    const uint64_t cached_tail = *reinterpret_cast<volatile uint64_t*>(tail_cache);
    const uint64_t pos = fetch_add_relaxed_gpu(head, 1);
    const uint64_t capacity = uint64_t(1) << size_log2;
    if (pos >= cached_tail + capacity) {
      // The ring is full. Only pushers near its front read the host's tail (PCIe); they share
      // what they read through tail_cache in device memory, which everyone else polls with a
      // sleep, so thousands of waiting pushers cost a handful of PCIe reads.
      uint32_t polls = 0;
      bool stop = false;
      const bool room = spin_until(site, kWaitFifoSlot, pos - capacity + 1, [&](uint64_t& seen) {
        const uint64_t cached = *reinterpret_cast<volatile uint64_t*>(tail_cache);
        seen = cached;
        if (pos < cached + capacity) return true;
        ++polls;
        if (pos < cached + capacity + 32) {
          const uint64_t t = load_relaxed_sys(tail);
          atomicMax(reinterpret_cast<unsigned long long*>(tail_cache), static_cast<unsigned long long>(t));
          seen = t;
          if (pos < t + capacity) return true;
        } else {
          __nanosleep(1024);
        }
        if ((polls & 1023) == 0) stop = load_acquire_sys(stopped) != 0;
        return stop;
      });
      if (stop) wait_gave_up(site, kWaitProxyStopped, pos - capacity + 1, seen_tail(), 0);
      // The wait gave up (reported) or the communicator aborted: the slot is still the proxy's
      // to read, so it is left as it is; the caller's later waits return at once.
      if (!room) return pos;
    }
    ProxyTrigger* slot = triggers + (pos & (capacity - 1));
    const uint64_t parity = ((pos >> size_log2) & 1) ^ 1;
    const uint64_t meta = uint64_t(type & 7) | (uint64_t(semaphore) << 3) | (uint64_t(src_mem) << 19) |
                          (uint64_t(dst_mem) << 34) | (parity << 63);
    fence_acq_rel_sys();
    store_relaxed_sys_v2(&slot->src_offset, src_offset, dst_offset | (parity << 63));
    store_relaxed_sys_v2(&slot->size, size, meta);
    return pos;
  }
#endif
};
DOORBELL_CHECK_SIZE(FifoHandle, 88);

}  // namespace doorbell
