"""Expert-parallel dispatch and combine on GPUs (NVSHMEM runtime, ``torch.ops.uniep.ep_*``).

A GPU runtime belongs to one process group and is created collectively::

    uniep.ep.init_runtime(group, max_tokens=4096, hidden=7168, top_k=8, num_experts=256)
    res = uniep.ep.dispatch(x, topk_idx, topk_weights)            # tokens into receive slots
    y = expert_fn(res.recv_x.index_select(0, res.handle.row_slot))  # grouped-GEMM rows
    out = uniep.ep.combine(y, res.handle)                          # back to (token, k) slots

Receive slots are ordered by (source rank, source token): outputs never depend on arrival order
or on the SM budget. Every device-side wait times out after ``timeout_s`` (default 100 s, env
``UNIEP_TIMEOUT_S``) with an error naming the operation and the rank that did not answer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _C
from .distributed import group_name as _group_name
from .distributed import rank as _rank
from .distributed import world_size as _world_size

__all__ = [
    "DispatchResult",
    "Handle",
    "available",
    "combine",
    "dispatch",
    "init_runtime",
    "shutdown",
]

_DEFAULT_TIMEOUT_S = 100.0


def available() -> bool:
    """True when this build has the GPU runtime (CUDA torch) and a GPU is visible."""
    return bool(getattr(_C, "has_ep_runtime", False)) and torch.cuda.is_available()


def _timeout(timeout_s: float | None) -> float:
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


def init_runtime(
    group: dist.ProcessGroup | None = None,
    *,
    max_tokens: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    max_row_bytes: int = 0,
    timeout_s: float | None = None,
) -> None:
    """Create the GPU runtime of ``group`` on every rank (collective).

    Rank 0 makes an NVSHMEM unique id and ``group`` broadcasts it; NVSHMEM is then initialised
    over the group's ranks (or reused if this process already initialised it over the same
    ranks) and the symmetric buffers are sized from the arguments:
    ``max_tokens`` (most tokens any rank dispatches at once), ``hidden``, ``top_k``,
    ``num_experts`` (split evenly over the ranks) and ``max_row_bytes`` (0: ``hidden`` bf16).
    The current CUDA device must be this rank's GPU.
    """
    if not available():
        raise RuntimeError(
            "the UniEP GPU runtime needs a CUDA build of torch and a visible GPU "
            f"(build_info: {_C.build_info()})"
        )
    for name, value in (
        ("max_tokens", max_tokens),
        ("hidden", hidden),
        ("top_k", top_k),
        ("num_experts", num_experts),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    name = _group_name(group)
    world, me = _world_size(group), _rank(group)
    uid = _C.ep_unique_id() if me == 0 else b""
    if world > 1:
        resolved = group if group is not None else dist.group.WORLD
        box = [uid]
        src = dist.get_global_rank(resolved, 0)
        dist.broadcast_object_list(box, src=src, group=resolved)
        uid = box[0]
    _C.ep_create(
        name,
        uid,
        max_tokens,
        hidden,
        top_k,
        num_experts,
        world,
        me,
        max_row_bytes,
        _timeout(timeout_s),
    )


def shutdown(group: dist.ProcessGroup | None = None) -> None:
    """Free the group's GPU runtime (collective: every rank calls it)."""
    name = _group_name(group)
    if getattr(_C, "has_ep_runtime", False) and _C.ep_exists(name):
        _C.ep_destroy(name)


@dataclass(frozen=True)
class Handle:
    """What combine needs from its dispatch.

    row_slot [R] int64: receive slot each grouped-GEMM row reads (local experts in order, each
    expert's rows in slot order); row_target [R] int64: where the row's output goes back to;
    topk_idx / topk_weights: this rank's routing as given to dispatch.
    """

    row_slot: torch.Tensor
    row_target: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    group_name: str
    tuning: str
    epoch: int


@dataclass(frozen=True)
class DispatchResult:
    """recv_x [N, H]: received rows in slot order (x's dtype, or float8_e4m3fn with
    ``dispatch=fp8``); recv_scales [N, H / 128] float32 block scales (fp8 only, else [0, 0]);
    recv_src [N] int64 source token; recv_topk_idx [N, K] int64 local expert ids (-1: expert on
    another rank); recv_topk_weights [N, K] float32; tokens_per_expert [E_local] int64
    grouped-GEMM rows per local expert."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor
    recv_src: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: Handle


def _tuning_string(tuning: str | _C.TuningParams) -> str:
    params = tuning if isinstance(tuning, _C.TuningParams) else _C.TuningParams.parse(tuning)
    return params.to_string()


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    tuning: str | _C.TuningParams = "",
) -> DispatchResult:
    """Send each token of ``x`` [T, H] (rows of a multiple of 16 bytes) once to every rank that
    holds one of its experts. ``topk_idx`` [T, K] int64 global expert ids (-1 unused),
    ``topk_weights`` [T, K] float32. ``tuning``: ``sms=`` sets the SM budget of the transfer;
    ``dispatch=fp8`` casts bf16 rows (H % 128 == 0) to e4m3 with one scale per 1x128 block inside
    the kernel. Synchronizes the host once (to learn the receive count)."""
    name = _group_name(group)
    text = _tuning_string(tuning)
    out = torch.ops.uniep.ep_dispatch(x, topk_idx, topk_weights, name, text)
    recv_x, scales, recv_src, recv_idx, recv_w, per_expert, row_slot, row_target, epoch = out
    handle = Handle(row_slot, row_target, topk_idx, topk_weights, name, text, epoch)
    return DispatchResult(recv_x, scales, recv_src, recv_idx, recv_w, per_expert, handle)


def combine(y: torch.Tensor, handle: Handle) -> torch.Tensor:
    """``y`` [R, H] bf16 expert outputs, row r for ``handle.row_slot[r]``; returns [T, H] with
    out[t] = sum_k topk_weights[t, k] * y_(t, k), k ascending, accumulated in fp32.

    Each dispatch is combined once, before the next dispatch on the group (its buffers are
    reused then); anything else raises ValueError."""
    return torch.ops.uniep.ep_combine(
        y,
        handle.row_target,
        handle.topk_idx,
        handle.topk_weights,
        handle.group_name,
        handle.epoch,
        handle.tuning,
    )


@torch.library.register_fake("uniep::ep_dispatch")
def _dispatch_fake(x, topk_idx, topk_weights, group_name, tuning=""):  # noqa: ANN001, ANN202
    ctx = torch.library.get_ctx()
    n = ctx.new_dynamic_size()
    r = ctx.new_dynamic_size()
    k = topk_idx.shape[1]
    i64 = torch.int64
    fp8 = _C.TuningParams.parse(tuning).dispatch == "fp8"
    recv_x = x.new_empty((n, x.shape[1]), dtype=torch.float8_e4m3fn if fp8 else x.dtype)
    scales = x.new_empty((n, x.shape[1] // 128) if fp8 else (0, 0), dtype=torch.float32)
    return (
        recv_x,
        scales,
        x.new_empty((n,), dtype=i64),
        x.new_empty((n, k), dtype=i64),
        x.new_empty((n, k), dtype=torch.float32),
        x.new_empty((ctx.new_dynamic_size(),), dtype=i64),
        x.new_empty((r,), dtype=i64),
        x.new_empty((r,), dtype=i64),
        0,
    )


@torch.library.register_fake("uniep::ep_combine")
def _combine_fake(y, row_target, topk_idx, topk_weights, group_name, epoch, tuning=""):  # noqa: ANN001, ANN202
    return y.new_empty((topk_idx.shape[0], y.shape[1]))
