"""Process setup with the name and meaning of DeepEP's ``deep_ep.utils.envs.init_dist`` (what its
tests import), written for doorbell, and able to place several ranks on one GPU."""

from __future__ import annotations

import os
from typing import Any, Tuple


def init_dist(local_rank: int, num_local_ranks: int) -> Tuple[int, int, Any]:
    """Joins the job of ``num_local_ranks`` processes on each of ``WORLD_SIZE`` nodes (default 1;
    this node is ``RANK``, default 0; rendezvous at ``MASTER_ADDR``:``MASTER_PORT``, default
    127.0.0.1:8361) and returns ``(rank, world size, the group of every rank)``. The rank's GPU is
    ``local_rank`` modulo the GPUs it sees, so ranks may share one GPU; the process group's
    backend is NCCL when every local rank has a GPU of its own and gloo otherwise (NCCL refuses
    two ranks on one GPU), or ``DOORBELL_DEEP_EP_BACKEND``. Like DeepEP's, it makes bf16 and the
    GPU the defaults for new tensors."""
    import torch
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "8361"))
    nodes = int(os.environ.get("WORLD_SIZE", "1"))
    node = int(os.environ.get("RANK", "0"))
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise RuntimeError("init_dist: no GPU visible")
    shared = num_local_ranks > gpus
    backend = os.environ.get("DOORBELL_DEEP_EP_BACKEND", "gloo" if shared else "nccl")
    torch.cuda.set_device(local_rank % gpus)
    world = nodes * num_local_ranks
    rank = node * num_local_ranks + local_rank
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{addr}:{port}",
        world_size=world,
        rank=rank,
        device_id=None if shared else torch.device("cuda", local_rank % gpus),
    )
    if backend == "gloo":
        _stage_cuda_collectives_through_the_host()
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(world)))


def _stage_cuda_collectives_through_the_host() -> None:
    """gloo takes CPU tensors for most collectives; tests written for NCCL pass CUDA tensors to
    ``all_reduce``, ``all_gather`` and ``all_gather_into_tensor``. Wraps those three so that
    CUDA tensors go through host copies (synchronous: these are the tests' own bookkeeping
    collectives, not what they measure)."""
    import torch.distributed as dist

    if getattr(dist, "_doorbell_staged", False):
        return
    reduce, gather, gather_into = dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor

    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_cuda:
            return reduce(tensor, *args, **kwargs)
        host = tensor.cpu()
        work = reduce(host, *args, **kwargs)
        tensor.copy_(host)
        return work

    def all_gather(tensor_list: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not tensor.is_cuda:
            return gather(tensor_list, tensor, *args, **kwargs)
        hosts = [t.cpu() for t in tensor_list]
        work = gather(hosts, tensor.cpu(), *args, **kwargs)
        for t, h in zip(tensor_list, hosts):
            t.copy_(h)
        return work

    def all_gather_into_tensor(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        if not output.is_cuda:
            return gather_into(output, input, *args, **kwargs)
        # NCCL takes the output stacked ([world, *input.shape]) or concatenated ([world * rows,
        # ...]); gloo only the concatenated form: gather into that, then copy back whole.
        host = output.cpu().reshape((-1,) + tuple(input.shape[1:]))
        work = gather_into(host, input.cpu(), *args, **kwargs)
        output.copy_(host.view(output.shape))
        return work

    dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = all_reduce, all_gather, all_gather_into_tensor
    setattr(dist, "_doorbell_staged", True)
