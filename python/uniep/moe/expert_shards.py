"""Expert shards under data parallelism: marking them, and catching the DDP trap.

``DistributedDataParallel`` treats every parameter as a replica: it copies rank 0's values over
the other ranks at construction and averages the gradients. An expert-parallel layer's ``w1`` /
``w2`` are shards (rank ``r`` holds experts ``[r * E_local, (r + 1) * E_local)``), not replicas,
so plain DDP makes every rank train rank 0's experts, silently. ``uniep.nn.Experts`` and
``MoELayer`` are known to ``uniep.nn.prepare_data_parallel``; a module of the user's own that
calls ``torch.ops.uniep.moe_forward`` on its shards marks them with :func:`mark_expert_shards`,
and ``prepare_data_parallel`` / ``data_parallel`` then treat them alike.

The op side (:func:`check_distinct_shards`), for trainable shards at more than one rank: a call
made inside a running DDP that reduces them as replicas of other ranks' shards (its group holds
two ranks of the experts' group; a DDP over the experts' replicas, one an expert group, is
expert data parallelism and is left alone) raises at once; and the first time a
pair of ``(w1, w2)`` parameters goes through ``moe_forward``, the ranks compare a checksum of
them, since shards of different experts that are bit-identical on every rank are what DDP's
broadcast leaves behind (a model wrapped in DDP but called through ``ddp.module``, say). Either
raises on every rank, naming the fix. Marked shards are trusted (a test may give every rank the
same values on purpose).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "check_distinct_shards",
    "ddp_holds_other_shards",
    "ddp_reduces",
    "is_expert_shard",
    "mark_expert_shards",
    "marked_shards",
    "refuse_ddp_replicas",
]

# The attribute a marked parameter carries: the ranks of the group its experts are split over.
_MARK = "_uniep_expert_shard_ranks"

# Per DistributedDataParallel instance: the ids of the parameters it reduces (read once; a
# forward inside DDP asks at every call).
_DDP_PARAM_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# (id(w1), id(w2)) of the pairs already compared, dropped when either tensor dies.
_CHECKED: dict[tuple[int, int], tuple[weakref.ref, weakref.ref]] = {}


def mark_expert_shards(
    module: nn.Module,
    params: Iterable[str | nn.Parameter] | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[str]:
    """Mark parameters of ``module`` as expert shards split over ``group``.

    For a module of your own that calls ``torch.ops.uniep.moe_forward`` (or
    ``uniep.moe_forward``) on its experts' ``w1`` / ``w2``: ``uniep.nn.prepare_data_parallel`` and
    ``uniep.nn.data_parallel`` then leave them out of DDP's broadcast and all-reduce and scale
    their gradients by ``1 / D``, as for ``uniep.nn.Experts``; and ``moe_forward`` trusts them
    when they are equal on every rank.

    Args:
        module: the module holding the shards (any submodule of the model to wrap).
        params: the shards, by name (``"w1"``, ``"experts.w2"``, relative to ``module``) or as
            the parameters themselves; None marks every parameter named ``w1`` or ``w2`` (at any
            depth) of ``module``.
        group: the process group the experts are split over (None: ``uniep.init``'s group, else
            WORLD, else one rank).

    Returns:
        The names (relative to ``module``) of the parameters marked.

    Raises:
        ValueError: a name is not a parameter of ``module``, a parameter does not belong to it,
            or ``params`` is None and ``module`` has no ``w1`` / ``w2``.
    """
    from ..distributed import resolve_group

    resolved = resolve_group(group)
    ranks = tuple(dist.get_process_group_ranks(resolved)) if resolved is not None else (0,)
    named = dict(module.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    if params is None:
        chosen = [n for n in named if n.rsplit(".", 1)[-1] in ("w1", "w2")]
        if not chosen:
            raise ValueError(
                f"params: {type(module).__name__} has no parameter named w1 or w2; name the "
                "expert shards (e.g. params=['gate_up', 'down'])"
            )
    else:
        chosen = []
        for p in params:
            if isinstance(p, str):
                if p not in named:
                    raise ValueError(
                        f"params: {p!r} is not a parameter of {type(module).__name__} "
                        f"(it has {sorted(named)})"
                    )
                chosen.append(p)
            elif isinstance(p, torch.Tensor) and id(p) in by_id:
                chosen.append(by_id[id(p)])
            else:
                raise ValueError(
                    f"params: every entry must be a name or a parameter of "
                    f"{type(module).__name__}, got {type(p).__name__}"
                    + (f" of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else "")
                )
    for n in chosen:
        setattr(named[n], _MARK, ranks)
    return chosen


def ddp_reduces(*tensors: torch.Tensor) -> bool:
    """Whether a DistributedDataParallel forward is running and reduces (broadcasts at its
    construction, averages in backward) any of ``tensors`` as a replica."""
    ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
    if ddp is None:
        return False
    ids = _DDP_PARAM_IDS.get(ddp)
    if ids is None:
        ids = {id(p) for p in ddp._module_parameters}
        _DDP_PARAM_IDS[ddp] = ids
    return any(id(t) in ids for t in tensors)


def ddp_holds_other_shards(expert_ranks: Sequence[int]) -> bool:
    """Whether the running DistributedDataParallel's group holds two ranks of ``expert_ranks``
    (the group the experts are split over): only then does it take one rank's shard for
    another's. A DDP group that meets the experts' group at this rank alone (expert data
    parallelism: the DDP peers hold the same experts, one per expert group) reduces true
    replicas."""
    ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
    if ddp is None:
        return False
    group = getattr(ddp, "process_group", None)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return len(set(ranks) & set(expert_ranks)) > 1


def is_expert_shard(p: torch.Tensor) -> bool:
    """Whether ``p`` was marked by :func:`mark_expert_shards`."""
    return hasattr(p, _MARK)


def marked_shards(model: nn.Module) -> list[tuple[str, nn.Parameter, tuple[int, ...]]]:
    """``(qualified name, parameter, group ranks)`` of every marked parameter of ``model``."""
    return [(n, p, getattr(p, _MARK)) for n, p in model.named_parameters() if hasattr(p, _MARK)]


# Elements of a shard that its checksum reads: a strided sample, so that a layer of gigabytes
# costs a few megabytes once, not a float64 copy of its weights. Shards of different experts
# never agree on a million values; a DDP copy agrees on all of them.
_SAMPLE = 1 << 20


def _checksum(w: torch.Tensor) -> list[float]:
    flat = w.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLE)].double()
    return [float(sample.sum()), float((sample * sample).sum())]


def refuse_ddp_replicas(group_name: str, world: int, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise if a running DistributedDataParallel reduces the unmarked trainable shards ``w1`` /
    ``w2`` as replicas. Exact, and no collective: every rank runs the same DDP and raises here
    alike, so it also serves while torch.compile traces ``moe_forward``, where the checksums'
    exchange of :func:`check_distinct_shards` is skipped."""
    if world == 1 or not (w1.requires_grad and w2.requires_grad):
        return
    if is_expert_shard(w1) or is_expert_shard(w2):
        return
    if ddp_reduces(w1, w2):
        group = dist.distributed_c10d._resolve_process_group(group_name)
        if ddp_holds_other_shards(dist.get_process_group_ranks(group)):
            raise RuntimeError(_trap_message(group_name, world, w1, w2, in_ddp=True))


