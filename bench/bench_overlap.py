"""Tensor-parallel overlap: uniep's AG+GEMM and GEMM+RS against NCCL + mm and torch's fused ops.

For every TP size W (one spawn of W NCCL ranks per size) and every shape (M x K, N per rank; M is
the gathered row count, each rank holds M/W rows), in bf16:

- ``ag_mm``: a [M/W, K], b [K, N]. Ours: ``torch.ops.uniep.all_gather_matmul(a, b, group_name,
  chunks, "direct")`` -> (ag [M, K], out [M, N]). Baseline ``nccl_mm``: all_gather_into_tensor,
  then torch.mm. ``mm_alone``: [M, K] @ [K, N]; ``coll_alone``: the NCCL all-gather;
  ``torch_fused``: ``torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, ...)``.
- ``mm_rs``: a [M, K], b [K, N]. Ours: ``torch.ops.uniep.matmul_reduce_scatter`` -> [M/W, N],
  this rank's rows of the sum over ranks of a @ b. Baseline: torch.mm, then
  reduce_scatter_tensor; ``torch_fused``: ``fused_matmul_reduce_scatter(a, b, "sum", 0, ...)``.

Ours runs with chunks in {1, 2, 4} (those dividing M/W) and each GEMM choice of ``--gemm``
(``uniep.collectives.set_gemm``: ``ours_c2`` is the default, cuBLAS, at 2 chunks,
``ours_cutlass_sm8_c2`` the cutlass GEMM leaving 8 SMs); ``ours_best`` is the fastest. Before
timing, each output is compared with the baseline's (relative error of the norm < 2e-2; the
gathered ``ag`` must match bit for bit) and pass/fail goes into the JSON. The goal of the issue:
ours_best <= 1.05 x max(mm_alone, coll_alone) and ours_best <= nccl_mm, on every shape.

DP: a 1 GiB fp32 gradient bucket [32768, 8192] reduce-scattered on a side stream while the main
stream runs a backward GEMM (bf16 8192^3, repeated until it takes about as long as NCCL's
reduce-scatter): the time until both are done, ours (``torch.ops.uniep.reduce_scatter``) against
NCCL's ``reduce_scatter_tensor``, and each part alone. Ours must equal NCCL's sum to 1e-5.

Times are CUDA events around each call on the rank's current stream, after warm-up; per rank the
median, p10 and p90; the slowest rank's median is what ratios and goals use. A variant that
raises is recorded with its error (torch's fused ops included) and the run goes on.

    python bench/bench_overlap.py --quick                       # smoke run: small shapes
    python bench/bench_overlap.py                               # TP 2 and 4
    torchrun --nproc-per-node 4 bench/bench_overlap.py --tp 4   # one TP size: the world size

The JSON goes to bench/results/bench_overlap/bench_overlap.json (``--out``, ``--out-dir``) and
the plot beside it as .svg (``--plot``, ``--no-plot``), replacing the last run's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import (  # noqa: E402
    add_profile_argument,
    add_trace_arguments,
    env_info,
    measured,
    profile_kernels,
    replace_result,
    result_path,
    time_calls_ms,
    trace_paths,
)
from plot_svg import write_plot  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """M x K with N per rank; M is the row count after the gather (before the scatter)."""

    m: int
    k: int
    n: int

    @property
    def name(self) -> str:
        return f"{self.m}x{self.k}_n{self.n}"


# /work/shared/ANCHORS.md "Tensor-parallel overlap", then more M at the first shape's K and N.
ANCHOR_SHAPES = (Shape(8192, 8192, 7168), Shape(4096, 8192, 2048), Shape(16384, 4096, 3584))
EXTRA_M = (2048, 32768)
QUICK_SHAPES = (Shape(1024, 2048, 1024), Shape(4096, 2048, 1024))
# --cpu tries the harness (gloo ranks, the CPU executor): sizes a CPU multiplies in moments.
CPU_SHAPES = (Shape(256, 512, 128), Shape(1024, 512, 128))
CPU_DP_BUCKET_BYTES = 4 << 20
CPU_DP_GEMM = 256
KINDS = ("ag_mm", "mm_rs")
CHUNKS = (1, 2, 4)
GEMM_BACKENDS = ("cublas", "cutlass", "gated")  # uniep.collectives.GEMM_BACKENDS
DEFAULT_GEMM = ("cublas", 0)  # uniep.collectives.set_gemm's default
GPU_GEMMS = [DEFAULT_GEMM, ("cutlass", 0), ("gated", 0)]
BASELINES = ("nccl_mm", "mm_alone", "coll_alone", "torch_fused")
CHECK_TOL_BF16 = 2e-2
CHECK_TOL_FP32 = 1e-5
GOAL_IDEAL = 1.05  # ours <= 1.05 x max(mm alone, collective alone)
GOAL_BASELINE = 1.0  # ours never slower than NCCL + mm
DP_BUCKET_BYTES = 1 << 30
QUICK_DP_BUCKET_BYTES = 64 << 20
DP_COLS = 8192
DP_GEMM = 8192
QUICK_DP_GEMM = 4096
# Shapes bigger than this (M*K*N) get the reduced iteration count.
BIG_MKN = 2 * 8192 * 8192 * 7168

# ANCHORS.md, TP=4 on 4x H200 (ms): what NCCL + mm and torch's fused ops did before us.
ANCHORS_TP4: dict[str, dict[str, dict[str, float]]] = {
    "8192x8192_n7168": {
        "ag_mm": {"nccl_mm": 1.60, "mm_alone": 1.21, "coll_alone": 0.41, "torch_fused": 1.70},
        "mm_rs": {"nccl_mm": 1.64, "mm_alone": 1.31, "coll_alone": 0.40, "torch_fused": 1.63},
    },
    "4096x8192_n2048": {
        "ag_mm": {"nccl_mm": 0.44, "mm_alone": 0.21, "coll_alone": 0.27, "torch_fused": 0.78},
        "mm_rs": {"nccl_mm": 0.41, "mm_alone": 0.21, "coll_alone": 0.24, "torch_fused": 0.83},
    },
    "16384x4096_n3584": {
        "ag_mm": {"nccl_mm": 1.09, "mm_alone": 0.62, "coll_alone": 0.45, "torch_fused": 1.13},
        "mm_rs": {"nccl_mm": 1.04, "mm_alone": 0.68, "coll_alone": 0.43, "torch_fused": 1.00},
    },
}
# Inherited by the spawned ranks: no NVLink multicast (see KINDS.md), and device waits that give
# up well before the launcher's timeout.
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "UNIEP_TIMEOUT_S": "60",
}


# ---- pure helpers (no GPU) ----


def build_shapes(which: str) -> list[Shape]:
    """``anchors``: the three shapes of ANCHORS.md; ``all``: those plus M in EXTRA_M at the first
    anchor's K and N; ``quick``: two small shapes sharing K and N (so the plot has a line)."""
    if which == "anchors":
        return list(ANCHOR_SHAPES)
    if which == "all":
        first = ANCHOR_SHAPES[0]
        return [*ANCHOR_SHAPES, *(Shape(m, first.k, first.n) for m in EXTRA_M)]
    if which == "quick":
        return list(QUICK_SHAPES)
    raise ValueError(f"shapes must be all, anchors or quick, got {which!r}")


