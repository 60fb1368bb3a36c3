// MoE expert dispatch and combine inside a node over NVLink (high-throughput layout: a token goes
// to each destination rank once, however many of that rank's experts it selected).
//
// Dispatch, one kernel on the caller's stream (moe_dispatch, B blocks):
//   1. blocks [0, world), block r: the positions of the tokens bound for rank r (a block-wide
//      scan) and their count, stored straight into row `me` of every rank's count matrix as one
//      word with the call's number in it (no fence, no separate signal: the word is its own
//      flag), and a count on this GPU; block r also tells rank r which of my receive slots this
//      call's rows land in (the caller picks it: results of earlier calls in other slots stay).
//      A peer's word of this call also means that slot is free again: its stream has finished
//      everything before this call, the readers of the slot's previous results included.
//   2. every block waits for the counts of the lower ranks and this GPU's positions, so each
//      sender knows where its rows start in each receiver's results (after the rows of lower
//      ranks); a warp per (token, segment of its row), every warp of the grid with work and none
//      with two items where one would do, loads the row once and stores it, with the top-k ids
//      rebased to the receiver's local ids (-1 elsewhere), the weights (0 for experts elsewhere) and (source rank, token),
//      straight into the final place of every rank it goes to; every block then signals every
//      peer once (release: its rows land first) and counts itself done on this GPU.
//   3. once every peer's B signals and this GPU's B blocks are in, rows per local expert.
//   Nothing is copied twice. Every block of the grid is resident at once (B <= SMs), so the
//   waits between this GPU's own blocks cannot starve.
// The count matrix has two buffers, used by calls of alternating parity: a rank in call d + 1
// writes a peer's matrix only after that peer's call-d signals, which come after everything of
// call d - 1 on its stream (its combine's reads of the matrix included). A word holds the count
// in its low half and the dispatch number (mod 2^32) in its high half; the other parity's words
// are two calls old, so a stale word never carries this call's number.
// Combine, one kernel (moe_combine, B blocks), in one of two ways chosen by the grid (every rank
// has the same), each rank's combine area registered and mapped by every peer:
// Pulled (B > kPushBlocks): the area holds rows aligned with recv_x, and each source rank reads
// the rows of its own tokens straight from the ranks they went to:
//   1. for a second combine of one dispatch only, a signal each way first (the peer has finished
//      reading my area in its previous combine; after a dispatch the dispatch's signals already
//      said so);
//   2. the rows of y that came from other ranks into my area (none when the caller wrote them
//      there itself), split over every warp of the grid; every block signals every peer once;
//   3. once every peer's B signals arrived, for each token the rows of the ranks it went to, at
//      (rows of lower source ranks on that rank) + the token's position there, summed in f32 in
//      rank order into out; its own rows straight from y.
// Pushed (B <= kPushBlocks): the area has a row slot per (holding rank, position of the token in
// its owner's rows to that rank), and each rank stores the rows of y it holds for other ranks'
// tokens straight from y (wherever the caller has it) into their owners' areas:
//   1. as pulled;
//   2. the rows of y that came from other ranks, into their source rank's area at [me][position],
//      split over every warp of the grid; every block signals every peer once (release);
//   3. once every peer's B signals arrived, for each token the rows of the ranks it went to,
//      summed in f32 in rank order into out: the peers' from my own area, mine straight from y.
//      Local loads only. (Per-row flags letting the sums start before every push is in gained
//      nothing measurable on 2 x H100 at 20 blocks: 529-533 us either way.)
// Both sum in the same order, so their results are bit for bit the same. Both follow the layout
// of the dispatch whose receive slot the host names (its positions and rank prefix matrix live
// there), which need not be the last dispatch: two batches may be dispatched before either is
// combined. The area handshake keys on the last dispatch, so the first combine after it skips
// the signal and every later one (of any dispatch) waits for it.
// Every block keeps its own call count (`calls`, one slot per kernel and block, written by that
// block only), every wait's target derives from it, and every call consumes what it signals:
// CUDA-graph capturable, replays need no reset. Dispatch and combine are stream-ordered on each
// rank (one stream, or events between them).
#include <doorbell/coll/call_check.cuh>
#include <doorbell/coll/limits.cuh>
#include <doorbell/detail/collective_args.cuh>
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;

// Semaphore sets (`MoeArgs::sems`, [set][world]).
constexpr uint32_t kSetRows = 0;      // dispatch: a block's rows are in (B per call and peer)
constexpr uint32_t kSetRepeat = 1;    // combine: a second combine of one dispatch may start
constexpr uint32_t kSetCombined = 2;  // combine: a block's rows are in (B per call and peer)

// Grids of more blocks than this pull in the combine, others push. Measured at the prefill shape
// on 2 x H100 (4096 tokens a rank, hidden 7168, top-8 of 256-288, y in a separate buffer): with
// 132 blocks the pull (copy-in, then NVLink reads overlapping the local ones) took 225-235 us and
// the push 250; with 20 blocks (DeepEP's default) the push took 529-533 us, the pull 615 (537
// with y already in the combine area).
constexpr uint32_t kPushBlocks = 64;

