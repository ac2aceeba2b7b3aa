"""How UniEP times a call: the per-call times the tuner (``uniep.tune``) measures candidates by
and the benchmarks (``bench/harness/common.py``) report medians of."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

__all__ = ["interleaved_medians_ms", "time_calls_ms"]


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


def interleaved_medians_ms(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    iters: int,
    cuda: bool,
    *,
    warmup: int = 0,
    before: Callable[[], object] | None = None,
) -> dict[str, float]:
    """The median per-call time in ms of each of ``fns``, timed in ``rounds`` interleaved rounds
    (every function once per round, in order) of ``iters`` calls after ``warmup`` untimed ones,
    ``before()`` ahead of each: a clock or thermal drift spreads over all of them instead of
    favouring the ones timed first."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before is not None:
                before()
            for _ in range(warmup):
                fn()
            samples[name] += time_calls_ms(fn, iters, cuda)
    return {name: statistics.median(s) for name, s in samples.items()}
