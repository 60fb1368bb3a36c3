// InfiniBand kernels: the GPU side of tests/ib.rs for now (WQE bytes built by the device API of
// doorbell/ib/ibgda.cuh, compared there with the CPU builder's).
#include <doorbell/doorbell.cuh>

using namespace doorbell;

// One WQE to build (mirrored by WqeCase in tests/ib.rs).
struct WqeCase {
  uint32_t opcode;
  uint32_t fm_ce_se;
  uint64_t idx;
  uint32_t qpn;
  uint32_t rkey;
  uint64_t raddr;
  uint64_t laddr;
  uint32_t lkey;
  uint32_t len;
  uint64_t swap_add;
  uint64_t compare;
  uint32_t imm;
  uint32_t inline_len;  // nonzero or inline_off != ~0: an inline write of these bytes
  uint64_t inline_off;  // offset in `payloads`, ~0 when not inline
};
DOORBELL_CHECK_SIZE(WqeCase, 80);

// Thread i builds case i into ring i (2^depth_log2 WQEBBs each).
extern "C" __global__ void ib_test_build_wqes(const WqeCase* cases, uint32_t n, uint8_t* rings, uint32_t depth_log2,
                                              const uint8_t* payloads) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const WqeCase c = cases[i];
  void* sq = rings + (uint64_t(i) << depth_log2) * ib::kWqebb;
  const uint8_t fm = uint8_t(c.fm_ce_se);
  if (c.inline_off != ~uint64_t(0)) {
    ib::inline_write_wqe(sq, depth_log2, c.idx, c.qpn, fm, c.raddr, c.rkey, payloads + c.inline_off, c.inline_len);
    return;
  }
  switch (c.opcode) {
    case ib::kOpWrite:
    case ib::kOpWriteImm:
    case ib::kOpRead:
      ib::rdma_wqe(sq, depth_log2, c.idx, c.qpn, uint8_t(c.opcode), fm, c.raddr, c.rkey, c.laddr, c.lkey, c.len, c.imm);
      break;
    case ib::kOpFetchAdd:
    case ib::kOpCompareSwap:
      ib::atomic_wqe(sq, depth_log2, c.idx, c.qpn, uint8_t(c.opcode), fm, c.raddr, c.rkey, c.swap_add, c.compare, c.laddr,
                     c.lkey);
      break;
    default:
      ib::nop_wqe(sq, depth_log2, c.idx, c.qpn, fm);
  }
}

// Every thread puts `per_thread` chunks of `chunk` bytes (chunk thread * per_thread + j) from src
// to dst, adds 1 to the signal word (its old value lands at result[thread]), then waits for all
// its QP's completions.
extern "C" __global__ void ib_test_puts(IbQpHandle qp, uint64_t src, uint32_t src_key, uint64_t dst, uint32_t dst_key,
                                        uint32_t chunk, uint32_t per_thread, uint64_t signal, uint32_t signal_key,
                                        uint64_t result, uint32_t result_key) {
  const uint64_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (uint32_t j = 0; j < per_thread; ++j) {
    const uint64_t off = (tid * per_thread + j) * chunk;
    qp.put(dst + off, dst_key, src + off, src_key, chunk);
  }
  qp.atomic_add(signal, signal_key, 1, result + tid * 8, result_key);
  qp.quiet();
}

// Posting rate: every thread posts `per_thread` 8-byte writes (src and dst offsets wrap inside
// 4 KiB), then waits for its QP's completions.
extern "C" __global__ void ib_test_rate(IbQpHandle qp, uint64_t src, uint32_t src_key, uint64_t dst, uint32_t dst_key,
                                        uint32_t per_thread) {
  const uint64_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (uint32_t j = 0; j < per_thread; ++j) {
    const uint64_t off = ((tid * per_thread + j) * 8) & 4095;
    qp.put(dst + off, dst_key, src + off, src_key, 8);
  }
  qp.quiet();
}