// Slots of the call counts (`MoeArgs::calls`), per block unless said otherwise; each is written
// by its block only (the two GPU-wide counts by atomics).
constexpr uint32_t kDispatchCalls = 0;       // [B] dispatches so far
constexpr uint32_t kCombineCalls = 256;      // [B] combines so far
constexpr uint32_t kCombinedDispatch = 512;  // [B] the dispatch this block's last combine followed
constexpr uint32_t kRepeatCombines = 768;    // [B] combines that repeated one dispatch, so far
constexpr uint32_t kLayoutsDone = 1024;      // layout roles of this GPU done, over all calls
constexpr uint32_t kSentBlocks = 1025;       // blocks of this GPU done sending, over all calls

// This block's call number for the kernel whose counts start at `slots` (1 for the first call).
DOORBELL_DEVICE_INLINE uint64_t block_call(const MoeArgs& a, uint32_t slots) {
  __shared__ uint64_t n;
  if (threadIdx.x == 0) {
    n = a.calls[slots + blockIdx.x] + 1;
    a.calls[slots + blockIdx.x] = n;
  }
  __syncthreads();
  return n;
}

// The number of the last dispatch, read by the combine (this block's dispatch count).
DOORBELL_DEVICE_INLINE uint64_t last_dispatch(const MoeArgs& a) { return a.calls[kDispatchCalls + blockIdx.x]; }

// Waits (bounded) until the GPU-wide count at `slot` reached `target` (this GPU's own blocks),
// at my own entry's site (a site and no semaphore: with one rank it is the only entry).
DOORBELL_DEVICE_INLINE bool wait_own(const MoeArgs& a, uint32_t slot, uint64_t target) {
  return spin_until(a.sems[a.rank].site, kWaitSemaphore, target, [&](uint64_t& seen) {
    seen = load_acquire_gpu(a.calls + slot);
    return seen >= target;
  });
}

// wait_own for this grid's own blocks before results are marked cut short: after an abort too,
// since every block still reaches its count (its own waits leave at the abort) and a block still
// writing rows would overwrite the marks. Bounded by kOwnBlocksAfterAbortNs (the communicator
// has failed already: nothing more to report).
constexpr uint64_t kOwnBlocksAfterAbortNs = 1000000000ull;
DOORBELL_DEVICE_INLINE void wait_own_blocks(const MoeArgs& a, uint32_t slot, uint64_t target) {
  if (wait_own(a, slot, target)) return;
  const uint64_t start = global_timer_ns();
  while (load_acquire_gpu(a.calls + slot) < target && global_timer_ns() - start < kOwnBlocksAfterAbortNs) {
  }
}

// Adds one to the GPU-wide count at `slot`, after this thread's writes (one thread per block,
// after a __syncthreads).
DOORBELL_DEVICE_INLINE void count_own(const MoeArgs& a, uint32_t slot) {
  __threadfence();
  atomicAdd(reinterpret_cast<unsigned long long*>(a.calls + slot), 1ull);
}

// `owner`'s count matrix for dispatch number `d` ([source rank][destination rank], words of
// count | dispatch number << 32).
DOORBELL_DEVICE_INLINE uint64_t* count_matrix(const MoeArgs& a, uint32_t owner, uint64_t d) {
  return reinterpret_cast<uint64_t*>(a.land[owner] + a.off_matrix) + (d & 1) * a.world * a.world;
}

DOORBELL_DEVICE_INLINE uint64_t count_word(uint64_t d, uint32_t count) { return (d << 32) | count; }

// `owner`'s receive results of rank `r`'s slot `slot` (rows at 0, then the ids, weights, sources
// and scales at their offsets): each call's receiver picks one of its slots and tells every
// sender (the slot table below).
DOORBELL_DEVICE_INLINE char* results_at(const MoeArgs& a, uint32_t r, uint32_t slot) {
  return a.land[r] + uint64_t(slot) * a.slot_bytes;
}

// `owner`'s table of the receive slots of dispatch `d` ([rank], words of slot | dispatch number
// << 32, by call parity as the count matrix): entry r is where rank r takes this call's rows.
DOORBELL_DEVICE_INLINE uint64_t* slot_table(const MoeArgs& a, uint32_t owner, uint64_t d) {
  return reinterpret_cast<uint64_t*>(a.land[owner] + a.off_slots) + (d & 1) * a.world;
}

// The count of a word already known to belong to its call (the combine reads its dispatch's).
DOORBELL_DEVICE_INLINE uint32_t count_of(uint64_t word) { return static_cast<uint32_t>(word); }

// `owner`'s table of rows per expert by source for dispatch `d`, routing without top-k
// ([source][local expert], words of count | dispatch number << 32).
DOORBELL_DEVICE_INLINE uint64_t* expert_in(const MoeArgs& a, uint32_t owner, uint64_t d) {
  return reinterpret_cast<uint64_t*>(a.land[owner] + a.off_expert_in) + (d & 1) * a.world * a.experts_per_rank;
}

// `owner`'s combine area of top-k weights rows (`[world][max_tokens][topk]` f32, as the rows).
DOORBELL_DEVICE_INLINE float* comb_weights(const MoeArgs& a, uint32_t owner) {
  return reinterpret_cast<float*>(reinterpret_cast<char*>(a.comb_buf[owner]) + a.off_comb_weights);
}

// Rows ranks 0..s-1 sent rank r in the dispatch a combine follows, from that dispatch's rank
// prefix matrix (in its receive slot, so a combine may follow an earlier dispatch than the last);
// -1 after a dispatch an abort cut short.
DOORBELL_DEVICE_INLINE int32_t rows_before(const MoeArgs& a, uint32_t s, uint32_t r) {
  return s == 0 ? 0 : a.rank_prefix[uint64_t(s - 1) * a.world + r];
}

