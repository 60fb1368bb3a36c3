// MoE dispatch and combine for decode across nodes (DeepEP's low-latency semantics over any mix of
// NVLink and RDMA peers); protocol and device calls in doorbell/coll/moe_net.cuh, layouts in
// coll/moe_args.cuh (MoeNetArgs).
//
// dispatch send (moe_net_dispatch_send): a warp per token stages its message and sends it to each rank
// holding one of its experts (moe_net::put_token); the last block publishes the counts.
// dispatch receive (moe_net_dispatch_recv): block 0 waits for every source's count (over the network: its
// signal, then the word), publishes them to the grid, and every warp unpacks messages into the
// per-expert result rows; the last block writes the rows per (expert, source) and per expert.
// combine send (moe_net_combine_send): a warp per received message sends its token's partial row
// back; the last block tells every source its partial rows are in (NVLink: a word after a system
// fence; network: a signal after the puts, then a flush).
// combine receive (moe_net_combine_recv): block 0 waits for every peer, then every thread adds
// 16 bytes of a token's partial rows (moe_net::combine_chunk).
// Every kernel's grid is at most one block per SM; only block 0 waits for peers, the others wait
// for block 0, so the kernels make progress even when not all blocks are resident.
#include <doorbell/coll/limits.cuh>
#include <doorbell/coll/moe_ll.cuh>  // moe_ll::cast_row_fp8 (DeepEP's cast, shared with the NVLink path)
#include <doorbell/coll/moe_net.cuh>
#include <doorbell/detail/collective_args.cuh>
#include <doorbell/doorbell.cuh>

#include <cuda_bf16.h>

using namespace doorbell;

namespace {

constexpr uint32_t kWarp = 32;

// Counts of the receive's messages, by source; set once block 0 has published them.
struct Counts {
  uint32_t n[moe_net::kMaxRanks];
  uint32_t total;
};

// Block 0 waits (bounded) for every source's words of `epoch` (`wait_one(src)` stores what it
// learned and returns false when its wait gave up), then publishes `epoch` in `ready`; every block
// then reads the counts `read(src)`. Returns the counts by source, and false in every block when
// a wait gave up (block 0 then publishes nothing, so the other blocks' waits give up too).
template <typename WaitOne, typename Read>
__device__ bool gather_counts(const MoeNetArgs& a, uint64_t epoch, uint64_t* ready, WaitOne wait_one, Read read,
                              Counts& c) {
  bool ok = true;
  if (blockIdx.x == 0) {
    for (uint32_t src = threadIdx.x; src < a.world; src += blockDim.x) ok = wait_one(src) && ok;
    const bool all = !__syncthreads_or(!ok);
    if (threadIdx.x == 0 && all) {
      __threadfence();
      *reinterpret_cast<volatile uint64_t*>(ready) = epoch;
    }
  } else if (threadIdx.x == 0) {
    ok = spin_until(a.sites[a.rank], kWaitPacket, epoch, [&](uint64_t& seen) {
      seen = load_acquire_sys(ready);
      return seen == epoch;
    });
    __threadfence();
  }
  const bool cut = __syncthreads_or(!ok);
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (uint32_t src = 0; src < a.world; ++src) {
      c.n[src] = read(src);
      total += c.n[src];
    }
    c.total = total;
  }
  __syncthreads();
  return !cut;
}

// The message counts a receive of `half` recorded by source (the combines send a reply to each),
// read by thread 0 into `c` for the whole block.
__device__ void received_counts(const MoeNetArgs& a, uint32_t half, Counts& c) {
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (uint32_t src = 0; src < a.world; ++src) {
      c.n[src] = a.msgs[half * a.world + src];
      total += c.n[src];
    }
    c.total = total;
  }
  __syncthreads();
}

// Calls f(src, j) for every message of the counts, a warp each over the grid.
template <typename F>
__device__ void for_each_message(const MoeNetArgs& a, const Counts& c, F f) {
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  for (uint32_t q = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; q < c.total; q += warps) {
    uint32_t src = 0, j = q;
    while (j >= c.n[src]) j -= c.n[src++];
    f(src, j);
  }
}

// True in every thread of the block that arrives last at `counter` (which it then resets).
__device__ bool last_block(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) *counter = 0;
  }
  __syncthreads();
  return last;
}


// The end of a combine's send half, once every block's partial rows are out: the last block tells
// every peer (NVLink: the combine word after a system fence; network: a signal behind the puts,
// then a flush so the staging area may be reused) and stores the call.
__device__ void combine_sent(const MoeNetArgs& a, uint64_t call) {
  if (!last_block(&a.done[2])) return;
  for (uint32_t src = threadIdx.x; src < a.world; src += blockDim.x) {
    if (src == a.rank) continue;
    if (a.peer_area[src] != 0) {
      __threadfence_system();
      store_relaxed_sys(reinterpret_cast<uint64_t*>(a.peer_area[src] + a.off_cdone) + a.rank, call);
    } else {
      const PortChannelHandle& c = moe_net::channel(a, src);
      moe_net::announce_to(a, src);  // the call check's word (NVLink peers had it at the start)
      c.signal();
      c.flush();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) a.epochs[1] = call;
}

// The start of a combine's receive half: block 0 waits until every peer's partial rows of `call`
// are in, and every block waits for block 0. False when a wait gave up (the rows are not all in).
__device__ bool wait_combine(const MoeNetArgs& a, uint64_t call) {
  __shared__ Counts unused;
  return gather_counts(
      a, call, &a.epochs[3],
      [&](uint32_t src) -> bool {
        if (src == a.rank) return true;
        if (a.peer_area[src] == 0) return moe_net::wait_signal(a, src);
        const uint64_t* word = reinterpret_cast<const uint64_t*>(a.area + a.off_cdone) + src;
        return spin_until(a.sites[src], kWaitSemaphore, call, [&](uint64_t& seen) {
          seen = load_acquire_sys(word);
          return seen >= call;
        });
      },
      [](uint32_t) { return 0u; }, unused);
}

// Receives every source's count of dispatch `epoch` (block 0 waits, every block learns them).
__device__ void wait_dispatch(const MoeNetArgs& a, uint64_t epoch, Counts& counts) {
  const uint32_t half = uint32_t(epoch & 1);
  gather_counts(
      a, epoch, &a.epochs[2],
      [&](uint32_t src) {
        a.msgs[half * a.world + src] = moe_net::wait_count(a, epoch, src);
        return true;  // a count that never came reads 0 (reported; the receive moves nothing of it)
      },
      [&](uint32_t src) { return *reinterpret_cast<volatile uint32_t*>(&a.msgs[half * a.world + src]); }, counts);
}

}  // namespace

