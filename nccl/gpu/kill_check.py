"""A rank killed under PyTorch's "nccl" backend with libdoorbell_nccl.so preloaded in place of
NCCL: every survivor must end (PyTorch's watchdog sees ncclCommGetAsyncError, or the next call
fails) within 2 s of the kill, with NCCL's error code and doorbell's message naming the dead
rank, instead of hanging. The script launches its own ranks (torchrun would stop the survivors
itself when one worker dies), lets each run allreduces, SIGKILLs the last rank, and times the
others' ends. Ranks share the GPUs when there are more ranks than GPUs.

    DOORBELL_NCCL_LIB=.../libdoorbell_nccl.so [DOORBELL_NCCL_REAL=.../libnccl.so.2] \\
        python nccl/gpu/kill_check.py N
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

LIMIT_S = 2.0


def rank_main() -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=torch.device("cuda", dev))
    x = torch.full((4096,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    if not torch.equal(x, torch.full_like(x, float(world * (world + 1) // 2))):
        raise AssertionError("all_reduce before the kill")
    open(os.environ["KILL_CHECK_READY"] + f".{rank}", "w").close()
    # Allreduces until one fails (or the watchdog ends the process), for at most 30 s.
    end = time.monotonic() + 30
    try:
        while time.monotonic() < end:
            dist.all_reduce(x)
            torch.cuda.synchronize()
            time.sleep(0.001)
    except Exception as e:  # noqa: BLE001 - what the survivor saw is the point
        print(f"rank {rank}: the call failed: {type(e).__name__}: {e}", flush=True)
        os._exit(3)
    print(f"rank {rank}: no error within 30 s of the kill", flush=True)
    os._exit(4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(world: int) -> int:
    lib = os.environ["DOORBELL_NCCL_LIB"]
    logs = tempfile.mkdtemp(prefix="kill_check.")
    ready = os.path.join(logs, "ready")
    port = free_port()
    procs, outs = [], []
    for r in range(world):
        env = dict(
            os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), KILL_CHECK_CHILD="1", KILL_CHECK_READY=ready,
            LD_PRELOAD=lib,
        )
        out = open(os.path.join(logs, f"rank{r}.log"), "w")
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, __file__], env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{ready}.{r}") for r in range(world)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            print("FAIL: the ranks did not all reach the kill", flush=True)
            for r in range(world):
                print(f"--- rank {r}\n{open(os.path.join(logs, f'rank{r}.log')).read()[-3000:]}")
            return 1
        time.sleep(0.01)
    time.sleep(0.2)  # every survivor inside its loop of calls
    dead = world - 1
    t0 = time.monotonic()
    procs[dead].send_signal(signal.SIGKILL)
    ended = {}
    while len(ended) < world - 1 and time.monotonic() < t0 + 30:
        for r in range(world - 1):
            if r not in ended and procs[r].poll() is not None:
                ended[r] = time.monotonic() - t0
        time.sleep(0.005)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for out in outs:
        out.close()
    ok = True
    for r in range(world - 1):
        text = open(os.path.join(logs, f"rank{r}.log")).read()
        named = f"rank {dead}" in text
        code = next((c for c in ("ncclRemoteError", "remote process", "ncclSystemError", "ncclInvalidUsage") if c in text), None)
        took = ended.get(r)
        good = took is not None and took <= LIMIT_S and named and code is not None
        ok &= good
        lines = [ln for ln in text.splitlines() if f"rank {dead}" in ln or "nccl" in ln.lower()][-4:]
        print(f"rank {r}: {'ended' if took is not None else 'did not end'} "
              f"{'' if took is None else f'{took:.2f} s after the kill'}, exit {procs[r].returncode}, "
              f"names rank {dead}: {named}, NCCL code: {code} -> {'ok' if good else 'FAIL'}", flush=True)
        for ln in lines:
            print(f"    {ln[:400]}", flush=True)
    print(f"{'PASS' if ok else 'FAIL'}: {world} ranks, rank {dead} killed; logs in {logs}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if os.environ.get("KILL_CHECK_CHILD") == "1":
        rank_main()
    else:
        sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2))
