"""Routing layout and row lists: uniep's routing_layout and expert_rows against plain torch.

The baseline, measured in the same run on the same routing: scatter_add_ for tokens_per_expert,
scatter_ of each slot's rank into a [T, W+1] bool map (column W catches unused slots) for
token_in_rank, and its column sums for tokens_per_rank. No host synchronisation, so it is the
fastest plain-torch version we know. Both must produce identical outputs before either is timed.

On CUDA each implementation is timed twice: eagerly (the uniep op then includes its bad-id check,
one stream synchronisation) and as a replayed CUDA graph (under capture the op skips that check,
so this is the kernel alone).

The row lists (torch.ops.uniep.expert_rows, the dispatch's row-list kernels) are timed on what
rank 0 receives in the DeepSeek-V3 dispatch at EP2 and EP4, against a stable sort of the (slot,
k) entries by local expert in plain torch. Both read the row count on the host (one sync each);
on CUDA each row also carries its GPU time per kernel from the profiler (`kernel_us`).

    python bench/bench_layout.py --quick     # CPU op vs baseline on CPU, small shape
    python bench/bench_layout.py             # CUDA when present: DeepSeek-V3 and decode shapes
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import add_out_dir_argument, median_time_ms, profile_kernels, write_result  # noqa: E402

Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# (label, tokens, top_k, experts, world_size)
GPU_SHAPES = [("deepseek-v3 prefill", 4096, 8, 256, 4), ("decode", 128, 8, 288, 8)]
# (label, tokens per source, top_k, experts, world_size): rank 0's receive side
ROW_SHAPES = [("deepseek-v3 EP2", 4096, 8, 256, 2), ("deepseek-v3 EP4", 4096, 8, 256, 4)]
CPU_ROW_SHAPES = [("cpu small", 512, 8, 64, 4)]
CPU_QUICK = [("cpu small", 512, 8, 64, 4)]
CPU_FULL = CPU_QUICK + GPU_SHAPES


def torch_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> Layout:
    """routing_layout with plain torch ops: the baseline."""
    tokens = topk_idx.shape[0]
    used = topk_idx >= 0
    # Unused slots are sent to an extra bin (expert E, rank W) that is cut off afterwards.
    expert = torch.where(used, topk_idx, num_experts)
    tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_idx.device)
    tokens_per_expert.scatter_add_(0, expert.flatten(), torch.ones_like(expert).flatten())
    rank = torch.where(used, topk_idx // (num_experts // world_size), world_size)
    in_rank = torch.zeros(tokens, world_size + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, rank, True)
    token_in_rank = in_rank[:, :world_size].contiguous()
    return token_in_rank.sum(dim=0), tokens_per_expert[:num_experts], token_in_rank


def uniep_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> Layout:
    return torch.ops.uniep.routing_layout(topk_idx, num_experts, world_size)


def make_routing(tokens: int, top_k: int, experts: int, device: str) -> torch.Tensor:
    """Distinct experts per token, uniformly at random, as a router's top-k gives."""
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k]
    return idx.contiguous().to(device)


