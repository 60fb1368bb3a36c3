"""Timing helpers with the names and meaning of DeepEP's ``deep_ep.utils.testing`` (what its
tests import), written for doorbell."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union


def bench(fn: Callable[[], Any], num_warmups: int = 50, num_tests: int = 50, post_fn: Optional[Callable[[], Any]] = None) -> Tuple[float, float, float]:
    """Times ``fn`` on the current stream with CUDA events, the L2 cache flushed before each call:
    ``(mean, min, max)`` seconds over ``num_tests`` calls after ``num_warmups`` (the first timed
    call left out of the mean)."""
    import torch

    torch.cuda.synchronize()
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")  # 256 MB, past any L2
    for _ in range(num_warmups):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
    for i in range(num_tests):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
        if post_fn is not None:
            post_fn()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    kept = times[1:] if len(times) > 1 else times
    return sum(kept) / len(kept), min(times), max(times)


def bench_kineto(
    fn: Callable[[], Any],
    kernel_names: Union[str, Sequence[str]],
    num_tests: int = 30,
    suppress_kineto_output: bool = False,
    trace_path: Optional[str] = None,
    barrier_comm_profiling: bool = False,
    num_kernels_per_period: int = 1,
) -> Any:
    """Runs ``fn`` ``num_tests`` times under the PyTorch profiler and returns, for each name in
    ``kernel_names``, the mean GPU time in seconds of the kernels whose names contain it: one
    float per name, or with ``num_kernels_per_period`` > 1 a list of that many (the calls'
    first, second, ... part, in launch order). Each part is one kernel, or the sum of ``m``
    consecutive ones when a call launches ``m`` times ``num_kernels_per_period`` matching
    kernels (doorbell's calls across nodes: a dispatch is a prep, send, receive and pack
    kernel). A count per call that is not such a multiple is an error naming the kernels.
    ``barrier_comm_profiling``: a ``torch.distributed`` barrier before each call, so ranks start
    together."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    names = [kernel_names] if isinstance(kernel_names, str) else list(kernel_names)
    fn()  # warm up outside the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_tests):
            if barrier_comm_profiling:
                torch.distributed.barrier()
                torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernels.sort(key=lambda e: e.time_range.start)
    results: List[Any] = []
    for name in names:
        hits = [e for e in kernels if name in e.name]
        spans = [(e.time_range.end - e.time_range.start) / 1e6 for e in hits]  # us -> s
        results.append(_period_means(spans, num_tests, num_kernels_per_period, f"*{name}* ({sorted({e.name for e in hits})})"))
    if not suppress_kineto_output:
        print(prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=60, row_limit=12))
    return results[0] if isinstance(kernel_names, str) else tuple(results)


def _period_means(spans: Sequence[float], num_tests: int, period: int, what: str) -> Any:
    """The mean time of each of a call's ``period`` parts, from the matching kernels' durations
    ``spans`` in launch order over ``num_tests`` calls: a float for one part, else a list. A
    call that launches ``m`` times ``period`` matching kernels has each part summed over ``m``
    consecutive ones; any other count is an error naming ``what``."""
    per_part = len(spans) // (num_tests * period)
    if per_part == 0 or len(spans) != per_part * num_tests * period:
        raise AssertionError(
            f"bench_kineto: {len(spans)} kernels named {what} in {num_tests} calls; expected a "
            f"multiple of {period} per call"
        )
    parts = [sum(spans[i : i + per_part]) for i in range(0, len(spans), per_part)]
    means = [sum(parts[i::period]) / num_tests for i in range(period)]
    return means[0] if period == 1 else means
