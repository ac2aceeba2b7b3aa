"""One headline table per benchmark: our figure, the peer's from the same run, their ratio, the
goal and whether it is met (``bench/harness/summarize.py`` prints them; ``bench/run_all.sh`` ends
with them).

Each benchmark has one :class:`Spec` in :data:`SPECS`, keyed by its name: the columns that name a
case (from the row's keys), and its :class:`Figure` s, each with the field that holds our figure,
the peer's field (the baseline timed in the same run), the unit and the goals. :func:`headline`
raises :class:`SpecMismatch` when a result lacks a field its spec names, and summarize.py then
prints the generic table with that reason under it.

Field paths: ``dispatch_us_max`` (a key of the row), ``ms.fwd_sequential`` (a key of a dict in the
row; a key that itself holds a dot or brackets, like ``ms[uniep]``, is tried whole first),
``measured.{chosen}`` (``{field}`` filled from the row), ``@config.goal_ideal`` (from the result
file, beside its rows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

# Figures whose larger value is the better one; every other unit is a cost (ms, us, mJ, x).
HIGHER_IS_BETTER = ("GB/s", "TFLOP/s", "tokens/s")
# A peer's name longer than this (or with a space) goes under the table, not into column names.
_SHORT_NAME = 20
_MISSING = object()


class SpecMismatch(Exception):
    """A result that its benchmark's spec does not fit (a field missing, or not a number)."""


@dataclass(frozen=True)
class Goal:
    """``of <op> value``. ``value``: a number, a field path (the goal the benchmark recorded), or
    numbers by the value of the row's field ``by``. ``of``: ``"ours"`` (our figure, in the
    figure's unit), ``"ratio"`` (the ratio column) or a field path (shown with its value)."""

    op: str
    value: float | str | Mapping[str, float]
    of: str = "ours"
    label: str = ""
    unit: str = ""
    by: str = ""
    where: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Figure:
    """One measured figure of a benchmark's rows (those that match ``where``).

    ``ours`` and ``peer``: field paths of our figure and the peer's, shown times ``scale`` in
    ``unit``; ``peer_name`` may hold ``{field}``s of the peer's row. ``check``: a field path that
    must be true (or ``"pass"``) for the goal to count as met. ``optional``: rows without the
    figure's fields are left out instead of failing the spec. ``case``: column -> template,
    replacing the spec's case columns for this figure."""

    label: str
    ours: str
    unit: str
    peer: str = ""
    peer_name: str = ""
    scale: float = 1.0
    where: Mapping[str, Any] = field(default_factory=dict)
    goals: tuple[Goal, ...] = ()
    check: str = ""
    optional: bool = False
    case: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Pair:
    """Our figure and the peer's in two rows of one case: a row whose ``field`` is a key of
    ``peers`` is ours; its peer is the row of the same case whose ``field`` matches the value
    (an fnmatch pattern). The ``field`` becomes a case column."""

    field: str
    peers: Mapping[str, str]


@dataclass(frozen=True)
class Spec:
    """A benchmark's headline: what it measures (``title``), the case columns (column ->
    ``{field}`` template; a plain field name is its own column), its figures, and how the ratio
    reads: ``"time"`` is ours / peer time (below 1: ours faster), ``"speedup"`` peer / ours time
    (above 1: ours faster)."""

    title: str
    case: Mapping[str, str]
    figures: tuple[Figure, ...]
    ratio: str = "time"
    where: Mapping[str, Any] = field(default_factory=dict)
    pair: Pair | None = None
    note: str = ""


def _case(*fields: str, **named: str) -> dict[str, str]:
    """Case columns: each field under its own name, then ``column=template``."""
    return {f: "{" + f + "}" for f in fields} | named


