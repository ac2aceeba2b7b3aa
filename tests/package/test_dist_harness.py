"""The multi-rank harness itself: results come back in rank order, and a rank that raises or
hangs fails the call quickly with its traceback instead of hanging the session."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist import RankFailure, run_ranks


def sum_worker(rank: int, world_size: int, base: int) -> dict[str, object]:
    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": int(t)}


def raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 would wait here for good; the harness must stop it


def hang(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_results_in_rank_order() -> None:
    res = run_ranks(2, sum_worker, 10)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 21 for r in res)


def test_a_failing_rank_fails_the_call_with_its_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank one is broken"):
        run_ranks(2, raise_on_rank1)
    assert time.monotonic() - t0 < 30


def test_a_hanging_rank_times_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish"):
        run_ranks(2, hang, timeout=8)
    assert time.monotonic() - t0 < 20


def crash_at_exit(rank: int, world_size: int) -> int:
    """Returns, then dies by a signal while the process exits (as a bad teardown would)."""
    import atexit
    import os
    import signal

    if rank == 1:
        atexit.register(os.kill, os.getpid(), signal.SIGSEGV)
    return rank


def test_uniep_run_local_ranks_fails_a_rank_that_crashes_at_exit() -> None:
    from uniep.distributed import run_local_ranks

    with pytest.raises(
        RuntimeError, match="rank 1 returned its result but then exited with signal"
    ):
        run_local_ranks(crash_at_exit, 2, timeout_s=60)
    assert [r["rank"] for r in run_local_ranks(sum_worker, 2, args=(1,), timeout_s=60)] == [0, 1]


def many_tensors(rank: int, world_size: int) -> dict[int, list[torch.Tensor]]:
    return {
        i: [torch.full((64, 64), float(rank * 100 + i + j)) for j in range(4)] for i in range(8)
    }


def test_uniep_run_local_ranks_returns_tensors_after_their_rank_exits() -> None:
    """Tensors come back whole though their rank exits as soon as it has returned them (shared
    through a file descriptor, as the queue does by default, the parent's read failed when the
    rank had already gone)."""
    from uniep.distributed import run_local_ranks

    for _ in range(2):
        out = run_local_ranks(many_tensors, 2, timeout_s=60)
        for rank, got in enumerate(out):
            for i, ts in got.items():
                assert [float(t[0, 0]) for t in ts] == [rank * 100 + i + j for j in range(4)]
