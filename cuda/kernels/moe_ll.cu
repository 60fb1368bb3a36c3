// MoE dispatch and combine for decode (low latency), DeepEP's low-latency semantics: fixed
// worst-case buffers sized from max tokens per rank, a per-expert layout (one row per selected
// (token, expert)), counts only on the device, no count exchange before rows move, CUDA-graph
// capturable, and send and receive halves that can be called separately so other work overlaps
// the transfer. Over NVLink a row crosses once per destination rank (see coll/moe_ll.cuh).
//
// Layout on every rank: [2 halves][local expert][source rank][max_tokens] rows (coll/moe_args.cuh
// lists the sections). The half is the parity of the dispatch epoch, so a dispatch never
// overwrites rows the previous one delivered (two results may be alive at once, as with DeepEP).
//
// dispatch send (moe_ll_dispatch_send): a warp per (token, destination rank) reserves a slot of each
// selected expert there (an atomic on my own counter), writes the row once into the first (the
// carrier) and the selections' metadata, then after a system fence announces the carrier in the
// destination's queue for this source (moe_ll::put). The warp that finishes the call's last
// (token, rank) item publishes, for every expert, `epoch << 32 | rows` into the owner's count
// word and, for every rank, the carriers it sent there, after a system fence (no semaphores; the
// epoch tells a fresh word from last call's), and zeroes the counters; the last block stores the
// epoch.
// dispatch receive (moe_ll_dispatch_recv): warps take queue entries (entry j of every source before j + 1)
// and copy each carrier row into its pair's other slots the moment its entry appears; an entry
// past the source's carrier count is skipped. Block 0 waits for the count words and writes the
// rows per (expert, source) and per expert. moe_ll_dispatch runs both in one kernel, half of
// each block's warps sending while the other half copy, so copies overlap the transfer.
// combine send (moe_ll_combine_send): a warp per carrier row sends its pair's weighted partial sum
// to the token's rank (moe_ll::send_partial); the last block signals every peer.
// combine receive (moe_ll_combine_recv): waits for every peer's signal of this call, then adds
// each token's partial sums (moe_ll::combine_chunk). moe_ll_combine does both in one kernel.
//
// DeepEP's layout (MoeLlArgs::packed, MoeConfig::with_deep_ep_layout): the send half is the same;
// the receive half skips the copies into the slots and, once every source's counts are in,
// writes each local expert's rows packed from row 0 in source order into the caller's outputs,
// straight from the row that crossed (with FP8 rows, the send half cast it: e4m3 and scales
// cross, and are copied), with each row's source
// token and each (expert, source) range (pack_rows). The combine returns every row unweighted
// to its token's rank (combine_send_packed), which weighs them with the weights given to the
// combine (combine_recv_packed): DeepEP's traffic and semantics.
#include <doorbell/coll/limits.cuh>
#include <doorbell/coll/moe_ll.cuh>
#include <doorbell/detail/collective_args.cuh>  // kCutCount
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;

// Per-(expert, source) counts of the receive half (write_layout, or pack_rows's counts and
// beginnings in its two halves): one array, so a kernel with both paths fits its shared memory.
__shared__ uint32_t pair_scratch[kLlMaxPairs];

// The largest of `n[0..count)`, computed by the whole block.
__device__ uint32_t block_max(const uint32_t* n, uint32_t count) {
  __shared__ uint32_t best;
  if (threadIdx.x == 0) best = 0;
  __syncthreads();
  uint32_t m = 0;
  for (uint32_t q = threadIdx.x; q < count; q += blockDim.x) m = max(m, n[q]);
  atomicMax(&best, m);
  __syncthreads();
  return best;
}

// The send half, warps [0, nsend) of every block: item i (token i / world to rank i % world)
// goes to block i % grid, so every SM pushes a few rows; a warp per item (moe_ll::put). With no
// tokens the first warp publishes the (zero) counts at once: this rank's own receive warps wait
// for them before the block can reach finish_send (which would publish them too, harmlessly).
__device__ void send_items(const MoeLlArgs& a, uint32_t warp, uint32_t nsend) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t items = a.num_tokens * a.world;
  if (items == 0 && blockIdx.x == 0 && warp == 0) {
    __threadfence_system();
    moe_ll::publish_counts(a, moe_ll::send_epoch(a), lane);
  }
  for (uint32_t item = warp * gridDim.x + blockIdx.x; item < items; item += nsend * gridDim.x) {
    const uint32_t t = item / a.world;
    moe_ll::put(a, t, item % a.world, a.x + uint64_t(t) * a.hidden, lane);
  }
}

