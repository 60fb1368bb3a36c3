"""``python -m doorbell.bench allreduce|alltoall|moe|deep_ep`` under torchrun (one rank per GPU): doorbell
beside ``torch.distributed`` (NCCL) and, for allreduce where the machine allows it, PyTorch
symmetric memory's one-shot allreduce, in the same run. The table has the Rust examples'
columns (size, count, type, then per library CUDA-graph and eager time in us with busbw in GB/s,
max over ranks, and doorbell's speedup over the fastest peer); ``#wrong`` counts elements of
doorbell's result that differ from the exact answer (max over ranks). ``deep_ep`` times
doorbell.deep_ep (DeepEP's API) beside doorbell's own calls: single-call GPU p50/p99, and in
the eager tables the host's time to enqueue one call (``api host us``, ``own host us``). NVLink
multicast stays off (the variables set below)."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, List, Optional

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _hold(iters: int, per_call_us: float = 20.0) -> None:
    """Queues a GPU sleep longer than the host takes to enqueue ``iters`` eager calls (2 ms +
    ``per_call_us`` a call; 20 as the Rust harness), so the host's scheduling jitter stays out of
    eager timings: the GPU then runs the queued calls back to back."""
    import torch

    torch.cuda._sleep(int((2000 + per_call_us * iters) * 1e-6 * 2.0e9))  # cycles at about 2 GHz


def _time_us(fn: Callable[[], Any], iters: int, graph: bool) -> Optional[float]:
    """Mean time of one call, eager or replayed from a CUDA graph of ``iters`` calls; None when
    the call cannot run (or cannot be captured) here."""
    import torch

    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(iters):
                    fn()
            run: Callable[[], Any] = g.replay
            run()  # the first replay uploads the graph
        else:

            def run() -> None:
                for _ in range(iters):
                    fn()

        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if not graph:
            _hold(iters)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) * 1e3 / iters
    except Exception:  # noqa: BLE001 - a peer that cannot run here shows as "-"
        torch.cuda.synchronize()
        return None


def _time_calls(fn: Callable[[], Any], iters: int, graph: bool, host_us: float = 20.0) -> Optional[List[float]]:
    """Single calls, us each: ``iters`` eager launches (queued behind a hold of ``host_us`` a call) with an event between every two, or a
    CUDA graph of ``iters`` calls with an event node between every two (replayed once untimed,
    then timed). The first call is left out (it absorbs the ranks' skew in leaving the barrier
    before it). None when the call (or the graph's event nodes) cannot run here."""
    import torch
    import torch.distributed as dist

    try:
        marks = [torch.cuda.Event(enable_timing=True, external=graph) for _ in range(iters + 1)]
        fn()
        torch.cuda.synchronize()
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i, m in enumerate(marks):
                    m.record()
                    if i < iters:
                        fn()
            g.replay()
            torch.cuda.synchronize()
            dist.barrier()
            g.replay()
        else:
            dist.barrier()
            _hold(iters, host_us)
            for i, m in enumerate(marks):
                m.record()
                if i < iters:
                    fn()
        torch.cuda.synchronize()
        return [float(a.elapsed_time(b)) * 1e3 for a, b in zip(marks[1:], marks[2:])]
    except Exception:  # noqa: BLE001 - a peer that cannot run here shows as "-"
        torch.cuda.synchronize()
        return None


def _time_paired(a_fn: Callable[[], Any], b_fn: Callable[[], Any], iters: int) -> Optional[List[List[float]]]:
    """Calls that wait for the GPU on the host, timed in pairs: ``iters`` rounds of one call of
    each, the order alternating, each call between two events and waited for. Returns ``[a's
    times, b's times, a - b per round]`` in us, or None when either cannot run here. A drift in
    the host's speed (its wake-up time after a wait moved such p50s by half between runs of one
    machine) then reaches both alike, and the per-round difference is the cost."""
    import torch
    import torch.distributed as dist

    try:
        a_fn()
        b_fn()
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out: List[List[float]] = [[], [], []]
        for i in range(iters):
            pair = [0.0, 0.0]
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                start.record()
                (a_fn if k == 0 else b_fn)()
                end.record()
                end.synchronize()
                pair[k] = float(start.elapsed_time(end)) * 1e3
            out[0].append(pair[0])
            out[1].append(pair[1])
            out[2].append(pair[0] - pair[1])
        return out
    except Exception:  # noqa: BLE001 - a call that cannot run here shows as "-"
        torch.cuda.synchronize()
        return None


def _host_calls(fn: Callable[[], Any], iters: int, hold: bool) -> Optional[List[float]]:
    """Host wall time (``time.perf_counter``, us) of each of ``iters`` eager calls, after one
    untimed call and a barrier. With ``hold`` the calls queue behind a GPU sleep with room for
    200 us of host time a call, so each time is what the host takes to enqueue one call, never a
    wait for the GPU; a call that synchronizes with the host would only wait such a hold out, so
    those go without (``hold=False``) and their times include the GPU's. None when the call
    cannot run here."""
    import time

    import torch
    import torch.distributed as dist

    try:
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        if hold:
            _hold(10 * iters)
        out: List[float] = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return out
    except Exception:  # noqa: BLE001 - a peer that cannot run here shows as "-"
        torch.cuda.synchronize()
        return None


def _max(v: Optional[float]) -> Optional[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([-1.0 if v is None else v], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mine = torch.tensor([1.0 if v is None else 0.0], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # missing anywhere: missing
    return None if mine.item() > 0 else float(t.item())


def _fmt(v: Optional[float], prec: int) -> str:
    return "-" if v is None else f"{v:.{prec}f}"


def _sizes(lo: int, hi: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _bus(size: int, us: Optional[float], factor: float) -> Optional[float]:
    return None if us is None else size / us / 1e3 * factor


def _best(*v: Optional[float]) -> Optional[float]:
    got = [x for x in v if x is not None]
    return min(got) if got else None


def _ratio(peer: Optional[float], ours: Optional[float]) -> Optional[float]:
    return None if peer is None or ours is None else peer / ours


def _collective(a: argparse.Namespace, comm: Any) -> None:
    import torch
    import torch.distributed as dist

    w = comm.world_size
    me = comm.rank == 0
    allreduce = a.collective == "allreduce"
    factor = 2 * (w - 1) / w if allreduce else (w - 1) / w
    peer3 = "symm one-shot" if allreduce else "-"
    if me:
        print(f"# doorbell {a.collective}, {w} ranks; times in us (max over ranks), busbw in GB/s")
        print(
            f"#{'size':>11} {'count':>11} {'type':>8} | {'graph':>8} {'busbw':>7} {'eager':>8} {'busbw':>7} {'#wrong':>6} | "
            f"{'graph':>8} {'busbw':>7} {'eager':>8} {'busbw':>7} | {'graph':>8} {'eager':>8} | {'x graph':>7} {'x eager':>7}"
        )
        print(
            f"#{'(B)':>11} {'(elements)':>11} {'':>8} | {'doorbell':^39} | {'torch.distributed (NCCL)':^33} | "
            f"{peer3:^17} | {'speedup':^15}"
        )
    for size in _sizes(a.min_bytes, a.max_bytes):
        n = max(size // 4, w)
        n -= n % w
        size = n * 4
        if allreduce:
            t = torch.empty(n, device="cuda")
            t.copy_(torch.arange(n, device="cuda") % 7 + comm.rank)
            comm.all_reduce(t)
            want = (torch.arange(n, device="cuda") % 7) * w + w * (w - 1) // 2
            wrong = int((t != want).sum().item())
            ours = [_time_us(lambda: comm.all_reduce(t), a.iters, g) for g in (True, False)]
            nccl = [_time_us(lambda: dist.all_reduce(t), a.iters, g) for g in (True, False)]
            try:
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(n, device="cuda")
                name = dist.group.WORLD.group_name
                symm_mem.rendezvous(buf, name)
                third = [
                    _time_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name), a.iters, g)
                    for g in (True, False)
                ]
            except Exception:  # noqa: BLE001 - not available on this machine
                third = [None, None]
        else:
            inp = (torch.arange(n, device="cuda", dtype=torch.int32) // (n // w)) * 1000 + comm.rank
            out = torch.empty_like(inp)
            comm.all_to_all(out, inp)
            # Block p of my output is rank p's block for me: (my rank) * 1000 + p.
            want = comm.rank * 1000 + (torch.arange(n, device="cuda", dtype=torch.int32) // (n // w))
            wrong = int((out != want).sum().item())
            ours = [_time_us(lambda: comm.all_to_all(out, inp), a.iters, g) for g in (True, False)]
            nccl = [_time_us(lambda: dist.all_to_all_single(out, inp), a.iters, g) for g in (True, False)]
            third = [None, None]
        ours = [_max(v) for v in ours]
        nccl = [_max(v) for v in nccl]
        third = [_max(v) for v in third]
        wrong = int(_max(float(wrong)) or 0)
        if me:
            print(
                f"{size:>12} {n:>11} {'float' if allreduce else 'int32':>8} | "
                f"{_fmt(ours[0], 2):>8} {_fmt(_bus(size, ours[0], factor), 1):>7} "
                f"{_fmt(ours[1], 2):>8} {_fmt(_bus(size, ours[1], factor), 1):>7} {wrong:>6} | "
                f"{_fmt(nccl[0], 2):>8} {_fmt(_bus(size, nccl[0], factor), 1):>7} "
                f"{_fmt(nccl[1], 2):>8} {_fmt(_bus(size, nccl[1], factor), 1):>7} | "
                f"{_fmt(third[0], 2):>8} {_fmt(third[1], 2):>8} | "
                f"{_fmt(_ratio(_best(nccl[0], third[0]), ours[0]), 2):>7} "
                f"{_fmt(_ratio(_best(nccl[1], third[1]), ours[1]), 2):>7}",
                flush=True,
            )


def _moe(a: argparse.Namespace, comm: Any) -> None:
    import torch

    from . import moe

    w = comm.world_size
    hidden, experts, topk, tokens = 7168, 64 * w, 8, a.tokens
    buf = moe.Buffer(comm, hidden, experts, tokens, topk)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, device="cuda")[:topk] for _ in range(tokens)]).int()
    wts = torch.ones(tokens, topk, device="cuda")
    r = buf.dispatch(x, idx, wts)
    handle = r[4]

    def dispatch() -> None:
        buf.dispatch(x, idx, wts)

    def combine() -> None:
        buf.combine(buf.get_combine_buffer(), handle)

    d = [_max(_time_us(dispatch, a.iters, g)) for g in (True, False)]
    c = [_max(_time_us(combine, a.iters, g)) for g in (True, False)]
    if comm.rank == 0:
        print(f"# doorbell MoE (normal mode), {w} ranks, {tokens} tokens x top-{topk} of {experts}, hidden {hidden}, bf16")
        print(f"#{'call':>9} | {'graph us':>9} {'eager us':>9}")
        print(f"{'dispatch':>10} | {_fmt(d[0], 1):>9} {_fmt(d[1], 1):>9}")
        print(f"{'combine':>10} | {_fmt(c[0], 1):>9} {_fmt(c[1], 1):>9}")


def _p(v: Optional[List[float]], q: float) -> Optional[float]:
    """The ``q`` quantile of single-call times (None when they could not be taken)."""
    if not v:
        return None
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def _deep_ep(a: argparse.Namespace) -> None:
    """doorbell.deep_ep (DeepEP's API) beside doorbell's own calls on the same kernels and
    buffers: the low-latency mode at the decode shape and the normal mode at the prefill shape,
    per call GPU p50/p99 (single calls, max over ranks) in CUDA graphs and eager, GB/s as DeepEP's
    tests count bytes, the API's cost over the native call, SMs and GPU memory. The eager tables
    add the host's wall time to enqueue one call, the API's and doorbell's own (``api host us``,
    ``own host us``: median over the calls, max over ranks), which the GPU times leave out; the
    API's normal dispatch waits for its row count, so its host time includes the GPU's."""
    import torch
    import torch.distributed as dist

    from . import deep_ep, moe
    from .deep_ep._buffer import _normal_bytes_per_token

    group = dist.group.WORLD
    w, rank = dist.get_world_size(), dist.get_rank()
    hidden, topk = 7168, 8
    experts = (a.experts + w - 1) // w * w
    m = a.ll_tokens
    torch.manual_seed(rank)
    free0 = torch.cuda.mem_get_info()[0]
    buf = deep_ep.Buffer(
        group,
        _normal_bytes_per_token(w, hidden, topk) * a.tokens,
        deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, w, experts),
        low_latency_mode=True,
    )
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    local = experts // w

    def routing(tokens: int) -> Any:
        scores = torch.randn(tokens, experts, device="cuda").abs() + 1
        return torch.topk(scores, topk, dim=1).indices

    def row(
        name: str, api_fn: Callable[[], Any], own_fn: Callable[[], Any], nbytes: int, graph: bool, api_syncs: bool = False,
        host_us: float = 20.0, own_syncs: bool = False,
    ) -> List[Optional[float]]:
        """Times the API's call and doorbell's own and prints their row: single-call GPU p50 and
        p99, max over ranks (eager calls queued behind a GPU sleep with ``host_us`` of host time
        a call, so the GPU times leave the host's out); eager rows add each call's host time to
        enqueue it (median, max over ranks; ``api_syncs``: the API's call waits for the GPU, so
        it is timed without a hold; ``own_syncs`` the same for doorbell's own)."""
        api, native = _time_calls(api_fn, a.iters, graph, host_us), _time_calls(own_fn, a.iters, graph, host_us)
        vals = [_max(_p(api, 0.5)), _max(_p(api, 0.99)), _max(_p(native, 0.5)), _max(_p(native, 0.99))]
        cost = None if vals[0] is None or vals[2] is None else vals[0] - vals[2]
        gbs = None if vals[0] is None else nbytes / vals[0] / 1e3
        host: List[Optional[float]] = []
        if not graph:
            host = [
                _max(_p(_host_calls(api_fn, a.iters, hold=not api_syncs), 0.5)),
                _max(_p(_host_calls(own_fn, a.iters, hold=not own_syncs), 0.5)),
            ]
        if rank == 0:
            line = (
                f"{name:>26} | {_fmt(vals[0], 1):>7} {_fmt(vals[1], 1):>7} | {_fmt(vals[2], 1):>7} "
                f"{_fmt(vals[3], 1):>7} | {_fmt(cost, 2):>7} | {_fmt(gbs, 1):>7}"
            )
            if not graph:
                line += f" | {_fmt(host[0], 1):>11} {_fmt(host[1], 1):>11}"
            print(line, flush=True)
        return vals + host

    header = f"{'call':>26} | {'api p50':>7} {'p99':>7} | {'own p50':>7} {'p99':>7} | {'cost us':>7} | {'GB/s':>7}"
    eager_header = f"{header} | {'api host us':>11} {'own host us':>11}"

    # ---- low latency, decode shape ----
    x = torch.randn(m, hidden, device="cuda").to(torch.bfloat16)
    idx = routing(m).to(deep_ep.topk_idx_t)
    wts = torch.rand(m, topk, device="cuda")
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=False)
    y = recv.clone()
    free1 = torch.cuda.mem_get_info()[0]
    native = buf._ll[(hidden, experts, m, topk)]
    idx32 = idx.int()
    cap = w * m
    px = torch.empty((local, cap, hidden), dtype=torch.bfloat16, device="cuda")
    px8 = torch.empty((local, cap, hidden), dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty((local, hidden // 128, cap), dtype=torch.float32, device="cuda")
    count = torch.empty(local, dtype=torch.int32, device="cuda")
    src = torch.empty((local, cap), dtype=torch.int32, device="cuda")
    rng = torch.empty((local, w), dtype=torch.int64, device="cuda")
    out = torch.empty((m, hidden), dtype=torch.bfloat16, device="cuda")
    selections = int((idx >= 0).sum())

    def stream() -> int:
        return int(torch.cuda.current_stream().cuda_stream)

    def own_dispatch(fp8: bool) -> None:
        target, sc = (px8, scales.data_ptr()) if fp8 else (px, 0)
        native.dispatch_packed(x.data_ptr(), idx32.data_ptr(), m, target.data_ptr(), sc, False, False,
                               src.data_ptr(), rng.data_ptr(), count.data_ptr(), 0, 0, False, stream())

    def own_combine() -> None:
        native.combine_packed(y.data_ptr(), handle[0].data_ptr(), handle[1].data_ptr(), idx32.data_ptr(),
                              wts.data_ptr(), m, out.data_ptr(), 0, True, True, stream())

    if rank == 0:
        print(f"# doorbell.deep_ep against doorbell's own calls, {w} ranks, {torch.cuda.get_device_name()}")
        print(f"# low latency: {m} tokens x top-{topk} of {experts} experts, hidden {hidden}; {sms} SMs (every SM); "
              f"buffers {(free0 - free1) / 2**20:.0f} MiB a rank (free-memory drop, normal mode's included once built)")
        print("# GB/s as DeepEP's tests count: dispatch = selections x (FP8: hidden + hidden/128 x 4; bf16: 2 hidden), "
              "combine = selections x 2 hidden, over the API's p50")
    for graph in (True, False):
        if rank == 0:
            if graph:
                print(f"# CUDA graph, single calls\n{header}")
            else:
                print("# eager, single calls; host us: the host's time to enqueue one call (perf_counter, the calls "
                      f"queued behind a GPU sleep), median, max over ranks\n{eager_header}")
        for fp8 in (True, False):
            nbytes = selections * ((hidden + hidden // 128 * 4) if fp8 else 2 * hidden)
            row(f"ll dispatch {'fp8' if fp8 else 'bf16'}",
                lambda: buf.low_latency_dispatch(x, idx, m, experts, use_fp8=fp8), lambda: own_dispatch(fp8), nbytes, graph)
        row("ll combine", lambda: buf.low_latency_combine(y, idx, wts, handle), own_combine, selections * 2 * hidden, graph)

        def api_period() -> None:
            r = buf.low_latency_dispatch(x, idx, m, experts, use_fp8=True)
            buf.low_latency_combine(y, idx, wts, r[2])

        def own_period() -> None:
            own_dispatch(True)
            native.combine_packed(y.data_ptr(), src.data_ptr(), rng.data_ptr(), idx32.data_ptr(), wts.data_ptr(),
                                  m, out.data_ptr(), 0, True, True, stream())

        row("ll dispatch+combine", api_period, own_period, 0, graph)

    # ---- normal mode, prefill shape ----
    t = a.tokens
    xn = torch.randn(t, hidden, device="cuda").to(torch.bfloat16)
    idxn = routing(t).to(deep_ep.topk_idx_t)
    wn = torch.rand(t, topk, device="cuda")
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxn, experts)
    recv_x, _, _, _, nhandle, _ = buf.dispatch(xn, topk_idx=idxn, topk_weights=wn, num_tokens_per_rank=per_rank,
                                               is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    own_buf = buf._normal[(hidden, experts, topk)]
    own_handle = own_buf.dispatch(xn, idxn, wn)[4]
    rows_in = int(recv_x.shape[0])
    if rank == 0:
        print(f"# normal mode: {t} tokens x top-{topk} of {experts} experts, hidden {hidden}, bf16; "
              f"{max(_normal_sms(deep_ep), w)} SMs; GB/s = received rows x 2 hidden over the API's p50 (DeepEP's NVL count)")
        print("# eager, single calls; the worst-case dispatch and the combine queued behind a GPU sleep of 1 ms a "
              "call (GPU times without the host's); both combines given the API dispatch's recv_x. Host us as above; "
              "the API's dispatch reads the row count on the host, as DeepEP's, so it cannot queue ahead: its GPU "
              "and host times include the wait for the GPU (the kernels, every rank's arrival, the count's copy)"
              f"\n{eager_header}")
    row("normal dispatch", lambda: buf.dispatch(xn, topk_idx=idxn, topk_weights=wn, num_tokens_per_rank=per_rank,
                                                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert),
        lambda: own_buf.dispatch(xn, idxn, wn), rows_in * 2 * hidden, False, api_syncs=True)

    def own_read() -> None:
        # doorbell's own dispatch with what DeepEP's call has to do besides: its row count and
        # per-expert counts read on the host (one copy, one wait).
        r = own_buf.dispatch(xn, idxn, wn)
        torch.cat([r[4].num_recv, r[3]]).tolist()

    row("normal dispatch vs own+read", lambda: buf.dispatch(xn, topk_idx=idxn, topk_weights=wn, num_tokens_per_rank=per_rank,
                                                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert),
        own_read, rows_in * 2 * hidden, False, api_syncs=True, own_syncs=True)
    # The same two calls timed in alternating pairs over more rounds: the cost as the median of
    # the per-round differences (max over ranks), which the host's drift does not move.
    paired = _time_paired(
        lambda: buf.dispatch(xn, topk_idx=idxn, topk_weights=wn, num_tokens_per_rank=per_rank,
                             is_token_in_rank=in_rank, num_tokens_per_expert=per_expert),
        own_read, max(a.iters, 200),
    )
    medians: List[Optional[float]] = [None, None, None] if paired is None else [_p(v, 0.5) for v in paired]
    vals = [_max(v) for v in medians]
    if rank == 0:
        own50, diff = vals[1], vals[2]
        pct = None if diff is None or not own50 else 100.0 * diff / own50
        print(f"{'... paired, ' + str(max(a.iters, 200)) + ' rounds':>26} | {_fmt(vals[0], 1):>7} {'':>7} | {_fmt(vals[1], 1):>7} "
              f"{'':>7} | {_fmt(vals[2], 2):>7} | median of the per-round differences: {_fmt(pct, 1)} % of own", flush=True)
    # DeepEP's num_worst_tokens: outputs of the worst-case row count, no wait on the host (CUDA-graph
    # capturable), so this row compares the kernels and the adapter alone.
    row("normal dispatch, worst", lambda: buf.dispatch(xn, topk_idx=idxn, topk_weights=wn, num_tokens_per_rank=per_rank,
                                                       is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                       num_worst_tokens=w * t),
        lambda: own_buf.dispatch(xn, idxn, wn), rows_in * 2 * hidden, False, host_us=1000.0)
    row("normal combine", lambda: buf.combine(recv_x, nhandle),
        lambda: own_buf.combine(recv_x, own_handle), rows_in * 2 * hidden, False, host_us=1000.0)
    buf.destroy()


def _normal_sms(deep_ep: Any) -> int:
    """The SMs the normal mode's kernels take by default (``Buffer.num_sms``)."""
    return int(deep_ep.Buffer.num_sms)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m doorbell.bench", description=__doc__)
    p.add_argument("collective", choices=["allreduce", "alltoall", "moe", "deep_ep"])
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tokens", type=int, default=4096, help="moe, deep_ep's normal mode: tokens per rank")
    p.add_argument("--ll-tokens", type=int, default=128, help="deep_ep's low-latency mode: tokens per rank")
    p.add_argument("--experts", type=int, default=288, help="deep_ep: experts (rounded up to a multiple of the ranks)")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    import doorbell

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    if a.collective == "deep_ep":  # the Buffer joins doorbell through the process group
        _deep_ep(a)
        dist.destroy_process_group()
        return
    comm = doorbell.init()
    if a.collective == "moe":
        _moe(a, comm)
    else:
        _collective(a, comm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
