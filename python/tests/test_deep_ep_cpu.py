"""CPU tests of ``doorbell.deep_ep`` (DeepEP's API): what needs no GPU and no torch: the package
imports, DeepEP's static helpers and Config, argument refusals before anything is built, and the
names of what is not built yet."""

import importlib
import os
import types

import pytest

import doorbell
import doorbell.deep_ep as deep_ep
from doorbell.deep_ep import Buffer, Config, EventOverlap


def test_the_package_and_its_utils_import_without_torch():
    for m in ("doorbell.deep_ep.utils", "doorbell.deep_ep.utils.math", "doorbell.deep_ep.utils.testing", "doorbell.deep_ep.utils.envs"):
        importlib.import_module(m)
    assert set(deep_ep.__all__) == {"Buffer", "Config", "EventOverlap", "topk_idx_t"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        deep_ep.nope  # noqa: B018


def test_config_takes_deepeps_arguments_and_refuses_nonsense():
    c = Config(24, 8, 256)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens) == (24, 8, 256)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 256)
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0  # one node
    assert c.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    for bad in (0, -1, 1.5, True, "24"):
        with pytest.raises(ValueError, match="num_sms"):
            Config(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_max_nvl_chunked_recv_tokens"):
        Config(24, 8, 0)


def test_static_helpers_follow_deepep():
    assert Buffer.is_sm90_compiled()
    before = Buffer.num_sms
    try:
        Buffer.set_num_sms(32)
        assert Buffer.get_dispatch_config(8).num_sms == 32
        assert Buffer.get_combine_config(8).num_sms == 32
        with pytest.raises(ValueError, match="set_num_sms"):
            Buffer.set_num_sms(0)
    finally:
        Buffer.set_num_sms(before)
    small = Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert small > 0
    assert Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 256) > small


def test_buffer_refuses_before_joining_anything():
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(None, num_nvl_bytes=-1)
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        Buffer(None, num_qps_per_rank=0)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        Buffer(None, low_latency_mode=True)
    with pytest.raises(NotImplementedError, match="without a torch.distributed group"):
        Buffer(None, int(1e9), enable_shrink=True)
    with pytest.raises(NotImplementedError, match="without a torch.distributed group"):
        Buffer(None, int(1e9))


def test_an_event_overlap_without_an_event_says_so():
    e = EventOverlap()
    with pytest.raises(ValueError, match="no event"):
        e.current_stream_wait()
    with e as same:  # nothing to wait for at the end
        assert same is e


def _bare_low_latency_buffer() -> Buffer:
    """A Buffer's state without joining a group (the checks below come before any GPU work)."""
    b = Buffer.__new__(Buffer)
    b._destroyed = False
    b.low_latency_mode = True
    b.group_size = 2
    b.num_rdma_bytes = 0
    b._ll_made = {}
    return b


def test_low_latency_calls_refuse_deepeps_invalid_flag_mixes_before_anything_is_sent():
    b = _bare_low_latency_buffer()
    with pytest.raises(ValueError, match="use_ue8m0 needs round_scale=True"):
        b.low_latency_dispatch(None, None, 128, 16, use_ue8m0=True)
    with pytest.raises(ValueError, match="round_scale and use_ue8m0 are for use_fp8=True"):
        b.low_latency_dispatch(None, None, 128, 16, use_fp8=False, round_scale=True)
    # use_logfmt: bf16 rows, with one warning a process; log rows on one node when asked for.
    b._across = False
    assert not b._log_rows(False)
    Buffer._logfmt_warned = False
    with pytest.warns(UserWarning, match="slower than bf16; DOORBELL_DEEP_EP_LOG_ROWS=1 sends them"):
        assert not b._log_rows(True)
    os.environ["DOORBELL_DEEP_EP_LOG_ROWS"] = "1"
    try:
        assert b._log_rows(True)
        b._across = True
        Buffer._logfmt_warned = False
        with pytest.warns(UserWarning, match="across nodes there are no log rows yet"):
            assert not b._log_rows(True)
    finally:
        del os.environ["DOORBELL_DEEP_EP_LOG_ROWS"]
    with pytest.raises(TypeError, match="pass the handle low_latency_dispatch returned"):
        b.low_latency_combine(None, None, None, None, use_logfmt=True)
    with pytest.raises(ValueError, match="a multiple of 2"):
        b.clean_low_latency_buffer(128, 7168, 3)
    with pytest.raises(ValueError, match="hidden"):
        b.clean_low_latency_buffer(128, 0, 4)
    b.clean_low_latency_buffer(128, 7168, 4)  # nothing to clean: every word carries its call's epoch
    b.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        b.clean_low_latency_buffer(128, 7168, 4)


