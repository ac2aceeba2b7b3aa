"""uniep.integrations.hf: tiny random transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3) with their experts swapped for UniEP's give HF's logits, loss (with the router aux
loss, through output_router_logits) and gradients within 1e-5 in fp32 and the same greedy
generations, at 1 rank and at 2 gloo ranks under DDP (uniep.nn.data_parallel); checkpoints load
and save in HF's layout; a plain DDP around a swapped model raises instead of corrupting it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import uniep  # noqa: E402
from _dist import run_ranks  # noqa: E402
from _hf_models import (  # noqa: E402
    FAMILIES,
    batch,
    compare,
    expert_slice,
    hf_grads,
    make_model,
    step,
)
from uniep.integrations.hf import HFExperts, hf_state_dict, swap_moe_blocks  # noqa: E402


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_single_rank(family: str) -> None:
    model = make_model(family)
    swapped = copy.deepcopy(model)
    names = swap_moe_blocks(swapped)
    assert names and all(isinstance(swapped.get_submodule(n), HFExperts) for n in names)
    ids = batch(3)
    logits_ref, loss_ref = step(model, ids)
    loss_ref.backward()
    logits, loss = step(swapped, ids)
    loss.backward()
    bad = compare({"logits": logits, "loss": loss}, {"logits": logits_ref, "loss": loss_ref}, "out")
    bad += compare(hf_grads(swapped), hf_grads(model), "grad")
    # Same keys, shapes and values as HF's own state dict.
    bad += compare(_state(swapped), _state(model), "state_dict")
    assert not bad, "\n".join(bad)
    prompt = ids[:, :3]
    kw = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    assert torch.equal(swapped.generate(prompt, **kw), model.generate(prompt, **kw))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_checkpoint_round_trip(family: str, tmp_path: Any) -> None:
    import transformers

    model = make_model(family)
    # An HF checkpoint loads into a swapped model (here one whose weights differ).
    other = make_model(family, seed=5)
    swap_moe_blocks(other)
    other.load_state_dict(model.state_dict())
    assert not compare(_state(other), _state(model), "loaded")
    # A swapped model saves a checkpoint plain transformers loads.
    other.save_pretrained(tmp_path / "ckpt", state_dict=hf_state_dict(other))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert not compare(_state(back), _state(model), "reloaded")
    if family == "deepseek_v3":
        return  # 2I == H: a transposed tensor has the right shape
    # A wrong layout (a missing transpose) is refused, naming the key.
    sd = model.state_dict()
    key = next(k for k in sd if k.endswith("experts.gate_up_proj"))
    sd[key] = sd[key].transpose(1, 2)
    with pytest.raises(RuntimeError, match="gate_up_proj must be"):
        other.load_state_dict(sd)


def test_unsupported_modules_are_named() -> None:
    model = make_model("mixtral")
    half = copy.deepcopy(model).to(torch.float16)
    with pytest.raises(ValueError, match="float16"):
        swap_moe_blocks(half)
    experts = model.model.layers[0].mlp.experts
    experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts.*SiLU"):
        swap_moe_blocks(model)
    assert swap_moe_blocks(model, strict=False) == ["model.layers.1.mlp.experts"]
    with pytest.raises(ValueError, match="no HF experts"):
        swap_moe_blocks(torch.nn.Linear(2, 2))


def hf_worker(rank: int, world: int, families: list[str]) -> dict[str, list[str]]:
    """Every family on this rank: the swapped model under uniep.nn.data_parallel against the
    unswapped model run on every rank's batch with the mean of the ranks' losses. Returns the
    failed checks per family (empty lists when all pass)."""
    out: dict[str, list[str]] = {}
    for family in families:
        model = make_model(family)
        ids = [batch(10 + r) for r in range(world)]
        ref = copy.deepcopy(model)
        results = [step(ref, ids[r]) for r in range(world)]
        (sum(loss for _, loss in results) / world).backward()
        want_grads = expert_slice(hf_grads(ref), rank, world)

        swapped = copy.deepcopy(model)
        swap_moe_blocks(swapped)
        ddp = uniep.nn.data_parallel(swapped)
        logits, loss = step(ddp, ids[rank])
        loss.backward()
        bad = compare({"logits": logits}, {"logits": results[rank][0]}, "out")
        bad += compare(hf_grads(swapped), want_grads, "grad")
        # Each rank's state dict holds its experts in HF's layout; gathered, the HF model's.
        bad += compare(_state(swapped), expert_slice(_state(model), rank, world), "state_dict")
        bad += compare(hf_state_dict(swapped), _state(model), "hf_state_dict")
        # A full HF state dict loads: each rank keeps its experts.
        other = make_model(family, seed=5)
        swap_moe_blocks(other)
        other.load_state_dict(model.state_dict())
        bad += compare(_state(other), expert_slice(_state(model), rank, world), "loaded")
        # Greedy generation; every rank runs the same number of steps (min = max new tokens).
        kw = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False}
        with torch.no_grad():
            prompt = ids[rank][:, :3]
            if not torch.equal(swapped.generate(prompt, **kw), ref.generate(prompt, **kw)):
                bad.append("generate differs")
        # Plain DDP broadcasts rank 0's experts over rank 1's: the forward must refuse.
        plain = copy.deepcopy(model)
        swap_moe_blocks(plain)
        try:
            step(torch.nn.parallel.DistributedDataParallel(plain), ids[rank])
            bad.append("plain DDP did not raise")
        except ValueError as e:
            if "uniep.nn.data_parallel" not in str(e):
                bad.append(f"plain DDP raised an unexpected error: {e}")
        out[family] = bad
    return out


_RESULTS: list[dict[str, list[str]]] | Exception | None = None


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_ddp(family: str) -> None:
    global _RESULTS
    if _RESULTS is None:
        try:
            _RESULTS = run_ranks(2, hf_worker, FAMILIES)
        except Exception as e:
            _RESULTS = e
    if isinstance(_RESULTS, Exception):
        pytest.fail(f"multi-rank run failed:\n{_RESULTS}", pytrace=False)
    bad = [f"rank {r}: {line}" for r, res in enumerate(_RESULTS) for line in res[family]]
    assert not bad, "\n".join(bad)
