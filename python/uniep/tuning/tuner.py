"""``uniep.tune``: search the schedule keys of the tuning space for one MoE shape, cache the winner.

``uniep.tune(...)`` (this module is callable; it is ``uniep.tuning.tuner.tune``) ranks every
candidate schedule with a small cost model (alpha-beta per link for dispatch and combine, a
roofline for the expert GEMMs; docs/tuning.md), calibrated by a short measurement of the real op,
then times the best few with ``torch.ops.uniep.moe_forward`` on random routing of the given shape
(CUDA events on a GPU, the wall clock on CPU). With a process group every rank times every
candidate in the same order, a candidate's time is the slowest rank's, and rank 0's choice is
broadcast. Points that the executor runs alike are timed once (``executor_point``), and a point
replaces the default only when it is faster beyond the noise of the rounds (``pick_beyond_noise``).
``weights="bf16_packed"`` tunes ``uniep.moe.prepared.moe_forward_prepared`` on packed experts
instead, whose space holds both the separate launches (``overlap=sequential``) and the MegaKernel
(``overlap=fused`` with its ``sms``, ``skip_rounds`` and ``tile_m``); its winners are cached
under their own keys.

Only schedule keys are searched (``sms``, ``token_tile``, ``tile_m``, ``tile_n``, ``tile_k``,
``stages``, ``skip_rounds``, ``overlap``): they never change the output bits. The numerics keys
(``dispatch``, ``combine``, ``experts``) and the GEMM engine (``gemm``) are the caller's choice,
kept as given; the winner's output is compared bit for bit with the default point's on the
tuning inputs, and a winner whose bits differ is refused (a warning, and the default is kept).

Winners are cached in a JSON file (``cache_path()``: ``UNIEP_TUNE_CACHE``, else
``$XDG_CACHE_HOME/uniep/tune.json``, else ``~/.cache/uniep/tune.json``) under a key holding the
device name, world size, shape, dtype, weight format, numerics keys, UniEP version and the cache
schema, so that another GPU or world size never reuses an entry. ``uniep.moe_forward``, the
``uniep.nn`` modules and ``moe_forward_prepared`` use a cached point when their tuning string is
``""``. A corrupt, unreadable or foreign cache file is reported with a warning and ignored.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import _C, distributed
from .._util.timing import time_calls_ms
from ..gemm import pingpong_rows
from ..moe.megakernel.launch import (
    FUSED_TILE_MS,
    fused_by_default,
    fused_tile_m,
    fused_tile_n,
    megakernel_numerics,
    megakernel_shape_ok,
)
from .cache import (
    NUMERICS_KEYS,
    SCHEDULE_KEYS,
    SCHEMA,
    TUNABLE_DTYPES,
    WEIGHTS,
    cache_key,
    cache_path,
    check_weights,
    device_name,
    lookup,
    name_of_dtype,
    normalize_numerics,
    numerics_of,
    positive_int_arg,
    store,
)
from .params import parse as parse_tuning

__all__ = [
    "CUDA_FP8_TILES",
    "CUDA_TILES",
    "NUMERICS_KEYS",
    "SCHEDULE_KEYS",
    "SCHEMA",
    "Candidate",
    "CostModel",
    "MoeShape",
    "Pick",
    "TuneResult",
    "WEIGHTS",
    "cache_key",
    "cache_path",
    "candidate_points",
    "device_name",
    "executor_point",
    "lookup",
    "pick_beyond_noise",
    "store",
    "tune",
]

# The expert GEMM engine's compiled (tile_m, tile_n, tile_k), in its registry order
# (cpp/cuda/gemm/grouped): the only tile keys a CUDA candidate may name.
CUDA_TILES = ((128, 256, 64), (64, 128, 128), (128, 128, 64), (256, 128, 64), (64, 256, 64))
# The tile compiled in clusters of one and two CTAs along M (tuning key cluster): the automatic
# choice takes one by rows per expert (_C.grouped_gemm_auto_cluster), the tuner times both.
CUDA_CLUSTER_TILE = (64, 256, 64)
# The fp8 grouped GEMM's (experts=fp8, dispatch=fp8's default), in its registry order
# (_C.grouped_gemm_fp8_auto_config indexes it).
CUDA_FP8_TILES = ((128, 128, 128), (64, 128, 128))
# The CPU executor blocks its loops by any power of two in [16, 256]; auto is 128 columns
# (TuningParams::tile_n_or_default, include/uniep/tuning.hpp).
CPU_TILES = (16, 32, 64, 128, 256)
_CPU_AUTO_TILE_N = 128
_CUDA_SMS = (8, 16, 24, 32)
_CUDA_TOKEN_TILES = (32, 64, 128)
# The MegaKernel's points on packed experts, at each of its tile heights: (CTAs that send first,
# rounds of tiles the others take first; -1 = auto). 0 CTAs stands for every CTA (the SM count).
# The set holds the best points of bench_experts' world-1 sweeps (one H200, 2026-11-26, commits
# 17282dd and d0137b0).
_FUSED_POINTS = ((0, -1), (8, -1), (16, -1), (32, -1), (16, 0), (16, 16))
# SMs of communication warps that saturate a GPU's links (a model assumption, docs/tuning.md).
_SATURATING_COMM_SMS = 20


# ---- candidates and the cost model ----


@dataclass(frozen=True)
class MoeShape:
    """One tuning problem: ``tokens`` per rank, ``hidden``, ``ffn`` (per expert), ``experts`` in
    total, ``top_k``, ``world`` ranks, ``dtype`` name."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    world: int
    dtype: str

    @property
    def elem_bytes(self) -> int:
        return TUNABLE_DTYPES[self.dtype].itemsize

    @property
    def local_experts(self) -> int:
        return self.experts // self.world

    def ranks_per_token(self) -> float:
        """Expected distinct ranks a token goes to, top-k drawn uniformly without replacement."""
        if self.world == 1:
            return 1.0
        el = self.local_experts
        k = min(self.top_k, self.experts)
        miss = math.comb(self.experts - el, k) / math.comb(self.experts, k)
        return self.world * (1.0 - miss)


def fused_allowed(numerics: str | _C.TuningParams) -> bool:
    """Whether the MegaKernel runs these numerics (bf16 dispatch, per-k combine, UniEP's GEMMs)."""
    return megakernel_numerics(parse_tuning(normalize_numerics(numerics)))