// Waits (bounded) until my matrix of dispatch `d` holds source rank `s`'s count for rank `r`,
// and returns it.
DOORBELL_DEVICE_INLINE uint32_t wait_count(const MoeArgs& a, uint64_t d, uint32_t s, uint32_t r) {
  const uint64_t* w = count_matrix(a, a.rank, d) + uint64_t(s) * a.world + r;
  const uint32_t tag = static_cast<uint32_t>(d);
  uint64_t word = 0;
  spin_until(a.sems[kSetRows * a.world + s].site, kWaitSemaphore, tag, [&](uint64_t& seen) {
    word = load_relaxed_sys(w);
    seen = word >> 32;
    return seen == tag;
  });
  return count_of(word);
}

// Waits (bounded) until my slot table of dispatch `d` holds rank `r`'s receive slot, and returns
// it.
DOORBELL_DEVICE_INLINE uint32_t wait_slot(const MoeArgs& a, uint64_t d, uint32_t r) {
  const uint64_t* w = slot_table(a, a.rank, d) + r;
  const uint32_t tag = static_cast<uint32_t>(d);
  uint64_t word = 0;
  spin_until(a.sems[kSetRows * a.world + r].site, kWaitSemaphore, tag, [&](uint64_t& seen) {
    word = load_relaxed_sys(w);
    seen = word >> 32;
    return seen == tag;
  });
  return count_of(word);
}

// Waits (bounded) until my table of dispatch `d` holds source rank `s`'s rows for local expert
// `e` (routing without top-k), and returns them.
DOORBELL_DEVICE_INLINE uint32_t wait_expert_in(const MoeArgs& a, uint64_t d, uint32_t s, uint32_t e) {
  const uint64_t* w = expert_in(a, a.rank, d) + uint64_t(s) * a.experts_per_rank + e;
  const uint32_t tag = static_cast<uint32_t>(d);
  uint64_t word = 0;
  spin_until(a.sems[kSetRows * a.world + s].site, kWaitSemaphore, tag, [&](uint64_t& seen) {
    word = load_relaxed_sys(w);
    seen = word >> 32;
    return seen == tag;
  });
  return count_of(word);
}

// Segments to split each of `rows` rows of `chunks` 16-byte chunks into, so that `warps` warps
// each get at most one (row, segment) where there are enough of them: as many as fit, at least
// one, at most one per 32 chunks (a warp's width).
DOORBELL_DEVICE_INLINE uint32_t row_segments(uint32_t rows, uint32_t warps, uint32_t chunks) {
  const uint32_t fit = rows ? warps / rows : 1;
  const uint32_t most = chunks / kWarp > 0 ? chunks / kWarp : 1;
  return fit < 1 ? 1 : (fit > most ? most : fit);
}

// Copies `bytes` (a multiple of 16, both ends 16-byte aligned) with one warp.
DOORBELL_DEVICE_INLINE void warp_copy16(void* dst, const void* src, uint64_t bytes, uint32_t lane) {
  int4* d = static_cast<int4*>(dst);
  const int4* s = static_cast<const int4*>(src);
  const uint64_t n = bytes / 16;
  uint64_t i = lane;
  for (; i + 3 * kWarp < n; i += 4 * kWarp) {
    const int4 v0 = s[i], v1 = s[i + kWarp], v2 = s[i + 2 * kWarp], v3 = s[i + 3 * kWarp];
    d[i] = v0;
    d[i + kWarp] = v1;
    d[i + 2 * kWarp] = v2;
    d[i + 3 * kWarp] = v3;
  }
  for (; i < n; i += kWarp) d[i] = s[i];
}

// Waits (bounded) until every peer's `set` token reached calls x per_call: all of this call's
// signals from every peer arrived. Any number of threads may wait; nothing is consumed.
DOORBELL_DEVICE_INLINE bool wait_all_peers(const MoeArgs& a, uint32_t set, uint64_t calls, uint32_t per_call) {
  const uint64_t target = calls * per_call;
  bool ok = true;
  for (uint32_t r = 0; r < a.world; ++r) {
    if (r == a.rank) continue;
    const SemaphoreHandle& h = a.sems[set * a.world + r];
    ok = spin_until(h.site, kWaitSemaphore, target, [&](uint64_t& seen) {
      seen = load_acquire_sys(h.inbound_token);
      return seen >= target;
    }) && ok;
  }
  return ok;  // false: a wait gave up (the communicator aborted)
}

// Where the rows of my tokens held by rank r start, for the combine's sums: rank r's (r != me)
// are in my combine area at [r][position], mine in y after the rows of lower source ranks.
DOORBELL_DEVICE_INLINE const int4* held_rows(const MoeArgs& a, uint32_t r, uint32_t own_first) {
  const uint64_t chunks = a.hidden / 8;
  if (r == a.rank) return reinterpret_cast<const int4*>(a.y) + own_first * chunks;
  return reinterpret_cast<const int4*>(a.comb_buf[a.rank]) + uint64_t(r) * a.max_tokens * chunks;
}

