"""MoE decode at world 1: ``moe_forward`` on 1-512 tokens against reading the touched experts'
weights once.

In decode most experts get a handful of rows, so a layer's time is bounded below by the read of
the weights of the experts that some token picked. This benchmark measures that floor in the same
run (the HBM read rate of a streaming reduction over all the expert weights, times the touched
experts' bytes) and, per load and token count, the layer's paths against it:

    moe_forward           ``torch.ops.uniep.moe_forward``, default tuning
    moe_forward fused     the same with ``overlap=fused`` (the MegaKernel on w1 as stored)
    fused 64x256          ``overlap=fused,tile_m=64,tile_n=256``: the tiles before the decode shape
    gemm=torch            ``torch._grouped_mm`` for the experts
    prepared              ``moe_forward_prepared`` on ``bf16_packed`` experts, default tuning
                          (the MegaKernel on decode batches at world 1: ``fused_by_default``)
    local fused           ``moe_forward_local(overlap="fused")``: the MegaKernel without a host
                          sync (the low-latency path), errors checked after the timing; its tile
                          left to the choice; on these batches the routing is planned in the
                          MegaKernel's first launch (``moe_fused_local_planned``)
    local fused, plan apart  the same with the plan as its own launch ahead (``local_plan``, then
                          ``moe_fused_local``); ``graph_ratio[...]`` times the two graphs in
                          interleaved rounds
    local 64x256          the same with 64 x 256 tiles in clusters of two
    local 64x128          the same with the decode shape, 64 x 128 tiles in clusters of one
    prepared fp8          ``moe_forward_prepared`` on fp8 experts with ``dispatch=fp8`` (at world
                          1 the launches with no host sync: ``uniep.moe.fp8_local``), against
                          the read of the touched experts' fp8 bytes
    local fp8             the same launches with no host sync called eagerly
                          (``fp8_local.moe_forward_fp8_local``), which an eager ``prepared fp8``
                          call takes from ``EAGER_MIN_ROWS`` rows (below, the dispatch's path)
    moe_forward fp8       ``moe_forward`` with ``dispatch=fp8`` (at world 1 the device's plan,
                          each token quantized at its rows, the fp8 GEMMs on its e4m3 copy of
                          the weights, the combine), against the same read

Loads (bf16; top-k distinct experts per token, uniformly at random with a fixed seed):

    load       hidden  expert FFN  experts  top-k
    qwen3-128    2048         768      128      8
    dsv3-256     7168        2048      256      8

Each row also says whether each path's output has the bits of ``moe_forward``'s (every path of
UniEP's engine should; ``gemm=torch``, another GEMM, need not; the fp8 paths give their error
against the bf16 output's norm instead, and whether ``prepared fp8`` has ``moe_forward fp8``'s
bits) and whether the path can be captured in a CUDA graph
(``graph[...]``: the replay time, or the error capture gave). ``--profile N`` adds the per-kernel
GPU time of the two local tiles at each token count, and ``timeline_us[...]``: the fused layer's
and the fp8 step's graphs over N replays, each kernel as (label, end, after): when it ends after
the step's start and after the kernels ahead of it (``harness/common.kernel_timeline``).
``--tokens`` times other batch sizes (a scratch ``--out-dir``: the committed file holds the
decode table's 1-512), e.g. the few-token steps where GEMM 1's tiles fill one round of the SMs
or two, which ``local 64x128`` and ``local 64x256`` beside the launch's choice show.

    python bench/bench_decode.py          # on a Hopper GPU; skipped (exit 0) elsewhere
    python bench/bench_decode.py --plot RESULT.json   # the SVG of a result, again
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import (  # noqa: E402
    add_out_dir_argument,
    graph_timeline,
    median_time_ms,
    profile_kernels,
    sm90_kernel_missing,
    topk_routing,
    write_result,
)

# (load, hidden, ffn, experts, top-k)
LOADS = [("qwen3-128", 2048, 768, 128, 8), ("dsv3-256", 7168, 2048, 256, 8)]
TOKENS = [1, 16, 64, 128, 256, 512]
# Paths of moe_forward by their tuning string.
PLAIN = {
    "moe_forward": "",
    "moe_forward fused": "overlap=fused",
    "fused 64x256": "overlap=fused,tile_m=64,tile_n=256",
    "gemm=torch": "gemm=torch",
    "moe_forward fp8": "dispatch=fp8",
}


def capture(fn: Callable[[], torch.Tensor]) -> torch.cuda.CUDAGraph | str:
    """``fn`` captured in a CUDA graph, or why capture failed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - the reason is the result
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return graph


