// doorbell device API, core tier: LL ("low latency") packets.
//
// A packet carries data and a flag in one store, so a reader that sees the expected flag has the
// data with it: no separate signal, no fence, one NVLink crossing. Callers pick a fresh flag per
// use of a buffer (an epoch kept in device memory and bumped every call), so buffers never need
// clearing and stale packets from an earlier call can never match.
//   LL16: {data1, flag1, data2, flag2}, 16 bytes carrying 8; written and read with one v4 access.
//         Each 8-byte half is checked, so it also survives transports that are only 8-byte atomic.
//   LL8:  {data, flag}, 8 bytes carrying 4; one v2 access.
#pragma once

#include "wait.cuh"

namespace doorbell {

struct alignas(16) LL16Packet {
  uint32_t data1;
  uint32_t flag1;
  uint32_t data2;
  uint32_t flag2;

  static constexpr uint32_t kPayload = 8;

#if DOORBELL_CUDA
  DOORBELL_DEVICE_INLINE void write(uint32_t lo, uint32_t hi, uint32_t flag) {
    store_volatile_v4(&data1, lo, flag, hi, flag);
  }
  DOORBELL_DEVICE_INLINE bool try_read(uint32_t& lo, uint32_t& hi, uint32_t flag, uint64_t& seen) const {
    uint32_t f1, f2;
    load_volatile_v4(&data1, lo, f1, hi, f2);
    seen = f1 != flag ? f1 : f2;
    return f1 == flag && f2 == flag;
  }
#endif
};
DOORBELL_CHECK_SIZE(LL16Packet, 16);

struct alignas(8) LL8Packet {
  uint32_t data;
  uint32_t flag;

  static constexpr uint32_t kPayload = 4;

#if DOORBELL_CUDA
  DOORBELL_DEVICE_INLINE void write(uint32_t lo, uint32_t /*hi*/, uint32_t f) { store_volatile_v2(&data, lo, f); }
  DOORBELL_DEVICE_INLINE bool try_read(uint32_t& lo, uint32_t& hi, uint32_t f, uint64_t& seen) const {
    uint32_t got;
    load_volatile_v2(&data, lo, got);
    hi = 0;
    seen = got;
    return got == f;
  }
#endif
};
DOORBELL_CHECK_SIZE(LL8Packet, 8);

#if DOORBELL_CUDA

// Loads up to 8 payload bytes at `src` (any alignment), zero-padding past `n`.
DOORBELL_DEVICE_INLINE void load_payload(const char* src, uint32_t n, uint32_t& lo, uint32_t& hi) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(src) & 7) == 0) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    lo = v.x;
    hi = v.y;
    return;
  }
  if ((n == 4 || n == 8) && (reinterpret_cast<uintptr_t>(src) & 3) == 0) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
    lo = w[0];
    hi = n == 8 ? w[1] : 0;
    return;
  }
  uint64_t v = 0;
  for (uint32_t i = 0; i < n; ++i) v |= uint64_t(static_cast<unsigned char>(src[i])) << (8 * i);
  lo = static_cast<uint32_t>(v);
  hi = static_cast<uint32_t>(v >> 32);
}

// Stores the first `n` of 8 payload bytes to `dst` (any alignment).
DOORBELL_DEVICE_INLINE void store_payload(char* dst, uint32_t n, uint32_t lo, uint32_t hi) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
    return;
  }
  if ((n == 4 || n == 8) && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
    uint32_t* w = reinterpret_cast<uint32_t*>(dst);
    w[0] = lo;
    if (n == 8) w[1] = hi;
    return;
  }
  const uint64_t v = uint64_t(lo) | (uint64_t(hi) << 32);
  for (uint32_t i = 0; i < n; ++i) dst[i] = static_cast<char>(v >> (8 * i));
}

// Number of packets that carry `bytes` of payload.
template <typename Packet>
DOORBELL_HOST_DEVICE_INLINE uint64_t packets_for(uint64_t bytes) {
  return (bytes + Packet::kPayload - 1) / Packet::kPayload;
}

// Wraps `bytes` from `src` into packets at `dst` (which may be a peer's buffer), cooperatively.
// The last packet is zero-padded when `bytes` is not a multiple of the payload.
template <typename Packet>
DOORBELL_DEVICE_INLINE void copy_to_packets(Packet* dst, const void* src, uint64_t bytes, uint32_t flag, uint32_t tid,
                                            uint32_t nthreads) {
  const char* s = static_cast<const char*>(src);
  const uint64_t n = packets_for<Packet>(bytes);
  for (uint64_t i = tid; i < n; i += nthreads) {
    const uint64_t off = i * Packet::kPayload;
    const uint64_t left = bytes - off;
    const uint32_t take = left < Packet::kPayload ? uint32_t(left) : Packet::kPayload;
    uint32_t lo, hi;
    load_payload(s + off, take, lo, hi);
    dst[i].write(lo, hi, flag);
  }
}

// What a packet wait that gave up (the communicator aborted) delivers instead of the slot's stale
// bytes: all ones, a NaN in f32, f16 and bf16 alike, so an output cut short by a fault cannot pass
// for a result (Error::PeerFailed or Timeout names the fault on the host).
constexpr uint32_t kMissingPayload = 0xFFFFFFFFu;

// Waits (bounded) for `bytes` of payload in packets at `src` carrying `flag`, and stores the data
// to `dst`, cooperatively. Only `bytes` bytes are written.
template <typename Packet>
DOORBELL_DEVICE_INLINE void copy_from_packets(void* dst, const Packet* src, uint64_t bytes, uint32_t flag, uint32_t tid,
                                              uint32_t nthreads, const WaitSite& site) {
  char* d = static_cast<char*>(dst);
  const uint64_t n = packets_for<Packet>(bytes);
  for (uint64_t i = tid; i < n; i += nthreads) {
    uint32_t lo = 0, hi = 0;
    if (!spin_until_packet(site, kWaitPacket, flag, [&](uint64_t& seen) { return src[i].try_read(lo, hi, flag, seen); })) {
      lo = hi = kMissingPayload;  // never came (the communicator aborted): marked, not stale bytes
    }
    const uint64_t off = i * Packet::kPayload;
    const uint64_t left = bytes - off;
    store_payload(d + off, left < Packet::kPayload ? uint32_t(left) : Packet::kPayload, lo, hi);
  }
}

#endif  // DOORBELL_CUDA
}  // namespace doorbell
