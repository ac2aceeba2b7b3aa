"""uniep.nn.MoELayer on one rank and on 2 gloo ranks, against a dense float64 reference whose
router is written here (softmax, top-k, renormalise) independently of uniep.nn."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_ranks
from _moe_cases import rel_err
from uniep.nn import MoELayer
from uniep.reference import moe_reference

H, FFN, E, K, SEED = 20, 12, 4, 2, 7


def reference_layer(
    x: torch.Tensor,
    router: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    topk_idx: torch.Tensor,
) -> torch.Tensor:
    """Dense float64 MoE layer. `topk_idx` is the expert choice (not differentiable); the gate
    weights are recomputed from `router` so that its gradient is the reference's."""
    probs = torch.softmax(x.double() @ router.double().t(), dim=-1)
    chosen = probs.gather(1, topk_idx)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    return moe_reference(x.double(), topk_idx, weights, w1.double(), w2.double())


def _check_routing(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    idx, weights = layer.route(x)
    probs = torch.softmax(x.double() @ layer.router.weight.double().t(), dim=-1)
    want = probs.topk(layer.top_k, dim=-1).indices
    assert torch.equal(idx.sort(dim=-1).values, want.sort(dim=-1).values)
    torch.testing.assert_close(weights.double().sum(-1), torch.ones(len(x), dtype=torch.float64))
    return idx


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_single_rank_forward_backward(dtype: torch.dtype) -> None:
    torch.manual_seed(SEED)
    layer = MoELayer(H, FFN, E, K, dtype=dtype)
    assert layer.world_size == 1 and layer.w1.shape == (E, H, 2 * FFN)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    grad = torch.randn(3, 5, H, generator=gen, dtype=torch.float64).to(dtype)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    y.backward(grad)

    tokens = x.detach().reshape(-1, H)
    idx = _check_routing(layer, tokens)
    ref = {
        "x": tokens.double().requires_grad_(True),
        "router": layer.router.weight.detach().double().requires_grad_(True),
        "w1": layer.w1.detach().double().requires_grad_(True),
        "w2": layer.w2.detach().double().requires_grad_(True),
    }
    y_ref = reference_layer(ref["x"], ref["router"], ref["w1"], ref["w2"], K, idx)
    y_ref.backward(grad.reshape(-1, H).double())
    tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(y.reshape(-1, H), y_ref) <= tol
    got = {
        "x": x.grad.reshape(-1, H),
        "router": layer.router.weight.grad,
        "w1": layer.w1.grad,
        "w2": layer.w2.grad,
    }
    for name, g in got.items():
        assert g is not None, f"no gradient reached {name}"
        assert g.abs().sum() > 0, f"zero gradient for {name}"
        assert rel_err(g, ref[name].grad) <= 10 * tol, name


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_experts"):
        MoELayer(H, FFN, 0, 1)
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(H, FFN, E, E + 1)
    with pytest.raises(ValueError, match="tile_m"):
        MoELayer(H, FFN, E, K, tuning="tile_m=3")
    with pytest.raises(ValueError, match="dtype"):
        MoELayer(H, FFN, E, K, dtype=torch.float16)
    layer = MoELayer(H, FFN, E, K)
    with pytest.raises(ValueError, match=r"\bx\b"):
        layer(torch.randn(4, H + 1))


def layer_worker(rank: int, world_size: int, configs: list[list[int]]) -> list[dict[str, Any]]:
    """One MoELayer forward+backward per config (tokens per rank) on this rank."""
    out = []
    for tokens in configs:
        torch.manual_seed(SEED)
        layer = MoELayer(H, FFN, E, K, dtype=torch.float64)
        gen = torch.Generator().manual_seed(len(out) + 2)
        x_all = torch.randn(sum(tokens), H, generator=gen, dtype=torch.float64)
        g_all = torch.randn(sum(tokens), H, generator=gen, dtype=torch.float64)
        lo = sum(tokens[:rank])
        x = x_all[lo : lo + tokens[rank]].clone().requires_grad_(True)
        y = layer(x)
        y.backward(g_all[lo : lo + tokens[rank]])
        out.append(
            {
                "y": y.detach(),
                "x_grad": x.grad,
                "router_grad": layer.router.weight.grad,
                "w1": layer.w1.detach(),
                "w2": layer.w2.detach(),
                "w1_grad": layer.w1.grad,
                "w2_grad": layer.w2.grad,
                "x_all": x_all,
                "g_all": g_all,
            }
        )
    return out


CONFIGS = [[9, 6], [0, 11]]
_RESULTS: list[list[dict[str, Any]]] | Exception | None = None


def _two_rank_results(config: int) -> list[dict[str, Any]]:
    global _RESULTS
    if _RESULTS is None:
        try:
            _RESULTS = run_ranks(2, layer_worker, CONFIGS)
        except Exception as e:
            _RESULTS = e
    if isinstance(_RESULTS, Exception):
        pytest.fail(f"multi-rank run failed:\n{_RESULTS}", pytrace=False)
    return [per_rank[config] for per_rank in _RESULTS]


@pytest.mark.parametrize("config", range(len(CONFIGS)), ids=["w2", "w2-rank0-empty"])
def test_two_ranks_match_reference(config: int) -> None:
    tokens = CONFIGS[config]
    res = _two_rank_results(config)
    # Same seed: the ranks' experts together are the one-rank layer's experts.
    torch.manual_seed(SEED)
    full = MoELayer(H, FFN, E, K, dtype=torch.float64)
    assert torch.equal(torch.cat([r["w1"] for r in res]), full.w1.detach())
    assert torch.equal(torch.cat([r["w2"] for r in res]), full.w2.detach())

    x_all, g_all = res[0]["x_all"], res[0]["g_all"]
    idx = _check_routing(full, x_all)
    ref = {
        "x": x_all.clone().requires_grad_(True),
        "router": full.router.weight.detach().clone().requires_grad_(True),
        "w1": full.w1.detach().clone().requires_grad_(True),
        "w2": full.w2.detach().clone().requires_grad_(True),
    }
    reference_layer(ref["x"], ref["router"], ref["w1"], ref["w2"], K, idx).backward(g_all)
    y_ref = reference_layer(x_all, full.router.weight.detach(), full.w1, full.w2, K, idx)
    tol = 1e-10
    assert rel_err(torch.cat([r["y"] for r in res]), y_ref.detach()) <= tol
    assert rel_err(torch.cat([r["x_grad"] for r in res]), ref["x"].grad) <= tol
    assert rel_err(torch.cat([r["w1_grad"] for r in res]), ref["w1"].grad) <= tol
    assert rel_err(torch.cat([r["w2_grad"] for r in res]), ref["w2"].grad) <= tol
    # The router is replicated: each rank holds its tokens' share, the shares sum to the total.
    router = torch.stack([r["router_grad"] for r in res]).sum(0)
    assert rel_err(router, ref["router"].grad) <= tol
    for rank, r in enumerate(res):
        if tokens[rank] == 0:
            assert (r["router_grad"] == 0).all(), "a rank without tokens has no router gradient"
        else:
            assert r["router_grad"].abs().sum() > 0, f"rank {rank}: no gradient reached router"


def test_routing_stays_fp32_under_autocast() -> None:
    """The router's logits (hence the experts each token picks) are fp32 inside torch.autocast
    too, as outside it; autocast would otherwise run their matmul in bf16."""
    torch.manual_seed(1)
    layer = MoELayer(hidden=32, ffn_hidden=16, num_experts=8, top_k=2)
    x = torch.randn(64, 32)
    _, plain = layer(x, return_router_logits=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, cast = layer(x, return_router_logits=True)
    assert cast.dtype == torch.float32
    assert torch.equal(cast, plain)


def test_reset_parameters_after_meta_zeroes_the_score_bias() -> None:
    layer = MoELayer(
        hidden=16, ffn_hidden=8, num_experts=4, top_k=2, score_bias=True, device="meta"
    )
    layer = layer.to_empty(device="cpu")
    layer.score_bias.fill_(1e3)  # what uninitialised memory may hold
    with torch.no_grad():
        layer.reset_parameters()
    assert torch.equal(layer.score_bias, torch.zeros(4))


def test_experts_refuse_routing_of_other_leading_dims() -> None:
    """Routing [3, 2, K] for x [2, 3, H] has as many entries but pairs tokens with other tokens'
    experts: refused; the flattened [T, K] form is taken."""
    from uniep.nn import Experts

    torch.manual_seed(0)
    experts = Experts(hidden=8, ffn_hidden=8, num_experts=4)
    x = torch.randn(2, 3, 8)
    weights, idx = torch.randn(2, 3, 4).softmax(-1).topk(2, dim=-1)
    y = experts(x, idx, weights)
    assert torch.equal(experts(x, idx.reshape(6, 2), weights.reshape(6, 2)), y)
    with pytest.raises(ValueError, match="topk_idx must be"):
        experts(x, idx.reshape(3, 2, 2), weights.reshape(3, 2, 2))