// ---- The low-latency dispatch send (moe_net_dispatch_send): every part of it at once over the grid. ----
// Tokens form groups of 32 (at least one group, so every rank gets its counts). The work is a list
// of tasks, each block taking tasks blockIdx.x, blockIdx.x + gridDim.x, ... in order:
//   stage tasks (a block each, kStageParts per group): build kStageTokens messages of group g in
//     the staging area (kStageSplit warps a message), then count on staged[g] (epoch x
//     kStageParts once the group is staged);
//   network tasks (a warp per rank on another node; blockDim / 32 ranks a block task): list the
//     tokens that selected an expert on rank r (message j of this call goes to r's slot j), wait
//     until their groups are staged, and post them, the count word and the signal as one batch
//     (PortChannelHandle::put_rows_warp: one reservation, one publish and one doorbell when the
//     GPU posts; the signal is a READ, the flush of every WRITE before it, then the fetch-add the
//     receiver waits for);
//   NVLink tasks (g, r) for a rank r whose area is mapped here (a block): write the messages of
//     group g's tokens that selected an expert on r straight into r's slots (from x: no staging;
//     slots from an atomic per destination, fill[r]), then arrive at r; the task that arrives
//     last (arrived[r] reaches the group count) stores r's count after a system fence.
// Only network tasks wait, and only for stage tasks, which come first in every block's order:
// whatever the blocks' scheduling, a waited-for stage task is never behind its waiter. Network
// tasks come before the NVLink ones so that posting starts as soon as the staging is done.
// The fused-send device API (moe_net::put_token / finish_send) produces the same messages and
// counts with a warp per token and the last block posting.
namespace {

// The tokens of group g that selected an expert on rank r (bit i: token 32 g + i). One warp.
__device__ uint32_t group_mask(const MoeNetArgs& a, uint32_t g, uint32_t r, uint32_t lane) {
  const uint32_t t = g * kWarp + lane;
  bool hit = false;
  if (t < a.num_tokens) {
    for (uint32_t k = 0; k < a.topk; ++k) {
      const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
      hit |= e >= 0 && uint32_t(e) < a.experts_per_rank * a.world && uint32_t(e) / a.experts_per_rank == r;
    }
  }
  return __ballot_sync(0xffffffffu, hit);
}

// Counts one finished (group, r) task; true (once per call and rank) for the last of `groups`,
// which then takes r's message count (resetting the counters for the next call). One thread.
__device__ bool arrive(const MoeNetArgs& a, uint32_t r, uint32_t groups, uint32_t& n) {
  __threadfence();
  if (atomicAdd(&a.arrived[r], 1u) != groups - 1) return false;
  __threadfence();
  n = atomicExch(&a.fill[r], 0u);
  a.arrived[r] = 0;
  return true;
}

__device__ void probe_max(const MoeNetArgs& a, uint32_t i) {
  if (a.probe != nullptr) {
    atomicMax(reinterpret_cast<unsigned long long*>(&a.probe[i]), static_cast<unsigned long long>(global_timer_ns()));
  }
}

__device__ void probe_min(const MoeNetArgs& a, uint32_t i) {
  if (a.probe != nullptr) {
    atomicMin(reinterpret_cast<unsigned long long*>(&a.probe[i]), static_cast<unsigned long long>(global_timer_ns()));
  }
}

// A stage task builds kStageTokens messages, kStageSplit warps each (blocks of 256 threads); a
// group takes kStageParts tasks, each announcing itself in its own word staged[g * kStageParts +
// part] (the epoch it staged). The three are coll/limits.cuh's (Rust sizes the words).
using moe_net::kStageParts;
using moe_net::kStageSplit;
using moe_net::kStageTokens;
static_assert(kStageParts == kWarp / kStageTokens, "a group is a warp's tokens");

// Stage task `part` of group g (a block): its tokens' messages into the staging area, then the
// epoch in staged[g * kStageParts + part]. Each warp issues every load it needs (the header's ids
// and weights, the scales, its piece of the row) before its first store: one trip to memory.
__device__ void stage_part(const MoeNetArgs& a, uint32_t g, uint32_t part, uint64_t epoch) {
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, scales = a.fp8 ? a.hidden / 128 : 0;
  const uint32_t split = blockDim.x / kWarp >= kStageTokens * kStageSplit ? kStageSplit : 1;
  const uint32_t half = uint32_t(epoch & 1);
  for (uint32_t w = warp; w < kStageTokens * split; w += blockDim.x / kWarp) {
    const uint32_t t = g * kWarp + part * kStageTokens + w / split, piece = w % split;
    if (t >= a.num_tokens) continue;
    char* m = a.stage + moe_net::stage_offset(a, half, t);
    const uint8_t* row = a.x + uint64_t(t) * moe_net::row_bytes(a);
    // The header's inputs and the first 64 scales (piece 0), loaded before the row.
    moe_net::HeaderLane head{0, 0.0f};
    float sc[2] = {0.0f, 0.0f};
    const float* sc_src = a.scales + uint64_t(t) * scales;
    if (piece == 0) {
      head = moe_net::load_header_lane(a, t, lane);
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j) {
        if (lane + j * kWarp < scales) sc[j] = __ldg(sc_src + lane + j * kWarp);
      }
    }
    const uint32_t words = moe_net::row_bytes(a) / 16, per = (words + split - 1) / split;
    const uint32_t lo = piece * per, hi = lo + per < words ? lo + per : words;
    if (lo < hi) {
      copy_words_batched<int4, 8>(reinterpret_cast<int4*>(m + a.header_bytes) + lo,
                                  reinterpret_cast<const int4*>(row) + lo, hi - lo, lane, kWarp);
    }
    if (piece == 0) {
      moe_net::store_message_header(a, m, t, epoch, head, lane);
      float* s = reinterpret_cast<float*>(m + a.header_bytes + moe_net::row_bytes(a));
#pragma unroll
      for (uint32_t j = 0; j < 2; ++j) {
        if (lane + j * kWarp < scales) s[lane + j * kWarp] = sc[j];
      }
      for (uint32_t i = lane + 2 * kWarp; i < scales; i += kWarp) s[i] = sc_src[i];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The block's messages before the word (release, cumulative over the block's stores after
    // the barrier): GPU scope, as the staging area is GPU memory and the poster fences
    // system-wide before its doorbell, as NVSHMEM does for GPU-memory data.
    store_release_gpu(&a.staged[g * kStageParts + part], epoch);
    probe_max(a, 3);
  }
}

// NVLink task (g, r) for a mapped rank r (a block).
__device__ void nvlink_task(const MoeNetArgs& a, uint32_t g, uint32_t r, uint32_t groups, uint64_t epoch) {
  __shared__ uint32_t base;
  const uint32_t lane = threadIdx.x % kWarp, scales = a.hidden / 128, half = uint32_t(epoch & 1);
  const uint64_t mapped = a.peer_area[r];
  const uint32_t mask = group_mask(a, g, r, lane);
  const uint32_t cnt = __popc(mask);
  if (threadIdx.x == 0) base = cnt == 0 ? 0 : atomicAdd(&a.fill[r], cnt);
  __syncthreads();
  for (uint32_t i = threadIdx.x / kWarp; i < cnt; i += blockDim.x / kWarp) {
    const uint32_t t = g * kWarp + uint32_t(__fns(mask, 0, int(i) + 1));
    moe_net::write_message(a, reinterpret_cast<char*>(mapped + moe_net::wire_offset(a, half, a.rank, base + i)), t,
                           a.x + uint64_t(t) * moe_net::row_bytes(a), a.fp8 ? a.scales + uint64_t(t) * scales : nullptr,
                           lane);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's stores before its arrival
    uint32_t n = 0;
    if (arrive(a, r, groups, n)) {
      __threadfence_system();  // every group's stores (their arrivals) before the count
      const uint64_t count_dst = a.off_counts + (uint64_t(half) * a.world + a.rank) * 8;
      store_relaxed_sys(reinterpret_cast<uint64_t*>(mapped + count_dst), epoch << 32 | n);
    }
  }
  __syncthreads();  // `base` is rewritten by the next task
}

// Masks of kMaskGroups groups from g0 on, like group_mask: every load of their top-k ids is
// issued before the first compare (one trip to memory for a decode batch), 16 bytes at a time
// when the rows allow. One warp.
constexpr uint32_t kMaskGroups = 4;
__device__ void group_masks(const MoeNetArgs& a, uint32_t g0, uint32_t r, uint32_t lane, uint32_t (&m)[kMaskGroups]) {
  const int32_t lo = int32_t(r * a.experts_per_rank), hi = lo + int32_t(a.experts_per_rank);
  const auto in = [&](int32_t e) { return e >= lo && e < hi; };
  bool hit[kMaskGroups] = {};
  if (a.topk % 4 == 0 && reinterpret_cast<uintptr_t>(a.topk_idx) % 16 == 0) {
#pragma unroll 2
    for (uint32_t k = 0; k < a.topk / 4; ++k) {
#pragma unroll
      for (uint32_t j = 0; j < kMaskGroups; ++j) {
        const uint32_t t = (g0 + j) * kWarp + lane;
        const int4 e = t < a.num_tokens ? __ldg(reinterpret_cast<const int4*>(a.topk_idx + uint64_t(t) * a.topk) + k)
                                        : make_int4(-1, -1, -1, -1);
        hit[j] |= in(e.x) || in(e.y) || in(e.z) || in(e.w);
      }
    }
  } else {
#pragma unroll 8
    for (uint32_t k = 0; k < a.topk; ++k) {
#pragma unroll
      for (uint32_t j = 0; j < kMaskGroups; ++j) {
        const uint32_t t = (g0 + j) * kWarp + lane;
        hit[j] |= t < a.num_tokens && in(__ldg(a.topk_idx + uint64_t(t) * a.topk + k));
      }
    }
  }
#pragma unroll
  for (uint32_t j = 0; j < kMaskGroups; ++j) m[j] = __ballot_sync(0xffffffffu, hit[j]);
}

// Network task for a rank r on another node (a warp): r's messages of this call, in token order,
// posted as one batch with the count word and the signal. The batch is written while the stage
// tasks still work and published once every group is staged (the gate); each lane writes the
// work requests of the tokens it found.
__device__ __forceinline__ void network_task(const MoeNetArgs& a, uint32_t r, uint32_t groups, uint64_t epoch) {
  const uint32_t lane = threadIdx.x % kWarp, half = uint32_t(epoch & 1);
  if (lane == 0) {
    probe_min(a, 7);
    moe_net::announce_to(a, r);  // the call check's word, ahead of the messages
  }
  // The queue pair's fields, loaded while the tokens are listed.
  const PortChannelHandle& channel = moe_net::channel(a, r);
  const IbPortLink* ib = channel.ib;
  const uint64_t word = ib != nullptr ? link_word(ib, lane) : 0;
  // A decode batch (at most kMaskGroups groups) keeps its masks in registers; a larger one lists
  // its tokens in a.list.
  uint32_t first[kMaskGroups];
  uint32_t* list = a.list + uint64_t(r) * a.max_tokens;
  const bool listed = groups > kMaskGroups;
  const uint32_t below = (1u << lane) - 1;
  uint32_t n = 0;
  for (uint32_t g0 = 0; g0 < groups; g0 += kMaskGroups) {
    uint32_t m[kMaskGroups];
    group_masks(a, g0, r, lane, m);
#pragma unroll
    for (uint32_t j = 0; j < kMaskGroups; ++j) {
      if (g0 == 0) first[j] = m[j];
      if (listed && (m[j] >> lane & 1)) list[n + __popc(m[j] & below)] = (g0 + j) * kWarp + lane;
      n += __popc(m[j]);
    }
  }
  if (lane == 0) probe_max(a, 4);
  const uint64_t count_src = a.stage_counts + (uint64_t(half) * a.world + r) * 8;
  const uint64_t count_dst = a.off_counts + (uint64_t(half) * a.world + a.rank) * 8;
  if (lane == 0) *reinterpret_cast<volatile uint64_t*>(a.stage + count_src) = epoch << 32 | n;
  __syncwarp();
  const auto rows_of = [&](auto emit) {
    if (listed) {
      for (uint32_t i = lane; i < n; i += kWarp) {
        const uint32_t t = reinterpret_cast<const volatile uint32_t*>(list)[i];
        emit(i, moe_net::wire_offset(a, half, a.rank, i), moe_net::stage_offset(a, half, t));
      }
      return;
    }
    uint32_t before = 0;  // messages of the groups before j
#pragma unroll
    for (uint32_t j = 0; j < kMaskGroups; ++j) {
      if (first[j] >> lane & 1) {
        const uint32_t i = before + __popc(first[j] & below);
        emit(i, moe_net::wire_offset(a, half, a.rank, i), moe_net::stage_offset(a, half, j * kWarp + lane));
      }
      before += __popc(first[j]);
    }
  };
  const auto staged = [&](uint32_t l) {
    if (l == 0) probe_max(a, 5);
    // Every group staged (a word per stage task, polled a lane each).
    for (uint32_t w = l; w < groups * kStageParts; w += kWarp) {
      spin_until(a.sites[a.rank], kWaitPacket, epoch, [&](uint64_t& seen) {
        seen = load_acquire_gpu(&a.staged[w]);
        return seen == epoch;
      });
    }
    __syncwarp();
    if (l == 0) probe_max(a, 6);
  };
  if (ib != nullptr) {
    channel.put_emitted_warp(link_view_from(word), n, rows_of, moe_net::used_bytes(a), count_dst, count_src, 8, true,
                             lane, true, staged);
  } else {
    channel.put_emitted_warp(n, rows_of, moe_net::used_bytes(a), count_dst, count_src, 8, true, lane, true, staged);
  }
  if (lane == 0) probe_max(a, 1);
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256) moe_net_dispatch_send(MoeNetArgs a) {
  moe_net::announce_nvlink(a);  // network peers: in their network task, before the messages
  if (a.probe != nullptr && threadIdx.x == 0) {
    atomicMin(reinterpret_cast<unsigned long long*>(&a.probe[0]), static_cast<unsigned long long>(global_timer_ns()));
  }
  const uint64_t epoch = moe_net::send_epoch(a);
  const uint32_t warps = blockDim.x / kWarp;
  const uint32_t groups = a.num_tokens == 0 ? 1 : (a.num_tokens + kWarp - 1) / kWarp;
  const uint32_t pairs = groups * a.world;
  const uint32_t stages = groups * kStageParts;
  const uint32_t net = (a.world + warps - 1) / warps;
  const uint32_t tasks = stages + net + pairs;
  for (uint32_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    if (task < stages) {
      stage_part(a, task / kStageParts, task % kStageParts, epoch);
    } else if (task < stages + net) {
      const uint32_t r = (task - stages) * warps + threadIdx.x / kWarp;
      if (r < a.world && a.peer_area[r] == 0) network_task(a, r, groups, epoch);  // uniform in the warp
    } else {
      const uint32_t g = (task - stages - net) / a.world, r = (task - stages - net) % a.world;
      if (a.peer_area[r] != 0) nvlink_task(a, g, r, groups, epoch);  // uniform in the block
    }
  }
  if (last_block(&a.done[0]) && threadIdx.x == 0) {
    a.epochs[0] = epoch;
    if (a.ticket != nullptr) a.ticket[0] = epoch;  // for this send's own receive half
    probe_max(a, 2);
  }
}

extern "C" __global__ void __launch_bounds__(512) moe_net_dispatch_recv(MoeNetArgs a) {
  moe_net::check_call(a);  // first: a peer in another call sends no counts to wait for
  // The send's epoch: its ticket's (two dispatches in flight), else the last send's.
  const uint64_t epoch = a.ticket != nullptr ? *reinterpret_cast<volatile uint64_t*>(a.ticket) : a.epochs[0];
  const uint32_t half = uint32_t(epoch & 1);
  __shared__ Counts counts;
  wait_dispatch(a, epoch, counts);
  const uint32_t lane = threadIdx.x % kWarp;
  for_each_message(a, counts, [&](uint32_t src, uint32_t j) { moe_net::unpack(a, half, src, j, lane); });
  if (!last_block(&a.done[1])) return;
  // Every block has unpacked: a receive cut short (the communicator failed) writes no layout
  // (the combine sends nothing) and every expert's count kCutCount.
  const bool cut = __syncthreads_or(threadIdx.x == 0 && failed(a.sites[a.rank]));
  uint32_t* rows = a.fill + a.world;
  const uint32_t pairs = a.experts_per_rank * a.world;
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) a.layout[q] = cut ? 0u : atomicAdd(&rows[q], 0u);
  __syncthreads();
  for (uint32_t le = threadIdx.x; le < a.experts_per_rank; le += blockDim.x) {
    uint32_t n = 0;
    for (uint32_t src = 0; src < a.world; ++src) n += a.layout[le * a.world + src];
    a.recv_count[le] = cut ? kCutCount : n;
  }
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) rows[q] = 0;
  if (threadIdx.x == 0 && (a.packed & kPacked) != 0) {
    // DeepEP's layout: the epochs of the last two receives (moe_net_dispatch_pack reads the last, a
    // combine the one its handle names).
    a.epochs[5] = a.epochs[4];
    a.epochs[4] = epoch;
  }
}

