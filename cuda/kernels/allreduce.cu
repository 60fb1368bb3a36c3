// Allreduce (sum) inside one node, over NVLink loads and stores. Three algorithms, each templated
// on the element type (bf16, f16, f32); src/collectives/allreduce.rs picks one by size and rank
// count and launches it on the caller's stream.
//
// Scratch: every rank owns one scratch buffer that every peer maps (`scratch[r]` is rank r's, as
// seen from this rank). It holds two regions:
//   LL region      [half 0 | half 1], each half [RS area: world slots][AG area: world slots],
//                  one slot per sending rank. Calls alternate halves by epoch parity.
//   pipeline region, one part per lane: [slot 0 | slot 1], each [RS: world x tile][AG: world x tile].
//
// Per-call state lives in device memory (`state[0]` = epoch, `state[1]` = blocks finished), so a
// captured CUDA graph replays correctly any number of times:
//   - LL kernels take flag = epoch + 1 for every packet of the call and read/write the half
//     `epoch & 1`. The last block to finish advances the epoch; the next call in the stream sees
//     it. A rank can run at most one call ahead of a peer (it needs the peer's packets of the
//     current call to finish it), so a call never overwrites a half a peer is still reading.
//   - The pipelined kernel synchronizes with monotonic semaphores (one per lane and peer), whose
//     signal and wait counts per call are the same on every rank, so nothing needs resetting.
//
// Every block of a launch must be resident at once (blocks spin on peers' blocks): the host caps
// the grid at the number of SMs.
#include <doorbell/doorbell.cuh>
#include <doorbell/collective_args.cuh>
#include <doorbell/reduce.cuh>

using namespace doorbell;

// Advances the epoch once every block of this launch is done with it.
DOORBELL_DEVICE_INLINE void finish_call(const AllReduceArgs& a) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t done = atomicAdd(&a.state[1], 1u);
    if (done == gridDim.x - 1) {
      a.state[1] = 0;
      // Epochs run over an even number of values so the half parity alternates across the wrap;
      // flag = epoch + 1 is never 0 (the value of untouched scratch).
      a.state[0] = a.state[0] >= 0xFFFFFFFDu ? 0u : a.state[0] + 1u;
    }
  }
}

template <typename P>
DOORBELL_DEVICE_INLINE void wait_packet(const P* pk, uint32_t flag, uint32_t* w, WaitSite& site, uint32_t peer) {
  site.peer = static_cast<int32_t>(peer);
  spin_until(site, kWaitPacket, flag, [&](uint64_t& seen) { return pk->try_read(w[0], w[1], flag, seen); });
}

// One-shot: every rank pushes its whole input as packets into every peer's slot, then reduces
// all contributions in rank order. One NVLink crossing; (world - 1) x the input per GPU.
// Thread `tid` pushes exactly the packets it later reduces, so in-place calls are safe.
template <typename T, typename P>
DOORBELL_DEVICE_INLINE void oneshot(const AllReduceArgs& a) {
  constexpr int W = P::kPayload / 4;
  const uint32_t epoch = a.state[0];
  const uint32_t flag = epoch + 1;
  const uint64_t half = (epoch & 1) * a.ll_half_bytes;
  const uint64_t bytes = a.count * sizeof(T);
  const uint64_t npk = packets_for<P>(bytes);
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
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
  finish_call(a);
}

// Two-shot with packets: reduce-scatter (each rank reduces one shard of packets), then
// all-gather of the reduced shards, in one kernel with no barrier. Two NVLink crossings;
// 2 (world - 1) / world x the input per GPU.
template <typename T, typename P>
DOORBELL_DEVICE_INLINE void twoshot(const AllReduceArgs& a) {
  constexpr int W = P::kPayload / 4;
  const uint32_t epoch = a.state[0];
  const uint32_t flag = epoch + 1;
  const uint64_t half = (epoch & 1) * a.ll_half_bytes;
  const uint64_t area = uint64_t(a.world) * a.ll_slot_bytes;  // RS area, then AG area
  const uint64_t bytes = a.count * sizeof(T);
  const uint64_t npk = packets_for<P>(bytes);
  const uint64_t spk = (npk + a.world - 1) / a.world;  // packets per shard
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
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
  finish_call(a);
}

