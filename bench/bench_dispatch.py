"""Expert-parallel dispatch and combine: uniep.moe.ep against NCCL all_to_all_single, same routing.

One NCCL process per GPU (all visible GPUs, at least 2). Each rank routes its tokens to top-k
distinct random experts; both implementations then move the same rows:

- uniep: ``uniep.moe.ep.dispatch`` (a token goes once to every rank hosting one of its experts; the
  op synchronises the host to learn the receive count, which is part of its time) and
  ``uniep.moe.ep.combine`` of one random row per grouped-GEMM row, for several SM budgets,
  with the default combine (bf16 rows, one row per (token, k) on the wire) and
  ``combine=rank_partials`` (fp32 rows, as ``moe_forward`` passes the second GEMM's sums: the
  expert rank first sums its rows of each token, weights applied, and sends one bf16 row per
  (token, rank): the baseline's bytes, with that local sum inside our time). Every one of
  them runs on the row's SM budget (tuning ``sms=S/S``); before 2026-11-26 the combines ran on
  the whole GPU whatever the row said. Both combines are also timed once on the whole GPU
  (``combine_whole_gpu_*``, ``rank_partials_combine_whole_gpu_*``): what the budget costs them.
- uniep cached: ``uniep.moe.ep.dispatch_cached`` of the same rows on the plan of the last dispatch
  (no layout, count exchange or host sync; a device barrier, then the transfer), bf16 and fp8
  (cast in the kernel). DeepEP's own sweep, where the ANCHORS.md figures come from, times this
  mode (``buffer.dispatch(x, handle=...)``), with its fp8 rows cast before the timed call.
- baseline (what users write today): ``all_to_all_single`` of one bf16 row per (token,
  destination rank), i.e. the copy-equivalent of our dispatch, and for combine the reverse
  ``all_to_all_single`` followed by ``index_add_`` into [T, H]. Only the collectives (and the
  index_add_) are timed; split sizes are exchanged once up front.

GB/s are counted as DeepEP counts them: bytes received (rows received by the rank x H x 2) over
the slowest rank's median time; combine uses the dispatch's byte count. A combine needs a fresh
dispatch (the runtime re-arms its combine signals in dispatch), so every timed combine follows an
untimed dispatch. Before timing, the combine of the received rows themselves must give back
x * sum_k w (rel. err < 1e-2), or the run fails.

Each shape runs in its own spawn (init_runtime, timing, shutdown): NVSHMEM is finalised when the
runtime that started it is destroyed, and its heap is sized by the first runtime of a process.

    python bench/bench_dispatch.py --quick   # decode shape and a small one; skipped without CUDA
    python bench/bench_dispatch.py           # DeepSeek-V3 prefill and low-latency decode shapes
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import (  # noqa: E402
    ShapeClock,
    add_budget_argument,
    add_out_dir_argument,
    add_profile_argument,
    add_trace_arguments,
    median_time_ms,
    profile_kernels,
    trace_paths,
    write_result,
)

# (name, tokens per rank, hidden, top_k, experts in total): the shapes of /work/shared/ANCHORS.md.
SHAPES_FULL = [("dsv3", 4096, 7168, 8, 256), ("ll", 128, 7168, 8, 288)]
SHAPES_QUICK = [("ll", 128, 7168, 8, 288), ("small", 512, 2048, 4, 32)]
SM_BUDGETS = (24, 16, 32)
CHECK_TOLERANCE = 1e-2

# The goals, and DeepEP v1.2.1 intranode on 4x H200 (EP4) as recorded in ANCHORS.md.
GOALS = {
    "goal_dispatch_GBps": 370.0,
    "goal_fp8_dispatch_GBps": 300.0,
    "goal_combine_GBps": 410.0,
    "goal_ll_total_us": 75.0,
}
ANCHORS = {
    "deepep_dispatch_GBps": 261.0,
    "deepep_combine_GBps": 357.0,
    "deepep_dispatch_us": 811.0,
    "deepep_combine_us": 594.0,
    "deepep_ll_dispatch_us": 36.7,
    "deepep_ll_combine_us": 55.4,
    "deepep_ll_total_us": 95.0,
    "anchor_world_size": 4,
}
# Inherited by the spawned ranks: no NVLink multicast (see KINDS.md), and device waits that give
# up well before the launcher's timeout.
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "UNIEP_TIMEOUT_S": "60",
}


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (out.float() - expected).abs().max().item()
    scale = expected.abs().max().item()
    return diff / (scale if scale > 0 else 1.0)


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _settle() -> None:
    """Every rank idle and at the same point before a variant is timed."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def _median_combine_ms(
    dispatch_fn: Callable[[], Any], combine_fn: Callable[[Any], object], warmup: int, iters: int
) -> float:
    """Median CUDA-event time of ``combine_fn(handle)`` alone, each after an untimed dispatch."""
    for _ in range(warmup):
        combine_fn(dispatch_fn().handle)
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        handle = dispatch_fn().handle
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        combine_fn(handle)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in events))


