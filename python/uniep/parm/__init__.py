"""Parm: MoE layers under MP+EP+ESP training with the schedules of arXiv 2407.00599.

``plan(...)`` prices the three schedules (``baseline``: DeepSpeed-MoE with tensor-parallel experts;
``s1`` and ``s2``: Parm's) with the alpha-beta cost model and returns the fastest;
``fit_alpha_beta`` fits a collective's alpha and beta from measured (size, seconds) samples;
``ParmMoELayer`` is the layer, run by the step-list interpreter (``uniep.parm.executor``): the CPU
executor over gloo for CPU tensors (``uniep.parm.cpu``), the CUDA executor over UniEP's
collectives for CUDA tensors (``uniep.parm.cuda``). The step
lists and the cost model are C++ (``cpp/core/parm``, ``include/uniep/parm.hpp``); docs/parm.md
says what follows the paper and what is a reconstruction.

Rank layout (``rank_layout``): MP group = N consecutive ranks, EP group = ranks with the same MP
index; ``new_groups(mp_size)`` makes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _C

# ops registers the CPU kernels, fake kernels and autograd of torch.ops.uniep.parm_moe_*.
from . import ops  # noqa: F401
from .agreement import join_as_failed
from .cpu import CapacityError, Groups

__all__ = [
    "CLUSTERS",
    "CapacityError",
    "DEFAULT_DTYPE",
    "ParmMoELayer",
    "ParmPlan",
    "SCHEDULES",
    "cluster_spec",
    "cost_model",
    "fit_alpha_beta",
    "new_groups",
    "plan",
    "rank_layout",
    "saa_chunk_plan",
]

SCHEDULES = ("baseline", "s1", "s2")
rank_layout = _C.parm.rank_layout

# Described clusters (per-GPU bandwidths: a node's NICs are shared by its GPUs). Rough public
# figures, for the simulator and for schedule="auto" before a profile exists; a fitted profile
# (uniep parm profile) replaces the communication coefficients.
CLUSTERS: dict[str, dict[str, float]] = {
    # 8x H100 SXM per node, NVLink 4, 8x 400 Gb/s InfiniBand (one NIC per GPU).
    "h100-ib": dict(
        gpus_per_node=8,
        nodes=4,
        intra_alpha=4e-6,
        intra_bw=300e9,
        inter_alpha=8e-6,
        inter_bw=40e9,
        peak_flops=600e12,
        mem_bw=3e12,
        kernel_alpha=5e-6,
    ),
    # FSMoE's testbed A: 8x RTX A6000 per node (PCIe 4.0 between most pairs), one 200 Gb/s NIC.
    "a6000-ib": dict(
        gpus_per_node=8,
        nodes=4,
        intra_alpha=8e-6,
        intra_bw=20e9,
        inter_alpha=12e-6,
        inter_bw=3e9,
        peak_flops=75e12,
        mem_bw=768e9,
        kernel_alpha=8e-6,
    ),
    # FSMoE's testbed B: 4x RTX 2080 Ti per node over PCIe 3.0, one 100 Gb/s NIC, 8 nodes.
    "2080ti-ib": dict(
        gpus_per_node=4,
        nodes=8,
        intra_alpha=10e-6,
        intra_bw=10e9,
        inter_alpha=15e-6,
        inter_bw=3e9,
        peak_flops=27e12,
        mem_bw=616e9,
        kernel_alpha=8e-6,
    ),
}


def cluster_spec(cluster: str | dict[str, float] | Any = "h100-ib") -> Any:
    """A ``ClusterSpec`` from a preset name (``CLUSTERS``), a dict of its fields, or itself."""
    if isinstance(cluster, _C.parm.ClusterSpec):
        return cluster
    fields = CLUSTERS.get(cluster) if isinstance(cluster, str) else cluster
    if fields is None:
        raise ValueError(f"cluster must be one of {sorted(CLUSTERS)} or a dict, got {cluster!r}")
    spec = _C.parm.ClusterSpec()
    for name, value in fields.items():
        if not hasattr(spec, name):
            raise ValueError(f"cluster: unknown field {name!r}")
        setattr(spec, name, type(getattr(spec, name))(value))
    return spec


def cost_model(
    world_size: int, mp_size: int, cluster: Any = "h100-ib", gpus_per_node: int | None = None
) -> Any:
    """The ring-model ``CostModel`` of a described cluster for this layout."""
    spec = cluster_spec(cluster)
    gpn = gpus_per_node or spec.gpus_per_node
    return _C.parm.cost_model_from_cluster(spec, rank_layout(world_size, mp_size, gpn))


def fit_alpha_beta(sizes: list[float], seconds: list[float]) -> Any:
    """Least-squares ``t = alpha + beta * n``; the result has ``alpha``, ``beta``, ``r2``."""
    return _C.parm.fit_alpha_beta([float(s) for s in sizes], [float(t) for t in seconds])


@dataclass
class ParmPlan:
    """The chosen schedule and the predicted seconds of all three (forward, backward, total)."""

    schedule: str
    predicted: dict[str, dict[str, float]]
    shape: Any

    @property
    def speedup(self) -> float:
        """Predicted baseline time over the chosen schedule's."""
        return self.predicted["baseline"]["total"] / self.predicted[self.schedule]["total"]

    def steps(self, schedule: str | None = None, pass_: str = "forward") -> Any:
        return _C.parm.build_steps(self.shape, schedule or self.schedule, pass_)