def candidate_points(
    shape: MoeShape,
    device: str,
    numerics: str = "",
    sm_count: int = 132,
    weights: str = "plain",
) -> list[str]:
    """Every schedule point the tuner considers for ``shape`` on ``device`` ("cpu" or "cuda"),
    as full tuning strings with ``numerics`` kept; the default point first.

    CPU: ``tile_n`` (the width of the executor's inner loop) over the powers of two 16..256, the
    only schedule key that changes the CPU executor's loops (``executor_point``).

    CUDA, plain weights (``moe_forward``) and ``weights="bf16_packed"`` (``moe_forward_prepared``)
    alike, both paths: the separate launches (``overlap=sequential``, the default point: what an
    empty tuning string runs without a cache entry, but on packed experts at world 1 on decode
    batches, ``fused_by_default``, where the default is the MegaKernel with every CTA sending
    and the launch's tiles) over the engine's compiled tile shapes (the
    fp8 GEMM's with fp8 experts) and auto, ``sms`` in 8/16/24/32 (below the device's SMs) and
    ``token_tile`` 32/64/128; and, when ``fused_allowed``, the MegaKernel (``overlap=fused``; on
    plain weights it runs on a packed copy of ``w1``, ``uniep.moe.megakernel.forward``) at
    ``tile_m`` 64 and 128 and the ``(sms, skip_rounds)`` pairs of ``_FUSED_POINTS`` (``sms`` = the
    SM count: every CTA sends first).
    """
    check_weights(weights)
    if weights != "plain" and device != "cuda":
        raise ValueError(f"weights={weights!r} is tuned on cuda only, got device {device!r}")
    base = parse_tuning(normalize_numerics(numerics))
    if device == "cuda":
        # A full tuning string names its overlap, and overlap=fused runs the MegaKernel: the
        # default point must be the separate launches that an empty string runs (on packed
        # experts' decode batches the MegaKernel's, put first below).
        base.overlap = "sequential"
    out = [base.to_string()]
    seen = set(out)

    def add(**keys: Any) -> None:
        p = parse_tuning(base.to_string())
        for k, v in keys.items():
            setattr(p, k, v)
        p.validate()
        text = p.to_string()
        if text not in seen:
            seen.add(text)
            out.append(text)

    if device == "cpu":
        for tn in CPU_TILES:
            add(tile_n=tn)
    elif device == "cuda":
        compiled = CUDA_FP8_TILES if base.fp8_experts else CUDA_TILES
        # (tile_m, tile_n, tile_k, cluster); cluster 0 leaves it to the engine's rule.
        tiles: list[tuple[int, int, int, int]] = [(0, 0, 0, 0), *((*t, 0) for t in compiled)]
        if not base.fp8_experts:
            tiles += [(*CUDA_CLUSTER_TILE, c) for c in (1, 2)]
        for sms in _CUDA_SMS:
            if sms >= sm_count:
                continue
            for tt in _CUDA_TOKEN_TILES:
                for tm, tn, tk, cl in tiles:
                    add(comm_sms=sms, token_tile=tt, tile_m=tm, tile_n=tn, tile_k=tk, cluster=cl)
        if fused_allowed(numerics):
            for tm in FUSED_TILE_MS:
                for comm, skip in _FUSED_POINTS:
                    if comm < sm_count:
                        add(overlap="fused", comm_sms=comm or sm_count, skip_rounds=skip, tile_m=tm)
            if weights == "bf16_packed" and packed_default_is_fused(shape):
                # What an empty string runs there: the MegaKernel, every CTA sending, its tiles
                # the launch's choice.
                p = parse_tuning(base.to_string())
                p.overlap, p.comm_sms, p.skip_rounds = "fused", sm_count, -1
                default = p.to_string()
                if default in seen:
                    out.remove(default)
                out.insert(0, default)
                seen.add(default)
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return out


def packed_default_is_fused(shape: MoeShape) -> bool:
    """Whether an empty tuning string runs the MegaKernel on packed experts of ``shape`` (with
    nothing cached): ``fused_by_default`` where the MegaKernel takes the layer's sizes."""
    rows = shape.tokens * shape.top_k
    return megakernel_shape_ok(shape.hidden, shape.ffn) and fused_by_default(
        rows, shape.local_experts, shape.world
    )


# What each executor reads of the schedule keys, as ``tune`` says it when every point runs alike.
_EXECUTOR_READS = {
    "cpu": "the CPU executor reads only tile_n of the schedule keys, as its inner loop's width, "
    "at most the GEMM's N",
    "cuda": "no CUDA path reads token_tile",
}


def executor_point(shape: MoeShape, device: str, tuning: str) -> str:
    """What the executor on ``device`` ("cpu" or "cuda") does at ``tuning`` for ``shape``, as a
    string: two points with the same string run the same work in the same loops, so that timing
    one against the other measures only noise.

    CPU (``cpp/core/cpu_moe.cpp``, ``cpu_math.hpp``): the numerics keys and, of the schedule
    keys, ``tile_n`` alone, as the width of each expert GEMM's inner loop, ``min(tile_n, N)``
    for its ``N`` (``2 * ffn``, then ``hidden``). ``tile_k`` cuts that loop's ``k`` range into
    blocks walked in the same order, ``tile_m`` cuts an expert's rows into work tiles taken in
    the same order, and ``overlap`` only reorders the work tiles (each row streams its expert's
    weights whatever the order); ``sms``, ``token_tile``, ``stages`` and ``skip_rounds`` are
    not read. CUDA: every key but ``token_tile``, which no CUDA path reads.
    """
    p = parse_tuning(tuning)
    if device == "cuda":
        p.token_tile = _C.TuningParams().token_tile
        return p.to_string()
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    tn = p.tile_n or _CPU_AUTO_TILE_N
    widths = "/".join(str(min(tn, n)) for n in (2 * shape.ffn, shape.hidden))
    return f"{normalize_numerics(p)},loop_n={widths}"