// The pushing combine's sums (combine_push, step 3). kW: the rank count when known at compile
// time (two items per thread, loads in registers), else 0 (one item, any rank count).
template <int kW>
DOORBELL_DEVICE_INLINE void sum_pushed_rows(const MoeArgs& a, uint32_t own_first) {
  constexpr uint32_t U = kW == 0 ? 1 : 2;
  constexpr uint32_t R = kW == 0 ? kMaxRanks : kW;
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;  // < 2^32, checked by the host
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += U * stride) {
    int4 v[U][R];
    bool has[U][R];
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t item = i + u * stride;
      const uint32_t t = item / chunks, c = item % chunks;
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        has[u][r] = false;
        if (item >= n_items || r >= a.world) continue;
        const int32_t p = a.pos[uint64_t(t) * a.world + r];
        has[u][r] = p >= 0;
        if (p >= 0) v[u][r] = held_rows(a, r, own_first)[uint64_t(p) * chunks + c];
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t item = i + u * stride;
      if (item >= n_items) continue;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        if (has[u][r]) add_bf16x8(acc, v[u][r]);
      }
      reinterpret_cast<int4*>(a.out)[item] = to_bf16x8(acc);
    }
  }
}

// The pulling combine's sums (combine_pull, step 3). kW: the rank count when known at compile time (two
// items per thread, loads in registers), else 0 (one item, any rank count).
template <int kW>
DOORBELL_DEVICE_INLINE void sum_pulled_rows(const MoeArgs& a, const uint32_t* first) {
  constexpr uint32_t U = kW == 0 ? 1 : 2;
  constexpr uint32_t R = kW == 0 ? kMaxRanks : kW;
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;  // < 2^32, checked by the host
  const uint32_t stride = gridDim.x * blockDim.x;
  auto rows = [&](uint32_t r) -> const int4* {
    return static_cast<const int4*>(r == a.rank ? static_cast<const void*>(a.y) : static_cast<const void*>(a.comb_buf[r]));
  };
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += U * stride) {
    int4 v[U][R];
    bool has[U][R];
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t item = i + u * stride;
      const uint32_t t = item / chunks, c = item % chunks;
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        has[u][r] = false;
        if (item >= n_items || r >= a.world) continue;
        const int32_t p = a.pos[uint64_t(t) * a.world + r];
        has[u][r] = p >= 0;
        if (p >= 0) v[u][r] = rows(r)[(first[r] + uint64_t(p)) * chunks + c];
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      const uint32_t item = i + u * stride;
      if (item >= n_items) continue;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        if (has[u][r]) add_bf16x8(acc, v[u][r]);
      }
      reinterpret_cast<int4*>(a.out)[item] = to_bf16x8(acc);
    }
  }
}

}  // namespace

// The call check (coll/call_check.cuh): the layout kernel and the combine's copy-in announce the
// call, the last kernel of each checks every peer made the same one.
DOORBELL_DEVICE_INLINE void check_moe_call(const MoeArgs& a) {
  check_call(a.call, a.rank, a.world, a.sems[checked_peer(a.world) % a.world].site);
}

// Blocks [0, world) of the dispatch: block r finds the positions of the tokens bound for rank r
// (a block-wide scan) and their count, stores it into row `me` of every rank's count matrix
// (dispatch `d`, the word carrying d) and counts itself done on this GPU.
DOORBELL_DEVICE_INLINE void dispatch_layout(const MoeArgs& a, uint64_t d) {
  const uint32_t r = blockIdx.x;
  const uint32_t tid = threadIdx.x;
  __shared__ uint32_t warp_sums[32];
  __shared__ uint32_t base;
  if (tid == 0) base = 0;
  if (r == a.rank) {
    for (uint32_t e = tid; e < a.experts_per_rank; e += blockDim.x) a.expert_counts[e] = 0;
  }
  __syncthreads();
  const uint32_t lane = tid % kWarp, warp = tid / kWarp, warps = blockDim.x / kWarp;
  for (uint32_t start = 0; start < a.num_tokens; start += blockDim.x) {
    const uint32_t t = start + tid;
    uint32_t flag = 0;
    if (t < a.num_tokens && a.in_rank != nullptr) {
      flag = a.in_rank[uint64_t(t) * a.world + r] != 0;
    } else if (t < a.num_tokens) {
      for (uint32_t k = 0; k < a.topk; ++k) {
        const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
        if (e >= 0 && uint32_t(e) / a.experts_per_rank == r) flag = 1;
      }
    }
    // Block-wide exclusive scan of the flags.
    const uint32_t ballot = __ballot_sync(0xffffffffu, flag);
    const uint32_t in_warp = __popc(ballot & ((1u << lane) - 1));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    uint32_t before = 0, total = 0;
    for (uint32_t w = 0; w < warps; ++w) {
      if (w < warp) before += warp_sums[w];
      total += warp_sums[w];
    }
    if (t < a.num_tokens) a.pos[uint64_t(t) * a.world + r] = flag ? int32_t(base + before + in_warp) : -1;
    __syncthreads();
    if (tid == 0) base += total;
    __syncthreads();
  }
  // My count for r into row `me` of every rank's matrix: one word, the call's number its flag;
  // and my receive slot into r's slot table (r sends me rows there).
  if (tid < a.world) store_relaxed_sys(count_matrix(a, tid, d) + uint64_t(a.rank) * a.world + r, count_word(d, base));
  if (tid == kWarp) store_relaxed_sys(slot_table(a, r, d) + a.rank, count_word(d, a.slot));
  // Routing without top-k: my rows per expert of rank r, into row `me` of r's table (flagged
  // words as the matrix's; r's final phase sums the rows).
  if (a.in_rank != nullptr && a.tokens_per_expert != nullptr) {
    for (uint32_t e = tid; e < a.experts_per_rank; e += blockDim.x) {
      const int32_t c = a.tokens_per_expert[uint64_t(r) * a.experts_per_rank + e];
      store_relaxed_sys(expert_in(a, r, d) + uint64_t(a.rank) * a.experts_per_rank + e, count_word(d, uint32_t(c)));
    }
  }
  if (tid == 0) count_own(a, kLayoutsDone);
}

