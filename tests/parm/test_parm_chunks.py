"""The SAA chunk counts of a Parm plan: the cost model prices each SAA pair at a pipeline degree
(``Pricing.chunks``), ``saa_chunk_plan`` turns that into the ops' ``chunks`` argument, and the
executor cuts each pair into that many chunks. One process, no torch.distributed."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from uniep import _C, parm
from uniep.parm.cpu import GlooBackend
from uniep.parm.executor import Groups, SerialLanes, check_chunks
from uniep.parm.ops import split_chunks


def _shape(N: int = 2, G: int = 2, **fields: Any) -> Any:
    """A ``ParmShape`` of N x G ranks; ``fields`` replace the defaults."""
    layer = dict(tokens=4096, hidden=1024, ffn_hidden=2048, num_experts=8, top_k=2)
    layer.update(capacity_factor=1.2, dtype_bytes=2)
    layer.update(fields)
    return _C.parm.ParmShape(world_size=N * G, mp_size=N, gpus_per_node=N, **layer)


def _pairs(steps: Any) -> list[int]:
    return [i for i, s in enumerate(steps.steps) if s.overlap_with > i]


def _model(alpha: float) -> Any:
    """The h100-ib model of a 2 x 2 layout with every collective's alpha set to ``alpha``."""
    m = parm.cost_model(4, 2, gpus_per_node=2)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for link in ("intra", "inter"):
            m.set(kind, link, _C.parm.AlphaBeta(alpha, m.get(kind, link).beta))
    return m


@pytest.mark.parametrize("schedule", ["s1", "s2"])
def test_plan_follows_the_model(schedule: str) -> None:
    shape = _shape()
    # A collective that costs 1 ms a call is never worth cutting; one that costs 1 us is.
    for alpha, pipelined in ((1e-3, False), (1e-6, True)):
        model = _model(alpha)
        plan = parm.saa_chunk_plan(shape, schedule, model)
        want: list[int] = []
        for pass_ in ("forward", "backward"):
            steps = _C.parm.build_steps(shape, schedule, pass_)
            counts = list(_C.parm.price(steps, model).chunks)
            off_pairs = [c for c, s in zip(counts, steps.steps, strict=True) if s.overlap_with < 0]
            assert set(off_pairs) == {1}
            want += counts
        assert plan == want
        assert (max(plan) > 1) == pipelined, (alpha, plan)


def test_plan_with_a_fixed_count_and_the_baseline() -> None:
    shape = _shape()
    plan = parm.saa_chunk_plan(shape, "s2", chunks=3)
    fwd = _C.parm.build_steps(shape, "s2", "forward")
    bwd = _C.parm.build_steps(shape, "s2", "backward")
    assert len(plan) == len(fwd.steps) + len(bwd.steps)
    on_pairs = {i for i, s in enumerate(fwd.steps) if s.overlap_with >= 0}
    on_pairs |= {len(fwd.steps) + i for i, s in enumerate(bwd.steps) if s.overlap_with >= 0}
    assert len(on_pairs) == 8  # two pairs per pass, two steps per pair
    assert all(c == (3 if i in on_pairs else 1) for i, c in enumerate(plan))
    # The baseline has no SAA pair: nothing to cut, whatever the model.
    assert set(parm.saa_chunk_plan(shape, "baseline", _model(1e-6))) == {1}


def test_check_chunks_names_what_is_wrong() -> None:
    shape = _shape()
    steps = _C.parm.build_steps(shape, "s2", "forward")
    n = len(steps.steps)
    first = _pairs(steps)[0]
    assert check_chunks(None, steps) == [] and check_chunks([], steps) == []
    good = [1] * n
    good[first] = good[first + 1] = 4
    assert check_chunks(good, steps) == good
    with pytest.raises(ValueError, match=f"per step of the s2 forward list \\({n}\\)"):
        check_chunks([1] * (n - 1), steps)
    bad = list(good)
    bad[0] = 0
    with pytest.raises(ValueError, match="step 0 .*expected an int >= 1, got 0"):
        check_chunks(bad, steps)
    bad = list(good)
    bad[first + 1] = 2
    with pytest.raises(ValueError, match=f"pair of steps {first} and {first + 1} .* got 4 and 2"):
        check_chunks(bad, steps)
    bad = list(good)
    bad[0] = True
    with pytest.raises(ValueError, match="got True"):
        check_chunks(bad, steps)


def test_split_chunks_needs_both_passes() -> None:
    shape = _shape()
    fwd = _C.parm.build_steps(shape, "s1", "forward")
    bwd = _C.parm.build_steps(shape, "s1", "backward")
    plan = parm.saa_chunk_plan(shape, "s1", chunks=2)
    f, b = split_chunks(plan, fwd, bwd)
    assert f == plan[: len(fwd.steps)] and b == plan[len(fwd.steps) :]
    assert split_chunks([], fwd, bwd) == ([], [])
    with pytest.raises(ValueError, match="forward list .* and of its backward list"):
        split_chunks(plan[: len(fwd.steps)], fwd, bwd)


