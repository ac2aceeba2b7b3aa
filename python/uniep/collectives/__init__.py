"""P2P-decomposed collectives with tail-free GEMM overlap (after Flash-Overlap).

``torch.ops.uniep.{all_gather_matmul, matmul_reduce_scatter, all_gather, reduce_scatter,
all_to_all_ulysses}`` replace a collective (and the GEMM next to it) by chunked peer-to-peer
transfers scheduled so that the local chunk fills the slot that would otherwise be the exposed
tail. This module adds their fake kernels (torch.compile) and autograd, and Python wrappers that
take a process group instead of its name.

Every rank of the group must call the same ops in the same order with the same ``chunks`` and
``order`` (and, for autograd, use the same outputs). ``order`` is ``"direct"`` (each chunk goes
straight to the rank that needs it: a full-NVLink node) or ``"ring"`` (neighbours only). Neither
``order`` nor ``chunks`` changes a bit of any result: reductions add the ranks' contributions in
a fixed order (``reduce_order``) in fp32 (fp64 for float64), whatever the schedule.

Supported dtypes: float32, bfloat16, float64. CPU tensors run on the CPU executor over a gloo
group; the group name ``""`` is a world of one rank. CUDA tensors run on the CUDA executor
(``include/uniep/cuda/collectives.hpp``): copy-engine transfers between the GPUs of one NVLink
domain into two sets of slots (calls of odd and even epoch, so no barrier per call), with bounded
device waits on arrival signals, over a runtime that ``init_cuda`` creates (the wrappers
below create it on first use). On CUDA, ``order`` must be ``"direct"``, calls are not
CUDA-graph capturable, and a device timeout (a rank that never calls) raises at the group's next
call or at ``check``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Importing _C registers the torch.ops.uniep schemas and kernels that the code below extends.
from .. import _C, distributed
from .._util.runtime import require_gpu_runtime
from ..moe import ep as _ep

__all__ = [
    "KINDS",
    "all_gather",
    "all_gather_matmul",
    "all_to_all_ulysses",
    "GEMM_BACKENDS",
    "check",
    "init_cuda",
    "matmul_reduce_scatter",
    "reduce_order",
    "reduce_scatter",
    "schedule",
    "gemm",
    "set_gemm",
    "shutdown_cuda",
    "subgroup_members",
    "validate_schedules",
]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_ORDERS = ("direct", "ring")
KINDS = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "all_gather",
    "reduce_scatter",
    "all_to_all_ulysses",
)


def _world_size_of(group_name: str) -> int:
    if group_name == "":
        return 1
    try:
        group = dist.distributed_c10d._resolve_process_group(group_name)
    except Exception as e:  # the registry raises various types for an unknown name
        raise ValueError(
            f"group_name '{group_name}' names no torch.distributed process group (pass "
            'group.group_name of an initialised group, or "" for a single rank)'
        ) from e
    return int(group.size())


# ---- fake kernels: shape checks worded like the C++ ones, outputs of the right metadata ----


def _check_common(chunks: int, order: str) -> None:
    torch._check_value(order in _ORDERS, lambda: f'order must be "direct" or "ring", got "{order}"')
    torch._check_value(chunks >= 1, lambda: f"chunks must be >= 1, got {chunks}")


def _check_float(t: torch.Tensor, name: str) -> None:
    torch._check_value(
        t.dtype in _FLOAT_DTYPES,
        lambda: f"{name} must be float32, bfloat16 or float64, got {t.dtype}",
    )


def _check_divides(chunks: int, rows: int, what: str) -> None:
    torch._check_value(rows % chunks == 0, lambda: f"chunks ({chunks}) must divide {what} ({rows})")


def _check_pair(a: torch.Tensor, b: torch.Tensor, a_shape: str, b_shape: str) -> None:
    torch._check_value(
        a.dim() == 2, lambda: f"a must be a 2-D tensor {a_shape}, got shape {tuple(a.shape)}"
    )
    _check_float(a, "a")
    torch._check_value(
        b.dim() == 2, lambda: f"b must be a 2-D tensor {b_shape}, got shape {tuple(b.shape)}"
    )
    torch._check_value(
        b.dtype == a.dtype, lambda: f"b must have a's dtype {a.dtype}, got {b.dtype}"
    )
    torch._check_value(
        b.shape[0] == a.shape[1],
        lambda: (
            f"b must be {b_shape} with K = a.size(1) = {a.shape[1]} rows, "
            f"got shape {tuple(b.shape)}"
        ),
    )
    torch._check_value(
        b.device == a.device, lambda: f"b must be on a's device {a.device}, got {b.device}"
    )


def _check_x(x: torch.Tensor) -> None:
    torch._check_value(
        x.dim() >= 1,
        lambda: "x must have at least 1 dimension (dim 0 is split across ranks), got a 0-d tensor",
    )
    _check_float(x, "x")


@torch.library.register_fake("uniep::all_gather_matmul")
def _all_gather_matmul_fake(
    a: torch.Tensor, b: torch.Tensor, group_name: str, chunks: int = 1, order: str = "direct"
) -> tuple[torch.Tensor, torch.Tensor]:
    world = _world_size_of(group_name)
    _check_pair(a, b, "[M/W, K]", "[K, N]")
    _check_common(chunks, order)
    _check_divides(chunks, a.shape[0], "a.size(0), the rows of this rank's shard")
    rows = world * a.shape[0]
    return a.new_empty((rows, a.shape[1])), a.new_empty((rows, b.shape[1]))


@torch.library.register_fake("uniep::matmul_reduce_scatter")
def _matmul_reduce_scatter_fake(
    a: torch.Tensor, b: torch.Tensor, group_name: str, chunks: int = 1, order: str = "direct"
) -> torch.Tensor:
    world = _world_size_of(group_name)
    _check_pair(a, b, "[M, K_local]", "[K_local, N]")
    _check_common(chunks, order)
    torch._check_value(
        a.shape[0] % world == 0,
        lambda: f"a.size(0) (M = {a.shape[0]}) must be divisible by the world size {world}",
    )
    _check_divides(chunks, a.shape[0] // world, "M / world size, the rows of this rank's output")
    return a.new_empty((a.shape[0] // world, b.shape[1]))


@torch.library.register_fake("uniep::sm90_gemm")
def _sm90_gemm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None = None,
    sm_carveout: int = 0,
    tile_n: int = 0,
    swizzle: int = 0,
    raster: str = "auto",
) -> torch.Tensor:
    _check_pair(a, b, "[M, K]", "[K, N]")
    torch._check_value(a.dtype == torch.bfloat16, lambda: f"a must be bfloat16, got {a.dtype}")
    if c is not None:
        torch._check_value(
            tuple(c.shape) == (a.shape[0], b.shape[1]) and c.dtype == a.dtype,
            lambda: f"c must be [M, N] = [{a.shape[0]}, {b.shape[1]}] of a's dtype",
        )
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.register_fake("uniep::part_gemm")
def _part_gemm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    parts: int = 1,
    ready: torch.Tensor | None = None,
    epoch: int = 0,
    timeout_s: float = 10.0,
    sm_carveout: int = 0,
    swizzle: int = 0,
    raster: str = "auto",
) -> torch.Tensor:
    _check_pair(a, b, "[M, K]", "[K, N]")
    torch._check_value(a.dtype == torch.bfloat16, lambda: f"a must be bfloat16, got {a.dtype}")
    torch._check_value(
        parts >= 1 and a.shape[0] % parts == 0,
        lambda: f"parts ({parts}) must be >= 1 and divide the rows of a ({a.shape[0]})",
    )
    if ready is not None:
        torch._check_value(
            ready.dtype == torch.int64 and tuple(ready.shape) == (parts,),
            lambda: f"ready must be an int64 tensor [parts] = [{parts}], got {tuple(ready.shape)}",
        )
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.register_fake("uniep::all_gather")
def _all_gather_fake(
    x: torch.Tensor, group_name: str, chunks: int = 1, order: str = "direct"
) -> torch.Tensor:
    world = _world_size_of(group_name)
    _check_x(x)
    _check_common(chunks, order)
    _check_divides(chunks, x.shape[0], "x.size(0), the rows of this rank's shard")
    return x.new_empty((world * x.shape[0], *x.shape[1:]))


@torch.library.register_fake("uniep::reduce_scatter")
def _reduce_scatter_fake(
    x: torch.Tensor, group_name: str, chunks: int = 1, order: str = "direct"
) -> torch.Tensor:
    world = _world_size_of(group_name)
    _check_x(x)
    _check_common(chunks, order)
    torch._check_value(
        x.shape[0] % world == 0,
        lambda: f"x.size(0) ({x.shape[0]}) must be divisible by the world size {world}",
    )
    _check_divides(
        chunks, x.shape[0] // world, "x.size(0) / world size, the rows of this rank's output"
    )
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))


def _ulysses_dims(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, world: int
) -> tuple[int, int]:
    torch._check_value(
        x.dim() >= 2,
        lambda: (
            "x must have at least 2 dimensions (one to scatter, one to gather), "
            f"got shape {tuple(x.shape)}"
        ),
    )
    _check_float(x, "x")
    n = x.dim()
    for name, d in (("scatter_dim", scatter_dim), ("gather_dim", gather_dim)):
        torch._check_value(
            -n <= d < n,
            lambda name=name, d=d: (
                f"{name} must be in [{-n}, {n}) for a tensor of {n} dimensions, got {d}"
            ),
        )
    sd, gd = scatter_dim % n, gather_dim % n
    torch._check_value(
        sd != gd, lambda: f"scatter_dim and gather_dim must differ, both are dimension {sd}"
    )
    torch._check_value(
        x.shape[sd] % world == 0,
        lambda: (
            f"x.size(scatter_dim = {sd}) ({x.shape[sd]}) must be divisible by the world "
            f"size {world}"
        ),
    )
    return sd, gd


@torch.library.register_fake("uniep::all_to_all_ulysses")
def _all_to_all_ulysses_fake(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group_name: str
) -> torch.Tensor:
    world = _world_size_of(group_name)
    sd, gd = _ulysses_dims(x, scatter_dim, gather_dim, world)
    shape = list(x.shape)
    shape[sd] //= world
    shape[gd] *= world
    return x.new_empty(shape)


# ---- autograd: every backward is the dual collective, so it overlaps the same way ----
# Which collectives a backward runs depends only on which inputs need gradients and which
# outputs were used: the same on every rank of an SPMD program, as it must be.


def _ag_mm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    a, b, group_name, chunks, order = inputs
    ag_out, _ = output
    ctx.save_for_backward(ag_out, b)
    ctx.args = (group_name, chunks, order)
    # An unused output's gradient stays None, so its collective is skipped on every rank.
    ctx.set_materialize_grads(False)


def _ag_mm_backward(ctx: Any, grad_ag: torch.Tensor | None, grad_mm: torch.Tensor | None) -> tuple:
    ag_out, b = ctx.saved_tensors
    group_name, chunks, order = ctx.args
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_a = grad_b = None
    if grad_mm is not None:
        if need_a:
            # d(ag @ b)/da is GEMM-RS: each rank's rows of sum over ranks of grad_mm @ b^T.
            grad_a = torch.ops.uniep.matmul_reduce_scatter(
                grad_mm.contiguous(), b.t().contiguous(), group_name, chunks, order
            )
        if need_b:
            grad_b = ag_out.t() @ grad_mm
    if grad_ag is not None and need_a:
        rs = torch.ops.uniep.reduce_scatter(grad_ag.contiguous(), group_name, chunks, order)
        grad_a = rs if grad_a is None else grad_a + rs
    return grad_a, grad_b, None, None, None


torch.library.register_autograd(
    "uniep::all_gather_matmul", _ag_mm_backward, setup_context=_ag_mm_setup
)


def _mm_rs_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, b, group_name, chunks, order = inputs
    ctx.save_for_backward(a, b)
    ctx.args = (group_name, chunks, order)


def _mm_rs_backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
    a, b = ctx.saved_tensors
    group_name, chunks, order = ctx.args
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_a = grad_b = None
    g = grad_out.contiguous()
    if need_a:
        # d(RS(a @ b))/da is AG-GEMM: all-gather grad_out, times b^T.
        gathered, grad_a = torch.ops.uniep.all_gather_matmul(
            g, b.t().contiguous(), group_name, chunks, order
        )
    elif need_b:
        gathered = torch.ops.uniep.all_gather(g, group_name, chunks, order)
    if need_b:
        grad_b = a.t() @ gathered
    return grad_a, grad_b, None, None, None


torch.library.register_autograd(
    "uniep::matmul_reduce_scatter", _mm_rs_backward, setup_context=_mm_rs_setup
)


def _save_args(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    # The one-tensor ops: their backward needs every argument but the tensor.
    ctx.args = inputs[1:]


def _all_gather_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return torch.ops.uniep.reduce_scatter(grad.contiguous(), *ctx.args), None, None, None


def _reduce_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return torch.ops.uniep.all_gather(grad.contiguous(), *ctx.args), None, None, None


torch.library.register_autograd("uniep::all_gather", _all_gather_backward, setup_context=_save_args)
torch.library.register_autograd(
    "uniep::reduce_scatter", _reduce_scatter_backward, setup_context=_save_args
)


def _ulysses_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    scatter_dim, gather_dim, group_name = ctx.args
    # The inverse re-layout: split what was gathered, gather what was split.
    return (
        torch.ops.uniep.all_to_all_ulysses(grad.contiguous(), gather_dim, scatter_dim, group_name),
        None,
        None,
        None,
    )


torch.library.register_autograd(
    "uniep::all_to_all_ulysses", _ulysses_backward, setup_context=_save_args
)


# ---- the CUDA runtime ----

DEFAULT_MAX_BLOCK_BYTES = 256 << 20


def init_cuda(
    group: dist.ProcessGroup | None = None,
    *,
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    timeout_s: float | None = None,
    parent: dist.ProcessGroup | None = None,
) -> None:
    """Create the CUDA collectives runtime of ``group`` on every rank (collective).

    NVSHMEM is initialised from rank 0's unique id (or shared with the expert-parallel runtime
    of the same ranks), and ``2 * world_size * max_block_bytes`` of symmetric memory is
    allocated (two sets of slots, so that no call needs a barrier): ``max_block_bytes`` is the
    largest block one rank moves in a call (all-gather kinds: the shard ``a``/``x`` in bytes;
    reduce-scatter kinds: one rank's output in bytes; all-to-all: one rank's block). A larger
    call later raises an error naming it. Every rank of ``group`` must be on one NVLink domain,
    and the current CUDA device must be this rank's GPU.

    ``parent`` (the default group, or any group that holds ``group``) makes ``group`` a
    sub-group: NVSHMEM and the symmetric memory span ``parent``'s ranks, but the group's calls
    move only its own ranks' blocks. Collective over ``parent``: every rank of it calls
    ``init_cuda`` at once, each with its own sub-group (the sub-groups partition ``parent``, as
    the MP or the EP groups of a layout do) and the same ``max_block_bytes``; ``shutdown_cuda``
    of the sub-groups is collective over ``parent`` too.
    """
    if not getattr(_C, "has_ep_runtime", False) or not torch.cuda.is_available():
        raise RuntimeError(
            "the UniEP CUDA collectives need a CUDA build of torch and a visible GPU "
            f"(build_info: {_C.build_info()})"
        )
    if not isinstance(max_block_bytes, int) or max_block_bytes < 1:
        raise ValueError(f"max_block_bytes must be a positive int, got {max_block_bytes!r}")
    members: list[int] = []  # the whole group
    if parent is None:
        name, world, me, uid = distributed.nvshmem_bootstrap(group)
    else:
        members = subgroup_members(group, parent)
        _, world, me, uid = distributed.nvshmem_bootstrap(parent)
        name = distributed.group_name(group)
    _C.coll_create(name, uid, world, me, max_block_bytes, _ep.wait_limit_s(timeout_s), members)


def subgroup_members(group: dist.ProcessGroup | None, parent: dist.ProcessGroup) -> list[int]:
    """The ranks in ``parent`` of ``group``'s ranks, in ``group``'s rank order (ascending, as
    torch orders a new group's ranks); a ValueError naming the argument where ``group`` is not
    a group of this rank inside ``parent`` or orders its ranks otherwise."""
    if group is None:
        raise ValueError("group: a sub-group (parent is given) must be a process group, got None")
    ranks = [int(r) for r in dist.get_process_group_ranks(group)]
    in_parent = set(int(r) for r in dist.get_process_group_ranks(parent))
    outside = [r for r in ranks if r not in in_parent]
    if outside:
        raise ValueError(f"group: ranks {outside} are not in parent (ranks {sorted(in_parent)})")
    members = [dist.get_group_rank(parent, r) for r in ranks]
    if members != sorted(members):
        raise ValueError(
            f"group: its ranks {ranks} must be in ascending order of their ranks in parent "
            f"({members}), the order the collectives number them in"
        )
    return members


def shutdown_cuda(group: dist.ProcessGroup | None = None) -> None:
    """Destroy the group's CUDA collectives runtime (collective; a no-op if there is none). A
    sub-group's (``init_cuda(parent=...)``) is collective over the parent: every rank of it
    destroys its own sub-group's runtime at once."""
    name = distributed.group_name(group)
    if getattr(_C, "has_ep_runtime", False) and _C.coll_exists(name):
        torch.cuda.synchronize()
        _C.coll_destroy(name)


def check(group: dist.ProcessGroup | None = None) -> None:
    """Synchronise the device and raise a timeout a CUDA collective of ``group`` recorded
    (NotImplementedError on a build without the GPU runtime, which has no ``_C.coll_*``
    functions at all: docs/errors.md's error for a request the build cannot serve)."""
    require_gpu_runtime(
        "uniep.collectives.check",
        "the collectives on CPU tensors run on the CPU executor over gloo, which needs no runtime",
    )
    _C.coll_check(distributed.group_name(group), True)


GEMM_BACKENDS = ("cublas", "cutlass", "gated")
_gemm_setting: tuple[str, int] = ("cublas", 0)


def set_gemm(backend: str = "cublas", sm_carveout: int = 0) -> None:
    """Choose the GEMM that the CUDA executor runs for the chunks of ``all_gather_matmul`` and
    ``matmul_reduce_scatter`` (process-wide; every rank of a group must choose the same).

    - ``"cublas"`` (the default): ``torch.mm``. A GEMM + reduce-scatter folds the ranks'
      partials with a kernel after the GEMM of each of its own parts; the last fold runs after
      the last GEMM.
    - ``"cutlass"``: UniEP's Hopper GEMM (``torch.ops.uniep.sm90_gemm``, CUTLASS 3) where it takes
      the operands: bfloat16 on compute capability 9.0 with rows of a multiple of 16 bytes;
      ``torch.mm`` elsewhere. A GEMM + reduce-scatter adds the peers' partials in the epilogue of
      its own parts' GEMMs (to the fp32 accumulator, so the own partial is rounded once, with the
      sum), which leaves no fold after the last GEMM; those parts' GEMMs wait for the peers'
      partials, so ``chunks >= 2`` lets the first ones arrive in time. The persistent grid
      leaves ``sm_carveout`` SMs free for the copies, waits and folds that run beside it. On most
      TP=2 shapes of bench_overlap it is slower than ``"cublas"`` (the GEMM alone is 3-16%
      slower than cuBLAS's on an H200: bench_gemm), hence not the default.

    - ``"gated"``: one persistent GEMM over all the chunks (``torch.ops.uniep.part_gemm``: the
      expert GEMM engine's gated 128 x 256 tiles, or 128 x 128 where the wider ones would
      leave much of the last wave idle) instead of one GEMM per chunk.
      ``all_gather_matmul``'s is launched at once; each tile waits on the device for its
      chunk's arrival word, the own shard's tiles first, and reads the peers' rows where they
      landed: the bits of the GEMM of the gathered operand for every chunk count.
      ``matmul_reduce_scatter``'s computes the peers' partials first and announces each chunk's
      stored tiles, on which the pushes wait (a stream wait, no SM), so every partial leaves as
      soon as it is stored; its own rows are folded with the peers' in the reduce order after
      the GEMM: the fixed-order sum of the partials, the same bits for every chunk count.
      ``sm_carveout`` SMs stay free. Where the operands do not fit it (as for ``"cutlass"``) or
      its 256-row tile clusters would pad a chunk by more than a quarter (chunks of fewer than
      256 rows, say), the chunks' GEMMs run as for ``"cutlass"`` but with the same fold, so the
      bits stay those of the fixed-order sum.

    Results are deterministic with each backend, but they round differently. The CPU executor
    is not affected.
    """
    global _gemm_setting
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    if isinstance(sm_carveout, bool) or not isinstance(sm_carveout, int) or sm_carveout < 0:
        raise ValueError(f"sm_carveout must be an int >= 0, got {sm_carveout!r}")
    if getattr(_C, "has_ep_runtime", False):
        _C.coll_set_gemm(backend, sm_carveout)
    _gemm_setting = (backend, sm_carveout)


def gemm() -> tuple[str, int]:
    """The ``(backend, sm_carveout)`` that ``set_gemm`` chose."""
    if getattr(_C, "has_ep_runtime", False):
        backend, carveout = _C.coll_gemm()
        return str(backend), int(carveout)
    return _gemm_setting


def _ensure_cuda(group_name: str, block_bytes: int) -> None:
    """Create the group's CUDA runtime on first use, large enough for ``block_bytes`` (the same
    on every rank for valid calls) and at least ``DEFAULT_MAX_BLOCK_BYTES``."""
    if _C.coll_exists(group_name):
        return
    group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else None
    capacity = max(DEFAULT_MAX_BLOCK_BYTES, 1 << max(0, block_bytes - 1).bit_length())
    init_cuda(group, max_block_bytes=capacity)


def _maybe_cuda(t: torch.Tensor, group_name: str, block_bytes: int) -> None:
    if t.is_cuda and getattr(_C, "has_ep_runtime", False):
        _ensure_cuda(group_name, block_bytes)


# ---- Python wrappers ----


def all_gather_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    chunks: int = 1,
    order: str = "direct",
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather ``a`` along rows and multiply by ``b``, the GEMM overlapping the transfers.

    The semantics of torch's ``fused_all_gather_matmul`` with ``gather_dim=0``. The local shard
    is multiplied first, while the first remote chunks arrive; nothing is in flight once the last
    chunk's GEMM starts. Differentiable: ``grad_a`` is a ``matmul_reduce_scatter`` (plus a
    ``reduce_scatter`` of ``ag_out``'s gradient when it is used), ``grad_b = ag_out^T @ grad``.

    Args:
        a: ``[M/W, K]`` this rank's rows; float32, bfloat16 or float64. ``M/W`` must be the same
            on every rank and divisible by ``chunks``.
        b: ``[K, N]`` of ``a``'s dtype: this rank's matrix (``N`` may differ across ranks, e.g.
            a column shard of a weight).
        group: the process group (None: see ``uniep.distributed.group_name``).
        chunks: pieces each rank's shard is split into (more pieces, finer overlap).
        order: ``"direct"`` or ``"ring"``; neither changes the result.

    Returns:
        ``(ag_out, mm_out)``: ``ag_out`` ``[M, K]`` every rank's ``a`` in rank order (a bit-exact
        copy), ``mm_out`` ``[M, N] = ag_out @ b`` accumulated in fp32 (fp64 for float64), in
        ``a``'s dtype.

    Raises:
        ValueError: a bad shape, dtype, ``chunks`` or ``order``, or a mismatch across ranks; the
            message names the argument.
    """
    name = distributed.group_name(group)
    _maybe_cuda(a, name, a.numel() * a.element_size())
    return torch.ops.uniep.all_gather_matmul(a, b, name, chunks, order)


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    chunks: int = 1,
    order: str = "direct",
) -> torch.Tensor:
    """``reduce_scatter(a @ b)`` along rows, the transfers overlapping the GEMM.

    Each rank computes its partial products for the other ranks' rows first and sends them while
    it computes the next; its own rows come last, so the last GEMM's output needs no transfer.
    Partials are rounded to ``a``'s dtype (as a GEMM writes them) and added in
    ``reduce_order(W, rank)`` in fp32 (fp64 for float64). Differentiable: ``grad_a`` is an
    ``all_gather_matmul`` of the output gradient with ``b^T``, ``grad_b = a^T @ gathered grad``.

    Args:
        a: ``[M, K_local]`` float32, bfloat16 or float64; ``M`` the same on every rank and
            divisible by ``W * chunks``.
        b: ``[K_local, N]`` of ``a``'s dtype (``N`` the same on every rank).
        group, chunks, order: as for ``all_gather_matmul``.

    Returns:
        ``[M/W, N]`` in ``a``'s dtype: rows ``[rank*M/W, (rank+1)*M/W)`` of the sum over ranks of
        ``a @ b``.
    """
    name = distributed.group_name(group)
    world = _world_size_of(name)
    _maybe_cuda(a, name, a.shape[0] // world * b.shape[-1] * a.element_size())
    return torch.ops.uniep.matmul_reduce_scatter(a, b, name, chunks, order)


def all_gather(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    chunks: int = 1,
    order: str = "direct",
) -> torch.Tensor:
    """All-gather along dim 0 by peer-to-peer chunks (e.g. a data-parallel parameter gather).

    Args:
        x: ``[m, ...]`` float32, bfloat16 or float64; the same shape on every rank, ``m``
            divisible by ``chunks``.

    Returns:
        ``[W*m, ...]``: every rank's ``x`` in rank order. Backward: ``reduce_scatter``.
    """
    name = distributed.group_name(group)
    _maybe_cuda(x, name, x.numel() * x.element_size())
    return torch.ops.uniep.all_gather(x, name, chunks, order)


def reduce_scatter(
    x: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    chunks: int = 1,
    order: str = "direct",
) -> torch.Tensor:
    """Sum over ranks, scattered along dim 0 (e.g. a data-parallel gradient reduce-scatter).

    Deterministic: the contributions are added in ``reduce_order(W, rank)`` in fp32 (fp64 for
    float64) and rounded once, the same bits for every ``chunks`` and ``order``.

    Args:
        x: ``[W*m, ...]`` float32, bfloat16 or float64; the same shape on every rank, ``m``
            divisible by ``chunks``.

    Returns:
        ``[m, ...]``: rows ``[rank*m, (rank+1)*m)`` of the sum. Backward: ``all_gather``.
    """
    name = distributed.group_name(group)
    _maybe_cuda(x, name, x.numel() // _world_size_of(name) * x.element_size())
    return torch.ops.uniep.reduce_scatter(x, name, chunks, order)


def all_to_all_ulysses(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The Ulysses sequence <-> heads all-to-all.

    Splits ``x`` along ``scatter_dim`` into ``W`` blocks, sends block ``p`` to rank ``p``, and
    concatenates the blocks received along ``gather_dim`` in rank order. With ``x`` ``[S/W, H, D]``
    (sequence-sharded), ``scatter_dim=1, gather_dim=0`` gives ``[S, H/W, D]`` (head-sharded);
    ``scatter_dim=0, gather_dim=1`` goes back. Backward: the same op with the dims swapped.

    Args:
        x: at least 2-D, float32, bfloat16 or float64; the same shape on every rank,
            ``x.size(scatter_dim)`` divisible by ``W``.
        scatter_dim, gather_dim: distinct dims of ``x`` (negative counts from the end), the same
            dims on every rank.

    Returns:
        ``x``'s shape with ``scatter_dim`` divided and ``gather_dim`` multiplied by ``W``.

    Raises:
        ValueError: a bad shape, dtype or dim, or a mismatch across ranks (the CPU executor
            checks the shape, dtype and dims of every rank; every rank raises).
    """
    name = distributed.group_name(group)
    _maybe_cuda(x, name, x.numel() // _world_size_of(name) * x.element_size())
    return torch.ops.uniep.all_to_all_ulysses(x, scatter_dim, gather_dim, name)


def schedule(
    kind: str, world_size: int, rank: int, chunks: int = 1, order: str = "direct"
) -> _C.CollectiveSchedule:
    """The plan ``rank`` runs for ``kind`` (one of ``KINDS``): per step, the chunk it computes,
    what it sends to and receives from which peer, and which arrivals each GEMM waits on.

    See ``include/uniep/collectives.hpp`` for the step model and why each order is tail-free.
    """
    return _C.collective_schedule(kind, world_size, rank, chunks, order)


def validate_schedules(ranks: list[_C.CollectiveSchedule]) -> None:
    """Check the schedules of all ranks of one world; raises RuntimeError naming the first
    violated invariant (matching, data flow, reduce order, tail-free)."""
    _C.validate_schedules(ranks)


def reduce_order(world_size: int, dest: int) -> list[int]:
    """Ranks whose contributions the reductions add for ``dest``'s rows, in order:
    ``dest+1, ..., dest-1`` (mod ``W``), then ``dest`` itself (its own partial is computed last)."""
    return list(_C.reduce_order(world_size, dest))