extern "C" __global__ void __launch_bounds__(512) moe_net_combine_send(MoeNetArgs a) {
  moe_net::announce_nvlink(a);  // network peers: in combine_sent, before their signal
  const uint64_t epoch = a.epochs[0];
  const uint32_t half = uint32_t(epoch & 1);
  const uint64_t call = a.epochs[1] + 1;
  __shared__ Counts counts;
  received_counts(a, half, counts);
  const uint32_t lane = threadIdx.x % kWarp;
  for_each_message(a, counts, [&](uint32_t src, uint32_t j) { moe_net::send_partial(a, half, src, j, lane); });
  combine_sent(a, call);
}

extern "C" __global__ void __launch_bounds__(512) moe_net_combine_recv(MoeNetArgs a) {
  moe_net::check_call(a);
  const uint64_t call = a.epochs[1];
  // Cut short (a wait gave up: the communicator aborted): the partial rows are not all in, so
  // the output is all ones (NaN in bf16), not a sum of what the slots held.
  const bool in = wait_combine(a, call);
  const uint32_t chunks = a.hidden / 8;
  const uint64_t items = uint64_t(a.num_tokens) * chunks;
  const uint64_t first = blockIdx.x * blockDim.x + threadIdx.x, stride = uint64_t(gridDim.x) * blockDim.x;
  if (!in) {
    for (uint64_t i = first; i < items; i += stride) reinterpret_cast<int4*>(a.out)[i] = make_int4(-1, -1, -1, -1);
    return;
  }
  for (uint64_t i = first; i < items; i += stride) moe_net::combine_chunk(a, uint32_t(i / chunks), uint32_t(i % chunks));
}

