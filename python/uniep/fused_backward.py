"""The MoE backward at world 1 on the MegaKernel's pieces (docs/megakernel.md, "The fused
backward"): the gradients of ``moe_forward`` for one rank's experts on its own tokens, with no
host sync anywhere.

1. the forward's plan (:func:`uniep.gate.sender_rows` at the gate's 128-row tiles);
2. the send of x's and grad_out's rows into their GEMM rows, each row counted on its tile gate,
   and the two GEMMs that need only those rows, gated tile by tile: ``h = rows_x w1`` (the
   forward's first GEMM, recomputed) and ``grad_act = rows_go w2^T``, read as ``rows_go w2t``
   with ``w2t = w2`` transposed (:func:`uniep.fused_forward.transposed_w2` keeps one copy per
   ``w2`` version), so that both GEMMs read their weight N-major and run as one grouped GEMM;
3. the element-wise pass (``torch.ops.uniep.swiglu_backward``: SwiGLU's backward, ``act x w``
   and each row's ``<act, grad_act>``, the routing weight's gradient);
4. ``grad_rows = grad_h w1^T`` and the reduce over k with unit weights
   (:func:`uniep.gate.combine_rows`), then the weight gradients (``grouped_mm_wgrad``).

``overlap`` chooses how step 2 runs: ``"sequential"`` (two sends, then two gated GEMMs, on the
current stream), ``"streams"`` (the sends on ``comm_sms`` SMs beside the GEMMs, which wait per
tile) or ``"fused"`` (one persistent launch, ``torch.ops.uniep.moe_fused_backward_local``:
every CTA sends, then all of them take the GEMMs' tiles). Steps 3 and 4 are the same launches in
every mode, so all three give the same bits.
"""

from __future__ import annotations

import torch

from . import gate
from .fused_forward import transposed_w2
from .gemm import grouped_mm_dgrad, grouped_mm_wgrad
from .megakernel import _begin, _check, _finish, expert_counts

__all__ = ["moe_backward_local"]


def _check_grad_out(grad_out: torch.Tensor, x: torch.Tensor) -> None:
    if grad_out.shape != x.shape or grad_out.dtype != x.dtype or grad_out.device != x.device:
        raise ValueError(
            f"grad_out must be {x.dtype} [T, H] = {tuple(x.shape)} on {x.device} like x, got "
            f"{grad_out.dtype} of shape {tuple(grad_out.shape)} on {grad_out.device}"
        )


def _check_w2t(w2t: torch.Tensor, w2: torch.Tensor) -> None:
    e, i, h = w2.shape
    if w2t.shape != (e, h, i) or w2t.dtype != w2.dtype or not w2t.is_contiguous():
        raise ValueError(
            f"w2t must be w2 transposed, contiguous {w2.dtype} [E = {e}, H = {h}, I = {i}], got "
            f"{w2t.dtype} of shape {tuple(w2t.shape)}"
        )