# fmt: off
SPECS: dict[str, Spec] = {
    "bench_dispatch": Spec(
        title="EP dispatch and combine against NCCL all_to_all_single of the same rows "
              "(slowest rank's median)",
        case=_case(shape="{shape}", SMs="{num_sms}", W="{world_size}"),
        # The goals' SM budget (at most 24 SMs).
        where={"num_sms": 24},
        figures=(
            Figure("bf16 dispatch", "dispatch_us_max", "us", "nccl_dispatch_us_max", "NCCL",
                   goals=(Goal(">=", "goal_dispatch_GBps", "dispatch_GBps", unit="GB/s",
                               where={"shape": "dsv3"}),)),
            Figure("bf16 dispatch, cached plan", "cached_dispatch_us_max", "us",
                   "nccl_dispatch_us_max", "NCCL"),
            # 300 GB/s: the fp8 dispatch goal (bench/harness/multigpu_summary.py DISPATCH_FP8_GBPS;
            # results of bench_dispatch from before it recorded goal_fp8_dispatch_GBps lack it).
            Figure("fp8 dispatch", "fp8_dispatch_us_max", "us", "nccl_dispatch_us_max", "NCCL",
                   optional=True,
                   goals=(Goal(">=", 300.0, "fp8_dispatch_GBps", unit="GB/s",
                               where={"shape": "dsv3"}),)),
            Figure("combine, a row per (token, k)", "combine_us_max", "us", "nccl_combine_us_max",
                   "NCCL",
                   goals=(Goal(">=", "goal_combine_GBps", "combine_GBps", unit="GB/s",
                               where={"shape": "dsv3"}),)),
            Figure("combine rank_partials", "rank_partials_combine_us_max", "us",
                   "nccl_combine_us_max", "NCCL",
                   goals=(Goal(">=", "goal_combine_GBps", "rank_partials_combine_GBps",
                               unit="GB/s", where={"shape": "dsv3"}),)),
            Figure("low-latency dispatch + combine", "ll_total_us_max", "us", "nccl_total_us_max",
                   "NCCL", optional=True, goals=(Goal("<=", "goal_ll_total_us"),)),
        ),
        note="DeepEP's figures in the JSON (deepep_*) are ANCHORS.md's, from another run: not a "
             "peer here. Other SM budgets: summarize.py --detail.",
    ),
    "bench_moe_ep": Spec(
        title="the MoE layer at EP = world against all-to-all + expert GEMMs in torch "
              "(slowest rank's median)",
        case=_case("shape", W="{world_size}"),
        figures=(
            Figure("forward, overlap=sequential", "ms.fwd_sequential", "ms", "ms.fwd_baseline",
                   "{baseline}",
                   goals=(Goal("<=", "goal_forward_over_experts", "forward_over_experts",
                               "fwd/expert GEMMs"),)),
            Figure("forward, MegaKernel (best point)", "ms.fwd_megakernel_best", "ms",
                   "ms.fwd_baseline", "{baseline}", optional=True,
                   goals=(Goal("<=", "goal_forward_over_experts", "megakernel_over_experts",
                               "fwd/expert GEMMs"),)),
            Figure("forward + backward", "ms.fwd_bwd_sequential", "ms", "ms.fwd_bwd_baseline",
                   "{baseline}"),
            Figure("uniep.tune's pick / best re-timed point", "pick_over_best", "x",
                   optional=True, goals=(Goal("<=", "goal_tune"),)),
        ),
    ),
    "bench_moe": Spec(
        title="the MoE layer forward against all-to-all + per-expert GEMMs in plain torch",
        case=_case("shape", W="{world_size}"),
        pair=Pair("impl", {"uniep": "baseline*", "uniep combine=rank_partials": "baseline*"}),
        # No goal: neither the benchmark nor ANCHORS.md sets one against this baseline.
        figures=(Figure("forward", "median_ms", "ms", "median_ms", "{impl}"),),
    ),
    "bench_layout": Spec(
        title="routing layout and row lists against plain torch, outputs equal",
        case=_case("shape", W="{world_size}"),
        ratio="speedup",
        pair=Pair("impl", {"uniep": "torch", "uniep graph": "torch graph",
                           "uniep expert_rows": "torch expert_rows"}),
        # No goal: neither the benchmark nor ANCHORS.md sets one.
        figures=(Figure("median time", "median_ms", "us", "median_ms", "torch", scale=1e3),),
    ),
    "bench_gemm": Spec(
        title="sm90_gemm against cuBLAS on the TP chunk shapes (bf16)",
        case=_case("M", "K", "N"),
        # No goal: neither the benchmark nor ANCHORS.md sets one.
        figures=(
            Figure("A @ B, every SM (cuBLAS: torch.mm)", "sm90_carve0_ms", "ms", "cublas_ms",
                   "cuBLAS"),
            Figure("A @ B + C (cuBLAS: torch.addmm)", "sm90_addend_ms", "ms", "cublas_addmm_ms",
                   "cuBLAS"),
        ),
    ),
    "grouped_variants": Spec(
        title="the expert GEMM's CUTLASS configurations on the expert loads (a sweep, bf16)",
        case=_case("load", "tokens", "gemm"),
        # No goal: a sweep to choose configurations by, held to the engine's bits.
        figures=(
            Figure("the sweep's best point (best_point in the JSON)", "best_ms", "ms", "engine_ms",
                   "the engine's grouped_mm"),
            Figure("the engine's grouped_mm (its automatic choice)", "engine_ms", "ms",
                   "torch_ms", "torch._grouped_mm", optional=True),
        ),
    ),
    "bench_experts": Spec(
        title="the expert GEMM engine and the MoE layer at world 1",
        case=_case("load"),
        figures=(
            Figure("grouped GEMM", "uniep_ms", "ms", "torch_ms", "torch._grouped_mm",
                   where={"part": "kernel"}),
            # Per load, over max(dense cuBLAS chain, weight read): bench_experts.GOALS (the
            # expert GEMM engine issue; ANCHORS.md "One GPU, world 1"); not in the JSON.
            Figure("moe_forward", "ms[uniep]", "ms", "ms[torch._grouped_mm]", "torch._grouped_mm",
                   where={"part": "layer"},
                   goals=(Goal("<=", {"dsv3-ep8-rank": 1.10, "mixtral-ep4-rank": 1.05,
                                      "qwen3-30b-a3b": 1.15, "dsv3-256-experts": 1.15},
                               "over_floor[uniep]", "ours/floor", by="load"),)),
            # ANCHORS.md "One GPU, world 1": the fp8 layer <= 0.6x the bf16 layer.
            Figure("fp8 layer (prepared, dispatch=fp8)", "ms[fp8]", "ms", where={"part": "layer"},
                   goals=(Goal("<=", 0.6, "over_bf16_layer[fp8]", "ours/bf16 layer"),)),
            # bench_experts.BACKWARD_GOAL: moe_backward <= 1.15x the dense chain's fwd + bwd.
            Figure("moe_backward", "backward_ms[uniep]", "ms", "backward_ms[torch._grouped_mm]",
                   "torch._grouped_mm", where={"part": "layer"},
                   goals=(Goal("<=", 1.15, "backward_over_dense_fwd_bwd[uniep]",
                               "ours/dense fwd+bwd"),)),
            Figure("moe_backward", "backward_ms[uniep]", "ms", where={"part": "backward"},
                   goals=(Goal("<=", 1.15, "backward_over_dense_fwd_bwd[uniep]",
                               "ours/dense fwd+bwd"),)),
            # The MegaKernel's goal, 1.03x the engine's two GEMMs alone (the tune rows record it
            # as goal_fused; the local rows do not).
            Figure("MegaKernel at world 1, best point", "ms[local fused]", "ms",
                   where={"part": "local"}, optional=True,
                   goals=(Goal("<=", 1.03, "over_gemm_only[local fused]", "ours/GEMMs alone"),)),
            Figure("uniep.tune's pick / best re-timed point", "pick_over_best", "x",
                   where={"part": "tune"}, goals=(Goal("<=", "goal_tune"),)),
            Figure("best MegaKernel point / GEMMs alone", "best_fused_over_gemm_only", "x",
                   where={"part": "tune"}, goals=(Goal("<=", "goal_fused"),)),
        ),
    ),
    "bench_decode": Spec(
        title="MoE decode at world 1: the low-latency path (the MegaKernel without a host sync, "
              "replayed in a CUDA graph) against reading the touched experts' weights once",
        case=_case("load", T="{tokens}", touched="{touched}"),
        figures=(
            # The fine-grained experts issue's goals: <= 1.25x the weight read, and <= 40 us for
            # one token of the small experts (whose eight read in ~19 us; the large experts' take
            # ~170, so the ratio holds there too).
            Figure("CUDA graph of the fused layer", "graph[local fused]", "us", "floor_ms",
                   "weight read at the measured HBM rate", scale=1e3,
                   goals=(Goal("<=", 40.0, where={"tokens": 1, "load": "qwen3-128"}),
                          Goal("<=", 1.25, "ratio", where={"tokens": (16, 64, 128, 256, 512)}),
                          Goal("<=", 1.25, "ratio", where={"tokens": 1, "load": "dsv3-256"}))),
            Figure("its tile choice against 64 x 256 tiles", "graph[local fused]", "us",
                   "graph[local 64x256]", "64 x 256", scale=1e3, optional=True),
            Figure("torch.ops.uniep.moe_forward, eager", "ms[moe_forward]", "us", "floor_ms",
                   "weight read at the measured HBM rate", scale=1e3),
        ),
    ),
    "bench_multinode": Spec(
        title="the two-level path (logical nodes, combine=node_partials) against one node on the "
              "same ranks, and its rail alone (slowest rank's median)",
        case=_case("layout", "device", "rail"),
        # No goal yet: docs/multinode.md's simulator predicts; this measures the legs it fits.
        figures=(
            Figure("layer forward, two levels", "ms.two_level", "ms", "ms.flat", "one node",
                   check="check.pass"),
            Figure("rail exchange", "rail_gbs", "GB/s", optional=True),
        ),
    ),
    "bench_power": Spec(
        title="the world-1 MoE forward and its parts run back to back, at the GPU's power cap",
        case=_case("load", "variant"),
        where={"variant": ("gemm_only", "gemms_combine", "sequential", "fused")},
        # No goal: the benchmark explains the cap; it sets none.
        figures=(
            Figure("time per call", "ms_per_call", "ms"),
            Figure("energy per call", "mj_per_call", "mJ"),
        ),
    ),
    "bench_parm": Spec(
        title="Parm: the cost model's schedule choice, measured and simulated",
        case={"case": ""},
        figures=(
            Figure("the cost model chose the measured-faster schedule", "right_fraction",
                   "of layers", where={"kind": "choice"}, goals=(Goal(">=", "goal"),),
                   case={"case": "{layers} layers, W {world_size}, MP {mp_size}"}),
            Figure("measured speedup of auto over the baseline (geomean)",
                   "auto_speedup_measured", "x", "auto_speedup_predicted", "predicted",
                   where={"kind": "choice"}, optional=True,
                   case={"case": "{layers} layers, W {world_size}, MP {mp_size}"}),
            Figure("predicted speedup of auto over the baseline (geomean)", "auto_geomean", "x",
                   where={"kind": "simulate"}, goals=(Goal(">=", "goal"),),
                   case={"case": "{cluster}, {layers} layers"}),
            Figure("fwd+bwd time of the chosen schedule", "measured.{chosen}", "ms",
                   "measured.baseline", "baseline schedule", scale=1e3,
                   where={"kind": "measure"},
                   case={"case": "T {tokens}, H {hidden}, I {ffn_hidden}, E {num_experts}, "
                                 "top-{top_k}, chose {chosen}"}),
        ),
    ),
    "bench_overlap": Spec(
        title="TP AG+GEMM and GEMM+RS against NCCL + torch.mm, and the DP reduce-scatter beside "
              "a GEMM against NCCL's (slowest rank's median)",
        case=_case(TP="{tp}", shape="{shape}"),
        figures=(
            Figure("AG+GEMM", "ours_best_ms", "ms", "nccl_mm_ms", "NCCL", where={"kind": "ag_mm"},
                   check="check",
                   goals=(Goal("<=", "@config.goal_ideal", "ratio_to_ideal", "ours/ideal"),
                          Goal("<=", "@config.goal_baseline", "ratio"))),
            Figure("GEMM+RS", "ours_best_ms", "ms", "nccl_mm_ms", "NCCL", where={"kind": "mm_rs"},
                   check="check",
                   goals=(Goal("<=", "@config.goal_ideal", "ratio_to_ideal", "ours/ideal"),
                          Goal("<=", "@config.goal_baseline", "ratio"))),
            # DP's goal is NCCL's overlap alone (bench_overlap: the ideal is reported only).
            Figure("DP reduce-scatter beside a GEMM", "ours_best_ms", "ms", "nccl_overlap_ms",
                   "NCCL", where={"kind": "dp_rs"}, check="check",
                   goals=(Goal("<=", "@config.goal_baseline", "ratio"),)),
        ),
    ),
    "bench_ulysses_ag": Spec(
        title="the Ulysses all-to-all and the DP all-gather beside a GEMM against NCCL "
              "(slowest rank's median)",
        case=_case(W="{tp}", shape="{shape}"),
        # Goal 1: bench_ulysses_ag.GOAL_BASELINE, ours no slower than NCCL (the issue's
        # "beside NCCL"); the JSON records only the verdict, goal_met.
        figures=(
            Figure("Ulysses seq -> heads", "ms.ours", "ms", "ms.nccl", "NCCL",
                   where={"kind": "ulysses_seq_to_heads"}, check="check.pass",
                   goals=(Goal("<=", 1.0, "ratio"),)),
            Figure("Ulysses heads -> seq", "ms.ours", "ms", "ms.nccl", "NCCL",
                   where={"kind": "ulysses_heads_to_seq"}, check="check.pass",
                   goals=(Goal("<=", 1.0, "ratio"),)),
            Figure("DP all-gather beside a GEMM", "ms.ours_best", "ms", "ms.nccl_overlap", "NCCL",
                   where={"kind": "dp_ag"}, check="check.pass",
                   goals=(Goal("<=", 1.0, "ratio"),)),
        ),
    ),
}
# fmt: on


