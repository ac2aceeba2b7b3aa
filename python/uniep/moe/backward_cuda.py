"""The CUDA implementation of ``torch.ops.uniep.moe_backward``, composed from the GPU runtime's
pieces (``uniep.moe.ep``), the expert GEMM engine's gradient GEMMs, and, with ``overlap=fused``, the
MegaKernel's backward (``uniep.moe.megakernel.backward``). Importing this module registers it
(``ops`` does). It sits above the runtime and the MegaKernel so that neither imports the other back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed import wait_limit_s
from ..gemm import dequantize_rows
from ..tuning.params import parse as parse_tuning
from .ep import grad_tuning, rows_to_slots
from .megakernel.backward import ensure_backward_runtime, moe_backward_ep, moe_backward_local
from .megakernel.launch import megakernel_overlap

__all__: list[str] = []


@torch.library.impl("uniep::moe_backward", "CUDA")
def _moe_backward_cuda(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    tuning: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of moe_forward on GPUs, built from the runtime's pieces.

    The forward rows are dispatched again (same routing, so the same slots and rows), and
    grad_out on that dispatch's plan (a cached dispatch); the expert math is differentiated
    locally on the expert GEMM engine (data- and weight-gradient grouped GEMMs, one C++ op,
    ``moe_backward_engine``; torch._grouped_mm's autograd with tuning gemm=torch, composed here);
    grad_x comes home through a combine with unit weights (sum over k, ascending, fp32); the
    per-(token, k) dot products for grad_topk_weights go back over the group's NCCL all_to_all
    (at world 1 straight to their slots). With ``overlap=fused`` named (bf16, the MegaKernel's
    numerics) it runs the fused backward instead (``uniep.moe.megakernel.backward``: at one rank
    ``moe_backward_local``, across ranks ``moe_backward_ep`` on the group's fused runtime, which
    it creates with the backward's buffers on first use, collectively), and with
    ``overlap=chunked`` at one rank ``moe_backward_local(overlap="streams")``; the same bits.
    """
    try:
        engine = parse_tuning(tuning).gemm == "uniep"
    except ValueError:
        engine = True  # moe_backward_engine's agreed checks raise it on every rank
    world, overlap = _fused_world(grad_out, x, w1, w2, group_name, tuning) if engine else (0, "")
    if world:
        # overlap=fused: the MegaKernel's backward (uniep.moe.megakernel.backward), the same bits,
        # after the same checks; across ranks on the group's fused runtime, made (collectively, as
        # this call is) with the backward's buffers when it lacks them.
        torch.ops.uniep.moe_backward_checks(
            grad_out, x, topk_idx, topk_weights, w1, w2, group_name, tuning
        )
        operands = (grad_out.contiguous(), x, topk_idx, topk_weights.float(), w1, w2)
        if world == 1:
            grads = moe_backward_local(*operands, overlap=overlap, timeout_s=wait_limit_s(None))
        else:
            group = dist.distributed_c10d._resolve_process_group(group_name)
            ensure_backward_runtime(group, x, topk_idx, w1, w2)
            grads = moe_backward_ep(*operands, group)
        grad_x, grad_w, grad_w1, grad_w2 = grads
        return grad_x, grad_w.to(topk_weights.dtype), grad_w1, grad_w2
    if engine:
        # One C++ op from the checks to the combine (cpp/torch/ep/cuda_ops.cpp); only the routing
        # weights' gradients come back to their slots here.
        grad_x, dots, row_target, grad_w1, grad_w2 = torch.ops.uniep.moe_backward_engine(
            grad_out, x, topk_idx, topk_weights, w1, w2, group_name, tuning
        )
        grad_w = rows_to_slots(dots, row_target, topk_idx, group_name)
        return grad_x, grad_w.to(topk_weights.dtype), grad_w1.to(w1.dtype), grad_w2.to(w2.dtype)
    # Every check first, agreed with the peers (a bad argument on one rank raises on all).
    torch.ops.uniep.moe_backward_checks(
        grad_out, x, topk_idx, topk_weights, w1, w2, group_name, tuning
    )
    params = parse_tuning(tuning)
    text = params.to_string()
    # grad_out travels in bf16 whatever the forward's dispatch precision.
    grad_text = grad_tuning(text)
    k_top = topk_idx.shape[1]
    ffn = w2.shape[1]

    fwd = torch.ops.uniep.ep_dispatch(x, topk_idx, topk_weights, group_name, text)
    recv_x, scales, _, _, recv_w, per_expert, row_slot, row_target, plan_epoch = fwd
    rows = recv_x.index_select(0, row_slot)
    if params.dispatch == "fp8":
        rows = dequantize_rows(rows, scales.index_select(0, row_slot)).to(torch.bfloat16)
    k_of_row = row_target % k_top
    w_row = recv_w.index_select(0, row_slot).gather(1, k_of_row.unsqueeze(1)).squeeze(1)
    offs = per_expert.cumsum(0).to(torch.int32)

    # Same routing: grad_out rides on the forward rows' plan (no second count exchange).
    recv_go, _, back_epoch = torch.ops.uniep.ep_dispatch_cached(
        grad_out.contiguous(), topk_idx, topk_weights, group_name, plan_epoch, grad_text
    )
    go_rows = recv_go.index_select(0, row_slot)
    grad_rows, grad_w1, grad_w2, dots = _experts_backward_torch(
        rows, go_rows, w_row, w1, w2, offs, ffn
    )
    ones = torch.ones_like(topk_weights)
    grad_x = torch.ops.uniep.ep_combine(
        grad_rows.contiguous(), row_target, topk_idx, ones, group_name, back_epoch, grad_text
    )
    grad_w = rows_to_slots(dots, row_target, topk_idx, group_name)
    return grad_x, grad_w.to(topk_weights.dtype), grad_w1.to(w1.dtype), grad_w2.to(w2.dtype)


