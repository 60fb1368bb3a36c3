"""libdoorbell_nccl.so on a GPU, through NCCL's C ABI as ctypes calls it (pynccl's way): one
process per rank (torchrun), ranks may share a GPU. The unique id is made by rank 0 and passed
over a gloo group; then allreduce (sum of bf16, f16, f32, several sizes), all-to-all, a group of
sends and receives forming an uneven all-to-all(v) (as torch's all_to_all_single), and what is
not doorbell's (an int64 product): refused by name, or with DOORBELL_NCCL_FORWARD=1 run by the
real NCCL (DOORBELL_NCCL_REAL); each result checked against a reference.

    torchrun --nproc-per-node N nccl/gpu/abi_check.py  (DOORBELL_NCCL_LIB: the library's path)
"""

import ctypes
import os
import sys

import torch
import torch.distributed as dist


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo")
    # doorbell alone unless told to forward (then DOORBELL_NCCL_REAL names the real NCCL).
    os.environ.setdefault("DOORBELL_NCCL_FORWARD", "0")
    forwarding = os.environ["DOORBELL_NCCL_FORWARD"] != "0"
    lib = ctypes.CDLL(os.environ["DOORBELL_NCCL_LIB"])
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclGetLastError.argtypes = [vp]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, UniqueId, i]
    lib.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
    lib.ncclAlltoAll.argtypes = [vp, vp, sz, i, vp, vp]
    lib.ncclSend.argtypes = [vp, sz, i, i, vp, vp]
    lib.ncclRecv.argtypes = [vp, sz, i, i, vp, vp]
    lib.ncclCommDestroy.argtypes = [vp]

    def ok(r: int, what: str) -> None:
        if r != 0:
            why = lib.ncclGetLastError(None).decode()
            raise AssertionError(f"rank {rank}: {what}: {lib.ncclGetErrorString(r).decode()}: {why}")

    v = ctypes.c_int()
    ok(lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    assert v.value == 22809, v.value
    uid = UniqueId()
    if rank == 0:
        ok(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    box = [bytes(uid.internal)]
    dist.broadcast_object_list(box, src=0)
    ctypes.memmove(uid.internal, box[0], 128)
    comm = vp()
    ok(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    stream = torch.cuda.current_stream()
    s = vp(stream.cuda_stream)
    codes = {torch.bfloat16: 9, torch.float16: 6, torch.float32: 7}

    for dtype, code in codes.items():
        for n in (1, 1000, 1 << 20, 3 << 20):
            torch.manual_seed(n + rank)
            x = torch.randint(-8, 8, (n,), device="cuda").to(dtype)
            y = torch.empty_like(x)
            ok(lib.ncclAllReduce(vp(x.data_ptr()), vp(y.data_ptr()), n, code, 0, comm, s), f"allreduce {dtype} {n}")
            ref = x.float().clone()
            gathered = [torch.empty_like(ref.cpu()) for _ in range(world)]
            dist.all_gather(gathered, ref.cpu())
            want = torch.stack(gathered).sum(0).to(dtype)
            stream.synchronize()
            assert torch.equal(y.cpu(), want), f"rank {rank}: allreduce {dtype} {n}"
            # In place, as torch calls it.
            ok(lib.ncclAllReduce(vp(x.data_ptr()), vp(x.data_ptr()), n, code, 0, comm, s), f"allreduce in place {dtype} {n}")
            stream.synchronize()
            assert torch.equal(x.cpu(), want), f"rank {rank}: allreduce in place {dtype} {n}"

    for n in (1, 4096, 1 << 18):
        x = (torch.arange(world * n, device="cuda", dtype=torch.float32) + rank * 1e6)
        y = torch.empty_like(x)
        ok(lib.ncclAlltoAll(vp(x.data_ptr()), vp(y.data_ptr()), n, 7, comm, s), f"alltoall {n}")
        stream.synchronize()
        want = torch.cat([torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) + p * 1e6 for p in range(world)])
        assert torch.equal(y.cpu(), want), f"rank {rank}: alltoall {n}"
        # In place, as nccl-tests' alltoall_perf calls it (NCCL runs it; doorbell copies the
        # input aside first).
        ok(lib.ncclAlltoAll(vp(x.data_ptr()), vp(x.data_ptr()), n, 7, comm, s), f"alltoall in place {n}")
        stream.synchronize()
        assert torch.equal(x.cpu(), want), f"rank {rank}: alltoall in place {n}"

    # Uneven all-to-all(v) as torch's all_to_all_single issues it: zero counts left out.
    send_counts = [(rank + p) % 3 * 1000 for p in range(world)]
    recv_counts = [(p + rank) % 3 * 1000 for p in range(world)]
    x = torch.arange(sum(send_counts), device="cuda", dtype=torch.float32) + rank * 1e6
    y = torch.full((sum(recv_counts),), -1.0, device="cuda")
    ok(lib.ncclGroupStart(), "ncclGroupStart")
    so = ro = 0
    for p in range(world):
        if send_counts[p]:
            ok(lib.ncclSend(vp(x.data_ptr() + so * 4), send_counts[p], 7, p, comm, s), f"send {p}")
        if recv_counts[p]:
            ok(lib.ncclRecv(vp(y.data_ptr() + ro * 4), recv_counts[p], 7, p, comm, s), f"recv {p}")
        so += send_counts[p]
        ro += recv_counts[p]
    ok(lib.ncclGroupEnd(), "ncclGroupEnd (all-to-all(v))")
    stream.synchronize()
    parts = []
    for p in range(world):
        # What p sent me: its block for me starts after its blocks for ranks below me.
        off = sum((p + q) % 3 * 1000 for q in range(rank))
        parts.append(torch.arange(off, off + recv_counts[p], dtype=torch.float32) + p * 1e6)
    assert torch.equal(y.cpu(), torch.cat(parts)), f"rank {rank}: all-to-all(v)"

    # Not doorbell's: with forwarding off refused by name, nothing run; with it on, the real
    # NCCL's product (DOORBELL_NCCL_FORWARD=1 and DOORBELL_NCCL_REAL set).
    x = torch.full((8,), 2, dtype=torch.int64, device="cuda")
    r = lib.ncclAllReduce(vp(x.data_ptr()), vp(x.data_ptr()), 8, 4, 1, comm, s)
    # The real NCCL needs a GPU per rank: with ranks sharing one there is no real communicator.
    sharing = world > torch.cuda.device_count()
    if forwarding and not sharing:
        ok(r, "allreduce int64 prod (forwarded)")
        stream.synchronize()
        assert torch.equal(x.cpu(), torch.full((8,), 2**world, dtype=torch.int64)), f"rank {rank}: forwarded prod"
    elif forwarding:
        assert r == 5 and b"share a GPU" in lib.ncclGetLastError(None), (r, lib.ncclGetLastError(None))
    else:
        assert r == 5 and b"int64" in lib.ncclGetLastError(None), (r, lib.ncclGetLastError(None))
    ok(lib.ncclCommDestroy(comm), "ncclCommDestroy")
    dist.barrier()
    print(f"rank {rank}: nccl abi ok", flush=True)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL {e}", flush=True)
        sys.exit(1)