// The receive half's copies, by `nrecv` warps over the grid (this is warp `w`): entry j of every
// source's queue (the carrier rows it announced, in the order it wrote them) is taken by `parts`
// warps, each copying its share of the carrier row into the pair's other selections' slots as
// soon as the entry appears. An entry past the source's final count (its sent word) is skipped.
__device__ void copy_announced(const MoeLlArgs& a, uint64_t epoch, uint32_t w, uint32_t nrecv) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t entries = a.world * a.max_tokens;
  const uint32_t parts = max(1u, min(8u, nrecv / entries));
  const int32_t* from = moe_ll::section<int32_t>(a, a.rank, a.off_from);
  const int32_t* rec = moe_ll::section<int32_t>(a, a.rank, a.off_rec);
  int4* rows = reinterpret_cast<int4*>(a.area[a.rank]);
  const uint32_t words = a.hidden / 8;
  constexpr uint32_t kUnroll = 8;
  for (uint64_t x = w; x < uint64_t(entries) * parts; x += nrecv) {
    const uint32_t e = uint32_t(x / parts), part = uint32_t(x % parts);
    const uint32_t j = e / a.world, src = e % a.world;  // entry j of every source before entry j + 1
    const uint64_t* entry = moe_ll::queue_entry(a, a.rank, half, src, j);
    const uint64_t* sent = moe_ll::sent_word(a, a.rank, half, src);
    uint64_t got = 0;
    bool none = false;
    const bool arrived = spin_until(moe_ll::site(a, src), kWaitPacket, epoch, [&](uint64_t& seen) {
      got = load_acquire_sys(entry);
      if ((got >> 32) == epoch) return true;
      const uint64_t n = load_acquire_sys(sent);
      seen = n >> 32;
      none = seen == epoch && j >= uint32_t(n);
      return none;
    });
    // A wait that left (abort, budget) has no entry: its stale carrier row would index garbage.
    if (none || !arrived) continue;
    const uint64_t carrier = uint32_t(got);
    const uint32_t n = uint32_t(-from[carrier]);  // the pair's selections; rec lists the carrier first
    const int32_t slot = lane < n ? rec[carrier * a.topk + lane] : 0;
    const uint32_t begin = uint32_t(uint64_t(words) * part / parts), end = uint32_t(uint64_t(words) * (part + 1) / parts);
    for (uint32_t base = begin; base < end; base += kWarp * kUnroll) {  // uniform: the shuffles need every lane
      int4 v[kUnroll];
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + lane + u * kWarp;
        if (i < end) v[u] = rows[carrier * words + i];
      }
      for (uint32_t k = 1; k < n; ++k) {
        const uint64_t to = uint32_t(__shfl_sync(0xffffffffu, slot, k));
#pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
          const uint32_t i = base + lane + u * kWarp;
          if (i < end) rows[to * words + i] = v[u];
        }
      }
    }
  }
}

// The receive half's bookkeeping, one block: waits (bounded) for every count word of `epoch`
// and writes the rows per (expert, source) and per expert. A dispatch cut short (a wait here
// gave up, or the communicator failed while other blocks still copied: their skipped entries
// leave slots stale) writes no layout (the combine then sends nothing), every expert's count
// kCutCount, and all ones (NaN) over every row of this half: nothing of it passes for a result.
__device__ void write_layout(const MoeLlArgs& a, uint64_t epoch) {
  uint32_t* rows_of = pair_scratch;
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t pairs = a.experts_per_rank * a.world;
  bool gave_up = false;
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) {
    const uint32_t src = q % a.world;
    const uint64_t* word = moe_ll::count_word(a, a.rank, half, q / a.world, src);
    uint64_t got = 0;
    if (!spin_until(moe_ll::site(a, src), kWaitPacket, epoch, [&](uint64_t& seen) {
          got = load_acquire_sys(word);
          seen = got >> 32;
          return seen == epoch;
        })) {
      got = 0;  // the wait left: no rows (a stale count would index the other half's rows)
      gave_up = true;
    }
    rows_of[q] = uint32_t(got);
  }
  const bool cut = __syncthreads_or(gave_up || (threadIdx.x == 0 && failed(moe_ll::site(a, a.rank))));
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) a.layout[q] = cut ? 0u : rows_of[q];
  for (uint32_t le = threadIdx.x; le < a.experts_per_rank; le += blockDim.x) {
    uint32_t n = 0;
    for (uint32_t src = 0; src < a.world; ++src) n += rows_of[le * a.world + src];
    a.recv_count[le] = cut ? kCutCount : n;
  }
  if (cut) {
    const uint64_t words = moe_ll::half_rows(a) * (a.hidden / 8);
    int4* rows = reinterpret_cast<int4*>(a.area[a.rank]) + half * words;
    for (uint64_t i = threadIdx.x; i < words; i += blockDim.x) rows[i] = make_int4(-1, -1, -1, -1);
  }
}

