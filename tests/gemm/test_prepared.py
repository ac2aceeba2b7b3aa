"""uniep.moe.prepared on CPU: prepared expert weights turn back into the plain ones, and
moe_forward_prepared equals moe_forward on them (the reference the GPU path is tested against)."""

from __future__ import annotations

import pytest
import torch
import uniep
from uniep.moe.prepared import fused_launch, moe_forward_prepared, prepare_experts

T, H, FFN, E, K = 24, 256, 128, 4, 2


def _layer(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w1 = torch.randn(E, H, 2 * FFN, generator=gen) * H**-0.5
    w2 = torch.randn(E, FFN, H, generator=gen) * FFN**-0.5
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    weights = torch.softmax(torch.randn(T, K, generator=gen), dim=1)
    return x, idx, weights, w1, w2


def test_bf16_packed_is_moe_forward_on_the_bf16_weights() -> None:
    x, idx, weights, w1, w2 = _layer(1)
    experts = prepare_experts(w1, w2, "bf16_packed")
    assert experts.format == "bf16_packed" and experts.w1.dtype == torch.bfloat16
    assert (experts.num_experts, experts.hidden, experts.ffn) == (E, H, FFN)
    p1, p2 = experts.plain(torch.float32)
    assert torch.equal(p1, w1.bfloat16().float()) and torch.equal(p2, w2.bfloat16().float())
    got = moe_forward_prepared(x, idx, weights, experts)
    want = uniep.moe_forward(x, idx, weights, w1.bfloat16().float(), w2.bfloat16().float())
    assert torch.equal(got, want)


def test_fp8_is_moe_forward_on_the_dequantized_weights() -> None:
    x, idx, weights, w1, w2 = _layer(2)
    experts = prepare_experts(w1, w2, "fp8")
    assert experts.w1.dtype == torch.float8_e4m3fn and experts.w1.shape == (E, 2 * FFN, H)
    # w1's rows packed for the SwiGLU epilogue: a scale per 64 rows.
    assert experts.w2.shape == (E, H, FFN) and experts.w1_scales.shape == (
        E,
        H // 128,
        2 * FFN // 64,
    )
    q1, s1 = uniep.gemm.quantize_expert_weights(w1)
    packed = uniep.gemm.pack_gate_up_fp8(q1, s1)
    assert torch.equal(experts.w1.view(torch.uint8), packed[0].view(torch.uint8))
    assert torch.equal(experts.w1_scales, packed[1])
    assert (experts.hidden, experts.ffn) == (H, FFN)
    got = moe_forward_prepared(x, idx, weights, experts, tuning="dispatch=fp8")
    d1, d2 = experts.plain(torch.float32)
    want = uniep.moe_forward(x, idx, weights, d1, d2, tuning="dispatch=fp8")
    assert torch.equal(got, want)
    # e4m3 keeps 3 mantissa bits: about 2.4% RMS per value, ~3.4% per GEMM of random operands
    # (both quantized), compounding over the layer's two GEMMs (5.6% measured on this seed).
    exact = uniep.moe_forward(x, idx, weights, w1, w2)
    assert float((got - exact).norm() / exact.norm()) <= 8e-2


def test_named_errors() -> None:
    x, idx, weights, w1, w2 = _layer(3)
    with pytest.raises(ValueError, match="format must be one of"):
        prepare_experts(w1, w2, "int4")
    with pytest.raises(ValueError, match=r"w2 must be \[E, I, H\]"):
        prepare_experts(w1, w2[:, :64], "bf16_packed")
    with pytest.raises(ValueError, match="multiples of 128"):
        prepare_experts(w1[:, :, :192], w2[:, :96], "fp8")
    experts = prepare_experts(w1, w2, "fp8")
    with pytest.raises(ValueError, match="add dispatch=fp8 to tuning"):
        moe_forward_prepared(x, idx, weights, experts)
    with pytest.raises(TypeError, match="experts must be a PreparedExperts"):
        moe_forward_prepared(x, idx, weights, (w1, w2))  # type: ignore[arg-type]


def test_fused_launch_keys() -> None:
    assert fused_launch("overlap=fused") == (None, -1, None, None)
    assert fused_launch("overlap=fused,sms=16/0,skip_rounds=2,tile_m=64") == (16, 2, 64, None)
    assert fused_launch("tile_m=128,tile_n=256,tile_k=64,stages=auto") == (None, -1, 128, 256)
    # The decode tile: 128 wide takes 64-row tiles, asked for or left to the choice.
    assert fused_launch("overlap=fused,tile_n=128") == (None, -1, 64, 128)
    assert fused_launch("overlap=fused,tile_m=64,tile_n=128") == (None, -1, 64, 128)
    for bad, key in (
        ("tile_m=32", "tile_m must be one of auto, 128, 64, got 32"),
        ("tile_n=64", "tile_n must be one of auto, 256, 128, got 64"),
        ("tile_m=128,tile_n=128", "tile_n=128 runs 64-row tiles"),
        ("tile_k=128", "tile_k must be one of auto, 64, got 128"),
        ("stages=4", "stages must be one of auto, got 4"),
        ("cluster=1", "cluster must be one of auto, got 1"),  # the MegaKernel's tiles fix theirs
    ):
        with pytest.raises(ValueError, match=key):
            fused_launch("overlap=fused," + bad)
