"""How UniEP times a call: the per-call times the tuner (``uniep.tune``) measures candidates by
and the benchmarks (``bench/common.py``) report medians of."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["time_calls_ms"]


def time_calls_ms(fn: Callable[[], object], iters: int, cuda: bool) -> list[float]:
    """The time of each of ``iters`` calls of ``fn()`` in milliseconds, no warm-up.

    With ``cuda`` each call is timed with CUDA events on the current stream (the host does not
    wait between calls, so launch overhead is hidden as it would be in a training step);
    otherwise with ``time.perf_counter``.
    """
    if not cuda:
        times: list[float] = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]