// ---- DeepEP's layout ----

constexpr uint32_t kMaxPackedPairs = kLlMaxPairs / 2;  // local experts x ranks (= experts), checked on the host

// Rows per local expert in the packed outputs.
__device__ uint32_t packed_cap(const MoeLlArgs& a) { return a.world * a.max_tokens; }

// The source whose rows hold position `i` of a local expert, or -1 past them; `range(src, begin,
// rows)` gives each source's range. One warp, every lane with its lane id.
template <typename Range>
__device__ int32_t source_of(uint32_t world, uint32_t i, uint32_t lane, Range range) {
  for (uint32_t base = 0; base < world; base += kWarp) {
    const uint32_t src = base + lane;
    bool hit = false;
    if (src < world) {
      uint32_t begin = 0, rows = 0;
      range(src, begin, rows);
      hit = i >= begin && i - begin < rows;
    }
    const uint32_t m = __ballot_sync(0xffffffffu, hit);
    if (m != 0) return int32_t(base + __ffs(m) - 1);
  }
  return -1;
}

// Adds the cycles since `start` to source `src`'s wait (MoeLlArgs::wait_cycles, given).
__device__ void add_wait_cycles(const MoeLlArgs& a, uint32_t src, long long start) {
  atomicAdd(reinterpret_cast<unsigned long long*>(a.wait_cycles + src), static_cast<unsigned long long>(clock64() - start));
}

// Where the scale of group `g` of packed row (`le`, `pos`) goes (column-major, as DeepEP's).
__device__ void store_scale(const MoeLlArgs& a, uint32_t le, uint32_t g, uint32_t pos, float scale_inv) {
  const uint64_t cap = packed_cap(a);
  if (a.packed & kPackedUe8m0) {
    uint8_t* s = static_cast<uint8_t*>(a.packed_scales);
    s[((uint64_t(le) * (a.hidden / 512) + g / 4) * cap + pos) * 4 + g % 4] = uint8_t(__float_as_uint(scale_inv) >> 23);
  } else {
    static_cast<float*>(a.packed_scales)[(uint64_t(le) * (a.hidden / 128) + g) * cap + pos] = scale_inv;
  }
}

