"""fp8 prepared experts on one rank (CUDA): the layer as launches that never wait for the host,
so that a CUDA graph captures it (an inference server's decode step). ``moe_forward_prepared``
takes it inside a capture and for large eager batches (:func:`takes_local_path`).

The path through the dispatch (``ep_dispatch``, the fp8 GEMMs, ``ep_combine``) sizes its receive
buffer from the rows that arrived, a host read of a device count that no graph can hold. At world
1 the rows need no exchange: the routing's plan (``local_plan``: every expert's rows in
``(token, k)`` order, as the dispatch at world 1 lays them out) says where each token's copy
goes, the buffer holds ``T x K`` rows whatever the routing (those past the last expert's end are
neither computed nor read), and:

1. ``local_plan``: counts, the GEMM's row ends and each entry's row (one launch up to 4,096
   entries);
2. ``quantize_fp8_rows``: each token in the fp8 dispatch's own encoding (1 x 128 scales),
   quantized once and stored at each of its entries' rows, in one launch;
3. the two fp8 grouped GEMMs on the device's row ends, the first with SwiGLU in its epilogue
   (``grouped_mm_fp8_swiglu`` on w1 packed by ``pack_gate_up_fp8``), the activation quantized
   for the second by ``quantize_fp8``;
4. ``combine_rows``: the per-k combine's arithmetic (ascending k, fp32, one rounding).

The plan's error word covers every step after it: steps 2 and 4 take the plan's rows and fill
no word of their own (``report=False``), so the step launches no fill for them.

The same rows in the same order, the same GEMMs and the combine's arithmetic: the bits of the
dispatch's path. A bad expert id or a row past the GEMM's output is reported as the MegaKernel
reports it (``check``: ``uniep.moe.megakernel.launch``'s ``True``, ``False`` or ``"deferred"``,
which inside a CUDA graph keeps the first error of any replay on the device until
``check_errors()`` reads it).
"""

from __future__ import annotations

import torch

from .tile_gates import TILE_M

__all__ = ["EAGER_MIN_ROWS", "keep_graph_errors", "moe_forward_fp8_local", "takes_local_path"]

# The error word's name (what check_errors() says failed).
_PLAN = "moe_forward_prepared (fp8 plan)"

# Rows (tokens x top-k) from which an eager call takes this path rather than the dispatch's. Its
# dozen launches cost the host more than the dispatch's few: on one H200 (2026-12-02, 64c357b)
# the eager call took 1.95x the dispatch path's time at 1 token on 128 experts of FFN 768 and
# 1.11x at 512 tokens, but 0.89x at 4,096 tokens (0.97x on 256 experts of FFN 2048), while a CUDA
# graph of it replayed in 0.59-0.61x the bf16 MegaKernel's graph from 16 tokens on the latter
# (bench_decode at 38495ce).
EAGER_MIN_ROWS = 8192


def takes_local_path(rows: int) -> bool:
    """Whether a world-1 call on fp8 experts of ``rows`` rows runs here: always inside a CUDA
    graph's capture (the dispatch path cannot be captured), else from ``EAGER_MIN_ROWS``."""
    return torch.cuda.is_current_stream_capturing() or rows >= EAGER_MIN_ROWS


def keep_graph_errors(device: torch.device, top_k: int) -> None:
    """Make the device word a captured call keeps its errors in (``check="deferred"``), as an
    eager call of this path would: the warm-up before a capture may have taken the dispatch."""
    from .megakernel import launch

    # Only its dtype, shape and device matter (no fill launched); a word made before is kept.
    like = torch.empty(1, dtype=torch.int64, device=device)
    launch.sticky_word("send", like, _PLAN, top_k)


def moe_forward_fp8_local(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: object,
    tuning: str,
    *,
    check: bool | str = "deferred",
) -> torch.Tensor:
    """The layer on fp8 ``PreparedExperts`` at world 1 (module docstring): ``x [T, H]`` bf16 on
    CUDA, ``topk_idx [T, K]`` int64 (-1: no expert), ``topk_weights [T, K]``; ``tuning`` (a
    canonical string) picks the fp8 GEMMs' tiles. Returns ``[T, H]`` bf16. The caller
    (``moe_forward_prepared``) has checked the operands' shapes and devices."""
    from .megakernel import launch

    launch.begin_call(check)
    ops = torch.ops.uniep
    tokens, top_k = topk_idx.shape
    slots = tokens * top_k
    if slots == 0:
        return x.new_zeros(x.shape)
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()  # the combine's sums take fp32 weights
    _, offs, _, _, gemm_row, _, plan_error = ops.local_plan(
        topk_idx.contiguous(), experts.num_experts, TILE_M
    )
    # One kernel where a quantize, a scatter and two gathers took ten launches (128 tokens on 128
    # experts of FFN 768, one H200, 2026-12-02: 17 us of the step's 264 as a CUDA graph). No
    # error word (report=False, no fill to launch): the rows are the plan's own, which the plan's
    # error word covers.
    rows, row_scales, _ = ops.quantize_fp8_rows(x.contiguous(), gemm_row, report=False)
    # SwiGLU in GEMM 1's epilogue: the [R, 2I] product is neither stored nor read back.
    act16 = ops.grouped_mm_fp8_swiglu(rows, row_scales, experts.w1, experts.w1_scales, offs, tuning)
    act, act_scales = ops.quantize_fp8(act16)
    y = ops.grouped_mm_fp8(act, act_scales, experts.w2, experts.w2_scales, offs, tuning)
    # No error word either (report=False): its rows are the plan's, as the quantize's are.
    out, _ = ops.combine_rows(y, gemm_row, topk_weights, report=False)
    launch.finish_call(check, [("send", plan_error, _PLAN, top_k)])
    return out