extern "C" __global__ void __launch_bounds__(512) moe_dispatch(MoeArgs a) {
  announce_call(a.call, a.rank, a.world);
  const uint64_t d = block_call(a, kDispatchCalls);
  if (blockIdx.x < a.world) dispatch_layout(a, d);
  __shared__ uint32_t first[kMaxRanks];  // where my rows start in each rank's results
  __shared__ char* results[kMaxRanks];   // each rank's receive slot of this call
  // Thread r: rank r's word of this call (r has started it, so its results area is free), its
  // receive slot and the lower ranks' counts for r (where my rows start there); thread `kWarp`:
  // my positions.
  if (threadIdx.x < a.world) {
    if (threadIdx.x != a.rank) wait_count(a, d, threadIdx.x, a.rank);
    results[threadIdx.x] = results_at(a, threadIdx.x, threadIdx.x == a.rank ? a.slot : wait_slot(a, d, threadIdx.x));
    uint32_t before = 0;
    for (uint32_t s = 0; s < a.rank; ++s) before += wait_count(a, d, s, threadIdx.x);
    first[threadIdx.x] = before;
  }
  if (threadIdx.x == kWarp) wait_own(a, kLayoutsDone, d * a.world);
  __syncthreads();
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  // Warps numbered from block `world` on, the layout blocks' last: with fewer items than warps
  // the blocks that scanned get none.
  const uint32_t warp_id = ((blockIdx.x + gridDim.x - a.world) % gridDim.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  // bf16 rows are 2 x hidden bytes; FP8 rows hidden bytes plus hidden / 128 scales.
  const bool fp8 = a.scales != nullptr;
  const uint32_t chunks = fp8 ? a.hidden / 16 : a.hidden / 8;
  const uint32_t n_scales = a.hidden / 128;
  // Work items are (token, segment of its row): with few tokens (decode) the rows are split so
  // every warp has at most one item (rounding up would give some warps two, and the call would
  // wait for them); with many, one segment per token.
  const uint32_t segs = row_segments(a.num_tokens, warps, chunks);
  const uint32_t items = a.num_tokens * segs;
  for (uint32_t item = warp_id; item < items; item += warps) {
    const uint32_t t = item / segs, seg = item % segs;
    int4* dst[kMaxRanks];
    uint64_t row[kMaxRanks];
    uint32_t n = 0;
    for (uint32_t r = 0; r < a.world; ++r) {
      const int32_t p = a.pos[uint64_t(t) * a.world + r];
      if (p < 0) continue;
      row[n] = (uint64_t(r) << 40) | (first[r] + uint32_t(p));
      dst[n] = reinterpret_cast<int4*>(results[r]) + (first[r] + uint64_t(p)) * chunks;
      ++n;
    }
    if (n == 0) continue;
    // The row is read once and stored to every rank it goes to.
    const int4* src = reinterpret_cast<const int4*>(a.x) + uint64_t(t) * chunks;
    const uint32_t end = uint32_t(uint64_t(chunks) * (seg + 1) / segs);
    uint32_t c = uint32_t(uint64_t(chunks) * seg / segs) + lane;
    for (; c + 3 * kWarp < end; c += 4 * kWarp) {  // four loads in flight before the stores
      int4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = src[c + u * kWarp];
      for (uint32_t d = 0; d < n; ++d) {
#pragma unroll
        for (int u = 0; u < 4; ++u) dst[d][c + u * kWarp] = v[u];
      }
    }
    for (; c < end; c += kWarp) {
      const int4 v = src[c];
      for (uint32_t d = 0; d < n; ++d) dst[d][c] = v;
    }
    if (seg != 0) continue;
    for (uint32_t d = 0; d < n; ++d) {
      const uint32_t r = uint32_t(row[d] >> 40);
      const uint64_t j = row[d] & ((uint64_t(1) << 40) - 1);
      if (fp8) {
        float* scales = reinterpret_cast<float*>(results[r] + a.off_scales) + j * n_scales;
        for (uint32_t q = lane; q < n_scales; q += kWarp) scales[q] = a.scales[uint64_t(t) * n_scales + q];
      }
      int32_t* ids = reinterpret_cast<int32_t*>(results[r] + a.off_idx) + j * a.topk;
      float* weights = reinterpret_cast<float*>(results[r] + a.off_weights) + j * a.topk;
      for (uint32_t k = lane; a.in_rank == nullptr && k < a.topk; k += kWarp) {
        const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
        const bool here = e >= 0 && uint32_t(e) / a.experts_per_rank == r;
        ids[k] = here ? int32_t(uint32_t(e) % a.experts_per_rank) : -1;
        weights[k] = here ? a.topk_weights[uint64_t(t) * a.topk + k] : 0.0f;  // DeepEP: 0 elsewhere
      }
      if (lane == 0) {
        int32_t* src_info = reinterpret_cast<int32_t*>(results[r] + a.off_src) + 2 * j;
        src_info[0] = int32_t(a.rank);
        src_info[1] = int32_t(t);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[kSetRows * a.world + threadIdx.x].signal();
  // This block's rows into my own results are written too: count it done on this GPU (the
  // histogram below reads rows that other blocks of this grid wrote).
  if (threadIdx.x == 0) count_own(a, kSentBlocks);

  // Every row of this call is in once every peer's B blocks signalled and this GPU's B blocks
  // are done (every block of the grid is resident, so waiting here cannot starve a sender).
  // A dispatch cut short (a wait gave up, or the communicator failed) marks its results:
  // num_recv kCutCount, kCutBit into every expert count, all ones (NaN) over this block's share
  // of every row slot (the counts of a stale word would index rows of another call).
  __shared__ uint32_t total;
  __shared__ bool cut;
  if (threadIdx.x == 0) {
    bool ok = wait_all_peers(a, kSetRows, d, a.blocks);
    wait_own_blocks(a, kSentBlocks, d * a.blocks);
    uint32_t n = 0;
    for (uint32_t s = 0; s < a.world; ++s) n += wait_count(a, d, s, a.rank);
    cut = !ok || failed(a.sems[checked_peer(a.world) % a.world].site);
    total = cut ? 0u : n;
    if (blockIdx.x == 0) *a.num_recv = cut ? kCutCount : n;
  }
  // Per-block histograms in shared memory, then one global add per expert and block: the same
  // few counters hit by every thread would serialize on global atomics.
  __shared__ uint32_t hist[kHtMaxLocalExperts];
  for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int32_t* ids = reinterpret_cast<const int32_t*>(results[a.rank] + a.off_idx);
  const uint64_t n = a.in_rank != nullptr || cut ? 0 : uint64_t(total) * a.topk;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const int32_t e = ids[i];
    if (e >= 0) atomicAdd(&hist[e], 1u);
  }
  // Routing without top-k: the sources' own counts per expert (block 0).
  if (a.in_rank != nullptr && a.tokens_per_expert != nullptr && blockIdx.x == 0 && !cut) {
    for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) {
      uint32_t sum = 0;
      for (uint32_t s = 0; s < a.world; ++s) sum += wait_expert_in(a, d, s, e);
      hist[e] = sum;
    }
  }
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) {
    if (hist[e]) atomicAdd(&a.expert_counts[e], hist[e]);
    if (cut) atomicOr(&a.expert_counts[e], kCutBit);
  }
  // DeepEP's num_worst_tokens: the rows past the received ones, up to fill_rows, carry no
  // expert (-1 ids), so a caller reading a fixed number of rows sees them empty.
  if (a.in_rank == nullptr && !cut && a.fill_rows > total) {
    int32_t* mine = reinterpret_cast<int32_t*>(results[a.rank] + a.off_idx);
    const uint64_t end = uint64_t(a.fill_rows) * a.topk;
    for (uint64_t i = uint64_t(total) * a.topk + blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < end;
         i += uint64_t(gridDim.x) * blockDim.x) {
      mine[i] = -1;
    }
  }
  // DeepEP's rank_prefix_matrix ([s][r]: rows that ranks 0..=s send rank r), by block 0: every
  // rank stores its counts into every rank's matrix before its rows, so these waits end at once.
  if (blockIdx.x == 0 && threadIdx.x < a.world) {
    const uint32_t r = threadIdx.x;
    int32_t sum = 0;
    for (uint32_t s = 0; s < a.world; ++s) {
      if (!cut) sum += int32_t(wait_count(a, d, s, r));
      a.rank_prefix[uint64_t(s) * a.world + r] = cut ? -1 : sum;
    }
  }
  if (cut) {
    const uint64_t row_bytes = a.scales != nullptr ? a.hidden : uint64_t(a.hidden) * 2;
    const uint64_t words = uint64_t(a.world) * a.max_tokens * row_bytes / 16;
    int4* rows = reinterpret_cast<int4*>(results[a.rank]);
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < words; i += uint64_t(gridDim.x) * blockDim.x) {
      rows[i] = make_int4(-1, -1, -1, -1);
    }
  }
  check_moe_call(a);
}

