// Allreduce (sum) inside one node, over NVLink loads and stores. Three algorithms, each templated
// on the element type (bf16, f16, f32); src/host/collectives/allreduce.rs picks one by size and rank
// count and launches it on the caller's stream.
//
// Scratch: every rank owns one scratch buffer that every peer maps (`scratch[r]` is rank r's, as
// seen from this rank). It holds two regions:
//   LL region      [half 0 | half 1], each half [RS area: world slots][AG area: world slots],
//                  one slot per sending rank. Calls alternate halves by epoch parity.
//   pipeline region, one part per lane: [slot 0 | slot 1 | slot 2], each
//                  [RS: world x tile shard][AG: world x tile shard].
//
// Per-call state lives in device memory, so a captured CUDA graph replays correctly any number
// of times:
//   - LL kernels always run with the same grid (the host fixes it per communicator), so packet i
//     of any LL call is always written and read by the same block index on every rank. Each
//     block keeps its own epoch (`epochs[block]`), reads it at the start, uses flag = epoch + 1
//     for every packet and the scratch half `epoch & 1`, and advances it at the end: no atomics,
//     no grid-wide step. A rank can run at most one call ahead of a peer: every LL call has at
//     least one packet some block waits for, so a rank's kernel for call k+1 cannot end before
//     the peer's kernel k+1 started, i.e. finished call k; so no call overwrites a half a peer
//     is still reading.
//   - The pipelined kernel synchronizes with monotonic semaphores (two per lane and peer), whose
//     signal and wait counts per call are the same on every rank, so nothing needs resetting.
//
//   - The sentinel ("Lamport") two-shot carries no flags at all: its three buffers are filled with
//     all-ones bytes (a NaN in every type), writers replace that one NaN pattern by a canonical
//     quiet NaN, and readers poll each element until it is no longer all ones. Every element is
//     checked on its own, so only element-size stores need to be atomic. Call j uses buffer
//     j % 3 and each block clears, in buffer (j - 1) % 3, exactly what it consumed in call j - 1;
//     that buffer is next written in call j + 2, by peers that must first receive this rank's
//     data of call j + 1, which it sends only after this kernel (and its clearing) completed.
//
// Every block of a launch must be resident at once (blocks spin on peers' blocks): the host caps
// the grid at the number of SMs.
#include <doorbell/coll/call_check.cuh>
#include <doorbell/coll/limits.cuh>
#include <doorbell/detail/collective_args.cuh>
#include <doorbell/doorbell.cuh>

using namespace doorbell;

// This block's LL epoch for the call.
DOORBELL_DEVICE_INLINE uint32_t block_epoch(const AllReduceArgs& a) { return a.epochs[blockIdx.x]; }

// Advances this block's epoch once every thread of the block is done with the call. Epochs run
// over an even number of values so the half parity alternates across the wrap, and flag =
// epoch + 1 is never 0 (the value of untouched scratch).
DOORBELL_DEVICE_INLINE void finish_call(const AllReduceArgs& a, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) a.epochs[blockIdx.x] = epoch >= 0xFFFFFFFDu ? 0u : epoch + 1u;
}

// Packet index of this thread in LL kernels: warps are interleaved across blocks (warp w of the
// grid is warp w / gridDim of block w % gridDim), so a message of a few packets already spreads
// over many SMs, while each warp still touches 32 consecutive packets. The mapping depends only
// on the (fixed) grid, so packet i always belongs to the same block in every call.
DOORBELL_DEVICE_INLINE uint32_t ll_thread() {
  return ((threadIdx.x / 32) * gridDim.x + blockIdx.x) * 32 + (threadIdx.x % 32);
}

template <typename P>
DOORBELL_DEVICE_INLINE void wait_packet(const P* pk, uint32_t flag, uint32_t* w, WaitSite& site, uint32_t peer) {
  site.peer = static_cast<int32_t>(peer);
  if (!spin_until_packet(site, kWaitPacket, flag, [&](uint64_t& seen) { return pk->try_read(w[0], w[1], flag, seen); })) {
    w[0] = w[1] = kMissingPayload;  // NaN: the sum it enters is marked, not stale
  }
}

