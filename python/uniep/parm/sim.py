"""The Parm simulator: price baseline, S1 and S2 over a grid of MoE layers on a described cluster.

The default grid has 3^3 * 2^4 * 3 * 2 = 1296 layers (the count of the Parm paper's grid, whose
values are not published; these follow FSMoE's Table 4 with k, N and experts per MP group added):
batch x sequence gives S, the tokens per MP group.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from .. import _C
from . import cluster_spec, rank_layout

GRID: dict[str, tuple] = {
    "batch": (1, 2, 4),
    "seq": (512, 1024, 2048),
    "hidden": (1024, 2048, 4096),
    "ffn_ratio": (2, 4),
    "top_k": (1, 2),
    "capacity_factor": (1.2, 2.4),
    "mp_size": (2, 4, 8),
    "experts_per_group": (1, 2),
}


def grid_configs(grid: dict[str, tuple] | None = None) -> list[dict[str, Any]]:
    """Every combination of the grid's values, as dicts."""
    grid = grid or GRID
    keys = list(grid)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]


def simulate(
    cluster: Any = "h100-ib",
    model: Any = None,
    grid: dict[str, tuple] | None = None,
    dtype_bytes: int = 2,
    profile: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per layer: its configuration, the predicted seconds (forward + backward) of each
    schedule, the choice and its predicted speedup over the baseline. ``model`` (a whole
    ``CostModel``) replaces the cluster's ring-model coefficients for every layout; ``profile``
    (the result of ``uniep parm profile``) replaces only those it measured
    (``profile.profiled_coefficients``), the rest staying the cluster's for each layout. Layers that
    cannot exist on the cluster are left out (:func:`left_out` counts them, :data:`LEFT_OUT`
    says why): those whose MP size does not divide its GPUs (no layout has them), and those with
    fewer experts than their top-k (experts per MP group times the MP groups)."""
    if model is not None and profile is not None:
        raise ValueError("simulate: give model or profile, not both")
    spec = cluster_spec(cluster)
    P = spec.gpus_per_node * spec.nodes
    models: dict[int, Any] = {}
    rows = []
    for cfg in grid_configs(grid):
        N = cfg["mp_size"]
        if _left_out_why(cfg, P):
            continue
        if N not in models:
            models[N] = model or _C.parm.cost_model_from_cluster(
                spec, rank_layout(P, N, spec.gpus_per_node)
            )
            if profile is not None:
                from .profile import cost_model_from_profile

                models[N] = cost_model_from_profile(profile, base=models[N])
        shape = _C.parm.ParmShape(
            world_size=P,
            mp_size=N,
            gpus_per_node=spec.gpus_per_node,
            tokens=cfg["batch"] * cfg["seq"],
            hidden=cfg["hidden"],
            ffn_hidden=cfg["hidden"] * cfg["ffn_ratio"],
            num_experts=cfg["experts_per_group"] * (P // N),
            top_k=cfg["top_k"],
            capacity_factor=cfg["capacity_factor"],
            dtype_bytes=dtype_bytes,
        )
        best, costs = _C.parm.choose(shape, models[N])
        totals = {name: f + b for name, (f, b) in costs.items()}
        rows.append(
            dict(cfg, seconds=totals, choice=best, speedup=totals["baseline"] / totals[best])
        )
    return rows


# Why a grid layer cannot exist on a cluster of P GPUs: key -> what :func:`left_out` reports.
LEFT_OUT = {
    "mp_size": "the MP size must divide the {gpus} GPUs",
    "top_k": "fewer experts than top-k (experts per MP group x {groups} MP group(s))",
}


def _left_out_why(cfg: dict[str, Any], P: int) -> str | None:
    N = cfg["mp_size"]
    if P % N:
        return "mp_size"
    if cfg["experts_per_group"] * (P // N) < cfg["top_k"]:
        return "top_k"
    return None


def left_out(
    cluster: Any = "h100-ib", grid: dict[str, tuple] | None = None
) -> dict[str, dict[int, int]]:
    """The grid's layers :func:`simulate` leaves out on ``cluster``: per reason (a key of
    :data:`LEFT_OUT`, whose text takes ``gpus`` and ``groups``, the MP groups), the count per MP
    size; reasons with no layer are absent."""
    spec = cluster_spec(cluster)
    P = spec.gpus_per_node * spec.nodes
    out: dict[str, dict[int, int]] = {}
    for cfg in grid_configs(grid):
        why = _left_out_why(cfg, P)
        if why:
            per_n = out.setdefault(why, {})
            per_n[cfg["mp_size"]] = per_n.get(cfg["mp_size"], 0) + 1
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per MP size and overall: layers, how often each schedule is chosen, and the geomean / min /
    max predicted speedup of the choice (auto) and of S1 and S2 over the baseline."""

    def one(part: list[dict[str, Any]]) -> dict[str, Any]:
        speed = [r["speedup"] for r in part]
        return {
            "layers": len(part),
            "chosen": {s: sum(r["choice"] == s for r in part) for s in ("baseline", "s1", "s2")},
            "auto_geomean": _geomean(speed),
            "auto_min": min(speed, default=float("nan")),
            "auto_max": max(speed, default=float("nan")),
            "s1_geomean": _geomean([r["seconds"]["baseline"] / r["seconds"]["s1"] for r in part]),
            "s2_geomean": _geomean([r["seconds"]["baseline"] / r["seconds"]["s2"] for r in part]),
        }

    out = {"all": one(rows)}
    for n in sorted({r["mp_size"] for r in rows}):
        out[f"N={n}"] = one([r for r in rows if r["mp_size"] == n])
    return out


def format_table(summary: dict[str, Any]) -> str:
    head = (
        f"{'layers':<8}{'count':>6}{'baseline':>10}{'s1':>6}{'s2':>6}"
        f"{'auto geomean':>14}{'min':>7}{'max':>7}{'s1 gm':>8}{'s2 gm':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        c = s["chosen"]
        lines.append(
            f"{name:<8}{s['layers']:>6}{c['baseline']:>10}{c['s1']:>6}{c['s2']:>6}"
            f"{s['auto_geomean']:>13.2f}x{s['auto_min']:>6.2f}x{s['auto_max']:>6.2f}x"
            f"{s['s1_geomean']:>7.2f}x{s['s2_geomean']:>7.2f}x"
        )
    return "\n".join(lines)
