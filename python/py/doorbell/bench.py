"""``python -m doorbell.bench allreduce|alltoall|moe`` under torchrun (one rank per GPU): doorbell
beside ``torch.distributed`` (NCCL) and, for allreduce where the machine allows it, PyTorch
symmetric memory's one-shot allreduce, in the same run. The table has the Rust examples'
columns (size, count, type, then per library CUDA-graph and eager time in us with busbw in GB/s,
max over ranks, and doorbell's speedup over the fastest peer); ``#wrong`` counts elements of
doorbell's result that differ from the exact answer (max over ranks). NVLink multicast stays
off (the variables set below)."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, List, Optional

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _hold(iters: int) -> None:
    """Queues a GPU sleep longer than the host takes to enqueue ``iters`` eager calls (2 ms + 20
    us a call, as the Rust harness), so the host's scheduling jitter stays out of eager timings:
    the GPU then runs the queued calls back to back."""
    import torch

    torch.cuda._sleep(int((2000 + 20 * iters) * 1e-6 * 2.0e9))  # cycles at about 2 GHz


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


def _time_calls(fn: Callable[[], Any], iters: int, graph: bool) -> Optional[List[float]]:
    """Single calls, us each: ``iters`` eager launches (queued behind a hold) with an event between every two, or a
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
            _hold(iters)
            for i, m in enumerate(marks):
                m.record()
                if i < iters:
                    fn()
        torch.cuda.synchronize()
        return [float(a.elapsed_time(b)) * 1e3 for a, b in zip(marks[1:], marks[2:])]
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


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m doorbell.bench", description=__doc__)
    p.add_argument("collective", choices=["allreduce", "alltoall", "moe"])
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tokens", type=int, default=4096, help="moe: tokens per rank")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    import doorbell

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    comm = doorbell.init()
    if a.collective == "moe":
        _moe(a, comm)
    else:
        _collective(a, comm)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
