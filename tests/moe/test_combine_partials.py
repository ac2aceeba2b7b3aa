"""combine=rank_partials on the CPU executor (1, 2 and 4 gloo ranks).

Each expert rank sums its own k's of a token (ascending, fp32 for bf16/fp32, fp64 for fp64,
weights applied) over the second product's outputs as accumulated, never rounded to the dtype,
rounds that partial once to the dtype, and the token's rank sums the partials in ascending rank
order. The test rebuilds that order in torch from the per-(token, k) expert outputs, which it
reads off the executor itself: a moe_forward whose routing keeps only choice k, with weight 1,
returns y_(t, k) rounded once to the dtype. That is the unrounded output for float32 and float64;
for bf16 the rebuild is exact where no rank holds two of a token's choices and the weights are
powers of two (the partial is then one weighted row, and bf16(w y) = w bf16(y)). Other bf16
routings are checked against per_k's tolerance and, on a larger layer, for per_k's accuracy
against float64.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from _dist import run_ranks, run_ranks_once
from _moe_cases import MoeCase, rank_inputs, rel_err, same_bits

PARTIALS = "combine=rank_partials"
# Schedules change nothing within a combine mode.
TUNINGS = [PARTIALS, f"{PARTIALS},overlap=sequential,tile_m=64,tile_n=64,tile_k=32,sms=8/132"]
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}
CASES: dict[int, list[MoeCase]] = {
    1: [
        MoeCase("w1-random-k4-bf16", (13,), 40, 16, 8, 4, "bfloat16", seed=40),
        MoeCase("w1-random-k4-f32", (11,), 40, 16, 8, 4, "float32", seed=47),
    ],
    2: [
        MoeCase("w2-random-k4-bf16", (14, 11), 48, 16, 8, 4, "bfloat16", seed=41),
        MoeCase("w2-random-k8-f32", (9, 12), 40, 16, 8, 8, "float32", seed=42),
        MoeCase("w2-one-rank-k3-bf16", (10, 6), 32, 8, 8, 3, "bfloat16", "one_rank", 43),
        MoeCase("w2-zero-tokens-k2-f64", (0, 9), 24, 8, 4, 2, "float64", seed=44),
        MoeCase("w2-rank-per-k-k2-bf16", (12, 9), 40, 16, 8, 2, "bfloat16", "rank_per_k", 48),
    ],
    4: [
        MoeCase("w4-random-k6-bf16", (7, 0, 9, 8), 56, 16, 16, 6, "bfloat16", seed=45),
        MoeCase("w4-one-expert-k2-f32", (5, 6, 4, 7), 32, 8, 8, 2, "float32", "one_expert", 46),
        MoeCase("w4-rank-per-k-k3-bf16", (6, 8, 0, 7), 48, 16, 16, 3, "bfloat16", "rank_per_k", 49),
    ],
}


def _exact(case: MoeCase) -> bool:
    """Whether _expected rebuilds the executor's bits (see the module's docstring)."""
    return case.dtype != "bfloat16" or case.routing == "rank_per_k"


def _args(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w1"], inp["w2"]


def _power_of_two_weights(w: torch.Tensor) -> torch.Tensor:
    """1/2, 1/4 or 1/8 by position: products with them are exact in every dtype."""
    t, k = w.shape
    return (2.0 ** -(1 + (torch.arange(t).unsqueeze(1) + torch.arange(k)) % 3)).to(w.dtype)


def partials_worker(rank: int, world_size: int, cases: list[MoeCase]) -> dict[str, Any]:
    import uniep  # noqa: F401  (loads the ops)
    from uniep.distributed import group_name

    group = group_name()
    results: dict[str, Any] = {}
    for case in cases:
        try:
            inp = rank_inputs(case, rank)
            x, idx, w, w1, w2 = _args(inp)
            if case.routing == "rank_per_k":
                w = _power_of_two_weights(w)
            outs = [
                torch.ops.uniep.moe_forward(x, idx, w, w1, w2, group, t)
                for t in TUNINGS + TUNINGS[:1]
            ]
            per_k = torch.ops.uniep.moe_forward(x, idx, w, w1, w2, group, "")
            # y_(t, k) for every choice: one choice kept, weight 1 (exact in every dtype).
            ys = []
            for k in range(case.top_k):
                only = torch.full_like(idx, -1)
                only[:, k] = idx[:, k]
                ones = torch.zeros_like(w)
                ones[:, k] = 1.0
                ys.append(torch.ops.uniep.moe_forward(x, only, ones, w1, w2, group, ""))
            results[case.name] = {"outs": outs, "per_k": per_k, "ys": ys, "idx": idx, "w": w}
        except Exception:
            results[case.name] = traceback.format_exc()
    return results


_RESULTS: dict[int, Any] = {}


def _results(world: int) -> list[dict[str, Any]]:
    return run_ranks_once(_RESULTS, world, partials_worker, CASES[world])


def _expected(case: MoeCase, res: dict[str, Any]) -> torch.Tensor:
    """Partials per expert rank in ascending k, then their sum in ascending rank order."""
    dtype = case.torch_dtype
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    idx, w = res["idx"], res["w"].to(acc_dtype)
    out = torch.zeros(idx.shape[0], case.hidden, dtype=acc_dtype)
    owner = torch.where(idx >= 0, idx // case.experts_per_rank, -1)
    for r in range(case.world_size):
        part = torch.zeros_like(out)
        for k in range(case.top_k):
            on_r = (owner[:, k] == r).unsqueeze(1)
            part = torch.where(on_r, part + w[:, k : k + 1] * res["ys"][k].to(acc_dtype), part)
        went = (owner == r).any(1, keepdim=True)
        out = torch.where(went, out + part.to(dtype).to(acc_dtype), out)
    return out.to(dtype)


def _params() -> list[Any]:
    return [pytest.param(c, id=c.name) for w in sorted(CASES) for c in CASES[w]]


@pytest.mark.parametrize("case", _params())
def test_rank_partials_sum_in_the_documented_order(case: MoeCase) -> None:
    for rank, res in enumerate(_results(case.world_size)):
        assert not isinstance(res[case.name], str), f"rank {rank} raised:\n{res[case.name]}"
        got = res[case.name]
        for out in got["outs"][1:]:
            assert same_bits(out, got["outs"][0]), (case.name, rank)
        if _exact(case):
            assert same_bits(got["outs"][0], _expected(case, got)), (case.name, rank)
        # The same function: only where the sum is split and rounded changes.
        assert rel_err(got["outs"][0], got["per_k"]) <= TOLERANCE[case.dtype], (case.name, rank)
        if case.world_size == 1 and case.dtype != "bfloat16":
            # One partial per token, and y is not rounded in float32: per_k's bits exactly.
            assert same_bits(got["outs"][0], got["per_k"])


def accuracy_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    import uniep  # noqa: F401
    from uniep.distributed import group_name

    case = MoeCase("acc", (64,) * world_size, 256, 128, 32, 8, "bfloat16", seed=7)
    inp = rank_inputs(case, rank)
    args = _args(inp)
    wide = [a.double() if a.is_floating_point() else a for a in args]
    out = {t: torch.ops.uniep.moe_forward(*args, group_name(), t) for t in ("", PARTIALS)}
    out["float64"] = torch.ops.uniep.moe_forward(*wide, group_name(), "")
    return out


def test_rank_partials_keep_per_k_accuracy() -> None:
    """One bf16 row per (token, rank), and the error against a float64 layer stays per_k's: the
    partial's rounding replaces the expert rows' own (with the rows rounded as well, the RMS
    error on this layer is 1.09x per_k's)."""
    res = run_ranks(4, accuracy_worker)
    ref = torch.cat([r["float64"] for r in res])

    def rms(mode: str) -> float:
        out = torch.cat([r[mode] for r in res]).double()
        return float(((out - ref) ** 2).mean().sqrt())

    assert rms(PARTIALS) <= 1.03 * rms(""), (rms(PARTIALS), rms(""))


def mode_mismatch_worker(rank: int, world_size: int) -> str:
    import uniep  # noqa: F401
    from uniep.distributed import group_name

    case = CASES[2][0]
    inp = rank_inputs(case, rank)
    try:
        torch.ops.uniep.moe_forward(*_args(inp), group_name(), PARTIALS if rank == 0 else "")
    except Exception as e:  # every rank must fail, naming the field
        return str(e)
    return "no error"


def test_ranks_disagreeing_on_combine_mode_all_raise() -> None:
    for rank, msg in enumerate(run_ranks(2, mode_mismatch_worker)):
        want = "tuning combine differs across ranks: rank 0 has rank_partials, rank 1 has per_k"
        assert want in msg, (rank, msg)


def test_combine_mode_parses_and_prints() -> None:
    from uniep import _C

    params = _C.TuningParams.parse(PARTIALS)
    assert params.combine == "rank_partials"
    assert "combine=rank_partials" in params.to_string()
    assert _C.TuningParams.parse("").combine == "per_k"
    with pytest.raises(ValueError, match="combine must be per_k, rank_partials or node_partials"):
        _C.TuningParams.parse("combine=tree")


def test_docs_say_partials_are_stored_in_x_dtype() -> None:
    """docs/determinism.md, docs/tuning.md and ``uniep.moe.ep.combine`` say what
    test_rank_partials_sum_in_the_documented_order checks: each partial is stored in x's dtype
    (one bf16 rounding for bf16 x, the CUDA executor's only dtype; none for float32 or float64 x),
    not "rounded once to bf16" whatever the dtype."""
    from pathlib import Path

    from uniep.moe import ep

    docs = Path(__file__).resolve().parents[2] / "docs"
    determinism = (docs / "determinism.md").read_text()
    bullet = determinism[determinism.index("- `combine=rank_partials`") :]
    bullet = bullet[: bullet.index("\n- ")]
    tuning = (docs / "tuning.md").read_text().splitlines()
    row = next(line for line in tuning if line.startswith("| `combine` |"))
    for page, text in (("determinism.md", bullet), ("tuning.md", row)):
        flat = " ".join(text.split())
        assert "stored once in x's dtype" in flat, page
        assert "rounded once to bf16" not in flat, page
    assert "with float32 or float64 x, no extra rounding" in " ".join(ep.combine.__doc__.split())
