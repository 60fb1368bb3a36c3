"""One rank of the GPU tests (started by test_gpu.py with torchrun-style variables; every rank
uses GPU 0 unless DOORBELL_TEST_GPUS says how many to spread over). Exits non-zero with the
reason on a mismatch."""

import sys

import torch

import doorbell
from doorbell import moe


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def all_reduce(comm):
    r, w = comm.rank, comm.world_size
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 1000, 1 << 20):
            t = (torch.arange(n, device="cuda") % 7 + r).to(dtype)
            want = (torch.arange(n, device="cuda") % 7 * w + w * (w - 1) // 2).to(dtype)
            work = comm.all_reduce(t, async_op=True)
            assert work is not None
            work.wait()
            comm.synchronize()  # a healthy job: returns, and the result is one
            check(work.is_completed(), "a synchronized call is completed")
            check(torch.equal(t, want), f"all_reduce {dtype} n={n} rank {r}")
    # Graph capture, replays with changing input.
    t = torch.zeros(4096, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(t)  # warm-up builds the allreduce outside the capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        comm.all_reduce(t)
    for i in range(20):
        t.fill_(float(r + i))
        g.replay()
        torch.cuda.synchronize()
        check(bool((t == w * i + w * (w - 1) / 2).all()), f"all_reduce graph replay {i} rank {r}")


def all_to_all(comm):
    r, w = comm.rank, comm.world_size
    rows = 3
    inp = torch.empty(w * rows, 2, dtype=torch.int32, device="cuda")
    for p in range(w):
        inp[p * rows:(p + 1) * rows, 0] = r
        inp[p * rows:(p + 1) * rows, 1] = p
    out = torch.full_like(inp, -1)
    comm.all_to_all(out, inp)
    torch.cuda.synchronize()
    for p in range(w):
        check(bool((out[p * rows:(p + 1) * rows, 0] == p).all()), f"all_to_all from {p}")
        check(bool((out[p * rows:(p + 1) * rows, 1] == r).all()), f"all_to_all to {r}")
    # Uneven: rank r sends p + 1 rows to rank p.
    send = [p + 1 for p in range(w)]
    recv = [r + 1] * w
    inp = torch.cat([torch.full((p + 1, 4), r * 100 + p, dtype=torch.float32, device="cuda") for p in range(w)])
    out = torch.full((sum(recv), 4), -1.0, device="cuda")
    comm.all_to_all_v(out, inp, output_split_sizes=recv, input_split_sizes=send)
    torch.cuda.synchronize()
    at = 0
    for p in range(w):
        check(bool((out[at:at + r + 1] == p * 100 + r).all()), f"all_to_all_v from {p}")
        at += r + 1


def routing(rank, tokens, topk, experts, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[0, :] = -1  # a token with no expert
    if tokens > 1:
        idx[1, 1:] = -1  # a token with one
    return idx


def moe_normal(comm):
    r, w = comm.rank, comm.world_size
    hidden, experts, topk, tokens = 256, 4 * w, 4, 64
    buf = moe.Buffer(comm, hidden, experts, tokens, topk)
    for seed in range(3):
        n = tokens - 7 * seed  # uneven token counts
        idx = routing(r, n, topk, experts, seed).cuda()
        x = torch.zeros(n, hidden, dtype=torch.bfloat16, device="cuda")
        x[:, 0] = r
        x[:, 1] = torch.arange(n, device="cuda").to(torch.bfloat16)
        x[:, 2:] = 1
        wts = torch.ones(n, topk, device="cuda")
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, idx, wts)
        torch.cuda.synchronize()
        got = int(handle.num_recv.item())
        want = 0
        for s in range(w):
            other = routing(s, tokens - 7 * seed, topk, experts, seed)
            mine = ((other >= 0) & (other // (experts // w) == r)).any(1)
            want += int(mine.sum())
        check(got == want, f"moe dispatch rank {r}: {got} rows, expected {want}")
        check(bool((recv_x[:got, 2:] == 1).all()), "moe payload")
        y = recv_x[:got].clone()
        out, _, _ = buf.combine(y, handle)
        torch.cuda.synchronize()
        ranks_of = ((idx >= 0)[:, :, None] & ((idx // (experts // w))[:, :, None] == torch.arange(w, device="cuda"))).any(1).sum(1)
        check(bool((out[:, 2:] == ranks_of[:, None].to(torch.bfloat16)).all()), f"moe combine rank {r}")


def moe_low_latency_graph(comm, replays):
    r, w = comm.rank, comm.world_size
    hidden, experts, topk, tokens = 256, 4 * w, 4, 32
    buf = moe.Buffer(comm, hidden, experts, tokens, topk, low_latency_mode=True)
    idx = routing(r, tokens, topk, experts, 7).cuda()
    valid = (idx >= 0).sum(1)
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    wts = torch.ones(tokens, topk, device="cuda")

    def step():
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(
            x, idx, tokens, experts, return_recv_hook=True, topk_weights=wts
        )
        hook()
        comb = buf.get_next_low_latency_combine_buffer(handle)
        comb.copy_(recv_x)  # the identity expert
        out, _, _ = buf.low_latency_combine(comb, idx, wts, handle)
        return out

    x.fill_(1)
    out = step()  # eager, and it builds everything before the capture
    torch.cuda.synchronize()
    check(bool((out == valid[:, None].to(torch.bfloat16)).all()), f"LL eager rank {r}")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
        outs = step()  # two per replay: the receive halves alternate with the dispatch's parity
    for i in range(replays):
        v = float(i % 13 + 1)
        x.fill_(v)
        g.replay()
        torch.cuda.synchronize()
        check(bool((outs == valid[:, None].to(torch.bfloat16) * v).all()), f"LL graph replay {i} rank {r}")


def channels(comm):
    r, w = comm.rank, comm.world_size
    src, dst = comm.alloc(1 << 20), comm.alloc(1 << 20)
    chans = comm.memory_channels(src, dst)
    h = chans.handles
    check(tuple(h.shape) == (w, chans.handle_size), f"handles shape {tuple(h.shape)}")
    check(bool((h[r] == 0).all()), "own handle row is zero")
    for p in range(w):
        if p != r:
            check(bool((h[p] != 0).any()), f"handle to {p} is empty")
    t = src.tensor(torch.float32, (256, 1024))
    t.fill_(r)
    torch.cuda.synchronize()
    check(bool((t == r).all()), "SymmetricMemory view")
    # The channels move data: a kernel of ours, built against doorbell.get_include(), puts this
    # rank's src into slot r of every peer's dst, signals each peer and waits for each.
    chunk = (1 << 20) // w // 16 * 16
    src.tensor(torch.float32, (chunk // 4,)).copy_(torch.arange(chunk // 4, device="cuda") + 1000 * r)
    out = dst.tensor(torch.float32, ((1 << 20) // 4,))
    out.fill_(-1)
    torch.cuda.synchronize()
    comm.check_health()
    _launch_exchange(h, r, w, chunk)
    comm.synchronize()
    for p in range(w):
        got = out[p * chunk // 4 : (p + 1) * chunk // 4]
        if p == r:
            check(bool((got == -1).all()), "nothing lands in a rank's own slot")
        else:
            want = torch.arange(chunk // 4, device="cuda", dtype=torch.float32) + 1000 * p
            check(torch.equal(got, want), f"rank {r}: the block from rank {p} over its MemoryChannel")


_EXCHANGE = r"""
#include <doorbell/doorbell.cuh>
extern "C" __global__ void exchange(const doorbell::MemoryChannelHandle* h, unsigned rank, unsigned world,
                                    unsigned long long chunk) {
  for (unsigned p = 0; p < world; ++p) {
    if (p != rank) h[p].put(rank * chunk, 0, chunk, threadIdx.x, blockDim.x);
  }
  __syncthreads();
  const unsigned p = threadIdx.x;
  if (p < world && p != rank) {
    h[p].signal();
    h[p].wait();
  }
}
"""


def _launch_exchange(handles, rank, world, chunk):
    """Builds _EXCHANGE with nvcc (doorbell.get_include()) and launches it through the driver
    API on torch's current stream: one block of 256 threads."""
    import ctypes
    import os
    import shutil
    import subprocess
    import tempfile

    nvcc = shutil.which("nvcc") or next(
        (p for p in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), "/usr/local/cuda/bin/nvcc")
         if os.path.exists(p)),
        None,
    )
    if nvcc is None:
        raise AssertionError("no nvcc: the channels case needs it to build its kernel")
    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "exchange.cu")
        cubin = os.path.join(d, "exchange.cubin")
        with open(src, "w") as f:
            f.write(_EXCHANGE)
        subprocess.run(
            [nvcc, "-cubin", "-std=c++17", f"-arch=sm_{major}{minor}", "-I", doorbell.get_include(), src, "-o", cubin],
            check=True,
        )
        with open(cubin, "rb") as f:
            image = f.read()
    cuda = ctypes.CDLL("libcuda.so.1")
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(module), image) == 0, "cuModuleLoadData")
    check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"exchange") == 0, "cuModuleGetFunction")
    args = [
        ctypes.c_uint64(handles.data_ptr()),
        ctypes.c_uint32(rank),
        ctypes.c_uint32(world),
        ctypes.c_uint64(chunk),
    ]
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    rc = cuda.cuLaunchKernel(fn, 1, 1, 1, 256, 1, 1, 0, stream, params, None)
    check(rc == 0, f"cuLaunchKernel: {rc}")


def kill_loop(comm, seed):
    """The loop of issue 26: all_reduce, torch.cuda.synchronize(), check, while the last rank
    kills itself (SIGKILL) at a random call. A survivor must see right results, or results marked
    as cut short (NaN), then DoorbellError; never a wrong result without an exception. Sizes of
    1, 16 and 256 KiB take the LL kernels, whose outputs an abort marks."""
    import os
    import random
    import signal

    r, w = comm.rank, comm.world_size
    kill_at = random.Random(seed).randrange(3, 60)
    right = marked = wrong = 0
    raised = None
    for i in range(200):
        if r == w - 1 and i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        n = (256, 4096, 65536)[i % 3]
        t = torch.full((n,), float(r + 1 + i), device="cuda")
        want = float(sum(p + 1 + i for p in range(w)))
        try:
            comm.all_reduce(t)
            torch.cuda.synchronize()
        except doorbell.DoorbellError as e:
            raised = e
            break
        if bool((t == want).all()):
            right += 1
        elif bool(t.isnan().any()):
            marked += 1
        else:
            wrong += 1
            print(f"rank {r}: call {i} returned a wrong result without an exception", flush=True)
    if raised is None:
        try:
            comm.synchronize()
        except doorbell.DoorbellError as e:
            raised = e
    print(f"rank {r}: kill at call {kill_at}: {right} right, {marked} marked, {wrong} wrong; then {raised}", flush=True)
    check(wrong == 0, f"rank {r}: {wrong} wrong results returned without an exception")
    check(raised is not None, f"rank {r}: the killed rank was never reported")


def bad_arguments(comm):
    t = torch.zeros(8, dtype=torch.int32, device="cuda")
    try:
        comm.all_reduce(t)
    except TypeError as e:
        check("float32" in str(e), str(e))
    else:
        raise AssertionError("all_reduce took int32")


def main():
    case = sys.argv[1]
    gpus = torch.cuda.device_count()
    comm = doorbell.init(device=int(__import__("os").environ.get("LOCAL_RANK", "0")) % gpus)
    if case == "all_reduce":
        all_reduce(comm)
    elif case == "all_to_all":
        all_to_all(comm)
    elif case == "moe":
        moe_normal(comm)
    elif case == "moe_graph":
        moe_low_latency_graph(comm, int(sys.argv[2]))
    elif case == "channels":
        channels(comm)
    elif case == "bad_arguments":
        bad_arguments(comm)
    elif case == "kill_loop":
        kill_loop(comm, int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown case {case}")
    print(f"rank {comm.rank}: {case} ok", flush=True)


if __name__ == "__main__":
    main()
