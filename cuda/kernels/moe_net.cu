// MoE dispatch and combine for decode across nodes (DeepEP's low-latency semantics over any mix of
// NVLink and RDMA peers); protocol and device calls in doorbell/moe_net.cuh, layouts in
// collective_args.cuh (MoeNetArgs).
//
// dispatch send (moe_net_send): a warp per token stages its message and sends it to each rank
// holding one of its experts (moe_net::put_token); the last block publishes the counts.
// dispatch receive (moe_net_recv): block 0 waits for every source's count (over the network: its
// signal, then the word), publishes them to the grid, and every warp unpacks messages into the
// per-expert result rows; the last block writes the rows per (expert, source) and per expert.
// combine send (moe_net_combine_send): a warp per received message sends its token's partial row
// back; the last block tells every source its partial rows are in (NVLink: a word after a system
// fence; network: a signal after the puts, then a flush).
// combine receive (moe_net_combine_recv): block 0 waits for every peer, then every thread adds
// 16 bytes of a token's partial rows (moe_net::combine_chunk).
// Every kernel's grid is at most one block per SM; only block 0 waits for peers, the others wait
// for block 0, so the kernels make progress even when not all blocks are resident.
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

// Block 0 waits (bounded) for every source's words of `epoch` (`wait_one(src)` returns the count
// and stores it), then publishes `epoch` in `ready`; every block then reads the counts `read(src)`.
// Returns the counts by source.
template <typename WaitOne, typename Read>
__device__ void gather_counts(const MoeNetArgs& a, uint64_t epoch, uint64_t* ready, WaitOne wait_one, Read read,
                              Counts& c) {
  if (blockIdx.x == 0) {
    for (uint32_t src = threadIdx.x; src < a.world; src += blockDim.x) wait_one(src);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      *reinterpret_cast<volatile uint64_t*>(ready) = epoch;
    }
  } else if (threadIdx.x == 0) {
    spin_until(a.sites[a.rank], kWaitPacket, epoch, [&](uint64_t& seen) {
      seen = load_acquire_sys(ready);
      return seen == epoch;
    });
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (uint32_t src = 0; src < a.world; ++src) {
      c.n[src] = read(src);
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

}  // namespace

extern "C" __global__ void __launch_bounds__(512) moe_net_send(MoeNetArgs a) {
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const uint32_t scales = a.hidden / 128;
  for (uint32_t t = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp; t < a.num_tokens; t += warps) {
    moe_net::put_token(a, t, a.x + uint64_t(t) * moe_net::row_bytes(a),
                       a.fp8 ? a.scales + uint64_t(t) * scales : nullptr, lane);
  }
  moe_net::finish_send(a);
}

extern "C" __global__ void __launch_bounds__(512) moe_net_recv(MoeNetArgs a) {
  const uint64_t epoch = a.epochs[0];
  const uint32_t half = uint32_t(epoch & 1);
  __shared__ Counts counts;
  gather_counts(
      a, epoch, &a.epochs[2],
      [&](uint32_t src) { a.msgs[half * a.world + src] = moe_net::wait_count(a, epoch, src); },
      [&](uint32_t src) { return *reinterpret_cast<volatile uint32_t*>(&a.msgs[half * a.world + src]); }, counts);
  const uint32_t lane = threadIdx.x % kWarp;
  for_each_message(a, counts, [&](uint32_t src, uint32_t j) { moe_net::unpack(a, half, src, j, lane); });
  if (!last_block(&a.done[1])) return;
  uint32_t* rows = a.fill + a.world;
  const uint32_t pairs = a.experts_per_rank * a.world;
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) a.layout[q] = atomicAdd(&rows[q], 0u);
  __syncthreads();
  for (uint32_t le = threadIdx.x; le < a.experts_per_rank; le += blockDim.x) {
    uint32_t n = 0;
    for (uint32_t src = 0; src < a.world; ++src) n += a.layout[le * a.world + src];
    a.recv_count[le] = n;
  }
  for (uint32_t q = threadIdx.x; q < pairs; q += blockDim.x) rows[q] = 0;
}

extern "C" __global__ void __launch_bounds__(512) moe_net_combine_send(MoeNetArgs a) {
  const uint64_t epoch = a.epochs[0];
  const uint32_t half = uint32_t(epoch & 1);
  const uint64_t call = a.epochs[1] + 1;
  __shared__ Counts counts;
  if (threadIdx.x == 0) {
    uint32_t total = 0;
    for (uint32_t src = 0; src < a.world; ++src) {
      counts.n[src] = a.msgs[half * a.world + src];
      total += counts.n[src];
    }
    counts.total = total;
  }
  __syncthreads();
  const uint32_t lane = threadIdx.x % kWarp;
  for_each_message(a, counts, [&](uint32_t src, uint32_t j) { moe_net::send_partial(a, half, src, j, lane); });
  if (!last_block(&a.done[2])) return;
  for (uint32_t src = threadIdx.x; src < a.world; src += blockDim.x) {
    if (src == a.rank) continue;
    if (a.peer_area[src] != 0) {
      __threadfence_system();
      store_relaxed_sys(reinterpret_cast<uint64_t*>(a.peer_area[src] + a.off_cdone) + a.rank, call);
    } else {
      const PortChannelHandle& c = moe_net::channel(a, src);
      c.signal();
      c.flush();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) a.epochs[1] = call;
}

extern "C" __global__ void __launch_bounds__(512) moe_net_combine_recv(MoeNetArgs a) {
  const uint64_t call = a.epochs[1];
  __shared__ Counts unused;
  gather_counts(
      a, call, &a.epochs[3],
      [&](uint32_t src) {
        if (src == a.rank) return;
        if (a.peer_area[src] == 0) {
          moe_net::wait_signal(a, src);
          return;
        }
        const uint64_t* word = reinterpret_cast<const uint64_t*>(a.area + a.off_cdone) + src;
        spin_until(a.sites[src], kWaitSemaphore, call, [&](uint64_t& seen) {
          seen = load_acquire_sys(word);
          return seen >= call;
        });
      },
      [](uint32_t) { return 0u; }, unused);
  const uint32_t chunks = a.hidden / 8;
  const uint64_t items = uint64_t(a.num_tokens) * chunks;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += uint64_t(gridDim.x) * blockDim.x) {
    moe_net::combine_chunk(a, uint32_t(i / chunks), uint32_t(i % chunks));
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
