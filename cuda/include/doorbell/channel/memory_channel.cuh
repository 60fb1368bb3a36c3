// doorbell device API, channel tier: MemoryChannel, a channel over NVLink (or PCIe peer access)
// driven by loads and stores of GPU threads.
//
// A channel joins my rank to one peer. It holds:
//   dst            the peer's buffer, mapped into my address space (puts land here)
//   src            my buffer (puts read from here, gets land here)
//   packet_buffer         my packet landing zone: the peer's put_packets write here
//   remote_packet_buffer  the peer's packet landing zone, mapped: my put_packets write there
//   semaphore      the signal/wait pair between the two of us
// Protocol for a bulk transfer: all writer threads put(), synchronize (__syncthreads or a grid
// barrier), one thread signal()s; on the peer one thread wait()s, then synchronizes its block
// before reading. For small transfers, put_packets()/unpack_packets() need no signal at all.
//
// Offsets are bytes. Ranges are the caller's responsibility on the device (checking them costs
// cycles on every call); the host checks them when it builds launch arguments.
#pragma once

#include "../core/copy.cuh"
#include "../core/packet.cuh"
#include "semaphore.cuh"

namespace doorbell {

struct MemoryChannelHandle {
  SemaphoreHandle semaphore;
  void* dst;
  void* src;
  void* packet_buffer;
  void* remote_packet_buffer;
  uint64_t dst_bytes;
  uint64_t src_bytes;
  uint64_t packet_buffer_bytes;

#if DOORBELL_CUDA
  // Copies `bytes` from my src + src_off to the peer's dst + dst_off.
  DOORBELL_DEVICE_INLINE void put(uint64_t dst_off, uint64_t src_off, uint64_t bytes, uint32_t tid,
                                  uint32_t nthreads) const {
    copy(static_cast<char*>(dst) + dst_off, static_cast<const char*>(src) + src_off, bytes, tid, nthreads);
  }

  // Copies `bytes` from the peer's dst + remote_off to my src + local_off.
  DOORBELL_DEVICE_INLINE void get(uint64_t remote_off, uint64_t local_off, uint64_t bytes, uint32_t tid,
                                  uint32_t nthreads) const {
    copy(static_cast<char*>(src) + local_off, static_cast<const char*>(dst) + remote_off, bytes, tid, nthreads);
  }

  DOORBELL_DEVICE_INLINE void signal() const { semaphore.signal(); }
  DOORBELL_DEVICE_INLINE void relaxed_signal() const { semaphore.relaxed_signal(); }
  DOORBELL_DEVICE_INLINE void wait(uint64_t count = 1) const { semaphore.wait(count); }
  DOORBELL_DEVICE_INLINE bool poll() const { return semaphore.poll(); }

  // Wraps `bytes` from my src + src_off into packets written at the peer's packet buffer +
  // packet_off (bytes; the area must hold packets_for<Packet>(bytes) packets). Both packet buffers
  // have the same size.
  template <typename Packet>
  DOORBELL_DEVICE_INLINE void put_packets(uint64_t packet_off, uint64_t src_off, uint64_t bytes, uint32_t flag,
                                          uint32_t tid, uint32_t nthreads) const {
    copy_to_packets(reinterpret_cast<Packet*>(static_cast<char*>(remote_packet_buffer) + packet_off),
                    static_cast<const char*>(src) + src_off, bytes, flag, tid, nthreads);
  }

  // Waits for packets carrying `flag` at my packet_buffer + packet_off and unpacks `bytes` of
  // payload into my src + local_off.
  template <typename Packet>
  DOORBELL_DEVICE_INLINE void unpack_packets(uint64_t local_off, uint64_t packet_off, uint64_t bytes, uint32_t flag,
                                             uint32_t tid, uint32_t nthreads) const {
    copy_from_packets(static_cast<char*>(src) + local_off,
                      reinterpret_cast<const Packet*>(static_cast<const char*>(packet_buffer) + packet_off), bytes,
                      flag, tid, nthreads, semaphore.site);
  }
#endif
};
DOORBELL_CHECK_SIZE(MemoryChannelHandle, 120);

}  // namespace doorbell
