"""The Parm CPU executor over gloo: baseline, S1 and S2 forward and backward against a float64
dense single-process reference and against each other.

World 4 (N = 2 and the edge layouts N = 4 / N = 1) and world 8 (N = 4, and N = 2); each world is
one spawn that runs every case under every schedule. Per case: y, l_aux, dx and the gate gradient
of every rank against its MP group's reference, each rank's expert-shard gradients against the
matching slice of the full reference gradients, the dropped-pair count, and the capacity error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_ranks
from _parm_cases import SCHEDULES, rank_worker, reference

TOL = 1e-5  # fp32 executor vs float64 reference, relative to the largest reference entry

BASE = dict(M=8, H=6, E=4, k=2, f=2.0, seed=0)
CASES: dict[int, list[dict[str, Any]]] = {
    4: [
        dict(BASE, name="k1-even", N=2, S=12, k=1, f=4.0, auto=True, seed=1),
        dict(BASE, name="k2-odd-shapes", N=2, S=13, M=7, H=10, seed=2),
        dict(BASE, name="k4-no-drop", N=2, S=9, E=8, k=4, f=0.0, seed=3),
        dict(BASE, name="k8-all-experts", N=2, S=7, E=8, k=8, f=0.0, seed=4),
        dict(BASE, name="fewer-tokens-than-mp", N=2, S=1, f=0.0, seed=5),
        dict(BASE, name="empty-experts", N=2, S=10, k=1, f=0.0, one_expert=True, seed=6),
        dict(
            BASE,
            name="overflow-drop",
            N=2,
            S=16,
            k=2,
            f=1.0,
            one_expert=True,
            overflow="drop",
            seed=7,
        ),
        dict(BASE, name="overflow-error", N=2, S=16, k=2, f=1.0, one_expert=True, seed=7),
        dict(BASE, name="mp-only", N=4, S=11, H=8, k=3, f=0.0, seed=8),
        dict(BASE, name="ep-only", N=1, S=6, k=2, f=1.0, one_expert=True, overflow="drop", seed=9),
    ],
    8: [
        dict(BASE, name="n4-k2-uneven-slices", N=4, S=10, H=8, seed=11),
        dict(BASE, name="n4-k3-no-drop", N=4, S=17, M=5, H=12, E=6, k=3, f=0.0, seed=12),
        dict(BASE, name="n4-k8-drop", N=4, S=9, H=4, E=8, k=8, f=0.5, overflow="drop", seed=13),
        dict(BASE, name="n2-g4-k2", N=2, S=11, E=8, f=3.0, seed=14),
        dict(BASE, name="misuse", N=2, S=1, errors=True),
    ],
}

_RESULTS: dict[int, list[Any] | Exception] = {}


def _results(world: int) -> list[Any]:
    if world not in _RESULTS:
        cases = [dict(c, world=world) for c in CASES[world]]
        try:
            _RESULTS[world] = run_ranks(world, rank_worker, cases, timeout=240)
        except Exception as e:  # one failure reports in every test of the world
            _RESULTS[world] = e
    res = _RESULTS[world]
    if isinstance(res, Exception):
        pytest.fail(f"multi-rank run failed:\n{res}", pytrace=False)
    return res


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max()) or 1.0
    err = float((got.double() - want.double()).abs().max()) / scale
    assert err <= TOL, f"{what}: max error {err:.2e} relative to {scale:.2e} (> {TOL})"


PARAMS = [(w, i, c["name"]) for w, cs in CASES.items() for i, c in enumerate(cs)]


@pytest.mark.parametrize(("world", "index", "name"), PARAMS, ids=[p[2] for p in PARAMS])
def test_schedules_match_dense_reference(world: int, index: int, name: str) -> None:
    case = dict(CASES[world][index], world=world)
    per_rank = [r[index] for r in _results(world)]
    N = case["N"]
    G = world // N
    E_loc, Hn = case["E"] // G, case["H"] // N
    if name == "misuse":
        for rank in range(world):
            got = per_rank[rank]
            assert "expected the layout of uniep.parm.rank_layout" in got["swapped-groups"]
            for schedule in SCHEDULES:
                assert "same number of tokens" in got[schedule], (rank, schedule, got[schedule])
        return
    if name == "overflow-error":
        messages = {per_rank[r][s].get("error") for r in range(world) for s in SCHEDULES}
        assert len(messages) == 1 and None not in messages, messages
        assert "capacity overflow" in messages.pop()
        return
    ref = reference(case)
    if case.get("overflow") == "drop":
        assert ref["dropped"] > 0, "the case was meant to overflow"
    for schedule in per_rank[0]:
        for rank in range(world):
            got = per_rank[rank][schedule]
            assert "error" not in got, f"{schedule} rank {rank}: {got.get('error')}"
            g, m = rank // N, rank % N
            what = f"{name} {schedule} rank {rank}"
            if schedule == "auto":
                assert got["ran"] in SCHEDULES
            else:
                assert got["ran"] == schedule
            assert got["dropped"] == ref["dropped"], f"{what}: dropped pairs"
            _close(got["y"], ref["y"][g], f"{what} y")
            _close(got["l_aux"], ref["l_aux"][g], f"{what} l_aux")
            _close(got["dx"], ref["dx"][g], f"{what} dx")
            _close(got["dgate"], ref["dgate"][g], f"{what} dgate")
            es, hs = slice(g * E_loc, (g + 1) * E_loc), slice(m * Hn, (m + 1) * Hn)
            _close(got["dw1"], ref["dw1"][es, :, hs], f"{what} dw1")
            _close(got["dw2"], ref["dw2"][es, hs, :], f"{what} dw2")
            base = per_rank[rank]["baseline"]
            for key in ("y", "dx", "dgate", "dw1", "dw2"):
                _close(got[key], base[key].double(), f"{what} {key} vs baseline")


def _layer_defaults_worker(rank: int, world: int) -> dict[str, Any]:
    from uniep.parm import ParmMoELayer, cluster_spec, new_groups, plan

    mp, ep = new_groups(2)
    errors = []
    for ffn, experts in ((9, 4), (8, 3)):  # the MP size (2) fails; then only the EP size (2)
        try:
            ParmMoELayer(mp, ep, 8, ffn, experts, 1)
        except ValueError as e:
            errors.append(str(e))
    layer = ParmMoELayer(mp, ep, 16, 32, 4, 2)
    tokens = 64
    # plan() with the layer's arguments and no dtype: a layout where bf16 and float32 differ.
    wide = ParmMoELayer(mp, ep, 64, 256, 8, 2, gpus_per_node=2)
    return {
        "errors": errors,
        "gpus_per_node": layer.gpus_per_node,
        "cluster_gpus": cluster_spec("h100-ib").gpus_per_node,
        "layer_pick": layer._plan(tokens)[0],
        "plan_pick": plan(world, 2, tokens, 16, 32, 4, 2, dtype=torch.float32).schedule,
        "wide_layer_pick": wide._plan(1024)[0],
        "wide_plan_pick": plan(world, 2, 1024, 64, 256, 8, 2, gpus_per_node=2).schedule,
    }


def test_layer_defaults_are_plans_and_errors_name_the_failing_size() -> None:
    for r in run_ranks(4, _layer_defaults_worker, timeout=120):
        first, second = r["errors"]
        assert "ffn_hidden (9) must divide by the MP size 2" in first and "EP" not in first
        assert "num_experts (3) must divide by the EP size 2" in second
        assert "ffn_hidden" not in second
        # schedule="auto" prices the layout plan() prices: the cluster's GPUs per node.
        assert r["gpus_per_node"] == r["cluster_gpus"]
        assert r["layer_pick"] == r["plan_pick"]
        assert r["wide_layer_pick"] == r["wide_plan_pick"] == "s2"


def _bad_rank_worker(rank: int, world: int) -> dict[str, Any]:
    import time

    from uniep.parm import ParmMoELayer, new_groups

    mp, ep = new_groups(2)
    torch.manual_seed(0)
    layer = ParmMoELayer(mp, ep, 16, 32, 4, 2, capacity_factor=0.0)
    x = torch.randn(8, 16)
    out: dict[str, Any] = {}
    # Rank 0 passes a wrong hidden size, rank 1 (a second call) a wrong x dtype to the op.
    for case, bad_rank in (("layer", 0), ("op", 1)):
        start = time.monotonic()
        try:
            if case == "layer":
                layer(torch.randn(8, 12) if rank == bad_rank else x)
            else:
                torch.ops.uniep.parm_moe_forward(
                    x.double() if rank == bad_rank else x, layer.gate, layer.w1, layer.w2,
                    mp.group_name, ep.group_name, 2, 0.0, "s1", "error", [],
                )  # fmt: skip
            out[case] = "no error"
        except ValueError as e:
            out[case] = str(e)
        out[f"{case}_s"] = time.monotonic() - start
    # The group still works: a good call on every rank.
    out["after"] = tuple(layer(x).shape)
    return out


def test_a_rank_with_bad_arguments_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIEP_TIMEOUT_S", "60")
    reports = run_ranks(4, _bad_rank_worker, timeout=120)
    for rank, r in enumerate(reports):
        for case, bad in (("layer", 0), ("op", 1)):
            assert r[f"{case}_s"] < 30, f"rank {rank} waited {r[case + '_s']:.0f} s in {case}"
            if rank == bad:
                continue
            assert f"rank {bad} failed its checks" in r[case], (rank, case, r[case])
        assert "hidden=16" in r["layer"], r["layer"]
        assert "w1 must be torch.float64" in r["op"], r["op"]
        assert r["after"] == (8, 16)
