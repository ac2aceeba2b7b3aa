"""uniep.integrations.hf: tiny random transformers MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3) with their experts swapped for UniEP's give HF's logits, loss (with the router aux
loss, through output_router_logits) and gradients within 1e-5 in fp32 and the same greedy
generations, at 1 rank and at 2 gloo ranks under DDP (uniep.nn.data_parallel); checkpoints load
and save in HF's layout; a plain DDP around a swapped model raises instead of corrupting it.

With whole MoE blocks swapped for UniEP's MoELayer (swap_moe_layers: Mixtral, Qwen2-MoE,
Qwen3-MoE), the same, and HF's output recording still returns one router-logits tensor per layer
(also when the model recorded outputs before the swap), equal to HF's, so the aux loss and its
gradients (the routers' included) match too."""

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
    LAYER_FAMILIES,
    batch,
    compare,
    expert_slice,
    hf_grads,
    make_model,
    outputs,
    step,
)
from uniep.integrations.hf import (  # noqa: E402
    HFExperts,
    HFMoELayer,
    hf_state_dict,
    swap_moe_blocks,
    swap_moe_layers,
)


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


@pytest.mark.parametrize("family", LAYER_FAMILIES)
def test_swap_layers_single_rank(family: str) -> None:
    model = make_model(family)
    swapped = copy.deepcopy(model)
    names = swap_moe_layers(swapped)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(isinstance(swapped.get_submodule(n), HFMoELayer) for n in names)
    ids = batch(3)
    want = outputs(model, ids)
    want["loss"].backward()
    got = outputs(swapped, ids)
    got["loss"].backward()
    # Logits, loss, aux loss and one router-logits tensor per layer; then every gradient.
    bad = compare(got, want, "out")
    bad += compare(hf_grads(swapped), hf_grads(model), "grad")
    bad += compare(_state(swapped), _state(model), "state_dict")
    assert not bad, "\n".join(bad)
    prompt = ids[:, :3]
    kw = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False}
    assert torch.equal(swapped.generate(prompt, **kw), model.generate(prompt, **kw))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_swap_layers_after_recording(family: str) -> None:
    """HF installs its recording hooks once, at the first forward that records an output, on the
    routers present then: the swapped layers' routers must still be recorded, once each."""
    model = make_model(family)
    swapped = copy.deepcopy(model)
    outputs(swapped, batch(1))
    assert swapped.model._output_capturing_hooks_installed
    swap_moe_layers(swapped)
    ids = batch(3)
    bad = compare(outputs(swapped, ids), outputs(model, ids), "out")
    assert not bad, "\n".join(bad)


def test_unsupported_blocks_are_named() -> None:
    with pytest.raises(ValueError, match=r"layers\.1\.mlp \(DeepseekV3MoE\).*swap_moe_blocks"):
        swap_moe_layers(make_model("deepseek_v3"))
    model = make_model("mixtral")
    with pytest.raises(ValueError, match="float16"):
        swap_moe_layers(copy.deepcopy(model).to(torch.float16))
    model.model.layers[0].mlp.jitter_noise = 0.1
    with pytest.raises(ValueError, match=r"layers\.0\.mlp.*router_jitter_noise"):
        swap_moe_layers(model)
    assert swap_moe_layers(model, strict=False) == ["model.layers.1.mlp"]
    qwen2 = make_model("qwen2_moe")
    qwen2.model.layers[1].mlp.shared_expert.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"layers\.1\.mlp.*shared expert.*SiLU"):
        swap_moe_layers(qwen2)
    swapped_experts = make_model("qwen3_moe")
    swap_moe_blocks(swapped_experts)
    with pytest.raises(ValueError, match="already UniEP's"):
        swap_moe_layers(swapped_experts)
    with pytest.raises(ValueError, match="no HF sparse MoE block"):
        swap_moe_layers(torch.nn.Linear(2, 2))


_SWAPS = {"blocks": swap_moe_blocks, "layers": swap_moe_layers}


@pytest.mark.parametrize(
    "family, swap",
    [
        ("mixtral", "blocks"),
        ("deepseek_v3", "blocks"),
        ("mixtral", "layers"),
        ("qwen2_moe", "layers"),
    ],
)
def test_checkpoint_round_trip(family: str, swap: str, tmp_path: Any) -> None:
    import transformers

    model = make_model(family)
    # An HF checkpoint loads into a swapped model (here one whose weights differ).
    other = make_model(family, seed=5)
    _SWAPS[swap](other)
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


def hf_layer_worker(rank: int, world: int, families: list[str]) -> dict[str, list[str]]:
    """hf_worker's checks for swap_moe_layers, with the router logits and aux loss compared
    too."""
    out: dict[str, list[str]] = {}
    for family in families:
        model = make_model(family)
        ids = [batch(10 + r) for r in range(world)]
        ref = copy.deepcopy(model)
        results = [outputs(ref, ids[r]) for r in range(world)]
        (sum(res["loss"] for res in results) / world).backward()
        want_grads = expert_slice(hf_grads(ref), rank, world)

        swapped = copy.deepcopy(model)
        swap_moe_layers(swapped)
        ddp = uniep.nn.data_parallel(swapped)  # held: its reducer reduces in backward
        got = outputs(ddp, ids[rank])
        got["loss"].backward()
        bad = compare(got, results[rank], "out")
        bad += compare(hf_grads(swapped), want_grads, "grad")
        bad += compare(_state(swapped), expert_slice(_state(model), rank, world), "state_dict")
        bad += compare(hf_state_dict(swapped), _state(model), "hf_state_dict")
        other = make_model(family, seed=5)
        swap_moe_layers(other)
        other.load_state_dict(model.state_dict())
        bad += compare(_state(other), expert_slice(_state(model), rank, world), "loaded")
        out[family] = bad
    return out


def two_rank_worker(rank: int, world: int) -> dict[str, dict[str, list[str]]]:
    # One spawn for both swaps: starting the ranks costs more than all their checks.
    return {
        "blocks": hf_worker(rank, world, FAMILIES),
        "layers": hf_layer_worker(rank, world, LAYER_FAMILIES),
    }


_RESULTS: list[dict[str, dict[str, list[str]]]] | Exception | None = None


def _two_rank_failures(swap: str, family: str) -> list[str]:
    global _RESULTS
    if _RESULTS is None:
        try:
            _RESULTS = run_ranks(2, two_rank_worker)
        except Exception as e:
            _RESULTS = e
    if isinstance(_RESULTS, Exception):
        pytest.fail(f"multi-rank run failed:\n{_RESULTS}", pytrace=False)
    return [f"rank {r}: {line}" for r, res in enumerate(_RESULTS) for line in res[swap][family]]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_ddp(family: str) -> None:
    bad = _two_rank_failures("blocks", family)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("family", LAYER_FAMILIES)
def test_two_ranks_layers_ddp(family: str) -> None:
    bad = _two_rank_failures("layers", family)
    assert not bad, "\n".join(bad)
