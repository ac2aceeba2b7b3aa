"""A dense MoE reference written for clarity, not speed: the numbers UniEP is checked against.

It loops over experts in plain torch, so it is easy to read and differentiable with autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["moe_reference"]


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_full: torch.Tensor,
    w2_full: torch.Tensor,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """SwiGLU mixture of experts over all experts on one process.

    ``y[t] = sum_k topk_weights[t, k] * (silu(x[t] @ W1g[e]) * (x[t] @ W1u[e])) @ W2[e]`` with
    ``e = topk_idx[t, k]``; slots with ``e == -1`` contribute nothing. Only what the routing uses
    is computed: a NaN or inf in an expert no token uses, in the weight of a -1 slot, or in a
    token routed nowhere does not reach the output (a token routed nowhere gives zeros), while
    one in a used expert shows up in the tokens that use it.

    Args:
        x: ``[T, H]`` tokens, any floating dtype.
        topk_idx: ``[T, K]`` int64 global expert ids in ``[0, E)`` or -1.
        topk_weights: ``[T, K]`` floating gate weights.
        w1_full: ``[E, H, 2I]`` gate (columns ``0..I-1``) and up (columns ``I..2I-1``) weights of
            all experts.
        w2_full: ``[E, I, H]`` down weights of all experts.
        compute_dtype: dtype of every intermediate (float64 by default, so the reference is more
            precise than what it checks).

    Returns:
        ``[T, H]`` in ``x.dtype``. Differentiable with respect to ``x``, ``topk_weights``,
        ``w1_full`` and ``w2_full``.
    """
    _check(x.dim() == 2, f"x must be [T, H], got shape {tuple(x.shape)}")
    _check(topk_idx.dim() == 2, f"topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}")
    _check(topk_idx.dtype == torch.int64, f"topk_idx must be int64, got {topk_idx.dtype}")
    _check(
        topk_idx.shape[0] == x.shape[0],
        f"topk_idx must have T={x.shape[0]} rows like x, got {topk_idx.shape[0]}",
    )
    _check(
        topk_weights.shape == topk_idx.shape,
        f"topk_weights must have the shape of topk_idx {tuple(topk_idx.shape)}, "
        f"got {tuple(topk_weights.shape)}",
    )
    _check(w1_full.dim() == 3, f"w1_full must be [E, H, 2I], got shape {tuple(w1_full.shape)}")
    _check(w2_full.dim() == 3, f"w2_full must be [E, I, H], got shape {tuple(w2_full.shape)}")
    num_experts, hidden, two_i = w1_full.shape
    ffn = w2_full.shape[1]
    _check(hidden == x.shape[1], f"w1_full must be [E, H={x.shape[1]}, 2I], got H={hidden}")
    _check(
        two_i % 2 == 0,
        f"w1_full's last dimension must be 2I (gate then up columns), an even number; got "
        f"{two_i} in shape {tuple(w1_full.shape)}",
    )
    _check(
        tuple(w2_full.shape) == (num_experts, two_i // 2, hidden),
        f"w2_full must be [E={num_experts}, I={two_i // 2}, H={hidden}] to match w1_full, "
        f"got {tuple(w2_full.shape)}",
    )
    if topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        _check(
            lo >= -1 and hi < num_experts,
            f"topk_idx must hold expert ids in [0, {num_experts}) or -1, got values in "
            f"[{lo}, {hi}]",
        )

    xs = x.to(compute_dtype)
    gates = topk_weights.to(compute_dtype)
    # Starts connected to every input, so the result is differentiable even when no token
    # reaches any expert (its gradients are then zeros, not an error). Through empty slices, not
    # `* 0`: a NaN or inf in an unused expert, an unused slot's weight or an unrouted token must
    # not reach the output (NaN * 0 is NaN).
    untouched = sum(t[:0].sum().to(compute_dtype) for t in (xs, gates, w1_full, w2_full))
    y = xs.new_zeros(xs.shape) + untouched
    for e in range(num_experts):
        tokens, slots = (topk_idx == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = xs[tokens] @ w1_full[e].to(compute_dtype)
        act = F.silu(h[:, :ffn]) * h[:, ffn:]
        out = act @ w2_full[e].to(compute_dtype)
        y = y.index_add(0, tokens, out * gates[tokens, slots].unsqueeze(1))
    return y.to(x.dtype)
