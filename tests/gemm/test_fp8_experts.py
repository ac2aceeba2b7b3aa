"""dispatch=fp8 runs the experts in fp8 (tuning experts=auto) on the CPU executor: the semantics
the CUDA path is tested against (tests/gemm/test_gpu_prepared.py).

With fp8 experts the tokens arrive as e4m3 with one scale per 1 x 128 block, w1 and w2 are
rounded to e4m3 in 128 x 128 blocks, and the SwiGLU activation (rounded to the dtype) is rounded
like a token row before the second product. The reference below does each rounding in turn with
uniep.gemm's quantizers and the products in float64.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import uniep
from _dist import run_ranks
from _moe_cases import MoeCase, make_inputs, rank_inputs, rel_err, same_bits
from uniep.gemm import (
    dequantize_expert_weights,
    dequantize_rows,
    quantize_expert_weights,
    quantize_rows,
)

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def _args(g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return g["x"], g["topk_idx"], g["topk_weights"], g["w1"], g["w2"]


def _fp8_rows(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(*quantize_rows(x.float())).double()


def _fp8_weights(w: torch.Tensor) -> torch.Tensor:
    return dequantize_expert_weights(*quantize_expert_weights(w.float())).double()


def fp8_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """The layer with fp8 experts at world 1, rounding to x's dtype where the executors write."""
    dtype, ffn = x.dtype, w2.shape[1]
    xq, w1q, w2q = _fp8_rows(x), _fp8_weights(w1), _fp8_weights(w2)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            h = (xq[t] @ w1q[e]).to(dtype).double()
            act = (h[:ffn] * torch.sigmoid(h[:ffn]) * h[ffn:]).to(dtype)
            y = (_fp8_rows(act.unsqueeze(0))[0] @ w2q[e]).to(dtype).double()
            out[t] += float(topk_weights[t, k]) * y
    return out.to(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_experts_match_the_rounded_reference(dtype: str) -> None:
    case = MoeCase("fp8-experts", (37,), 256, 128, 6, 3, dtype, seed=70)
    g = make_inputs(case)
    y = torch.ops.uniep.moe_forward(*_args(g), "", "dispatch=fp8")
    ref = fp8_reference(*_args(g))
    assert rel_err(y, ref) <= TOLERANCE[dtype]
    # Against the layer without fp8: fp8's own accuracy (3 mantissa bits, four roundings).
    assert rel_err(y, uniep.reference.moe_reference(*_args(g))) <= 0.1


def test_experts_key_is_numerics_and_the_schedule_is_not() -> None:
    case = MoeCase("fp8-keys", (29,), 128, 256, 4, 2, "bfloat16", seed=71)
    g = make_inputs(case)
    y = torch.ops.uniep.moe_forward(*_args(g), "", "dispatch=fp8")
    for tuning in (
        "dispatch=fp8,experts=fp8",
        "dispatch=fp8,experts=auto,tile_m=16,tile_n=32,tile_k=128,token_tile=1",
        "dispatch=fp8,overlap=sequential,combine=per_k,sms=4/8",
    ):
        assert same_bits(torch.ops.uniep.moe_forward(*_args(g), "", tuning), y), tuning
    # experts=bf16: the fp8 rows into bf16 experts, what dispatch=fp8 alone did before.
    wire_only = torch.ops.uniep.moe_forward(*_args(g), "", "dispatch=fp8,experts=bf16")
    assert not same_bits(wire_only, y)
    x_rows = _fp8_rows(g["x"]).to(g["x"].dtype)
    ref = uniep.reference.moe_reference(x_rows, *_args(g)[1:])
    assert rel_err(wire_only, ref) <= TOLERANCE["bfloat16"]


def test_gradients_are_the_bf16_layers_at_the_received_rows() -> None:
    """The backward passes the weights' and activation's rounding straight through: the
    gradients of fp8 experts are those of experts=bf16 (the same fp8 rows, bf16 weights)."""
    case = MoeCase("fp8-grad", (21,), 128, 128, 4, 2, "float32", seed=72)
    g = make_inputs(case)
    go = g["grad_out"]
    fp8 = torch.ops.uniep.moe_backward(go, *_args(g), "", "dispatch=fp8")
    bf16 = torch.ops.uniep.moe_backward(go, *_args(g), "", "dispatch=fp8,experts=bf16")
    assert all(same_bits(a, b) for a, b in zip(fp8, bf16, strict=True))
    x, w, w1, w2 = (g[n].clone().requires_grad_(True) for n in ("x", "topk_weights", "w1", "w2"))
    uniep.moe_forward(x, g["topk_idx"], w, w1, w2, tuning="dispatch=fp8").backward(go)
    for leaf, want, name in zip(
        (x, w, w1, w2), fp8, ("x", "topk_weights", "w1", "w2"), strict=True
    ):
        assert leaf.grad is not None and same_bits(leaf.grad, want), name


def test_named_errors() -> None:
    bad_hidden = make_inputs(MoeCase("fp8-h200", (8,), 200, 128, 4, 2, "bfloat16", seed=73))
    with pytest.raises(ValueError, match=r"multiples of 128.*hidden=200, ffn=128.*experts=bf16"):
        torch.ops.uniep.moe_forward(*_args(bad_hidden), "", "dispatch=fp8")
    bad_ffn = make_inputs(MoeCase("fp8-i24", (8,), 128, 24, 4, 2, "float32", seed=74))
    with pytest.raises(ValueError, match=r"multiples of 128.*ffn=24"):
        torch.ops.uniep.moe_forward(*_args(bad_ffn), "", "dispatch=fp8,experts=fp8")
    # experts=bf16 takes any shape, as the fp8 dispatch does.
    y = torch.ops.uniep.moe_forward(*_args(bad_ffn), "", "dispatch=fp8,experts=bf16")
    assert torch.isfinite(y).all()
    with pytest.raises(ValueError, match="experts=fp8 needs dispatch=fp8"):
        uniep.TuningParams.parse("experts=fp8")
    with pytest.raises(ValueError, match="experts must be auto, bf16 or fp8, got 'int4'"):
        uniep.TuningParams.parse("dispatch=fp8,experts=int4")


CASES = {
    2: [
        MoeCase("w2-fp8-k3-bf16", (13, 9), 128, 128, 4, 3, "bfloat16", seed=75),
        MoeCase("w2-fp8-zero-f32", (0, 11), 256, 128, 4, 2, "float32", seed=76),
    ],
    4: [MoeCase("w4-fp8-k2-bf16", (5, 7, 0, 6), 128, 128, 8, 2, "bfloat16", seed=77)],
}


def world_worker(rank: int, world: int, cases: list[MoeCase]) -> dict[str, Any]:
    import uniep  # noqa: F401
    from uniep.distributed import group_name

    out: dict[str, Any] = {}
    for case in cases:
        try:
            inp = rank_inputs(case, rank)
            out[case.name] = torch.ops.uniep.moe_forward(*_args(inp), group_name(), "dispatch=fp8")
        except Exception:
            out[case.name] = traceback.format_exc()
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_every_world_size_gives_the_same_bits(world: int) -> None:
    """Each rank's experts round their own weights the same way a single rank rounds all of
    them (128 x 128 blocks never straddle two experts), and each token row is rounded by its
    own blocks: the bits do not depend on the world size."""
    results = run_ranks(world, world_worker, CASES[world])
    for case in CASES[world]:
        parts = [r[case.name] for r in results]
        for p in parts:
            assert isinstance(p, torch.Tensor), p
        g = make_inputs(case)
        alone = torch.ops.uniep.moe_forward(*_args(g), "", "dispatch=fp8")
        assert same_bits(torch.cat(parts), alone), case.name
