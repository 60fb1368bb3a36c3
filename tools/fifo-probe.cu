// FIFO probe: what a GPU -> host -> GPU round trip costs on this machine, piece by piece, with
// nothing of doorbell in the way. A host thread echoes a sequence number the GPU writes into pinned
// host memory; the GPU times each round trip with %globaltimer. Variants: the fence before the
// GPU's store, how the GPU polls for the echo (one load at a time, or several loads in flight at
// staggered times on separate copies of the echoed word), how the echo word is allocated, and
// where the host thread runs.
// Build: nvcc -O2 -arch=sm_90 tools/fifo-probe.cu -o fifo-probe -lpthread   Run: ./fifo-probe
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sched.h>
#include <string>
#include <thread>
#include <vector>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

constexpr int kStride = 16;  // u64 words between copies of the echo word: 128 bytes, separate L2 lines
constexpr int kMaxCopies = 8;

__device__ __forceinline__ uint64_t now_ns() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ uint64_t ld_sys(const uint64_t* p) { uint64_t v; asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ uint64_t ld_volatile(const uint64_t* p) { uint64_t v; asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void spin_ns(uint64_t ns) { uint64_t t = now_ns(); while (now_ns() - t < ns) {} }

// fence: 0 none, 1 fence.acq_rel.sys then relaxed store, 2 st.release.sys, 3 fence.acq_rel.gpu,
// 4 fence.sc.sys. copies: how many loads the poll keeps in flight (each on its own copy, or all on
// copy 0 when `same` is set), `gap` ns apart.
template <int K>
__device__ void echo_loop(uint64_t* out, const uint64_t* echo, uint64_t* lat, uint32_t iters, int fence, int same,
                          uint32_t gap, uint64_t* scratch) {
  for (uint32_t i = 1; i <= iters; ++i) {
    *scratch = i;  // a device-memory write for the fence to order, as a real push has
    const uint64_t t0 = now_ns();
    switch (fence) {
      case 1: asm volatile("fence.acq_rel.sys;" ::: "memory"); asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(out), "l"(uint64_t(i)) : "memory"); break;
      case 2: asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(out), "l"(uint64_t(i)) : "memory"); break;
      case 3: asm volatile("fence.acq_rel.gpu;" ::: "memory"); asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(out), "l"(uint64_t(i)) : "memory"); break;
      case 4: asm volatile("fence.sc.sys;" ::: "memory"); asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(out), "l"(uint64_t(i)) : "memory"); break;
      default: asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(out), "l"(uint64_t(i)) : "memory"); break;
    }
    const uint64_t t1 = now_ns();
    uint64_t v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v[k] = ld_sys(echo + (same ? 0 : k * kStride));
      if (k + 1 < K) spin_ns(gap);
    }
    bool done = false;
    while (!done) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (!done) {
          if (v[k] >= i) done = true;
          else v[k] = ld_sys(echo + (same ? 0 : k * kStride));
        }
      }
    }
    const uint64_t t2 = now_ns();
    lat[2 * (i - 1)] = t1 - t0;
    lat[2 * (i - 1) + 1] = t2 - t0;
  }
}

__global__ void echo_kernel(uint64_t* out, const uint64_t* echo, uint64_t* lat, uint32_t iters, int fence, int copies,
                            int same, uint32_t gap, uint64_t* scratch) {
  switch (copies) {
    case 1: echo_loop<1>(out, echo, lat, iters, fence, same, gap, scratch); break;
    case 2: echo_loop<2>(out, echo, lat, iters, fence, same, gap, scratch); break;
    case 4: echo_loop<4>(out, echo, lat, iters, fence, same, gap, scratch); break;
    default: echo_loop<8>(out, echo, lat, iters, fence, same, gap, scratch); break;
  }
}

// Dependent loads from host memory: the PCIe read round trip.
__global__ void read_latency(const uint64_t* host, uint32_t iters, uint64_t* result, int volatile_load) {
  uint64_t idx = 0;
  const uint64_t t0 = now_ns();
  for (uint32_t i = 0; i < iters; ++i) idx = volatile_load ? ld_volatile(host + idx) : ld_sys(host + idx);
  result[0] = (now_ns() - t0);
  result[1] = idx;
}

