"""uniep.reference.moe_reference computes only what the routing uses.

A NaN or inf in an expert no token reaches, in the weight of a -1 slot or in a token routed
nowhere must not reach the output or the gradients; one in a used expert must show up exactly in
the tokens that use it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from uniep.reference import moe_reference

T, H, FFN, E, K = 6, 5, 3, 4, 2
UNUSED = 3  # no token routes to this expert
NOWHERE = 5  # this token's slots are all -1


def _inputs(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 1], [2, -1], [1, 0], [2, 1], [-1, 0], [-1, -1]])
    assert not (idx == UNUSED).any() and (idx[NOWHERE] == -1).all()
    return {
        "x": torch.randn(T, H, generator=gen, dtype=dtype),
        "topk_idx": idx,
        "topk_weights": torch.rand(T, K, generator=gen, dtype=dtype),
        "w1_full": torch.randn(E, H, 2 * FFN, generator=gen, dtype=dtype),
        "w2_full": torch.randn(E, FFN, H, generator=gen, dtype=dtype),
    }


def _poison(name: str, where: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
    a = _inputs()
    where(a[name])
    return a


def _set(index: tuple[int | slice, ...], value: float) -> Callable[[torch.Tensor], None]:
    def fill(t: torch.Tensor) -> None:
        t[index] = value

    return fill


# Entries nothing reads: (input, where, value).
UNREAD = [
    pytest.param("w1_full", (UNUSED, 0, 0), float("nan"), id="w1-unused-expert-nan"),
    pytest.param("w1_full", (UNUSED,), float("inf"), id="w1-unused-expert-inf"),
    pytest.param("w2_full", (UNUSED, 1, 2), float("-inf"), id="w2-unused-expert-inf"),
    pytest.param("topk_weights", (1, 1), float("nan"), id="weight-of-a-minus-1-slot-nan"),
    pytest.param("topk_weights", (NOWHERE, slice(None)), float("inf"), id="weights-unrouted-inf"),
    pytest.param("x", (NOWHERE, 2), float("nan"), id="x-of-an-unrouted-token-nan"),
]


@pytest.mark.parametrize(("name", "index", "value"), UNREAD)
def test_unread_non_finite_values_do_not_reach_the_output(
    name: str, index: tuple[int | slice, ...], value: float
) -> None:
    clean = moe_reference(**_inputs())
    got = moe_reference(**_poison(name, _set(index, value)))
    assert torch.isfinite(got).all(), got
    assert torch.equal(got, clean)
    assert (got[NOWHERE] == 0).all()


@pytest.mark.parametrize(("name", "index", "value"), UNREAD)
def test_unread_non_finite_values_do_not_reach_the_gradients(
    name: str, index: tuple[int | slice, ...], value: float
) -> None:
    def grads(a: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        leaves = {k: (v.requires_grad_(True) if v.is_floating_point() else v) for k, v in a.items()}
        y = moe_reference(**leaves)
        g = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
        floats = [v for v in leaves.values() if v.requires_grad]
        return torch.autograd.grad((y * g).sum(), floats)

    clean = grads(_inputs())
    got = grads(_poison(name, _set(index, value)))
    for c, p in zip(clean, got, strict=True):
        assert torch.isfinite(p).all() and torch.equal(p, c)


def test_non_finite_in_a_used_expert_shows_in_its_tokens_only() -> None:
    a = _poison("w2_full", _set((2, 0, 1), float("nan")))
    got = moe_reference(**a)
    users = (a["topk_idx"] == 2).any(dim=1)
    assert users.any() and (~users).any()
    # Column 1 of expert 2's output is NaN in every token that uses it, and nothing else is.
    assert got[users, 1].isnan().all()
    assert torch.isfinite(got[~users]).all()
    clean = moe_reference(**_inputs())
    assert torch.equal(got[~users], clean[~users])


def test_no_routing_at_all_is_zero_and_differentiable() -> None:
    a = _inputs()
    a["topk_idx"] = torch.full((T, K), -1)
    a["w1_full"][0, 0, 0] = float("nan")
    leaves = [a[k].requires_grad_(True) for k in ("x", "topk_weights", "w1_full", "w2_full")]
    y = moe_reference(**a)
    assert torch.equal(y, torch.zeros_like(y))
    for g in torch.autograd.grad(y.sum(), leaves):
        assert torch.equal(g, torch.zeros_like(g))


def test_gradcheck_with_a_nan_in_an_unused_expert() -> None:
    a = _poison("w1_full", _set((UNUSED, 1, 1), float("nan")))
    names = ("x", "topk_weights", "w1_full", "w2_full")

    def f(*floats: torch.Tensor) -> torch.Tensor:
        return moe_reference(floats[0], a["topk_idx"], *floats[1:])

    assert torch.autograd.gradcheck(f, tuple(a[n].requires_grad_(True) for n in names))


def test_computes_in_float64_by_default() -> None:
    a32 = _inputs(torch.float32)
    a64 = {k: (v.double() if v.is_floating_point() else v) for k, v in a32.items()}
    got = moe_reference(**a32)
    assert got.dtype == torch.float32
    assert torch.equal(got, moe_reference(**a64).float())


def test_names_an_odd_w1_width_and_a_w2_that_does_not_match() -> None:
    a = _inputs()
    # 2I = 5: the message named w2_full's expected shape, which was the shape it got.
    odd = {**a, "w1_full": a["w1_full"][:, :, :5], "w2_full": a["w2_full"][:, :2]}
    with pytest.raises(ValueError, match=r"w1_full's last dimension must be 2I .* got 5 in shape"):
        moe_reference(**odd)
    with pytest.raises(ValueError, match=r"w2_full must be \[E=4, I=3, H=5\] .* got \(4, 2, 5\)"):
        moe_reference(**{**a, "w2_full": a["w2_full"][:, :2]})
