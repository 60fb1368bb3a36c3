// doorbell device API, coll tier: the node-spanning low-latency MoE exchange as calls for your own
// kernels. `MoeLowLatency` (Rust) takes this path when its communicator spans nodes (or with
// DOORBELL_MOE_NET=1); `cuda/kernels/moe_net.cu` is built from the same calls.
//
// One code path for every peer: a token's message (header + row, see MoeNetArgs in
// coll/moe_args.cuh) is built once in the sender's staging area (the half of the dispatch's
// epoch), then goes to each rank holding one of its experts: by NVLink stores, from the token's
// own warp, where that rank's area is mapped here (same node, and this rank itself); by
// PortChannel puts otherwise (RDMA WRITEs that the kernel or the proxy posts, whichever posting
// mode the transports chose), which the token's warp only lists: the sending grid's last block
// posts each network peer's list as one batch of WRITEs (one reservation, one publish and one
// doorbell when the GPU posts) followed by the count word and the signal (a READ that flushes the
// writes before it, then the fetch-add the receiver waits for). The slot
// is the sender's to pick (an atomic on its own counter per destination), so no receiver is ever
// asked first: each source owns `max_tokens` message slots per half at each receiver, which one
// call can never overrun (DeepEP's low-latency layout; a decode step cannot wait for a grant,
// since the receive half runs after the send half). Over NVLink the count word is a store after
// a system fence.
//
// The send never waits for its network completions (no SM is held for the NIC): the staging half
// of call e is rebuilt by call e + 2, and by then every peer has received call e + 1's counts
// from every rank, which each rank sends only after its own receive of call e saw this rank's
// signal, which the NIC executes after every WRITE of call e.
//
// Fused dispatch, per call:
//   host: args = begin_fused_send(...)   (a FusedSend::Net, launches nothing)
//   your kernel, any grid: for each token t you own, one warp calls
//       moe_net::put_token(args, t, row, scales, lane)   // scales: null unless args.fp8
//     and every block calls moe_net::finish_send(args) once after its puts (all its threads).
//   host: dispatch_recv(stream)
// Combine: the receive side's moe_net::send_partial (one warp per message it received) sums the
// token's selections there (weight x expert output, f32 in top-k order, rounded to bf16) and
// sends that partial row back; moe_net::combine_chunk adds the ranks' partial rows in rank order.
#pragma once

#include "../channel/port_channel.cuh"
#include "../core/copy.cuh"
#include "../core/reduce.cuh"
#include "call_check.cuh"
#include "limits.cuh"  // moe_net::kMaxRanks, which the call check's inbox below is sized by
#include "moe_args.cuh"

#if DOORBELL_CUDA
#include <cuda_bf16.h>

