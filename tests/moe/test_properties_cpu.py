"""Randomized properties of the CPU executor and planner, on seeded cases from _routing_gen:
top-k 1..16, 1..512 experts, 0..4096 tokens per rank with empty ranks, uniform, Zipf,
one-expert, rank-skewed and holed routings, float32 / bfloat16 / float64.

What must hold for every case, at world 1 and over 2 and 4 gloo ranks:
- moe_forward is within tolerance of the float64 dense reference (moe_backward too, on a subset);
- its bits are the same for every point of the tuning space that only schedules the work (sms,
  token_tile, tile_m/n/k, stages, overlap), fixed and randomly drawn ones;
- its bits are the same at every world size for the same global tokens and experts (README,
  Determinism), with the case's own token split and with an even split over another world;
- combine=rank_partials stays within tolerance of per_k (the same bits at world 1 in float32
  and float64, where each token has one partial and the expert rows need no rounding) and has
  bits of its own that no schedule changes; dispatch=fp8 (with
  experts=bf16: the rows' rounding alone) likewise against the reference, with a tolerance for
  the e4m3 rounding;
- routing_layout and expert_rows equal their definitions written out here in torch.

Each world size runs all its cases in one spawn (a spawn costs seconds); the ranks compare the
tunings among themselves and return a base output and the tunings that differed.
"""

from __future__ import annotations

import os
import random
import traceback
from collections import Counter
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _moe_cases import rel_err, same_bits
from _routing_gen import ROUTINGS, RoutingCase, draw_case, global_inputs, random_tuning, rank_inputs

# Cases per world size; seeds are disjoint across world sizes. UNIEP_PROPERTY_SEED shifts them
# all, to explore beyond what CI runs (CI keeps the default, 0, so its cases never change).
COUNTS = {1: 70, 2: 45, 4: 35}
SEED_SHIFT = int(os.environ.get("UNIEP_PROPERTY_SEED", "0"))
SEED_BASE = {1: 0, 2: 10_000, 4: 20_000}
CASES: dict[int, list[RoutingCase]] = {
    w: [draw_case(SEED_SHIFT + SEED_BASE[w] + i, w) for i in range(n)] for w, n in COUNTS.items()
}
ALL_CASES = [c for w in sorted(CASES) for c in CASES[w]]
# Backward on every other case whose work is small: it costs about three forwards, plus a
# float64 autograd reference.
BACKWARD_WORK_CAP = 1 << 22
BACKWARD_CASES = [c for c in ALL_CASES if c.seed % 2 == 0 and c.work <= BACKWARD_WORK_CAP]

# Schedule-only tuning points, the extremes of each key; each case adds two random ones.
FIXED_TUNINGS = [
    "overlap=sequential,tile_m=16,tile_n=16,tile_k=16,stages=1,token_tile=1",
    "overlap=chunked,tile_m=256,tile_n=256,tile_k=256,stages=8,token_tile=4096,sms=64/132",
    "overlap=fused,tile_m=32,tile_n=64,tile_k=128,sms=1/2,stages=3,token_tile=7",
]
PARTIALS = "combine=rank_partials"
FP8 = "dispatch=fp8,experts=bf16"
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}
BACKWARD_TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float64": 1e-10}
GRAD_NAMES = ("x", "topk_weights", "w1", "w2")


def case_tunings(case: RoutingCase, dispatch: str = "bf16", combine: str = "per_k") -> list[str]:
    """The points a case runs with the given numerics: the defaults, then the fixed ones (for
    per_k bf16 only), then two drawn from the case's seed."""
    rng = random.Random(case.seed)
    base = f"dispatch={dispatch},combine={combine}"
    fixed = []
    if (dispatch, combine) == ("bf16", "per_k"):
        fixed = [f"{base},{t}" for t in FIXED_TUNINGS]
    drawn = [random_tuning(rng, dispatch=dispatch, combine=combine) for _ in range(2)]
    # The fp8 family is the wire's property (any hidden, any dtype): bf16 expert GEMMs on the fp8
    # rows. Its fp8 experts have tests/gemm/test_fp8_experts.py.
    wire = ",experts=bf16" if dispatch == "fp8" else ""
    return [t + wire for t in (base, *fixed, *drawn)]


