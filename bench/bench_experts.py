"""The expert GEMM engine (``torch.ops.uniep.grouped_mm``) against ``torch._grouped_mm``, world 1.

Loads (bf16, rows routed at random over the experts with a fixed seed, so row counts are uneven
and fill no whole tile):
  - the DeepSeek-V3 EP8 rank: R = 32768 rows over 32 experts, the up projection K 7168 -> N 4096
    (gate and up, 2 x 2048) and the down projection K 2048 -> N 7168;
  - many small experts: 256 experts, about 128 rows each (R = 32768), K 7168 -> N 4096.
Device time is the median of CUDA events over many calls after warm-up; TFLOP/s count
2 * R * K * N. Each row also has both results' relative error against an fp32 reference and
whether uniep's bits repeat run to run.

    python bench/bench_experts.py      # on a Hopper GPU; skipped (exit 0) elsewhere
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    median_time_ms,
    sm90_gemm_bench_args,
    sm90_kernel_missing,
    write_result,
)

# (load, experts, rows, K, N)
LOADS = [
    ("dsv3-rank-up", 32, 32768, 7168, 4096),
    ("dsv3-rank-down", 32, 32768, 2048, 7168),
    ("many-small", 256, 32768, 7168, 4096),
]


def routed_counts(experts: int, rows: int, seed: int) -> torch.Tensor:
    """Rows per expert of `rows` rows each sent to a uniformly random expert (int64, CPU)."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.randint(0, experts, (rows,), generator=gen)
    return torch.bincount(choice, minlength=experts)


def tflops(rows: int, k: int, n: int, ms: float) -> float:
    return 2.0 * rows * k * n / (ms * 1e-3) / 1e12


def bench_load(
    load: str, experts: int, rows: int, k: int, n: int, warmup: int, iters: int
) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(experts + k + n)
    # Drawn in bf16 directly: the many-small load's weights alone are 15 GB.
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, k, n, generator=gen, device="cuda", dtype=torch.bfloat16)
    w.mul_(k**-0.5)
    counts = routed_counts(experts, rows, seed=experts)
    offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)

    ref = torch.empty(rows, n, device="cuda", dtype=torch.float32)
    lo = 0
    for e, c in enumerate(counts.tolist()):
        ref[lo : lo + c] = x[lo : lo + c].float() @ w[e].float()
        lo += c
    ours = torch.ops.uniep.grouped_mm(x, w, offs)
    theirs = torch._grouped_mm(x, w, offs=offs)
    row: dict[str, Any] = {
        "load": load,
        "E": experts,
        "R": rows,
        "K": k,
        "N": n,
        "rows_min": int(counts.min()),
        "rows_max": int(counts.max()),
        "rel_err_uniep": float((ours.float() - ref).norm() / ref.norm()),
        "rel_err_torch": float((theirs.float() - ref).norm() / ref.norm()),
        "uniep_bits_repeat": bool(torch.equal(torch.ops.uniep.grouped_mm(x, w, offs), ours)),
    }
    del ref
    row["torch_ms"] = median_time_ms(
        lambda: torch._grouped_mm(x, w, offs=offs), warmup, iters, cuda=True
    )
    row["uniep_ms"] = median_time_ms(
        lambda: torch.ops.uniep.grouped_mm(x, w, offs), warmup, iters, cuda=True
    )
    row["torch_tflops"] = tflops(rows, k, n, row["torch_ms"])
    row["uniep_tflops"] = tflops(rows, k, n, row["uniep_ms"])
    row["uniep_over_torch"] = row["uniep_ms"] / row["torch_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    args = sm90_gemm_bench_args(__doc__.splitlines()[0], argv)
    if sm90_kernel_missing("bench_experts", "uniep::grouped_mm"):
        return 0
    rows = []
    print(
        "| load | E | R | K | N | rows/expert | torch ms | uniep ms | uniep/torch | TFLOP/s "
        "torch / uniep | rel err torch / uniep | bits repeat |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|---|")
    for load, experts, total, k, n in LOADS:
        r = bench_load(load, experts, total, k, n, args.warmup, args.iters)
        rows.append(r)
        print(
            f"| {load} | {experts} | {total} | {k} | {n} | {r['rows_min']}-{r['rows_max']} "
            f"| {r['torch_ms']:.3f} | {r['uniep_ms']:.3f} | {r['uniep_over_torch']:.3f} "
            f"| {r['torch_tflops']:.0f} / {r['uniep_tflops']:.0f} "
            f"| {r['rel_err_torch']:.2e} / {r['rel_err_uniep']:.2e} | {r['uniep_bits_repeat']} |",
            flush=True,
        )
    path = write_result("bench_experts", rows, args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