namespace doorbell {
namespace moe_net {

DOORBELL_DEVICE_INLINE const PortChannelHandle& channel(const MoeNetArgs& a, uint32_t r) {
  return static_cast<const PortChannelHandle*>(a.channels)[r];
}

// ---- The call check across nodes: call_check.cuh's protocol, its inbox reached over the channels.
// Ranks on other nodes map no memory of each other, so the inbox lives in the registered area
// (`off_inbox`): [2 parities][kMaxRanks] slots its peers write, then the counts of calls
// announced to and checked against each peer (kInboxWords words, zeroed at allocation). A send
// kernel announces its call to every peer: an NVLink peer by a store into its inbox, a network
// peer by an 8-byte put (no signal: the MoE protocol counts its signals; a lone aligned 8-byte
// write lands whole) from one of four staging words (`stage_words`, by the call's count n: word
// n & 3). Its put goes before the call's signal on the same channel, so it has landed once the
// peer's receive of call n saw that signal; word n & 3 is written again by call n + 4, which this
// rank sends only after its receive of call n + 2 (at most two calls in flight: a dispatch and a
// combine, or two halves of one kind), and the peer sends call n + 2 only after its receive of
// call n. A receive kernel's checker threads
// (the last block's last `world` threads) wait, bounded, for each peer's word of this call and
// compare. Every dispatch and every combine is one call, so a dispatch against a combine is a
// mismatch too, named on both sides. The two parities suffice as in call_check.cuh: a peer writes
// call n + 2's word only after its call n + 1 received from this rank, which sends only after
// this rank's receive of call n (where the check reads slot n) ended.
constexpr uint32_t kInboxAnnounced = 2 * kMaxRanks, kInboxChecked = 3 * kMaxRanks, kInboxWords = 4 * kMaxRanks;

// My inbox slot in peer p's inbox for call n (an offset in every area).
DOORBELL_DEVICE_INLINE uint64_t inbox_slot(const MoeNetArgs& a, uint64_t n, uint32_t from) {
  return a.off_inbox + ((n & 1) * kMaxRanks + from) * 8;
}

// Announces this call to peer r: one thread (for a network peer, the one that posts to r, so
// that posts to r stay in one thread's order).
DOORBELL_DEVICE_INLINE void announce_to(const MoeNetArgs& a, uint32_t r) {
  if (a.call_word == 0) return;
  uint64_t* own = reinterpret_cast<uint64_t*>(a.area + a.off_inbox);
  const uint64_t n = own[kInboxAnnounced + r];
  if (a.peer_area[r] != 0) {
    store_relaxed_sys(reinterpret_cast<uint64_t*>(a.peer_area[r] + inbox_slot(a, n, a.rank)), a.call_word);
  } else {
    // Every announcing thread stages the same word; the put reads it after this store.
    const uint64_t word = a.stage_words + 8 * (n & 3);
    *reinterpret_cast<volatile uint64_t*>(a.stage + word) = a.call_word;
    __threadfence_system();
    channel(a, r).put(inbox_slot(a, n, a.rank), word, 8);
  }
  own[kInboxAnnounced + r] = n + 1;
}

// Announces this call to every NVLink peer: block 0's threads (every thread of every block may
// call it).
DOORBELL_DEVICE_INLINE void announce_nvlink(const MoeNetArgs& a) {
  if (a.call_word == 0 || blockIdx.x != 0) return;
  for (uint32_t p = threadIdx.x; p < a.world; p += blockDim.x) {
    if (p != a.rank && a.peer_area[p] != 0) announce_to(a, p);
  }
}

// Waits (bounded) for peer p's word of this call and compares it with mine; a difference is
// reported as a mismatch (the communicator aborts). One thread per peer.
DOORBELL_DEVICE_INLINE void check_peer(const MoeNetArgs& a, uint32_t p) {
  if (a.call_word == 0 || p == a.rank) return;
  uint64_t* own = reinterpret_cast<uint64_t*>(a.area + a.off_inbox);
  const uint64_t n = own[kInboxChecked + p];
  own[kInboxChecked + p] = n + 1;
  const uint64_t* slot = own + (n & 1) * kMaxRanks + p;
  uint64_t theirs = 0;
  spin_until(a.sites[p], kWaitArgMismatch, a.call_word, [&](uint64_t& seen) {
    seen = load_relaxed_sys(slot);
    theirs = seen;
    return call_key(seen) == call_key(a.call_word);
  });
  if (call_key(theirs) == call_key(a.call_word) && theirs != a.call_word) {
    report_mismatch(a.sites[p], static_cast<int32_t>(p), a.call_word, theirs);
  }
}

// The check against every peer, by the checker threads (the last block's last `world` threads).
// Every thread of every block calls it.
DOORBELL_DEVICE_INLINE void check_call(const MoeNetArgs& a) {
  if (a.call_word == 0 || blockIdx.x != gridDim.x - 1 || threadIdx.x + a.world < blockDim.x) return;
  check_peer(a, threadIdx.x + a.world - blockDim.x);
}

// A message header: [0] the source token, [1] 1 if the row is e4m3, [2..4) the dispatch epoch
// (u64), then topk expert ids (i32) and topk weights (f32); header_bytes rounds it up to 16.
constexpr uint32_t kHeaderIds = 4;

// The epoch of the dispatch being sent: one past the last one finished (finish_send stores it).
DOORBELL_DEVICE_INLINE uint64_t send_epoch(const MoeNetArgs& a) { return a.epochs[0] + 1; }

// Bytes of a row as it moves: hidden bf16, or hidden e4m3.
DOORBELL_DEVICE_INLINE uint32_t row_bytes(const MoeNetArgs& a) { return a.fp8 ? a.hidden : a.hidden * 2; }

// Bytes of a message that carry something: the header, the row, the scales (16-byte multiple).
DOORBELL_DEVICE_INLINE uint32_t used_bytes(const MoeNetArgs& a) {
  const uint32_t scales = a.fp8 ? a.hidden / 128 * 4 : 0;
  return (a.header_bytes + row_bytes(a) + scales + 15) & ~15u;
}

// Where message j of `src` sits in an area (half `half`).
DOORBELL_DEVICE_INLINE uint64_t wire_offset(const MoeNetArgs& a, uint32_t half, uint32_t src, uint32_t j) {
  return ((uint64_t(half) * a.world + src) * a.max_tokens + j) * a.msg_bytes;
}

// Row `i` of local expert `le` from `src` in half `half` of the results.
DOORBELL_DEVICE_INLINE uint64_t row_index(const MoeNetArgs& a, uint32_t half, uint32_t le, uint32_t src, uint32_t i) {
  return ((uint64_t(half) * a.experts_per_rank + le) * a.world + src) * a.max_tokens + i;
}

// The entry of `rec` for selection k of message j from `src`.
DOORBELL_DEVICE_INLINE int32_t* rec_entry(const MoeNetArgs& a, uint32_t half, uint32_t src, uint32_t j, uint32_t k) {
  return a.rec + ((uint64_t(half) * a.world + src) * a.max_tokens + j) * a.topk + k;
}

// Where token t's message of half `half` sits in the staging area.
DOORBELL_DEVICE_INLINE uint64_t stage_offset(const MoeNetArgs& a, uint32_t half, uint32_t t) {
  return (uint64_t(half) * a.max_tokens + t) * a.msg_bytes;
}

// What one lane of a warp puts in token t's message header: top-k entry `lane`'s expert id and
// weight (zeros past top-k). Loaded apart from the store so a caller can issue these loads beside
// others before its first store.
struct HeaderLane {
  int32_t id;
  float weight;
};

DOORBELL_DEVICE_INLINE HeaderLane load_header_lane(const MoeNetArgs& a, uint32_t t, uint32_t lane) {
  HeaderLane v{0, 0.0f};
  if (lane < a.topk) {
    // No ids (a dispatch routed by ranks writes its own header words) travel as -1.
    v.id = a.topk_idx != nullptr ? a.topk_idx[uint64_t(t) * a.topk + lane] : -1;
    // No weights (DeepEP's layout: the combine takes them) travel as zeros.
    v.weight = a.topk_weights != nullptr ? a.topk_weights[uint64_t(t) * a.topk + lane] : 0.0f;
  }
  return v;
}

// Stores the header of token t's message at `m`: the token, the row format (the receive half
// learns it here), the dispatch `epoch`, then the top-k ids and weights (each lane its `v`). One
// warp.
DOORBELL_DEVICE_INLINE void store_message_header(const MoeNetArgs& a, char* m, uint32_t t, uint64_t epoch,
                                                 HeaderLane v, uint32_t lane) {
  int32_t* h = reinterpret_cast<int32_t*>(m);
  if (lane == 0) {
    h[0] = int32_t(t);
    h[1] = int32_t(a.fp8);
    reinterpret_cast<uint64_t*>(h)[1] = epoch;
  }
  if (lane < a.topk) {
    h[kHeaderIds + lane] = v.id;
    reinterpret_cast<float*>(h)[kHeaderIds + a.topk + lane] = v.weight;
  }
}

// The header of token t's message at `m` (see write_message). One warp.
DOORBELL_DEVICE_INLINE void write_message_header(const MoeNetArgs& a, char* m, uint32_t t, uint32_t lane) {
  store_message_header(a, m, t, send_epoch(a), load_header_lane(a, t, lane), lane);
}

// Writes token t's message at `m` (any memory this GPU reaches: the staging area, or a same-node
// peer's slot): the header (token, row format, dispatch epoch, its top-k ids and weights), the
// row (`row`: hidden bf16 or e4m3, 16-byte aligned, any memory) and with fp8 its scales. One
// warp, every lane with its lane id.
DOORBELL_DEVICE_INLINE void write_message(const MoeNetArgs& a, char* m, uint32_t t, const void* row,
                                          const float* scales, uint32_t lane) {
  write_message_header(a, m, t, lane);
  char* p = m + a.header_bytes;
  copy_words_batched<int4, 8>(reinterpret_cast<int4*>(p), static_cast<const int4*>(row), row_bytes(a) / 16, lane, 32);
  if (a.fp8) {
    float* s = reinterpret_cast<float*>(p + row_bytes(a));
    for (uint32_t i = lane; i < a.hidden / 128; i += 32) s[i] = scales[i];
  }
}

// Builds token t's message in the staging area (the half of the epoch being sent). One warp.
DOORBELL_DEVICE_INLINE void stage_token(const MoeNetArgs& a, uint32_t t, const void* row, const float* scales,
                                        uint32_t lane) {
  write_message(a, a.stage + stage_offset(a, uint32_t(send_epoch(a) & 1), t), t, row, scales, lane);
}

// Sends token t's staged message to rank r: NVLink stores into my next message slot there when
// its area is mapped here; else the slot and token go on r's list, which finish_send posts. One
// warp.
DOORBELL_DEVICE_INLINE void send_to(const MoeNetArgs& a, uint32_t t, uint32_t r, uint32_t lane) {
  const uint32_t half = uint32_t(send_epoch(a) & 1);
  uint32_t j = 0;
  if (lane == 0) j = atomicAdd(&a.fill[r], 1u);
  j = __shfl_sync(0xffffffffu, j, 0);
  const uint64_t mapped = a.peer_area[r];
  if (mapped != 0) {
    const char* msg = a.stage + stage_offset(a, half, t);
    copy_words_batched<int4, 8>(reinterpret_cast<int4*>(mapped + wire_offset(a, half, a.rank, j)),
                                reinterpret_cast<const int4*>(msg), used_bytes(a) / 16, lane, 32);
  } else if (lane == 0 && j < a.max_tokens) {
    a.list[uint64_t(r) * a.max_tokens + j] = t;
  }
}

// Sends token t (row and, with fp8, scales as for stage_token) to every rank holding one of its
// experts, once per rank. One warp, every lane with its lane id; each token of the call exactly
// once (finish_send's counts cover what was put before it).
DOORBELL_DEVICE_INLINE void put_token(const MoeNetArgs& a, uint32_t t, const void* row, const float* scales,
                                      uint32_t lane) {
  stage_token(a, t, row, scales, lane);
  __syncwarp();
  int32_t r_of = -1;
  if (lane < a.topk) {
    const int32_t e = a.topk_idx[uint64_t(t) * a.topk + lane];
    if (e >= int32_t(a.experts_per_rank * a.world)) {
      report_failure(a.sites[a.rank], kWaitBadInput, a.experts_per_rank * a.world, uint64_t(e), 0);
    } else if (e >= 0) {
      r_of = e / int32_t(a.experts_per_rank);
    }
  }
  for (uint32_t k = 0; k < a.topk; ++k) {
    const int32_t r = __shfl_sync(0xffffffffu, r_of, k);
    if (r < 0) continue;
    const uint32_t same = __ballot_sync(0xffffffffu, r_of == r);
    if (uint32_t(__ffs(same)) - 1 != k) continue;  // the rank's first selection sends
    send_to(a, t, uint32_t(r), lane);
  }
  __syncwarp();
}

// Posts rank r's listed messages of this call (`n` of them, half `half`, listed in a.list) as one
// batch, followed by the count `word` and the signal. One warp.
DOORBELL_DEVICE_INLINE void post_messages(const MoeNetArgs& a, uint32_t r, uint32_t half, uint32_t n, uint64_t word,
                                          uint32_t lane) {
  const PortChannelHandle& c = channel(a, r);
  const uint64_t count_src = a.stage_counts + (uint64_t(half) * a.world + r) * 8;
  const uint64_t count_dst = a.off_counts + (uint64_t(half) * a.world + a.rank) * 8;
  if (lane == 0) *reinterpret_cast<volatile uint64_t*>(a.stage + count_src) = word;
  __syncwarp();
  const uint32_t* list = a.list + uint64_t(r) * a.max_tokens;
  c.put_rows_warp(
      n,
      [&](uint32_t i) {
        const uint32_t t = reinterpret_cast<const volatile uint32_t*>(list)[i];
        return make_ulonglong2(wire_offset(a, half, a.rank, i), stage_offset(a, half, t));
      },
      used_bytes(a), count_dst, count_src, 8, true, lane);
}

// Every block of the sending grid calls this once, with all its threads, after its puts. The
// last block to arrive publishes the counts and posts the network peers' messages (see the top
// of this file), then stores the epoch.
DOORBELL_DEVICE_INLINE void finish_send(const MoeNetArgs& a) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's NVLink stores and staged messages before its arrival
    last = atomicAdd(&a.done[0], 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const uint64_t epoch = send_epoch(a);
  const uint32_t half = uint32_t(epoch & 1);
  const uint32_t lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (uint32_t r = threadIdx.x / 32; r < a.world; r += warps) {
    uint32_t n = 0;
    if (lane == 0) n = atomicExch(&a.fill[r], 0u);
    n = __shfl_sync(0xffffffffu, n, 0);
    n = n < a.max_tokens ? n : a.max_tokens;  // more is impossible: each token sends once per rank
    const uint64_t word = epoch << 32 | n;
    if (lane == 0 && r != a.rank) announce_to(a, r);  // the call check (a fused send runs no moe_net_dispatch_send)
    __syncwarp();
    if (a.peer_area[r] != 0) {
      if (lane == 0) {
        __threadfence_system();
        store_relaxed_sys(reinterpret_cast<uint64_t*>(a.peer_area[r] + a.off_counts +
                                                      (uint64_t(half) * a.world + a.rank) * 8),
                          word);
      }
    } else {
      post_messages(a, r, half, n, word, lane);
      if (a.probe != nullptr && lane == 0) {
        atomicMax(reinterpret_cast<unsigned long long*>(&a.probe[1]), static_cast<unsigned long long>(global_timer_ns()));
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a.epochs[0] = epoch;
    a.done[0] = 0;
    if (a.probe != nullptr) {
      atomicMax(reinterpret_cast<unsigned long long*>(&a.probe[2]), static_cast<unsigned long long>(global_timer_ns()));
    }
  }
}

// Waits (bounded) for the next signal from `src` over its PortChannel; false if the wait left.
DOORBELL_DEVICE_INLINE bool wait_signal(const MoeNetArgs& a, uint32_t src) {
  const PortChannelHandle& c = channel(a, src);
  const uint64_t expected = fetch_add_relaxed_gpu(c.expected_inbound, 1) + 1;
  uint32_t polls = 0;
  spin_until(a.sites[src], kWaitSemaphore, expected, [&](uint64_t& seen) {
    seen = load_acquire_sys(c.inbound_token);
    return seen >= expected || c.proxy_stopped(polls);
  });
  const uint64_t seen = load_acquire_sys(c.inbound_token);
  if (seen >= expected) return true;
  if (load_acquire_sys(c.fifo.stopped) != 0) report_failure(a.sites[src], kWaitProxyStopped, expected, seen, 0);
  return false;
}

// The number of messages `src` sent here in dispatch `epoch` (0 if the wait left). One thread.
DOORBELL_DEVICE_INLINE uint32_t wait_count(const MoeNetArgs& a, uint64_t epoch, uint32_t src) {
  const uint32_t half = uint32_t(epoch & 1);
  const uint64_t* word = reinterpret_cast<const uint64_t*>(a.area + a.off_counts) + uint64_t(half) * a.world + src;
  if (a.peer_area[src] == 0 && !wait_signal(a, src)) return 0;
  uint64_t got = 0;
  // Over the network the word is in before the signal: this wait ends at its first poll unless
  // the data path lost the order (then it reports).
  if (!spin_until(a.sites[src], kWaitPacket, epoch, [&](uint64_t& seen) {
        got = load_acquire_sys(word);
        seen = got >> 32;
        return seen == epoch;
      })) {
    return 0;
  }
  const uint32_t n = uint32_t(got);
  if (n > a.max_tokens) {
    report_failure(a.sites[src], kWaitBadInput, a.max_tokens, n, 0);
    return 0;
  }
  return n;
}

// Copies message j from `src` (half `half`, arrived) into the result rows of the experts here
// that its token selected, with their source token and weight, and lists those rows in `rec`
// for the combine. One warp.
DOORBELL_DEVICE_INLINE void unpack(const MoeNetArgs& a, uint32_t half, uint32_t src, uint32_t j, uint32_t lane) {
  const char* m = a.area + wire_offset(a, half, src, j);
  const int32_t* h = reinterpret_cast<const int32_t*>(m);
  const int32_t t = h[0];
  const bool fp8 = h[1] != 0;
  int32_t e = -1;
  float w = 0;
  if (lane < a.topk) {
    e = h[kHeaderIds + lane];
    w = reinterpret_cast<const float*>(h)[kHeaderIds + a.topk + lane];
  }
  int32_t row = -1;
  if (e >= 0 && uint32_t(e) / a.experts_per_rank == a.rank) {
    const uint32_t le = uint32_t(e) % a.experts_per_rank;
    const uint32_t i = atomicAdd(&a.fill[a.world + le * a.world + src], 1u);
    // More rows for one expert than tokens per rank: the token listed that expert twice.
    if (i >= a.max_tokens || t < 0 || uint32_t(t) >= a.max_tokens) {
      report_failure(a.sites[src], kWaitBadInput, a.max_tokens, i, 0);
    } else {
      row = int32_t(row_index(a, half, le, src, i));
      a.recv_src[row] = t;
      a.recv_weights[row] = w;
    }
  }
  if (lane < a.topk) *rec_entry(a, half, src, j, lane) = row;
  const uint32_t mask = __ballot_sync(0xffffffffu, row >= 0);
  if (mask == 0) return;
  // Rows of the half at its start, each `bytes` long (a half holds room for bf16 rows).
  const uint32_t bytes = fp8 ? a.hidden : a.hidden * 2;
  const uint64_t rows = uint64_t(a.experts_per_rank) * a.world * a.max_tokens;
  const int4* from = reinterpret_cast<const int4*>(m + a.header_bytes);
  char* to = reinterpret_cast<char*>(a.recv_x) + uint64_t(half) * rows * a.hidden * 2;
  const uint32_t words = bytes / 16;
  constexpr uint32_t kUnroll = 4;
  for (uint32_t base = 0; base < words; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint32_t c = base + lane + u * 32;
      if (c < words) v[u] = from[c];
    }
    for (uint32_t bits = mask; bits != 0; bits &= bits - 1) {
      const uint64_t r = uint32_t(__shfl_sync(0xffffffffu, row, __ffs(bits) - 1)) % rows;
      int4* dst = reinterpret_cast<int4*>(to + r * bytes);
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t c = base + lane + u * 32;
        if (c < words) dst[c] = v[u];
      }
    }
  }
  if (fp8) {
    const uint32_t n = a.hidden / 128;
    const float* s = reinterpret_cast<const float*>(m + a.header_bytes + bytes);
    for (uint32_t bits = mask; bits != 0; bits &= bits - 1) {
      const uint64_t r = uint32_t(__shfl_sync(0xffffffffu, row, __ffs(bits) - 1));
      for (uint32_t i = lane; i < n; i += 32) a.recv_scales[r * n + i] = s[i];
    }
  }
}

// Combine send for message j from `src` (the last dispatch's half): the sum over its token's
// selections here of weight x expert output (the combine buffer's row at the result row's
// place), f32 in top-k order, rounded to bf16, into `src`'s partial row for (this rank, token):
// NVLink stores, or staged and put. One warp.
DOORBELL_DEVICE_INLINE void send_partial(const MoeNetArgs& a, uint32_t half, uint32_t src, uint32_t j, uint32_t lane) {
  const uint32_t t = uint32_t(reinterpret_cast<const int32_t*>(a.area + wire_offset(a, half, src, j))[0]);
  int32_t my_row = -1;
  float my_weight = 0;
  if (lane < a.topk) {
    my_row = *rec_entry(a, half, src, j, lane);
    if (my_row >= 0) my_weight = a.recv_weights[my_row];
  }
  const uint32_t mask = __ballot_sync(0xffffffffu, my_row >= 0);
  if (mask == 0 || t >= a.max_tokens) return;
  const uint64_t rows = uint64_t(a.experts_per_rank) * a.world * a.max_tokens;
  const uint32_t words = a.hidden / 8;
  const uint64_t part_row = (uint64_t(a.rank) * a.max_tokens + t) * words;
  const uint64_t stage_row = (uint64_t(src) * a.max_tokens + t) * words;
  const uint64_t mapped = a.peer_area[src];
  int4* dst = mapped != 0 ? reinterpret_cast<int4*>(mapped + a.off_part) + part_row
                          : reinterpret_cast<int4*>(a.stage + a.stage_part) + stage_row;
  const int4* y = reinterpret_cast<const int4*>(a.y);
  constexpr uint32_t kUnroll = 8;
  for (uint32_t base = 0; base < words; base += 32 * kUnroll) {  // uniform: the shuffles need every lane
    float acc[kUnroll][8] = {};
    for (uint32_t bits = mask; bits != 0; bits &= bits - 1) {
      const uint32_t k = __ffs(bits) - 1;
      const float w = __shfl_sync(0xffffffffu, my_weight, k);
      const uint64_t yrow = uint64_t(uint32_t(__shfl_sync(0xffffffffu, my_row, k))) % rows;
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
  if (mapped == 0) {
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      channel(a, src).put(a.off_part + part_row * 16, a.stage_part + stage_row * 16, uint64_t(words) * 16);
    }
  }
}

// Combine: 16 bytes (eight values, chunk c) of token t's output: the partial rows of the ranks its
// selections went to, added in f32 in rank order. Every peer's partial rows must have arrived.
DOORBELL_DEVICE_INLINE void combine_chunk(const MoeNetArgs& a, uint32_t t, uint32_t c) {
  const uint32_t words = a.hidden / 8;
  uint64_t ranks = 0;
  for (uint32_t k = 0; k < a.topk; ++k) {
    const int32_t e = a.topk_idx[uint64_t(t) * a.topk + k];
    if (e >= 0 && uint32_t(e) < a.experts_per_rank * a.world) ranks |= uint64_t(1) << (uint32_t(e) / a.experts_per_rank);
  }
  const int4* part = reinterpret_cast<const int4*>(a.area + a.off_part);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint32_t r = 0; r < a.world; ++r) {
    if (!(ranks >> r & 1)) continue;
    const int4 v = part[(uint64_t(r) * a.max_tokens + t) * words + c];
    add_bf16x8(acc, v);
  }
  reinterpret_cast<int4*>(a.out)[uint64_t(t) * words + c] = to_bf16x8(acc);
}

}  // namespace moe_net
}  // namespace doorbell
#endif  // DOORBELL_CUDA