// The receive half in DeepEP's layout, every block: waits (bounded) for every count word of
// `epoch`, takes each local expert's ranges in source order, and writes every received row at
// its packed place straight from the row that crossed (its carrier), with its source token; block
// 0 writes the ranges, the counts, the legacy per-(expert, source) counts, and adds to the stats.
// A dispatch cut short (a wait gave up, or the communicator failed) writes count -1, no ranges,
// and all ones (NaN in bf16 and e4m3, and in the scales) over the rows of the blocks that saw it.
__device__ void pack_rows(const MoeLlArgs& a, uint64_t epoch) {
  uint32_t* rows_of = pair_scratch;
  uint32_t* begin_of = pair_scratch + kMaxPackedPairs;
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t world = a.world, local = a.experts_per_rank, pairs = local * world, cap = packed_cap(a);
  bool gave_up = false;
  const long long start = clock64();
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) {
    const uint32_t src = q % world;
    const uint64_t* word = moe_ll::count_word(a, a.rank, half, q / world, src);
    uint64_t got = 0;
    if (moe_ll::masked(a, src)) {
      got = 0;  // a masked source sends nothing (its experts' selections read as -1)
    } else if (!spin_until(moe_ll::site(a, src), kWaitPacket, epoch, [&](uint64_t& seen) {
                 got = load_acquire_sys(word);
                 seen = got >> 32;
                 return seen == epoch;
               })) {
      got = 0;
      // A source that died (tolerated: a rank mask) sent nothing; anything else cuts the call.
      if (!peer_lost(moe_ll::site(a, src))) gave_up = true;
    }
    rows_of[q] = min(uint32_t(got), a.max_tokens);  // a sender reserves at most max_tokens
    if (a.wait_cycles != nullptr && blockIdx.x == 0) add_wait_cycles(a, src, start);
  }
  const bool cut = __syncthreads_or(gave_up || (threadIdx.x == 0 && failed(moe_ll::site(a, a.rank))));
  for (uint32_t le = threadIdx.x; le < local; le += blockDim.x) {
    uint32_t n = 0;
    for (uint32_t src = 0; src < world; ++src) {
      begin_of[le * world + src] = n;
      n += rows_of[le * world + src];
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) {
      a.packed_range[q] = cut ? 0 : int64_t((uint64_t(begin_of[q]) << 32) | rows_of[q]);
      a.layout[q] = cut ? 0u : rows_of[q];
    }
    for (uint32_t le = threadIdx.x; le < local; le += blockDim.x) {
      const uint32_t last = le * world + world - 1;
      const uint32_t n = begin_of[last] + rows_of[last];
      a.packed_count[le] = cut ? -1 : int32_t(n);
      a.recv_count[le] = cut ? kCutCount : n;
      if (!cut && a.packed_stats != nullptr) a.packed_stats[le] += int32_t(n);
    }
  }
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t words = a.hidden / 8;
  const bool fp8 = (a.packed & kPackedFp8) != 0;
  const uint64_t row_bytes = fp8 ? uint64_t(a.hidden) : uint64_t(a.hidden) * 2;
  const int32_t* from = moe_ll::section<int32_t>(a, a.rank, a.off_from);
  const int32_t* token = moe_ll::section<int32_t>(a, a.rank, a.off_src);
  const int4* rows = reinterpret_cast<const int4*>(a.area[a.rank]);
  for (uint64_t p = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; p < uint64_t(local) * cap; p += warps) {
    const uint32_t le = uint32_t(p / cap), i = uint32_t(p % cap);
    uint8_t* dst = a.packed_x + p * row_bytes;
    if (cut) {
      for (uint64_t w = lane; w < row_bytes / 16; w += kWarp) reinterpret_cast<int4*>(dst)[w] = make_int4(-1, -1, -1, -1);
      if (fp8) {
        for (uint32_t g = lane; g < a.hidden / 128; g += kWarp) store_scale(a, le, g, i, __uint_as_float(~0u));
      }
      continue;
    }
    const int32_t src = source_of(world, i, lane, [&](uint32_t s, uint32_t& begin, uint32_t& n) {
      begin = begin_of[le * world + s];
      n = rows_of[le * world + s];
    });
    if (src < 0) continue;  // past the expert's rows
    const uint64_t at = moe_ll::row_index(a, half, le, uint32_t(src), i - begin_of[le * world + src]);
    const int32_t f = from[at];
    const uint64_t carrier = f < 0 ? at : uint64_t(f);
    if (lane == 0) a.packed_src[p] = token[at];
    if (fp8) {
      // The send half cast the row (moe_ll::push_row_fp8): e4m3 bytes, then a scale per group.
      const uint8_t* slot = reinterpret_cast<const uint8_t*>(rows + carrier * words);
      copy_words_batched<int4, 8>(reinterpret_cast<int4*>(dst), reinterpret_cast<const int4*>(slot), a.hidden / 16, lane,
                                  kWarp);
      const float* scales = reinterpret_cast<const float*>(slot + a.hidden);
      for (uint32_t g = lane; g < a.hidden / 128; g += kWarp) store_scale(a, le, g, i, scales[g]);
    } else {
      copy_words_batched<int4, 8>(reinterpret_cast<int4*>(dst), rows + carrier * words, words, lane, kWarp);
    }
  }
}

// Waits until every peer signalled combine `call` and this rank's own send grid finished it (a
// fused combine's blocks read rows other blocks of the same grid wrote: the send's last block
// stores the call only after every block's rows). False when a wait gave up. One thread per rank;
// with `timed`, block 0 adds each rank's wait to MoeLlArgs::wait_cycles (when given).
__device__ bool combine_arrived(const MoeLlArgs& a, uint64_t call, uint32_t* lost = nullptr, bool timed = false) {
  bool ok = true;
  const long long start = clock64();
  if (threadIdx.x < a.world && threadIdx.x != a.rank && !moe_ll::masked(a, threadIdx.x)) {
    const SemaphoreHandle& h = a.ready[threadIdx.x];
    ok = spin_until(h.site, kWaitSemaphore, call, [&](uint64_t& seen) {
      seen = load_acquire_sys(h.inbound_token);
      return seen >= call;
    });
    // A peer that died (tolerated: a rank mask) returns nothing: left out, with its experts.
    if (!ok && lost != nullptr && peer_lost(h.site)) {
      atomicOr(lost, 1u << threadIdx.x);
      ok = true;
    }
  } else if (threadIdx.x == a.rank) {
    ok = spin_until(moe_ll::site(a, a.rank), kWaitSemaphore, call, [&](uint64_t& seen) {
      seen = load_acquire_gpu(a.epochs + 1);
      return seen >= call;
    });
  }
  if (timed && a.wait_cycles != nullptr && blockIdx.x == 0 && threadIdx.x < a.world && !moe_ll::masked(a, threadIdx.x)) {
    add_wait_cycles(a, threadIdx.x, start);
  }
  return ok;
}

