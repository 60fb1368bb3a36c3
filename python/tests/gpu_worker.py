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


def _gloo_group(r, w):
    """This rank's GPU (ranks may share them) and a gloo process group over DOORBELL_MASTER_PORT,
    as the DeepEP-API cases use (doorbell joins through it)."""
    import os

    import torch.distributed as dist

    torch.cuda.set_device(r % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['DOORBELL_MASTER_PORT']}", rank=r, world_size=w)


def _normal_inputs(r, w, T, H, K, E):
    """A normal-mode case's inputs on rank r: rows holding the rank in every column but the last
    (the token), random top-K of E experts with every 7th token's second id -1, random weights;
    and every rank's ids and weights (all_gather over the process group)."""
    import torch.distributed as dist

    from doorbell import deep_ep

    torch.manual_seed(r)
    x = torch.full((T, H), float(r), dtype=torch.bfloat16, device="cuda")
    x[:, -1] = torch.arange(T, device="cuda").to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand(T, E, device="cuda"), K, dim=1).indices.to(deep_ep.topk_idx_t)
    topk_idx[::7, 1] = -1
    topk_weights = torch.rand(T, K, device="cuda")
    all_idx = [torch.zeros(T, K, dtype=torch.int64) for _ in range(w)]
    all_w = [torch.zeros(T, K) for _ in range(w)]
    dist.all_gather(all_idx, topk_idx.cpu())
    dist.all_gather(all_w, topk_weights.cpu())
    return x, topk_idx, topk_weights, all_idx, all_w