def test_the_low_latency_size_hint_holds_the_rows_the_combine_returns():
    # DeepEP's decode shape: every (expert, token) row can come back, in two halves.
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 2, 288) >= 2 * 288 * 128 * 7168 * 2


class _FakeLowLatency:
    """Records the rank-mask calls a Buffer makes on one low-latency shape's exchange."""

    def __init__(self) -> None:
        self.calls: list = []

    def set_rank_masked(self, rank: int, masked: bool, stream: int) -> None:
        self.calls.append(("set", rank, masked, stream))

    def clean_rank_mask(self, stream: int) -> None:
        self.calls.append(("clean", stream))


def test_rank_masks_need_enable_shrink_and_reach_every_low_latency_shape():
    b = _bare_low_latency_buffer()
    b.enable_shrink = False
    b._masked = set()
    b._ll = {}
    for call in (lambda: b.low_latency_update_mask_buffer(1, True), b.low_latency_clean_mask_buffer,
                 lambda: b.low_latency_query_mask_buffer(None)):
        with pytest.raises(RuntimeError, match="enable_shrink=True"):
            call()
    b.enable_shrink = True
    b._current_stream_handle = lambda: 7
    shapes = [_FakeLowLatency(), _FakeLowLatency()]
    b._ll = {(7168, 16, 128, 8): shapes[0], (4096, 16, 128, 8): shapes[1]}
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match="rank_to_mask"):
            b.low_latency_update_mask_buffer(bad, True)
    assert all(s.calls == [] for s in shapes)
    b.low_latency_update_mask_buffer(1, True)
    assert b._masked == {1}
    b.low_latency_update_mask_buffer(1)  # DeepEP's default: unmask
    assert b._masked == set()
    b.low_latency_update_mask_buffer(0, True)
    b.low_latency_clean_mask_buffer()
    assert b._masked == set()
    for s in shapes:
        assert s.calls == [("set", 1, True, 7), ("set", 1, False, 7), ("set", 0, True, 7), ("clean", 7)]
    b.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        b.low_latency_clean_mask_buffer()