def _row_entries(row: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[capacity]`` int64: the entry ``t x K + k`` each GEMM row holds, -1 for none (unused
    entries are scattered to one extra slot that is dropped: no mask, no host sync)."""
    flat = row.reshape(-1)
    entries = torch.arange(flat.numel(), device=row.device)
    out = torch.full((capacity + 1,), -1, dtype=torch.int64, device=row.device)
    out.scatter_(0, torch.where(flat >= 0, flat, capacity), entries)
    return out[:capacity]


def moe_backward_local(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    overlap: str = "fused",
    comm_sms: int | None = None,
    timeout_s: float = 10.0,
    check: bool | str = True,
    w2t: torch.Tensor | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_topk_weights, grad_w1, grad_w2)`` of ``moe_forward(x, topk_idx,
    topk_weights, w1, w2)`` at world 1 (every expert on this GPU; ``w1`` ``[E, H, 2I]`` gate
    columns then up, as ``moe_forward`` takes it) for the output gradient ``grad_out``: the
    module docstring's steps. ``grad_topk_weights`` is float32, 0 where ``topk_idx`` is -1.
    ``comm_sms``: the SMs that send with ``overlap="streams"`` (default 16). ``w2t``: ``w2``
    transposed and contiguous, when the caller keeps one (default: made once per ``w2`` version).
    ``trace`` (``fused`` only; int64, 4 per SM, zeroed): each CTA's global-timer stamps in ns at
    its start, after its send and after its GEMM tiles, then the last again (the forward's
    reduce stamp: :func:`uniep.megakernel.trace_phases` reads it).
    ``check`` as for :func:`uniep.megakernel.moe_forward_local` (a bad expert id, a gate that
    timed out). Every GEMM accumulates in fp32 in one fixed order, so the bits do not depend on
    ``overlap`` or on when a tile started."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 0
    if comm_sms is None:
        comm_sms = sms if overlap == "fused" else 16
    _check(x, topk_idx, topk_weights, w1, w2, overlap, comm_sms)
    _check_grad_out(grad_out, x)
    if w2t is None:
        w2t = transposed_w2(w2)
    _check_w2t(w2t, w2)
    if trace is not None and overlap != "fused":
        raise ValueError(f"trace is for overlap='fused' only, got overlap={overlap!r}")
    _begin(check)
    grad_out = grad_out.contiguous()
    t, h = x.shape
    k = topk_idx.shape[1]
    e, _, two_i = w1.shape
    if t == 0:
        return (
            x.new_empty(0, h),
            topk_weights.new_zeros(0, k),
            torch.zeros_like(w1),
            torch.zeros_like(w2),
        )
    capacity = t * k
    counts = expert_counts(topk_idx, e)
    dest, row, counter, plan_error = gate.sender_rows(
        topk_idx, counts.view(1, e), 0, check=False, tile_m=gate.TILE_M
    )
    offs = counts.cumsum(0).to(torch.int32)
    base = gate.tile_base(offs, capacity, gate.TILE_M)
    what = f"moe_backward_local ({overlap})"
    errors = [("send", plan_error, "moe_backward_local (plan)", k)]
    if overlap == "fused":
        rows_x, rows_go, hh, grad_act, send_error, t1 = torch.ops.uniep.moe_fused_backward_local(
            grad_out, x, row, counter, w1, w2t, offs, base, timeout_s, trace
        )
        errors += [("send", send_error, what, k), ("gate", t1, what, k)]
    else:
        counters = torch.zeros(
            2, capacity // gate.TILE_M + e + 1, dtype=torch.int32, device=x.device
        )
        rows_x = torch.empty(capacity, h, dtype=x.dtype, device=x.device)
        rows_go = torch.empty_like(rows_x)
        hh = torch.empty(capacity, two_i, dtype=x.dtype, device=x.device)
        grad_act = torch.empty(capacity, two_i // 2, dtype=x.dtype, device=x.device)

        def gemms(gemm_sms: int) -> list[torch.Tensor]:
            gated = {"timeout_s": timeout_s, "sm_count": gemm_sms}
            _, t1 = gate.grouped_mm_gated(rows_x, w1, offs, counters[0], base, out=hh, **gated)
            _, t2 = gate.grouped_mm_gated(
                rows_go, w2t, offs, counters[1], base, out=grad_act, **gated
            )
            return [t1, t2]

        def sends(send_sms: int) -> list[torch.Tensor]:
            return [
                gate.send_rows(src, dest, row, counter, rows, c, sm_count=send_sms)
                for src, rows, c in ((x, rows_x, counters[0]), (grad_out, rows_go, counters[1]))
            ]

        if overlap == "sequential":
            send_errors = sends(sms)
            waits = gemms(sms)
        else:
            # The GEMMs take their SMs first and wait per tile; the sends get the ones left.
            main = torch.cuda.current_stream(x.device)
            side = torch.cuda.Stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                waits = gemms((sms - comm_sms) // 2 * 2)
            send_errors = sends(comm_sms)
            main.wait_stream(side)
            for tensor in (rows_x, rows_go, hh, grad_act, counters, offs, base, w1, w2t):
                tensor.record_stream(side)
        errors += [("send", s, what, k) for s in send_errors]
        errors += [("gate", w, what, k) for w in waits]

    entry = _row_entries(row, capacity)
    w_row = torch.where(entry >= 0, topk_weights.reshape(-1)[entry.clamp(min=0)], 0.0)
    act_w, grad_h, dots = torch.ops.uniep.swiglu_backward(hh, grad_act, w_row)
    grad_rows = grouped_mm_dgrad(grad_h, w1, offs)
    grad_w1 = grouped_mm_wgrad(rows_x, grad_h, offs)
    grad_w2 = grouped_mm_wgrad(act_w, rows_go, offs)
    ones = torch.ones_like(topk_weights)
    grad_x, combine_error = gate.combine_rows(grad_rows, row, ones, check=False)
    grad_w = torch.where(row >= 0, dots[row.clamp(min=0)], 0.0)
    errors.append(("send", combine_error, "moe_backward_local (combine)", k))
    _finish(check, errors)
    return grad_x, grad_w, grad_w1, grad_w2


@torch.library.register_fake("uniep::moe_fused_backward_local")
def _moe_fused_backward_local_fake(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    gemm_row: torch.Tensor,
    counter: torch.Tensor,
    w1: torch.Tensor,
    w2t: torch.Tensor,
    offs: torch.Tensor,
    tile_base: torch.Tensor,
    timeout_s: float,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    torch._check_value(
        gemm_row.dim() == 2 and gemm_row.shape[0] == x.shape[0],
        lambda: f"gemm_row must be [T = {x.shape[0]}, K], got shape {tuple(gemm_row.shape)}",
    )
    torch._check_value(
        w1.dim() == 3 and w1.shape[1] == x.shape[1],
        lambda: f"w1 must be [E, H = {x.shape[1]}, 2I], got shape {tuple(w1.shape)}",
    )
    capacity, two_i = x.shape[0] * gemm_row.shape[1], w1.shape[2]
    return (
        x.new_empty((capacity, x.shape[1])),
        x.new_empty((capacity, x.shape[1])),
        x.new_empty((capacity, two_i)),
        x.new_empty((capacity, two_i // 2)),
        x.new_empty((1,), dtype=torch.int64),
        x.new_empty((5,), dtype=torch.int32),
    )