// The same with whole warps posting through put_warp (32 WQEs per doorbell).
extern "C" __global__ void ib_test_rate_warp(IbQpHandle qp, uint64_t src, uint32_t src_key, uint64_t dst,
                                             uint32_t dst_key, uint32_t per_thread) {
  const uint64_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t j = 0; j < per_thread; ++j) {
    const uint64_t off = ((tid * per_thread + j) * 8) & 4095;
    qp.put_warp(dst + off, dst_key, src + off, src_key, 8, lane);
  }
  qp.quiet();
}

// One rank's side of the ring test: every thread writes its chunks into the right neighbour's
// dst (addresses and keys as that rank registered them), optionally READs 8 bytes back (the
// flush a relaxed-ordering platform needs before a signal), then adds 1 to the neighbour's
// signal word and waits for its completions.
extern "C" __global__ void ib_test_ring(IbQpHandle qp, uint64_t src, uint32_t src_key, uint64_t dst, uint32_t dst_key,
                                        uint32_t chunk, uint32_t per_thread, uint64_t signal, uint32_t signal_key,
                                        uint64_t scratch, uint32_t scratch_key, uint32_t flush) {
  const uint64_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (uint32_t j = 0; j < per_thread; ++j) {
    const uint64_t off = (tid * per_thread + j) * chunk;
    qp.put(dst + off, dst_key, src + off, src_key, chunk);
  }
  if (flush) qp.get(dst, dst_key, scratch + tid * 16, scratch_key, 8);
  qp.atomic_add(signal, signal_key, 1, scratch + tid * 16 + 8, scratch_key);
  qp.quiet();
}

// Waits (bounded) until the local signal word reaches `expected`.
extern "C" __global__ void ib_test_wait(const uint64_t* signal, uint64_t expected, WaitSite site) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  spin_until(site, kWaitSemaphore, expected, [&](uint64_t& seen) {
    seen = load_acquire_sys(signal);
    return seen >= expected;
  });
}

// The posting cost of a low-latency MoE dispatch across nodes (issue 16's budget): warp w posts
// to qps[w] (one QP per remote rank) `rows` RDMA WRITEs of `row_bytes` (32 per reservation and
// doorbell), the last batch together with a WRITE of the rank's count block (`count_bytes`), the
// READ that flushes them and an 8-byte fetch-add flag (post_warp: no single-WQE posts; the flag's
// old value lands at flag_result + 16 w + 8). Each warp records when it
// started, when its last WQE was posted and when all had completed (globaltimer, ns) at
// times[3 w ..].
extern "C" __global__ void ib_test_dispatch_post(const IbQpHandle* qps, uint32_t nqps, uint64_t src, uint32_t src_key,
                                                 uint64_t dst, uint32_t dst_key, uint32_t rows, uint32_t row_bytes,
                                                 uint32_t count_bytes, uint64_t flag_result, uint32_t result_key,
                                                 uint64_t* times) {
  const uint32_t w = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const uint32_t lane = threadIdx.x % 32;
  if (w >= nqps) return;
  const IbQpHandle qp = qps[w];
  __syncwarp();
  const uint64_t t0 = doorbell::global_timer_ns();
  uint32_t j = 0;
  for (; j + 32 < rows; j += 32) {
    const uint64_t off = uint64_t(j + lane) * row_bytes;
    qp.put_warp(dst + off, dst_key, src + off, src_key, row_bytes, lane);
  }
  const uint64_t off = uint64_t(j + lane) * row_bytes;
  qp.post_warp(rows - j, dst + off, dst_key, src + off, src_key, row_bytes, dst, src, count_bytes, true, dst, dst_key, 1,
               flag_result + w * 16, result_key, lane);
  __syncwarp();
  const uint64_t t1 = doorbell::global_timer_ns();
  if (lane == 0) qp.quiet();
  __syncwarp();
  const uint64_t t2 = doorbell::global_timer_ns();
  if (lane == 0) {
    times[3 * w] = t0;
    times[3 * w + 1] = t1;
    times[3 * w + 2] = t2;
  }
}
