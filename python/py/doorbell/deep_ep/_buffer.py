"""``Buffer``, ``Config`` and ``EventOverlap`` with DeepEP's V1 names and semantics, on doorbell's
MoE kernels (see ``docs/deep_ep.md`` for what is built and what is not yet)."""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from .. import moe as _moe
from .._check import check_tensor, device_view
from .._comm import current_raw_stream

_PLAN = "docs/deep_ep.md"


def _not_yet(what: str, step: str) -> NotImplementedError:
    return NotImplementedError(
        f"doorbell.deep_ep: {what} is not built yet ({step} of issue 27's plan, {_PLAN}); "
        "nothing was sent"
    )


class Config:
    """DeepEP's tuning knobs: ``num_sms`` sets the blocks doorbell's kernels run on (at least the
    rank count); the chunk and buffer sizes are DeepEP's own pipeline's and are accepted and
    ignored (doorbell sizes its buffers from the shapes and ``num_nvl_bytes``)."""

    def __init__(
        self,
        num_sms: int,
        num_max_nvl_chunked_send_tokens: int = 6,
        num_max_nvl_chunked_recv_tokens: int = 256,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 256,
    ) -> None:
        values = {
            "num_sms": num_sms,
            "num_max_nvl_chunked_send_tokens": num_max_nvl_chunked_send_tokens,
            "num_max_nvl_chunked_recv_tokens": num_max_nvl_chunked_recv_tokens,
            "num_max_rdma_chunked_send_tokens": num_max_rdma_chunked_send_tokens,
            "num_max_rdma_chunked_recv_tokens": num_max_rdma_chunked_recv_tokens,
        }
        for name, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Config: {name}={v!r}; a positive int")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_nvl_bytes`` that hold this config's NVLink chunks for rows of
        ``hidden_bytes`` (the tokens in flight per rank pair, as DeepEP counts them)."""
        return int(num_ranks * num_ranks * self.num_max_nvl_chunked_recv_tokens * (hidden_bytes + 256))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of ``num_rdma_bytes`` for this config across nodes (0 inside one node)."""
        nodes = max(num_ranks // 8, 1)
        if nodes == 1:
            return 0
        return int(2 * nodes * self.num_max_rdma_chunked_recv_tokens * (hidden_bytes + 256))

    def __repr__(self) -> str:
        return (
            f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
            f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
            f"{self.num_max_rdma_chunked_recv_tokens}))"
        )


class EventOverlap:
    """A CUDA event (and the tensors that must live until it completes), as DeepEP returns with
    ``async_finish=True``: ``current_stream_wait()`` makes PyTorch's current stream wait for it;
    ``with event:`` runs the block, then makes the current stream wait."""

    def __init__(self, event: Any = None, extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise ValueError("EventOverlap: no event to wait for (the call finished on the current stream)")
        import torch

        torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()


def _route_key(t: Any) -> Tuple[Any, int, int]:
    """Names a routing tensor's contents as long as nobody writes it: the same object (kept
    alive by the key, so its id cannot be reused), storage and version counter (PyTorch bumps it
    on every in-place change) mean the same values."""
    return (t, int(t.data_ptr()), int(getattr(t, "_version", 0)))


class _NormalHandle:
    """The part of a normal-mode handle only doorbell reads (DeepEP's ``send_head`` slot): the
    buffer, its dispatch, the receive slot that keeps the dispatch's layout (and which dispatch
    into that slot it was), and the routing tensor's key (a later dispatch of the same routing
    into the slot leaves the same layout). Across nodes also the order that put the received
    rows into DeepEP's (``order[i]``: the row of doorbell's receive that became row ``i``) and
    the dispatch's top-k routing (a cached dispatch sends by it again)."""

    def __init__(
        self, buffer: _moe.Buffer, dispatch: _moe.DispatchHandle, num_tokens: int, hidden: int,
        route: Tuple[Any, int, int], slot: int, serial: int, rows: Optional[int] = None,
        order: Any = None, topk: Optional[Tuple[Any, Any]] = None,
    ) -> None:
        self.buffer = buffer
        self.dispatch = dispatch
        self.num_tokens = num_tokens
        self.hidden = hidden
        self.route = route
        self.slot = slot
        self.serial = serial
        self.rows = rows  # rows the dispatch delivered here, when known on the host
        self.order = order
        self.topk = topk


class _AcrossRoute:
    """How a dispatch across nodes routes: by top-k (``topk``: ``(topk_idx, topk_weights)``), or
    by ranks (``topk`` None: ``is_token_in_rank``, with ``per_expert`` the sources' counts, or
    None in a cached dispatch, whose list DeepEP does not return)."""

    def __init__(self, topk: Optional[Tuple[Any, Any]] = None, per_expert: Any = None) -> None:
        self.topk = topk
        self.per_expert = per_expert

    def tensors(self) -> Tuple[Any, ...]:
        """What the dispatch reads, kept alive until it is done."""
        return (self.topk or ()) + ((self.per_expert,) if self.per_expert is not None else ())


def _doorbells_part(handle: Any) -> Optional[_NormalHandle]:
    """The doorbell part of a normal-mode handle: the last entry of DeepEP's one-node 6-tuple or
    of its internode 10-tuple."""
    if isinstance(handle, tuple) and len(handle) in (6, 10) and isinstance(handle[-1], _NormalHandle):
        return handle[-1]
    return None


def _receive_slots() -> int:
    """Receive slots of the normal mode (``DOORBELL_DEEP_EP_RECEIVE_SLOTS``, default 3): one the
    adapter copies out of when every other is held, the rest handed out as the results."""
    v = os.environ.get("DOORBELL_DEEP_EP_RECEIVE_SLOTS", "3")
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"DOORBELL_DEEP_EP_RECEIVE_SLOTS={v!r}; a count, 1 or more")
    return int(v)


def _normal_bytes_per_token(world: int, hidden: int, topk: int, slots: Optional[int] = None) -> int:
    """Bytes the normal mode's NVLink buffers take per token of ``max_tokens``: each receive
    slot's rows, ids, weights, origins, FP8 scales and positions, the combine rows
    (collective/moe/ht_nvlink.rs)."""
    s = _receive_slots() if slots is None else slots
    return world * (s * (hidden * 2 + topk * 8 + 8 + (hidden // 128) * 4 + 4) + hidden * 2)


class _CountRead:
    """A one-node normal dispatch's one host wait, as DeepEP's: its row count and per-local-expert
    counts copied into pinned host memory right after the launch, an event behind them; the host
    builds the results while the kernels run and then waits for the event alone, so little host
    work is left between the kernels' end and the call's return. One per exchange, reused (each
    call reads it before returning)."""

    def __init__(self, buf: _moe.Buffer) -> None:
        import torch

        self.num_recv, counts = buf._count_views()
        local = buf.num_local_experts
        # device="cpu" said outright: callers (DeepEP's tests) may make CUDA the default device.
        self.host = torch.empty(1 + local, dtype=torch.int32, device="cpu", pin_memory=True)
        start = int(self.num_recv.data_ptr())
        if int(counts.data_ptr()) == start + 4:
            # The counts right behind the row count (one node): one copy.
            self.copies = [(self.host, buf._view(start, (1 + local,), "int32"))]
        else:
            self.copies = [(self.host[:1], self.num_recv), (self.host[1:], counts)]
        self.event = torch.cuda.Event()

    def start(self) -> None:
        """Queues the copies on the current stream (the dispatch's), then the event."""
        for host, device in self.copies:
            host.copy_(device, non_blocking=True)
        self.event.record()

    def values(self) -> List[int]:
        """Waits for the copies: ``[rows, count per local expert...]``."""
        self.event.synchronize()
        return self.host.tolist()  # type: ignore[no-any-return]


class _SlotLease:
    """Held, through their storage, by the tensors a dispatch handed out of a receive slot: the
    slot is free again once every one of them (views included) is gone."""


class _Slots:
    """The receive slots of one normal-mode exchange: slot 0 is the adapter's own (copied out
    of), the others are handed out as the results, each while a lease on it lives. Under CUDA
    graph capture a slot's lease is kept for good (the graph's replays write it)."""

    def __init__(self, count: int) -> None:
        self.leases: List[Optional[Any]] = [None] * count
        # Dispatches into each slot so far, and the routing key of the last: a handle's layout is
        # still in its slot while no other routing was dispatched there since.
        self.serial: List[int] = [0] * count
        self.route: List[Optional[Tuple[Any, int, int]]] = [None] * count
        self.pointed = -1  # the slot the exchange's calls use now (set_receive_slot)

    def point(self, native: Any, k: int) -> None:
        """Points the exchange's next call at slot ``k`` (a native call only when it changes)."""
        if k != self.pointed:
            native.set_receive_slot(k)
            self.pointed = k

    def take(self, capturing: bool) -> Tuple[int, Optional[_SlotLease]]:
        for k in range(1, len(self.leases)):
            held = self.leases[k]
            if held is None or (isinstance(held, weakref.ref) and held() is None):
                lease = _SlotLease()
                self.leases[k] = lease if capturing else weakref.ref(lease)
                return k, lease
        return 0, None

    def landed(self, k: int, route: Tuple[Any, int, int]) -> int:
        """Records a dispatch of routing ``route`` into slot ``k``; its serial."""
        self.serial[k] += 1
        self.route[k] = route
        return self.serial[k]

    def holds(self, handle: "_NormalHandle") -> bool:
        """Whether slot ``handle.slot`` still holds the layout of the handle's dispatch."""
        k, route = handle.slot, self.route[handle.slot]
        if self.serial[k] == handle.serial:
            return True
        return route is not None and route[0] is handle.route[0] and route[1:] == handle.route[1:]


class Buffer:
    """DeepEP's ``Buffer`` on doorbell: the normal kernels (``dispatch``/``combine``) over NVLink
    and the low-latency ones (``low_latency_dispatch``/``low_latency_combine``) on one node or
    across nodes. Across nodes the normal mode runs doorbell's node-spanning dispatch and puts
    the rows into DeepEP's order on the communication stream (one more copy of the received
    rows each way); it has no dispatch without top-k, no combined top-k weights and one receive
    slot (results are copies), and the low-latency calls keep one dispatch and one combine in flight at a time (a second send half
    before the first's hook is refused by name), take a combine's handle from one of the last
    two dispatches, and have no rank mask.

    ``group``: the ``torch.distributed`` process group of the ranks (doorbell joins it with
    ``doorbell.init(group)``). ``num_nvl_bytes`` bounds the normal mode's buffers: they hold
    ``num_nvl_bytes // (bytes per token)`` tokens per rank and call, built on the first call of
    each shape (hidden size, experts, top-k): every rank makes that call, so building there is
    collective. ``num_rdma_bytes``, ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``,
    ``allow_mnnvl``, ``use_fabric`` and ``explicitly_destroy`` are accepted with DeepEP's checks;
    doorbell picks NVLink or the network per peer itself. ``enable_shrink`` gives the
    low-latency calls DeepEP's rank mask (one node): masks the caller sets, and a rank whose
    process died or fell silent is left out by itself (the communicator then tolerates peer
    loss; its other calls fail naming the dead rank). A rank that stays alive but stops calling
    is not masked by a timeout as DeepEP's is (its peers' waits end the job at their budget), and
    ``destroy()`` meets every rank, so it is not for a Buffer that lost one. ``comm`` (an MPI
    communicator instead of ``group``) is not built yet."""

    num_sms: int = 20
    _logfmt_warned: bool = False  # use_logfmt's warning, once a process

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Buffer: {name}={v!r}; a byte count, 0 or more")
        if isinstance(num_qps_per_rank, bool) or not isinstance(num_qps_per_rank, int) or num_qps_per_rank <= 0:
            raise ValueError(f"Buffer: num_qps_per_rank={num_qps_per_rank!r}; a positive int")
        if low_latency_mode and num_rdma_bytes == 0:
            raise ValueError(
                "Buffer: low_latency_mode needs num_rdma_bytes (Buffer.get_low_latency_rdma_size_hint)"
            )
        if group is None:
            raise _not_yet("a Buffer without a torch.distributed group (comm=)", "step 2")
        import doorbell
        import torch

        self.group = group
        self.rank: int = torch.distributed.get_rank(group)
        self.group_size: int = torch.distributed.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        # The ranks the caller masked (low_latency_update_mask_buffer), applied to every
        # low-latency shape's exchange, including those built later.
        self._masked: Set[int] = set()
        self._comm = doorbell.init(group=group)
        self._across = bool(self._comm.spans_nodes)
        self._rank_node: Any = None  # [ranks] int64 node of each rank (across nodes), built once
        self._stream = torch.cuda.Stream(device=self._comm.device)
        self._normal: Dict[Tuple[int, int, int], _moe.Buffer] = {}
        self._slots: Dict[int, _Slots] = {}  # by id() of the _moe.Buffer
        self._worst_rows: Dict[int, int] = {}  # what each _moe.Buffer's kernel fills, by id()
        self._reads: Dict[int, _CountRead] = {}  # each _moe.Buffer's host read of its counts, by id()
        self._ll: Dict[Tuple[int, int, int, int], Any] = {}
        self._ll_combine_buffers: Dict[Tuple[int, int, int], List[Any]] = {}
        # The last handles low_latency_dispatch returned, by id (each kept, so its id is not
        # reused while listed): a combine given one of them skips the handle's checks.
        self._ll_made: Dict[int, Tuple[Any, ...]] = {}
        self._destroyed = False

    # ---- DeepEP's static helpers ----

    @staticmethod
    def is_sm90_compiled() -> bool:
        """doorbell's kernels are built for sm_90 (H100/H200) and up."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The SMs the default configs use (``get_dispatch_config``/``get_combine_config``)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0:
            raise ValueError(f"set_num_sms: {new_num_sms!r}; a positive int")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on PyTorch's current stream (pass it as ``previous_event``)."""
        import torch

        return EventOverlap(torch.cuda.current_stream().record_event())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Bytes doorbell's low-latency buffers take for this shape (receive rows of both halves
        with FP8 scales and headers, the combine rows), whatever the top-k."""
        m, e = num_max_dispatch_tokens_per_rank, num_experts
        rows = e * m  # local experts x sources x tokens, summed over the ranks' share
        per_row = hidden * 2 + (hidden // 128) * 4 + 32
        returned = 2 * e * m * hidden * 2  # DeepEP's combine: every row back to its token's rank
        return int(2 * rows * per_row + rows * hidden * 2 + num_ranks * m * hidden * 2 + returned)

    def get_comm_stream(self) -> Any:
        """The communication stream: normal-mode calls run on it across nodes or when given
        ``async_finish`` or ``previous_event``, low-latency calls with ``async_finish``; the
        others run on the current stream (the order DeepEP's give every stream)."""
        return self._stream

    def destroy(self) -> None:
        """Drops the buffers (with ``explicitly_destroy=True``, DeepEP's way to free them).
        Collective, as DeepEP's: the GPU finishes this rank's calls and every rank arrives before
        the memory that peers write into goes."""
        held = [getattr(self, h, {}) for h in ("_normal", "_ll", "_ll_combine_buffers", "_ll_made")]
        if any(held) and getattr(self, "group", None) is not None:
            import torch

            torch.cuda.synchronize()
            torch.distributed.barrier(group=self.group)
        for h in held:
            h.clear()
        self._destroyed = True

    # ---- the stream rules ----

    def _begin(self, previous_event: Optional[EventOverlap], async_finish: bool) -> Any:
        """Where a normal-mode call runs. On one node with neither ``previous_event`` nor
        ``async_finish``: None, the current stream itself (DeepEP runs the call on its
        communication stream and makes the current stream wait for it at once; running it on
        the current stream gives every stream the same order without two event waits, a stream
        switch and the tensors' stream records: 70-100 us less host time a call). Across nodes
        never: there the current stream (most often PyTorch's legacy default stream) failed
        every separate-node case, the emulated NIC's proxy completing no work until the waits
        gave up (2026-11-27; why is not known), where the communication stream passes them.
        Else the current stream, after the communication stream was made to wait for
        ``previous_event``, else for it."""
        if previous_event is None and not async_finish and not self._across:
            return None
        import torch

        compute = torch.cuda.current_stream()
        if previous_event is not None:
            if not isinstance(previous_event, EventOverlap) or previous_event.event is None:
                raise TypeError("previous_event: pass an EventOverlap with an event (Buffer.capture())")
            self._stream.wait_event(previous_event.event)
        else:
            self._stream.wait_stream(compute)
        return compute

    def _on(self, compute: Any) -> Any:
        """The stream context of a call begun by ``_begin``: none on the current stream, else the
        communication stream's."""
        if compute is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self._stream)

    def _finish(self, compute: Any, async_finish: bool, tensors: Tuple[Any, ...]) -> EventOverlap:
        """With ``async_finish`` an event on the communication stream; else the current stream
        waits for it and the event is empty (DeepEP returns an ``EventOverlap`` either way, so
        ``with event:`` works after both). Tensors made on one stream and used on the other are
        recorded on both. A call that ran on the current stream (``compute`` None) needs
        neither."""
        if compute is None:
            return EventOverlap(None)
        for t in tensors:
            if t is not None and hasattr(t, "record_stream"):
                t.record_stream(compute)
                t.record_stream(self._stream)
        if async_finish:
            return EventOverlap(self._stream.record_event(), tensors)
        compute.wait_stream(self._stream)
        return EventOverlap(None)

    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("Buffer: used after destroy()")

    # ---- normal mode ----

    def _normal_for(self, hidden: int, num_experts: int, topk: int, num_tokens: int, config: Optional[Config]) -> _moe.Buffer:
        key = (hidden, num_experts, topk)
        buf = self._normal.get(key)
        if buf is None:
            # Across nodes doorbell keeps one receive slot (its node-spanning path has no other).
            slots = 1 if self._across else _receive_slots()
            per_token = _normal_bytes_per_token(self.group_size, hidden, topk, slots)
            max_tokens = self.num_nvl_bytes // per_token
            if max_tokens == 0:
                raise ValueError(
                    f"Buffer: num_nvl_bytes={self.num_nvl_bytes} holds no token of hidden {hidden} "
                    f"at {self.group_size} ranks ({per_token} bytes per token)"
                )
            sms = max((config or Config(Buffer.num_sms)).num_sms, self.group_size)
            buf = _moe.Buffer(self._comm, hidden, num_experts, max_tokens, topk, num_sms=sms, receive_slots=slots)
            self._normal[key] = buf
            self._slots[id(buf)] = _Slots(slots)
        if num_tokens > buf.num_max_tokens:
            need = num_tokens * _normal_bytes_per_token(self.group_size, hidden, topk, 1 if self._across else None)
            raise ValueError(
                f"dispatch: {num_tokens} tokens, but num_nvl_bytes={self.num_nvl_bytes} holds "
                f"{buf.num_max_tokens} of this shape; give the Buffer at least {need} bytes"
            )
        return buf

    def _take_slot(self, buf: _moe.Buffer, host_read: bool = False) -> Tuple[int, Optional[_SlotLease]]:
        """Points ``buf``'s next dispatch at a free receive slot: the slot and its lease, or None
        for the adapter's own slot (every other one held: the results are copied out of it).
        ``host_read``: the dispatch reads its counts on the host, which a CUDA graph capture
        cannot hold; refused there before anything is queued."""
        import torch

        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and host_read:
            raise RuntimeError(
                "dispatch: this dispatch reads its row count on the host, which a CUDA graph "
                "capture cannot do; pass num_worst_tokens (DeepEP's capturable dispatch)"
            )
        slots = self._slots[id(buf)]
        k, lease = slots.take(capturing)
        slots.point(buf._native, k)
        return k, lease

    def _slot_results(
        self, buf: _moe.Buffer, lease: Optional[_SlotLease], fp8: bool, with_topk: bool
    ) -> Tuple[Any, Optional[Any], Optional[Any], Any]:
        """The last dispatch's rows (an ``(e4m3, scales)`` pair after FP8), int32 ids and weights
        (``with_topk``), every row of the slot's capacity, and its rank prefix matrix: tensors
        over its slot that hold ``lease``, or, for the adapter's own slot (``lease`` None), the
        cached views the results are copied out of."""
        import torch

        r = buf._native.results()
        cap, base, world = int(r["max_rows"]), int(r["recv_x"]), self.group_size
        h, k = buf.hidden, buf.num_topk
        if lease is None:
            def part(key: str, dtype: Any, rows: int, cols: int) -> Any:
                return buf._view(r[key], (rows, cols), str(dtype).removeprefix("torch."))
        else:
            root = device_view(base, (int(r["slot_bytes"]),), "uint8", self._comm.device, lease)

            def part(key: str, dtype: Any, rows: int, cols: int) -> Any:
                off = int(r[key]) - base
                return root[off : off + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)

        x: Any = (
            (part("recv_x", torch.float8_e4m3fn, cap, h), part("recv_scales", torch.float32, cap, h // 128))
            if fp8
            else part("recv_x", torch.bfloat16, cap, h)
        )
        ids = part("recv_idx", torch.int32, cap, k) if with_topk else None
        weights = part("recv_weights", torch.float32, cap, k) if with_topk else None
        return x, ids, weights, part("rank_prefix", torch.int32, world, world)

    def get_dispatch_layout(
        self,
        topk_idx: Any,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], Any, Any, EventOverlap]:
        """``(num_tokens_per_rank [ranks] int32, num_tokens_per_rdma_rank [nodes] int32 (None on
        one node), num_tokens_per_expert [experts] int32, is_token_in_rank [tokens, ranks] bool,
        event)`` for ``topk_idx`` (int64, -1: none); a node counts a token once however many of
        its ranks it goes to.
        Computed on the current stream, or with ``previous_event`` or ``async_finish`` (or
        across nodes) on the communication stream (its tensors recorded on the current stream
        too, so ``allocate_on_comm_stream`` changes nothing that can be observed)."""
        import torch

        self._alive()
        world = self.group_size
        if num_experts <= 0 or num_experts % world != 0:
            raise ValueError(f"get_dispatch_layout: num_experts={num_experts}; a positive multiple of {world}")
        check_tensor("topk_idx", topk_idx, device=self._comm.device, dtypes=("int64", "int32"), ndim=2, align=4)
        compute = self._begin(previous_event, async_finish)
        with self._on(compute):
            idx = topk_idx.long()
            valid = idx >= 0
            per_expert = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
            per_expert.scatter_add_(0, idx.clamp(min=0).flatten(), valid.flatten().long())
            rank_of = torch.where(valid, idx // (num_experts // world), torch.full_like(idx, world))
            in_rank = torch.zeros(idx.shape[0], world + 1, dtype=torch.bool, device=idx.device)
            in_rank.scatter_(1, rank_of, True)
            is_token_in_rank = in_rank[:, :world].contiguous()
            per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
            per_expert_i32 = per_expert.int()
            per_node = None
            if self._across:
                rank_node = self._rank_nodes()
                hits = torch.zeros(idx.shape[0], int(max(self._comm.node_of_rank())) + 1, dtype=torch.int32, device=idx.device)
                hits.index_add_(1, rank_node, is_token_in_rank.int())
                per_node = (hits > 0).sum(0, dtype=torch.int32)
        kept = (topk_idx, per_rank, per_expert_i32, is_token_in_rank) + ((per_node,) if per_node is not None else ())
        event = self._finish(compute, async_finish, kept)
        return per_rank, per_node, per_expert_i32, is_token_in_rank, event

    def _rank_nodes(self) -> Any:
        """``[ranks]`` int64 on this GPU: each rank's node (built on first use)."""
        if self._rank_node is None:
            import torch

            self._rank_node = torch.tensor(self._comm.node_of_rank(), dtype=torch.int64, device=f"cuda:{self._comm.device}")
        return self._rank_node

    def dispatch(
        self,
        x: Union[Any, Tuple[Any, Any]],
        handle: Optional[Tuple[Any, ...]] = None,
        num_tokens_per_rank: Optional[Any] = None,
        num_tokens_per_rdma_rank: Optional[Any] = None,
        is_token_in_rank: Optional[Any] = None,
        num_tokens_per_expert: Optional[Any] = None,
        topk_idx: Optional[Any] = None,
        topk_weights: Optional[Any] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], Optional[Any], List[int], Tuple[Any, ...], EventOverlap]:
        """DeepEP's normal dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``; ``recv_x`` holds this rank's rows in
        source-rank order (``handle[0]``, the rank prefix matrix, says where each source's rows
        end), bf16 or an ``(e4m3, scales)`` pair like ``x``; ids are local (-1: an expert
        elsewhere) and their weights 0 there. Without ``num_worst_tokens`` the row count is read
        on the host (DeepEP waits for it too); with it, outputs have that many rows, ids -1 past
        the received ones, and the list is empty. Results are fresh tensors, as DeepEP's."""
        self._alive()
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment <= 0:
            raise ValueError(f"dispatch: expert_alignment={expert_alignment!r}; a positive int")
        if handle is not None or topk_idx is None:
            return self._dispatch_by_rank(
                x, handle, is_token_in_rank, num_tokens_per_expert, topk_weights, expert_alignment,
                num_worst_tokens, config, previous_event, async_finish,
            )
        if topk_weights is None:
            raise ValueError("dispatch: topk_weights is required with topk_idx")
        if num_tokens_per_rdma_rank is not None and not self._across:
            raise ValueError("dispatch: num_tokens_per_rdma_rank is for the internode kernels; this Buffer is one node")
        if num_tokens_per_expert is None:
            raise ValueError("dispatch: num_tokens_per_expert (from get_dispatch_layout) is required with topk_idx")
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"dispatch: num_worst_tokens={num_worst_tokens!r}; 0 or a row count")
        if num_worst_tokens and self._across:
            raise ValueError("dispatch: num_worst_tokens is for one node (DeepEP refuses it across nodes too)")
        fp8 = isinstance(x, tuple)
        rows: Any = x[0] if fp8 else x
        if len(getattr(rows, "shape", ())) != 2:
            raise ValueError("dispatch: x is (num_tokens, hidden) bf16, or an (e4m3, scales) pair")
        if len(getattr(topk_idx, "shape", ())) != 2:
            raise ValueError("dispatch: topk_idx is (num_tokens, num_topk)")
        num_tokens, hidden = int(rows.shape[0]), int(rows.shape[1])
        num_experts, topk = int(num_tokens_per_expert.numel()), int(topk_idx.shape[1])
        if self._across:
            buf = self._normal_for(hidden, num_experts, topk, num_tokens, config)
            by_topk = _AcrossRoute(topk=(topk_idx, topk_weights))
            return self._dispatch_across(buf, x, by_topk, is_token_in_rank, expert_alignment, previous_event, async_finish)
        buf = self._normal_for(hidden, num_experts, topk, num_tokens, config)
        cap = buf.num_max_tokens * self.group_size
        if num_worst_tokens > cap:
            raise ValueError(f"dispatch: num_worst_tokens={num_worst_tokens}, but the buffer holds {cap} rows")
        compute = self._begin(previous_event, async_finish)
        slot, lease = self._take_slot(buf, host_read=not num_worst_tokens)
        if num_worst_tokens != self._worst_rows.get(id(buf), 0):
            # The kernel writes -1 ids into the rows past the received ones (no mask here).
            buf._native.set_worst_rows(num_worst_tokens)
            self._worst_rows[id(buf)] = num_worst_tokens
        with self._on(compute):
            scales_in = x[1] if fp8 else None  # the caller's, read on this stream: kept below
            if fp8:
                # DeepEP passes column-major scales ([tokens, hidden / 128], stride (1, tokens));
                # the kernels read rows of scales (a stride argument comes with step 3).
                x = (x[0], x[1].contiguous())
            idx32, _ = buf._launch_dispatch(x, topk_idx, topk_weights)
            # The count's copy first: everything below overlaps the kernels, and the host waits
            # only for the copy.
            read = None if num_worst_tokens else self._count_read(buf)
            if read is not None:
                read.start()
            recv_x, recv_idx, recv_w, prefix = self._slot_results(buf, lease, fp8, True)
            assert recv_idx is not None and recv_w is not None
            if lease is None:
                prefix = prefix.clone()
            ids = recv_idx.long()
            num_recv = read.num_recv if read is not None else buf._count_views()[0]
            h = _moe.DispatchHandle(num_tokens, hidden, (x, idx32, topk_weights), num_recv)
            buf._dispatches += 1
            route = _route_key(topk_idx)
            serial = self._slots[id(buf)].landed(slot, route)
            mine = _NormalHandle(buf, h, num_tokens, hidden, route, slot, serial)
            listed: List[int] = []
            if read is None:
                n = num_worst_tokens
            else:
                n, listed = self._checked_counts(read.values(), expert_alignment)
                mine.rows = n
            # DeepEP's tensors outlive the next call: a leased slot's are (the slot stays taken
            # while they live); the adapter's own slot is copied out of.
            if lease is not None:
                out_x: Any = (recv_x[0][:n], recv_x[1][:n]) if fp8 else recv_x[:n]
                out_w = recv_w[:n]
            else:
                out_x = (recv_x[0][:n].clone(), recv_x[1][:n].clone()) if fp8 else recv_x[:n].clone()
                out_w = recv_w[:n].clone()
            out_idx = ids[:n]
        handle_out = (prefix, None, None, None, is_token_in_rank, mine)
        tensors = tuple(out_x) if fp8 else (out_x,)
        kept = tensors + (out_idx, out_w, prefix, rows, topk_idx, topk_weights) + ((scales_in,) if fp8 else ())
        event = self._finish(compute, async_finish, kept)
        return out_x, out_idx, out_w, listed, handle_out, event

    def _count_read(self, buf: _moe.Buffer) -> _CountRead:
        """``buf``'s host read of its counts (made on first use)."""
        read = self._reads.get(id(buf))
        if read is None:
            read = self._reads[id(buf)] = _CountRead(buf)
        return read

    def _received(self, h: _moe.DispatchHandle, counts: Any, alignment: int) -> Tuple[int, List[int]]:
        """The host wait of a normal dispatch across nodes (one node: ``_CountRead``), read where
        it is called: ``_checked_counts`` of the dispatch's counts."""
        import torch

        return self._checked_counts(torch.cat([h.num_recv, counts]).tolist(), alignment)

    def _checked_counts(self, host: List[int], alignment: int) -> Tuple[int, List[int]]:
        """A normal dispatch's counts once the host has them, ``[rows, count per local
        expert...]`` (Python ints, as ``tolist`` gives them; on the host's critical path, so no
        loop more than needed): the rows delivered here and the per-local-expert counts rounded
        up to ``alignment``. A dispatch that a fault cut short raises the communicator's error:
        its counts are negative, or (across nodes, where the exchange between nodes can give up
        while the node's own dispatch of what did arrive finishes) the communicator has
        failed."""
        n, listed = host[0], host[1:]
        cut = n < 0 or (len(listed) > 0 and min(listed) < 0)
        if cut or self._across:
            self._comm.check_health()
        if cut:
            raise RuntimeError("dispatch: cut short by a fault (comm.check_health() names it)")
        if alignment > 1:
            listed = [(c + alignment - 1) // alignment * alignment for c in listed]
        return n, listed

    def _dispatch_across(
        self,
        buf: _moe.Buffer,
        x: Union[Any, Tuple[Any, Any]],
        route: "_AcrossRoute",
        is_token_in_rank: Any,
        expert_alignment: int,
        previous_event: Optional[EventOverlap],
        async_finish: bool,
        cached: Optional[_NormalHandle] = None,
    ) -> Tuple[Any, Any, Any, Any, Any, EventOverlap]:
        """The normal dispatch when the communicator spans nodes: doorbell's node-spanning
        dispatch (by top-k, or by ranks: DeepEP's dispatch without top-k), whose rows come
        grouped by forwarding rank, then source node, then source token, gathered on the
        communication stream into DeepEP's order (source rank, then source token), with their
        ids (-1 and weight 0 for experts elsewhere), weights and scales (by ranks: no ids or
        weights, None). Returns DeepEP's 6-tuple with its internode handle, a 10-tuple:
        ``is_token_in_rank`` at 0, ``recv_gbl_rank_prefix_sum`` (``[ranks]`` int32, inclusive)
        at 6, doorbell's part at 9, None in the places of DeepEP's channel tables. With
        ``cached`` (a cached dispatch: the handle's routing again) ``(recv_x, None, None, None,
        None, event)``."""
        import torch

        fp8 = isinstance(x, tuple)
        rows: Any = x[0] if fp8 else x
        num_tokens, hidden = int(rows.shape[0]), int(rows.shape[1])
        world = self.group_size
        compute = self._begin(previous_event, async_finish)
        slot, lease = self._take_slot(buf)  # slot 0, the only one across nodes: results are copies
        with self._on(compute):
            scales_in = x[1] if fp8 else None
            if fp8:
                x = (x[0], x[1].contiguous())  # DeepEP's column-major scales, as on one node
            if route.topk is not None:
                recv_x, recv_idx, recv_w, counts, h, _ = buf.dispatch(x, route.topk[0], route.topk[1])
            else:
                per_expert = None if route.per_expert is None else route.per_expert.int()
                recv_x, recv_idx, recv_w, counts, h, _ = buf.dispatch_by_rank(x, is_token_in_rank, per_expert)
            r = buf._native.results()
            src = buf._view(r["recv_src"], (int(r["max_rows"]), 2), "int32")
            n, listed = self._received(h, counts, expert_alignment)
            origin = src[:n].long()
            order = torch.argsort(origin[:, 0] * buf.num_max_tokens + origin[:, 1])
            out_x: Any = (
                (recv_x[0][:n].index_select(0, order), recv_x[1][:n].index_select(0, order))
                if fp8
                else recv_x[:n].index_select(0, order)
            )
            out_idx: Any = None
            out_w: Any = None
            if route.topk is not None:
                out_idx = recv_idx[:n].index_select(0, order).long()
                out_w = recv_w[:n].index_select(0, order).masked_fill(out_idx < 0, 0.0)
            prefix = torch.bincount(origin[:, 0], minlength=world).cumsum(0).int()
        tensors = tuple(out_x) if fp8 else (out_x,)
        kept = tensors + (out_idx, out_w, prefix, order, rows, is_token_in_rank) + route.tensors() + ((scales_in,) if fp8 else ())
        event = self._finish(compute, async_finish, kept)
        del lease  # None: slot 0 is the adapter's own
        if cached is not None:
            # The handle's routing again: its combine reads this dispatch's layout, the same one.
            self._slots[id(buf)].landed(slot, cached.route)
            cached.dispatch, cached.order = h, order
            return out_x, None, None, None, None, event
        key = _route_key(route.topk[0] if route.topk is not None else is_token_in_rank)
        serial = self._slots[id(buf)].landed(slot, key)
        mine = _NormalHandle(buf, h, num_tokens, hidden, key, slot, serial, n, order, route.topk)
        handle_out = (is_token_in_rank, None, None, None, None, None, prefix, None, None, mine)
        return out_x, out_idx, out_w, listed, handle_out, event

    def _dispatch_by_rank(
        self,
        x: Union[Any, Tuple[Any, Any]],
        handle: Optional[Tuple[Any, ...]],
        is_token_in_rank: Optional[Any],
        num_tokens_per_expert: Optional[Any],
        topk_weights: Optional[Any],
        expert_alignment: int,
        num_worst_tokens: int,
        config: Optional[Config],
        previous_event: Optional[EventOverlap],
        async_finish: bool,
    ) -> Tuple[Any, Optional[Any], Optional[Any], Any, Any, EventOverlap]:
        """DeepEP's dispatch without top-k: routed by ``is_token_in_rank``, or (with ``handle``,
        the cached dispatch) by the routing of the handle's dispatch. Returns ``(recv_x, None,
        None, num_recv_tokens_per_expert_list, handle, event)``, or for the cached dispatch
        ``(recv_x, None, None, None, None, event)`` as DeepEP does."""
        if topk_weights is not None:
            raise ValueError("dispatch: topk_weights without topk_idx")
        if num_worst_tokens:
            raise _not_yet("num_worst_tokens without top-k", "step 3")
        cached: Optional[_NormalHandle] = None
        if handle is not None:
            cached = _doorbells_part(handle)
            if cached is None:
                raise TypeError("dispatch: pass the handle a dispatch of this Buffer returned")
            if cached.order is not None:
                # Across nodes: the handle's routing again (top-k, or its ranks), in DeepEP's order.
                rows0: Any = x[0] if isinstance(x, tuple) else x
                shape = tuple(int(d) for d in getattr(rows0, "shape", ()))
                if shape != (cached.num_tokens, cached.hidden):
                    raise ValueError(
                        f"dispatch: x of {shape}, but the handle's dispatch moved {cached.num_tokens} x {cached.hidden}"
                    )
                again = _AcrossRoute(topk=cached.topk)
                return self._dispatch_across(cached.buffer, x, again, handle[0], 1, previous_event, async_finish, cached)
            is_token_in_rank = handle[4]
            num_tokens_per_expert = None
        if is_token_in_rank is None:
            raise ValueError("dispatch: without topk_idx, is_token_in_rank (get_dispatch_layout) routes the tokens")
        if cached is None and num_tokens_per_expert is None:
            raise ValueError("dispatch: num_tokens_per_expert (get_dispatch_layout) is required")
        fp8 = isinstance(x, tuple)
        rows: Any = x[0] if fp8 else x
        if len(getattr(rows, "shape", ())) != 2:
            raise ValueError("dispatch: x is (num_tokens, hidden) bf16, or an (e4m3, scales) pair")
        num_tokens, hidden = int(rows.shape[0]), int(rows.shape[1])
        if cached is not None:
            buf = cached.buffer
            if (num_tokens, hidden) != (cached.num_tokens, cached.hidden):
                raise ValueError(
                    f"dispatch: x of {num_tokens} x {hidden}, but the handle's dispatch moved "
                    f"{cached.num_tokens} x {cached.hidden}"
                )
        else:
            assert num_tokens_per_expert is not None
            num_experts = int(num_tokens_per_expert.numel())
            # Without top-k the rows carry no ids: the buffer of any top-k serves; reuse one of
            # this shape if there is one.
            same = [b for (h, e, _), b in self._normal.items() if (h, e) == (hidden, num_experts)]
            buf = same[0] if same else self._normal_for(hidden, num_experts, 1, num_tokens, config)
            if self._across:
                by_ranks = _AcrossRoute(per_expert=num_tokens_per_expert)
                return self._dispatch_across(buf, x, by_ranks, is_token_in_rank, expert_alignment, previous_event, async_finish)
        compute = self._begin(previous_event, async_finish)
        slot, lease = self._take_slot(buf, host_read=True)
        with self._on(compute):
            if fp8:
                x = (x[0], x[1].contiguous())  # column-major scales, as in dispatch
            per_expert = None if num_tokens_per_expert is None else num_tokens_per_expert.int()
            buf._launch_dispatch_by_rank(x, is_token_in_rank, per_expert)
            read = self._count_read(buf)
            read.start()  # first, as in dispatch: the rest overlaps the kernels
            recv_x, _, _, prefix = self._slot_results(buf, lease, fp8, False)
            if lease is None:
                prefix = prefix.clone()
            h = _moe.DispatchHandle(num_tokens, hidden, (x, is_token_in_rank, per_expert), read.num_recv)
            buf._dispatches += 1
            n, listed = self._checked_counts(read.values(), expert_alignment)
            if lease is not None:
                out_x: Any = (recv_x[0][:n], recv_x[1][:n]) if fp8 else recv_x[:n]
            else:
                out_x = (recv_x[0][:n].clone(), recv_x[1][:n].clone()) if fp8 else recv_x[:n].clone()
        tensors = tuple(out_x) if fp8 else (out_x,)
        event = self._finish(compute, async_finish, tensors + (prefix, rows, is_token_in_rank))
        if cached is not None:
            # The handle's routing again (the same layout): a combine may still take that handle.
            self._slots[id(buf)].landed(slot, cached.route)
            return out_x, None, None, None, None, event
        route = _route_key(is_token_in_rank)
        serial = self._slots[id(buf)].landed(slot, route)
        handle_out = (prefix, None, None, None, is_token_in_rank, _NormalHandle(buf, h, num_tokens, hidden, route, slot, serial, n))
        return out_x, None, None, listed, handle_out, event

    def combine(
        self,
        x: Any,
        handle: Tuple[Any, ...],
        topk_weights: Optional[Any] = None,
        bias: Any = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[Any, Optional[Any], EventOverlap]:
        """DeepEP's normal combine: ``(combined_x [tokens, hidden] bf16, combined_topk_weights,
        event)``, each token's rows (and, given ``topk_weights [rows, topk]`` f32, its weights
        rows) summed over the ranks it went to, in f32 in rank order; no weights are applied."""
        self._alive()
        if bias is not None:
            raise _not_yet("the combine's bias", "step 3")
        mine = _doorbells_part(handle)
        if mine is None:
            raise TypeError("combine: pass the handle the matching dispatch of this Buffer returned")
        slots = self._slots.get(id(mine.buffer))
        if slots is None or not any(b is mine.buffer for b in self._normal.values()):
            raise TypeError("combine: pass the handle a dispatch of this Buffer returned")
        if not slots.holds(mine):
            # Its receive slot was the adapter's own (every other one was held, so its results
            # were copies) and a dispatch of another routing landed there since.
            raise ValueError(
                "combine: the handle's layout is gone: its dispatch's results were copies (every "
                "receive slot was held), and a later dispatch of another routing took the slot; "
                "drop results sooner or raise DOORBELL_DEEP_EP_RECEIVE_SLOTS"
            )
        check_tensor("x", x, device=self._comm.device, dtypes="bfloat16", ndim=2)
        if mine.rows is not None and int(x.shape[0]) != mine.rows:
            # The kernel reads as many rows as the dispatch delivered.
            raise ValueError(f"combine: x has {int(x.shape[0])} rows; the handle's dispatch delivered {mine.rows}")
        import torch

        compute = self._begin(previous_event, async_finish)
        # The combine follows the layout kept in the handle's receive slot.
        slots.point(mine.buffer._native, mine.slot)
        with self._on(compute):
            y, y_weights = x, topk_weights
            if mine.order is not None:
                # Across nodes: the rows (and their weights) back into the order of doorbell's
                # receive.
                y = torch.empty_like(x).index_copy_(0, mine.order, x)
                if topk_weights is not None:
                    check_tensor("topk_weights", topk_weights, device=self._comm.device, dtypes="float32", shape=(int(x.shape[0]), mine.buffer.num_topk))
                    y_weights = torch.empty_like(topk_weights).index_copy_(0, mine.order, topk_weights)
            out, weights, _ = mine.buffer.combine(y, mine.dispatch, topk_weights=y_weights)
        event = self._finish(compute, async_finish, (x, y, out, weights, topk_weights, y_weights))
        return out, weights, event

    # ---- low-latency mode ----

    def _ll_for(self, hidden: int, num_experts: int, m: int, topk: int) -> Any:
        """doorbell's low-latency exchange in DeepEP's layout for this shape, built on the shape's
        first call (every rank makes it: collective)."""
        key = (hidden, num_experts, m, topk)
        native = self._ll.get(key)
        if native is not None:
            return native
        from .. import _doorbell

        if not self.low_latency_mode:
            raise ValueError("low-latency calls need a Buffer built with low_latency_mode=True")
        world = self.group_size
        if num_experts <= 0 or num_experts % world != 0:
            raise ValueError(f"num_experts={num_experts}; a positive multiple of the {world} ranks")
        if m <= 0:
            raise ValueError(f"num_max_dispatch_tokens_per_rank={m}; a positive int")
        if hidden <= 0 or hidden % 128 != 0:
            raise ValueError(f"hidden={hidden}; a positive multiple of 128")
        need = Buffer.get_low_latency_rdma_size_hint(m, hidden, world, num_experts)
        if need > self.num_rdma_bytes:
            raise ValueError(
                f"low-latency calls of hidden {hidden}, {num_experts} experts and {m} tokens per "
                f"rank need num_rdma_bytes >= {need} (Buffer.get_low_latency_rdma_size_hint); "
                f"the Buffer has {self.num_rdma_bytes}"
            )
        native = _doorbell.MoeLowLatency(self._comm._native, hidden, topk, num_experts, m, None, True, self.enable_shrink)
        stream = self._current_stream_handle()
        for r in sorted(self._masked):
            native.set_rank_masked(r, True, stream)
        self._ll[key] = native
        return native

    def _ll_launch(self, async_finish: bool, return_recv_hook: bool) -> int:
        """The stream a low-latency call launches on, as a handle. DeepEP runs the call on its
        communication stream unless a hook is asked for, and without ``async_finish`` makes the
        current stream wait for it at once; so here only an ``async_finish`` call goes to the
        communication stream (after what the current stream queued: the inputs and the outputs'
        allocation), the others run on the current stream (the same order as seen from every
        stream the caller has, without two event waits, or a Stream object, of host time per
        call). The caller makes its tensors on the current stream first."""
        if async_finish:
            if return_recv_hook:
                raise ValueError("async_finish and return_recv_hook cannot both be set")
            import torch

            self._stream.wait_stream(torch.cuda.current_stream(self._comm.device))
            return int(self._stream.cuda_stream)
        return current_raw_stream(self._comm.device)

    def _ll_finish(self, async_finish: bool, tensors: Tuple[Any, ...]) -> EventOverlap:
        """The event DeepEP returns: with ``async_finish`` one on the communication stream (the
        tensors, made on the current stream, recorded on it as well, since the current stream
        goes on without waiting); else empty (the call ran on the current stream, which is
        ordered after every use, so CUDA-graph capture works)."""
        if not async_finish:
            return EventOverlap(None)
        for t in tensors:
            if t is not None:
                t.record_stream(self._stream)
        return EventOverlap(self._stream.record_event(), tensors)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: doorbell tags every count and signal with its call's epoch, so what an
        earlier call left is never read as this call's (the arguments are checked)."""
        self._alive()
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden), ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"clean_low_latency_buffer: {name}={v!r}; a positive int")
        if num_experts % self.group_size != 0:
            raise ValueError(f"clean_low_latency_buffer: num_experts={num_experts}; a multiple of {self.group_size}")

    def low_latency_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[Any] = None,
        dispatch_wait_recv_cost_stats: Optional[Any] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> Tuple[Any, Any, Tuple[Any, ...], EventOverlap, Optional[Callable[[], None]]]:
        """DeepEP's low-latency dispatch: ``(recv_x, recv_count, handle, event, hook)``. ``recv_x``
        is ``[local experts, ranks * M, hidden]`` bf16, or with ``use_fp8`` (the default) a pair
        of e4m3 rows and their scales (f32 ``[.., hidden / 128]``, or with ``use_ue8m0`` int32
        ``[.., hidden / 512]``, column-major as DeepEP's), cast by the kernel per 128 values; each
        expert's rows packed from row 0, source rank 0's first; ``recv_count`` int32 per local
        expert; ``handle = (src_info, layout_range, M, hidden, num_experts)``. With
        ``return_recv_hook`` the send half runs on the current stream and ``hook()`` runs the
        receive half. ``dispatch_wait_recv_cost_stats`` (``[ranks]`` int64, one node): the
        receive half adds the SM cycles it waited for each source rank's counts, per local
        expert, as DeepEP's. Fresh output tensors each call, as DeepEP's."""
        self._alive()
        if use_ue8m0 and not round_scale:
            raise ValueError("low_latency_dispatch: use_ue8m0 needs round_scale=True")
        if (round_scale or use_ue8m0) and not use_fp8:
            raise ValueError("low_latency_dispatch: round_scale and use_ue8m0 are for use_fp8=True")
        dev = self._comm.device
        if len(getattr(x, "shape", ())) != 2:
            raise ValueError("low_latency_dispatch: x is (num_tokens, hidden) bf16")
        num_tokens, hidden = int(x.shape[0]), int(x.shape[1])
        m = num_max_dispatch_tokens_per_rank
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= num_tokens <= m:
            raise ValueError(f"low_latency_dispatch: {num_tokens} tokens, num_max_dispatch_tokens_per_rank={m!r}")
        check_tensor("x", x, device=dev, dtypes="bfloat16", shape=(num_tokens, hidden))
        check_tensor("topk_idx", topk_idx, device=dev, dtypes=("int64", "int32"), ndim=2, align=topk_idx.element_size() if hasattr(topk_idx, "element_size") else 4)
        if int(topk_idx.shape[0]) != num_tokens:
            raise ValueError(f"low_latency_dispatch: topk_idx has {int(topk_idx.shape[0])} rows, x {num_tokens}")
        topk = int(topk_idx.shape[1])
        if use_ue8m0 and hidden % 512 != 0:
            raise ValueError(f"low_latency_dispatch: use_ue8m0 needs a hidden size that is a multiple of 512 (it is {hidden})")
        native = self._ll_for(hidden, num_experts, m, topk)
        world = self.group_size
        local, cap = num_experts // world, world * m
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, device=dev, dtypes="int32", shape=(local,), align=4)
        waits = self._wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        import torch

        # The outputs on the current stream, as DeepEP's; int64 ids are read as they are.
        idx = topk_idx
        ids_i64 = topk_idx.dtype == torch.int64
        scales_store: Optional[Any] = None
        on = x.device
        if use_fp8:
            packed_x = torch.empty((local, cap, hidden), dtype=torch.float8_e4m3fn, device=on)
            # DeepEP's column-major scales ([.., groups, cap] in memory, seen as [.., cap,
            # groups]) made in that shape at once: no transposed view to build per call.
            groups = hidden // 512 if use_ue8m0 else hidden // 128
            scales_store = torch.empty_strided(
                (local, cap, groups), (groups * cap, 1, cap), dtype=torch.int32 if use_ue8m0 else torch.float32, device=on
            )
        else:
            packed_x = torch.empty((local, cap, hidden), dtype=torch.bfloat16, device=on)
        count = torch.empty(local, dtype=torch.int32, device=on)
        src_info = torch.empty((local, cap), dtype=torch.int32, device=on)
        layout_range = torch.empty((local, world), dtype=torch.int64, device=on)
        # With the hook: where the send half leaves its epoch for this call's receive half (another
        # dispatch may be sent before the hook runs: two in flight, as DeepEP allows). Both halves
        # in one kernel need none (the receive half pairs with the send of its own launch).
        ticket = torch.empty(2, dtype=torch.int64, device=on) if return_recv_hook else None
        stats = cumulative_local_expert_recv_stats
        outputs = (
            packed_x.data_ptr(), 0 if scales_store is None else scales_store.data_ptr(), round_scale, use_ue8m0,
            src_info.data_ptr(), layout_range.data_ptr(), count.data_ptr(), 0 if stats is None else stats.data_ptr(),
            0 if ticket is None else ticket.data_ptr(),
        )
        launch = self._ll_launch(async_finish, return_recv_hook)
        native.dispatch_packed(x.data_ptr(), idx.data_ptr(), num_tokens, *outputs, return_recv_hook, launch, ids_i64, waits)
        recv_x: Any = (packed_x, scales_store) if scales_store is not None else packed_x
        kept = (x, topk_idx, idx, packed_x, scales_store, count, src_info, layout_range, stats, ticket, dispatch_wait_recv_cost_stats)
        handle = (src_info, layout_range, m, hidden, num_experts)
        made = self._ll_made
        if len(made) >= 8:
            del made[next(iter(made))]
        made[id(handle)] = handle
        event = self._ll_finish(async_finish, kept)
        if not return_recv_hook:
            return recv_x, count, handle, event, None

        def hook(_keep: Tuple[Any, ...] = kept) -> None:
            # On the stream of the send half, as DeepEP's hook: ordered after it whatever stream
            # is current when the hook is called. The hook holds the call's tensors (the ticket
            # above all, which the send wrote and this half reads) until it is dropped.
            native.dispatch_packed_recv(*outputs, launch, waits)

        return recv_x, count, handle, event, hook

    def _ll_handle(self, handle: Any) -> Tuple[Any, Any, int, int, int]:
        if not isinstance(handle, tuple) or len(handle) != 5:
            raise TypeError("pass the handle low_latency_dispatch returned: (src_info, layout_range, M, hidden, num_experts)")
        src_info, layout_range, m, hidden, num_experts = handle
        if self._ll_made.get(id(handle)) is handle:
            return src_info, layout_range, int(m), int(hidden), int(num_experts)  # checked when made
        world, dev = self.group_size, self._comm.device
        if num_experts % world != 0:
            raise ValueError(f"handle: num_experts={num_experts}; a multiple of {world}")
        local = num_experts // world
        check_tensor("handle src_info", src_info, device=dev, dtypes="int32", shape=(local, world * m), align=4)
        check_tensor("handle layout_range", layout_range, device=dev, dtypes="int64", shape=(local, world), align=8)
        return src_info, layout_range, int(m), int(hidden), int(num_experts)

    def get_next_low_latency_combine_buffer(self, handle: Any) -> Any:
        """The tensor the next ``zero_copy=True`` combine reads: ``[local experts, ranks * M,
        hidden]`` bf16; two per shape, taken in turn by the zero-copy combines (as DeepEP's two
        buffers), so filling the next one never overwrites rows a combine still in flight reads."""
        self._alive()
        return self._ll_combine_buffer(handle, advance=False)

    def _ll_combine_buffer(self, handle: Any, advance: bool) -> Any:
        _, _, m, hidden, num_experts = self._ll_handle(handle)
        import torch

        key = (hidden, num_experts, m)
        pair = self._ll_combine_buffers.get(key)
        if pair is None:
            world = self.group_size
            shape = (num_experts // world, world * m, hidden)
            pair = [torch.empty(shape, dtype=torch.bfloat16, device=self._comm.device) for _ in range(2)] + [0]
            self._ll_combine_buffers[key] = pair
        buf = pair[pair[2] % 2]
        if advance:
            pair[2] += 1
        return buf

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: Any,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[Any] = None,
        combine_wait_recv_cost_stats: Optional[Any] = None,
    ) -> Tuple[Any, EventOverlap, Optional[Callable[[], None]]]:
        """DeepEP's low-latency combine: ``(combined_x, event, hook)``; every row of the handle's
        dispatch goes back to its token's rank, where ``combined_x[t] = sum_k topk_weights[t, k]
        x row(t, k)`` (f32 in top-k order, ids of -1 add nothing). ``x`` is the experts' outputs
        in the dispatch's layout (with ``zero_copy``, the tensor from
        ``get_next_low_latency_combine_buffer`` is read instead). ``combine_wait_recv_cost_stats``
        (``[ranks]`` int64, one node): the SM cycles the receive waited for each rank's rows are
        added to it. ``use_logfmt``: the rows go back as bf16, with a warning once a process (over
        NVLink doorbell's 10-bit log rows are slower; ``DOORBELL_DEEP_EP_LOG_ROWS=1`` sends them on
        one node: each 128 values in 176 bytes instead of 256, magnitudes to within half a log
        step of the group's range)."""
        self._alive()
        log_rows = self._log_rows(use_logfmt)
        src_info, layout_range, m, hidden, num_experts = self._ll_handle(handle)
        dev, world = self._comm.device, self.group_size
        check_tensor("topk_idx", topk_idx, device=dev, dtypes=("int64", "int32"), ndim=2, align=4)
        num_tokens, topk = int(topk_idx.shape[0]), int(topk_idx.shape[1])
        if num_tokens > m:
            raise ValueError(f"low_latency_combine: {num_tokens} tokens; the handle's dispatch allows {m}")
        check_tensor("topk_weights", topk_weights, device=dev, dtypes="float32", shape=(num_tokens, topk), align=4)
        native = self._ll_for(hidden, num_experts, m, topk)
        waits = self._wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        if zero_copy:
            x = self._ll_combine_buffer(handle, advance=True)
        check_tensor("x", x, device=dev, dtypes="bfloat16", shape=(num_experts // world, world * m, hidden))
        if out is not None:
            check_tensor("out", out, device=dev, dtypes="bfloat16", shape=(num_tokens, hidden))
        import torch

        # The output on the current stream, as DeepEP's; int64 ids are read as they are.
        idx = topk_idx
        ids_i64 = topk_idx.dtype == torch.int64
        if out is None:
            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
        # The hook's pairing word, as in low_latency_dispatch (none when one kernel does both).
        ticket = torch.empty(2, dtype=torch.int64, device=x.device) if return_recv_hook else None
        launch = self._ll_launch(async_finish, return_recv_hook)
        native.combine_packed(
            x.data_ptr(), src_info.data_ptr(), layout_range.data_ptr(), idx.data_ptr(), topk_weights.data_ptr(),
            num_tokens, out.data_ptr(), 0 if ticket is None else ticket.data_ptr(), True, not return_recv_hook,
            launch, ids_i64, 0 if return_recv_hook else waits, log_rows,
        )
        kept = (x, topk_idx, idx, topk_weights, src_info, layout_range, out, ticket, combine_wait_recv_cost_stats)
        event = self._ll_finish(async_finish, kept)
        if not return_recv_hook:
            return out, event, None
        assert ticket is not None  # made above whenever there is a hook
        result, pairing = out, int(ticket.data_ptr())

        def hook(_keep: Tuple[Any, ...] = kept) -> None:
            # On the stream of the send half, as DeepEP's hook; it holds the call's tensors.
            native.combine_packed(
                0, 0, 0, idx.data_ptr(), topk_weights.data_ptr(), num_tokens, result.data_ptr(), pairing,
                False, True, launch, ids_i64, waits, log_rows,
            )

        return out, event, hook

    def _log_rows(self, use_logfmt: bool) -> bool:
        """Whether the combine's rows go back as doorbell's 10-bit log rows. ``use_logfmt`` asks
        for fewer bytes; over NVLink doorbell's log rows are slower than bf16 (measured: the
        send half 63 us against 35 at 128 tokens, top-8, hidden 7168 on 2 x H100), so the rows
        go as bf16 (at least as precise) unless ``DOORBELL_DEEP_EP_LOG_ROWS=1`` asks for log
        rows on one node; across nodes there are none yet. Said once a process."""
        if not use_logfmt:
            return False
        if not self._across and os.environ.get("DOORBELL_DEEP_EP_LOG_ROWS") == "1":
            return True
        if not Buffer._logfmt_warned:
            Buffer._logfmt_warned = True
            where = (
                "across nodes there are no log rows yet"
                if self._across
                else "over NVLink doorbell's log rows are slower than bf16; DOORBELL_DEEP_EP_LOG_ROWS=1 sends them"
            )
            warnings.warn(
                f"doorbell.deep_ep: use_logfmt=True: the combine's rows travel as bf16 ({where}); "
                "the sums are at least as precise",
                stacklevel=3,
            )
        return False

    def _wait_stats(self, name: str, t: Optional[Any]) -> int:
        """The address of DeepEP's ``dispatch/combine_wait_recv_cost_stats`` (``[ranks]`` int64,
        to which the receive half adds, for each source rank, the SM cycles it waited for that
        rank), checked; 0 for None. One node only (the node-spanning kernels refuse it)."""
        if t is None:
            return 0
        check_tensor(name, t, device=self._comm.device, dtypes="int64", shape=(self.group_size,), align=8)
        return int(t.data_ptr())

    # ---- rank masks (enable_shrink) ----

    def _current_stream_handle(self) -> int:
        return current_raw_stream(self._comm.device)

    def _need_shrink(self, what: str) -> None:
        self._alive()
        if not self.enable_shrink:
            raise RuntimeError(f"{what}: build the Buffer with enable_shrink=True (DeepEP asserts the same)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks ``rank_to_mask`` (``mask=True``) or unmasks it, on the current stream, for the
        low-latency calls after: a masked rank is sent nothing, waited for by no one, and its
        experts add nothing to a combine (their selections count as -1). Every live rank should
        mask the same ranks; a masked rank makes no more low-latency calls."""
        self._need_shrink("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask={rank_to_mask!r}; a rank in [0, {self.group_size})")
        stream = self._current_stream_handle()
        for native in self._ll.values():
            native.set_rank_masked(rank_to_mask, bool(mask), stream)
        if mask:
            self._masked.add(rank_to_mask)
        else:
            self._masked.discard(rank_to_mask)

    def low_latency_query_mask_buffer(self, mask_status: Any) -> None:
        """Writes each rank's mask into ``mask_status`` (``[num_ranks]`` int32 on this GPU, 1 =
        masked), on the current stream."""
        self._need_shrink("low_latency_query_mask_buffer")
        check_tensor("mask_status", mask_status, device=self._comm.device, dtypes="int32", shape=(self.group_size,))
        stream = self._current_stream_handle()
        native = next(iter(self._ll.values()), None)
        if native is None:
            mask_status.zero_()
            for r in self._masked:
                mask_status[r] = 1
            return
        mask = device_view(native.rank_mask_ptr(stream), (self.group_size,), "int32", self._comm.device, native)
        mask_status.copy_(mask)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank, on the current stream."""
        self._need_shrink("low_latency_clean_mask_buffer")
        stream = self._current_stream_handle()
        for native in self._ll.values():
            native.clean_rank_mask(stream)
        self._masked.clear()


__all__ = ["Buffer", "Config", "EventOverlap"]
