"""Process groups for UniEP: which ranks share the experts, and a small local launcher.

UniEP never starts its own launcher for real jobs: ranks and processes come from
``torch.distributed``. ``init(group)`` records the group that later calls use by default, and
``run_local_ranks`` spawns a few processes on one host for demos, benchmarks and tests.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue as _queue
import signal
import socket
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import _C

__all__ = [
    "Runtime",
    "init",
    "group_name",
    "world_size",
    "rank",
    "ranks_per_node",
    "default_group",
    "run_local_ranks",
]

# Besides __all__, the helpers that UniEP's own modules share (resolve_group, wait_limit_s,
# staging_device, bounded_wait, nvshmem_bootstrap, broadcast_bytes, raise_on_all_ranks) live
# here, beside the default group they read; they are not part of the public API.

# A bounded wait's limit when neither the call nor UNIEP_TIMEOUT_S gives one.
_DEFAULT_TIMEOUT_S = 100.0

# The group passed to init(); None means "WORLD if torch.distributed is initialised, else one rank".
_default_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class Runtime:
    """What ``uniep.init`` resolved: the group the ops use and where this process sits in it.

    ``group_name`` is ``""`` for a world of one rank without ``torch.distributed``; ``device`` is
    ``"cuda"`` for NCCL groups and ``"cpu"`` for gloo-only groups.
    """

    group_name: str
    rank: int
    world_size: int
    device: str
    backend: str
    # Ranks per node (an NVLink domain); world_size when the group is one node.
    ranks_per_node: int = 1


def _check_group(group: object) -> dist.ProcessGroup | None:
    if group is None:
        return None
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group does not contain this process (it is NON_GROUP_MEMBER)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first"
        )
    if dist.get_rank(group) < 0:
        raise ValueError("group does not contain this process (its rank in the group is -1)")
    return group


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The explicit group, else the init() default, else WORLD, else None (one rank)."""
    group = _check_group(group)
    if group is not None:
        return group
    if _default_group is not None:
        return _default_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def group_by_name(name: str) -> dist.ProcessGroup:
    """The process group a ``group_name`` names (the registry torch's own ops resolve through)."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._resolve_process_group(name)
    except Exception as e:
        raise ValueError(f"group_name {name!r} names no torch.distributed process group") from e


def default_group() -> dist.ProcessGroup | None:
    """The group ``init`` recorded, else WORLD, else None (no torch.distributed)."""
    return resolve_group(None)


def group_name(group: dist.ProcessGroup | None = None) -> str:
    """The name the ``torch.ops.uniep`` ops take as ``group_name``.

    ``""`` (a world of one rank) when ``group`` is None and torch.distributed is not initialised;
    otherwise ``group.group_name`` of ``group``, of the group given to ``init``, or of WORLD.
    """
    resolved = resolve_group(group)
    if resolved is None:
        return ""
    _record_launcher_topology(resolved)
    return resolved.group_name


# Group name -> the group whose topology was recorded under it (WORLD's launcher topology, or
# init's ranks_per_node). torch names groups "0", "1", ... again after destroy_process_group: a
# new group under a recorded name drops the old group's topology.
_topology_of: dict[str, weakref.ref] = {}


def _launcher_ranks_per_node(world: int) -> int | None:
    """``LOCAL_WORLD_SIZE`` (torchrun's ranks on this node) when it is below WORLD's size: nodes.
    A value that does not divide the world is kept as it is, for the calls' checks to refuse on
    every rank (nodes of unequal size, or a wrong variable): read as one node, it ran a topology
    nobody declared, or failed later naming a value nobody set."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not text.isdigit():
        return None
    local = int(text)
    return local if 1 <= local < world else None


def _record_launcher_topology(group: dist.ProcessGroup) -> None:
    # WORLD under a multi-node launch is split into nodes unless init() said otherwise; a
    # sub-group's nodes are the caller's to declare (init(group, ranks_per_node=...)).
    name = group.group_name
    seen = _topology_of.get(name)
    if seen is not None and seen() is group:
        return
    if seen is not None:
        # A destroyed group's, under a name torch gave again.
        _C.set_ranks_per_node(name, 0)
        _C.set_group_ranks(name, [])
    _topology_of[name] = weakref.ref(group)
    if group is not dist.group.WORLD:
        # Errors name the group's own ranks: recorded, they also say which global ranks those
        # are (none needed where the two numberings agree).
        ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(len(ranks))):
            _C.set_group_ranks(name, ranks)
        return
    local = _launcher_ranks_per_node(dist.get_world_size(group))
    if local is not None:
        _C.set_ranks_per_node(name, local)


