"""The ``uniep`` command: ``uniep info`` (what this build contains), ``uniep demo``, ``uniep tune``,
``uniep parm`` and ``uniep multinode``; one module per command (``info``, ``demo``, ``tune``,
``parm``, ``multinode``) and the options' types (``args``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .args import (
    non_negative_float,
    non_negative_int,
    parm_profile_file,
    positive_float,
    positive_int,
    positive_seconds,
    profile_sizes,
    seed,
    settle_seconds,
)
from .demo import TOLERANCE, cmd_demo
from .info import cmd_info
from .multinode import cmd_multinode_simulate
from .parm import cmd_parm_profile, cmd_parm_simulate
from .tune import cmd_tune

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="uniep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="what this build contains (CUDA, NVSHMEM, CUTLASS, archs)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument(
        "--cmake-prefix-path",
        action="store_true",
        help="print only the folder for CMAKE_PREFIX_PATH (find_package(uniep) from C++)",
    )
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo",
        help="run an MoE layer forward+backward on local ranks and check it against a reference",
    )
    demo.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help="local ranks to spawn (default: one per visible GPU, or 2 on CPU)",
    )
    demo.add_argument("--tokens", type=positive_int, default=512, help="tokens per rank")
    demo.add_argument("--hidden", type=positive_int, default=256)
    demo.add_argument("--ffn", type=positive_int, default=512, help="expert intermediate width")
    demo.add_argument(
        "--experts",
        type=positive_int,
        default=None,
        help="experts in total (default: the smallest multiple of the world size >= 8)",
    )
    demo.add_argument("--top-k", type=positive_int, default=2)
    demo.add_argument(
        "--dtype",
        choices=sorted(TOLERANCE),
        default=None,
        help="default: bfloat16 on GPUs, float32 on CPU",
    )
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.add_argument("--iters", type=positive_int, default=3, help="timed iterations (median)")
    demo.add_argument("--seed", type=seed, default=0)
    demo.add_argument(
        "--timeout",
        type=positive_seconds,
        default=120.0,
        help="seconds before hung ranks are stopped",
    )
    demo.set_defaults(func=cmd_demo)

    tune_p = sub.add_parser(
        "tune",
        help="search the schedule keys for one MoE shape, measure the best, cache the winner",
    )
    tune_p.add_argument("--tokens", type=positive_int, required=True, help="tokens per rank")
    tune_p.add_argument("--hidden", type=positive_int, required=True)
    tune_p.add_argument("--ffn", type=positive_int, required=True, help="per expert")
    tune_p.add_argument("--experts", type=positive_int, required=True, help="in total")
    tune_p.add_argument("--top-k", dest="top_k", type=positive_int, required=True)
    tune_p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32", "float64"],
        default=None,
        help="default: bfloat16 on GPUs, float32 on CPU",
    )
    tune_p.add_argument("--world-size", type=positive_int, default=1, help="local ranks")
    tune_p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    tune_p.add_argument(
        "--candidates", type=positive_int, default=8, help="best predicted points to measure"
    )
    tune_p.add_argument(
        "--iters",
        type=positive_int,
        default=10,
        help="timed calls each, in 2 to 4 interleaved rounds; a point replaces the default only "
        "when it is faster than the default in every round (1 call: one round, the default stays)",
    )
    tune_p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed calls each")
    tune_p.add_argument(
        "--budget", type=positive_seconds, default=None, help="seconds of measuring at most"
    )
    tune_p.add_argument(
        "--cache", default=None, help="cache file (default: $UNIEP_TUNE_CACHE or the user cache)"
    )
    tune_p.add_argument("--dispatch", choices=["bf16", "fp8"], default=None, help="kept as given")
    tune_p.add_argument(
        "--combine",
        choices=["per_k", "rank_partials", "node_partials"],
        default=None,
        help="kept as given; node_partials (a group that spans nodes: on one node per_k's bits) "
        "on the CPU executor only",
    )
    tune_p.add_argument("--gemm", choices=["uniep", "torch"], default=None, help="kept as given")
    tune_p.add_argument(
        "--expert-precision",
        dest="expert_precision",
        choices=["auto", "bf16", "fp8"],
        default=None,
        help="the tuning key experts, the expert GEMMs' precision (auto: fp8 under --dispatch "
        "fp8, else bf16); kept as given",
    )
    tune_p.add_argument(
        "--weights",
        choices=["plain", "bf16_packed"],
        default="plain",
        help="plain: moe_forward; bf16_packed: moe_forward_prepared on packed experts (the "
        "separate launches and the MegaKernel), cached under its own key",
    )
    tune_p.add_argument(
        "--settle-s",
        dest="settle_s",
        type=settle_seconds,
        default=0.0,
        help="seconds each candidate runs back to back before its timed calls, so that it is "
        "timed at the clock a GPU at its power limit settles at (training); 0: short rounds",
    )
    tune_p.add_argument("--timeout", type=positive_seconds, default=600.0)
    tune_p.set_defaults(func=cmd_tune)

    parm = sub.add_parser("parm", help="Parm schedules (MP+EP+ESP): simulator and profiler")
    parm_sub = parm.add_subparsers(dest="parm_command", required=True)
    sim = parm_sub.add_parser(
        "simulate", help="price baseline, S1 and S2 over a 1296-layer grid on a described cluster"
    )
    from ..parm import CLUSTERS

    sim.add_argument(
        "--cluster",
        choices=sorted(CLUSTERS),
        default="h100-ib",
        help="preset the options below override",
    )
    sim.add_argument("--gpus-per-node", dest="gpus_per_node", type=positive_int)
    sim.add_argument("--nodes", type=positive_int)
    sim.add_argument("--intra-bw", dest="intra_bw", type=positive_float, help="GB/s per GPU")
    sim.add_argument("--inter-bw", dest="inter_bw", type=positive_float, help="GB/s per GPU")
    sim.add_argument(
        "--intra-alpha", dest="intra_alpha", type=non_negative_float, help="us per hop"
    )
    sim.add_argument(
        "--inter-alpha", dest="inter_alpha", type=non_negative_float, help="us per hop"
    )
    sim.add_argument("--peak-tflops", dest="peak_flops", type=positive_float)
    sim.add_argument("--dtype-bytes", type=positive_int, default=2)
    sim.add_argument(
        "--profile",
        type=parm_profile_file,
        help="JSON of `uniep parm profile`: the coefficients it measured replace the cluster's",
    )
    sim.add_argument("--out", default="parm-simulate.json", help="JSON output")
    sim.set_defaults(func=cmd_parm_simulate)
    prof = parm_sub.add_parser(
        "profile",
        help="fit alpha/beta of the collectives on local gloo ranks (CPU) or, with --device "
        "cuda, of the CUDA executor's collectives on local ranks sharing one GPU",
    )
    prof.add_argument("--world-size", type=positive_int, default=4)
    prof.add_argument("--mp-size", type=positive_int, default=2)
    prof.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo collectives; cuda: UniEP's CUDA collectives as the Parm CUDA executor "
        "calls them, ranks sharing one GPU (its memory is every link)",
    )
    prof.add_argument("--iters", type=positive_int, default=5, help="timed runs per size")
    prof.add_argument(
        "--sizes",
        type=profile_sizes,
        default=16,
        help="message sizes, 2 to 16: the first of the default sizes (1-16 MiB on cpu, 4-64 MiB "
        "on cuda), or as many even steps up to --up-to-mib where it lies past them",
    )
    prof.add_argument(
        "--up-to-mib",
        type=positive_int,
        default=None,
        help="stretch the sizes to reach this many MiB: the largest message of the layers to be "
        "priced (uniep.parm.profile.largest_message), where it lies past the sizes' range",
    )
    prof.add_argument("--timeout", type=positive_seconds, default=300.0)
    prof.add_argument("--out", default="parm-profile.json", help="JSON output")
    prof.set_defaults(func=cmd_parm_profile)
    multinode = sub.add_parser(
        "multinode", help="expert parallelism across nodes: the two-level path, predicted"
    )
    multinode_sub = multinode.add_subparsers(dest="multinode_command", required=True)
    msim = multinode_sub.add_parser(
        "simulate",
        help="predict dispatch, combine and exposed communication at EP16-EP256 beside DeepEP",
    )
    msim.add_argument(
        "--worlds",
        type=positive_int,
        nargs="+",
        default=[16, 32, 64, 128, 256],
        help="EP sizes: multiples of --gpus-per-node that divide the layer's 256 experts",
    )
    msim.add_argument("--gpus-per-node", type=positive_int, default=8)
    msim.add_argument(
        "--network-gbs", type=positive_float, default=50.0, help="network GB/s a GPU (assumed)"
    )
    msim.add_argument(
        "--network-alpha-us",
        type=non_negative_float,
        default=5.0,
        help="network latency a leg, us (assumed)",
    )
    msim.add_argument("--out", default="", help="JSON output (none if empty)")
    msim.set_defaults(func=cmd_multinode_simulate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))
