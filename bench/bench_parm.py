"""Parm cost model: the alpha/beta fit of each collective (R^2), the simulator's predicted speedup
of schedule="auto" over the baseline (DeepSpeed-MoE with tensor-parallel experts), and, on real
runs, how often the cost model picked the measured-fastest schedule.

Two devices (``--device``):
  cpu   (default) local gloo ranks: the CPU executor's collectives (torch.distributed on gloo),
        float32 layers. A check of the fitting path, not a GPU profile.
  cuda  local ranks sharing ONE GPU (the first visible one): the CUDA executor's collectives
        (UniEP's P2P collectives on the world carrier groups, the calls uniep.parm_cuda makes),
        a bf16 matmul, bf16 layers on the CUDA executor. The ranks time-slice the GPU and every
        "link", intra and inter alike, is that GPU's memory: the fit and the measured choice say
        how the cost model does on this executor on this GPU, not on a cluster.

Rows:
  kind=fit        one per (collective, link) and the GEMM, from `uniep parm profile`'s measurement
                  (uniep.parm_profile.profile); backend "gloo" or "uniep-cuda", the device name
  kind=measure    (without --quick, or with --measure) a few layers timed under each schedule on
                  the same ranks, beside the cost model's prediction from this run's fit:
                  whether its choice was the measured best, and the regret
  kind=choice     the measure rows summed up: how often the choice was the measured best (goal
                  >= 95%), mean and largest regret
  kind=simulate   one per described cluster (uniep.parm.CLUSTERS): the 1296-layer grid, the
                  geomean / min / max predicted fwd+bwd speedup of auto over the baseline, and how
                  often each schedule is chosen (predictions; kind=measure is the measured check).

    python bench/bench_parm.py --quick                 # CPU, 4 gloo ranks, 8 message sizes
    python bench/bench_parm.py                         # CPU, 16 message sizes, measured layers
    python bench/bench_parm.py --device cuda --out-dir DIR   # 4 ranks on one GPU, 8 layers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402
from plot_svg import Panel, Series, render_svg  # noqa: E402

GOAL_SPEEDUP = 1.5  # issue 20: geomean predicted speedup of auto over the baseline
GOAL_RIGHT = 0.95  # issue 20: how often auto picks the measured-faster schedule


# Layers for the measured check: big enough on CPU that the exchange is not all start-up cost.
MEASURED_LAYERS = [
    dict(tokens=t, hidden=m, ffn_hidden=2 * m, num_experts=4, top_k=k, capacity_factor=f)
    for t, m in ((256, 128), (1024, 256))
    for k in (1, 2)
    for f in (1.0, 2.0)
]
# On one GPU (bf16): transfers of 4-80 MiB and expert GEMMs of 2k-20k rows, so that the times
# are not all launch overhead, while 8 layers x 3 schedules stay well inside a few minutes at
# world 4. num_experts=8 divides by every EP size up to 8.
CUDA_MEASURED_LAYERS = [
    dict(tokens=t, hidden=m, ffn_hidden=2 * m, num_experts=8, top_k=k, capacity_factor=1.2)
    for t in (2048, 8192)
    for m in (1024, 2048)
    for k in (1, 2)
]


def fit_rows(result: dict, world_size: int, mp_size: int) -> list[dict]:
    """One kind=fit row per (collective, link) of a profile, and one for the GEMM."""
    fits = [
        (k, link, c) for k, links in result["coefficients"].items() for link, c in links.items()
    ]
    fits.append(("gemm", "local", result["gemm"]))
    return [
        dict(
            kind="fit",
            collective=kind,
            link=link,
            alpha_s=c["alpha"],
            beta=c["beta"],
            beta_unit="s/flop" if kind == "gemm" else "s/byte",
            r2=c["r2"],
            samples=len(c["samples"]),
            world_size=world_size,
            mp_size=mp_size,
            backend=result["backend"],
            device=result["device_name"],
        )
        for kind, link, c in fits
    ]


def choice_row(measured: list[dict], backend: str, world_size: int, mp_size: int) -> dict:
    """The kind=choice row: how often the cost model's choice was the measured best."""
    right = sum(r["right"] for r in measured)
    regrets = [r["regret"] for r in measured]
    return dict(
        kind="choice",
        backend=backend,
        world_size=world_size,
        mp_size=mp_size,
        layers=len(measured),
        right=right,
        right_fraction=right / len(measured),
        mean_regret=sum(regrets) / len(regrets),
        max_regret=max(regrets),
        goal=GOAL_RIGHT,
        meets_goal=right / len(measured) >= GOAL_RIGHT,
    )


