"""``MoELayer``: a drop-in expert-parallel SwiGLU MoE block built on ``torch.ops.uniep``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _C, distributed
from ..moe.expert_shards import (
    ddp_holds_other_shards,
    ddp_reduces,
    mark_expert_shards,
    marked_shards,
)
from ..tuning.params import as_string as tuning_string
from ..tuning.params import parse as parse_tuning
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "Experts",
    "MoELayer",
    "RowParallelLinear",
    "data_parallel",
    "expert_modules",
    "mark_expert_shards",
    "prepare_data_parallel",
    "route",
    "route_from_logits",
    "route_weights",
    "router_logits",
]


_SCORES = ("softmax", "sigmoid")


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """``x [T, H] @ router_weight [E, H]^T`` in float32 (float64 for float64 ``x``): ``[T, E]``.

    Routing decisions are made in fp32 whatever the activation dtype: bf16 logits tie often
    enough to change which experts a token picks. Hence also with autocast off here (under
    ``torch.autocast`` the matmul would run in its lower precision).
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(dtype), router_weight.to(dtype))


def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    if score == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"score must be one of {_SCORES}, got {score!r}")


def _gate(
    scores: torch.Tensor, idx: torch.Tensor, renormalize: bool, scaling: float
) -> torch.Tensor:
    weights = scores.gather(1, idx)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling if scaling != 1.0 else weights


def route_from_logits(
    logits: torch.Tensor,
    top_k: int,
    *,
    score: str = "softmax",
    renormalize: bool = True,
    scaling: float = 1.0,
    num_groups: int = 1,
    topk_groups: int | None = None,
    score_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing from router logits ``[T, E]``.

    ``scores = softmax(logits)`` or ``sigmoid(logits)``. The choice ranks ``scores + score_bias``
    (``[E]``, a load-balancing bias that steers the choice only, as DeepSeek-V3's
    ``e_score_correction_bias``). With ``num_groups > 1`` the experts form ``num_groups``
    contiguous groups, each scored by the sum of its two best choice values (its best one for
    groups of one expert); only experts of the ``topk_groups`` best groups can be picked. The
    ``top_k`` best experts' scores (without the bias) are the weights, renormalised to sum to 1
    if ``renormalize``, then multiplied by ``scaling``.

    Returns:
        ``topk_idx`` ``[T, top_k]`` int64 and ``topk_weights`` ``[T, top_k]`` of the logits'
        dtype, differentiable with respect to the logits.
    """
    scores = _scores(logits, score)
    choice = scores.detach()
    if score_bias is not None:
        choice = choice + score_bias.to(choice.dtype)
    num_experts = logits.shape[-1]
    if num_groups > 1:
        if num_experts % num_groups != 0:
            raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
        groups = topk_groups if topk_groups is not None else num_groups
        if not 1 <= groups <= num_groups:
            raise ValueError(f"topk_groups must be in [1, {num_groups}], got {groups}")
        per_group = num_experts // num_groups
        grouped = choice.reshape(-1, num_groups, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(groups, dim=-1).indices, True)
        keep = keep.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(-1, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices
    return idx, _gate(scores, idx, renormalize, scaling)


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, **options: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``x`` ``[T, H]`` by ``router_weight`` ``[E, H]``.

    By default softmax over all experts, the ``top_k`` largest kept and renormalised to sum to 1
    per token; ``options`` are ``route_from_logits``'s (score, renormalize, scaling, num_groups,
    topk_groups, score_bias).

    Returns:
        ``topk_idx`` ``[T, top_k]`` int64 and ``topk_weights`` ``[T, top_k]`` (float32, float64
        for float64 ``x``), differentiable with respect to ``x`` and ``router_weight`` through
        the weights.
    """
    return route_from_logits(router_logits(x, router_weight), top_k, **options)


def route_weights(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    topk_idx: torch.Tensor,
    *,
    score: str = "softmax",
    renormalize: bool = True,
    scaling: float = 1.0,
) -> torch.Tensor:
    """The gate weights ``route`` gives for a known ``topk_idx`` ``[T, K]``.

    Useful to differentiate routing without re-deciding it (the choice itself has no gradient).
    """
    scores = _scores(router_logits(x, router_weight), score)
    return _gate(scores, topk_idx, renormalize, scaling)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


_EXPERT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _check_expert_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float16:
        raise ValueError(
            "dtype float16 is not supported: the expert kernels (the CPU executor and the CUDA "
            "MegaKernel) compute in float32, bfloat16 or float64 only, and a silent upcast would "
            "double the experts' memory on every call; cast the model to bfloat16 (same size, "
            "wider range) or float32"
        )
    if dtype not in _EXPERT_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float64, got {dtype}")
    return dtype


def _parse_tuning(tuning: object) -> str:
    if isinstance(tuning, _C.TuningParams):
        return tuning_string(tuning)  # its given keys alone, as the ops read them
    if isinstance(tuning, str):
        parse_tuning(tuning)  # fail here, naming the bad key, not at first forward
        return tuning
    raise ValueError(f"tuning must be a str or TuningParams, got {type(tuning).__name__}")


def _setup_expert_group(
    module: nn.Module, group: dist.ProcessGroup | None, num_experts: int
) -> None:
    """Sets the group attributes an expert-parallel module carries (see ``Experts``)."""
    resolved = distributed.resolve_group(group)
    module.group_name = distributed.group_name(group)
    module.world_size = distributed.world_size(group)
    module.rank = distributed.rank(group)
    module.group_ranks = (0,) if resolved is None else tuple(dist.get_process_group_ranks(resolved))
    if num_experts % module.world_size != 0:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the group's world size "
            f"({module.world_size})"
        )
    module.num_local_experts = num_experts // module.world_size
    module.expert_offset = module.rank * module.num_local_experts
    # Set by prepare_data_parallel: the factor expert gradients are multiplied by.
    module._ddp_grad_scale = None


