// Copy-engine probe: how fast can the copy engines of one GPU push to its NVLink peers, alone,
// fanned out to every peer, and while every GPU does the same (the reduce-scatter pattern)?
// Optionally with SM stores to peers running at the same time (hybrid). Single process, all GPUs.
// Build: nvcc -O2 -arch=sm_90 tools/ce-probe.cu -o ce-probe   Run: ./ce-probe (PROBE=ring: from
// the bidirectional rows on; PROBE=hybrid: the copy engine to the ring neighbour beside SM stores
// to the other peers, against SM stores to every peer)
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <chrono>
#include <string>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void sm_push(int4* const* dst, const int4* src, size_t n16, int npeers) {
  // Each block handles one peer round-robin; grid-stride over 16-byte words.
  int peer = blockIdx.x % npeers;
  int bpp = gridDim.x / npeers;
  int b = blockIdx.x / npeers;
  int4* d = dst[peer];
  for (size_t i = (size_t)b * blockDim.x + threadIdx.x; i < n16; i += (size_t)bpp * blockDim.x) d[i] = src[i];
}

int ngpu;
std::vector<char*> src, dstbuf;  // src[g]: 1 GiB on g; dstbuf[g]: 3 GiB on g (one GiB per sender slot)
const size_t GiB = 1ull << 30;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// copies: list of (from, to, bytes, chunk, streams-per-pair). Returns seconds.
bool g_pull = false;   // issue each copy on the destination GPU's stream instead of the source's
int g_sm_ring = 0;     // 1: SM push only to the ring neighbour (g+1); 2: to every peer but it; 0: every peer
int sm_peers() { return g_sm_ring == 1 ? 1 : g_sm_ring == 2 ? ngpu - 2 : ngpu - 1; }
double run(const std::vector<std::pair<int,int>>& pairs, size_t bytes, size_t chunk, int spp, int sm_blocks, size_t sm_bytes) {
  std::vector<std::vector<cudaStream_t>> st(pairs.size());
  for (size_t p = 0; p < pairs.size(); ++p) {
    CK(cudaSetDevice(g_pull ? pairs[p].second : pairs[p].first));
    st[p].resize(spp);
    for (auto& s : st[p]) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  std::vector<cudaStream_t> kst(ngpu);
  std::vector<int4**> dptrs(ngpu);
  for (int g = 0; g < ngpu; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaStreamCreateWithFlags(&kst[g], cudaStreamNonBlocking));
    std::vector<int4*> h;
    for (int q = 0; q < ngpu; ++q) {
      const bool next = q == (g + 1) % ngpu;
      if (q != g && (g_sm_ring == 0 || (g_sm_ring == 1) == next)) h.push_back((int4*)(dstbuf[q] + (size_t)g * GiB));
    }
    CK(cudaMalloc(&dptrs[g], h.size() * sizeof(int4*)));
    CK(cudaMemcpy(dptrs[g], h.data(), h.size() * sizeof(int4*), cudaMemcpyHostToDevice));
  }
  for (int g = 0; g < ngpu; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); }
  double t0 = now();
  for (int rep = 0; rep < 2; ++rep) {
    if (rep == 1) { for (int g = 0; g < ngpu; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); } t0 = now(); }
    if (sm_blocks > 0)
      for (int g = 0; g < ngpu; ++g) {
        CK(cudaSetDevice(g));
        sm_push<<<sm_blocks, 512, 0, kst[g]>>>(dptrs[g], (const int4*)(src[g] + 512 * (1 << 20) * 0), sm_bytes / 16, sm_peers());
      }
    for (size_t off = 0; off < bytes; off += chunk) {
      for (size_t p = 0; p < pairs.size(); ++p) {
        int a = pairs[p].first, b = pairs[p].second;
        CK(cudaSetDevice(g_pull ? b : a));
        size_t n = std::min(chunk, bytes - off);
        int s = (off / chunk) % spp;
        CK(cudaMemcpyAsync(dstbuf[b] + (size_t)a * GiB + 512 * (1 << 20) + off % (512 << 20), src[a] + off, n, cudaMemcpyDefault, st[p][s]));
      }
    }
    for (int g = 0; g < ngpu; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); }
  }
  double t = now() - t0;
  for (size_t p = 0; p < pairs.size(); ++p) { CK(cudaSetDevice(g_pull ? pairs[p].second : pairs[p].first)); for (auto s : st[p]) CK(cudaStreamDestroy(s)); }
  for (int g = 0; g < ngpu; ++g) { CK(cudaSetDevice(g)); CK(cudaStreamDestroy(kst[g])); CK(cudaFree(dptrs[g])); }
  return t;
}

