"""The GPU expert-parallel runtime with a group of one rank, on one GPU (marker `gpu`).

The workers of test_gpu_ep.py at world size 1: every round then runs the whole path (layout,
count exchange with itself, transfer of the metadata, own rows, copy-out, row lists, combine)
against the CPU planner, so a one-GPU machine checks the runtime end to end. Peer traffic needs
the multi-GPU tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_gpu_ep import _cached_worker, _ep_worker, _ll_worker, _mixed_rounds_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKERS: list[tuple[str, Callable[[int, int], object]]] = [
    ("dispatch_combine_moe", _ep_worker),
    ("cached_dispatch", _cached_worker),
    ("mixed_rounds", _mixed_rounds_worker),
    ("low_latency", _ll_worker),
]


@pytest.mark.parametrize("worker", [w for _, w in WORKERS], ids=[n for n, _ in WORKERS])
def test_one_rank_against_cpu(worker: Callable[[int, int], object]) -> None:
    from uniep.distributed import run_local_ranks

    (report,) = run_local_ranks(worker, 1, backend="nccl", timeout_s=300)
    if worker is _mixed_rounds_worker:
        assert report == 0, f"{report} of the mixed rounds differed from the first round"