# ---- reading rows ----


def lookup(payload: Mapping[str, Any], row: Mapping[str, Any], path: str) -> Any:
    """The value at ``path`` (see the module docstring), or ``_MISSING``."""
    obj: Any = row
    if path.startswith("@"):
        obj, path = payload, path[1:]
    if "{" in path:
        try:
            path = path.format_map(row)
        except (KeyError, ValueError, IndexError):
            return _MISSING
    while isinstance(obj, Mapping):
        if path in obj:
            return obj[path]
        head, dot, path = path.partition(".")
        if not dot or head not in obj:
            return _MISSING
        obj = obj[head]
    return _MISSING


def _fill(template: str, row: Mapping[str, Any]) -> str:
    """``template`` with the row's fields, ``-`` where one is missing."""
    try:
        return template.format_map({k: _text(v) for k, v in row.items()})
    except (KeyError, ValueError, IndexError):
        return "-"


def _text(value: Any) -> Any:
    if isinstance(value, dict | list):
        return "-"  # per-rank or nested detail is no name for a case
    return f"{value:g}" if isinstance(value, float) else value


def not_measured(row: Mapping[str, Any]) -> str | None:
    """Why a row holds no measurement (skipped, failed), or None for a measured row."""
    if "error" in row:
        lines = str(row["error"]).strip().splitlines()
        return "FAILED: " + (lines[-1] if lines else "?")
    for key in ("skipped", "status"):
        if key in row:
            return str(row[key])
    if row.get("kind") == "skipped":
        return str(row.get("why", "skipped"))
    return None


