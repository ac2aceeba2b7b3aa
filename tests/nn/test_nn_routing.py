"""uniep.nn.Experts with routing from outside (int32 ids, bf16 gate weights) against the dense
reference, and MoELayer's routing options against transformers' own MoE blocks (Qwen2-MoE:
softmax without renormalisation and a gated shared expert; DeepSeek-V3: sigmoid, grouped top-k,
score bias, scaling, shared expert) with the weights copied over."""

from __future__ import annotations

import pytest
import torch
from _moe_cases import rel_err
from uniep.nn import Experts, MoELayer
from uniep.reference import moe_reference

H, FFN, E = 32, 12, 8


def test_experts_any_router_dtypes() -> None:
    torch.manual_seed(0)
    experts = Experts(H, FFN, E)
    x = torch.randn(2, 5, H, requires_grad=True)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, E, (2, 5, 2), generator=gen).to(torch.int32)
    idx[0, 0, 1] = -1
    gates = torch.rand(2, 5, 2, generator=gen).to(torch.bfloat16).requires_grad_(True)
    y = experts(x, idx, gates)
    y.square().sum().backward()
    xr = x.detach().double().requires_grad_(True)
    gr = gates.detach().double().requires_grad_(True)
    ref = moe_reference(
        xr.reshape(-1, H), idx.reshape(-1, 2).long(), gr.reshape(-1, 2), experts.w1, experts.w2
    )
    ref.square().sum().backward()
    assert rel_err(y.reshape(-1, H), ref) <= 1e-5
    assert rel_err(x.grad, xr.grad) <= 1e-5
    assert gates.grad.dtype == torch.bfloat16 and rel_err(gates.grad, gr.grad) <= 1e-2
    with pytest.raises(ValueError, match="float16 is not supported.*bfloat16"):
        Experts(H, FFN, E, dtype=torch.float16)
    with pytest.raises(ValueError, match="topk_weights must have"):
        experts(x, idx, gates[..., :1])


def test_moe_layer_default_routing_unchanged() -> None:
    torch.manual_seed(3)
    layer = MoELayer(H, FFN, E, 2)
    x = torch.randn(6, H)
    y, logits = layer(x, return_router_logits=True)
    assert logits.shape == (6, E) and torch.equal(y, layer(x))
    probs = torch.softmax(logits.double(), -1)
    w, i = probs.topk(2, dim=-1)
    ref = moe_reference(x, i, w / w.sum(-1, keepdim=True), layer.w1, layer.w2)
    assert rel_err(y, ref) <= 1e-5


def _copy_block(layer: MoELayer, block: torch.nn.Module, shared_name: str) -> None:
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.w1.copy_(block.experts.gate_up_proj.transpose(1, 2))
        layer.w2.copy_(block.experts.down_proj.transpose(1, 2))
        shared = getattr(block, shared_name)
        layer.shared_w1.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).t())
        layer.shared_w2.copy_(shared.down_proj.weight.t())
        if layer.shared_gate is not None:
            layer.shared_gate.weight.copy_(block.shared_expert_gate.weight)
        if layer.score_bias is not None:
            layer.score_bias.copy_(block.gate.e_score_correction_bias)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_moe_layer_routing_matches_hf(family: str) -> None:
    pytest.importorskip("transformers")
    from _hf_models import make_model

    model = make_model(family)
    block = model.model.layers[1].mlp
    cfg = model.config
    if family == "qwen2_moe":
        layer = MoELayer(
            H,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            renormalize=cfg.norm_topk_prob,
            shared_ffn_hidden=cfg.shared_expert_intermediate_size,
            shared_gate=True,
        )
        shared_name = "shared_expert"
    else:
        layer = MoELayer(
            H,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            score="sigmoid",
            renormalize=cfg.norm_topk_prob,
            scaling=cfg.routed_scaling_factor,
            num_groups=cfg.n_group,
            topk_groups=cfg.topk_group,
            score_bias=True,
            shared_ffn_hidden=cfg.moe_intermediate_size * cfg.n_shared_experts,
        )
        shared_name = "shared_experts"
    _copy_block(layer, block, shared_name)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(4))
    y, logits = layer(x, return_router_logits=True)
    assert rel_err(y, block(x)) <= 1e-5
    assert rel_err(logits, block.gate(x)[0]) <= 1e-6