class _CountingLanes(SerialLanes):
    def __init__(self) -> None:
        self.calls = 0

    def run_second(self, second: Any, mid: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return second(mid)


def test_executor_cuts_each_pair_as_planned() -> None:
    """The CUDA executor's backend (on CPU tensors, one rank) runs each pair in its plan's count,
    and the default count where no plan is given; the values never change."""
    from uniep.parm.cuda import CudaExecutor

    torch.manual_seed(0)
    S, M, H, E, k = 40, 8, 12, 4, 2
    shape = _shape(
        1,
        1,
        tokens=S,
        hidden=M,
        ffn_hidden=H,
        num_experts=E,
        top_k=k,
        capacity_factor=0.0,
        dtype_bytes=8,
    )
    groups = Groups(mp=None, ep=None, mp_size=1, ep_size=1, mp_index=0, ep_index=0)
    x, gate = torch.randn(S, M, dtype=torch.float64), torch.randn(M, E)
    w1, w2 = torch.randn(E, M, H, dtype=torch.float64), torch.randn(E, H, M, dtype=torch.float64)
    fwd = _C.parm.build_steps(shape, "s2", "forward")
    first, second = _pairs(fwd)
    plan = [1] * len(fwd.steps)
    plan[first] = plan[first + 1] = 3
    plan[second] = plan[second + 1] = 5
    results = []
    for chunks, calls in ((plan, 3 + 5), (None, 2 + 2)):
        lanes = _CountingLanes()
        ex = CudaExecutor(shape, groups, "drop", lanes=lanes, chunks=2)
        y, _, _ = ex.forward(x, gate, w1, w2, fwd, chunks)
        assert lanes.calls == calls, (chunks, lanes.calls)
        results.append(y)
    assert torch.equal(results[0], results[1])


def test_layer_passes_its_plan_to_both_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """ParmMoELayer's chunks reach the forward op and, through autograd, the backward op."""
    seen: list[int | None] = []
    run = GlooBackend.pipelined

    def spy(self: Any, first: Any, second: Any, t: torch.Tensor, chunks: Any = None) -> Any:
        seen.append(chunks)
        return run(self, first, second, t, chunks)

    monkeypatch.setattr(GlooBackend, "pipelined", spy)
    torch.manual_seed(1)
    layer = parm.ParmMoELayer(None, None, 8, 12, 4, 2, capacity_factor=0.0, schedule="s2", chunks=3)
    x = torch.randn(6, 8, requires_grad=True)
    y = layer(x)
    assert seen == [3, 3]  # s2's two forward pairs
    (y.sum() + layer.l_aux).backward()
    assert seen == [3, 3, 3, 3]
    assert layer.last_chunks == parm.saa_chunk_plan(layer._shape(6), "s2", chunks=3)
    # "auto" on one rank: every link is local, so no pair is worth cutting.
    layer.chunks, layer._plans = "auto", {}
    seen.clear()
    layer(x).sum().backward()
    assert seen == [1, 1, 1, 1] and set(layer.last_chunks) == {1}


def test_layer_and_op_reject_bad_chunks() -> None:
    for bad in (0, -2, True, 2.0, "four"):
        with pytest.raises(ValueError, match="chunks must be 'auto' or an int >= 1"):
            parm.ParmMoELayer(None, None, 8, 8, 4, 2, chunks=bad)
    layer = parm.ParmMoELayer(None, None, 8, 12, 4, 2, capacity_factor=0.0)
    x = torch.randn(5, 8)
    args = (x, layer.gate, layer.w1, layer.w2, "", "", 2, 0.0, "s1", "error")
    with pytest.raises(ValueError, match="chunks: expected one count per step"):
        torch.ops.uniep.parm_moe_forward(*args, [2, 2])


def test_cost_model_pickles() -> None:
    """A fitted model reaches spawned ranks by pickle (uniep.parm.profile.measure_layers)."""
    m = _model(3e-4)
    m.gemm = _C.parm.AlphaBeta(2e-5, 1e-15)
    m.mem_beta, m.max_chunks, m.step_alpha = 1e-12, 8, 2e-4
    back = pickle.loads(pickle.dumps(m))
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for link in ("intra", "inter"):
            got, want = back.get(kind, link), m.get(kind, link)
            assert (got.alpha, got.beta) == (want.alpha, want.beta)
    got = (back.gemm.alpha, back.gemm.beta, back.mem_beta, back.max_chunks, back.step_alpha)
    assert got == (2e-5, 1e-15, 1e-12, 8, 2e-4)
    shape = _shape()
    assert parm.saa_chunk_plan(shape, "s2", back) == parm.saa_chunk_plan(shape, "s2", m)
