"""GPU tests: ranks as processes sharing the machine's GPUs (several per GPU when there are
fewer GPUs than ranks), each running gpu_worker.py. Run on a GPU machine with
``pytest -m gpu python/tests`` (DOORBELL_TEST_RANKS="2 4" picks the rank counts)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("gpu_worker.py")
RANKS = [int(n) for n in os.environ.get("DOORBELL_TEST_RANKS", "2 4").split()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n, *args, timeout=600):
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            DOORBELL_MASTER_PORT=str(port),
            NCCL_NVLS_ENABLE="0",
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            NVSHMEM_DISABLE_NVLS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *map(str, args)],
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
            pytest.fail(f"rank {r} of {n} did not finish {args} in {timeout} s")
        if p.returncode != 0:
            failed.append(f"rank {r} (exit {p.returncode}):\n{out}")
    assert not failed, "\n".join(failed)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("case", ["all_reduce", "all_to_all", "moe", "channels", "bad_arguments"])
def test_collectives_against_torch(case, ranks):
    run_ranks(ranks, case)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", RANKS)
def test_moe_low_latency_graph_replayed_1000_times(ranks):
    run_ranks(ranks, "moe_graph", 1000)