def _matches(row: Mapping[str, Any], where: Mapping[str, Any]) -> bool:
    """Whether the row holds each ``where`` value (or one of a tuple of values)."""
    for key, want in where.items():
        allowed = want if isinstance(want, tuple) else (want,)
        if row.get(key, _MISSING) not in allowed:
            return False
    return True


def _number(value: Any, what: str) -> float | None:
    """A figure as a float; None where the JSON says null (not measured)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecMismatch(f"{what} is {type(value).__name__} {str(value)[:40]!r}, not a number")
    return float(value) if math.isfinite(value) else None


# ---- formatting ----


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    size = abs(value)
    if unit in ("x", "of layers") and size < 100:
        return f"{value:.3f}"
    if size >= 1e3:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 10:
        return f"{value:.2f}"
    return f"{value:#.4g}"


def _limit(value: float) -> str:
    return f"{value:g}"


def _short(name: str) -> bool:
    """Whether a peer's name fits in a column name (``NCCL``, ``torch._grouped_mm``)."""
    return len(name) <= _SHORT_NAME and not any(c in name for c in " {")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


# ---- the table ----


@dataclass
class _Row:
    case: dict[str, str]
    figure: str
    unit: str
    ours: float | None
    peer: float | None = None
    peer_name: str = ""
    ratio: float | None = None
    goal: str = "-"
    met: str = "-"


