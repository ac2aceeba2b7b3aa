"""ParmMoELayer in one process (no torch.distributed: a world of one, N = G = 1): the executor's
math against the dense reference in fp32 and bf16, and its argument checks."""

from __future__ import annotations

import pytest
import torch
from uniep.parm import SCHEDULES, CapacityError, ParmMoELayer
from uniep.parm.reference import parm_reference


def _layer_and_reference(dtype: torch.dtype, schedule: str, top_k: int = 2, f: float = 0.0):
    torch.manual_seed(0)
    layer = ParmMoELayer(
        None, None, 16, 24, 6, top_k, capacity_factor=f, schedule=schedule, dtype=dtype
    )
    x = torch.randn(9, 16)
    gate, w1, w2 = (p.detach().double().requires_grad_() for p in (layer.gate, layer.w1, layer.w2))
    x64 = x.double().requires_grad_()
    cap = layer._shape(9).slice_capacity
    y_ref, laux_ref, _ = parm_reference(x64, gate, w1, w2, top_k, 1, cap)
    (y_ref.sum() + laux_ref).backward()
    xin = x.to(dtype).requires_grad_()
    y = layer(xin)
    (y.float().sum() + layer.l_aux).backward()
    got = (y.detach(), xin.grad, layer.gate.grad, layer.w1.grad, layer.w2.grad)
    want = (y_ref.detach(), x64.grad, gate.grad, w1.grad, w2.grad)
    return got, want


@pytest.mark.parametrize("schedule", [*SCHEDULES, "auto"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_one_rank_matches_reference(schedule: str, dtype: torch.dtype, tol: float) -> None:
    got, want = _layer_and_reference(dtype, schedule)
    for name, g, w in zip(("y", "dx", "dgate", "dw1", "dw2"), got, want, strict=True):
        assert g.dtype == (torch.float32 if name == "dgate" else dtype), name
        err = float((g.double() - w).abs().max() / w.abs().max())
        assert err <= tol, f"{name}: {err:.2e}"


def test_capacity_overflow_raises_unless_dropping() -> None:
    torch.manual_seed(1)
    layer = ParmMoELayer(None, None, 8, 8, 4, 2, capacity_factor=0.1)
    with pytest.raises(CapacityError, match="capacity overflow: .* overflow='drop'"):
        layer(torch.randn(32, 8))
    layer.overflow = "drop"
    y = layer(torch.randn(32, 8))
    assert y.shape == (32, 8) and layer.last_stats["dropped"] > 0


def test_a_second_derivative_is_refused_not_left_out() -> None:
    """A gradient penalty through the layer raises: its backward op has no derivative, and
    autograd would otherwise leave the second-order terms out with a warning."""
    torch.manual_seed(2)
    layer = ParmMoELayer(None, None, 16, 8, 4, 2, capacity_factor=4.0)
    x = torch.randn(8, 16, requires_grad=True)
    y = layer(x)
    with pytest.raises(ValueError, match="ParmMoELayer has no second derivative"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    (gx,) = torch.autograd.grad(layer(x).sum(), x)  # the first derivative alone is fine
    assert gx.shape == x.shape


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="schedule"):
        ParmMoELayer(None, None, 8, 8, 4, 2, schedule="s3")
    with pytest.raises(ValueError, match="overflow"):
        ParmMoELayer(None, None, 8, 8, 4, 2, overflow="ignore")
    layer = ParmMoELayer(None, None, 8, 8, 4, 2)
    with pytest.raises(ValueError, match="hidden=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="top_k"):
        ParmMoELayer(None, None, 8, 8, 4, 5)


def test_assigned_plan_arguments_take_effect() -> None:
    """The plan is cached per token count; an assignment after a forward reaches the next
    forward at the same token count (it was ignored there), and a bad value raises."""
    from uniep import _C

    torch.manual_seed(4)
    layer = ParmMoELayer(None, None, 8, 8, 4, 2, capacity_factor=0.0, schedule="baseline")
    x = torch.randn(6, 8)
    want = layer(x)
    assert layer.last_schedule == "baseline"
    steps = _C.parm.build_steps(layer._shape(6), "s2", "forward").steps
    pairs = [i for i, step in enumerate(steps) if step.overlap_with >= 0]
    assert pairs
    for chunks in (3, 2):
        layer.schedule, layer.chunks = "s2", chunks
        torch.testing.assert_close(layer(x), want)
        assert layer.last_schedule == "s2"
        assert {layer.last_chunks[i] for i in pairs} == {chunks}
    layer.schedule = "s3"
    with pytest.raises(ValueError, match="schedule must be 'auto', 'baseline', 's1' or 's2'"):
        layer(x)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ops_pass_opcheck(schedule: str) -> None:
    torch.manual_seed(2)
    layer = ParmMoELayer(None, None, 8, 12, 4, 2, capacity_factor=0.0)
    x = torch.randn(5, 8, requires_grad=True)
    args = (x, layer.gate, layer.w1, layer.w2, "", "", 2, 0.0, schedule, "error")
    torch.library.opcheck(torch.ops.uniep.parm_moe_forward.default, args)
    y, l_aux, exp_in, comb, stats = torch.ops.uniep.parm_moe_forward(*args)
    back = (
        torch.randn(5, 8),
        torch.tensor(0.5),
        x.detach(),
        layer.gate.detach(),
        layer.w1.detach(),
        layer.w2.detach(),
        exp_in,
        comb,
        stats,
        "",
        "",
        2,
        0.0,
        schedule,
    )
    torch.library.opcheck(torch.ops.uniep.parm_moe_backward.default, back)


def test_layer_compiles_through_the_fake_kernels() -> None:
    torch.manual_seed(3)
    layer = ParmMoELayer(None, None, 8, 12, 4, 2, capacity_factor=0.0, schedule="s2")
    x = torch.randn(6, 8)
    want = layer(x)
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x.requires_grad_())
    got.sum().backward()
    torch.testing.assert_close(got, want)
    assert x.grad is not None and layer.w1.grad is not None


def test_plans_of_ragged_batches_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import uniep.parm as parm

    monkeypatch.setattr(parm, "_PLANS_KEPT", 3)
    layer = ParmMoELayer(None, None, 8, 8, 4, 2, capacity_factor=4.0)
    for t in (3, 4, 5, 6, 7):
        layer(torch.randn(t, 8))
    assert list(layer._plans) == [5, 6, 7]
    layer(torch.randn(3, 8))  # planned again
    assert list(layer._plans) == [6, 7, 3]
