"""The CPU executor of the Parm step lists: the interpreter of ``uniep.parm.executor`` over
torch.distributed (gloo).

Collectives are the plan's (all-gather, reduce-scatter, all-reduce, all-to-all over the MP/ESP or
EP group) as torch.distributed calls, each wait bounded by ``UNIEP_TIMEOUT_S``
(``uniep.distributed.bounded_wait``). An SAA pair runs as its all-to-all followed by its
all-gather, which is what the pipelined version computes. The expert shards are dense
``torch.bmm``. Sums over ranks (the reduce-scatter and all-reduce of the expert partials, the
gate gradient) add the partials in MP-rank order, so they do not depend on the backend's
reduction order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import bounded_wait
from .agreement import world_all_gather_ints
from .executor import CapacityError, ForwardState, Groups, ParmExecutor, Routing, ordered_sum

__all__ = [
    "CapacityError",
    "CpuExecutor",
    "ForwardState",
    "GlooBackend",
    "Groups",
    "Routing",
    "world_all_gather_ints",
]


def _wait(work: Any, group: dist.ProcessGroup | None, what: str) -> None:
    bounded_wait(work, group if group is not None else dist.group.WORLD, what)


class GlooBackend:
    """The ``ParmBackend`` of CPU tensors: torch.distributed collectives over the groups."""

    default_chunks = 1  # every pair unpipelined (``pipelined``)

    def __init__(self, groups: Groups) -> None:
        self.g = groups

    def _all_gather(
        self, t: torch.Tensor, group: dist.ProcessGroup | None, n: int
    ) -> list[torch.Tensor]:
        if n == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(n)]
        _wait(dist.all_gather(parts, t.contiguous(), group=group, async_op=True), group, "parm")
        return parts

    def _all_to_all(self, t: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> torch.Tensor:
        """t [n, ...]: block i goes to group rank i; returns [n, ...], block j from rank j."""
        if n == 1:
            return t.clone()
        t = t.contiguous()
        out = torch.empty_like(t)
        _wait(dist.all_to_all_single(out, t, group=group, async_op=True), group, "parm")
        return out

    def mp_all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._all_gather(t, self.g.mp, self.g.mp_size)

    def ep_all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_to_all(t, self.g.ep, self.g.ep_size)

    def mp_reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        # An all-to-all of the blocks and a local sum in MP-rank order (the same order as
        # mp_all_reduce's), so the bits do not depend on the backend's reduction order.
        got = self._all_to_all(t, self.g.mp, self.g.mp_size)
        return ordered_sum(list(got.unbind(0)))

    def mp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return ordered_sum(self.mp_all_gather(t))

    def world_all_gather_ints(self, mine: torch.Tensor) -> torch.Tensor:
        return world_all_gather_ints(mine, "parm routing agreement")

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)

    def pipelined(
        self,
        first: Callable[[torch.Tensor], torch.Tensor],
        second: Callable[[torch.Tensor], torch.Tensor],
        t: torch.Tensor,
        chunks: int | None = None,
    ) -> torch.Tensor:
        # Unpipelined whatever the plan's chunks: gloo's calls block, so there is nothing to
        # overlap, and the result is the same.
        return second(first(t))

    def end_pass(self) -> None:
        return None


class CpuExecutor(ParmExecutor):
    """The interpreter over ``GlooBackend``: one layer's steps on this rank, CPU tensors."""

    def __init__(self, shape: Any, groups: Groups, overflow: str) -> None:
        super().__init__(shape, groups, overflow, GlooBackend(groups))
