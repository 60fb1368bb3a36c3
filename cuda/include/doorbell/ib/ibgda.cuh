// doorbell device API, ib tier: mlx5 work requests built on the GPU (the IBGDA path). Byte layouts
// follow rdma-core's providers/mlx5/mlx5dv.h, exactly as src/host/transport/ib/posting/wqe.rs builds
// them on the CPU (tests compare the two byte for byte; the CPU builder is itself compared with
// rdma-core's helpers).
//
// A send queue is a ring of 2^depth_log2 WQEBBs (64 bytes); a WQE is 16-byte DS units: control,
// then per opcode remote address, data, inline or atomic segments. Indices count WQEBBs, are
// 64-bit here and 16-bit in the control segment; a WQE that runs past the ring's end continues at
// its start, one 16-byte unit at a time, each written with a single 16-byte store. Multi-byte
// fields are big-endian; keys and addresses are taken in host order. The immediate of a write
// with immediate is taken as the 4 bytes to send (already in network order), as rdma-core does.
// Bytes of a WQE's last WQEBB past its DS units are not written (the NIC reads DS units only).
#pragma once

#include "../core/atomics.cuh"
#include "../core/common.cuh"
#include "../core/wait.cuh"

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

// Largest inline payload (a WQE of at most 4 WQEBBs), as transport::ib::posting::wqe::MAX_INLINE.
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

// A gate that is always open (post_rows_warp's default).
struct NoGate {
#if DOORBELL_CUDA
  DOORBELL_DEVICE_INLINE void operator()(uint32_t) const {}
#endif
};

// A queue pair the GPU posts to. Many threads may post at once: each reserves WQEBBs (an atomic
// on `state[kReserved]`), writes its WQE, then publishes in reservation order (`state[kReady]`
// moves from its base to its end by compare-and-swap), and rings: under a lock, if the ready
// index passed what was rung, either (IBGDA) the doorbell record gets the new index and, after a
// system fence, the doorbell register gets `{index << 8, qpn << 8}` big-endian, or (CPU-assisted,
// `host_ready` set) the index is published to a host thread that does both. A poster whose WQEs
// someone else already rang returns without ringing (doorbells coalesce); one that finds nothing
// in its way publishes and takes the ring lock with two atomics in flight at once. Completions: a WQE
// that asks for a CQE records its size in `sizes` at its slot; one thread at a time consumes
// CQEs in order (owner bit by lap parity) and advances `state[kCompleted]` past each signaled
// WQE (the unsignaled ones before it completed too), publishing the CQ's consumer index. An
// error CQE is reported like a failed wait (kWaitIbError), which aborts the communicator; the
// poller stops there and returns (no thread exits: a warp posting together must stay whole for
// its shuffles). A reservation that cannot get room (the budget ran out, or the communicator
// aborted) returns kNoSlot and its poster writes and publishes nothing, so no WQE ever lands on a
// slot the NIC may still be reading. `put_warp` posts 32 writes with one reservation, one publish
// and one doorbell, only the last asking for a CQE.
struct IbQpHandle {
  uint8_t* sq;           // send queue ring, 2^sq_log2 WQEBBs
  uint32_t* dbr;         // send doorbell record (big-endian 16-bit index)
  uint64_t* doorbell;    // the doorbell register (a UAR page, or the emulated NIC's word)
  uint8_t* cq;           // completion queue, 2^cq_log2 CQEs of 64 bytes
  uint32_t* cq_ci;       // the CQ's consumer index record (big-endian 24-bit)
  uint64_t* state;       // device memory [8], see below
  uint8_t* sizes;        // device memory [2^sq_log2]: WQEBBs of the WQE starting at each slot
  uint64_t* host_ready;  // CPU-assisted posting: the ready index for the host to ring; else null
  uint32_t qpn;
  uint32_t sq_log2;
  uint32_t cq_log2;
  uint32_t flags;  // kRingsInGpu, or 0
  WaitSite site;

  // flags: the send queue and its record are GPU memory (NVSHMEM's placement): a batch's WQEs
  // need only a GPU-scope fence before they are published (ring() fences system-wide before the
  // doorbell); rings in host memory take a system-scope fence per batch, as NVSHMEM does.
  static constexpr uint32_t kRingsInGpu = 1;

