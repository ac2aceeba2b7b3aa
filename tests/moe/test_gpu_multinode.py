"""The two-level path on CUDA tensors (marker `gpu`): four or eight ranks sharing one GPU as
logical nodes (2 x 2, 2 x 4, 4 x 2: `uniep.init(ranks_per_node=...)`), the rail on gloo, each
node's CUDA runtime over its own group. combine=node_partials against the CPU executor's on the
same ranks and inputs, and per_k against the CPU executor's per_k, forward and gradients; the
same bits run to run and through uniep.nn.Experts; rank_partials refused by name."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, FFN, E_LOCAL, K, T = 256, 128, 2, 4, 24
PARTIALS = "combine=node_partials"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _worker(rank: int, world: int, per_node: int) -> dict[str, object]:
    import uniep

    uniep.init(ranks_per_node=per_node)
    experts = E_LOCAL * world
    gen = torch.Generator().manual_seed(11)
    w1_all = torch.randn(experts, H, 2 * FFN, generator=gen) * H**-0.5
    w2_all = torch.randn(experts, FFN, H, generator=gen) * FFN**-0.5
    gen.manual_seed(100 + rank)
    tokens = T + 3 * rank
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :K].contiguous()
    idx[torch.rand(tokens, K, generator=gen) < 0.2] = -1
    w = torch.rand(tokens, K, generator=gen)
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    w1 = w1_all[mine].bfloat16().contiguous()
    w2 = w2_all[mine].bfloat16().contiguous()
    go = torch.randn(tokens, H, generator=gen).bfloat16()

    def run(dev: str, tuning: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # detach: .to() of a tensor already on dev is the tensor itself, which must stay a
        # plain input for the other runs.
        leaves = [t.detach().to(dev).requires_grad_(True) for t in (x, w, w1, w2)]
        y = uniep.moe_forward(leaves[0], idx.to(dev), *leaves[1:], tuning=tuning)
        y.backward(go.to(dev))
        return y.detach().cpu(), [t.grad.cpu() for t in leaves]

    def bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))

    out: dict[str, object] = {}
    for tuning in (PARTIALS, ""):
        y_cuda, g_cuda = run("cuda", tuning)
        y_again, _ = run("cuda", tuning)
        y_cpu, g_cpu = run("cpu", tuning)
        out[tuning or "per_k"] = {
            "forward": _rel(y_cuda, y_cpu),
            "grads": [_rel(a, b) for a, b in zip(g_cuda, g_cpu, strict=True)],
            "repeat_bits": bits(y_cuda, y_again),
            "y": y_cuda,
        }
    # uniep.nn.Experts over the same group takes the same path.
    layer = uniep.nn.Experts(H, FFN, experts, tuning=PARTIALS, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.w1.copy_(w1)
        layer.w2.copy_(w2)
    y_module = layer(x.cuda(), idx.cuda(), w.cuda()).detach().cpu()
    out["module_bits"] = bits(y_module, out[PARTIALS]["y"])
    for combine in (PARTIALS, "per_k"):  # tensors would go back through shared memory
        del out[combine]["y"]
    try:
        tuning = "combine=rank_partials"
        uniep.moe_forward(x.cuda(), idx.cuda(), w.cuda(), w1.cuda(), w2.cuda(), tuning=tuning)
    except ValueError as e:
        out["rank_partials"] = str(e)
    bad = idx.clone()
    if rank == 1:
        bad[0, 0] = experts  # one rank's bad id: every rank raises with its reason
    try:
        uniep.moe_forward(x.cuda(), bad.cuda(), w.cuda(), w1.cuda(), w2.cuda(), tuning=PARTIALS)
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.parametrize(("world", "per_node"), [(4, 2), (8, 4), (8, 2)], ids=["2x2", "2x4", "4x2"])
def test_logical_nodes_on_one_gpu_match_the_cpu_executor(
    world: int, per_node: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uniep.distributed import run_local_ranks

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", first)
    reports = run_local_ranks(_worker, world, (per_node,), backend="gloo", timeout_s=300)
    for rank, r in enumerate(reports):
        for combine in (PARTIALS, "per_k"):
            got = r[combine]
            assert got["forward"] < 2e-2, (rank, combine, got)
            assert max(got["grads"]) < 5e-2, (rank, combine, got)
            assert got["repeat_bits"], (rank, combine)
        assert r["module_bits"], rank
        assert "combine=rank_partials" in r["rank_partials"], (rank, r)
        # The failing rank raises its own reason; the others name it.
        bound = f"outside [-1, {E_LOCAL * world})"
        assert bound in r["bad"] and (rank == 1 or "rank 1" in r["bad"]), (rank, r)
