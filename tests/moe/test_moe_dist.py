"""Multi-rank CPU executor (2 and 4 gloo ranks) against the dense single-process reference.

Each world size is one spawn: every rank runs all forward and backward cases, then the test
process compares against `uniep.reference.moe_reference` on the global problem.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _moe_cases import MoeCase, make_inputs, rank_inputs, rel_err, same_bits

# Same dispatch precision everywhere: only schedule parameters change, so bits may not.
TUNINGS = [
    "",
    "overlap=sequential",
    "sms=8/132,token_tile=16,tile_m=64,tile_n=64,tile_k=32,stages=1,overlap=sequential",
    "overlap=chunked,token_tile=32,stages=3,tile_n=256",
    "tile_k=128,tile_m=256,overlap=fused,stages=4,sms=32/132",
    "dispatch=bf16,sms=20/108,token_tile=128,tile_m=64,overlap=chunked",
    "token_tile=16,tile_m=64,tile_n=128,tile_k=64,stages=2,overlap=fused",
]
REPEATS = 2
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}

FORWARD_CASES: dict[int, list[MoeCase]] = {
    2: [
        MoeCase("w2-random-k2-h48-f32", (24, 17), 48, 32, 8, 2, "float32", seed=1),
        MoeCase("w2-random-k1-h100-bf16", (20, 20), 100, 40, 4, 1, "bfloat16", seed=2),
        MoeCase("w2-random-k8-h72-f32", (16, 13), 72, 24, 8, 8, "float32", seed=3),
        MoeCase("w2-one-expert-k3-h40-f32", (18, 18), 40, 16, 6, 3, "float32", "one_expert", 4),
        MoeCase("w2-zero-tokens-k4-h56-bf16", (0, 22), 56, 24, 8, 4, "bfloat16", seed=5),
        MoeCase("w2-one-rank-k2-h48-bf16", (19, 7), 48, 32, 8, 2, "bfloat16", "one_rank", 6),
        MoeCase("w2-random-k5-h36-f64", (15, 11), 36, 20, 10, 5, "float64", seed=7),
        MoeCase("w2-random-k7-h96-bf16", (14, 21), 96, 48, 16, 7, "bfloat16", seed=8),
    ],
    4: [
        MoeCase("w4-random-k3-h60-f32", (10, 12, 0, 9), 60, 28, 8, 3, "float32", seed=11),
        MoeCase("w4-random-k6-h80-bf16", (12, 12, 12, 12), 80, 24, 8, 6, "bfloat16", seed=12),
        MoeCase(
            "w4-one-expert-k1-h44-bf16", (9, 11, 5, 13), 44, 20, 4, 1, "bfloat16", "one_expert", 13
        ),
        MoeCase("w4-random-k8-h112-f32", (8, 14, 6, 10), 112, 32, 16, 8, "float32", seed=14),
        MoeCase("w4-zero-two-ranks-k4-h52-f32", (0, 15, 0, 9), 52, 24, 12, 4, "float32", seed=15),
        MoeCase("w4-one-rank-k2-h24-f32", (7, 9, 8, 6), 24, 12, 8, 2, "float32", "one_rank", 16),
        MoeCase("w4-random-k4-h30-f64", (7, 9, 8, 6), 30, 12, 8, 4, "float64", seed=17),
        MoeCase(
            "w4-one-expert-k5-h66-f32", (6, 0, 7, 5), 66, 18, 8, 5, "float32", "one_expert", 18
        ),
    ],
}

BACKWARD_CASES: dict[int, list[MoeCase]] = {
    2: [
        MoeCase("w2-bwd-random-k2", (9, 7), 20, 12, 4, 2, "float64", seed=21),
        MoeCase("w2-bwd-zero-tokens-k3", (0, 8), 18, 10, 6, 3, "float64", seed=22),
        MoeCase("w2-bwd-one-expert-k2", (6, 5), 14, 6, 4, 2, "float64", "one_expert", 23),
        MoeCase("w2-bwd-random-k4-f32", (8, 6), 24, 16, 8, 4, "float32", seed=24),
    ],
    4: [
        MoeCase("w4-bwd-random-k3", (5, 6, 0, 4), 18, 10, 8, 3, "float64", seed=31),
        MoeCase("w4-bwd-one-rank-k2", (4, 3, 5, 2), 12, 8, 8, 2, "float64", "one_rank", 32),
        MoeCase("w4-bwd-random-k1", (3, 7, 2, 5), 10, 6, 4, 1, "float64", seed=33),
    ],
}
# Run on 4 ranks as two independent 2-rank subgroups.
SUBGROUP_CASES = [FORWARD_CASES[2][0], FORWARD_CASES[2][4]]
BACKWARD_TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
GRAD_NAMES = ("x", "topk_weights", "w1", "w2")


def _moe_args(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w1"], inp["w2"]


def batch_worker(
    rank: int,
    world_size: int,
    forward_cases: list[MoeCase],
    backward_cases: list[MoeCase],
    tunings: list[str],
    repeats: int,
    subgroup_cases: list[MoeCase],
) -> dict[str, Any]:
    """Runs on every rank. Per case: a list of outputs, a dict of grads, or a traceback."""
    import torch.distributed as dist
    import uniep  # loads the ops, fake kernels and autograd
    from uniep.distributed import group_name

    group = group_name()
    results: dict[str, Any] = {}
    for case in forward_cases:
        try:
            inp = rank_inputs(case, rank)
            outs = []
            for tuning in tunings:
                for _ in range(repeats):
                    outs.append(torch.ops.uniep.moe_forward(*_moe_args(inp), group, tuning))
            results[case.name] = outs
        except Exception:
            results[case.name] = traceback.format_exc()
    for case in backward_cases:
        try:
            inp = rank_inputs(case, rank)
            leaves = {n: inp[n].requires_grad_(True) for n in GRAD_NAMES}
            y = torch.ops.uniep.moe_forward(*_moe_args(inp), group, "")
            y.backward(inp["grad_out"])
            grads = {n: leaves[n].grad for n in GRAD_NAMES}
            with torch.no_grad():
                for tuning in tunings:
                    direct = torch.ops.uniep.moe_backward(
                        inp["grad_out"], *_moe_args(inp), group, tuning
                    )
                    key = "op" if tuning == tunings[0] else f"op[{tuning}]"
                    grads.update({f"{key}_{n}": g for n, g in zip(GRAD_NAMES, direct, strict=True)})
            results[case.name] = grads
        except Exception:
            results[case.name] = traceback.format_exc()
    if world_size == 4:
        # Experts split over a subgroup: ranks {0, 1} and {2, 3} each run a 2-rank problem.
        subgroups = [dist.new_group(ranks=[0, 1]), dist.new_group(ranks=[2, 3])]
        sub = subgroups[rank // 2]
        for case in subgroup_cases:
            try:
                inp = rank_inputs(case, rank % 2)
                results[f"sub:{case.name}"] = uniep.moe.ops.moe_forward(*_moe_args(inp), group=sub)
            except Exception:
                results[f"sub:{case.name}"] = traceback.format_exc()
    return results


_BATCHES: dict[int, list[dict[str, Any]] | Exception] = {}


def _batch(world_size: int) -> list[dict[str, Any]]:
    """All cases of one world size, run once per session however many tests read them."""
    if world_size not in _BATCHES:
        try:
            _BATCHES[world_size] = run_ranks(
                world_size,
                batch_worker,
                FORWARD_CASES[world_size],
                BACKWARD_CASES[world_size],
                TUNINGS,
                REPEATS,
                SUBGROUP_CASES,
            )
        except Exception as e:
            _BATCHES[world_size] = e
    result = _BATCHES[world_size]
    if isinstance(result, Exception):
        pytest.fail(f"multi-rank run failed:\n{result}", pytrace=False)
    return result


def _case_results(case: MoeCase) -> list[Any]:
    per_rank = [r[case.name] for r in _batch(case.world_size)]
    for rank, res in enumerate(per_rank):
        if isinstance(res, str):
            pytest.fail(f"{case.name}: rank {rank} raised:\n{res}", pytrace=False)
    return per_rank


def _params(cases: dict[int, list[MoeCase]]) -> list[Any]:
    return [pytest.param(c, id=c.name) for w in sorted(cases) for c in cases[w]]


def _reference(case: MoeCase) -> torch.Tensor:
    from uniep.reference import moe_reference

    g = make_inputs(case)
    return moe_reference(g["x"], g["topk_idx"], g["topk_weights"], g["w1"], g["w2"])


@pytest.mark.parametrize("case", _params(FORWARD_CASES))
def test_forward_matches_reference(case: MoeCase) -> None:
    outs = [r[0] for r in _case_results(case)]
    for rank, y in enumerate(outs):
        t0, t1 = case.token_range(rank)
        assert y.shape == (t1 - t0, case.hidden), f"rank {rank}"
        assert y.dtype == case.torch_dtype, f"rank {rank}"
        assert torch.isfinite(y).all(), f"rank {rank} output has NaN/Inf"
    y = torch.cat(outs)
    ref = _reference(case)
    err = rel_err(y, ref)
    assert err <= TOLERANCE[case.dtype], f"{case.name}: rel. err {err:.3e}"


@pytest.mark.parametrize("case", _params(FORWARD_CASES))
def test_forward_bits_same_across_runs_and_tunings(case: MoeCase) -> None:
    for rank, outs in enumerate(_case_results(case)):
        assert len(outs) == len(TUNINGS) * REPEATS
        for j, y in enumerate(outs):
            tuning, run = TUNINGS[j // REPEATS], j % REPEATS
            assert same_bits(y, outs[0]), f"rank {rank}: tuning {tuning!r} run {run} differs"


@pytest.mark.parametrize("case", _params(FORWARD_CASES))
def test_forward_bits_independent_of_world_size(case: MoeCase) -> None:
    """Slot-indexed buffers and a k-ascending combine make the bits a function of the routing
    alone, so W ranks reproduce one rank holding every expert."""
    y = torch.cat([r[0] for r in _case_results(case)])
    g = make_inputs(case)
    single = torch.ops.uniep.moe_forward(
        g["x"], g["topk_idx"], g["topk_weights"], g["w1"], g["w2"], "", ""
    )
    assert same_bits(y, single)


@pytest.mark.parametrize("case", SUBGROUP_CASES, ids=lambda c: c.name)
def test_forward_on_subgroups_of_a_larger_world(case: MoeCase) -> None:
    results = _batch(4)
    g = make_inputs(case)
    single = torch.ops.uniep.moe_forward(
        g["x"], g["topk_idx"], g["topk_weights"], g["w1"], g["w2"], "", ""
    )
    ref = _reference(case)
    for ranks in ([0, 1], [2, 3]):
        outs = [results[r][f"sub:{case.name}"] for r in ranks]
        for r, y in zip(ranks, outs, strict=True):
            if isinstance(y, str):
                pytest.fail(f"rank {r} raised:\n{y}", pytrace=False)
        y = torch.cat(outs)
        assert rel_err(y, ref) <= TOLERANCE[case.dtype], f"subgroup {ranks}"
        assert same_bits(y, single), f"subgroup {ranks}"


@pytest.mark.parametrize("case", _params(BACKWARD_CASES))
def test_backward_bits_same_across_tunings(case: MoeCase) -> None:
    for rank, res in enumerate(_case_results(case)):
        for tuning in TUNINGS[1:]:
            for n in GRAD_NAMES:
                assert same_bits(res[f"op[{tuning}]_{n}"], res[f"op_{n}"]), (rank, tuning, n)


@pytest.mark.parametrize("case", _params(BACKWARD_CASES))
def test_backward_matches_reference_autograd(case: MoeCase) -> None:
    from uniep.reference import moe_reference

    per_rank = _case_results(case)
    g = make_inputs(case)
    leaves = {n: g[n].double().requires_grad_(True) for n in GRAD_NAMES}
    ref_y = moe_reference(
        leaves["x"], g["topk_idx"], leaves["topk_weights"], leaves["w1"], leaves["w2"]
    )
    ref_y.backward(g["grad_out"].double())
    tol = BACKWARD_TOLERANCE[case.dtype]
    for name in GRAD_NAMES:
        ref_grad = leaves[name].grad
        for rank, res in enumerate(per_rank):
            if name in ("x", "topk_weights"):
                lo, hi = case.token_range(rank)
            else:
                lo, hi = case.expert_range(rank)
            for key in (name, f"op_{name}"):
                got = res[key]
                assert got is not None, f"rank {rank}: no gradient for {key}"
                assert got.shape == ref_grad[lo:hi].shape, f"rank {rank}: {key} shape"
                assert got.dtype == g[name].dtype, f"rank {rank}: {key} dtype"
                assert torch.isfinite(got).all(), f"rank {rank}: {key} has NaN/Inf"
                if hi > lo:
                    err = rel_err(got, ref_grad[lo:hi])
                    assert err <= tol, f"rank {rank}: grad {key} rel. err {err:.3e}"
        if name == "topk_weights":
            # Unused slots (-1) contribute nothing, so their weights get no gradient.
            got = torch.cat([r[name] for r in per_rank])
            assert (got[g["topk_idx"] < 0] == 0).all()


# ---- ranks that disagree on the problem fail together, naming what differs ----

# (id, what the message must say, {rank: overrides of the baseline shape}). Every rank gets the
# same message: rank 0's value against rank 1's, enums by name.
MISMATCHES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "hidden",
        "hidden (x.size(1)) differs across ranks: rank 0 has 16, rank 1 has 24",
        {"hidden": 24},
    ),
    (
        "ffn",
        "ffn_hidden (w2.size(1)) differs across ranks: rank 0 has 8, rank 1 has 12",
        {"ffn": 12},
    ),
    (
        "top_k",
        "top_k (topk_idx.size(1)) differs across ranks: rank 0 has 2, rank 1 has 3",
        {"top_k": 3},
    ),
    (
        "local-experts",
        "num_experts (w1.size(0) x world size) differs across ranks: rank 0 has 4, rank 1 has 6",
        {"local_experts": 3},
    ),
    (
        "dtype",
        "x dtype differs across ranks: rank 0 has float32, rank 1 has float64",
        {"dtype": torch.float64},
    ),
    (
        "dispatch",
        "tuning dispatch differs across ranks: rank 0 has bf16, rank 1 has fp8",
        {"tuning": "dispatch=fp8"},
    ),
]


def mismatch_worker(
    rank: int, world_size: int, cases: list[tuple[str, str, dict[str, Any]]]
) -> dict[str, str]:
    """Rank 1 applies each case's overrides; every rank reports the error it got."""
    import uniep  # noqa: F401
    from uniep.distributed import group_name

    group = group_name()
    out = {}
    for case_id, _, overrides in cases:
        p = {"hidden": 16, "ffn": 8, "top_k": 2, "local_experts": 2, "dtype": torch.float32}
        p["tuning"] = ""
        if rank == 1:
            p.update(overrides)
        gen = torch.Generator().manual_seed(rank)
        experts = p["local_experts"] * world_size
        tokens = 5
        idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, : p["top_k"]]
        try:
            torch.ops.uniep.moe_forward(
                torch.randn(tokens, p["hidden"], dtype=p["dtype"]),
                idx.contiguous(),
                torch.rand(tokens, p["top_k"]),
                torch.randn(p["local_experts"], p["hidden"], 2 * p["ffn"], dtype=p["dtype"]),
                torch.randn(p["local_experts"], p["ffn"], p["hidden"], dtype=p["dtype"]),
                group,
                p["tuning"],
            )
            out[case_id] = "no error"
        except Exception as e:
            out[case_id] = f"{type(e).__name__}: {e}"
    return out


_MISMATCH_RESULTS: list[dict[str, str]] | Exception | None = None


@pytest.mark.parametrize(("case_id", "field"), [(c, f) for c, f, _ in MISMATCHES])
def test_ranks_disagreeing_on_shape_all_raise(case_id: str, field: str) -> None:
    global _MISMATCH_RESULTS
    if _MISMATCH_RESULTS is None:
        try:
            _MISMATCH_RESULTS = run_ranks(2, mismatch_worker, MISMATCHES)
        except Exception as e:
            _MISMATCH_RESULTS = e
    if isinstance(_MISMATCH_RESULTS, Exception):
        pytest.fail(f"multi-rank run failed:\n{_MISMATCH_RESULTS}", pytrace=False)
    for rank, res in enumerate(_MISMATCH_RESULTS):
        msg = res[case_id]
        assert msg.startswith(("ValueError", "RuntimeError")), f"rank {rank}: {msg}"
        assert field in msg, f"rank {rank}: {msg}"