  static constexpr uint32_t kReserved = 0, kReady = 1, kRung = 2, kCompleted = 3, kRingLock = 4, kPollLock = 5,
                            kCqConsumed = 6;
  // What reserve() and the posting calls return when nothing was posted.
  static constexpr uint64_t kNoSlot = ~uint64_t(0);

#if DOORBELL_CUDA
  DOORBELL_DEVICE_INLINE uint64_t depth() const { return uint64_t(1) << sq_log2; }
  // Orders this thread's WQE bytes before anything that publishes them (see kRingsInGpu).
  DOORBELL_DEVICE_INLINE void order_wqes() const {
    if (flags & kRingsInGpu) {
      __threadfence();
    } else {
      fence_acq_rel_sys();
    }
  }
  // State words are shared by every SM: read and written volatile (never from a stale L1 line).
  DOORBELL_DEVICE_INLINE volatile uint64_t& word(uint32_t i) const { return reinterpret_cast<volatile uint64_t*>(state)[i]; }
  DOORBELL_DEVICE_INLINE uint64_t completed() const { return word(kCompleted); }

  // Consumes the CQEs that have arrived, if no other thread is doing it; returns how many WQEBBs
  // are known complete.
  DOORBELL_DEVICE_INLINE uint64_t poll() const {
    if (atomicCAS(reinterpret_cast<unsigned long long*>(&state[kPollLock]), 0ull, 1ull) != 0) return completed();
    uint64_t k = word(kCqConsumed);
    uint64_t done = word(kCompleted);
    const uint64_t consumed = k;
    for (;;) {
      const uint64_t* e = reinterpret_cast<const uint64_t*>(cq + ((k & ((uint64_t(1) << cq_log2) - 1)) << 6));
      const uint64_t tail = load_relaxed_sys(e + 7);  // sop_drop_qpn, wqe_counter, signature, op_own
      const uint32_t op_own = uint32_t(tail >> 56);
      if ((op_own >> 4) == 15 || (op_own & 1) != ((k >> cq_log2) & 1)) break;
      fence_acq_rel_sys();
      const uint32_t counter = uint32_t((tail >> 32) & 0xff) << 8 | uint32_t((tail >> 40) & 0xff);
      if ((op_own >> 4) == 13 || (op_own >> 4) == 14) {
        // Reported (the communicator aborts) and left unconsumed: nothing past it completes.
        const uint64_t word = load_relaxed_sys(e + 6);  // bytes 48..55: syndrome is byte 55
        report_failure(site, kWaitIbError, done + ((counter - uint32_t(done)) & 0xffff), word >> 56, 0);
        break;
      }
      // The completed WQE starts at the oldest outstanding index with these low 16 bits.
      const uint64_t start = done + ((counter - uint32_t(done)) & 0xffff);
      done = start + reinterpret_cast<volatile uint8_t*>(sizes)[start & (depth() - 1)];
      ++k;
    }
    if (k != consumed) {
      word(kCqConsumed) = k;
      store_release_sys(cq_ci, ib::bswap32(uint32_t(k & 0xffffff)));
      __threadfence();
      word(kCompleted) = done;
    }
    __threadfence();
    atomicExch(reinterpret_cast<unsigned long long*>(&state[kPollLock]), 0ull);
    return done;
  }

  // Reserves `n` WQEBBs (waiting, bounded, for room); returns the first, or kNoSlot when the
  // wait for room gave up (the reservation stays taken: the communicator has aborted).
  DOORBELL_DEVICE_INLINE uint64_t reserve(uint32_t n) const {
    // Completions read beside the atomic, not after it: one trip to memory when there is room (a
    // stale count only sends the check below to the slow path, which polls).
    const uint64_t done = completed();
    const uint64_t base = fetch_add_relaxed_gpu(&state[kReserved], n);
    if (base + n > done + depth()) {
      // Published work nobody rang yet (publish without doorbell) must reach the NIC, or its
      // room never comes back.
      __threadfence();
      const uint64_t ready = word(kReady);
      if (ready > word(kRung)) ring(ready);
      const bool room = spin_until(site, kWaitIbProgress, base + n - depth(), [&](uint64_t& seen) {
        seen = poll();
        return base + n <= seen + depth();
      });
      if (!room) return kNoSlot;
    }
    return base;
  }

  // Records that the WQE at `at`, `n` WQEBBs long, asks for a CQE (before it is published).
  DOORBELL_DEVICE_INLINE void signaled(uint64_t at, uint32_t n) const {
    reinterpret_cast<volatile uint8_t*>(sizes)[at & (depth() - 1)] = uint8_t(n);
  }

