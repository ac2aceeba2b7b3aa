"""Parm cost model: the alpha/beta fit of each collective (R^2), the simulator's predicted speedup
of schedule="auto" over the baseline (DeepSpeed-MoE with tensor-parallel experts), and, on real
runs, how often the cost model picked the measured-fastest schedule.

Two devices (``--device``):
  cpu   (default) local gloo ranks: the CPU executor's collectives (torch.distributed on gloo),
        float32 layers. A check of the fitting path, not a GPU profile.
  cuda  local ranks sharing ONE GPU (the first visible one): the CUDA executor's collectives
        (UniEP's P2P collectives on the MP and EP groups, the calls uniep.parm.cuda makes),
        a bf16 matmul, bf16 layers on the CUDA executor. The ranks time-slice the GPU and every
        "link", intra and inter alike, is that GPU's memory: the fit and the measured choice say
        how the cost model does on this executor on this GPU, not on a cluster.
        With --ranks-per-gpu 1: one rank per GPU (world = the GPU count unless --world-size),
        the same executor and calls, the links NVLink between the GPUs of one host (the MP and
        EP groups alike: "inter" in the fit is NVLink too). The ranks are spawned here with
        uniep.parm.profile's own rank functions (profile_rank, measure_rank) and gloo for the
        host agreement, as the one-GPU runs do; only the GPU each rank uses differs.

--grid-sample K measures K layers drawn (fixed seed) from the simulator's grid (uniep.parm.sim.
GRID, the count of the Parm paper's grid) that fit the layout instead of the fixed set: the
layers whose MP size is --mp-size, experts = experts per MP group x (world / MP size).

Rows:
  kind=fit        one per (collective, link) and the GEMM, from `uniep parm profile`'s measurement
                  (uniep.parm.profile.profile); backend "gloo" or "uniep-cuda", the device name
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
    python bench/bench_parm.py --device cuda --ranks-per-gpu 1 --grid-sample 8   # every GPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import add_out_dir_argument, write_result  # noqa: E402
from plot_svg import Panel, Series, render_svg  # noqa: E402

GOAL_SPEEDUP = 1.5  # Parm's goal: geomean predicted speedup of auto over the baseline
GOAL_RIGHT = 0.95  # Parm's goal: how often auto picks the measured-faster schedule


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


LAYER_KEYS = ("tokens", "hidden", "ffn_hidden", "num_experts", "top_k", "capacity_factor")


def grid_layers(world: int, mp_size: int, count: int, seed: int = 0) -> list[dict]:
    """``count`` distinct layers of the simulator's grid (``uniep.parm.sim.GRID``) that fit a
    ``world``-rank layout with MP groups of ``mp_size``: the grid's entries of that MP size, with
    ``tokens = batch * seq``, ``ffn_hidden = hidden * ffn_ratio``, ``num_experts =
    experts_per_group * (world // mp_size)``, and ``top_k <= num_experts``. Drawn with a fixed
    seed, returned in grid order. ValueError if the grid has no entry of that MP size."""
    from uniep.parm import sim as parm_sim

    if count < 1 or mp_size < 1 or world % mp_size:
        raise ValueError(f"need count >= 1 and mp_size dividing world, got {count}, {mp_size}")
    layers: list[dict] = []
    for c in parm_sim.grid_configs():
        if c["mp_size"] != mp_size:
            continue
        layer = dict(
            tokens=c["batch"] * c["seq"],
            hidden=c["hidden"],
            ffn_hidden=c["hidden"] * c["ffn_ratio"],
            num_experts=c["experts_per_group"] * (world // mp_size),
            top_k=c["top_k"],
            capacity_factor=c["capacity_factor"],
        )
        if layer["top_k"] <= layer["num_experts"] and layer not in layers:
            layers.append(layer)
    if not layers:
        raise ValueError(f"the simulator's grid has no layer with MP size {mp_size}")
    picked = sorted(random.Random(seed).sample(range(len(layers)), min(count, len(layers))))
    return [layers[i] for i in picked]


def measure_table(measured: list[dict]) -> list[str]:
    """Predicted against measured ms per schedule, the choice, the measured best, the regret,
    and the SAA chunk counts the layers ran (s1/s2: the model's; the baseline has no pair)."""
    lines = [
        "| layer | baseline pred / meas ms | s1 pred / meas | s2 pred / meas | chosen | "
        "measured best | chose the faster | regret | SAA chunks s1/s2 |",
        "|---|---:|---:|---:|---|---|---|---:|---|",
    ]
    for r in measured:
        name = (
            f"S={r['tokens']} M={r['hidden']} H={r['ffn_hidden']} E={r['num_experts']} "
            f"k={r['top_k']} f={r['capacity_factor']}"
        )
        cells = " | ".join(
            f"{r['predicted'][s] * 1e3:.2f} / {r['measured'][s] * 1e3:.2f}"
            for s in ("baseline", "s1", "s2")
        )
        chunks = r.get("saa_chunks", {})
        lines.append(
            f"| {name} | {cells} | {r['chosen']} | {r['measured_best']} | "
            f"{'yes' if r['right'] else 'no'} | {r['regret']:.1%} | "
            f"{chunks.get('s1', '-')}/{chunks.get('s2', '-')} |"
        )
    return lines


def _spawn(fn: Any, args: argparse.Namespace, fn_args: tuple, timeout_s: float) -> list:
    """``fn(rank, world, *fn_args)`` on one rank per GPU (``--ranks-per-gpu 1``): gloo carries
    the host agreement and barriers, as where the ranks share a GPU; each rank picks GPU
    ``rank % count`` (``uniep.parm.profile``)."""
    from uniep.distributed import run_local_ranks

    return run_local_ranks(fn, args.world_size, fn_args, backend="gloo", timeout_s=timeout_s)


def _profile(args: argparse.Namespace, sizes: list[int], iters: int) -> dict:
    from uniep.parm.profile import fit_profile, profile, profile_rank

    if args.ranks_per_gpu == "all":
        return profile(
            args.world_size, args.mp_size, sizes, iters, args.timeout, device=args.device
        )
    fn_args = (args.mp_size, sizes, iters, args.device)
    per_rank = _spawn(profile_rank, args, fn_args, args.timeout)
    return fit_profile(per_rank, args.world_size, args.mp_size, iters, args.device)


def step_row(result: dict, world_size: int, mp_size: int) -> dict:
    """The kind=step_fit row: the cost model's per-step cost from the calibration layer."""
    fit = result["step_alpha"]
    return dict(
        kind="step_fit",
        alpha_s=fit["seconds"],
        steps=fit["steps"],
        calibration_measured_s=fit["measured"],
        world_size=world_size,
        mp_size=mp_size,
        backend=result["backend"],
        device=result["device_name"],
    )


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
    """The kind=choice row: how often the cost model's choice was the measured best, and the
    geomean speedup of the chosen schedule over the baseline, measured beside predicted on the
    same layers (and the measured best's, the most a choice could give)."""
    right = sum(r["right"] for r in measured)
    regrets = [r["regret"] for r in measured]

    def speedup(kind: str, pick: str) -> float:
        return statistics.geometric_mean(r[kind]["baseline"] / r[kind][r[pick]] for r in measured)

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
        auto_speedup_measured=speedup("measured", "chosen"),
        auto_speedup_predicted=speedup("predicted", "chosen"),
        best_speedup_measured=speedup("measured", "measured_best"),
        goal=GOAL_RIGHT,
        meets_goal=right / len(measured) >= GOAL_RIGHT,
    )


def measured_layers(args: argparse.Namespace) -> list[dict]:
    """The layers whose schedules the run times (and whose messages the profile must span)."""
    if args.grid_sample:
        return grid_layers(args.world_size, args.mp_size, args.grid_sample)
    return CUDA_MEASURED_LAYERS if args.device == "cuda" else MEASURED_LAYERS


def _measure(
    args: argparse.Namespace, layers: list[dict], profile_result: dict, rows: list[dict]
) -> None:
    """Time every schedule of a few layers on the same ranks and check the cost model's choice
    (fitted from this run's profile) against the measured best."""
    from uniep.parm.profile import (
        cost_model_from_profile,
        measure_layers,
        measure_rank,
        measure_rows,
    )

    cuda = args.device == "cuda"
    model = cost_model_from_profile(profile_result)
    iters = args.iters or ((3 if args.quick else 5) if cuda else 3)
    if args.ranks_per_gpu == "all":
        measured = measure_layers(
            args.world_size,
            args.mp_size,
            layers,
            iters=iters,
            model=model,
            timeout_s=args.timeout,
            device=args.device,
            chunks=args.saa_chunks,
        )
    else:
        fn_args = (args.mp_size, layers, iters, args.device, model, args.saa_chunks)
        per_rank = _spawn(measure_rank, args, fn_args, args.timeout)
        measured = measure_rows(
            layers, per_rank, args.world_size, args.mp_size, model, "cuda", args.saa_chunks
        )
    backend = profile_result["backend"]
    print()
    print("\n".join(measure_table(measured)))
    for r in measured:
        rows.append(
            dict(
                kind="measure",
                world_size=args.world_size,
                mp_size=args.mp_size,
                backend=backend,
                placement=_placement(args),
                **r,
            )
        )
    summary = choice_row(measured, backend, args.world_size, args.mp_size)
    summary["placement"] = _placement(args)
    rows.append(summary)
    print(
        f"choice right in {summary['right']}/{summary['layers']} layers "
        f"(goal >= {GOAL_RIGHT:.0%}), mean regret {summary['mean_regret']:.1%}; auto over the "
        f"baseline (geomean): measured {summary['auto_speedup_measured']:.2f}x, predicted "
        f"{summary['auto_speedup_predicted']:.2f}x (the measured best: "
        f"{summary['best_speedup_measured']:.2f}x)"
    )


def _placement(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        return "gloo-ranks-on-cpu"
    return "one-rank-per-gpu" if args.ranks_per_gpu == "1" else "ranks-share-one-gpu"


def _speedup_panel(cluster: str, rows: list[dict]) -> Panel:
    """Each MP size's layers sorted by the chosen schedule's predicted speedup."""
    series = []
    for n, color in zip((2, 4, 8), ("#1f77b4", "#2ca02c", "#d62728"), strict=True):
        ys = sorted(r["speedup"] for r in rows if r["mp_size"] == n)
        xs = [100.0 * (i + 1) / len(ys) for i in range(len(ys))]
        series.append(Series(f"N = {n}", xs, ys, color))
    return Panel(cluster, series, x_label="layers (percentile)", y_label="speedup (x)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks (default 4; with --ranks-per-gpu 1 the GPU count)",
    )
    parser.add_argument("--mp-size", type=int, default=2)
    add_out_dir_argument(parser)
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
        help="cpu: gloo ranks; cuda: the CUDA executor (see above)",
    )
    parser.add_argument(
        "--ranks-per-gpu",
        choices=["all", "1"],
        default="all",
        help="with --device cuda: all ranks on the first GPU (default) or one rank per GPU",
    )
    parser.add_argument(
        "--grid-sample",
        type=int,
        default=0,
        metavar="K",
        help="measure K layers of the simulator's grid at this layout (default: the fixed set)",
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls per size / layer")
    parser.add_argument(
        "--saa-chunks",
        default="auto",
        help="chunks per SAA pair in the measured layers: auto (the fitted model's) or an int",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per spawn")
    parser.add_argument("--no-simulate", action="store_true", help="skip the simulator grids")
    args = parser.parse_args(argv)
    if args.ranks_per_gpu == "1" and args.device != "cuda":
        parser.error("--ranks-per-gpu 1 needs --device cuda")
    if args.world_size is None:
        per_gpu = args.ranks_per_gpu == "1"
        args.world_size = _gpu_count() if per_gpu else 4
    if args.mp_size < 1 or args.world_size >= 1 and args.world_size % args.mp_size:
        # (No GPU with --ranks-per-gpu 1 leaves a world of 0: per_gpu_problem says why.)
        parser.error(f"--mp-size {args.mp_size} must divide --world-size {args.world_size}")
    if args.grid_sample < 0 or args.iters is not None and args.iters < 1:
        parser.error("--grid-sample must be >= 0 and --iters >= 1")
    if args.saa_chunks != "auto":
        if not args.saa_chunks.isdigit() or int(args.saa_chunks) < 1:
            parser.error(f"--saa-chunks must be auto or an int >= 1, got {args.saa_chunks!r}")
        args.saa_chunks = int(args.saa_chunks)
    return args


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def per_gpu_problem(args: argparse.Namespace) -> str | None:
    """Why one rank per GPU cannot run here (None when it can)."""
    if args.ranks_per_gpu != "1":
        return None
    gpus = _gpu_count()
    if gpus < 2:
        return f"one rank per GPU needs >= 2 GPUs, found {gpus}"
    if args.world_size < 2 or args.world_size > gpus:
        return f"one rank per GPU needs 2..{gpus} ranks here, asked for {args.world_size}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from uniep import parm
    from uniep.parm import sim as parm_sim
    from uniep.parm.profile import sizes_for_layers

    rows: list[dict] = []
    why = per_gpu_problem(args)
    if why:
        print(f"bench_parm: skipped ({why})")
        row = dict(kind="skipped", why=why, world_size=args.world_size, mp_size=args.mp_size)
        print(f"wrote {write_result('bench_parm', [row], args.out_dir)}")
        return 0
    # The fitted range reaches the largest message of the layers measured below.
    layers = measured_layers(args)
    sizes = sizes_for_layers(layers, args.world_size, args.mp_size, args.device)
    sizes = sizes[::2] if args.quick else sizes
    result = _profile(args, sizes, args.iters or (3 if args.quick else 5))
    print(f"fit: {result['backend']} on {result['device_name']}, {args.world_size} ranks")
    print(f"{'fit':<16}{'link':<7}{'alpha (us)':>12}{'beta':>12}{'R^2':>8}")
    for row in fit_rows(result, args.world_size, args.mp_size):
        print(
            f"{row['collective']:<16}{row['link']:<7}{row['alpha_s'] * 1e6:>12.2f}"
            f"{row['beta']:>12.3e}{row['r2']:>8.4f}"
        )
        rows.append(dict(row, placement=_placement(args)))
    if result.get("step_alpha"):
        step = step_row(result, args.world_size, args.mp_size)
        print(
            f"per step (the calibration layer beyond its price): {step['alpha_s'] * 1e6:.1f} us "
            f"over {step['steps']} steps"
        )
        rows.append(dict(step, placement=_placement(args)))

    print(f"\n{'simulate':<12}{'layers':>7}{'auto geomean':>14}{'min':>7}{'max':>7}  chosen")
    panels = []
    for name in [] if args.no_simulate else parm.CLUSTERS:
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
        _measure(args, layers, result, rows)
    path = write_result("bench_parm", rows, args.out_dir)
    print(f"wrote {path}")
    if panels and not args.no_plot:
        svg = Path(path).with_suffix(".svg")
        title = "Parm: predicted speedup of auto over the baseline (fwd+bwd), 1296 layers"
        svg.write_text(render_svg(panels, title, columns=3, log_x=False, log_y=False))
        print(f"wrote {svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