class _Shaped:
    """Stands in for a tensor where only the shape is read before the refusal."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape


def _bare_normal_buffer() -> Buffer:
    b = Buffer.__new__(Buffer)
    b._destroyed = False
    b.low_latency_mode = False
    b.group_size = 2
    b._normal = {}
    b._last_normal = (None, None)
    b._last_route = None
    b._across = False
    return b


def test_across_nodes_normal_mode_refuses_what_it_lacks_before_anything_is_sent():
    b = _bare_normal_buffer()
    b._across = True
    x, idx, per_expert = _Shaped(64, 7168), _Shaped(64, 8), _Shaped(16)
    # DeepEP refuses num_worst_tokens across nodes too (with top-k and without).
    with pytest.raises(ValueError, match="num_worst_tokens is for one node"):
        b.dispatch(x, topk_idx=idx, topk_weights=object(), num_tokens_per_expert=per_expert, num_worst_tokens=128)
    with pytest.raises(NotImplementedError, match="num_worst_tokens without top-k"):
        b.dispatch(x, is_token_in_rank=object(), num_tokens_per_expert=per_expert, num_worst_tokens=128)
    # Without top-k the layout's outputs are required there as on one node.
    with pytest.raises(ValueError, match="num_tokens_per_expert"):
        b.dispatch(x, is_token_in_rank=object())
    # A handle is DeepEP's one-node 6-tuple or internode 10-tuple with doorbell's part last.
    for bad in ((None,) * 10, (None,) * 6, (None,) * 9):
        with pytest.raises(TypeError, match="the handle a dispatch of this Buffer returned"):
            b.dispatch(x, handle=bad)


def test_a_normal_dispatchs_host_read_raises_what_cut_it_short():
    class Comm:
        def __init__(self, error=None):
            self.error, self.asked = error, 0

        def check_health(self):
            self.asked += 1
            if self.error is not None:
                raise self.error

    b = _bare_normal_buffer()
    b._comm = Comm()
    # One node: counts that are results are not checked further; rounded up to the alignment.
    assert b._checked_counts([7, 3, 4], 4) == (7, [4, 4]) and b._comm.asked == 0
    # Marked counts raise, naming the communicator's error where it has one.
    with pytest.raises(RuntimeError, match="cut short by a fault"):
        b._checked_counts([-1, 3], 1)
    b._comm = Comm(doorbell.DoorbellError("rank 1 failed: timeout"))
    with pytest.raises(doorbell.DoorbellError, match="rank 1 failed"):
        b._checked_counts([5, -2147483648], 1)
    # Across nodes the exchange between nodes can give up while the node's dispatch of what did
    # arrive finishes: counts that look whole still raise when the communicator failed.
    b._across = True
    with pytest.raises(doorbell.DoorbellError, match="rank 1 failed"):
        b._checked_counts([5, 2, 3], 1)
    b._comm = Comm()
    assert b._checked_counts([5, 2, 3], 1) == (5, [2, 3]) and b._comm.asked == 1


def test_normal_dispatch_refuses_deepeps_invalid_arguments_before_anything_is_sent():
    b = _bare_normal_buffer()
    x, idx, per_expert = _Shaped(64, 7168), _Shaped(64, 8), _Shaped(16)
    with pytest.raises(ValueError, match="topk_weights is required"):
        b.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank is for the internode"):
        b.dispatch(x, topk_idx=idx, topk_weights=object(), num_tokens_per_expert=per_expert,
                   num_tokens_per_rdma_rank=object())
    with pytest.raises(ValueError, match="num_tokens_per_expert .* is required"):
        b.dispatch(x, topk_idx=idx, topk_weights=object())
    for bad in (0, -2, True, 1.0):
        with pytest.raises(ValueError, match="expert_alignment"):
            b.dispatch(x, topk_idx=idx, topk_weights=object(), num_tokens_per_expert=per_expert, expert_alignment=bad)
        # Without top-k too (the list is rounded up to it there as well).
        with pytest.raises(ValueError, match="expert_alignment"):
            b.dispatch(x, is_token_in_rank=object(), num_tokens_per_expert=per_expert, expert_alignment=bad)
    for bad in (-1, False, 2.5):
        with pytest.raises(ValueError, match="num_worst_tokens"):
            b.dispatch(x, topk_idx=idx, topk_weights=object(), num_tokens_per_expert=per_expert, num_worst_tokens=bad)
    with pytest.raises(ValueError, match="x is \\(num_tokens, hidden\\)"):
        b.dispatch(_Shaped(7168), topk_idx=idx, topk_weights=object(), num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match="topk_idx is \\(num_tokens, num_topk\\)"):
        b.dispatch(x, topk_idx=_Shaped(64), topk_weights=object(), num_tokens_per_expert=per_expert)
    # Without top-k: routed by is_token_in_rank, or by a handle of this Buffer.
    with pytest.raises(ValueError, match="topk_weights without topk_idx"):
        b.dispatch(x, is_token_in_rank=object(), topk_weights=object())
    with pytest.raises(ValueError, match="is_token_in_rank .* routes the tokens"):
        b.dispatch(x, num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match="num_tokens_per_expert .* is required"):
        b.dispatch(x, is_token_in_rank=object())
    with pytest.raises(TypeError, match="the handle a dispatch of this Buffer returned"):
        b.dispatch(x, handle=(None,) * 6)
    with pytest.raises(NotImplementedError, match="num_worst_tokens without top-k"):
        b.dispatch(x, is_token_in_rank=object(), num_tokens_per_expert=per_expert, num_worst_tokens=128)
    assert b._normal == {}  # nothing was built


def test_normal_combine_refuses_a_foreign_handle_and_a_bias():
    b = _bare_normal_buffer()
    with pytest.raises(TypeError, match="the handle the matching dispatch"):
        b.combine(_Shaped(64, 7168), (None,) * 6)
    with pytest.raises(TypeError, match="the handle the matching dispatch"):
        b.combine(_Shaped(64, 7168), "handle")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="bias"):
        b.combine(_Shaped(64, 7168), (None,) * 6, bias=object())
    b.destroy()
    with pytest.raises(RuntimeError, match="after destroy"):
        b.combine(_Shaped(64, 7168), (None,) * 6)


def test_low_latency_calls_refuse_bad_shapes_and_handles_before_anything_is_sent():
    b = _bare_low_latency_buffer()
    b._comm = types.SimpleNamespace(device=0)  # the GPU the checks name; never opened here
    with pytest.raises(ValueError, match="x is \\(num_tokens, hidden\\)"):
        b.low_latency_dispatch(_Shaped(7168), None, 128, 16)
    with pytest.raises(ValueError, match="200 tokens, num_max_dispatch_tokens_per_rank=128"):
        b.low_latency_dispatch(_Shaped(200, 7168), None, 128, 16)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=True"):
        b.low_latency_dispatch(_Shaped(1, 7168), None, True, 16)  # type: ignore[arg-type]
    for handle in (None, (1, 2, 3), "handle"):
        with pytest.raises(TypeError, match="pass the handle low_latency_dispatch returned"):
            b.get_next_low_latency_combine_buffer(handle)
        with pytest.raises(TypeError, match="pass the handle low_latency_dispatch returned"):
            b.low_latency_combine(None, None, None, handle)
    with pytest.raises(ValueError, match="num_experts=15; a multiple of 2"):
        b.get_next_low_latency_combine_buffer((None, None, 128, 7168, 15))


def test_receive_slots_are_leased_and_layouts_tracked(monkeypatch):
    """The normal mode's receive slots (no GPU): a slot is handed out while a lease on it lives
    (slot 0, the adapter's own, when every other is held), and a handle's layout counts as kept
    while no dispatch of another routing landed in its slot since."""
    import gc

    from doorbell.deep_ep import _buffer as b

    slots = b._Slots(3)
    k1, l1 = slots.take(capturing=False)
    k2, l2 = slots.take(capturing=False)
    k0, l0 = slots.take(capturing=False)
    assert (k1, k2, k0) == (1, 2, 0) and l1 is not None and l2 is not None and l0 is None
    del l1
    gc.collect()
    assert slots.take(capturing=False)[0] == 1  # its lease is gone: free again
    # Under graph capture a slot stays taken for good (the graph's replays write it).
    slots = b._Slots(2)
    assert slots.take(capturing=True)[0] == 1
    gc.collect()
    assert slots.take(capturing=False)[0] == 0

    route_a, route_b = (object(), 1, 0), (object(), 2, 0)
    slots = b._Slots(2)
    h = b._NormalHandle(None, None, 4, 8, route_a, 0, slots.landed(0, route_a))  # type: ignore[arg-type]
    assert slots.holds(h)
    slots.landed(0, route_a)  # the same routing again (a cached dispatch): the same layout
    assert slots.holds(h)
    slots.landed(0, route_b)
    assert not slots.holds(h)

    # The exchange is pointed at a slot by a native call only when the slot changes (a host
    # call less on the dispatch's path to its launch).
    class Native:
        def __init__(self):
            self.calls = []

        def set_receive_slot(self, k):
            self.calls.append(k)

    native, slots = Native(), b._Slots(3)
    for k in (1, 1, 2, 2, 1, 0, 0):
        slots.point(native, k)
    assert native.calls == [1, 2, 1, 0] and slots.pointed == 0

    monkeypatch.setenv("DOORBELL_DEEP_EP_RECEIVE_SLOTS", "2")
    assert b._receive_slots() == 2
    assert b._normal_bytes_per_token(2, 128, 2) < b._normal_bytes_per_token(2, 128, 2, slots=3)
    for bad in ("0", "x", "-1"):
        monkeypatch.setenv("DOORBELL_DEEP_EP_RECEIVE_SLOTS", bad)
        with pytest.raises(ValueError, match="DOORBELL_DEEP_EP_RECEIVE_SLOTS"):
            b._receive_slots()


def test_bench_kineto_sums_a_calls_kernels_per_part_and_names_a_wrong_count():
    from doorbell.deep_ep.utils.testing import _period_means

    # One kernel per call and part: plain means.
    assert _period_means([1.0, 3.0], 2, 1, "*x*") == 2.0
    assert _period_means([1.0, 2.0, 3.0, 4.0], 2, 2, "*x*") == [2.0, 3.0]
    # Across nodes a dispatch launches prep, send, receive and pack: summed per call (one part),
    # or per half with the hook (two parts of two kernels each).
    assert _period_means([1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0], 2, 1, "*x*") == 10.0
    assert _period_means([1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0], 2, 2, "*x*") == [3.0, 7.0]
    for spans in ([], [1.0, 2.0, 3.0]):
        with pytest.raises(AssertionError, match=r"kernels named \*x\* in 2 calls; expected a multiple of 2"):
            _period_means(spans, 2, 2, "*x*")


def test_the_wait_statistics_are_ranks_int64_on_the_communicators_gpu():
    """DeepEP's dispatch/combine_wait_recv_cost_stats: [ranks] int64 on the communicator's GPU,
    8-byte aligned; None passes nothing."""
    from test_cpu import FakeTensor

    b = _bare_low_latency_buffer()
    b._comm = types.SimpleNamespace(device=0)
    assert b._wait_stats("dispatch_wait_recv_cost_stats", None) == 0
    good = FakeTensor((2,), dtype="int64", ptr=0x20000, size=8)
    assert b._wait_stats("dispatch_wait_recv_cost_stats", good) == 0x20000
    with pytest.raises(ValueError, match=r"combine_wait_recv_cost_stats: .*expected shape \(2\)"):
        b._wait_stats("combine_wait_recv_cost_stats", FakeTensor((4,), dtype="int64", size=8))
    with pytest.raises(TypeError, match="expected int64"):
        b._wait_stats("combine_wait_recv_cost_stats", FakeTensor((2,), dtype="int32", size=4))
    with pytest.raises(ValueError, match="move it to the GPU"):
        b._wait_stats("dispatch_wait_recv_cost_stats", FakeTensor((2,), dtype="int64", cuda=False, size=8))


def test_normal_calls_run_on_the_current_stream_only_on_one_node_without_event_or_async(monkeypatch):
    """Where a normal-mode call runs: the current stream itself (None) on one node without
    previous_event or async_finish; the communication stream, made to wait for the current
    one, across nodes (where the current stream failed every separate-node case) or with
    async_finish."""
    import sys
    import types

    waited = []

    class Stream:
        def wait_stream(self, other):
            waited.append(other)

    current = Stream()
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(current_stream=lambda: current)
    monkeypatch.setitem(sys.modules, "torch", fake)
    b = _bare_normal_buffer()
    b._stream = Stream()
    assert b._begin(None, False) is None and waited == []
    assert b._begin(None, True) is current and waited == [current]
    b._across = True
    assert b._begin(None, False) is current and waited == [current, current]


def test_a_combine_skips_the_checks_only_for_a_handle_this_buffer_made():
    """A handle low_latency_dispatch returned (listed by id, kept) is taken as it is; any other
    tuple, even with the same contents, is checked."""
    b = _bare_low_latency_buffer()
    b._comm = type("C", (), {"device": 0})()
    bad = (_Shaped(1), _Shaped(1), 128, 7168, 288)  # tensors no check would accept
    b._ll_made[id(bad)] = bad
    assert b._ll_handle(bad) == (bad[0], bad[1], 128, 7168, 288)
    with pytest.raises((TypeError, ValueError)):
        b._ll_handle((bad[0], bad[1], 128, 7168, 288))


def test_a_host_reading_dispatch_is_refused_under_graph_capture_before_a_slot_is_taken(monkeypatch):
    """Under CUDA graph capture a dispatch that reads its count on the host is refused by name
    (num_worst_tokens is the capturable form) before any slot is leased or pointed; a capturable
    dispatch there takes a slot for good; outside capture the slot is pointed once."""
    import sys
    import types

    from doorbell.deep_ep import _buffer as bmod

    capturing = [True]
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_current_stream_capturing=lambda: capturing[0])
    monkeypatch.setitem(sys.modules, "torch", fake)

    class Native:
        def __init__(self):
            self.calls = []

        def set_receive_slot(self, k):
            self.calls.append(k)

    buf = types.SimpleNamespace(_native=Native())
    b = _bare_normal_buffer()
    b._slots = {id(buf): bmod._Slots(3)}
    with pytest.raises(RuntimeError, match="num_worst_tokens"):
        b._take_slot(buf, host_read=True)  # type: ignore[arg-type]
    assert buf._native.calls == [] and b._slots[id(buf)].leases == [None, None, None]
    k, lease = b._take_slot(buf)  # type: ignore[arg-type]
    assert k == 1 and lease is not None and b._slots[id(buf)].leases[1] is lease  # kept for good
    capturing[0] = False
    k2, l2 = b._take_slot(buf, host_read=True)  # type: ignore[arg-type]
    del l2  # its results dropped: slot 2 free again
    k3, l3 = b._take_slot(buf, host_read=True)  # type: ignore[arg-type]
    assert (k2, k3) == (2, 2) and buf._native.calls == [1, 2]  # pointed only when it changed
    k4, _ = b._take_slot(buf, host_read=True)  # type: ignore[arg-type]
    assert k4 == 0 and buf._native.calls == [1, 2, 0]  # every other slot held: the adapter's own