int main() {
  CK(cudaGetDeviceCount(&ngpu));
  printf("%d GPUs\n", ngpu);
  src.resize(ngpu); dstbuf.resize(ngpu);
  for (int g = 0; g < ngpu; ++g) {
    CK(cudaSetDevice(g));
    for (int q = 0; q < ngpu; ++q) if (q != g) CK(cudaDeviceEnablePeerAccess(q, 0));
    CK(cudaMalloc(&src[g], GiB));
    CK(cudaMalloc(&dstbuf[g], (size_t)ngpu * GiB));
    CK(cudaMemset(src[g], 1, GiB));
  }
  const size_t B = 256 << 20;
  auto report = [&](const char* name, const std::vector<std::pair<int,int>>& pairs, size_t bytes, size_t chunk, int spp, int smb = 0, size_t smbytes = 0) {
    double t = run(pairs, bytes, chunk, spp, smb, smbytes);
    // egress per sending GPU
    std::vector<int> per(ngpu, 0);
    for (auto& p : pairs) per[p.first]++;
    int maxp = 0; for (int v : per) maxp = std::max(maxp, v);
    double ce = maxp * (double)bytes / t / 1e9;
    printf("%-44s bytes/pair %5zu MiB chunk %5zu MiB spp %d sm_blocks %3d: %8.1f us, CE egress/GPU %6.1f GB/s, +SM %6.1f -> total %6.1f GB/s\n",
           name, bytes >> 20, chunk >> 20, spp, smb, t * 1e6, ce, smb ? smbytes * sm_peers() / t / 1e9 : 0.0, ce + (smb ? smbytes * sm_peers() / t / 1e9 : 0.0));
  };
  (void)0;
  std::vector<std::pair<int,int>> one = {{0, 1}}, fan, all;
  for (int q = 1; q < ngpu; ++q) fan.push_back({0, q});
  for (int g = 0; g < ngpu; ++g) for (int q = 0; q < ngpu; ++q) if (q != g) all.push_back({g, q});
  std::vector<std::pair<int,int>> ring, bidi = {{0, 1}, {1, 0}};
  for (int g = 0; g < ngpu; ++g) ring.push_back({g, (g + 1) % ngpu});
  const char* which = getenv("PROBE") ? getenv("PROBE") : "all";
  if (std::string(which) == "hybrid") {
    // All-to-all split between engines: each GPU's copy engine carries its share for the ring
    // neighbour while SM stores carry the shares for the other peers, all at once.
    report("SM all-to-all (132 blocks)", {}, 0, 1, 1, 132, B);
    g_sm_ring = 2;
    for (int smb : {66, 99, 128})
      report("CE to g+1 + SM to the other peers", ring, B, B, 1, smb, B);
    for (int smb : {99, 128})
      report("CE to g+1 in 4M copies + SM to the others", ring, B, 4 << 20, 1, smb, B);
    g_sm_ring = 0;
    return 0;
  }
  if (std::string(which) == "base" || std::string(which) == "all") {
    report("single 0->1", one, 1 * GiB / 2, 512 << 20, 1);
    report("fan-out 0->all", fan, B, B, 1);
    report("all-to-all", all, B, B, 1);
  }
  report("bidirectional 0<->1", bidi, B, B, 1);
  report("ring push", ring, B, B, 1);
  report("ring push chunked 16M", ring, B, 16 << 20, 1);
  report("ring push chunked 32M", ring, B, 32 << 20, 1);
  report("ring push chunked 16M 2 streams", ring, B, 16 << 20, 2);
  g_pull = true;
  report("single 0->1 pull", one, B, B, 1);
  report("ring pull", ring, B, B, 1);
  report("bidirectional pull", bidi, B, B, 1);
  report("all-to-all pull", all, B, B, 1);
  report("all-to-all pull chunked 8M", all, B, 8 << 20, 1);
  g_pull = false;
  g_sm_ring = 1;
  report("SM ring push only (132 blocks)", {}, 0, 1, 1, 132, (size_t)(512 << 20));
  for (int smb : {16, 32, 66})
    report("ring CE push + SM ring push", ring, B, B, 1, smb, (size_t)(64 << 20) * smb / 16);
  g_sm_ring = 0;
  report("all-to-all 3 streams per pair", all, B, 8 << 20, 3);
  return 0;
}
