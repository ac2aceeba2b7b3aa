"""The MoE backward at world 1 on the MegaKernel's pieces (docs/megakernel.md, "The fused
backward"): the gradients of ``moe_forward`` for one rank's experts on its own tokens, with no
host sync anywhere.

1. the forward's plan (:func:`uniep.moe.tile_gates.sender_rows` at the gate's 128-row tiles);
2. the send of x's and grad_out's rows into their GEMM rows, each row counted on its tile gate,
   and the two GEMMs that need only those rows, gated tile by tile: ``h = rows_x w1`` (the
   forward's first GEMM, recomputed) and ``grad_act = rows_go w2^T``, read as ``rows_go w2t``
   with ``w2t = w2`` transposed (:func:`uniep.moe.kept_weights.transposed_w2` keeps one copy per
   ``w2`` version), so that both GEMMs read their weight N-major and run as one grouped GEMM;
3. the element-wise pass (``torch.ops.uniep.swiglu_backward``: SwiGLU's backward, ``act x w``
   and each row's ``<act, grad_act>``, the routing weight's gradient);
4. ``grad_rows = grad_h w1^T`` and the reduce over k with unit weights
   (:func:`uniep.moe.tile_gates.combine_rows`), then the weight gradients (``grouped_mm_wgrad``).

``overlap`` chooses how step 2 runs: ``"sequential"`` (two sends, then two gated GEMMs, on the
current stream), ``"streams"`` (the sends on ``comm_sms`` SMs beside the GEMMs, which wait per
tile) or ``"fused"`` (one persistent launch, ``torch.ops.uniep.moe_fused_backward_local``:
every CTA sends, then all of them take the GEMMs' tiles). Steps 3 and 4 are the same launches in
every mode, so all three give the same bits.

Across the ranks of a group, :func:`moe_backward_ep` runs the same steps on the group's fused
runtime (``uniep.moe.megakernel.launch.init_fused_ep(..., backward=True)``;
include/uniep/cuda/fused_ep.hpp): the count exchange and the plan, one persistent launch per rank
that stores the rank's x and grad_out rows into their experts' ranks' GEMM rows (with each row's
source slot and routing weight) and runs the local experts' h and grad_act gated on the rows that
arrive, the element-wise pass and ``grad_rows = grad_h w1^T`` over the rank's rows, the rows'
gradients and dots back into their sources' slots with the reduce over k on each source, then the
weight gradients. The bits equal :func:`moe_backward_local` on every rank's tokens together with
every expert's weights (a row's arithmetic does not depend on where it sits, an expert's rows are in
the same order, the reduce is the same ascending-k fp32 sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ... import _C, distributed
from ...gemm import grouped_mm_dgrad, grouped_mm_wgrad
from .. import tile_gates
from ..kept_weights import transposed_w2
from .launch import (
    CpuPlan,
    agree_cpu_call,
    begin_call,
    check_call,
    check_operands,
    finish_call,
    sends_beside_gemms,
)

__all__ = ["ensure_backward_runtime", "moe_backward_ep", "moe_backward_local"]


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
    reduce stamp: :func:`uniep.moe.megakernel.launch.trace_phases` reads it).
    ``check`` as for :func:`uniep.moe.megakernel.launch.moe_forward_local` (a bad expert id, a gate
    that timed out). Every GEMM accumulates in fp32 in one fixed order, so the bits do not depend on
    ``overlap`` or on when a tile started."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 0
    if comm_sms is None:
        comm_sms = sms if overlap == "fused" else 16
    check_call(x, topk_idx, topk_weights, w1, w2, overlap, comm_sms)
    _check_grad_out(grad_out, x)
    if w2t is None:
        w2t = transposed_w2(w2)
    _check_w2t(w2t, w2)
    if trace is not None and overlap != "fused":
        raise ValueError(f"trace is for overlap='fused' only, got overlap={overlap!r}")
    begin_call(check)
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
    _, offs, base, dest, row, counter, plan_error = tile_gates.local_plan(
        topk_idx, e, tile_gates.TILE_M
    )
    what = f"moe_backward_local ({overlap})"
    errors = [("send", plan_error, "moe_backward_local (plan)", k)]
    if overlap == "fused":
        rows_x, rows_go, hh, grad_act, send_error, t1 = torch.ops.uniep.moe_fused_backward_local(
            grad_out, x, row, counter, w1, w2t, offs, base, timeout_s, trace
        )
        errors += [("send", send_error, what, k), ("gate", t1, what, k)]
    else:
        counters = torch.zeros(
            2, capacity // tile_gates.TILE_M + e + 1, dtype=torch.int32, device=x.device
        )
        rows_x = torch.empty(capacity, h, dtype=x.dtype, device=x.device)
        rows_go = torch.empty_like(rows_x)
        hh = torch.empty(capacity, two_i, dtype=x.dtype, device=x.device)
        grad_act = torch.empty(capacity, two_i // 2, dtype=x.dtype, device=x.device)

        def gemms(gemm_sms: int) -> list[torch.Tensor]:
            gated = {"timeout_s": timeout_s, "sm_count": gemm_sms}
            _, t1 = tile_gates.grouped_mm_gated(
                rows_x, w1, offs, counters[0], base, out=hh, **gated
            )
            _, t2 = tile_gates.grouped_mm_gated(
                rows_go, w2t, offs, counters[1], base, out=grad_act, **gated
            )
            return [t1, t2]

        def sends(send_sms: int) -> list[torch.Tensor]:
            return [
                tile_gates.send_rows(src, dest, row, counter, rows, c, sm_count=send_sms)
                for src, rows, c in ((x, rows_x, counters[0]), (grad_out, rows_go, counters[1]))
            ]

        if overlap == "sequential":
            send_errors, waits = sends(sms), gemms(sms)
        else:
            # The sends on comm_sms SMs of a side stream, the GEMMs on the others, waiting per
            # tile (the queue-order rule: uniep.moe.megakernel.launch.sends_beside_gemms).
            uses = (x, grad_out, dest, row, counter, rows_x, rows_go, counters)
            send_errors, waits = sends_beside_gemms(x.device, sends, gemms, sms, comm_sms, uses)
        errors += [("send", s, what, k) for s in send_errors]
        errors += [("gate", w, what, k) for w in waits]

    entry = _row_entries(row, capacity)
    w_row = torch.where(entry >= 0, topk_weights.reshape(-1)[entry.clamp(min=0)], 0.0)
    act_w, grad_h, dots = torch.ops.uniep.swiglu_backward(hh, grad_act, w_row)
    grad_rows = grouped_mm_dgrad(grad_h, w1, offs)
    grad_w1 = grouped_mm_wgrad(rows_x, grad_h, offs)
    grad_w2 = grouped_mm_wgrad(act_w, rows_go, offs)
    ones = torch.ones_like(topk_weights)
    grad_x, combine_error = tile_gates.combine_rows(grad_rows, row, ones, check=False)
    grad_w = torch.where(row >= 0, dots[row.clamp(min=0)], 0.0)
    errors.append(("send", combine_error, "moe_backward_local (combine)", k))
    finish_call(check, errors)
    return grad_x, grad_w, grad_w1, grad_w2


def moe_backward_ep(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    check: bool | str = True,
    w2t: torch.Tensor | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_topk_weights, grad_w1, grad_w2)`` of the MoE forward across the ranks of
    ``group`` (:func:`uniep.moe.megakernel.launch.moe_forward_ep`'s, or ``moe_forward``'s with
    ``overlap=fused``) for this rank's tokens and this rank's experts' weights (``w1``
    ``[E / W, H, 2I]`` gate columns then up, ``w2`` ``[E / W, I, H]``), on the group's fused
    runtime, which must hold the backward's buffers (``init_fused_ep(..., backward=True)`` or
    ``ensure_fused_ep(..., backward=True)``); the module docstring's steps. Every rank calls it
    in the same order as its other calls on that runtime (a rank with no tokens too: its experts
    still compute the others' rows). ``grad_topk_weights`` is float32, 0 where ``topk_idx`` is
    -1. ``w2t``: ``w2`` transposed and contiguous (default: made once per ``w2`` version).
    ``trace`` (int64, 4 per SM, zeroed): the first launch's stamps, as for
    :func:`moe_backward_local`. ``check`` as for
    :func:`uniep.moe.megakernel.launch.moe_forward_ep`: a bad expert id, an exchange a rank never
    joined, rows or gradients that never came raise here. At one rank it is
    :func:`moe_backward_local` (``overlap="fused"``).

    On CPU tensors (a gloo group) the CPU executor runs the same plan, once every rank's
    arguments are checked and agreed as in ``moe_forward_ep``'s (a bad argument on one rank, or
    a size that differs, raises ValueError on every rank): the counts all-gathered,
    :func:`uniep.moe.tile_gates.sender_rows`, each entry's x and grad_out rows and weight to its
    GEMM row on its expert's rank, the experts' backward with the kernels' roundings (h, grad_act,
    grad_h, the rows' gradients and the weights' gradients rounded to bf16), the rows' gradients
    and dots back to their (token, k) slots and the sum over k ascending in fp32; within bf16
    rounding of the GPU's bits (the GEMMs' summation order differs)."""
    if not x.is_cuda and not w1.is_cuda:
        return _moe_backward_ep_cpu(grad_out, x, topk_idx, topk_weights, w1, w2, group)
    from ...distributed import wait_limit_s
    from .launch import require_runtime

    if distributed.world_size(group) == 1:
        return moe_backward_local(
            grad_out, x, topk_idx, topk_weights, w1, w2, overlap="fused",
            timeout_s=wait_limit_s(None), check=check, w2t=w2t, trace=trace,
        )  # fmt: skip
    require_runtime()
    if not x.is_cuda:
        raise ValueError(f"x must be a CUDA tensor like w1, got {x.device}")
    check_operands(x, topk_idx, topk_weights, w1, w2, experts="E / W", w1_name="w1")
    _check_grad_out(grad_out, x)
    if w2t is None:
        w2t = transposed_w2(w2)
    _check_w2t(w2t, w2)
    begin_call(check)
    name = distributed.group_name(group)
    if not _C.fused_ep_exists(name) or not _C.fused_ep_config(name)["backward"]:
        raise RuntimeError(
            f"group '{name}' has no fused MoE runtime with the backward's buffers: call "
            "uniep.moe.megakernel.launch.init_fused_ep(group, ..., backward=True) (or "
            "ensure_fused_ep(..., backward=True)) on every rank first"
        )
    grad_x, grad_w, grad_w1, grad_w2, error, timeout = torch.ops.uniep.moe_fused_ep_backward(
        grad_out.contiguous(), x.contiguous(), topk_idx, topk_weights, w1.contiguous(), w2t,
        name, trace,
    )  # fmt: skip
    k = topk_idx.shape[1]
    finish_call(
        check, [("gate", timeout, "moe_backward_ep", k), ("send", error, "moe_backward_ep", k)]
    )
    return grad_x, grad_w, grad_w1, grad_w2