// The last block of a combine's send grid signals every peer and stores `call` as the combine
// count. Every thread of every block, after its rows.
__device__ void finish_combine_send(const MoeLlArgs& a, uint64_t call) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&a.done[1], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  if (threadIdx.x < a.world && threadIdx.x != a.rank && !moe_ll::masked(a, threadIdx.x)) a.ready[threadIdx.x].signal();
  __syncthreads();  // every signal out before the call is stored
  if (threadIdx.x == 0) {
    a.done[1] = 0;
    if (a.ticket != nullptr) *a.ticket = call;
    __threadfence();
    store_release_gpu(a.epochs + 1, call);
  }
}

// ---- Log rows (kPackedLogFmt: DeepEP's use_logfmt, in a format of doorbell's own) ----
// Each group of 128 values of a returned row travels in the first 176 of its 256 bytes: 128
// codes of 10 bits (bytes 0-159; value j at bits 10j..10j+9, little-endian), then two f32: `lo`,
// the log2 magnitude of code 1, and `step`, the log2 distance between codes, then 8 bytes of
// padding. Code 0 is zero; otherwise bit 9 is the sign and m = bits 0-8 (1..511) gives
// |x| = 2^(lo + (m - 1) step): the group's magnitudes from its largest down kLogRange octaves
// in 510 steps (relative error at most 2^(step / 2) - 1, 0.5% for a group spanning 7 octaves);
// smaller ones go as zero. A group holding a NaN or an infinity goes as NaN throughout.
constexpr float kLogRange = 16.0f;

// Encodes one group of 128 values (`raw`: this lane's four, values 4 lane .. 4 lane + 3) into
// the log row group at `dst` (16 int4 of a peer's return slot; 11 written). One warp: lanes 0-9
// gather the 128 code bits of their 16 bytes from the lanes holding them (shuffles: no shared
// memory, no warp barrier), lane 10 stores lo and step.
__device__ void push_log_group(int4* dst, uint2 raw, uint32_t lane) {
  const __nv_bfloat162 h0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 h1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  const float v[4] = {__low2float(h0), __high2float(h0), __low2float(h1), __high2float(h1)};
  float l[4], hi = -INFINITY, lo = INFINITY;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bad |= !isfinite(v[i]);
    l[i] = v[i] != 0.0f ? __log2f(fabsf(v[i])) : -INFINITY;
    if (v[i] != 0.0f) {
      hi = fmaxf(hi, l[i]);
      lo = fminf(lo, l[i]);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
  }
  bad = __any_sync(0xffffffffu, bad);
  lo = fmaxf(lo, hi - kLogRange);
  const float step = hi > lo ? (hi - lo) / 510.0f : 0.0f;
  const float inv = step > 0.0f ? 1.0f / step : 0.0f;
  uint64_t bits = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t code = 0;
    if (bad) {
      code = 1;  // decodes to NaN with lo NaN
    } else if (v[i] != 0.0f && l[i] >= lo - 0.5f * step) {
      const float q = fminf(fmaxf(rintf((l[i] - lo) * inv), 0.0f), 510.0f);
      code = (uint32_t(q) + 1u) | (v[i] < 0.0f ? 0x200u : 0u);
    }
    bits |= uint64_t(code) << (10 * i);
  }
  // Lane l < 10 stores code bits [128 l, 128 l + 128): 40-bit words j0 .. j0 + 3 from bit o.
  const uint32_t j0 = min(lane, 9u) * 128 / 40, o = min(lane, 9u) * 128 % 40;
  uint64_t w[4];
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) w[i] = __shfl_sync(0xffffffffu, bits, j0 + i);
  const unsigned __int128 low = static_cast<unsigned __int128>(w[0]) | static_cast<unsigned __int128>(w[1]) << 40 |
                                static_cast<unsigned __int128>(w[2]) << 80;
  const unsigned __int128 out = (low >> o) | static_cast<unsigned __int128>(w[3]) << (120 - o);
  if (lane < 10) {
    dst[lane] = make_int4(int(uint32_t(out)), int(uint32_t(out >> 32)), int(uint32_t(out >> 64)), int(uint32_t(out >> 96)));
  } else if (lane == 10) {
    const float base = bad ? __int_as_float(0x7fc00000) : hi == -INFINITY ? 0.0f : lo;
    dst[10] = make_int4(__float_as_int(base), __float_as_int(step), 0, 0);
  }
}

