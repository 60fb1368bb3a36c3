// doorbell device API, channel tier: PortChannel, a channel whose data moves by DMA (copy engines,
// or the network) on behalf of the GPU: kernels push small triggers into the proxy's FIFO and keep
// computing; the ProxyService performs them. Over InfiniBand with GPU posting (`ib` set by the
// host), the same calls write the work requests from the kernel instead (ib/ibgda.cuh): that is
// why this channel tier sits above ib/.
//
// Semantics (the same vocabulary as MemoryChannel):
//   put                       copy bytes from my registered memory to the peer's (asynchronous)
//   signal                    add 1 to the peer's inbound token, after every earlier put of this
//                             channel has landed (the proxy orders it on the same copy stream)
//   put_with_signal           both, as one trigger
//   flush                     wait until everything this channel pushed before has completed
//                             locally (sources reusable); returns only then
//   wait / poll               consume a signal from the peer, as on a semaphore
// A put returns before the data moves: do not overwrite its source before a flush, and let the
// peer read the destination only after it waited for the matching signal.
#pragma once

#include "../ib/ibgda.cuh"
#include "fifo.cuh"

namespace doorbell {

// A PortChannel over RDMA whose kernels post their own work requests (IBGDA or CPU-assisted
// posting, see ib/ibgda.cuh) instead of pushing triggers to the proxy: a put becomes RDMA WRITEs
// (1 GiB pieces, large ones striped over up to 4 QPs to the peer, DOORBELL_IB_QPS_PER_PEER), a
// signal an 8-byte READ of the peer's token (the flush that keeps the signal behind the data) then
// a fetch-add of 1 on it, a flush waits for every completion of the QPs.
struct IbPortLink {
  IbQpHandle qp;
  uint64_t src;      // my source memory's first byte
  uint64_t dst;      // the peer's destination's first byte, at the peer's address
  uint64_t token;    // the peer's inbound token for me, at the peer's address
  uint64_t scratch;  // 16 bytes of my device memory the NIC writes (READ and fetch-add results)
  uint32_t src_key;
  uint32_t dst_key;
  uint32_t token_key;
  uint32_t scratch_key;
  uint32_t stripes;      // QPs a put is striped over: qp, then more[0 .. stripes - 1)
  uint32_t reserved;
  IbQpHandle more[3];    // the other QPs to the same peer

#if DOORBELL_CUDA
  DOORBELL_DEVICE_INLINE const IbQpHandle& stripe(uint32_t q) const { return q == 0 ? qp : more[q - 1]; }
#endif
};
DOORBELL_CHECK_SIZE(IbPortLink, 536);

// The fields of an IbPortLink that a batch post reads (its first kLinkWords words: the first queue
// pair and the link's addresses, keys and stripes), by value: loaded early, before the work that
// decides the batch, they are in registers when the post starts instead of costing it trips to
// device memory. A warp loads them with one coalesced load (link_word on every lane) and
// assembles them when it needs them (link_view_from).
struct IbLinkView {
  IbQpHandle qp;
  uint64_t src, dst, token, scratch;
  uint32_t src_key, dst_key, token_key, scratch_key, stripes, reserved;
};
constexpr uint32_t kLinkWords = sizeof(IbLinkView) / 8;
static_assert(sizeof(IbLinkView) % 8 == 0 && kLinkWords <= 32, "a link view is one word per lane");
static_assert(offsetof(IbLinkView, src) == offsetof(IbPortLink, src) &&
                  offsetof(IbLinkView, scratch_key) == offsetof(IbPortLink, scratch_key) &&
                  offsetof(IbLinkView, reserved) == offsetof(IbPortLink, reserved),
              "IbLinkView is IbPortLink's prefix");

#if DOORBELL_CUDA
DOORBELL_DEVICE_INLINE IbLinkView link_view(const IbPortLink& l) {
  return IbLinkView{l.qp,      l.src,     l.dst,       l.token,       l.scratch, l.src_key,
                    l.dst_key, l.token_key, l.scratch_key, l.stripes, l.reserved};
}

// Lane `lane`'s word of link l's view (every lane of a warp: one coalesced load).
DOORBELL_DEVICE_INLINE uint64_t link_word(const IbPortLink* l, uint32_t lane) {
  return lane < kLinkWords ? reinterpret_cast<const uint64_t*>(l)[lane] : 0;
}

// The view from every lane's link_word (a full warp).
DOORBELL_DEVICE_INLINE IbLinkView link_view_from(uint64_t word) {
  uint64_t w[kLinkWords];
#pragma unroll
  for (uint32_t k = 0; k < kLinkWords; ++k) w[k] = __shfl_sync(0xffffffffu, word, k);
  IbLinkView v;
  memcpy(&v, w, sizeof v);
  return v;
}
#endif

struct PortChannelHandle {
  FifoHandle fifo;
  uint64_t* inbound_token;     // mine: the peer's proxy writes its running count here
  uint64_t* expected_inbound;  // mine, private: signals consumed
  const uint64_t* flush_done;  // host-pinned: every position below it has completed
  uint32_t semaphore;          // proxy semaphore id: signals go to the peer's inbound token
  uint32_t dst_mem;            // proxy memory id of the peer's buffer
  uint32_t src_mem;            // proxy memory id of my buffer
  uint32_t reserved;
  const IbPortLink* ib;        // device memory: set when kernels post RDMA work themselves

