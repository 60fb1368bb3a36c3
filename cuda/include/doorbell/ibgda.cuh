// doorbell device API: mlx5 work requests built on the GPU (the IBGDA path). Byte layouts follow
// rdma-core's providers/mlx5/mlx5dv.h, exactly as src/rdma/wqe.rs builds them on the CPU (tests
// compare the two byte for byte; the CPU builder is itself compared with rdma-core's helpers).
//
// A send queue is a ring of 2^depth_log2 WQEBBs (64 bytes); a WQE is 16-byte DS units: control,
// then per opcode remote address, data, inline or atomic segments. Indices count WQEBBs, are
// 64-bit here and 16-bit in the control segment; a WQE that runs past the ring's end continues at
// its start, one 16-byte unit at a time, each written with a single 16-byte store. Multi-byte
// fields are big-endian; keys and addresses are taken in host order. The immediate of a write
// with immediate is taken as the 4 bytes to send (already in network order), as rdma-core does.
// Bytes of a WQE's last WQEBB past its DS units are not written (the NIC reads DS units only).
#pragma once

#include "common.cuh"

namespace doorbell {
namespace ib {

constexpr uint32_t kWqebb = 64;
constexpr uint32_t kDs = 16;

// Opcodes (MLX5_OPCODE_*).
constexpr uint8_t kOpNop = 0x00;
constexpr uint8_t kOpWrite = 0x08;
constexpr uint8_t kOpWriteImm = 0x09;
constexpr uint8_t kOpRead = 0x10;
constexpr uint8_t kOpCompareSwap = 0x11;
constexpr uint8_t kOpFetchAdd = 0x12;

// fm_ce_se bits.
constexpr uint8_t kCqUpdate = 2 << 2;
constexpr uint8_t kSolicited = 1 << 1;
constexpr uint8_t kFence = 4 << 5;
constexpr uint32_t kInlineSeg = 0x80000000u;

// Largest inline payload (a WQE of at most 4 WQEBBs), as rdma::wqe::MAX_INLINE.
constexpr uint32_t kMaxInline = 4 * kWqebb - 2 * kDs - 4;

#if DOORBELL_CUDA

DOORBELL_DEVICE_INLINE uint32_t bswap32(uint32_t x) { return __byte_perm(x, 0, 0x0123); }

// The 16-byte unit `u` of the WQE starting at WQEBB `idx` of a ring of 2^depth_log2 WQEBBs.
DOORBELL_DEVICE_INLINE uint4* unit(void* sq, uint32_t depth_log2, uint64_t idx, uint32_t u) {
  const uint64_t block = (idx + u / 4) & ((uint64_t(1) << depth_log2) - 1);
  return reinterpret_cast<uint4*>(static_cast<char*>(sq) + block * kWqebb + (u % 4) * kDs);
}

// Big-endian words of a 64-bit value, in memory order.
DOORBELL_DEVICE_INLINE uint32_t be_hi(uint64_t v) { return bswap32(uint32_t(v >> 32)); }
DOORBELL_DEVICE_INLINE uint32_t be_lo(uint64_t v) { return bswap32(uint32_t(v)); }

DOORBELL_DEVICE_INLINE uint4 ctrl_seg(uint64_t idx, uint8_t opcode, uint32_t qpn, uint32_t ds, uint8_t fm_ce_se,
                                      uint32_t imm) {
  return make_uint4(bswap32((uint32_t(idx & 0xffff) << 8) | opcode), bswap32(((qpn & 0xffffff) << 8) | (ds & 0x3f)),
                    uint32_t(fm_ce_se) << 24, imm);
}

DOORBELL_DEVICE_INLINE uint4 raddr_seg(uint64_t raddr, uint32_t rkey) {
  return make_uint4(be_hi(raddr), be_lo(raddr), bswap32(rkey), 0);
}

DOORBELL_DEVICE_INLINE uint4 data_seg(uint32_t len, uint32_t lkey, uint64_t addr) {
  return make_uint4(bswap32(len), bswap32(lkey), be_hi(addr), be_lo(addr));
}

DOORBELL_DEVICE_INLINE uint4 atomic_seg(uint64_t swap_add, uint64_t compare) {
  return make_uint4(be_hi(swap_add), be_lo(swap_add), be_hi(compare), be_lo(compare));
}

DOORBELL_DEVICE_INLINE void store_unit(uint4* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Each builder writes the WQE at `idx` and returns the WQEBBs it takes.

// RDMA WRITE (opcode kOpWrite), WRITE with immediate (kOpWriteImm) or READ (kOpRead): `len` bytes
// between local `laddr` (key `lkey`) and remote `raddr` (key `rkey`).
DOORBELL_DEVICE_INLINE uint32_t rdma_wqe(void* sq, uint32_t depth_log2, uint64_t idx, uint32_t qpn, uint8_t opcode,
                                         uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey,
                                         uint32_t len, uint32_t imm = 0) {
  store_unit(unit(sq, depth_log2, idx, 0), ctrl_seg(idx, opcode, qpn, 3, fm_ce_se, opcode == kOpWriteImm ? imm : 0));
  store_unit(unit(sq, depth_log2, idx, 1), raddr_seg(raddr, rkey));
  store_unit(unit(sq, depth_log2, idx, 2), data_seg(len, lkey, laddr));
  return 1;
}

// Fetch-and-add (kOpFetchAdd: `swap_add` is the addend) or compare-and-swap (kOpCompareSwap) on
// the 8 bytes at `raddr`; the old value lands at local `result` (key `lkey`).
DOORBELL_DEVICE_INLINE uint32_t atomic_wqe(void* sq, uint32_t depth_log2, uint64_t idx, uint32_t qpn, uint8_t opcode,
                                           uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey, uint64_t swap_add,
                                           uint64_t compare, uint64_t result, uint32_t lkey) {
  store_unit(unit(sq, depth_log2, idx, 0), ctrl_seg(idx, opcode, qpn, 4, fm_ce_se, 0));
  store_unit(unit(sq, depth_log2, idx, 1), raddr_seg(raddr, rkey));
  store_unit(unit(sq, depth_log2, idx, 2), atomic_seg(swap_add, opcode == kOpFetchAdd ? 0 : compare));
  store_unit(unit(sq, depth_log2, idx, 3), data_seg(8, lkey, result));
  return 1;
}

// RDMA WRITE of `len` (<= kMaxInline) bytes carried in the WQE.
DOORBELL_DEVICE_INLINE uint32_t inline_write_wqe(void* sq, uint32_t depth_log2, uint64_t idx, uint32_t qpn,
                                                 uint8_t fm_ce_se, uint64_t raddr, uint32_t rkey, const void* data,
                                                 uint32_t len) {
  const uint32_t ds = 2 + (4 + len + kDs - 1) / kDs;
  store_unit(unit(sq, depth_log2, idx, 0), ctrl_seg(idx, kOpWrite, qpn, ds, fm_ce_se, 0));
  store_unit(unit(sq, depth_log2, idx, 1), raddr_seg(raddr, rkey));
  // The inline segment: a 4-byte header, then the payload, zero-padded to whole units.
  const uint8_t* src = static_cast<const uint8_t*>(data);
  for (uint32_t u = 2; u < ds; ++u) {
    uint32_t w[4];
#pragma unroll
    for (uint32_t j = 0; j < 4; ++j) {
      const int32_t at = int32_t((u - 2) * kDs + j * 4) - 4;  // payload offset of this word
      uint32_t v = 0;
      if (at < 0) {
        v = bswap32(len | kInlineSeg);
      } else {
#pragma unroll
        for (uint32_t b = 0; b < 4; ++b) {
          if (uint32_t(at) + b < len) v |= uint32_t(src[at + b]) << (8 * b);
        }
      }
      w[j] = v;
    }
    store_unit(unit(sq, depth_log2, idx, u), make_uint4(w[0], w[1], w[2], w[3]));
  }
  return (ds * kDs + kWqebb - 1) / kWqebb;
}

DOORBELL_DEVICE_INLINE uint32_t nop_wqe(void* sq, uint32_t depth_log2, uint64_t idx, uint32_t qpn, uint8_t fm_ce_se) {
  store_unit(unit(sq, depth_log2, idx, 0), ctrl_seg(idx, kOpNop, qpn, 1, fm_ce_se, 0));
  return 1;
}

#endif  // DOORBELL_CUDA

}  // namespace ib
}  // namespace doorbell