  // Publishes WQEBBs [base, base + n), written by this thread, once every earlier reservation is
  // published, then rings.
  DOORBELL_DEVICE_INLINE void submit(uint64_t base, uint32_t n) const {
    order_wqes();  // the WQE's bytes before anything that lets the NIC read them
    publish(base, n);
  }

  // submit() without the fence, for WQEs whose writers fenced already. With `doorbell` false the
  // WQEBBs are only published: a later ring (another batch's, or reserve() before it waits for
  // room) covers them.
  DOORBELL_DEVICE_INLINE void publish(uint64_t base, uint32_t n, bool doorbell = true) const {
    if (doorbell) {
      publish_and_ring(base, n);
      return;
    }
    spin_until(site, kWaitIbProgress, base, [&](uint64_t& seen) {
      seen = atomicCAS(reinterpret_cast<unsigned long long*>(&state[kReady]), static_cast<unsigned long long>(base),
                       static_cast<unsigned long long>(base + n));
      return seen == base;
    });
  }

  // Makes sure a doorbell covering WQEBBs before `end` (all published) rings: returns at once if
  // one did; else rings for everything published, unless another thread is doing it, which then
  // covers `end` too (it reads the ready index after taking the lock). Each retry tries the
  // atomic first: a GPU atomic resolves at L2 with no cache line to bounce, so reading the lock
  // before it (test-and-test-and-set) only adds a trip (measured: no gain, docs/open-work.md).
  DOORBELL_DEVICE_INLINE void ring(uint64_t end) const {
    spin_until(site, kWaitIbProgress, end, [&](uint64_t& seen) {
      if (cas_acquire_gpu(&state[kRingLock], 0, 1) != 0) {
        seen = word(kRung);  // another thread rings: done once its doorbell covers `end`
        return seen >= end;
      }
      const uint64_t ready = word(kReady), rung = word(kRung);
      if (ready > rung) ring_locked(ready);
      unlock_ring();
      seen = ready;
      return true;
    });
  }

  // publish(base, n) then ring(base + n), in one round trip when nothing stands in the way: the
  // publish and the ring lock are taken with two atomics in flight at once (a queue pair posted by
  // one warp at a time always takes this path); otherwise the two steps one after the other.
  DOORBELL_DEVICE_INLINE void publish_and_ring(uint64_t base, uint32_t n) const {
    const uint64_t was = atomicCAS(reinterpret_cast<unsigned long long*>(&state[kReady]),
                                   static_cast<unsigned long long>(base), static_cast<unsigned long long>(base + n));
    const uint64_t locked = cas_acquire_gpu(&state[kRingLock], 0, 1);
    if (locked == 0) {
      if (was == base) {
        // Everything before `base` was published before this publish succeeded, and no doorbell
        // can have covered past `base`: ring up to our end (later publishers ring for theirs).
        ring_locked(base + n);
        unlock_ring();
        return;
      }
      unlock_ring();
    }
    if (was != base) publish(base, n, false);
    ring(base + n);
  }

  // Rings for WQEBBs before `ready` (all published), holding the ring lock: the doorbell record,
  // one system fence (every published WQE and the record before the doorbell), the doorbell; or,
  // posting CPU-assisted, the ready index for the host thread, which rings.
  DOORBELL_DEVICE_INLINE void ring_locked(uint64_t ready) const {
    if (host_ready != nullptr) {
      store_release_sys(host_ready, ready);
    } else {
      *reinterpret_cast<volatile uint32_t*>(dbr) = ib::bswap32(uint32_t(ready & 0xffff));
      fence_acq_rel_sys();
      const uint64_t word_ = uint64_t(ib::bswap32(uint32_t(ready & 0xffff) << 8)) |
                             (uint64_t(ib::bswap32((qpn & 0xffffff) << 8)) << 32);
      store_relaxed_sys(doorbell, word_);
    }
    word(kRung) = ready;
  }

  // Releases the ring lock (the rung index, stored before, is seen by the next holder).
  DOORBELL_DEVICE_INLINE void unlock_ring() const { store_release_gpu(&state[kRingLock], 0); }

  // RDMA WRITE of `len` bytes from local `laddr` to remote `raddr`, with a CQE; returns its index.
  DOORBELL_DEVICE_INLINE uint64_t put(uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t len) const {
    const uint64_t at = reserve(1);
    if (at == kNoSlot) return kNoSlot;
    ib::rdma_wqe(sq, sq_log2, at, qpn, ib::kOpWrite, ib::kCqUpdate, raddr, rkey, laddr, lkey, len);
    signaled(at, 1);
    submit(at, 1);
    return at;
  }