def ranks_per_node(group: dist.ProcessGroup | None = None) -> int:
    """Ranks of ``group`` on each node: what ``init(group, ranks_per_node=...)`` set, else
    ``LOCAL_WORLD_SIZE`` for WORLD under a launcher that splits it into nodes (torchrun
    ``--nnodes`` > 1), else the world size (one node)."""
    resolved = resolve_group(group)
    return 1 if resolved is None else _node_size(resolved)


def _node_size(group: dist.ProcessGroup) -> int:
    recorded = _C.ranks_per_node(group_name(group))
    return recorded if recorded > 0 else dist.get_world_size(group)


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks the experts are split over (1 without torch.distributed)."""
    resolved = resolve_group(group)
    return 1 if resolved is None else dist.get_world_size(resolved)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the group (0 without torch.distributed)."""
    resolved = resolve_group(group)
    return 0 if resolved is None else dist.get_rank(resolved)


def nvshmem_bootstrap(group: dist.ProcessGroup | None) -> tuple[str, int, int, bytes]:
    """``(group name, world size, rank, NVSHMEM unique id)`` of ``group`` (collective).

    What ``_C.ep_create`` and ``_C.coll_create`` take: every rank must initialise NVSHMEM from
    the same unique id, so rank 0 makes it and the group broadcasts it.
    """
    resolved = resolve_group(group)
    if resolved is None:
        return "", 1, 0, _C.ep_unique_id()
    world, me = dist.get_world_size(resolved), dist.get_rank(resolved)
    per_node = _node_size(resolved)
    if per_node < world:
        # Every rank of the group reads the same topology (init is given it on each), so all
        # raise here together.
        nodes = (
            f"spans {world // per_node} nodes of {per_node} ranks"
            if world % per_node == 0
            else f"declares nodes of {per_node} ranks, which do not divide its {world}"
        )
        raise NotImplementedError(
            f"group '{resolved.group_name}' {nodes} "
            "(uniep.init's ranks_per_node, or LOCAL_WORLD_SIZE under torchrun); UniEP's CUDA "
            "runtimes work within one NVLink domain: across nodes, call uniep.moe_forward (or "
            "MoELayer), which runs a runtime per node and the rail between them "
            "(docs/multinode.md)"
        )
    uid = _C.ep_unique_id() if me == 0 else b""
    if world > 1:
        uid = broadcast_bytes(uid, resolved, "NVSHMEM start-up (the unique id's broadcast)")
    return resolved.group_name, world, me, uid


def wait_limit_s(timeout_s: float | None) -> float:
    """``timeout_s`` if given, else ``UNIEP_TIMEOUT_S``, else 100 s: the limit of every bounded
    wait (the GPU runtimes' device-side waits and the host's collectives)."""
    if timeout_s is not None:
        return float(timeout_s)
    env = os.environ.get("UNIEP_TIMEOUT_S")
    if env is None:
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"UNIEP_TIMEOUT_S must be a number of seconds, got {env!r}") from None
    if value <= 0:
        raise ValueError(f"UNIEP_TIMEOUT_S must be > 0, got {env!r}")
    return value


def staging_device(group: dist.ProcessGroup) -> str:
    """Where a few words for ``group`` go: the CPU unless the group is NCCL only."""
    return "cuda" if str(dist.get_backend(group)) == "nccl" else "cpu"


