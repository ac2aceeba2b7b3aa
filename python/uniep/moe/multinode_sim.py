"""The two-level expert-parallel path at scale, on paper (docs/multinode.md).

An alpha-beta model of the two legs (the rail between nodes, NVLink within one) prices the
dispatch, the combine and the layer's exposed communication at EP16-EP256 from the expected
bytes of random top-k routing, beside DeepEP's published internode figures. The NVLink leg's
coefficients are fitted on UniEP's measured dispatch (:func:`fit_leg`); the network leg's are
assumptions (50 GB/s a GPU, as an InfiniBand NDR NIC per GPU gives), because no network leg has
been measured yet. Everything here is a prediction and is labelled as one.

Expected counts come from exact combinatorics, not sampling: a token picks ``top_k`` distinct
experts uniformly among those of ``node_limit`` nodes (DeepSeek-V3's group-limited routing; None:
among all), so the chance that a given node (or rank) holds none of them is a ratio of binomials.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Leg",
    "Layer",
    "DEEPEP_NORMAL_GBS",
    "DEEPEP_LL_US",
    "NVLINK_H200",
    "NETWORK_50GBS",
    "fit_leg",
    "expected_nodes",
    "expected_ranks",
    "simulate",
    "table",
    "format_table",
]


@dataclass(frozen=True)
class Leg:
    """``alpha_us + bytes / gbs``: one leg of one rank's exchange."""

    alpha_us: float
    gbs: float
    source: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gbs) and self.gbs > 0):
            raise ValueError(f"Leg: gbs must be a finite number > 0, got {self.gbs!r}")
        if not math.isfinite(self.alpha_us):
            raise ValueError(f"Leg: alpha_us must be finite, got {self.alpha_us!r}")

    def time_us(self, nbytes: float) -> float:
        return self.alpha_us + nbytes / (self.gbs * 1e3)


def fit_leg(points: list[tuple[float, float]], source: str = "") -> Leg:
    """Least squares of ``time_us = alpha_us + bytes / (gbs * 1e3)`` over ``(bytes, time_us)``
    points (two at least, of different sizes)."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise ValueError("fit_leg needs at least two points of different byte counts")
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((b - mb) ** 2 for b, _ in points)
    sxy = sum((b - mb) * (t - mt) for b, t in points)
    slope = sxy / sxx  # us per byte
    if slope <= 0:
        raise ValueError("fit_leg: the times do not grow with the bytes")
    return Leg(alpha_us=mt - slope * mb, gbs=1e-3 / slope, source=source)


# UniEP's dispatch on 4x H200 (bench_dispatch, 2026-11-26, commit 9b4addf): 211,283,968 bytes
# received a rank in 653.1 us (4096 tokens, H 7168, top-8 of 256, 24 SMs) and the low-latency
# dispatch's 6,623,232 in 45.7 us (128 tokens of 288 experts). Re-fitted from the committed JSON
# by tests/moe/test_multinode_sim.py.
NVLINK_H200 = fit_leg(
    [(211_283_968.0, 653.088), (6_623_232.0, 45.712)],
    source="fitted on bench_dispatch (4x H200, 2026-11-26, 9b4addf)",
)
# Assumed, not measured: one 400 Gb/s NIC a GPU (~50 GB/s) and a few microseconds a message.
NETWORK_50GBS = Leg(alpha_us=5.0, gbs=50.0, source="assumed: 50 GB/s a GPU, 5 us")

# DeepEP's published internode figures (its README, H800 + CX7 400 Gb/s, 4096 tokens, H 7168,
# top-4 groups, top-8, fp8 dispatch, bf16 combine): the RDMA bottleneck bandwidth of normal mode
# (dispatch, combine), and low-latency mode's dispatch and combine latency at 128 tokens.
DEEPEP_NORMAL_GBS = {16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
DEEPEP_LL_US = {
    16: (118.0, 195.0),
    32: (155.0, 273.0),
    64: (173.0, 314.0),
    128: (192.0, 369.0),
    256: (194.0, 360.0),
}


@dataclass(frozen=True)
class Layer:
    """One MoE layer's exchange (DeepSeek-V3's by default) on ``world`` ranks."""

    world: int
    gpus_per_node: int = 8
    tokens: int = 4096  # a rank's tokens
    hidden: int = 7168
    ffn: int = 2048
    experts: int = 256
    top_k: int = 8
    node_limit: int | None = 4  # nodes a token's experts may span (None: any)
    dispatch_bytes_per_elem: float = 1.0 + 4.0 / 128  # fp8 and one fp32 scale per 128
    combine_bytes_per_elem: float = 2.0  # bf16
    gemm_tflops: float = 600.0  # the expert GEMMs' rate a GPU, for the exposed time
    chunks: int = 8  # pieces the overlap cuts the exchange into

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node

    def check(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1 or self.world % self.gpus_per_node:
            raise ValueError(
                f"world ({self.world}) must be a positive multiple of gpus_per_node "
                f"({self.gpus_per_node})"
            )
        if self.experts % self.world:
            raise ValueError(f"experts ({self.experts}) must divide over world ({self.world})")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts], got {self.top_k}")
        if self.node_limit is not None and self.node_limit < 1:
            raise ValueError(f"node_limit must be >= 1 or None, got {self.node_limit}")


def _none_of(pool: int, excluded: int, k: int) -> float:
    """P(k distinct picks from ``pool`` avoid ``excluded`` given items)."""
    if pool - excluded < k:
        return 0.0
    return math.comb(pool - excluded, k) / math.comb(pool, k)


def _span(layer: Layer) -> int:
    """Nodes a token's experts are drawn from."""
    n = layer.nodes
    return n if layer.node_limit is None else min(layer.node_limit, n)


