"""One rank's bad argument is the same clear error on every rank, within seconds (2 gloo ranks).

Each multi-rank op checks its arguments and then exchanges a call signature with its peers
before any collective work (cpp/core/call_agreement.hpp): a rank whose checks fail still joins
that exchange, so its peers raise at once, quoting its error, instead of waiting in a transfer
for gloo's 30-minute timeout. Arguments that are fine on each rank but differ across ranks (a
dtype, top-k, a tuning key) are named too, and so is a rank in another call (a backward run on
some ranks only). A rank that never joins makes the others time out after UNIEP_TIMEOUT_S.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

T, H, FFN, E, K = 6, 16, 8, 4, 2
BAD = 1  # the rank that passes the bad argument
LIMIT_S = 30.0  # every rank must have its error within this


def _inputs(rank: int, k: int = K, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(10 + rank)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous()
    local = E // 2
    return {
        "x": torch.randn(T, H, generator=gen).to(dtype),
        "topk_idx": idx,
        "topk_weights": torch.rand(T, k, generator=gen).to(
            torch.float64 if dtype == torch.float64 else torch.float32
        ),
        "w1": torch.randn(local, H, 2 * FFN, generator=gen).to(dtype),
        "w2": torch.randn(local, FFN, H, generator=gen).to(dtype),
    }


def _forward(a: dict, tuning: object = "") -> torch.Tensor:
    import uniep

    return uniep.moe_forward(
        a["x"], a["topk_idx"], a["topk_weights"], a["w1"], a["w2"], tuning=tuning
    )


def _backward(a: dict, grad_out: torch.Tensor) -> object:
    name = dist.group.WORLD.group_name
    return torch.ops.uniep.moe_backward(
        grad_out, a["x"], a["topk_idx"], a["topk_weights"], a["w1"], a["w2"], name, ""
    )


def _strided_x() -> torch.Tensor:
    return torch.randn(T, 2 * H)[:, ::2]


def _bad_expert(a: dict) -> dict:
    idx = a["topk_idx"].clone()
    idx[2, 0] = E + 3
    return {**a, "topk_idx": idx}


def _layer(rank: int) -> torch.nn.Module:
    import uniep

    torch.manual_seed(0)
    return uniep.nn.MoELayer(H, FFN, E, K)


# (id, call on a good rank, call on the bad rank, text every rank's error must hold, text the
# bad rank's error must hold)
Case = tuple[str, Callable[[int], object], Callable[[int], object], str, str]
CASES: list[Case] = [
    (
        "forward-x-float16",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward({**_inputs(r), "x": _inputs(r)["x"].half()}),
        r"\bx\b",
        r"\bx\b",
    ),
    (
        "forward-x-non-contiguous",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward({**_inputs(r), "x": _strided_x()}),
        "contiguous",
        r"\bx\b",
    ),
    (
        "forward-bad-tuning-string",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward(_inputs(r), tuning="overlap=sometimes"),
        "overlap",
        "overlap",
    ),
    (
        "forward-tuning-not-a-string",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward(_inputs(r), tuning=24),
        "tuning",
        "tuning",
    ),
    (
        "forward-tuning-differs",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward(_inputs(r), tuning="combine=rank_partials"),
        "tuning combine differs",
        "rank_partials",
    ),
    (
        "forward-dtype-differs",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward(_inputs(r, dtype=torch.float64)),
        "x dtype differs",
        "float64",
    ),
    (
        "forward-top_k-differs",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward(_inputs(r, k=3)),
        "top_k",
        "top_k",
    ),
    (
        "forward-w1-wrong-hidden",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward({**_inputs(r), "w1": torch.randn(E // 2, H + 8, 2 * FFN)}),
        r"\bw1\b",
        r"\bw1\b",
    ),
    (
        "forward-topk_weights-float16",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward({**_inputs(r), "topk_weights": torch.rand(T, K).half()}),
        "topk_weights",
        "topk_weights",
    ),
    (
        "forward-expert-id-out-of-range",
        lambda r: _forward(_inputs(r)),
        lambda r: _forward(_bad_expert(_inputs(r))),
        "topk_idx",
        "topk_idx",
    ),
    (
        "backward-grad_out-shape",
        lambda r: _backward(_inputs(r), torch.ones(T, H)),
        lambda r: _backward(_inputs(r), torch.ones(T, H + 1)),
        "grad_out",
        "grad_out",
    ),
    (
        "backward-grad_out-dtype",
        lambda r: _backward(_inputs(r), torch.ones(T, H)),
        lambda r: _backward(_inputs(r), torch.ones(T, H, dtype=torch.float64)),
        "grad_out",
        "grad_out",
    ),
    (
        "layer-x-wrong-hidden",
        lambda r: _layer(r)(torch.randn(T, H)),
        lambda r: _layer(r)(torch.randn(T, H + 2)),
        r"\bx\b",
        r"\bx\b",
    ),
    (
        "layer-x-wrong-dtype",
        lambda r: _layer(r)(torch.randn(T, H)),
        lambda r: _layer(r)(torch.randn(T, H, dtype=torch.float64)),
        r"\bx\b",
        "float64",
    ),
    (
        # Rank 0 runs the backward of the forward both ranks made (its output is in _PENDING),
        # rank 1 skips it and starts the next forward.
        "backward-on-some-ranks-then-forward",
        lambda r: _PENDING.pop().sum().backward(),
        lambda r: _forward(_inputs(r)),
        "a backward run on some ranks only",
        "moe_backward",
    ),
]
_PENDING: list[torch.Tensor] = []


def _agreement_worker(rank: int, world: int) -> list[tuple[str, str, str, float]]:
    """Runs every case; returns (id, exception type, message, seconds) per case on this rank."""
    import uniep

    os.environ["UNIEP_TIMEOUT_S"] = "20"
    uniep.init()
    out = []
    for case_id, good, bad, _, _ in CASES:
        if case_id.startswith("backward-on-some-ranks"):
            _PENDING.append(_forward({**_inputs(rank), "x": _inputs(rank)["x"].requires_grad_()}))
        start = time.monotonic()
        try:
            (bad if rank == BAD else good)(rank)
            out.append((case_id, "", "no error", time.monotonic() - start))
        except Exception as e:  # noqa: BLE001 - the test checks which error it was
            out.append((case_id, type(e).__name__, str(e), time.monotonic() - start))
    return out


def test_one_rank_bad_argument_fails_every_rank_at_once() -> None:
    reports = run_ranks(2, _agreement_worker, timeout=180)
    for i, (case_id, _, _, every, bad_text) in enumerate(CASES):
        for rank, report in enumerate(reports):
            got_id, kind, message, seconds = report[i]
            assert got_id == case_id
            assert kind == "ValueError", (case_id, rank, kind, message)
            assert seconds < LIMIT_S, (case_id, rank, seconds)
            pattern = bad_text if rank == BAD else every
            assert re.search(pattern, message), (case_id, rank, message)
            if rank != BAD and "differs" not in every and "some ranks" not in every:
                assert f"rank {BAD}" in message, (case_id, rank, message)


def _subgroup_worker(rank: int, world: int) -> list[tuple[str, str]]:
    """4 ranks, sub-groups {1, 3} and {0, 2}: global rank 3 (rank 1 of {1, 3}) passes a wrong
    hidden size, then an expert id out of range (which the call agreement does not see: the
    executor's routing exchange finds it); {0, 2} runs fine both times."""
    import uniep

    os.environ["UNIEP_TIMEOUT_S"] = "20"
    odd, even = dist.new_group([1, 3]), dist.new_group([0, 2])
    out = []
    for bad in ("hidden", "expert id"):
        a = _inputs(rank)
        if rank == 3 and bad == "hidden":
            a["x"] = torch.randn(T, H + 8)
        elif rank == 3:
            a["topk_idx"][0, 0] = E + 5
        try:
            uniep.moe_forward(
                a["x"],
                a["topk_idx"],
                a["topk_weights"],
                a["w1"],
                a["w2"],
                group=odd if rank % 2 else even,
            )
            out.append(("", "no error"))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    return out


def test_subgroup_errors_say_which_global_ranks_they_name() -> None:
    """An error names the ranks of the call's group; on a sub-group it also says which global
    ranks those are, on every rank of the group."""
    reports = run_ranks(4, _subgroup_worker, timeout=120)
    for rank in (0, 2):
        assert reports[rank] == [("", "no error")] * 2, (rank, reports[rank])
    note = "whose ranks 0, 1, ... are global ranks 1, 3"
    kind, message = reports[1][0]
    assert kind == "ValueError", message
    # Its peer by its group rank, 1, and which global rank that is.
    assert "rank 1 failed its argument checks" in message, message
    assert note in message, message
    kind, message = reports[3][0]  # its own error, which names no rank
    assert kind == "ValueError" and "w1 must be" in message, message
    assert "global ranks" not in message, message
    # The executor's own exchange names the peer too.
    kind, message = reports[1][1]
    assert kind == "ValueError" and "rank 1 passed an invalid topk_idx" in message, message
    assert note in message, message
    kind, message = reports[3][1]
    assert kind == "ValueError" and f"expert id {E + 5}" in message, message
    assert "global ranks" not in message, message


def _unknown_group_worker(rank: int, world: int) -> tuple[str, str, float]:
    import uniep  # noqa: F401 - registers torch.ops.uniep

    os.environ["UNIEP_TIMEOUT_S"] = "5"
    a = _inputs(rank)
    name = "no-such-group" if rank == BAD else dist.group.WORLD.group_name
    start = time.monotonic()
    try:
        torch.ops.uniep.moe_forward(
            a["x"], a["topk_idx"], a["topk_weights"], a["w1"], a["w2"], name, ""
        )
        return "", "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start
    finally:
        if rank == BAD:
            time.sleep(8)  # stay in the group while the peer times out (no connection reset)


def test_rank_that_never_joins_makes_the_others_time_out() -> None:
    """A rank with an unknown group name cannot join its peers' exchange: it names the group,
    and the peers raise after UNIEP_TIMEOUT_S (5 s here) naming the call, not after gloo's 30
    minutes."""
    reports = run_ranks(2, _unknown_group_worker, timeout=120)
    kind, message, _ = reports[BAD]
    assert kind == "ValueError" and "group_name" in message, message
    kind, message, seconds = reports[1 - BAD]
    assert kind == "RuntimeError", (kind, message)
    assert "moe_forward" in message and "timed out" in message, message
    assert 4.0 < seconds < LIMIT_S, seconds


def _lone_backward_worker(rank: int, world: int) -> tuple[str, str, float]:
    os.environ["UNIEP_TIMEOUT_S"] = "5"
    import uniep

    uniep.init()
    x = _inputs(rank)["x"].requires_grad_()
    y = _forward({**_inputs(rank), "x": x})
    start = time.monotonic()
    if rank == BAD:
        time.sleep(10)  # never runs the backward, but stays in the group
        return "", "skipped", 0.0
    try:
        y.sum().backward()
        return "", "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start


@pytest.mark.parametrize("world", [2])
def test_backward_on_some_ranks_only_times_out_naming_it(world: int) -> None:
    reports = run_ranks(world, _lone_backward_worker, timeout=120)
    kind, message, seconds = reports[0]
    assert kind == "RuntimeError", (kind, message)
    assert "moe_backward" in message and "timed out" in message, message
    assert seconds < LIMIT_S, seconds


def _broadcast_worker(rank: int, world: int) -> tuple[bytes, str]:
    from uniep.distributed import broadcast_bytes

    os.environ["UNIEP_TIMEOUT_S"] = "3"
    data = bytes(range(7, 7 + 131)) if rank == 0 else b""
    got = broadcast_bytes(data, dist.group.WORLD, "the test's broadcast")
    # Rank 1 never joins the second broadcast: rank 0 must raise after about 3 s.
    message = ""
    if rank == 0:
        try:
            broadcast_bytes(b"x", dist.group.WORLD, "the lone broadcast")
        except RuntimeError as e:
            message = str(e)
    else:
        time.sleep(6)
    return got, message


def test_runtime_start_up_broadcast_is_exact_and_bounded() -> None:
    """What the GPU runtimes' start-up sends (NVSHMEM's unique id): rank 0's bytes on every
    rank, and a rank that never joins makes rank 0 raise after UNIEP_TIMEOUT_S."""
    reports = run_ranks(2, _broadcast_worker, timeout=60)
    assert [r[0] for r in reports] == [bytes(range(7, 7 + 131))] * 2
    assert "the lone broadcast" in reports[0][1] and "timed out" in reports[0][1], reports[0][1]