def _bench_rank(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import uniep.moe.ep as ep

    name, tokens, hidden, top_k, experts = cfg["shape"]
    warmup, iters = cfg["warmup"], cfg["iters"]
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    bf16 = torch.bfloat16

    gen = torch.Generator(device=dev).manual_seed(1234 + 7919 * rank)
    x = torch.randn(tokens, hidden, generator=gen, device=dev).to(bf16)
    idx = torch.rand(tokens, experts, generator=gen, device=dev).topk(top_k, dim=1).indices
    idx = idx.contiguous()
    w = torch.randn(tokens, top_k, generator=gen, device=dev).softmax(dim=1).contiguous()

    # Decode batches also get the low-latency buffers (no host sync, graph-capturable).
    ll_tokens = tokens if tokens <= 256 else 0
    ep.init_runtime(
        max_tokens=tokens,
        hidden=hidden,
        top_k=top_k,
        num_experts=experts,
        ll_max_tokens=ll_tokens,
    )

    # ---- correctness guard: combine(received rows per row_slot) == x * sum_k w over valid k ----
    res = ep.dispatch(x, idx, w, tuning=f"sms={SM_BUDGETS[0]}")
    n_recv, n_rows = res.recv_x.shape[0], res.handle.row_slot.numel()
    back = ep.combine(res.recv_x.index_select(0, res.handle.row_slot), res.handle)
    expected = x.float() * (w * (idx >= 0)).sum(dim=1, keepdim=True)
    (check_err,) = _max_over_ranks([_rel_err(back, expected)], dev)
    if not check_err < CHECK_TOLERANCE:  # also catches NaN
        raise RuntimeError(
            f"{name}: combine(dispatch(x)) differs from x * sum(w): max rel err {check_err:.3e} "
            f">= {CHECK_TOLERANCE:.0e} on some rank; the rows did not move correctly"
        )
    # The same with combine=rank_partials (one bf16 partial per (token, rank) on the wire).
    res = ep.dispatch(x, idx, w, tuning=f"sms={SM_BUDGETS[0]},combine=rank_partials")
    back = ep.combine(res.recv_x.index_select(0, res.handle.row_slot), res.handle)
    ep.check()
    (partials_err,) = _max_over_ranks([_rel_err(back, expected)], dev)
    if not partials_err < CHECK_TOLERANCE:
        raise RuntimeError(
            f"{name}: combine=rank_partials of dispatch(x) differs from x * sum(w): max rel err "
            f"{partials_err:.3e} >= {CHECK_TOLERANCE:.0e} on some rank"
        )
    y = torch.randn(n_rows, hidden, generator=gen, device=dev).to(bf16)
    y32 = y.float()  # rank_partials' rows, fp32 as moe_forward's second GEMM stores them
    del back, expected

    # ---- NCCL baseline on the same routing: one row per (token, destination rank) ----
    _, _, token_in_rank = torch.ops.uniep.routing_layout(idx, experts, world)
    # Rows for rank d are the tokens with token_in_rank[:, d], ascending: (dst, token) order.
    send_idx = token_in_rank.t().nonzero()[:, 1].contiguous()
    send_counts = token_in_rank.sum(dim=0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    if sum(recv_splits) != n_recv:
        raise RuntimeError(
            f"{name}: rank {rank} receives {n_recv} rows from uniep.moe.ep.dispatch but "
            f"{sum(recv_splits)} with the same routing over NCCL"
        )
    send_x = x.index_select(0, send_idx)
    nccl_recv = x.new_empty(n_recv, hidden)
    nccl_y = torch.randn(n_recv, hidden, generator=gen, device=dev).to(bf16)
    nccl_back = x.new_empty(send_idx.numel(), hidden)

    def nccl_dispatch() -> None:
        dist.all_to_all_single(nccl_recv, send_x, recv_splits, send_splits)

    def nccl_combine() -> torch.Tensor:
        dist.all_to_all_single(nccl_back, nccl_y, send_splits, recv_splits)
        out = torch.zeros(tokens, hidden, dtype=bf16, device=dev)
        return out.index_add_(0, send_idx, nccl_back)

    def nccl_both() -> torch.Tensor:
        nccl_dispatch()
        return nccl_combine()

    # Receive slots are ordered (source rank, source token), as the NCCL rows are.
    nccl_dispatch()
    same = torch.tensor([int(torch.equal(nccl_recv, res.recv_x))], device=dev)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    recv_matches_nccl = bool(same.item())
    del res

    timings: dict[str, float] = {}
    for key, fn in (
        ("nccl_dispatch", nccl_dispatch),
        ("nccl_combine", nccl_combine),
        ("nccl_total", nccl_both),
    ):
        _settle()
        timings[key] = median_time_ms(fn, warmup, iters, cuda=True)

    # ---- ours, per SM budget ----
    # A cached dispatch needs the handle of the runtime's current plan: the last fresh dispatch.
    latest: dict[str, ep.Handle] = {}

    def run_dispatch(tuning: str) -> ep.DispatchResult:
        res = ep.dispatch(x, idx, w, tuning=tuning)
        latest["handle"] = res.handle
        return res

    def run_cached(tuning: str) -> ep.CachedDispatchResult:
        return ep.dispatch_cached(x, latest["handle"], tuning=tuning)

    def run_combine(handle: ep.Handle) -> torch.Tensor:
        return ep.combine(y32 if "combine=rank_partials" in handle.tuning else y, handle)

    def run_both(tuning: str) -> torch.Tensor:
        return run_combine(run_dispatch(tuning).handle)

    for sms in SM_BUDGETS:
        # sms=S/S: the dispatch's S communication SMs, and S in all for the combine (which
        # takes the tuning's total; "sms=S" alone would leave it the whole device).
        tuning = f"sms={sms}/{sms}"
        _settle()
        timings[f"dispatch_{sms}"] = median_time_ms(
            functools.partial(run_dispatch, tuning), warmup, iters, cuda=True
        )
        _settle()
        timings[f"combine_{sms}"] = _median_combine_ms(
            functools.partial(run_dispatch, tuning), run_combine, warmup, iters
        )
        _settle()
        timings[f"rpcombine_{sms}"] = _median_combine_ms(
            functools.partial(run_dispatch, f"{tuning},combine=rank_partials"),
            run_combine,
            warmup,
            iters,
        )
        _settle()
        timings[f"total_{sms}"] = median_time_ms(
            functools.partial(run_both, tuning), warmup, iters, cuda=True
        )
        _settle()
        timings[f"cached_{sms}"] = median_time_ms(
            functools.partial(run_cached, tuning), warmup, iters, cuda=True
        )
        if hidden % 128 == 0:
            # fp8: the cast to e4m3 (1x128 block scales) happens inside the dispatch kernel.
            _settle()
            timings[f"fp8dispatch_{sms}"] = median_time_ms(
                functools.partial(run_dispatch, f"{tuning},dispatch=fp8"), warmup, iters, cuda=True
            )
            _settle()
            timings[f"fp8cached_{sms}"] = median_time_ms(
                functools.partial(run_cached, f"{tuning},dispatch=fp8"), warmup, iters, cuda=True
            )

    # The combines once more on the whole GPU (tuning total 0), beside the budgeted ones: what
    # the SM budget costs them.
    for key, tuning in (
        ("combine_all", "sms=24"),
        ("rpcombine_all", "sms=24,combine=rank_partials"),
    ):
        _settle()
        timings[key] = _median_combine_ms(
            functools.partial(run_dispatch, tuning), run_combine, warmup, iters
        )

    profile_fns: dict[str, Callable[[], object]] = {
        "dispatch_24": functools.partial(run_dispatch, "sms=24/24"),
        "fp8dispatch_24": functools.partial(run_dispatch, "sms=24/24,dispatch=fp8"),
        "cached_24": functools.partial(run_cached, "sms=24/24"),
        "fp8cached_24": functools.partial(run_cached, "sms=24/24,dispatch=fp8"),
        "dispatch_combine_24": functools.partial(run_both, "sms=24/24"),
        "dispatch_rpcombine_24": functools.partial(run_both, "sms=24/24,combine=rank_partials"),
    }
    if hidden % 128 != 0:
        del profile_fns["fp8dispatch_24"], profile_fns["fp8cached_24"]
    if ll_tokens:
        # Low-latency mode: dispatch + (stand-in expert: the received rows) + combine, eager and
        # as replays of one captured CUDA graph (how decode steps run it).
        def ll_both(buffer: int = 0) -> torch.Tensor:
            res = ep.ll_dispatch(x, idx, buffer=buffer)
            return ep.ll_combine(res.recv_x.contiguous(), idx, w, buffer=buffer)

        def ll_dispatch_only() -> ep.LowLatencyResult:
            return ep.ll_dispatch(x, idx, buffer=0)

        _settle()
        timings["ll_dispatch"] = median_time_ms(ll_dispatch_only, warmup, iters, cuda=True)
        _settle()
        timings["ll_total"] = median_time_ms(ll_both, warmup, iters, cuda=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ll_both(1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ll_both(1)
        _settle()
        timings["ll_total_graph"] = median_time_ms(graph.replay, warmup, iters, cuda=True)
        ep.check()
        profile_fns = {"ll_dispatch": ll_dispatch_only, "ll_dispatch_combine": ll_both}

    # Every rank runs the profiled calls (they are collective); rank 0's numbers are kept.
    _settle()

    traces = trace_paths(cfg, f"trace-{name}", rank)
    profile = profile_kernels(profile_fns, cfg.get("profile_iters", 0), traces)

    keys = sorted(timings)
    slowest = dict(zip(keys, _max_over_ranks([timings[k] for k in keys], dev), strict=True))
    _settle()
    ep.shutdown()
    if rank != 0:
        return []

    recv_bytes = n_recv * hidden * 2
    # What fp8 rows weigh on the wire, as DeepEP counts them: e4m3 bytes plus the block scales.
    fp8_bytes = n_recv * (hidden + hidden // 128 * 4)

    def us(key: str) -> float:
        return timings[key] * 1e3

    def us_max(key: str) -> float:
        return slowest[key] * 1e3

    def gbps(key: str) -> float:
        return recv_bytes / (slowest[key] * 1e-3) / 1e9

    common = {
        "shape": name,
        "tokens_per_rank": tokens,
        "hidden": hidden,
        "top_k": top_k,
        "experts": experts,
        "world_size": world,
        "recv_rows": n_recv,
        "grouped_rows": n_rows,
        "recv_bytes": recv_bytes,
    }
    baseline = {
        "nccl_dispatch_us": us("nccl_dispatch"),
        "nccl_dispatch_us_max": us_max("nccl_dispatch"),
        "nccl_combine_us": us("nccl_combine"),
        "nccl_combine_us_max": us_max("nccl_combine"),
        "nccl_total_us_max": us_max("nccl_total"),
        "nccl_dispatch_GBps": gbps("nccl_dispatch"),
        "nccl_combine_GBps": gbps("nccl_combine"),
    }
    rows = []
    for sms in SM_BUDGETS:
        d, c, t = f"dispatch_{sms}", f"combine_{sms}", f"total_{sms}"
        row = {**common, "num_sms": sms}
        row.update(
            dispatch_us=us(d),
            dispatch_us_max=us_max(d),
            combine_us=us(c),
            combine_us_max=us_max(c),
            total_us=us(t),
            total_us_max=us_max(t),
            dispatch_GBps=gbps(d),
            combine_GBps=gbps(c),
        )
        rp = f"rpcombine_{sms}"
        row.update(
            rank_partials_combine_us=us(rp),
            rank_partials_combine_us_max=us_max(rp),
            rank_partials_combine_GBps=gbps(rp),
            rank_partials_speedup_vs_nccl=slowest["nccl_combine"] / slowest[rp],
            rank_partials_check_rel_err=partials_err,
            combine_sms=sms,
        )
        cd = f"cached_{sms}"
        row.update(
            cached_dispatch_us=us(cd),
            cached_dispatch_us_max=us_max(cd),
            cached_dispatch_GBps=gbps(cd),
        )
        f8, c8 = f"fp8dispatch_{sms}", f"fp8cached_{sms}"
        if f8 in timings:
            row.update(
                fp8_dispatch_us=us(f8),
                fp8_dispatch_us_max=us_max(f8),
                fp8_dispatch_GBps=fp8_bytes / (slowest[f8] * 1e-3) / 1e9,
                fp8_cached_dispatch_us=us(c8),
                fp8_cached_dispatch_us_max=us_max(c8),
                fp8_cached_dispatch_GBps=fp8_bytes / (slowest[c8] * 1e-3) / 1e9,
            )
        row.update(baseline)
        row.update(
            combine_whole_gpu_us_max=us_max("combine_all"),
            combine_whole_gpu_GBps=gbps("combine_all"),
            rank_partials_combine_whole_gpu_us_max=us_max("rpcombine_all"),
            rank_partials_combine_whole_gpu_GBps=gbps("rpcombine_all"),
        )
        row.update(
            dispatch_speedup_vs_nccl=slowest["nccl_dispatch"] / slowest[d],
            combine_speedup_vs_nccl=slowest["nccl_combine"] / slowest[c],
            check_rel_err=check_err,
            recv_matches_nccl=recv_matches_nccl,
            warmup=warmup,
            iters=iters,
        )
        if "ll_total" in timings:
            row.update(
                ll_dispatch_us_max=us_max("ll_dispatch"),
                ll_total_us_max=us_max("ll_total"),
                ll_total_graph_us_max=us_max("ll_total_graph"),
            )
        row.update(GOALS)
        row.update(ANCHORS)
        if profile:
            row["kernel_us_rank0"] = profile
        rows.append(row)
    return rows


HEADER = [
    "| shape | W | SMs | dispatch us (max) | dispatch GB/s | combine us (max) | combine GB/s | "
    "rank-partials combine us (GB/s) | total us (max) | fp8 dispatch us (GB/s) | "
    "cached dispatch us (GB/s) | cached fp8 us (GB/s) | NCCL dispatch us | NCCL combine us | "
    "check err |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _markdown(row: dict[str, Any]) -> str:
    if "skipped" in row or "error" in row:
        lines = str(row.get("error", "")).strip().splitlines() or ["?"]
        why = row.get("skipped") or f"FAILED: {lines[-1]}"
        return f"| {row.get('shape', '-')} | {row.get('world_size', '-')} | - | {why} |"
    return (
        f"| {row['shape']} | {row['world_size']} | {row['num_sms']} | "
        f"{row['dispatch_us']:.1f} ({row['dispatch_us_max']:.1f}) | {row['dispatch_GBps']:.1f} | "
        f"{row['combine_us']:.1f} ({row['combine_us_max']:.1f}) | {row['combine_GBps']:.1f} | "
        f"{row['rank_partials_combine_us_max']:.1f} ({row['rank_partials_combine_GBps']:.1f}) | "
        f"{row['total_us']:.1f} ({row['total_us_max']:.1f}) | "
        + (
            f"{row['fp8_dispatch_us_max']:.1f} ({row['fp8_dispatch_GBps']:.1f}) | "
            if "fp8_dispatch_us_max" in row
            else "- | "
        )
        + f"{row['cached_dispatch_us_max']:.1f} ({row['cached_dispatch_GBps']:.1f}) | "
        + (
            f"{row['fp8_cached_dispatch_us_max']:.1f} ({row['fp8_cached_dispatch_GBps']:.1f}) | "
            if "fp8_cached_dispatch_us_max" in row
            else "- | "
        )
        + f"{row['nccl_dispatch_us_max']:.1f} | {row['nccl_combine_us_max']:.1f} | "
        f"{row['check_rel_err']:.1e} |"
        + (
            f" LL dispatch {row['ll_dispatch_us_max']:.1f} us, dispatch+combine "
            f"{row['ll_total_us_max']:.1f} us eager / {row['ll_total_graph_us_max']:.1f} us graph |"
            if "ll_total_us_max" in row
            else ""
        )
    )


def _finish(rows: list[dict[str, Any]], out_dir: str | None) -> None:
    path = write_result("bench_dispatch", rows, out_dir)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="decode shape and a small one")
    add_out_dir_argument(parser)
    parser.add_argument("--world-size", type=int, default=None, help="default: all GPUs")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (>= 30)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up iterations (>= 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per shape")
    add_budget_argument(parser)
    add_profile_argument(parser)
    add_trace_arguments(parser)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        row = {"skipped": "no CUDA GPUs"}
        print(_markdown(row))
        _finish([row], args.out_dir)
        return 0
    gpus = torch.cuda.device_count()
    world = args.world_size or gpus
    if not 2 <= world <= gpus:
        row = {"skipped": f"needs 2 to {gpus} ranks (one per CUDA GPU), asked for {world}"}
        if gpus < 2:
            row = {"skipped": f"needs >= 2 CUDA GPUs, found {gpus}"}
        print(_markdown(row))
        _finish([row], args.out_dir)
        return 0

    import uniep
    import uniep.moe.ep

    if not uniep.moe.ep.available():
        row = {"skipped": f"uniep built without the GPU runtime ({uniep.build_info()})"}
        print(_markdown(row))
        _finish([row], args.out_dir)
        return 0

    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    from uniep.distributed import run_local_ranks

    shapes = SHAPES_QUICK if args.quick else SHAPES_FULL
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 10)
    iters = args.iters if args.iters is not None else (30 if args.quick else 50)
    rows: list[dict[str, Any]] = []
    failed = False
    print("\n".join(HEADER), flush=True)
    clock = ShapeClock(args.timeout, args.budget, floor_s=15.0)
    for i, shape in enumerate(shapes):
        name, experts = shape[0], shape[4]
        if experts % world != 0:
            new = [{"shape": name, "world_size": world, "skipped": f"{experts} experts % {world}"}]
        else:
            cfg = {
                "shape": shape,
                "warmup": warmup,
                "iters": iters,
                "profile_iters": args.profile,
                "trace": args.trace,
                "trace_dir": args.trace_dir,
            }
            try:
                timeout_s = clock.timeout(len(shapes) - 1 - i)
                new = run_local_ranks(
                    _bench_rank, world, (cfg,), backend="nccl", timeout_s=timeout_s
                )[0]
            except RuntimeError as exc:
                # Keep the other shapes' numbers; the run still fails below.
                failed = True
                print(f"{name}: {exc}", file=sys.stderr, flush=True)
                new = [{"shape": name, "world_size": world, "error": str(exc)[-4000:]}]
        for row in new:
            print(_markdown(row), flush=True)
        rows += new
    _finish(rows, args.out_dir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
