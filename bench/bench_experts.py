"""The expert GEMM engine at world 1: its grouped GEMMs against ``torch._grouped_mm``, and the
whole ``moe_forward`` against the dense cuBLAS chain of the same FLOPs.

Layers (bf16; every token picks top-k distinct experts uniformly at random with a fixed seed, so
row counts are uneven and fill no whole tile):

    load              tokens T  hidden H  expert FFN I  experts E  top-k
    dsv3-ep8-rank         4096      7168          2048         32      8
    mixtral-ep4-rank      8192      4096         14336          2      2
    qwen3-30b-a3b         4096      2048           768        128      8   (many small experts)
    dsv3-256-experts      4096      7168          2048        256      8   (many small experts)

Part 1, kernels: each layer's up projection (K = H -> N = 2I) and down projection (K = I -> N = H)
as a grouped GEMM over the layer's R = T * top-k routed rows: torch._grouped_mm, the engine's
automatic choice, and every compiled configuration; whether all of them give the same bits. The
up projection also with SwiGLU in its epilogue, w1 packed (``pack_gate_up``) against w1 as stored
(``grouped_mm_swiglu_plain``), interleaved beside the plain GEMM, with whether their bits agree.

Where k and n are multiples of 128, the fp8 engine too (``grouped_mm_fp8``: each compiled tile,
interleaved) beside cuBLAS's fp8 GEMM on one dense matrix of the same FLOPs (per-tensor scales,
and the engine's 1 x 128 / 128 x 128 block scales where torch's ``_scaled_mm`` takes them).

Part 2, layers: ``torch.ops.uniep.moe_forward`` (a group of one rank: with the engine and the
per-k combine the device's plan of the routing, the rows stored, the experts, the combine of the
rows; otherwise dispatch to itself, experts, combine) with the engine (default) and with
``gemm=torch``, each with both combines, beside
  - the dense chain: the same rows through one [R, H] x [H, 2I] matmul, SwiGLU and one
    [R, I] x [I, H] matmul (cuBLAS; the same FLOPs with no routing at all);
  - the weight floor: reading every expert weight once from HBM (a sum over w1 and w2).
The goal ratios are against max(dense chain, weight floor). Also: ``uniep.moe.prepared``'s
``moe_forward_prepared`` with w1 packed for the SwiGLU epilogue (at the default point,
separate launches; with ``overlap=fused`` named, the MegaKernel) and with fp8 experts (and the fp8
dispatch), the latter against the bf16 layer's time and output, beside ``moe_forward`` with
``dispatch=fp8`` (the same fp8 experts on the e4m3 copy of the weights it keeps: the same bits
expected), and ``uniep.moe_forward`` with ``overlap=fused`` on the plain weights (the MegaKernel
reading w1 as stored) and the same layer from its pieces without the EP runtime (``local
plan``: the local plan, a gather from x, the engine's GEMMs and ``combine_rows``; its bits
against the layer's), all interleaved with the default layer; and ``moe_backward`` (which
recomputes the experts' forward) against the dense chain's backward alone and with its forward.

The backward part (only when asked, ``--part backward``): ``moe_backward`` alone against the
dense chain's forward + backward (the layers part times it too, after everything else), beside
the MegaKernel's backward at world 1 (``uniep.moe.megakernel.backward.moe_backward_local``,
sequential and fused, with whether its bits equal ``moe_backward``'s); ``--profile N`` adds each
one's GPU time per kernel.

The tune part (only when asked, ``--part tune``): ``uniep.tune(weights="bf16_packed")`` over
``moe_forward_prepared``'s two paths (the separate launches and the MegaKernel's points), its
``--tune-candidates`` best points and the default measured; then every point it measured re-timed on
the load's inputs, interleaved with the engine's two GEMMs alone on the same rows (the fastest of
its automatic tiles and the MegaKernel's two tiles forced): the MegaKernel's goals, the tuner's pick
within 1.03x of the best re-timed point and the MegaKernel within 1.03x of the GEMMs alone.
With ``--settle-s S`` the tuner settles each point first (``uniep.tune(settle_s=S)``) and the
re-timing runs each function back to back for about S seconds first: the GPU at its power limit.

Device time is the median of CUDA events over many calls after warm-up; TFLOP/s count 2 * R * K * N.
``--profile N`` adds each layer's per-kernel GPU time (torch profiler, N calls) for the dense chain
and moe_forward with each GEMM engine.

    python bench/bench_experts.py      # on a Hopper GPU; skipped (exit 0) elsewhere
    python bench/bench_experts.py --plot RESULT.json   # the SVG of a result, again
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import (  # noqa: E402
    median_time_ms,
    profile_kernels,
    sm90_gemm_bench_args,
    sm90_kernel_missing,
    topk_routing,
    write_result,
)

# (load, tokens, hidden, ffn, experts, top-k)
LAYERS = [
    ("dsv3-ep8-rank", 4096, 7168, 2048, 32, 8),
    ("mixtral-ep4-rank", 8192, 4096, 14336, 2, 2),
    ("qwen3-30b-a3b", 4096, 2048, 768, 128, 8),
    ("dsv3-256-experts", 4096, 7168, 2048, 256, 8),
]
# Loads run only when --loads names them: one rank's share at EP4 of the issue-23 layer (64
# experts of ~512 rows), where the MegaKernel across ranks was measured.
EXTRA_LAYERS = [("dsv3-ep4-rank", 4096, 7168, 2048, 64, 8)]


def selected(loads: list[str]) -> list[tuple[str, int, int, int, int, int]]:
    """The layers a run covers: LAYERS, or those of LAYERS and EXTRA_LAYERS that --loads names."""
    if not loads:
        return LAYERS
    return [layer for layer in LAYERS + EXTRA_LAYERS if layer[0] in loads]


# The engine's compiled configurations, as tuning requests (include/uniep/cuda/grouped_gemm.hpp).
CONFIGS = [
    "tile_m=128,tile_n=256,tile_k=64",
    "tile_m=64,tile_n=128,tile_k=128",
    "tile_m=128,tile_n=128,tile_k=64",
    "tile_m=256,tile_n=128,tile_k=64",
    "tile_m=64,tile_n=256,tile_k=64,cluster=2",
    "tile_m=64,tile_n=256,tile_k=64,cluster=1",
]
LAYER_VARIANTS = [
    ("uniep", ""),
    ("uniep rank_partials", "combine=rank_partials"),
    ("torch._grouped_mm", "gemm=torch"),
    ("torch._grouped_mm rank_partials", "gemm=torch,combine=rank_partials"),
]

# The layer's other calls timed in the layer's own interleaved rounds, each reported over it.
TIMED_BESIDE_LAYER = (
    "bf16_packed", "bf16_packed_fused", "moe_forward fused", "fp8", "fp8 m64", "fp8 moe_forward",
)  # fmt: skip


def tflops(rows: int, k: int, n: int, ms: float) -> float:
    return 2.0 * rows * k * n / (ms * 1e-3) / 1e12


def bench_kernel(
    load: str,
    counts: torch.Tensor,
    k: int,
    n: int,
    warmup: int,
    iters: int,
    swiglu: bool = False,
) -> dict[str, Any]:
    experts, rows = counts.numel(), int(counts.sum())
    gen = torch.Generator(device="cuda").manual_seed(experts + k + n)
    x = torch.randn(rows, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, k, n, generator=gen, device="cuda", dtype=torch.bfloat16)
    w.mul_(k**-0.5)
    offs = counts.cumsum(0).to(device="cuda", dtype=torch.int32)
    op = torch.ops.uniep.grouped_mm
    ours = op(x, w, offs)
    theirs = torch._grouped_mm(x, w, offs=offs)
    row: dict[str, Any] = {
        "load": load,
        "E": experts,
        "R": rows,
        "K": k,
        "N": n,
        "rows_min": int(counts.min()),
        "rows_max": int(counts.max()),
        "rel_diff_uniep_vs_torch": float(
            (ours.float() - theirs.float()).norm() / theirs.float().norm()
        ),
        "bits_repeat": bool(torch.equal(op(x, w, offs), ours)),
        "bits_same_every_config": all(torch.equal(op(x, w, offs, c), ours) for c in CONFIGS),
    }
    row["torch_ms"] = median_time_ms(
        lambda: torch._grouped_mm(x, w, offs=offs), warmup, iters, cuda=True
    )
    row["uniep_ms"] = median_time_ms(lambda: op(x, w, offs), warmup, iters, cuda=True)
    for c in CONFIGS:
        row[f"uniep_ms[{c}]"] = median_time_ms(lambda c=c: op(x, w, offs, c), warmup, iters, True)
    row["best_config"] = min(CONFIGS, key=lambda c: row[f"uniep_ms[{c}]"])
    if k % 128 == 0 and n % 128 == 0:
        # The fp8 engine on the same product (rows with 1x128 scales, weights with 128x128).
        from uniep.gemm import quantize_expert_weights, quantize_rows

        xq, xs = quantize_rows(x)
        wq, ws = quantize_expert_weights(w)
        fp8 = torch.ops.uniep.grouped_mm_fp8
        got = fp8(xq, xs, wq, ws, offs).float()
        row["fp8_rel_diff_vs_bf16"] = float((got - ours.float()).norm() / ours.float().norm())
        same = True
        for c in FP8_CONFIGS:
            same &= torch.equal(fp8(xq, xs, wq, ws, offs, c).float(), got)
        row["fp8_bits_same_every_config"] = same
        # The automatic choice and each tile interleaved: fp8 GEMMs move the clock the most.
        from uniep._util.timing import interleaved_medians_ms

        fns = {c: (lambda c=c: fp8(xq, xs, wq, ws, offs, c)) for c in ["", *FP8_CONFIGS]}
        refs, refused = _cublas_fp8_references(x, w[0], k, n)
        fns.update(refs)
        fp8_ms = interleaved_medians_ms(fns, max(1, iters // 4), 4, True, warmup=warmup)
        row["fp8_ms"] = fp8_ms[""]
        row["fp8_tflops"] = tflops(rows, k, n, row["fp8_ms"])
        row["fp8_over_uniep"] = row["fp8_ms"] / row["uniep_ms"]
        for c in FP8_CONFIGS:
            row[f"fp8_ms[{c}]"] = fp8_ms[c]
        row["fp8_best_config"] = min(FP8_CONFIGS, key=lambda c: row[f"fp8_ms[{c}]"])
        for name in refs:
            row[f"{name}_ms"] = fp8_ms[name]
            row[f"{name}_tflops"] = tflops(rows, k, n, fp8_ms[name])
        if refused:
            row["cublas_fp8_blockwise_refused"] = refused
        del xq, xs, wq, ws, got
    row["torch_tflops"] = tflops(rows, k, n, row["torch_ms"])
    row["uniep_tflops"] = tflops(rows, k, n, row["uniep_ms"])
    row["uniep_over_torch"] = row["uniep_ms"] / row["torch_ms"]
    if swiglu and n % 128 == 0:
        row.update(_bench_swiglu(x, w, offs, warmup, iters))
    return row


def _cublas_fp8_references(
    x: torch.Tensor, w: torch.Tensor, k: int, n: int
) -> tuple[dict[str, Any], str]:
    """cuBLAS's fp8 GEMM (``torch._scaled_mm``) on one dense [R, k] x [k, n] matrix of the
    grouped product's FLOPs, as what this GPU reaches in fp8: per-tensor scales, and the engine's
    own format (1 x 128 row scales, 128 x 128 weight blocks) where torch takes it. Returns the
    calls by name and, where torch refused the blockwise one, its message."""
    a8 = x.to(torch.float8_e4m3fn)
    b8 = w.t().contiguous().to(torch.float8_e4m3fn)  # [n, k]: b8.t() is [k, n] column-major
    one = torch.ones((), device=x.device)
    refs: dict[str, Any] = {
        "cublas_fp8_per_tensor": lambda: torch._scaled_mm(
            a8, b8.t(), one, one, out_dtype=torch.bfloat16
        )
    }
    # Scale layouts torch asks for: A's (R, k / 128) outer-dim-major, B's (k / 128, n / 128)
    # with its transpose's rows padded to a multiple of 4 scales.
    sa = (torch.rand(k // 128, x.shape[0], device=x.device) + 0.5).t()
    padded = (k // 128 + 3) // 4 * 4
    sb = (torch.rand(n // 128, padded, device=x.device) + 0.5)[:, : k // 128].t()

    def blockwise() -> torch.Tensor:
        return torch._scaled_mm(a8, b8.t(), sa, sb, out_dtype=torch.bfloat16)

    try:
        blockwise()
    except RuntimeError as e:
        return refs, str(e).splitlines()[0][:200]
    refs["cublas_fp8_blockwise"] = blockwise
    return refs, ""


def _bench_swiglu(
    x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, warmup: int, iters: int
) -> dict[str, Any]:
    """The up projection with SwiGLU in its epilogue, w1 packed (a copy made beforehand) against
    w1 as stored (no copy), interleaved beside the plain GEMM: the same bits expected."""
    from uniep._util.timing import interleaved_medians_ms
    from uniep.gemm import grouped_mm_swiglu, grouped_mm_swiglu_plain, pack_gate_up

    packed = pack_gate_up(w1)
    tile = "tile_m=64,tile_n=256,tile_k=64,cluster="
    fns = {
        "gemm": lambda: torch.ops.uniep.grouped_mm(x, w1, offs),
        "packed": lambda: grouped_mm_swiglu(x, packed, offs),
        "plain": lambda: grouped_mm_swiglu_plain(x, w1, offs),
        # The 64 x 256 tile in each of its clusters (the automatic choice takes one by rows).
        "packed_c1": lambda: grouped_mm_swiglu(x, packed, offs, tile + "1"),
        "packed_c2": lambda: grouped_mm_swiglu(x, packed, offs, tile + "2"),
    }
    ms = interleaved_medians_ms(fns, max(1, iters // 4), 4, True, warmup=warmup)
    act = fns["packed"]()
    return {
        "swiglu_bits_plain_eq_packed": bool(torch.equal(fns["plain"](), act)),
        "swiglu_bits_same_both_clusters": all(
            torch.equal(fns[c](), act) for c in ("packed_c1", "packed_c2")
        ),
        "swiglu_packed_ms": ms["packed"],
        "swiglu_plain_ms": ms["plain"],
        "swiglu_gemm_ms": ms["gemm"],
        "swiglu_plain_over_packed": ms["plain"] / ms["packed"],
        "swiglu_c1_ms": ms["packed_c1"],
        "swiglu_c2_ms": ms["packed_c2"],
        "swiglu_c1_over_c2": ms["packed_c1"] / ms["packed_c2"],
    }


# The fp8 grouped GEMM's compiled tiles, by the tuning key that picks each.
FP8_CONFIGS = ["tile_m=128", "tile_m=64"]


def kernels(warmup: int, iters: int, loads: list[str]) -> list[dict[str, Any]]:
    rows = []
    print(
        "| grouped GEMM | E | R | K | N | rows/expert | torch ms | uniep ms (auto) | best config "
        "ms | uniep/torch | bits same across configs | fp8 ms (x uniep) | "
        + " | ".join(f"fp8 {c} ms" for c in FP8_CONFIGS)
        + " | fp8 bits same |"
    )
    print(
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|"
        + "---:|" * len(FP8_CONFIGS)
        + "---|"
    )
    nan = float("nan")
    for load, tokens, hidden, ffn, experts, top_k in selected(loads):
        idx, _ = topk_routing(tokens, experts, top_k, seed=experts)
        counts = torch.bincount(idx.flatten(), minlength=experts)
        for part, k, n in (("up", hidden, 2 * ffn), ("down", ffn, hidden)):
            r = bench_kernel(f"{load} {part}", counts, k, n, warmup, iters, part == "up")
            rows.append({"part": "kernel", **r})
            best = r[f"uniep_ms[{r['best_config']}]"]
            counts_text = f"{r['rows_min']}-{r['rows_max']}"
            print(
                f"| {r['load']} | {r['E']} | {r['R']} | {k} | {n} | {counts_text} "
                f"| {r['torch_ms']:.3f} | {r['uniep_ms']:.3f} | {best:.3f} ({r['best_config']}) "
                f"| {r['uniep_over_torch']:.3f} | {r['bits_same_every_config']} "
                f"| {r.get('fp8_ms', nan):.3f} ({r.get('fp8_over_uniep', nan):.2f}x) | "
                + " | ".join(f"{r.get(f'fp8_ms[{c}]', nan):.3f}" for c in FP8_CONFIGS)
                + f" | {r.get('fp8_bits_same_every_config')} |",
                flush=True,
            )
            if "cublas_fp8_per_tensor_tflops" in r:
                blockwise = r.get("cublas_fp8_blockwise_tflops", nan)
                print(
                    f"|   {r['load']} fp8 TFLOP/s: ours {r['fp8_tflops']:.0f}, cuBLAS on one "
                    f"dense matrix: 1x128 / 128x128 blocks {blockwise:.0f}, per-tensor "
                    f"{r['cublas_fp8_per_tensor_tflops']:.0f} |",
                    flush=True,
                )
            if "swiglu_plain_ms" in r:
                print(
                    f"|   {r['load']} with SwiGLU: w1 packed {r['swiglu_packed_ms']:.3f} ms, as "
                    f"stored {r['swiglu_plain_ms']:.3f} ms "
                    f"({r['swiglu_plain_over_packed']:.3f}x), plain GEMM "
                    f"{r['swiglu_gemm_ms']:.3f} ms; same bits: "
                    f"{r['swiglu_bits_plain_eq_packed']}; 64 x 256 in clusters of one over two "
                    f"{r['swiglu_c1_over_c2']:.3f} (same bits: "
                    f"{r['swiglu_bits_same_both_clusters']}) |",
                    flush=True,
                )
            torch.cuda.empty_cache()
    return rows


def _dense_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, ffn: int) -> torch.Tensor:
    """The experts' FLOPs with no routing: x [R, H] through one [H, 2I] matmul, SwiGLU and one
    [I, H] matmul (cuBLAS)."""
    h = x @ w1
    return (F.silu(h[:, :ffn]) * h[:, ffn:]) @ w2


def _dense_forward_backward(
    leaves: list[torch.Tensor], go: torch.Tensor, ffn: int
) -> tuple[torch.Tensor, ...]:
    """The dense chain's forward and backward: the like-for-like FLOPs of moe_backward, which
    recomputes the experts' forward."""
    with torch.enable_grad():
        return torch.autograd.grad(_dense_chain(*leaves, ffn), leaves, go)