// ---- DeepEP's low-latency layout across nodes (MoeNetArgs's packed fields). ----
// A dispatch: moe_net_dispatch_prep (a warp per token: the ids as i32, those outside the experts
// as -1, and with FP8 the row cast once, DeepEP's cast, so e4m3 crosses), the send and receive
// above, then moe_net_dispatch_pack (each local expert's rows in source order from row 0, with their
// source tokens, ranges and counts, the scales in DeepEP's column-major form).
// A combine: moe_net_combine_send_packed (a warp per message of the handle's dispatch: each
// selection's row of the experts' outputs, read at its packed place, goes back unweighted to
// the token's rank, into its slot (token, k) of the combine's parity; NVLink stores, or staged
// and put), then
// moe_net_combine_recv_packed (every token's slots times the combine's weights, f32 in top-k
// order). A row per selection crosses back, as DeepEP's, since the weights are the combine's
// and live on the token's side. The slots come in two sets by the combine's parity: with two
// dispatches in flight, a peer's next combine may send before this rank's receive has read the
// last one (it waited for this rank's send only), but not the one after (that waits for this
// rank's next send, which its stream orders after this receive).

// Most (local expert, source) pairs of a packed receive (two u32 of shared memory each):
// moe_net::kMaxPackPairs (coll/limits.cuh), checked on the host.

__device__ int32_t packed_id(const MoeNetArgs& a, uint64_t at) {
  const int64_t e = (a.packed & kIds64) != 0 ? static_cast<const int64_t*>(a.in_ids)[at]
                                             : int64_t(static_cast<const int32_t*>(a.in_ids)[at]);
  return e >= 0 && e < int64_t(a.experts_per_rank) * a.world ? int32_t(e) : -1;
}

extern "C" __global__ void __launch_bounds__(512) moe_net_dispatch_prep(MoeNetArgs a) {
  const uint32_t lane = threadIdx.x % kWarp, warps = gridDim.x * (blockDim.x / kWarp);
  int32_t* ids = const_cast<int32_t*>(a.topk_idx);  // the exchange's own scratch, written here
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < a.num_tokens; t += warps) {
    if (lane < a.topk) ids[uint64_t(t) * a.topk + lane] = packed_id(a, uint64_t(t) * a.topk + lane);
    if (a.fp8) {
      moe_ll::cast_row_fp8(reinterpret_cast<const int4*>(a.in_x) + uint64_t(t) * (a.hidden / 8),
                   const_cast<uint8_t*>(a.x) + uint64_t(t) * a.hidden,
                   const_cast<float*>(a.scales) + uint64_t(t) * (a.hidden / 128), a.hidden,
                   (a.packed & kPackedRound) != 0, lane);
    }
  }
}

// Where the scale of group `g` of packed row (`le`, `pos`) goes (column-major, as DeepEP's).
__device__ void store_net_scale(const MoeNetArgs& a, uint32_t le, uint32_t g, uint32_t pos, float scale_inv) {
  const uint64_t cap = uint64_t(a.world) * a.max_tokens;
  if (a.packed & kPackedUe8m0) {
    uint8_t* s = static_cast<uint8_t*>(a.packed_scales);
    s[((uint64_t(le) * (a.hidden / 512) + g / 4) * cap + pos) * 4 + g % 4] = uint8_t(__float_as_uint(scale_inv) >> 23);
  } else {
    static_cast<float*>(a.packed_scales)[(uint64_t(le) * (a.hidden / 128) + g) * cap + pos] = scale_inv;
  }
}

// The receive in DeepEP's layout, after moe_net_dispatch_recv of the same call (which left the
// per-(expert, source) rows in `layout`, and every count kCutCount when cut short): every block
// takes each expert's ranges in source order; block 0 writes ranges, counts and stats; the warps
// copy each received row to its packed place. Cut short: count -1, no ranges, rows all ones.
extern "C" __global__ void __launch_bounds__(512) moe_net_dispatch_pack(MoeNetArgs a) {
  __shared__ uint32_t rows_of[moe_net::kMaxPackPairs], begin_of[moe_net::kMaxPackPairs];
  const uint32_t half = uint32_t(a.epochs[4] & 1);
  const uint32_t world = a.world, local = a.experts_per_rank, pairs = local * world, cap = world * a.max_tokens;
  const bool cut = a.recv_count[0] == kCutCount;
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) rows_of[q] = cut ? 0u : min(a.layout[q], a.max_tokens);
  __syncthreads();
  for (uint32_t le = threadIdx.x; le < local; le += blockDim.x) {
    uint32_t n = 0;
    for (uint32_t src = 0; src < world; ++src) {
      begin_of[le * world + src] = n;
      n += rows_of[le * world + src];
    }
    if (blockIdx.x == 0) {
      a.packed_count[le] = cut ? -1 : int32_t(n);
      if (!cut && a.packed_stats != nullptr) a.packed_stats[le] += int32_t(n);
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) {
      a.packed_range[q] = cut ? 0 : int64_t((uint64_t(begin_of[q]) << 32) | rows_of[q]);
    }
  }
  const uint32_t lane = threadIdx.x % kWarp, warps = gridDim.x * (blockDim.x / kWarp);
  const bool fp8 = (a.packed & kPackedFp8) != 0;
  const uint64_t row_bytes = fp8 ? uint64_t(a.hidden) : uint64_t(a.hidden) * 2;
  const uint64_t rows = uint64_t(local) * world * a.max_tokens;
  const uint8_t* from_half = a.recv_x + uint64_t(half) * rows * a.hidden * 2;
  for (uint64_t p = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; p < uint64_t(local) * cap; p += warps) {
    const uint32_t le = uint32_t(p / cap), i = uint32_t(p % cap);
    uint8_t* dst = a.packed_x + p * row_bytes;
    if (cut) {
      for (uint64_t w = lane; w < row_bytes / 16; w += kWarp) reinterpret_cast<int4*>(dst)[w] = make_int4(-1, -1, -1, -1);
      if (fp8) {
        for (uint32_t g = lane; g < a.hidden / 128; g += kWarp) store_net_scale(a, le, g, i, __uint_as_float(~0u));
      }
      continue;
    }
    int32_t src = -1;
    for (uint32_t base = 0; base < world && src < 0; base += kWarp) {  // the source holding position i
      const uint32_t s = base + lane;
      const bool hit = s < world && i >= begin_of[le * world + s] && i - begin_of[le * world + s] < rows_of[le * world + s];
      const uint32_t m = __ballot_sync(0xffffffffu, hit);
      if (m != 0) src = int32_t(base + __ffs(m) - 1);
    }
    if (src < 0) continue;  // past the expert's rows
    const uint64_t at = moe_net::row_index(a, half, le, uint32_t(src), i - begin_of[le * world + src]);
    if (lane == 0) a.packed_src[p] = a.recv_src[at];
    const int4* row = reinterpret_cast<const int4*>(from_half + (at % rows) * row_bytes);
    copy_words_batched<int4, 8>(reinterpret_cast<int4*>(dst), row, row_bytes / 16, lane, kWarp);
    if (fp8) {
      const float* scales = a.recv_scales + at * (a.hidden / 128);
      for (uint32_t g = lane; g < a.hidden / 128; g += kWarp) store_net_scale(a, le, g, i, scales[g]);
    }
  }
}