  // Every lane of a full warp (all 32 calling together, each with its own `lane`) posts one RDMA
  // WRITE: one reservation, one publish, one doorbell for the 32, and only lane 31's WQE asks
  // for a CQE. Returns the index of this lane's WQE.
  DOORBELL_DEVICE_INLINE uint64_t put_warp(uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t len,
                                           uint32_t lane) const {
    uint64_t base = 0;
    if (lane == 0) base = reserve(32);
    base = __shfl_sync(0xffffffffu, base, 0);
    if (base == kNoSlot) return kNoSlot;  // every lane alike
    const uint64_t at = base + lane;
    ib::rdma_wqe(sq, sq_log2, at, qpn, ib::kOpWrite, lane == 31 ? ib::kCqUpdate : 0, raddr, rkey, laddr, lkey, len);
    if (lane == 31) signaled(at, 1);
    order_wqes();  // each lane's WQE (and lane 31's size) before lane 0 publishes
    __syncwarp();
    if (lane == 0) publish(base, 32);
    __syncwarp();
    return at;
  }

  // A batch posted by a full warp (all 32 lanes calling together) with one reservation, one
  // publish and one doorbell: `rows` RDMA WRITEs of `len` bytes each (any number, the same on
  // every lane), row i from local `row(i).y` to remote `row(i).x` (row(i) is called by lane
  // i % 32 only); then, when `tail_len` > 0, a WRITE of `tail_len` bytes from `tail_laddr` to
  // `tail_raddr` (a count or chunk descriptor); then, when `flag`, an 8-byte READ of `flag_raddr`
  // into `result` (the flush that keeps the flag behind every write before it, as relaxed
  // ordering needs) and a fetch-add of `add` there (its old value lands at `result + 8`). Only the
  // last WQE asks for a CQE. With `doorbell` false the batch is published, not rung (a later
  // batch's doorbell covers it). `gate(lane)`, called by every lane once the WQEs are written
  // (before their fence, so the two waits overlap), returns when the NIC may read what they point
  // at (data other threads are still writing): the batch is built while that data is in the
  // making and published only after.
  // Returns the last WQE's index (every lane the same), or ~0 when the batch is empty.
  template <typename Row, typename Gate = NoGate>
  DOORBELL_DEVICE_INLINE uint64_t post_rows_warp(uint32_t rows, Row row, uint32_t rkey, uint32_t lkey, uint32_t len,
                                                 uint64_t tail_raddr, uint64_t tail_laddr, uint32_t tail_len,
                                                 bool flag, uint64_t flag_raddr, uint32_t flag_rkey, uint64_t add,
                                                 uint64_t result, uint32_t result_lkey, uint32_t lane,
                                                 bool doorbell = true, Gate gate = Gate()) const {
    return post_emitted_warp(
        rows,
        [&](auto emit) {
          for (uint32_t i = lane; i < rows; i += 32) {
            const ulonglong2 at = row(i);
            emit(i, at.x, at.y);
          }
        },
        rkey, lkey, len, tail_raddr, tail_laddr, tail_len, flag, flag_raddr, flag_rkey, add, result, result_lkey, lane,
        doorbell, gate);
  }

