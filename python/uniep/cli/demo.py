"""``uniep demo``: the MoE layer on random routing against the float64 reference, forward and
backward, on CPU ranks over gloo or on the GPUs, with its timing."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .args import check_layer
from .info import has_cuda_moe_kernel

# Max relative error (max |got - ref| / max |ref|) accepted against the float64 reference.
TOLERANCE = {
    "float64": {"forward": 1e-10, "grad": 1e-10},
    "float32": {"forward": 1e-4, "grad": 1e-4},
    "bfloat16": {"forward": 3e-2, "grad": 5e-2},
}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    # Gathered in a wide dtype: not every backend reduces/gathers bfloat16, and the widening is
    # exact.
    wide = t.detach().double() if t.is_floating_point() else t.detach()
    parts = [torch.empty_like(wide) for _ in range(world)]
    dist.all_gather(parts, wide.contiguous())
    return torch.cat(parts)


def _median_ms(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    # No warm-up call here: the checked forward+backward before timing already ran every path.
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _demo_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from ..nn import MoELayer, route_weights
    from ..reference import moe_reference

    device = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    dtype = getattr(torch, cfg["dtype"])
    tokens, hidden = cfg["tokens"], cfg["hidden"]

    torch.manual_seed(cfg["seed"])
    layer = MoELayer(hidden, cfg["ffn"], cfg["experts"], cfg["top_k"], dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(cfg["seed"] * 7919 + 1 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    grad_y = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    x.requires_grad_(True)

    y = layer(x)
    y.backward(grad_y)
    router_grad = layer.router.weight.grad.detach().double().clone()
    dist.all_reduce(router_grad)  # the router is replicated: its gradient is summed over ranks

    # Reference: every rank's tokens through all experts in float64, differentiated by autograd.
    with torch.no_grad():
        topk_idx, _ = layer.route(x)
    x_all = _gather(x, world).requires_grad_(True)
    grad_all = _gather(grad_y, world)
    idx_all = _gather(topk_idx, world)
    w1_all = _gather(layer.w1, world).requires_grad_(True)
    w2_all = _gather(layer.w2, world).requires_grad_(True)
    router_ref = layer.router.weight.detach().double().clone().requires_grad_(True)
    weights_all = route_weights(x_all, router_ref, idx_all)
    y_ref = moe_reference(x_all, idx_all, weights_all, w1_all, w2_all)
    y_ref.backward(grad_all)

    rows = slice(rank * tokens, (rank + 1) * tokens)
    experts = slice(layer.expert_offset, layer.expert_offset + layer.num_local_experts)
    errors = {
        "forward": _rel_err(y, y_ref[rows]),
        "grad x": _rel_err(x.grad, x_all.grad[rows]),
        "grad w1": _rel_err(layer.w1.grad, w1_all.grad[experts]),
        "grad w2": _rel_err(layer.w2.grad, w2_all.grad[experts]),
        "grad router": _rel_err(router_grad, router_ref.grad),
    }
    worst = torch.tensor(list(errors.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    errors = dict(zip(errors, worst.tolist(), strict=True))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def forward_backward() -> None:
        layer(x).backward(grad_y)

    times = torch.tensor(
        [
            _median_ms(forward, cfg["iters"], sync),
            _median_ms(forward_backward, cfg["iters"], sync),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return {"errors": errors, "forward_ms": times[0].item(), "fwd_bwd_ms": times[1].item()}


# Gloo ranks per CPU core that `uniep demo` spawns at most: each rank is a process with its own
# torch and a share of the cores, and CI runs 2 and 4 ranks on 2-core machines.
CPU_RANKS_PER_CORE = 4


def _usable_cpus() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class DemoPlan:
    """What ``uniep demo`` runs: ``device`` ("cuda" or "cpu"), ``world`` ranks, ``dtype``,
    ``experts`` in total, and ``why`` it is not on GPUs when it is not ("" on GPUs)."""

    device: str
    world: int
    dtype: str
    experts: int
    why: str


def plan_demo(
    device: str,
    world: int | None,
    dtype: str | None,
    experts: int | None,
    *,
    gpus: int,
    cuda_ops: bool,
    cuda_kernel: bool,
    cpus: int,
) -> DemoPlan:
    """Pick the demo's configuration for this machine (pure: the machine comes as arguments).

    ``device``: "auto", "cpu" or "cuda"; ``world`` / ``dtype`` / ``experts``: as given on the
    command line, None for "pick one". On GPUs the world is one rank per visible GPU (1 on a
    one-GPU box) and the dtype bfloat16 (the CUDA executor's); on CPU two gloo ranks (the
    exchange between ranks is what the demo shows) in float32. "auto" runs on GPUs when this
    build has the CUDA kernels and enough GPUs for an explicit ``world``, else on CPU, saying
    why. On CPU the world is at most ``CPU_RANKS_PER_CORE`` ranks per core of the ``cpus``.
    ``experts`` defaults to the smallest multiple of the world that is at least 8.

    Raises:
        SystemExit: ``device="cuda"`` cannot run here, naming what is missing; ``world`` is
            below 1, or more ranks than the machine holds (one per GPU, or the CPU bound),
            naming ``--world-size``. Nothing has been spawned then.
    """
    if world is not None and world < 1:
        raise SystemExit(f"uniep demo: error: --world-size must be >= 1, got {world}")
    problems = []
    if gpus < 1:
        problems.append("no CUDA device is visible")
    elif world is not None and gpus < world:
        problems.append(f"{gpus} CUDA device(s) visible, --world-size {world} asks for {world}")
    if not cuda_ops:
        problems.append("this build has no torch CUDA ops")
    elif not cuda_kernel:
        problems.append("torch.ops.uniep.moe_forward has no CUDA kernel yet")
    if dtype not in (None, "bfloat16"):
        problems.append(f"the CUDA executor takes bfloat16, not --dtype {dtype}")
    if device == "cuda" and problems:
        raise SystemExit("uniep demo: error: --device cuda is not possible: " + "; ".join(problems))
    on_gpu = device != "cpu" and not problems
    why = "" if on_gpu else ("--device cpu" if device == "cpu" else "; ".join(problems))
    most = CPU_RANKS_PER_CORE * max(1, cpus)
    if not on_gpu and world is not None and world > most:
        raise SystemExit(
            f"uniep demo: error: --world-size {world} is more than this machine holds: at most "
            f"{most} gloo ranks on CPU ({CPU_RANKS_PER_CORE} per core, {cpus} core(s))"
            + (f"; not on GPU: {why}" if device != "cpu" else "")
        )
    if world is None:
        world = gpus if on_gpu else 2
    if dtype is None:
        dtype = "bfloat16" if on_gpu else "float32"
    if experts is None:
        experts = -(-max(8, world) // world) * world
    return DemoPlan("cuda" if on_gpu else "cpu", world, dtype, experts, why)


def cmd_demo(args: argparse.Namespace) -> int:
    import uniep

    from ..distributed import run_local_ranks

    plan = plan_demo(
        args.device,
        args.world_size,
        args.dtype,
        args.experts,
        gpus=torch.cuda.device_count(),
        cuda_ops=bool(uniep.build_info().get("cuda_ops")),
        cuda_kernel=has_cuda_moe_kernel(),
        cpus=_usable_cpus(),
    )
    args.world_size, args.dtype, args.experts = plan.world, plan.dtype, plan.experts
    device, why = plan.device, plan.why
    check_layer("demo", args.world_size, args.experts, args.top_k)
    cfg = {
        "device": device,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "experts": args.experts,
        "top_k": args.top_k,
        "iters": args.iters,
        "seed": args.seed,
    }
    backend = "nccl" if device == "cuda" else "gloo"
    where = f"{device} ({backend})" + (f"; not on GPU: {why}" if why else "")
    print(
        f"uniep demo: {args.world_size} ranks on {where}\n"
        f"  {args.dtype}, tokens/rank={args.tokens} hidden={args.hidden} ffn={args.ffn} "
        f"experts={args.experts} top_k={args.top_k}",
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        try:
            results = run_local_ranks(
                _demo_rank, args.world_size, (cfg,), backend=backend, timeout_s=args.timeout
            )
        except RuntimeError as exc:
            # A build can register CUDA ops without every kernel; only a missing kernel is a
            # reason to fall back, any other failure is reported.
            if device != "cuda" or args.device != "auto" or "NotImplementedError" not in str(exc):
                raise
            print("  a CUDA kernel is missing; running on cpu (gloo) instead", flush=True)
            cfg["device"] = "cpu"
            results = run_local_ranks(
                _demo_rank, args.world_size, (cfg,), backend="gloo", timeout_s=args.timeout
            )
    except RuntimeError as exc:
        print(f"uniep demo: FAILED: {exc}", file=sys.stderr)
        return 1
    res = results[0]
    tol = TOLERANCE[args.dtype]
    ok = True
    print("  check against uniep.reference.moe_reference (float64), max rel error:")
    for name, err in res["errors"].items():
        limit = tol["forward"] if name == "forward" else tol["grad"]
        good = err <= limit
        ok &= good
        print(f"    {name:<12} {err:.2e}  (tol {limit:.0e})  {'ok' if good else 'MISMATCH'}")
    total_tokens = args.tokens * args.world_size
    for label, key in (("forward", "forward_ms"), ("forward+backward", "fwd_bwd_ms")):
        ms = res[key]
        print(
            f"  {label:<17} {ms:8.2f} ms median of {args.iters}  "
            f"{total_tokens / (ms / 1e3):12,.0f} tokens/s ({args.world_size} ranks)"
        )
    print(f"uniep demo: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
