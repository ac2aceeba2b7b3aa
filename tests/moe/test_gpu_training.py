"""What a training job meets on one GPU (marker `gpu`), at world 1 and with ranks sharing it:

- a process that grew the GPU runtime (a larger batch, another layer shape) exits with code 0,
  with or without ``uniep.moe.ep.shutdown()`` and ``destroy_process_group()``; the runtime's
  re-creation used to finalise NVSHMEM and start it again, and the process then died by SIGSEGV
  at exit after printing everything;
- an empty batch keeps its autograd graph and joins the backward's exchanges;
- ``overlap=fused`` accepts in its backward every shape its forward accepts (both fall back to
  the separate launches where the MegaKernel cannot run the shape), with the same bits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_GROW = """
import torch, torch.distributed as dist, uniep
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
if {pg}:
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    uniep.init()
def layer(t, h, i, e, k=2, grad=False):
    g = torch.Generator(device=dev).manual_seed(t)
    x = torch.randn(t, h, device=dev, generator=g).bfloat16().requires_grad_(grad)
    idx = torch.randint(0, e, (t, k), device=dev, generator=g)
    w = torch.rand(t, k, device=dev, generator=g)
    w1 = (torch.randn(e, h, 2 * i, device=dev, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, i, h, device=dev, generator=g) * 0.02).bfloat16()
    y = uniep.moe_forward(x, idx, w, w1, w2, tuning={tuning!r})
    if grad:
        y.float().sum().backward()
    return y
for t, h, i, e in {shapes}:
    layer(t, h, i, e, grad={grad})
torch.cuda.synchronize()
if {shutdown}:
    uniep.moe.ep.shutdown()
if {pg}:
    dist.destroy_process_group()