// Encodes `hidden` bf16 values at `src` into log rows at `dst` (a peer's return slot). One warp.
__device__ void push_log_row(int4* dst, const int4* src, uint32_t hidden, uint32_t lane) {
  // Eight groups' loads in flight at a time (a row is 56 groups at hidden 7168): with one load
  // per group the send half took 299 us on 2 x H200, with eight 221, against the bf16 copy's
  // 32 (docs/deep_ep.md, "Log rows as built": the rest is not understood yet).
  constexpr uint32_t kBatch = 8;
  const uint32_t groups = hidden / 128;
  for (uint32_t g0 = 0; g0 < groups; g0 += kBatch) {
    uint2 batch[kBatch];
#pragma unroll
    for (uint32_t b = 0; b < kBatch; ++b) {
      if (g0 + b < groups) batch[b] = __ldg(reinterpret_cast<const uint2*>(src) + (g0 + b) * 32 + lane);
    }
#pragma unroll
    for (uint32_t b = 0; b < kBatch; ++b) {
      if (g0 + b < groups) push_log_group(dst + (g0 + b) * 16, batch[b], lane);
    }
  }
}

// Adds `w` x the eight values of chunk `c` (values 8c .. 8c + 7) of the log row at `row` to
// `acc`.
__device__ void fma_log_chunk(float* acc, float w, const uint8_t* row, uint32_t c) {
  const uint8_t* group = row + uint64_t(c / 16) * 256;
  const uint16_t* p = reinterpret_cast<const uint16_t*>(group + 10 * (c % 16));
  const uint64_t w0 = uint64_t(p[0]) | uint64_t(p[1]) << 16 | uint64_t(p[2]) << 32 | uint64_t(p[3]) << 48;
  const uint32_t w1 = p[4];
  const float lo = reinterpret_cast<const float*>(group + 160)[0];
  const float step = reinterpret_cast<const float*>(group + 160)[1];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t code = j < 6 ? uint32_t(w0 >> (10 * j)) & 0x3ffu
                          : j == 6 ? (uint32_t(w0 >> 60) | (w1 << 4)) & 0x3ffu
                                   : (w1 >> 6) & 0x3ffu;
    const uint32_t m = code & 0x1ffu;
    if (m == 0) continue;
    const float mag = exp2f(lo + float(m - 1) * step);
    acc[j] += w * ((code & 0x200u) != 0 ? -mag : mag);
  }
}

// DeepEP's combine, send half: every row of the handle's dispatch (`packed_range`, `packed_src`),
// read from the caller's `y [local expert][cap][hidden]`, goes back unweighted to its token's
// rank, into that rank's return slot for (this expert, token): as it is, or as a log row
// (kPackedLogFmt).
__device__ void combine_send_packed(const MoeLlArgs& a, uint64_t call) {
  const bool log_rows = (a.packed & kPackedLogFmt) != 0;
  const uint32_t half = uint32_t(call & 1), cap = packed_cap(a), lane = threadIdx.x % kWarp;
  const uint32_t words = a.hidden / 8, experts = a.experts_per_rank * a.world;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const int4* y = reinterpret_cast<const int4*>(a.y);
  // Positions taken row by row across the experts (row i of every expert, then row i + 1): an
  // expert's rows are its first few positions, so this deals them out to consecutive warps. In
  // expert order only the warps whose positions fell on small i had rows, several each, one
  // after another (at 128 tokens, top-8 of 288 experts on 2 ranks: about one warp in nine,
  // four rows each).
  for (uint64_t q = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; q < uint64_t(a.experts_per_rank) * cap;
       q += warps) {
    const uint32_t i = uint32_t(q / a.experts_per_rank), le = uint32_t(q % a.experts_per_rank);
    const uint64_t p = uint64_t(le) * cap + i;
    const int32_t src = source_of(a.world, i, lane, [&](uint32_t s, uint32_t& begin, uint32_t& n) {
      const uint64_t r = uint64_t(a.packed_range[le * a.world + s]);
      begin = uint32_t(r >> 32);
      n = uint32_t(r);
    });
    if (src < 0 || moe_ll::masked(a, uint32_t(src))) continue;
    const int32_t t = a.packed_src[p];
    if (t < 0 || uint32_t(t) >= a.max_tokens) continue;  // not a row a dispatch wrote
    const uint32_t e = a.rank * a.experts_per_rank + le;
    int4* dst = reinterpret_cast<int4*>(a.area[src] + a.off_ret) + ((uint64_t(half) * experts + e) * a.max_tokens + t) * words;
    if (log_rows) {
      push_log_row(dst, y + p * words, a.hidden, lane);
    } else {
      copy_words_batched<int4, 8>(dst, y + p * words, words, lane, kWarp);
    }
  }
  finish_combine_send(a, call);
}

