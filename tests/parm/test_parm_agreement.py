"""The Parm routing agreement on gloo ranks: a layer configured differently on one rank makes every
rank raise the same ValueError at once, naming the field and both ranks' values, before any data
moves; the group stays usable."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from _dist import run_ranks

# Layer arguments of every rank, then what the last rank passes instead. World 4: N = 2, G = 2.
BASE: dict[str, Any] = dict(hidden=16, ffn_hidden=16, num_experts=4, top_k=2, capacity_factor=0.0)
FREE_LINKS = dict(inter_bw=1e18, intra_bw=1e18, inter_alpha=0.0, intra_alpha=0.0)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], str | None]] = {
    # name: (every rank's extra arguments, the last rank's, the message's "rank 0 has ..., rank 3
    # has ...", or None where the layers agree)
    "top_k": ({}, dict(top_k=1), "top_k differs across ranks: rank 0 has 2, rank 3 has 1"),
    "ffn_hidden": ({}, dict(ffn_hidden=32), "ffn_hidden differs .* rank 0 has 16, rank 3 has 32"),
    "num_experts": ({}, dict(num_experts=8), "num_experts differs .* 0 has 4, rank 3 has 8"),
    "schedule": (
        dict(schedule="baseline"),
        dict(schedule="s1"),
        "schedule differs .* rank 0 has 'baseline', rank 3 has 's1'",
    ),
    "dtype": ({}, dict(dtype=torch.float64), "dtype differs .* torch.float32, rank 3 has torch.f"),
    "capacity_factor": (
        dict(capacity_factor=2.0),
        dict(capacity_factor=4.0),
        "capacity_factor differs .* rank 0 has 2.0, rank 3 has 4.0",
    ),
    # Both mean no drops: no error.
    "capacity_factor<=0": (
        dict(capacity_factor=0.0),
        dict(capacity_factor=-1.0),
        None,
    ),
    "overflow": (
        dict(capacity_factor=0.3),
        dict(capacity_factor=0.3, overflow="drop"),
        "overflow differs .* rank 0 has 'error', rank 3 has 'drop'",
    ),
    "chunks": (
        dict(schedule="s2", chunks=2),
        dict(schedule="s2", chunks=3),
        r"chunks differs .* rank 0 has SAA chunk counts \[2, 2\] \(forward\), \[2, 2\] "
        r"\(backward\), rank 3 has SAA chunk counts \[3, 3\]",
    ),
    # schedule="auto" priced on another cluster on one rank (baseline elsewhere, S1 there).
    "auto-cluster": (
        {},
        dict(cluster=dict(FREE_LINKS, gpus_per_node=8)),
        "schedule differs .* rank 0 has 'baseline', rank 3 has 's1'; .*cluster",
    ),
}
TOKENS = 8


def _config_worker(rank: int, world: int) -> dict[str, Any]:
    from uniep.parm import ParmMoELayer, new_groups

    mp, ep = new_groups(2)
    out: dict[str, Any] = {}
    for name, (common, last) in ((n, c[:2]) for n, c in CASES.items()):
        kw = {**BASE, **common, **(last if rank == world - 1 else {})}
        torch.manual_seed(0)
        layer = ParmMoELayer(mp, ep, **kw)
        x = torch.randn(TOKENS, 16, dtype=layer.w1.dtype)
        start = time.monotonic()
        try:
            layer(x)
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
        out[f"{name}_s"] = time.monotonic() - start
        # The group still works: one configuration on every rank.
        good = ParmMoELayer(mp, ep, **BASE)
        out[f"{name}_after"] = tuple(good(torch.randn(TOKENS, 16)).shape)
    return out


def test_a_configuration_that_differs_fails_every_rank_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before the configuration was agreed these crashed (gloo's size checks), waited for this
    # limit, or returned different outputs inside one MP group.
    monkeypatch.setenv("UNIEP_TIMEOUT_S", "20")
    reports = run_ranks(4, _config_worker, timeout=90)
    for rank, r in enumerate(reports):
        for name, (_, _, want) in CASES.items():
            got = r[name]
            if want is None:
                assert got == "no error", (rank, name, got)
                continue
            assert got.startswith("ValueError: Parm forward: "), (rank, name, got)
            assert got == reports[0][name], (rank, name)
            assert re.search(want, got), (rank, name, got)
            assert r[f"{name}_s"] < 10, f"rank {rank} took {r[name + '_s']:.1f} s in {name}"
            assert r[f"{name}_after"] == (TOKENS, 16), (rank, name)


def _bad_input_worker(rank: int, world: int) -> dict[str, Any]:
    from uniep.parm import ParmMoELayer, new_groups

    mp, ep = new_groups(1)
    layer = ParmMoELayer(mp, ep, 8, 8, 4, 2, capacity_factor=0.0)
    good = torch.randn(6, 8)
    out: dict[str, Any] = {}
    # On rank 1 only: a 0-d x (x.shape[-1] raised IndexError before the ranks agreed), an x
    # without tokens (the plan's ValueError, which did not join the agreement either).
    for name, bad in (("0-d", torch.tensor(1.0)), ("no-tokens", torch.randn(0, 8))):
        start = time.monotonic()
        try:
            layer(bad if rank == 1 else good)
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
        out[f"{name}_s"] = time.monotonic() - start
    # A schedule assigned after a forward reaches the cached token count's plan: a bad one on
    # rank 1 only fails every rank.
    layer.schedule = "s3" if rank == 1 else "s1"
    start = time.monotonic()
    try:
        layer(good)
        out["schedule"] = "no error"
    except Exception as e:
        out["schedule"] = f"{type(e).__name__}: {e}"
    out["schedule_s"] = time.monotonic() - start
    layer.schedule = "auto"
    out["after"] = tuple(layer(good).shape)
    return out


def test_a_bad_x_or_schedule_on_one_rank_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIEP_TIMEOUT_S", "20")
    reports = run_ranks(2, _bad_input_worker, timeout=60)
    why = {
        "0-d": r"x: last dimension must be hidden=8, got \(\)",
        "no-tokens": "x: expected at ",
        "schedule": "schedule must be 'auto', 'baseline', 's1' or 's2', got 's3'",
    }
    for rank, r in enumerate(reports):
        for name, want in why.items():
            got = r[name]
            assert got.startswith("ValueError: "), (rank, name, got)
            assert re.search(want, got), (rank, name, got)
            if rank == 0:
                assert "rank 1 failed its checks" in got, got
            assert r[f"{name}_s"] < 10, f"rank {rank} took {r[name + '_s']:.1f} s in {name}"
        assert r["after"] == (6, 8)


def _default_chunks_worker(rank: int, world: int) -> dict[str, Any]:
    """The CUDA executor's plumbing on CPU tensors (as tests/parm/test_parm_backends.py runs it)
    with no chunk plan: the SAA pairs run in the backend's default count, set_saa_chunks's."""
    from uniep import _C
    from uniep.parm import new_groups
    from uniep.parm.cuda import CudaExecutor
    from uniep.parm.executor import Groups
    from uniep.parm.ops import _shape

    N, G, E, H, k = 2, 2, 4, 16, 2
    mp, ep = new_groups(N)
    groups = Groups(mp=mp, ep=ep, mp_size=N, ep_size=G, mp_index=rank % N, ep_index=rank // N)
    torch.manual_seed(0)
    x, gate = torch.randn(TOKENS, H), torch.randn(H, E)
    w1, w2 = torch.randn(E // G, H, H // N), torch.randn(E // G, H // N, H)
    shape = _shape(x, gate, w1, N, G, k, 0.0)
    steps = _C.parm.build_steps(shape, "s2", "forward")
    out: dict[str, Any] = {}
    for name, chunks in (("same", 2), ("differs", 3 if rank == world - 1 else 2)):
        try:
            CudaExecutor(shape, groups, "error", chunks=chunks).forward(x, gate, w1, w2, steps)
            out[name] = "no error"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_a_default_chunk_count_that_differs_fails_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, the agreement carried only a plan's counts, so ranks with different
    # set_saa_chunks counts went on with differently cut pairs.
    monkeypatch.setenv("UNIEP_TIMEOUT_S", "20")
    reports = run_ranks(4, _default_chunks_worker, timeout=90)
    for rank, r in enumerate(reports):
        assert r["same"] == "no error", (rank, r["same"])
        assert r["differs"] == reports[0]["differs"], rank
        assert re.search(
            r"chunks differs .* rank 0 has SAA chunk counts \[2, 2\] \(forward\), \[\] "
            r"\(backward\), rank 3 has SAA chunk counts \[3, 3\] .*set_saa_chunks",
            r["differs"],
        ), (rank, r["differs"])
