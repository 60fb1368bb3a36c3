"""The communicator: joining the job, and the collectives on torch tensors."""

from __future__ import annotations

import hashlib
import os
import socket
import warnings
from typing import Any, List, Optional, Sequence, Tuple

from . import _doorbell
from ._check import check_tensor, describe, device_view, dtype_name, nbytes, numel
from ._doorbell import NoGpuError

_REDUCE_DTYPES = ("bfloat16", "float16", "float32")


def get_include() -> str:
    """The directory holding doorbell's CUDA headers (``#include <doorbell/doorbell.cuh>``), for
    CUDA extensions and Triton kernels that fuse communication into their own kernels."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


_raw_stream: Any = None


def current_raw_stream(device: int) -> int:
    """The handle of PyTorch's current stream on ``device`` as an int: PyTorch's own
    ``torch._C._cuda_getCurrentRawStream`` (what its compiled code calls; no ``Stream`` object is
    built), or the public ``torch.cuda.current_stream`` where it is missing."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if raw is not None else (lambda d: int(torch.cuda.current_stream(d).cuda_stream))
    return int(_raw_stream(device))


class Work:
    """What an ``async_op=True`` call returns: the call is already on the stream it was issued
    on; ``wait()`` makes the current stream wait for it, ``is_completed()`` polls it. Both raise
    ``DoorbellError`` naming the rank and the cause once the job is known to have failed (a
    result cut short by a fault is not a result); ``Communicator.synchronize()`` waits and
    checks in one call."""

    def __init__(self, stream: Any, native: Any) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._native = native

    def wait(self) -> None:
        import torch

        self._native.check_health()
        torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        done = bool(self._event.query())
        if done:
            self._native.check_health()
        return done


