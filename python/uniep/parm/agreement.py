"""The routing agreement's world all-gather, and what it carries when a rank's own checks fail.

Every Parm forward starts its collectives with the routing agreement (``world_agree_routing``):
each rank's token count, dropped pairs and largest demand, gathered over the world. A rank whose
arguments fail its checks before that point joins the same all-gather marked failed, then the
message exchange below, and raises its own error; the others see the mark in the agreement, join
the exchange and raise at once, naming the failed rank and its reason, instead of waiting for it
until the timeout. Both exchanges are fixed-size, so every rank's calls match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import bounded_wait

__all__ = ["ROUTING_WORDS", "join_as_failed", "raise_if_a_rank_failed", "world_all_gather_ints"]

# Per rank: tokens, dropped pairs, the largest demand, and 1 where the rank's checks failed.
ROUTING_WORDS = 4
_MESSAGE_BYTES = 1024


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_all_gather_ints(mine: torch.Tensor, what: str) -> torch.Tensor:
    """``mine`` [k] int64 of every world rank, [P, k] on the CPU, over the default group (its
    staging device: the CPU for gloo, the GPU for NCCL), the wait bounded."""
    if not _world():
        return mine[None].clone()
    world = dist.group.WORLD
    device = "cuda" if str(dist.get_backend(world)) == "nccl" else "cpu"
    t = mine.to(device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    bounded_wait(dist.all_gather(parts, t, async_op=True), world, what)
    return torch.stack(parts).cpu()


def _gather_messages(message: str) -> list[str]:
    raw = message.encode()[:_MESSAGE_BYTES]
    buf = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.int64)
    buf[0] = len(raw)
    if raw:
        buf[1 : len(raw) + 1] = torch.tensor(list(raw), dtype=torch.int64)
    rows = world_all_gather_ints(buf, "parm argument agreement")
    return [bytes(row[1 : int(row[0]) + 1].tolist()).decode(errors="replace") for row in rows]


def join_as_failed(message: str) -> None:
    """For a rank whose checks failed before its forward's routing agreement: join the agreement
    marked failed and share ``message``, so the other ranks raise too. The caller raises its own
    error after. Nothing to join without a world of several ranks."""
    if not _world():
        return
    world_all_gather_ints(torch.tensor([0, 0, 0, 1], dtype=torch.long), "parm routing agreement")
    _gather_messages(message)


def raise_if_a_rank_failed(rows: torch.Tensor) -> None:
    """After the routing agreement (``rows`` [P, ROUTING_WORDS]): if a rank joined it failed,
    take the messages and raise ``ValueError`` naming the first failed rank and its reason."""
    failed = [int(r) for r in torch.nonzero(rows[:, 3]).flatten()]
    if not failed:
        return
    messages = _gather_messages("")
    first = failed[0]
    others = f" (and ranks {failed[1:]})" if len(failed) > 1 else ""
    raise ValueError(
        f"rank {first}{others} failed its checks before this Parm forward's collectives, so "
        f"no rank ran it: {messages[first]}"
    )
