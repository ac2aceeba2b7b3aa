"""The Parm CUDA executor against the CPU executor on one GPU (marker `gpu`).

The CUDA executor's acceptance: ranks that share one GPU (2, 4 and 8 processes, as in
test_gpu_on_one_gpu.py: NVSHMEM's multiple processes per GPU, host agreement over gloo) run
ParmMoELayer under baseline, S1 and S2, forward and backward, once on CUDA tensors (the CUDA
executor: UniEP's collectives on the MP and EP sub-groups' own runtimes, the chunk-pipelined SAA
pairs on two streams, torch._grouped_mm where it fits) and once on CPU tensors in the same worker
(the CPU executor over the same gloo groups), on the same inputs. bf16 within bf16 tolerance and
fp32 within 1e-4, relative to the largest entry, for y, l_aux, dx and the gate and expert-shard
gradients; the dropped-pair counts equal. Shapes cover odd sizes (rows that are no multiple of 8
take torch.bmm), top-k 1 to 8, an empty expert and dropped pairs, and SAA chunk counts 1 to 5. At
world 1 (no torch.distributed) the same comparison and opcheck of both ops on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _parm_cases import SCHEDULES, case_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}

BASE = dict(M=16, H=32, E=4, k=2, f=2.0, seed=0, chunks=4)
CASES: dict[int, list[dict[str, Any]]] = {
    2: [
        dict(BASE, name="n2-k2", N=2, S=24, seed=1),
        dict(BASE, name="n2-odd-k3", N=2, S=13, M=7, H=10, E=6, k=3, seed=2, chunks=3),
        dict(BASE, name="n1-g2-k1", N=1, S=10, k=1, f=1.0, seed=3, chunks=2),
        dict(BASE, name="n2-k8", N=2, S=9, E=8, k=8, f=0.0, seed=4, chunks=5),
    ],
    4: [
        dict(BASE, name="n2-g2-k2", N=2, S=20, seed=11),
        dict(BASE, name="n2-g2-odd-k4", N=2, S=15, M=9, H=6, E=8, k=4, f=0.0, seed=12),
        dict(BASE, name="n4-k1", N=4, S=17, k=1, f=0.0, seed=13, chunks=1),
        dict(BASE, name="n4-k8", N=4, S=11, E=8, k=8, f=0.0, seed=14, chunks=2),
        dict(
            BASE, name="n2-empty-expert-drop", N=2, S=16, f=1.0, one_expert=True, seed=15, chunks=3
        ),
        dict(BASE, name="n1-g4-k2", N=1, S=12, E=8, seed=16),
    ],
    8: [
        dict(BASE, name="n2-g4-k2", N=2, S=16, E=8, seed=21),
        dict(BASE, name="n4-g2-odd-k4", N=4, S=11, M=9, H=12, E=8, k=4, f=0.0, seed=22, chunks=3),
        dict(BASE, name="n8-k2", N=8, S=9, E=8, f=0.0, seed=23, chunks=2),
        dict(BASE, name="n1-g8-k3", N=1, S=10, E=16, k=3, seed=24),
        dict(BASE, name="n2-g4-drop", N=2, S=12, E=8, f=1.0, one_expert=True, seed=25, chunks=3),
    ],
}


def _device(rank: int) -> torch.device:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _run_layer(
    case: dict[str, Any],
    t: dict[str, torch.Tensor],
    mp: Any,
    ep: Any,
    g: int,
    schedule: str,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[torch.Tensor], int]:
    from uniep.parm import ParmMoELayer

    layer = ParmMoELayer(
        mp,
        ep,
        case["M"],
        case["H"],
        case["E"],
        case["k"],
        capacity_factor=case["f"],
        schedule=schedule,
        overflow="drop",
        dtype=dtype,
        chunks=case["chunks"],
    ).to(device)
    layer.load_full(t["gate"].float(), t["w1"].to(dtype), t["w2"].to(dtype))
    x = t["x"][g].to(dtype).to(device).requires_grad_()
    y = layer(x)
    dy = t["dy"][g].float().to(device)
    loss = (y.float() * dy).sum() + t["dl"][g].float().to(device) * layer.l_aux
    loss.backward()
    outs = [y, layer.l_aux, x.grad, layer.gate.grad, layer.w1.grad, layer.w2.grad]
    return [o.detach().cpu() for o in outs], layer.last_stats["dropped"]


def _compare_worker(rank: int, world: int, cases: list[dict[str, Any]] | None = None) -> list:
    """Per case, dtype and schedule: (name, dtype, schedule, worst relative error and which
    output, dropped on CUDA, dropped on CPU)."""
    import uniep.parm.cuda as pc
    from uniep.parm import new_groups

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = _device(rank)
    cases = cases if cases is not None else CASES[world]
    groups: dict[int, tuple[Any, Any]] = {}
    report = []
    for case in cases:
        N = case["N"]
        if N not in groups:
            groups[N] = new_groups(N) if world > 1 else (None, None)
        mp, ep = groups[N]
        t = case_tensors(dict(case, world=world))
        g = rank // N
        for dtype in (torch.bfloat16, torch.float32):
            for schedule in SCHEDULES:
                on_gpu, drop_gpu = _run_layer(case, t, mp, ep, g, schedule, dtype, dev)
                on_cpu, drop_cpu = _run_layer(
                    case, t, mp, ep, g, schedule, dtype, torch.device("cpu")
                )
                worst, what = 0.0, ""
                names = ("y", "l_aux", "dx", "dgate", "dw1", "dw2")
                for name, a, b in zip(names, on_gpu, on_cpu, strict=True):
                    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape)
                    scale = b.double().abs().max().clamp_min(1e-30)
                    err = float((a.double() - b.double()).abs().max() / scale)
                    if err > worst or not what:
                        worst, what = err, name
                report.append((case["name"], str(dtype), schedule, worst, what, drop_gpu, drop_cpu))
    if world > 1:
        pc.shutdown()
    return report


def _check(reports: list[list]) -> None:
    for per_rank in reports:
        for name, dtype, schedule, err, what, drop_gpu, drop_cpu in per_rank:
            tol = TOL[torch.bfloat16 if "bfloat16" in dtype else torch.float32]
            assert err <= tol, f"{name} {dtype} {schedule}: {what} differs by {err:.2e}"
            assert drop_gpu == drop_cpu, (name, dtype, schedule, drop_gpu, drop_cpu)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_cuda_executor_equals_cpu_executor_on_ranks_sharing_the_gpu(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uniep.distributed import run_local_ranks

    # The ranks (spawned, so they read it afresh) see one GPU, also on a multi-GPU machine.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    # NCCL refuses two ranks on one device: gloo for the host agreement and the CPU executor.
    reports = run_local_ranks(_compare_worker, world, backend="gloo", timeout_s=600)
    _check(reports)
    assert any(r[5] > 0 for per in reports for r in per), "no case dropped a pair"


def test_cuda_executor_equals_cpu_executor_on_one_rank() -> None:
    cases = [
        dict(BASE, name="one-rank-k2", N=1, S=21, seed=21),
        dict(BASE, name="one-rank-odd-k5", N=1, S=9, M=11, H=13, E=6, k=5, f=0.0, seed=22),
    ]
    _check([_compare_worker(0, 1, cases)])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ops_pass_opcheck_on_cuda(schedule: str) -> None:
    from uniep.parm import ParmMoELayer

    torch.manual_seed(2)
    dev = _device(0)
    layer = ParmMoELayer(None, None, 8, 16, 4, 2, capacity_factor=0.0, dtype=torch.bfloat16)
    layer = layer.to(dev)
    x = torch.randn(5, 8, device=dev, dtype=torch.bfloat16, requires_grad=True)
    args = (x, layer.gate, layer.w1, layer.w2, "", "", 2, 0.0, schedule, "error")
    torch.library.opcheck(torch.ops.uniep.parm_moe_forward.default, args)
    y, l_aux, exp_in, comb, stats = torch.ops.uniep.parm_moe_forward(*args)
    assert y.is_cuda and exp_in.is_cuda and comb.is_cuda and stats.is_cuda
    back = (
        torch.randn(5, 8, device=dev, dtype=torch.bfloat16),
        torch.tensor(0.5, device=dev),
        x.detach(),
        layer.gate.detach(),
        layer.w1.detach(),
        layer.w2.detach(),
        exp_in,
        comb,
        stats,
        "",
        "",
        2,
        0.0,
        schedule,
    )
    torch.library.opcheck(torch.ops.uniep.parm_moe_backward.default, back)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_only_the_routing_agreement_waits_for_the_device(schedule: str) -> None:
    """One rank on CUDA: the forward reads the device once (the routing's overflow counts, for
    the agreement that lets every rank raise together), the backward never, so the host keeps
    enqueueing while the GPU works. Any other synchronizing call is named by file and line."""
    import warnings

    from uniep.parm import ParmMoELayer

    torch.manual_seed(4)
    dev = _device(0)
    layer = ParmMoELayer(
        None,
        None,
        64,
        128,
        8,
        2,
        capacity_factor=1.0,
        schedule=schedule,
        overflow="drop",
        dtype=torch.bfloat16,
        chunks=2,
    ).to(dev)
    x = torch.randn(96, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for timed in (False, True):  # the first pass warms the caches (allocator, pinned memory)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                y = layer(x)
                forward = [f"{w.filename}:{w.lineno}" for w in seen]
                (y.float().sum() + layer.l_aux).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        backward = [f"{w.filename}:{w.lineno}" for w in seen][len(forward) :]
        if timed:
            assert len(forward) == 1 and "parm/executor.py" in forward[0].replace("\\", "/"), (
                forward
            )
            assert backward == [], backward
    assert layer.last_stats["slice_capacity"] > 0