def _args(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w1"], inp["w2"]


def _forward_family(inp: dict[str, torch.Tensor], group: str, tunings: list[str]) -> dict[str, Any]:
    """The output at the first tuning, and the tunings whose bits differ from it (the first one
    runs twice: run to run)."""
    tunings = [*tunings, tunings[0]]
    outs = [torch.ops.uniep.moe_forward(*_args(inp), group, t) for t in tunings]
    return {
        "out": outs[0],
        "differ": [t for t, y in zip(tunings, outs, strict=True) if not same_bits(y, outs[0])],
    }


def properties_worker(
    rank: int, world: int, cases: list[RoutingCase], regrouped: list[RoutingCase]
) -> dict[str, Any]:
    """Runs on every rank (or in the test process at world 1). Per case: the families of
    outputs, gradients for backward cases, or a traceback. `regrouped`: other world sizes'
    cases split evenly over this one, forward at the default tuning only."""
    import uniep  # noqa: F401  (loads the ops)
    from uniep.distributed import group_name

    group = group_name()
    results: dict[str, Any] = {}
    for case in cases:
        try:
            inp = rank_inputs(case, rank)
            res = {
                "per_k": _forward_family(inp, group, case_tunings(case)),
                "partials": _forward_family(
                    inp, group, case_tunings(case, combine="rank_partials")
                ),
                "fp8": _forward_family(inp, group, case_tunings(case, dispatch="fp8")),
            }
            if case in BACKWARD_CASES:
                tunings = case_tunings(case)[::2]
                grads = [
                    torch.ops.uniep.moe_backward(inp["grad_out"], *_args(inp), group, t)
                    for t in tunings
                ]
                res["grads"] = dict(zip(GRAD_NAMES, grads[0], strict=True))
                res["grads_differ"] = [
                    t
                    for t, g in zip(tunings, grads, strict=True)
                    if not all(same_bits(a, b) for a, b in zip(g, grads[0], strict=True))
                ]
            results[case.name] = res
        except Exception:
            results[case.name] = traceback.format_exc()
    for case in regrouped:
        try:
            inp = rank_inputs(case, rank)
            results[f"regrouped:{case.name}"] = torch.ops.uniep.moe_forward(*_args(inp), group, "")
        except Exception:
            results[f"regrouped:{case.name}"] = traceback.format_exc()
    return results


def _regrouped_onto(world: int) -> list[RoutingCase]:
    """Cases of the other multi-rank world sizes whose experts split over `world` ranks."""
    return [
        c.on_world(world)
        for w in CASES
        if w not in (1, world)
        for c in CASES[w]
        if c.experts % world == 0
    ]


_RESULTS: dict[int, list[dict[str, Any]] | Exception] = {}


def _results(world: int) -> list[dict[str, Any]]:
    """Every case of one world size, run once per session however many tests read them."""
    if world not in _RESULTS:
        try:
            if world == 1:
                _RESULTS[world] = [properties_worker(0, 1, CASES[1], [])]
            else:
                _RESULTS[world] = run_ranks(
                    world, properties_worker, CASES[world], _regrouped_onto(world), timeout=300
                )
        except Exception as e:
            _RESULTS[world] = e
    got = _RESULTS[world]
    if isinstance(got, Exception):
        pytest.fail(f"run on {world} ranks failed:\n{got}", pytrace=False)
    return got


def _per_rank(case: RoutingCase, key: str | None = None) -> list[Any]:
    """Each rank's result for `case` (its entry `key`, if given); fails on a rank's traceback."""
    name = case.name if key is None else key
    per_rank = [r[name] for r in _results(case.world_size)]
    for rank, res in enumerate(per_rank):
        if isinstance(res, str):
            pytest.fail(f"{name}: rank {rank} raised:\n{res}", pytrace=False)
    return per_rank


def _joined(case: RoutingCase, family: str) -> torch.Tensor:
    """The family's output at its first tuning, every rank's tokens in rank order."""
    return torch.cat([r[family]["out"] for r in _per_rank(case)])


def _reference(case: RoutingCase) -> torch.Tensor:
    from uniep.reference import moe_reference

    return moe_reference(*_args(global_inputs(case)))


def _single_rank(case: RoutingCase, tuning: str = "") -> torch.Tensor:
    return torch.ops.uniep.moe_forward(*_args(global_inputs(case)), "", tuning)


def _params(cases: list[RoutingCase]) -> list[Any]:
    return [pytest.param(c, id=c.name) for c in cases]


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_matches_reference(case: RoutingCase) -> None:
    for rank, res in enumerate(_per_rank(case)):
        y = res["per_k"]["out"]
        t0, t1 = case.token_range(rank)
        assert y.shape == (t1 - t0, case.hidden) and y.dtype == case.torch_dtype, rank
        assert torch.isfinite(y).all(), f"rank {rank} output has NaN/Inf"
    err = rel_err(_joined(case, "per_k"), _reference(case))
    assert err <= TOLERANCE[case.dtype], f"rel. err {err:.3e}"


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_forward_bits_same_across_tunings(case: RoutingCase) -> None:
    for rank, res in enumerate(_per_rank(case)):
        for family in ("per_k", "partials", "fp8"):
            assert res[family]["differ"] == [], f"rank {rank} {family}: these tunings differ"


MULTI_RANK = [c for w in sorted(CASES) if w > 1 for c in CASES[w]]


@pytest.mark.parametrize("case", _params(MULTI_RANK))
def test_forward_bits_same_across_world_sizes(case: RoutingCase) -> None:
    """Slot-indexed buffers and a k-ascending combine make the bits a function of the routing
    alone: one rank holding every expert, this case's split and an even split over the other
    multi-rank world size all give the same bits (fp8 too: the encoding is per row)."""
    single = _single_rank(case)
    assert same_bits(_joined(case, "per_k"), single)
    assert same_bits(_joined(case, "fp8"), _single_rank(case, FP8))
    for other in CASES:
        if other in (1, case.world_size) or case.experts % other != 0:
            continue
        moved = case.on_world(other)
        y = torch.cat(_per_rank(moved, f"regrouped:{moved.name}"))
        assert same_bits(y, single), f"split over {other} ranks as {moved.tokens}"


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_rank_partials_close_to_per_k(case: RoutingCase) -> None:
    partials, per_k = _joined(case, "partials"), _joined(case, "per_k")
    assert torch.isfinite(partials).all()
    if case.world_size == 1 and case.dtype != "bfloat16":
        # One partial per token, and the unrounded rows are the rows: per_k's bits exactly. In
        # bf16, per_k rounds each row and then the sum; the partial only the sum.
        assert same_bits(partials, per_k)
    err = rel_err(partials, per_k)
    assert err <= TOLERANCE[case.dtype], f"rel. err {err:.3e}"


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x as the expert ranks see it with dispatch=fp8: e4m3 values (the executors' encoding,
    from _C.encode_fp8_rows) times their 1x128 block scale, one fp32 product, in x's dtype."""
    from uniep import _C

    q, scales = _C.encode_fp8_rows(x.float().numpy())
    values = torch.from_numpy(q).view(torch.float8_e4m3fn).float()
    block_of_column = torch.arange(x.shape[1]) // 128
    return (values * torch.from_numpy(scales)[:, block_of_column]).to(x.dtype)


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_fp8_dispatch_matches_reference_on_fp8_rows(case: RoutingCase) -> None:
    """dispatch=fp8 changes what the experts read, nothing else: the reference on the rows
    rounded the same way is as close as without fp8."""
    from uniep.reference import moe_reference

    y = _joined(case, "fp8")
    assert torch.isfinite(y).all()
    g = global_inputs(case)
    ref = moe_reference(fp8_roundtrip(g["x"]), *_args(g)[1:])
    err = rel_err(y, ref)
    assert err <= TOLERANCE[case.dtype], f"rel. err {err:.3e}"


@pytest.mark.parametrize("case", _params(BACKWARD_CASES))
def test_backward_matches_reference_autograd(case: RoutingCase) -> None:
    from uniep.reference import moe_reference

    per_rank = _per_rank(case)
    for rank, res in enumerate(per_rank):
        assert res["grads_differ"] == [], f"rank {rank}: these tunings differ"
    g = global_inputs(case)
    leaves = {n: g[n].double().requires_grad_(True) for n in GRAD_NAMES}
    ref_y = moe_reference(
        leaves["x"], g["topk_idx"], leaves["topk_weights"], leaves["w1"], leaves["w2"]
    )
    ref_y.backward(g["grad_out"].double())
    for name in GRAD_NAMES:
        ref = leaves[name].grad
        assert ref is not None, name
        span = case.token_range if name in ("x", "topk_weights") else case.expert_range
        # grad_topk_weights comes in topk_weights' float32, whatever x's dtype.
        tol = BACKWARD_TOLERANCE[case.dtype]
        if name == "topk_weights":
            tol = max(tol, BACKWARD_TOLERANCE["float32"])
        for rank, res in enumerate(per_rank):
            lo, hi = span(rank)
            got = res["grads"][name]
            assert got.shape == ref[lo:hi].shape and got.dtype == g[name].dtype, (rank, name)
            assert torch.isfinite(got).all(), (rank, name)
            err = rel_err(got, ref[lo:hi])
            assert err <= tol, f"rank {rank} {name}: rel. err {err:.3e}"
    # Unused slots (-1) contribute nothing, so their weights get no gradient.
    grad_w = torch.cat([r["grads"]["topk_weights"] for r in per_rank])
    assert (grad_w[g["topk_idx"] < 0] == 0).all()


# ---- the planner's ops against their definitions ----


def layout_definition(
    idx: torch.Tensor, experts: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens_per_rank [W], tokens_per_expert [E], token_in_rank [T, W]: a token counts once on
    each rank holding any of its experts; an expert counts each (token, k) routed to it."""
    per_rank = experts // world
    valid = idx >= 0
    owner = torch.where(valid, idx // per_rank, -1)
    token_in_rank = torch.stack([(owner == r).any(1) for r in range(world)], dim=1)
    token_in_rank = token_in_rank.reshape(idx.shape[0], world)
    tokens_per_expert = torch.bincount(idx[valid], minlength=experts)
    return token_in_rank.sum(0), tokens_per_expert, token_in_rank


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_routing_layout_follows_definition(case: RoutingCase) -> None:
    """On the whole routing and on each rank's, for every world size up to 8 the experts split
    over (the layout does not depend on who computes it)."""
    g = global_inputs(case)
    routings = [g["topk_idx"]] + [
        g["topk_idx"][slice(*case.token_range(r))] for r in range(case.world_size)
    ]
    for world in (w for w in (1, 2, 3, 4, 8) if case.experts % w == 0):
        for idx in routings:
            got = torch.ops.uniep.routing_layout(idx.contiguous(), case.experts, world)
            want = layout_definition(idx, case.experts, world)
            for name, a, b in zip(
                ("tokens_per_rank", "tokens_per_expert", "token_in_rank"), got, want, strict=True
            ):
                assert a.dtype == b.dtype and torch.equal(a, b), (world, name)


def received_by(
    case: RoutingCase, idx: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `rank` receives in a dispatch of the routing `idx` (every rank's tokens): each source
    rank's tokens with an expert on `rank`, in (source, token) order, with their whole top-k."""
    e0, e1 = case.expert_range(rank)
    srcs, ids, counts = [], [], []
    for s in range(case.world_size):
        mine = idx[slice(*case.token_range(s))]
        keep = ((mine >= e0) & (mine < e1)).any(1)
        srcs.append(torch.arange(mine.shape[0])[keep])
        ids.append(mine[keep])
        counts.append(int(keep.sum()))
    return torch.cat(srcs), torch.cat(ids).contiguous(), torch.tensor(counts, dtype=torch.int64)


def expert_rows_definition(
    case: RoutingCase,
    recv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rank: int,
    max_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per received (slot, k) on a local expert, ordered by (expert, slot, k); the row
    goes back to source * max_tokens * K + token * K + k."""
    src, ids, from_rank = recv
    k_top = case.top_k
    e0, e1 = case.expert_range(rank)
    slot, k = ((ids >= e0) & (ids < e1)).nonzero(as_tuple=True)  # by slot, then k
    expert = ids[slot, k]
    order = torch.sort(expert, stable=True).indices
    slot, k, expert = slot[order], k[order], expert[order]
    source = torch.repeat_interleave(torch.arange(case.world_size), from_rank)
    target = source[slot] * max_tokens * k_top + src[slot] * k_top + k
    per_expert = torch.bincount(expert - e0, minlength=e1 - e0)
    return slot, target, per_expert


@pytest.mark.parametrize("case", _params(ALL_CASES))
def test_expert_rows_follow_definition(case: RoutingCase) -> None:
    idx = global_inputs(case)["topk_idx"]
    max_tokens = max(max(case.tokens), 1)
    for rank in range(case.world_size):
        recv = received_by(case, idx, rank)
        got = torch.ops.uniep.expert_rows(*recv, rank, case.experts, max_tokens)
        want = expert_rows_definition(case, recv, rank, max_tokens)
        for name, a, b in zip(
            ("row_slot", "row_target", "tokens_per_expert"), got, want, strict=True
        ):
            assert a.dtype == torch.int64 and torch.equal(a, b), (rank, name)


# ---- what the cases cover ----


def test_cases_cover_the_space(record_property: Any) -> None:
    """The drawn cases reach every corner of the space in the module docstring; a change to the
    generator that loses one fails here rather than silently testing less."""
    cases = ALL_CASES
    kinds = Counter(c.routing for c in cases)
    summary = {
        "cases": len(cases),
        "per_world": {w: len(c) for w, c in CASES.items()},
        "backward": len(BACKWARD_CASES),
        "regrouped": {w: len(_regrouped_onto(w)) for w in CASES if w > 1},
        "routings": dict(kinds),
        "dtypes": dict(Counter(c.dtype for c in cases)),
    }
    record_property("property_cases", summary)
    print(f"\nproperty cases (CPU): {summary}")
    assert set(kinds) == set(ROUTINGS)
    assert {c.dtype for c in cases} == {"float32", "bfloat16", "float64"}
    assert any(0 in c.tokens for c in MULTI_RANK), "no empty rank"
    assert any(c.total_tokens == 0 for c in cases), "no case without tokens"
    assert max(max(c.tokens) for c in cases) >= 2048
    assert max(c.experts for c in cases) >= 256
    assert {c.top_k for c in cases} >= {1, 2, 8} and max(c.top_k for c in cases) >= 12
    assert any(c.top_k > c.experts for c in cases), "no top-k wider than the experts"
    assert {c.hidden % 128 for c in cases} == {0, 64}