def plain_swiglu_epilogue(ffn: int, p: _C.TuningParams) -> bool:
    """Whether ``moe_forward`` runs the SwiGLU in the first expert GEMM's epilogue on w1 as
    stored (``uniep.gemm.grouped_mm_swiglu_plain``) at ``p``: the FFN size a multiple of 64, and
    of ``tile_n / 2`` where ``p`` names ``tile_n`` (cpp/torch/gemm/grouped_ops.cpp,
    ``plain_gate_up_ok``; a contiguous w1 is assumed)."""
    return ffn % 64 == 0 and (p.tile_n == 0 or ffn % (p.tile_n // 2) == 0)


def _cuda_auto_tiles(
    rows: int, experts: int, n: int, k: int, pingpong_rows: int = 2048, swiglu: bool = False
) -> tuple[int, int, int]:
    # The engine's own choice for tile keys left at auto: the rule grouped_gemm_select runs
    # (uniep/tuning.hpp); pingpong_rows: uniep.gemm.pingpong_rows of the device.
    return CUDA_TILES[_C.grouped_gemm_auto_config(rows, experts, n, k, swiglu, pingpong_rows)]


def _runs_megakernel(p: _C.TuningParams) -> bool:
    # What uniep.moe_forward and moe_forward_prepared run on CUDA for a full tuning string
    # (uniep.moe.megakernel.launch.runs_fused): the MegaKernel for overlap=fused with its numerics.
    return p.overlap == "fused" and megakernel_numerics(p)


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one ``moe_forward`` at a tuning point (docs/tuning.md).

    ``comm = 3 (W - 1) alpha + (dispatch + combine bytes) * beta`` (per link, expected bytes under
    uniform routing; on CUDA the bandwidth falls with fewer than 20 communication SMs);
    ``gemm`` is a roofline (``max(flops / peak_flops, bytes / mem_bw)``): on CPU over the whole
    GEMM plus ``tile_cost`` per start of the executor's innermost loop (``tile_n`` columns), on
    CUDA per output tile, wave-quantised over the SMs left to the GEMM. On CPU the executor's
    phases add up in every overlap mode. ``scale`` maps the model onto the measured time of the
    default point.

    On CUDA, for plain weights (``moe_forward``) and ``weights="bf16_packed"``
    (``moe_forward_prepared``) alike: ``sequential`` is the separate launches, the GEMMs plus the
    local copies (the row gather, which reads each received row once, and the combine's read of
    the rows; plain weights whose FFN size the SwiGLU epilogue on w1 as stored does not take also
    the SwiGLU pass over the first GEMM's output) plus the communication; ``fused`` is the
    MegaKernel, GEMMs on every SM with its own tiles (``tile_m`` x ``tile_n`` x 64, each as the
    launch picks it when auto: ``fused_tile_m``, ``fused_tile_n``), plus the share of
    the send its senders spend (all of it when every CTA sends first; the rest runs under the
    other CTAs' tiles) and the reduce's read of the rows.
    """

    device: str
    peak_flops: float
    mem_bw: float
    alpha: float = 0.0
    beta: float = 0.0
    tile_cost: float = 0.0
    sm_count: int = 1
    scale: float = 1.0
    weights: str = "plain"
    pingpong_rows: int = 2048  # uniep.gemm.pingpong_rows of the device

    def comm_seconds(self, shape: MoeShape, p: _C.TuningParams) -> float:
        w = shape.world
        if w == 1:
            return 0.0
        remote = (w - 1) / w
        wire = 1.0 + 4.0 / 128 if p.dispatch == "fp8" else float(shape.elem_bytes)
        rows_out = shape.tokens * shape.ranks_per_token() * remote
        dispatch_bytes = rows_out * shape.hidden * wire
        combine_rows = (
            rows_out if p.combine == "rank_partials" else shape.tokens * shape.top_k * remote
        )
        combine_bytes = combine_rows * shape.hidden * shape.elem_bytes
        beta = self.beta
        if self.device == "cuda":
            beta /= min(1.0, p.comm_sms / _SATURATING_COMM_SMS)
        return 3 * (w - 1) * self.alpha + (dispatch_bytes + combine_bytes) * beta

    def _rows_seconds(self, shape: MoeShape) -> float:
        # Reading or writing one bf16 row per (token, k): the unit of the local copies.
        return shape.tokens * shape.top_k * shape.hidden * shape.elem_bytes / self.mem_bw

    def cuda_seconds(self, shape: MoeShape, p: _C.TuningParams) -> float:
        """The unscaled time of ``moe_forward_prepared`` (``moe_forward`` with plain weights) on
        CUDA at ``p``."""
        comm = self.comm_seconds(shape, p)
        rows = self._rows_seconds(shape)
        if not _runs_megakernel(p):
            # Plain weights run the SwiGLU in the first GEMM's epilogue, reading w1 as stored,
            # where the FFN size allows it (plain_swiglu_epilogue), as packed ones always do.
            # Else the first GEMM writes [rows, 2I] and a SwiGLU pass reads it and writes
            # [rows, I]; fp8 experts always take that pass (it quantizes the activation). The
            # gather reads each received row once and writes one row per (token, k); fp8
            # experts gather e4m3 rows (half a bf16 row each way) and write an e4m3 activation.
            received = rows * shape.ranks_per_token() / shape.top_k
            gather = (rows + received) * (0.5 if p.fp8_experts else 1.0)
            swiglu = (2.5 if p.fp8_experts else 3.0) * rows * shape.ffn / shape.hidden
            separate_pass = self.weights == "plain" and (
                p.fp8_experts or not plain_swiglu_epilogue(shape.ffn, p)
            )
            gemm = self.gemm_seconds(shape, p, swiglu_epilogue=not separate_pass)
            return gemm + comm + gather + 2 * rows + (swiglu if separate_pass else 0.0)
        fused = parse_tuning(p.to_string())
        el = shape.local_experts
        if fused.tile_n == 128:
            fused.tile_m = 64
        if fused.tile_m == 0:
            fused.tile_m = fused_tile_m(
                shape.tokens * shape.top_k, el, pingpong_rows=self.pingpong_rows
            )
        if fused.tile_n == 0:
            fused.tile_n = fused_tile_n(
                fused.tile_m, shape.tokens * shape.top_k, el, shape.ffn, self.sm_count
            )
        fused.tile_k = 64
        fused.overlap = "sequential"  # every SM runs tiles once its share of the send is done
        # The whole send, at the rate of its senders: at world 1 on an H100 fewer senders were
        # slower on every load, as the other CTAs' tiles wait at their gates for the rows
        # (2026-11-26, commit a4f66c4), so none of it is modelled as hidden.
        senders = min(p.comm_sms, self.sm_count)
        send = max(2 * rows, comm) / min(1.0, senders / _SATURATING_COMM_SMS)
        return self.gemm_seconds(shape, fused) + send + 2 * rows

    def gemm_seconds(
        self, shape: MoeShape, p: _C.TuningParams, swiglu_epilogue: bool = False
    ) -> float:
        h, i, eb = shape.hidden, shape.ffn, shape.elem_bytes
        rows = shape.tokens * shape.top_k  # expected rows per rank under uniform routing
        # The two expert GEMMs as (N, K): [rows, H] x [H, 2I], then [rows, I] x [I, H].
        gemms = ((2 * i, h), (h, i))
        if self.device == "cpu":
            # The executor multiplies one row at a time (cpp/core/cpu_math.hpp, vec_mat): every
            # row streams each weight matrix once, whatever the blocking, and its innermost loop
            # (tile_n columns of one k) starts ceil(N / tile_n) * K times: the blocking's cost.
            tn = p.tile_n or _CPU_AUTO_TILE_N
            flops = 2.0 * rows * sum(n * k for n, k in gemms)
            weight_bytes = rows * sum(n * k for n, k in gemms) * eb
            loops = rows * sum(math.ceil(n / tn) * k for n, k in gemms)
            return max(flops / self.peak_flops, weight_bytes / self.mem_bw) + loops * self.tile_cost
        el = shape.local_experts
        m = rows / el  # rows per local expert
        gemm_sms = self.sm_count - (p.comm_sms if p.overlap == "fused" else 0)
        gemm_sms = max(1, gemm_sms)
        # fp8 experts: e4m3 operands at twice the bf16 tensor-core rate (peak_flops is bf16's).
        fp8 = p.fp8_experts and not _runs_megakernel(p)
        rate, eb = (2.0, 1) if fp8 else (1.0, eb)
        if fp8:  # both GEMMs: one rule of the rows per expert
            fp8_tm = p.tile_m or CUDA_FP8_TILES[_C.grouped_gemm_fp8_auto_config(int(rows), el)][0]
        total = 0.0
        for index, (n, k) in enumerate(gemms):
            if fp8:
                tm, tn, tk = (fp8_tm, 128, 128)
            elif p.tile_m or p.tile_n or p.tile_k:
                tm, tn, tk = p.tile_m or 128, p.tile_n or 128, p.tile_k or 64
            else:
                swiglu = swiglu_epilogue and index == 0
                tm, tn, tk = _cuda_auto_tiles(int(rows), el, n, k, self.pingpong_rows, swiglu)
            tiles = el * math.ceil(m / tm) * math.ceil(n / tn)
            waves = math.ceil(tiles / gemm_sms)
            per_sm_flops = rate * self.peak_flops / self.sm_count
            per_sm_bw = self.mem_bw / self.sm_count
            tile_s = max(2.0 * tm * tn * k / per_sm_flops, (tm + tn) * k * eb / per_sm_bw)
            total += waves * (tile_s + self.tile_cost * math.ceil(k / tk))
        return total

    def seconds(self, shape: MoeShape, tuning: str) -> float:
        p = parse_tuning(tuning)
        if self.device == "cuda" or self.weights != "plain":
            return self.scale * self.cuda_seconds(shape, p)
        # The CPU executor runs its phases one after another whatever the overlap mode.
        return self.scale * (self.comm_seconds(shape, p) + self.gemm_seconds(shape, p))


# ---- measurement ----


def _times_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> list[float]:
    """Per-call times in ms of ``iters`` calls after ``warmup`` untimed ones: CUDA events on the
    current stream (the host does not wait between calls) or the wall clock."""
    for _ in range(warmup):
        fn()
    return time_calls_ms(fn, iters, cuda)


def settle_calls(settle_s: float, est_ms: Sequence[float], grp: _Group | None = None) -> list[int]:
    """The untimed calls that take about ``settle_s`` seconds for candidates of ``est_ms`` ms a
    call (at least 1 when settling, at most 100,000; 0 for a candidate with no finite estimate,
    one that failed), the largest over ``grp``'s ranks so that every rank makes the same calls."""
    if settle_s <= 0:
        return [0] * len(est_ms)
    counts = [
        float(min(100_000, max(1, math.ceil(settle_s * 1e3 / max(ms, 1e-3)))))
        if math.isfinite(ms)
        else 0.0
        for ms in est_ms
    ]
    if grp is not None:
        counts = grp.max(counts, "settle")
    return [int(c) for c in counts]


def _settle(fn: Callable[[], object], calls: int, cuda: bool) -> None:
    """``calls`` untimed calls back to back; on a GPU the host waits every 16 calls, so that the
    launch queue does not fill and the GPU runs them without gaps."""
    for n in range(calls):
        fn()
        if cuda and n % 16 == 15:
            torch.cuda.synchronize()


class _Group:
    """The few collectives the tuner needs, bounded like UniEP's own (``UNIEP_TIMEOUT_S``)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.pg = distributed.resolve_group(group)
        self.world = 1 if self.pg is None else dist.get_world_size(self.pg)
        self.rank = 0 if self.pg is None else dist.get_rank(self.pg)
        self.device = "cpu" if self.pg is None else distributed.staging_device(self.pg)

    def max(self, values: Sequence[float], what: str) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg, async_op=True)
        distributed.bounded_wait(work, self.pg, f"uniep.tune ({what})")
        return t.cpu().tolist()

    def rank0_text(self, text: str, what: str) -> str:
        if self.world == 1:
            return text
        data = distributed.broadcast_bytes(text.encode(), self.pg, f"uniep.tune ({what})")
        return data.decode()


def _inputs(
    shape: MoeShape, device: torch.device, rank: int, seed: int
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed * 7919 + 1 + rank)
    dtype = TUNABLE_DTYPES[shape.dtype]
    t, h, i, e, k, el = (
        shape.tokens,
        shape.hidden,
        shape.ffn,
        shape.experts,
        shape.top_k,
        shape.local_experts,
    )
    x = torch.randn(t, h, generator=gen).to(dtype)
    idx = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous()
    weights = torch.rand(t, k, generator=gen) + 0.1
    weights = (weights / weights.sum(dim=1, keepdim=True)).to(
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    w1 = (torch.randn(el, h, 2 * i, generator=gen) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn(el, i, h, generator=gen) / math.sqrt(i)).to(dtype)
    return tuple(a.to(device) for a in (x, idx, weights, w1, w2))


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


# ---- the tuner ----


# On a GPU the close calls of the search are measured again: one H200 spread a point's median by
# up to 5% between runs of the same search (2026-11-28, commit 8857330, DeepSeek-V3's EP8
# rank: the fused point measured 5.31 ms in the search and 5.52 ms re-timed).
RUNOFF_MARGIN = 1.05
RUNOFF_POINTS = 4


def runoff_points(
    medians: Sequence[float], margin: float = RUNOFF_MARGIN, most: int = RUNOFF_POINTS
) -> list[int]:
    """Indices of the measured points whose median is within ``margin`` times the best one's,
    fastest first and at most ``most`` of them; empty when no other point is that close (the
    search then has nothing to settle)."""
    if margin < 1 or most < 2:
        raise ValueError(f"margin must be >= 1 and most >= 2, got {margin!r} and {most!r}")
    finite = sorted((m, n) for n, m in enumerate(medians) if math.isfinite(m))
    if not finite:
        return []
    close = [n for m, n in finite if m <= finite[0][0] * margin][:most]
    return close if len(close) > 1 else []


@dataclass(frozen=True)
class Pick:
    """``pick_beyond_noise``'s answer: ``chosen``, the index of the point to keep; ``fastest``,
    the index of the lowest median; ``why``: ``"beyond noise"`` (``chosen`` is not the default),
    ``"default fastest"``, ``"within noise"``, ``"one round"`` (fewer than two paired rounds to
    judge by) or ``"default failed"`` (``chosen`` is then the fastest point)."""

    chosen: int
    fastest: int
    why: str


def pick_beyond_noise(
    medians: Sequence[float], rounds: Sequence[Sequence[float]], default: int
) -> Pick:
    """Which measured point to keep: the default unless another one is faster beyond the noise.

    ``medians[n]``: point ``n``'s median time (inf when it failed or was not measured);
    ``rounds[n]``: its time in each interleaved round; ``default``: the default point's index.
    A point replaces the default only when it was faster than the default in every round that
    timed both (at least two): the rounds interleave the points, so a drift of the clock or of
    the machine's load between rounds hits both alike, and a point that wins each paired round
    wins by more than the round-to-round noise. Among such points the lowest median wins; with
    none the default stays, also when the fastest median is another point's (``"within
    noise"``). A point timed in fewer than two rounds beside the default never replaces it.
    """
    if not len(medians) == len(rounds) > default >= 0:
        raise ValueError(
            f"medians and rounds must be as long as each other and hold the default's index "
            f"{default}, got {len(medians)} and {len(rounds)}"
        )
    finite = [n for n, m in enumerate(medians) if math.isfinite(m)]
    fastest = min(finite, key=lambda n: (medians[n], n != default), default=default)
    if not math.isfinite(medians[default]):
        return Pick(fastest, fastest, "default failed")
    if fastest == default:
        return Pick(default, fastest, "default fastest")

    def paired(n: int) -> list[tuple[float, float]]:
        return list(zip(rounds[default], rounds[n], strict=False))

    beyond = [
        n
        for n in finite
        if n != default
        and medians[n] < medians[default]
        and len(paired(n)) >= 2
        and all(mine < base for base, mine in paired(n))
    ]
    if beyond:
        return Pick(min(beyond, key=lambda n: (medians[n], n)), fastest, "beyond noise")
    if len(paired(fastest)) < 2:
        return Pick(default, fastest, "one round")
    return Pick(default, fastest, "within noise")


def _label(tuning: str, default: str) -> str:
    """The keys of ``tuning`` that differ from ``default`` (``"default"`` when none do)."""
    diff = [kv for kv, d in zip(tuning.split(","), default.split(","), strict=True) if kv != d]
    return ",".join(diff) or "default"


def _changes(tuning: str, default: str) -> int:
    """How many keys of ``tuning`` differ from ``default``."""
    return sum(kv != d for kv, d in zip(tuning.split(","), default.split(","), strict=True))


@dataclass
class Candidate:
    """One measured point: its tuning string, the model's prediction, the measured median and its
    time in each interleaved round (both the slowest rank's) in ms; ``error`` when it could not
    run (then ``measured_ms`` is inf)."""

    tuning: str
    predicted_ms: float
    measured_ms: float = math.nan
    error: str = ""
    rounds_ms: list[float] = field(default_factory=list)

    @property
    def spread(self) -> str:
        """Its round times as ``"min..max"`` ms (``"-"`` when not measured)."""
        if not self.rounds_ms:
            return "-"
        return f"{min(self.rounds_ms):.3f}..{max(self.rounds_ms):.3f}"

    @property
    def schedule(self) -> str:
        """The schedule keys only (the numerics keys are the same for every candidate)."""
        return ",".join(
            kv for kv in self.tuning.split(",") if kv.split("=", 1)[0] not in NUMERICS_KEYS
        )


@dataclass
class TuneResult:
    """What ``tune`` found. ``tuning``: the point to use (the default unless another point was
    faster beyond the noise, ``pick_beyond_noise``, with the same bits); ``candidates``: the
    measured points in the cost model's order (``considered`` were ranked, ``distinct`` of them
    run differently on the executor, ``executor_point``); ``verdict``: one line saying why
    ``tuning`` was kept; ``cache_path``: where it was stored (None when not stored)."""

    tuning: str
    default: str
    key: str
    device_name: str
    world_size: int
    default_ms: float
    best_ms: float
    considered: int
    candidates: list[Candidate] = field(default_factory=list)
    calibration: dict[str, float] = field(default_factory=dict)
    bits_identical: bool = True
    cache_path: str | None = None
    weights: str = "plain"
    distinct: int = 0
    verdict: str = ""

    def table(self) -> str:
        """The measured candidates as a Markdown table (schedule keys, predicted and measured ms,
        the round times' range, the chosen one marked)."""
        lines = [
            "| # | schedule | predicted ms | measured ms | rounds ms | chosen |",
            "|---:|---|---:|---:|---:|:---:|",
        ]
        for n, c in enumerate(self.candidates, 1):
            measured = f"{c.measured_ms:.3f}" if math.isfinite(c.measured_ms) else "failed"
            chosen = "**yes**" if c.tuning == self.tuning else ""
            default = " (default)" if c.tuning == self.default else ""
            lines.append(
                f"| {n} | `{c.schedule}`{default} | {c.predicted_ms:.3f} | {measured} | "
                f"{c.spread} | {chosen} |"
            )
        return "\n".join(lines)


def _verdict(
    pick: Pick,
    rows: Sequence[Candidate],
    default_index: int,
    considered: int,
    distinct: int,
    device: str,
) -> str:
    """One line on why ``pick.chosen`` is kept, with the times it rests on."""
    d, f, c = rows[default_index], rows[pick.fastest], rows[pick.chosen]
    kept = f"the default, {d.measured_ms:.3f} ms"
    fastest = f"the fastest point, {_label(f.tuning, d.tuning)} at {f.measured_ms:.3f} ms,"
    if distinct == 1:
        return (
            f"{kept}: all {considered} points run alike on the {device} executor at this shape "
            f"({_EXECUTOR_READS[device]}), so none was raced against it"
        )
    if pick.why == "beyond noise":
        return (
            f"{c.measured_ms:.3f} ms vs {d.measured_ms:.3f} ms for the default "
            f"({d.measured_ms / c.measured_ms:.2f}x), faster in every round (round times: "
            f"{c.spread} ms, the default's {d.spread} ms)"
        )
    if pick.why == "within noise":
        return (
            f"{kept}: {fastest} is within noise: not faster in every round (round times: "
            f"{f.spread} ms, the default's {d.spread} ms)"
        )
    if pick.why == "one round":
        return f"{kept}: {fastest} ran in one round, which cannot tell it from noise"
    if pick.why == "default failed":
        return f"{c.measured_ms:.3f} ms; the default failed ({d.error})"
    return f"{kept}: no other point measured faster"


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        cuda = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
            "uniep::moe_forward", "CUDA"
        )
        device = "cuda" if cuda else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device is cuda but no CUDA device is visible")
        return torch.device(
            "cuda", dev.index if dev.index is not None else torch.cuda.current_device()
        )
    if dev.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return dev


def _calibrate(
    shape: MoeShape,
    dev: torch.device,
    grp: _Group,
    run: Callable[[str], torch.Tensor],
    default: str,
    probe: str | None,
    warmup: int,
    iters: int,
    weights: str = "plain",
) -> CostModel:
    """Fit the cost model's constants with a few short measurements (slowest rank's, so that every
    rank ranks the candidates alike): a matmul (peak flops), a copy (memory bandwidth), two
    all-reduces (alpha, beta), and the op itself at the default point (and, on CPU, at the
    narrowest loop blocks, ``tile_n=16``, which fixes the cost per loop start)."""
    cuda = dev.type == "cuda"
    dtype = TUNABLE_DTYPES[shape.dtype]
    m = max(16, min(256, shape.tokens * shape.top_k))
    a = torch.randn(m, shape.hidden, device=dev).to(dtype)
    b = torch.randn(shape.hidden, 2 * shape.ffn, device=dev).to(dtype)
    mm_ms = statistics.median(_times_ms(lambda: a @ b, 1, 3, cuda))
    buf = torch.empty(1 << 22, dtype=torch.uint8, device=dev)
    copy_ms = statistics.median(_times_ms(buf.clone, 1, 3, cuda))
    small_ms = big_ms = 0.0
    big_bytes = 1 << 20
    if grp.world > 1:
        one = torch.zeros(1, device=grp.device)
        big = torch.zeros(big_bytes // 4, device=grp.device)
        small_ms = statistics.median(
            _times_ms(lambda: dist.all_reduce(one, group=grp.pg), 1, 5, False)
        )
        big_ms = statistics.median(
            _times_ms(lambda: dist.all_reduce(big, group=grp.pg), 1, 3, False)
        )
    op_ms = statistics.median(_times_ms(lambda: run(default), warmup, iters, cuda))
    probe_ms = 0.0
    if probe is not None:
        probe_ms = statistics.median(_times_ms(lambda: run(probe), warmup, iters, cuda))
    mm_ms, copy_ms, small_ms, big_ms, op_ms, probe_ms = grp.max(
        [mm_ms, copy_ms, small_ms, big_ms, op_ms, probe_ms], "calibration"
    )
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 1
    # An all-reduce of n bytes moves about 2n over each link (ring): beta per byte of one link.
    alpha = small_ms / 1e3 / 2 if grp.world > 1 else 0.0
    beta = max(0.0, (big_ms - small_ms) / 1e3 / (2 * big_bytes)) if grp.world > 1 else 0.0
    model = CostModel(
        device=dev.type,
        peak_flops=2.0 * m * shape.hidden * 2 * shape.ffn / max(mm_ms / 1e3, 1e-9),
        mem_bw=2.0 * buf.numel() / max(copy_ms / 1e3, 1e-9),
        alpha=alpha,
        beta=beta,
        sm_count=sm_count,
        weights=weights,
        pingpong_rows=pingpong_rows(dev) if cuda else 2048,
    )
    if probe is not None:
        # Two measurements, two unknowns (scale s, cost per loop start c):
        # t = s * (base + blocks * c) at the default point and at the probe.
        base_d = model.seconds(shape, default)
        base_p = model.seconds(shape, probe)
        one_block = CostModel(**{**model.__dict__, "tile_cost": 1.0})
        blocks_d = one_block.seconds(shape, default) - base_d
        blocks_p = one_block.seconds(shape, probe) - base_p
        t_d, t_p = op_ms / 1e3, probe_ms / 1e3
        denom = t_d * blocks_p - t_p * blocks_d
        cost = (t_p * base_d - t_d * base_p) / denom if denom > 0 else 0.0
        model = CostModel(**{**model.__dict__, "tile_cost": max(0.0, cost)})
    raw = model.seconds(shape, default)
    scale = (op_ms / 1e3) / raw if raw > 0 else 1.0
    return CostModel(**{**model.__dict__, "scale": scale})


def tune(
    group: dist.ProcessGroup | None = None,
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype | str = torch.bfloat16,
    numerics: str = "",
    candidates: int = 8,
    warmup: int = 2,
    iters: int = 10,
    budget_s: float | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    cache: bool = True,
    path: str | os.PathLike | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    weights: str = "plain",
    settle_s: float = 0.0,
) -> TuneResult:
    """Find the fastest schedule for one MoE shape and cache it; collective over ``group``.

    Every rank of ``group`` (default: as ``uniep.moe_forward``) must call it with the same
    arguments. It ranks every candidate schedule (``uniep.tuning.tuner.candidate_points``) with a
    cost model calibrated by a short measurement, then times the best ``candidates`` of them, the
    default point (and on packed experts the model's best point of each path) with
    ``torch.ops.uniep.moe_forward`` (``moe_forward_prepared`` with ``weights="bf16_packed"``) on
    random routing: ``warmup`` untimed calls, then ``iters`` timed ones in 2 to 4 interleaved
    rounds (median; CUDA events on a GPU, the wall clock on CPU); on a GPU the points within 5% of
    the best (``runoff_points``, at most 4) are timed again in as many rounds, their medians then
    over every sample. Points that the executor runs alike (``executor_point``) are measured once.
    A candidate's time is the slowest rank's; rank 0's choice is broadcast. The default is kept
    unless another point beat it beyond the noise (``pick_beyond_noise``: faster than the default
    in every interleaved round that timed both); ``TuneResult.verdict`` says which and why. The
    winner's output must equal the default point's bit for bit on the tuning inputs, else a
    warning and the default.

    Args:
        group: the process group the experts are split over.
        tokens: tokens per rank (``x.shape[0]`` of the calls to tune for).
        hidden, ffn, experts, top_k: ``H``, ``I`` (per expert), ``E`` in total, ``K``.
        dtype: float32, bfloat16 or float64 (the CUDA executor takes bfloat16).
        numerics: ``dispatch``, ``combine``, ``gemm``, ``experts`` keys, kept as given (e.g.
            ``"dispatch=fp8"``).
        candidates: how many of the model's best points to measure (plus the default).
        warmup, iters: calls per candidate, untimed and timed.
        budget_s: stop measuring new candidates after this many seconds (all ranks agree).
        device: "cpu" or "cuda" (default: cuda when this build runs moe_forward there).
        seed: seed of the random inputs.
        cache: store the winner (every rank writes its own ``cache_path()``, atomically); a
            failed write warns.
        path: the cache file instead of ``cache_path()``.
        progress: ``progress(done, total, what)`` after each measurement.
        weights: ``"plain"`` (``moe_forward``) or ``"bf16_packed"`` (``moe_forward_prepared`` on
            ``prepare_experts(w1, w2, "bf16_packed")``: the separate launches and the MegaKernel;
            CUDA and bfloat16 only); cached under its own key.
        settle_s: about how many seconds each candidate runs back to back, untimed, before its
            timed calls in every round (a call count from its predicted time in the first
            round, from its measured median after; the same on every rank), so that it is timed
            at the clock it settles at. A GPU at its power limit (a training step of GEMMs; on
            an H200 nvidia-smi then reports the "SW power cap" throttle) runs at the clock the
            limit allows for what it runs, so a call's time follows the energy of all it does,
            and overlapping communication with the GEMMs saves little: on one H200 the
            MegaKernel at world 1 was 1.00x the GEMMs alone in interleaved rounds of a few
            calls and 1.11x run back to back on DeepSeek-V3's EP8 rank, where the separate
            launches were 1.11x and 1.08x (2026-11-28, commit c174a4f). 0 (the
            default): no settling, short interleaved rounds. The winner is cached under the same
            key either way.

    Returns:
        A ``TuneResult``.

    Raises:
        ValueError: a bad argument (named), or the ranks were given different arguments.
    """
    for name, value in (
        ("tokens", tokens),
        ("hidden", hidden),
        ("ffn", ffn),
        ("experts", experts),
        ("top_k", top_k),
        ("candidates", candidates),
        ("iters", iters),
    ):
        positive_int_arg(name, value)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(settle_s, bool) or not (
        isinstance(settle_s, (int, float)) and math.isfinite(settle_s) and 0 <= settle_s <= 600
    ):
        raise ValueError(f"settle_s must be a number of seconds in [0, 600], got {settle_s!r}")
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget_s must be a number of seconds > 0 or None, got {budget_s!r}")
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) must be <= experts ({experts})")
    dtype_name = name_of_dtype(dtype)
    numerics = normalize_numerics(numerics)
    check_weights(weights)
    dev = _resolve_device(device)
    if weights != "plain" and (dev.type != "cuda" or dtype_name != "bfloat16"):
        raise ValueError(
            f"weights={weights!r} tunes moe_forward_prepared's CUDA paths: it needs device cuda "
            f"and dtype bfloat16, got {dev.type} and {dtype_name}"
        )
    grp = _Group(group)
    if experts % grp.world != 0:
        raise ValueError(f"experts ({experts}) must be divisible by the world size ({grp.world})")
    shape = MoeShape(tokens, hidden, ffn, experts, top_k, grp.world, dtype_name)
    # Different arguments on different ranks would pair up different candidates' calls.
    mine = json.dumps(
        [shape.__dict__, numerics, candidates, warmup, iters, budget_s, dev.type, weights,
         settle_s]
    )  # fmt: skip
    theirs = grp.rank0_text(mine, "arguments")
    # The last rank whose arguments are not rank 0's, so that every rank can name one.
    differing = int(grp.max([float(grp.rank if theirs != mine else -1)], "arguments")[0])
    if differing >= 0:
        detail = (
            f"rank 0: {theirs}, rank {grp.rank}: {mine}"
            if theirs != mine
            else f"rank {differing}'s differ from rank 0's: {theirs}"
        )
        raise ValueError(
            "uniep.tune: the ranks were given different arguments (shape, dtype, numerics, "
            f"candidates, warmup, iters, budget_s, device, weights or settle_s); {detail}"
        )

    from ..moe import ops

    x, idx, topk_weights, w1, w2 = _inputs(shape, dev, grp.rank, seed)
    cuda = dev.type == "cuda"
    if weights == "plain":

        @torch.no_grad()
        def run(tuning: str) -> torch.Tensor:
            return ops.moe_forward(x, idx, topk_weights, w1, w2, group, tuning=tuning)

    else:
        from ..moe.prepared import moe_forward_prepared, prepare_experts

        packed = prepare_experts(w1, w2, weights)
        del w1, w2

        @torch.no_grad()
        def run(tuning: str) -> torch.Tensor:
            return moe_forward_prepared(x, idx, topk_weights, packed, group, tuning)

    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 132
    points = candidate_points(shape, dev.type, numerics, sm_count, weights)
    default = points[0]
    probe = None
    if not cuda:
        probe = parse_tuning(default)
        probe.tile_n = CPU_TILES[0]
        probe = probe.to_string()
    run(default)  # the GPU runtime's creation and first-call costs stay out of the calibration
    model = _calibrate(
        shape, dev, grp, run, default, probe, min(warmup, 1), max(3, iters // 2), weights
    )
    ranked = sorted(points, key=lambda t: (model.seconds(shape, t), _changes(t, default), t))
    # One point per distinct execution (the default standing for its own): points that the
    # executor runs alike would race only noise against each other.
    runs_as = {t: executor_point(shape, dev.type, t) for t in points}
    first = {runs_as[default]: default}
    for t in ranked:
        first.setdefault(runs_as[t], t)
    ranked = [t for t in ranked if first[runs_as[t]] == t]
    chosen = ranked[:candidates]
    # The default, and on CUDA the separate launches' best point and the MegaKernel's default
    # launch (every CTA sends) at each tile height: the model ranks points within a path and
    # tile better than the paths and tiles against each other.
    musts = [default]
    if cuda:
        musts += [next((t for t in ranked if "overlap=sequential" in t), default)]
        musts += [
            t
            for t in points
            if f"sms={sm_count}/0," in t and "skip_rounds=auto" in t and "overlap=fused" in t
        ]
    for t in musts:
        if first[runs_as[t]] not in chosen:
            chosen.append(first[runs_as[t]])
    # Every rank measures rank 0's list in rank 0's order.
    chosen = json.loads(grp.rank0_text(json.dumps(chosen), "candidates"))
    rows = [Candidate(t, model.seconds(shape, t) * 1e3) for t in chosen]

    samples: list[list[float]] = [[] for _ in rows]
    # Interleaved rounds so that a clock or thermal drift during the search spreads over every
    # candidate instead of favouring the ones measured early: 2 to 4 rounds of at least 3 calls.
    rounds = min(iters, max(2, min(4, iters // 3)))
    per_round = [iters // rounds + (1 if r < iters % rounds else 0) for r in range(rounds)]
    # Each point's median in each round (-1: not timed), the search's rounds then the runoff's.
    round_ms = [[-1.0] * (2 * rounds) for _ in rows]
    total = rounds * len(rows)
    done = 0
    start = time.monotonic()
    out_of_time = False
    # The default first: a budget that runs out still leaves the reference measured.
    order = sorted(range(len(rows)), key=lambda n: rows[n].tuning != default)
    for r in range(rounds):
        settle = settle_calls(
            settle_s,
            [
                statistics.median(s) if s else row.predicted_ms
                for s, row in zip(samples, rows, strict=True)
            ],
            grp,
        )
        for n in order:
            row = rows[n]
            skip = row.error or ((out_of_time or r > 0) and not samples[n])
            if not skip:
                try:
                    _settle(lambda t=row.tuning: run(t), settle[n], cuda)
                    times = _times_ms(
                        lambda t=row.tuning: run(t), warmup if r == 0 else 0, per_round[r], cuda
                    )
                    samples[n] += times
                    round_ms[n][r] = statistics.median(times)
                except (ValueError, RuntimeError, NotImplementedError) as e:
                    # moe_forward agrees its checks before any transfer: every rank fails alike.
                    row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            done += 1
            if progress is not None and grp.rank == 0:
                progress(done, total, _label(row.tuning, default))
            if budget_s is not None and r == 0 and not out_of_time:
                elapsed = grp.max([time.monotonic() - start], "budget")[0]
                out_of_time = elapsed > budget_s
    medians = [
        statistics.median(s) if s and not row.error else math.inf
        for s, row in zip(samples, rows, strict=True)
    ]
    medians = grp.max(medians, "measurements")
    # The close calls again, in as many interleaved rounds, their medians over every sample.
    again = runoff_points(medians) if cuda and not out_of_time else []
    if again:
        total += rounds * len(again)
        settle = settle_calls(settle_s, medians, grp)
        for r in range(rounds):
            for n in again:
                _settle(lambda t=rows[n].tuning: run(t), settle[n], cuda)
                times = _times_ms(lambda t=rows[n].tuning: run(t), 0, per_round[r], cuda)
                samples[n] += times
                round_ms[n][rounds + r] = statistics.median(times)
                done += 1
                if progress is not None and grp.rank == 0:
                    progress(done, total, _label(rows[n].tuning, default))
        medians = grp.max(
            [statistics.median(s) if n in again else medians[n] for n, s in enumerate(samples)],
            "runoff",
        )
    width = 2 * rounds
    slowest = grp.max([t for times in round_ms for t in times], "rounds")
    for n, (row, ms) in enumerate(zip(rows, medians, strict=True)):
        row.measured_ms = ms
        if not row.error:
            row.rounds_ms = [t for t in slowest[n * width : (n + 1) * width] if t >= 0]
    measured = [row for n, row in enumerate(rows) if samples[n] or row.error]
    default_index = next(n for n, row in enumerate(rows) if row.tuning == default)
    default_row = rows[default_index]
    pick = pick_beyond_noise(medians, [row.rounds_ms for row in rows], default_index)
    winner = grp.rank0_text(rows[pick.chosen].tuning, "winner")
    if numerics_of(winner) != numerics:
        raise AssertionError(f"uniep.tune changed the numerics keys: {winner!r} vs {numerics!r}")

    bits_ok = True
    if winner != default:
        same = torch.equal(_bits(run(default)), _bits(run(winner)))
        bits_ok = grp.max([0.0 if same else 1.0], "bit check")[0] == 0.0
        if not bits_ok:
            warnings.warn(
                f"uniep.tune: the output of {winner!r} differs bitwise from the default "
                f"point's on the tuning inputs (it must not: only numerics keys may change "
                "bits); keeping the default",
                RuntimeWarning,
                stacklevel=2,
            )
            winner = default
    winner_ms = next(row.measured_ms for row in rows if row.tuning == winner)
    verdict = _verdict(pick, rows, default_index, len(points), len(first), dev.type)
    if not bits_ok:
        verdict = (
            f"the default, {default_row.measured_ms:.3f} ms: the faster point's output bits "
            "differed from the default's (see the warning)"
        )
    name = device_name(dev)
    result = TuneResult(
        tuning=winner,
        default=default,
        key=cache_key(
            device_name=name,
            world_size=grp.world,
            tokens=tokens,
            hidden=hidden,
            ffn=ffn,
            experts=experts,
            top_k=top_k,
            dtype=dtype_name,
            numerics=numerics,
            weights=weights,
        ),
        device_name=name,
        world_size=grp.world,
        default_ms=default_row.measured_ms,
        best_ms=winner_ms,
        considered=len(points),
        candidates=measured,
        calibration={
            k: float(v) for k, v in model.__dict__.items() if k not in ("device", "weights")
        },
        bits_identical=bits_ok,
        weights=weights,
        distinct=len(first),
        verdict=verdict,
    )
    if cache:
        try:
            result.cache_path = str(
                store(
                    winner,
                    tokens=tokens,
                    hidden=hidden,
                    ffn=ffn,
                    experts=experts,
                    top_k=top_k,
                    dtype=dtype_name,
                    world_size=grp.world,
                    device_name=name,
                    numerics=numerics,
                    path=path,
                    weights=weights,
                    info={
                        "measured_ms": winner_ms,
                        "default_ms": default_row.measured_ms,
                        "measured": len(measured),
                        "considered": len(points),
                        "verdict": verdict,
                    },
                )
            )
        except OSError as e:
            warnings.warn(
                f"uniep.tune: {e}; the result is not cached", RuntimeWarning, stacklevel=2
            )
    return result
