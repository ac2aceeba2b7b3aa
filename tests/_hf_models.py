"""Tiny random transformers MoE models (hidden 32, 2 layers, 4-8 experts) for the HF swap tests,
and the checks the tests share. Importing this needs transformers."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from _moe_cases import rel_err
from torch import nn

VOCAB = 96
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
# The families whose whole MoE blocks swap_moe_layers replaces.
LAYER_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
TOL = 1e-5

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "eos_token_id": None,
    "pad_token_id": 0,
    "bos_token_id": 1,
}


def make_config(family: str) -> transformers.PretrainedConfig:
    """Expert widths: 2I != H for Mixtral and Qwen2-MoE (a transposed tensor has the wrong
    shape), 2I == H for Qwen3-MoE and DeepSeek-V3 (only the values tell). Each family with its
    routing: Mixtral (softmax, renormalised), Qwen2-MoE (softmax, not
    renormalised, gated shared expert), Qwen3-MoE (renormalised, head_dim), DeepSeek-V3
    (sigmoid, grouped top-k, score bias, scaling, shared expert, first layer dense)."""
    c = dict(_COMMON)
    if family == "mixtral":
        return transformers.MixtralConfig(
            **c, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **c,
            intermediate_size=48,
            moe_intermediate_size=12,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **c,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            head_dim=8,
        )
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **c,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        )
    raise ValueError(family)


def make_model(family: str, seed: int = 0) -> nn.Module:
    """The same fp32 model on every process for one seed, with routers spread enough (and
    DeepSeek-V3's score bias nonzero) that the routing is not near-uniform."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make_config(family)).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.2 - 0.1)
    return model


def batch(seed: int, rows: int = 2, length: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (rows, length), generator=gen)


def step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward with labels and router logits (so the aux loss reaches the routers): (logits,
    loss)."""
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.router_logits is not None and len(out.router_logits) > 0
    return out.logits, out.loss


def outputs(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward with labels and router logits: logits, loss (with the aux loss), aux_loss and
    router_logits.<layer> ([T, E] each)."""
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    got = {"logits": out.logits, "loss": out.loss, "aux_loss": out.aux_loss}
    got.update({f"router_logits.{i}": t for i, t in enumerate(out.router_logits)})
    return got


def hf_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients under HF's names and layout: an HFExperts' w1/w2 grads become
    gate_up_proj/down_proj (this rank's experts), an HFMoELayer's are mapped by its to_hf."""
    from uniep.integrations.hf import HFExperts, HFMoELayer

    grads = {}
    layers: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(layer) for layer in layers):
            continue  # counted with its HFMoELayer
        if isinstance(module, HFMoELayer):
            layers.append(f"{name}.")
            own = {k: p.grad for k, p in module.named_parameters() if p.grad is not None}
            grads.update({f"{name}.{k}": g for k, g in module.to_hf(own).items()})
            continue
        for pname, p in module.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            if p.grad is None:
                continue
            if isinstance(module, HFExperts):
                key = f"{name}.{'gate_up_proj' if pname == 'w1' else 'down_proj'}"
                grads[key] = module._local_to_hf(p.grad)
            else:
                grads[key] = p.grad.clone()
    return grads


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    """Names whose relative error exceeds TOL, with the error (empty when all match)."""
    bad = (
        [f"{what}: keys differ: {sorted(set(got) ^ set(want))}"]
        if got.keys() != want.keys()
        else []
    )
    for k in sorted(got.keys() & want.keys()):
        if got[k].shape != want[k].shape:
            bad.append(f"{what} {k}: shape {tuple(got[k].shape)} != {tuple(want[k].shape)}")
        elif (err := rel_err(got[k], want[k])) > TOL:
            bad.append(f"{what} {k}: rel err {err:.2e}")
    return bad


def expert_slice(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """``state`` with every experts tensor cut to ``rank``'s share of ``world``."""
    out = {}
    for k, v in state.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            local = v.shape[0] // world
            v = v[rank * local : (rank + 1) * local]
        out[k] = v
    return out
