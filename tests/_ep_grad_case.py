"""Gradients through ``uniep.moe.ep.dispatch`` + ``uniep.moe.ep.combine`` against autograd through a
dense local reference; run on every rank of a group.

Shared by the GPU test (the real ops on the NVSHMEM runtime) and a CPU test that runs the same
code over gloo with the ops simulated from the CPU planner, so the backward logic (and this
check itself) is exercised without a GPU.

The expert side scales each row by ``c[e] + w[t, k]``, reading ``w`` from ``recv_topk_weights``,
so ``topk_weights`` gets gradient through both ops:
``out[t] = sum_k w[t, k] * x[t] * (c[e] + w[t, k])`` over valid k, with ``e = topk_idx[t, k]``.
Each rank's output depends on its own tokens only, so the reference is local, while the
gradients in the pipeline cross the ranks.
"""

from __future__ import annotations

import torch

KINDS = ("random", "one_expert", "empty_rank", "top1")
TOLERANCE = 2e-2  # relative norm; bf16 rows, products and sums rounded on the way


def ragged_tokens(max_tokens: int, rank: int) -> int:
    """Rank ``rank``'s token count: 37 fewer a rank, wrapping past max_tokens (eight ranks)."""
    return max_tokens - (37 * rank) % max_tokens


def routing(kind: str, tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    if kind in ("random", "empty_rank"):
        # Several of a token's experts share a rank: its slot there is the gradient of one row.
        idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
        drop = torch.rand(tokens, top_k, generator=gen) < 0.2
        return torch.where(drop, torch.full_like(idx, -1), idx)
    idx = torch.full((tokens, top_k), -1, dtype=torch.long)
    if kind == "one_expert":
        idx[:, 0] = 0
    elif kind == "top1":
        idx[:, top_k - 1] = torch.randint(0, experts, (tokens,), generator=gen)
    else:
        raise ValueError(kind)
    return idx


def _reference(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, c: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x.detach().double().requires_grad_(True)
    wr = w.detach().double().requires_grad_(True)
    out = torch.zeros_like(xr)
    for k in range(idx.shape[1]):
        valid = (idx[:, k] >= 0).unsqueeze(1)
        scale = c.double()[idx[:, k].clamp(min=0)].unsqueeze(1) + wr[:, k : k + 1]
        out = torch.where(valid, out + wr[:, k : k + 1] * xr * scale, out)
    (out * g.double()).sum().backward()
    assert xr.grad is not None and wr.grad is not None
    return xr.grad, wr.grad


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-6))


def run_cases(
    rank: int,
    world: int,
    device: torch.device,
    *,
    max_tokens: int,
    hidden: int,
    top_k: int,
    experts: int,
) -> dict[str, tuple[float, float]]:
    """Runs every kind on this rank (collective); returns {kind: (err of x, err of weights)}."""
    import uniep

    per_rank = experts // world
    errors: dict[str, tuple[float, float]] = {}
    for seed, kind in enumerate(KINDS):
        gen = torch.Generator().manual_seed(700 + seed)
        c = torch.rand(experts, generator=gen) + 0.5
        inputs = []
        for r in range(world):
            tokens = 0 if (kind == "empty_rank" and r == 1) else ragged_tokens(max_tokens, r)
            idx = routing(kind, tokens, experts, top_k, gen)
            x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
            w = torch.rand(tokens, top_k, generator=gen)
            g = torch.randn(tokens, hidden, generator=gen)
            inputs.append((x, idx, w, g))
        x0, idx0, w0, g0 = inputs[rank]

        x = x0.to(device, copy=True).requires_grad_(True)
        w = w0.to(device, copy=True).requires_grad_(True)
        idx = idx0.to(device)
        res = uniep.moe.ep.dispatch(x, idx, w)
        h = res.handle
        k_of_row = (h.row_target % top_k).unsqueeze(1)
        rows = res.recv_x.index_select(0, h.row_slot)
        local = res.recv_topk_idx.index_select(0, h.row_slot).gather(1, k_of_row).squeeze(1)
        w_row = res.recv_topk_weights.index_select(0, h.row_slot).gather(1, k_of_row)
        scale = c.to(device)[local + rank * per_rank].unsqueeze(1) + w_row
        y = (rows.float() * scale).to(torch.bfloat16)
        if kind == "random":
            # The raw op takes y's rows in any order, with row_target saying where each goes.
            perm = torch.randperm(y.shape[0], generator=gen).to(device)
            out = torch.ops.uniep.ep_combine(
                y[perm], h.row_target[perm], idx, w, h.group_name, h.epoch, h.tuning
            )
        else:
            out = uniep.moe.ep.combine(y, h)
        (out.float() * g0.to(device)).sum().backward()

        want_x, want_w = _reference(x0, idx0, w0, c, g0)
        assert x.grad is not None and w.grad is not None, kind
        assert x.grad.shape == x0.shape and x.grad.dtype == torch.bfloat16, kind
        assert w.grad.shape == w0.shape and w.grad.dtype == torch.float32, kind
        err_x, err_w = _rel_err(x.grad.cpu(), want_x), _rel_err(w.grad.cpu(), want_w)
        assert err_x <= TOLERANCE and err_w <= TOLERANCE, (kind, rank, err_x, err_w)
        errors[kind] = (err_x, err_w)

    # A cached dispatch (other rows on the plan of the last dispatch) differentiates as a
    # dispatch of the same rows does, bit for bit: its backward is the same combine.
    gen = torch.Generator().manual_seed(900)
    inputs = []
    for r in range(world):
        tokens = ragged_tokens(max_tokens, r)
        idx = routing("random", tokens, experts, top_k, gen)
        inputs.append((idx, torch.rand(tokens, top_k, generator=gen)))
        inputs[-1] += (torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16),)
    idx, w, x0 = (t.to(device) for t in inputs[rank])
    grads = []
    for cached in (True, False):
        x = x0.clone().requires_grad_(True)
        if cached:
            plan = uniep.moe.ep.dispatch(torch.zeros_like(x0), idx, w)
            recv_x = uniep.moe.ep.dispatch_cached(x, plan.handle).recv_x
        else:
            recv_x = uniep.moe.ep.dispatch(x, idx, w).recv_x
        g = torch.randn(recv_x.shape, generator=torch.Generator().manual_seed(rank))
        (recv_x.float() * g.to(device)).sum().backward()
        grads.append(x.grad)
    assert grads[0] is not None and torch.equal(grads[0], grads[1]), rank
    return errors