def bounded_wait(work: dist.Work, group: dist.ProcessGroup, what: str) -> None:
    """``work.wait()``, bounded by ``UNIEP_TIMEOUT_S`` (default 100 s): a peer that never joins
    makes this rank raise RuntimeError naming ``what`` and the group, not wait for the backend's
    own timeout (gloo's is 30 minutes). The group is unusable after that."""
    limit = wait_limit_s(None)
    start = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except Exception as e:
        if time.monotonic() - start < limit:
            raise
        raise RuntimeError(
            f"{what} on rank {dist.get_rank(group)} of group '{group.group_name}' timed out "
            f"after {limit} s waiting for its peers (did every rank call it?); "
            "UNIEP_TIMEOUT_S sets the limit"
        ) from e


def broadcast_bytes(data: bytes, group: dist.ProcessGroup, what: str) -> bytes:
    """Rank 0's ``data`` on every rank of ``group`` (a length, then the bytes), each wait
    bounded."""
    device = staging_device(group)
    src = dist.get_global_rank(group, 0)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    bounded_wait(dist.broadcast(size, src=src, group=group, async_op=True), group, what)
    payload = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank(group) == 0:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    bounded_wait(dist.broadcast(payload, src=src, group=group, async_op=True), group, what)
    return bytes(payload.cpu().tolist())


def raise_on_all_ranks(group_name: str, call: str, error: str, device: str) -> NoReturn:
    """Raise ``ValueError(error)`` here and on every other rank of the group.

    For checks made in Python before a multi-rank op (``call``: ``"moe_forward"`` or
    ``"moe_backward"``): the other ranks are in that op's argument agreement (or in the GPU
    runtime's creation, on a first call), which this joins with the error, so they raise at once
    naming this rank and its message instead of waiting for it. ``device``: where the op's
    tensors are (``"cpu"`` or ``"cuda"``).
    """
    _C.agree_call(group_name, call, [], error, device)
    raise ValueError(error)  # agree_call raises first; this line states the contract


def _device_kind(backend: str) -> str:
    if "nccl" in backend:
        return "cuda"
    if backend:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def init(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None) -> Runtime:
    """Record ``group`` as the default for later UniEP calls and describe it.

    Args:
        group: the ``torch.distributed`` process group the experts are split over; None means WORLD
            when torch.distributed is initialised, else a world of one rank (no torch.distributed
            needed). CPU tensors need a gloo group, CUDA tensors an NCCL group.
        ranks_per_node: ranks of the group on each node (an NVLink domain): the group is
            ``W / ranks_per_node`` nodes of consecutive ranks, and tokens cross between nodes
            once per (token, node) (docs/multinode.md). None: ``LOCAL_WORLD_SIZE`` for WORLD
            under a launcher that sets it (``torchrun --nnodes N``), else one node. A value
            below the machine's declares logical nodes (the network leg runs on one machine,
            for tests). Every rank must pass the same; the ops check it. On CUDA tensors
            ``moe_forward`` and the expert modules compose the two levels (a CUDA runtime per
            node); the runtimes themselves (``uniep.moe.ep``, the MegaKernel, the low-latency
            path) refuse a group that spans nodes.

    Returns:
        A ``Runtime`` with the group name, this rank, the world size, the device kind and the
        ranks per node.

    Raises:
        ValueError: ``group`` is not a ProcessGroup, torch.distributed is not initialised, this
            process is not a member of ``group``, or ``ranks_per_node`` is not a positive
            divisor of the group's size.
    """
    global _default_group
    checked = _check_group(group)
    if ranks_per_node is not None and (
        isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
    ):
        raise ValueError(f"ranks_per_node must be an int or None, got {ranks_per_node!r}")
    _default_group = checked
    resolved = resolve_group(None)
    if resolved is None:
        if ranks_per_node not in (None, 1):
            raise ValueError(
                f"ranks_per_node must be 1 (or None) for a world of one rank, got {ranks_per_node}"
            )
        return Runtime(
            group_name="",
            rank=0,
            world_size=1,
            device=_device_kind(""),
            backend="",
            ranks_per_node=1,
        )
    world = dist.get_world_size(resolved)
    if ranks_per_node is not None:
        if ranks_per_node < 1 or world % ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node must divide the group's {world} ranks into equal nodes "
                f"(a divisor of {world}), got {ranks_per_node}"
            )
        _topology_of[resolved.group_name] = weakref.ref(resolved)
        _C.set_ranks_per_node(resolved.group_name, 0 if ranks_per_node == world else ranks_per_node)
    else:
        _record_launcher_topology(resolved)
    backend = str(dist.get_backend(resolved))
    return Runtime(
        group_name=resolved.group_name,
        rank=dist.get_rank(resolved),
        world_size=world,
        device=_device_kind(backend),
        backend=backend,
        ranks_per_node=_node_size(resolved),
    )


