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
  check A.csv [B.csv ...] --kind K        the performance check (scripts/gpu-suite.sh SUITE=perf):
                                          fails on a stall, on doorbell slower than the fastest
                                          peer without a stated hardware reason, or on a size
                                          more than 10% slower than the recorded table of kind K;
                                          with --retaken R.csv ..., a failing size that was timed
                                          again fails only if it fails there too

Every CSV has the examples' columns (``collective,ranks,dtype,bytes,library,graph_us,eager_us``,
then ``graph_p50,graph_p99,graph_max,graph_stalls`` and the same for eager: single calls; times
in us per call, max over ranks, empty where a library could not run). The tables (one for
CUDA-graph timing, one for eager) have a column per library and, per peer, ``x peer`` = the
peer's time / doorbell's (above 1: doorbell is faster), then the fastest peer and doorbell's
ratio to it; a time marked ``!`` had a stall (a call above 5 x its size's median), and a table of
single calls (p50/p99/max) follows each. ``--plot PNG`` draws time against size for every
library (needs matplotlib). bf16 throughout. NVLink multicast stays off (the variables set
below)."""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

MEANS = "collective,ranks,dtype,bytes,library,graph_us,eager_us"
SPREAD_COLUMNS = ("p50", "p99", "max", "stalls")
HEADER = MEANS + "".join(f",{m}_{c}" for m in ("graph", "eager") for c in SPREAD_COLUMNS)
OURS = "doorbell"
# A call slower than this many times its size's median is a stall (the examples' rule).
STALL_FACTOR = 5.0
# The performance check: a size more than this much slower than the recorded table fails.
REGRESSION = 1.10


class Spread(NamedTuple):
    """Single calls of one size and mode: p50, p99, max (us) and how many stalled."""

    p50: float
    p99: float
    max: float
    stalls: int

    def text(self) -> str:
        t = f"{self.p50:.2f}/{self.p99:.2f}/{self.max:.2f}"
        return t + (f" STALL x{self.stalls}" if self.stalls else "")


class Entry(NamedTuple):
    """One library at one size: mean us per call in a CUDA graph and eager, and single calls."""

    graph: Optional[float]
    eager: Optional[float]
    graph_calls: Optional[Spread] = None
    eager_calls: Optional[Spread] = None

    def mean(self, mode: int) -> Optional[float]:
        return self.graph if mode == 0 else self.eager

    def calls(self, mode: int) -> Optional[Spread]:
        return self.graph_calls if mode == 0 else self.eager_calls


# (collective, bytes) -> library -> timings
Rows = Dict[Tuple[str, int], Dict[str, Entry]]
MODES = (("CUDA graph", 0), ("eager", 1))


def spread_of(calls: Sequence[float]) -> Optional[Spread]:
    """p50/p99/max by nearest rank and the stall count, as the examples compute them."""
    if not calls:
        return None
    v = sorted(calls)

    def rank(q: float) -> float:
        return v[min(max(math.ceil(q * len(v)), 1), len(v)) - 1]

    p50 = rank(0.5)
    return Spread(p50, rank(0.99), v[-1], sum(1 for t in v if t > STALL_FACTOR * p50))


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


def csv_line(collective: str, ranks: int, size: int, library: str, e: Entry) -> str:
    """One line of the CSV (HEADER's columns), bf16."""
    cells = [_cell(e.graph), _cell(e.eager)]
    for c in (e.graph_calls, e.eager_calls):
        cells.append(",,," if c is None else f"{c.p50:.3f},{c.p99:.3f},{c.max:.3f},{c.stalls}")
    return f"{collective},{ranks},bf16,{size},{library}," + ",".join(cells)


def _spread(line: Dict[str, str], mode: str) -> Optional[Spread]:
    got = [line.get(f"{mode}_{c}") or "" for c in SPREAD_COLUMNS]
    if any(not v.strip() for v in got):
        return None
    return Spread(float(got[0]), float(got[1]), float(got[2]), int(float(got[3])))


def merge(texts: Sequence[str]) -> Rows:
    """Every CSV's lines by (collective, bytes) and library; a later line replaces an earlier one
    of the same key. CSVs of means only (the header before single calls were timed) are read
    too. Raises ValueError on a file without the expected header."""
    rows: Rows = {}
    for text in texts:
        reader = csv.DictReader(io.StringIO(text))
        if reader.fieldnames is None or ",".join(reader.fieldnames) not in (HEADER, MEANS):
            raise ValueError(f"not a timings CSV (header {reader.fieldnames}, want {HEADER})")
        for line in reader:
            key = (line["collective"], int(line["bytes"]))
            rows.setdefault(key, {})[line["library"]] = Entry(
                _num(line["graph_us"]), _num(line["eager_us"]), _spread(line, "graph"), _spread(line, "eager")
            )
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


def _marked(e: Optional[Entry], mode: int) -> str:
    if e is None or e.mean(mode) is None:
        return "-"
    calls = e.calls(mode)
    return _fmt(e.mean(mode)) + ("!" if calls is not None and calls.stalls else "")


def _fastest_peer(got: Dict[str, Entry], peers: Sequence[str], mode: int) -> Optional[Tuple[float, str]]:
    measured = [(us, p) for p in peers if p in got for us in (got[p].mean(mode),) if us is not None]
    return min(measured) if measured else None


def tables(rows: Rows) -> str:
    """Markdown: for each collective and timing mode, a table of time per library and every
    peer's ratio to doorbell (a time marked ! had a stall), then one of single calls."""
    out: List[str] = []
    for collective in sorted({c for c, _ in rows}):
        keys = sorted(k for k in rows if k[0] == collective)
        libs = libraries({k: rows[k] for k in keys})
        peers = libs[1:]
        for mode, i in MODES:
            out.append(f"{collective}, {mode} (us per call, max over ranks; x peer = peer / doorbell)\n")
            head = ["size"] + [f"{lib} us" for lib in libs] + [f"x {p}" for p in peers] + ["fastest peer", "x fastest"]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---:|" * (1 + len(libs)) + "---:|" * len(peers) + "---|---:|")
            for key in keys:
                got = rows[key]
                ours = got[OURS].mean(i) if OURS in got else None
                fastest = _fastest_peer(got, peers, i)
                cells = [human(key[1])] + [_marked(got.get(lib), i) for lib in libs]
                cells += [_fmt(_ratio(got[p].mean(i) if p in got else None, ours)) for p in peers]
                cells += [
                    "-" if fastest is None else fastest[1],
                    "-" if fastest is None else _fmt(_ratio(fastest[0], ours)),
                ]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
            if any(e.calls(i) is not None for k in keys for e in rows[k].values()):
                out.append(f"{collective}, {mode}, single calls (us, p50/p99/max, max over ranks)\n")
                out.append("| size | " + " | ".join(libs) + " |")
                out.append("|---:|" + "---:|" * len(libs))
                for key in keys:
                    cells = [human(key[1])]
                    for lib in libs:
                        calls = rows[key][lib].calls(i) if lib in rows[key] else None
                        cells.append("-" if calls is None else calls.text())
                    out.append("| " + " | ".join(cells) + " |")
                out.append("")
    return "\n".join(out)


class Reason(NamedTuple):
    """A stated hardware reason for doorbell to be slower than a peer somewhere, and its probe."""

    kind: str
    collective: str
    mode: str  # "graph", "eager" or "*"
    lo: int
    hi: int
    reason: str

    def covers(self, kind: str, collective: str, mode: str, size: int) -> bool:
        return (
            self.kind in (kind, "*")
            and self.collective in (collective, "*")
            and self.mode in (mode, "*")
            and self.lo <= size <= self.hi
        )


def read_reasons(text: str) -> List[Reason]:
    """``kind,collective,mode,min_bytes,max_bytes,reason`` lines (``*`` matches any); ``#``
    starts a comment."""
    out: List[Reason] = []
    for line in csv.reader(io.StringIO(text)):
        if not line or line[0].startswith("#") or line[0] == "kind":
            continue
        if len(line) != 6:
            raise ValueError(f"reasons: want 6 fields, got {line}")
        out.append(Reason(line[0], line[1], line[2], parse_size(line[3]), parse_size(line[4]), line[5]))
    return out


def check(rows: Rows, kind: str, baseline: Optional[Rows] = None, reasons: Sequence[Reason] = ()) -> List[str]:
    """The performance check's failures (empty: passed). Per collective, size and mode: a stall
    of doorbell's; doorbell slower than the fastest peer where no reason covers it; doorbell
    more than 10% slower than the recorded table (``baseline``) of the same machine kind (in the
    mean, and in the single calls' p50 too where both tables have single calls). For
    the low-latency MoE collectives (``moe_ll_*``) also: the graph time within 10% of eager."""
    return [f for _, f in check_keyed(rows, kind, baseline, reasons)]


def check_keyed(
    rows: Rows, kind: str, baseline: Optional[Rows] = None, reasons: Sequence[Reason] = ()
) -> List[Tuple[Tuple[str, int], str]]:
    """:func:`check`'s failures, each with the (collective, bytes) it is about."""
    failed: List[Tuple[Tuple[str, int], str]] = []
    for key in sorted(rows):
        collective, size = key
        got = rows[key]
        if OURS not in got:
            continue
        ours = got[OURS]
        for name, i in MODES:
            mode = "graph" if i == 0 else "eager"
            where = f"{collective} {human(size)} {mode}"
            t = ours.mean(i)
            calls = ours.calls(i)
            if calls is not None and calls.stalls:
                failed.append((key, f"{where}: stall ({calls.stalls} calls > {STALL_FACTOR:g} x median; {calls.text()})"))
            if t is None:
                continue
            fastest = _fastest_peer(got, [lib for lib in got if lib != OURS], i)
            if fastest is not None and t > fastest[0]:
                why = [r.reason for r in reasons if r.covers(kind, collective, mode, size)]
                if not why:
                    failed.append((key, f"{where}: {t:.2f} us, slower than {fastest[1]} ({fastest[0]:.2f} us, x {fastest[0] / t:.2f})"))
            before = baseline.get(key, {}).get(OURS) if baseline else None
            b = before.mean(i) if before is not None else None
            if before is not None and b is not None and t > REGRESSION * b:
                # Slower in the mean and in the typical single call (p50) alike, where both
                # tables have single calls: a mean alone moves with one slow stretch of a run
                # (2 MiB all-to-all's graph mean was 12.7, 14.3 and 12.8 us in three runs of
                # one build, its p50 12.7-13.3), and a stall is caught by the stall test.
                b50 = before.calls(i)
                if calls is None or b50 is None:
                    failed.append((key, f"{where}: {t:.2f} us, {t / b:.2f} x the recorded {b:.2f} us (more than {REGRESSION:g} x)"))
                elif calls.p50 > REGRESSION * b50.p50:
                    failed.append(
                        (
                            key,
                            f"{where}: {t:.2f} us, {t / b:.2f} x the recorded {b:.2f} us, single calls' p50 {calls.p50:.2f} us, "
                            f"{calls.p50 / b50.p50:.2f} x the recorded {b50.p50:.2f} (both more than {REGRESSION:g} x)",
                        )
                    )
        if collective.startswith("moe_ll") and ours.graph is not None and ours.eager is not None:
            if ours.graph > REGRESSION * ours.eager:
                failed.append(
                    (key, f"{collective} {human(size)}: graph {ours.graph:.2f} us vs eager {ours.eager:.2f} us (more than {REGRESSION:g} x)")
                )
    return failed


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
        for c, (mode, i) in enumerate(MODES):
            ax = axes[r][c]
            for lib in libraries(rows):
                pts = [(k[1], v) for k in keys if lib in rows[k] for v in (rows[k][lib].mean(i),) if v is not None]
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

    from .bench import _max, _time_calls, _time_us

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    w = dist.get_world_size()
    group = dist.group.WORLD.group_name
    lines = [HEADER]

    def over_ranks(mine: Optional[Spread]) -> Optional[Spread]:
        """Each field at its largest over ranks; None if any rank has none."""
        fields = [_max(None if mine is None else float(v)) for v in (mine or Spread(0.0, 0.0, 0.0, 0))]
        if mine is None or any(f is None for f in fields):
            return None
        p50, p99, top, stalls = (float(f or 0.0) for f in fields)
        return Spread(p50, p99, top, int(stalls))

    def timed(fn: Callable[[], object]) -> Entry:
        """Means and single calls, graph and eager, each the maximum over ranks."""
        means: List[Optional[float]] = []
        spreads: List[Optional[Spread]] = []
        for g in (True, False):
            means.append(_max(_time_us(fn, a.iters, g)))
            calls = _time_calls(fn, a.iters, g)
            spreads.append(over_ranks(spread_of(calls) if calls else None))
        return Entry(means[0], means[1], spreads[0], spreads[1])

    for size in sizes(a.collective, parse_size(a.min_bytes), parse_size(a.max_bytes), w):
        n = size // 2
        got: Dict[str, Entry] = {}
        if a.collective == "allreduce":
            x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
            got["torch.distributed"] = timed(lambda: dist.all_reduce(x))
            try:
                import torch.distributed._symmetric_memory as symm_mem

                buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
                buf.zero_()
                symm_mem.rendezvous(buf, group)
                ops = torch.ops.symm_mem
                got["torch symm one-shot"] = timed(lambda: ops.one_shot_all_reduce(buf, "sum", group))
                got["torch symm two-shot"] = timed(lambda: ops.two_shot_all_reduce_(buf, "sum", group))
                del buf
            except Exception:  # noqa: BLE001 - symmetric memory unavailable here: those columns show "-"
                got.setdefault("torch symm one-shot", Entry(None, None))
                got.setdefault("torch symm two-shot", Entry(None, None))
        else:
            inp = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
            out = torch.empty_like(inp)
            got["torch.distributed"] = timed(lambda: dist.all_to_all_single(out, inp))
        for lib, e in got.items():
            lines.append(csv_line(a.collective, w, size, lib, e))
        if dist.get_rank() == 0:
            Path(a.csv).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _finish(rows: Rows, a: argparse.Namespace, texts: Sequence[str]) -> None:
    print(tables(rows))
    if a.out_csv:
        # Lines of means-only CSVs get empty single-call cells, so every line has the header's fields.
        pad = "," * (HEADER.count(",") - MEANS.count(","))
        body = [[line if line.count(",") == HEADER.count(",") else line + pad for line in t.splitlines()[1:] if line] for t in texts]
        Path(a.out_csv).write_text("\n".join([HEADER] + [line for b in body for line in b]) + "\n")
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
    chk = sub.add_parser("check", help="the performance check over CSVs written earlier (exit 1 on a failure)")
    chk.add_argument("files", nargs="+")
    chk.add_argument("--kind", required=True, help="the machine kind (e.g. 2xH100-80GB-HBM3), for --baseline and reasons")
    chk.add_argument("--baseline", help="the last recorded merged CSV of this kind (a size more than 10%% slower fails)")
    chk.add_argument("--reasons", help="stated hardware reasons: kind,collective,mode,min_bytes,max_bytes,reason")
    chk.add_argument(
        "--retaken",
        nargs="*",
        default=[],
        help="CSVs of failing sizes timed again (every library): a size fails only if it fails there too",
    )
    chk.add_argument("--failing-sizes", help="write the failing sizes here, one 'collective bytes' per line")
    for q in (run, table):
        q.add_argument("--plot", help="also draw time against size into this PNG (matplotlib)")
        q.add_argument("--out-csv", help="also write the merged timings here")
    run.add_argument(
        "--example-args", default="", help='more arguments for the example, one string (--example-args="--sms 16 --no-eager")'
    )
    return p


def settle(
    rows: Rows,
    retaken: Rows,
    kind: str,
    baseline: Optional[Rows] = None,
    reasons: Sequence[Reason] = (),
) -> Tuple[List[str], List[str]]:
    """The check over ``rows``, where a failing size that was timed again (``retaken``: every
    library, that size alone) is judged again on the retake: (failures, failures the retake
    cleared). A size fails when it fails in both timings; a size of the first timing that was
    not taken again keeps its failure. The first timing's failure is kept in either list, so
    an isolated slow call is reported even where it is not held against doorbell."""
    failed: List[str] = []
    cleared: List[str] = []
    first = check_keyed(rows, kind, baseline, reasons)
    for key in dict.fromkeys(k for k, _ in first):
        mine = [f for k, f in first if k == key]
        if OURS not in retaken.get(key, {}):
            failed += mine
            continue
        again = check_keyed({key: retaken[key]}, kind, baseline, reasons)
        if again:
            failed += [f"{f}; taken again: {'; '.join(g for _, g in again)}" for f in mine]
        else:
            cleared += mine
    return failed, cleared


def _check(a: argparse.Namespace) -> int:
    rows = merge([Path(f).read_text() for f in a.files])
    retaken = merge([Path(f).read_text() for f in a.retaken]) if a.retaken else {}
    baseline = merge([Path(a.baseline).read_text()]) if a.baseline and Path(a.baseline).is_file() else None
    reasons = read_reasons(Path(a.reasons).read_text()) if a.reasons and Path(a.reasons).is_file() else []
    print(tables(rows))
    if baseline is None:
        print(f"# no recorded table for {a.kind} ({a.baseline}): nothing to compare sizes against")
    failed, cleared = settle(rows, retaken, a.kind, baseline, reasons)
    if a.failing_sizes:
        keys = dict.fromkeys(k for k, _ in check_keyed(rows, a.kind, baseline, reasons))
        Path(a.failing_sizes).write_text("".join(f"{c} {b}\n" for c, b in keys))
    for r in reasons:
        if r.kind in (a.kind, "*"):
            print(f"# stated reason: {r.collective} {r.mode} {human(r.lo)}-{human(r.hi)}: {r.reason}")
    if retaken:
        print(tables({k: v for k, v in retaken.items()}))
    for f in cleared:
        print(f"# taken again and passed: {f}")
    if failed:
        print(f"PERF FAIL ({len(failed)}):")
        for f in failed:
            print(f"  {f}")
        return 1
    again = f"; {len(cleared)} failure(s) of the first timing did not repeat when taken again, listed above" if cleared else ""
    print(
        f"PERF PASS: {len(rows)} sizes, no stall, doorbell >= the fastest peer or a stated reason, "
        f"within {REGRESSION:g} x the recorded table{again}"
    )
    return 0


def main(argv: Optional[List[str]] = None) -> None:
    a = parser().parse_args(argv)
    if a.command == "worker":
        _worker(a)
    elif a.command == "run":
        _run(a)
    elif a.command == "check":
        sys.exit(_check(a))
    else:
        texts = [Path(f).read_text() for f in a.files]
        _finish(merge(texts), a, texts)


if __name__ == "__main__":
    main()