def parse_tp(text: str) -> list[int]:
    """``"2,4"`` -> [2, 4] (sorted, without repeats)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--tp takes integers like 2,4, got {text!r}") from e
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--tp takes positive integers like 2,4, got {text!r}")
    return sizes


def valid_chunks(rows_per_rank: int, chunks: Iterable[int] = CHUNKS) -> list[int]:
    """The chunk counts the ops accept: those dividing this rank's rows."""
    return [c for c in chunks if c >= 1 and rows_per_rank % c == 0]


def max_block_bytes(
    shapes: Iterable[Shape], world: int, dp_bucket_bytes: int = 0, elem_bytes: int = 2
) -> int:
    """The largest per-rank block any op of the run moves: AG (M/W) x K, RS (M/W) x N (bf16), and
    the DP bucket's 1/W; what ``uniep.collectives.init_cuda`` must be able to hold."""
    blocks = [dp_bucket_bytes // world]
    for s in shapes:
        rows = s.m // world
        blocks += [rows * s.k * elem_bytes, rows * s.n * elem_bytes]
    return max(blocks)


def iters_for(shape: Shape, iters: int, big_iters: int) -> int:
    return big_iters if shape.m * shape.k * shape.n > BIG_MKN else iters


def time_stats(times_ms: Sequence[float]) -> dict[str, float]:
    """Median, p10 and p90 (inclusive quantiles) of one rank's samples."""
    if not times_ms:
        raise ValueError("no samples")
    if len(times_ms) == 1:
        t = float(times_ms[0])
        return {"median": t, "p10": t, "p90": t}
    q = statistics.quantiles(times_ms, n=10, method="inclusive")
    return {"median": float(statistics.median(times_ms)), "p10": q[0], "p90": q[8]}


def slowest_medians(per_rank: Sequence[dict[str, dict[str, float] | None]]) -> dict[str, float]:
    """Variant -> the largest per-rank median (variants missing on any rank are left out)."""
    names = set().union(*(r.keys() for r in per_rank)) if per_rank else set()
    out = {}
    for name in sorted(names):
        stats = [r.get(name) for r in per_rank]
        if all(s is not None for s in stats):
            out[name] = max(s["median"] for s in stats)  # type: ignore[index]
    return out


def parse_gemms(text: str) -> list[tuple[str, int]]:
    """``cublas,cutlass@8`` -> [(backend, sm_carveout), ...] for ``set_gemm``."""
    specs = []
    for item in text.split(","):
        backend, _, carveout = item.strip().partition("@")
        if backend not in GEMM_BACKENDS or carveout and not carveout.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected BACKEND[@SMS] with BACKEND in {GEMM_BACKENDS}, got {item.strip()!r}"
            )
        specs.append((backend, int(carveout or 0)))
    if not specs or len(set(specs)) != len(specs):
        raise argparse.ArgumentTypeError(f"expected distinct GEMM choices, got {text!r}")
    return specs


def ours_prefix(gemm: Sequence[Any] = DEFAULT_GEMM) -> str:
    """Our variants' name before the chunk count: ``ours_c`` with the default GEMM choice,
    ``ours_cutlass_sm8_c`` with backend cutlass leaving 8 SMs."""
    backend, carveout = gemm
    if (backend, carveout) == DEFAULT_GEMM:
        return "ours_c"
    return f"ours_{backend}" + (f"_sm{carveout}" if carveout else "") + "_c"


def best_ours(ms: dict[str, float], prefix: str = "ours_c") -> tuple[int | None, float | None]:
    """(chunks, ms) of the fastest ``{prefix}{chunks}`` entry, or (None, None)."""
    cands = [
        (v, int(k[len(prefix) :]))
        for k, v in ms.items()
        if k.startswith(prefix) and k[len(prefix) :].isdigit()
    ]
    if not cands:
        return None, None
    t, c = min(cands)
    return c, t