// DeepEP's combine, receive half: once every row is back, token t's output is the sum over its
// top-k of weight x the row its expert returned (f32 in top-k order; ids of -1 or past the
// experts skipped). A block whose wait gave up writes all ones (NaN) over its share instead.
__device__ void combine_recv_packed(const MoeLlArgs& a, uint64_t call) {
  __shared__ uint32_t lost;  // peers found dead while waiting (every block waits for every peer)
  if (threadIdx.x == 0) lost = 0;
  __syncthreads();
  const bool cut = __syncthreads_or(!combine_arrived(a, call, &lost, true));
  const uint32_t words = a.hidden / 8, experts = a.experts_per_rank * a.world, half = uint32_t(call & 1);
  const uint32_t n_items = a.num_tokens * words;
  const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  int4* out = reinterpret_cast<int4*>(a.out);
  if (cut) {
    for (uint32_t i = first; i < n_items; i += stride) out[i] = make_int4(-1, -1, -1, -1);
    return;
  }
  const int4* ret = reinterpret_cast<const int4*>(a.area[a.rank] + a.off_ret);
  const bool log_rows = (a.packed & kPackedLogFmt) != 0;
  for (uint32_t i = first; i < n_items; i += stride) {
    const uint32_t t = i / words, c = i % words;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t k = 0; k < a.topk; ++k) {
      const int32_t e = moe_ll::topk_id(a, uint64_t(t) * a.topk + k);
      if (e < 0 || uint32_t(e) >= experts) continue;
      const uint32_t owner = uint32_t(e) / a.experts_per_rank;
      if (moe_ll::masked(a, owner) || ((lost >> owner) & 1u) != 0u) continue;
      const uint64_t row = ((uint64_t(half) * experts + uint32_t(e)) * a.max_tokens + t) * words;
      const float w = a.topk_weights[uint64_t(t) * a.topk + k];
      if (log_rows) {
        fma_log_chunk(acc, w, reinterpret_cast<const uint8_t*>(ret + row), c);
      } else {
        fma_bf16x8(acc, w, ret[row + c]);
      }
    }
    out[i] = to_bf16x8(acc);
  }
}

// The combine's send half: a warp per carrier row of the last dispatch sends its pair's partial
// sum; the last block to finish signals every peer and stores `call` as the combine count.
// `layout` must have been written by a kernel before this one.
__device__ void combine_send(const MoeLlArgs& a, uint64_t call) {
  const uint32_t half = uint32_t(a.epochs[0] & 1);
  const uint32_t pairs = a.experts_per_rank * a.world;
  const uint32_t deepest = block_max(a.layout, pairs);
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t positions = uint64_t(deepest) * pairs;
  const int32_t* from = moe_ll::section<int32_t>(a, a.rank, a.off_from);
  for (uint64_t p = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; p < positions; p += warps) {
    const uint32_t i = uint32_t(p / pairs), q = uint32_t(p % pairs);
    if (i >= a.layout[q]) continue;
    const uint64_t at = moe_ll::row_index(a, half, q / a.world, q % a.world, i);
    if (from[at] < 0) moe_ll::send_partial(a, at, lane);
  }
  finish_combine_send(a, call);
}

// The combine's receive half: waits until every peer signalled combine `call` (and this rank's own
// send grid finished it), then a thread per
// (token, 16 bytes of the row) adds the partial sums. A block whose wait gave up (the
// communicator aborted) stores all ones (NaN in bf16) over its share of the output instead: the
// partial sums are not all in, and the slots' old ones would pass for a result.
__device__ void combine_recv(const MoeLlArgs& a, uint64_t call) {
  const bool cut = __syncthreads_or(!combine_arrived(a, call));
  const uint32_t chunks = a.hidden / 8;
  const uint32_t n_items = a.num_tokens * chunks;
  const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
  if (cut) {
    for (uint32_t i = first; i < n_items; i += stride) reinterpret_cast<int4*>(a.out)[i] = make_int4(-1, -1, -1, -1);
    return;
  }
  for (uint32_t i = first; i < n_items; i += stride) moe_ll::combine_chunk(a, i / chunks, i % chunks);
}

}  // namespace

// Each half alone, and both in one kernel (one launch and one kernel boundary less; half of each
// block's warps send while the other half copy what arrives). The kernels that wait on peers
// have grids of at most one block per SM, all resident at once. Epochs are read at kernel
// start, before the last block stores the new ones.
// The send kernels announce the call at their start (finish_send announces it for fused sends,
// after the rows, and is told not to here: a call is announced once): a send that waits (for
// queue room, say) must not keep the peers' checks waiting.
extern "C" __global__ void __launch_bounds__(512) moe_ll_dispatch_send(MoeLlArgs a) {
  announce_split_call(a.call, a.rank, a.world, a.ticket != nullptr ? a.ticket + 1 : nullptr, a.epochs + 2,
                      a.rank_mask);
  send_items(a, threadIdx.x / kWarp, blockDim.x / kWarp);
  moe_ll::finish_send(a, true);
}

