"""Swap Megatron-core-style MoE blocks for UniEP's expert-parallel ones.

Megatron-core is not imported (nor needed): a *Megatron-style block* is recognised by the
structure Megatron-core's ``MoELayer`` has (``megatron/core/transformer/moe/moe_layer.py``,
``router.py``, ``experts.py``):

- ``block.config``: the ``TransformerConfig`` (any object with its field names; fields it lacks
  take Megatron's defaults);
- ``block.router``: a ``TopKRouter``-like module with the gate ``weight [E, H]`` (no bias), and
  optionally the buffers ``expert_bias [E]`` and ``local_tokens_per_expert [E]``;
- ``block.experts`` in one of Megatron's three layouts, all ``E`` experts (a model built with
  ``expert_model_parallel_size=1``, or such a checkpoint loaded on every rank), SwiGLU without
  biases (``gated_linear_unit=True``, ``activation_func=F.silu``, ``add_bias_linear=False``):

  ============== ============================================= ==========================
  layout          parameters (per rank, ``e`` = local expert)   Megatron class
  ============== ============================================= ==========================
  ``sequential`` ``local_experts.{e}.linear_fc1.weight [2I, H]``  ``SequentialMLP``
                  ``local_experts.{e}.linear_fc2.weight [H, I]``
  ``te_grouped`` ``linear_fc1.weight{e} [2I, H]``               ``TEGroupedMLP``
                  ``linear_fc2.weight{e} [H, I]``                 (TE ``GroupedLinear``)
  ``grouped``    ``weight1 [H, E_local * 2I]``,                  ``GroupedMLP`` (legacy,
                  ``weight2 [E_local * I, H]``                    viewed as ``[E_local, H,
                                                                  2I]`` / ``[E_local, I, H]``)
  ============== ============================================= ==========================

  ``linear_fc1``'s output rows are the gate (``0..I-1``) then the up projection, as Megatron's
  ``glu`` splits them (``torch.chunk(x, 2, -1)``: ``act(x[0]) * x[1]``);
- ``block.shared_experts`` (optional): any module ``[S, B, H] -> [S, B, H]``, kept as it is.

``swap_moe_blocks`` replaces each such block by ``MegatronMoE``: the router's module is kept
(its parameter and buffers keep their names), the experts become ``MegatronExperts`` (this
rank's ``E / W`` experts in UniEP's layout), and routing follows Megatron's
``topk_routing_with_score_function`` for the config: softmax over the top-k logits (or over all
experts first with ``moe_router_pre_softmax``), sigmoid scores renormalised over the top-k with
``expert_bias`` steering the choice, group-limited top-k (``moe_router_num_groups`` /
``moe_router_group_topk``, groups scored by the sum of their ``topk / group_topk`` best),
``moe_router_topk_scaling_factor``, logits in ``moe_router_dtype``. ``forward(hidden_states)``
returns ``(output, None)`` like Megatron's ``MoELayer``.

Checkpoints use Megatron's names and layouts through state-dict hooks: ``state_dict`` gives this
rank's experts numbered ``0..E_local-1`` (what a Megatron rank with
``expert_model_parallel_size=W`` saves), ``load_state_dict`` takes that or all ``E`` experts
(``expert_model_parallel_size=1``; each rank keeps its own), and ``megatron_state_dict(model)``
(collective) gathers the ``E`` experts into the ``expert_model_parallel_size=1`` layout.
Transformer Engine's ``_extra_state`` entries (FP8 metadata) of the experts are dropped on load.

In training (``block.training`` and autograd on), the block adds the router losses of
Megatron's ``TopKRouter`` for the config, attached to the graph as Megatron attaches them: the
load-balancing losses ``moe_router_load_balancing_type`` ``"aux_loss"`` (micro-batch) and
``"seq_aux_loss"`` (per sequence, averaged), alone or as a list with a list of
``moe_aux_loss_coeff``, and the z-loss (``moe_z_loss_coeff``), with
``calculate_per_token_loss``'s scaling. ``loss.backward()`` on the main loss alone then gives
the gradients Megatron's block gives; ``MegatronMoE.aux_losses`` holds the last values and
``MegatronMoE.aux_loss_scale`` is Megatron's aux-loss backward scale (see ``MegatronMoE``).

Not supported (refused, naming the block, the field and the reason): ``sinkhorn`` and
``quantile_balancing`` routing, the ``global_aux_loss`` (a coefficient above 0), token dropping
(``moe_expert_capacity_factor``), input jitter, ``moe_apply_probs_on_input``, expert or router
biases, a non-SwiGLU expert, float16, expert tensor parallelism (the shapes would not match),
an ``expert_bias`` with softmax scores.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _C
from ..nn import Experts
from ._layout_hooks import register_layout_hooks
from .hf import is_silu, replace_found

__all__ = [
    "LAYOUTS",
    "MegatronExperts",
    "MegatronMoE",
    "expert_layout",
    "megatron_route",
    "megatron_state_dict",
    "swap_moe_blocks",
    "unsupported_reason",
]

LAYOUTS = ("sequential", "te_grouped", "grouped")

# TransformerConfig fields read here, with Megatron-core's defaults.
_DEFAULTS: dict[str, Any] = {
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_scaling_factor": None,
    "moe_router_dtype": None,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "calculate_per_token_loss": False,
    "moe_input_jitter_eps": None,
    "moe_expert_capacity_factor": None,
    "moe_apply_probs_on_input": False,
    "gated_linear_unit": False,
    "activation_func": F.gelu,
}
_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}
# Load-balancing types -> the name Megatron's metrics tracker logs the loss under.
_BALANCE_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def _cfg(config: object, name: str) -> Any:
    return getattr(config, name, _DEFAULTS[name])


def _balancing(config: object) -> tuple[list[Any], list[Any]]:
    """The load-balancing types and their coefficients, as lists: a single type takes
    ``moe_aux_loss_coeff`` as it is, a list of types pairs with a list of coefficients (a
    single coefficient then gives an empty list)."""
    kinds = _cfg(config, "moe_router_load_balancing_type")
    coeffs = _cfg(config, "moe_aux_loss_coeff")
    if isinstance(kinds, str):
        return [kinds], [coeffs]
    return list(kinds), list(coeffs) if isinstance(coeffs, (list, tuple)) else []


def _indexed(module: nn.Module, stem: str) -> list[nn.Parameter]:
    """Parameters ``{stem}0, {stem}1, ...`` of ``module`` in index order (TE GroupedLinear)."""
    found = {}
    for name, p in module.named_parameters(recurse=False):
        m = re.fullmatch(rf"{stem}(\d+)", name)
        if m:
            found[int(m.group(1))] = p
    if sorted(found) != list(range(len(found))):
        return []
    return [found[i] for i in range(len(found))]


def expert_layout(experts: nn.Module) -> str | None:
    """Which of ``LAYOUTS`` a Megatron experts module has, by its parameters; None if none."""
    local = getattr(experts, "local_experts", None)
    if isinstance(local, nn.ModuleList) and len(local) > 0:
        if all(
            isinstance(getattr(getattr(m, "linear_fc1", None), "weight", None), torch.Tensor)
            and isinstance(getattr(getattr(m, "linear_fc2", None), "weight", None), torch.Tensor)
            for m in local
        ):
            return "sequential"
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    if isinstance(fc1, nn.Module) and isinstance(fc2, nn.Module):
        w1, w2 = _indexed(fc1, "weight"), _indexed(fc2, "weight")
        if w1 and len(w1) == len(w2):
            return "te_grouped"
    names = {n for n, _ in experts.named_parameters(recurse=False)}
    if {"weight1", "weight2"} <= names:
        return "grouped"
    return None


def _expert_weights(
    experts: nn.Module, layout: str, num_experts: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts of a Megatron experts module as UniEP's ``w1 [E, H, 2I]``, ``w2 [E, I, H]``
    (views of the grouped layout, stacked transposes of the others)."""
    if layout in ("sequential", "te_grouped"):
        if layout == "sequential":
            fc1 = [m.linear_fc1.weight for m in experts.local_experts]
            fc2 = [m.linear_fc2.weight for m in experts.local_experts]
        else:
            fc1 = _indexed(experts.linear_fc1, "weight")
            fc2 = _indexed(experts.linear_fc2, "weight")
        return torch.stack([w.t() for w in fc1]), torch.stack([w.t() for w in fc2])
    w1, w2 = experts.weight1, experts.weight2
    if (
        w1.dim() != 2
        or w2.dim() != 2
        or w1.shape[0] != hidden
        or w2.shape[1] != hidden
        or w1.shape[1] != 2 * w2.shape[0]
        or w2.shape[0] % num_experts
        or w2.shape[0] == 0
    ):
        raise ValueError(
            f"weight1 must be [H={hidden}, E*2I] and weight2 [E*I, H={hidden}] with "
            f"E={num_experts}, got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    ffn = w2.shape[0] // num_experts
    # GroupedMLP views its flat weights this way (not a transpose).
    return w1.reshape(num_experts, hidden, 2 * ffn), w2.reshape(num_experts, ffn, hidden)


def unsupported_reason(block: nn.Module) -> str | None:
    """Why ``block`` (a Megatron-style MoE block) cannot become ``MegatronMoE``; None if it can."""
    config = getattr(block, "config", None)
    router = getattr(block, "router", None)
    experts = getattr(block, "experts", None)
    if config is None or router is None or experts is None:
        return "it lacks config, router or experts"
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "router.weight is not a 2-D [E, H] tensor"
    others = sorted(n for n, _ in router.named_parameters() if n != "weight")
    if others:
        return f"the router has parameters {others} besides weight (a router bias?)"
    num_experts, hidden = weight.shape
    layout = expert_layout(experts)
    if layout is None:
        return f"its experts ({type(experts).__name__}) are in none of Megatron's layouts {LAYOUTS}"
    biases = [n for n, _ in experts.named_parameters() if "bias" in n.rsplit(".", 1)[-1]]
    if biases:
        return f"its experts have biases ({biases[0]}, ...; add_bias_linear=True)"
    if not _cfg(config, "gated_linear_unit"):
        return "its experts are not gated (gated_linear_unit=False): UniEP's are SwiGLU"
    if not is_silu(_cfg(config, "activation_func")):
        return "its activation_func is not SiLU: UniEP's experts are SwiGLU"
    reason = _balancing_reason(config)
    if reason is not None:
        return reason
    for name, why in (
        ("moe_input_jitter_eps", "input jitter"),
        ("moe_expert_capacity_factor", "token dropping (UniEP drops no token)"),
        ("moe_apply_probs_on_input", "probabilities applied before the experts"),
    ):
        if _cfg(config, name):
            return f"it asks for {why} ({name}={_cfg(config, name)!r})"
    score = _cfg(config, "moe_router_score_function")
    if score not in ("softmax", "sigmoid"):
        return f"moe_router_score_function={score!r} (UniEP follows softmax and sigmoid)"
    if score == "softmax" and getattr(router, "expert_bias", None) is not None:
        return "it has an expert_bias with softmax scores (Megatron applies it with sigmoid only)"
    if _cfg(config, "moe_router_dtype") not in _ROUTER_DTYPES:
        return f"moe_router_dtype={_cfg(config, 'moe_router_dtype')!r} (None, 'fp32' or 'fp64')"
    try:
        w1, w2 = _expert_weights(experts, layout, num_experts, hidden)
    except (RuntimeError, ValueError) as e:
        return f"its {layout} experts do not fit together: {e}"
    if w1.shape[0] != num_experts:
        return (
            f"it holds {w1.shape[0]} experts but its router has {num_experts}: UniEP takes a "
            "block with all experts (expert_model_parallel_size=1) and splits them itself"
        )
    if w1.shape[1] != hidden or w2.shape != (num_experts, w1.shape[2] // 2, hidden):
        return (
            f"expert shapes [E, H, 2I] {tuple(w1.shape)} / [E, I, H] {tuple(w2.shape)} do not "
            f"match the router's [E, H] {tuple(weight.shape)} (expert tensor parallelism?)"
        )
    if w1.dtype == torch.float16:
        return (
            "it is float16: UniEP's expert kernels compute in float32, bfloat16 or float64 "
            "(cast the model to bfloat16 first)"
        )
    return None


def _balancing_reason(config: object) -> str | None:
    """Why the config's load balancing cannot be followed; None if it can."""
    kinds, coeffs = _balancing(config)
    field = f"moe_router_load_balancing_type={_cfg(config, 'moe_router_load_balancing_type')!r}"
    if len(kinds) != len(coeffs):
        return (
            f"{field} needs a list of as many moe_aux_loss_coeff, got "
            f"{_cfg(config, 'moe_aux_loss_coeff')!r}"
        )
    for kind, coeff in zip(kinds, coeffs, strict=True):
        if not isinstance(coeff, (int, float)):
            return f"moe_aux_loss_coeff={coeff!r} for {kind!r} is not a number"
        if kind in ("sinkhorn", "quantile_balancing"):
            return f"{field}: UniEP routes by top-k scores, not by {kind} balancing"
        if kind == "global_aux_loss" and coeff > 0:
            return (
                f"{field} with moe_aux_loss_coeff={coeff}: the global-batch loss counts tokens "
                "over the data-parallel group and across micro-batches, which the block does not "
                "track"
            )
        if kind not in ("none", "global_aux_loss", *_BALANCE_LOSSES):
            return f"{field}: unknown load-balancing type {kind!r}"
    z = _cfg(config, "moe_z_loss_coeff")
    if z is not None and not isinstance(z, (int, float)):
        return f"moe_z_loss_coeff={z!r} is not a number"
    return None


def _group_limited_topk(
    scores: torch.Tensor, top_k: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = scores.shape
    grouped = scores.reshape(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(top_k // group_topk, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
    mask = keep.unsqueeze(-1).expand(-1, -1, experts // num_groups).reshape(tokens, experts)
    return scores.masked_fill(~mask, float("-inf")).topk(top_k, dim=-1)


def megatron_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-core's top-k routing from logits ``[T, E]``, as ``[T, K]`` ids and weights.

    softmax: the top-k of the logits, then a softmax over those k (``pre_softmax``: a softmax
    over all experts, then its top-k, not renormalised). sigmoid: the top-k of
    ``sigmoid(logits) (+ expert_bias, for the choice only)``, renormalised over the k when
    ``k > 1``. ``group_topk``: only experts of the ``group_topk`` best of ``num_groups``
    contiguous groups, each scored by the sum of its ``top_k / group_topk`` best values.
    ``scaling_factor`` multiplies the weights. Weights have the logits' dtype (softmax in fp32).
    """

    def topk(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            return _group_limited_topk(values, top_k, num_groups or 1, group_topk)
        return values.topk(top_k, dim=-1)

    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, idx = topk(scores)
        else:
            top, idx = topk(logits)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, idx = topk(scores + expert_bias)
            probs = scores.gather(1, idx)
        else:
            probs, idx = topk(scores)
        if top_k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    return idx, probs


def _balance_loss(
    scores: torch.Tensor, chosen: torch.Tensor, top_k: int, sequences: int
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E * sum_e f_e * P_e`` without coefficient,
    averaged over ``sequences`` interleaved sequences of the ``T`` tokens (Megatron's ``[S, B]``
    order: token ``s * B + b`` is of sequence ``b``). ``f_e``: the share of a sequence's
    ``S * top_k`` choices ``chosen [T, E]`` that pick ``e``; ``P_e``: ``e``'s mean score
    ``scores [T, E]`` over the sequence. ``sequences=1`` is ``aux_loss``, ``B`` ``seq_aux_loss``.
    """
    tokens, experts = scores.shape
    seq_len = tokens // sequences
    score_sums = scores.reshape(seq_len, sequences, experts).sum(0)
    counts = chosen.reshape(seq_len, sequences, experts).sum(0)
    return (score_sums * counts).sum() * (experts / (top_k * seq_len * seq_len * sequences))


class _AttachLoss(torch.autograd.Function):
    """``x`` unchanged; in backward, ``loss`` gets the gradient ``block.aux_loss_scale`` (read
    then) whatever ``x``'s is. The loss so joins the backward of any loss that ``x`` reaches
    without being added to it: Megatron's ``MoEAuxLossAutoScaler``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, block: MegatronMoE) -> torch.Tensor:
        ctx.block = block
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.block.aux_loss_scale, None


class MegatronExperts(Experts):
    """``uniep.nn.Experts`` with a Megatron experts module's checkpoint names and layout.

    ``layout`` is one of ``LAYOUTS``; see the module docstring for the keys. Parameters are
    UniEP's ``w1 [E_local, H, 2I]`` / ``w2 [E_local, I, H]``: nothing is copied per call.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        layout: str,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        super().__init__(hidden, ffn_hidden, num_experts, group, tuning, dtype, device)
        self.layout = layout
        register_layout_hooks(self, _save_megatron_layout, _load_megatron_layout)

    def to_megatron(
        self, w1: torch.Tensor, w2: torch.Tensor, prefix: str = ""
    ) -> dict[str, torch.Tensor]:
        """``w1 [n, H, 2I]`` / ``w2 [n, I, H]`` (this rank's experts, or all, or their
        gradients) under Megatron's keys and layouts, experts numbered from 0."""
        n = w1.shape[0]
        if self.layout == "grouped":
            # The flat layout GroupedMLP views as [n, H, 2I] / [n, I, H].
            return {
                f"{prefix}weight1": w1.contiguous().reshape(self.hidden, -1).clone(),
                f"{prefix}weight2": w2.contiguous().reshape(-1, self.hidden).clone(),
            }
        out = {}
        for e in range(n):
            fc1, fc2 = w1[e].t().contiguous(), w2[e].t().contiguous()
            if self.layout == "sequential":
                out[f"{prefix}local_experts.{e}.linear_fc1.weight"] = fc1
                out[f"{prefix}local_experts.{e}.linear_fc2.weight"] = fc2
            else:
                out[f"{prefix}linear_fc1.weight{e}"] = fc1
                out[f"{prefix}linear_fc2.weight{e}"] = fc2
        return out

    def _from_megatron(self, state: dict[str, Any], prefix: str) -> tuple[torch.Tensor, ...]:
        """Pops this module's Megatron keys from ``state``: all E experts or this rank's
        E_local; returns this rank's ``w1``, ``w2`` in UniEP's layout."""
        hid, ffn = self.hidden, self.ffn_hidden
        local, first = self.num_local_experts, self.expert_offset
        if self.layout == "grouped":
            w1 = state.pop(f"{prefix}weight1")
            w2 = state.pop(f"{prefix}weight2")
            n = w1.numel() // (hid * 2 * ffn) if w1.dim() == 2 and w1.shape[0] == hid else -1
            if n not in (local, self.num_experts) or tuple(w2.shape) != (n * ffn, hid):
                raise ValueError(
                    f"weight1 must be [H={hid}, n*{2 * ffn}] and weight2 [n*{ffn}, H={hid}] with "
                    f"n = E={self.num_experts} or E_local={local}, got {tuple(w1.shape)} and "
                    f"{tuple(w2.shape)}"
                )
            w1, w2 = w1.reshape(n, hid, 2 * ffn), w2.reshape(n, ffn, hid)
            if n == self.num_experts:
                w1, w2 = w1[first : first + local], w2[first : first + local]
            return w1, w2
        if self.layout == "sequential":
            keys = (f"{prefix}local_experts.{{}}.linear_fc1.weight",)
            keys += (f"{prefix}local_experts.{{}}.linear_fc2.weight",)
        else:
            keys = (f"{prefix}linear_fc1.weight{{}}", f"{prefix}linear_fc2.weight{{}}")
        n = 0
        while keys[0].format(n) in state:
            n += 1
        if n not in (local, self.num_experts):
            raise ValueError(
                f"{keys[0].format('e')} must exist for e in [0, E={self.num_experts}) or "
                f"[0, E_local={local}), found {n}"
            )
        fc1 = [state.pop(keys[0].format(e)) for e in range(n)]
        fc2 = [state.pop(keys[1].format(e), None) for e in range(n)]
        for e in range(n):
            if (
                fc2[e] is None
                or tuple(fc1[e].shape) != (2 * ffn, hid)
                or tuple(fc2[e].shape) != (hid, ffn)
            ):
                raise ValueError(
                    f"expert {e}: linear_fc1 must be [2I={2 * ffn}, H={hid}] and linear_fc2 "
                    f"[H={hid}, I={ffn}], got {tuple(fc1[e].shape)} / "
                    f"{None if fc2[e] is None else tuple(fc2[e].shape)}"
                )
        if n == self.num_experts:
            fc1, fc2 = fc1[first : first + local], fc2[first : first + local]
        return torch.stack([w.t() for w in fc1]), torch.stack([w.t() for w in fc2])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout}"


def _save_megatron_layout(module: MegatronExperts, state_dict: dict, prefix: str) -> None:
    if prefix + "w1" in state_dict and prefix + "w2" in state_dict:
        w1, w2 = state_dict.pop(prefix + "w1"), state_dict.pop(prefix + "w2")
        state_dict.update(module.to_megatron(w1, w2, prefix))


def _load_megatron_layout(
    module: MegatronExperts, state_dict: dict, prefix: str, error_msgs: list
) -> None:
    if prefix + "w1" in state_dict:
        return  # UniEP's own layout
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("._extra_state")]:
        del state_dict[key]  # Transformer Engine's FP8 metadata
    marker = "weight1" if module.layout == "grouped" else None
    if marker is None:
        marker = (
            "local_experts.0.linear_fc1.weight"
            if module.layout == "sequential"
            else "linear_fc1.weight0"
        )
    if prefix + marker not in state_dict:
        return  # missing: load_state_dict reports w1 / w2
    try:
        state_dict[prefix + "w1"], state_dict[prefix + "w2"] = module._from_megatron(
            state_dict, prefix
        )
    except (KeyError, ValueError) as e:
        error_msgs.append(f"{prefix}: {e} ({module.layout} layout)")


class MegatronMoE(nn.Module):
    """A Megatron-style MoE block on UniEP: the block's router, ``MegatronExperts``, its shared
    experts. ``forward(hidden_states [S, B, H]) -> (output [S, B, H], None)`` like Megatron's
    ``MoELayer`` (``[T, H]`` is one sequence of ``T`` tokens); every rank of the group must call
    it, with its own tokens.

    Router losses, as Megatron's ``TopKRouter`` computes them, only in training with autograd
    on, each attached to the graph (not added to the output; see ``aux_loss_scale``):

    - z-loss: ``moe_z_loss_coeff * mean_t logsumexp(logits_t)^2`` over the logits (in
      ``moe_router_dtype``), attached to them before routing;
    - load balancing, for each type of ``moe_router_load_balancing_type`` whose
      ``moe_aux_loss_coeff`` is above 0: ``coeff * E * sum_e f_e * P_e`` with ``P_e`` the mean
      score of expert ``e`` over all ``E`` experts (float32 softmax of the logits, or their
      sigmoid normalised to sum to 1, whatever the routing's ``pre_softmax``, group limit or
      ``expert_bias``) and ``f_e`` the share of the tokens' top-k picks of those scores that go
      to ``e``; over the micro-batch (``"aux_loss"``) or per sequence ``b`` of ``[S, B]`` and
      averaged over ``B`` (``"seq_aux_loss"``); attached to the routing weights.

    With ``calculate_per_token_loss`` each attached loss is multiplied by this rank's token
    count ``S * B`` (for a loop that sums the main loss over tokens and divides the gradients
    by the global token count, as Megatron's does).

    Several ranks: each rank's losses are over its own tokens. Megatron sums ``tokens_per_expert``
    (and the token count) over the tensor- and context-parallel group only, never over the
    expert-parallel one; UniEP's block runs whole sequences on each rank with the router
    replicated (tensor and context parallel size 1), so nothing is reduced: this rank's counts
    are the ones used, as on a Megatron rank of ``expert_model_parallel_size=W``. This rank's
    router gradient is that of its main loss plus its router losses; ``uniep.nn.data_parallel``
    averages it over the ranks as Megatron's data-parallel gradient reduction does.

    Attributes:
        aux_losses: the last forward's losses by the names Megatron's metrics tracker logs them
            under (``"load_balancing_loss"``, ``"seq_load_balancing_loss"``, ``"z_loss"``),
            each without its coefficient as Megatron logs it, for this rank's tokens (Megatron
            then averages the logs over ranks), detached; ``{}`` when none was computed.
        aux_loss_scale: the gradient each attached loss gets in backward (read when backward
            runs); a float or a 0-d tensor, by default 1, set on the class for every block or
            on one. Megatron's schedule sets its ``MoEAuxLossAutoScaler`` scale to
            ``grad_scale / num_microbatches`` (``grad_scale`` alone with
            ``calculate_per_token_loss``): set it to what your main loss is multiplied by before
            its backward, e.g. ``1 / accumulation_steps``. Not for the average over ranks:
            ``uniep.nn.data_parallel`` does that.
    """

    aux_loss_scale: float | torch.Tensor = 1.0

    def __init__(
        self,
        config: object,
        router: nn.Module,
        experts: MegatronExperts,
        shared_experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.router = router
        self.experts = experts
        self.shared_experts = shared_experts
        self.top_k = int(_cfg(config, "moe_router_topk"))
        self.router_dtype = _ROUTER_DTYPES[_cfg(config, "moe_router_dtype")]
        kinds, coeffs = _balancing(config)
        self._balance_coeffs = {
            k: float(c)
            for k, c in zip(kinds, coeffs, strict=True)
            if k in _BALANCE_LOSSES and c > 0
        }
        self._z_loss_coeff = float(_cfg(config, "moe_z_loss_coeff") or 0.0)
        self.aux_losses: dict[str, torch.Tensor] = {}

    @classmethod
    def from_megatron(
        cls,
        block: nn.Module,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
    ) -> MegatronMoE:
        """This rank's share of the Megatron-style ``block`` (its router and shared experts
        are moved over, its experts copied; ``block`` is not used afterwards).

        Raises:
            ValueError: ``block`` is not supported (the reason is named).
        """
        reason = unsupported_reason(block)
        if reason is not None:
            raise ValueError(f"cannot swap {type(block).__name__}: {reason}")
        num_experts, hidden = block.router.weight.shape
        layout = expert_layout(block.experts)
        w1, w2 = _expert_weights(block.experts, layout, num_experts, hidden)
        experts = MegatronExperts(
            hidden,
            w1.shape[2] // 2,
            num_experts,
            layout,
            group,
            tuning,
            dtype=w1.dtype,
            device="meta",
        )
        experts.to_empty(device=w1.device)
        first, local = experts.expert_offset, experts.num_local_experts
        with torch.no_grad():
            experts.w1.copy_(w1[first : first + local])
            experts.w2.copy_(w2[first : first + local])
        experts.train(block.experts.training)
        new = cls(block.config, block.router, experts, getattr(block, "shared_experts", None))
        new.train(block.training)
        return new

    def route(self, tokens: torch.Tensor, sequences: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [T, H]`` (Megatron's ``[S, B, H]`` flattened, ``B = sequences``) ->
        ``topk_idx [T, K]``, ``topk_weights [T, K]`` (Megatron's), with the router losses
        attached in training and ``aux_losses`` set."""
        if sequences < 1 or tokens.shape[0] % sequences:
            raise ValueError(f"{tokens.shape[0]} tokens are not {sequences} sequences of S")
        weight = self.router.weight
        dtype = self.router_dtype or tokens.dtype
        logits = F.linear(tokens.to(dtype), weight.to(dtype))
        config = self.config
        self.aux_losses = {}
        losses_on = self.training and torch.is_grad_enabled()
        # Megatron scales by this rank's token count: the tensor/context-parallel group is 1.
        per_token = tokens.shape[0] if _cfg(config, "calculate_per_token_loss") else 1
        if losses_on and self._z_loss_coeff:
            z_loss = torch.logsumexp(logits, dim=-1).square().mean()
            self.aux_losses["z_loss"] = z_loss.detach()
            logits = _AttachLoss.apply(logits, z_loss * (self._z_loss_coeff * per_token), self)
        idx, probs = megatron_route(
            logits,
            self.top_k,
            score_function=_cfg(config, "moe_router_score_function"),
            pre_softmax=bool(_cfg(config, "moe_router_pre_softmax")),
            num_groups=_cfg(config, "moe_router_num_groups"),
            group_topk=_cfg(config, "moe_router_group_topk"),
            scaling_factor=_cfg(config, "moe_router_topk_scaling_factor"),
            expert_bias=getattr(self.router, "expert_bias", None),
        )
        if losses_on and self._balance_coeffs:
            probs = self._attach_balance_losses(probs, logits, sequences, per_token)
        counts = getattr(self.router, "local_tokens_per_expert", None)
        if self.training and isinstance(counts, torch.Tensor):
            # What Megatron's router accumulates for its expert_bias update after the step.
            with torch.no_grad():
                counts += torch.bincount(idx.flatten(), minlength=counts.numel()).to(counts.dtype)
        return idx, probs

    def _attach_balance_losses(
        self, probs: torch.Tensor, logits: torch.Tensor, sequences: int, per_token: int
    ) -> torch.Tensor:
        if _cfg(self.config, "moe_router_score_function") == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        # The balance is measured on a plain top-k of these scores, not on the routing's
        # choice (which a group limit or expert_bias may move).
        chosen = torch.zeros_like(scores, dtype=torch.int64)
        chosen.scatter_(1, scores.topk(self.top_k, dim=-1).indices, 1)
        for kind, coeff in self._balance_coeffs.items():
            groups = sequences if kind == "seq_aux_loss" else 1
            loss = _balance_loss(scores, chosen, self.top_k, groups)
            self.aux_losses[_BALANCE_LOSSES[kind]] = loss.detach()
            probs = _AttachLoss.apply(probs, loss * (coeff * per_token), self)
        return probs

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``hidden_states [S, B, H]`` (or ``[T, H]``) -> ``(output, None)``, output shaped
        like ``hidden_states``."""
        if (
            hidden_states.dim() > 3
            and "seq_aux_loss" in self._balance_coeffs
            and self.training
            and torch.is_grad_enabled()
        ):
            raise ValueError(
                "seq_aux_loss needs hidden_states [S, B, H] (or [T, H]), got shape "
                f"{tuple(hidden_states.shape)}"
            )
        sequences = hidden_states.shape[1] if hidden_states.dim() == 3 else 1
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        idx, probs = self.route(tokens, sequences)
        out = self.experts(tokens, idx, probs).reshape(hidden_states.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out, None

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}"


def _is_candidate(module: nn.Module) -> bool:
    router, experts = getattr(module, "router", None), getattr(module, "experts", None)
    return (
        not isinstance(module, MegatronMoE)
        and isinstance(router, nn.Module)
        and isinstance(getattr(router, "weight", None), torch.Tensor)
        and isinstance(experts, nn.Module)
    )


def swap_moe_blocks(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    tuning: str | _C.TuningParams = "",
    strict: bool = True,
) -> list[str]:
    """Replace every Megatron-style MoE block of ``model`` by ``MegatronMoE``, in place.

    Candidates are the submodules with a ``router`` holding a ``weight`` and an ``experts``
    module (``model`` itself included). Every rank must hold the whole model (all ``E`` experts
    of every block) and call this with the same ``group``; each keeps its share. For training,
    wrap afterwards with ``uniep.nn.data_parallel(model)``.

    Returns:
        The qualified names of the swapped blocks.

    Raises:
        ValueError: ``strict`` and a candidate is unsupported (named, with the reason), there
            is no candidate, or ``model`` is itself a block (use ``MegatronMoE.from_megatron``).
    """
    found = [(name, m) for name, m in model.named_modules() if _is_candidate(m)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no Megatron-style MoE block (a module with a router "
            "holding weight [E, H] and experts)"
        )
    if found[0][0] == "":
        raise ValueError(
            f"{type(model).__name__} is itself a Megatron-style block: use "
            "MegatronMoE.from_megatron(block) instead of swapping it in place"
        )
    return replace_found(
        model,
        found,
        unsupported_reason,
        lambda block: MegatronMoE.from_megatron(block, group, tuning),
        strict,
    )


def megatron_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every ``MegatronExperts``' experts gathered from all ranks,
    numbered ``0..E-1``: the state dict of the unswapped model
    (``expert_model_parallel_size=1``). Collective over every swapped block's group; each rank
    gets the whole dict."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, MegatronExperts) or module.world_size == 1:
            continue
        prefix = f"{name}." if name else ""
        group = dist.distributed_c10d._resolve_process_group(module.group_name)
        mine = module.to_megatron(module.w1.detach(), module.w2.detach(), prefix)
        for key in mine:
            state.pop(key)
        gathered = []
        for t in (module.w1.detach().contiguous(), module.w2.detach().contiguous()):
            parts = [torch.empty_like(t) for _ in range(module.world_size)]
            dist.all_gather(parts, t, group=group)
            gathered.append(torch.cat(parts))
        state.update(module.to_megatron(gathered[0], gathered[1], prefix))
    return state
