// doorbell device API, coll tier: the low-latency MoE exchange as calls for your own kernels, so
// an expert or attention kernel can send its rows the moment it has them (fused dispatch) and
// reduce the combine inside its epilogue. The host side (`MoeLowLatency` in Rust) prepares each
// call and hands out the `MoeLlArgs` these take (coll/moe_args.cuh); `cuda/kernels/moe_ll.cu` is
// built from the same calls.
//
// Transport: a token's row crosses NVLink once per destination rank, however many of that rank's
// experts it selected (top-8 of 256 on 4 ranks reaches 3.6 ranks on average, so about half the
// bytes of one row per selection). The row lands in the slot of the first such selection (the
// carrier); the receive half copies it into the other selections' slots, so the layout a caller
// sees is still one row per (token, expert). Each carrier row is announced in the receiver's
// queue for its source as soon as it is written, so the receiver copies rows while others are
// still on the wire; the counts follow once every (token, rank) item of the call is sent. On
// the way back, each rank sums its selections of a
// token (weight x expert output, f32, top-k order), rounds that partial sum to bf16 and writes it
// into the token's rank, which adds the partial sums of the ranks in rank order.
//
// Fused dispatch, per call:
//   host: args = begin_fused_send(topk_idx, topk_weights, num_tokens)   (launches nothing)
//   your kernel, any grid: for each token t (or each (t, rank) pair) you own, one warp calls
//       moe_ll::put_token(args, t, row, lane)   // or moe_ll::put(args, t, rank, row, lane)
//     (row: hidden bf16, 16-byte aligned, any memory; every (token, rank) pair of the call
//     exactly once, since the counts go out when the last one is done) and every block calls
//     moe_ll::finish_send(args) once after its puts (all its threads).
//   host: dispatch_recv(stream)
// Fused combine: `combine_send` sends the partial sums (moe_ll::send_partial, one warp per
// carrier row); once every peer's have arrived (the receive half waits for that),
// moe_ll::combine_chunk(args, t, c) writes 16 bytes of token t's output.
#pragma once

#include "../core/copy.cuh"
#include "../core/reduce.cuh"
#include "moe_args.cuh"