def _rows_for(r, all_idx, local):
    """The (source rank, token) of every row rank r receives in a normal dispatch, in DeepEP's
    order (source rank, then token): tokens with an expert on r, given every rank's ids."""
    return [(s, t) for s, ids in enumerate(all_idx) for t in range(ids.shape[0]) if bool(((ids[t] >= 0) & (ids[t] // local == r)).any())]


def _check_rows_in_deep_eps_order(recv_x, recv_idx, recv_w, rows, all_idx, all_w, r, local, hidden, what):
    """Checks a normal dispatch's rows against `rows` (from _rows_for): row j holds its source
    rank in column 0 and its token in the last column, local expert ids (-1 elsewhere) and the
    source's weights (0 elsewhere). Returns the rows per local expert."""
    n, topk = len(rows), int(all_idx[0].shape[1])
    check(recv_x.shape == (n, hidden) and recv_idx.shape == (n, topk) and recv_w.shape == (n, topk), f"{what}: shapes {tuple(recv_x.shape)}, {n} rows expected")
    check(recv_idx.dtype == torch.int64, f"{what}: ids int64")
    rx, ri, rw = recv_x.float().cpu(), recv_idx.cpu(), recv_w.cpu()
    counts = [0] * local
    for j, (s, t) in enumerate(rows):
        check(rx[j, 0] == s and rx[j, -1] == t, f"{what}: row {j} is ({s}, {t}), got ({rx[j, 0]}, {rx[j, -1]})")
        for k in range(topk):
            e = int(all_idx[s][t, k])
            here = e >= 0 and e // local == r
            check(int(ri[j, k]) == (e % local if here else -1), f"{what}: row {j} id {k}")
            check(float(rw[j, k]) == (float(all_w[s][t, k]) if here else 0.0), f"{what}: row {j} weight {k}")
            if here:
                counts[e % local] += 1
    return counts


def deep_ep_normal():
    """doorbell.deep_ep's normal mode through DeepEP's calls, on a gloo process group (ranks may
    share a GPU): layout, dispatch (rows in source-rank order, local ids, weights 0 elsewhere,
    the rank prefix matrix, the per-expert list), combine, the async/previous-event forms,
    num_worst_tokens, and the refusal of what is not built yet."""
    import os

    import torch.distributed as dist

    from doorbell import deep_ep

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _gloo_group(r, w)
    group = dist.group.WORLD
    T, H, K, E = 64, 256, 4, 4 * w
    local = E // w
    buf = deep_ep.Buffer(group, int(1e8))
    x, topk_idx, topk_weights, all_idx, all_w = _normal_inputs(r, w, T, H, K, E)

    per_rank, rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(topk_idx, E)
    check(rdma is None and isinstance(ev, deep_ep.EventOverlap) and ev.event is None, "layout: one node, synchronous")
    idx_cpu = topk_idx.cpu()
    for p in range(w):
        want = [bool(((idx_cpu[t] >= 0) & (idx_cpu[t] // local == p)).any()) for t in range(T)]
        check(in_rank[:, p].cpu().tolist() == want, f"is_token_in_rank column {p}")
        check(int(per_rank[p]) == sum(want), f"num_tokens_per_rank[{p}]")
    for e in range(E):
        check(int(per_expert[e]) == int((idx_cpu == e).sum()), f"num_tokens_per_expert[{e}]")

    # What rank r receives, in source-rank order.
    rows = _rows_for(r, all_idx, local)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    def check_dispatch(recv_x, recv_idx, recv_w, listed, handle, what):
        counts = _check_rows_in_deep_eps_order(recv_x, recv_idx, recv_w, rows, all_idx, all_w, r, local, H, what)
        prefix = handle[0].cpu()
        sent = [sum(1 for (s2, _) in rows if s2 == s) for s in range(w)]
        check([int(prefix[s, r]) for s in range(w)] == [sum(sent[: s + 1]) for s in range(w)], f"{what}: rank_prefix_matrix column {r}: {prefix[:, r].tolist()}")
        if listed is not None:
            check(listed == counts, f"{what}: per-expert list {listed} vs {counts}")

    recv_x, recv_idx, recv_w, listed, handle, ev = buf.dispatch(x, **args)
    check(isinstance(ev, deep_ep.EventOverlap) and ev.event is None, "synchronous dispatch: an empty event, as DeepEP's")
    check_dispatch(recv_x, recv_idx, recv_w, listed, handle, "dispatch")

    combined, cw, ev = buf.combine(recv_x, handle)
    check(cw is None and ev.event is None, "combine: no weights asked, synchronous")
    times = in_rank.sum(1, keepdim=True).float()
    check(torch.equal(combined.float(), x.float() * times), "combine: each row times the ranks it went to")
    combined_w, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    check(torch.equal(combined_w, combined), "combine with weights: the same rows")
    # Weight k of a token reaches only its expert's rank (0 elsewhere): the sum is the weight.
    check(torch.equal(cw, topk_weights.masked_fill(topk_idx < 0, 0.0)), "combined_topk_weights")

    # The stream rules: after an event of the current stream, finishing asynchronously.
    recv_x2, recv_idx2, recv_w2, listed2, handle2, ev = buf.dispatch(x, **args, previous_event=buf.capture(), async_finish=True)
    check(isinstance(ev, deep_ep.EventOverlap), "async dispatch returns an EventOverlap")
    ev.current_stream_wait()
    check_dispatch(recv_x2, recv_idx2, recv_w2, listed2, handle2, "async dispatch")
    combined2, _, ev = buf.combine(recv_x2, handle2, async_finish=True)
    with ev:
        pass
    check(torch.equal(combined2, combined), "async combine")
    check(torch.equal(recv_x, recv_x2), "results of the first dispatch outlive the second")

    # num_worst_tokens: fixed-size outputs, no host wait, ids -1 past the received rows.
    worst = w * T
    wx, wi, ww, empty, _, _ = buf.dispatch(x, **args, num_worst_tokens=worst)
    check(empty == [] and wx.shape[0] == worst and wi.shape[0] == worst, "num_worst_tokens: shapes, empty list")
    check(torch.equal(wx[: len(rows)], recv_x) and torch.equal(wi[: len(rows)], recv_idx), "num_worst_tokens: same rows first")
    check(bool((wi[len(rows):] == -1).all()), "num_worst_tokens: ids -1 past the received rows")

    # Without top-k: routed by is_token_in_rank; the same rows and per-expert list, no ids.
    nx, ni, nw, nlisted, nhandle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    check(ni is None and nw is None, "dispatch without top-k: no ids or weights")
    check(torch.equal(nx, recv_x), "dispatch without top-k: the same rows")
    check(nlisted == listed, f"dispatch without top-k: per-expert list {nlisted} vs {listed}")
    check(torch.equal(nhandle[0], handle[0]), "dispatch without top-k: the same prefix matrix")
    # The cached dispatch: the handle's routing, new rows; then a combine with that handle.
    x2 = x * 2
    cx, c1, c2, c3, c4, _ = buf.dispatch(x2, handle=nhandle)
    check(c1 is None and c2 is None and c3 is None and c4 is None, "cached dispatch: DeepEP's tuple")
    check(torch.equal(cx, recv_x * 2), "cached dispatch: the handle's routing, the new rows")
    combined3, _, _ = buf.combine(cx, nhandle)
    check(torch.equal(combined3.float(), x2.float() * times), "combine after the cached dispatch")
    # Results handed out of a receive slot keep it while any view of them lives: a part of the
    # first dispatch's rows, its other tensors dropped, outlives more dispatches than there are
    # slots; the slots the dropped results held serve them.
    # (A handle holds its dispatch's slot too: its prefix matrix is a view of the slot; so does
    # an asynchronous call's event, which keeps the call's tensors.)
    part, want = recv_x[:, :8], recv_x[:, :8].clone()
    del recv_x, recv_idx, recv_w, handle, recv_x2, recv_idx2, recv_w2, handle2, ev, wx, wi, ww, nx, nhandle, cx
    for i in range(4):
        y3, i3, _, _, h3, _ = buf.dispatch(x * (i + 3), **args)
        check(torch.equal(y3[:, :8], want * (i + 3)), f"dispatch {i} after the drop: rows")
        out3, _, _ = buf.combine(y3, h3)
        check(torch.equal(out3, ((x * (i + 3)).float() * times).bfloat16()), f"dispatch {i} after the drop: combine")
    check(torch.equal(part, want), "a view of the first dispatch's rows outlived four more dispatches")
    # Two-batch overlap: two dispatches of different routings in flight, then their combines,
    # each following its own dispatch's layout. `part` holds slot 1, so the first lands in slot
    # 2 and the second in the adapter's own slot (copies).
    del y3, i3, h3, out3
    idx_b = torch.topk(torch.rand(T, E, device="cuda"), K, dim=1).indices.to(deep_ep.topk_idx_t)
    pr_b, _, pe_b, ir_b, _ = buf.get_dispatch_layout(idx_b, E)
    args_b = dict(num_tokens_per_rank=pr_b, is_token_in_rank=ir_b, num_tokens_per_expert=pe_b, topk_idx=idx_b, topk_weights=topk_weights)
    ra = buf.dispatch(x, **args)
    rb = buf.dispatch(x * 2, **args_b)
    ca, _, _ = buf.combine(ra[0], ra[4])
    cb, _, _ = buf.combine(rb[0], rb[4])
    check(torch.equal(ca.float(), x.float() * times), "two-batch overlap: the first batch's combine after the second's dispatch")
    times_b = ir_b.sum(1, keepdim=True).float()
    check(torch.equal(cb, ((x * 2).float() * times_b).bfloat16()), "two-batch overlap: the second batch's combine")
    # A copied dispatch's layout lasts until a dispatch of another routing takes the slot.
    rc = buf.dispatch(x, **args)
    try:
        buf.combine(rb[0], rb[4])
    except ValueError as e:
        check("layout is gone" in str(e), str(e))
    else:
        raise AssertionError("a combine of an overwritten layout was not refused")
    cc, _, _ = buf.combine(rc[0], rc[4])
    check(torch.equal(cc.float(), x.float() * times), "the later dispatch's combine")
    # CUDA graphs: a dispatch that reads its count on the host is refused under capture before
    # anything is queued; with num_worst_tokens it is captured and replays with new rows.
    ref = rc[0].clone()
    del ra, rb, rc, ca, cb, cc
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            buf.dispatch(x, **args)
    except RuntimeError as e:
        check("num_worst_tokens" in str(e), str(e))
    else:
        raise AssertionError("a dispatch that reads its count on the host was captured")
    xs = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gx, gi, _, glisted, _, _ = buf.dispatch(xs, **args, num_worst_tokens=worst)
    check(glisted == [] and gx.shape[0] == worst, "captured num_worst_tokens dispatch: shapes")
    for i in range(3):
        xs.copy_(x * (i + 2))
        g.replay()
        torch.cuda.synchronize()
        check(torch.equal(gx[: len(rows)], ref * (i + 2)), f"captured num_worst_tokens dispatch, replay {i}: rows")
        check(bool((gi[len(rows):] == -1).all()), f"captured num_worst_tokens dispatch, replay {i}: ids -1 past the rows")
    del g, gx, gi
    # Not built yet: refused by name, nothing sent.
    try:
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, num_worst_tokens=worst)
    except NotImplementedError as e:
        check("not built yet" in str(e), str(e))
    else:
        raise AssertionError("num_worst_tokens without top-k was not refused")
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {r}: deep_ep_normal ok", flush=True)


# Emulated nodes of doorbell's node-spanning paths, by variant name (tests/moe.rs's set). The
# emulated NIC and the Ethernet transport copy on host threads with CUDA calls, which a kernel
# that PyTorch loads lazily while doorbell's kernels wait would hold back until the waits give up
# (DoorbellError names it): these processes load modules eagerly.
_EAGER = {"CUDA_MODULE_LOADING": "EAGER"}
_ACROSS = {
    "proxy": {**_EAGER, "DOORBELL_IB_EMULATE": "1", "DOORBELL_IB_EMULATE_RELAXED": "8", "DOORBELL_IB_POSTING": "proxy"},
    "ibgda": {**_EAGER, "DOORBELL_IB_EMULATE": "1", "DOORBELL_IB_EMULATE_RELAXED": "8", "DOORBELL_IB_POSTING": "ibgda"},
    "cpu": {**_EAGER, "DOORBELL_IB_EMULATE": "1", "DOORBELL_IB_EMULATE_RELAXED": "8", "DOORBELL_IB_POSTING": "cpu"},
    "verbs": {**_EAGER, "DOORBELL_IB_EMULATE": "1", "DOORBELL_IB_EMULATE_RELAXED": "8", "DOORBELL_IB_POSTING": "verbs"},
    "proxy-pairs": {**_EAGER, "DOORBELL_IB_EMULATE": "1", "DOORBELL_IB_EMULATE_RELAXED": "8", "DOORBELL_IB_POSTING": "proxy", "DOORBELL_NODE_SIZE": "2"},
    "ethernet-pairs": {**_EAGER, "DOORBELL_IB_DISABLE": "1", "DOORBELL_NODE_SIZE": "2"},
}


def deep_ep_normal_across(variant):
    """doorbell.deep_ep's normal mode when the communicator spans (emulated) nodes: the layout's
    per-node counts, rows in DeepEP's order (source rank, then token) with local ids, weights 0
    elsewhere and the internode handle's rank prefix sum, bf16 and FP8, the combine and its
    combined top-k weights, the async form, the cached dispatch, the dispatch without top-k (by
    is_token_in_rank) with its combine and cached form, and the refusals of what is not built
    across nodes."""
    import os

    import torch.distributed as dist

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    env = _ACROSS[variant]
    size = int(env.get("DOORBELL_NODE_SIZE", "1"))
    if w % size or w // size < 2:
        # The node-spanning high-throughput path needs two or more nodes of one size.
        print(f"rank {r}: deep_ep_normal_across {variant}: not run, {w} ranks make no two nodes of {size}", flush=True)
        return
    os.environ.update(env, DOORBELL_SEPARATE_NODES="1")
    from doorbell import deep_ep

    _gloo_group(r, w)
    group = dist.group.WORLD
    T, H, K, E = 64, 256, 4, 4 * w
    local = E // w
    buf = deep_ep.Buffer(group, int(1e8))
    check(buf._comm.spans_nodes, f"{variant}: the communicator spans nodes")
    node_of = buf._comm.node_of_rank()
    check(node_of == [p // size for p in range(w)], f"{variant}: nodes {node_of}")
    x, topk_idx, topk_weights, all_idx, all_w = _normal_inputs(r, w, T, H, K, E)

    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
    idx_cpu = topk_idx.cpu()
    nodes = w // size
    check(per_node is not None and per_node.dtype == torch.int32 and tuple(per_node.shape) == (nodes,), "layout: num_tokens_per_rdma_rank [nodes] int32")
    for nd in range(nodes):
        want = sum(bool(((idx_cpu[t] >= 0) & (idx_cpu[t] // (local * size) == nd)).any()) for t in range(T))
        check(int(per_node[nd]) == want, f"num_tokens_per_rdma_rank[{nd}] {int(per_node[nd])} vs {want}")

    rows = _rows_for(r, all_idx, local)
    sent = [sum(1 for (s2, _) in rows if s2 == s) for s in range(w)]
    args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    def check_dispatch(recv_x, recv_idx, recv_w, listed, handle, what):
        counts = _check_rows_in_deep_eps_order(recv_x, recv_idx, recv_w, rows, all_idx, all_w, r, local, H, what)
        check(len(handle) == 10, f"{what}: DeepEP's internode handle is a 10-tuple")
        prefix = handle[-4]
        check(prefix.dtype == torch.int32 and prefix.cpu().tolist() == [sum(sent[: s + 1]) for s in range(w)], f"{what}: recv_gbl_rank_prefix_sum {prefix.tolist()}")
        check(handle[0] is in_rank, f"{what}: handle[0] is is_token_in_rank")
        check(listed == counts, f"{what}: per-expert list {listed} vs {counts}")

    times = in_rank.sum(1, keepdim=True).float()
    for step in range(3):  # more than one call: the order and the combine's rows each time
        recv_x, recv_idx, recv_w, listed, handle, _ = buf.dispatch(x, **args)
        check_dispatch(recv_x, recv_idx, recv_w, listed, handle, f"dispatch {step}")
        y = recv_x * (step + 1)
        combined, cw, _ = buf.combine(y, handle)
        check(cw is None, "combine: no weights asked")
        want = (x.float() * times * (step + 1)).bfloat16()  # exact sums of small ints, rounded once
        bad = (combined != want).nonzero()[:4].tolist()
        detail = [(t, c, float(combined[t, c]), float(want[t, c]), int(times[t, 0])) for t, c in bad]
        if bad:
            try:
                buf._comm.synchronize()
                health = "the communicator reports nothing"
            except Exception as e:  # the wait report that cut the combine short, if one did
                health = f"{type(e).__name__}: {e}"
            detail.append(health)
        check(not bad, f"combine {step}: each row times the ranks it went to; (token, column, got, want, ranks): {detail}")

    # The combined top-k weights: the combine's (here 3 x the dispatch's), summed inside each
    # node and then over the nodes; only the expert's own rank holds a nonzero weight for it.
    combined, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w * 3)
    check(torch.equal(combined, (x.float() * times).bfloat16()), "combine with weights: the rows")
    check(cw is not None and cw.dtype == torch.float32 and tuple(cw.shape) == (T, K), "combined_topk_weights [tokens, topk] f32")
    want_w = (topk_weights * 3).masked_fill(topk_idx < 0, 0.0)
    check(torch.equal(cw, want_w), f"combined_topk_weights: {(cw - want_w).abs().max().item()} off")

    # FP8 rows: the same order, e4m3 and scales as sent (DeepEP's column-major scales).
    x8 = (x.float() / 2).to(torch.float8_e4m3fn)
    sc = (torch.arange(T * (H // 128), device="cuda", dtype=torch.float32).view(H // 128, T).t() + r * 1000)
    (fx, fs), fi, fw, flisted, fhandle, _ = buf.dispatch((x8, sc), **args)
    check(fx.dtype == torch.float8_e4m3fn and tuple(fs.shape) == (len(rows), H // 128), "FP8 dispatch: dtypes and shapes")
    want8 = (recv_x.float() / 2).to(torch.float8_e4m3fn)  # the bf16 rows, cast as the senders did
    check(torch.equal(fx.view(torch.uint8), want8.view(torch.uint8)), "FP8 dispatch: the rows in DeepEP's order")
    for j, (s, t) in enumerate(rows):
        want = [float(s * 1000 + c * T + t) for c in range(H // 128)]
        check(fs[j].cpu().tolist() == want, f"FP8 dispatch: row {j} scales")
    check(flisted == listed and torch.equal(fi, recv_idx), "FP8 dispatch: ids and list")

    # Asynchronous, after an event of the current stream.
    ra = buf.dispatch(x, **args, previous_event=buf.capture(), async_finish=True)
    ra[5].current_stream_wait()
    check_dispatch(*ra[:5], "async dispatch")
    ca, _, ev = buf.combine(ra[0], ra[4], async_finish=True)
    ev.current_stream_wait()
    check(torch.equal(ca, (x.float() * times).bfloat16()), "async combine")

    # The cached dispatch: the handle's routing, new rows; then a combine with that handle.
    cx, c1, c2, c3, c4, _ = buf.dispatch(x * 2, handle=ra[4])
    check(c1 is None and c2 is None and c3 is None and c4 is None, "cached dispatch: DeepEP's tuple")
    check(torch.equal(cx, ra[0] * 2), "cached dispatch: the handle's routing, the new rows")
    cc, _, _ = buf.combine(cx, ra[4])
    check(torch.equal(cc, ((x * 2).float() * times).bfloat16()), "combine after the cached dispatch")

    # Without top-k (routed by is_token_in_rank): the same rows in the same order, no ids or
    # weights, the per-expert list from the sources' counts, the same prefix sum; its combine;
    # its cached dispatch; FP8.
    by_rank = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    bx, bi, bw, blisted, bhandle, _ = buf.dispatch(x, **by_rank)
    check(bi is None and bw is None, "without top-k: no ids or weights")
    check(torch.equal(bx, recv_x), "without top-k: the rows of the top-k dispatch, in DeepEP's order")
    check(blisted == listed, f"without top-k: per-expert list {blisted} vs {listed}")
    check(len(bhandle) == 10 and torch.equal(bhandle[-4], handle[-4]) and bhandle[0] is in_rank, "without top-k: the internode handle")
    bc, _, _ = buf.combine(bx * 3, bhandle)
    check(torch.equal(bc, (x.float() * times * 3).bfloat16()), "without top-k: the combine")
    cbx, *rest = buf.dispatch(x * 2, handle=bhandle)
    check(all(v is None for v in rest[:4]) and torch.equal(cbx, bx * 2), "without top-k: the cached dispatch")
    cbc, _, _ = buf.combine(cbx, bhandle)
    check(torch.equal(cbc, ((x * 2).float() * times).bfloat16()), "without top-k: the combine after the cached dispatch")
    (bfx, bfs), *_ = buf.dispatch((x8, sc), **by_rank)
    check(torch.equal(bfx.view(torch.uint8), fx.view(torch.uint8)) and torch.equal(bfs, fs), "without top-k: FP8 rows and scales")

    # Refused across nodes, by name, before anything is sent.
    for what, call, exc in (
        ("num_worst_tokens", lambda: buf.dispatch(x, **args, num_worst_tokens=w * T), ValueError),
    ):
        try:
            call()
        except exc as e:
            check("across nodes" in str(e) or "one node" in str(e), f"{what}: {e}")
        else:
            raise AssertionError(f"{what} across nodes was not refused")
    # Still usable after the refusals.
    rz = buf.dispatch(x, **args)
    check_dispatch(*rz[:5], "dispatch after the refusals")
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {r}: deep_ep_normal_across {variant} ok", flush=True)


def deep_ep_low_latency():
    """doorbell.deep_ep's low-latency mode through DeepEP's calls, on a gloo process group (ranks
    may share a GPU): every expert's rows packed from row 0 in source order (layout_range,
    src_info, counts, the stats added up), bf16 and FP8 (plain, power-of-two and UE8M0 scales),
    with and without the receive hook, and the combine applying the weights given to it, from x
    and from the zero-copy buffer."""
    import os

    import torch.distributed as dist

    from doorbell import deep_ep
    from doorbell.deep_ep.utils.math import calc_diff, per_token_cast_back

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _gloo_group(r, w)
    group = dist.group.WORLD
    T, H, K, E = 48, 512, 4, 4 * w
    local = E // w
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, w, E), low_latency_mode=True)
    torch.manual_seed(100 + r)
    x = torch.full((T, H), float(r - 8), dtype=torch.bfloat16, device="cuda")
    x[:, -128:] = torch.arange(T, device="cuda").to(torch.bfloat16).view(-1, 1)
    topk_idx = torch.topk(torch.rand(T, E, device="cuda"), K, dim=1).indices.to(deep_ep.topk_idx_t)
    topk_idx[::5, 2] = -1
    topk_weights = torch.rand(T, K, device="cuda")
    all_idx = [torch.zeros(T, K, dtype=torch.int64) for _ in range(w)]
    dist.all_gather(all_idx, topk_idx.cpu())
    stats = torch.zeros(local, dtype=torch.int32, device="cuda")
    calls = 0
    for fp8, rnd, ue8m0 in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        for hook_mode in (False, True):
            calls += 1
            recv, count, handle, ev, hook = buf.low_latency_dispatch(
                x, topk_idx, T, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, round_scale=rnd,
                use_ue8m0=ue8m0, async_finish=not hook_mode, return_recv_hook=hook_mode,
            )
            hook() if hook_mode else ev.current_stream_wait()
            what = f"fp8={fp8} round={rnd} ue8m0={ue8m0} hook={hook_mode}"
            if fp8:
                check(recv[1].stride(1) == 1, f"{what}: scales column-major, as DeepEP's")
                rows = per_token_cast_back(recv[0].view(-1, H), recv[1].contiguous().view(-1, recv[1].shape[2])).view(local, w * T, H)
            else:
                rows = recv
            src_info, layout_range = handle[0], handle[1]
            for le in range(local):
                e = r * local + le
                n = int(count[le])
                want = sum(int((all_idx[j] == e).sum()) for j in range(w))
                check(n == want, f"{what}: expert {le} has {n} rows, {want} selected it")
                ranges = layout_range[le].cpu().tolist()
                begin = 0
                for j in range(w):
                    b, c = ranges[j] >> 32, ranges[j] & 0xFFFFFFFF
                    check(b == begin and c == int((all_idx[j] == e).sum()), f"{what}: expert {le} range of source {j}: {b}, {c}")
                    part = rows[le, b:b + c].float()
                    check(bool((part[:, :-128] == float(j - 8)).all()), f"{what}: expert {le} rows from {j}")
                    toks = src_info[le, b:b + c].cpu()
                    sel = (all_idx[j] == e).any(dim=1).nonzero().flatten()
                    check(sorted(toks.tolist()) == sorted(sel.tolist()), f"{what}: expert {le} source tokens from {j}")
                    if not rnd:
                        check(bool((part[:, -128:] == toks.cuda().float().view(-1, 1)).all()), f"{what}: token ids in the rows")
                    begin += c
            check(int(stats.sum()) == calls * int(count.sum()), f"{what}: stats {stats.tolist()}")
            gemm = rows.clone()
            for zero_copy in (False, True):
                if zero_copy:
                    buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = gemm
                out, ev2, hook2 = buf.low_latency_combine(
                    gemm, topk_idx, topk_weights, handle, zero_copy=zero_copy,
                    async_finish=not hook_mode, return_recv_hook=hook_mode,
                )
                hook2() if hook_mode else ev2.current_stream_wait()
                ref = x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1, keepdim=True)
                diff = calc_diff(ref, out)
                check(not bool(out.isnan().any()), f"{what}: NaN in the combine")
                if not rnd:  # rounded scales move the token ids (DeepEP's test skips this too)
                    check(diff < (1e-3 if fp8 else 1e-5), f"{what} zero_copy={zero_copy}: combine diff {diff}")
    # Two dispatches in flight (DeepEP's two-batch overlap): send A, send B, then A's hook and
    # B's, or B's first; each receive half pairs with its own send.
    for order in ((0, 1), (1, 0)):
        halves = []
        for factor in (1.0, 2.0):
            halves.append(buf.low_latency_dispatch(x * factor, topk_idx, T, E, use_fp8=False, return_recv_hook=True))
        for i in order:
            halves[i][4]()
        for factor, (recv, count, handle, _, _) in zip((1.0, 2.0), halves):
            for le in range(local):
                for j in range(w):
                    b, c = int(handle[1][le, j]) >> 32, int(handle[1][le, j]) & 0xFFFFFFFF
                    part = recv[le, b:b + c, :-128].float()
                    check(bool((part == factor * (j - 8)).all()),
                          f"two in flight, hooks {order}: batch x{factor} expert {le} rows from {j}")
    # DeepEP's wait statistics: [ranks] int64 cycles each receive waited for each source, added
    # up. The last rank holds its sends back about 20 ms (a GPU sleep before both calls), so on
    # every other rank its entry is the largest, in the dispatch's and in the combine's.
    for hook_mode in (False, True):
        waits_d = torch.zeros(w, dtype=torch.int64, device="cuda")
        waits_c = torch.zeros(w, dtype=torch.int64, device="cuda")
        dist.barrier()
        late = r == w - 1
        if late:
            torch.cuda._sleep(40_000_000)
        recv, count, handle, ev, hook = buf.low_latency_dispatch(
            x, topk_idx, T, E, use_fp8=False, dispatch_wait_recv_cost_stats=waits_d,
            async_finish=not hook_mode, return_recv_hook=hook_mode,
        )
        hook() if hook_mode else ev.current_stream_wait()
        if late:
            torch.cuda._sleep(40_000_000)
        out, ev2, hook2 = buf.low_latency_combine(
            recv.clone(), topk_idx, topk_weights, handle, combine_wait_recv_cost_stats=waits_c,
            async_finish=not hook_mode, return_recv_hook=hook_mode,
        )
        hook2() if hook_mode else ev2.current_stream_wait()
        torch.cuda.synchronize()
        for name, waits in (("dispatch", waits_d), ("combine", waits_c)):
            got = waits.cpu().tolist()
            check(all(v > 0 for v in got), f"hook={hook_mode}: {name} wait cycles {got}: every source waited for")
            if not late:
                check(max(range(w), key=lambda j: got[j]) == w - 1 and got[w - 1] > 5_000_000,
                      f"hook={hook_mode}: {name} wait cycles {got}: the late rank {w - 1} the largest")
    # use_logfmt with DOORBELL_DEEP_EP_LOG_ROWS=1: the rows go back as 10-bit log rows: close to
    # the bf16 combine (DeepEP's test allows 1e-5 after a bf16 dispatch), not the same bytes; a
    # NaN in a row shows in the output.
    os.environ["DOORBELL_DEEP_EP_LOG_ROWS"] = "1"
    rough = torch.randn_like(gemm) * 0.5
    plain, _, _ = buf.low_latency_combine(rough, topk_idx, topk_weights, handle)
    for hook_mode in (False, True):
        logfmt, ev3, hook3 = buf.low_latency_combine(
            rough, topk_idx, topk_weights, handle, use_logfmt=True,
            async_finish=not hook_mode, return_recv_hook=hook_mode,
        )
        hook3() if hook_mode else ev3.current_stream_wait()
        diff = calc_diff(plain.float(), logfmt.float())
        check(diff < 1e-5 and not bool(logfmt.isnan().any()), f"log rows (hook={hook_mode}): diff {diff} from bf16")
        check(not torch.equal(plain, logfmt), "log rows differ from bf16 rows somewhere (they were encoded)")
    hit = torch.tensor([1 if r == 0 and int(handle[1][0, 0]) & 0xFFFFFFFF > 0 else 0])
    if int(hit):
        rough[0, int(handle[1][0, 0]) >> 32, 3] = float("nan")
    dist.all_reduce(hit)
    nans = []
    for log_rows in (False, True):
        got, _, _ = buf.low_latency_combine(rough, topk_idx, topk_weights, handle, use_logfmt=log_rows)
        n = torch.tensor([int(got.isnan().sum())])
        dist.all_reduce(n)
        nans.append(int(n))
    check(nans[1] >= nans[0] > 0 if int(hit) else nans == [0, 0],
          f"a NaN row value: {nans[0]} NaN outputs with bf16 rows, {nans[1]} with log rows")
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {r}: deep_ep_low_latency ok", flush=True)


def _masked_decode_step(buf, r, w, step, left_out):
    """One decode step of the rank-mask cases through DeepEP's API (T=32 tokens, hidden 256,
    top-4 of 4 experts a rank, bf16), checked: every (expert, source) range, its rows and each
    expert's count with the ranks in `left_out` sending nothing, and the combine with their
    experts adding nothing."""
    from doorbell import deep_ep

    T, H, K, E = 32, 256, 4, 4 * w
    local = E // w

    def routing(src):
        g = torch.Generator().manual_seed(1000 * step + src)
        idx = torch.topk(torch.rand(T, E, generator=g), K, dim=1).indices
        idx[step % 3::4, 1] = -1
        return idx, torch.rand(T, K, generator=g)

    x = torch.full((T, H), float(r - 8), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(T).to(torch.bfloat16).view(-1, 1)
    idx, wts = routing(r)
    idx_d = idx.to(deep_ep.topk_idx_t).cuda()
    recv, count, handle, _, _ = buf.low_latency_dispatch(x.cuda(), idx_d, T, E, use_fp8=False)
    counts = count.tolist()
    for le in range(local):
        e = r * local + le
        for j in range(w):
            b, c = int(handle[1][le, j]) >> 32, int(handle[1][le, j]) & 0xFFFFFFFF
            want = 0 if j in left_out else int((routing(j)[0] == e).sum())
            check(c == want, f"step {step}: expert {e} got {c} rows from {j}, want {want}")
            if c:
                part = recv[le, b:b + c].float().cpu()
                check(bool((part[:, :-128] == j - 8).all()), f"step {step}: expert {e} rows from {j}")
        want_total = sum(int((routing(j)[0] == e).sum()) for j in range(w) if j not in left_out)
        check(counts[le] == want_total, f"step {step}: expert {e} count {counts[le]}, want {want_total}")
    out, _, _ = buf.low_latency_combine(recv, idx_d, wts.cuda(), handle)
    live = torch.tensor([[int(t) >= 0 and int(t) // local not in left_out for t in row] for row in idx.tolist()])
    ref = x.float() * (wts * live).sum(dim=1, keepdim=True)
    got = out.float().cpu()
    check(bool(torch.isfinite(got).all()), f"step {step}: combine not finite")
    check(torch.allclose(got, ref, rtol=1e-2, atol=1e-2), f"step {step}: combine off by {(got - ref).abs().max()}")


def deep_ep_masks(steps):
    """DeepEP's rank masks (enable_shrink), set by the caller: after one round with every rank,
    each rank masks the last one, which then makes no more low-latency calls; the others run
    `steps` decode steps (new routing each, every step's dispatch and combine checked): no row
    from or to the masked rank, its experts' selections adding nothing to the combine, the
    mask reported by low_latency_query_mask_buffer, and nothing waiting for it."""
    import os

    import torch.distributed as dist

    from doorbell import deep_ep

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _gloo_group(r, w)
    T, H, E, victim = 32, 256, 4 * w, w - 1
    buf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, w, E),
                         low_latency_mode=True, enable_shrink=True)
    status = torch.zeros(w, dtype=torch.int32, device="cuda")
    for step in range(steps + 1):
        if step == 1:
            buf.low_latency_update_mask_buffer(victim, True)
            buf.low_latency_query_mask_buffer(status)
            check(status.tolist() == [1 if j == victim else 0 for j in range(w)], f"mask status {status.tolist()}")
            if r == victim:
                break  # a masked rank makes no more calls (DeepEP's failed rank)
        _masked_decode_step(buf, r, w, step, set() if step == 0 else {victim})
    torch.cuda.synchronize()
    dist.barrier()
    buf.destroy()
    dist.destroy_process_group()
    print(f"rank {r}: deep_ep_masks {steps} ok", flush=True)


def deep_ep_shrink(steps):
    """DeepEP's enable_shrink with a rank that dies: after one decode step with every rank, the
    last rank kills itself (SIGKILL); the others run `steps` more decode steps through the same
    Buffer, each dispatch's ranges, rows and counts and each combine checked with the dead
    rank's rows and experts left out, and the mask lists it. No step may fail or wait past the
    watchdog's finding (the first after the kill leaves the dead rank out by itself)."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from doorbell import deep_ep

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _gloo_group(r, w)
    victim = w - 1
    survivors = dist.new_group(list(range(victim)))  # every rank makes it, before the kill
    T, H, E = 32, 256, 4 * w
    buf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, w, E),
                         low_latency_mode=True, enable_shrink=True)
    status = torch.zeros(w, dtype=torch.int32, device="cuda")
    first_after = None
    for step in range(steps + 1):
        if step == 1 and r == victim:
            torch.cuda.synchronize()
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        _masked_decode_step(buf, r, w, step, set() if step == 0 else {victim})
        if step == 1:
            first_after = time.monotonic() - t0
            # The watchdog's finding (a killed process: within about 2 s) bounds this step.
            check(first_after < 10.0, f"the first step after the kill took {first_after:.1f} s")
            buf.low_latency_query_mask_buffer(status)
            check(status.tolist() == [1 if j == victim else 0 for j in range(w)], f"mask status {status.tolist()}")
    torch.cuda.synchronize()
    dist.barrier(group=survivors)
    print(f"rank {r}: deep_ep_shrink {steps} ok (the first step after the kill took {first_after:.3f} s)", flush=True)
    os._exit(0)  # the dead rank's process group and exchange are not torn down collectively


def deep_ep_low_latency_graph(replays):
    """doorbell.deep_ep's low-latency dispatch + combine captured in one CUDA graph (FP8 dispatch,
    DeepEP's default, and the hook halves), replayed `replays` times with new inputs and weights
    each time; every replay's combined rows checked against x times the sum of the weights."""
    import os

    import torch.distributed as dist

    from doorbell import deep_ep
    from doorbell.deep_ep.utils.math import calc_diff, per_token_cast_back

    r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _gloo_group(r, w)
    group = dist.group.WORLD
    T, H, K, E = 32, 256, 4, 4 * w
    buf = deep_ep.Buffer(group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, w, E), low_latency_mode=True)
    torch.manual_seed(200 + r)
    x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    idx = torch.topk(torch.rand(T, E, device="cuda"), K, dim=1).indices.to(deep_ep.topk_idx_t)
    idx[::6, 1] = -1
    wts = torch.ones(T, K, device="cuda")

    def step():
        recv, _, handle, _, hook = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True, return_recv_hook=True)
        hook()
        rows = per_token_cast_back(recv[0].view(-1, H), recv[1].contiguous().view(-1, H // 128)).view(recv[0].shape)
        out, _, hook2 = buf.low_latency_combine(rows, idx, wts, handle, return_recv_hook=True)
        hook2()
        return out

    def want():
        return x.float() * wts.masked_fill(idx == -1, 0).sum(dim=1, keepdim=True)

    x.fill_(1.0)
    out = step()  # eager first: the shape's first call builds the exchange (collective)
    torch.cuda.synchronize()
    check(calc_diff(want(), out) < 1e-3, f"LL deep_ep eager rank {r}")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    for i in range(replays):
        x.copy_(torch.randn(T, H, device="cuda").to(torch.bfloat16))
        wts.copy_(torch.rand(T, K, device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        d = calc_diff(want(), outs)
        check(d < 1e-3 and not bool(outs.isnan().any()), f"LL deep_ep graph replay {i} rank {r}: diff {d}")
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {r}: deep_ep_low_latency_graph ok", flush=True)


def deep_ep_utils():
    """The helpers doorbell.deep_ep.utils gives DeepEP's tests: FP8 casts both ways (column-major
    and UE8M0 scales), calc_diff, inplace_unique, hash_tensor, bench and bench_kineto."""
    from doorbell import deep_ep
    from doorbell.deep_ep.utils.math import calc_diff, hash_tensor, inplace_unique, per_token_cast_back, per_token_cast_to_fp8
    from doorbell.deep_ep.utils.testing import bench, bench_kineto

    check(deep_ep.topk_idx_t == torch.int64, "topk_idx_t")
    x = torch.randn(64, 512, device="cuda").to(torch.bfloat16)
    q, s = per_token_cast_to_fp8(x)
    back = per_token_cast_back(q, s.T.contiguous().T)
    check(calc_diff(back.float(), x.float()) < 1e-3, "FP8 round trip")
    e = torch.tensor([[127, 128, 126, 130]], dtype=torch.uint8, device="cuda")
    u = per_token_cast_back(torch.ones(1, 512, device="cuda").to(torch.float8_e4m3fn), e.view(torch.int32)).float()
    check(u[0, ::128].tolist() == [1.0, 2.0, 0.5, 8.0], f"UE8M0 scales {u[0, ::128].tolist()}")
    r = torch.tensor([[3, 1, 3, -1], [0, 1, 2, 3]], device="cuda")
    inplace_unique(r, 4)
    check(r.tolist() == [[3, 1, -1, -1], [3, 2, 1, 0]], f"inplace_unique {r.tolist()}")
    check(hash_tensor(x) == hash_tensor(x.clone()) and hash_tensor(x) != hash_tensor(x + 1), "hash_tensor")
    y = torch.empty_like(x)
    mean, lo, hi = bench(lambda: y.copy_(x), num_warmups=3, num_tests=5)
    check(0 < lo <= mean <= hi < 1.0, f"bench {mean} {lo} {hi}")
    z = x.clone()
    t = bench_kineto(lambda: z.abs_(), "AbsFunctor", num_tests=3, suppress_kineto_output=True)
    check(isinstance(t, float) and t > 0, f"bench_kineto {t}")


def main():
    case = sys.argv[1]
    if case == "deep_ep_normal":  # its own process group; doorbell joins through it
        deep_ep_normal()
        return
    if case == "deep_ep_normal_across":
        deep_ep_normal_across(sys.argv[2])
        return
    if case == "deep_ep_low_latency":
        deep_ep_low_latency()
        return
    if case == "deep_ep_low_latency_graph":
        deep_ep_low_latency_graph(int(sys.argv[2]))
        return
    if case == "deep_ep_shrink":
        deep_ep_shrink(int(sys.argv[2]))
        return
    if case == "deep_ep_masks":
        deep_ep_masks(int(sys.argv[2]))
        return
    if case == "deep_ep_utils":
        torch.cuda.set_device(int(__import__("os").environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        deep_ep_utils()
        print("deep_ep_utils ok", flush=True)
        return
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