  // Puts of at least this many bytes are striped over the link's queue pairs.
  static constexpr uint64_t kStripeMin = uint64_t(1) << 20;

#if DOORBELL_CUDA
  // Each call returns a position: the FIFO's (proxy posting) or the WQE's index (GPU posting).
  DOORBELL_DEVICE_INLINE uint64_t put(uint64_t dst_off, uint64_t src_off, uint64_t bytes) const {
    if (ib != nullptr) return ib_put(dst_off, src_off, bytes);
    return fifo.push(kTriggerData, semaphore, src_mem, src_off, dst_mem, dst_off, bytes);
  }
  DOORBELL_DEVICE_INLINE uint64_t signal() const {
    if (ib != nullptr) return ib_signal();
    return fifo.push(kTriggerFlag, semaphore, 0, 0, 0, 0, 0);
  }
  DOORBELL_DEVICE_INLINE uint64_t put_with_signal(uint64_t dst_off, uint64_t src_off, uint64_t bytes) const {
    if (ib != nullptr) {
      ib_put(dst_off, src_off, bytes);
      return ib_signal();
    }
    return fifo.push(kTriggerData | kTriggerFlag, semaphore, src_mem, src_off, dst_mem, dst_off, bytes);
  }
  DOORBELL_DEVICE_INLINE void put_with_signal_and_flush(uint64_t dst_off, uint64_t src_off, uint64_t bytes) const {
    if (ib != nullptr) {
      put_with_signal(dst_off, src_off, bytes);
      ib_quiet();
      return;
    }
    wait_flushed(
        fifo.push(kTriggerData | kTriggerFlag | kTriggerFlush, semaphore, src_mem, src_off, dst_mem, dst_off, bytes));
  }
  DOORBELL_DEVICE_INLINE void flush() const {
    if (ib != nullptr) {
      ib_quiet();
      return;
    }
    wait_flushed(fifo.push(kTriggerFlush, semaphore, 0, 0, 0, 0, 0));
  }

  // A batch of puts by a full warp (all 32 lanes calling together): lanes below `rows` (0..=32,
  // the same on every lane) put `bytes` each from their own `src_off` to their own `dst_off`;
  // then, when `tail_bytes` > 0, one put of `tail_bytes` from `tail_src` to `tail_dst` (a count
  // or descriptor that describes the rows); then, when `with_signal`, a signal behind all of it.
  // Over RDMA posted by the kernel, the whole batch is one reservation, one publish and one
  // doorbell on the first queue pair (ib/ibgda.cuh's post_warp: the signal is a READ that flushes
  // the writes, then the fetch-add); with the proxy, one trigger per put and one for the signal.
  // `ring` false (RDMA posted by the kernel): the batch is published but the doorbell is left to
  // a later batch on the same queue pair (which rings for everything published before it), so
  // batches of many warps cost one doorbell; the caller guarantees that later batch.
  DOORBELL_DEVICE_INLINE void put_warp(uint32_t rows, uint64_t dst_off, uint64_t src_off, uint64_t bytes,
                                       uint64_t tail_dst, uint64_t tail_src, uint64_t tail_bytes, bool with_signal,
                                       uint32_t lane, bool ring = true) const {
    put_rows_warp(
        rows, [&](uint32_t) { return make_ulonglong2(dst_off, src_off); }, bytes, tail_dst, tail_src, tail_bytes,
        with_signal, lane, ring);
  }