def _ratio(spec: Spec, unit: str, ours: float | None, peer: float | None) -> float | None:
    if ours is None or peer is None or ours <= 0 or peer <= 0:
        return None
    time_ratio = peer / ours if unit in HIGHER_IS_BETTER else ours / peer
    return time_ratio if spec.ratio == "time" else 1.0 / time_ratio


def ratio_label(spec: Spec, peer: str) -> str:
    """The ratio column's name: ``ours/NCCL time`` or ``torch/ours speedup``."""
    if spec.ratio == "time":
        return f"ours/{peer} time"
    return f"{peer}/ours speedup"


def _goals(
    payload: Mapping[str, Any],
    row: Mapping[str, Any],
    fig: Figure,
    got: _Row,
    ratio_name: str,
    where: str,
) -> None:
    """Fill ``got.goal`` and ``got.met`` from the figure's goals that apply to the row."""
    texts, verdicts = [], []
    for goal in fig.goals:
        if not _matches(row, goal.where):
            continue
        if isinstance(goal.value, Mapping):
            key = row.get(goal.by)
            if key not in goal.value:
                continue
            limit: float | None = float(goal.value[key])
        elif isinstance(goal.value, str):
            found = lookup(payload, row, goal.value)
            if found is _MISSING:
                raise SpecMismatch(f"{where} has no goal field '{goal.value}'")
            limit = _number(found, f"goal field '{goal.value}' of {where}")
        else:
            limit = float(goal.value)
        if limit is None:
            continue
        unit = goal.unit or (fig.unit if goal.of == "ours" and fig.unit != "x" else "")
        if goal.of == "ours":
            value, label = got.ours, goal.label
        elif goal.of == "ratio":
            value, label = got.ratio, goal.label or ratio_name
        else:
            found = lookup(payload, row, goal.of)
            if found is _MISSING:
                raise SpecMismatch(f"{where} has no field '{goal.of}' (a goal of '{fig.label}')")
            value, label = _number(found, f"field '{goal.of}' of {where}"), goal.label
        text = " ".join(p for p in (label, goal.op, _limit(limit), unit) if p)
        if goal.of not in ("ours", "ratio"):
            text += f" ({_num(value, unit or 'x')})"
        texts.append(text)
        if value is None:
            verdicts.append(None)
        else:
            verdicts.append(value <= limit if goal.op == "<=" else value >= limit)
    if not texts:
        return
    got.goal = "; ".join(texts)
    if None in verdicts:
        got.met = "-"
    else:
        got.met = "yes" if all(verdicts) else "no"
    if fig.check:
        ok = lookup(payload, row, fig.check)
        if ok is _MISSING:
            raise SpecMismatch(f"{where} has no field '{fig.check}' (the check of '{fig.label}')")
        if ok is not True and ok != "pass":
            got.met = "no (check failed)"