def expected_nodes(layer: Layer) -> float:
    """Distinct nodes a token's ``top_k`` experts land on."""
    span = _span(layer)
    per_node = layer.experts // layer.nodes
    return span * (1.0 - _none_of(span * per_node, per_node, layer.top_k))


def expected_ranks(layer: Layer) -> float:
    """Distinct ranks a token's ``top_k`` experts land on."""
    span = _span(layer)
    per_node = layer.experts // layer.nodes
    per_rank = layer.experts // layer.world
    ranks = span * layer.gpus_per_node
    return ranks * (1.0 - _none_of(span * per_node, per_rank, layer.top_k))


def _pipelined(legs: list[tuple[Leg, float]]) -> float:
    """Legs cut into chunks and overlapped: every leg's latency, then the slowest leg's bytes."""
    return sum(leg.alpha_us for leg, _ in legs) + max(
        nbytes / (leg.gbs * 1e3) for leg, nbytes in legs
    )


def simulate(
    layer: Layer, nvlink: Leg = NVLINK_H200, network: Leg = NETWORK_50GBS
) -> dict[str, float]:
    """One rank's predicted exchange, in microseconds and bytes.

    Dispatch: one row per (token, remote node) on the rail, then one per (token, rank) of the
    node over NVLink. Combine ``per_k``: one row per (token, k) back over NVLink and per remote
    (token, k) on the rail; ``node_partials``: per (token, k) over NVLink, per (token, remote
    node) on the rail. ``flat_*``: a one-level exchange for comparison (every (token, rank) row
    to a remote node crosses the network). ``exposed_us``: what the overlap leaves uncovered with
    ``chunks`` pieces (the first dispatch and the last combine piece, and whatever of the rest
    outlasts the expert GEMMs).
    """
    layer.check()
    n, g = layer.nodes, layer.gpus_per_node
    t, k, h = layer.tokens, layer.top_k, layer.hidden
    remote = (n - 1) / n
    nodes, ranks = expected_nodes(layer), expected_ranks(layer)
    row_d, row_c = h * layer.dispatch_bytes_per_elem, h * layer.combine_bytes_per_elem
    in_node = (g - 1) / g
    out: dict[str, float] = {
        "world": layer.world,
        "nodes": n,
        "tokens": t,
        "nodes_per_token": nodes,
        "ranks_per_token": ranks,
    }
    rail_d = t * nodes * remote * row_d
    nvl_d = t * ranks * in_node * row_d
    out["dispatch_rail_bytes"] = rail_d
    out["dispatch_us"] = _pipelined([(network, rail_d), (nvlink, nvl_d)])
    out["dispatch_rail_gbs"] = rail_d / out["dispatch_us"] / 1e3
    flat_rail = t * ranks * (layer.world - g) / layer.world * row_d
    out["flat_dispatch_rail_bytes"] = flat_rail
    flat_nvl = t * ranks * (g - 1) / layer.world * row_d
    out["flat_dispatch_us"] = _pipelined([(network, flat_rail), (nvlink, flat_nvl)])
    nvl_c = t * k * in_node * row_c
    for name, rail_rows in (("per_k", t * k * remote), ("node_partials", t * nodes * remote)):
        rail_c = rail_rows * row_c
        out[f"combine_{name}_rail_bytes"] = rail_c
        out[f"combine_{name}_us"] = _pipelined([(network, rail_c), (nvlink, nvl_c)])
        out[f"combine_{name}_rail_gbs"] = rail_c / out[f"combine_{name}_us"] / 1e3
    gemm_us = t * k * 6.0 * h * layer.ffn / (layer.gemm_tflops * 1e6)
    out["gemm_us"] = gemm_us
    for name in ("per_k", "node_partials"):
        comm = out["dispatch_us"] + out[f"combine_{name}_us"]
        head_tail = comm / layer.chunks
        exposed = head_tail + max(0.0, comm - head_tail - gemm_us)
        out[f"exposed_{name}_us"] = exposed
        out[f"exposed_{name}_share"] = exposed / (gemm_us + exposed)
    return out


