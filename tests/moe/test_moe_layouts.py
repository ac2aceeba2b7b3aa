"""moe_forward reads strided w1 / w2 in place and bfloat16 routing weights (CPU executor): the
results are bit-identical to the contiguous / float32 call, forward and backward, at 1 and 2
gloo ranks; float16 is refused with the reason; opcheck passes for the new layouts."""

from __future__ import annotations

import pytest
import torch
import uniep
from _dist import run_ranks

T, H, FFN, E, K = 7, 16, 8, 4, 2


def _routing(seed: int, tokens: int = T, experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :K].contiguous()
    idx[0, 1] = -1
    return idx, torch.rand(tokens, K, generator=gen)


def _layouts(w1: torch.Tensor, w2: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values as w1 [E, H, 2I] / w2 [E, I, H] in another memory layout."""
    if layout == "transposed":  # HF's gate_up_proj [E, 2I, H] / down_proj [E, H, I], viewed
        return w1.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(
            1, 2
        ).contiguous().transpose(1, 2)
    if layout == "every_other":  # a slice of a wider buffer
        wide1 = torch.zeros(*w1.shape[:-1], 2 * w1.shape[-1], dtype=w1.dtype)
        wide2 = torch.zeros(*w2.shape[:-1], 2 * w2.shape[-1], dtype=w2.dtype)
        wide1[..., ::2] = w1
        wide2[..., ::2] = w2
        return wide1[..., ::2], wide2[..., ::2]
    if layout == "experts_permuted":  # expert dim not outermost in memory
        return w1.permute(1, 0, 2).contiguous().permute(1, 0, 2), w2.permute(
            2, 0, 1
        ).contiguous().permute(1, 2, 0)
    raise ValueError(layout)


def _run(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: str = "",
) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().requires_grad_(True) for t in (x, weights, w1, w2)]
    y = torch.ops.uniep.moe_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], group, "")
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
    return (y.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["transposed", "every_other", "experts_permuted"])
def test_strided_weights_same_bits(dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w1 = torch.randn(E, H, 2 * FFN, generator=gen).to(dtype)
    w2 = torch.randn(E, FFN, H, generator=gen).to(dtype)
    idx, weights = _routing(2)
    weights = weights.to(torch.float64 if dtype == torch.float64 else torch.float32)
    s1, s2 = _layouts(w1, w2, layout)
    assert not s1.is_contiguous() and not s2.is_contiguous()
    want = _run(x, idx, weights, w1, w2)
    got = _run(x, idx, weights, s1, s2)
    for name, a, b in zip(
        ("y", "grad_x", "grad_weights", "grad_w1", "grad_w2"), got, want, strict=True
    ):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bf16_routing_weights(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen).to(dtype)
    w1 = torch.randn(E, H, 2 * FFN, generator=gen).to(dtype)
    w2 = torch.randn(E, FFN, H, generator=gen).to(dtype)
    idx, weights = _routing(4)
    bf = weights.bfloat16()
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    want = _run(x, idx, bf.to(wide), w1, w2)
    got = _run(x, idx, bf, w1, w2)
    assert got[2].dtype == torch.bfloat16  # the gradient has its input's dtype
    for name, a, b in zip(
        ("y", "grad_x", "grad_weights", "grad_w1", "grad_w2"), got, want, strict=True
    ):
        if name == "grad_weights":
            b = b.float().bfloat16()  # fp32 (fp64) accumulated, rounded once to bf16
        assert torch.equal(a, b), name


def test_uniep_moe_forward_bf16_weights_and_transposed_experts() -> None:
    """The wrapper passes bf16 weights and transposed views straight to the op (no copy)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen)
    gate_up = torch.randn(E, 2 * FFN, H, generator=gen)  # HF layout, viewed as UniEP's
    down = torch.randn(E, H, FFN, generator=gen)
    idx, weights = _routing(6)
    got = uniep.moe_forward(x, idx, weights.bfloat16(), gate_up.transpose(1, 2), down.mT)
    want = uniep.moe_forward(
        x, idx, weights.bfloat16().float(), gate_up.transpose(1, 2).contiguous(), down.mT.clone()
    )
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("x", "x must be float32, bfloat16 or float64, got float16: the expert kernels"),
        ("topk_weights", "topk_weights must be float32 or bfloat16, got float16"),
    ],
)
def test_float16_refused_with_reason(change: str, words: str) -> None:
    gen = torch.Generator().manual_seed(7)
    idx, weights = _routing(8)
    args = {
        "x": torch.randn(T, H, generator=gen),
        "topk_weights": weights,
        "w1": torch.randn(E, H, 2 * FFN, generator=gen),
        "w2": torch.randn(E, FFN, H, generator=gen),
    }
    args[change] = args[change].half()
    for device in ("cpu", "meta"):  # the real kernel and the fake one
        a = {k: v.to(device) for k, v in args.items()}
        with pytest.raises(ValueError, match=words):
            torch.ops.uniep.moe_forward(
                a["x"], idx.to(device), a["topk_weights"], a["w1"], a["w2"], "", ""
            )


@pytest.mark.parametrize("case", ["transposed", "bf16_weights"])
def test_opcheck(case: str) -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, 2 * FFN, generator=gen)
    w2 = torch.randn(E, FFN, H, generator=gen)
    idx, weights = _routing(10)
    if case == "transposed":
        w1, w2 = _layouts(w1, w2, "transposed")
    else:
        weights = weights.bfloat16()
    args = [t.requires_grad_(True) for t in (x, weights, w1, w2)]
    torch.library.opcheck(
        torch.ops.uniep.moe_forward.default, (args[0], idx, args[1], args[2], args[3], "", "")
    )


def _two_rank_worker(rank: int, world: int) -> list[str]:
    """Every rank: transposed expert views and bf16 routing weights against the contiguous,
    fp32 call over the same gloo group."""
    gen = torch.Generator().manual_seed(11 + rank)
    experts = E * world
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, 2 * FFN, generator=gen)
    w2 = torch.randn(E, FFN, H, generator=gen)
    idx, weights = _routing(12 + rank, experts=experts)
    bf = weights.bfloat16()
    name = uniep.distributed.group_name(None)
    want = _run(x, idx, bf.float(), w1, w2, name)
    s1, s2 = _layouts(w1, w2, "transposed")
    got = _run(x, idx, bf, s1, s2, name)
    bad = []
    for label, a, b in zip(
        ("y", "grad_x", "grad_weights", "grad_w1", "grad_w2"), got, want, strict=True
    ):
        b = b.bfloat16() if label == "grad_weights" else b
        if not torch.equal(a, b):
            bad.append(f"rank {rank}: {label} differs")
    return bad


def test_two_ranks() -> None:
    results = run_ranks(2, _two_rank_worker)
    assert not [b for r in results for b in r]