  // put_warp for any number of rows: row i (0 <= i < rows) puts `bytes` from `row(i).y` to
  // `row(i).x` (offsets; row(i) is called by lane i % 32 only). Over RDMA posted by the kernel
  // the rows, tail and signal are still one reservation, one publish and one doorbell. `gate(lane)`
  // (every lane) returns once the sources may be read (see IbQpHandle::post_rows_warp): over RDMA
  // the work requests are written before it and published after; through the proxy every put
  // waits for it.
  template <typename Row, typename Gate = NoGate>
  DOORBELL_DEVICE_INLINE void put_rows_warp(uint32_t rows, Row row, uint64_t bytes, uint64_t tail_dst,
                                            uint64_t tail_src, uint64_t tail_bytes, bool with_signal, uint32_t lane,
                                            bool ring = true, Gate gate = Gate()) const {
    put_emitted_warp(
        rows,
        [&](auto emit) {
          for (uint32_t i = lane; i < rows; i += 32) {
            const ulonglong2 o = row(i);
            emit(i, o.x, o.y);
          }
        },
        bytes, tail_dst, tail_src, tail_bytes, with_signal, lane, ring, gate);
  }

  // put_rows_warp with the rows' writers chosen by the caller (IbQpHandle::post_emitted_warp):
  // `rows_of(emit)`, on every lane, calls emit(i, dst_off, src_off) for each row i that lane puts.
  template <typename RowsOf, typename Gate = NoGate>
  DOORBELL_DEVICE_INLINE void put_emitted_warp(uint32_t rows, RowsOf rows_of, uint64_t bytes, uint64_t tail_dst,
                                               uint64_t tail_src, uint64_t tail_bytes, bool with_signal,
                                               uint32_t lane, bool ring = true, Gate gate = Gate()) const {
    if (ib != nullptr && bytes < kStripeMin && tail_bytes < kStripeMin) {
      put_emitted_warp(link_view(*ib), rows, rows_of, bytes, tail_dst, tail_src, tail_bytes, with_signal, lane, ring,
                       gate);
      return;
    }
    gate(lane);
    __syncwarp();
    rows_of([&](uint32_t, uint64_t dst_off, uint64_t src_off) { put(dst_off, src_off, bytes); });
    __syncwarp();
    if (lane == 0) {
      if (tail_bytes > 0) put(tail_dst, tail_src, tail_bytes);
      if (with_signal) signal();
    }
    __syncwarp();
  }

  // put_emitted_warp over RDMA posted by the kernel, with this channel's link read beforehand
  // (`link` = link_view(*ib), ib set): one reservation, one publish and one doorbell. Puts of
  // kStripeMin bytes or more take the general path.
  template <typename RowsOf, typename Gate = NoGate>
  DOORBELL_DEVICE_INLINE void put_emitted_warp(const IbLinkView& link, uint32_t rows, RowsOf rows_of, uint64_t bytes,
                                               uint64_t tail_dst, uint64_t tail_src, uint64_t tail_bytes,
                                               bool with_signal, uint32_t lane, bool ring = true,
                                               Gate gate = Gate()) const {
    if (bytes >= kStripeMin || tail_bytes >= kStripeMin) {
      put_emitted_warp(rows, rows_of, bytes, tail_dst, tail_src, tail_bytes, with_signal, lane, ring, gate);
      return;
    }
    if (with_signal && link.stripes > 1 && lane == 0) {
      // Earlier puts of this channel may have gone over the other queue pairs: flush them first.
      for (uint32_t q = 1; q < link.stripes; ++q) {
        ib->stripe(q).get(link.token, link.token_key, link.scratch, link.scratch_key, 8);
        ib->stripe(q).quiet();
      }
    }
    __syncwarp();
    link.qp.post_emitted_warp(
        rows,
        [&](auto emit) {
          rows_of([&](uint32_t i, uint64_t dst_off, uint64_t src_off) { emit(i, link.dst + dst_off, link.src + src_off); });
        },
        link.dst_key, link.src_key, uint32_t(bytes), link.dst + tail_dst, link.src + tail_src, uint32_t(tail_bytes),
        with_signal, link.token, link.token_key, 1, link.scratch, link.scratch_key, lane, ring, gate);
  }

