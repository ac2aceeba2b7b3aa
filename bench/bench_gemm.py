"""UniEP's Hopper GEMM (``torch.ops.uniep.sm90_gemm``) against cuBLAS (``torch.mm``).

The collectives run one of the two for every chunk (``uniep.collectives.set_gemm``), so the
shapes are the chunks of bench_overlap's TP=2 anchors: (M/W)/chunks rows of [K] times [K, N], bf16.
For each: torch.mm, ``sm90_gemm`` with every SM and with 8 and 16 SMs left out, ``sm90_gemm``
with an addend (D = A @ B + C, the reduce-scatter's epilogue fold) against ``torch.addmm``, and
``sm90_gemm`` at every tile width, swizzle and raster order (the sweep its defaults come from), and
the part GEMM that ``set_gemm("gated")`` runs for a whole all-gather + GEMM
(``torch.ops.uniep.part_gemm``: one persistent gated GEMM over 4 row blocks, as at TP=4 with one
chunk, every block present and no arrival words read), whose goal is cuBLAS's rate, with each
of its tile widths named beside its automatic choice.
Device time is the median of CUDA events over many calls after warm-up; host time is the median
wall time to enqueue one call (the GPU busy with a long kernel meanwhile), which bounds how small
a chunk can be before the host, not the GPU, sets the pace.

    python bench/bench_gemm.py                 # on a Hopper GPU; skipped (exit 0) elsewhere
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import (  # noqa: E402
    median_time_ms,
    sm90_gemm_bench_args,
    sm90_kernel_missing,
    write_result,
)

# (M, K, N): bench_overlap's anchors at TP=2, their halves (2 chunks) and quarters.
SHAPES = [
    (m, k, n)
    for (rows, k, n) in ((4096, 8192, 7168), (2048, 8192, 2048), (8192, 4096, 3584))
    for m in (rows, rows // 2, rows // 4)
]
CARVEOUTS = (0, 8, 16)
PARTS = 4  # the part GEMM's row blocks


def host_us(fn: Callable[[], object], iters: int = 50) -> float:
    """Median wall time to enqueue one call while the GPU is busy (so launches never wait)."""
    torch.cuda._sleep(200_000_000)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def tflops(m: int, k: int, n: int, ms: float) -> float:
    return 2.0 * m * k * n / (ms * 1e-3) / 1e12


def bench_shape(m: int, k: int, n: int, warmup: int, iters: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    a = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    b = (torch.randn(k, n, generator=gen, device="cuda") * k**-0.5).bfloat16()
    c = torch.randn(m, n, generator=gen, device="cuda").bfloat16()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    row: dict[str, Any] = {"M": m, "K": k, "N": n}
    row["rel_err_cublas"] = float((torch.mm(a, b).float() - ref).norm() / ref.norm())
    row["rel_err_sm90"] = float((torch.ops.uniep.sm90_gemm(a, b).float() - ref).norm() / ref.norm())
    ref_c = ref + c.float()
    got_c = torch.ops.uniep.sm90_gemm(a, b, c).float()
    row["rel_err_sm90_addend"] = float((got_c - ref_c).norm() / ref_c.norm())
    calls: dict[str, Callable[[], object]] = {"cublas_ms": lambda: torch.mm(a, b, out=out)}
    calls["cublas_addmm_ms"] = lambda: torch.addmm(c, a, b, out=out)
    for sms in CARVEOUTS:
        calls[f"sm90_carve{sms}_ms"] = lambda sms=sms: torch.ops.uniep.sm90_gemm(a, b, None, sms)
    calls["sm90_addend_ms"] = lambda: torch.ops.uniep.sm90_gemm(a, b, c)
    if m % PARTS == 0:
        calls["part_ms"] = lambda: torch.ops.uniep.part_gemm(a, b, PARTS)
        # Each tile width named: what the automatic choice (part_gemm_tile_n) chose between.
        for tile in (128, 256):
            calls[f"part_t{tile}_ms"] = lambda tile=tile: torch.ops.uniep.part_gemm(
                a, b, PARTS, None, 0, 10.0, 0, 0, "auto", tile
            )
    for tile in (128, 256):
        for swz in (1, 2, 4, 8):
            for raster in ("m", "n"):
                calls[f"sm90_t{tile}_s{swz}_r{raster}_ms"] = (
                    lambda tile=tile, swz=swz, raster=raster: torch.ops.uniep.sm90_gemm(
                        a, b, None, 0, tile, swz, raster
                    )
                )
    for name, fn in calls.items():
        row[name] = median_time_ms(fn, warmup, iters, cuda=True)
    sweep = {k: v for k, v in row.items() if k.startswith("sm90_t")}
    row["sm90_best_config"] = min(sweep, key=sweep.__getitem__)
    row["sm90_best_ms"] = sweep[row["sm90_best_config"]]
    row["cublas_tflops"] = tflops(m, k, n, row["cublas_ms"])
    row["sm90_tflops"] = tflops(m, k, n, row["sm90_carve0_ms"])
    row["sm90_over_cublas"] = row["sm90_carve0_ms"] / row["cublas_ms"]
    if "part_ms" in row:
        row["part_over_cublas"] = row["part_ms"] / row["cublas_ms"]
        row["part_over_sm90"] = row["part_ms"] / row["sm90_carve0_ms"]
    row["host_us_cublas"] = host_us(lambda: torch.mm(a, b, out=out))
    row["host_us_sm90"] = host_us(lambda: torch.ops.uniep.sm90_gemm(a, b))
    return row


def _part_over_sm90(r: dict[str, Any]) -> str:
    """The part GEMM over sm90_gemm, its automatic tile width and then each width named."""
    if "part_ms" not in r:
        return "-"
    sm90 = r["sm90_carve0_ms"]
    return (
        f"{r['part_ms'] / sm90:.3f} ({r['part_t128_ms'] / sm90:.3f} / "
        f"{r['part_t256_ms'] / sm90:.3f})"
    )


def main(argv: list[str] | None = None) -> int:
    args = sm90_gemm_bench_args(__doc__.splitlines()[0], argv)
    if sm90_kernel_missing("bench_gemm", "uniep::sm90_gemm"):
        return 0
    rows = []
    print(
        "| M | K | N | cuBLAS ms | sm90 ms (carve 0/8/16) | sm90/cuBLAS | part/cuBLAS | part/sm90 "
        "(tiles 128 / 256) | TFLOP/s | host us | best sm90 config (ms) |"
    )
    print("|---:|---:|---:|---:|---|---:|---:|---|---|---|---|")
    for m, k, n in SHAPES:
        r = bench_shape(m, k, n, args.warmup, args.iters)
        rows.append(r)
        carves = "/".join(f"{r[f'sm90_carve{s}_ms']:.3f}" for s in CARVEOUTS)
        print(
            f"| {m} | {k} | {n} | {r['cublas_ms']:.3f} | {carves} | {r['sm90_over_cublas']:.3f} "
            f"| {r.get('part_over_cublas', float('nan')):.3f} | {_part_over_sm90(r)} "
            f"| {r['cublas_tflops']:.0f} / {r['sm90_tflops']:.0f} "
            f"| {r['host_us_cublas']:.1f} / {r['host_us_sm90']:.1f} "
            f"| {r['sm90_best_config'][5:-3]} ({r['sm90_best_ms']:.3f}) |",
            flush=True,
        )
    path = write_result("bench_gemm", rows, args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