# ---- local launcher: a few processes on this host, joined over TCP on 127.0.0.1 ----


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    local_rank: int,
    fn: Callable[..., Any],
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    results: Any,
    args: tuple,
) -> None:
    # Gloo resolves the hostname to pick an interface; on machines where that name maps to an
    # unreachable address it hangs, and every rank here is local anyway.
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # The parent stops the other ranks when one fails (terminate); each then prints where it was,
    # which is what tells a rank stuck on its host from one waiting on its peers.
    if hasattr(faulthandler, "register"):  # not on Windows
        faulthandler.register(signal.SIGTERM, all_threads=False, chain=True)
    # Ranks share the host's cores; oversubscribing threads makes every collective wait on the
    # slowest rank.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=local_rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        init()
        out = fn(local_rank, world, *args)
        # As bytes: the queue would share a tensor's storage through a file descriptor that dies
        # with this process, which may exit before the parent has read it.
        results.put((local_rank, True, pickle.dumps(out)))
    except BaseException:
        # The parent prints this traceback and stops the other ranks, which may be blocked in a
        # collective waiting for this one.
        results.put((local_rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_ranks(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes joined by a process group.

    Each process initialises ``torch.distributed`` (``backend``: gloo for CPU, nccl for one GPU
    per rank) on a free TCP port of 127.0.0.1 and calls ``uniep.init()`` before ``fn``. ``fn`` must
    be a module-level function; its return values must be picklable.

    Returns:
        The values ``fn`` returned, in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died, or the ranks did not
            all finish within ``timeout_s`` seconds; every remaining process is stopped first.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank: world={world}, "
            f"visible GPUs={torch.cuda.device_count()}"
        )
    # The free port is found before the children bind it; another process can take it in
    # between (seen on busy machines as EADDRINUSE): that, and only that, is retried.
    for _ in range(2):
        try:
            return _run_local_ranks_once(fn, world, args, backend, timeout_s)
        except RuntimeError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
    return _run_local_ranks_once(fn, world, args, backend, timeout_s)


def _run_local_ranks_once(
    fn: Callable[..., Any], world: int, args: tuple, backend: str, timeout_s: float
) -> list[Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, fn, world, port, backend, timeout_s, results, args),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    error: str | None = None
    try:
        while len(outputs) < world:
            try:
                r, ok, value = results.get(timeout=0.2)
            except _queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if p.exitcode is not None and p.exitcode != 0 and i not in outputs
                ]
                if dead:
                    # Give the queue a moment: a rank that raised posts its traceback first.
                    try:
                        r, ok, value = results.get(timeout=1.0)
                    except _queue.Empty:
                        error = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}"
                        break
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(outputs))
                    error = f"ranks {missing} did not finish within {timeout_s:.0f} s"
                    break
                else:
                    continue
            if not ok:
                error = f"rank {r} failed:\n{value}"
                break
            outputs[r] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5.0 if error is None else 0.5)
        # A rank that gave its result and then died (a crash in the teardown at exit, say) still
        # fails the run: a job that ends in a signal looks failed to every scheduler.
        exits = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if error is None and exits:
            i, code = exits[0]
            how = f"signal {-code}" if code < 0 else f"code {code}"
            error = f"rank {i} returned its result but then exited with {how}"
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if error is not None:
        raise RuntimeError(error)
    return [outputs[r] for r in range(world)]
