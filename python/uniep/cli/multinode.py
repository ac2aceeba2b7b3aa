"""``uniep multinode simulate``: the two-level path at EP16-EP256, predicted."""

from __future__ import annotations

import argparse
import json


def cmd_multinode_simulate(args: argparse.Namespace) -> int:
    from ..moe import multinode_sim as sim

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
