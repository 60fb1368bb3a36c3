"""``python -m doorbell.bench allreduce|alltoall|moe`` under torchrun: doorbell beside
``torch.distributed`` (NCCL) and, for allreduce where the machine allows it, PyTorch symmetric
memory, in the same run, with nccl-tests columns (time is the max over ranks, eager and CUDA
graph) and a ratio per peer. NVLink multicast stays off (the variables below)."""

from __future__ import annotations

import argparse
import os
from typing import Callable, List, Optional

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _time_us(fn: Callable[[], None], iters: int, graph: bool) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:

        def run() -> None:
            for _ in range(iters):
                fn()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _max_over_ranks(v: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([v], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sizes(lo: int, hi: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _row(size: int, count: int, dtype: str, us: float, bus_factor: float, peers: List[Optional[float]]) -> str:
    algbw = size / us / 1e3
    cols = [f"{size:>12}", f"{count:>12}", f"{dtype:>8}", f"{us:>10.2f}", f"{algbw:>8.2f}", f"{algbw * bus_factor:>8.2f}"]
    cols += ["       -" if p is None else f"{p / us:>8.2f}" for p in peers]
    return " ".join(cols)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m doorbell.bench", description=__doc__)
    p.add_argument("collective", choices=["allreduce", "alltoall", "moe"])
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    import doorbell
    from doorbell import moe

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl")
    comm = doorbell.init()
    w = comm.world_size
    me = comm.rank == 0
    mode = "graph" if a.graph else "eager"
    if a.collective in ("allreduce", "alltoall"):
        peers = ["nccl"] + (["symm_mem"] if a.collective == "allreduce" else [])
        if me:
            print(f"# doorbell {a.collective}, {w} ranks, {mode}; ratio = peer time / doorbell time")
            print(" ".join(["        size", "       count", "    type", "  time(us)", "  algbw", "  busbw"] + [f"{x:>8}" for x in peers]))
        for size in _sizes(a.min_bytes, a.max_bytes):
            n = size // 4
            if a.collective == "allreduce":
                t = torch.ones(n, device="cuda")
                ours = _time_us(lambda: comm.all_reduce(t), a.iters, a.graph)
                nccl = _time_us(lambda: dist.all_reduce(t), a.iters, a.graph)
                symm = None
                try:
                    import torch.distributed._symmetric_memory as symm_mem

                    buf = symm_mem.empty(n, device="cuda")
                    symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
                    name = dist.group.WORLD.group_name
                    symm = _time_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name), a.iters, a.graph)
                except Exception:  # not available on this machine (peers not symmetric-capable)
                    symm = None
                row = [_max_over_ranks(x) if x is not None else None for x in (ours, nccl, symm)]
                factor = 2 * (w - 1) / w
            else:
                n -= n % w
                inp, out = torch.ones(n, device="cuda"), torch.empty(n, device="cuda")
                ours = _time_us(lambda: comm.all_to_all(out, inp), a.iters, a.graph)
                nccl = _time_us(lambda: dist.all_to_all_single(out, inp), a.iters, a.graph)
                row = [_max_over_ranks(ours), _max_over_ranks(nccl)]
                factor = (w - 1) / w
            if me:
                print(_row(n * 4, n, "float", row[0], factor, row[1:]))
    else:
        hidden, experts, topk, tokens = 7168, 64 * w, 8, 4096
        buf = moe.Buffer(comm, hidden, experts, tokens, topk)
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(experts, device="cuda")[:topk] for _ in range(tokens)])
        wts = torch.ones(tokens, topk, device="cuda")
        state = {}

        def dispatch() -> None:
            state["r"] = buf.dispatch(x, idx, wts)

        def combine() -> None:
            rx, _, _, _, h, _ = state["r"]
            buf.combine(rx, h)

        d = _max_over_ranks(_time_us(dispatch, a.iters, False))
        c = _max_over_ranks(_time_us(combine, a.iters, False))
        if me:
            print(f"# doorbell MoE high-throughput, {w} ranks, {tokens} tokens x top-{topk}, hidden {hidden}, bf16 (eager)")
            print(f"dispatch {d:.1f} us, combine {c:.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
