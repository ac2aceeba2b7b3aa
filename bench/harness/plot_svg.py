"""Line charts as SVG without dependencies (matplotlib is used instead when it is installed).

The GPU machine has no network and may lack matplotlib, so the benchmarks can always draw their
plots with the small writer below. ``overlap_panels`` turns a ``bench_overlap.py`` result into
one panel per (TP size, op kind): time against M for each variant.

    python bench/harness/plot_svg.py     # bench/results/bench_overlap/bench_overlap.svg
    python bench/harness/plot_svg.py RESULT.json -o plot.svg --no-matplotlib
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = ["Panel", "Series", "nice_ticks", "overlap_panels", "render_svg", "write_plot"]

# bench_overlap.py's result (common.result_path, which is not imported: common needs torch).
OVERLAP_RESULT = Path(__file__).resolve().parents[1] / "results/bench_overlap/bench_overlap.json"


@dataclass(frozen=True)
class Series:
    """One line: ``ys[i]`` at ``xs[i]``; a ``None`` y leaves a gap (e.g. a variant that failed)."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    series: Sequence[Series]
    x_label: str = "M"
    y_label: str = "time (ms)"


def nice_ticks(hi: float, count: int = 5) -> list[float]:
    """Ticks 0, s, 2s, ... covering ``[0, hi]`` with s in {1, 2, 2.5, 5} x 10^k."""
    if not hi > 0 or not math.isfinite(hi):
        return [0.0, 1.0]
    raw = hi / count
    base = 10.0 ** math.floor(math.log10(raw))
    step = next(f * base for f in (1.0, 2.0, 2.5, 5.0, 10.0) if f * base >= raw)
    n = math.ceil(hi / step - 1e-9)
    return [round(i * step, 10) for i in range(n + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2, 5 x 10^k within ``[lo, hi]`` (0 < lo < hi); the decades alone if that is too many."""
    ticks = []
    for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        ticks += [f * 10.0**e for f in (1, 2, 5) if lo <= f * 10.0**e <= hi]
    if len(ticks) > 8:
        ticks = [t for t in ticks if math.isclose(10 ** round(math.log10(t)), t)]
    return [round(t, 10) for t in ticks]


def _fmt(v: float) -> str:
    if v >= 1024 and v == int(v) and int(v) % 1024 == 0:
        return f"{int(v) // 1024}k"
    return f"{v:g}"


# Geometry of one panel (px): plot area inside the margins.
_W, _H = 380, 270
_ML, _MR, _MT, _MB = 58, 14, 30, 44


def _panel_svg(panel: Panel, ox: float, oy: float, log_x: bool, log_y: bool) -> list[str]:
    xs = sorted({x for s in panel.series for x, y in zip(s.xs, s.ys, strict=True) if y is not None})
    ys = [y for s in panel.series for y in s.ys if y is not None and math.isfinite(y)]
    out = [
        f'<text x="{ox + _W / 2:.1f}" y="{oy + 18:.1f}" text-anchor="middle" '
        f'font-weight="bold">{escape(panel.title)}</text>'
    ]
    x0, x1, y0, y1 = ox + _ML, ox + _W - _MR, oy + _H - _MB, oy + _MT
    out.append(
        f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#999"/>'
    )
    if not xs or not ys:
        out.append(
            f'<text x="{(x0 + x1) / 2}" y="{(y0 + y1) / 2}" text-anchor="middle">no data</text>'
        )
        return out
    tx = (lambda v: math.log2(v)) if log_x and min(xs) > 0 else (lambda v: v)
    lo, hi = tx(xs[0]), tx(xs[-1])
    span = hi - lo or 1.0
    pad = 0.06 * (x1 - x0)

    def px(v: float) -> float:
        return x0 + pad + (tx(v) - lo) / span * (x1 - x0 - 2 * pad)

    if log_y and min(ys) > 0:
        ylo, yhi = math.log10(min(ys) / 1.3), math.log10(max(ys) * 1.3)
        yticks = log_ticks(10**ylo, 10**yhi)

        def ty(v: float) -> float:
            return (math.log10(v) - ylo) / (yhi - ylo)

    else:
        yticks = nice_ticks(max(ys))

        def ty(v: float) -> float:
            return v / yticks[-1]

    def py(v: float) -> float:
        return y0 - ty(v) * (y0 - y1)

    for t in yticks:
        out.append(
            f'<line x1="{x0}" y1="{py(t):.1f}" x2="{x1}" y2="{py(t):.1f}" stroke="#e5e5e5"/>'
            f'<text x="{x0 - 5}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>'
        )
    for v in xs:
        out.append(
            f'<line x1="{px(v):.1f}" y1="{y0}" x2="{px(v):.1f}" y2="{y0 + 4}" stroke="#999"/>'
            f'<text x="{px(v):.1f}" y="{y0 + 16}" text-anchor="middle">{_fmt(v)}</text>'
        )
    out.append(
        f'<text x="{(x0 + x1) / 2:.1f}" y="{y0 + 34}" text-anchor="middle">'
        f"{escape(panel.x_label)}{' (log scale)' if log_x else ''}</text>"
        f'<text transform="translate({ox + 14},{(y0 + y1) / 2:.1f}) rotate(-90)" '
        f'text-anchor="middle">{escape(panel.y_label)}{", log scale" if log_y else ""}</text>'
    )
    for s in panel.series:
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        pts = [(px(x), py(y)) for x, y in zip(s.xs, s.ys, strict=True) if y is not None]
        # A None splits the line: no segment across a missing point.
        run: list[tuple[float, float]] = []
        for x, y in [*zip(s.xs, s.ys, strict=True), (None, None)]:
            if y is None or x is None:
                if len(run) > 1:
                    path = " ".join(f"{a:.1f},{b:.1f}" for a, b in run)
                    out.append(
                        f'<polyline points="{path}" fill="none" stroke="{s.color}" '
                        f'stroke-width="2"{dash}/>'
                    )
                run = []
            else:
                run.append((px(x), py(y)))
        out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{s.color}"/>' for a, b in pts]
    return out


def render_svg(
    panels: Sequence[Panel],
    title: str = "",
    columns: int = 2,
    log_x: bool = True,
    log_y: bool = True,
) -> str:
    """One SVG document: a shared legend on top, then the panels in a grid of ``columns``."""
    columns = max(1, min(columns, len(panels) or 1))
    rows = max(1, math.ceil(len(panels) / columns))
    labels: dict[str, Series] = {}
    for p in panels:
        for s in p.series:
            labels.setdefault(s.label, s)
    top = 30 + (22 if title else 0)
    width, height = columns * _W, top + rows * _H + 8
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    if title:
        out.append(
            f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14" '
            f'font-weight="bold">{escape(title)}</text>'
        )
    x, y = 12.0, top - 12.0
    for s in labels.values():
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(
            f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{s.color}" '
            f'stroke-width="2"{dash}/><text x="{x + 29}" y="{y + 4}">{escape(s.label)}</text>'
        )
        x += 40 + 6.5 * len(s.label)
    for i, p in enumerate(panels):
        out += _panel_svg(p, (i % columns) * _W, top + (i // columns) * _H, log_x, log_y)
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---- bench_overlap.py results ----

KIND_TITLES = {"ag_mm": "AG + GEMM", "mm_rs": "GEMM + RS"}
# (key in a result's "ms", legend label, colour, dashed)
OVERLAP_VARIANTS = (
    ("ours_best", "ours (best chunks)", "#d62728", False),
    ("nccl_mm", "NCCL + mm", "#1f77b4", False),
    ("torch_fused", "torch fused (symm_mem)", "#2ca02c", False),
    ("mm_alone", "mm alone", "#555555", False),
    ("coll_alone", "collective alone", "#9467bd", True),
)


def overlap_panels(payload: dict[str, Any]) -> tuple[list[Panel], str]:
    """Panels of time vs M, one per (TP, kind), for the (K, N) that has the most values of M.

    Returns the panels and a subtitle naming K and N. Ties between (K, N) go to the one seen
    first (the first shape of the run).
    """
    results = [r for r in payload.get("results", []) if "ms" in r]
    ms_per_kn: dict[tuple[int, int], set[int]] = {}
    for r in results:
        ms_per_kn.setdefault((r["K"], r["N"]), set()).add(r["M"])
    if not ms_per_kn:
        return [], "no results"
    k, n = max(ms_per_kn, key=lambda kn: len(ms_per_kn[kn]))  # max() keeps the first of ties
    panels = []
    for tp in sorted({r["tp"] for r in results}):
        for kind, kind_title in KIND_TITLES.items():
            rows = sorted(
                (
                    r
                    for r in results
                    if r["tp"] == tp and r["kind"] == kind and (r["K"], r["N"]) == (k, n)
                ),
                key=lambda r: r["M"],
            )
            if not rows:
                continue
            xs = [r["M"] for r in rows]
            series = [
                Series(label, xs, [r["ms"].get(key) for r in rows], color, dashed)
                for key, label, color, dashed in OVERLAP_VARIANTS
            ]
            panels.append(Panel(f"TP={tp}, {kind_title}", series))
    return panels, f"bf16, K={k}, N={n} per rank"


def _matplotlib_plot(panels: Sequence[Panel], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels, strict=False):
        for s in p.series:
            pts = [(x, y) for x, y in zip(s.xs, s.ys, strict=True) if y is not None]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    "o-" if not s.dashed else "o--",
                    color=s.color,
                    label=s.label,
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for s in p.series for x in s.xs}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _fmt(v)))
        ax.set_yscale("log")
        ax.set(title=p.title, xlabel=p.x_label, ylabel=p.y_label)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, y=0.995, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, format="svg")
    plt.close(fig)


def write_plot(payload: dict[str, Any], path: str | Path, prefer_matplotlib: bool = True) -> str:
    """Draw ``overlap_panels(payload)`` into ``path`` (SVG); returns the backend used."""
    panels, subtitle = overlap_panels(payload)
    env = payload.get("env", {})
    title = (
        f"TP overlap, {subtitle}: {env.get('device', payload.get('device', '?'))}, "
        f"commit {env.get('commit', payload.get('commit', '?'))}"
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if prefer_matplotlib and panels:
        try:
            _matplotlib_plot(panels, title, path)
            return "matplotlib"
        except ImportError:
            pass
    path.write_text(render_svg(panels, title))
    return "svg"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "result",
        nargs="?",
        default=str(OVERLAP_RESULT),
        help="a bench_overlap.py JSON (default bench/results/bench_overlap/bench_overlap.json)",
    )
    parser.add_argument("-o", "--out", default=None, help="SVG path (default: RESULT with .svg)")
    parser.add_argument("--no-matplotlib", action="store_true", help="always the built-in writer")
    args = parser.parse_args(argv)
    payload = json.loads(Path(args.result).read_text())
    out = Path(args.out) if args.out else Path(args.result).with_suffix(".svg")
    backend = write_plot(payload, out, prefer_matplotlib=not args.no_matplotlib)
    print(f"wrote {out} ({backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
