"""uniep.integrations.megatron: tiny stand-ins of Megatron-core's MoE blocks (_megatron_blocks:
SequentialMLP, TEGroupedMLP and GroupedMLP experts; softmax, pre-softmax and sigmoid routing with
expert bias, group-limited top-k and scaling; a gated shared expert; the router's aux_loss,
seq_aux_loss and z-loss, alone and together) swapped for UniEP's give the same fp32 outputs,
router loss values and gradients within 1e-5 at 1 rank and at 2 gloo ranks under DDP
(uniep.nn.data_parallel); state dicts keep Megatron's names and layouts, per rank and gathered,
and round-trip through torch.save."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import uniep
from _dist import run_ranks
from _megatron_blocks import (
    CASES,
    LOSS_CASES,
    AuxLossAutoScaler,
    aux_losses,
    compare,
    loss_of,
    make_model,
    megatron_grads,
    rank_share,
    tokens,
)
from uniep.integrations.megatron import (
    MegatronExperts,
    MegatronMoE,
    megatron_route,
    megatron_state_dict,
    swap_moe_blocks,
    unsupported_reason,
)


def _state(model: torch.nn.Module, drop_counts: bool = False) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if not (drop_counts and k.endswith("local_tokens_per_expert"))
    }


@pytest.mark.parametrize("case", list(CASES))
def test_swap_single_rank(case: str) -> None:
    model = make_model(case)
    swapped = copy.deepcopy(model)
    names = swap_moe_blocks(swapped)
    assert names == ["decoder.layers.0.mlp", "decoder.layers.1.mlp"]
    for n in names:
        block = swapped.get_submodule(n)
        assert isinstance(block, MegatronMoE) and isinstance(block.experts, MegatronExperts)
        assert block.experts.layout == CASES[case][0]
    x = tokens(1)
    xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref, out = model(xr), swapped(xs)
    ref_loss, loss = loss_of(ref), loss_of(out)
    ref_loss.backward()
    loss.backward()
    bad = compare({"out": out, "grad_x": xs.grad}, {"out": ref, "grad_x": xr.grad}, "out")
    bad += compare({"loss": loss}, {"loss": ref_loss}, "loss")
    bad += compare(megatron_grads(swapped), megatron_grads(model), "grad")
    # The router losses' values; their gradients are in the router's and x's.
    assert bool(aux_losses(model)) == (case in LOSS_CASES)
    bad += compare(aux_losses(swapped), aux_losses(model), "aux_losses")
    # Same keys, layouts and values as Megatron's state dict (the routing counts included).
    bad += compare(_state(swapped), _state(model), "state_dict")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_round_trip(case: str) -> None:
    model = make_model(case)
    # A Megatron checkpoint loads into a swapped model whose weights differ ...
    other = make_model(case, seed=7)
    swap_moe_blocks(other)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert not compare(_state(other), _state(model), "loaded")
    x = tokens(2)
    assert not compare({"y": other(x)}, {"y": model(x)}, "after load")
    # ... and the swapped model's checkpoint loads into the Megatron model.
    back = make_model(case, seed=9)
    buf = io.BytesIO()
    torch.save(megatron_state_dict(other), buf)
    buf.seek(0)
    back.load_state_dict(torch.load(buf, weights_only=True))
    assert not compare(_state(back), _state(model), "reloaded")


def test_wrong_layout_is_named() -> None:
    model = make_model("softmax-sequential")
    sd = model.state_dict()
    key = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"
    sd[key] = sd[key].t().contiguous()
    swapped = make_model("softmax-sequential")
    swap_moe_blocks(swapped)
    with pytest.raises(RuntimeError, match=r"expert 1: .*linear_fc2 \[H=16, I=8\], got"):
        swapped.load_state_dict(sd)


def _with_config(case: str, **fields: object) -> torch.nn.Module:
    """The case's model with ``fields`` set on its first block's config."""
    model = make_model(case)
    block = model.decoder.layers[0].mlp
    block.config = copy.copy(block.config)
    for field, value in fields.items():
        setattr(block.config, field, value)
    return model


def test_unsupported_blocks_are_named() -> None:
    # Router losses are supported; only other load balancing is refused.
    for fields in (
        dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
        dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01),
        dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.0),
        dict(moe_z_loss_coeff=1e-3),
    ):
        assert (
            unsupported_reason(_with_config("softmax-sequential", **fields).decoder.layers[0].mlp)
            is None
        ), fields

    model = _with_config("softmax-sequential", moe_router_load_balancing_type="sinkhorn")
    assert "moe_router_load_balancing_type='sinkhorn'" in (
        unsupported_reason(model.decoder.layers[0].mlp) or ""
    )
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp.*sinkhorn"):
        swap_moe_blocks(model)
    assert swap_moe_blocks(model, strict=False) == ["decoder.layers.1.mlp"]

    for fields, words in (
        (dict(activation_func=torch.nn.functional.gelu), "not SiLU"),
        (dict(gated_linear_unit=False), "not gated"),
        (dict(moe_expert_capacity_factor=1.0), "token dropping"),
        (dict(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
        (dict(moe_router_load_balancing_type="quantile_balancing"), "quantile_balancing"),
        (
            dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01),
            "global_aux_loss' with moe_aux_loss_coeff=0.01",
        ),
        (
            dict(
                moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=0.01
            ),
            "needs a list of as many moe_aux_loss_coeff",
        ),
        (
            dict(moe_router_load_balancing_type="switch", moe_aux_loss_coeff=0.01),
            "unknown load-balancing type 'switch'",
        ),
    ):
        m = _with_config("softmax-sequential", **fields)
        assert words in (unsupported_reason(m.decoder.layers[0].mlp) or ""), fields
    half = make_model("softmax-sequential").half()
    assert "float16" in (unsupported_reason(half.decoder.layers[0].mlp) or "")
    with pytest.raises(ValueError, match="no Megatron-style MoE block"):
        swap_moe_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="from_megatron"):
        swap_moe_blocks(make_model("softmax-sequential").decoder.layers[0].mlp)


def test_aux_loss_scale_for_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two accumulated micro-batches with the main loss halved: the router losses' backward
    scale set to 1/2 (as Megatron's schedule sets MoEAuxLossAutoScaler's) on both models."""
    model = make_model("all-sigmoid")
    swapped = copy.deepcopy(model)
    swap_moe_blocks(swapped)
    monkeypatch.setattr(AuxLossAutoScaler, "scale", 0.5)
    monkeypatch.setattr(MegatronMoE, "aux_loss_scale", torch.tensor(0.5))
    for seed in (30, 31):
        (loss_of(model(tokens(seed))) / 2).backward()
        (loss_of(swapped(tokens(seed))) / 2).backward()
    bad = compare(megatron_grads(swapped), megatron_grads(model), "grad")
    assert not bad, "\n".join(bad)


