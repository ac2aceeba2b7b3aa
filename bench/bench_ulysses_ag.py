"""Ulysses all-to-all and the data-parallel all-gather: uniep's P2P collectives against NCCL
(the multi-GPU run's part 3, beside bench_overlap.py's TP and DP reduce-scatter rows).

For every group size W in ``--tp`` (one spawn of W NCCL ranks each), in bf16:

- ``ulysses_seq_to_heads``: x [S/W, H, D] -> [S, H/W, D]. Ours:
  ``torch.ops.uniep.all_to_all_ulysses(x, 1, 0, group)``. Baseline ``nccl``: what DeepSpeed-Ulysses
  style code writes, the head blocks made contiguous (a copy), ``all_to_all_single``, the result a
  view. ``coll_alone``: the ``all_to_all_single`` alone on contiguous buffers.
- ``ulysses_heads_to_seq``: the way back, [S, H/W, D] -> [S/W, H, D] (``(x, 0, 1)``); the
  baseline's copy comes after the ``all_to_all_single``.
- ``dp_ag``: a bf16 parameter bucket [R, C], each rank holding R/W rows, all-gathered on a side
  stream while the main stream runs forward GEMMs (bf16 8192^3, repeated until they take about as
  long as NCCL's all-gather alone): the time until both are done, ours
  (``torch.ops.uniep.all_gather``, chunks 1/2/4) against NCCL's ``all_gather_into_tensor``, and
  each part alone.

Every output is compared with NCCL's before timing: the Ulysses results and the gathered bucket
must be equal bit for bit. Goal (the issue's "beside NCCL"): ours no slower than the NCCL baseline
(``ratio_to_baseline <= 1``). Times: per-call CUDA events after warm-up, per rank the median, the
slowest rank's median in the ratios (``bench_overlap._Runner``).

    python bench/bench_ulysses_ag.py --cpu      # gloo ranks, the CPU executor, tiny sizes
    python bench/bench_ulysses_ag.py --tp 2     # one NCCL rank per GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from bench_overlap import (  # noqa: E402
    CHILD_ENV,
    _checked,
    _GemmUnder,
    _init_ours,
    _poison,
    _rank_device,
    _Runner,
    _settle,
    best_ours,
    finite_json,
    parse_tp,
    rel_norm_err,
    valid_chunks,
)
from common import add_out_dir_argument, write_result  # noqa: E402

# (S, H, D): sequence length over the group, heads, head dim.
ULYSSES_SHAPES = ((8192, 32, 128), (32768, 32, 128))
CPU_ULYSSES_SHAPES = ((256, 8, 16),)
DP_AG_ROWS, DP_AG_COLS = 32768, 8192  # 512 MiB of bf16 parameters
CPU_DP_AG_ROWS, CPU_DP_AG_COLS = 512, 256
DP_GEMM, CPU_DP_GEMM = 8192, 256
CHUNKS = (1, 2, 4)
GOAL_BASELINE = 1.0


def ulysses_block_bytes(shapes: tuple[tuple[int, int, int], ...], world: int) -> int:
    """The largest block one rank moves to one peer in the Ulysses calls (bf16)."""
    return max((s * h * d * 2) // (world * world) for s, h, d in shapes)


def ratio_goal(ours: float | None, base: float | None, check_ok: bool) -> dict[str, Any]:
    """ours / base and whether ours is no slower than the baseline (and the check passed)."""
    ratio = ours / base if ours is not None and base else None
    return {
        "ratio_to_baseline": ratio,
        "goal_met": bool(ratio is not None and ratio <= GOAL_BASELINE and check_ok),
    }


def _ulysses_row(
    world: int, rank: int, gname: str, shape: tuple[int, int, int], to_heads: bool, cfg: dict
) -> dict[str, Any]:
    dev = _rank_device(cfg)
    s, h, d = shape
    kind = "ulysses_seq_to_heads" if to_heads else "ulysses_heads_to_seq"
    row: dict[str, Any] = {"tp": world, "kind": kind, "shape": f"S{s}_H{h}_D{d}", "S": s}
    row.update(H=h, D=d, dtype="bfloat16")
    if s % world or h % world:
        return {**row, "skipped": f"S={s} or H={h} does not split over {world} ranks"}
    gen = torch.Generator(device=dev).manual_seed(31 + 7 * rank + s + h)
    if to_heads:
        x = torch.randn(s // world, h, d, generator=gen, device=dev).to(torch.bfloat16)
        dims, out_shape = (1, 0), (s, h // world, d)
    else:
        x = torch.randn(s, h // world, d, generator=gen, device=dev).to(torch.bfloat16)
        dims, out_shape = (0, 1), (s // world, h, d)
    send = torch.empty(world, x.numel() // world, dtype=x.dtype, device=dev)
    recv = torch.empty_like(send)

    def coll_alone() -> None:
        dist.all_to_all_single(recv, send)

    def nccl() -> torch.Tensor:
        if to_heads:
            # [S/W, H, D] -> [W, S/W, H/W, D]: head block p for rank p, then [S, H/W, D].
            blocks = x.view(s // world, world, h // world, d).transpose(0, 1)
            send.view(world, s // world, h // world, d).copy_(blocks)
            coll_alone()
            return recv.view(s, h // world, d)
        send.copy_(x.view(world, -1))
        coll_alone()
        # [W, S/W, H/W, D] (block p from rank p) -> [S/W, W, H/W, D] -> [S/W, H, D].
        return recv.view(world, s // world, h // world, d).transpose(0, 1).reshape(out_shape)

    def ours() -> torch.Tensor:
        return torch.ops.uniep.all_to_all_ulysses(x, dims[0], dims[1], gname)

    ref = nccl().clone()
    errors: dict[str, str] = {}
    checks: dict[str, Any] = {}
    if cfg["ours_off"] is None:

        def measure() -> float:
            _poison((out_shape, torch.bfloat16), dev=dev)
            got = ours()
            return 0.0 if torch.equal(got, ref) else max(rel_norm_err(got, ref), 1e-30)

        checks["ours_rel_err"] = _checked(errors, "ours", measure, dev)
        checks["pass"] = checks["ours_rel_err"] == 0.0
    else:
        checks.update({"pass": False, "ours_skipped": cfg["ours_off"]})
    runner = _Runner(dev, cfg["warmup"], cfg["iters"])
    runner.time("coll_alone", coll_alone)
    runner.time("nccl", nccl)
    if checks["pass"]:
        runner.time("ours", ours)
    per_rank, ms = runner.gather()
    return {
        **row,
        "ms": ms,
        "per_rank": per_rank,
        "check": checks,
        "errors": {**errors, **runner.errors},
        "bytes_per_rank": x.numel() * 2,
        **ratio_goal(ms.get("ours"), ms.get("nccl"), checks["pass"]),
        "ours_over_coll_alone": ms["ours"] / ms["coll_alone"]
        if "ours" in ms and ms.get("coll_alone")
        else None,
    }


def _dp_ag_row(world: int, rank: int, gname: str, cfg: dict) -> dict[str, Any]:
    dev = _rank_device(cfg)
    rows, cols, g = cfg["dp_rows"], cfg["dp_cols"], cfg["dp_gemm"]
    row: dict[str, Any] = {"tp": world, "kind": "dp_ag", "shape": f"bf16 [{rows}, {cols}]"}
    row.update(bucket_bytes=rows * cols * 2, gemm_mnk=[g, g, g])
    if rows % world:
        return {**row, "skipped": f"{rows} rows do not split over {world} ranks"}
    gen = torch.Generator(device=dev).manual_seed(555 + 13 * rank)
    shard = torch.randn(rows // world, cols, generator=gen, device=dev).to(torch.bfloat16)
    full = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)
    chunks = valid_chunks(rows // world, CHUNKS)

    def nccl_ag() -> None:
        dist.all_gather_into_tensor(full, shard)

    def ours_ag(ch: int) -> torch.Tensor:
        return torch.ops.uniep.all_gather(shard, gname, ch, "direct")

    nccl_ag()
    ref = full.clone()
    errors: dict[str, str] = {}
    checks: dict[str, Any] = {}
    if cfg["ours_off"] is None:

        def measure(ch: int) -> float:
            _poison(((rows, cols), torch.bfloat16), dev=dev)
            got = ours_ag(ch)
            return 0.0 if torch.equal(got, ref) else max(rel_norm_err(got, ref), 1e-30)

        by_chunks = {
            ch: _checked(errors, f"ours_c{ch}", lambda ch=ch: measure(ch), dev) for ch in chunks
        }
        checks["ours_rel_err_by_chunks"] = {str(ch): e for ch, e in by_chunks.items()}
        checks["pass"] = all(e == 0.0 for e in by_chunks.values()) and bool(by_chunks)
    else:
        checks.update({"pass": False, "ours_skipped": cfg["ours_off"]})
    ok_chunks = [ch for ch in chunks if cfg["ours_off"] is None and f"ours_c{ch}" not in errors]

    # The compute under the all-gather: as many GEMMs as take about as long as NCCL's.
    bg = _GemmUnder(dev, g, gen, nccl_ag, "nccl_ag_alone", cfg["warmup"], cfg["iters"])
    overlapped = bg.overlapped

    runner = _Runner(dev, cfg["warmup"], cfg["iters"])
    runner.time("gemm_alone", bg.gemm)
    runner.time("nccl_ag_alone", nccl_ag)
    runner.time("nccl_overlap", lambda: overlapped(nccl_ag))
    for ch in ok_chunks:
        runner.time(f"ours_ag_alone_c{ch}", lambda ch=ch: ours_ag(ch))
        runner.time(f"ours_overlap_c{ch}", lambda ch=ch: overlapped(lambda: ours_ag(ch)))
    per_rank, ms = runner.gather()
    best_ch, best = best_ours(ms, "ours_overlap_c")
    _, best_alone = best_ours(ms, "ours_ag_alone_c")
    if best is not None:
        ms["ours_best"] = best
    return {
        **row,
        "gemm_reps": bg.reps,
        "chunks": chunks,
        "ms": ms,
        "per_rank": per_rank,
        "ours_best_chunks": best_ch,
        "check": checks,
        "errors": {**errors, **runner.errors},
        **ratio_goal(best, ms.get("nccl_overlap"), checks["pass"]),
        "ours_alone_over_nccl_alone": best_alone / ms["nccl_ag_alone"]
        if best_alone is not None and ms.get("nccl_ag_alone")
        else None,
    }


def _bench_rank(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import uniep.distributed

    warnings.filterwarnings("ignore", r".*is deprecated\. Please use .*_single", FutureWarning)
    dev = _rank_device(cfg)
    group = dist.group.WORLD
    gname = uniep.distributed.group_name(group)
    shapes = tuple(tuple(s) for s in cfg["ulysses_shapes"])
    block = max(ulysses_block_bytes(shapes, world), cfg["dp_rows"] * cfg["dp_cols"] * 2 // world)
    cfg = {**cfg, "ours_off": _init_ours(group, block, dev)}
    rows = [
        _ulysses_row(world, rank, gname, shape, to_heads, cfg)
        for shape in shapes
        for to_heads in (True, False)
    ]
    rows.append(_dp_ag_row(world, rank, gname, cfg))
    shutdown = getattr(sys.modules.get("uniep.collectives"), "shutdown_cuda", None)
    if cfg["ours_off"] is None and dev.type == "cuda" and callable(shutdown):
        _settle(dev)
        shutdown(group)
    return rows if rank == 0 else []


def build_config(args: argparse.Namespace) -> dict[str, Any]:
    small = args.cpu
    return {
        "device": "cpu" if args.cpu else "cuda",
        "warmup": args.warmup if args.warmup is not None else (2 if small else 5),
        "iters": args.iters if args.iters is not None else (5 if small else 30),
        "ulysses_shapes": [list(s) for s in (CPU_ULYSSES_SHAPES if small else ULYSSES_SHAPES)],
        "dp_rows": CPU_DP_AG_ROWS if small else DP_AG_ROWS,
        "dp_cols": CPU_DP_AG_COLS if small else DP_AG_COLS,
        "dp_gemm": CPU_DP_GEMM if small else DP_GEMM,
    }


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r or "error" in r:
        why = r.get("skipped") or "FAILED: " + str(r["error"]).strip().splitlines()[-1]
        return f"| {r.get('tp', '-')} | {r.get('kind', '-')} | {r.get('shape', '-')} | {why} |"
    ms = r["ms"]
    ours = ms.get("ours", ms.get("ours_best"))
    base = ms.get("nccl", ms.get("nccl_overlap"))

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    return (
        f"| {r['tp']} | {r['kind']} | {r['shape']} | {f(ours)} | {f(base)} | "
        f"{f(r.get('ratio_to_baseline'))} | {'pass' if r['check'].get('pass') else 'FAIL'} | "
        f"{'met' if r.get('goal_met') else 'not met'} |"
    )


HEADER = [
    "| W | kind | shape | ours ms | NCCL ms | ours/NCCL (goal <= 1) | check | goal |",
    "|---:|---|---|---:|---:|---:|---|---|",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tp", type=parse_tp, default=None, help="group sizes (default 2,4; 2 with --cpu)"
    )
    parser.add_argument("--cpu", action="store_true", help="gloo ranks, CPU executor, tiny sizes")
    parser.add_argument("--quick", action="store_true", help="the same as --cpu (run_all.sh)")
    add_out_dir_argument(parser)
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per group size")
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1 or args.warmup is not None and args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    args.cpu = args.cpu or args.quick
    if args.tp is None:
        args.tp = [2] if args.cpu else [2, 4]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from uniep.distributed import run_local_ranks

    cfg = build_config(args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows: list[dict[str, Any]] = []
    failed = False
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    print("\n".join(HEADER), flush=True)
    for tp in args.tp:
        why = None
        if tp < 2:
            why = "the group needs >= 2 ranks"
        elif not args.cpu and tp > gpus:
            why = f"needs {tp} GPUs, found {gpus}"
        if why:
            rows.append({"tp": tp, "skipped": why})
        else:
            backend = "gloo" if args.cpu else "nccl"
            try:
                rows += run_local_ranks(
                    _bench_rank, tp, (cfg,), backend=backend, timeout_s=args.timeout
                )[0]
            except RuntimeError as exc:
                failed = True
                print(f"W={tp}: {exc}", file=sys.stderr, flush=True)
                rows.append({"tp": tp, "error": str(exc)[-4000:]})
    for r in rows:
        print(markdown(r), flush=True)
        failed = failed or bool(r.get("errors")) or ("check" in r and not r["check"].get("pass"))
    path = write_result("bench_ulysses_ag", finite_json(rows), args.out_dir)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
