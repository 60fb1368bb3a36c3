"""``python -m doorbell.peers``: doorbell's Rust examples beside PyTorch's own collectives, in one
table with a ratio column per peer.

  run allreduce|alltoall --examples DIR   runs DIR/allreduce (or alltoall) with --csv, which times
                                          doorbell, NCCL and (allreduce) NCCL with symmetric
                                          registration; then, on the same GPUs, this module's
                                          worker under torchrun (one rank per GPU), which times
                                          PyTorch's peers; prints the merged tables
  worker allreduce|alltoall --csv F       the torchrun half: allreduce: torch.distributed
                                          (NCCL), symmetric memory's one-shot and two-shot
                                          allreduce; all-to-all: all_to_all_single
  table A.csv [B.csv ...]                 merges CSVs written earlier and prints the tables

Every CSV has the examples' columns (``collective,ranks,dtype,bytes,library,graph_us,eager_us``;
times in us per call, max over ranks, empty where a library could not run). The tables (one for
CUDA-graph timing, one for eager) have a column per library and, per peer, ``x peer`` = the
peer's time / doorbell's (above 1: doorbell is faster), then the fastest peer and doorbell's
ratio to it. ``--plot PNG`` draws time against size for every library (needs matplotlib).
bf16 throughout. NVLink multicast stays off (the variables set below)."""

from __future__ import annotations

import argparse
import csv
import io
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

HEADER = "collective,ranks,dtype,bytes,library,graph_us,eager_us"
OURS = "doorbell"

# (collective, bytes) -> library -> (graph us, eager us)
Rows = Dict[Tuple[str, int], Dict[str, Tuple[Optional[float], Optional[float]]]]


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``64K``, ``2M``, ``1G`` (powers of 1024), as the examples take them."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    if not digits.isdigit():
        raise ValueError(f"not a size: {text!r} (bytes, or a number with K, M or G)")
    return int(digits) * scale


