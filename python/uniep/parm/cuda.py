"""The CUDA executor of the Parm step lists: the interpreter of ``uniep.parm.executor`` over UniEP's
P2P collectives (``uniep.collectives``: NVSHMEM peer copies with bounded device waits).

What runs on which primitive (one rank):
- MP (= ESP) all-gathers (the ESP all-gather of the expert input, MP-AllGather of tokens and of
  the capacity dimension, and the all-reduces, which are an all-gather plus a sum in MP-rank
  order): ``torch.ops.uniep.all_gather``.
- The ESP reduce-scatter of the expert partials: ``torch.ops.uniep.reduce_scatter`` (fp32
  accumulation in ``uniep.collectives.reduce_order``, rounded once).
- The EP all-to-alls: ``torch.ops.uniep.all_to_all_ulysses`` on a [P, block] tensor (scatter
  dim 0, gather dim 1), which is a plain block all-to-all.
- The expert shards: UniEP's expert GEMM engine (``torch.ops.uniep.grouped_mm``, bf16 on
  compute capability 9.0 with the engine built; ``torch._grouped_mm`` on 10.x), K and N
  multiples of 8 (every local expert has the same capacity rows, so the groups are equal);
  otherwise ``torch.bmm``.
- Routing, order, I-order and the backward's VJPs: torch ops on the GPU (``parm_exec``).
- The routing agreement (the routing counts and the call's configuration, 18 int64 per rank:
  ``uniep.parm.agreement``): torch.distributed on the default group (gloo on the CPU when ranks
  share a GPU, NCCL otherwise), the wait bounded by ``UNIEP_TIMEOUT_S``.

**Sub-groups have runtimes of their own.** NVSHMEM spans the world (it is shared only over the
same ranks), and the MP and EP groups of a Parm layout are sub-groups of it when N > 1 and
G > 1. Each rank's MP group and EP group get a collectives runtime of their own
(``uniep.collectives.init_cuda(group, parent=WORLD)``: the symmetric memory over the world, the
calls' peers the group's ranks), so each collective moves exactly the group's blocks: the bytes
the cost model prices. The sums run in the group's reduce order, which is the world's order
restricted to the group, so the bits are those of the CPU executor.

**The SAA pairs are pipelined.** An EP all-to-all followed by the MP all-gather of what arrived
(the S1/S2 dispatch, and S2's combine) is cut into chunks of the capacity dimension: as many as
the plan gives the pair (the ops' ``chunks``, which ``ParmMoELayer`` takes from the cost model
that priced the schedule, ``uniep._C.parm.price(...).chunks``), else ``set_saa_chunks``'s count
(default 4). Chunk i's all-to-all is issued on the caller's stream, its all-gather on a second
stream after an event, so chunk i's all-gather runs beside chunk i+1's all-to-all. The two
halves use two groups (MP and EP), i.e. two collectives runtimes with their own slots and
streams, so neither waits for the other's previous call. The values are those of the
unpipelined steps (``parm_exec.chunk_pipeline``; tests/parm/test_parm_backends.py checks it on CPU).

The same backend also runs on CPU tensors, over UniEP's CPU collectives on the same MP and EP
groups (gloo): that is how the CPU tests check its plumbing on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from .agreement import world_all_gather_ints
from .executor import Groups, Lanes, ParmExecutor, SerialLanes, chunk_pipeline, ordered_sum

__all__ = [
    "CudaBackend",
    "CudaExecutor",
    "CudaLanes",
    "layer_block_bytes",
    "saa_chunks",
    "set_saa_chunks",
    "shutdown",
]

_saa_chunks = 4
# (world size, role) -> a group of every rank, whose collectives runtime carries that role's
# calls: "a2a" the EP all-to-alls, "gather" the MP all-gathers and reduce-scatters.
# group name -> the MP or EP group whose CUDA collectives runtime this process created.
_runtimes: dict[str, dist.ProcessGroup] = {}
_side_streams: dict[int, Any] = {}
_MIN_BLOCK_BYTES = 1 << 20


def set_saa_chunks(chunks: int) -> None:
    """Chunks of the capacity dimension that each SAA pair is pipelined in (process-wide; every
    rank must choose the same). 1 runs the pair unpipelined. Results do not depend on it."""
    global _saa_chunks
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    _saa_chunks = chunks


def saa_chunks() -> int:
    """The chunk count that ``set_saa_chunks`` chose."""
    return _saa_chunks


def shutdown() -> None:
    """Destroy the MP and EP groups' CUDA collectives runtimes (collective: every rank
    together, each its own groups'). A later CUDA layer creates them again."""
    from .. import collectives

    for group in _runtimes.values():
        collectives.shutdown_cuda(group)
    _runtimes.clear()


