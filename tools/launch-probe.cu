// Launch probe: what one kernel launch costs the GPU on this machine, queued eagerly (launches
// back to back behind a hold kernel, as the benchmarks time them) and replayed from a CUDA graph,
// for kernels that do nothing but differ in what a launch carries: the parameter bytes (8, 64,
// 312 = doorbell's AllReduceArgs, 440 = AllReduceDirectArgs) and the grid (1 x 32 threads up to
// 64 x 512 = doorbell's LL grid). The question it answers: in the eager allreduce below 16 KiB
// doorbell's kernel is faster than NCCL symmetric memory's in a graph but not eagerly; is the
// difference the launch (parameters, grid) rather than the kernel? The PDL rows: the same with
// programmatic dependent launch (griddepcontrol), which lets a launch overlap the one before.
// Build: nvcc -O2 -arch=sm_90 tools/launch-probe.cu -o launch-probe   Run: ./launch-probe [launches]
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

template <int kBytes>
struct Params {
  uint64_t w[kBytes / 8];
};

// Does nothing unless the first word says so (it never does): the compiler keeps the parameter.
template <int kBytes>
__global__ void empty(Params<kBytes> p) {
  if (p.w[0] == 1 && threadIdx.x == 0 && blockIdx.x == 0) printf("%llu\n", (unsigned long long)p.w[kBytes / 8 - 1]);
}

// The same, for a launch that may overlap the previous kernel (programmatic dependent launch):
// every block lets the next launch start, then waits for the previous grid to finish and flush
// before anything else, which keeps plain stream order for memory.
template <int kBytes>
__global__ void empty_pdl(Params<kBytes> p) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (p.w[0] == 1 && threadIdx.x == 0 && blockIdx.x == 0) printf("%llu\n", (unsigned long long)p.w[kBytes / 8 - 1]);
}

template <int kBytes>
void launch(bool pdl, cudaStream_t s, dim3 grid, dim3 block, const Params<kBytes>& p) {
  if (!pdl) {
    empty<kBytes><<<grid, block, 0, s>>>(p);
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, empty_pdl<kBytes>, p));
}

// One thread sleeping `ns`: the launches queue behind it, so the host's pace stays out.
__global__ void hold(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}

template <int kBytes>
void row(cudaStream_t s, int n, dim3 grid, dim3 block, bool pdl = false) {
  Params<kBytes> p{};
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  // Eager, queued.
  float best_eager = 1e30f;
  for (int rep = 0; rep < 3; ++rep) {
    hold<<<1, 1, 0, s>>>(uint64_t(n) * 4000 + 2000000);
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < n; ++i) launch<kBytes>(pdl, s, grid, block, p);
    CK(cudaEventRecord(b, s));
    CK(cudaStreamSynchronize(s));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    best_eager = ms < best_eager ? ms : best_eager;
  }
  // Graph of n launches, replayed.
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < n; ++i) launch<kBytes>(pdl, s, grid, block, p);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  float best_graph = 1e30f;
  for (int rep = 0; rep < 3; ++rep) {
    hold<<<1, 1, 0, s>>>(2000000);
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaStreamSynchronize(s));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    best_graph = ms < best_graph ? ms : best_graph;
  }
  printf("| %d%s | %u x %u | %.3f | %.3f |\n", kBytes, pdl ? " PDL" : "", grid.x, block.x, best_eager * 1e3f / n, best_graph * 1e3f / n);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? atoi(argv[1]) : 2000;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d launches per row, best of 3\n\n", prop.name, n);
  printf("| parameter bytes | grid | eager us per launch | graph us per launch |\n|---:|---|---:|---:|\n");
  const dim3 grids[] = {dim3(1), dim3(1), dim3(8), dim3(32), dim3(64)};
  const dim3 blocks[] = {dim3(32), dim3(512), dim3(512), dim3(512), dim3(512)};
  for (int g = 0; g < 5; ++g) {
    row<8>(s, n, grids[g], blocks[g]);
    row<64>(s, n, grids[g], blocks[g]);
    row<312>(s, n, grids[g], blocks[g]);
    row<440>(s, n, grids[g], blocks[g]);
  }
  // Programmatic dependent launch (each kernel waits for the previous one first).
  for (int g = 0; g < 5; ++g) row<312>(s, n, grids[g], blocks[g], true);
  return 0;
}