// One-shot: every rank pushes its whole input as packets into every peer's slot, then reduces
// all contributions in rank order. One NVLink crossing; (world - 1) x the input per GPU.
// Thread `tid` pushes exactly the packets it later reduces, so in-place calls are safe.
template <typename T, typename P>
DOORBELL_DEVICE_INLINE void oneshot(const AllReduceArgs& a) {
  constexpr int W = P::kPayload / 4;
  const uint32_t epoch = block_epoch(a);
  const uint32_t flag = epoch + 1;
  const uint64_t half = (epoch & 1) * a.ll_half_bytes;
  const uint64_t bytes = a.count * sizeof(T);
  const uint64_t npk = packets_for<P>(bytes);
  const uint32_t tid = ll_thread();
  const uint32_t nthreads = gridDim.x * blockDim.x;
  const char* in = static_cast<const char*>(a.input);
  char* out = static_cast<char*>(a.output);

  for (uint32_t k = 1; k < a.world; ++k) {
    const uint32_t p = (a.rank + k) % a.world;
    P* dst = reinterpret_cast<P*>(a.scratch[p] + a.ll_offset + half + a.rank * a.ll_slot_bytes);
    copy_to_packets(dst, in, bytes, flag, tid, nthreads);
  }
  const char* mine = a.scratch[a.rank] + a.ll_offset + half;
  WaitSite site = a.site;
  for (uint64_t i = tid; i < npk; i += nthreads) {
    const uint64_t off = i * P::kPayload;
    const uint32_t take = bytes - off < P::kPayload ? uint32_t(bytes - off) : P::kPayload;
    WordSum<T, W> acc;
    for (uint32_t r = 0; r < a.world; ++r) {
      uint32_t w[2] = {0, 0};
      if (r == a.rank) {
        load_payload(in + off, take, w[0], w[1]);
      } else {
        wait_packet(reinterpret_cast<const P*>(mine + r * a.ll_slot_bytes) + i, flag, w, site, r);
      }
      if (r == 0) acc.set(w); else acc.add(w);
    }
    uint32_t w[2] = {0, 0};
    acc.get(w);
    store_payload(out + off, take, w[0], w[1]);
  }
  finish_call(a, epoch);
}

// Two-shot with packets: reduce-scatter (each rank reduces one shard of packets), then
// all-gather of the reduced shards, in one kernel with no barrier. Two NVLink crossings;
// 2 (world - 1) / world x the input per GPU.
template <typename T, typename P>
DOORBELL_DEVICE_INLINE void twoshot(const AllReduceArgs& a) {
  constexpr int W = P::kPayload / 4;
  const uint32_t epoch = block_epoch(a);
  const uint32_t flag = epoch + 1;
  const uint64_t half = (epoch & 1) * a.ll_half_bytes;
  const uint64_t area = uint64_t(a.world) * a.ll_slot_bytes;  // RS area, then AG area
  const uint64_t bytes = a.count * sizeof(T);
  const uint64_t npk = packets_for<P>(bytes);
  const uint64_t spk = (npk + a.world - 1) / a.world;  // packets per shard
  const uint32_t tid = ll_thread();
  const uint32_t nthreads = gridDim.x * blockDim.x;
  const char* in = static_cast<const char*>(a.input);
  char* out = static_cast<char*>(a.output);
  auto shard_bytes = [&](uint32_t j) -> uint64_t {
    const uint64_t begin = j * spk * P::kPayload;
    if (begin >= bytes) return 0;
    const uint64_t end = begin + spk * P::kPayload;
    return (end < bytes ? end : bytes) - begin;
  };

  // 1. Reduce-scatter push: my part of shard p into p's RS slot for me.
  for (uint32_t k = 1; k < a.world; ++k) {
    const uint32_t p = (a.rank + k) % a.world;
    P* dst = reinterpret_cast<P*>(a.scratch[p] + a.ll_offset + half + a.rank * a.ll_slot_bytes);
    copy_to_packets(dst, in + p * spk * P::kPayload, shard_bytes(p), flag, tid, nthreads);
  }
  // 2. Reduce my shard in rank order; keep it and push it to every peer's AG slot for me.
  const char* mine = a.scratch[a.rank] + a.ll_offset + half;
  WaitSite site = a.site;
  const uint64_t my_bytes = shard_bytes(a.rank);
  const uint64_t my_packets = packets_for<P>(my_bytes);
  const uint64_t my_off = a.rank * spk * P::kPayload;
  for (uint64_t j = tid; j < my_packets; j += nthreads) {
    const uint64_t off = j * P::kPayload;
    const uint32_t take = my_bytes - off < P::kPayload ? uint32_t(my_bytes - off) : P::kPayload;
    WordSum<T, W> acc;
    for (uint32_t r = 0; r < a.world; ++r) {
      uint32_t w[2] = {0, 0};
      if (r == a.rank) {
        load_payload(in + my_off + off, take, w[0], w[1]);
      } else {
        wait_packet(reinterpret_cast<const P*>(mine + r * a.ll_slot_bytes) + j, flag, w, site, r);
      }
      if (r == 0) acc.set(w); else acc.add(w);
    }
    uint32_t w[2] = {0, 0};
    acc.get(w);
    store_payload(out + my_off + off, take, w[0], w[1]);
    for (uint32_t k = 1; k < a.world; ++k) {
      const uint32_t p = (a.rank + k) % a.world;
      P* dst = reinterpret_cast<P*>(a.scratch[p] + a.ll_offset + half + area + a.rank * a.ll_slot_bytes);
      dst[j].write(w[0], w[1], flag);
    }
  }
  // 3. All-gather: unpack every peer's reduced shard.
  for (uint32_t k = 1; k < a.world; ++k) {
    const uint32_t p = (a.rank + k) % a.world;
    site.peer = static_cast<int32_t>(p);
    const P* src = reinterpret_cast<const P*>(mine + area + p * a.ll_slot_bytes);
    copy_from_packets(out + p * spk * P::kPayload, src, shard_bytes(p), flag, tid, nthreads, site);
  }
  finish_call(a, epoch);
}