// Combine send in DeepEP's layout for message j from `src` of the dispatch in half `half`: each
// selection here returns its row of the experts' outputs (`y [local expert][cap][hidden]` at
// the packed place the handle's ranges give) unweighted to slot (call parity, token, k) of
// `src`'s partial rows: NVLink stores, or staged at (src, j, k) and put. One warp.
__device__ void send_selections(const MoeNetArgs& a, uint64_t call, uint32_t half, uint32_t src, uint32_t j,
                                uint32_t lane) {
  const uint32_t t = uint32_t(reinterpret_cast<const int32_t*>(a.area + moe_net::wire_offset(a, half, src, j))[0]);
  const int32_t mine = lane < a.topk ? *moe_net::rec_entry(a, half, src, j, lane) : -1;
  const uint32_t mask = __ballot_sync(0xffffffffu, mine >= 0);
  if (mask == 0 || t >= a.max_tokens) return;
  const uint64_t rows = uint64_t(a.experts_per_rank) * a.world * a.max_tokens, cap = uint64_t(a.world) * a.max_tokens;
  const uint32_t words = a.hidden / 8;
  const uint64_t mapped = a.peer_area[src];
  const int4* y = reinterpret_cast<const int4*>(a.y);
  for (uint32_t bits = mask; bits != 0; bits &= bits - 1) {
    const uint32_t k = __ffs(bits) - 1;
    const uint64_t r = uint64_t(uint32_t(__shfl_sync(0xffffffffu, mine, k))) % rows;
    const uint32_t i = uint32_t(r % a.max_tokens), le = uint32_t(r / a.max_tokens / a.world);
    const uint64_t pos = uint64_t(uint32_t(uint64_t(a.packed_range[le * a.world + src]) >> 32)) + i;
    if (pos >= cap) {  // not the ranges of this dispatch
      if (lane == 0) report_failure(a.sites[a.rank], kWaitBadInput, cap, pos, 0);
      continue;
    }
    const uint64_t slot = (uint64_t(call & 1) * a.max_tokens + t) * a.topk + k;
    const uint64_t staged = (uint64_t(src) * a.max_tokens + j) * a.topk + k;
    int4* dst = mapped != 0 ? reinterpret_cast<int4*>(mapped + a.off_part) + slot * words
                            : reinterpret_cast<int4*>(a.stage + a.stage_part) + staged * words;
    copy_words_batched<int4, 8>(dst, y + (uint64_t(le) * cap + pos) * words, words, lane, kWarp);
    if (mapped == 0) {
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        moe_net::channel(a, src).put(a.off_part + slot * words * 16, a.stage_part + staged * words * 16,
                                     uint64_t(words) * 16);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(512) moe_net_combine_send_packed(MoeNetArgs a) {
  moe_net::announce_nvlink(a);  // network peers: in combine_sent, before their signal
  const uint32_t half = uint32_t(a.epochs[4 + (a.back & 1)] & 1);
  const uint64_t call = a.epochs[1] + 1;
  __shared__ Counts counts;
  received_counts(a, half, counts);
  const uint32_t lane = threadIdx.x % kWarp;
  for_each_message(a, counts, [&](uint32_t src, uint32_t j) { send_selections(a, call, half, src, j, lane); });
  combine_sent(a, call);
}

// Combine receive in DeepEP's layout: out[t] = sum over k of topk_weights[t, k] x slot (t, k),
// f32 in top-k order, ids outside the experts adding nothing. Cut short: all ones.
extern "C" __global__ void __launch_bounds__(512) moe_net_combine_recv_packed(MoeNetArgs a) {
  moe_net::check_call(a);
  const uint64_t call = a.epochs[1];
  const bool in = wait_combine(a, call);
  const uint32_t words = a.hidden / 8;
  const uint64_t items = uint64_t(a.num_tokens) * words;
  const uint64_t first = blockIdx.x * blockDim.x + threadIdx.x, stride = uint64_t(gridDim.x) * blockDim.x;
  int4* out = reinterpret_cast<int4*>(a.out);
  const int4* part = reinterpret_cast<const int4*>(a.area + a.off_part) + (call & 1) * a.max_tokens * a.topk * words;
  for (uint64_t q = first; q < items; q += stride) {
    if (!in) {
      out[q] = make_int4(-1, -1, -1, -1);
      continue;
    }
    const uint64_t t = q / words, c = q % words;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t k = 0; k < a.topk; ++k) {
      if (packed_id(a, t * a.topk + k) < 0) continue;
      fma_bf16x8(acc, a.topk_weights[t * a.topk + k], part[(t * a.topk + k) * words + c]);
    }
    out[q] = to_bf16x8(acc);
  }
}

// ---- High throughput (prefill) across nodes, DeepEP's hierarchical scheme (MoeHtArgs). ----
//
// A dispatch, launched in this order on the caller's stream:
//   stage (moe_ht_stage, the SM budget's blocks): a warp per token builds its message once in the
//     staging area and fills this node's forwarding slot [my node][t] when one of its experts is
//     on this node (empties it otherwise).
//   exchange (moe_ht_exchange): block 0 sends, a warp per other node, to that node's rank of my
//     local index (my rail peer there): it lists the tokens with an expert on that node, in token
//     order, and posts them in chunks of kHtChunk messages: a batch of WRITEs into the next chunk
//     of the peer's ring for my node, the chunk's descriptor (epoch, messages, last), and a signal
//     behind them. Every dispatch sends at least one chunk to every other node (an empty last one
//     when no token goes there), so a receiver always learns that a source is done.
//     Receiver-driven admission: the ring holds `chunks` chunks per source node, fewer than the
//     worst case, and a sender writes its chunk g >= chunks only after taking one credit (a
//     signal on the credit channel), which the receiver sends once it has consumed chunk
//     g - chunks: an incast of every node onto one rank can never overrun it. The other blocks
//     receive, a block per other node: thread 0 waits for the next chunk's signal and reads its
//     descriptor, the block's warps copy its messages into forwarding slots [node][token], and
//     once every warp is done thread 0 grants the chunk's slot back with a credit signal.
//   The NVLink MoE dispatch of the node then moves the forwarding slots to the ranks holding their
//   experts; remap (moe_ht_remap) names each received row's origin.
// Positions are monotonic over calls (chunks sent and received per node, signals on both channel
// sets), so nothing is reset between calls and a captured graph replays as is.
// A dispatch by ranks (DeepEP's without top-k) sends a token to the nodes of the ranks in its
// in_rank row, its message carrying that row as a rank mask, which fills the slot's row of the
// node's own dispatch by ranks; each source's counts of a node's experts ride in its first chunk's
// descriptor to that node, where the rail peer adds them to its own for the node dispatch.
// Combine: the node's NVLink combine sums the node's ranks' outputs per slot (and, asked, their
// top-k weights); combine_send (moe_ht_combine_send) sends each slot's sum back to its origin, one
// row per (token, node), into the origin's partial rows (which hold exactly its own tokens:
// nothing to admit), the weights beside it in a region of their own; combine_recv
// (moe_ht_combine_recv) adds the nodes' rows (and weights) in node order, over the nodes the
// dispatch recorded for each token (tok_nodes).

namespace {

// Node-local expert id of global expert e (-1 when on another node or out of range), and its node.
__device__ int32_t node_local_expert(const MoeNetArgs& a, const MoeHtArgs& h, int32_t e, int32_t& node) {
  node = -1;
  if (e < 0 || uint32_t(e) >= a.experts_per_rank * a.world) return -1;
  const uint32_t r = uint32_t(e) / a.experts_per_rank;
  node = int32_t(h.node_of[r]);
  if (uint32_t(node) != h.node) return -1;
  return int32_t(h.local_of[r] * a.experts_per_rank + uint32_t(e) % a.experts_per_rank);
}

// Ranks of a node (every node the same size).
__device__ uint32_t node_size(const MoeNetArgs& a, const MoeHtArgs& h) { return a.world / h.nodes; }

// The OR of every lane's `m`.
__device__ uint64_t warp_or(uint64_t m) {
  for (uint32_t o = 16; o > 0; o >>= 1) m |= __shfl_xor_sync(0xffffffffu, m, o);
  return m;
}

// Token t's ranks in a dispatch by ranks (bit r: rank r), every lane. One warp.
__device__ uint64_t token_ranks(const MoeNetArgs& a, const MoeHtArgs& h, uint32_t t, uint32_t lane) {
  uint64_t m = 0;
  for (uint32_t r = lane; r < a.world; r += kWarp) {
    if (h.in_rank[uint64_t(t) * a.world + r] != 0) m |= uint64_t(1) << r;
  }
  return warp_or(m);
}

// The nodes token t goes to (bit n: node n), every lane: its experts' nodes, or the nodes of the
// ranks in `ranks` (a dispatch by ranks). One warp.
__device__ uint64_t token_nodes(const MoeNetArgs& a, const MoeHtArgs& h, uint32_t t, uint64_t ranks, uint32_t lane) {
  uint64_t m = 0;
  if (h.by_rank != 0) {
    for (uint32_t r = lane; r < a.world; r += kWarp) {
      if (ranks >> r & 1) m |= uint64_t(1) << h.node_of[r];
    }
  } else if (lane < a.topk) {
    int32_t node;
    node_local_expert(a, h, a.topk_idx[uint64_t(t) * a.topk + lane], node);
    if (node >= 0) m = uint64_t(1) << node;
  }
  return warp_or(m);
}

// Fills forwarding slot `slot` from a message (header + row; bf16 or e4m3 by `fp8`) of `origin`.
// The message is read around L1 (a ring slot is rewritten by the NIC while the kernel runs). One
// warp.
__device__ void fill_slot(const MoeNetArgs& a, const MoeHtArgs& h, uint64_t slot, const char* m, bool fp8,
                          int32_t origin, uint32_t lane) {
  const volatile int32_t* hd = reinterpret_cast<const volatile int32_t*>(m);
  if (h.by_rank != 0) {
    // The token's rank mask (see MoeHtArgs): its row of this node's ranks.
    const uint64_t ranks =
        uint64_t(uint32_t(hd[moe_net::kHeaderIds])) | uint64_t(uint32_t(hd[moe_net::kHeaderIds + a.topk])) << 32;
    for (uint32_t r = lane; r < a.world; r += kWarp) {
      if (h.node_of[r] == h.node) h.fwd_in_rank[slot * node_size(a, h) + h.local_of[r]] = uint8_t(ranks >> r & 1);
    }
  } else if (lane < a.topk) {
    int32_t node;
    h.fwd_idx[slot * a.topk + lane] = node_local_expert(a, h, hd[moe_net::kHeaderIds + lane], node);
    h.fwd_w[slot * a.topk + lane] = reinterpret_cast<const volatile float*>(hd)[moe_net::kHeaderIds + a.topk + lane];
  }
  if (lane == 0) {
    h.fwd_origin[2 * slot] = origin;
    h.fwd_origin[2 * slot + 1] = hd[0];
  }
  const uint32_t bytes = fp8 ? a.hidden : a.hidden * 2;
  const int4* src = reinterpret_cast<const int4*>(m + a.header_bytes);
  int4* dst = reinterpret_cast<int4*>(h.fwd_x + slot * bytes);
  constexpr uint32_t kUnroll = 4;
  for (uint32_t base = 0; base < bytes / 16; base += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + lane + u * 32;
      if (i < bytes / 16) v[u] = __ldcg(src + i);
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + lane + u * 32;
      if (i < bytes / 16) dst[i] = v[u];
    }
  }
  if (fp8) {
    const uint32_t n = a.hidden / 128;
    const float* sc = reinterpret_cast<const float*>(m + a.header_bytes + bytes);
    for (uint32_t i = lane; i < n; i += 32) h.fwd_scales[slot * n + i] = __ldcg(sc + i);
  }
}

// Marks forwarding slot `slot` empty this call. One warp.
__device__ void empty_slot(const MoeNetArgs& a, const MoeHtArgs& h, uint64_t slot, uint32_t lane) {
  if (lane < a.topk) h.fwd_idx[slot * a.topk + lane] = -1;
  if (h.by_rank != 0) {
    for (uint32_t l = lane; l < node_size(a, h); l += kWarp) h.fwd_in_rank[slot * node_size(a, h) + l] = 0;
  }
  if (lane == 0) h.fwd_origin[2 * slot] = -1;
}

__device__ const PortChannelHandle& credit_channel(const MoeHtArgs& h, uint32_t r) {
  return static_cast<const PortChannelHandle*>(h.credits)[r];
}

// Message i of ring chunk `chunk` for source node `src_node` in a receiver's area.
__device__ uint64_t ring_offset(const MoeNetArgs& a, const MoeHtArgs& h, uint32_t src_node, uint32_t chunk,
                                uint32_t i) {
  return h.off_ring + ((uint64_t(src_node) * h.chunks + chunk) * kHtChunk + i) * a.msg_bytes;
}

__device__ uint64_t desc_offset(const MoeHtArgs& h, uint32_t src_node, uint32_t chunk) {
  return h.off_desc + (uint64_t(src_node) * h.chunks + chunk) * h.desc_bytes;
}

// Experts of a node, and where a dispatch's per-expert counts sit behind a descriptor.
__device__ uint32_t node_experts(const MoeNetArgs& a, const MoeHtArgs& h) {
  return a.experts_per_rank * node_size(a, h);
}
__device__ uint64_t desc_counts(uint64_t desc) { return desc + sizeof(HtChunkDesc); }

// Sends this dispatch's tokens for node n to its rail peer (see above). One warp.
__device__ void send_node(const MoeNetArgs& a, const MoeHtArgs& h, uint32_t n, uint64_t epoch, uint32_t lane) {
  const uint32_t peer = h.rail[n];
  const uint32_t half = uint32_t(epoch & 1);
  uint32_t* list = h.list + uint64_t(n) * a.max_tokens;
  uint32_t m = 0;
  for (uint32_t base = 0; base < a.num_tokens; base += 32) {
    const uint32_t t = base + lane;
    const bool go = t < a.num_tokens && (h.tok_nodes[t] >> n & 1) != 0;
    const uint32_t mask = __ballot_sync(0xffffffffu, go);
    if (go) list[m + __popc(mask & ((1u << lane) - 1))] = t;
    m += __popc(mask);
  }
  __syncwarp();
  const PortChannelHandle& c = moe_net::channel(a, peer);
  if (lane == 0) moe_net::announce_to(a, peer);  // the call check's word, ahead of the chunks
  __syncwarp();
  const uint64_t sent = *reinterpret_cast<volatile uint64_t*>(&h.sent_chunks[n]);
  const uint32_t chunks = m == 0 ? 1 : (m + kHtChunk - 1) / kHtChunk;
  for (uint32_t i = 0; i < chunks; ++i) {
    const uint64_t g = sent + i;
    if (g >= h.chunks && lane == 0) credit_channel(h, peer).wait();  // chunk g - chunks consumed
    __syncwarp();
    const uint32_t slot = uint32_t(g % h.chunks);
    const uint32_t first = i * kHtChunk;
    const uint32_t rows = m - first < kHtChunk ? m - first : kHtChunk;
    // The descriptor's source is rewritten only after this chunk's credit came back (delivered).
    const uint64_t desc_src = h.stage_desc + (uint64_t(n) * h.chunks + slot) * h.desc_bytes;
    // The first chunk carries this rank's counts of node n's experts (a dispatch by ranks).
    const bool counts = i == 0 && h.tokens_per_expert != nullptr;
    if (counts) {
      int32_t* to = reinterpret_cast<int32_t*>(a.stage + desc_counts(desc_src));
      for (uint32_t r = 0; r < a.world; ++r) {
        if (h.node_of[r] != n) continue;
        for (uint32_t j = lane; j < a.experts_per_rank; j += kWarp) {
          to[h.local_of[r] * a.experts_per_rank + j] = h.tokens_per_expert[uint64_t(r) * a.experts_per_rank + j];
        }
      }
      __threadfence_system();
      __syncwarp();
    }
    if (lane == 0) {
      volatile HtChunkDesc* d = reinterpret_cast<volatile HtChunkDesc*>(a.stage + desc_src);
      d->epoch = epoch;
      d->messages = rows;
      d->last = i + 1 == chunks ? 1 : 0;
      __threadfence_system();
    }
    const uint32_t t = lane < rows ? list[first + lane] : 0;
    c.put_warp(rows, ring_offset(a, h, h.node, slot, lane), moe_net::stage_offset(a, half, t), moe_net::used_bytes(a),
               desc_offset(h, h.node, slot), desc_src, counts ? h.desc_bytes : sizeof(HtChunkDesc), true, lane);
  }
  if (lane == 0) {
    h.sent_chunks[n] = sent + chunks;
    c.flush();  // the staged messages may be rebuilt by the next dispatch
  }
  __syncwarp();
}

// Receives this dispatch's chunks from node n's rail peer into forwarding slots [n][token]
// (see above). A whole block.
__device__ void receive_node(const MoeNetArgs& a, const MoeHtArgs& h, uint32_t n, uint64_t epoch) {
  const uint32_t src = h.rail[n];
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  // Slots no message fills this call stay empty.
  for (uint32_t t = warp; t < a.max_tokens; t += warps) empty_slot(a, h, uint64_t(n) * a.max_tokens + t, lane);
  __shared__ uint32_t rows, last, ok;
  uint64_t g = *reinterpret_cast<volatile uint64_t*>(&h.recv_chunks[n]);
  uint32_t total = 0;
  bool first = true;
  __syncthreads();  // the empty slots before any message fills one
  for (;;) {
    if (threadIdx.x == 0) {
      ok = moe_net::wait_signal(a, src) ? 1 : 0;
      if (ok) {
        const volatile HtChunkDesc* d =
            reinterpret_cast<const volatile HtChunkDesc*>(a.area + desc_offset(h, n, uint32_t(g % h.chunks)));
        rows = d->messages;
        last = d->last;
        // Another dispatch's chunk: the peer made another call (or lost the order).
        if (d->epoch != epoch || rows > kHtChunk) {
          report_failure(a.sites[src], kWaitBadInput, epoch, d->epoch, 0);
          ok = 0;
        }
      }
    }
    __syncthreads();
    if (!ok) break;
    if (first && h.tokens_per_expert != nullptr) {
      // The source's counts of this node's experts, in its first chunk's descriptor.
      const volatile int32_t* from =
          reinterpret_cast<const volatile int32_t*>(a.area + desc_counts(desc_offset(h, n, uint32_t(g % h.chunks))));
      for (uint32_t e = threadIdx.x; e < node_experts(a, h); e += blockDim.x) atomicAdd(&h.fwd_tpe[e], from[e]);
    }
    first = false;
    for (uint32_t i = warp; i < rows; i += warps) {
      const char* m = a.area + ring_offset(a, h, n, uint32_t(g % h.chunks), i);
      const volatile int32_t* hd = reinterpret_cast<const volatile int32_t*>(m);
      const int32_t t = hd[0];
      if (t >= 0 && uint32_t(t) < a.max_tokens) {
        fill_slot(a, h, uint64_t(n) * a.max_tokens + uint32_t(t), m, hd[1] != 0, int32_t(src), lane);
      } else if (lane == 0) {
        report_failure(a.sites[src], kWaitBadInput, a.max_tokens, uint32_t(t), 0);
      }
    }
    __syncthreads();  // every warp has read the chunk: its slot may be written again
    if (threadIdx.x == 0) credit_channel(h, src).signal();
    total += rows;
    ++g;
    if (last) break;
  }
  if (threadIdx.x == 0) {
    h.recv_chunks[n] = g;
    h.net_rows[n] = total;
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(512) moe_ht_stage(MoeNetArgs a, MoeHtArgs h) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t scales = a.hidden / 128;
  const uint32_t half = uint32_t(moe_net::send_epoch(a) & 1);
  if (blockIdx.x == 0 && h.tokens_per_expert != nullptr) {
    // The node dispatch's per-expert counts start from mine of the node's experts; the receive
    // of each other node's first chunk adds its source's (moe_ht_exchange, after this kernel).
    for (uint32_t r = 0; r < a.world; ++r) {
      if (h.node_of[r] != h.node) continue;
      for (uint32_t j = threadIdx.x; j < a.experts_per_rank; j += blockDim.x) {
        h.fwd_tpe[h.local_of[r] * a.experts_per_rank + j] = h.tokens_per_expert[uint64_t(r) * a.experts_per_rank + j];
      }
    }
  }
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < a.max_tokens; t += warps) {
    const uint64_t slot = uint64_t(h.node) * a.max_tokens + t;
    if (t >= a.num_tokens) {
      empty_slot(a, h, slot, lane);
      continue;
    }
    char* staged = a.stage + moe_net::stage_offset(a, half, t);
    moe_net::stage_token(a, t, a.x + uint64_t(t) * moe_net::row_bytes(a),
                         a.fp8 ? a.scales + uint64_t(t) * scales : nullptr, lane);
    __syncwarp();
    uint64_t ranks = 0;
    if (h.by_rank != 0) {
      ranks = token_ranks(a, h, t, lane);
      // The rank mask in the header's first id and first weight words (see MoeHtArgs).
      int32_t* hd = reinterpret_cast<int32_t*>(staged);
      if (lane == 0) hd[moe_net::kHeaderIds] = int32_t(uint32_t(ranks));
      if (lane == 1) hd[moe_net::kHeaderIds + a.topk] = int32_t(uint32_t(ranks >> 32));
    } else if (lane < a.topk) {
      const int32_t e = a.topk_idx[uint64_t(t) * a.topk + lane];
      if (e >= int32_t(a.experts_per_rank * a.world)) {
        report_failure(a.sites[a.rank], kWaitBadInput, a.experts_per_rank * a.world, uint64_t(e), 0);
      }
    }
    const uint64_t nodes = token_nodes(a, h, t, ranks, lane);
    if (lane == 0) h.tok_nodes[t] = nodes;
    __syncwarp();
    // This node's slot: the token itself, forwarded by this rank.
    if ((nodes >> h.node & 1) != 0) {
      fill_slot(a, h, slot, staged, a.fp8 != 0, int32_t(a.rank), lane);
    } else {
      empty_slot(a, h, slot, lane);
    }
  }
}

// Grid: `senders` = ceil(nodes / 16) blocks of 512 threads send, a warp per node; then a block
// per node receives. Every sender and every receiver serves one peer only, so a sender waiting
// for credits waits only for the one receiver that is waiting only for it: the exchange cannot
// deadlock however the peers' blocks are scheduled, as long as each rank's blocks are resident.
extern "C" __global__ void __launch_bounds__(512) moe_ht_exchange(MoeNetArgs a, MoeHtArgs h) {
  // The call check with the rail peers, the ranks this exchange moves rows with (send_node
  // announces; the node's NVLink dispatch checks its own ranks): the last block's thread n checks
  // node n's rail peer, before any wait on chunks a peer in another call would never send.
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x < h.nodes && threadIdx.x != h.node) {
    moe_net::check_peer(a, h.rail[threadIdx.x]);
  }
  const uint64_t epoch = moe_net::send_epoch(a);
  const uint32_t warps = blockDim.x / kWarp;
  const uint32_t senders = (h.nodes + warps - 1) / warps;
  if (blockIdx.x < senders) {
    const uint32_t n = blockIdx.x * warps + threadIdx.x / kWarp;
    if (n < h.nodes && n != h.node) send_node(a, h, n, epoch, threadIdx.x % kWarp);
  } else {
    const uint32_t n = blockIdx.x - senders;
    if (n < h.nodes && n != h.node) receive_node(a, h, n, epoch);
  }
  if (last_block(&a.done[1]) && threadIdx.x == 0) {
    h.net_rows[h.node] = 0;
    a.epochs[0] = epoch;
  }
}

extern "C" __global__ void moe_ht_remap(MoeNetArgs a, MoeHtArgs h) {
  // The exchange between nodes gave up (or the communicator failed since): the node's dispatch
  // ran over what had arrived, on the node's own communicator, so its results look whole. Mark
  // them as a dispatch cut short marks its own: the row count kCutCount, kCutBit into every
  // expert count, all ones (NaN) over this block's share of the row slots.
  const bool cut = __syncthreads_or(threadIdx.x == 0 && (failed(a.sites[a.rank]) || aborted(a.sites[a.rank])));
  if (cut) {
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0) *h.node_num_recv = kCutCount;
      for (uint32_t e = threadIdx.x; e < a.experts_per_rank; e += blockDim.x) atomicOr(&h.node_counts[e], kCutBit);
    }
    const uint64_t row_bytes = a.fp8 != 0 ? a.hidden : uint64_t(a.hidden) * 2;
    const uint64_t words = h.node_max_rows * row_bytes / 16;
    int4* rows = reinterpret_cast<int4*>(h.node_rows);
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < words; i += uint64_t(gridDim.x) * blockDim.x) {
      rows[i] = make_int4(-1, -1, -1, -1);
    }
    return;
  }
  const uint32_t rows = *h.node_num_recv;
  if (rows == kCutCount) return;  // the node's dispatch was cut short and marked its results
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) {
    const uint32_t l = uint32_t(h.node_src[2 * i]), slot = uint32_t(h.node_src[2 * i + 1]);
    const int32_t* origin = reinterpret_cast<const int32_t*>(h.origin_of[l]) + 2 * uint64_t(slot);
    h.recv_src[2 * i] = origin[0];
    h.recv_src[2 * i + 1] = origin[1];
  }
}