def _backward_rank(
    rank: int, world: int, warmup: int, iters: int, loads: list[str], profile: int = 0
) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import uniep

    rows = []
    for layer in selected(loads):
        load, tokens, hidden, ffn, experts, top_k = layer
        group = dist.new_group([0])
        uniep.moe.ep.init_runtime(
            group, max_tokens=tokens, hidden=hidden, top_k=top_k, num_experts=experts
        )
        name = uniep.distributed.group_name(group)
        gen, x, w1, w2, idx, weights = _layer_inputs(layer)
        go = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        xd = torch.randn(tokens * top_k, hidden, generator=gen, device="cuda", dtype=x.dtype)
        leaves = [t.detach().requires_grad_(True) for t in (xd, w1[0].clone(), w2[0].clone())]
        go_d = torch.randn(tokens * top_k, hidden, generator=gen, device="cuda", dtype=x.dtype)

        dense_forward_backward = functools.partial(_dense_forward_backward, leaves, go_d, ffn)
        backward = functools.partial(
            torch.ops.uniep.moe_backward, go, x, idx, weights, w1, w2, name, ""
        )

        row: dict[str, Any] = {"part": "backward", "load": load, "tokens": tokens}
        # The MegaKernel's backward at world 1 (uniep.moe.megakernel.backward), w2's transposed
        # copy kept as moe_forward(overlap=fused) keeps it; its bits against moe_backward's.
        w2t = uniep.moe.megakernel.forward.transposed_w2(w2)
        engine = backward()
        fns: dict[str, Any] = {
            "dense forward+backward": dense_forward_backward,
            "moe_backward": backward,
        }
        for mode in ("sequential", "fused"):
            local = functools.partial(
                uniep.moe.megakernel.backward.moe_backward_local, go, x, idx, weights, w1, w2,
                overlap=mode, w2t=w2t, check=False,
            )  # fmt: skip
            got = local()
            uniep.moe.megakernel.launch.check_errors()
            row[f"backward_equal_engine[local_{mode}]"] = all(
                torch.equal(a, b.to(a.dtype)) for a, b in zip(got, engine, strict=True)
            )
            fns[f"local {mode}"] = local
        # Every variant timed in turn (rounds of 5 calls), so the clock's drift over the run
        # (a long layer heats the GPU) reaches all of them alike.
        from uniep._util.timing import interleaved_medians_ms

        for fn in fns.values():
            for _ in range(warmup):
                fn()
        ms = interleaved_medians_ms(fns, max(1, iters // 5), 5, True, warmup=1)
        dense = row["dense_forward_backward_ms"] = ms["dense forward+backward"]
        for key, impl in (("moe_backward", "uniep"), ("local sequential", "local_sequential"),
                          ("local fused", "local_fused")):  # fmt: skip
            row[f"backward_ms[{impl}]"] = ms[key]
            row[f"backward_over_dense_fwd_bwd[{impl}]"] = ms[key] / dense
        # Where the fused launch's time goes: each CTA's send and tiles.
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        trace = torch.zeros(4 * sms, dtype=torch.int64, device=x.device)
        uniep.moe.megakernel.backward.moe_backward_local(
            go, x, idx, weights, w1, w2, w2t=w2t, check=False, trace=trace
        )
        row["phases_us[local fused]"] = uniep.moe.megakernel.launch.trace_phases(trace)
        if profile:
            # Where each backward's time goes, kernel by kernel, against the dense chain's.
            row["kernels_us"] = profile_kernels(fns, profile, trace=_trace_paths(load))
        rows.append(row)
        del x, w1, w2, w2t, leaves, go_d
        torch.cuda.empty_cache()
    return rows


def backward_part(
    warmup: int, iters: int, loads: list[str], profile: int = 0
) -> list[dict[str, Any]]:
    import uniep

    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(12 << 30))
    full = uniep.distributed.run_local_ranks(
        _backward_rank, 1, (warmup, iters, loads, profile), backend="nccl", timeout_s=900
    )[0]
    print(
        "| layer | dense fwd+bwd ms | moe_backward ms | ratio (goal 1.15) | local sequential ms "
        "| local fused ms | fused ratio | fused bits = engine |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in full:
        print(
            f"| {r['load']} | {r['dense_forward_backward_ms']:.3f} | {r['backward_ms[uniep]']:.3f} "
            f"| {r['backward_over_dense_fwd_bwd[uniep]']:.3f} "
            f"| {r['backward_ms[local_sequential]']:.3f} | {r['backward_ms[local_fused]']:.3f} "
            f"| {r['backward_over_dense_fwd_bwd[local_fused]']:.3f} "
            f"| {r['backward_equal_engine[local_fused]']} |"
        )
    return full


def fp8_format_floor(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The MoE layer in fp32 on the fp8 path's quantized operands: each row quantized 1x128 (the
    fp8 dispatch), each weight 128x128 (``prepare_experts(..., "fp8")``) and the SwiGLU activation
    1x128 (the second GEMM's input), every product and sum in fp32. Its distance from the bf16
    layer is the error of the format alone, whatever the kernels do."""
    from uniep.gemm import (
        dequantize_expert_weights,
        dequantize_rows,
        quantize_expert_weights,
        quantize_rows,
    )

    ffn = w2.shape[1]
    xq = dequantize_rows(*quantize_rows(x))
    out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
    for e in range(w1.shape[0]):
        tokens, slot = (idx == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        w1e = dequantize_expert_weights(*quantize_expert_weights(w1[e : e + 1]))[0]
        w2e = dequantize_expert_weights(*quantize_expert_weights(w2[e : e + 1]))[0]
        h = xq[tokens] @ w1e
        act = F.silu(h[:, :ffn]) * h[:, ffn:]
        y = dequantize_rows(*quantize_rows(act)) @ w2e
        out.index_add_(0, tokens, y * weights[tokens, slot].float().unsqueeze(1))
    return out


def _layer_inputs(layer: tuple[str, int, int, int, int, int]) -> tuple[Any, ...]:
    """A load's operands on the GPU, the same in every part: (generator, x, w1, w2, topk_idx,
    topk_weights), the weights scaled so the activations stay O(1)."""
    _, tokens, hidden, ffn, experts, top_k = layer
    gen = torch.Generator(device="cuda").manual_seed(experts)
    bf16 = torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=bf16)
    w1 = torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda", dtype=bf16)
    w1.mul_(hidden**-0.5)
    w2 = torch.randn(experts, ffn, hidden, generator=gen, device="cuda", dtype=bf16)
    w2.mul_(ffn**-0.5)
    idx, weights = topk_routing(tokens, experts, top_k, seed=experts)
    return gen, x, w1, w2, idx.cuda(), weights.cuda()


def _bench_layer(
    group: Any, layer: tuple[str, int, int, int, int, int], warmup: int, iters: int, profile: int
) -> dict[str, Any]:
    import uniep

    load, tokens, hidden, ffn, experts, top_k = layer
    uniep.moe.ep.init_runtime(
        group, max_tokens=tokens, hidden=hidden, top_k=top_k, num_experts=experts
    )
    name = uniep.distributed.group_name(group)
    gen, x, w1, w2, idx, weights = _layer_inputs(layer)
    bf16 = torch.bfloat16
    xd = torch.randn(tokens * top_k, hidden, generator=gen, device="cuda", dtype=bf16)
    w1d, w2d = w1[0].clone(), w2[0].clone()

    dense = functools.partial(_dense_chain, xd, w1d, w2d, ffn)

    def weight_read() -> torch.Tensor:
        return w1.sum(dtype=torch.float32) + w2.sum(dtype=torch.float32)

    def layer_call(tuning: str) -> torch.Tensor:
        return torch.ops.uniep.moe_forward(x, idx, weights, w1, w2, name, tuning)

    go = torch.randn(tokens, hidden, generator=gen, device="cuda", dtype=bf16)

    def backward_call(tuning: str) -> tuple[torch.Tensor, ...]:
        return torch.ops.uniep.moe_backward(go, x, idx, weights, w1, w2, name, tuning)

    # The dense chain's backward alone (its graph kept), and with its forward: moe_backward
    # recomputes the experts' forward, so the second is its like-for-like FLOP count.
    leaves = [t.detach().requires_grad_(True) for t in (xd, w1d, w2d)]
    with torch.enable_grad():
        out_d = _dense_chain(*leaves, ffn)
    go_d = torch.randn_like(out_d)

    def dense_backward() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out_d, leaves, go_d, retain_graph=True)

    dense_forward_backward = functools.partial(_dense_forward_backward, leaves, go_d, ffn)

    row: dict[str, Any] = {
        "part": "layer",
        "load": load,
        "tokens": tokens,
        "hidden": hidden,
        "ffn": ffn,
        "experts": experts,
        "top_k": top_k,
        "weight_gb": (w1.numel() + w2.numel()) * 2 / 1e9,
    }

    def progress(stage: str) -> None:
        # Where the memory goes, stage by stage (the largest loads come close to 80 GB).
        gb = torch.cuda.memory_allocated() / 1e9
        peak = torch.cuda.max_memory_allocated() / 1e9
        print(f"{load}: {stage} (allocated {gb:.1f} GB, peak {peak:.1f} GB)", flush=True)

    with torch.no_grad():
        progress("inputs")
        ref = layer_call("gemm=torch").float()
        row["dense_ms"] = median_time_ms(dense, warmup, iters, cuda=True)
        row["weight_read_ms"] = median_time_ms(weight_read, warmup, iters, cuda=True)
        floor = max(row["dense_ms"], row["weight_read_ms"])
        for impl, tuning in LAYER_VARIANTS:
            out = layer_call(tuning).float()
            row[f"rel_diff[{impl}]"] = float((out - ref).norm() / ref.norm())
            ms = median_time_ms(lambda t=tuning: layer_call(t), warmup, iters, cuda=True)
            row[f"ms[{impl}]"] = ms
            row[f"over_floor[{impl}]"] = ms / floor
        # Prepared experts (uniep.moe.prepared): w1 packed for the SwiGLU epilogue, and fp8 with the
        # fp8 dispatch; each against the bf16 layer's output and time.
        from uniep.moe.prepared import moe_forward_prepared, prepare_experts

        progress("moe_forward variants")
        # bf16_packed at the default point runs the dispatch, the engine's SwiGLU-epilogue GEMMs
        # and the combine as separate launches; with overlap=fused named, the MegaKernel.
        # Those two, fp8 and the plain layer are timed interleaved (the GPU's clock drifts over
        # a run), then the MegaKernel's own points (_bench_local).
        from uniep._util.timing import interleaved_medians_ms

        packed = prepare_experts(w1, w2, "bf16_packed")
        fp8 = prepare_experts(w1, w2, "fp8")
        prepared_variants = {
            "bf16_packed": (packed, ""),
            "bf16_packed_fused": (packed, "overlap=fused"),
            "fp8": (fp8, "dispatch=fp8"),
            "fp8 m64": (fp8, "dispatch=fp8,tile_m=64"),
        }
        calls = {
            variant: (lambda p=p, t=t: moe_forward_prepared(x, idx, weights, p, group, t))
            for variant, (p, t) in prepared_variants.items()
        }
        # The plain layer with dispatch=fp8: fp8 experts on the e4m3 copy of w1 and w2 it keeps
        # (made by the first call, outside the timing).
        calls["fp8 moe_forward"] = lambda: layer_call("dispatch=fp8")
        for variant, call in calls.items():
            out = call().float()
            row[f"rel_diff[{variant}]"] = float((out - ref).norm() / ref.norm())
            del out
        row["fp8_moe_forward_equals_prepared"] = bool(
            torch.equal(calls["fp8 moe_forward"](), calls["fp8"]())
        )
        # What e4m3 itself costs on these operands: the same quantizations (rows 1x128, weights
        # 128x128, the activation 1x128) with every product and sum in fp32.
        emulated = fp8_format_floor(x, idx, weights, w1, w2)
        row["rel_diff[fp8 format floor]"] = float((emulated - ref).norm() / ref.norm())
        row["fp8_error_over_format_floor"] = (
            row["rel_diff[fp8]"] / row["rel_diff[fp8 format floor]"]
        )
        del emulated
        # uniep.moe_forward with overlap=fused on the plain weights: the MegaKernel reading w1 as
        # stored where the FFN size allows it (no packed copy to remake after a weight update).
        calls["moe_forward fused"] = lambda: uniep.moe_forward(
            x, idx, weights, w1, w2, group, tuning="overlap=fused"
        )
        row["fused_moe_forward_equals_layer"] = bool(
            torch.equal(calls["moe_forward fused"](), layer_call(""))
        )
        # The dense chain among them too: its ratio to the layer from one clock; and the engine's
        # two GEMMs alone on rows gathered beforehand (what the layer adds around them).
        gemm_only = _gemms_alone(x, idx, packed)[3]
        # The fp8 layers among them as well: timed apart, after the bf16 rounds, their ratio to
        # the bf16 layer moved with the clock (the same fp8 call 4.8 and 5.9 ms in one run).
        side = {"dense": dense, "gemm_only": gemm_only, "uniep": lambda: layer_call("")} | {
            v: calls[v] for v in TIMED_BESIDE_LAYER
        }
        side["local plan"] = _local_plan_layer(x, idx, weights, w1, w2)
        row["local_plan_equals_layer"] = bool(torch.equal(side["local plan"](), layer_call("")))
        # The engine's tiles in clusters of two along M wherever they were compiled so (the
        # automatic choice before clusters of one for experts of at most 256 rows).
        side["uniep cluster=2"] = lambda: layer_call("cluster=2")
        row["cluster2_equals_layer"] = bool(torch.equal(side["uniep cluster=2"](), layer_call("")))
        for fn in side.values():
            for _ in range(warmup):
                fn()
        side_ms = interleaved_medians_ms(side, max(1, iters // 5), 5, True, warmup=1)
        row["ms_interleaved[uniep]"] = side_ms["uniep"]
        row["dense_ms_interleaved"] = side_ms["dense"]
        row["gemm_only_ms_interleaved"] = side_ms["gemm_only"]
        row["ms_interleaved[uniep cluster=2]"] = side_ms["uniep cluster=2"]
        row["auto_over_cluster2_interleaved"] = side_ms["uniep"] / side_ms["uniep cluster=2"]
        row["local_plan_over_layer_interleaved"] = side_ms["local plan"] / side_ms["uniep"]
        for v in ("uniep", "bf16_packed", "bf16_packed_fused", "moe_forward fused", "local plan"):
            # max(dense, weight read) with the dense chain from the same rounds.
            floor_i = max(side_ms["dense"], row["weight_read_ms"])
            row[f"over_floor_interleaved[{v}]"] = side_ms[v] / floor_i
            row[f"over_gemm_only_interleaved[{v}]"] = side_ms[v] / side_ms["gemm_only"]
        del gemm_only
        for variant in TIMED_BESIDE_LAYER:
            # Against the layer timed in the same rounds.
            ms = side_ms[variant]
            row[f"ms[{variant}]"] = ms
            row[f"over_bf16_layer[{variant}]"] = ms / side_ms["uniep"]
            row[f"over_floor[{variant}]"] = ms / floor
        progress("prepared")
        _bench_local(row, x, idx, weights, packed, ref, warmup, iters)
        del packed, fp8, calls, side
        torch.cuda.empty_cache()
        progress("local")
        row["dense_backward_ms"] = median_time_ms(dense_backward, warmup, iters, cuda=True)
        row["dense_forward_backward_ms"] = median_time_ms(
            dense_forward_backward, warmup, iters, cuda=True
        )
        for impl, tuning in LAYER_VARIANTS[:3:2]:
            ms = median_time_ms(lambda t=tuning: backward_call(t), warmup, iters, cuda=True)
            row[f"backward_ms[{impl}]"] = ms
            row[f"backward_over_dense_fwd_bwd[{impl}]"] = ms / row["dense_forward_backward_ms"]
        # The backward beside itself with cluster=2 (the data gradient's small-expert tile in
        # clusters of two, as before clusters of one), interleaved.
        bw = {"auto": lambda: backward_call(""), "cluster=2": lambda: backward_call("cluster=2")}
        row["backward_cluster2_same_bits"] = all(
            torch.equal(a, b) for a, b in zip(bw["auto"](), bw["cluster=2"](), strict=True)
        )
        bw_ms = interleaved_medians_ms(bw, max(1, iters // 4), 4, True, warmup=warmup)
        row["backward_auto_over_cluster2_interleaved"] = bw_ms["auto"] / bw_ms["cluster=2"]
        progress("backward")
        if profile:
            fns = {"dense": dense} | {
                impl: lambda t=tuning: layer_call(t) for impl, tuning in LAYER_VARIANTS[:3:2]
            }
            fns["dense forward+backward"] = dense_forward_backward
            fns["moe_backward uniep"] = lambda: backward_call("")
            prepared8 = prepare_experts(w1, w2, "fp8")
            fns["fp8 prepared"] = lambda: moe_forward_prepared(
                x, idx, weights, prepared8, group, "dispatch=fp8"
            )
            fns["fp8 moe_forward"] = lambda: layer_call("dispatch=fp8")
            # uniep.moe_forward (the op runs the separate launches in every mode).
            fns["moe_forward fused"] = lambda: uniep.moe_forward(
                x, idx, weights, w1, w2, group, tuning="overlap=fused"
            )
            row["kernels_us"] = profile_kernels(fns, profile, trace=_trace_paths(load))
    return row


# The fused MoE kernel's tuning points timed at world 1: (CTAs that send first, rounds of tiles
# the others take before they join; -1 = the launch's bandwidth model). 10000 CTAs: every CTA
# sends its share before it computes.
FUSED_POINTS = [(16, -1), (8, -1), (32, -1), (16, 0), (16, 4), (16, 16), (10000, 0)]
# The same with the 64-row (ping-pong) tiles, at the points that were best with 128 rows.
FUSED_POINTS_64 = [(16, -1), (32, -1), (16, 16), (10000, 0)]


def _gemms_alone(x: torch.Tensor, idx: torch.Tensor, prepared: Any) -> tuple[Any, ...]:
    """The routed rows gathered beforehand in the kernel's row order, their per-expert offsets,
    each entry's row (``[T, K]``, -1: unused) and ``gemm_only(tiles="")``: the engine's two GEMMs
    alone on them (SwiGLU epilogue, then the down projection), the reference of the
    MegaKernel's 1.03x goal."""
    from uniep.moe import tile_gates as gate
    from uniep.moe.megakernel.launch import expert_counts

    experts = prepared.w1.shape[0]
    counts = expert_counts(idx, experts)
    dest, grow, _, _ = gate.sender_rows(idx, counts.view(1, experts), 0)
    offs = counts.cumsum(0).to(torch.int32)
    used = dest >= 0
    rows = torch.zeros(int(counts.sum()), x.shape[1], dtype=x.dtype, device=x.device)
    rows[grow[used]] = x.unsqueeze(1).expand(-1, idx.shape[1], -1)[used]

    def gemm_only(tiles: str = "") -> torch.Tensor:
        act = torch.ops.uniep.grouped_mm_swiglu(rows, prepared.w1, offs, tiles)
        return torch.ops.uniep.grouped_mm(act, prepared.w2, offs, tiles)

    return rows, offs, grow, gemm_only


def _gemms_combine(gemm_only: Any, grow: torch.Tensor, weights: torch.Tensor) -> Any:
    """The engine's two GEMMs, then the combine of their output rows: the least any world-1
    forward does with a free plan and dispatch. A token's k rows come from k experts' tiles spread
    over all of GEMM 2, so summing them reads them back from memory after GEMM 2 wrote them,
    fused or not: at the power cap this pair's time, not the GEMMs' alone, is the floor."""
    from uniep.moe import tile_gates as gate

    def gemms_combine() -> torch.Tensor:
        return gate.combine_rows(gemm_only(), grow, weights, check=False)[0]

    return gemms_combine


def _local_plan_layer(
    x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> Any:
    """The world-1 layer from its pieces without the EP runtime: ``local_plan`` (every expert's
    rows in (token, k) order, no count read by the host), each GEMM row's token gathered from x,
    the engine's two GEMMs (w1 as stored where the FFN size allows, as ``moe_forward``), and
    ``combine_rows`` (the per-k combine's arithmetic): ``moe_forward``'s bits expected. What a
    world-1 path of ``moe_forward`` that skips the dispatch's notify, transfer and self-row
    kernels and its host sync would take."""
    from uniep.gemm import pack_gate_up

    ops = torch.ops.uniep
    tokens, top_k = idx.shape
    experts, ffn = w1.shape[0], w1.shape[2] // 2
    slots = tokens * top_k
    token = torch.arange(tokens, device=x.device).unsqueeze(1).expand(tokens, top_k).reshape(-1)
    plain = ffn % 64 == 0
    w1_used = w1 if plain else pack_gate_up(w1)

    def layer() -> torch.Tensor:
        _, offs, _, _, gemm_row, _, _ = ops.local_plan(idx, experts, 128)
        # Entries with no row write a spare slot past the rows.
        row_token = torch.zeros(slots + 1, dtype=torch.int64, device=x.device)
        row_token.scatter_(0, torch.where(gemm_row >= 0, gemm_row, slots).view(-1), token)
        rows = x.index_select(0, row_token[:slots])
        swiglu = ops.grouped_mm_swiglu_plain if plain else ops.grouped_mm_swiglu
        y = ops.grouped_mm(swiglu(rows, w1_used, offs, ""), w2, offs, "")
        return ops.combine_rows(y, gemm_row, weights, report=False)[0]

    return layer


def _gated_gemms(rows: torch.Tensor, offs: torch.Tensor, prepared: Any) -> Any:
    """The two gated GEMMs of the sequential path on ``rows`` (gathered beforehand, per-expert
    ends ``offs``), gates open and GEMM 2 waiting on GEMM 1's done signal: the GEMMs' share of
    ``sequential``, and the price of the signal. The call returns GEMM 2's output."""
    from uniep.moe import tile_gates as gate

    experts, ffn2 = prepared.w1.shape[0], prepared.w1.shape[2]
    zeros = torch.zeros(rows.shape[0] // gate.TILE_M + experts + 1, dtype=torch.int32,
                        device=rows.device)  # fmt: skip
    base = gate.tile_base(offs, rows.shape[0])
    act = rows.new_empty(rows.shape[0], ffn2 // 2)
    y = torch.empty_like(rows)

    def gated_gemms() -> torch.Tensor:
        done = torch.zeros_like(zeros)
        gate.grouped_mm_gated(rows, prepared.w1, offs, zeros, base, per_row=0, swiglu=True,
                              done=done, out=act)  # fmt: skip
        gate.grouped_mm_gated(act, prepared.w2, offs, done, base, per_row=0,
                              per_tile=gate.done_per_tile(ffn2), out=y)  # fmt: skip
        return y

    return gated_gemms


def _bench_local(
    row: dict[str, Any],
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    prepared: Any,
    ref: torch.Tensor | None,
    warmup: int,
    iters: int,
    profile: int = 0,
) -> None:
    """The MegaKernel at world 1 (uniep.moe.megakernel.launch.moe_forward_local: no host sync; its
    sequential and streams compositions and the fused persistent kernel at FUSED_POINTS) beside
    the GEMMs alone on rows gathered beforehand: the MegaKernel's goal is the fused forward
    within 1.03x of that GEMM-only time."""
    from uniep.moe.megakernel.launch import moe_forward_local, trace_phases

    rows, offs, grow, gemm_only = _gemms_alone(x, idx, prepared)

    # The engine's 64 x 256 ping-pong tiles forced (its automatic choice may be the 128-row
    # ones): the fused kernel has both, so its ratio is also given over the faster GEMMs.
    def gemm_only_m64() -> torch.Tensor:
        return gemm_only("tile_m=64,tile_n=256,tile_k=64")

    points: list[tuple[str, dict[str, Any]]] = [
        ("sequential", {"overlap": "sequential"}),
        ("streams", {"overlap": "streams"}),
    ]
    # The defaults (every CTA sends, fused_tile_m's tile), then the tuning points.
    points.append(("fused default", {"overlap": "fused"}))
    points += [
        (
            f"fused c{comm} s{skip}",
            {"overlap": "fused", "comm_sms": comm, "skip_rounds": skip, "tile_m": 128},
        )
        for comm, skip in FUSED_POINTS
    ]
    # The 64-row tiles, 256 wide in clusters of two; then the decode shape (64 x 128 in
    # clusters of one) on these prefill loads: no expert rounded up to a cluster's two tiles,
    # but each weight tile loaded once per m-tile instead of once per pair.
    for label, tile_n in (("m64", 256), ("m64 n128", 128)):
        points += [
            (
                f"fused c{comm} s{skip} {label}",
                {
                    "overlap": "fused",
                    "comm_sms": comm,
                    "skip_rounds": skip,
                    "tile_m": 64,
                    "tile_n": tile_n,
                },
            )
            for comm, skip in FUSED_POINTS_64
        ]
    # The two gated GEMMs of the sequential path on the same rows, gates open and GEMM 2 waiting
    # on GEMM 1's done signal: the GEMMs' share of `sequential`, and the price of the signal.
    fns: dict[str, Any] = {
        "gemm_only": gemm_only,
        "gemm_only_m64": gemm_only_m64,
        "gated_gemms": _gated_gemms(rows, offs, prepared),
        "gemms_combine": _gemms_combine(gemm_only, grow, weights),
    }
    seq = None
    fused_equal = True
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for name, kwargs in points:

        def local(kw: dict[str, Any] = kwargs, check: bool = False) -> torch.Tensor:
            return moe_forward_local(x, idx, weights, prepared.w1, prepared.w2, check=check, **kw)

        key = f"local {name}"
        try:
            out = local(check=True)
        except (RuntimeError, ValueError, TimeoutError) as e:
            row[f"error[{key}]"] = f"{type(e).__name__}: {e}"
            print(f"{row['load']}: {key} failed: {row[f'error[{key}]']}", flush=True)
            fused_equal = fused_equal and kwargs["overlap"] != "fused"
            continue
        if seq is None:
            seq = out
        elif kwargs["overlap"] == "fused":
            fused_equal = fused_equal and torch.equal(out, seq)
        if ref is not None:
            row[f"rel_diff[{key}]"] = float((out.float() - ref).norm() / ref.norm())
        del out
        fns[key] = local
        if kwargs["overlap"] == "fused":
            # Where the time goes inside the launch: each CTA's send, tiles and reduce.
            trace = torch.zeros(6 * sms, dtype=torch.int64, device=x.device)
            local(dict(kwargs, trace=trace))
            row[f"phases_us[{key}]"] = trace_phases(trace, sms)
    # Every variant timed in turn (rounds of 5 calls, the host not waiting between calls, as in
    # a training step), so the GPU's clock drift over the run reaches all of them alike.
    from uniep._util.timing import interleaved_medians_ms

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ms = interleaved_medians_ms(fns, max(1, iters // 5), 5, True, warmup=1)
    row["gemm_only_ms"] = ms.pop("gemm_only")
    row["gemm_only_m64_ms"] = ms.pop("gemm_only_m64")
    row["gated_gemms_ms"] = ms.pop("gated_gemms")
    row["gemms_combine_ms"] = ms.pop("gemms_combine")
    row["gemms_combine_over_gemm_only"] = row["gemms_combine_ms"] / row["gemm_only_ms"]
    fastest_gemms = min(row["gemm_only_ms"], row["gemm_only_m64_ms"])
    best = None
    for key, t in ms.items():
        row[f"ms[{key}]"] = t
        row[f"over_gemm_only[{key}]"] = t / row["gemm_only_ms"]
        if "fused" in key and (best is None or t < ms[best]):
            best = key
    row["fused_bits_equal_sequential"] = fused_equal
    if best is not None:
        row["fused_best_point"] = best[len("local ") :]
        row["ms[local fused]"] = ms[best]
        row["over_gemm_only[local fused]"] = ms[best] / row["gemm_only_ms"]
        row["over_fastest_gemms[local fused]"] = ms[best] / fastest_gemms
    if profile:
        # Per-kernel GPU time: what runs around the fused launch, against the event time.
        picks = {k: fns[k] for k in ("gemm_only", "local sequential", best) if k in fns}
        row["kernels_us_local"] = profile_kernels(picks, profile, trace=_trace_paths(row["load"]))


def _local_rank(warmup: int, iters: int, loads: list[str], profile: int) -> list[dict[str, Any]]:
    """The ``local`` part: only the world-1 MegaKernel rows of each load (no EP runtime)."""
    from uniep.moe.prepared import prepare_experts

    rows = []
    for load, tokens, hidden, ffn, experts, top_k in selected(loads):
        _, x, w1, w2, idx, weights = _layer_inputs((load, tokens, hidden, ffn, experts, top_k))
        prepared = prepare_experts(w1, w2, "bf16_packed")
        del w1
        row: dict[str, Any] = {"part": "local", "load": load, "tokens": tokens, "hidden": hidden,
                               "ffn": ffn, "experts": experts, "top_k": top_k}  # fmt: skip
        with torch.no_grad():
            _bench_local(row, x, idx.cuda(), weights.cuda(), prepared, None, warmup, iters, profile)
        for variant, kernels_us in row.get("kernels_us_local", {}).items():
            top = ", ".join(f"{k} {v:.0f}" for k, v in list(kernels_us.items())[:10])
            print(f"{load} / {variant}: us per call: {top}", flush=True)
        print(
            f"{load}: GEMMs alone {row['gemm_only_ms']:.3f} ms; "
            f"GEMMs then combine {row['gemms_combine_over_gemm_only']:.3f}x; "
            + ", ".join(
                f"{k[len('over_gemm_only[') : -1]} {v:.3f}x"
                for k, v in row.items()
                if k.startswith("over_gemm_only[")
            ),
            flush=True,
        )
        rows.append(row)
        del x, w2, prepared
        torch.cuda.empty_cache()
    return rows


# The tuner's acceptance: its pick within 3% of the best point it measured, re-timed.
GOAL_TUNE = 1.03


def _tune_rank(
    rank: int, world: int, warmup: int, iters: int, loads: list[str], candidates: int,
    settle_s: float = 0.0,
) -> list[dict[str, Any]]:  # fmt: skip
    """The ``tune`` part, on one rank: :func:`_tune_load` per load."""
    import torch.distributed as dist

    out = []
    for layer in selected(loads):
        # A group per load: the EP runtime a group creates keeps its top_k and sizes.
        out.append(_tune_load(dist.new_group([0]), layer, warmup, iters, candidates, settle_s))
        torch.cuda.empty_cache()
    return out


def _tune_load(
    group: Any, layer: tuple[str, int, int, int, int, int], warmup: int, iters: int,
    candidates: int, settle_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    """``uniep.tune(weights="bf16_packed")`` (cache off) over moe_forward_prepared's two paths,
    then every point it measured re-timed on the load's own inputs, interleaved with the
    engine's GEMMs alone on the same rows. With ``settle_s`` the tuner settles each candidate
    (``uniep.tune(settle_s=)``) and each re-timed function first runs back to back for about
    as long (a call count from the tuner's median time)."""
    from uniep._util.timing import interleaved_medians_ms
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts
    from uniep.tuning import tuner as tune

    load, tokens, hidden, ffn, experts, top_k = layer
    result = tune.tune(
        group, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
        dtype=torch.bfloat16, device="cuda", candidates=candidates, warmup=warmup, iters=iters,
        cache=False, weights="bf16_packed", settle_s=settle_s,
    )  # fmt: skip
    torch.cuda.empty_cache()
    _, x, w1, w2, idx, weights = _layer_inputs(layer)
    packed = prepare_experts(w1, w2, "bf16_packed")
    del w1, w2
    points = [c.tuning for c in result.candidates if c.measured_ms < float("inf")]
    fns = {p: (lambda p=p: moe_forward_prepared(x, idx, weights, packed, group, p)) for p in points}
    # The engine's GEMMs alone with its automatic tiles and with each of the two tiles the
    # MegaKernel has forced: the reference is the fastest of the three.
    gemm_only = _gemms_alone(x, idx, packed)[3]
    gemm_tiles = {"auto": "", "128x256": "tile_m=128,tile_n=256,tile_k=64"}
    gemm_tiles["64x256"] = "tile_m=64,tile_n=256,tile_k=64"
    for name, tiles in gemm_tiles.items():
        fns[f"gemms alone {name}"] = lambda t=tiles: gemm_only(t)
    with torch.no_grad():
        first = fns[points[0]]()
        same = all(torch.equal(fns[p](), first) for p in points[1:])
        del first
        finite = [c.measured_ms for c in result.candidates if c.measured_ms < float("inf")]
        settle = tune.settle_calls(settle_s, [statistics.median(finite)])[0] if finite else 0
        again = interleaved_medians_ms(fns, 3, max(3, iters // 3), True, warmup=max(warmup, settle))
    gemm_each = {name: again.pop(f"gemms alone {name}") for name in gemm_tiles}
    gemm_ms = min(gemm_each.values())
    best = min(again, key=again.__getitem__)
    fused = [again[p] for p in again if "overlap=fused" in p]
    pick = again[result.tuning]
    row: dict[str, Any] = {
        "part": "tune", "load": load, "tokens": tokens, "hidden": hidden, "ffn": ffn,
        "experts": experts, "top_k": top_k, "pick": result.tuning, "default": result.default,
        "considered": result.considered, "table": result.table(),
        "tuner_ms": {c.tuning: c.measured_ms for c in result.candidates},
        "retimed_ms": again, "gemm_only_ms": gemm_ms, "gemm_only_ms_by_tiles": gemm_each,
        "bits_equal_across_points": same,
        "best_retimed": best, "pick_over_best": pick / again[best],
        "pick_over_gemm_only": pick / gemm_ms,
        "best_fused_over_gemm_only": min(fused) / gemm_ms if fused else None,
        "goal_tune": GOAL_TUNE, "goal_fused": 1.03, "settle_s": settle_s,
    }  # fmt: skip
    row["tune_goal_met"] = row["pick_over_best"] <= GOAL_TUNE
    print(result.table(), flush=True)
    print(
        f"{load}: pick {tune._label(result.tuning, result.default)} {pick:.3f} ms, best "
        f"re-timed {again[best]:.3f} ms ({row['pick_over_best']:.3f}x, goal {GOAL_TUNE}); GEMMs "
        f"alone {gemm_ms:.3f} ms, pick {row['pick_over_gemm_only']:.3f}x; bits equal: {same}",
        flush=True,
    )
    return row


def tune_part(
    warmup: int, iters: int, loads: list[str], candidates: int, settle_s: float = 0.0
) -> list[dict[str, Any]]:
    import uniep

    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(12 << 30))
    return uniep.distributed.run_local_ranks(
        _tune_rank,
        1,
        (warmup, iters, loads, candidates, settle_s),
        backend="nccl",
        timeout_s=1800,
    )[0]


def _trace_paths(load: str) -> Any:
    """--trace VARIANT / --trace-dir, passed to the spawned rank through the environment."""
    names = [v for v in os.environ.get("UNIEP_BENCH_TRACE", "").split(",") if v]
    directory = os.environ.get("UNIEP_BENCH_TRACE_DIR", "")

    def path(variant: str) -> str | None:
        if variant not in names or not directory:
            return None
        name = variant.replace(" ", "_").replace("+", "_").replace("/", "_")
        return os.path.join(directory, f"{load}-{name}.json")

    return path


def _layer_rank(
    rank: int, world: int, warmup: int, iters: int, profile: int, loads: list[str]
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    rows = []
    for layer in selected(loads):
        rows.append(_bench_layer(dist.new_group([0]), layer, warmup, iters, profile))
        torch.cuda.empty_cache()
    return rows


def layers(warmup: int, iters: int, profile: int, loads: list[str]) -> list[dict[str, Any]]:
    import uniep

    # One process, one rank; NVSHMEM's heap (sized once per process) holds every load's runtime.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(12 << 30))
    rows = uniep.distributed.run_local_ranks(
        _layer_rank, 1, (warmup, iters, profile, loads), backend="nccl", timeout_s=900
    )[0]
    print()
    names = [impl for impl, _ in LAYER_VARIANTS]
    print(
        "| layer | dense ms | weight read ms | "
        + " | ".join(f"{n} ms (x floor)" for n in names)
        + " |"
    )
    print("|---|---:|---:|" + "---:|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[f'ms[{n}]']:.3f} ({r[f'over_floor[{n}]']:.2f}x)" for n in names)
        print(f"| {r['load']} | {r['dense_ms']:.3f} | {r['weight_read_ms']:.3f} | {cells} |")
    print()
    print(
        "| layer | dense ms, interleaved | GEMMs alone ms | uniep ms, interleaved (x floor, x "
        "GEMMs) | moe_forward overlap=fused ms (x floor, x GEMMs) | same bits | prepared "
        "bf16_packed ms | prepared overlap=fused ms |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        fused = r["ms[moe_forward fused]"]
        u, f = "uniep", "moe_forward fused"
        print(
            f"| {r['load']} | {r['dense_ms_interleaved']:.3f} "
            f"| {r['gemm_only_ms_interleaved']:.3f} "
            f"| {r['ms_interleaved[uniep]']:.3f} ({r[f'over_floor_interleaved[{u}]']:.3f}x, "
            f"{r[f'over_gemm_only_interleaved[{u}]']:.3f}x) | {fused:.3f} "
            f"({r[f'over_floor_interleaved[{f}]']:.3f}x, "
            f"{r[f'over_gemm_only_interleaved[{f}]']:.3f}x) "
            f"| {r['fused_moe_forward_equals_layer']} | {r['ms[bf16_packed]']:.3f} "
            f"| {r['ms[bf16_packed_fused]']:.3f} |"
        )
    for r in rows:
        print(
            f"{r['load']}: moe_forward over the same with tuning cluster=2, interleaved: "
            f"{r['auto_over_cluster2_interleaved']:.3f} (same bits: {r['cluster2_equals_layer']}); "
            f"moe_backward: {r['backward_auto_over_cluster2_interleaved']:.3f} (same bits: "
            f"{r['backward_cluster2_same_bits']}); the local plan's pieces over moe_forward: "
            f"{r['local_plan_over_layer_interleaved']:.3f} (same bits: "
            f"{r['local_plan_equals_layer']})"
        )
    print()
    print(
        "| layer | dense bwd ms | dense fwd+bwd ms | moe_backward uniep ms (x fwd+bwd) | torch ms |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        u, t = "uniep", "torch._grouped_mm"
        print(
            f"| {r['load']} | {r['dense_backward_ms']:.3f} | {r['dense_forward_backward_ms']:.3f} "
            f"| {r[f'backward_ms[{u}]']:.3f} ({r[f'backward_over_dense_fwd_bwd[{u}]']:.2f}x) "
            f"| {r[f'backward_ms[{t}]']:.3f} |"
        )
    print()
    print(
        "| layer | fp8 / bf16 layer | fp8 tile_m=64 / bf16 layer | moe_forward dispatch=fp8 "
        "/ bf16 layer (same bits) | fp8 rel. error | e4m3 format floor | error / floor |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['load']} | {r['over_bf16_layer[fp8]']:.3f} "
            f"| {r['over_bf16_layer[fp8 m64]']:.3f} "
            f"| {r['over_bf16_layer[fp8 moe_forward]']:.3f} "
            f"({r['fp8_moe_forward_equals_prepared']}) | {r['rel_diff[fp8]']:.4f} "
            f"| {r['rel_diff[fp8 format floor]']:.4f} | {r['fp8_error_over_format_floor']:.3f} |"
        )
    for r in rows:
        for variant, kernels_us in r.get("kernels_us", {}).items():
            top = ", ".join(f"{k} {v:.0f}" for k, v in list(kernels_us.items())[:8])
            print(f"{r['load']} / {variant}: us per call: {top}")
    return rows


# Goals of the expert GEMM engine issue, as ratios: layer time over max(dense chain, weight read)
# per load, the fp8 layer over the bf16 layer, the backward over the dense chain's.
GOALS = {
    "dsv3-ep8-rank": 1.10,
    "mixtral-ep4-rank": 1.05,
    "qwen3-30b-a3b": 1.15,
    "dsv3-256-experts": 1.15,
}
FP8_GOAL, BACKWARD_GOAL = 0.6, 1.15


def plot_layers(result_path: str | Path) -> Path:
    """An SVG beside a bench_experts JSON: per load (x = its number in LAYERS order), the
    forward variants over their floor with the goals, fp8 over bf16, and the backward over the
    dense chain's forward + backward."""
    import json

    from plot_svg import Panel, Series, render_svg

    payload = json.loads(Path(result_path).read_text())
    rows = [r for r in payload["rows"] if r.get("part") == "layer"]
    xs = [float(i + 1) for i in range(len(rows))]
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]

    def series(label: str, key: str, color: str, dashed: bool = False) -> Series:
        return Series(label, xs, [r.get(key) for r in rows], color, dashed)

    forward = [
        series(f"{impl}", f"over_floor[{impl}]", colors[i])
        for i, (impl, _) in enumerate(LAYER_VARIANTS)
    ] + [series("bf16_packed", "over_floor[bf16_packed]", colors[4])]
    forward.append(Series("goal", xs, [GOALS.get(r["load"]) for r in rows], "#000000", True))
    fp8 = [
        series("fp8 layer / bf16 layer", "over_bf16_layer[fp8]", colors[5]),
        Series("fp8 goal", xs, [FP8_GOAL] * len(rows), "#000000", True),
    ]
    backward = [
        series(
            "moe_backward (engine) / dense fwd+bwd", "backward_over_dense_fwd_bwd[uniep]", colors[0]
        ),
        Series("backward goal", xs, [BACKWARD_GOAL] * len(rows), "#000000", True),
    ]
    loads = ", ".join(f"{i + 1}={r['load']}" for i, r in enumerate(rows))
    panels = [
        Panel("moe_forward / max(dense, weight read)", forward, "load", "ratio"),
        Panel("fp8", fp8, "load", "ratio"),
        Panel("backward", backward, "load", "ratio"),
    ]
    env = payload.get("env", {})
    title = f"bench_experts on {env.get('device', '?')} ({env.get('commit', '?')}): {loads}"
    out = Path(result_path).with_suffix(".svg")
    out.write_text(render_svg(panels, title, columns=3, log_x=False, log_y=False))
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--plot":
        print(f"wrote {plot_layers(argv[1])}")
        return 0
    args = sm90_gemm_bench_args(
        __doc__.splitlines()[0],
        argv,
        profile=True,
        parts=("kernels", "layers", "local", "tune", "backward"),
        trace=True,
        tune=True,
    )
    if args.trace and args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        os.environ["UNIEP_BENCH_TRACE"] = ",".join(args.trace)
        os.environ["UNIEP_BENCH_TRACE_DIR"] = args.trace_dir
    if sm90_kernel_missing("bench_experts", "uniep::grouped_mm"):
        return 0
    loads = [name for name in args.loads.split(",") if name] if args.loads else []
    known = [layer[0] for layer in LAYERS + EXTRA_LAYERS]
    unknown = sorted(set(loads) - set(known))
    if unknown:
        print(f"bench_experts: unknown --loads {unknown}; known: {known}")
        return 2
    rows = kernels(args.warmup, args.iters, loads) if args.part in ("kernels", "all") else []
    if args.part == "kernels":
        pass
    elif args.part == "local":
        rows += _local_rank(args.warmup, args.iters, loads, args.profile)
    elif args.part == "tune":
        rows += tune_part(args.warmup, args.iters, loads, args.tune_candidates, args.settle_s)
    elif args.part == "backward":
        rows += backward_part(args.warmup, args.iters, loads, args.profile)
    elif torch._C._dispatch_has_kernel_for_dispatch_key("uniep::moe_forward", "CUDA"):
        rows += layers(args.warmup, args.iters, args.profile, loads)
    else:
        print("bench_experts: layer part skipped (this build has no CUDA moe_forward)")
    path = write_result("bench_experts", rows, args.out_dir)
    print(f"wrote {path}")
    if any(r.get("part") == "layer" for r in rows):
        print(f"wrote {plot_layers(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
