"""``uniep multinode simulate``: the two-level path at EP16-EP256, predicted."""

from __future__ import annotations

import argparse
import json
import sys


def check_worlds(worlds: list[int], gpus_per_node: int, experts: int) -> None:
    """Each EP size of ``--worlds`` must be whole nodes of ``--gpus-per-node`` and split the
    layer's ``experts`` evenly; else a usage error (exit 2) naming them."""
    problems = []
    nodes = [w for w in worlds if w % gpus_per_node]
    if nodes:
        problems.append(
            f"{', '.join(map(str, nodes))}: not a multiple of --gpus-per-node ({gpus_per_node})"
        )
    split = [w for w in worlds if experts % w]
    if split:
        problems.append(
            f"{', '.join(map(str, split))}: does not divide the layer's {experts} experts "
            "(DeepSeek-V3's layer; every rank holds as many)"
        )
    if problems:
        print(
            "uniep multinode simulate: error: argument --worlds: " + "; ".join(problems),
            file=sys.stderr,
        )
        raise SystemExit(2)  # argparse's code for a usage error


def cmd_multinode_simulate(args: argparse.Namespace) -> int:
    from ..moe import multinode_sim as sim

    check_worlds(args.worlds, args.gpus_per_node, sim.Layer(world=1).experts)
    network = sim.Leg(
        alpha_us=args.network_alpha_us,
        gbs=args.network_gbs,
        source=f"assumed: {args.network_gbs:g} GB/s a GPU, {args.network_alpha_us:g} us",
    )
    rows = sim.table(tuple(args.worlds), network=network, gpus_per_node=args.gpus_per_node)
    print(
        f"Predicted (alpha-beta model; NVLink leg {sim.NVLINK_H200.source}: "
        f"{sim.NVLINK_H200.alpha_us:.0f} us + {sim.NVLINK_H200.gbs:.0f} GB/s; network leg "
        f"{network.source}); DeepSeek-V3 layer, {args.gpus_per_node} GPUs a node, fp8 dispatch, "
        "bf16 combine. DeepEP: its published H800 figures."
    )
    print(sim.format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "nvlink": vars(sim.NVLINK_H200),
                    "network": vars(network),
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.out}")
    return 0
