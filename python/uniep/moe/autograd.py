"""The autograd formula of ``torch.ops.uniep.moe_forward`` (registered on import): the forward
saves its inputs, the backward is ``torch.ops.uniep.moe_backward`` on every rank. The
MegaKernel's autograd (``uniep.moe.megakernel.forward``) falls back to the same backward.
"""

from __future__ import annotations

from typing import Any

import torch

from . import expert_shards

__all__ = ["backward", "refuse_double_backward", "setup_context"]


def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, topk_idx, topk_weights, w1, w2, group_name, tuning = inputs
    # Trainable shards equal on every rank are a plain DDP wrapper's doing: caught on a
    # layer's first training call, while every rank is still in this op.
    expert_shards.check_distinct_shards(group_name, w1, w2)
    ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2)
    ctx.group_name = group_name
    ctx.tuning = tuning


def refuse_double_backward(group_name: str, grad_out: torch.Tensor, *saved: torch.Tensor) -> None:
    """Raise on every rank where autograd is building the backward's own graph (a backward with
    ``create_graph=True``, as for a gradient penalty) through tensors that need it:
    ``moe_backward`` has no derivative, so the second-order gradients would silently be missing.
    """
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (grad_out, *saved)):
        return
    from .. import distributed

    error = (
        "moe_forward has no second derivative: its backward (torch.ops.uniep.moe_backward) is "
        "not differentiable, but autograd is building the backward's graph (create_graph=True) "
        "through it; take the gradient penalty (or other higher-order term) over the parts of "
        "the model without UniEP's MoE ops, or detach the layer's inputs there"
    )
    distributed.raise_on_all_ranks(group_name, "moe_backward", error, grad_out.device.type)


def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
    x, topk_idx, topk_weights, w1, w2 = ctx.saved_tensors
    refuse_double_backward(ctx.group_name, grad_out, x, topk_weights, w1, w2)
    # Every rank must enter moe_backward: the gradient of a local expert needs the rows other
    # ranks sent it, so the call cannot be skipped even where no input here needs a gradient.
    grad_x, grad_weights, grad_w1, grad_w2 = torch.ops.uniep.moe_backward(
        grad_out.contiguous(), x, topk_idx, topk_weights, w1, w2, ctx.group_name, ctx.tuning
    )
    needs = ctx.needs_input_grad
    return (
        grad_x if needs[0] else None,
        None,
        grad_weights if needs[2] else None,
        grad_w1 if needs[3] else None,
        grad_w2 if needs[4] else None,
        None,
        None,
    )


torch.library.register_autograd("uniep::moe_forward", backward, setup_context=setup_context)