def human(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def sizes(collective: str, lo: int, hi: int, ranks: int) -> List[int]:
    """The examples' sweep (doubling from ``lo`` to ``hi``) with their rounding: whole bf16
    elements (allreduce), or whole elements per rank (all-to-all)."""
    unit = 2 if collective == "allreduce" else 2 * ranks
    out: List[int] = []
    s = lo
    while s <= hi:
        out.append(max(s // unit, 1) * unit)
        s *= 2
    return out


def _num(v: str) -> Optional[float]:
    return float(v) if v.strip() else None


def merge(texts: Sequence[str]) -> Rows:
    """Every CSV's lines by (collective, bytes) and library; a later line replaces an earlier one
    of the same key. Raises ValueError on a file without the expected header."""
    rows: Rows = {}
    for text in texts:
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames is None or ",".join(reader.fieldnames) != HEADER:
            raise ValueError(f"not a timings CSV (header {reader.fieldnames}, want {HEADER})")
        for line in reader:
            key = (line["collective"], int(line["bytes"]))
            rows.setdefault(key, {})[line["library"]] = (_num(line["graph_us"]), _num(line["eager_us"]))
    return rows


def libraries(rows: Rows) -> List[str]:
    """doorbell first, then the peers in the order they first appear."""
    seen: List[str] = [OURS]
    for libs in rows.values():
        for lib in libs:
            if lib not in seen:
                seen.append(lib)
    return seen


def _fmt(v: Optional[float], prec: int = 2) -> str:
    return "-" if v is None else f"{v:.{prec}f}"


def _cell(v: Optional[float]) -> str:
    return "" if v is None else f"{v:.3f}"


def _ratio(peer: Optional[float], ours: Optional[float]) -> Optional[float]:
    return None if peer is None or ours is None else peer / ours


def tables(rows: Rows) -> str:
    """Markdown: for each collective and timing mode, a table of time per library and every
    peer's ratio to doorbell."""
    out: List[str] = []
    libs = libraries(rows)
    peers = libs[1:]
    for collective in sorted({c for c, _ in rows}):
        keys = sorted(k for k in rows if k[0] == collective)
        for mode, i in (("CUDA graph", 0), ("eager", 1)):
            out.append(f"{collective}, {mode} (us per call, max over ranks; x peer = peer / doorbell)\n")
            head = ["size"] + [f"{lib} us" for lib in libs] + [f"x {p}" for p in peers] + ["fastest peer", "x fastest"]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---:|" * (1 + len(libs)) + "---:|" * len(peers) + "---|---:|")
            for key in keys:
                got = rows[key]
                t = {lib: got.get(lib, (None, None))[i] for lib in libs}
                ours = t[OURS]
                measured = [(us, p) for p in peers for us in (t[p],) if us is not None]
                fastest = min(measured) if measured else None
                cells = [human(key[1])] + [_fmt(t[lib]) for lib in libs] + [_fmt(_ratio(t[p], ours)) for p in peers]
                cells += [
                    "-" if fastest is None else fastest[1],
                    "-" if fastest is None else _fmt(_ratio(fastest[0], ours)),
                ]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def plot(rows: Rows, path: Path) -> None:
    """Time against size, log-log, a line per library, a panel per collective and timing mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); the tables above are complete without it") from e
    collectives = sorted({c for c, _ in rows})
    fig, axes = plt.subplots(len(collectives), 2, figsize=(12, 4.5 * len(collectives)), squeeze=False)
    for r, collective in enumerate(collectives):
        keys = sorted(k for k in rows if k[0] == collective)
        for c, (mode, i) in enumerate((("CUDA graph", 0), ("eager", 1))):
            ax = axes[r][c]
            for lib in libraries(rows):
                pts = [(k[1], rows[k][lib][i]) for k in keys if lib in rows[k] and rows[k][lib][i] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=lib)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("bytes")
            ax.set_ylabel("us per call")
            ax.set_title(f"{collective}, {mode}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from .bench import _max, _time_us

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    w = dist.get_world_size()
    group = dist.group.WORLD.group_name
    lines = [HEADER]
    for size in sizes(a.collective, parse_size(a.min_bytes), parse_size(a.max_bytes), w):
        n = size // 2
        got: Dict[str, List[Optional[float]]] = {}
        if a.collective == "allreduce":
            x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
            got["torch.distributed"] = [_time_us(lambda: dist.all_reduce(x), a.iters, g) for g in (True, False)]
            try:
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
                buf.zero_()
                symm_mem.rendezvous(buf, group)
                ops = torch.ops.symm_mem
                got["torch symm one-shot"] = [
                    _time_us(lambda: ops.one_shot_all_reduce(buf, "sum", group), a.iters, g) for g in (True, False)
                ]
                got["torch symm two-shot"] = [
                    _time_us(lambda: ops.two_shot_all_reduce_(buf, "sum", group), a.iters, g) for g in (True, False)
                ]
                del buf
            except Exception:  # noqa: BLE001 - symmetric memory unavailable here: those columns show "-"
                got.setdefault("torch symm one-shot", [None, None])
                got.setdefault("torch symm two-shot", [None, None])
        else:
            inp = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
            out = torch.empty_like(inp)
            got["torch.distributed"] = [
                _time_us(lambda: dist.all_to_all_single(out, inp), a.iters, g) for g in (True, False)
            ]
        for lib, (graph, eager) in got.items():
            gm, em = _max(graph), _max(eager)
            lines.append(f"{a.collective},{w},bf16,{size},{lib},{_cell(gm)},{_cell(em)}")
        if dist.get_rank() == 0:
            Path(a.csv).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _finish(rows: Rows, a: argparse.Namespace, texts: Sequence[str]) -> None:
    print(tables(rows))
    if a.out_csv:
        body = [t.splitlines()[1:] for t in texts]
        Path(a.out_csv).write_text("\n".join([HEADER] + [line for b in body for line in b if line]) + "\n")
    if a.plot:
        plot(rows, Path(a.plot))
        print(f"plot written to {a.plot}")


def _run(a: argparse.Namespace) -> None:
    exe = Path(a.examples) / a.collective
    if not exe.is_file():
        raise SystemExit(f"{exe}: no such example (build with `cargo build --release --examples`, or pass --examples)")
    with tempfile.TemporaryDirectory() as d:
        ours, theirs = Path(d) / "examples.csv", Path(d) / "torch.csv"
        cmd = [str(exe), "--dtype", "bf16", "--csv", str(ours), "--min-bytes", a.min_bytes, "--max-bytes", a.max_bytes]
        if a.nranks:
            cmd += ["--nranks", str(a.nranks)]
        subprocess.run(cmd + shlex.split(a.example_args), check=True)
        measured = list(csv.DictReader(io.StringIO(ours.read_text())))
        if not measured:
            raise SystemExit(f"{exe} wrote no timings")
        ranks = int(measured[0]["ranks"])  # the same process layout for the PyTorch peers
        worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        worker += ["-m", "doorbell.peers", "worker", a.collective, "--csv", str(theirs)]
        worker += ["--min-bytes", a.min_bytes, "--max-bytes", a.max_bytes, "--iters", str(a.iters)]
        subprocess.run(worker, check=True)
        texts = [ours.read_text(), theirs.read_text()]
    _finish(merge(texts), a, texts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m doorbell.peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the Rust example, then the PyTorch peers, then one table")
    run.add_argument("collective", choices=["allreduce", "alltoall"])
    run.add_argument("--examples", default="target/release/examples", help="folder of the built examples")
    run.add_argument("--nranks", type=int, default=0, help="ranks (default: the example's, one per GPU)")
    work = sub.add_parser("worker", help="the PyTorch half, under torchrun (what `run` starts)")
    work.add_argument("collective", choices=["allreduce", "alltoall"])
    work.add_argument("--csv", required=True, help="where rank 0 writes the timings")
    for q in (run, work):
        q.add_argument("--min-bytes", default="8")
        q.add_argument("--max-bytes", default="1G")
        q.add_argument("--iters", type=int, default=20, help="PyTorch peers: calls per timing (and per graph)")
    table = sub.add_parser("table", help="merge CSVs written earlier (examples' --csv, worker's --csv)")
    table.add_argument("files", nargs="+")
    for q in (run, table):
        q.add_argument("--plot", help="also draw time against size into this PNG (matplotlib)")
        q.add_argument("--out-csv", help="also write the merged timings here")
    run.add_argument(
        "--example-args", default="", help='more arguments for the example, one string (--example-args="--sms 16 --no-eager")'
    )
    return p


def main(argv: Optional[List[str]] = None) -> None:
    a = parser().parse_args(argv)
    if a.command == "worker":
        _worker(a)
    elif a.command == "run":
        _run(a)
    else:
        texts = [Path(f).read_text() for f in a.files]
        _finish(merge(texts), a, texts)


if __name__ == "__main__":
    main()