def _reserve_heap(world: int, block_bytes: int) -> None:
    """NVSHMEM's symmetric heap is sized when it starts. When a group's runtime is the first
    UniEP runtime of the process, size it for both groups' runtimes and one growth of each (the
    user's NVSHMEM_SYMMETRIC_SIZE wins; a heap started earlier, e.g. by the EP runtime, stays)."""
    if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        per = int(_C.coll_symmetric_heap_bytes(world, block_bytes))
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(4 * per + (256 << 20))


class CudaLanes:
    """Two CUDA streams: ``first`` on the caller's, ``second`` on a side stream that waits for
    an event recorded after ``first``; ``join`` makes the caller's stream wait for the side."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(device=index)
        self.side = _side_streams[index]
        self.main = torch.cuda.current_stream(index)

    def run_second(
        self, second: Callable[[torch.Tensor], torch.Tensor], mid: torch.Tensor
    ) -> torch.Tensor:
        ready = torch.cuda.Event()
        ready.record(self.main)
        with torch.cuda.stream(self.side):
            self.side.wait_event(ready)
            out = second(mid)
        # mid was allocated on the main stream and is read on the side one.
        mid.record_stream(self.side)
        return out

    def join(self, outs: list[torch.Tensor]) -> None:
        done = torch.cuda.Event()
        done.record(self.side)
        self.main.wait_event(done)
        # Allocated on the side stream, read on the main one (the concatenation and after).
        for o in outs:
            o.record_stream(self.main)


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16):
        return False
    if not hasattr(torch, "_grouped_mm") or a.shape[1] == 0:
        return False
    # The kernel's TMA moves rows of 16 bytes: K and N multiples of 8 bf16 elements.
    if a.shape[2] % 8 or b.shape[2] % 8:
        return False
    return torch.cuda.get_device_capability(a.device)[0] in (9, 10)


def _engine_fits(a: torch.Tensor) -> bool:
    """Whether UniEP's expert GEMM engine runs here: a compute capability 9.0 GPU and a build
    with its CUDA kernel (``_grouped_mm_fits`` has checked the rest)."""
    return torch.cuda.get_device_capability(a.device) == (9, 0) and bool(
        torch._C._dispatch_has_kernel_for_dispatch_key("uniep::grouped_mm", "CUDA")
    )


def layer_block_bytes(shape: Any) -> int:
    """The largest per-rank block of any call of a layer of ``ParmShape`` ``shape``: the
    [E, N*c, M] dispatch tensor (the baseline's all-reduce gathers it whole), a token slice, the
    gate gradient, the stats. The groups' runtimes' slots are sized from it."""
    E, N, c, M, b = (
        shape.num_experts,
        shape.mp_size,
        shape.slice_capacity,
        shape.hidden,
        shape.dtype_bytes,
    )
    return max(E * N * c * M * b, shape.slice_tokens(0) * M * b, M * E * 4, 16 * E)


class CudaBackend:
    """The ``ParmBackend`` over UniEP's collectives (CUDA tensors; CPU tensors too, on the CPU
    collectives, for tests). See the module docstring for what runs where.

    Args:
        shape: the layer's ``ParmShape`` (sizes the runtimes' slots: the largest block any call
            of the layer moves, so that one runtime serves the whole layer); may be None when
            ``block_bytes`` is given.
        groups: this rank's MP and EP groups.
        lanes: where an SAA pair's halves run; None: ``CudaLanes`` for CUDA tensors, one lane
            (``SerialLanes``) for CPU tensors.
        chunks: chunks per SAA pair where the step list's plan gives none (None:
            ``saa_chunks()``).
        block_bytes: the runtimes' slot size in bytes, for callers that run no layer
            (``uniep.parm.profile``); None: ``layer_block_bytes(shape)``.
    """

    def __init__(
        self,
        shape: Any,
        groups: Groups,
        lanes: Lanes | None = None,
        chunks: int | None = None,
        block_bytes: int | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            if groups.mp_size * groups.ep_size != 1:
                raise ValueError(
                    "groups: MP and EP groups of more than one rank need torch.distributed "
                    "to be initialised"
                )
            self.world, self.rank = 1, 0
        else:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.g = groups
        self.mp_ranks = self._ranks(groups.mp, "mp_group")
        self.ep_ranks = self._ranks(groups.ep, "ep_group")
        if len(self.mp_ranks) != groups.mp_size or len(self.ep_ranks) != groups.ep_size:
            raise ValueError(
                f"groups: mp_size={groups.mp_size} and ep_size={groups.ep_size} must be the "
                f"groups' sizes, got {len(self.mp_ranks)} and {len(self.ep_ranks)}"
            )
        self.lanes = lanes
        self.chunks = _saa_chunks if chunks is None else chunks
        self._used: list[str] = []
        self.block_bytes = layer_block_bytes(shape) if block_bytes is None else block_bytes

    @property
    def default_chunks(self) -> int:
        return self.chunks

    def _ranks(self, group: dist.ProcessGroup | None, name: str) -> list[int]:
        if group is None:
            return [self.rank]
        ranks = [int(r) for r in dist.get_process_group_ranks(group)]
        if ranks[dist.get_rank(group)] != self.rank:
            raise ValueError(f"{name}: this rank ({self.rank}) is not at its place in {ranks}")
        return ranks

    # ---- the MP and EP groups' runtimes: sub-groups of the world ----
    def _runtime(self, group: dist.ProcessGroup, t: torch.Tensor, need: int) -> str:
        """The name of ``group`` (this rank's MP or EP group), its CUDA runtime created (or
        grown) so that a block of ``need`` bytes fits. A sub-group's runtime is made over the
        world (its symmetric memory is): collective on first use, every rank reaching it at
        the same call for its own group with the same sizes (the routing agreement has checked
        the token counts)."""
        name = group.group_name
        if not t.is_cuda:
            return name
        from .. import collectives

        if name not in self._used:
            self._used.append(name)
        if _C.coll_exists(name):
            if int(_C.coll_config(name)["max_block_bytes"]) >= need:
                return name
            collectives.shutdown_cuda(group)
        want = max(need, self.block_bytes, _MIN_BLOCK_BYTES)
        cap = 1 << (want - 1).bit_length()
        _reserve_heap(self.world, cap)
        collectives.init_cuda(group, max_block_bytes=cap, parent=dist.group.WORLD)
        _runtimes[name] = group
        return name

    # ---- the ParmBackend primitives ----
    def mp_all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.g.mp_size == 1:
            return [t]
        flat = t.reshape(1, -1)
        name = self._runtime(self.g.mp, t, flat.numel() * t.element_size())
        every = torch.ops.uniep.all_gather(flat, name, 1, "direct")
        return list(every.view(self.g.mp_size, *t.shape).unbind(0))

    def ep_all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        if self.g.ep_size == 1:
            return t.clone()
        send = t.reshape(self.g.ep_size, -1)
        name = self._runtime(self.g.ep, t, send.shape[1] * t.element_size())
        # Ulysses with scatter dim 0 and gather dim 1 on [G, block]: block p goes to EP rank p
        # and the result's p-th block of columns came from EP rank p.
        recv = torch.ops.uniep.all_to_all_ulysses(send, 0, 1, name)
        return recv.view(t.shape)

    def mp_reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        if self.g.mp_size == 1:
            return t[0].clone()
        send = t.reshape(self.g.mp_size, -1)
        name = self._runtime(self.g.mp, t, send.shape[1] * t.element_size())
        out = torch.ops.uniep.reduce_scatter(send, name, 1, "direct")
        return out.view(t.shape[1:])

    def mp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        # The same arithmetic as the CPU executor: the MP group's copies summed in rank order.
        return ordered_sum(self.mp_all_gather(t))

    def world_all_gather_ints(self, mine: torch.Tensor) -> torch.Tensor:
        return world_all_gather_ints(mine, "parm routing agreement")

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not _grouped_mm_fits(a, b):
            return torch.bmm(a, b)
        B, m, k = a.shape
        offs = torch.arange(1, B + 1, device=a.device, dtype=torch.int32) * m
        rows, w = a.contiguous().view(B * m, k), b.contiguous()
        if _engine_fits(a):
            out = torch.ops.uniep.grouped_mm(rows, w, offs)
        else:
            out = torch._grouped_mm(rows, w, offs)
        return out.view(B, m, b.shape[2])

    def pipelined(
        self,
        first: Callable[[torch.Tensor], torch.Tensor],
        second: Callable[[torch.Tensor], torch.Tensor],
        t: torch.Tensor,
        chunks: int | None = None,
    ) -> torch.Tensor:
        lanes = self.lanes
        if lanes is None:
            lanes = CudaLanes(t.device) if t.is_cuda else SerialLanes()
        return chunk_pipeline(first, second, t, self.chunks if chunks is None else chunks, lanes)

    def end_pass(self) -> None:
        # A device wait that timed out (a peer that never called) raises here, naming the peer;
        # no device synchronisation (it reads the runtime's mapped error word).
        for name in self._used:
            _C.coll_check(name, False)


class CudaExecutor(ParmExecutor):
    """The interpreter over ``CudaBackend``: one layer's steps on this rank, CUDA tensors."""

    def __init__(self, shape: Any, groups: Groups, overflow: str, **backend: Any) -> None:
        super().__init__(shape, groups, overflow, CudaBackend(shape, groups, **backend))