extern "C" __global__ void __launch_bounds__(512) moe_ht_combine_send(MoeNetArgs a, MoeHtArgs h) {
  moe_net::announce_nvlink(a);  // network peers: in combine_sent, before their signal
  const uint64_t call = a.epochs[1] + 1;
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint64_t slots = uint64_t(h.nodes) * a.max_tokens;
  const uint32_t words = a.hidden / 8;
  // The partial rows (and weights) alternate between two halves by the call's parity: a peer
  // one combine ahead (it has all of this combine's rows) writes the other half while this rank
  // still reads its own; two ahead it cannot be, since that needs this rank's next rows.
  const uint64_t half = call & 1;
  for (uint64_t q = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; q < slots; q += warps) {
    const int32_t src = h.fwd_origin[2 * q];
    if (src < 0) continue;
    const uint32_t t = uint32_t(q % a.max_tokens);
    const int4* row = reinterpret_cast<const int4*>(h.fwd_out) + q * words;
    const uint64_t prow = (half * a.world + a.rank) * a.max_tokens + t;
    const uint64_t part_row = prow * words;
    const uint64_t stage_row = (uint64_t(src) * a.max_tokens + t) * words;
    const uint64_t mapped = a.peer_area[src];
    int4* dst = mapped != 0 ? reinterpret_cast<int4*>(mapped + a.off_part) + part_row
                            : reinterpret_cast<int4*>(a.stage + a.stage_part) + stage_row;
    copy_words_batched<int4, 8>(dst, row, words, lane, 32);
    // The slot's top-k weights beside its row (their own region: the rows' stride is shared
    // with the low-latency path).
    const uint64_t part_w = prow * a.topk;
    const uint64_t stage_w = (uint64_t(src) * a.max_tokens + t) * a.topk;
    if (h.weights != 0 && lane < a.topk) {
      float* wdst = mapped != 0 ? reinterpret_cast<float*>(mapped + h.off_part_w) + part_w
                                : reinterpret_cast<float*>(a.stage + h.stage_part_w) + stage_w;
      wdst[lane] = h.fwd_wout[q * a.topk + lane];
    }
    if (mapped == 0) {
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();
        const PortChannelHandle& c = moe_net::channel(a, uint32_t(src));
        c.put(a.off_part + part_row * 16, a.stage_part + stage_row * 16, uint64_t(words) * 16);
        if (h.weights != 0) c.put(h.off_part_w + part_w * 4, h.stage_part_w + stage_w * 4, uint64_t(a.topk) * 4);
      }
    }
  }
  combine_sent(a, call);
}