  // A put of at least kStripeMin bytes is cut into `stripes` contiguous parts (4 KiB multiples),
  // one per queue pair; each part goes as WRITEs of at most 1 GiB (a data segment carries less
  // than 2 GiB). Returns the last WQE's index on the first QP.
  DOORBELL_DEVICE_INLINE uint64_t ib_put(uint64_t dst_off, uint64_t src_off, uint64_t bytes) const {
    constexpr uint64_t kPiece = uint64_t(1) << 30;
    const uint32_t qps = bytes >= kStripeMin && ib->stripes > 1 ? ib->stripes : 1;
    const uint64_t part = ((bytes + qps - 1) / qps + 4095) & ~uint64_t(4095);
    uint64_t at = 0;
    for (uint32_t q = 0; q < qps; ++q) {
      const uint64_t first = uint64_t(q) * part < bytes ? uint64_t(q) * part : bytes;
      const uint64_t last = first + part < bytes ? first + part : bytes;
      for (uint64_t o = first; o < last; o += kPiece) {
        const uint64_t n = last - o < kPiece ? last - o : kPiece;
        const uint64_t i = ib->stripe(q).put(ib->dst + dst_off + o, ib->dst_key, ib->src + src_off + o, ib->src_key,
                                             uint32_t(n));
        if (q == 0) at = i;
      }
    }
    return at;
  }
  // The signal lands after every earlier put of this channel on every QP: the other QPs first
  // READ (flushing their writes, as relaxed ordering needs) and complete everything, then the
  // first QP READs and adds 1 to the peer's token.
  DOORBELL_DEVICE_INLINE uint64_t ib_signal() const {
    for (uint32_t q = 1; q < ib->stripes; ++q) {
      ib->stripe(q).get(ib->token, ib->token_key, ib->scratch, ib->scratch_key, 8);
      ib->stripe(q).quiet();
    }
    ib->qp.get(ib->token, ib->token_key, ib->scratch, ib->scratch_key, 8);
    return ib->qp.atomic_add(ib->token, ib->token_key, 1, ib->scratch + 8, ib->scratch_key);
  }
  DOORBELL_DEVICE_INLINE void ib_quiet() const {
    for (uint32_t q = 0; q < ib->stripes; ++q) ib->stripe(q).quiet();
  }

  // The proxy's stop word lives in host memory: reading it costs a PCIe round trip, so waits look
  // at it only every 256th poll instead of paying two round trips per poll.
  DOORBELL_DEVICE_INLINE bool proxy_stopped(uint32_t& polls) const {
    return (++polls & 255) == 0 && load_acquire_sys(fifo.stopped) != 0;
  }

  // Waits (bounded) until the proxy reports position `pos` complete.
  DOORBELL_DEVICE_INLINE void wait_flushed(uint64_t pos) const {
    uint32_t polls = 0;
    spin_until(fifo.site, kWaitFlush, pos + 1, [&](uint64_t& seen) {
      seen = load_acquire_sys(flush_done);
      return seen > pos || proxy_stopped(polls);
    });
    if (load_acquire_sys(fifo.stopped) != 0 && load_acquire_sys(flush_done) <= pos) {
      wait_gave_up(fifo.site, kWaitProxyStopped, pos + 1, load_acquire_sys(flush_done), 0);
    }
  }

  // Waits until the proxy consumed the trigger at `pos` (it has been taken off the ring, not
  // necessarily performed): the FIFO round trip.
  DOORBELL_DEVICE_INLINE void wait_consumed(uint64_t pos) const {
    // Relaxed: only the count matters here, nothing is read under its protection.
    uint32_t polls = 0;
    spin_until(fifo.site, kWaitFifoSlot, pos + 1, [&](uint64_t& seen) {
      seen = load_relaxed_sys(fifo.tail);
      return seen > pos || proxy_stopped(polls);
    });
  }

  DOORBELL_DEVICE_INLINE bool poll() const {
    const uint64_t next = *expected_inbound + 1;
    if (load_acquire_sys(inbound_token) < next) return false;
    *expected_inbound = next;
    return true;
  }

  DOORBELL_DEVICE_INLINE void wait(uint64_t count = 1) const {
    const uint64_t expected = fetch_add_relaxed_gpu(expected_inbound, count) + count;
    uint32_t polls = 0;
    spin_until(fifo.site, kWaitSemaphore, expected, [&](uint64_t& seen) {
      seen = load_acquire_sys(inbound_token);
      return seen >= expected || proxy_stopped(polls);
    });
    if (load_acquire_sys(inbound_token) < expected) {
      wait_gave_up(fifo.site, kWaitProxyStopped, expected, load_acquire_sys(inbound_token), 0);
    }
  }
#endif
};
DOORBELL_CHECK_SIZE(PortChannelHandle, 136);

}  // namespace doorbell
