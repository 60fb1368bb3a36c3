# Types of the extension module built from python/src/lib.rs (device addresses and stream
# handles are plain ints; only the doorbell package should call it).
from typing import Dict, Optional, Tuple

class DoorbellError(RuntimeError): ...
class NoGpuError(DoorbellError): ...

def version() -> str: ...
def cuda_driver_present() -> bool: ...
def device_count() -> int: ...
def free_port() -> int: ...

class Comm:
    @staticmethod
    def connect(
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        addr: str,
        port: int,
        secret: bytes,
        device: int,
        timeout_s: float = 300.0,
    ) -> "Comm": ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def spans_nodes(self) -> bool: ...
    def all_reduce(self, input: int, output: int, count: int, dtype_name: str, stream: int) -> None: ...
    def all_to_all(self, input: int, output: int, bytes_per_peer: int, stream: int) -> None: ...
    def all_to_all_v(
        self, input: int, input_bytes: int, output: int, output_bytes: int, counts: int, stream: int
    ) -> None: ...
    def synchronize(self, stream: int) -> None: ...
    def check_health(self) -> None: ...
    def alloc(self, nbytes: int) -> "Registered": ...
    def memory_channels(
        self, src: "Registered", dst: "Registered", packets: Optional["Registered"] = None
    ) -> "MemChannels": ...

class Registered:
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

class MemChannels:
    def handles(self) -> bytes: ...
    @staticmethod
    def handle_size() -> int: ...

class MoeHighThroughput:
    def __init__(
        self,
        comm: Comm,
        hidden: int,
        topk: int,
        num_experts: int,
        max_tokens: int,
        sms: Optional[int] = None,
        net_chunks: Optional[int] = None,
    ) -> None: ...
    @property
    def spans_nodes(self) -> bool: ...
    @property
    def sms(self) -> int: ...
    def dispatch(self, x: int, topk_idx: int, topk_weights: int, num_tokens: int, stream: int) -> None: ...
    def dispatch_fp8(
        self, x: int, scales: int, topk_idx: int, topk_weights: int, num_tokens: int, stream: int
    ) -> None: ...
    def combine(self, y: int, out: int, stream: int, y_weights: int = 0, out_weights: int = 0) -> None: ...
    def dispatch_by_rank(self, x: int, scales: int, in_rank: int, tokens_per_expert: int, num_tokens: int, stream: int) -> None: ...
    def results(self) -> Dict[str, int]: ...

class MoeLowLatency:
    def __init__(
        self,
        comm: Comm,
        hidden: int,
        topk: int,
        num_experts: int,
        max_tokens: int,
        sms: Optional[int] = None,
        deep_ep_layout: bool = False,
        rank_mask: bool = False,
    ) -> None: ...
    @property
    def spans_nodes(self) -> bool: ...
    def set_rank_masked(self, rank: int, masked: bool, stream: int) -> None: ...
    def clean_rank_mask(self, stream: int) -> None: ...
    def rank_mask_ptr(self, stream: int) -> int: ...
    def dispatch_send(
        self, x: int, scales: int, topk_idx: int, topk_weights: int, num_tokens: int, stream: int
    ) -> None: ...
    def begin_fused_send(self, topk_idx: int, topk_weights: int, num_tokens: int) -> Tuple[str, bytes]: ...
    def dispatch_recv(self, stream: int) -> None: ...
    def combine_send(self, stream: int) -> None: ...
    def combine_recv(self, out: int, stream: int) -> None: ...
    def results(self, n: Optional[int] = None) -> Dict[str, int]: ...
    def dispatch_packed(
        self,
        x: int,
        topk_idx: int,
        num_tokens: int,
        out_x: int,
        scales: int,
        round_scale: bool,
        ue8m0: bool,
        src_info: int,
        layout_range: int,
        count: int,
        stats: int,
        ticket: int,
        send_only: bool,
        stream: int,
        ids_i64: bool = False,
    ) -> None: ...
    def dispatch_packed_recv(
        self,
        out_x: int,
        scales: int,
        round_scale: bool,
        ue8m0: bool,
        src_info: int,
        layout_range: int,
        count: int,
        stats: int,
        ticket: int,
        stream: int,
    ) -> None: ...
    def combine_packed(
        self,
        y: int,
        src_info: int,
        layout_range: int,
        topk_idx: int,
        topk_weights: int,
        num_tokens: int,
        out: int,
        ticket: int,
        send: bool,
        recv: bool,
        stream: int,
        ids_i64: bool = False,
    ) -> None: ...