// Sentinel two-shot ---------------------------------------------------------------------------

constexpr uint32_t kEmpty = 0xFFFFFFFFu;  // an untouched 32-bit word of a sentinel buffer

// True when no element of `w` is still the sentinel.
template <typename T>
DOORBELL_DEVICE_INLINE bool all_arrived(const uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (sizeof(T) == 4 ? w[i] == kEmpty : ((w[i] & 0xFFFFu) == 0xFFFFu || (w[i] >> 16) == 0xFFFFu)) return false;
  }
  return true;
}

// Replaces elements whose bits are all ones (the sentinel) by the type's canonical quiet NaN.
template <typename T>
DOORBELL_DEVICE_INLINE void canonicalize(uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (sizeof(T) == 4) {
      if (w[i] == kEmpty) w[i] = 0x7FC00000u;
    } else {
      const uint32_t nan16 = std::is_same<T, __half>::value ? 0x7E00u : 0x7FC0u;  // f16 : bf16
      if ((w[i] & 0xFFFFu) == 0xFFFFu) w[i] = (w[i] & 0xFFFF0000u) | nan16;
      if ((w[i] >> 16) == 0xFFFFu) w[i] = (w[i] & 0xFFFFu) | (nan16 << 16);
    }
  }
}

DOORBELL_DEVICE_INLINE void load_vec(const void* p, uint32_t (&w)[4]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
}

