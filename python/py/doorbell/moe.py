"""MoE expert-parallel dispatch and combine on torch tensors, with DeepEP's names and shapes where
they fit (see ``docs/python.md`` for what differs).

Results live in doorbell's buffers (sized once for ``num_max_tokens`` tokens per rank) and are
returned as torch views of them, valid until the next dispatch of the same kind; counts stay on
the GPU, so dispatch and combine are capturable in ``torch.cuda.graph``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

from . import _doorbell
from ._check import check_tensor, describe, device_view, dtype_name
from ._comm import Communicator

def _topk_i32(comm: Communicator, topk_idx: Any, num_tokens: int, topk: int) -> Any:
    """DeepEP passes int64 ids; the kernels read int32 (converted on the stream)."""
    check_tensor("topk_idx", topk_idx, device=comm.device, dtypes=("int64", "int32"), shape=(num_tokens, topk), align=4)
    if dtype_name(topk_idx) == "int32":
        return topk_idx
    import torch

    return topk_idx.to(torch.int32)


class DispatchHandle:
    """What combine needs from a dispatch (opaque)."""

    def __init__(self, num_tokens: int, hidden: int, keep: Tuple[Any, ...], num_recv: Any, dispatch_no: int = 0) -> None:
        self.num_tokens = num_tokens
        self.hidden = hidden
        self.num_recv = num_recv  # device scalar: rows received
        self.dispatch_no = dispatch_no
        self._keep = keep


class Buffer:
    """Buffers for one MoE layer's exchange on ``comm``: ``hidden`` values per token,
    ``num_experts`` experts (a multiple of the ranks; expert ``e`` lives on rank ``e //
    (num_experts // world_size)``), ``num_topk`` experts per token, at most ``num_max_tokens``
    tokens per rank and call. ``low_latency_mode`` builds the decode layout
    (``low_latency_dispatch``/``low_latency_combine``) instead of the normal one
    (``dispatch``/``combine``). ``num_sms`` bounds the blocks the kernels use (the rest of the GPU
    stays free for compute). ``receive_slots`` (normal mode, one node): rooms for a dispatch's
    results, picked per call by ``_native.set_receive_slot`` (``doorbell.deep_ep`` hands results
    out as tensors that outlive the next dispatch); default one, overwritten by each dispatch.
    Collective."""

    def __init__(
        self,
        comm: Communicator,
        hidden: int,
        num_experts: int,
        num_max_tokens: int,
        num_topk: int,
        low_latency_mode: bool = False,
        num_sms: Optional[int] = None,
        net_chunks: Optional[int] = None,
        receive_slots: int = 1,
    ) -> None:
        world = comm.world_size
        if hidden <= 0 or hidden % 128 != 0:
            raise ValueError(f"hidden={hidden}: a positive multiple of 128 (FP8 scales cover 128 values)")
        if num_experts <= 0 or num_experts % world != 0:
            raise ValueError(f"num_experts={num_experts}: a positive multiple of the {world} ranks")
        if not 0 < num_topk <= min(num_experts, 32):
            raise ValueError(f"num_topk={num_topk}: between 1 and min(num_experts, 32)")
        if num_max_tokens <= 0:
            raise ValueError(f"num_max_tokens={num_max_tokens}: at least 1")
        if num_sms is not None and num_sms <= 0:
            raise ValueError(f"num_sms={num_sms}: at least 1, or None for all SMs")
        self.comm = comm
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_local_experts = num_experts // world
        self.num_max_tokens = num_max_tokens
        self.num_topk = num_topk
        self.low_latency_mode = low_latency_mode
        self._native: Any
        if low_latency_mode:
            self._native = _doorbell.MoeLowLatency(comm._native, hidden, num_topk, num_experts, num_max_tokens, num_sms)
        else:
            self._native = _doorbell.MoeHighThroughput(
                comm._native, hidden, num_topk, num_experts, num_max_tokens, num_sms, net_chunks, receive_slots
            )
        self._dispatches = 0
        # Views of doorbell's result memory, made once per (address, shape, dtype): building one
        # through __cuda_array_interface__ takes tens of microseconds of host time, a call's
        # results are at fixed addresses (the low-latency path across nodes alternates two).
        self._views: Dict[Tuple[int, Tuple[int, ...], str], Any] = {}

    def _view(self, ptr: int, shape: Tuple[int, ...], dtype: str) -> Any:
        """A fresh alias (``view``) of the cached view of doorbell's memory at ``ptr``: callers may
        reshape what they get without touching the cache."""
        key = (int(ptr), shape, dtype)
        base = self._views.get(key)
        if base is None:
            # Owned by the native object, not by self: no cycle through the cache.
            base = device_view(ptr, shape, dtype, self.comm.device, self._native)
            self._views[key] = base
        return base.view(shape)

    # ---- layout ----

    def get_dispatch_layout(self, topk_idx: Any, num_experts: Optional[int] = None) -> Tuple[Any, Any, Any, Any, None]:
        """(num_tokens_per_rank [world] int32, num_tokens_per_rdma_rank [nodes] int32 or None
        inside one node, num_tokens_per_expert [num_experts] int32, is_token_in_rank
        [num_tokens, world] bool, None): computed with torch ops on the current stream. The
        dispatch computes its own layout on the GPU; this is for callers that want it."""
        import torch

        if num_experts is not None and num_experts != self.num_experts:
            raise ValueError(f"num_experts={num_experts}, but this buffer was built for {self.num_experts}")
        world = self.comm.world_size
        if len(getattr(topk_idx, "shape", ())) != 2:
            raise ValueError("topk_idx: expected shape (num_tokens, num_topk)")
        check_tensor("topk_idx", topk_idx, device=self.comm.device, dtypes=("int64", "int32"), ndim=2, align=4)
        idx = topk_idx.long()
        valid = idx >= 0
        per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=idx.device)
        per_expert.scatter_add_(0, idx.clamp(min=0).flatten(), valid.flatten().long())
        rank_of = torch.where(valid, idx // self.num_local_experts, torch.full_like(idx, world))
        in_rank = torch.zeros(idx.shape[0], world + 1, dtype=torch.bool, device=idx.device)
        in_rank.scatter_(1, rank_of, True)
        in_rank = in_rank[:, :world].contiguous()
        per_rank = in_rank.sum(0).int()
        return per_rank, None, per_expert.int(), in_rank, None

    # ---- normal (high-throughput) mode ----

    def dispatch(
        self, x: Union[Any, Tuple[Any, Any]], topk_idx: Any, topk_weights: Any, **_deepep_layout: Any
    ) -> Tuple[Any, Any, Any, Any, DispatchHandle, None]:
        """Sends each token once to every rank holding one of its experts. ``x``: bf16
        ``[num_tokens, hidden]``, or ``(e4m3 [num_tokens, hidden], float32 scales [num_tokens,
        hidden // 128])``. Returns ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert, handle, None)``: rows in ``recv_x[:handle.num_recv]`` (a
        device count: views span the buffer's capacity), local expert ids (-1 for experts
        elsewhere), and the per-local-expert counts as an int32 CUDA tensor. DeepEP's layout
        arguments are accepted and ignored (the kernels compute the layout). A dispatch that a
        fault cut short (the next synchronize raises ``DoorbellError``) leaves ``num_recv`` -1,
        every per-expert count negative and the rows all NaN, so nothing of it passes for a
        result."""
        idx, num_tokens = self._launch_dispatch(x, topk_idx, topk_weights)
        fp8 = isinstance(x, tuple)
        r = self._native.results()
        cap, k = int(r["max_rows"]), self.num_topk
        if fp8:
            recv_x = (
                self._view(r["recv_x"], (cap, self.hidden), "float8_e4m3fn"),
                self._view(r["recv_scales"], (cap, self.hidden // 128), "float32"),
            )
        else:
            recv_x = self._view(r["recv_x"], (cap, self.hidden), "bfloat16")
        recv_idx = self._view(r["recv_idx"], (cap, k), "int32")
        recv_w = self._view(r["recv_weights"], (cap, k), "float32")
        num_recv, counts = self._count_views(r)
        handle = DispatchHandle(num_tokens, self.hidden, (x, idx, topk_weights), num_recv)
        self._dispatches += 1
        return recv_x, recv_idx, recv_w, counts, handle, None

    def _launch_dispatch(self, x: Union[Any, Tuple[Any, Any]], topk_idx: Any, topk_weights: Any) -> Tuple[Any, int]:
        """:meth:`dispatch`'s checks and launch, without its results: the int32 ids the kernels
        read (keep them alive with the call) and the token count."""
        self._need(False, "dispatch")
        comm = self.comm
        fp8 = isinstance(x, tuple)
        rows: Any = x[0] if fp8 else x
        num_tokens = int(rows.shape[0]) if len(getattr(rows, "shape", ())) == 2 else -1
        if num_tokens < 0:
            raise ValueError("x: expected shape (num_tokens, hidden)")
        if num_tokens > self.num_max_tokens:
            raise ValueError(f"x: {num_tokens} tokens, but the buffer holds {self.num_max_tokens} per rank")
        idx = _topk_i32(comm, topk_idx, num_tokens, self.num_topk)
        check_tensor("topk_weights", topk_weights, device=comm.device, dtypes="float32", shape=(num_tokens, self.num_topk), align=4)
        stream = comm._stream_handle()
        if fp8:
            check_tensor("x[0]", x[0], device=comm.device, dtypes="float8_e4m3fn", shape=(num_tokens, self.hidden))
            check_tensor("x[1]", x[1], device=comm.device, dtypes="float32", shape=(num_tokens, self.hidden // 128), align=4)
            self._native.dispatch_fp8(x[0].data_ptr(), x[1].data_ptr(), idx.data_ptr(), topk_weights.data_ptr(), num_tokens, stream)
        else:
            check_tensor("x", rows, device=comm.device, dtypes="bfloat16", shape=(num_tokens, self.hidden))
            self._native.dispatch(rows.data_ptr(), idx.data_ptr(), topk_weights.data_ptr(), num_tokens, stream)
        return idx, num_tokens

    def _count_views(self, r: Optional[Dict[str, Any]] = None) -> Tuple[Any, Any]:
        """The high-throughput dispatch's device counts, at fixed addresses whatever the receive
        slot: rows received (int32 ``[1]``) and rows per local expert (int32 ``[local experts]``).
        ``r``: ``results()``, when the caller has it."""
        if r is None:
            r = self._native.results()
        return (
            self._view(r["num_recv"], (1,), "int32"),
            self._view(r["expert_counts"], (self.num_local_experts,), "int32"),
        )

    def dispatch_by_rank(
        self, x: Union[Any, Tuple[Any, Any]], is_token_in_rank: Any, num_tokens_per_expert: Any = None
    ) -> Tuple[Any, None, None, Any, DispatchHandle, None]:
        """A dispatch routed by ranks instead of experts (DeepEP's dispatch without top-k):
        ``is_token_in_rank [num_tokens, world]`` bool says where each token goes (each rank once).
        Rows arrive as from :meth:`dispatch`, with no ids or weights; ``num_tokens_per_expert``
        (int32 ``[num_experts]``, this rank's rows per expert) is summed over the sources into the
        per-local-expert counts (without it they stay 0). Returns ``(recv_x, None, None,
        num_recv_tokens_per_expert, handle, None)``; also across nodes."""
        num_tokens = self._launch_dispatch_by_rank(x, is_token_in_rank, num_tokens_per_expert)
        fp8 = isinstance(x, tuple)
        r = self._native.results()
        cap = int(r["max_rows"])
        if fp8:
            recv_x: Any = (
                self._view(r["recv_x"], (cap, self.hidden), "float8_e4m3fn"),
                self._view(r["recv_scales"], (cap, self.hidden // 128), "float32"),
            )
        else:
            recv_x = self._view(r["recv_x"], (cap, self.hidden), "bfloat16")
        num_recv, counts = self._count_views(r)
        handle = DispatchHandle(num_tokens, self.hidden, (x, is_token_in_rank, num_tokens_per_expert), num_recv)
        self._dispatches += 1
        return recv_x, None, None, counts, handle, None

    def _launch_dispatch_by_rank(self, x: Union[Any, Tuple[Any, Any]], is_token_in_rank: Any, num_tokens_per_expert: Any) -> int:
        """:meth:`dispatch_by_rank`'s checks and launch, without its results: the token count."""
        self._need(False, "dispatch_by_rank")
        comm = self.comm
        fp8 = isinstance(x, tuple)
        rows: Any = x[0] if fp8 else x
        num_tokens = int(rows.shape[0]) if len(getattr(rows, "shape", ())) == 2 else -1
        if num_tokens < 0:
            raise ValueError("x: expected shape (num_tokens, hidden)")
        if num_tokens > self.num_max_tokens:
            raise ValueError(f"x: {num_tokens} tokens, but the buffer holds {self.num_max_tokens} per rank")
        world = comm.world_size
        check_tensor("is_token_in_rank", is_token_in_rank, device=comm.device, dtypes="bool", shape=(num_tokens, world), align=1)
        per_expert = 0
        if num_tokens_per_expert is not None:
            check_tensor("num_tokens_per_expert", num_tokens_per_expert, device=comm.device, dtypes="int32", shape=(self.num_experts,), align=4)
            per_expert = num_tokens_per_expert.data_ptr()
        stream = comm._stream_handle()
        if fp8:
            check_tensor("x[0]", x[0], device=comm.device, dtypes="float8_e4m3fn", shape=(num_tokens, self.hidden))
            check_tensor("x[1]", x[1], device=comm.device, dtypes="float32", shape=(num_tokens, self.hidden // 128), align=4)
            # A rank with no tokens still says FP8 (a nonzero scales value; nothing is read).
            self._native.dispatch_by_rank(x[0].data_ptr(), x[1].data_ptr() or 16, is_token_in_rank.data_ptr(), per_expert, num_tokens, stream)
        else:
            check_tensor("x", rows, device=comm.device, dtypes="bfloat16", shape=(num_tokens, self.hidden))
            self._native.dispatch_by_rank(rows.data_ptr(), 0, is_token_in_rank.data_ptr(), per_expert, num_tokens, stream)
        return num_tokens

    def combine(
        self, x: Any, handle: DispatchHandle, out: Any = None, topk_weights: Any = None
    ) -> Tuple[Any, Optional[Any], None]:
        """``x``: bf16 rows aligned with the last dispatch's ``recv_x`` (each already weighted and
        summed over this rank's experts of its token). Returns ``(combined_x [num_tokens,
        hidden], combined_topk_weights, None)``: per token, the sum over the ranks it went to (f32,
        rank order); with ``topk_weights`` (float32 ``[rows, num_topk]`` aligned with ``x``, e.g.
        the dispatch's ``recv_topk_weights``) those are summed the same way into
        ``combined_topk_weights [num_tokens, num_topk]`` (across nodes: inside each node in rank
        order, then over the nodes in node order), else it is None."""
        import torch

        self._need(False, "combine")
        comm = self.comm
        if not isinstance(handle, DispatchHandle):
            raise TypeError("handle: pass the handle the matching dispatch returned")
        r = self._native.results()
        check_tensor("x", x, device=comm.device, dtypes="bfloat16", ndim=2)
        if int(x.shape[1]) != self.hidden or int(x.shape[0]) > int(r["max_rows"]):
            raise ValueError(f"x: {describe(x)}; expected (rows, {self.hidden}) with rows <= {int(r['max_rows'])}")
        if out is None:
            out = torch.empty(handle.num_tokens, self.hidden, dtype=torch.bfloat16, device=f"cuda:{comm.device}")
        check_tensor("out", out, device=comm.device, dtypes="bfloat16", shape=(handle.num_tokens, self.hidden))
        stream = comm._stream_handle()
        if topk_weights is None:
            self._native.combine(x.data_ptr(), out.data_ptr(), stream)
            return out, None, None
        check_tensor("topk_weights", topk_weights, device=comm.device, dtypes="float32", shape=(int(x.shape[0]), self.num_topk), align=4)
        weights = torch.empty(handle.num_tokens, self.num_topk, dtype=torch.float32, device=f"cuda:{comm.device}")
        self._native.combine(x.data_ptr(), out.data_ptr(), stream, topk_weights.data_ptr(), weights.data_ptr())
        return out, weights, None

    def get_combine_buffer(self) -> Any:
        """Normal mode: room for the expert outputs, bf16 ``[rows, hidden]`` aligned with
        ``recv_x``. With more than 64 SMs the combine pulls rows from each rank's combine area:
        this is that area, and outputs written here (after the dispatch) are not copied in. With
        64 or fewer it pushes rows from ``x`` wherever it is, and this is a tensor of its own."""
        self._need(False, "get_combine_buffer")
        r = self._native.results()
        return self._view(self._native.combine_buffer(), (int(r["max_rows"]), self.hidden), "bfloat16")

    # ---- low-latency mode ----

    def low_latency_dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        use_fp8: bool = False,
        return_recv_hook: bool = False,
        topk_weights: Any = None,
    ) -> Tuple[Any, Any, DispatchHandle, None, Optional[Callable[[], None]]]:
        """Decode dispatch: ``x`` bf16 ``[num_tokens, hidden]``. Returns ``(recv_x, recv_count,
        handle, None, hook)``: ``recv_x`` ``[num_local_experts, world * num_max_tokens,
        hidden]`` bf16 (with ``use_fp8``: a tuple of e4m3 rows and their float32 scales
        ``[.., hidden // 128]``, cast here per 128 values), ``recv_count`` int32
        ``[num_local_experts]``. With ``return_recv_hook`` only the send half is queued and
        ``hook()`` queues the receive half on the then-current stream (nothing holds an SM in
        between); otherwise hook is None. ``topk_weights`` (float32) are the weights
        ``low_latency_combine`` applies (default: ones). A dispatch that a fault cut short (the
        next synchronize raises ``DoorbellError``) leaves every ``recv_count`` -1 (and, inside a
        node, the rows NaN)."""
        import torch

        self._need(True, "low_latency_dispatch")
        comm = self.comm
        if num_max_dispatch_tokens_per_rank != self.num_max_tokens or num_experts != self.num_experts:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, num_experts={num_experts}: "
                f"this buffer was built for {self.num_max_tokens} and {self.num_experts}"
            )
        num_tokens = int(x.shape[0]) if len(getattr(x, "shape", ())) == 2 else -1
        if not 0 <= num_tokens <= self.num_max_tokens:
            raise ValueError(f"x: expected shape (num_tokens <= {self.num_max_tokens}, {self.hidden})")
        check_tensor("x", x, device=comm.device, dtypes="bfloat16", shape=(num_tokens, self.hidden))
        idx = _topk_i32(comm, topk_idx, num_tokens, self.num_topk)
        if topk_weights is None:
            topk_weights = torch.ones(num_tokens, self.num_topk, dtype=torch.float32, device=x.device)
        check_tensor("topk_weights", topk_weights, device=comm.device, dtypes="float32", shape=(num_tokens, self.num_topk), align=4)
        keep: Tuple[Any, ...] = (x, idx, topk_weights)
        stream = comm._stream_handle()
        if use_fp8:
            rows, scales = cast_fp8(x)
            keep = keep + (rows, scales)
            self._native.dispatch_send(rows.data_ptr(), scales.data_ptr(), idx.data_ptr(), topk_weights.data_ptr(), num_tokens, stream)
        else:
            self._native.dispatch_send(x.data_ptr(), 0, idx.data_ptr(), topk_weights.data_ptr(), num_tokens, stream)
        recv_x, recv_count, handle = self._ll_results(use_fp8, num_tokens, keep)
        hook = self._dispatch_recv_hook()
        if return_recv_hook:
            return recv_x, recv_count, handle, None, hook
        hook()
        return recv_x, recv_count, handle, None, None

    def begin_fused_low_latency_dispatch(
        self, topk_idx: Any, topk_weights: Any
    ) -> Tuple["FusedSend", Any, DispatchHandle, Callable[[], None]]:
        """A low-latency dispatch whose send half runs in your own CUDA kernel (fused with the
        computation that produces the rows). Launches nothing; returns ``(fused, recv_x,
        handle, hook)``: launch your kernel with ``fused.args`` (the bytes of the struct
        ``fused.struct`` from ``doorbell/coll/moe_args.cuh``, under ``get_include()``) and, in
        it, have one warp per token call ``put_token`` and every block ``finish_send`` (see the
        top of ``doorbell/coll/moe_ll.cuh`` or ``doorbell/coll/moe_net.cuh``, per ``fused.kind``); then call
        ``hook()`` for the receive half. ``recv_x`` and ``handle`` are as
        ``low_latency_dispatch``'s (bf16 rows)."""
        self._need(True, "begin_fused_low_latency_dispatch")
        comm = self.comm
        num_tokens = int(topk_idx.shape[0]) if len(getattr(topk_idx, "shape", ())) == 2 else -1
        if not 0 <= num_tokens <= self.num_max_tokens:
            raise ValueError(f"topk_idx: expected shape (num_tokens <= {self.num_max_tokens}, {self.num_topk})")
        idx = _topk_i32(comm, topk_idx, num_tokens, self.num_topk)
        check_tensor("topk_weights", topk_weights, device=comm.device, dtypes="float32", shape=(num_tokens, self.num_topk), align=4)
        kind, args = self._native.begin_fused_send(idx.data_ptr(), topk_weights.data_ptr(), num_tokens)
        recv_x, _, handle = self._ll_results(False, num_tokens, (idx, topk_weights))
        return FusedSend(kind, args), recv_x, handle, self._dispatch_recv_hook()

    def _ll_results(self, fp8: bool, num_tokens: int, keep: Tuple[Any, ...]) -> Tuple[Any, Any, DispatchHandle]:
        """Views of the low-latency dispatch just issued (its half: halves alternate), and its
        handle, which keeps ``keep`` alive until the combine."""
        self._dispatches += 1
        r = self._native.results()
        dev, el = self.comm.device, self.num_local_experts
        slots = self.comm.world_size * self.num_max_tokens
        recv_x: Any
        if fp8:
            recv_x = (
                self._view(r["recv_x"], (el, slots, self.hidden), "float8_e4m3fn"),
                self._view(r["recv_scales"], (el, slots, self.hidden // 128), "float32"),
            )
        else:
            recv_x = self._view(r["recv_x"], (el, slots, self.hidden), "bfloat16")
        recv_count = self._view(r["recv_count"], (el,), "int32")
        return recv_x, recv_count, DispatchHandle(num_tokens, self.hidden, keep, recv_count, self._dispatches)

    def _dispatch_recv_hook(self) -> Callable[[], None]:
        """Queues the receive half of the last dispatch on the then-current stream."""

        def hook() -> None:
            s = self.comm._stream_handle()
            self._native.dispatch_recv(s)

        return hook

    def get_next_low_latency_combine_buffer(self, handle: DispatchHandle) -> Any:
        """The combine buffer as a bf16 ``[num_local_experts, world * num_max_tokens, hidden]``
        tensor: write expert outputs here and pass it to ``low_latency_combine`` (no copy)."""
        self._need(True, "get_next_low_latency_combine_buffer")
        r = self._native.results()
        shape = (self.num_local_experts, self.comm.world_size * self.num_max_tokens, self.hidden)
        return self._view(r["combine_buffer"], shape, "bfloat16")

    def low_latency_combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: DispatchHandle,
        return_recv_hook: bool = False,
        out: Any = None,
    ) -> Tuple[Any, None, Optional[Callable[[], None]]]:
        """``x``: bf16 ``[num_local_experts, world * num_max_tokens, hidden]`` expert outputs at
        ``recv_x``'s positions. Returns ``(combined_x [num_tokens, hidden], None, hook)``: per
        token, the sum of its selections' outputs weighted by the dispatch's ``topk_weights``
        (``topk_idx``/``topk_weights`` here must be the dispatch's). With ``return_recv_hook``
        ``hook()`` queues the receive half."""
        import torch

        self._need(True, "low_latency_combine")
        comm = self.comm
        if not isinstance(handle, DispatchHandle):
            raise TypeError("handle: pass the handle the matching low_latency_dispatch returned")
        buf = self.get_next_low_latency_combine_buffer(handle)
        check_tensor("x", x, device=comm.device, dtypes="bfloat16", shape=tuple(buf.shape))
        if x.data_ptr() != buf.data_ptr():
            buf.copy_(x)
        if out is None:
            out = torch.empty(handle.num_tokens, self.hidden, dtype=torch.bfloat16, device=f"cuda:{comm.device}")
        check_tensor("out", out, device=comm.device, dtypes="bfloat16", shape=(handle.num_tokens, self.hidden))
        stream = comm._stream_handle()
        self._native.combine_send(stream)

        def hook() -> None:
            s = comm._stream_handle()
            self._native.combine_recv(out.data_ptr(), s)

        if return_recv_hook:
            return out, None, hook
        hook()
        return out, None, None

    def _need(self, low_latency: bool, call: str) -> None:
        if low_latency != self.low_latency_mode:
            mode = "low_latency_mode=True" if low_latency else "low_latency_mode=False"
            raise RuntimeError(f"{call} needs a Buffer built with {mode}")


class FusedSend:
    """The argument struct of a fused send: ``kind`` is ``"nvlink"`` (struct ``MoeLlArgs``, calls
    in ``doorbell/coll/moe_ll.cuh``) or ``"net"`` (``MoeNetArgs``, ``doorbell/coll/moe_net.cuh``); ``args``
    its bytes, to pass by value as the kernel parameter of that type."""

    def __init__(self, kind: str, args: bytes) -> None:
        self.kind = kind
        self.struct = "doorbell::MoeLlArgs" if kind == "nvlink" else "doorbell::MoeNetArgs"
        self.args = bytes(args)

    def __repr__(self) -> str:
        return f"FusedSend({self.kind!r}, {self.struct}, {len(self.args)} bytes)"


def cast_fp8(x: Any) -> Tuple[Any, Any]:
    """bf16 ``[n, hidden]`` -> (e4m3 ``[n, hidden]``, float32 scales ``[n, hidden // 128]``):
    each 128 values scaled so their largest magnitude maps to 448 (e4m3's largest)."""
    import torch

    n, h = int(x.shape[0]), int(x.shape[1])
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    scales = (amax / 448.0).contiguous()
    rows = (blocks / scales.unsqueeze(-1)).view(n, h).to(torch.float8_e4m3fn).contiguous()
    return rows, scales