@torch.no_grad()
def _draw_experts(module: nn.Module) -> None:
    # Every global expert is drawn in order on every rank and the local ones kept: the ranks'
    # experts together equal a one-rank module's, and the RNG stays in step across ranks.
    w1, w2 = module.w1, module.w2
    if w1.device.type == "meta":
        return
    hidden, ffn = w1.shape[1], w2.shape[1]
    bound1, bound2 = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(ffn)
    first = module.expert_offset
    for e in range(module.num_experts):
        # Drawn in fp32 and rounded, so a bf16 module holds the rounded fp32 module.
        a = torch.empty((hidden, 2 * ffn), device=w1.device).uniform_(-bound1, bound1)
        b = torch.empty((ffn, hidden), device=w2.device).uniform_(-bound2, bound2)
        if first <= e < first + module.num_local_experts:
            w1[e - first].copy_(a)
            w2[e - first].copy_(b)


def _check_ddp(module: nn.Module) -> str | None:
    """An error if this forward runs inside a DDP that treats the experts as replicated."""
    if module.world_size == 1:
        return None  # one shard per rank is a replica: DDP's broadcast and average are right
    if torch.nn.parallel.DistributedDataParallel._active_ddp_module is None:
        return None
    reduced = ddp_reduces(module.w1, module.w2)
    if reduced and ddp_holds_other_shards(module.group_ranks):
        return (
            f"{type(module).__name__} holds experts [{module.expert_offset}, "
            f"{module.expert_offset + module.num_local_experts}) of {module.num_experts}, "
            f"different on each of the {module.world_size} ranks, but the enclosing "
            "DistributedDataParallel treats them as replicated: it overwrote them with rank 0's "
            "at construction and would average their gradients. Wrap the model with "
            "uniep.nn.data_parallel(model, ...) (or call uniep.nn.prepare_data_parallel(model) "
            "before DistributedDataParallel), which excludes the experts and scales their "
            "gradients"
        )
    if module._ddp_grad_scale is None:
        if reduced:
            # Expert data parallelism: the DDP peers hold the same experts (one per expert
            # group), so its broadcast and average are right for them.
            advice = (
                "averages these experts over their replicas (the DDP group meets the expert "
                f"group at this rank alone), but their gradients are sums over the expert "
                f"group's {module.world_size} ranks' tokens: scale them by "
                f"1/{module.world_size}, and reduce the replicated parameters (the router) over "
                "the expert group as well; uniep.nn.data_parallel serves expert parallelism "
                "over the whole data-parallel group only"
            )
        else:
            advice = (
                "averages the replicated gradients but this module's expert gradients are sums "
                "over the ranks' losses; use uniep.nn.prepare_data_parallel(model) to scale them"
            )
        warnings.warn(f"{type(module).__name__}: DistributedDataParallel {advice}", stacklevel=3)
        module._ddp_grad_scale = 1.0
    return None


