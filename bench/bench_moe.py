"""MoE layer forward: torch.ops.uniep.moe_forward against what users write today.

The baseline, measured in the same run on the same ranks: copy each token once per chosen expert,
exchange the copies with all_to_all_single, run each local expert with torch matmuls (or
torch._grouped_mm on GPU), send the results back and combine them with index_add.

    python bench/bench_moe.py --quick          # 2 gloo ranks on CPU, small shape
    python bench/bench_moe.py                  # one NCCL rank per GPU when CUDA is present
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import add_out_dir_argument, median_time_ms, write_result  # noqa: E402

CUDA_SKIP = "this build has no CUDA moe_forward (torch without CUDA)"
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}

# (name, tokens per rank, hidden, ffn, experts in total, top_k); the GPU shapes are those of
# /work/shared/ANCHORS.md so the numbers compare with the recorded baselines.
# The default combine (one row per (token, k), summed at home) and the per-rank partials.
UNIEP_VARIANTS = [("uniep", ""), ("uniep combine=rank_partials", "combine=rank_partials")]
CPU_QUICK = [("cpu-small", 256, 256, 512, 8, 2)]
CPU_FULL = CPU_QUICK + [("cpu-medium", 1024, 512, 1024, 16, 4)]
GPU_FULL = [("dsv3-like", 4096, 7168, 2048, 256, 8), ("mixtral-like", 4096, 4096, 14336, 8, 2)]


def _experts_mm(rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor):
    ffn = w2.shape[1]
    outs = []
    for e, part in enumerate(rows.split(counts)):
        h = part @ w1[e]
        outs.append((F.silu(h[:, :ffn]) * h[:, ffn:]) @ w2[e])
    return torch.cat(outs) if outs else rows.new_empty(0, w2.shape[2])


def _experts_grouped(rows: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor):
    ffn = w2.shape[1]
    offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(rows, w1, offs=offs)
    return torch._grouped_mm(F.silu(h[:, :ffn]) * h[:, ffn:], w2, offs=offs)


def route_rows(
    topk_idx: torch.Tensor, local_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], torch.Tensor]:
    """The hand-written baseline's routing exchange: the valid (token, k) entries sorted by
    expert (experts are owned in contiguous blocks, so that is destination-rank order), their
    tokens, the split sizes both ways, and the local expert of each row this rank receives."""
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = topk_idx.reshape(-1)
    keep = (flat >= 0).nonzero().squeeze(1)
    keep = keep[torch.argsort(flat[keep], stable=True)]
    experts = flat[keep]
    send_counts = torch.bincount(experts // local_experts, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    recv_e = experts.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv_e, experts, recv_splits, send_splits)
    return keep, keep // topk_idx.shape[1], send_splits, recv_splits, recv_e - rank * local_experts


def baseline_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    grouped: bool,
) -> torch.Tensor:
    """All-to-all MoE as commonly hand-written: one token copy per (token, expert)."""
    keep, tokens, send_splits, recv_splits, local = route_rows(topk_idx, w1.shape[0])
    recv_x = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(recv_x, x[tokens], recv_splits, send_splits)
    by_expert = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=w1.shape[0]).tolist()
    run = _experts_grouped if grouped else _experts_mm
    out = torch.empty_like(recv_x)
    out[by_expert] = run(recv_x[by_expert], counts, w1, w2).to(x.dtype)

    back = x.new_empty(tokens.numel(), x.shape[1])
    dist.all_to_all_single(back, out, send_splits, recv_splits)
    gates = topk_weights.reshape(-1)[keep].unsqueeze(1)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    y.index_add_(0, tokens, back.float() * gates)
    return y.to(x.dtype)


def _rel_diff(a: torch.Tensor, b: torch.Tensor, chunk_elems: int = 1 << 26) -> float:
    """max |a - b| / max |b| in fp64, a slice of rows at a time: the expert weight gradients of
    the DeepSeek-V3 shape are ~15 GB each, and whole fp64 copies of them do not fit beside the
    layer (the first H200x2 run ran out of memory here)."""
    if a.shape != b.shape:
        raise ValueError(f"_rel_diff: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    a1, b1 = a.reshape(-1), b.reshape(-1)
    diff = scale = 0.0
    for i in range(0, a1.numel(), chunk_elems):
        sa, sb = a1[i : i + chunk_elems].double(), b1[i : i + chunk_elems].double()
        d, m = (sa - sb).abs().max().item(), sb.abs().max().item()
        if math.isnan(d) or math.isnan(m):  # max() below would drop a NaN: report it
            return math.nan
        diff, scale = max(diff, d), max(scale, m)
    return diff / (scale if scale > 0 else 1.0)


def _bench_rank(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import uniep

    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = getattr(torch, cfg["dtype"])
    rows = []
    for shape, tokens, hidden, ffn, experts, top_k in cfg["shapes"]:
        if experts % world != 0:
            raise ValueError(f"{shape}: {experts} experts do not split over {world} ranks")
        group = None
        if cuda and cfg["cuda_op"]:
            # A GPU runtime is sized for one shape: each shape gets its own group and runtime
            # (NVSHMEM is shared; NVSHMEM_SYMMETRIC_SIZE in main() leaves room for all of them).
            group = dist.new_group(list(range(world)))
            uniep.moe.ep.init_runtime(
                group, max_tokens=tokens, hidden=hidden, top_k=top_k, num_experts=experts
            )
        group_name = uniep.distributed.group_name(group)
        torch.manual_seed(0)
        layer = uniep.nn.MoELayer(hidden, ffn, experts, top_k, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        with torch.no_grad():
            topk_idx, topk_weights = layer.route(x)
            w1, w2 = layer.w1.detach(), layer.w2.detach()
        common = {
            "shape": shape,
            "tokens_per_rank": tokens,
            "hidden": hidden,
            "ffn": ffn,
            "experts": experts,
            "top_k": top_k,
            "world_size": world,
            "dtype": cfg["dtype"],
            "device": device.type,
        }

        grouped = False
        if cuda and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            try:
                baseline_moe(x, topk_idx, topk_weights, w1, w2, grouped=True)
                grouped = True
            except RuntimeError:
                grouped = False
        base_name = "baseline: a2a + " + ("torch._grouped_mm" if grouped else "per-expert mm")

        def run_uniep(
            tuning: str = "",
            x=x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            w1=w1,
            w2=w2,
            name=group_name,
        ) -> torch.Tensor:
            return torch.ops.uniep.moe_forward(x, topk_idx, topk_weights, w1, w2, name, tuning)

        def run_base(
            x=x, topk_idx=topk_idx, topk_weights=topk_weights, w1=w1, w2=w2, grouped=grouped
        ) -> torch.Tensor:
            return baseline_moe(x, topk_idx, topk_weights, w1, w2, grouped)

        with torch.no_grad():
            y_base = run_base()
            uniep_rows = []
            for impl, tuning in UNIEP_VARIANTS:
                if cuda and not cfg["cuda_op"]:
                    uniep_rows.append({"impl": impl, "skipped": CUDA_SKIP})
                    continue
                run = functools.partial(run_uniep, tuning)
                diff = torch.tensor([_rel_diff(run(), y_base)], dtype=torch.float64, device=device)
                dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                # Timing a wrong answer is meaningless: the two must agree first.
                if diff.item() > TOLERANCE[cfg["dtype"]]:
                    raise RuntimeError(
                        f"{impl} and the baseline disagree: max rel diff {diff.item():.2e} > "
                        f"{TOLERANCE[cfg['dtype']]:.0e} for {common}"
                    )
                dist.barrier()
                ms = median_time_ms(run, cfg["warmup"], cfg["iters"], cuda)
                uniep_rows.append(
                    {"impl": impl, "median_ms": ms, "max_rel_diff_vs_baseline": diff.item()}
                )
            dist.barrier()
            base_ms = median_time_ms(run_base, cfg["warmup"], cfg["iters"], cuda)
        base_row = {"impl": base_name, "median_ms": base_ms}
        for row in (*uniep_rows, base_row):
            if "median_ms" in row:
                # A step is as slow as its slowest rank.
                t = torch.tensor([row["median_ms"]], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                row["median_ms"] = t.item()
                row["tokens_per_s"] = tokens * world / (row["median_ms"] / 1e3)
            rows.append({**common, **row})
    return rows


def _markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| shape | T/rank, H, I, E, K, W | dtype | device | impl | median ms | tokens/s |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        dims = (
            f"{r['tokens_per_rank']}, {r['hidden']}, {r['ffn']}, {r['experts']}, "
            f"{r['top_k']}, {r['world_size']}"
        )
        if "skipped" in r:
            timing = f"skipped: {r['skipped']} | -"
        else:
            timing = f"{r['median_ms']:.3f} | {r['tokens_per_s']:,.0f}"
        lines.append(
            f"| {r['shape']} | {dims} | {r['dtype']} | {r['device']} | {r['impl']} | {timing} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 gloo ranks on CPU, small shape")
    add_out_dir_argument(parser)
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    import uniep

    gpu = torch.cuda.is_available() and not args.quick
    if gpu:
        world = args.world_size or torch.cuda.device_count()
        cuda_op = bool(uniep.build_info().get("cuda_ops")) and bool(
            torch._C._dispatch_has_kernel_for_dispatch_key("uniep::moe_forward", "CUDA")
        )
        cfg = {"device": "cuda", "dtype": "bfloat16", "shapes": GPU_FULL, "cuda_op": cuda_op}
        cfg.update(warmup=5, iters=args.iters or 20)
        backend = "nccl"
        # Room for one runtime per shape in NVSHMEM's heap, which is sized once per process.
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 << 30))
    else:
        world = args.world_size or 2
        shapes = CPU_QUICK if args.quick else CPU_FULL
        cfg = {"device": "cpu", "dtype": "float32", "shapes": shapes, "cuda_op": False}
        cfg.update(warmup=2, iters=args.iters or (10 if args.quick else 20))
        backend = "gloo"

    results = uniep.distributed.run_local_ranks(
        _bench_rank, world, (cfg,), backend=backend, timeout_s=args.timeout
    )
    rows = results[0]
    path = write_result("bench_moe", rows, args.out_dir)
    print("\n".join(_markdown(rows)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