def graph_time_ms(fn: Callable[[], torch.Tensor], warmup: int, iters: int) -> float | str:
    """The replay time of ``fn`` captured in a CUDA graph, or why capture failed."""
    graph = capture(fn)
    if isinstance(graph, str):
        return graph
    return median_time_ms(graph.replay, warmup, iters, cuda=True)


def interleaved_graph_ratio(
    a: Callable[[], torch.Tensor],
    b: Callable[[], torch.Tensor],
    warmup: int,
    iters: int,
    rounds: int = 10,
) -> float | str:
    """The median over ``rounds`` interleaved rounds of a's replay time over b's (each round
    times both graphs, a first in even rounds and b first in odd ones), or why capture failed:
    a ratio of two paths free of the drift between separate timings."""
    graphs = [capture(a), capture(b)]
    for g in graphs:
        if isinstance(g, str):
            return g
    per = max(iters // rounds, 5)
    ratios = []
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        ms = [0.0, 0.0]
        for i in order:
            ms[i] = median_time_ms(graphs[i].replay, warmup if r == 0 else 2, per, cuda=True)
        ratios.append(ms[0] / ms[1])
    return sorted(ratios)[len(ratios) // 2]


def _paths(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    packed: Any,
    fp8: Any,
    group: Any,
) -> dict[str, Callable[[], torch.Tensor]]:
    """The layer's paths on one batch, by label (module docstring)."""
    import uniep
    from uniep.moe import fp8_local
    from uniep.moe.megakernel.launch import moe_forward_local
    from uniep.moe.prepared import moe_forward_prepared

    gname = uniep.distributed.group_name(group)

    def plain(tuning: str) -> Callable[[], torch.Tensor]:
        return lambda: torch.ops.uniep.moe_forward(x, idx, weights, w1, w2, gname, tuning)

    fns = {label: plain(tuning) for label, tuning in PLAIN.items()}
    fns["prepared"] = lambda: moe_forward_prepared(x, idx, weights, packed, group)

    def local(**tiles: int) -> Callable[[], torch.Tensor]:
        return lambda: moe_forward_local(
            x, idx, weights, packed.w1, packed.w2, overlap="fused", check=False, **tiles
        )

    fns["local fused"] = local()

    def plan_apart() -> torch.Tensor:
        # The plan as its own launch ahead of the MegaKernel's two (moe_forward_local's path past
        # the planned launch's bounds), on the tile moe_forward_local picks.
        from uniep.moe import tile_gates
        from uniep.moe.megakernel.launch import fused_tile_m, fused_tile_shape

        tile_m = fused_tile_m(idx.numel(), packed.w1.shape[0], x.device)
        _, tile_n = fused_tile_shape(tile_m, None, "fused")
        _, offs, base, _, row, counter, _ = tile_gates.local_plan(idx, packed.w1.shape[0], tile_m)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        out, _, _ = torch.ops.uniep.moe_fused_local(
            x, weights, row, counter, packed.w1, packed.w2, offs, base, sms, -1, 10.0, None,
            tile_m, False, tile_n,
        )  # fmt: skip
        return out

    fns["local fused, plan apart"] = plan_apart
    fns["local 64x256"] = local(tile_m=64, tile_n=256)
    fns["local 64x128"] = local(tile_m=64, tile_n=128)
    fns["prepared fp8"] = lambda: moe_forward_prepared(x, idx, weights, fp8, group, "dispatch=fp8")
    # Its no-sync launches called eagerly, where an eager call below EAGER_MIN_ROWS takes the
    # dispatch: what that threshold weighs.
    fns["local fp8"] = lambda: fp8_local.moe_forward_fp8_local(
        x, idx, weights, fp8, "dispatch=fp8", check=False
    )
    return fns


def _load_rows(
    group: Any, load: tuple[str, int, int, int, int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    import uniep
    from uniep.moe.megakernel.launch import check_errors
    from uniep.moe.prepared import prepare_experts

    name, hidden, ffn, experts, top_k = load
    tokens_list = [t for t in args.tokens if t <= args.max_tokens]
    uniep.moe.ep.init_runtime(
        group, max_tokens=max(tokens_list), hidden=hidden, top_k=top_k, num_experts=experts
    )
    gen = torch.Generator(device="cuda").manual_seed(experts)
    bf16 = torch.bfloat16
    w1 = torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda", dtype=bf16)
    w1.mul_(hidden**-0.5)
    w2 = torch.randn(experts, ffn, hidden, generator=gen, device="cuda", dtype=bf16)
    w2.mul_(ffn**-0.5)
    packed = prepare_experts(w1, w2, "bf16_packed")
    fp8 = prepare_experts(w1, w2, "fp8")
    expert_bytes = (hidden * 2 * ffn + ffn * hidden) * 2

    # The HBM read rate: one streaming reduction over every expert weight.
    def read_all() -> torch.Tensor:
        return w1.sum(dtype=torch.float32) + w2.sum(dtype=torch.float32)

    read_ms = median_time_ms(read_all, args.warmup, args.iters, cuda=True)
    read_gbs = experts * expert_bytes / read_ms / 1e6
    print(f"{name}: HBM read {read_gbs:.0f} GB/s", flush=True)
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=bf16)
        idx, weights = (t.cuda() for t in topk_routing(tokens, experts, top_k, seed=tokens))
        touched = int(idx.unique().numel())
        floor_ms = touched * expert_bytes / read_gbs / 1e6
        row: dict[str, Any] = {
            "load": name,
            "tokens": tokens,
            "hidden": hidden,
            "ffn": ffn,
            "experts": experts,
            "top_k": top_k,
            "touched": touched,
            "read_gbs": read_gbs,
            "floor_ms": floor_ms,
            "floor_fp8_ms": floor_ms / 2,
        }
        fns = _paths(x, idx, weights, w1, w2, packed, fp8, group)
        with torch.no_grad():
            ref = fns["moe_forward"]()
            fp8_outs = {}
            for label, fn in fns.items():
                try:
                    out = fn()
                    check_errors()
                except (RuntimeError, ValueError, TimeoutError) as e:
                    row[f"error[{label}]"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(f"{name} T={tokens}: {label}: {row[f'error[{label}]']}", flush=True)
                    continue
                if "fp8" in label:
                    rel = float((out.float() - ref.float()).norm() / ref.float().norm())
                    row[f"rel_diff[{label}]"] = rel
                    fp8_outs[label] = out
                else:
                    row[f"same_bits[{label}]"] = bool(torch.equal(out, ref))
                ms = median_time_ms(fn, args.warmup, args.iters, cuda=True)
                check_errors()
                row[f"ms[{label}]"] = ms
                floor = row["floor_fp8_ms"] if "fp8" in label else floor_ms
                row[f"over_floor[{label}]"] = ms / floor
            for other in ("moe_forward fp8", "local fp8"):
                if "prepared fp8" in fp8_outs and other in fp8_outs:
                    row[f"same_bits[prepared fp8, {other}]"] = bool(
                        torch.equal(fp8_outs["prepared fp8"], fp8_outs[other])
                    )
            graphed = ("local fused", "local 64x256", "local 64x128", "prepared", "prepared fp8")
            for label in graphed:
                if f"ms[{label}]" in row:
                    row[f"graph[{label}]"] = graph_time_ms(fns[label], args.warmup, args.iters)
            if "ms[local fused, plan apart]" in row:
                row["graph_ratio[local fused / plan apart]"] = interleaved_graph_ratio(
                    fns["local fused"], fns["local fused, plan apart"], args.warmup, args.iters
                )
            if args.profile:
                picks = {k: fns[k] for k in ("local 64x256", "local 64x128") if f"ms[{k}]" in row}
                row["kernels_us"] = profile_kernels(picks, args.profile)
                # Where a step's time goes: each kernel of the graph by when it ends.
                for label in ("local fused", "prepared fp8"):
                    graph = capture(fns[label]) if f"ms[{label}]" in row else None
                    if graph is not None and not isinstance(graph, str):
                        row[f"timeline_us[{label}]"] = graph_timeline(graph, args.profile)
        print(
            f"{name} T={tokens:4d} touched={touched:3d} floor={floor_ms * 1e3:7.1f} us  "
            + "  ".join(
                f"{k[3:-1]}={row[k] * 1e3:.0f}us({row['over_floor' + k[2:]]:.1f}x)"
                for k in row
                if k.startswith("ms[")
            )
            + "  graph: "
            + ", ".join(f"{k[6:-1]}={row[k]}" for k in row if k.startswith("graph["))
            + "".join(f"  {k}={row[k]}" for k in row if k.startswith("graph_ratio[")),
            flush=True,
        )
        rows.append(row)
    uniep.moe.ep.shutdown(group)
    return rows


# The fine-grained experts issue's goals: each path within 1.25x the weight read.
GOAL_OVER_READ = 1.25


def plot_decode(result_path: str | Path) -> Path:
    """An SVG beside a bench_decode JSON: per load, each path's time over the weight read against
    the token count (log-log), with the goal."""
    import json

    from plot_svg import Panel, Series, render_svg

    payload = json.loads(Path(result_path).read_text())
    lines = [
        ("CUDA graph, fused layer (its tile)", "graph[local fused]", "#1f77b4"),
        ("CUDA graph, 64 x 256 tiles", "graph[local 64x256]", "#ff7f0e"),
        ("moe_forward, eager", "ms[moe_forward]", "#2ca02c"),
        ("moe_forward_prepared, eager", "ms[prepared]", "#9467bd"),
        ("CUDA graph, prepared fp8 (over the fp8 read)", "graph[prepared fp8]", "#d62728"),
    ]

    def over(r: dict[str, Any], key: str) -> float | None:
        v = r.get(key)
        floor = r.get("floor_fp8_ms", r["floor_ms"] / 2) if "fp8" in key else r["floor_ms"]
        return v / floor if isinstance(v, (int, float)) else None

    panels = []
    for load in dict.fromkeys(r["load"] for r in payload["rows"]):
        rows = [r for r in payload["rows"] if r["load"] == load]
        xs = [float(r["tokens"]) for r in rows]
        series = [
            Series(label, xs, [over(r, key) for r in rows], color) for label, key, color in lines
        ]
        series.append(Series("goal", xs, [GOAL_OVER_READ] * len(rows), "#000000", True))
        r0 = rows[0]
        title = f"{load}: {r0['experts']} experts, H {r0['hidden']}, FFN {r0['ffn']}"
        panels.append(Panel(title, series, "tokens", "time / weight read"))
    env = payload.get("env", {})
    title = f"bench_decode on {env.get('device', '?')} ({env.get('commit', '?')})"
    out = Path(result_path).with_suffix(".svg")
    out.write_text(render_svg(panels, title, columns=2, log_x=True, log_y=True))
    return out


def _rank(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.distributed as dist

    group = dist.new_group([0])
    rows = []
    for load in LOADS:
        if args.loads and load[0] not in args.loads:
            continue
        rows += _load_rows(group, load, args)
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--plot":
        print(f"wrote {plot_decode(argv[1])}")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=max(TOKENS))
    parser.add_argument(
        "--tokens",
        default=",".join(map(str, TOKENS)),
        help="comma-separated token counts (default: the decode table's); a run of others "
        "belongs in a scratch --out-dir",
    )
    parser.add_argument("--loads", default="", help="comma-separated loads (default: all)")
    parser.add_argument("--profile", type=int, default=0, help="profile N calls per path")
    parser.add_argument("--quick", action="store_true", help="(CPU runs: nothing to measure)")
    add_out_dir_argument(parser)
    args = parser.parse_args(argv)
    args.loads = [name for name in args.loads.split(",") if name]
    try:
        args.tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1:
        parser.error(f"--tokens needs at least one count, each >= 1; got {args.tokens}")
    unknown = sorted(set(args.loads) - {load[0] for load in LOADS})
    if unknown:
        parser.error(f"unknown --loads {unknown}; known: {[load[0] for load in LOADS]}")
    if sm90_kernel_missing("bench_decode", "uniep::moe_forward"):
        return 0
    import uniep

    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(4 << 30))
    rows = uniep.distributed.run_local_ranks(_rank, 1, (args,), backend="nccl", timeout_s=900)[0]
    path = write_result("bench_decode", rows, args.out_dir)
    print(f"wrote {path}")
    print(f"wrote {plot_decode(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