def _peer_row(
    spec: Spec, rows: list[Mapping[str, Any]], row: Mapping[str, Any], where: str
) -> Mapping[str, Any]:
    pair = spec.pair
    assert pair is not None
    pattern = pair.peers[row[pair.field]]
    case = {c: _fill(t, row) for c, t in spec.case.items()}
    for other in rows:
        if (
            other is not row
            and fnmatchcase(str(other.get(pair.field, "")), pattern)
            and {c: _fill(t, other) for c, t in spec.case.items()} == case
        ):
            return other
    raise SpecMismatch(f"{where} has no peer row ({pair.field} '{pattern}') of the same case")


def _rows(spec: Spec, payload: Mapping[str, Any], rows: list[Mapping[str, Any]]) -> list[_Row]:
    """The table's lines, figure by figure, each over the measured rows in the file's order."""
    measured = [r for r in rows if not_measured(r) is None]
    out: list[_Row] = []
    # The ratio's name in a goal: the peer's when every figure names the same short one, as the
    # ratio column's header does.
    names = {f.peer_name for f in spec.figures if f.peer}
    short = names.pop() if len(names) == 1 else "peer"
    if not _short(short):
        short = "peer"
    ratio_name = ratio_label(spec, short).rsplit(" ", 1)[0]
    for fig in spec.figures:
        for index, row in enumerate(rows):
            if not_measured(row) is not None:
                continue
            if not (_matches(row, spec.where) and _matches(row, fig.where)):
                continue
            if spec.pair and row.get(spec.pair.field) not in spec.pair.peers:
                continue
            case_t = dict(fig.case) or dict(spec.case)
            case = {c: _fill(t, row) for c, t in case_t.items()}
            if spec.pair:
                case[spec.pair.field] = str(row[spec.pair.field])
            where = f"row {index + 1} ({', '.join(f'{k} {v}' for k, v in case.items())})"
            ours = lookup(payload, row, fig.ours)
            peer_row = row
            if fig.peer and spec.pair and ours is not _MISSING:
                try:
                    peer_row = _peer_row(spec, measured, row, where)
                except SpecMismatch:
                    if fig.optional:
                        continue
                    raise
            peer = lookup(payload, peer_row, fig.peer) if fig.peer else None
            if ours is _MISSING or peer is _MISSING:
                if fig.optional:
                    continue
                path = fig.ours if ours is _MISSING else fig.peer
                raise SpecMismatch(f"{where} has no field '{path}' ('{fig.label}')")
            got = _Row(case, fig.label, fig.unit, None)
            value = _number(ours, f"field '{fig.ours}' of {where}")
            got.ours = None if value is None else value * fig.scale
            if fig.peer:
                value = _number(peer, f"field '{fig.peer}' of {where}")
                got.peer = None if value is None else value * fig.scale
                got.peer_name = _fill(fig.peer_name, peer_row)
                got.ratio = _ratio(spec, fig.unit, got.ours, got.peer)
            _goals(payload, row, fig, got, ratio_name, where)
            out.append(got)
    return out