def check_distinct_shards(group_name: str, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Raise on every rank if the trainable shards ``w1`` / ``w2`` are bit-for-bit the same on
    all ranks of the group named ``group_name`` (rank 0's, copied by a plain DDP wrapper).

    Collective, once per ``(w1, w2)`` pair: every rank of the group calls it from the same
    ``moe_forward`` (which each rank of the group calls too). Nothing is compared at one rank,
    for tensors that need no gradient (inference, frozen experts), for marked shards
    (:func:`mark_expert_shards`), or for a ``w1`` of zeros (an initialisation, not a copy).
    """
    if not group_name or torch.compiler.is_compiling():
        return
    if not (w1.requires_grad and w2.requires_grad and w1.is_leaf and w2.is_leaf):
        return
    if is_expert_shard(w1) or is_expert_shard(w2):
        return
    group = dist.distributed_c10d._resolve_process_group(group_name)
    world = dist.get_world_size(group)
    if world == 1:
        return
    refuse_ddp_replicas(group_name, world, w1, w2)
    key = (id(w1), id(w2))
    seen = _CHECKED.get(key)
    if seen is not None and seen[0]() is w1 and seen[1]() is w2:
        return

    def forget(_ref: weakref.ref, k: tuple[int, int] = key) -> None:
        _CHECKED.pop(k, None)

    _CHECKED[key] = (weakref.ref(w1, forget), weakref.ref(w2, forget))
    from .. import _C
    from ..distributed import staging_device

    # Through the calls' agreement message (bounded, of one size for every call): a rank that
    # is in another call (its forward under no_grad, say, so it never came here) is named, where
    # a plain all-gather paired with that call's exchange and aborted the process.
    mine = torch.tensor(_checksum(w1) + _checksum(w2), dtype=torch.float64).view(torch.int64)
    device = staging_device(group)
    shared = _C.share_call(group_name, "expert_shard_check", mine.tolist(), device)
    rows = torch.tensor(shared, dtype=torch.int64).view(torch.float64).view(world, 4)
    if bool((rows == rows[0]).all()) and float(rows[0, 1]) > 0.0:
        raise RuntimeError(_trap_message(group_name, world, w1, w2, in_ddp=False))


def _trap_message(
    group_name: str, world: int, w1: torch.Tensor, w2: torch.Tensor, in_ddp: bool
) -> str:
    held = (
        "are parameters that the running DistributedDataParallel treats as replicas"
        if in_ddp
        else f"hold exactly the same values on all {world} ranks"
    )
    return (
        f"moe_forward: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} {held} of group "
        f"'{group_name}', but each rank's are other experts (rank r holds experts "
        "[r * E_local, (r + 1) * E_local)). A plain DistributedDataParallel copies rank 0's "
        "shard to every rank and averages the shards' gradients. Mark the shards with "
        "uniep.nn.mark_expert_shards(module, ['w1', 'w2']) and wrap with "
        "uniep.nn.data_parallel(model) (uniep.nn.Experts and MoELayer need no marking); if "
        "equal shards are intended, marking them says so"
    )