#if DOORBELL_CUDA
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace doorbell {
namespace moe_ll {

// Top-k id `i` of the call: int32, or int64 with kIds64 (an id outside -1..experts reads as -1,
// which selects nothing, as an int32 id past the experts does).
DOORBELL_DEVICE_INLINE int32_t topk_id(const MoeLlArgs& a, uint64_t i) {
  if (a.packed & kIds64) {
    const int64_t v = reinterpret_cast<const int64_t*>(a.topk_idx)[i];
    return v >= 0 && v < int64_t(a.experts_per_rank) * a.world ? int32_t(v) : -1;
  }
  return a.topk_idx[i];
}

// Row `i` of local expert `le` from `src` in half `half` of a receive area.
DOORBELL_DEVICE_INLINE uint64_t row_index(const MoeLlArgs& a, uint32_t half, uint32_t le, uint32_t src, uint32_t i) {
  return ((uint64_t(half) * a.experts_per_rank + le) * a.world + src) * a.max_tokens + i;
}

// Rows in one half of a receive area.
DOORBELL_DEVICE_INLINE uint64_t half_rows(const MoeLlArgs& a) {
  return uint64_t(a.experts_per_rank) * a.world * a.max_tokens;
}

// Section `off` of `owner`'s receive area as an array of T.
template <typename T>
DOORBELL_DEVICE_INLINE T* section(const MoeLlArgs& a, uint32_t owner, uint64_t off) {
  return reinterpret_cast<T*>(a.area[owner] + off);
}

// The count word `owner` holds for (half, local expert, source).
DOORBELL_DEVICE_INLINE uint64_t* count_word(const MoeLlArgs& a, uint32_t owner, uint32_t half, uint32_t le,
                                            uint32_t src) {
  return section<uint64_t>(a, owner, a.off_counts) + (uint64_t(half) * a.experts_per_rank + le) * a.world + src;
}

// The epoch of the dispatch being sent: one past the last one finished (finish_send stores it).
DOORBELL_DEVICE_INLINE uint64_t send_epoch(const MoeLlArgs& a) { return a.epochs[0] + 1; }

// Where waits and input errors about `peer` are reported (this rank's own: a neighbour's site
// naming this rank, so a dead neighbour never ends a wait for this rank's own words).
DOORBELL_DEVICE_INLINE WaitSite site(const MoeLlArgs& a, uint32_t peer) {
  WaitSite s = a.ready[peer == a.rank ? (a.rank + 1) % a.world : peer].site;
  if (peer == a.rank) s.peer = int32_t(a.rank);
  return s;
}

// Whether rank r is masked for this call (MoeLlArgs::rank_mask): nothing goes to it, nothing is
// waited for from it.
DOORBELL_DEVICE_INLINE bool masked(const MoeLlArgs& a, uint32_t r) {
  return a.rank_mask != nullptr && a.rank_mask[r] != 0u;
}

// No carrier row: the (token, rank) pair has no selection on that rank.
constexpr uint64_t kNoRow = ~0ull;

// Entry `j` of the queue in which `src` announces its carrier rows to `owner` (half `half`).
DOORBELL_DEVICE_INLINE uint64_t* queue_entry(const MoeLlArgs& a, uint32_t owner, uint32_t half, uint32_t src,
                                             uint32_t j) {
  return section<uint64_t>(a, owner, a.off_queue) + (uint64_t(half) * a.world + src) * a.max_tokens + j;
}

// The word in which `src` tells `owner` how many carrier rows it sent there (half `half`).
DOORBELL_DEVICE_INLINE uint64_t* sent_word(const MoeLlArgs& a, uint32_t owner, uint32_t half, uint32_t src) {
  return section<uint64_t>(a, owner, a.off_sent) + uint64_t(half) * a.world + src;
}

// Reserves token t's slots on rank r: a slot of each selected expert of r, and for every
// selection its source token, its weight and where its row will be; the first slot (the
// carrier, returned to every lane) also lists the pair's slots for the combine. kNoRow when no
// selection of t is on r. One warp, every lane calling with its lane id.
DOORBELL_DEVICE_INLINE uint64_t reserve(const MoeLlArgs& a, uint32_t t, uint32_t r, uint32_t lane) {
  const uint32_t half = uint32_t(send_epoch(a) & 1);
  const uint64_t sel = uint64_t(t) * a.topk + lane;
  int32_t e = -1;
  if (lane < a.topk) e = topk_id(a, sel);
  const bool here = e >= 0 && uint32_t(e) / a.experts_per_rank == r && !masked(a, r);
  const uint32_t mask = __ballot_sync(0xffffffffu, here);
  if (mask == 0) return kNoRow;
  const uint32_t first = __ffs(mask) - 1;
  uint64_t at = 0;
  if (here) {
    uint32_t i = atomicAdd(&a.fill[e], 1u);
    // More rows for one expert than tokens per rank: the token listed that expert twice. Report
    // and abort; the lane stays (the warp's shuffles below need every lane) on the last row,
    // whose contents no longer matter.
    if (i >= a.max_tokens) {
      report_failure(site(a, r), kWaitBadInput, a.max_tokens, i, 0);
      i = a.max_tokens - 1;
    }
    at = row_index(a, half, uint32_t(e) % a.experts_per_rank, a.rank, i);
  }
  const uint64_t carrier = __shfl_sync(0xffffffffu, at, first);
  if (here) {
    section<int32_t>(a, r, a.off_src)[at] = int32_t(t);
    section<float>(a, r, a.off_weight)[at] = a.topk_weights != nullptr ? a.topk_weights[sel] : 0.f;  // DeepEP's layout: none
    section<int32_t>(a, r, a.off_from)[at] = lane == first ? -int32_t(__popc(mask)) : int32_t(carrier);
    section<int32_t>(a, r, a.off_rec)[carrier * a.topk + __popc(mask & ((1u << lane) - 1))] = int32_t(at);
  }
  return carrier;
}

// Publishes the counts of send epoch `epoch`: every expert's rows (`epoch << 32 | rows`) into its
// owner's count word and every rank's carrier rows into its sent word, then zeroes the
// counters for the next call. Called by one warp once every (token, rank) item is done, after a
// system fence of its own: a receiver that sees a count (acquire) sees the rows and queue
// entries it counts.
DOORBELL_DEVICE_INLINE void publish_counts(const MoeLlArgs& a, uint64_t epoch, uint32_t lane) {
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t experts = a.experts_per_rank * a.world;
  for (uint32_t e = lane; e < experts + a.world; e += 32) {
    const uint32_t n = *reinterpret_cast<volatile uint32_t*>(&a.fill[e]);
    a.fill[e] = 0;
    // Relaxed: this thread's system fence above makes the pair a release (one fence per
    // thread instead of one per store).
    if (e < experts) {
      const uint32_t r = e / a.experts_per_rank, le = e % a.experts_per_rank;
      if (!masked(a, r)) store_relaxed_sys(count_word(a, r, half, le, a.rank), (epoch << 32) | n);
    } else if (!masked(a, e - experts)) {
      store_relaxed_sys(sent_word(a, e - experts, half, a.rank), (epoch << 32) | n);
    }
  }
}

// Marks one (token, rank) item of this call done; the warp that finishes the last one publishes
// the counts. One warp, after put() has fenced the item's reservations, rows and metadata (an
// item with no selection there made none). The queue entry put() stores after that fence needs
// no fence of its own: a receiver that sees the count but not yet an entry below it keeps
// polling the entry (copy_announced), so this costs no second NVLink round trip.
DOORBELL_DEVICE_INLINE void item_done(const MoeLlArgs& a, uint32_t lane) {
  __syncwarp();
  uint32_t last = 0;
  if (lane == 0) last = atomicAdd(&a.done[2], 1u) == a.num_tokens * a.world - 1;
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __syncwarp();  // orders the other lanes after lane 0's atomic, which saw every item's fence
  __threadfence_system();
  publish_counts(a, send_epoch(a), lane);
  if (lane == 0) a.done[2] = 0;
}

// Writes a row (hidden bf16 at `row`, 16-byte aligned) into rank r's row `carrier`. One warp.
DOORBELL_DEVICE_INLINE void push_row(const MoeLlArgs& a, uint32_t r, uint64_t carrier, const void* row, uint32_t lane) {
  const uint32_t words = a.hidden / 8;
  copy_words_batched<int4, 8>(reinterpret_cast<int4*>(a.area[r]) + carrier * words, static_cast<const int4*>(row),
                              words, lane, 32);
}

// ceil(log2(x)) for a positive normal float.
DOORBELL_DEVICE_INLINE int32_t ceil_log2(float x) {
  const uint32_t bits = __float_as_uint(x);
  return int32_t((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
}

// Loads in flight per lane before the FP8 cast uses any (a 7168-wide row in one pass): one at a
// time made a row a chain of dependent reads.
constexpr uint32_t kCastBatch = 8;

// DeepEP's FP8 cast of a bf16 row (`hidden` values at `src`, a multiple of 128): e4m3 bytes to
// `dst` (`hidden` bytes) and one f32 scale per 128 values to `scales` (the factor that restores
// them). Per group: amax (at least 1e-4), scale amax / 448, or with `round` the next power of two
// up (UE8M0-representable), values times its inverse, saturated. One warp: a half-warp per group,
// eight values a lane; `dst` and `scales` may be a peer's memory (8- and 4-byte stores).
DOORBELL_DEVICE_INLINE void cast_row_fp8(const int4* src, uint8_t* dst, float* scales, uint32_t hidden, bool round,
                                         uint32_t lane) {
  const uint32_t words = hidden / 8;
  for (uint32_t base = 0; base < words; base += 32 * kCastBatch) {  // uniform: the shuffles need every lane
    int4 raw[kCastBatch];
#pragma unroll
    for (uint32_t b = 0; b < kCastBatch; ++b) {
      const uint32_t w = base + b * 32 + lane;
      raw[b] = w < words ? src[w] : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (uint32_t b = 0; b < kCastBatch; ++b) {
      if (base + b * 32 >= words) break;  // uniform
      const uint32_t w = base + b * 32 + lane;
      float v[8];
      float amax = 0.f;
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw[b]);
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x;
        v[2 * j + 1] = f.y;
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
#pragma unroll
      for (uint32_t o = 8; o >= 1; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if (w >= words) continue;
      amax = fmaxf(amax, 1e-4f);
      float scale_inv, mul;
      if (round) {
        const int32_t e = ceil_log2(amax * (1.f / 448.f));
        scale_inv = __uint_as_float(uint32_t(e + 127) << 23);
        mul = __uint_as_float(uint32_t(127 - e) << 23);
      } else {
        scale_inv = amax * (1.f / 448.f);
        mul = 448.f / amax;
      }
      uint32_t q8[2] = {0, 0};
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) {
        const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(make_float2(v[2 * j] * mul, v[2 * j + 1] * mul),
                                                                __NV_SATFINITE, __NV_E4M3);
        q8[j / 2] |= uint32_t(q) << (16 * (j % 2));
      }
      reinterpret_cast<uint2*>(dst)[w] = make_uint2(q8[0], q8[1]);
      if (lane % 16 == 0) scales[w / 16] = scale_inv;
    }
  }
}

// DeepEP's layout with FP8 rows (kPackedFp8): the carrier slot (2 x hidden bytes) holds the row
// cast once here, on the sending side, as DeepEP's send does: e4m3 bytes [0, hidden), then the
// f32 scales of its 128-value groups. Half the bytes cross, and each row is cast once per token
// and rank instead of once per selection; the receive half copies bytes and scales.
DOORBELL_DEVICE_INLINE void push_row_fp8(const MoeLlArgs& a, uint32_t r, uint64_t carrier, const void* row,
                                         uint32_t lane) {
  uint8_t* slot = reinterpret_cast<uint8_t*>(a.area[r]) + carrier * (uint64_t(a.hidden) * 2);
  cast_row_fp8(static_cast<const int4*>(row), slot, reinterpret_cast<float*>(slot + a.hidden), a.hidden,
               (a.packed & kPackedRound) != 0, lane);
}

// Sends token t's row (hidden bf16, 16-byte aligned, at `row` in any memory) to rank r if any
// of its selections is there: reserve(), the whole row into the carrier slot, then (after a
// system fence) the carrier's entry in r's queue for this rank, so r can copy it into the other
// selections' slots at once. A pair with no selection on r sends nothing but still counts as
// done. One warp, every lane calling with its lane id; each (t, r) of the call exactly once.
DOORBELL_DEVICE_INLINE void put(const MoeLlArgs& a, uint32_t t, uint32_t r, const void* row, uint32_t lane) {
  const uint64_t carrier = reserve(a, t, r, lane);
  if (carrier != kNoRow) {
    if (a.packed & kPackedFp8) {
      push_row_fp8(a, r, carrier, row, lane);
    } else {
      push_row(a, r, carrier, row, lane);
    }
    __syncwarp();
    if (lane == 0) {
      // The slot first: the fence then orders it (and the reservations, rows and metadata)
      // before both the entry and item_done's count.
      const uint32_t j = atomicAdd(&a.fill[a.experts_per_rank * a.world + r], 1u);
      __threadfence_system();
      const uint64_t epoch = send_epoch(a);
      store_relaxed_sys(queue_entry(a, r, uint32_t(epoch & 1), a.rank, j), (epoch << 32) | carrier);
    }
  }
  item_done(a, lane);
}

// put() to every rank.
DOORBELL_DEVICE_INLINE void put_token(const MoeLlArgs& a, uint32_t t, const void* row, uint32_t lane) {
  for (uint32_t r = 0; r < a.world; ++r) put(a, t, r, row, lane);
}

// Every block of the sending grid calls this once, with all its threads, after its puts. The
// last block to arrive stores the epoch for the next call (every block has read the old one by
// then), so a dispatch needs no kernel before its send; with no tokens it also publishes the
// (zero) counts, since no item did (a kernel that also receives must publish them earlier: see
// send_items in moe_ll.cu). It also announces the call, which the receive half checks
// (call_check.cuh), unless `announced`: a kernel that announced it already, at its start (the
// library's send kernels do, so a send that waits never keeps the peers' checks waiting), passes
// true, as a call is announced once.
DOORBELL_DEVICE_INLINE void finish_send(const MoeLlArgs& a, bool announced = false) {
  if (!announced) {
    announce_split_call(a.call, a.rank, a.world, a.ticket != nullptr ? a.ticket + 1 : nullptr, a.epochs + 2,
                        a.rank_mask);
  }
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&a.done[0], 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
  }
  __syncthreads();
  if (!last) return;
  const uint64_t epoch = send_epoch(a);
  if (a.num_tokens == 0 && threadIdx.x < 32) {
    __threadfence_system();
    publish_counts(a, epoch, threadIdx.x);
  }
  __syncthreads();  // every thread has read the old epoch
  if (threadIdx.x == 0) {
    if (a.ticket != nullptr) *a.ticket = epoch;
    a.epochs[0] = epoch;
    a.done[0] = 0;
  }
}

// Combine send for the carrier row `at` (a row of this rank's receive area, in the last
// dispatch's half, with off_from < 0): the sum over its pair's selections of weight x expert
// output (the combine buffer's row at the same place), f32 in top-k order, rounded to bf16 and
// written into the token's rank. One warp, every lane with its lane id.
DOORBELL_DEVICE_INLINE void send_partial(const MoeLlArgs& a, uint64_t at, uint32_t lane) {
  const uint64_t rows = half_rows(a);
  const uint32_t half = uint32_t(at / rows);
  const uint32_t n = uint32_t(-section<int32_t>(a, a.rank, a.off_from)[at]);
  const uint32_t src = uint32_t((at % rows) / a.max_tokens) % a.world;
  const uint32_t t = uint32_t(section<int32_t>(a, a.rank, a.off_src)[at]);
  // Lane j holds selection j's row and weight, so the loop below only waits for expert outputs.
  int32_t my_row = 0;
  float my_weight = 0;
  if (lane < n) {
    my_row = section<int32_t>(a, a.rank, a.off_rec)[at * a.topk + lane];
    my_weight = section<float>(a, a.rank, a.off_weight)[my_row];
  }
  const uint32_t words = a.hidden / 8;
  const int4* y = reinterpret_cast<const int4*>(a.y);
  int4* dst = reinterpret_cast<int4*>(a.area[src] + a.off_part) +
              ((uint64_t(half) * a.world + a.rank) * a.max_tokens + t) * words;
  // Eight 16-byte words per lane at a time (a 7168-wide row in one pass), each needing n loads
  // before its one store, all in flight together.
  constexpr uint32_t kUnroll = 8;
  for (uint32_t base = 0; base < words; base += 32 * kUnroll) {  // uniform: the shuffles need every lane
    float acc[kUnroll][8] = {};
    for (uint32_t j = 0; j < n; ++j) {
      const float w = __shfl_sync(0xffffffffu, my_weight, j);
      const uint64_t yrow = uint64_t(__shfl_sync(0xffffffffu, my_row, j)) % rows;
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t c = base + lane + u * 32;
        if (c < words) fma_bf16x8(acc[u], w, y[yrow * words + c]);
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint32_t c = base + lane + u * 32;
      if (c < words) dst[c] = to_bf16x8(acc[u]);
    }
  }
}

// Combine: 16 bytes (eight values, chunk c) of token t's output: the partial sums of the ranks
// its selections went to, added in f32 in rank order. Every peer's partial sums must have
// arrived (see the receive half).
DOORBELL_DEVICE_INLINE void combine_chunk(const MoeLlArgs& a, uint32_t t, uint32_t c) {
  const uint32_t words = a.hidden / 8;
  const uint32_t half = uint32_t(a.epochs[0] & 1);
  uint32_t ranks = 0;
  for (uint32_t k = 0; k < a.topk; ++k) {
    const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
    // An id past the experts names no rank (the send half dropped it too).
    if (e >= 0 && uint32_t(e) < a.experts_per_rank * a.world) ranks |= 1u << (uint32_t(e) / a.experts_per_rank);
  }
  const int4* part = reinterpret_cast<const int4*>(a.area[a.rank] + a.off_part);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint32_t r = 0; r < a.world; ++r) {
    if (!(ranks >> r & 1)) continue;
    const int4 v = part[((uint64_t(half) * a.world + r) * a.max_tokens + t) * words + c];
    add_bf16x8(acc, v);
  }
  reinterpret_cast<int4*>(a.out)[uint64_t(t) * words + c] = to_bf16x8(acc);
}

}  // namespace moe_ll
}  // namespace doorbell
#endif  // DOORBELL_CUDA