def graphed(fn: Callable[[], Layout]) -> Callable[[], None]:
    """fn captured once in a CUDA graph; the returned callable replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph advises
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_shape(
    label: str, tokens: int, top_k: int, experts: int, world: int, device: str, iters: int
) -> list[dict[str, Any]]:
    idx = make_routing(tokens, top_k, experts, device)
    ours, base = uniep_layout(idx, experts, world), torch_layout(idx, experts, world)
    names = ("tokens_per_rank", "tokens_per_expert", "token_in_rank")
    for name, a, b in zip(names, ours, base, strict=True):
        # Timing a wrong answer is meaningless.
        if a.dtype != b.dtype or not torch.equal(a, b):
            raise RuntimeError(f"{label}: uniep and the baseline disagree on {name}")

    cuda = device == "cuda"
    common = {"shape": label, "tokens": tokens, "top_k": top_k, "experts": experts}
    common.update(world_size=world, device=device)
    impls: list[tuple[str, Callable[[], object]]] = [
        ("uniep", lambda: uniep_layout(idx, experts, world)),
        ("torch", lambda: torch_layout(idx, experts, world)),
    ]
    if cuda:
        impls += [
            ("uniep graph", graphed(lambda: uniep_layout(idx, experts, world))),
            ("torch graph", graphed(lambda: torch_layout(idx, experts, world))),
        ]
    rows = []
    for impl, fn in impls:
        ms = median_time_ms(fn, warmup=max(3, iters // 10), iters=iters, cuda=cuda)
        rows.append({**common, "impl": impl, "median_ms": ms})
    for row in rows:
        twin = "torch graph" if row["impl"].endswith("graph") else "torch"
        base_ms = next(r["median_ms"] for r in rows if r["impl"] == twin)
        row["speedup_vs_torch"] = base_ms / row["median_ms"]
    return rows


def received(tokens: int, top_k: int, experts: int, world: int, device: str) -> Layout:
    """What rank 0 receives when every rank dispatches `tokens` routed tokens: (recv_src,
    recv_topk_idx, recv_from_rank), slots ordered by (source, token)."""
    per_rank = experts // world
    srcs, ids, counts = [], [], []
    for s in range(world):
        idx = make_routing(tokens + s, top_k, experts, "cpu")[:tokens]
        keep = (idx < per_rank).any(dim=1)
        srcs.append(torch.arange(tokens)[keep])
        ids.append(idx[keep])
        counts.append(int(keep.sum()))
    return (
        torch.cat(srcs).to(device),
        torch.cat(ids).contiguous().to(device),
        torch.tensor(counts, dtype=torch.int64, device=device),
    )


def torch_expert_rows(recv: Layout, experts: int, max_tokens: int) -> Layout:
    """expert_rows of rank 0 in plain torch: a stable sort of the (slot, k) entries by expert."""
    src, ids, from_rank = recv
    world, top_k = from_rank.numel(), ids.shape[1]
    per_rank = experts // world
    local = (ids >= 0) & (ids < per_rank)
    key = torch.where(local, ids, per_rank).flatten()
    per_expert = torch.bincount(key, minlength=per_rank + 1)[:per_rank]
    rows = int(per_expert.sum())
    entry = torch.sort(key, stable=True).indices[:rows]
    slot = entry // top_k
    source = torch.repeat_interleave(
        torch.arange(world, device=ids.device), from_rank, output_size=src.numel()
    )
    target = source[slot] * (max_tokens * top_k) + src[slot] * top_k + entry % top_k
    return slot, target, per_expert


def bench_rows(
    label: str, tokens: int, top_k: int, experts: int, world: int, device: str, iters: int
) -> list[dict[str, Any]]:
    recv = received(tokens, top_k, experts, world, device)
    fns: dict[str, Callable[[], object]] = {
        "uniep expert_rows": lambda: torch.ops.uniep.expert_rows(*recv, 0, experts, tokens),
        "torch expert_rows": lambda: torch_expert_rows(recv, experts, tokens),
    }
    ours, base = (fn() for fn in fns.values())
    for name, a, b in zip(("row_slot", "row_target", "tokens_per_expert"), ours, base, strict=True):
        if not torch.equal(a, b):
            raise RuntimeError(f"{label}: uniep and the baseline disagree on {name}")
    cuda = device == "cuda"
    common = {"shape": f"{label} ({recv[0].numel()} slots)", "tokens": tokens, "top_k": top_k}
    common.update(experts=experts, world_size=world, device=device)
    kernels = profile_kernels(fns, iters=20) if cuda else {}
    rows = []
    for impl, fn in fns.items():
        ms = median_time_ms(fn, warmup=max(3, iters // 10), iters=iters, cuda=cuda)
        rows.append({**common, "impl": impl, "median_ms": ms, "kernel_us": kernels.get(impl)})
    for row in rows:
        row["speedup_vs_torch"] = rows[1]["median_ms"] / row["median_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU op vs baseline, small shape")
    add_out_dir_argument(parser)
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)

    import uniep  # noqa: F401  (registers torch.ops.uniep)

    if torch.cuda.is_available() and not args.quick:
        device, shapes, iters = "cuda", GPU_SHAPES, args.iters or 200
    else:
        device = "cpu"
        shapes, iters = (
            (CPU_QUICK, args.iters or 20) if args.quick else (CPU_FULL, args.iters or 50)
        )
    rows = []
    print("| shape | T | K | E | W | device | impl | median ms | speedup vs torch |")
    print("|---|---:|---:|---:|---:|---|---|---:|---:|")
    row_shapes = CPU_ROW_SHAPES if device == "cpu" else ROW_SHAPES
    results = [bench_shape(*shape, device=device, iters=iters) for shape in shapes]
    results += [bench_rows(*shape, device=device, iters=iters) for shape in row_shapes]
    for shape_rows in results:
        for r in shape_rows:
            rows.append(r)
            print(
                f"| {r['shape']} | {r['tokens']} | {r['top_k']} | {r['experts']} | "
                f"{r['world_size']} | {r['device']} | {r['impl']} | {r['median_ms']:.4f} | "
                f"{r['speedup_vs_torch']:.2f}x |",
                flush=True,
            )
    for r in rows:
        if r.get("kernel_us"):
            print(f"{r['shape']}, {r['impl']}: GPU us per call by kernel {r['kernel_us']}")
    path = write_result("bench_layout", rows, args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