def _title(payload: Mapping[str, Any], spec: Spec | None) -> list[str]:
    env = payload.get("env", {}) if isinstance(payload.get("env"), Mapping) else {}
    name = payload.get("name", "?")
    device = str(env.get("device", payload.get("device", "?")))
    if env.get("kind") and env["kind"] != device:
        device += f" ({env['kind']})"
    date = str(env.get("date", payload.get("date", "?")))[:10]
    about = (
        f"{device}, torch {env.get('torch', '?')}, CUDA {env.get('cuda') or 'none'}, "
        f"commit {env.get('commit', payload.get('commit', '?'))}, {date}"
    )
    return [f"### {name}" + (f": {spec.title}" if spec else ""), "", about]


def env_has_gpu(payload: Mapping[str, Any]) -> bool:
    """Whether the result came from GPUs (its env names a CUDA version and a GPU device)."""
    env = payload.get("env", {}) if isinstance(payload.get("env"), Mapping) else {}
    return bool(env.get("cuda")) and not str(env.get("device", "cpu")).startswith("cpu")


def headline(payload: Mapping[str, Any], spec: Spec | None = None) -> list[str]:
    """The headline table of one result file: our figure, the peer's, their ratio, the goal and
    whether it is met, one line per (case, figure). Raises :class:`SpecMismatch` where the
    result does not fit its spec (``SPECS[payload["name"]]``, or ``spec``), KeyError where the
    benchmark has none."""
    spec = spec or SPECS[str(payload.get("name"))]
    rows = [r for r in payload.get("rows", []) if isinstance(r, Mapping)]
    measured = [r for r in rows if not_measured(r) is None]
    lines = _title(payload, spec)
    skipped = []
    for r in rows:
        why = not_measured(r)
        if why is not None:
            who = ", ".join(
                f"{c} {v}" for c, t in spec.case.items() if (v := _fill(t, r)) not in ("-", "")
            )
            skipped.append(f"{who}: {why}" if who else why)
    if not measured:
        return lines + ["", "nothing measured: " + ("; ".join(skipped) or "no rows")]
    got = _rows(spec, payload, rows)
    if not got:
        raise SpecMismatch("no row has the fields of any headline figure")
    seen, unique = set(), []
    for r in got:
        key = (tuple(r.case.items()), r.figure, r.ours, r.peer, r.goal)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    got = unique
    lines += [""] + _table(spec, got)
    if not env_has_gpu(payload) and any("NCCL" in r.peer_name for r in got):
        lines += [
            "",
            "a CPU run: NCCL's calls ran on gloo (torch.distributed), the numbers mean little",
        ]
    if skipped:
        lines += ["", "not measured: " + "; ".join(skipped)]
    return lines


