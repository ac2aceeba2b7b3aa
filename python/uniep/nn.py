"""``MoELayer``: a drop-in expert-parallel SwiGLU MoE block built on ``torch.ops.uniep``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _C, distributed
from .parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "MoELayer", "RowParallelLinear", "route", "route_weights"]


def _router_probs(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    # Routing decisions are made in fp32 (fp64 for fp64 layers) whatever the activation dtype:
    # bf16 logits tie often enough to change which experts a token picks.
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = F.linear(x.to(dtype), router_weight.to(dtype))
    return torch.softmax(logits, dim=-1)


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing.

    Args:
        x: ``[T, H]`` tokens.
        router_weight: ``[E, H]`` router projection.
        top_k: experts per token.

    Returns:
        ``topk_idx`` ``[T, top_k]`` int64 and ``topk_weights`` ``[T, top_k]`` (float32, float64
        for float64 ``x``): softmax over all experts, the ``top_k`` largest kept and renormalised
        to sum to 1 per token. Differentiable with respect to ``x`` and ``router_weight`` through
        the weights.
    """
    probs = _router_probs(x, router_weight)
    weights, idx = probs.topk(top_k, dim=-1)
    return idx, weights / weights.sum(dim=-1, keepdim=True)


def route_weights(
    x: torch.Tensor, router_weight: torch.Tensor, topk_idx: torch.Tensor
) -> torch.Tensor:
    """The renormalised gate weights ``route`` gives for a known ``topk_idx`` ``[T, K]``.

    Useful to differentiate routing without re-deciding it (the choice itself has no gradient).
    """
    weights = _router_probs(x, router_weight).gather(1, topk_idx)
    return weights / weights.sum(dim=-1, keepdim=True)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class MoELayer(nn.Module):
    """Mixture of SwiGLU experts with top-k softmax routing, experts split over a process group.

    The router (``nn.Linear(hidden, num_experts, bias=False)``, replicated on every rank) scores
    each token in fp32; the ``top_k`` best experts are kept and their softmax probabilities
    renormalised to sum to 1. ``torch.ops.uniep.moe_forward`` then sends each token to the ranks
    holding its experts and combines the results. Gradients reach ``x``, the router (through the
    gate weights) and this rank's experts; ``router.weight.grad`` holds this rank's tokens' share
    only, to be reduced over ranks like any replicated parameter (DDP does it).

    Parameters: ``router.weight`` ``[E, H]``; ``w1`` ``[E_local, H, 2I]`` (gate then up
    projection); ``w2`` ``[E_local, I, H]``; ``E_local = num_experts / world_size``, and this rank
    holds global experts ``[rank * E_local, (rank + 1) * E_local)``.

    Initialisation follows ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``) and draws every global
    expert in order on every rank, keeping the local ones: under the same ``torch.manual_seed``
    the concatenation of all ranks' experts equals a one-rank layer's, and the RNG stays in step
    across ranks.

    Args:
        hidden: ``H``, the model width.
        ffn_hidden: ``I``, each expert's intermediate width.
        num_experts: ``E``, experts in total, divisible by the group's world size.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        group: process group the experts are split over (see ``uniep.moe_forward``); resolved
            once, here.
        tuning: ``TuningParams`` or its string form, passed to every forward.
        dtype: parameter dtype (float32, bfloat16 or float64); the router stays float32
            (float64 for float64 layers).
        device: parameter device.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        group: torch.distributed.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.hidden = _positive_int("hidden", hidden)
        self.ffn_hidden = _positive_int("ffn_hidden", ffn_hidden)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"dtype must be float32, bfloat16 or float64, got {dtype}")
        if isinstance(tuning, _C.TuningParams):
            tuning = tuning.to_string()
        elif isinstance(tuning, str):
            _C.TuningParams.parse(tuning)  # fail here, naming the bad key, not at first forward
        else:
            raise ValueError(f"tuning must be a str or TuningParams, got {type(tuning).__name__}")
        self.tuning = tuning

        self.group_name = distributed.group_name(group)
        self.world_size = distributed.world_size(group)
        self.rank = distributed.rank(group)
        if num_experts % self.world_size != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the group's world size "
                f"({self.world_size})"
            )
        self.num_local_experts = num_experts // self.world_size
        self.expert_offset = self.rank * self.num_local_experts

        router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=router_dtype, device=device)
        local = self.num_local_experts
        self.w1 = nn.Parameter(
            torch.empty(local, hidden, 2 * ffn_hidden, dtype=dtype, device=device)
        )
        self.w2 = nn.Parameter(torch.empty(local, ffn_hidden, hidden, dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw the router and experts (see the class docstring for the order)."""
        self.router.reset_parameters()
        if self.w1.device.type == "meta":
            return
        bound1 = 1.0 / math.sqrt(self.hidden)
        bound2 = 1.0 / math.sqrt(self.ffn_hidden)
        shape1 = (self.hidden, 2 * self.ffn_hidden)
        shape2 = (self.ffn_hidden, self.hidden)
        first = self.expert_offset
        for e in range(self.num_experts):
            # Drawn in fp32 and rounded, so a bf16 layer holds the rounded fp32 layer.
            a = torch.empty(shape1, device=self.w1.device).uniform_(-bound1, bound1)
            b = torch.empty(shape2, device=self.w2.device).uniform_(-bound2, bound2)
            if first <= e < first + self.num_local_experts:
                self.w1[e - first].copy_(a)
                self.w2[e - first].copy_(b)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx, topk_weights)``, each ``[T, top_k]``, for ``x [T, H]`` (see ``route``)."""
        return route(x, self.router.weight, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., H]`` of the layer's dtype -> ``[..., H]``."""
        error = None
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            error = f"x must be [..., H={self.hidden}], got shape {tuple(x.shape)}"
        elif x.dtype != self.w1.dtype:
            error = f"x must have the layer's dtype {self.w1.dtype}, got {x.dtype}"
        elif x.device != self.w1.device:
            error = f"x must be on the layer's device {self.w1.device}, got {x.device}"
        if error is not None:
            # The other ranks are in this forward's exchange: they raise too, naming this rank.
            distributed.raise_on_all_ranks(self.group_name, "moe_forward", error, x.device.type)
        tokens = x.reshape(-1, self.hidden).contiguous()
        if tokens.is_cuda:
            from . import ep

            ep.ensure_runtime(
                self.group_name, tokens.shape[0], self.hidden, self.top_k, self.num_experts
            )
        topk_idx, topk_weights = self.route(tokens)
        y = torch.ops.uniep.moe_forward(
            tokens,
            topk_idx,
            topk_weights.contiguous(),
            self.w1,
            self.w2,
            self.group_name,
            self.tuning,
        )
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"local_experts=[{self.expert_offset}, {self.expert_offset + self.num_local_experts}), "
            f"world_size={self.world_size}, tuning={self.tuning!r}"
        )
