"""``uniep parm profile``: measure the collectives the Parm cost model prices, fit alpha/beta.

On local gloo ranks (CPU) in the Parm layout: all-gather, reduce-scatter and all-reduce over the
MP groups, all-to-all over the EP groups, each over a range of message sizes (the cost model's
convention: all-gather output, reduce-scatter input, all-reduce buffer, all-to-all per-rank send
bytes), plus a GEMM (torch.matmul) for the compute coefficients. A sample's time is the slowest
rank's median; the fit is ``fit_alpha_beta``. The MP groups count as intra-node and the EP groups
as inter-node, as on a cluster with one MP group per node, though here every link is the loopback.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from . import _C
from .parm import fit_alpha_beta, new_groups

# Message sizes in bytes, 1 MiB .. 16 MiB in 16 even steps (FSMoE's profile also steps linearly):
# large enough that the bandwidth term stands out of the scheduling noise of shared CPU cores.
DEFAULT_SIZES = [2**20 * i for i in range(1, 17)]
GEMM_SIZES = [(64 * i, 256, 256) for i in range(1, 13)]  # (m, k, n)


def _time(fn: Any, iters: int, group: Any = None, sync: bool = True) -> float:
    fn()  # warm-up (buffers, connections)
    times = []
    for _ in range(iters):
        if sync:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collective(kind: str, n_bytes: int, group: Any, size: int) -> Any:
    elems = max(size, n_bytes // 4 // size * size)  # divisible by the group size
    if kind == "all_gather":
        inp, out = torch.ones(elems // size), torch.empty(elems)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = torch.ones(elems), torch.empty(elems // size)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    if kind == "all_reduce":
        buf = torch.ones(elems)
        return lambda: dist.all_reduce(buf, group=group)
    inp, out = torch.ones(elems), torch.empty(elems)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def profile_rank(rank: int, world: int, mp_size: int, sizes: list[int], iters: int) -> dict:
    """Every rank's median seconds per (collective, link, size), and rank 0's GEMM times."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor names, deprecated
    mp, ep = new_groups(mp_size)
    out: dict[str, Any] = {"comm": {}, "gemm": []}
    plan = [
        ("all_gather", "intra", mp, mp_size),
        ("reduce_scatter", "intra", mp, mp_size),
        ("all_reduce", "intra", mp, mp_size),
        ("all_to_all", "inter", ep, world // mp_size),
    ]
    for kind, link, group, size in plan:
        if size == 1:
            continue
        out["comm"][f"{kind}/{link}"] = [
            (n, _time(_collective(kind, n, group, size), iters, group)) for n in sizes
        ]
    if rank == 0:  # alone: the other ranks wait in the barrier below
        for m, k, n in GEMM_SIZES:
            a, b = torch.randn(m, k), torch.randn(k, n)
            t = _time(lambda a=a, b=b: a @ b, iters, sync=False)
            out["gemm"].append((2.0 * m * k * n, t))
    dist.barrier()
    return out


def profile(
    world: int = 4,
    mp_size: int = 2,
    sizes: list[int] | None = None,
    iters: int = 5,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Run the profile on ``world`` local gloo ranks and fit every (collective, link)."""
    from .distributed import run_local_ranks

    sizes = sizes or DEFAULT_SIZES
    per_rank = run_local_ranks(profile_rank, world, (mp_size, sizes, iters), timeout_s=timeout_s)
    result: dict[str, Any] = {
        "world_size": world,
        "mp_size": mp_size,
        "iters": iters,
        "coefficients": {},
    }
    for key in per_rank[0]["comm"]:
        # A collective is as slow as its slowest rank.
        samples = [
            (n, max(r["comm"][key][i][1] for r in per_rank))
            for i, (n, _) in enumerate(per_rank[0]["comm"][key])
        ]
        fit = fit_alpha_beta([n for n, _ in samples], [t for _, t in samples])
        kind, link = key.split("/")
        result["coefficients"].setdefault(kind, {})[link] = {
            "alpha": fit.alpha,
            "beta": fit.beta,
            "r2": fit.r2,
            "samples": samples,
        }
    gemm = per_rank[0]["gemm"]
    fit = fit_alpha_beta([f for f, _ in gemm], [t for _, t in gemm])
    result["gemm"] = {"alpha": fit.alpha, "beta": fit.beta, "r2": fit.r2, "samples": gemm}
    return result


def cost_model_from_profile(result: dict[str, Any], base: Any = None) -> Any:
    """A ``CostModel`` with the profile's coefficients; what it did not measure comes from
    ``base`` (another CostModel) or is zero."""
    model = base or _C.parm.CostModel()
    for kind, links in result["coefficients"].items():
        for link, c in links.items():
            model.set(kind, link, _C.parm.AlphaBeta(c["alpha"], c["beta"]))
    if "gemm" in result:
        model.gemm = _C.parm.AlphaBeta(result["gemm"]["alpha"], result["gemm"]["beta"])
    return model


def measure_rank(rank: int, world: int, mp_size: int, layers: list[dict], iters: int) -> list:
    """Median seconds of ParmMoELayer forward+backward per layer config and schedule."""
    from .parm import SCHEDULES, ParmMoELayer

    mp, ep = new_groups(mp_size)
    out = []
    for cfg in layers:
        times = {}
        for schedule in SCHEDULES:
            torch.manual_seed(0)
            layer = ParmMoELayer(
                mp,
                ep,
                cfg["hidden"],
                cfg["ffn_hidden"],
                cfg["num_experts"],
                cfg["top_k"],
                capacity_factor=cfg["capacity_factor"],
                schedule=schedule,
                overflow="drop",
            )
            x = torch.randn(
                cfg["tokens"], cfg["hidden"], generator=torch.Generator().manual_seed(1)
            )

            def step(layer: ParmMoELayer = layer, x: torch.Tensor = x) -> None:
                y = layer(x.requires_grad_())
                (y.sum() + layer.l_aux).backward()

            times[schedule] = _time(step, iters)
        out.append(times)
    return out


def measure_layers(
    world: int,
    mp_size: int,
    layers: list[dict],
    iters: int = 3,
    model: Any = None,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Measure every schedule of every layer on local gloo ranks (the slowest rank's median) and
    set beside it the cost model's prediction: per layer the measured and predicted seconds, the
    predicted choice, the measured best, and the regret of the choice."""
    from .distributed import run_local_ranks
    from .parm import plan

    per_rank = run_local_ranks(measure_rank, world, (mp_size, layers, iters), timeout_s=timeout_s)
    rows = []
    for i, cfg in enumerate(layers):
        measured = {s: max(r[i][s] for r in per_rank) for s in per_rank[0][i]}
        p = plan(world, mp_size, dtype=torch.float32, gpus_per_node=mp_size, model=model, **cfg)
        best = min(measured, key=measured.get)
        rows.append(
            dict(
                cfg,
                measured=measured,
                predicted={s: v["total"] for s, v in p.predicted.items()},
                chosen=p.schedule,
                measured_best=best,
                right=p.schedule == best,
                regret=measured[p.schedule] / measured[best] - 1,
            )
        )
    return rows
