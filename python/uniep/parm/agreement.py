"""The routing agreement's world all-gather, what it carries, and what it carries when a rank's
own checks fail.

Every Parm forward starts its collectives with the routing agreement (``world_agree_routing``):
each rank's token count, dropped pairs and largest demand, and the call's configuration
(``CallConfig``: the schedule, sizes, top-k, capacity factor, overflow policy, dtype and SAA
chunk counts), gathered over the world. A configuration that differs between ranks makes every
rank raise ``ValueError`` naming the field and both ranks' values before any data moves: the
ranks would otherwise run different collectives (a crash or a wait until the timeout) or return
different outputs inside one MP group. A rank whose arguments fail its checks before that point
joins the same all-gather marked failed, then the message exchange below, and raises its own
error; the others see the mark in the agreement, join the exchange and raise at once, naming the
failed rank and its reason, instead of waiting for it until the timeout. Both exchanges are
fixed-size, so every rank's calls match whatever its configuration.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..distributed import bounded_wait

__all__ = [
    "CallConfig",
    "ROUTING_WORDS",
    "join_as_failed",
    "raise_if_a_rank_failed",
    "raise_if_configs_differ",
    "world_all_gather_ints",
]

_SCHEDULES = ("baseline", "s1", "s2")
_OVERFLOWS = ("error", "drop")
# By name, so that every process numbers them alike; a dtype not listed is sent as 0.
_DTYPES = tuple(
    getattr(torch, name)
    for name in (
        "float32",
        "bfloat16",
        "float16",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "bool",
        "complex64",
        "complex128",
    )
    if hasattr(torch, name)
)
# SAA pairs per step list: S2 has two (its dispatch and its combine).
CHUNK_SLOTS = 2
# Per rank: tokens, dropped pairs, the largest demand, 1 where the rank's checks failed...
_HEAD = 4
# ...then the configuration: one word per CallConfig field but the last, then the SAA chunk
# counts of the forward list and of the backward list, CHUNK_SLOTS each.
_SCALARS = 10
ROUTING_WORDS = _HEAD + _SCALARS + 2 * CHUNK_SLOTS
_MESSAGE_BYTES = 1024


def _code(value: object, table: tuple) -> int:
    return table.index(value) + 1 if value in table else 0


def _name(code: int, table: tuple) -> str:
    return str(table[code - 1]) if 0 < code <= len(table) else f"an unknown value ({code})"


@dataclass(frozen=True)
class CallConfig:
    """What every rank of one Parm forward must share: its collectives' sequence and sizes, and
    the values an MP group's replicated output depends on. ``chunks`` holds the SAA pairs'
    chunk counts of the forward list (without a plan, the backend's default count for each), then
    of the backward list (``()`` without a backward plan: the forward's default again)."""

    schedule: str
    mp_size: int
    ep_size: int
    hidden: int
    ffn_hidden: int
    num_experts: int
    top_k: int
    capacity_factor: float
    overflow: str
    dtype: torch.dtype
    chunks: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def words(self) -> list[int]:
        """The configuration as the agreement's int64 words (those after the routing's four)."""
        out = [
            _code(self.schedule, _SCHEDULES),
            self.mp_size,
            self.ep_size,
            self.hidden,
            self.ffn_hidden,
            self.num_experts,
            self.top_k,
            # Every factor <= 0 means no drops: one word for all of them.
            struct.unpack("<q", struct.pack("<d", max(float(self.capacity_factor), 0.0)))[0],
            _code(self.overflow, _OVERFLOWS),
            _code(self.dtype, _DTYPES),
        ]
        for counts in self.chunks:
            if len(counts) > CHUNK_SLOTS:
                raise RuntimeError(
                    f"parm routing agreement: a step list with {len(counts)} SAA pairs; it "
                    f"carries {CHUNK_SLOTS} per list (raise agreement.CHUNK_SLOTS)"
                )
            out += [*counts, *[0] * (CHUNK_SLOTS - len(counts))]
        return out

    @staticmethod
    def texts(words: list[int]) -> dict[str, str]:
        """Each field of the configuration ``words`` (``words()``), as an error message shows it."""
        names = [f.name for f in fields(CallConfig)]
        out = {name: str(w) for name, w in zip(names[:_SCALARS], words, strict=False)}
        out["schedule"] = repr(_name(words[0], _SCHEDULES))
        out["capacity_factor"] = repr(struct.unpack("<d", struct.pack("<q", words[7]))[0])
        out["overflow"] = repr(_name(words[8], _OVERFLOWS))
        out["dtype"] = _name(words[9], _DTYPES)
        fwd, bwd = (
            [c for c in words[_SCALARS + i * CHUNK_SLOTS : _SCALARS + (i + 1) * CHUNK_SLOTS] if c]
            for i in range(2)
        )
        out["chunks"] = (
            f"SAA chunk counts {fwd} (forward), {bwd} (backward)" if fwd or bwd else "no SAA pairs"
        )
        return out


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
    mine = torch.zeros(ROUTING_WORDS, dtype=torch.long)
    mine[3] = 1
    world_all_gather_ints(mine, "parm routing agreement")
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


def raise_if_configs_differ(rows: torch.Tensor) -> None:
    """After the routing agreement (``rows`` [P, ROUTING_WORDS], no rank failed): raise
    ``ValueError`` naming the first configuration field that differs from rank 0's, and both
    ranks' values (the same message on every rank)."""
    words = rows[:, _HEAD:].tolist()
    names = [f.name for f in fields(CallConfig)]
    # The chunk counts are compared as one field: their words follow the others'.
    spans = [(i, i + 1) for i in range(_SCALARS)] + [(_SCALARS, len(words[0]))]
    for name, (lo, hi) in zip(names, spans, strict=True):
        for r in range(1, len(words)):
            if words[r][lo:hi] == words[0][lo:hi]:
                continue
            first, theirs = CallConfig.texts(words[0])[name], CallConfig.texts(words[r])[name]
            hint = ""
            if name in ("schedule", "chunks"):
                hint = (
                    " (ParmMoELayer resolves schedule='auto' and chunks='auto' from its model, "
                    "cluster and gpus_per_node, which must agree too; without a chunk plan "
                    "the pairs run in uniep.parm.cuda.set_saa_chunks's count)"
                )
            raise ValueError(
                f"Parm forward: {name} differs across ranks: rank 0 has {first}, rank {r} has "
                f"{theirs}; every rank must run the layer with the same configuration{hint}"
            )
