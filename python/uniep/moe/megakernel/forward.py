"""``uniep.moe_forward`` on the MegaKernel: what ``overlap=fused`` runs on CUDA.

The MegaKernel's first GEMM applies SwiGLU in its epilogue, so it reads w1 with gate and up
interleaved (``uniep.gemm.pack_gate_up``), not the ``[E, H, 2I]`` gate-then-up layout
``moe_forward`` takes. This module keeps one packed copy per ``w1`` tensor and packs again only
when ``w1`` changed: its version counter (every in-place write through autograd's view of the
tensor, an optimizer step included) or its storage moved. Writes that bypass the version counter
(``w1.data.copy_(...)``, or through another process) are not seen: call :func:`clear_packed`
after them. The copy costs one more ``w1`` of GPU memory; an inference server with fixed weights
should prepare them once instead (``uniep.moe.prepared``).

The bits are those of the separate launches (``overlap=sequential``). The backward is the fused
one (``uniep.moe.megakernel.backward``: one persistent launch sends x's and grad_out's rows, across
ranks to their experts' ranks, and runs the GEMMs on them; it reads w2 transposed, kept like the
packed w1); across ranks the forward then creates the group's fused runtime with the backward's
buffers. A bf16 forward's float32 or float64 ``grad_out`` runs ``moe_backward``'s separate
launches instead (the fused backward takes bf16 gradients). Not capturable in a
CUDA graph (the MegaKernel's errors are checked after the call); the MegaKernel's own entry
points are, with ``check=False``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..autograd import backward as op_backward
from ..autograd import refuse_double_backward
from ..kept_weights import clear_packed, packed_gate_up, transposed_w2
from .launch import megakernel_overlap, megakernel_shape_ok, runs_fused

__all__ = [
    "clear_packed",
    "moe_forward_fused",
    "megakernel_overlap",
    "megakernel_shape_ok",
    "packed_gate_up",
    "runs_fused",
    "transposed_w2",
]


def _forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup | None,
    tuning: str,
    backward: bool = False,
) -> torch.Tensor:
    from ...distributed import world_size
    from ..prepared import PreparedExperts, forward_fused
    from .launch import check_operands

    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "moe_forward with overlap=fused (or chunked at one rank) cannot be captured in a "
            "CUDA graph: it checks the MegaKernel's errors after the call, which a graph cannot "
            "hold; capture uniep.moe.megakernel.launch.moe_forward_local (world 1) or "
            "moe_forward_ep (across ranks) with check=False instead"
        )
    if w1.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError(
            f"w1 and w2 must be bfloat16 like x for overlap=fused, got {w1.dtype} and {w2.dtype}"
        )
    # The MegaKernel's own operand checks, before the packing (w1 has the packed shape).
    check_operands(x, topk_idx, topk_weights, w1, w2, experts="E_local", w1_name="w1")
    world = world_size(group)
    # The MegaKernel's GEMMs read w1 as stored where the FFN size allows it (a multiple of 128):
    # no packed copy, so nothing to redo after an optimizer step. Else a packed copy kept per w1
    # version.
    as_stored = w1.shape[2] % 256 == 0
    w1_used = w1.detach().contiguous() if as_stored else packed_gate_up(w1)
    # (The format gives forward_fused the shapes only; w1_as_stored says which layout w1 has.)
    experts = PreparedExperts("bf16_packed", w1_used, w2.detach().contiguous())
    return forward_fused(
        x, topk_idx, topk_weights, experts, group, world, tuning, backward=backward,
        w1_as_stored=as_stored, agree=True,
    )  # fmt: skip


class _FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        group: dist.ProcessGroup | None,
        name: str,
        tuning: str,
    ) -> torch.Tensor:
        from ...distributed import world_size
        from ..expert_shards import check_distinct_shards

        ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2)
        ctx.group, ctx.group_name, ctx.tuning, ctx.world = group, name, tuning, world_size(group)
        y = _forward(x, topk_idx, topk_weights, w1, w2, group, tuning, backward=True)
        check_distinct_shards(name, w1, w2)  # as moe_forward's other launches do
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        refuse_double_backward(ctx.group_name, grad_out, *ctx.saved_tensors)
        if grad_out.dtype == torch.bfloat16:
            return _backward_fused(ctx, grad_out)
        # moe_forward's own backward (its inputs have no group: one None more for it here).
        return (*op_backward(ctx, grad_out)[:5], None, None, None)


def _backward_fused(ctx: Any, grad_out: torch.Tensor) -> tuple:
    """The fused backward (``uniep.moe.megakernel.backward``): at one rank ``moe_backward_local``,
    across ranks ``moe_backward_ep`` on the group's fused runtime; the errors checked as the forward
    checks them (deferred)."""
    from ...distributed import wait_limit_s
    from .backward import ensure_backward_runtime, moe_backward_ep, moe_backward_local

    x, topk_idx, topk_weights, w1, w2 = ctx.saved_tensors
    weights = topk_weights.float() if topk_weights.dtype != torch.float32 else topk_weights
    # Keyed by the saved w2 itself (the caller's tensor), so the copy is kept across steps; a
    # detached view is a new tensor at every call and would be transposed again each time.
    w2t = transposed_w2(w2)
    operands = (grad_out.contiguous(), x, topk_idx, weights, w1.detach(), w2.detach())
    if ctx.world == 1:
        overlap = megakernel_overlap(ctx.tuning, 1) or "fused"
        grads = moe_backward_local(
            *operands, overlap=overlap, timeout_s=wait_limit_s(None), check="deferred", w2t=w2t
        )
    else:
        # The forward agreed on these sizes, but a call of other sizes since may have replaced
        # the runtime with one that fits some ranks' batches and not others': agree again.
        ensure_backward_runtime(ctx.group, x, topk_idx, w1, w2)
        grads = moe_backward_ep(*operands, ctx.group, check="deferred", w2t=w2t)
    grad_x, grad_w, grad_w1, grad_w2 = grads
    needs = ctx.needs_input_grad
    return (
        grad_x if needs[0] else None,
        None,
        grad_w.to(topk_weights.dtype) if needs[2] else None,
        grad_w1 if needs[3] else None,
        grad_w2 if needs[4] else None,
        None,
        None,
        None,
    )


def moe_forward_fused(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup | None,
    name: str,
    tuning: str,
) -> torch.Tensor:
    """``moe_forward`` on the MegaKernel's pieces (CUDA, ``megakernel_overlap(tuning, world)``
    not None), differentiable as ``moe_forward`` is."""
    args = (x, topk_idx, topk_weights, w1, w2)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args):
        return _FusedMoE.apply(x, topk_idx, topk_weights, w1, w2, group, name, tuning)
    return _forward(x, topk_idx, topk_weights, w1, w2, group, tuning)