DOORBELL_DEVICE_INLINE void store_vec(void* p, const uint32_t (&w)[4]) {
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T>
DOORBELL_DEVICE_INLINE void wait_vec(const uint32_t* p, uint32_t (&w)[4], WaitSite& site, uint32_t peer) {
  site.peer = static_cast<int32_t>(peer);
  spin_until_packet(site, kWaitPacket, kEmpty, [&](uint64_t& seen) {
    load_volatile_v4(p, w[0], w[1], w[2], w[3]);
    seen = w[0];
    return all_arrived<T>(w);
  });
}

// Two-shot over sentinel buffers: like the LL two-shot (reduce-scatter, then all-gather, one
// kernel, no barrier), with no flag bytes, so twice the payload per byte moved. Needs 16-byte
// aligned buffers and a size that is a multiple of 16 bytes (the host checks).
template <typename T>
DOORBELL_DEVICE_INLINE void twoshot_sentinel(const AllReduceArgs& a) {
  LamportState* state = a.lamport_state + blockIdx.x;
  const uint32_t call = state->call;
  const uint64_t prev_count = state->prev_count;
  const uint32_t buf = call % 3, old = (call + 2) % 3;
  const uint32_t world = a.world;
  const uint32_t tid = ll_thread();
  const uint32_t nthreads = gridDim.x * blockDim.x;
  const uint64_t slot = a.lamport_slot_bytes;
  auto area = [&](uint32_t b, uint32_t ag, uint32_t owner, uint32_t from) -> uint32_t* {
    return reinterpret_cast<uint32_t*>(a.scratch[owner] + a.lamport_offset + b * a.lamport_buf_bytes +
                                       (ag * world + from) * slot);
  };
  auto shard_vecs = [&](uint64_t nvec, uint64_t svec, uint32_t j) -> uint64_t {
    const uint64_t begin = j * svec;
    return begin >= nvec ? 0 : (begin + svec <= nvec ? svec : nvec - begin);
  };
  const uint64_t nvec = a.count * sizeof(T) / 16;
  const uint64_t svec = (nvec + world - 1) / world;
  const char* in = static_cast<const char*>(a.input);
  char* out = static_cast<char*>(a.output);
  WaitSite site = a.site;

  // 1. Reduce-scatter push: my part of shard p into p's RS slot for me.
  for (uint32_t k = 1; k < world; ++k) {
    const uint32_t p = (a.rank + k) % world;
    const uint64_t n = shard_vecs(nvec, svec, p);
    uint32_t* dst = area(buf, 0, p, a.rank);
    for (uint64_t v = tid; v < n; v += nthreads) {
      uint32_t w[4];
      load_vec(in + (p * svec + v) * 16, w);
      canonicalize<T>(w);
      store_volatile_v4(dst + v * 4, w[0], w[1], w[2], w[3]);
    }
  }
  // 2. Reduce my shard in rank order; keep it and push it to every peer's AG slot for me.
  {
    const uint64_t n = shard_vecs(nvec, svec, a.rank);
    for (uint64_t v = tid; v < n; v += nthreads) {
      WordSum<T, 4> acc;
      for (uint32_t r = 0; r < world; ++r) {
        uint32_t w[4];
        if (r == a.rank) {
          load_vec(in + (a.rank * svec + v) * 16, w);
        } else {
          wait_vec<T>(area(buf, 0, a.rank, r) + v * 4, w, site, r);
        }
        if (r == 0) acc.set(w); else acc.add(w);
      }
      uint32_t y[4];
      acc.get(y);
      canonicalize<T>(y);
      store_vec(out + (a.rank * svec + v) * 16, y);
      for (uint32_t k = 1; k < world; ++k) {
        const uint32_t p = (a.rank + k) % world;
        store_volatile_v4(area(buf, 1, p, a.rank) + v * 4, y[0], y[1], y[2], y[3]);
      }
    }
  }
  // 3. All-gather: every peer's reduced shard.
  for (uint32_t k = 1; k < world; ++k) {
    const uint32_t p = (a.rank + k) % world;
    const uint64_t n = shard_vecs(nvec, svec, p);
    const uint32_t* src = area(buf, 1, a.rank, p);
    for (uint64_t v = tid; v < n; v += nthreads) {
      uint32_t w[4];
      wait_vec<T>(src + v * 4, w, site, p);
      store_vec(out + (p * svec + v) * 16, w);
    }
  }
  // 4. Refill with the sentinel what this thread consumed in the previous call (same mapping).
  {
    const uint64_t pnvec = prev_count * sizeof(T) / 16;
    const uint64_t psvec = (pnvec + world - 1) / world;
    const uint64_t mine = shard_vecs(pnvec, psvec, a.rank);
    for (uint32_t r = 0; r < world; ++r) {
      if (r == a.rank) continue;
      uint32_t* rs = area(old, 0, a.rank, r);
      for (uint64_t v = tid; v < mine; v += nthreads) store_vec(rs + v * 4, {kEmpty, kEmpty, kEmpty, kEmpty});
      uint32_t* ag = area(old, 1, a.rank, r);
      const uint64_t theirs = shard_vecs(pnvec, psvec, r);
      for (uint64_t v = tid; v < theirs; v += nthreads) store_vec(ag + v * 4, {kEmpty, kEmpty, kEmpty, kEmpty});
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    state->call = (call + 1) % 3;
    state->prev_count = a.count;
  }
}

// Sums 16-byte vector `v` of `srcs[0..world)` (rank order) into `dst` and every `peer_dst[k]`.
template <typename T>
DOORBELL_DEVICE_INLINE void reduce_vector(const T* const* srcs, uint32_t world, uint64_t v, T* dst, T* const* peer_dst,
                                          uint32_t npeers) {
  WordSum<T, 4> acc;  // 16 bytes = 4 words
  for (uint32_t r = 0; r < world; ++r) {
    const uint4 x = reinterpret_cast<const uint4*>(srcs[r])[v];
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    if (r == 0) acc.set(w); else acc.add(w);
  }
  uint32_t w[4];
  acc.get(w);
  const uint4 y = make_uint4(w[0], w[1], w[2], w[3]);
  reinterpret_cast<uint4*>(dst)[v] = y;
  for (uint32_t k = 0; k < npeers; ++k) reinterpret_cast<uint4*>(peer_dst[k])[v] = y;
}

// Sums elements [first, n) at `srcs[0..world)` (rank order), one element per thread of a group of
// `nthreads` at a time from `first + tid`, into `dst` and every `peer_dst[k]`.
template <typename T>
DOORBELL_DEVICE_INLINE void reduce_elements(const T* const* srcs, uint32_t world, uint64_t first, uint64_t n, T* dst,
                                            T* const* peer_dst, uint32_t npeers, uint64_t tid, uint64_t nthreads) {
  for (uint64_t i = first + tid; i < n; i += nthreads) {
    float acc = 0.f;
    for (uint32_t r = 0; r < world; ++r) acc += to_f32(srcs[r][i]);
    const T y = from_f32<T>(acc);
    dst[i] = y;
    for (uint32_t k = 0; k < npeers; ++k) peer_dst[k][i] = y;
  }
}

// Sums `n` elements at `srcs[0..world)` (rank order) into `dst` and every `peer_dst[k]`, with
// threads [tid, n) of a group of `nthreads`.
template <typename T, bool kVec>
DOORBELL_DEVICE_INLINE void reduce_range_group(const T* const* srcs, uint32_t world, uint64_t n, T* dst,
                                               T* const* peer_dst, uint32_t npeers, uint32_t tid, uint32_t nthreads) {
  uint64_t done = 0;
  if (kVec) {
    const uint64_t per = 16 / sizeof(T);
    const uint64_t nvec = n / per;
    for (uint64_t v = tid; v < nvec; v += nthreads) reduce_vector(srcs, world, v, dst, peer_dst, npeers);
    done = nvec * per;
  }
  reduce_elements(srcs, world, done, n, dst, peer_dst, npeers, tid, nthreads);
}

// Slots per lane in the pipeline ring: kPipeDepth (coll/limits.cuh; see the reuse argument below).

// Pipelined reduce-scatter + all-gather for medium and large messages. The message is cut into
// tiles of world shards (`tile_elems` each); shard j of a tile is reduced by rank j. Lane (block)
// l takes tiles l, l + lanes, ...; its k-th tile uses slot k % 3 and goes through three stages:
//   1. put my part of shard p into p's RS slot for me, for every peer p;
//   2. sum shard `rank` (my input + the peers' parts, rank order); write it to my output and
//      into every peer's AG slot for me;
//   3. copy the peers' reduced shards from my AG slots to my output.
// The block is split into three warp groups that run, in iteration k, stage 1 of tile k, stage 2
// of tile k-1 and stage 3 of tile k-2 at the same time. Each iteration:
//   one thread per peer waits for that peer's rs signal of tile k-1 and ag signal of tile k-2
//   (both sent at the end of the peer's previous iteration); __syncthreads; the three groups
//   work; __syncthreads (every put of the block issued); one thread per peer signals rs for
//   tile k and ag for tile k-1.
// A wait that gives up (the communicator aborted) marks the block's outputs from then on: stage 2
// and 3 store all ones (NaN) where they would have stored a sum or a copy of slots the peer never
// filled, so a call cut short cannot pass for a result (the tiles done before stay right).
// Slot reuse needs no extra signal, with 3 slots: stage 1 of tile k writes p's RS slot after I
// waited (in iteration k-1) for p's ag signal of tile k-3, sent after p reduced tile k-3; stage
// 2 of tile k-1 writes p's AG slot after I waited for p's rs signal of tile k-1, sent at the end
// of p's iteration k-1, after its stage 3 of tile k-4, the slot's previous user. Across calls the
// same holds, because a call ends only after every peer's last signals.
template <typename T, bool kVec>
DOORBELL_DEVICE_INLINE void pipelined(const AllReduceArgs& a) {
  const uint32_t lane = blockIdx.x;
  const uint32_t lanes = gridDim.x;
  const uint32_t world = a.world;
  const uint32_t npeers = world - 1;
  const uint64_t ke = a.tile_elems;
  const uint64_t tile = ke * world;
  const uint64_t ntiles = (a.count + tile - 1) / tile;
  const uint64_t mine = lane < ntiles ? (ntiles - lane + lanes - 1) / lanes : 0;  // my tiles
  const uint64_t slot_bytes = 2 * uint64_t(world) * ke * sizeof(T);
  const SemaphoreHandle* rs_sems = a.rs_sems + uint64_t(lane) * world;
  const SemaphoreHandle* ag_sems = a.ag_sems + uint64_t(lane) * world;
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  const bool peer_thread = threadIdx.x < npeers;
  const uint32_t my_peer = (a.rank + 1 + threadIdx.x) % world;  // meaningful for peer threads

  const uint32_t warps = blockDim.x / 32;
  const uint32_t warp = threadIdx.x / 32;
  auto shard = [&](uint64_t k, uint32_t j, uint64_t& begin) -> uint64_t {
    begin = (lane + k * lanes) * tile + j * ke;
    if (begin >= a.count) return 0;
    return begin + ke <= a.count ? ke : a.count - begin;
  };
  auto rs = [&](uint64_t k, uint32_t owner, uint32_t from) -> T* {
    char* slot = a.scratch[owner] + a.pipe_offset + lane * a.pipe_lane_bytes + (k % kPipeDepth) * slot_bytes;
    return reinterpret_cast<T*>(slot) + from * ke;
  };
  auto ag = [&](uint64_t k, uint32_t owner, uint32_t from) -> T* { return rs(k, owner, from) + uint64_t(world) * ke; };

  bool cut = false;  // a wait of this block gave up: outputs from here on are marked
  for (uint64_t k = 0; k < mine + 2; ++k) {
    const bool s1 = k < mine;
    const bool s2 = k >= 1 && k - 1 < mine;
    const bool s3 = k >= 2;
    bool ok = true;
    if (peer_thread) {
      if (s2) ok = rs_sems[my_peer].wait();
      if (s3) ok = ag_sems[my_peer].wait() && ok;
    }
    // Warps go to the active stages in proportion 3 : 3 : 2 (push : reduce : copy-out); a stage
    // that runs alone (the first and last iterations, or a lane with one tile) gets them all.
    uint32_t n1 = 0, n2 = 0, n3 = 0;
    {
      const uint32_t total = (s1 ? 3 : 0) + (s2 ? 3 : 0) + (s3 ? 2 : 0);  // > 0: some stage runs
      if (s1) n1 = max(1u, warps * 3 / total);
      if (s2) n2 = max(1u, warps * 3 / total);
      // The last active stage takes the remaining warps.
      if (s3) n3 = warps - n1 - n2;
      else if (s2) n2 = warps - n1;
      else n1 = warps;
    }
    const uint32_t group = warp < n1 ? 0 : (warp < n1 + n2 ? 1 : 2);
    const uint32_t group_first = group == 0 ? 0 : (group == 1 ? n1 : n1 + n2);
    const uint32_t group_warps = group == 0 ? n1 : (group == 1 ? n2 : n3);
    const uint32_t gtid = threadIdx.x - group_first * 32;
    const uint32_t gthreads = group_warps * 32;
    cut = __syncthreads_or(!ok) || cut;
    if (cut) {  // marked: my shard of tile k-1 and the peers' shards of tile k-2
      uint64_t begin;
      if (group == 1 && s2) {
        const uint64_t n = shard(k - 1, a.rank, begin);
        mark_missing(out + begin, n * sizeof(T), gtid, gthreads);
      } else if (group == 2 && s3) {
        for (uint32_t i = 1; i < world; ++i) {
          const uint64_t n = shard(k - 2, (a.rank + i) % world, begin);
          mark_missing(out + begin, n * sizeof(T), gtid, gthreads);
        }
      }
    } else if (group == 0 && s1) {  // 1. reduce-scatter push of tile k
      for (uint32_t i = 1; i < world; ++i) {
        const uint32_t p = (a.rank + i) % world;
        uint64_t begin;
        const uint64_t n = shard(k, p, begin);
        copy(rs(k, p, a.rank), in + begin, n * sizeof(T), gtid, gthreads);
      }
    } else if (group == 1 && s2) {  // 2. reduce tile k-1, push it to every peer
      const uint64_t j = k - 1;
      uint64_t begin;
      const uint64_t n = shard(j, a.rank, begin);
      const T* srcs[kMaxRanks];
      T* peer_dst[kMaxRanks];
      for (uint32_t r = 0; r < world; ++r) srcs[r] = r == a.rank ? in + begin : rs(j, a.rank, r);
      for (uint32_t i = 0; i < npeers; ++i) peer_dst[i] = ag(j, (a.rank + 1 + i) % world, a.rank);
      reduce_range_group<T, kVec>(srcs, world, n, out + begin, peer_dst, npeers, gtid, gthreads);
    } else if (group == 2 && s3) {  // 3. all-gather copy-out of tile k-2
      const uint64_t j = k - 2;
      for (uint32_t i = 1; i < world; ++i) {
        const uint32_t p = (a.rank + i) % world;
        uint64_t begin;
        const uint64_t n = shard(j, p, begin);
        copy(out + begin, ag(j, a.rank, p), n * sizeof(T), gtid, gthreads);
      }
    }
    __syncthreads();  // every put of this iteration is issued before the signals
    // Cut short, no more signals: a peer must not take slots I did not fill for done.
    if (peer_thread && !cut) {
      if (s1) rs_sems[my_peer].signal();
      if (s2) ag_sems[my_peer].signal();
    }
  }
}

// Two-shot on registered windows: every rank's input and output are mapped by every peer (the
// caller registered them, at the same offsets on every rank), so nothing is staged. Block b of
// every rank handles the same elements; per block and peer:
//   1. a signal each way (rs semaphore of lane b): the peer's kernel runs, so its input is
//      complete and its output no longer read by the work before the call;
//   2. my shard, elements [rank * se, (rank + 1) * se): load every rank's input (peers' over
//      NVLink), sum in rank order, store into my output and every peer's (NVLink);
//   3. a signal each way (ag semaphore of lane b), after the block's stores: the peer is done
//      reading my input and writing my output, so my stream may go on; its stores to my output
//      are visible to my later work (release / acquire).
// Each element is read and written by one thread of one rank, so in place is safe. The
// semaphores are the pipeline's (balanced per call: one signal and one wait each way). A block
// whose wait gives up (the communicator aborted) stores all ones (NaN) over the whole output
// instead: a peer's input may not be this call's, and a peer's stores into my output may be
// missing, so nothing of it can pass for a result.
// Sums my shard's `nvec` vectors with a stride of `nthreads`, U vectors per thread in flight
// (every rank's loads of all U before any sum), the last round too (its loads predicated: a
// partial round done one vector at a time would put up to U NVLink round trips in a row on the
// call's critical path). kW: the rank count when known at compile time (the load arrays then
// live in registers), else 0 and one vector at a time.
template <typename T, int kW>
DOORBELL_DEVICE_INLINE void direct_vectors(const T* const* srcs, uint32_t world, uint64_t nvec, T* dst,
                                          T* const* peer_dst, uint32_t npeers, uint64_t tid, uint64_t nthreads) {
  if constexpr (kW == 0) {
    for (uint64_t v = tid; v < nvec; v += nthreads) reduce_vector(srcs, world, v, dst, peer_dst, npeers);
  } else {
    // 4 (2 x H100, 8-64 MiB, graph): 2 was 1-2% slower everywhere, 8 1.5% faster from 16 MiB
    // and 3.5% slower at 8 MiB.
    constexpr int U = 4;
    for (uint64_t v = tid; v < nvec; v += U * nthreads) {
      uint4 x[kW][U];
#pragma unroll
      for (int r = 0; r < kW; ++r) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (v + u * nthreads < nvec) x[r][u] = reinterpret_cast<const uint4*>(srcs[r])[v + u * nthreads];
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (v + u * nthreads >= nvec) continue;
        WordSum<T, 4> acc;
#pragma unroll
        for (int r = 0; r < kW; ++r) {
          const uint32_t w[4] = {x[r][u].x, x[r][u].y, x[r][u].z, x[r][u].w};
          if (r == 0) acc.set(w); else acc.add(w);
        }
        uint32_t w[4];
        acc.get(w);
        const uint4 y = make_uint4(w[0], w[1], w[2], w[3]);
        reinterpret_cast<uint4*>(dst)[v + u * nthreads] = y;
#pragma unroll
        for (int k = 0; k < kW - 1; ++k) reinterpret_cast<uint4*>(peer_dst[k])[v + u * nthreads] = y;
      }
    }
  }
}

template <typename T, bool kVec>
DOORBELL_DEVICE_INLINE void twoshot_direct(const AllReduceDirectArgs& d) {
  const AllReduceArgs& a = d.base;
  const uint32_t world = a.world;
  const SemaphoreHandle* rs_sems = a.rs_sems + uint64_t(blockIdx.x) * world;
  const SemaphoreHandle* ag_sems = a.ag_sems + uint64_t(blockIdx.x) * world;
  const bool peer_thread = threadIdx.x < world && threadIdx.x != a.rank;
  bool ok = true;
  if (peer_thread) {
    rs_sems[threadIdx.x].signal();
    ok = rs_sems[threadIdx.x].wait();
  }
  // Cut short (a peer's input may not be this call's): summed all the same, but not signalled
  // and marked below. Kept in shared memory across the sums, which leave no register to spare.
  __shared__ bool cut_short;
  const bool cut = __syncthreads_or(!ok);
  if (threadIdx.x == 0) cut_short = cut;
  constexpr uint64_t per = 16 / sizeof(T);
  const uint64_t se = ((a.count + world - 1) / world + per - 1) / per * per;  // shard elements
  const uint64_t begin = uint64_t(a.rank) * se;
  const uint64_t n = begin >= a.count ? 0 : (begin + se <= a.count ? se : a.count - begin);
  // Sources in rank order; my own peers' outputs (rank order, me skipped).
  const T* srcs[kMaxRanks];
  T* peer_dst[kMaxRanks];
  uint32_t npeers = 0;
  for (uint32_t r = 0; r < world; ++r) {
    srcs[r] = static_cast<const T*>(r == a.rank ? a.input : d.peer_input[r]) + begin;
    if (r != a.rank) peer_dst[npeers++] = static_cast<T*>(d.peer_output[r]) + begin;
  }
  T* dst = static_cast<T*>(a.output) + begin;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t nthreads = uint64_t(gridDim.x) * blockDim.x;
  uint64_t done = 0;
  if (kVec) {
    const uint64_t nvec = n / per;
    if (world == 2) {
      direct_vectors<T, 2>(srcs, world, nvec, dst, peer_dst, npeers, tid, nthreads);
    } else {
      direct_vectors<T, 0>(srcs, world, nvec, dst, peer_dst, npeers, tid, nthreads);
    }
    done = nvec * per;
  }
  reduce_elements(srcs, world, done, n, dst, peer_dst, npeers, tid, nthreads);
  __syncthreads();  // every store of the block issued before the signals
  if (peer_thread) {
    // Cut short, no signal: a peer must not take my shard of its output (not stored) for done.
    const bool stored = !cut_short;
    if (stored) ag_sems[threadIdx.x].signal();
    ok = ag_sems[threadIdx.x].wait() && stored;
  }
  if (__syncthreads_or(!ok)) mark_missing(a.output, a.count * sizeof(T), threadIdx.x, blockDim.x);
}

// Every allreduce kernel first waits for the kernel before it in the stream (launched with
// programmatic dependent launch, it may start early: core/common.cuh), then runs its body between
// the call check's announce and check (coll/call_check.cuh): a rank that makes another call (count,
// type, algorithm) is named on every rank.
// (Written out in each kernel, not through a lambda: the launch arguments stay in parameter space.)
#define DOORBELL_ALLREDUCE_KERNELS(T, NAME)                                                                          \
  extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot_ll8_##NAME(AllReduceArgs a) {                \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); oneshot<T, LL8Packet>(a); check_call(a.call, a.rank, a.world, a.site);   \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot_ll16_##NAME(AllReduceArgs a) {               \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); oneshot<T, LL16Packet>(a); check_call(a.call, a.rank, a.world, a.site);  \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_ll8_##NAME(AllReduceArgs a) {                \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); twoshot<T, LL8Packet>(a); check_call(a.call, a.rank, a.world, a.site);   \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_ll16_##NAME(AllReduceArgs a) {               \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); twoshot<T, LL16Packet>(a); check_call(a.call, a.rank, a.world, a.site);  \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_sentinel_##NAME(AllReduceArgs a) {           \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); twoshot_sentinel<T>(a); check_call(a.call, a.rank, a.world, a.site);     \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_pipelined_vec_##NAME(AllReduceArgs a) {              \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); pipelined<T, true>(a); check_call(a.call, a.rank, a.world, a.site);      \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_pipelined_scalar_##NAME(AllReduceArgs a) {           \
    wait_previous_grid();                                                                                            \
    announce_call(a.call, a.rank, a.world); pipelined<T, false>(a); check_call(a.call, a.rank, a.world, a.site);     \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_direct_vec_##NAME(AllReduceDirectArgs d) {   \
    wait_previous_grid();                                                                                            \
    announce_call(d.base.call, d.base.rank, d.base.world); twoshot_direct<T, true>(d);                               \
    check_call(d.base.call, d.base.rank, d.base.world, d.base.site);                                                 \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_direct_scalar_##NAME(AllReduceDirectArgs d) {\
    wait_previous_grid();                                                                                            \
    announce_call(d.base.call, d.base.rank, d.base.world); twoshot_direct<T, false>(d);                              \
    check_call(d.base.call, d.base.rank, d.base.world, d.base.site);                                                 \
  }

DOORBELL_ALLREDUCE_KERNELS(__nv_bfloat16, bf16)
DOORBELL_ALLREDUCE_KERNELS(__half, f16)
DOORBELL_ALLREDUCE_KERNELS(float, f32)
