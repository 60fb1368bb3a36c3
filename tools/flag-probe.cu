// Flag probe: what one NVLink signal+wait round trip between two GPUs costs on this machine, with
// nothing of doorbell in the way, for each way of writing and reading the flag. One process drives
// both GPUs (peer access on); one thread on each GPU; GPU 0 writes i into its peer's flag and waits
// for i back in its own, GPU 1 echoes. Variants: the write (st.release.sys, red.release.sys.add as
// doorbell's semaphore signal does, st.relaxed.sys, st.volatile) and the read (ld.acquire.sys as
// doorbell's wait, ld.relaxed.sys, ld.volatile); where the flag lives (the reader's memory, so the
// writer stores across NVLink and the reader polls its own; or the writer's, so the reader polls
// across NVLink); and doorbell's own wait loop shape (a clock read every 64 polls). The same
// orderings split apart: a fence then a relaxed store, relaxed polls then one fence.
// Build: nvcc -O2 -arch=sm_90 tools/flag-probe.cu -o flag-probe   Run: ./flag-probe [iters]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ uint64_t now_ns() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

enum Write { kStRelease, kRedRelease, kStRelaxed, kStVolatile, kFenceThenStRelaxed };
enum Read { kLdAcquire, kLdRelaxed, kLdVolatile, kLdRelaxedThenFence };

__device__ __forceinline__ void write_flag(uint64_t* p, uint64_t v, int how) {
  switch (how) {
    case kStRelease: asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory"); break;
    case kRedRelease: asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(uint64_t(1)) : "memory"); break;
    case kStRelaxed: asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory"); break;
    case kFenceThenStRelaxed:
      asm volatile("fence.acq_rel.sys;\n\tst.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
      break;
    default: asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory"); break;
  }
}

__device__ __forceinline__ uint64_t read_flag(const uint64_t* p, int how) {
  uint64_t v;
  switch (how) {
    case kLdAcquire: asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); break;
    case kLdRelaxed:
    case kLdRelaxedThenFence: asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); break;
    default: asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); break;
  }
  return v;
}

// Waits until *p >= want; `clocked` reads the global timer every 64 polls, as doorbell's bounded
// wait does.
__device__ __forceinline__ void wait_flag(const uint64_t* p, uint64_t want, int how, bool clocked, uint64_t* sink) {
  if (read_flag(p, how) >= want) {
    if (how == kLdRelaxedThenFence) asm volatile("fence.acq_rel.sys;" ::: "memory");
    return;
  }
  uint64_t t = clocked ? now_ns() : 0;
  for (uint32_t i = 1;; ++i) {
    if (read_flag(p, how) >= want) break;
    if (clocked && (i & 63) == 0) t ^= now_ns();
  }
  if (t == 1) *sink = t;  // keeps the clock reads
  if (how == kLdRelaxedThenFence) asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// `out` is the flag this GPU writes (its peer's), `in` the one it waits on. Tokens count up from
// `base` (the flags are never reset, as doorbell's semaphores).
__global__ void pingpong(uint64_t* out, const uint64_t* in, uint32_t iters, int initiator, int w, int r, int clocked,
                         uint64_t base, uint64_t* elapsed) {
  const uint64_t t0 = now_ns();
  for (uint32_t i = 1; i <= iters; ++i) {
    const uint64_t v = base + i;
    if (initiator) {
      write_flag(out, v, w);
      wait_flag(in, v, r, clocked, elapsed + 1);
    } else {
      wait_flag(in, v, r, clocked, elapsed + 1);
      write_flag(out, v, w);
    }
  }
  elapsed[0] = now_ns() - t0;
}

int main(int argc, char** argv) {
  const uint32_t iters = argc > 1 ? atoi(argv[1]) : 20000;
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) { printf("needs two GPUs (found %d)\n", n); return 1; }
  int access = 0;
  CK(cudaDeviceCanAccessPeer(&access, 0, 1));
  if (!access) { printf("GPU 0 cannot access GPU 1\n"); return 1; }
  // flags[g]: two words in GPU g's memory: [0] the flag the other GPU writes into, [1] spare.
  uint64_t* flags[2];
  uint64_t* elapsed[2];
  cudaStream_t st[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaMalloc(&flags[g], 256));
    CK(cudaMemset(flags[g], 0, 256));
    CK(cudaMalloc(&elapsed[g], 16));
    CK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
  }
  const char* wname[] = {"st.release.sys", "red.release.sys.add", "st.relaxed.sys", "st.volatile",
                         "fence.sys+st.relaxed"};
  const char* rname[] = {"ld.acquire.sys", "ld.relaxed.sys", "ld.volatile", "ld.relaxed+fence.sys"};
  printf("# round trip GPU0 -> GPU1 -> GPU0, one thread each, %u iterations, median of 5 runs\n", iters);
  printf("%-20s %-22s %-22s %-8s %10s\n", "write", "read", "flag lives", "clock", "us");
  struct Case { int w, r, remote_poll, clocked; };
  std::vector<Case> cases = {
      {kStRelease, kLdAcquire, 0, 0}, {kRedRelease, kLdAcquire, 0, 0}, {kRedRelease, kLdAcquire, 0, 1},
      {kStRelaxed, kLdRelaxed, 0, 0}, {kStVolatile, kLdVolatile, 0, 0}, {kStRelease, kLdAcquire, 1, 0},
      {kStRelaxed, kLdRelaxed, 1, 0},
      {kStRelease, kLdRelaxed, 0, 0},         {kStRelaxed, kLdAcquire, 0, 0},
      {kRedRelease, kLdRelaxedThenFence, 0, 0}, {kFenceThenStRelaxed, kLdRelaxedThenFence, 0, 0},
      {kFenceThenStRelaxed, kLdRelaxed, 0, 0},
  };
  for (const Case& c : cases) {
    std::vector<double> runs;
    for (int rep = 0; rep < 5; ++rep) {
      // Flag placement: remote_poll = 0: GPU g waits on flags[g] (its own memory) and writes
      // flags[1-g] across NVLink; 1: GPU g waits on flags[1-g] + 1 (the peer's memory, polled across
      // NVLink) and writes into its own flags[g] + 1.
      uint64_t* out[2];
      const uint64_t* in[2];
      for (int g = 0; g < 2; ++g) {
        out[g] = c.remote_poll ? flags[g] + 1 : flags[1 - g];
        in[g] = c.remote_poll ? flags[1 - g] + 1 : flags[g];
      }
      // red.add counts up by one per write: both flags must start from the same base.
      for (int g = 0; g < 2; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaMemset(flags[g], 0, 256));
      }
      for (int g = 0; g < 2; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaDeviceSynchronize());
      }
      for (int g = 1; g >= 0; --g) {
        CK(cudaSetDevice(g));
        pingpong<<<1, 1, 0, st[g]>>>(out[g], in[g], iters, g == 0, c.w, c.r, c.clocked, 0, elapsed[g]);
        CK(cudaGetLastError());
      }
      uint64_t ns = 0;
      for (int g = 0; g < 2; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaStreamSynchronize(st[g]));
      }
      CK(cudaSetDevice(0));
      CK(cudaMemcpy(&ns, elapsed[0], 8, cudaMemcpyDeviceToHost));
      runs.push_back(ns / 1e3 / iters);
    }
    std::sort(runs.begin(), runs.end());
    printf("%-20s %-22s %-22s %-8s %10.3f\n", wname[c.w], rname[c.r], c.remote_poll ? "writer (remote poll)" : "reader (local poll)",
           c.clocked ? "yes" : "no", runs[2]);
  }
  return 0;
}