def _run_experts(
    module: nn.Module, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """``moe_forward`` over ``module.w1`` / ``module.w2`` after the module-level checks.

    ``x`` ``[..., H]``, ``topk_idx`` / ``topk_weights`` ``[..., K]`` with the same leading
    dimensions (or already flattened to ``[T, K]``). Returns ``[..., H]``.
    """
    hidden, w1 = module.hidden, module.w1
    error = None
    if x.dim() < 1 or x.shape[-1] != hidden:
        error = f"x must be [..., H={hidden}], got shape {tuple(x.shape)}"
    elif x.dtype != w1.dtype:
        error = f"x must have the experts' dtype {w1.dtype}, got {x.dtype}"
    elif x.device != w1.device:
        error = f"x must be on the experts' device {w1.device}, got {x.device}"
    elif topk_idx.dim() < 1 or (
        tuple(topk_idx.shape[:-1]) != tuple(x.shape[:-1])
        and (topk_idx.dim() != 2 or topk_idx.shape[0] != x.numel() // hidden)
    ):
        error = (
            f"topk_idx must be [..., K] with the tokens of x {tuple(x.shape[:-1])}, "
            f"got shape {tuple(topk_idx.shape)}"
        )
    elif topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        error = f"topk_idx must be an integer tensor, got {topk_idx.dtype}"
    elif topk_weights.shape != topk_idx.shape:
        error = (
            f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    elif not topk_weights.dtype.is_floating_point:
        error = f"topk_weights must be floating point, got {topk_weights.dtype}"
    else:
        error = _check_ddp(module)
    if error is not None:
        # The other ranks are in this forward's exchange: they raise too, naming this rank.
        distributed.raise_on_all_ranks(module.group_name, "moe_forward", error, x.device.type)
    tokens = x.reshape(-1, hidden).contiguous()
    top_k = topk_idx.shape[-1]
    # [T, K] routing is small next to the tokens: int32 ids and bf16/fp16 weights (what most
    # routers give in a bf16 model) are converted here, differentiably for the weights.
    idx = topk_idx.reshape(-1, top_k).to(torch.int64).contiguous()
    weight_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    weights = topk_weights.reshape(-1, top_k).to(weight_dtype).contiguous()
    if tokens.is_cuda and 0 < _C.ranks_per_node(module.group_name) < module.world_size:
        # Across nodes: the rail between nodes, a CUDA runtime within each (uniep.moe_forward).
        from ..moe import multinode_cuda

        group = distributed.group_by_name(module.group_name)
        y = multinode_cuda.moe_forward(
            tokens, idx, weights, module.w1, module.w2, group, module.tuning
        )
        return y.reshape(x.shape)
    if tokens.is_cuda:
        from ..moe import ep

        ep.ensure_runtime(module.group_name, tokens.shape[0], hidden, top_k, module.num_experts)
    tuning = module.tuning
    if tuning != "" or torch.compiler.is_compiling():
        y = torch.ops.uniep.moe_forward(
            tokens, idx, weights, module.w1, module.w2, module.group_name, tuning
        )
        return y.reshape(x.shape)
    from ..tuning import cache as tune_cache

    def run(point: str) -> torch.Tensor:
        return torch.ops.uniep.moe_forward(
            tokens, idx, weights, module.w1, module.w2, module.group_name, point
        )

    y = tune_cache.call_with_cached_point(
        run, tokens, idx, module.ffn_hidden, module.num_experts, module.world_size
    )
    return y.reshape(x.shape)


class Experts(nn.Module):
    """SwiGLU experts split over a process group, fed by any router.

    ``y[t] = sum_k topk_weights[t, k] * (silu(x[t] @ W1g[e]) * (x[t] @ W1u[e])) @ W2[e]`` with
    ``e = topk_idx[t, k]`` (-1: unused slot), through ``torch.ops.uniep.moe_forward``: each token
    goes to the ranks holding its experts and comes back combined. This is the part of an MoE
    block after the router; use it to keep a model's own routing (sigmoid scores, grouped top-k,
    capacity rules, ...). Every rank of the group must call it, with its own tokens.

    Parameters: ``w1`` ``[E_local, H, 2I]`` (gate columns ``0..I-1``, up columns ``I..2I-1``) and
    ``w2`` ``[E_local, I, H]``, ``E_local = num_experts / world_size``; this rank holds global
    experts ``[rank * E_local, (rank + 1) * E_local)``. Initialised like ``MoELayer``'s experts
    (the concatenation over ranks equals a one-rank module's under the same seed).

    Gradients: ``w1.grad`` / ``w2.grad`` receive the contributions of every rank's tokens (the
    gradient of the sum of the ranks' losses). Under ``DistributedDataParallel``, which averages,
    use ``uniep.nn.data_parallel`` / ``prepare_data_parallel``; a DDP that would broadcast or
    average these shards makes the forward raise.

    Args:
        hidden: ``H``.
        ffn_hidden: ``I``, each expert's intermediate width.
        num_experts: ``E``, in total over the group, divisible by its world size.
        group: the process group the experts are split over (see ``uniep.moe_forward``).
        tuning: ``TuningParams`` or its string form, passed to every forward; ``""`` uses the
            point ``uniep.tune`` cached for each forward's shape, else the defaults (see
            ``uniep.moe_forward``).
        dtype: float32, bfloat16 or float64 (float16 is refused: the kernels have no float16
            path).
        device: parameter device.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.hidden = _positive_int("hidden", hidden)
        self.ffn_hidden = _positive_int("ffn_hidden", ffn_hidden)
        self.num_experts = _positive_int("num_experts", num_experts)
        dtype = _check_expert_dtype(torch.get_default_dtype() if dtype is None else dtype)
        self.tuning = _parse_tuning(tuning)
        _setup_expert_group(self, group, num_experts)
        local = self.num_local_experts
        self.w1 = nn.Parameter(
            torch.empty(local, hidden, 2 * ffn_hidden, dtype=dtype, device=device)
        )
        self.w2 = nn.Parameter(torch.empty(local, ffn_hidden, hidden, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw the experts (see the class docstring)."""
        _draw_experts(self)

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Run the experts.

        Args:
            x: ``[..., H]`` tokens of the experts' dtype.
            topk_idx: ``[..., K]`` (or ``[T, K]`` for ``T`` tokens) global expert ids in
                ``[0, E)`` or -1, any integer dtype (converted to int64).
            topk_weights: ``[..., K]`` gate weights, any floating dtype: converted to float32
                (float64 for float64 experts), differentiably.

        Returns:
            ``[..., H]`` like ``x``.
        """
        return _run_experts(self, x, topk_idx, topk_weights)

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
            f"num_experts={self.num_experts}, "
            f"local_experts=[{self.expert_offset}, {self.expert_offset + self.num_local_experts}), "
            f"world_size={self.world_size}, tuning={self.tuning!r}"
        )


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every ``Experts`` and ``MoELayer`` in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, (Experts, MoELayer)):
            yield name, module


def prepare_data_parallel(
    model: nn.Module, process_group: dist.ProcessGroup | None = None
) -> list[str]:
    """Make ``model`` safe to wrap in ``DistributedDataParallel`` over ``process_group``.

    DDP treats every parameter as a replica: it copies rank 0's values to the other ranks at
    construction and averages gradients over the group. Expert shards are not replicas. For
    every ``Experts`` / ``MoELayer`` of ``model`` split over more than one rank, this

    - adds ``w1`` and ``w2`` to the parameters DDP ignores (``_ddp_params_and_buffers_to_ignore``
      on ``model``, the module to wrap), so DDP neither overwrites nor all-reduces them;
    - scales their gradients by ``1 / D`` (``D`` = the DDP group's size): their gradient already
      sums every rank's contribution (the op sends it to the owning rank), while DDP's average
      makes the replicated parameters' gradients those of the mean of the ranks' losses; scaled,
      the whole model's gradient is that of the mean.

    Parameters marked with ``mark_expert_shards`` (the shards a module of your own passes to
    ``torch.ops.uniep.moe_forward``) are treated the same way.

    The experts' group must be the DDP group (expert parallelism over all data-parallel ranks);
    experts held whole on every rank (world size 1) stay with DDP. Calling it twice is harmless.

    Returns:
        The qualified names of the parameters DDP will ignore.

    Raises:
        ValueError: an expert group is neither the DDP group nor a world of one rank.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    size = len(ranks)
    names: list[str] = []
    for name, module in expert_modules(model):
        if module.world_size == 1:
            continue
        if module.group_ranks != ranks:
            raise ValueError(
                f"{name or type(module).__name__}: experts are split over ranks "
                f"{list(module.group_ranks)} but the data-parallel group is {list(ranks)}; only "
                "expert parallelism over the whole data-parallel group is supported (experts "
                "replicated over several expert groups would need their gradients reduced over "
                "the replicas, which this helper does not do)"
            )
        prefix = f"{name}." if name else ""
        names += [prefix + "w1", prefix + "w2"]
        for p in (module.w1, module.w2):
            _scale_grad(p, 1.0 / size)
        module._ddp_grad_scale = 1.0 / size
    for name, param, shard_ranks in marked_shards(model):
        if name in names or len(shard_ranks) == 1:
            continue
        if shard_ranks != ranks:
            raise ValueError(
                f"{name}: marked as an expert shard over ranks {list(shard_ranks)} but the "
                f"data-parallel group is {list(ranks)}; only expert parallelism over the whole "
                "data-parallel group is supported"
            )
        names.append(name)
        _scale_grad(param, 1.0 / size)
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    # DDP's reducer names a parameter of the wrapped module itself ".w1" (its module's name, "",
    # a dot, then the parameter's), where its broadcast and the list's users say "w1": a shard
    # held by the root module must be listed both ways, or its gradient is still averaged.
    dotted = {"." + n for n in names if "." not in n}
    model._ddp_params_and_buffers_to_ignore = sorted(ignored | set(names) | dotted)
    return names


def _scale_grad(param: nn.Parameter, scale: float) -> None:
    """Multiply ``param``'s gradient by ``scale`` through one hook, kept on the parameter with its
    factor: calling again with the same factor adds nothing, another factor replaces it."""
    held = getattr(param, "_uniep_ddp_hook", None)
    if held is not None and held[0] == scale:
        return
    if held is not None:
        held[1].remove()
    handle = param.register_hook(lambda g, s=scale: g * s)
    param._uniep_ddp_hook = (scale, handle)  # type: ignore[attr-defined]


def data_parallel(
    model: nn.Module, process_group: dist.ProcessGroup | None = None, **ddp_kwargs: object
) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model, process_group=..., **ddp_kwargs)`` after
    ``prepare_data_parallel(model, process_group)``: the replicated parameters are broadcast and
    averaged as usual, the expert shards are left alone and their gradients scaled to match."""
    prepare_data_parallel(model, process_group)
    return torch.nn.parallel.DistributedDataParallel(
        model, process_group=process_group, **ddp_kwargs
    )


class MoELayer(nn.Module):
    """Mixture of SwiGLU experts with top-k routing, experts split over a process group.

    The router (``nn.Linear(hidden, num_experts, bias=False)``, replicated on every rank) scores
    each token in fp32 (see ``route_from_logits`` for the options: softmax or sigmoid scores,
    renormalisation, scaling, grouped top-k, a choice-only score bias); by default softmax, the
    ``top_k`` best kept and renormalised to sum to 1 (Mixtral). ``torch.ops.uniep.moe_forward``
    then sends each token to the ranks holding its experts and combines the results. An optional
    shared expert (a replicated SwiGLU MLP every token goes through, optionally scaled by
    ``sigmoid(shared_gate(x))`` as in Qwen2-MoE) is added to the routed output. Gradients reach
    ``x``, the router (through the gate weights), the shared expert and this rank's experts;
    replicated parameters' gradients hold this rank's tokens' share only, to be reduced over ranks
    (``uniep.nn.data_parallel`` wraps DDP so that the expert shards are left out of it).

    Parameters: ``router.weight`` ``[E, H]``; ``w1`` ``[E_local, H, 2I]`` (gate then up
    projection); ``w2`` ``[E_local, I, H]``; ``E_local = num_experts / world_size``, and this rank
    holds global experts ``[rank * E_local, (rank + 1) * E_local)``; with a shared expert
    ``shared_w1`` ``[H, 2 * I_shared]``, ``shared_w2`` ``[I_shared, H]`` and optionally
    ``shared_gate.weight`` ``[1, H]``; with ``score_bias=True`` the buffer ``score_bias`` ``[E]``
    (zeros; the training loop adjusts it, it has no gradient).

    Initialisation follows ``nn.Linear`` (uniform in ``±1/sqrt(fan_in)``) and draws every global
    expert in order on every rank, keeping the local ones: under the same ``torch.manual_seed``
    the concatenation of all ranks' experts equals a one-rank layer's, and the RNG stays in step
    across ranks. The shared expert is drawn after the routed ones.

    Args:
        hidden: ``H``, the model width.
        ffn_hidden: ``I``, each expert's intermediate width.
        num_experts: ``E``, experts in total, divisible by the group's world size.
        top_k: experts per token, ``1 <= top_k <= num_experts``.
        group: process group the experts are split over (see ``uniep.moe_forward``); resolved
            once, here.
        tuning: ``TuningParams`` or its string form, passed to every forward; ``""`` uses the
            point ``uniep.tune`` cached for each forward's shape, else the defaults (see
            ``uniep.moe_forward``).
        dtype: parameter dtype (float32, bfloat16 or float64; float16 is refused); the router
            stays float32 (float64 for float64 layers).
        device: parameter device.
        score: ``"softmax"`` or ``"sigmoid"``.
        renormalize: renormalise the ``top_k`` kept scores to sum to 1.
        scaling: factor on the gate weights (DeepSeek-V3's ``routed_scaling_factor``).
        num_groups, topk_groups: grouped top-k (DeepSeek-V3's ``n_group``, ``topk_group``).
        score_bias: keep a choice-only bias buffer ``[E]``.
        shared_ffn_hidden: intermediate width of a shared expert; 0 for none.
        shared_gate: scale the shared expert by ``sigmoid(x @ shared_gate.weight^T)``.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        score: str = "softmax",
        renormalize: bool = True,
        scaling: float = 1.0,
        num_groups: int = 1,
        topk_groups: int | None = None,
        score_bias: bool = False,
        shared_ffn_hidden: int = 0,
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.hidden = _positive_int("hidden", hidden)
        self.ffn_hidden = _positive_int("ffn_hidden", ffn_hidden)
        self.num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        if score not in _SCORES:
            raise ValueError(f"score must be one of {_SCORES}, got {score!r}")
        num_groups = _positive_int("num_groups", num_groups)
        if num_experts % num_groups != 0:
            raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
        topk_groups = num_groups if topk_groups is None else topk_groups
        if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_groups must be an int in [1, {num_groups}], got {topk_groups}")
        if topk_groups * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"topk_groups ({topk_groups}) groups of {num_experts // num_groups} experts "
                f"cannot hold top_k ({top_k}) experts"
            )
        if isinstance(shared_ffn_hidden, bool) or not isinstance(shared_ffn_hidden, int):
            raise ValueError(f"shared_ffn_hidden must be an int, got {shared_ffn_hidden!r}")
        if shared_ffn_hidden < 0 or (shared_gate and shared_ffn_hidden == 0):
            raise ValueError(
                f"shared_ffn_hidden must be >= 0 (> 0 with shared_gate), got {shared_ffn_hidden}"
            )
        self.score = score
        self.renormalize = bool(renormalize)
        self.scaling = float(scaling)
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.shared_ffn_hidden = shared_ffn_hidden
        dtype = _check_expert_dtype(torch.get_default_dtype() if dtype is None else dtype)
        self.tuning = _parse_tuning(tuning)
        _setup_expert_group(self, group, num_experts)

        router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=router_dtype, device=device)
        local = self.num_local_experts
        self.w1 = nn.Parameter(
            torch.empty(local, hidden, 2 * ffn_hidden, dtype=dtype, device=device)
        )
        self.w2 = nn.Parameter(torch.empty(local, ffn_hidden, hidden, dtype=dtype, device=device))
        if score_bias:
            self.register_buffer(
                "score_bias", torch.zeros(num_experts, dtype=router_dtype, device=device)
            )
        else:
            self.score_bias = None
        self.shared_w1 = self.shared_w2 = self.shared_gate = None
        if shared_ffn_hidden:
            self.shared_w1 = nn.Parameter(
                torch.empty(hidden, 2 * shared_ffn_hidden, dtype=dtype, device=device)
            )
            self.shared_w2 = nn.Parameter(
                torch.empty(shared_ffn_hidden, hidden, dtype=dtype, device=device)
            )
            if shared_gate:
                self.shared_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype, device=device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw the router, the experts, then the shared expert (see the class docstring)."""
        self.router.reset_parameters()
        if self.score_bias is not None:
            self.score_bias.zero_()  # as built: a meta-device layer's buffer holds no values
        _draw_experts(self)
        if self.shared_w1 is not None and self.shared_w1.device.type != "meta":
            for w in (self.shared_w1, self.shared_w2):
                bound = 1.0 / math.sqrt(w.shape[0])
                w.copy_(torch.empty(w.shape, device=w.device).uniform_(-bound, bound))
            if self.shared_gate is not None:
                self.shared_gate.reset_parameters()

    def _routing_options(self) -> dict[str, object]:
        return {
            "score": self.score,
            "renormalize": self.renormalize,
            "scaling": self.scaling,
            "num_groups": self.num_groups,
            "topk_groups": self.topk_groups,
            "score_bias": self.score_bias,
        }

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx, topk_weights)``, each ``[T, top_k]``, for ``x [T, H]`` (see ``route``)."""
        return route(x, self.router.weight, self.top_k, **self._routing_options())

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output ``[T, H]`` for ``x [T, H]`` (with a shared expert)."""
        h = x @ self.shared_w1
        y = (
            F.silu(h[:, : self.shared_ffn_hidden]) * h[:, self.shared_ffn_hidden :]
        ) @ self.shared_w2
        if self.shared_gate is not None:
            y = torch.sigmoid(self.shared_gate(x)) * y
        return y

    def forward(
        self, x: torch.Tensor, return_router_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[..., H]`` of the layer's dtype -> ``[..., H]``.

        With ``return_router_logits``, also the router logits ``[T, E]`` (float32, T = tokens
        of ``x``), differentiable, for auxiliary (load-balancing, z-) losses.
        """
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
        tokens = x.reshape(-1, self.hidden)
        logits = router_logits(tokens, self.router.weight)
        topk_idx, topk_weights = route_from_logits(logits, self.top_k, **self._routing_options())
        y = _run_experts(self, tokens, topk_idx, topk_weights)
        if self.shared_w1 is not None:
            y = y + self.shared_expert(tokens)
        y = y.reshape(x.shape)
        return (y, logits) if return_router_logits else y

    def extra_repr(self) -> str:
        routing = f"score={self.score}, renormalize={self.renormalize}"
        if self.scaling != 1.0:
            routing += f", scaling={self.scaling}"
        if self.num_groups > 1:
            routing += f", num_groups={self.num_groups}, topk_groups={self.topk_groups}"
        if self.score_bias is not None:
            routing += ", score_bias"
        if self.shared_w1 is not None:
            routing += f", shared_ffn_hidden={self.shared_ffn_hidden}"
            routing += ", shared_gate" if self.shared_gate is not None else ""
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, "
            f"num_experts={self.num_experts}, top_k={self.top_k}, {routing}, "
            f"local_experts=[{self.expert_offset}, {self.expert_offset + self.num_local_experts}), "
            f"world_size={self.world_size}, tuning={self.tuning!r}"
        )
