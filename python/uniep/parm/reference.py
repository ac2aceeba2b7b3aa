"""A single-process dense reference of the Parm MoE layer, written for clarity, not speed.

Every expert runs on every token; the routing picks which results count. The capacity rule is the
one of include/uniep/parm.hpp, spelled out with loops: the S tokens of an MP group are cut into N
contiguous slices (torch.tensor_split), and inside a slice the (token, choice) pairs take an
expert's ``slice_capacity`` slots in choice-major, token-minor order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def keep_mask(
    topk_idx: torch.Tensor, mp_size: int, slice_capacity: int, num_experts: int
) -> tuple[torch.Tensor, int, int]:
    """(kept [S, k] bool, dropped pairs, largest (slice, expert) demand) of one MP group."""
    S, k = topk_idx.shape
    kept = torch.zeros(S, k, dtype=torch.bool)
    dropped = demand = 0
    for tokens in torch.tensor_split(torch.arange(S), mp_size):
        used = [0] * num_experts
        for j in range(k):
            for t in tokens.tolist():
                e = int(topk_idx[t, j])
                used[e] += 1
                if used[e] <= slice_capacity:
                    kept[t, j] = True
                else:
                    dropped += 1
        demand = max([demand, *used])
    return kept, dropped, demand


def parm_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    mp_size: int,
    slice_capacity: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One MP group: x [S, M], gate [M, E], w1 [E, M, H], w2 [E, H, M].

    Returns (y [S, M], l_aux, dropped pairs), differentiable in x, gate, w1 and w2. Computed in the
    dtype of its inputs (pass float64 for a reference)."""
    S, E = x.shape[0], gate.shape[1]
    probs = torch.softmax(x @ gate, dim=-1)
    weights, idx = probs.topk(top_k, dim=-1)
    kept, dropped, _ = keep_mask(idx, mp_size, slice_capacity, E)
    every = torch.stack([F.gelu(x @ w1[e]) @ w2[e] for e in range(E)])  # [E, S, M]
    y = torch.zeros_like(x)
    for j in range(top_k):
        out_j = every[idx[:, j], torch.arange(S)]  # [S, M]: each token's j-th expert
        y = y + (weights[:, j] * kept[:, j])[:, None] * out_j
    top1 = torch.bincount(idx[:, 0], minlength=E).to(x.dtype)
    l_aux = E * (probs.mean(0) * top1 / S).sum()
    return y, l_aux, dropped