// The pulling combine (moe_combine, pulled: see the top of the file), for call `c` after
// dispatch `d`.
DOORBELL_DEVICE_INLINE void combine_pull(const MoeArgs& a, uint64_t c) {
  // Only the rows peers read: those of other source ranks. My own tokens' rows stay in y, where
  // the sums below read them (on 2 ranks that halves the copy). A cut dispatch (its prefix
  // matrix all -1) left no rows to copy.
  const bool cut_dispatch = rows_before(a, a.world, a.rank) < 0;
  const uint32_t total = cut_dispatch ? 0u : uint32_t(rows_before(a, a.world, a.rank));
  const uint32_t own_first = cut_dispatch ? 0u : uint32_t(rows_before(a, a.rank, a.rank));
  const uint32_t own_rows = cut_dispatch ? 0u : uint32_t(rows_before(a, a.rank + 1, a.rank)) - own_first;
  const uint32_t others = total - own_rows;
  if (a.y_weights != nullptr && !cut_dispatch) {
    // The rows' top-k weights, to be summed as the rows are (DeepEP's combined_topk_weights).
    float* w = comb_weights(a, a.rank);
    const uint64_t n = uint64_t(others) * a.topk;
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
      const uint64_t row = i / a.topk;
      const uint64_t j = row < own_first ? row : row + own_rows;
      w[j * a.topk + i % a.topk] = a.y_weights[j * a.topk + i % a.topk];
    }
  }
  if (static_cast<const void*>(a.y) != static_cast<const void*>(a.comb_buf[a.rank])) {
    const uint32_t lane = threadIdx.x % kWarp;
    const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
    // (row, segment) items as in the dispatch: a decode batch's few rows are split over every
    // warp of the grid instead of keeping a few warps busy while the rest wait.
    const uint32_t chunks = a.hidden / 8;
    const uint32_t segs = row_segments(others, warps, chunks);
    int4* mine = reinterpret_cast<int4*>(a.comb_buf[a.rank]);
    const int4* y = reinterpret_cast<const int4*>(a.y);
    for (uint32_t i = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; i < others * segs; i += warps) {
      const uint32_t row = i / segs, seg = i % segs;
      const uint64_t j = row < own_first ? row : row + own_rows;
      const uint32_t from = uint32_t(uint64_t(chunks) * seg / segs), to = uint32_t(uint64_t(chunks) * (seg + 1) / segs);
      warp_copy16(mine + j * chunks + from, y + j * chunks + from, uint64_t(to - from) * 16, lane);
    }
  }
  // Every block tells every peer its rows are in (release: the block's copies first); the sums
  // below wait for all of them (my own rows are read from y, so no wait on this GPU's blocks).
  __syncthreads();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[kSetCombined * a.world + threadIdx.x].signal();

  __shared__ uint32_t first[kMaxRanks];  // where my tokens' rows start on each rank
  bool in = true;
  if (threadIdx.x == 0) in = wait_all_peers(a, kSetCombined, c, a.blocks);
  if (__syncthreads_or(!in)) {
    // Cut short (the communicator aborted): the peers' rows are not all in, so this block's
    // share of the output is all ones (NaN in bf16), not a sum of the buffers' old rows.
    const uint32_t n_items = a.num_tokens * (a.hidden / 8);
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += gridDim.x * blockDim.x) {
      reinterpret_cast<int4*>(a.out)[i] = make_int4(-1, -1, -1, -1);
    }
    if (a.out_weights != nullptr) {
      for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.num_tokens * a.topk; i += gridDim.x * blockDim.x) {
        a.out_weights[i] = __int_as_float(-1);
      }
    }
    return;
  }
  if (threadIdx.x < a.world) first[threadIdx.x] = cut_dispatch ? 0u : uint32_t(rows_before(a, a.rank, threadIdx.x));
  __syncthreads();
  // A thread per (token, 16 bytes of its row): every rank the token went to adds its eight bf16
  // values, in rank order, in f32; all of a thread's loads are in flight before the sums, and
  // there are enough threads for a decode batch's few tokens as for prefill's many. On 2 ranks
  // (the rank count known at compile time) each thread takes two items at once, its loads in
  // registers: twice the NVLink reads in flight.
  if (a.world == 2) {
    sum_pulled_rows<2>(a, first);
  } else {
    sum_pulled_rows<0>(a, first);
  }
  if (a.out_weights != nullptr) {
    // A thread per (token, k): the weights of every rank the token went to, in rank order, f32.
    const uint32_t n = a.num_tokens * a.topk;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
      const uint32_t t = i / a.topk, k = i % a.topk;
      float acc = 0.0f;
      for (uint32_t r = 0; r < a.world; ++r) {
        const int32_t p = a.pos[uint64_t(t) * a.world + r];
        if (p < 0) continue;
        const float* w = r == a.rank ? a.y_weights : comb_weights(a, r);
        acc += w[(first[r] + uint64_t(p)) * a.topk + k];
      }
      a.out_weights[i] = acc;
    }
  }
}

