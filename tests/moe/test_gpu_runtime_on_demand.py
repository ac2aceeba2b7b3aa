"""The GPU runtime created and grown by the op itself (marker `gpu`): a raw
torch.ops.uniep.moe_forward with no set-up creates the group's runtime from the call's shapes,
a later call with more tokens re-creates it larger on every rank, and both agree with the
float64 reference. World 1 (NCCL) and two ranks sharing the GPU (gloo), as
test_gpu_on_one_gpu.py runs them."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, FFN, E_LOCAL, K = 256, 128, 2, 2


def _call(rank: int, world: int, tokens: int, seed: int) -> float:
    """One raw moe_forward of ``tokens`` tokens on this rank: the max relative error against
    uniep.reference.moe_reference (float64, all experts gathered from the same seeds)."""
    import uniep
    from uniep.reference import moe_reference

    experts = E_LOCAL * world
    gen = torch.Generator().manual_seed(seed)
    w1_all = torch.randn(experts, H, 2 * FFN, generator=gen) * H**-0.5
    w2_all = torch.randn(experts, FFN, H, generator=gen) * FFN**-0.5
    gen.manual_seed(seed * 100 + rank)
    x = torch.randn(tokens, H, generator=gen)
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(tokens, K, generator=gen)
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    dev = torch.device("cuda", torch.cuda.current_device())
    bf = torch.bfloat16
    y = torch.ops.uniep.moe_forward(
        x.to(dev, bf),
        idx.to(dev),
        w.to(dev),
        w1_all[mine].to(dev, bf).contiguous(),
        w2_all[mine].to(dev, bf).contiguous(),
        uniep.distributed.group_name(None),
        "",
    )
    ref = moe_reference(
        x.to(bf).double(), idx, w.double(), w1_all.to(bf).double(), w2_all.to(bf).double()
    )
    return ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def _worker(rank: int, world: int) -> dict[str, object]:
    from uniep import _C
    from uniep.distributed import group_name

    name = group_name(None)
    out: dict[str, object] = {"exists_before": bool(_C.ep_exists(name))}
    # Ranks with different batch sizes: the runtime is sized for the largest.
    out["err_first"] = _call(rank, world, 100 + 50 * rank, 1)
    out["cap_first"] = _C.ep_config(name)["max_tokens"]
    out["err_again"] = _call(rank, world, 200, 2)  # fits: reused
    out["cap_again"] = _C.ep_config(name)["max_tokens"]
    # Only the last rank needs more: every rank grows the runtime in the same call.
    out["err_grown"] = _call(rank, world, 64 if rank < world - 1 else 1000, 3)
    out["cap_grown"] = _C.ep_config(name)["max_tokens"]
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_runtime_created_and_grown_by_moe_forward(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uniep
    from uniep.distributed import run_local_ranks

    if not uniep.moe.ep.available():
        pytest.skip("this build has no GPU runtime (CUDA torch ops)")
    if world > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    backend = "nccl" if world == 1 else "gloo"
    results = run_local_ranks(_worker, world, (), backend=backend, timeout_s=300)
    for r, res in enumerate(results):
        assert res["exists_before"] is False, r
        assert res["cap_first"] == res["cap_again"] == 256, (r, res)
        assert res["cap_grown"] == 1024, (r, res)
        for key in ("err_first", "err_again", "err_grown"):
            assert res[key] < 2e-2, (r, key, res[key])


def test_runtime_error_names_a_real_function() -> None:
    """Without the factory (a process that never imported uniep.moe.ep would have none), the
    missing runtime's message names uniep.moe.ep.init_runtime, which exists."""
    import uniep

    assert callable(uniep.moe.ep.init_runtime) and callable(uniep.moe.ep.shutdown)
    if not uniep.moe.ep.available():
        pytest.skip("this build has no GPU runtime (CUDA torch ops)")
    x = torch.zeros(4, H, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(4, K, device="cuda", dtype=torch.int64)
    w = torch.ones(4, K, device="cuda")
    with pytest.raises((ValueError, RuntimeError), match=r"uniep\.moe\.ep\.init_runtime"):
        torch.ops.uniep.ep_dispatch(x, idx, w, "no-runtime-here", "")


def test_node_partials_is_refused_on_cuda_by_name() -> None:
    # combine=node_partials is the combine of a group that spans nodes; the CUDA EP runtime of
    # one NVLink domain says so instead of combining another way.
    import uniep

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, H, generator=gen).to(dev, torch.bfloat16)
    idx = torch.rand(8, E_LOCAL, generator=gen).argsort(dim=1)[:, :K].contiguous().to(dev)
    w = torch.rand(8, K, generator=gen).to(dev)
    w1 = (torch.randn(E_LOCAL, H, 2 * FFN, generator=gen) * H**-0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(E_LOCAL, FFN, H, generator=gen) * FFN**-0.5).to(dev, torch.bfloat16)
    with pytest.raises(ValueError, match="node_partials is the combine of a group that spans"):
        uniep.moe_forward(x, idx, w, w1, w2, tuning="combine=node_partials")