def _fused_world(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    tuning: str,
) -> tuple[int, str]:
    """(the group's world size, the mode) when moe_backward runs the MegaKernel's backward
    (``uniep.moe.megakernel.launch.megakernel_overlap``: ``overlap=fused``, or ``overlap=chunked``
    at one rank, with the MegaKernel's numerics, and bfloat16 operands), else (0, "")."""
    if any(t.dtype != torch.bfloat16 for t in (grad_out, x, w1, w2)):
        return 0, ""
    world = 1
    if group_name:  # "": torch.distributed not initialised, a world of one rank
        world = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group_name))
    try:
        overlap = megakernel_overlap(tuning, world, x.shape[-1], w2.shape[-2])
    except ValueError:
        return 0, ""  # the engine's checks name the bad tuning string
    return (world, overlap) if overlap else (0, "")


def _experts_backward_torch(
    rows: torch.Tensor,
    go_rows: torch.Tensor,
    w_row: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor,
    ffn: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' gradients through torch._grouped_mm's autograd (tuning gemm=torch)."""
    with torch.enable_grad():
        xs = rows.detach().requires_grad_(True)
        w1_ = w1.detach().requires_grad_(True)
        w2_ = w2.detach().requires_grad_(True)
        if xs.shape[0] > 0:
            h = torch._grouped_mm(xs, w1_, offs)
            y = torch._grouped_mm(F.silu(h[:, :ffn]) * h[:, ffn:], w2_, offs)
            grad_y = (go_rows.float() * w_row.unsqueeze(1)).to(y.dtype)
            grad_rows, grad_w1, grad_w2 = torch.autograd.grad(y, (xs, w1_, w2_), grad_y)
            dots = (go_rows.float() * y.detach().float()).sum(1)
        else:
            grad_rows, grad_w1, grad_w2 = xs, torch.zeros_like(w1), torch.zeros_like(w2)
            dots = torch.zeros(0, dtype=torch.float32, device=rows.device)

    return grad_rows, grad_w1, grad_w2, dots