def saa_chunk_plan(
    shape: Any, schedule: str, model: Any = None, chunks: int | str = "auto"
) -> list[int]:
    """The ``chunks`` argument of ``torch.ops.uniep.parm_moe_forward`` for ``schedule`` on
    ``shape``: one count per step of its forward list, then of its backward list; 1 off the SAA
    pairs. "auto": the counts ``model`` priced the pairs at (``Pricing.chunks``); an int: that
    count on every pair."""
    out: list[int] = []
    for pass_ in ("forward", "backward"):
        steps = _C.parm.build_steps(shape, schedule, pass_)
        if chunks == "auto":
            out += [int(c) for c in _C.parm.price(steps, model).chunks]
        else:
            out += [chunks if s.overlap_with >= 0 else 1 for s in steps.steps]
    return out


# The experts' dtype of ParmMoELayer and of plan() alike, so that plan() with the layer's
# arguments names the schedule the layer's "auto" runs. float32: what the CPU executor and the
# tests run; bf16 training (the CUDA executor's dtype) passes torch.bfloat16 to both.
DEFAULT_DTYPE = torch.float32


def _dtype_bytes(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def plan(
    world_size: int,
    mp_size: int,
    tokens: int,
    hidden: int,
    ffn_hidden: int,
    num_experts: int,
    top_k: int,
    capacity_factor: float = 1.0,
    dtype: torch.dtype | int = DEFAULT_DTYPE,
    gpus_per_node: int | None = None,
    cluster: Any = "h100-ib",
    model: Any = None,
) -> ParmPlan:
    """Price baseline, S1 and S2 (forward + backward) and pick the fastest.

    ``tokens`` is S, the tokens entering the layer per MP group; ``model`` (a ``CostModel``, e.g.
    from a profile) overrides the one derived from ``cluster``. ``gpus_per_node`` defaults to the
    cluster's; it decides which groups cross nodes. ``dtype`` (or its size in bytes) is the
    experts' and the moved rows' dtype; its default is ``ParmMoELayer``'s (``DEFAULT_DTYPE``,
    float32), so the layer's ``schedule="auto"`` runs what ``plan`` names for the same
    arguments. Pass ``torch.bfloat16`` to price bf16 training."""
    spec = cluster_spec(cluster)
    gpn = gpus_per_node or spec.gpus_per_node
    shape = _C.parm.ParmShape(
        world_size=world_size,
        mp_size=mp_size,
        gpus_per_node=gpn,
        tokens=tokens,
        hidden=hidden,
        ffn_hidden=ffn_hidden,
        num_experts=num_experts,
        top_k=top_k,
        capacity_factor=capacity_factor,
        dtype_bytes=_dtype_bytes(dtype),
    )
    if model is None:
        model = _C.parm.cost_model_from_cluster(spec, rank_layout(world_size, mp_size, gpn))
    best, costs = _C.parm.choose(shape, model)
    predicted = {
        name: {"forward": f, "backward": b, "total": f + b} for name, (f, b) in costs.items()
    }
    return ParmPlan(schedule=best, predicted=predicted, shape=shape)


def new_groups(mp_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(mp_group, ep_group) of this rank in the Parm layout; every rank must call it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world, mp_size, mp_size)
    mine: dict[str, dist.ProcessGroup] = {}
    # new_group is collective over the world: create every group, in the same order everywhere.
    for g in range(layout.ep_size):
        grp = dist.new_group(layout.mp_group(g * mp_size))
        if layout.ep_index(rank) == g:
            mine["mp"] = grp
    for m in range(mp_size):
        grp = dist.new_group(layout.ep_group(m))
        if layout.mp_index(rank) == m:
            mine["ep"] = grp
    return mine["mp"], mine["ep"]


def _check_plan_args(schedule: Any, chunks: Any) -> None:
    count = isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1
    if chunks != "auto" and not count:
        raise ValueError(f"chunks must be 'auto' or an int >= 1, got {chunks!r}")
    if schedule not in ("auto", *SCHEDULES):
        raise ValueError(f"schedule must be 'auto', 'baseline', 's1' or 's2', got {schedule!r}")


def _same(a: tuple, b: tuple | None) -> bool:
    """Element by element: the same object, or equal values of one type (a dict's copy)."""
    return b is not None and all(
        x is y or (type(x) is type(y) and isinstance(x, (str, int, float, dict)) and x == y)
        for x, y in zip(a, b, strict=True)
    )


# Token counts whose plans a layer keeps: a job with ragged batches meets many, each a few hundred
# bytes; past this the oldest is dropped (and planned again if it comes back).
_PLANS_KEPT = 1024


class ParmMoELayer(nn.Module):
    """An MoE block whose dense neighbours are tensor-parallel over ``mp_group`` (its input is
    replicated there) and whose experts are spread over ``ep_group`` and sharded over the MP group.

    Args:
        mp_group, ep_group: this rank's groups (``new_groups``); None for a group of one.
        hidden (M), ffn_hidden (H, split N ways), num_experts (E, E / G per MP group), top_k.
        capacity_factor: per-(slice, expert) capacity c = ceil(k*f*S/(E*N)); <= 0: no drops.
        schedule: "auto" (cost model), "baseline", "s1" or "s2". All give the same result.
        overflow: "error" (default: every rank raises CapacityError) or "drop" (pairs beyond
            capacity contribute nothing; counted in ``last_stats['dropped']``).
        dtype: the experts' dtype (``w1``, ``w2``, and ``x``); float32 by default, as ``plan``'s.
        cluster / gpus_per_node / model: what "auto" prices (see ``plan``: with the same
            arguments and dtype it names the schedule the layer runs).
        chunks: how many chunks each SAA pair is pipelined in: "auto" (default) the count the
            cost model priced the pair at (``uniep._C.parm.price(steps, model).chunks``, from
            ``model`` or ``cluster``, whether the schedule is "auto" or named), so the layer
            runs what was priced; an int >= 1: that count for every pair. All give the same
            result.

    Parameters: ``gate`` [M, E] float32 (replicated; under S1 its gradient is summed over the MP
    group by the backward step list), ``w1`` [E_loc, M, H/N], ``w2`` [E_loc, H/N, M]: this rank's
    shards of its MP group's experts. Expert e: y = gelu(x W1_e) W2_e. Under one manual_seed on
    every rank, the shards of all ranks together are one full layer's weights (``load_full``).

    forward(x [..., M]) -> y [..., M]; ``self.l_aux`` is GShard's load-balancing loss of the MP
    group's tokens (differentiable), ``self.last_schedule``, ``self.last_chunks`` (the SAA chunk
    counts per step, forward list then backward list) and ``self.last_stats`` say what ran.
    """

    def __init__(
        self,
        mp_group: dist.ProcessGroup | None,
        ep_group: dist.ProcessGroup | None,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float = 1.0,
        schedule: str = "auto",
        overflow: str = "error",
        dtype: torch.dtype = DEFAULT_DTYPE,
        cluster: Any = "h100-ib",
        gpus_per_node: int | None = None,
        model: Any = None,
        chunks: int | str = "auto",
    ) -> None:
        super().__init__()
        _check_plan_args(schedule, chunks)
        if overflow not in ("error", "drop"):
            raise ValueError(f"overflow must be 'error' or 'drop', got {overflow!r}")
        N = dist.get_world_size(mp_group) if mp_group is not None else 1
        G = dist.get_world_size(ep_group) if ep_group is not None else 1
        m = dist.get_rank(mp_group) if mp_group is not None else 0
        g = dist.get_rank(ep_group) if ep_group is not None else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        layout_ok = N * G == world and rank == g * N + m
        if layout_ok and mp_group is not None and ep_group is not None:
            # The ranks themselves: a swapped pair of groups can pass the size and index checks.
            lay = rank_layout(world, N, N)
            mp_ranks = dist.get_process_group_ranks(mp_group)
            ep_ranks = dist.get_process_group_ranks(ep_group)
            layout_ok = mp_ranks == lay.mp_group(rank) and ep_ranks == lay.ep_group(rank)
        if not layout_ok:
            raise ValueError(
                f"mp_group/ep_group: expected the layout of uniep.parm.rank_layout (MP group = N "
                f"consecutive ranks, EP group = ranks with the same MP index; new_groups makes "
                f"them), got N={N}, G={G}, world={world}, rank {rank} at mp index {m}, "
                f"ep index {g}"
            )
        if ffn_hidden % N:
            raise ValueError(
                f"ffn_hidden ({ffn_hidden}) must divide by the MP size {N} (each rank of an MP "
                "group holds ffn_hidden / N columns of every expert)"
            )
        if num_experts % G:
            raise ValueError(
                f"num_experts ({num_experts}) must divide by the EP size {G} (each MP group "
                "holds num_experts / G experts)"
            )
        self.groups = Groups(mp=mp_group, ep=ep_group, mp_size=N, ep_size=G, mp_index=m, ep_index=g)
        self.hidden, self.ffn_hidden, self.num_experts, self.top_k = (
            hidden,
            ffn_hidden,
            num_experts,
            top_k,
        )
        self.capacity_factor, self.schedule, self.overflow = capacity_factor, schedule, overflow
        # plan()'s default: the cluster's GPUs per node (one default, one answer for "auto").
        self.cluster, self.model = cluster, model
        self.gpus_per_node = gpus_per_node or cluster_spec(cluster).gpus_per_node
        self.chunks = chunks
        E_loc, Hn = num_experts // G, ffn_hidden // N
        self.gate = nn.Parameter(torch.empty(hidden, num_experts, dtype=torch.float32))
        self.w1 = nn.Parameter(torch.empty(E_loc, hidden, Hn, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(E_loc, Hn, hidden, dtype=dtype))
        self.reset_parameters()
        self.l_aux: torch.Tensor | None = None
        self.last_schedule: str | None = None
        self.last_chunks: list[int] = []
        self._stats: torch.Tensor | None = None
        self._last_stats: dict[str, int] | None = None
        # Per token count; emptied when an input of the plan changes (_plan_inputs).
        self._plans: dict[int, tuple[str, list[int]]] = {}
        self._plan_key: tuple | None = None
        self._shape(1)  # ValueError now, naming the argument, rather than at the first forward

    def reset_parameters(self) -> None:
        # The full layer's weights on every rank (same seed), then this rank's shards: the shards
        # of all ranks together equal a one-rank layer's.
        E, M, H = self.num_experts, self.hidden, self.ffn_hidden
        gate = torch.empty(M, E).uniform_(-1 / math.sqrt(M), 1 / math.sqrt(M))
        w1 = torch.empty(E, M, H).uniform_(-1 / math.sqrt(M), 1 / math.sqrt(M))
        w2 = torch.empty(E, H, M).uniform_(-1 / math.sqrt(H), 1 / math.sqrt(H))
        self.load_full(gate, w1, w2)

    @torch.no_grad()
    def load_full(self, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """Set this rank's shards from a full layer: gate [M, E], w1 [E, M, H], w2 [E, H, M]."""
        gr = self.groups
        E_loc, Hn = self.num_experts // gr.ep_size, self.ffn_hidden // gr.mp_size
        es = slice(gr.ep_index * E_loc, (gr.ep_index + 1) * E_loc)
        hs = slice(gr.mp_index * Hn, (gr.mp_index + 1) * Hn)
        self.gate.copy_(gate)
        self.w1.copy_(w1[es, :, hs])
        self.w2.copy_(w2[es, hs, :])

    def _shape(self, tokens: int) -> Any:
        gr = self.groups
        return _C.parm.ParmShape(
            world_size=gr.mp_size * gr.ep_size,
            mp_size=gr.mp_size,
            gpus_per_node=self.gpus_per_node,
            tokens=tokens,
            hidden=self.hidden,
            ffn_hidden=self.ffn_hidden,
            num_experts=self.num_experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            dtype_bytes=_dtype_bytes(self.w1.dtype),
        )

    def _cost_model(self) -> Any:
        gr = self.groups
        return self.model or cost_model(
            gr.mp_size * gr.ep_size, gr.mp_size, self.cluster, self.gpus_per_node
        )

    def _plan_inputs(self) -> tuple:
        """What the plan depends on besides the token count: the attributes a caller may assign
        after a forward (``layer.schedule = "s1"``) and the parameters' dtype (``.to()``)."""
        cluster = dict(self.cluster) if isinstance(self.cluster, dict) else self.cluster
        return (
            self.schedule,
            self.chunks,
            self.model,
            cluster,
            self.gpus_per_node,
            self.hidden,
            self.ffn_hidden,
            self.num_experts,
            self.top_k,
            self.capacity_factor,
            self.w1.dtype,
        )

    def _plan(self, tokens: int) -> tuple[str, list[int]]:
        """(schedule, SAA chunk counts of its forward then backward list) for ``tokens``."""
        key = self._plan_inputs()
        if not _same(key, self._plan_key):
            _check_plan_args(self.schedule, self.chunks)
            self._plans.clear()
            self._plan_key = key
        if tokens not in self._plans:
            shape, name = self._shape(tokens), self.schedule
            model = self._cost_model() if "auto" in (name, self.chunks) else None
            if name == "auto":
                name = _C.parm.choose(shape, model)[0]
            if len(self._plans) >= _PLANS_KEPT:  # ragged batches: the oldest token count goes
                del self._plans[next(iter(self._plans))]
            self._plans[tokens] = (name, saa_chunk_plan(shape, name, model, self.chunks))
        return self._plans[tokens]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            error = self._check_input(x)
            if error:
                raise ValueError(error)
            flat = x.reshape(-1, self.hidden).contiguous()
            name, chunks = self._plan(flat.shape[0])
        except ValueError as e:
            # The other ranks wait in the forward's routing agreement: they raise with this
            # reason at once (uniep.parm.agreement), instead of at the timeout.
            join_as_failed(f"ParmMoELayer.forward: {e}")
            raise
        gr = self.groups
        y, self.l_aux, _, _, stats = torch.ops.uniep.parm_moe_forward(
            flat,
            self.gate,
            self.w1,
            self.w2,
            gr.mp.group_name if gr.mp is not None else "",
            gr.ep.group_name if gr.ep is not None else "",
            self.top_k,
            float(self.capacity_factor),
            name,
            self.overflow,
            chunks,
        )
        # Read on the host when asked (last_stats): reading them here would wait for the
        # forward's kernels before the layer returns.
        self._stats, self._last_stats = stats, None
        self.last_schedule, self.last_chunks = name, chunks
        return y.reshape(x.shape)

    def _check_input(self, x: torch.Tensor) -> str:
        """Why ``x`` cannot enter this layer, or "" if it can."""
        if not isinstance(x, torch.Tensor):
            return f"x: expected a tensor [..., hidden={self.hidden}], got {type(x).__name__}"
        if x.dim() == 0 or x.shape[-1] != self.hidden:
            return f"x: last dimension must be hidden={self.hidden}, got {tuple(x.shape)}"
        if x.numel() == 0:
            return f"x: expected at least one token, got shape {tuple(x.shape)}"
        if x.device.type not in ("cpu", "cuda"):
            return f"x: expected a CPU or CUDA tensor, got device {x.device}"
        if x.device != self.w1.device:
            return (
                f"x: expected the parameters' device {self.w1.device} (move the layer with "
                f".to()), got {x.device}"
            )
        return ""

    @property
    def last_stats(self) -> dict[str, int]:
        """The last forward's ``dropped`` pairs, ``max_demand`` and ``slice_capacity`` (empty
        before the first). The first read after a forward waits for that forward's kernels."""
        if self._last_stats is None:
            if self._stats is None:
                return {}
            E = self.num_experts
            dropped, demand, capacity = (int(v) for v in self._stats[E : E + 3].tolist())
            self._last_stats = {
                "dropped": dropped,
                "max_demand": demand,
                "slice_capacity": capacity,
            }
        return self._last_stats