def test_router_losses_only_when_training() -> None:
    model = make_model("all-softmax-per_token")
    swapped = copy.deepcopy(model)
    swap_moe_blocks(swapped)
    block, ref_block = swapped.decoder.layers[0].mlp, model.decoder.layers[0].mlp
    x = tokens(4)
    # [T, H] tokens are one sequence for seq_aux_loss.
    flat = x.reshape(-1, x.shape[-1])
    block(flat)
    ref_block(flat)
    assert set(block.aux_losses) == {"load_balancing_loss", "seq_load_balancing_loss", "z_loss"}
    bad = compare(block.aux_losses, ref_block.router.aux_losses, "[T, H]")
    with torch.no_grad():
        block(x)
    assert block.aux_losses == {}
    swapped.eval()
    model.eval()
    bad += compare({"y": swapped(x)}, {"y": model(x)}, "eval")
    assert aux_losses(swapped) == {} == aux_losses(model)
    assert not bad, "\n".join(bad)


def test_megatron_route_matches_dense_router() -> None:
    """The routing function against the stand-in router's dense formulation."""
    from _megatron_blocks import TopKRouter

    for _, config in CASES.values():
        torch.manual_seed(3)
        router = TopKRouter(config).eval()
        x = torch.randn(40, config.hidden_size)
        probs, routing_map = router(x)
        idx, w = megatron_route(
            torch.nn.functional.linear(x, router.weight),
            config.moe_router_topk,
            score_function=config.moe_router_score_function,
            pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            expert_bias=router.expert_bias,
        )
        dense = torch.zeros_like(probs).scatter(1, idx, w)
        assert torch.equal(dense != 0, routing_map)
        torch.testing.assert_close(dense, probs, rtol=1e-6, atol=1e-7)


def megatron_worker(rank: int, world: int, cases: list[str]) -> dict[str, list[str]]:
    """Per case: the swapped model under uniep.nn.data_parallel against the Megatron model run
    on every rank's batch with the mean of the ranks' losses; state dicts per rank (Megatron's
    expert_model_parallel_size=world layout) and gathered."""
    out: dict[str, list[str]] = {}
    for case in cases:
        model = make_model(case)
        xs = [tokens(20 + r) for r in range(world)]
        ref = copy.deepcopy(model)
        refs = []
        for r, x in enumerate(xs):
            refs.append(ref(x))
            if r == rank:
                want_losses = aux_losses(ref)
        # One process standing for `world` data-parallel ranks: the mean of their losses,
        # each rank's router losses scaled alike (DDP averages the ranks' gradients).
        AuxLossAutoScaler.scale = 1 / world
        (sum(loss_of(y) for y in refs) / world).backward()
        AuxLossAutoScaler.scale = 1.0
        want_grads = rank_share(megatron_grads(ref), rank, world)

        swapped = copy.deepcopy(model)
        swap_moe_blocks(swapped)
        ddp = uniep.nn.data_parallel(swapped)
        y = ddp(xs[rank])
        loss_of(y).backward()
        bad = compare({"out": y}, {"out": refs[rank]}, "out")
        bad += compare(aux_losses(swapped), want_losses, "aux_losses")
        bad += compare(megatron_grads(swapped), want_grads, "grad")
        bad += compare(
            _state(swapped, True), rank_share(_state(model, True), rank, world), "state_dict"
        )
        full = {k: v for k, v in megatron_state_dict(swapped).items() if "local_tokens" not in k}
        bad += compare(full, _state(model, True), "megatron_state_dict")
        # Both checkpoint forms load: all E experts (each rank keeps its own) or this rank's.
        for what, sd in (
            ("full", model.state_dict()),
            ("per rank", rank_share(model.state_dict(), rank, world)),
        ):
            other = make_model(case, seed=5)
            swap_moe_blocks(other)
            other.load_state_dict(sd)
            bad += compare(
                _state(other, True),
                rank_share(_state(model, True), rank, world),
                f"loaded {what}",
            )
        out[case] = bad
    return out


_RESULTS: list[dict[str, list[str]]] | Exception | None = None


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_ddp(case: str) -> None:
    global _RESULTS
    if _RESULTS is None:
        try:
            _RESULTS = run_ranks(2, megatron_worker, list(CASES))
        except Exception as e:
            _RESULTS = e
    if isinstance(_RESULTS, Exception):
        pytest.fail(f"multi-rank run failed:\n{_RESULTS}", pytrace=False)
    bad = [f"rank {r}: {line}" for r, res in enumerate(_RESULTS) for line in res[case]]
    assert not bad, "\n".join(bad)