def _table(spec: Spec, got: list[_Row]) -> list[str]:
    columns = list(dict.fromkeys(c for r in got for c in r.case))
    columns = [c for c in columns if any(r.case.get(c, "-") not in ("-", "") for r in got)]
    shared = []
    if len(got) > 1:
        shared = [c for c in columns if len({r.case.get(c) for r in got}) == 1]
    columns = [c for c in columns if c not in shared]
    figures = list(dict.fromkeys(r.figure for r in got))
    units = list(dict.fromkeys(r.unit for r in got))
    names = list(dict.fromkeys(r.peer_name for r in got if r.peer_name))
    above = []
    if len(figures) == 1:
        above.append(f"figure: {figures[0]}")
    above += [f"{c} {got[0].case[c]}" for c in shared]
    lines = ["all rows: " + "; ".join(above), ""] if above else []

    unit = f" {units[0]}" if len(units) == 1 else ""
    peer = names[0] if len(names) == 1 and _short(names[0]) else "peer"
    header = columns + (["figure"] if len(figures) > 1 else []) + (["unit"] if not unit else [])
    align = ["---"] * len(header)
    if len(names) > 1:
        header.append("peer")
        align.append("---")
    header.append(f"ours{unit}")
    if names:
        header += [f"{peer}{unit}", ratio_label(spec, peer)]
    header += ["goal", "met"]
    align += ["---:"] * (len(header) - len(align) - 2) + ["---", "---"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for r in got:
        cells = [r.case.get(c, "-") for c in columns]
        cells += [r.figure] if len(figures) > 1 else []
        cells += [r.unit] if not unit else []
        cells += [r.peer_name or "-"] if len(names) > 1 else []
        cells.append(_num(r.ours, r.unit))
        if names:
            cells += [_num(r.peer, r.unit) if r.peer_name else "-", _num(r.ratio, "x")]
        cells += [r.goal, r.met]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")

    notes = []
    if len(names) == 1 and peer == "peer":
        notes.append(f"peer: {names[0]}")
    if not names:
        has_peer = any(f.peer for f in spec.figures)
        notes.append("no peer in these rows" if has_peer else "no peer in this benchmark")
    if spec.note:
        notes.append(spec.note)
    return lines + ([""] + notes if notes else [])