// Dependent atomics on device memory, and a lone fence after a host store.
__global__ void small_costs(uint64_t* dev, uint64_t* host, uint32_t iters, uint64_t* result) {
  uint64_t t0 = now_ns(), x = 0;
  for (uint32_t i = 0; i < iters; ++i) x = atomicAdd(reinterpret_cast<unsigned long long*>(dev + (x & 1)), 1ull);
  result[0] = now_ns() - t0;
  uint64_t fs = 0, fg = 0;
  for (uint32_t i = 0; i < iters; ++i) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(host), "l"(uint64_t(i)) : "memory");
    spin_ns(3000);  // let the store drain first
    uint64_t a = now_ns();
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    uint64_t b = now_ns();
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    uint64_t c = now_ns();
    fs += b - a; fg += c - b;
  }
  result[1] = fs; result[2] = fg; result[3] = x;
}

static std::vector<int> parse_cpulist(const std::string& s) {
  std::vector<int> cpus;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i); if (j == std::string::npos) j = s.size();
    std::string part = s.substr(i, j - i);
    size_t d = part.find('-');
    if (!part.empty()) {
      int a = atoi(part.c_str()), b = d == std::string::npos ? a : atoi(part.c_str() + d + 1);
      for (int c = a; c <= b; ++c) cpus.push_back(c);
    }
    i = j + 1;
  }
  return cpus;
}