def table(
    worlds: tuple[int, ...] = (16, 32, 64, 128, 256),
    nvlink: Leg = NVLINK_H200,
    network: Leg = NETWORK_50GBS,
    **layer_fields: Any,
) -> list[dict[str, float]]:
    """:func:`simulate` at each world size in normal mode (4096 tokens a rank) and low-latency
    mode (128 tokens, no node limit, as DeepEP's low-latency test routes), with DeepEP's
    published figures beside them where it has some."""
    rows = []
    for world in worlds:
        normal = simulate(Layer(world=world, **layer_fields), nvlink, network)
        ll_fields = {**layer_fields, "tokens": 128, "node_limit": None}
        ll = simulate(Layer(world=world, **ll_fields), nvlink, network)
        row = {**normal}
        row["ll_dispatch_us"] = ll["dispatch_us"]
        row["ll_combine_us"] = ll["combine_per_k_us"]
        row["ll_combine_node_partials_us"] = ll["combine_node_partials_us"]
        if world in DEEPEP_NORMAL_GBS:
            row["deepep_dispatch_rail_gbs"], row["deepep_combine_rail_gbs"] = DEEPEP_NORMAL_GBS[
                world
            ]
        if world in DEEPEP_LL_US:
            row["deepep_ll_dispatch_us"], row["deepep_ll_combine_us"] = DEEPEP_LL_US[world]
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, float]]) -> str:
    """The rows of :func:`table` as two markdown tables: normal mode (per rank, 4096 tokens) and
    low-latency mode (128 tokens), DeepEP's published figures beside the predictions."""

    def cell(row: dict[str, float], key: str, fmt: str = "{:.0f}") -> str:
        return fmt.format(row[key]) if key in row else "-"

    lines = [
        "| EP | nodes a token | dispatch us | rail GB/s (DeepEP) | flat dispatch us | "
        "combine per_k us | combine node_partials us | rail GB/s (DeepEP) | "
        "exposed per_k / node_partials |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']:.0f} | {r['nodes_per_token']:.2f} | {r['dispatch_us']:.0f} | "
            f"{r['dispatch_rail_gbs']:.0f} ({cell(r, 'deepep_dispatch_rail_gbs')}) | "
            f"{r['flat_dispatch_us']:.0f} | {r['combine_per_k_us']:.0f} | "
            f"{r['combine_node_partials_us']:.0f} | {r['combine_node_partials_rail_gbs']:.0f} "
            f"({cell(r, 'deepep_combine_rail_gbs')}) | {r['exposed_per_k_share']:.0%} / "
            f"{r['exposed_node_partials_share']:.0%} |"
        )
    lines += [
        "",
        "| EP | LL dispatch us (DeepEP) | LL combine per_k us | LL combine node_partials us "
        "(DeepEP) |",
        "|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']:.0f} | {r['ll_dispatch_us']:.0f} ({cell(r, 'deepep_ll_dispatch_us')}) "
            f"| {r['ll_combine_us']:.0f} | {r['ll_combine_node_partials_us']:.0f} "
            f"({cell(r, 'deepep_ll_combine_us')}) |"
        )
    return "\n".join(lines)