// Sums `n` elements at `srcs[0..world)` (rank order) into `dst` and every `peers_dst[k]`.
template <typename T, bool kVec>
DOORBELL_DEVICE_INLINE void reduce_range(const T* const* srcs, uint32_t world, uint64_t n, T* dst, T* const* peer_dst,
                                         uint32_t npeers) {
  uint64_t done = 0;
  if (kVec) {
    constexpr int W = 4;  // 16 bytes = 4 words
    const uint64_t per = 16 / sizeof(T);
    const uint64_t nvec = n / per;
    for (uint64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      WordSum<T, W> acc;
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
    done = nvec * per;
  }
  for (uint64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    float acc = 0.f;
    for (uint32_t r = 0; r < world; ++r) acc += to_f32(srcs[r][i]);
    const T y = from_f32<T>(acc);
    dst[i] = y;
    for (uint32_t k = 0; k < npeers; ++k) peer_dst[k][i] = y;
  }
}

// Pipelined reduce-scatter + all-gather for large messages. The message is cut into tiles of
// world shards (`tile_elems` each); shard j of a tile is reduced by rank j. Lane (block) l takes
// tiles l, l + lanes, ... and for each tile:
//   1. puts my part of shard p into p's RS slot for me, for every peer p; signals each peer;
//   2. waits for every peer's signal, sums shard `rank` (my input + the peers' parts, rank
//      order), writes it to my output and into every peer's AG slot for me; signals each peer;
//   3. waits for every peer's signal and copies their reduced shards from my AG slots to my
//      output.
// Slots alternate per tile. Reuse is safe without extra signals: before I put tile t into p's
// slot, I have already waited for p's signals of tile t - 2 (p finished reading that slot), and
// p's signals of one call all precede its next call.
template <typename T, bool kVec>
DOORBELL_DEVICE_INLINE void pipelined(const AllReduceArgs& a) {
  const uint32_t lane = blockIdx.x;
  const uint32_t world = a.world;
  const uint32_t npeers = world - 1;
  const uint64_t ke = a.tile_elems;
  const uint64_t tile = ke * world;
  const uint64_t ntiles = (a.count + tile - 1) / tile;
  const uint64_t slot_bytes = 2 * uint64_t(world) * ke * sizeof(T);
  const SemaphoreHandle* sems = a.sems + uint64_t(lane) * world;
  const T* in = static_cast<const T*>(a.input);
  T* out = static_cast<T*>(a.output);
  const uint32_t peer_of_thread = (a.rank + 1 + threadIdx.x) % world;  // valid for threadIdx.x < npeers

  uint32_t iter = 0;
  for (uint64_t t = lane; t < ntiles; t += gridDim.x, ++iter) {
    const uint64_t slot = (iter & 1) * slot_bytes;
    auto shard = [&](uint32_t j, uint64_t& begin) -> uint64_t {
      begin = t * tile + j * ke;
      if (begin >= a.count) return 0;
      return begin + ke <= a.count ? ke : a.count - begin;
    };
    auto rs = [&](uint32_t owner, uint32_t from) -> T* {
      return reinterpret_cast<T*>(a.scratch[owner] + a.pipe_offset + lane * a.pipe_lane_bytes + slot) + from * ke;
    };
    auto ag = [&](uint32_t owner, uint32_t from) -> T* { return rs(owner, from) + uint64_t(world) * ke; };

    // 1. Reduce-scatter push.
    for (uint32_t k = 1; k < world; ++k) {
      const uint32_t p = (a.rank + k) % world;
      uint64_t begin;
      const uint64_t n = shard(p, begin);
      copy(rs(p, a.rank), in + begin, n * sizeof(T), threadIdx.x, blockDim.x);
    }
    __syncthreads();  // every put of this block is issued before the signals
    if (threadIdx.x < npeers) {
      sems[peer_of_thread].signal();
      sems[peer_of_thread].wait();
    }
    __syncthreads();

    // 2. Reduce my shard, keep it, push it to every peer.
    {
      uint64_t begin;
      const uint64_t n = shard(a.rank, begin);
      const T* srcs[kMaxRanks];
      T* peer_dst[kMaxRanks];
      for (uint32_t r = 0; r < world; ++r) srcs[r] = r == a.rank ? in + begin : rs(a.rank, r);
      for (uint32_t k = 0; k < npeers; ++k) peer_dst[k] = ag((a.rank + 1 + k) % world, a.rank);
      reduce_range<T, kVec>(srcs, world, n, out + begin, peer_dst, npeers);
    }
    __syncthreads();
    if (threadIdx.x < npeers) {
      sems[peer_of_thread].signal();
      sems[peer_of_thread].wait();
    }
    __syncthreads();

    // 3. All-gather: the peers' reduced shards into my output.
    for (uint32_t k = 1; k < world; ++k) {
      const uint32_t p = (a.rank + k) % world;
      uint64_t begin;
      const uint64_t n = shard(p, begin);
      copy(out + begin, ag(a.rank, p), n * sizeof(T), threadIdx.x, blockDim.x);
    }
    __syncthreads();
  }
}

#define DOORBELL_ALLREDUCE_KERNELS(T, NAME)                                                                          \
  extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot_ll8_##NAME(AllReduceArgs a) {                \
    oneshot<T, LL8Packet>(a);                                                                                        \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_oneshot_ll16_##NAME(AllReduceArgs a) {               \
    oneshot<T, LL16Packet>(a);                                                                                       \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_ll8_##NAME(AllReduceArgs a) {                \
    twoshot<T, LL8Packet>(a);                                                                                        \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(512) allreduce_twoshot_ll16_##NAME(AllReduceArgs a) {               \
    twoshot<T, LL16Packet>(a);                                                                                       \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(1024) allreduce_pipelined_vec_##NAME(AllReduceArgs a) {              \
    pipelined<T, true>(a);                                                                                           \
  }                                                                                                                  \
  extern "C" __global__ void __launch_bounds__(1024) allreduce_pipelined_scalar_##NAME(AllReduceArgs a) {           \
    pipelined<T, false>(a);                                                                                          \
  }

DOORBELL_ALLREDUCE_KERNELS(__nv_bfloat16, bf16)
DOORBELL_ALLREDUCE_KERNELS(__half, f16)
DOORBELL_ALLREDUCE_KERNELS(float, f32)