def goals(
    ours: float | None, mm: float | None, coll: float | None, base: float | None, check_ok: bool
) -> dict[str, Any]:
    """ratio_to_ideal = ours / max(mm, coll), ratio_to_baseline = ours / base, and the goals."""
    out: dict[str, Any] = {"ratio_to_ideal": None, "ratio_to_baseline": None}
    if ours is not None and mm is not None and coll is not None and max(mm, coll) > 0:
        out["ratio_to_ideal"] = ours / max(mm, coll)
    if ours is not None and base:
        out["ratio_to_baseline"] = ours / base
    ideal, baseline = out["ratio_to_ideal"], out["ratio_to_baseline"]
    out["goal_ideal_met"] = ideal is not None and ideal <= GOAL_IDEAL
    out["goal_baseline_met"] = baseline is not None and baseline <= GOAL_BASELINE
    out["goal_met"] = bool(out["goal_ideal_met"] and out["goal_baseline_met"] and check_ok)
    return out


def rel_norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (inf for a shape mismatch, NaN stays NaN)."""
    if out.shape != ref.shape:
        return math.inf
    ref32 = ref.float()
    den = torch.linalg.vector_norm(ref32).item()
    num = torch.linalg.vector_norm(out.float() - ref32).item()
    return num / (den if den > 0 else 1.0)


def finite_json(obj: Any) -> Any:
    """``obj`` with every inf or NaN float replaced by None (strict JSON; the error says why)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def summary_row(r: dict[str, Any]) -> dict[str, Any]:
    """The flat row summarize.py prints for one result (TP kind or DP)."""
    ms = r.get("ms", {})
    row = {"tp": r["tp"], "kind": r["kind"], "shape": r["shape"]}
    if "error" in r or "skipped" in r:
        row["status"] = r.get("skipped") or "FAILED: " + str(r["error"]).strip().splitlines()[-1]
        return row
    if r["kind"] == "dp_rs":
        keys = ("ours_best", "nccl_overlap", "gemm_alone", "nccl_rs_alone")
    else:
        keys = ("ours_best", "nccl_mm", "torch_fused", "mm_alone", "coll_alone")
    row.update({f"{k}_ms": ms.get(k) for k in keys})
    row["ours_chunks"] = r.get("ours_best_chunks")
    row["ratio_to_ideal"] = r.get("ratio_to_ideal")
    row["ratio_to_baseline"] = r.get("ratio_to_baseline")
    row["check"] = "pass" if r.get("check", {}).get("pass") else "FAIL"
    row["goal_met"] = r.get("goal_met")
    return row


HEADER = [
    "| TP | kind | shape | ours best ms (chunks) | NCCL+mm | torch fused | mm alone | "
    "coll alone | ours/ideal | ours/NCCL+mm | check | goal |",
    "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
]


