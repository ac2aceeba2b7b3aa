"""MoE test problems: seeded global inputs that every rank (and the test process) rebuilds
bit-identically, and how a rank slices its tokens and experts out of them.

Routing kinds:
  random      K distinct experts per token, about a quarter of the slots -1, one token all -1
  one_expert  every token routed to the same expert, at a random k; the other slots -1
  one_rank    every token routed only to experts of the last rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class MoeCase:
    name: str
    tokens: tuple[int, ...]  # tokens of each rank; len = world size
    hidden: int
    ffn: int  # I: w1 is [E, H, 2I]
    experts: int  # E, global
    top_k: int
    dtype: str = "float32"
    routing: str = "random"
    seed: int = 0

    @property
    def world_size(self) -> int:
        return len(self.tokens)

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def token_range(self, rank: int) -> tuple[int, int]:
        begin = sum(self.tokens[:rank])
        return begin, begin + self.tokens[rank]

    def expert_range(self, rank: int) -> tuple[int, int]:
        return rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank


def make_routing(case: MoeCase, gen: torch.Generator) -> torch.Tensor:
    t, e, k = sum(case.tokens), case.experts, case.top_k
    if case.routing == "random":
        idx = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous()
        idx[torch.rand(t, k, generator=gen) < 0.25] = -1
        if t > 1:
            idx[1] = -1  # a token that goes nowhere
        return idx
    if case.routing == "one_expert":
        hot = int(torch.randint(e, (1,), generator=gen))
        idx = torch.full((t, k), -1, dtype=torch.int64)
        idx[torch.arange(t), torch.randint(k, (t,), generator=gen)] = hot
        return idx
    if case.routing == "one_rank":
        per = case.experts_per_rank
        assert k <= per, "one_rank routing needs top_k <= experts per rank"
        local = torch.rand(t, per, generator=gen).argsort(dim=1)[:, :k]
        return local + (e - per)
    if case.routing == "rank_per_k":
        # Choice k of token t on rank (t + k) % W, a random expert there: no rank holds two of a
        # token's choices (a rank's partial is one weighted row). A quarter of the choices unused.
        per, w = case.experts_per_rank, case.world_size
        assert k <= w, "rank_per_k routing needs top_k <= world size"
        ranks = (torch.arange(t).unsqueeze(1) + torch.arange(k)) % w
        idx = ranks * per + torch.randint(per, (t, k), generator=gen)
        idx[torch.rand(t, k, generator=gen) < 0.25] = -1
        return idx
    raise ValueError(f"unknown routing kind {case.routing!r}")


def make_inputs(case: MoeCase) -> dict[str, torch.Tensor]:
    """Global problem: x, topk_idx, topk_weights, w1, w2 (all experts) and grad_out."""
    gen = torch.Generator().manual_seed(case.seed)
    t, h, i, e = sum(case.tokens), case.hidden, case.ffn, case.experts
    dtype = case.torch_dtype
    idx = make_routing(case, gen)
    x = torch.randn(t, h, generator=gen, dtype=torch.float64)
    # Unused slots keep nonzero weights: the output must ignore them, not rely on zeros.
    weights = torch.rand(t, case.top_k, generator=gen, dtype=torch.float64) + 0.1
    w1 = torch.randn(e, h, 2 * i, generator=gen, dtype=torch.float64) / math.sqrt(h)
    w2 = torch.randn(e, i, h, generator=gen, dtype=torch.float64) / math.sqrt(i)
    grad_out = torch.randn(t, h, generator=gen, dtype=torch.float64)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "x": x.to(dtype),
        "topk_idx": idx,
        "topk_weights": weights.to(weight_dtype),
        "w1": w1.to(dtype),
        "w2": w2.to(dtype),
        "grad_out": grad_out.to(dtype),
    }


def rank_inputs(case: MoeCase, rank: int) -> dict[str, torch.Tensor]:
    """This rank's tokens and its slice of the experts, as fresh contiguous tensors."""
    return rank_slice(make_inputs(case), case, rank)


def rank_slice(g: dict[str, torch.Tensor], case: Any, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of the global inputs ``g`` of ``case`` (anything with token_range
    and expert_range): its tokens and its slice of the experts, fresh and contiguous."""
    t0, t1 = case.token_range(rank)
    e0, e1 = case.expert_range(rank)
    local = {k: g[k][t0:t1] for k in ("x", "topk_idx", "topk_weights", "grad_out")}
    local["w1"] = g["w1"][e0:e1]
    local["w2"] = g["w2"][e0:e1]
    return {k: v.clone().contiguous() for k, v in local.items()}


def bf16_layer(
    gen: torch.Generator,
    tokens: list[int],
    hidden: int,
    ffn: int,
    experts: int,
    top_k: int,
    *,
    unused: float,
    scale: float,
    route_below: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The MegaKernel tests' layer, drawn from ``gen`` in a fixed order: each rank's bf16
    tokens, routing (``top_k`` distinct experts, or any ids below ``route_below``; about
    ``unused`` of the slots -1) and fp32 weights, then every expert's bf16 ``w1`` and ``w2``
    (standard normal over ``scale``)."""
    xs, idxs, ws = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, hidden, generator=gen).bfloat16())
        if route_below is not None:
            idx = torch.randint(0, route_below, (t, top_k), generator=gen)
        else:
            idx = torch.rand(t, experts, generator=gen).topk(top_k, dim=1).indices
        idx[torch.rand(t, top_k, generator=gen) < unused] = -1
        idxs.append(idx)
        ws.append(torch.rand(t, top_k, generator=gen))
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen) / scale).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen) / scale).bfloat16()
    return xs, idxs, ws, w1, w2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error in float64; 0 only when both are exactly zero."""
    diff = (y.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    view = ints[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