def ensure_backward_runtime(
    group: dist.ProcessGroup | None,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    """The group's fused runtime with the backward's buffers and room for this call's tokens on
    every rank (``uniep.moe.megakernel.launch.ensure_fused_ep``: collective, the sizes exchanged
    at every call, since the ranks' batches differ and a fit judged on one rank alone could send
    one rank into the exchange while the others launch)."""
    from .launch import ensure_fused_ep

    sizes = {
        "tokens": x.shape[0],
        "hidden": x.shape[1],
        "ffn": w2.shape[1],
        "top_k": topk_idx.shape[1],
        "num_experts": w1.shape[0] * distributed.world_size(group),
        "backward": True,
    }
    ensure_fused_ep(group, **sizes)


def _moe_backward_ep_cpu(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_backward_ep's CPU executor (its docstring): the arguments agreed across the ranks
    (``launch.agree_cpu_call``), the plan of the GPU path, the rows over the group's all_to_all,
    the kernels' arithmetic in float32 with their bf16 roundings."""

    def checks() -> None:
        check_operands(x, topk_idx, topk_weights, w1, w2, experts="E / W", w1_name="w1")
        _check_grad_out(grad_out, x)

    agree_cpu_call("moe_backward", "moe_backward_ep", group, x, topk_idx, w1, w2, checks)
    t, h = x.shape
    el, _, two_i = w1.shape
    i = two_i // 2
    k = topk_idx.shape[1]
    plan = CpuPlan(topk_idx, el, group, "moe_backward_ep")

    # The send: each used entry's x row, grad_out row and weight to its GEMM row on its rank.
    tokens = plan.entries // k
    payload = torch.cat(
        [
            x[tokens].view(torch.uint8),  # bf16 bits: the transport moves bytes
            grad_out.contiguous()[tokens].view(torch.uint8),
            topk_weights.float().reshape(-1)[plan.entries].unsqueeze(1).view(torch.uint8),
        ],
        dim=1,
    )
    got = plan.to_experts(payload)
    meta = plan.to_experts(plan.row.reshape(-1)[plan.entries])
    local = plan.local
    rows = int(local.sum())
    rows_x = torch.zeros(rows, h, dtype=torch.bfloat16)
    rows_go = torch.zeros(rows, h, dtype=torch.bfloat16)
    w_row = torch.zeros(rows, dtype=torch.float32)
    rows_x[meta] = got[:, : 2 * h].contiguous().view(torch.bfloat16)
    rows_go[meta] = got[:, 2 * h : 4 * h].contiguous().view(torch.bfloat16)
    w_row[meta] = got[:, 4 * h :].contiguous().view(torch.float32).squeeze(1)

    # The experts' backward with the kernels' roundings.
    grad_rows = torch.zeros(rows, h, dtype=torch.bfloat16)
    dots = torch.zeros(rows, dtype=torch.float32)
    grad_w1, grad_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    ends = local.cumsum(0).tolist()
    for e in range(el):
        b, end = (ends[e - 1] if e else 0), ends[e]
        if end == b:
            continue
        xr, gr, wr = rows_x[b:end].float(), rows_go[b:end].float(), w_row[b:end].unsqueeze(1)
        hh = (xr @ w1[e].float()).bfloat16().float()
        ga = (gr @ w2[e].float().t()).bfloat16().float()
        g, u = hh[:, :i], hh[:, i:]
        sig = 1.0 / (1.0 + torch.exp(-g))
        act = (g * sig * u).bfloat16().float()
        dots[b:end] = (act * ga).sum(1)
        gw = ga * wr
        grad_h = torch.cat([gw * u * sig * (1.0 + g * (1.0 - sig)), gw * g * sig], 1).bfloat16()
        act_w = (act * wr).bfloat16()
        grad_rows[b:end] = (grad_h.float() @ w1[e].float().t()).bfloat16()
        grad_w1[e] = (xr.t() @ grad_h.float()).to(w1.dtype)
        grad_w2[e] = (act_w.float().t() @ gr).to(w2.dtype)

    # The rows' gradients and dots back to their slots, in the order their rows came.
    back = torch.cat(
        [grad_rows[meta].view(torch.uint8), dots[meta].unsqueeze(1).view(torch.uint8)], 1
    )
    back_in = plan.to_sources(back)
    slots = torch.zeros(t * k, h, dtype=torch.bfloat16)
    slot_dots = torch.zeros(t * k, dtype=torch.float32)
    slots[plan.entries] = back_in[:, : 2 * h].contiguous().view(torch.bfloat16)
    slot_dots[plan.entries] = back_in[:, 2 * h :].contiguous().view(torch.float32).squeeze(1)
    slots = slots.view(t, k, h).float()
    used = plan.dest >= 0
    acc = torch.zeros(t, h, dtype=torch.float32)
    for j in range(k):
        acc = torch.where(used[:, j : j + 1], acc + slots[:, j], acc)
    grad_w = torch.where(used, slot_dots.view(t, k), 0.0)
    return acc.bfloat16(), grad_w, grad_w1, grad_w2


def _check_fake_rows(x: torch.Tensor, per_token: torch.Tensor, name: str) -> None:
    """The fake kernels' shape checks: x [T, H] and a [T, K] tensor beside it."""
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    torch._check_value(
        per_token.dim() == 2 and per_token.shape[0] == x.shape[0],
        lambda: f"{name} must be [T = {x.shape[0]}, K], got shape {tuple(per_token.shape)}",
    )


@torch.library.register_fake("uniep::moe_fused_ep_backward")
def _moe_fused_ep_backward_fake(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2t: torch.Tensor,
    group_name: str,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_fake_rows(x, topk_idx, "topk_idx")
    torch._check_value(
        w1.dim() == 3 and w2t.dim() == 3,
        lambda: f"w1 and w2t must be 3-D, got {tuple(w1.shape)} and {tuple(w2t.shape)}",
    )
    e, h, i = w2t.shape
    return (
        x.new_empty(x.shape),
        x.new_empty(topk_idx.shape, dtype=torch.float32),
        w1.new_empty(w1.shape),
        w2t.new_empty((e, i, h)),
        x.new_empty((1,), dtype=torch.int64),
        x.new_empty((5,), dtype=torch.int32),
    )


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
    _check_fake_rows(x, gemm_row, "gemm_row")
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
