"""The ``uniep`` command: ``uniep info`` (what this build contains), ``uniep demo``, ``uniep tune``
and ``uniep parm``."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["main"]

# Max relative error (max |got - ref| / max |ref|) accepted against the float64 reference.
_TOLERANCE = {
    "float64": {"forward": 1e-10, "grad": 1e-10},
    "float32": {"forward": 1e-4, "grad": 1e-4},
    "bfloat16": {"forward": 3e-2, "grad": 5e-2},
}


def _has_cuda_moe_kernel() -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("uniep::moe_forward", "CUDA"))


def _info() -> dict[str, Any]:
    import uniep

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "build": dict(uniep.build_info()),
        "cmake_prefix_path": uniep.cmake_prefix_path(),
        "runtime": {
            "torch_version": torch.__version__,
            "torch_cuda_version": torch.version.cuda or "",
            "cuda_devices": devices,
            "moe_forward_cuda_kernel": _has_cuda_moe_kernel(),
            "routing_layout_cuda_kernel": bool(
                torch._C._dispatch_has_kernel_for_dispatch_key("uniep::routing_layout", "CUDA")
            ),
        },
    }


def _yes(value: object) -> str:
    return "yes" if value else "no"


def _cmd_info(args: argparse.Namespace) -> int:
    import uniep

    if args.cmake_prefix_path:
        print(uniep.cmake_prefix_path())
        return 0
    info = _info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    b, r = info["build"], info["runtime"]
    devices = r["cuda_devices"]
    rows = [
        ("uniep", b.get("version", "")),
        ("CUDA kernels compiled", _yes(b.get("cuda_kernels"))),
        ("torch CUDA ops", _yes(b.get("cuda_ops"))),
        ("  moe_forward on CUDA", _yes(r["moe_forward_cuda_kernel"])),
        ("  routing_layout on CUDA", _yes(r["routing_layout_cuda_kernel"])),
        ("NVSHMEM", b.get("nvshmem_version") or "-"),
        ("CUTLASS", b.get("cutlass_version") or "-"),
        ("CUDA archs (sm)", b.get("cuda_archs") or "-"),
        ("CUDA compiler", b.get("cuda_compiler_version") or "-"),
        ("torch (built against)", b.get("torch_version") or "-"),
        ("torch (running)", f"{r['torch_version']} (CUDA {r['torch_cuda_version'] or 'none'})"),
        ("C++ package (CMake prefix)", info["cmake_prefix_path"]),
        (
            "CUDA devices visible",
            f"{len(devices)}" + (f": {', '.join(devices)}" if devices else ""),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# ---- demo ----


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


def _cmd_demo(args: argparse.Namespace) -> int:
    import uniep

    from ..distributed import run_local_ranks

    plan = plan_demo(
        args.device,
        args.world_size,
        args.dtype,
        args.experts,
        gpus=torch.cuda.device_count(),
        cuda_ops=bool(uniep.build_info().get("cuda_ops")),
        cuda_kernel=_has_cuda_moe_kernel(),
        cpus=_usable_cpus(),
    )
    args.world_size, args.dtype, args.experts = plan.world, plan.dtype, plan.experts
    device, why = plan.device, plan.why
    if args.experts % args.world_size != 0:
        raise SystemExit(
            f"uniep demo: --experts ({args.experts}) must be divisible by --world-size "
            f"({args.world_size})"
        )
    if args.top_k > args.experts:
        raise SystemExit(f"uniep demo: --top-k ({args.top_k}) must be <= --experts")
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
    tol = _TOLERANCE[args.dtype]
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


def _positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    """argparse type of --warmup: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _seed(text: str) -> int:
    """argparse type of --seed: an integer in [0, 2**32), so that the per-rank seeds derived from
    it stay within what torch.Generator.manual_seed takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [0, 2**32), got {text!r}"
        ) from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def _settle_seconds(text: str) -> float:
    """argparse type of --settle-s: a number of seconds in [0, 600]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 600):
        raise argparse.ArgumentTypeError(f"must be a number of seconds in [0, 600], got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    """argparse type of a timeout: a finite number of seconds > 0 (0 would stop every rank at
    once, and nan or inf would never stop a hung one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def _cluster_from_args(args: argparse.Namespace) -> dict[str, float]:
    from .. import parm

    fields = dict(parm.CLUSTERS[args.cluster])
    for name, scale in (
        ("gpus_per_node", 1),
        ("nodes", 1),
        ("intra_bw", 1e9),
        ("inter_bw", 1e9),
        ("intra_alpha", 1e-6),
        ("inter_alpha", 1e-6),
        ("peak_flops", 1e12),
    ):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value * scale
    return fields


def _cmd_parm_simulate(args: argparse.Namespace) -> int:
    from ..parm import sim as parm_sim
    from ..parm.profile import cost_model_from_profile

    cluster = _cluster_from_args(args)
    model = None
    if args.profile:
        with open(args.profile) as f:
            model = cost_model_from_profile(json.load(f))
    rows = parm_sim.simulate(cluster, model=model, dtype_bytes=args.dtype_bytes)
    summary = parm_sim.summarize(rows)
    P = int(cluster["gpus_per_node"] * cluster["nodes"])
    print(
        f"Parm simulator: {len(rows)} layers on {P} GPUs ({int(cluster['nodes'])} nodes x "
        f"{int(cluster['gpus_per_node'])}), predicted fwd+bwd speedup over the baseline"
    )
    print(parm_sim.format_table(summary))
    with open(args.out, "w") as f:
        json.dump(
            {
                "cluster": cluster,
                "profile": args.profile,
                "grid": parm_sim.GRID,
                "summary": summary,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")
    return 0


def _cmd_parm_profile(args: argparse.Namespace) -> int:
    from ..parm.profile import default_sizes, profile

    if args.world_size % args.mp_size or args.world_size == args.mp_size:
        print(
            f"uniep parm profile: --mp-size ({args.mp_size}) must divide --world-size "
            f"({args.world_size}) with at least two MP groups (the EP all-to-all needs them)",
            file=sys.stderr,
        )
        return 2
    sizes = default_sizes(args.device)[: args.sizes]
    try:
        result = profile(
            args.world_size, args.mp_size, sizes, args.iters, args.timeout, device=args.device
        )
    except RuntimeError as exc:
        print(f"uniep parm profile: FAILED: {exc}", file=sys.stderr)
        return 1
    print(
        f"{result['backend']} on {result['device_name']}, {args.world_size} ranks"
        + (" sharing one GPU" if args.device == "cuda" else "")
    )
    print(f"{'collective':<16}{'link':<7}{'alpha (us)':>12}{'beta (ns/B)':>13}{'R^2':>8}")
    for kind, links in result["coefficients"].items():
        for link, c in links.items():
            print(
                f"{kind:<16}{link:<7}{c['alpha'] * 1e6:>12.2f}{c['beta'] * 1e9:>13.4f}"
                f"{c['r2']:>8.4f}"
            )
    g = result["gemm"]
    print(
        f"{'gemm':<16}{'local':<7}{g['alpha'] * 1e6:>12.2f}{g['beta'] * 1e12:>13.4f}"
        f"{g['r2']:>8.4f}  (beta in ps/flop)"
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


# ---- tune ----


class _ProgressBar:
    """A one-line text progress bar on stderr (rewritten in place with a carriage return)."""

    def __init__(self, stream: Any = None, width: int = 30) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width

    def __call__(self, done: int, total: int, what: str) -> None:
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r[{bar}] {done}/{total} {what[:60]:<60}{end}")
        self.stream.flush()


def _tune_rank(rank: int, world: int, cfg: dict[str, Any]) -> Any:
    from ..tuning import tuner

    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
    return tuner.tune(
        tokens=cfg["tokens"],
        hidden=cfg["hidden"],
        ffn=cfg["ffn"],
        experts=cfg["experts"],
        top_k=cfg["top_k"],
        dtype=cfg["dtype"],
        numerics=cfg["numerics"],
        candidates=cfg["candidates"],
        warmup=cfg["warmup"],
        iters=cfg["iters"],
        budget_s=cfg["budget"],
        device=cfg["device"],
        path=cfg["cache"],
        progress=_ProgressBar() if rank == 0 else None,
        weights=cfg["weights"],
        settle_s=cfg["settle_s"],
    )


def _cmd_tune(args: argparse.Namespace) -> int:
    from ..tuning import tuner

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and _has_cuda_moe_kernel() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(
            f"uniep tune: --device cuda --world-size {args.world_size} needs one GPU per rank, "
            f"{torch.cuda.device_count()} visible"
        )
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.experts % args.world_size != 0:
        raise SystemExit(
            f"uniep tune: --experts ({args.experts}) must be divisible by --world-size "
            f"({args.world_size})"
        )
    if args.top_k > args.experts:
        raise SystemExit(f"uniep tune: --top-k ({args.top_k}) must be <= --experts")
    numerics = ",".join(
        f"{key}={value}"
        for key, value in (
            ("dispatch", args.dispatch),
            ("combine", args.combine),
            ("gemm", args.gemm),
        )
        if value is not None
    )
    cfg = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "experts": args.experts,
        "top_k": args.top_k,
        "dtype": dtype,
        "numerics": tuner.normalize_numerics(numerics),
        "candidates": args.candidates,
        "warmup": args.warmup,
        "iters": args.iters,
        "budget": args.budget,
        "device": device,
        "cache": args.cache,
        "weights": args.weights,
        "settle_s": args.settle_s,
    }
    if args.weights != "plain" and (device != "cuda" or dtype != "bfloat16"):
        raise SystemExit(
            f"uniep tune: --weights {args.weights} tunes moe_forward_prepared on CUDA: it needs "
            f"--device cuda and --dtype bfloat16, got {device} and {dtype}"
        )
    target = args.cache or str(tuner.cache_path())
    print(
        f"uniep tune: {args.world_size} rank(s) on {device}, {dtype}, tokens/rank={args.tokens} "
        f"hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k}, "
        f"{cfg['numerics']}, weights {args.weights}",
        file=sys.stderr,
        flush=True,
    )
    if args.world_size == 1:
        result = _tune_rank(0, 1, cfg)
    else:
        from ..distributed import run_local_ranks

        backend = "nccl" if device == "cuda" else "gloo"
        try:
            result = run_local_ranks(
                _tune_rank, args.world_size, (cfg,), backend=backend, timeout_s=args.timeout
            )[0]
        except RuntimeError as exc:
            print(f"uniep tune: FAILED: {exc}", file=sys.stderr)
            return 1
    print(
        f"{result.considered} candidates ranked by the cost model, {result.distinct} of them "
        f"distinct on the {device} executor, {len(result.candidates)} measured (median of "
        f"{args.iters} calls in interleaved rounds, slowest of {result.world_size} rank(s)) on "
        f"{result.device_name}:\n"
    )
    print(result.table())
    print(f"\nchosen: {result.tuning}")
    print(f"  {result.verdict}")
    print(f"  output bits equal to the default's: {_yes(result.bits_identical)}")
    if result.cache_path:
        print(f"  cached in {result.cache_path}")
    else:
        print(f"  NOT cached (see the warning above; target {target})")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uniep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="what this build contains (CUDA, NVSHMEM, CUTLASS, archs)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument(
        "--cmake-prefix-path",
        action="store_true",
        help="print only the folder for CMAKE_PREFIX_PATH (find_package(uniep) from C++)",
    )
    info.set_defaults(func=_cmd_info)

    demo = sub.add_parser(
        "demo",
        help="run an MoE layer forward+backward on local ranks and check it against a reference",
    )
    demo.add_argument(
        "--world-size",
        type=_positive_int,
        default=None,
        help="local ranks to spawn (default: one per visible GPU, or 2 on CPU)",
    )
    demo.add_argument("--tokens", type=_positive_int, default=512, help="tokens per rank")
    demo.add_argument("--hidden", type=_positive_int, default=256)
    demo.add_argument("--ffn", type=_positive_int, default=512, help="expert intermediate width")
    demo.add_argument(
        "--experts",
        type=_positive_int,
        default=None,
        help="experts in total (default: the smallest multiple of the world size >= 8)",
    )
    demo.add_argument("--top-k", type=_positive_int, default=2)
    demo.add_argument(
        "--dtype",
        choices=sorted(_TOLERANCE),
        default=None,
        help="default: bfloat16 on GPUs, float32 on CPU",
    )
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.add_argument("--iters", type=_positive_int, default=3, help="timed iterations (median)")
    demo.add_argument("--seed", type=_seed, default=0)
    demo.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=120.0,
        help="seconds before hung ranks are stopped",
    )
    demo.set_defaults(func=_cmd_demo)

    tune_p = sub.add_parser(
        "tune",
        help="search the schedule keys for one MoE shape, measure the best, cache the winner",
    )
    tune_p.add_argument("--tokens", type=_positive_int, required=True, help="tokens per rank")
    tune_p.add_argument("--hidden", type=_positive_int, required=True)
    tune_p.add_argument("--ffn", type=_positive_int, required=True, help="per expert")
    tune_p.add_argument("--experts", type=_positive_int, required=True, help="in total")
    tune_p.add_argument("--top-k", dest="top_k", type=_positive_int, required=True)
    tune_p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32", "float64"],
        default=None,
        help="default: bfloat16 on GPUs, float32 on CPU",
    )
    tune_p.add_argument("--world-size", type=_positive_int, default=1, help="local ranks")
    tune_p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    tune_p.add_argument(
        "--candidates", type=_positive_int, default=8, help="best predicted points to measure"
    )
    tune_p.add_argument(
        "--iters",
        type=_positive_int,
        default=10,
        help="timed calls each, in 2 to 4 interleaved rounds; a point replaces the default only "
        "when it is faster than the default in every round (1 call: one round, the default stays)",
    )
    tune_p.add_argument("--warmup", type=_non_negative_int, default=2, help="untimed calls each")
    tune_p.add_argument(
        "--budget", type=_positive_seconds, default=None, help="seconds of measuring at most"
    )
    tune_p.add_argument(
        "--cache", default=None, help="cache file (default: $UNIEP_TUNE_CACHE or the user cache)"
    )
    tune_p.add_argument("--dispatch", choices=["bf16", "fp8"], default=None, help="kept as given")
    tune_p.add_argument(
        "--combine", choices=["per_k", "rank_partials"], default=None, help="kept as given"
    )
    tune_p.add_argument("--gemm", choices=["uniep", "torch"], default=None, help="kept as given")
    tune_p.add_argument(
        "--weights",
        choices=["plain", "bf16_packed"],
        default="plain",
        help="plain: moe_forward; bf16_packed: moe_forward_prepared on packed experts (the "
        "separate launches and the MegaKernel), cached under its own key",
    )
    tune_p.add_argument(
        "--settle-s",
        dest="settle_s",
        type=_settle_seconds,
        default=0.0,
        help="seconds each candidate runs back to back before its timed calls, so that it is "
        "timed at the clock a GPU at its power limit settles at (training); 0: short rounds",
    )
    tune_p.add_argument("--timeout", type=_positive_seconds, default=600.0)
    tune_p.set_defaults(func=_cmd_tune)

    parm = sub.add_parser("parm", help="Parm schedules (MP+EP+ESP): simulator and profiler")
    parm_sub = parm.add_subparsers(dest="parm_command", required=True)
    sim = parm_sub.add_parser(
        "simulate", help="price baseline, S1 and S2 over a 1296-layer grid on a described cluster"
    )
    from ..parm import CLUSTERS

    sim.add_argument(
        "--cluster",
        choices=sorted(CLUSTERS),
        default="h100-ib",
        help="preset the options below override",
    )
    sim.add_argument("--gpus-per-node", dest="gpus_per_node", type=_positive_int)
    sim.add_argument("--nodes", type=_positive_int)
    sim.add_argument("--intra-bw", dest="intra_bw", type=float, help="GB/s per GPU")
    sim.add_argument("--inter-bw", dest="inter_bw", type=float, help="GB/s per GPU")
    sim.add_argument("--intra-alpha", dest="intra_alpha", type=float, help="us per hop")
    sim.add_argument("--inter-alpha", dest="inter_alpha", type=float, help="us per hop")
    sim.add_argument("--peak-tflops", dest="peak_flops", type=float)
    sim.add_argument("--dtype-bytes", type=_positive_int, default=2)
    sim.add_argument("--profile", help="JSON of `uniep parm profile`: fitted coefficients")
    sim.add_argument("--out", default="parm-simulate.json", help="JSON output")
    sim.set_defaults(func=_cmd_parm_simulate)
    prof = parm_sub.add_parser(
        "profile",
        help="fit alpha/beta of the collectives on local gloo ranks (CPU) or, with --device "
        "cuda, of the CUDA executor's collectives on local ranks sharing one GPU",
    )
    prof.add_argument("--world-size", type=_positive_int, default=4)
    prof.add_argument("--mp-size", type=_positive_int, default=2)
    prof.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo collectives; cuda: UniEP's CUDA collectives as the Parm CUDA executor "
        "calls them, ranks sharing one GPU (its memory is every link)",
    )
    prof.add_argument("--iters", type=_positive_int, default=5, help="timed runs per size")
    prof.add_argument("--sizes", type=_positive_int, default=16, help="message sizes (<= 16)")
    prof.add_argument("--timeout", type=_positive_seconds, default=300.0)
    prof.add_argument("--out", default="parm-profile.json", help="JSON output")
    prof.set_defaults(func=_cmd_parm_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))
