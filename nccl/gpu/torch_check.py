"""libdoorbell_nccl.so under PyTorch's "nccl" backend, preloaded in place of NCCL (LD_PRELOAD),
the real NCCL (DOORBELL_NCCL_REAL) behind it for what doorbell does not run. One process per rank
(torchrun); ranks may share a GPU. A CUDA graph of all_reduce is captured and replayed. Every
result is checked against a reference computed on the
host; DOORBELL_NCCL_LOG=1 prints how many calls each side ran when a communicator ends.

    LD_PRELOAD=libdoorbell_nccl.so DOORBELL_NCCL_REAL=.../libnccl.so.2 \\
        torchrun --nproc-per-node N nccl/gpu/torch_check.py
"""

import os
import sys

import torch
import torch.distributed as dist


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=torch.device("cuda", dev))
    total = world * (world + 1) // 2

    # doorbell's: allreduce sums of bf16 and f32 (eager), all-to-all, all-to-all(v).
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 4096, 1 << 20):
            x = torch.full((n,), float(rank + 1), dtype=dtype, device="cuda")
            dist.all_reduce(x)
            check(torch.equal(x, torch.full_like(x, float(total))), f"all_reduce sum {dtype} {n}")
    x = torch.arange(world * 1000, dtype=torch.float32, device="cuda") + rank * 1e6
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    want = torch.cat([torch.arange(rank * 1000, (rank + 1) * 1000, dtype=torch.float32) + p * 1e6 for p in range(world)])
    check(torch.equal(y.cpu(), want), "all_to_all_single (equal)")
    send = [(rank + p) % 3 * 100 for p in range(world)]
    recv = [(p + rank) % 3 * 100 for p in range(world)]
    x = torch.arange(sum(send), dtype=torch.float32, device="cuda") + rank * 1e6
    y = torch.full((sum(recv),), -1.0, device="cuda")
    dist.all_to_all_single(y, x, output_split_sizes=recv, input_split_sizes=send)
    parts = []
    for p in range(world):
        off = sum((p + q) % 3 * 100 for q in range(rank))
        parts.append(torch.arange(off, off + recv[p], dtype=torch.float32) + p * 1e6)
    check(torch.equal(y.cpu(), torch.cat(parts)), "all_to_all_single (uneven)")

    # A CUDA graph of all_reduce (doorbell's under capture), replayed with new inputs each time.
    gx = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(gx)  # the first call outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(gx)
    for k in range(5):
        gx.fill_(float(rank + 1 + k))
        graph.replay()
        torch.cuda.synchronize()
        want = float(sum(p + 1 + k for p in range(world)))
        check(torch.equal(gx, torch.full_like(gx, want)), f"graph replay {k} of all_reduce")

    # All-gather, reduce-scatter (sum) and broadcast: the real NCCL's where there is one, else
    # (ranks sharing a GPU, which the real NCCL refuses) doorbell's.
    g = torch.empty(world * 5, device="cuda")
    dist.all_gather_into_tensor(g, torch.full((5,), float(rank), device="cuda"))
    check(torch.equal(g.cpu(), torch.arange(world).float().repeat_interleave(5)), "all_gather_into_tensor")
    rs = torch.empty(4, device="cuda")
    dist.reduce_scatter_tensor(rs, torch.arange(world * 4, dtype=torch.float32, device="cuda"))
    check(torch.equal(rs.cpu(), (torch.arange(rank * 4, rank * 4 + 4).float() * world)), "reduce_scatter_tensor")
    b = torch.full((7,), float(rank), device="cuda")
    dist.broadcast(b, src=world - 1)
    check(torch.equal(b, torch.full_like(b, float(world - 1))), "broadcast")
    dist.barrier()

    # The average (doorbell's: the sum scaled by 1 / ranks), the maximum and the minimum (the
    # real NCCL's where there is one, else doorbell's: gathered, then reduced), f32 and bf16; the
    # values are exact in both, and differ per element and rank.
    for dt in (torch.float32, torch.bfloat16):
        x = torch.full((1000,), float(rank + 1), dtype=dt, device="cuda")
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        check(torch.allclose(x.float(), torch.full((1000,), total / world, device="cuda")), f"all_reduce avg {dt}")
        base = (torch.arange(3000, device="cuda") % 17 - 8).to(dt)
        for op, want in ((dist.ReduceOp.MAX, max), (dist.ReduceOp.MIN, min)):
            x = base * (rank + 1)
            dist.all_reduce(x, op=op)
            expect = torch.stack([base * (p + 1) for p in range(world)])
            expect = expect.amax(0) if want is max else expect.amin(0)
            check(torch.equal(x, expect), f"all_reduce {op} {dt}")

    # The real NCCL's only: other types, point to point outside an all-to-all, a subgroup. With
    # ranks sharing a GPU there is no real communicator: refused, naming why.
    if world > torch.cuda.device_count():
        x = torch.full((8,), rank + 1, dtype=torch.int64, device="cuda")
        try:
            dist.all_reduce(x)
            torch.cuda.synchronize()
            raise AssertionError("all_reduce of int64 with ranks sharing a GPU: expected a refusal")
        except dist.DistBackendError as e:
            check("share a GPU" in str(e), f"the refusal names why: {e}")
        print(f"rank {rank}: torch over libdoorbell_nccl ok (doorbell's calls incl. avg, max, min; int64 refused: ranks share a GPU)", flush=True)
        return
    x = torch.full((10,), rank + 1, dtype=torch.int64, device="cuda")
    dist.all_reduce(x)
    check(torch.equal(x, torch.full_like(x, total)), "all_reduce int64")
    if world >= 2:
        ring = torch.full((6,), float(rank), device="cuda")
        got = torch.empty_like(ring)
        ops = [dist.P2POp(dist.isend, ring, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        check(torch.equal(got, torch.full_like(got, float((rank - 1) % world))), "batch_isend_irecv ring")
    sub = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        s = torch.ones(16, device="cuda")
        dist.all_reduce(s, group=sub)
        check(torch.equal(s, torch.full_like(s, float((world + 1) // 2))), "all_reduce in a subgroup")
    dist.barrier()
    torch.cuda.synchronize()
    print(f"rank {rank}: torch over libdoorbell_nccl ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAIL rank {os.environ.get('RANK')}: {e}", flush=True)
        sys.exit(1)
