// Kernels behind the PortChannel tests and examples/portchannel: every PortChannel operation
// between ranks, the FIFO round trip, and put bandwidth through the proxy's copy engines.
#include <doorbell/doorbell.cuh>

using namespace doorbell;

// Every rank sends its outbox slot for peer p (bytes at src_skew) to p's inbox slot for it,
// one thread per peer, with the operation `mode` selects, then consumes the peer's signal:
//   0: put + signal (two triggers) + flush
//   1: put_with_signal + flush
//   2: put_with_signal_and_flush
//   3: put_with_signal, then poll() for the peer's signal (falling back to the bounded wait())
// Buffer layout as in selftest.cu: [outbox: world slots][inbox: world slots].
extern "C" __global__ void port_exchange(const PortChannelHandle* channels, uint32_t rank, uint32_t world,
                                         uint64_t slot, uint64_t bytes, uint64_t src_skew, uint64_t dst_skew,
                                         uint32_t mode) {
  const uint32_t i = threadIdx.x;
  if (i >= world - 1) return;
  const uint32_t peer = i < rank ? i : i + 1;
  const PortChannelHandle& ch = channels[i];
  const uint64_t dst = uint64_t(world) * slot + rank * slot + dst_skew;
  const uint64_t src = peer * slot + src_skew;
  switch (mode) {
    case 0:
      ch.put(dst, src, bytes);
      ch.signal();
      ch.flush();
      ch.wait();
      break;
    case 1:
      ch.put_with_signal(dst, src, bytes);
      ch.flush();
      ch.wait();
      break;
    case 2:
      ch.put_with_signal_and_flush(dst, src, bytes);
      ch.wait();
      break;
    default: {
      ch.put_with_signal(dst, src, bytes);
      bool got = false;
      for (uint32_t k = 0; k < (1u << 20) && !got; ++k) got = ch.poll();
      if (!got) ch.wait();
      ch.flush();
      break;
    }
  }
}

// FIFO round trip: push a no-op trigger and wait until the proxy took it, `iters` times.
extern "C" __global__ void port_fifo_roundtrip(PortChannelHandle ch, uint32_t iters) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (uint32_t i = 0; i < iters; ++i) ch.wait_consumed(ch.fifo.push(0, 0, 0, 0, 0, 0, 0));
}

// One thread puts my [0, bytes) to the peer's [dst_base, dst_base + bytes) in `chunk`-byte
// triggers, signalling with the last one.
extern "C" __global__ void port_put(PortChannelHandle ch, uint64_t bytes, uint64_t chunk, uint64_t dst_base) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (uint64_t off = 0; off < bytes; off += chunk) {
    const uint64_t n = bytes - off < chunk ? bytes - off : chunk;
    if (off + n >= bytes) {
      ch.put_with_signal(dst_base + off, off, n);
    } else {
      ch.put(dst_base + off, off, n);
    }
  }
}

// Waits for `count` signals, then (if `ack`) signals back once.
extern "C" __global__ void port_drain(PortChannelHandle ch, uint64_t count, uint32_t ack) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  ch.wait(count);
  if (ack) ch.signal();
}

// Waits for a signal nobody sends (the proxy is stopped meanwhile): must give up with a report.
extern "C" __global__ void port_wait_forever(PortChannelHandle ch) {
  if (threadIdx.x == 0 && blockIdx.x == 0) ch.wait();
}

// Many pushers across many laps: every thread of the grid signals `per_thread` times.
extern "C" __global__ void port_signal_storm(PortChannelHandle ch, uint32_t per_thread) {
  for (uint32_t i = 0; i < per_thread; ++i) ch.signal();
}

// Consumes exactly `count` signals, then reports in `extra` whether one more had arrived.
extern "C" __global__ void port_count_signals(PortChannelHandle ch, uint64_t count, uint32_t* extra) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  ch.wait(count);
  *extra = ch.poll() ? 1u : 0u;
}

// The FIFO round trip split in two with %globaltimer: the push (claim, fence, two 16-byte stores
// to pinned host memory) and the wait until the proxy's tail passes it. `fenced` = 0 writes the
// slot without the system-scope fence (a no-op trigger orders no data), to price the fence.
// out[0] = total push ns, out[1] = total wait ns.
extern "C" __global__ void port_fifo_roundtrip_split(PortChannelHandle ch, uint32_t iters, uint32_t fenced,
                                                     unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const FifoHandle& f = ch.fifo;
  uint64_t push_ns = 0, wait_ns = 0;
  for (uint32_t i = 0; i < iters; ++i) {
    const uint64_t t0 = global_timer_ns();
    uint64_t pos;
    if (fenced) {
      pos = f.push(0, 0, 0, 0, 0, 0, 0);
    } else {
      pos = fetch_add_relaxed_gpu(f.head, 1);  // never full here: one trigger in flight
      ProxyTrigger* slot = f.triggers + (pos & ((uint64_t(1) << f.size_log2) - 1));
      const uint64_t parity = ((pos >> f.size_log2) & 1) ^ 1;
      store_relaxed_sys_v2(&slot->src_offset, 0, parity << 63);
      store_relaxed_sys_v2(&slot->size, 0, parity << 63);
    }
    const uint64_t t1 = global_timer_ns();
    ch.wait_consumed(pos);
    const uint64_t t2 = global_timer_ns();
    push_ns += t1 - t0;
    wait_ns += t2 - t1;
  }
  out[0] = push_ns;
  out[1] = wait_ns;
  // The unfenced pushes above bypassed FifoHandle::push, which keeps tail_cache fresh; refresh it
  // so later pushers do not wait on a stale cache (FIFO liveness assumes every position was
  // claimed through push()).
  atomicMax(reinterpret_cast<unsigned long long*>(f.tail_cache),
            static_cast<unsigned long long>(load_relaxed_sys(f.tail)));
}