// The call check (coll/call_check.cuh): the send halves announce the call (finish_send,
// combine_send) and keep its ordinal (in the ticket, and as the last send's: epochs[2 + which]),
// the receive halves check every peer made the same one (`which`: 0 dispatch, 1 combine); whole
// calls announce and check in one kernel (`which` = 2).
DOORBELL_DEVICE_INLINE void check_moe_call(const MoeLlArgs& a, uint32_t which) {
  const uint64_t* ordinal = which == 2 ? nullptr : a.ticket != nullptr ? a.ticket + 1 : a.epochs + 2 + which;
  check_indexed_call(a.call, a.rank, a.world, moe_ll::site(a, checked_peer(a.world) % a.world), ordinal, a.rank_mask);
}

// The epoch (combine call) a receive half pairs with: its send's ticket, else the last send's.
__device__ uint64_t paired(const MoeLlArgs& a, uint32_t which) {
  return a.ticket != nullptr ? *a.ticket : a.epochs[which];
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_dispatch_recv(MoeLlArgs a) {
  const uint64_t epoch = paired(a, 0);
  const uint32_t nwarps = blockDim.x / kWarp;
  if (a.packed != 0) {
    pack_rows(a, epoch);
  } else {
    copy_announced(a, epoch, threadIdx.x / kWarp * gridDim.x + blockIdx.x, nwarps * gridDim.x);
    if (blockIdx.x == 0) write_layout(a, epoch);
  }
  check_moe_call(a, 0);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_dispatch(MoeLlArgs a) {
  announce_indexed_call(a.call, a.rank, a.world, a.rank_mask);
  const uint64_t epoch = moe_ll::send_epoch(a);
  const uint32_t warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp, nsend = nwarps / 2;
  if (a.packed != 0) {
    // Every warp sends, then every block packs once the counts are in (no copies to overlap).
    send_items(a, warp, nwarps);
    moe_ll::finish_send(a, true);
    pack_rows(a, epoch);
    check_moe_call(a, 2);
    return;
  }
  if (warp < nsend) {
    send_items(a, warp, nsend);
  } else {
    copy_announced(a, epoch, (warp - nsend) * gridDim.x + blockIdx.x, (nwarps - nsend) * gridDim.x);
  }
  moe_ll::finish_send(a, true);
  if (blockIdx.x == 0) write_layout(a, epoch);
  check_moe_call(a, 2);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine_send(MoeLlArgs a) {
  announce_split_call(a.call, a.rank, a.world, a.ticket != nullptr ? a.ticket + 1 : nullptr, a.epochs + 3,
                      a.rank_mask);
  if (a.packed != 0) {
    combine_send_packed(a, a.epochs[1] + 1);
  } else {
    combine_send(a, a.epochs[1] + 1);
  }
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine_recv(MoeLlArgs a) {
  if (a.packed != 0) {
    combine_recv_packed(a, paired(a, 1));
  } else {
    combine_recv(a, paired(a, 1));
  }
  check_moe_call(a, 1);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine(MoeLlArgs a) {
  const uint64_t call = a.epochs[1] + 1;
  announce_indexed_call(a.call, a.rank, a.world, a.rank_mask);
  if (a.packed != 0) {
    combine_send_packed(a, call);
    combine_recv_packed(a, call);
  } else {
    combine_send(a, call);
    combine_recv(a, call);
  }
  check_moe_call(a, 2);
}


// The fused-dispatch path of the tests: the row is made in shared memory by the kernel itself
// (as an expert or attention kernel would have it) and sent with moe_ll::put_token. Row values
// follow the tests' rule ((rank * 31 + t * 7 + h) % 64 - 32, exact in bf16).
extern "C" __global__ void moe_ll_test_fused_send(MoeLlArgs a) {
  extern __shared__ int4 rows[];
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(rows + uint64_t(warp) * (a.hidden / 8));
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + warp; t < a.num_tokens; t += warps) {
    for (uint32_t h = lane; h < a.hidden; h += kWarp) {
      row[h] = __float2bfloat16(float(int((a.rank * 31 + t * 7 + h) % 64) - 32));
    }
    __syncwarp();
    moe_ll::put_token(a, t, row, lane);
    __syncwarp();
  }
  moe_ll::finish_send(a);
}

