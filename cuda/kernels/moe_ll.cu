// MoE dispatch and combine for decode (low latency), DeepEP's low-latency semantics: fixed
// worst-case buffers sized from max tokens per rank, a per-expert layout (one row per selected
// (token, expert)), counts only on the device, no count exchange before rows move, CUDA-graph
// capturable, and send and receive halves that can be called separately so other work overlaps
// the transfer. Over NVLink a row crosses once per destination rank (see moe.cuh).
//
// Layout on every rank: [2 halves][local expert][source rank][max_tokens] rows (collective_args.cuh
// lists the sections). The half is the parity of the dispatch epoch, so a dispatch never
// overwrites rows the previous one delivered (two results may be alive at once, as with DeepEP).
//
// dispatch send (moe_ll_send): a warp per (token, destination rank) reserves a slot of each
// selected expert there (an atomic on my own counter), writes the row once into the first (the
// carrier) and the selections' metadata, then after a system fence announces the carrier in the
// destination's queue for this source (moe_ll::put). The warp that finishes the call's last
// (token, rank) item publishes, for every expert, `epoch << 32 | rows` into the owner's count
// word and, for every rank, the carriers it sent there, after a system fence (no semaphores; the
// epoch tells a fresh word from last call's), and zeroes the counters; the last block stores the
// epoch.
// dispatch receive (moe_ll_recv): warps take queue entries (entry j of every source before j + 1)
// and copy each carrier row into its pair's other slots the moment its entry appears; an entry
// past the source's carrier count is skipped. Block 0 waits for the count words and writes the
// rows per (expert, source) and per expert. moe_ll_dispatch runs both in one kernel, half of
// each block's warps sending while the other half copy, so copies overlap the transfer.
// combine send (moe_ll_combine_send): a warp per carrier row sends its pair's weighted partial sum
// to the token's rank (moe_ll::send_partial); the last block signals every peer.
// combine receive (moe_ll_combine_recv): waits for every peer's signal of this call, then adds
// each token's partial sums (moe_ll::combine_chunk). moe_ll_combine does both in one kernel.
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;
constexpr uint32_t kMaxPairs = 8192;  // local experts x ranks (1024 x 8), checked on the host

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
  __shared__ uint32_t rows_of[kMaxPairs];
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

// The combine's send half: a warp per carrier row of the last dispatch sends its pair's partial
// sum; the last block to finish signals every peer and stores `call` as the combine count.
// `layout` must have been written by a kernel before this one.
__device__ void combine_send(const MoeLlArgs& a, uint64_t call) {
  __shared__ bool last;
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
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&a.done[1], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence_system();
  if (threadIdx.x < a.world && threadIdx.x != a.rank) a.ready[threadIdx.x].signal();
  if (threadIdx.x == 0) {
    a.epochs[1] = call;
    a.done[1] = 0;
  }
}

// The combine's receive half: waits until every peer signalled combine `call`, then a thread per
// (token, 16 bytes of the row) adds the partial sums. A block whose wait gave up (the
// communicator aborted) stores all ones (NaN in bf16) over its share of the output instead: the
// partial sums are not all in, and the slots' old ones would pass for a result.
__device__ void combine_recv(const MoeLlArgs& a, uint64_t call) {
  bool ok = true;
  if (threadIdx.x < a.world && threadIdx.x != a.rank) {
    const SemaphoreHandle& h = a.ready[threadIdx.x];
    ok = spin_until(h.site, kWaitSemaphore, call, [&](uint64_t& seen) {
      seen = load_acquire_sys(h.inbound_token);
      return seen >= call;
    });
  }
  const bool cut = __syncthreads_or(!ok);
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
extern "C" __global__ void __launch_bounds__(512) moe_ll_send(MoeLlArgs a) {
  announce_call(a.call, a.rank, a.world);
  send_items(a, threadIdx.x / kWarp, blockDim.x / kWarp);
  moe_ll::finish_send(a, true);
}

// The call check (call_check.cuh): the send halves announce the call (finish_send, combine_send),
// the receive halves check every peer made the same one.
DOORBELL_DEVICE_INLINE void check_moe_call(const MoeLlArgs& a) {
  check_call(a.call, a.rank, a.world, moe_ll::site(a, checked_peer(a.world) % a.world));
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_recv(MoeLlArgs a) {
  const uint64_t epoch = a.epochs[0];
  const uint32_t nwarps = blockDim.x / kWarp;
  copy_announced(a, epoch, threadIdx.x / kWarp * gridDim.x + blockIdx.x, nwarps * gridDim.x);
  if (blockIdx.x == 0) write_layout(a, epoch);
  check_moe_call(a);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_dispatch(MoeLlArgs a) {
  announce_call(a.call, a.rank, a.world);
  const uint64_t epoch = moe_ll::send_epoch(a);
  const uint32_t warp = threadIdx.x / kWarp, nwarps = blockDim.x / kWarp, nsend = nwarps / 2;
  if (warp < nsend) {
    send_items(a, warp, nsend);
  } else {
    copy_announced(a, epoch, (warp - nsend) * gridDim.x + blockIdx.x, (nwarps - nsend) * gridDim.x);
  }
  moe_ll::finish_send(a, true);
  if (blockIdx.x == 0) write_layout(a, epoch);
  check_moe_call(a);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine_send(MoeLlArgs a) {
  announce_call(a.call, a.rank, a.world);
  combine_send(a, a.epochs[1] + 1);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine_recv(MoeLlArgs a) {
  combine_recv(a, a.epochs[1]);
  check_moe_call(a);
}

extern "C" __global__ void __launch_bounds__(512) moe_ll_combine(MoeLlArgs a) {
  const uint64_t call = a.epochs[1] + 1;
  announce_call(a.call, a.rank, a.world);
  combine_send(a, call);
  combine_recv(a, call);
  check_moe_call(a);
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

