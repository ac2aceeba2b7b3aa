"""``uniep parm simulate`` and ``uniep parm profile``."""

from __future__ import annotations

import argparse
import json
import sys


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


def cmd_parm_simulate(args: argparse.Namespace) -> int:
    from ..parm import sim as parm_sim
    from ..parm.profile import COEFFICIENTS, profiled_coefficients

    cluster = _cluster_from_args(args)
    profile = args.profile.result if args.profile else None
    fitted = profiled_coefficients(profile) if profile else []
    P = int(cluster["gpus_per_node"] * cluster["nodes"])
    skipped = parm_sim.left_out(cluster)
    why = [
        f"MP size {n} ({count} layers): " + parm_sim.LEFT_OUT[reason].format(gpus=P, groups=P // n)
        for reason, per_n in skipped.items()
        for n, count in sorted(per_n.items())
    ]
    rows = parm_sim.simulate(cluster, profile=profile, dtype_bytes=args.dtype_bytes)
    if not rows:
        print(
            f"uniep parm simulate: no layer of the grid fits {P} GPU(s) "
            f"({int(cluster['nodes'])} node(s) x {int(cluster['gpus_per_node'])}), nothing "
            "written: " + "; ".join(why),
            file=sys.stderr,
        )
        return 2
    summary = parm_sim.summarize(rows)
    print(
        f"Parm simulator: {len(rows)} layers on {P} GPUs ({int(cluster['nodes'])} nodes x "
        f"{int(cluster['gpus_per_node'])}), predicted fwd+bwd speedup over the baseline"
    )
    for line in why:
        print(f"left out of the grid: {line}")
    if args.profile:
        print(
            f"from the profile {args.profile.path}: {', '.join(fitted) or 'nothing'}; from the "
            f"cluster ({args.cluster} and the options): "
            + (", ".join(c for c in COEFFICIENTS if c not in fitted) or "nothing")
        )
    print(parm_sim.format_table(summary))
    with open(args.out, "w") as f:
        json.dump(
            {
                "cluster": cluster,
                "profile": args.profile.path if args.profile else None,
                "from_profile": fitted,
                "grid": parm_sim.GRID,
                "left_out": {
                    reason: {str(n): count for n, count in per_n.items()}
                    for reason, per_n in skipped.items()
                },
                "summary": summary,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")
    return 0


def cmd_parm_profile(args: argparse.Namespace) -> int:
    from ..parm.profile import profile, stretched_sizes

    if args.world_size % args.mp_size or args.world_size == args.mp_size:
        print(
            f"uniep parm profile: --mp-size ({args.mp_size}) must divide --world-size "
            f"({args.world_size}) with at least two MP groups (the EP all-to-all needs them)",
            file=sys.stderr,
        )
        return 2
    sizes = stretched_sizes(args.device, (args.up_to_mib or 0) * 2**20, args.sizes)
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