// The pushing combine (moe_combine, pushed: see the top of the file), for call `c` after
// dispatch `d`.
DOORBELL_DEVICE_INLINE void combine_push(const MoeArgs& a, uint64_t c) {
  // The rows of y from source rank s are its rows [start[s], start[s] + count(s -> me)) here,
  // in the order of s's positions; those of other sources go to their owners, mine stay in y.
  // A cut dispatch (its prefix matrix all -1) left no rows to push.
  __shared__ uint32_t start[kMaxRanks + 1];
  const bool cut_dispatch = rows_before(a, a.world, a.rank) < 0;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t chunks = a.hidden / 8;
  if (threadIdx.x <= a.world) start[threadIdx.x] = cut_dispatch ? 0u : uint32_t(rows_before(a, threadIdx.x, a.rank));
  __syncthreads();
  const uint32_t total = start[a.world];
  const uint32_t own_first = start[a.rank];
  const uint32_t own_rows = start[a.rank + 1] - own_first;
  const uint32_t others = total - own_rows;
  // Row j of y (j not mine) goes to source rank `src`, slot [me][j - start[src]] there.
  auto owner_of = [&](uint64_t j) {
    uint32_t src = 0;
    while (src + 1 < a.world && j >= start[src + 1]) ++src;
    return src;
  };
  if (a.y_weights != nullptr) {
    // The rows' top-k weights, to be summed as the rows are (DeepEP's combined_topk_weights).
    const uint64_t n = uint64_t(others) * a.topk;
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
      const uint64_t row = i / a.topk, k = i % a.topk;
      const uint64_t j = row < own_first ? row : row + own_rows;
      const uint32_t src = owner_of(j);
      const uint64_t slot = uint64_t(a.rank) * a.max_tokens + (j - start[src]);
      comb_weights(a, src)[slot * a.topk + k] = a.y_weights[j * a.topk + k];
    }
  }
  {
    const uint32_t lane = threadIdx.x % kWarp;
    // (row, segment) items as in the dispatch: a decode batch's few rows are split over every
    // warp of the grid instead of keeping a few warps busy while the rest wait.
    const uint32_t my_segs = row_segments(others, warps, chunks);
    const int4* y = reinterpret_cast<const int4*>(a.y);
    for (uint32_t i = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; i < others * my_segs; i += warps) {
      const uint32_t row = i / my_segs, seg = i % my_segs;
      const uint64_t j = row < own_first ? row : row + own_rows;
      const uint32_t src = owner_of(j);
      const uint64_t slot = uint64_t(a.rank) * a.max_tokens + (j - start[src]);
      int4* there = reinterpret_cast<int4*>(a.comb_buf[src]) + slot * chunks;
      const uint32_t from = uint32_t(uint64_t(chunks) * seg / my_segs), to = uint32_t(uint64_t(chunks) * (seg + 1) / my_segs);
      warp_copy16(there + from, y + j * chunks + from, uint64_t(to - from) * 16, lane);
    }
  }
  // Every block tells every peer its pushes are in (release: the block's stores first); the sums
  // below wait for all of them (my own rows are read from y, so no wait on this GPU's blocks).
  __syncthreads();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[kSetCombined * a.world + threadIdx.x].signal();
  bool in = true;
  if (threadIdx.x == 0) in = wait_all_peers(a, kSetCombined, c, a.blocks);
  if (__syncthreads_or(!in)) {
    // Cut short (the communicator aborted): the peers' rows are not all in, so this block's
    // share of the output is all ones (NaN in bf16), not a sum of the area's old rows.
    const uint32_t n_items = a.num_tokens * (a.hidden / 8);
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n_items; i += gridDim.x * blockDim.x) {
      reinterpret_cast<int4*>(a.out)[i] = make_int4(-1, -1, -1, -1);
    }
    if (a.out_weights != nullptr) {
      for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.num_tokens * a.topk; i += gridDim.x * blockDim.x) {
        a.out_weights[i] = __int_as_float(-1);
      }
    }
    return;
  }

  // A thread per (token, 16 bytes of its row): every rank the token went to adds its eight bf16
  // values, in rank order, in f32; all of a thread's loads are in flight before the sums, and
  // there are enough threads for a decode batch's few tokens as for prefill's many. On 2 ranks
  // (the rank count known at compile time) each thread takes two items at once, its loads in
  // registers.
  if (a.world == 2) {
    sum_pushed_rows<2>(a, own_first);
  } else {
    sum_pushed_rows<0>(a, own_first);
  }
  if (a.out_weights != nullptr) {
    // A thread per (token, k): the weights of every rank the token went to, in rank order, f32.
    const uint32_t n = a.num_tokens * a.topk;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
      const uint32_t t = i / a.topk, k = i % a.topk;
      float acc = 0.0f;
      for (uint32_t r = 0; r < a.world; ++r) {
        const int32_t p = a.pos[uint64_t(t) * a.world + r];
        if (p < 0) continue;
        acc += r == a.rank ? a.y_weights[(own_first + uint64_t(p)) * a.topk + k]
                           : comb_weights(a, a.rank)[(uint64_t(r) * a.max_tokens + p) * a.topk + k];
      }
      a.out_weights[i] = acc;
    }
  }
}