class Communicator:
    """A doorbell communicator on one GPU (use :func:`init`). Its calls take torch tensors of
    that GPU and enqueue on ``torch.cuda.current_stream()``, returning at once as
    ``torch.distributed`` calls do: keep the tensors alive until the stream has run the call.
    They are capturable in ``torch.cuda.graph``. Calls are collective: every rank makes the same
    calls in the same order."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self._device = int(native.device)

    @property
    def rank(self) -> int:
        return int(self._native.rank)

    @property
    def world_size(self) -> int:
        return int(self._native.world_size)

    @property
    def device(self) -> int:
        """The CUDA device index this communicator runs on."""
        return self._device

    @property
    def spans_nodes(self) -> bool:
        return bool(self._native.spans_nodes)

    def node_of_rank(self) -> List[int]:
        """Each rank's node, numbered from 0 in the order the nodes' first ranks come (ranks on
        one host are one node, unless ``DOORBELL_SEPARATE_NODES`` emulates several)."""
        return [int(n) for n in self._native.node_of_rank]

    def _stream(self) -> Tuple[Any, int]:
        import torch

        s = torch.cuda.current_stream(self._device)
        return s, int(s.cuda_stream)

    def _stream_handle(self) -> int:
        """The current stream's handle alone (no ``Stream`` object: about 8 us less a call)."""
        return current_raw_stream(self._device)

    def _done(self, stream: Any, async_op: bool) -> Optional[Work]:
        return Work(stream, self._native) if async_op else None

    def all_reduce(self, tensor: Any, op: str = "sum", async_op: bool = False) -> Optional[Work]:
        """Sums ``tensor`` (bfloat16, float16 or float32) over the ranks, in place."""
        if op != "sum":
            raise ValueError(f"op {op!r}: doorbell's all_reduce sums (op='sum')")
        check_tensor("tensor", tensor, device=self.device, dtypes=_REDUCE_DTYPES)
        stream, handle = self._stream()
        p = tensor.data_ptr()
        self._native.all_reduce(p, p, numel(tensor), dtype_name(tensor), handle)
        return self._done(stream, async_op)

    def all_to_all(self, output: Any, input: Any, async_op: bool = False) -> Optional[Work]:
        """``torch.distributed.all_to_all_single`` with equal splits: block ``p`` of ``input``
        (dimension 0 cut into world_size equal parts) goes to rank ``p``; block ``p`` of
        ``output`` comes from rank ``p``. Any dtype."""
        world = self.world_size
        check_tensor("input", input, device=self.device, dtypes=None)
        check_tensor("output", output, device=self.device, dtypes=[dtype_name(input)])
        if tuple(output.shape) != tuple(input.shape):
            raise ValueError(f"output: {describe(output)}; expected the input's shape {tuple(input.shape)}")
        total = nbytes(input)
        if total % world != 0 or (len(input.shape) > 0 and int(input.shape[0]) % world != 0):
            raise ValueError(
                f"input: {describe(input)}; its first dimension must split into {world} equal "
                "blocks (use all_to_all_v for uneven ones)"
            )
        if output.data_ptr() == input.data_ptr():
            raise ValueError("output and input are the same memory; all_to_all is not in place")
        stream, handle = self._stream()
        self._native.all_to_all(input.data_ptr(), output.data_ptr(), total // world, handle)
        return self._done(stream, async_op)

    def all_to_all_v(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Optional[Sequence[int]] = None,
        input_split_sizes: Optional[Sequence[int]] = None,
        counts: Any = None,
        async_op: bool = False,
    ) -> Optional[Work]:
        """``torch.distributed.all_to_all_single`` with splits (rows of dimension 0): rank ``p``
        gets ``input_split_sizes[p]`` rows of ``input`` (taken in rank order) and sends
        ``output_split_sizes[p]`` rows into ``output``. Lists are checked here and uploaded on
        the stream (not capturable); for CUDA graphs pass ``counts`` instead: an int64 CUDA
        tensor of shape (4, world_size) holding, in bytes, send counts, send offsets, receive
        counts and receive offsets, which replays may change."""
        world = self.world_size
        check_tensor("input", input, device=self.device, dtypes=None)
        check_tensor("output", output, device=self.device, dtypes=[dtype_name(input)])
        if counts is None:
            if output_split_sizes is None or input_split_sizes is None:
                raise ValueError("pass output_split_sizes and input_split_sizes, or counts")
            counts = self._counts(output, input, list(output_split_sizes), list(input_split_sizes))
        else:
            check_tensor("counts", counts, device=self.device, dtypes="int64", shape=(4, world), align=8)
        stream, handle = self._stream()
        self._native.all_to_all_v(
            input.data_ptr(), nbytes(input), output.data_ptr(), nbytes(output), counts.data_ptr(), handle
        )
        if async_op:
            return Work(stream, self._native)
        self._keep = counts  # alive until the next call (the upload is stream-ordered)
        return None

    def _counts(self, output: Any, input: Any, out_splits: List[int], in_splits: List[int]) -> Any:
        import torch

        world = self.world_size
        for name, splits, t in (("input_split_sizes", in_splits, input), ("output_split_sizes", out_splits, output)):
            if len(splits) != world or any(int(s) < 0 for s in splits):
                raise ValueError(f"{name}: {splits!r}; expected {world} non-negative row counts")
            rows = int(t.shape[0]) if len(t.shape) > 0 else 0
            if sum(splits) > rows:
                raise ValueError(f"{name}: {sum(splits)} rows in all, but the tensor has {rows}")
        def row_bytes(t: Any) -> int:
            return nbytes(t) // max(int(t.shape[0]), 1) if len(t.shape) > 0 else 0

        rb_in, rb_out = row_bytes(input), row_bytes(output)
        if rb_in != rb_out:
            raise ValueError(f"output: {describe(output)}; its rows must match the input's ({describe(input)})")

        def offsets(s: List[int]) -> List[int]:
            o, acc = [], 0
            for v in s:
                o.append(acc)
                acc += v
            return o

        host = [
            [v * rb_in for v in in_splits],
            [v * rb_in for v in offsets(in_splits)],
            [v * rb_out for v in out_splits],
            [v * rb_out for v in offsets(out_splits)],
        ]
        return torch.tensor(host, dtype=torch.int64).to(f"cuda:{self.device}", non_blocking=False)

    def check_health(self) -> None:
        """Raises DoorbellError naming failed ranks, if any."""
        self._native.check_health()

    def synchronize(self) -> None:
        """Waits for the current stream, then raises ``DoorbellError`` naming the rank and the
        cause if a fault cut a call on it short or the job has failed: after it returns, the
        outputs of every call enqueued before it are results (``torch.cuda.synchronize()``
        alone cannot tell a call that a dead peer cut short from one that finished)."""
        handle = self._stream_handle()
        self._native.synchronize(handle)

    # ---- the device API, for kernels of your own ----

    def alloc(self, nbytes: int) -> "SymmetricMemory":
        """``nbytes`` of zero-filled GPU memory allocated by doorbell, which the peers on this
        host can map (the memory MemoryChannels move between). Collective only through
        ``memory_channels``."""
        return SymmetricMemory(self._native.alloc(int(nbytes)), self.device)

    def memory_channels(
        self, src: "SymmetricMemory", dst: "SymmetricMemory", packets: Optional["SymmetricMemory"] = None
    ) -> "MemoryChannels":
        """MemoryChannels from this rank's ``src`` to every peer's ``dst`` (NVLink loads and
        stores; every rank on one host). Collective."""
        for name, m in (("src", src), ("dst", dst), ("packets", packets)):
            if m is not None and not isinstance(m, SymmetricMemory):
                raise TypeError(f"{name}: pass memory from Communicator.alloc (peers must be able to map it)")
        native = self._native.memory_channels(src._native, dst._native, None if packets is None else packets._native)
        return MemoryChannels(native, self.world_size, self.device, (src, dst, packets))


class SymmetricMemory:
    """GPU memory from :meth:`Communicator.alloc`."""

    def __init__(self, native: Any, device: int) -> None:
        self._native = native
        self.device = device

    @property
    def data_ptr(self) -> int:
        return int(self._native.ptr)

    @property
    def nbytes(self) -> int:
        return int(self._native.nbytes)

    def tensor(self, dtype: Any, shape: Sequence[int]) -> Any:
        """A torch view of the memory (no copy), alive as long as this object is referenced by
        the view."""
        import torch

        n = 1
        for d in shape:
            n *= int(d)
        size = torch.empty((), dtype=dtype).element_size()
        if n * size > self.nbytes:
            raise ValueError(f"shape {tuple(shape)} of {dtype} needs {n * size} bytes; this memory has {self.nbytes}")
        raw = device_view(self.data_ptr, (n * size,), "uint8", self.device, self)
        return raw.view(dtype).view(*shape)


class MemoryChannels:
    """MemoryChannels to every peer. ``handles`` is a CUDA uint8 tensor ``[world_size,
    handle_size]``: row ``p`` is the ``doorbell::MemoryChannelHandle`` to rank ``p`` (this rank's
    row is zero), to pass to a kernel as ``const doorbell::MemoryChannelHandle*``; the calls are in
    ``doorbell/channel/memory_channel.cuh`` under :func:`get_include`. Keep this object alive while
    kernels use the handles."""

    struct = "doorbell::MemoryChannelHandle"

    def __init__(self, native: Any, world: int, device: int, keep: Any) -> None:
        import torch

        self._native = native
        self._keep = keep
        self.handle_size = int(_doorbell.MemChannels.handle_size())
        raw = bytes(native.handles())
        self.handles = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(world, self.handle_size).to(f"cuda:{device}")


def _launch_env() -> Tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun, Slurm or Open MPI
    variables; a lone process without any is rank 0 of 1."""
    conventions = [
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
        ("PMI_RANK", "PMI_SIZE", None, None),
    ]
    for rank_v, size_v, lr_v, lw_v in conventions:
        if rank_v in os.environ or size_v in os.environ:
            try:
                rank = int(os.environ[rank_v])
                world = int(os.environ[size_v])
                local_rank = int(os.environ[lr_v]) if lr_v and lr_v in os.environ else rank
                local_world = int(os.environ[lw_v]) if lw_v and lw_v in os.environ else world
            except (KeyError, ValueError) as e:
                raise ValueError(f"launcher variables {rank_v}/{size_v}: {e!s}; set both to integers") from e
            if not 0 <= rank < world:
                raise ValueError(f"{rank_v}={rank} is not below {size_v}={world}")
            return rank, world, local_rank, local_world
    return 0, 1, 0, 1


def _my_address() -> str:
    addr = os.environ.get("DOORBELL_MASTER_ADDR") or os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def init(group: Any = None, device: Optional[int] = None, timeout: float = 300.0) -> Communicator:
    """Joins the job and returns its communicator on GPU ``device`` (default: PyTorch's current
    device). Collective: every rank calls it.

    - With ``group`` (a ``torch.distributed`` process group), or when ``torch.distributed`` is
      initialized, rank 0 of the group picks a port and a secret and broadcasts them through
      the group: doorbell joins an existing job beside NCCL.
    - Otherwise ranks come from torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
      ``LOCAL_WORLD_SIZE``), Open MPI or Slurm variables; rank 0 listens on ``MASTER_ADDR`` at
      ``DOORBELL_MASTER_PORT`` (default ``MASTER_PORT + 1``: torchrun's own store holds
      ``MASTER_PORT``); the secret is ``DOORBELL_JOB_SECRET`` or derived from the job's
      variables. A process started alone is rank 0 of 1.

    Raises NoGpuError without a CUDA driver or GPU."""
    if not _doorbell.cuda_driver_present():
        raise NoGpuError(
            "no CUDA driver: libcuda.so could not be loaded (doorbell needs an NVIDIA GPU and "
            "its driver); importing doorbell works without one, its calls do not"
        )
    _doorbell.device_count()  # raises NoGpuError when the driver sees no GPU
    import torch

    if device is None:
        device = torch.cuda.current_device()
    torch.cuda.set_device(device)
    torch.cuda.init()  # PyTorch's primary context exists before doorbell retains it

    dist = torch.distributed if torch.distributed.is_available() else None
    if group is not None or (dist is not None and dist.is_initialized()):
        assert dist is not None
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        local = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        local_rank, local_world = local.index(rank), len(local)
        info: List[Any] = [None, None, None]
        if rank == 0:
            info = [_my_address(), _doorbell.free_port(), os.urandom(32)]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(info, src=src, group=group)
        addr, port, secret = str(info[0]), int(info[1]), bytes(info[2])
    else:
        rank, world, local_rank, local_world = _launch_env()
        addr = _my_address() if world > 1 else "127.0.0.1"
        if "DOORBELL_MASTER_PORT" in os.environ:
            port = int(os.environ["DOORBELL_MASTER_PORT"])
        elif "MASTER_PORT" in os.environ:
            port = int(os.environ["MASTER_PORT"]) + 1
        elif world == 1:
            port = 0
        else:
            raise ValueError("MASTER_PORT (or DOORBELL_MASTER_PORT) is not set: rank 0 must listen somewhere")
        if "DOORBELL_JOB_SECRET" in os.environ:
            secret = os.environ["DOORBELL_JOB_SECRET"].encode()
        else:
            job = [os.environ.get(v, "") for v in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid")]
            secret = hashlib.sha256(repr((addr, port, world, job)).encode()).digest()
            if world > 1:
                warnings.warn(
                    "DOORBELL_JOB_SECRET is not set: the job secret is derived from the launcher's job id, the "
                    "address, port and world size, which anyone who can see this job's processes or guess its id "
                    "can rebuild and then join or impersonate a rank; set DOORBELL_JOB_SECRET to the same random "
                    "value on every rank, or call doorbell.init(group=...) with torch.distributed initialized",
                    stacklevel=2,
                )
    native = _doorbell.Comm.connect(rank, world, local_rank, local_world, addr, port, secret, device, timeout)
    hint = _doorbell.lazy_loading_hint()
    if hint is not None:
        # The emulated NIC or the Ethernet transport copies on host threads, which a kernel
        # loaded lazily while doorbell's kernels wait holds back (every timeout says so too).
        warnings.warn(hint, stacklevel=2)
    return Communicator(native)
