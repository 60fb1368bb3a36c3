"""Starting the GPU tests' ranks: processes sharing the machine's GPUs, each running
gpu_worker.py with torchrun-style variables. Used by test_gpu.py (pytest) and run_gpu.py (no
pytest needed, for GPU machines without it)."""

import os
import pathlib
import secrets
import signal
import subprocess
import sys
from typing import List, Tuple

from doorbell import _doorbell

WORKER = pathlib.Path(__file__).with_name("gpu_worker.py")
RANKS = [int(n) for n in os.environ.get("DOORBELL_TEST_RANKS", "2 4").split()]
CASES: List[Tuple[str, ...]] = [
    ("all_reduce",),
    ("all_to_all",),
    ("moe",),
    ("channels",),
    ("bad_arguments",),
    ("moe_graph", "1000"),
    ("deep_ep_normal",),
] + [("deep_ep_normal_across", v) for v in ("proxy", "ibgda", "cpu", "verbs", "proxy-pairs", "ethernet-pairs")] + [
    ("deep_ep_low_latency",),
    ("deep_ep_low_latency_graph", "1000"),
    ("deep_ep_utils",),
    ("deep_ep_masks", "100"),
    ("deep_ep_shrink", "100"),
] + [("kill_loop", str(seed)) for seed in range(10)]


def run_ranks(n: int, *args: str, timeout: float = 600) -> List[str]:
    """Runs gpu_worker.py with `args` as `n` ranks; returns the failures (empty: all passed). In
    the kill_loop and deep_ep_shrink cases the last rank kills itself: it must end by SIGKILL,
    the others pass."""
    victim = n - 1 if args and args[0] in ("kill_loop", "deep_ep_shrink") else None
    # Below the ephemeral range, so no outgoing connection takes it before rank 0 listens.
    port = _doorbell.free_port()
    secret = secrets.token_hex(16)  # one per job, as a launcher should set it
    procs = []
    for r in range(n):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            DOORBELL_JOB_SECRET=secret,
            DOORBELL_MASTER_PORT=str(port),
            NCCL_NVLS_ENABLE="0",
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            NVSHMEM_DISABLE_NVLS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    failed = []
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return [f"rank {r} of {n} did not finish {args} in {timeout} s"]
        if r == victim:
            if p.returncode != -signal.SIGKILL:
                failed.append(f"rank {r} was to kill itself (exit {p.returncode}):\n{out}")
        elif p.returncode != 0:
            failed.append(f"rank {r} (exit {p.returncode}):\n{out}")
    return failed