extern "C" __global__ void __launch_bounds__(512) moe_ht_combine_recv(MoeNetArgs a, MoeHtArgs h) {
  moe_net::check_call(a);  // every peer: every rank tells every rank its combine rows are in
  const uint64_t call = a.epochs[1];
  const bool in = wait_combine(a, call);
  const uint32_t words = a.hidden / 8;
  const uint64_t items = uint64_t(a.num_tokens) * words;
  const uint64_t first = blockIdx.x * blockDim.x + threadIdx.x, stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t wts = h.weights != 0 ? uint64_t(a.num_tokens) * a.topk : 0;
  if (!in) {  // cut short: marked (all ones, NaN in bf16), as moe_net_combine_recv
    for (uint64_t i = first; i < items; i += stride) reinterpret_cast<int4*>(a.out)[i] = make_int4(-1, -1, -1, -1);
    for (uint64_t i = first; i < wts; i += stride) h.w_out[i] = __int_as_float(-1);
    return;
  }
  // This call's half of the partial rows and weights (see moe_ht_combine_send).
  const uint64_t half = call & 1;
  const int4* part = reinterpret_cast<const int4*>(a.area + a.off_part);
  for (uint64_t i = first; i < items; i += stride) {
    const uint32_t t = uint32_t(i / words), c = uint32_t(i % words);
    const uint64_t nodes = h.tok_nodes[t];  // the dispatch's (moe_ht_stage)
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (uint32_t n = 0; n < h.nodes; ++n) {
      if (!(nodes >> n & 1)) continue;
      const int4 v = part[((half * a.world + h.rail[n]) * a.max_tokens + t) * words + c];
      add_bf16x8(acc, v);
    }
    reinterpret_cast<int4*>(a.out)[uint64_t(t) * words + c] = to_bf16x8(acc);
  }
  // A thread per (token, k): the weights of every node the token went to, in node order, f32.
  const float* part_w = reinterpret_cast<const float*>(a.area + h.off_part_w);
  for (uint64_t i = first; i < wts; i += stride) {
    const uint32_t t = uint32_t(i / a.topk);
    const uint64_t nodes = h.tok_nodes[t];
    float acc = 0.0f;
    for (uint32_t n = 0; n < h.nodes; ++n) {
      if (nodes >> n & 1) acc += part_w[((half * a.world + h.rail[n]) * a.max_tokens + t) * a.topk + i % a.topk];
    }
    h.w_out[i] = acc;
  }
}

// The fused-dispatch path of the tests: the row is made in shared memory by the kernel itself (as
// an expert or attention kernel would have it) and sent with moe_net::put_token. Row values follow
// the tests' rule ((rank * 31 + t * 7 + h) % 64 - 32, exact in bf16).
extern "C" __global__ void moe_net_test_fused_send(MoeNetArgs a) {
  extern __shared__ int4 rows[];
  const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  __nv_bfloat16* row = reinterpret_cast<__nv_bfloat16*>(rows + uint64_t(warp) * (a.hidden / 8));
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + warp; t < a.num_tokens; t += warps) {
    for (uint32_t h = lane; h < a.hidden; h += kWarp) {
      row[h] = __float2bfloat16(float(int((a.rank * 31 + t * 7 + h) % 64) - 32));
    }
    __syncwarp();
    moe_net::put_token(a, t, row, nullptr, lane);
    __syncwarp();
  }
  moe_net::finish_send(a);
}