int main(int argc, char** argv) {
  const uint32_t iters = argc > 1 ? atoi(argv[1]) : 20000;
  CK(cudaSetDevice(0));
  char bus[32]; CK(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
  for (char* c = bus; *c; ++c) *c = tolower(*c);
  std::string local;
  { std::ifstream f(std::string("/sys/bus/pci/devices/") + bus + "/local_cpulist"); std::getline(f, local); }
  std::string model;
  { std::ifstream f("/proc/cpuinfo"); std::string l; while (std::getline(f, l)) if (l.rfind("model name", 0) == 0) { model = l; break; } }
  std::vector<int> near = parse_cpulist(local);
  int ncpu = std::thread::hardware_concurrency();
  int near_cpu = near.empty() ? 0 : near[near.size() / 2];
  int far_cpu = near_cpu;
  for (int c = ncpu - 1; c >= 0; --c) if (std::find(near.begin(), near.end(), c) == near.end()) { far_cpu = c; break; }
  printf("GPU 0 at %s, local CPUs %s; %s; %d CPUs; near CPU %d, far CPU %d\n", bus, local.c_str(), model.c_str(), ncpu,
         near_cpu, far_cpu);

  uint64_t *out_h, *echo_h, *echo_wc_h, *out_d, *echo_d, *echo_wc_d;
  CK(cudaHostAlloc(&out_h, 4096, cudaHostAllocMapped));
  CK(cudaHostAlloc(&echo_h, 4096, cudaHostAllocMapped));
  CK(cudaHostAlloc(&echo_wc_h, 4096, cudaHostAllocMapped | cudaHostAllocWriteCombined));
  memset(out_h, 0, 4096); memset(echo_h, 0, 4096); memset(echo_wc_h, 0, 4096);
  CK(cudaHostGetDevicePointer(&out_d, out_h, 0));
  CK(cudaHostGetDevicePointer(&echo_d, echo_h, 0));
  CK(cudaHostGetDevicePointer(&echo_wc_d, echo_wc_h, 0));
  uint64_t *lat_d, *res_d, *scratch_d;
  CK(cudaMalloc(&lat_d, sizeof(uint64_t) * 2 * iters));
  CK(cudaMalloc(&res_d, 64));
  CK(cudaMalloc(&scratch_d, 64));
  CK(cudaMemset(scratch_d, 0, 64));
  std::vector<uint64_t> lat(2 * iters);

  { // PCIe read round trip
    uint64_t r[4];
    read_latency<<<1, 1>>>(echo_d, 100, res_d, 0);
    read_latency<<<1, 1>>>(echo_d, 2000, res_d, 0);
    CK(cudaMemcpy(r, res_d, 16, cudaMemcpyDeviceToHost));
    printf("GPU load from pinned host memory, dependent chain: %.3f us each (ld.relaxed.sys)\n", r[0] / 2000.0 / 1000);
    read_latency<<<1, 1>>>(echo_d, 2000, res_d, 1);
    CK(cudaMemcpy(r, res_d, 16, cudaMemcpyDeviceToHost));
    printf("GPU load from pinned host memory, dependent chain: %.3f us each (ld.volatile)\n", r[0] / 2000.0 / 1000);
    read_latency<<<1, 1>>>(echo_wc_d, 2000, res_d, 0);
    CK(cudaMemcpy(r, res_d, 16, cudaMemcpyDeviceToHost));
    printf("GPU load from write-combined pinned memory:        %.3f us each\n", r[0] / 2000.0 / 1000);
    small_costs<<<1, 1>>>(scratch_d, out_d, 2000, res_d);
    CK(cudaMemcpy(r, res_d, 32, cudaMemcpyDeviceToHost));
    printf("dependent device atomicAdd: %.3f us; fence.acq_rel.sys after a drained host store: %.3f us; fence.acq_rel.gpu: %.3f us\n",
           r[0] / 2000.0 / 1000, r[1] / 2000.0 / 1000, r[2] / 2000.0 / 1000);
    CK(cudaDeviceSynchronize());
  }

  struct Case { const char* name; int fence, copies, same, wc, cpu; uint32_t gap; };
  const int N = 0, F = 1, R = 2, G = 3, S = 4;
  std::vector<Case> cases = {
      {"no fence, 1 load", N, 1, 0, 0, near_cpu, 0},
      {"no fence, 1 load, far CPU", N, 1, 0, 0, far_cpu, 0},
      {"no fence, 1 load, unpinned", N, 1, 0, 0, -1, 0},
      {"no fence, 1 load, echo in WC memory", N, 1, 0, 1, near_cpu, 0},
      {"fence.acq_rel.sys + store", F, 1, 0, 0, near_cpu, 0},
      {"st.release.sys", R, 1, 0, 0, near_cpu, 0},
      {"fence.sc.sys + store", S, 1, 0, 0, near_cpu, 0},
      {"fence.acq_rel.gpu + store", G, 1, 0, 0, near_cpu, 0},
      {"no fence, 2 loads on 2 copies, gap 400", N, 2, 0, 0, near_cpu, 400},
      {"no fence, 4 loads on 4 copies, gap 200", N, 4, 0, 0, near_cpu, 200},
      {"no fence, 4 loads on 4 copies, gap 300", N, 4, 0, 0, near_cpu, 300},
      {"no fence, 8 loads on 8 copies, gap 100", N, 8, 0, 0, near_cpu, 100},
      {"no fence, 4 loads on 1 word, gap 200", N, 4, 1, 0, near_cpu, 200},
      {"fence.acq_rel.sys, 4 loads on 4 copies, gap 200", F, 4, 0, 0, near_cpu, 200},
      {"fence.acq_rel.gpu, 4 loads on 4 copies, gap 200", G, 4, 0, 0, near_cpu, 200},
      {"fence.acq_rel.gpu, 8 loads on 8 copies, gap 120", G, 8, 0, 0, near_cpu, 120},
  };
  printf("\n%-52s %9s %9s %9s %9s %9s\n", "GPU store -> host echo -> GPU sees it", "mean us", "p50", "p90", "p99", "store us");
  for (const Case& c : cases) {
    uint64_t* echo_host = c.wc ? echo_wc_h : echo_h;
    const uint64_t* echo_dev = c.wc ? echo_wc_d : echo_d;
    volatile uint64_t* vout = out_h;
    volatile uint64_t* vecho = echo_host;
    *vout = 0;
    for (int k = 0; k < kMaxCopies; ++k) vecho[k * kStride] = 0;
    std::atomic<bool> ready{false};
    std::thread host([&] {
      if (c.cpu >= 0) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(c.cpu, &s); sched_setaffinity(0, sizeof s, &s); }
      ready = true;
      uint64_t last = 0;
      while (last < iters) {
        uint64_t v = *vout;
        if (v != last) {
          for (int k = 0; k < c.copies; ++k) vecho[k * kStride] = v;
          last = v;
        }
      }
    });
    while (!ready) {}
    echo_kernel<<<1, 1>>>(out_d, echo_dev, lat_d, iters, c.fence, c.copies, c.same, c.gap, scratch_d);
    CK(cudaDeviceSynchronize());
    host.join();
    CK(cudaMemcpy(lat.data(), lat_d, sizeof(uint64_t) * 2 * iters, cudaMemcpyDeviceToHost));
    std::vector<uint64_t> rt, st;
    for (uint32_t i = iters / 10; i < iters; ++i) { st.push_back(lat[2 * i]); rt.push_back(lat[2 * i + 1]); }
    double mean = 0, smean = 0;
    for (auto x : rt) mean += x;
    for (auto x : st) smean += x;
    mean /= rt.size(); smean /= st.size();
    std::sort(rt.begin(), rt.end());
    auto pct = [&](double p) { return rt[size_t(p * (rt.size() - 1))] / 1000.0; };
    printf("%-52s %9.3f %9.3f %9.3f %9.3f %9.3f\n", c.name, mean / 1000, pct(0.5), pct(0.9), pct(0.99), smean / 1000);
  }
  return 0;
}