print("done", flush=True)
"""


def run_on_one_gpu(
    worker: Callable[[int, int], Any],
    world: int,
    monkeypatch: pytest.MonkeyPatch,
    timeout_s: float = 300,
) -> list[Any]:
    """``worker`` on ``world`` ranks of the first visible GPU: NCCL at one rank; gloo at more,
    every rank on that GPU (NCCL refuses two ranks on one device; the spawned ranks read
    CUDA_VISIBLE_DEVICES afresh, so a multi-GPU machine shows them one GPU too)."""
    from uniep.distributed import run_local_ranks

    if world > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    backend = "nccl" if world == 1 else "gloo"
    return run_local_ranks(worker, world, backend=backend, timeout_s=timeout_s)


_GROWTH = [(4096, 2048, 256, 128), (8192, 4096, 512, 2)]
# A decode loop: token counts that grow the runtime several times, on two layer shapes.
_DECODE = [(t, h, 256, e) for t in (1, 3, 17, 100, 300, 513) for h, e in ((1024, 16), (2048, 8))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "shapes, shutdown, pg, tuning, grad",
    [
        (_GROWTH, False, False, "", False),
        (_GROWTH, True, False, "", False),
        (_GROWTH, False, True, "", False),
        (_GROWTH, True, True, "", True),
        (_GROWTH, False, False, "overlap=fused", True),
        (_DECODE, False, False, "", False),
    ],
    ids=["grow", "grow-shutdown", "grow-process-group", "grow-both-backward", "fused", "decode"],
)
def test_process_exits_cleanly_after_the_runtime_grew(
    shapes: list, shutdown: bool, pg: bool, tuning: str, grad: bool
) -> None:
    script = _GROW.format(
        shapes=shapes, shutdown=shutdown, pg=pg, tuning=tuning, grad=grad, port=_free_port()
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert "done" in run.stdout, run.stderr[-3000:]
    assert run.returncode == 0, f"exit code {run.returncode}; stderr:\n{run.stderr[-3000:]}"


def _grow_worker(rank: int, world: int) -> int:
    """Each rank grows its runtime twice; run_local_ranks fails a rank that dies at exit."""
    import uniep

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    for t, h, e in ((64, 256, 8), (700, 256, 8), (300, 512, 4 * world)):
        x = torch.randn(t, h, device=dev).bfloat16().requires_grad_(True)
        idx = torch.randint(0, e, (t, 2), device=dev)
        w = torch.rand(t, 2, device=dev)
        w1 = (torch.randn(e // world, h, 256, device=dev) * 0.05).bfloat16().requires_grad_(True)
        w2 = (torch.randn(e // world, 128, h, device=dev) * 0.05).bfloat16().requires_grad_(True)
        uniep.moe_forward(x, idx, w, w1, w2).float().sum().backward()
    torch.cuda.synchronize()
    return rank


def test_ranks_sharing_the_gpu_exit_cleanly_after_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_on_one_gpu(_grow_worker, 2, monkeypatch) == [0, 1]


def _empty_batch_worker(rank: int, world: int) -> list[str]:
    """Every tuning with a backward, on ranks of zero tokens (all, or all but rank 0)."""
    import uniep

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    group = dist.group.WORLD if world > 1 else None
    h, i, k, e_local = 256, 128, 2, 4
    bad = []
    for tokens_of_rank0 in (0, 37):
        t = tokens_of_rank0 if rank == 0 else 0
        gen = torch.Generator().manual_seed(rank)
        w1 = (torch.randn(e_local, h, 2 * i, generator=gen) * 0.05).bfloat16().to(dev)
        w2 = (torch.randn(e_local, i, h, generator=gen) * 0.05).bfloat16().to(dev)
        for tuning in ("", "overlap=fused", "gemm=torch", "combine=rank_partials"):
            x = torch.randn(t, h, generator=gen).bfloat16().to(dev).requires_grad_(True)
            idx = torch.randint(0, e_local * world, (t, k), generator=gen).to(dev)
            w = torch.rand(t, k, generator=gen).to(dev).requires_grad_(True)
            a1, a2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
            name = uniep.distributed.group_name(group)
            for how, y in (
                ("op", torch.ops.uniep.moe_forward(x, idx, w, a1, a2, name, tuning)),
                ("wrapper", uniep.moe_forward(x, idx, w, a1, a2, group=group, tuning=tuning)),
            ):
                where = f"rank {rank} t={t} {how} tuning={tuning!r}"
                if y.grad_fn is None:
                    bad.append(f"{where}: no grad_fn")
                    continue
                a1.grad = a2.grad = None
                y.float().sum().backward()
                for n, p in (("w1", a1), ("w2", a2)):
                    if p.grad is None or p.grad.shape != p.shape:
                        bad.append(f"{where}: {n}.grad is {p.grad}")
                    elif tokens_of_rank0 == 0 and p.grad.abs().sum() != 0:
                        bad.append(f"{where}: {n}.grad is not zero with no tokens anywhere")
                if x.grad is None or x.grad.shape != x.shape:
                    bad.append(f"{where}: x.grad is {x.grad}")
                x.grad = w.grad = None
    torch.cuda.synchronize()
    return bad


@pytest.mark.parametrize("world", [1, 2])
def test_empty_batches_keep_their_graph(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = [b for rep in run_on_one_gpu(_empty_batch_worker, world, monkeypatch) for b in rep]
    assert not bad, "\n".join(bad)


def _odd_ffn_worker(rank: int, world: int) -> list[str]:
    """ffn = 96 (the MegaKernel steps by 64): overlap=fused's forward and backward both run, with
    the default's bits."""
    import uniep

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    group = dist.group.WORLD if world > 1 else None
    gen = torch.Generator().manual_seed(11 + rank)
    t, h, i, k, e_local = 96, 256, 96, 2, 4
    x0 = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    idx = torch.randint(0, e_local * world, (t, k), generator=gen).to(dev)
    w0 = torch.rand(t, k, generator=gen).to(dev)
    w1_0 = (torch.randn(e_local, h, 2 * i, generator=gen) * 0.05).bfloat16().to(dev)
    w2_0 = (torch.randn(e_local, i, h, generator=gen) * 0.05).bfloat16().to(dev)
    go = torch.randn(t, h, generator=gen).bfloat16().to(dev)
    out = {}
    for tuning in ("", "overlap=fused", "overlap=chunked"):
        leaves = [v.clone().requires_grad_(True) for v in (x0, w0, w1_0, w2_0)]
        x, w, w1, w2 = leaves
        y = uniep.moe_forward(x, idx, w, w1, w2, group=group, tuning=tuning)
        y.backward(go)
        out[tuning] = [y.detach()] + [v.grad for v in leaves]
    bad = []
    for tuning in ("overlap=fused", "overlap=chunked"):
        for n, a, b in zip(("y", "x", "w", "w1", "w2"), out[""], out[tuning], strict=True):
            if not torch.equal(a, b):
                bad.append(f"rank {rank} {tuning}: {n} differs from the default's")
    return bad


@pytest.mark.parametrize("world", [1, 2])
def test_fused_backward_accepts_what_its_forward_accepts(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = [b for rep in run_on_one_gpu(_odd_ffn_worker, world, monkeypatch) for b in rep]
    assert not bad, "\n".join(bad)