extern "C" __global__ void __launch_bounds__(512, 1) moe_combine(MoeArgs a) {
  announce_call(a.call, a.rank, a.world);
  const uint64_t c = block_call(a, kCombineCalls);
  const uint64_t d = last_dispatch(a);
  // A second combine of one dispatch: wait until every peer has finished reading its combine
  // area in its previous combine (it started this one: block 0 signals once per peer). After a
  // dispatch its signals already said so. Every thread reads the slot before thread 0 rewrites
  // it below (else a late warp would take a first combine for a second, and stop at a barrier
  // the others never reach).
  const bool repeat = a.calls[kCombinedDispatch + blockIdx.x] == d;
  __syncthreads();
  if (repeat) {
    const uint64_t repeats = a.calls[kRepeatCombines + blockIdx.x] + 1;
    if (blockIdx.x == 0 && threadIdx.x < a.world && threadIdx.x != a.rank) a.sems[kSetRepeat * a.world + threadIdx.x].signal();
    if (threadIdx.x == 0) wait_all_peers(a, kSetRepeat, repeats, 1);
    __syncthreads();
    if (threadIdx.x == 0) a.calls[kRepeatCombines + blockIdx.x] = repeats;
  }
  if (threadIdx.x == 0) a.calls[kCombinedDispatch + blockIdx.x] = d;
  if (a.blocks > kPushBlocks) {
    combine_pull(a, c);
  } else {
    combine_push(a, c);
  }
  check_moe_call(a);
}