def markdown(r: dict[str, Any]) -> str:
    row = summary_row(r)
    if "status" in row:
        return f"| {row['tp']} | {row['kind']} | {row['shape']} | {row['status']} |"

    def f(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    if r["kind"] == "dp_rs":
        cells = [row["nccl_overlap_ms"], None, row["gemm_alone_ms"], row["nccl_rs_alone_ms"]]
    else:
        cells = [row[k] for k in ("nccl_mm_ms", "torch_fused_ms", "mm_alone_ms", "coll_alone_ms")]
    return (
        f"| {row['tp']} | {row['kind']} | {row['shape']} | {f(row['ours_best_ms'])} "
        f"({row['ours_chunks'] or '-'}) | " + " | ".join(f(c) for c in cells) + " | "
        f"{f(row['ratio_to_ideal'])} | {f(row['ratio_to_baseline'])} | {row['check']} | "
        f"{'met' if row['goal_met'] else 'not met'} |"
    )


# ---- on the ranks ----


def _rank_device(cfg: dict[str, Any]) -> torch.device:
    if cfg["device"] == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _settle(dev: torch.device) -> None:
    """Every rank idle and at the same point before a variant is timed."""
    _sync(dev)
    dist.barrier()
    _sync(dev)


def _agree(ok: bool, dev: torch.device) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    t = torch.tensor([int(ok)], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _max_over_ranks(value: float, dev: torch.device) -> float:
    # NaN would not survive a MAX reduction reliably: make it the worst value instead.
    v = value if math.isfinite(value) else math.inf
    t = torch.tensor([v], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time(fn: Callable[[], object], warmup: int, iters: int, dev: torch.device) -> list[float]:
    """Per-call CUDA-event times (ms) on the current stream, the host never waiting in between
    (wall-clock times on CPU, where only the harness is being tried)."""
    _settle(dev)
    for _ in range(warmup):
        fn()
    _settle(dev)
    return time_calls_ms(fn, iters, cuda=dev.type == "cuda")


def _poison(*shapes: tuple[tuple[int, ...], torch.dtype], dev: torch.device) -> None:
    """Fill blocks of the outputs' sizes with NaN and free them, so that an output the op fails to
    write is caught by the check instead of holding a stale correct result from the cache."""
    for shape, dtype in shapes:
        torch.full(shape, float("nan"), dtype=dtype, device=dev)


class _GemmUnder:
    """The DP benches' background compute: a bf16 g^3 GEMM repeated ``reps`` times so that it
    takes about as long as the collective ``comm`` alone (measured here, after warm-up), and
    ``overlapped(fn)``, which runs the collective ``fn`` on a side stream under it."""

    def __init__(
        self,
        dev: torch.device,
        g: int,
        gen: torch.Generator,
        comm: Callable[[], object],
        comm_name: str,
        warmup: int,
        iters: int,
    ) -> None:
        self.a = torch.randn(g, g, generator=gen, device=dev).to(torch.bfloat16)
        self.b = (torch.randn(g, g, generator=gen, device=dev) * g**-0.5).to(torch.bfloat16)
        self.c = torch.empty(g, g, dtype=torch.bfloat16, device=dev)
        self.side = torch.cuda.Stream() if dev.type == "cuda" else None
        probe = _Runner(dev, warmup, iters)
        probe.time("gemm_once", lambda: torch.mm(self.a, self.b, out=self.c))
        probe.time(comm_name, comm)
        _, self.probe_ms = probe.gather()
        self.reps = 1
        if "gemm_once" in self.probe_ms and comm_name in self.probe_ms:
            self.reps = max(1, round(self.probe_ms[comm_name] / self.probe_ms["gemm_once"]))

    def gemm(self) -> None:
        for _ in range(self.reps):
            torch.mm(self.a, self.b, out=self.c)

    def overlapped(self, comm: Callable[[], object]) -> None:
        if self.side is None:  # CPU: no streams, the harness only
            comm()
            self.gemm()
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            comm()
        self.gemm()
        main.wait_stream(self.side)


class _Runner:
    """Times variants and records per-rank stats and errors; every rank calls it identically."""

    def __init__(self, dev: torch.device, warmup: int, iters: int) -> None:
        self.dev, self.warmup, self.iters = dev, warmup, iters
        self.stats: dict[str, dict[str, float] | None] = {}
        self.errors: dict[str, str] = {}

    def time(self, name: str, fn: Callable[[], object]) -> None:
        # One guarded call first: a variant that cannot run is dropped on every rank before any
        # rank enters the barriers of the timing loop.
        samples: list[float] = []
        for step in ("probe", "timing"):
            err = None
            try:
                if step == "probe":
                    fn()
                    _sync(self.dev)
                else:
                    samples = _time(fn, self.warmup, self.iters, self.dev)
            except Exception as exc:  # one variant failing must not end the benchmark
                err = _describe(exc)
            if not _agree(err is None, self.dev):
                self.errors[name] = err or "failed on another rank"
                self.stats[name] = None
                return
        self.stats[name] = time_stats(samples)

    def gather(self) -> tuple[list[dict[str, dict[str, float] | None]], dict[str, float]]:
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, self.stats)
        ok = [{k: v for k, v in r.items() if v is not None} for r in per_rank]
        return per_rank, slowest_medians(ok)


def _describe(exc: BaseException) -> str:
    # torch's first lines say what went wrong; the rest is often a list of dispatch keys.
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {' / '.join(lines[:3])}"[:1000]


def _device_check(dev: torch.device) -> dict[str, str]:
    """A device timeout our CUDA collectives recorded (``uniep.collectives.check``), if any."""
    check = getattr(sys.modules.get("uniep.collectives"), "check", None)
    if dev.type != "cuda" or not callable(check):
        return {}
    err = None
    try:
        check()
    except Exception as exc:
        err = _describe(exc)
    if _agree(err is None, dev):
        return {}
    return {"ours_device_check": err or "failed on another rank"}


def _checked(
    errors: dict[str, str], name: str, fn: Callable[[], float], dev: torch.device
) -> float:
    """``fn()``'s error measure, the worst over ranks; inf if it raised on any rank, and then
    ``errors[name]`` is set on every rank (so that every rank skips the same variants)."""
    raised = None
    try:
        value = fn()
    except Exception as exc:
        raised = _describe(exc)
        value = math.inf
    if not _agree(raised is None, dev):
        errors[name] = raised or "raised on another rank"
    return _max_over_ranks(value, dev)


def _timing_fields(
    runner: _Runner,
    chunks: list[int],
    checks: dict[str, Any],
    prefixes: Sequence[str] = ("ours_c",),
) -> dict[str, Any]:
    """Gathers ``runner``'s timings (collective) into the result fields both benchmarks write;
    ``ms["ours_best"]`` is the fastest ``{prefix}{chunks}`` variant of any prefix, if any ran."""
    per_rank, ms = runner.gather()
    best: tuple[float, int, str] | None = None
    for prefix in prefixes:
        ch, t = best_ours(ms, prefix)
        if t is not None and ch is not None and (best is None or t < best[0]):
            best = (t, ch, f"{prefix}{ch}")
    if best is not None:
        ms["ours_best"] = best[0]
    return {
        "warmup": runner.warmup,
        "iters": runner.iters,
        "chunks": chunks,
        "ms": ms,
        "per_rank": per_rank,
        "ours_best_chunks": best[1] if best else None,
        "ours_best_variant": best[2] if best else None,
        "check": checks,
    }


def _bench_tp_kind(
    shape: Shape,
    kind: str,
    world: int,
    rank: int,
    gname: str,
    cfg: dict[str, Any],
    ours_off: str | None,
) -> dict[str, Any]:
    dev = _rank_device(cfg)
    bf16 = torch.bfloat16
    m, k, n = shape.m, shape.k, shape.n
    rows = m // world
    gen = torch.Generator(device=dev).manual_seed(4242 + 7919 * rank + m + 3 * k + 7 * n)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=dev) * scale).to(bf16)

    b = randn(k, n, scale=k**-0.5)
    c = torch.empty(m, n, dtype=bf16, device=dev)
    chunks = valid_chunks(rows, cfg["chunks"])
    # Each call returns (the output to check, what else must match exactly or None).
    if kind == "ag_mm":
        a = randn(rows, k)
        ag = torch.empty(m, k, dtype=bf16, device=dev)

        def coll_alone() -> None:
            dist.all_gather_into_tensor(ag, a)

        def mm_alone() -> None:
            torch.mm(ag, b, out=c)

        def nccl_mm() -> None:
            coll_alone()
            mm_alone()

        def fused() -> tuple[torch.Tensor, torch.Tensor | None]:
            a_out, outs = torch.ops.symm_mem.fused_all_gather_matmul(
                a, [b], gather_dim=0, group_name=gname
            )
            return outs[0], a_out

        def ours(ch: int, gemm: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
            _set_gemm(gemm)
            ag_out, mm_out = torch.ops.uniep.all_gather_matmul(a, b, gname, ch, "direct")
            return mm_out, ag_out

        out_shapes = (((m, n), bf16), ((m, k), bf16))
        nccl_mm()
        ref, ref_exact = c.clone(), ag.clone()
    else:
        a = randn(m, k)
        out = torch.empty(rows, n, dtype=bf16, device=dev)

        def mm_alone() -> None:
            torch.mm(a, b, out=c)

        def coll_alone() -> None:
            dist.reduce_scatter_tensor(out, c)

        def nccl_mm() -> None:
            mm_alone()
            coll_alone()

        def fused() -> tuple[torch.Tensor, torch.Tensor | None]:
            return (
                torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b, "sum", scatter_dim=0, group_name=gname
                ),
                None,
            )

        def ours(ch: int, gemm: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
            _set_gemm(gemm)
            return torch.ops.uniep.matmul_reduce_scatter(a, b, gname, ch, "direct"), None

        out_shapes = (((rows, n), bf16),)
        nccl_mm()
        ref, ref_exact = out.clone(), None
    _sync(dev)

    def check(call: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[float, bool]:
        _poison(*out_shapes, dev=dev)
        got, exact = call()
        same = ref_exact is None or (exact is not None and torch.equal(exact, ref_exact))
        return rel_norm_err(got, ref), same

    errors: dict[str, str] = {}
    exact_ok: dict[str, bool] = {}

    def err_of(name: str, call: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]) -> float:
        def measure() -> float:
            err, same = check(call)
            exact_ok[name] = same
            return err

        value = _checked(errors, name, measure, dev)
        exact_ok[name] = _agree(exact_ok.get(name, False), dev)
        return value

    variants: list[str] = []
    checks: dict[str, Any] = {"tol": CHECK_TOL_BF16}
    fused_err = err_of("torch_fused", fused)
    checks["torch_fused_rel_err"] = fused_err
    checks["torch_fused_pass"] = fused_err < CHECK_TOL_BF16 and exact_ok["torch_fused"]
    # Our variants: name -> (chunks, GEMM choice), for every choice and chunk count.
    ours_variants = {
        f"{ours_prefix(g)}{ch}": (ch, tuple(g))
        for g in cfg.get("gemms", [DEFAULT_GEMM])
        for ch in chunks
    }
    if ours_off is None:
        errs = {v: err_of(v, lambda v=v: ours(*ours_variants[v])) for v in ours_variants}
        checks["ours_rel_err_by_variant"] = errs
        checks["ours_rel_err"] = max(errs.values(), default=math.inf)
        if kind == "ag_mm":
            checks["ours_ag_exact"] = all(exact_ok[v] for v in ours_variants)
        checks["pass"] = checks["ours_rel_err"] < CHECK_TOL_BF16 and all(
            exact_ok[v] for v in ours_variants
        )
        variants = list(ours_variants)
    else:
        checks["pass"] = False
        checks["ours_skipped"] = ours_off
    # A variant whose check raised (on any rank: errors agree) is not timed.
    check_errors = dict(errors)

    iters = iters_for(shape, cfg["iters"], cfg["big_iters"])
    runner = _Runner(dev, cfg["warmup"], iters)
    timed: list[tuple[str, Callable[[], object]]] = [
        ("nccl_mm", nccl_mm),
        ("mm_alone", mm_alone),
        ("coll_alone", coll_alone),
    ]
    if "torch_fused" not in check_errors:
        timed.append(("torch_fused", fused))
    timed += [(v, lambda v=v: ours(*ours_variants[v])) for v in variants if v not in check_errors]
    for name, fn in timed:
        runner.time(name, fn)
    _set_gemm(DEFAULT_GEMM)
    prefixes = [ours_prefix(g) for g in cfg.get("gemms", [DEFAULT_GEMM])]
    timing = _timing_fields(runner, chunks, checks, prefixes)
    ms = timing["ms"]
    errors = {**check_errors, **runner.errors}
    if ours_off is None:
        errors.update(_device_check(dev))
    result = {
        "tp": world,
        "kind": kind,
        "shape": shape.name,
        "M": m,
        "K": k,
        "N": n,
        "dtype": "bfloat16",
        **timing,
        **goals(
            ms.get("ours_best"),
            ms.get("mm_alone"),
            ms.get("coll_alone"),
            ms.get("nccl_mm"),
            checks["pass"],
        ),
        "torch_fused_ratio_to_baseline": (
            ms["torch_fused"] / ms["nccl_mm"] if "torch_fused" in ms and ms.get("nccl_mm") else None
        ),
        "errors": errors,
    }
    if world == 4 and shape.name in ANCHORS_TP4:
        result["anchor_ms"] = ANCHORS_TP4[shape.name][kind]
    if cfg.get("profile_iters", 0) > 0 and cfg["device"] == "cuda":
        # Every rank runs the profiled calls (they are collective); rank 0's numbers are kept.
        profiled = {n: fn for n, fn in timed if n not in errors}
        traces = trace_paths(cfg, f"trace-tp{world}-{kind}-{shape.name}", rank)
        result["kernel_us_rank0"] = profile_kernels(profiled, cfg["profile_iters"], traces)
    return result


def _bench_dp(
    world: int, rank: int, gname: str, cfg: dict[str, Any], ours_off: str | None
) -> dict[str, Any]:
    dev = _rank_device(cfg)
    bucket, g = cfg["dp_bucket_bytes"], cfg["dp_gemm"]
    total_rows = bucket // 4 // DP_COLS
    result: dict[str, Any] = {
        "tp": world,
        "kind": "dp_rs",
        "shape": f"fp32 [{total_rows}, {DP_COLS}] + bf16 gemm {g}^3",
        "bucket_bytes": bucket,
        "rows": total_rows,
        "cols": DP_COLS,
        "dtype": "float32",
        "gemm_mnk": [g, g, g],
    }
    if total_rows % world:
        return {**result, "skipped": f"{total_rows} rows do not split over {world} ranks"}
    gen = torch.Generator(device=dev).manual_seed(777 + 31 * rank)
    x = torch.randn(total_rows, DP_COLS, generator=gen, device=dev)
    out = torch.empty(total_rows // world, DP_COLS, device=dev)
    chunks = valid_chunks(total_rows // world, cfg["chunks"])

    def nccl_rs() -> None:
        dist.reduce_scatter_tensor(out, x)

    def ours_rs(ch: int) -> torch.Tensor:
        return torch.ops.uniep.reduce_scatter(x, gname, ch, "direct")

    nccl_rs()
    ref = out.clone()
    errors: dict[str, str] = {}
    checks: dict[str, Any] = {"tol": CHECK_TOL_FP32}
    if ours_off is None:

        def measure(ch: int) -> float:
            _poison(((total_rows // world, DP_COLS), torch.float32), dev=dev)
            return rel_norm_err(ours_rs(ch), ref)

        by_chunks = {
            ch: _checked(errors, f"ours_c{ch}", lambda ch=ch: measure(ch), dev) for ch in chunks
        }
        checks["ours_rel_err_by_chunks"] = {str(ch): e for ch, e in by_chunks.items()}
        checks["ours_rel_err"] = max(by_chunks.values(), default=math.inf)
        checks["pass"] = checks["ours_rel_err"] < CHECK_TOL_FP32
    else:
        checks.update({"pass": False, "ours_skipped": ours_off})
    ok_chunks = [ch for ch in chunks if ours_off is None and f"ours_c{ch}" not in errors]

    warmup, iters = cfg["warmup"], cfg["dp_iters"]
    # The backward's compute: as many GEMMs as take about as long as NCCL's reduce-scatter.
    bg = _GemmUnder(dev, g, gen, nccl_rs, "nccl_rs_alone", warmup, iters)
    overlapped = bg.overlapped

    runner = _Runner(dev, warmup, iters)
    runner.time("gemm_alone", bg.gemm)
    runner.time("nccl_rs_alone", nccl_rs)
    runner.time("nccl_overlap", lambda: overlapped(nccl_rs))
    for ch in ok_chunks:
        runner.time(f"ours_rs_alone_c{ch}", lambda ch=ch: ours_rs(ch))
        runner.time(f"ours_overlap_c{ch}", lambda ch=ch: overlapped(lambda: ours_rs(ch)))
    timing = _timing_fields(runner, chunks, checks, ("ours_overlap_c",))
    ms = timing["ms"]
    g_ok = goals(
        ms.get("ours_best"),
        ms.get("gemm_alone"),
        ms.get("nccl_rs_alone"),
        ms.get("nccl_overlap"),
        checks["pass"],
    )
    # DP's goal is the NCCL overlap; the ideal ratio is reported, not required.
    g_ok["goal_met"] = bool(g_ok["goal_baseline_met"] and checks["pass"])
    return {
        **result,
        "gemm_reps": bg.reps,
        "gemm_once_ms": bg.probe_ms.get("gemm_once"),
        **timing,
        **g_ok,
        "nccl_overlap_ratio_to_ideal": (
            ms["nccl_overlap"] / max(ms["gemm_alone"], ms["nccl_rs_alone"])
            if {"nccl_overlap", "gemm_alone", "nccl_rs_alone"} <= ms.keys()
            else None
        ),
        "errors": {**errors, **runner.errors, **(_device_check(dev) if ours_off is None else {})},
    }


def _set_gemm(gemm: Sequence[Any]) -> None:
    import uniep.collectives as coll

    coll.set_gemm(gemm[0], gemm[1])


def _init_ours(group: dist.ProcessGroup, block_bytes: int, dev: torch.device) -> str | None:
    """None if our CUDA ops are ready on every rank, else why not."""
    import uniep.collectives as coll

    reason = None
    if dev.type != "cuda":
        return None  # the CPU executor needs no runtime
    if not hasattr(coll, "init_cuda"):
        reason = "uniep.collectives.init_cuda is missing (built without the CUDA collectives?)"
    elif not torch._C._dispatch_has_kernel_for_dispatch_key("uniep::all_gather_matmul", "CUDA"):
        reason = "torch.ops.uniep.all_gather_matmul has no CUDA kernel in this build"
    else:
        try:
            coll.init_cuda(group, max_block_bytes=block_bytes)
        except Exception as exc:
            reason = f"init_cuda(max_block_bytes={block_bytes}) failed: {type(exc).__name__}: {exc}"
    if not _agree(reason is None, dev) and reason is None:
        reason = "init_cuda failed on another rank"
    return reason


def _enable_torch_fused(gname: str) -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():
            # Deprecated (a no-op need) in newer torch; still required by older ones.
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(gname)
    except Exception as exc:
        return _describe(exc)
    return None


def _append_partial(path: str | None, entry: dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _bench_rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One TP size on ``world`` ranks: every shape and kind, then DP. Rank 0 returns the records."""
    import uniep.distributed

    # torch >= 2.13 renames all_gather_into_tensor / reduce_scatter_tensor; 2.11 knows only these.
    warnings.filterwarnings("ignore", r".*is deprecated\. Please use .*_single", FutureWarning)
    dev = _rank_device(cfg)
    group = dist.group.WORLD
    gname = uniep.distributed.group_name(group)
    shapes = [Shape(**s) for s in cfg["shapes"]]
    dp_bytes = cfg["dp_bucket_bytes"] if cfg["dp"] else 0
    block = max_block_bytes(shapes, world, dp_bytes)
    ours_off = _init_ours(group, block, dev)
    fused_note = _enable_torch_fused(gname)
    notes = {
        "max_block_bytes": block,
        "ours_unavailable": ours_off,
        "symm_mem_enable_error": fused_note,
    }
    if rank == 0:
        _append_partial(cfg.get("partial"), {"tp": world, "notes": notes})
    results: list[dict[str, Any]] = []
    for shape in shapes:
        for kind in KINDS:
            if shape.m % world:
                r = {
                    "tp": world,
                    "kind": kind,
                    "shape": shape.name,
                    "M": shape.m,
                    "K": shape.k,
                    "N": shape.n,
                    "skipped": f"M={shape.m} does not split over {world} ranks",
                }
            else:
                r = _bench_tp_kind(shape, kind, world, rank, gname, cfg, ours_off)
            results.append(r)
            if rank == 0:
                _append_partial(cfg.get("partial"), {"result": r})
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    dp = []
    if cfg["dp"]:
        dp.append(_bench_dp(world, rank, gname, cfg, ours_off))
        if rank == 0:
            _append_partial(cfg.get("partial"), {"dp": dp[-1]})
    shutdown = getattr(sys.modules.get("uniep.collectives"), "shutdown_cuda", None)
    if ours_off is None and dev.type == "cuda" and callable(shutdown):
        _settle(dev)
        shutdown(group)
    return {"notes": notes, "results": results, "dp": dp} if rank == 0 else {}


# ---- launcher ----


def _read_partial(path: str) -> dict[str, Any]:
    got: dict[str, Any] = {"notes": None, "results": [], "dp": []}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return got
    for line in lines:
        entry = json.loads(line)
        if "notes" in entry:
            got["notes"] = entry["notes"]
        elif "result" in entry:
            got["results"].append(entry["result"])
        elif "dp" in entry:
            got["dp"].append(entry["dp"])
    return got


def _spawn_tp(
    world: int, cfg: dict[str, Any], timeout_s: float
) -> tuple[dict[str, Any], str | None]:
    """Run one TP size in ``world`` spawned ranks; on failure, what rank 0 recorded before it."""
    from uniep.distributed import run_local_ranks

    backend = "gloo" if cfg["device"] == "cpu" else "nccl"
    fd, partial = tempfile.mkstemp(prefix=f"bench_overlap_tp{world}_", suffix=".jsonl")
    os.close(fd)
    try:
        out = run_local_ranks(
            _bench_rank, world, ({**cfg, "partial": partial},), backend=backend, timeout_s=timeout_s
        )
        return out[0], None
    except RuntimeError as exc:
        return _read_partial(partial), str(exc)[-4000:]
    finally:
        os.unlink(partial)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    shapes = build_shapes("quick" if args.quick else args.shapes)
    small = args.quick or args.cpu
    warmup = args.warmup if args.warmup is not None else (2 if small else 5)
    iters = args.iters if args.iters is not None else (10 if small else 50)
    if args.cpu:
        shapes = list(CPU_SHAPES)
    bucket = CPU_DP_BUCKET_BYTES if args.cpu else DP_BUCKET_BYTES
    gemm = CPU_DP_GEMM if args.cpu else DP_GEMM
    if args.quick and not args.cpu:
        bucket, gemm = QUICK_DP_BUCKET_BYTES, QUICK_DP_GEMM
    return {
        "device": "cpu" if args.cpu else "cuda",
        "shapes": [asdict(s) for s in shapes],
        "chunks": list(CHUNKS),
        # On GPUs every GEMM choice, side by side.
        "gemms": [list(g) for g in args.gemm or ([DEFAULT_GEMM] if args.cpu else GPU_GEMMS)],
        "warmup": warmup,
        "iters": iters,
        "big_iters": min(iters, 20),
        "dp": not args.no_dp,
        "dp_bucket_bytes": bucket,
        "dp_gemm": gemm,
        "dp_iters": min(iters, 30),
        "check_tol_bf16": CHECK_TOL_BF16,
        "check_tol_fp32": CHECK_TOL_FP32,
        "goal_ideal": GOAL_IDEAL,
        "goal_baseline": GOAL_BASELINE,
        "profile_iters": args.profile,
        "trace": args.trace,
        "trace_dir": args.trace_dir,
    }


def _failed(payload: dict[str, Any]) -> bool:
    """A spawn that died, a check that failed, or one of our variants that raised."""
    if payload["errors"]:
        return True
    for r in payload["results"] + payload["dp"]:
        if "skipped" in r or "error" in r:
            continue
        if r["check"].get("ours_skipped"):
            continue
        if not r["check"].get("pass") or any(k.startswith("ours") for k in r.get("errors", {})):
            return True
    return False


def out_path(args: argparse.Namespace) -> Path:
    """The JSON's path: ``--out``, else ``common.result_path`` in ``--out-dir``."""
    return Path(args.out) if args.out else result_path("bench_overlap", args.out_dir)


def plot_path(args: argparse.Namespace) -> Path | None:
    """The SVG's path: ``--plot``, else beside the JSON; None with ``--no-plot``."""
    if args.no_plot:
        return None
    return Path(args.plot) if args.plot else out_path(args).with_suffix(".svg")


def _write(payload: dict[str, Any], args: argparse.Namespace) -> Path:
    text = json.dumps(finite_json(payload), indent=1, allow_nan=False) + "\n"
    return replace_result(out_path(args), text, measured(payload["results"] + payload["dp"]))


def _finish(payload: dict[str, Any], args: argparse.Namespace) -> int:
    payload["rows"] = [summary_row(r) for r in payload["results"] + payload["dp"]]
    payload["rows"] += [
        {"tp": s["tp"], "kind": "-", "shape": "-", "status": s["skipped"]}
        for s in payload["skipped"]
    ]
    plot = plot_path(args)
    if plot is not None and payload["results"]:
        payload["plot"] = plot.name
    path = _write(payload, args)
    print(f"wrote {path}")
    if payload.get("plot"):
        backend = write_plot(payload, plot)
        print(f"wrote {plot} ({backend})")
    return 1 if _failed(payload) else 0


def _payload(cfg: dict[str, Any], tps: list[int]) -> dict[str, Any]:
    env = env_info()
    return {
        "name": "bench_overlap",
        "bench": "overlap",
        "device": env["device"],
        "date": env["date"],
        "commit": env["commit"],
        "env": env,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "tp": tps,
        "config": cfg,
        "notes": {},
        "skipped": [],
        "errors": [],
        "results": [],
        "dp": [],
    }


def _add(payload: dict[str, Any], world: int, got: dict[str, Any], error: str | None) -> None:
    payload["notes"][str(world)] = got.get("notes")
    payload["results"] += got.get("results", [])
    payload["dp"] += got.get("dp", [])
    for r in got.get("results", []) + got.get("dp", []):
        print(markdown(r), flush=True)
    if error:
        print(f"TP={world}: {error}", file=sys.stderr, flush=True)
        payload["errors"].append({"tp": world, "error": error})


def _main_torchrun(args: argparse.Namespace) -> int:
    """Under torchrun: the one TP size that is the world size, in this process group."""
    import uniep

    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    if not args.cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if args.cpu else "nccl")
    uniep.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _config(args)
    try:
        got = _bench_rank(rank, world, cfg) if world in args.tp else {}
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    payload = _payload(cfg, args.tp)
    print("\n".join(HEADER), flush=True)
    for tp in args.tp:
        if tp != world:
            payload["skipped"].append(
                {"tp": tp, "skipped": f"torchrun runs one TP size, its world size {world}"}
            )
    if got:
        _add(payload, world, got, None)
    return _finish(payload, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=parse_tp, default=[2, 4], help="TP sizes, e.g. 2,4 (default)")
    parser.add_argument(
        "--shapes",
        choices=("all", "anchors", "quick"),
        default="all",
        help="all: ANCHORS.md shapes + M 2048, 32768 (default)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shapes and bucket, few iterations"
    )
    parser.add_argument("--no-dp", action="store_true", help="skip the DP reduce-scatter overlap")
    parser.add_argument("--out", default=None, help="JSON path (default: see --out-dir)")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="results folder when --out is not given: the JSON goes to "
        "DIR/bench_overlap/bench_overlap.json, replacing the last run's (default bench/results)",
    )
    parser.add_argument("--plot", default=None, help="SVG path (default: the JSON's, as .svg)")
    parser.add_argument("--no-plot", action="store_true", help="write no SVG")
    parser.add_argument(
        "--iters", type=int, default=None, help="timed iterations (default 50, 10 quick)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per TP size")
    parser.add_argument(
        "--gemm",
        type=parse_gemms,
        default=None,
        help="our GEMM choices to time, BACKEND[@SMS] comma-separated (uniep.collectives."
        "set_gemm(BACKEND, sm_carveout=SMS)), e.g. cublas,cutlass,cutlass@8 (default "
        "cublas,cutlass,gated; cublas with --cpu); ours_best is the fastest of all",
    )
    add_profile_argument(parser)
    add_trace_arguments(parser)
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="try the harness without a GPU: gloo ranks, the CPU executor, tiny shapes, "
        "wall-clock times (the numbers mean nothing)",
    )
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1 or args.warmup is not None and args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")

    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _main_torchrun(args)

    cfg = _config(args)
    payload = _payload(cfg, args.tp)
    gpus = payload["gpu_count"]
    runnable = []
    for tp in args.tp:
        why = None
        if tp < 2:
            why = "TP must be >= 2"
        elif args.cpu:
            why = None
        elif not torch.cuda.is_available():
            why = "no CUDA GPUs"
        elif tp > gpus:
            why = f"needs {tp} GPUs, found {gpus}"
        if why:
            payload["skipped"].append({"tp": tp, "skipped": why})
            print(f"TP={tp}: skipped ({why})", flush=True)
        else:
            runnable.append(tp)
    if runnable:
        for key, value in CHILD_ENV.items():
            os.environ.setdefault(key, value)
        print("\n".join(HEADER), flush=True)
    for tp in runnable:
        got, error = _spawn_tp(tp, cfg, args.timeout)
        _add(payload, tp, got, error)
    return _finish(payload, args)


if __name__ == "__main__":
    sys.exit(main())