def _measure(args: argparse.Namespace, profile_result: dict, rows: list[dict]) -> None:
    """Time every schedule of a few layers on the same ranks and check the cost model's choice
    (fitted from this run's profile) against the measured best."""
    from uniep.parm_profile import cost_model_from_profile, measure_layers

    cuda = args.device == "cuda"
    model = cost_model_from_profile(profile_result)
    measured = measure_layers(
        args.world_size,
        args.mp_size,
        CUDA_MEASURED_LAYERS if cuda else MEASURED_LAYERS,
        iters=(3 if args.quick else 5) if cuda else 3,
        model=model,
        device=args.device,
    )
    backend = profile_result["backend"]
    print(f"\n{'measured':<34}{'baseline':>10}{'s1':>10}{'s2':>10}  chosen/best  regret")
    for r in measured:
        name = f"S={r['tokens']} M={r['hidden']} k={r['top_k']} f={r['capacity_factor']}"
        m = r["measured"]
        print(
            f"{name:<34}{m['baseline'] * 1e3:>8.1f}ms{m['s1'] * 1e3:>8.1f}ms"
            f"{m['s2'] * 1e3:>8.1f}ms  {r['chosen']}/{r['measured_best']}  {r['regret']:.1%}"
        )
        rows.append(
            dict(
                kind="measure",
                world_size=args.world_size,
                mp_size=args.mp_size,
                backend=backend,
                **r,
            )
        )
    summary = choice_row(measured, backend, args.world_size, args.mp_size)
    rows.append(summary)
    print(
        f"choice right in {summary['right']}/{summary['layers']} layers "
        f"(goal >= {GOAL_RIGHT:.0%}), mean regret {summary['mean_regret']:.1%}"
    )


def _speedup_panel(cluster: str, rows: list[dict]) -> Panel:
    """Each MP size's layers sorted by the chosen schedule's predicted speedup."""
    series = []
    for n, color in zip((2, 4, 8), ("#1f77b4", "#2ca02c", "#d62728"), strict=True):
        ys = sorted(r["speedup"] for r in rows if r["mp_size"] == n)
        xs = [100.0 * (i + 1) / len(ys) for i in range(len(ys))]
        series.append(Series(f"N = {n}", xs, ys, color))
    return Panel(cluster, series, x_label="layers (percentile)", y_label="speedup (x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mp-size", type=int, default=2)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--no-plot", action="store_true", help="write no SVG")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also time the schedules (on by default without --quick)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo ranks; cuda: ranks sharing one GPU, the CUDA executor (see above)",
    )
    args = parser.parse_args(argv)

    from uniep import parm, parm_sim
    from uniep.parm_profile import default_sizes, profile

    rows: list[dict] = []
    sizes = default_sizes(args.device)
    sizes = sizes[::2] if args.quick else sizes
    result = profile(
        args.world_size,
        args.mp_size,
        sizes,
        iters=3 if args.quick else 5,
        device=args.device,
    )
    print(f"fit: {result['backend']} on {result['device_name']}, {args.world_size} ranks")
    print(f"{'fit':<16}{'link':<7}{'alpha (us)':>12}{'beta':>12}{'R^2':>8}")
    for row in fit_rows(result, args.world_size, args.mp_size):
        print(
            f"{row['collective']:<16}{row['link']:<7}{row['alpha_s'] * 1e6:>12.2f}"
            f"{row['beta']:>12.3e}{row['r2']:>8.4f}"
        )
        rows.append(row)

    print(f"\n{'simulate':<12}{'layers':>7}{'auto geomean':>14}{'min':>7}{'max':>7}  chosen")
    panels = []
    for name in parm.CLUSTERS:
        sim = parm_sim.simulate(name)
        panels.append(_speedup_panel(name, sim))
        summary = parm_sim.summarize(sim)["all"]
        print(
            f"{name:<12}{summary['layers']:>7}{summary['auto_geomean']:>13.2f}x"
            f"{summary['auto_min']:>6.2f}x{summary['auto_max']:>6.2f}x  {summary['chosen']}"
        )
        rows.append(
            dict(
                kind="simulate",
                cluster=name,
                layers=summary["layers"],
                auto_geomean=summary["auto_geomean"],
                auto_min=summary["auto_min"],
                auto_max=summary["auto_max"],
                s1_geomean=summary["s1_geomean"],
                s2_geomean=summary["s2_geomean"],
                chosen_counts=summary["chosen"],
                goal=GOAL_SPEEDUP,
                meets_goal=summary["auto_geomean"] >= GOAL_SPEEDUP,
            )
        )
    if args.measure or not args.quick:
        _measure(args, result, rows)
    path = write_result("bench_parm", rows, args.out_dir)
    print(f"wrote {path}")
    if not args.no_plot:
        svg = Path(path).with_suffix(".svg")
        title = "Parm: predicted speedup of auto over the baseline (fwd+bwd), 1296 layers"
        svg.write_text(render_svg(panels, title, columns=3, log_x=False, log_y=False))
        print(f"wrote {svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