  // post_rows_warp with the rows' writers chosen by the caller: `rows_of(emit)`, called on every
  // lane, calls emit(i, raddr, laddr) for each row i that lane writes (every i in 0..rows exactly
  // once over the warp), so a lane that already holds a row's addresses writes its WQE without
  // working out which row is the i-th.
  template <typename RowsOf, typename Gate = NoGate>
  DOORBELL_DEVICE_INLINE uint64_t post_emitted_warp(uint32_t rows, RowsOf rows_of, uint32_t rkey, uint32_t lkey,
                                                    uint32_t len, uint64_t tail_raddr, uint64_t tail_laddr,
                                                    uint32_t tail_len, bool flag, uint64_t flag_raddr,
                                                    uint32_t flag_rkey, uint64_t add, uint64_t result,
                                                    uint32_t result_lkey, uint32_t lane, bool doorbell = true,
                                                    Gate gate = Gate()) const {
    const uint32_t tail = tail_len > 0 ? 1 : 0;
    const uint32_t n = rows + tail + (flag ? 2 : 0);
    if (n == 0) return ~uint64_t(0);
    uint64_t base = 0;
    if (lane == 0) base = reserve(n);
    base = __shfl_sync(0xffffffffu, base, 0);
    if (base == kNoSlot) return kNoSlot;  // every lane alike
    rows_of([&](uint32_t i, uint64_t raddr, uint64_t laddr) {
      const uint32_t cq = i == n - 1 ? ib::kCqUpdate : 0;
      ib::rdma_wqe(sq, sq_log2, base + i, qpn, ib::kOpWrite, cq, raddr, rkey, laddr, lkey, len);
      if (cq != 0) signaled(base + i, 1);
    });
    // The tail, READ and fetch-add after the rows, a lane each.
    const uint32_t i = rows + lane;
    if (i < n) {
      const uint32_t cq = i == n - 1 ? ib::kCqUpdate : 0;
      if (i < rows + tail) {
        ib::rdma_wqe(sq, sq_log2, base + i, qpn, ib::kOpWrite, cq, tail_raddr, rkey, tail_laddr, lkey, tail_len);
      } else if (i == rows + tail) {
        ib::rdma_wqe(sq, sq_log2, base + i, qpn, ib::kOpRead, cq, flag_raddr, flag_rkey, result, result_lkey, 8);
      } else {
        ib::atomic_wqe(sq, sq_log2, base + i, qpn, ib::kOpFetchAdd, cq, flag_raddr, flag_rkey, add, 0, result + 8,
                       result_lkey);
      }
      if (cq != 0) signaled(base + i, 1);
    }
    // The gate's wait overlaps the fence's: both precede the publish, in either order.
    gate(lane);
    order_wqes();  // every lane's WQE (and the size of the signaled one) before lane 0 publishes
    __syncwarp();
    if (lane == 0) publish(base, n, doorbell);
    __syncwarp();
    return base + n - 1;
  }

  // post_rows_warp for at most 32 rows, lane i's row from its own `laddr` to its own `raddr`.
  DOORBELL_DEVICE_INLINE uint64_t post_warp(uint32_t rows, uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey,
                                            uint32_t len, uint64_t tail_raddr, uint64_t tail_laddr, uint32_t tail_len,
                                            bool flag, uint64_t flag_raddr, uint32_t flag_rkey, uint64_t add,
                                            uint64_t result, uint32_t result_lkey, uint32_t lane,
                                            bool doorbell = true) const {
    return post_rows_warp(
        rows, [&](uint32_t) { return make_ulonglong2(raddr, laddr); }, rkey, lkey, len, tail_raddr, tail_laddr,
        tail_len, flag, flag_raddr, flag_rkey, add, result, result_lkey, lane, doorbell);
  }

  // RDMA READ of `len` bytes from remote `raddr` into local `laddr`, with a CQE; returns its
  // index. A READ also flushes: the NIC delivers the QP's earlier writes before it (NCCL's GPU
  // flush), so a signal posted after it cannot overtake them.
  DOORBELL_DEVICE_INLINE uint64_t get(uint64_t raddr, uint32_t rkey, uint64_t laddr, uint32_t lkey, uint32_t len) const {
    const uint64_t at = reserve(1);
    if (at == kNoSlot) return kNoSlot;
    ib::rdma_wqe(sq, sq_log2, at, qpn, ib::kOpRead, ib::kCqUpdate, raddr, rkey, laddr, lkey, len);
    signaled(at, 1);
    submit(at, 1);
    return at;
  }

  // Atomic fetch-add of `add` to the 8 bytes at remote `raddr`; the old value lands at `result`.
  DOORBELL_DEVICE_INLINE uint64_t atomic_add(uint64_t raddr, uint32_t rkey, uint64_t add, uint64_t result,
                                             uint32_t lkey) const {
    const uint64_t at = reserve(1);
    if (at == kNoSlot) return kNoSlot;
    ib::atomic_wqe(sq, sq_log2, at, qpn, ib::kOpFetchAdd, ib::kCqUpdate, raddr, rkey, add, 0, result, lkey);
    signaled(at, 1);
    submit(at, 1);
    return at;
  }

  // Waits (bounded) until every WQE rung so far has completed.
  DOORBELL_DEVICE_INLINE void quiet() const {
    const uint64_t target = word(kRung);
    spin_until(site, kWaitIbProgress, target, [&](uint64_t& seen) {
      seen = poll();
      return seen >= target;
    });
  }
#endif
};
DOORBELL_CHECK_SIZE(IbQpHandle, 120);

}  // namespace doorbell
