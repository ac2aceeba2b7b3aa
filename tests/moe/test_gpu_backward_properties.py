"""Randomized backward properties on one GPU (marker `gpu`): every backward path of the CUDA
``moe_forward`` against float64 autograd, at world 1 and with 2 and 4 ranks sharing the GPU.

The cases are the forward property suite's (test_properties_gpu.SHAPES through _routing_gen:
hidden 64 to 1152, top-k 1 to 16, 4 to 512 experts, uniform, Zipf, one-expert, rank-skewed and
holed routings, empty ranks). For each case and each tuning of BACKWARD_TUNINGS every rank runs
``uniep.moe_forward`` on its tokens and experts, backward with its slice of one ``grad_out``, and
checks its gradients of x, the routing weights, w1 and w2 against the float64 reference's
slices. The MegaKernel's tuning (``overlap=fused``) must also give the default's bits: where the
MegaKernel cannot run a shape (hidden or ffn not a multiple of 64), forward and backward both
take the separate launches. Ranks record mismatches instead of raising, so they stay in step.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _moe_cases import rank_slice
from _routing_gen import global_inputs
from test_gpu_training import run_on_one_gpu
from test_properties_gpu import SHAPES, _device, _rel_err, cases_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORLDS = [1, 2, 4]
CASES_PER_SHAPE = int(os.environ.get("UNIEP_BACKWARD_PROPERTY_CASES", "3"))
# (tuning, needs hidden % 128 == 0): dispatch=fp8 sends e4m3 rows in 1 x 128 blocks.
BACKWARD_TUNINGS = [
    ("", False),
    ("overlap=fused", False),
    ("combine=rank_partials", False),
    ("gemm=torch", False),
    ("dispatch=fp8,experts=bf16", True),
]
GRADS = ("x", "topk_weights", "w1", "w2")
# bf16 gradients through two bf16 GEMMs per direction against float64; fp8 rows add e4m3's
# rounding of x (its gradient is the bf16 layer's at the received rows).
TOLERANCE = {"": 3e-2, "fp8": 8e-2}


def _reference_grads(g: dict[str, torch.Tensor], fp8: bool) -> dict[str, torch.Tensor]:
    from uniep.reference import moe_reference

    leaves = {n: g[n].double().requires_grad_(True) for n in GRADS}
    x = leaves["x"]
    if fp8:
        from test_properties_cpu import fp8_roundtrip

        x = x + (fp8_roundtrip(g["x"]).double() - g["x"].double())  # e4m3 value, x's gradient
    y = moe_reference(x, g["topk_idx"], leaves["topk_weights"], leaves["w1"], leaves["w2"])
    y.backward(g["grad_out"].double())
    return {n: leaves[n].grad for n in GRADS}


def _backward_worker(rank: int, world: int) -> dict[str, Any]:
    import uniep

    dev = _device(rank)
    # One heap for every shape's runtimes (they are re-created as the shapes change).
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(4 << 30))
    group = dist.new_group(list(range(world)), backend="gloo") if world > 1 else None
    failures: list[str] = []
    checks = 0
    per_shape: dict[str, int] = {}
    for shape, case in cases_of(world):
        if per_shape.get(shape.name, 0) >= CASES_PER_SHAPE:
            continue
        per_shape[shape.name] = per_shape.get(shape.name, 0) + 1
        g = global_inputs(case)
        refs = {fp8: _reference_grads(g, fp8) for fp8 in (False, case.hidden % 128 == 0)}
        local = rank_slice(g, case, rank)
        bits: dict[str, dict[str, torch.Tensor]] = {}
        for tuning, needs_128 in BACKWARD_TUNINGS:
            if needs_128 and case.hidden % 128:
                continue
            fp8 = "fp8" in tuning
            leaves = {n: local[n].to(dev).requires_grad_(True) for n in GRADS}
            y = uniep.moe_forward(
                leaves["x"],
                local["topk_idx"].to(dev),
                leaves["topk_weights"],
                leaves["w1"],
                leaves["w2"],
                group=group,
                tuning=tuning,
            )
            y.backward(local["grad_out"].to(dev))
            torch.cuda.synchronize()
            where = f"{shape.name} {case.name} tuning={tuning!r}"
            got = {}
            for name in GRADS:
                checks += 1
                grad = leaves[name].grad
                if grad is None:
                    failures.append(f"{where}: no gradient for {name}")
                    continue
                got[name] = grad.detach().cpu()
                span = case.token_range if name in GRADS[:2] else case.expert_range
                lo, hi = span(rank)
                want = refs[fp8][name][lo:hi]
                if got[name].shape != want.shape or not torch.isfinite(got[name]).all():
                    failures.append(f"{where}: {name} {tuple(got[name].shape)} or not finite")
                    continue
                err = _rel_err(got[name], want)
                if not err <= TOLERANCE["fp8" if fp8 else ""]:
                    failures.append(f"{where}: {name} rel. err {err:.3e}")
            unused = local["topk_idx"] < 0
            if "topk_weights" in got and unused.any() and (got["topk_weights"][unused] != 0).any():
                failures.append(f"{where}: unused slots got a routing-weight gradient")
            bits[tuning] = got
        for name in GRADS:
            a, b = bits.get("", {}).get(name), bits.get("overlap=fused", {}).get(name)
            if a is not None and b is not None and not torch.equal(a, b):
                failures.append(f"{shape.name} {case.name}: overlap=fused's {name} bits differ")
    if group is not None:
        dist.barrier(group)
    return {"cases": sum(per_shape.values()), "checks": checks, "failures": failures}


@pytest.mark.parametrize("world", WORLDS)
def test_backward_paths_against_float64_autograd(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = run_on_one_gpu(_backward_worker, world, monkeypatch, timeout_s=540)
    print(
        f"\nbackward properties (GPU, world {world}): {reports[0]['cases']} cases, "
        f"{sum(r['checks'] for r in reports)} gradient checks on all ranks"
    )
    assert reports[0]["cases"] == len(SHAPES) * CASES_PER_SHAPE
    failures = [f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"]]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:60])
