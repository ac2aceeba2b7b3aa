"""uniep.moe_forward with overlap=fused on one GPU (marker `gpu`): the MegaKernel runs (world 1:
moe_forward_local; ranks: moe_forward_ep) on the packed copy of w1 that
uniep.moe.megakernel.forward keeps, with the separate launches' bits, packed once, packed again
after an in-place update, and with the separate launches' gradients; a CUDA-graph capture of it is
refused by name. World 1 (NCCL) and two ranks sharing the GPU (gloo).
``torch.ops.uniep.moe_backward`` with overlap=fused (the fused backward) gives overlap=sequential's
bits. ``overlap=chunked`` at one rank runs the MegaKernel's pieces on streams
(``moe_forward_local(overlap="streams")``, and its backward the same way), across ranks the
separate launches: the same bits and gradients either way."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

T, H, FFN, E_LOCAL, K = 80, 256, 128, 5, 4


def _worker(rank: int, world: int) -> dict[str, float]:
    import uniep
    from uniep.moe.megakernel import forward as fused_forward
    from uniep.moe.megakernel import launch as megakernel

    dev = torch.device("cuda", torch.cuda.current_device())
    experts = E_LOCAL * world
    gen = torch.Generator().manual_seed(11)
    w1_all = torch.randn(experts, H, 2 * FFN, generator=gen) * H**-0.5
    w2_all = torch.randn(experts, FFN, H, generator=gen) * FFN**-0.5
    gen.manual_seed(300 + rank)
    x = torch.randn(T - 5 * rank, H, generator=gen).bfloat16().to(dev)
    idx = torch.rand(x.shape[0], experts, generator=gen).argsort(dim=1)[:, :K]
    idx[3, 1] = -1  # an unused slot
    idx = idx.contiguous().to(dev)
    w = torch.softmax(torch.randn(x.shape[0], K, generator=gen), dim=1).to(dev)
    mine = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    w1 = w1_all[mine].bfloat16().to(dev)
    w2 = w2_all[mine].bfloat16().to(dev)

    calls: list[str] = []
    real = {name: getattr(megakernel, name) for name in ("moe_forward_local", "moe_forward_ep")}

    def spy(name: str):  # noqa: ANN202
        def run(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            return real[name](*args, **kwargs)

        return run

    for name in real:
        setattr(megakernel, name, spy(name))
    out: dict[str, float] = {}
    try:
        base = uniep.moe_forward(x, idx, w, w1, w2, tuning="overlap=sequential")
        fused = uniep.moe_forward(x, idx, w, w1, w2, tuning="overlap=fused")
        packed = fused_forward.packed_gate_up(w1)
        again = uniep.moe_forward(x, idx, w, w1, w2, tuning="overlap=fused,sms=8")
        out["ran_kernel"] = float(len(calls) == 2 and len(set(calls)) == 1)
        out["kernel"] = 1.0 if calls and calls[0] == "moe_forward_local" else 2.0
        out["fused_equal"] = float(torch.equal(fused, base) and torch.equal(again, base))
        out["packed_once"] = float(fused_forward.packed_gate_up(w1) is packed)
        # An in-place update (an optimizer step): the next call packs w1 again.
        w1.mul_(0.75)
        updated = uniep.moe_forward(x, idx, w, w1, w2, tuning="overlap=fused")
        base_updated = uniep.moe_forward(x, idx, w, w1, w2)
        out["repacked_equal"] = float(
            torch.equal(updated, base_updated) and not torch.equal(updated, base)
        )
        out["repacked"] = float(fused_forward.packed_gate_up(w1) is not packed)
        # overlap=chunked: at one rank the MegaKernel's pieces on streams, else the launches.
        before = len(calls)
        chunked = uniep.moe_forward(x, idx, w, w1, w2, tuning="overlap=chunked,sms=12")
        out["chunked_equal"] = float(torch.equal(chunked, base_updated))
        out["chunked_calls"] = float(len(calls) - before)

        # Gradients: moe_backward's, whichever forward ran.
        grads = []
        for tuning in ("overlap=sequential", "overlap=fused", "overlap=chunked"):
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, w1, w2)]
            xg, wg, w1g, w2g = leaves
            y = uniep.moe_forward(xg, idx, wg, w1g, w2g, tuning=tuning)
            (y.float() * torch.linspace(-1, 1, H, device=dev)).sum().backward()
            grads.append([y.detach(), *(t.grad for t in leaves)])
        out["grads_equal"] = float(
            all(
                torch.equal(a, b)
                for other in grads[1:]
                for a, b in zip(grads[0], other, strict=True)
            )
        )
        # The op with overlap=fused (at world 1 the fused backward, else the engine's): the bits
        # of overlap=sequential.
        go = torch.randn(x.shape, generator=gen).bfloat16().to(dev)
        name = uniep.distributed.group_name(None)
        op = [
            torch.ops.uniep.moe_backward(go, x, idx, w, w1, w2, name, f"overlap={mode}")
            for mode in ("sequential", "fused", "chunked")
        ]
        out["op_fused_equal"] = float(
            all(torch.equal(a, b) for other in op[1:] for a, b in zip(op[0], other, strict=True))
        )
        out["calls"] = float(len(calls))
    finally:
        for name, fn in real.items():
            setattr(megakernel, name, fn)
    megakernel.check_errors()
    # Under CUDA-graph capture the call is refused before any launch, naming what captures.
    refused = ""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            uniep.moe_forward(x, idx, w, w1, w2, tuning="overlap=fused")
    except RuntimeError as e:
        refused = str(e)
    out["capture_refused"] = float("cannot be captured" in refused and "check=False" in refused)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_moe_forward_runs_the_megakernel(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from uniep.distributed import run_local_ranks

    if world > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    backend = "nccl" if world == 1 else "gloo"
    for report in run_local_ranks(_worker, world, backend=backend, timeout_s=300):
        assert report["ran_kernel"] == 1.0, report
        assert report["kernel"] == (1.0 if world == 1 else 2.0), report
        assert report["fused_equal"] == 1.0, report
        assert report["packed_once"] == 1.0, report
        assert report["repacked_equal"] == report["repacked"] == 1.0, report
        assert report["grads_equal"] == 1.0, report
        assert report["op_fused_equal"] == 1.0, report
        assert report["chunked_equal"] == 1.0, report
        # At one rank overlap=chunked runs moe_forward_local (streams); across ranks the launches.
        assert report["chunked_calls"] == (1.0 if world == 1 else 0.0), report
        # Two forwards, the update's, the gradients' (and overlap=chunked's two at one rank).
        assert report["calls"] == (6.0 if world == 1 else 4.0), report
        assert report["capture_refused"] == 1.0, report
