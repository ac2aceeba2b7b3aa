"""Expert-parallel dispatch and combine on GPUs (NVSHMEM runtime, ``torch.ops.uniep.ep_*``).

A GPU runtime belongs to one process group and is created collectively::

    uniep.moe.ep.init_runtime(group, max_tokens=4096, hidden=7168, top_k=8, num_experts=256)
    res = uniep.moe.ep.dispatch(x, topk_idx, topk_weights)            # tokens into receive slots
    y = expert_fn(res.recv_x.index_select(0, res.handle.row_slot))  # grouped-GEMM rows
    out = uniep.moe.ep.combine(y, res.handle)                          # back to (token, k) slots

Receive slots are ordered by (source rank, source token): outputs never depend on arrival order
or on the SM budget. Every device-side wait times out after ``timeout_s`` (default 100 s, env
``UNIEP_TIMEOUT_S``) with an error naming the operation and the rank that did not answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from .._util.runtime import require_gpu_runtime
from ..distributed import bounded_wait, nvshmem_bootstrap, staging_device, wait_limit_s
from ..distributed import group_name as _group_name
from ..tuning.params import parse as parse_tuning

__all__ = [
    "CachedDispatchResult",
    "DispatchResult",
    "Handle",
    "available",
    "combine",
    "dispatch",
    "dispatch_cached",
    "check",
    "ensure_runtime",
    "grown_capacity",
    "init_runtime",
    "ll_combine",
    "ll_dispatch",
    "LowLatencyResult",
    "shutdown",
]


def available() -> bool:
    """True when this build has the GPU runtime (CUDA torch) and a GPU is visible."""
    return bool(getattr(_C, "has_ep_runtime", False)) and torch.cuda.is_available()


def _require_built(what: str) -> None:
    require_gpu_runtime(
        f"uniep.moe.ep.{what}",
        "the CPU executor (uniep.moe_forward on CPU tensors) needs no runtime",
    )


def init_runtime(
    group: dist.ProcessGroup | None = None,
    *,
    max_tokens: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    max_row_bytes: int = 0,
    timeout_s: float | None = None,
    ll_max_tokens: int = 0,
) -> None:
    """Create the GPU runtime of ``group`` on every rank (collective).

    Rank 0 makes an NVSHMEM unique id and ``group`` broadcasts it; NVSHMEM is then initialised
    over the group's ranks (or reused if this process already initialised it over the same
    ranks) and the symmetric buffers are sized from the arguments:
    ``max_tokens`` (most tokens any rank dispatches at once), ``hidden``, ``top_k``,
    ``num_experts`` (split evenly over the ranks) and ``max_row_bytes`` (0: ``hidden`` bf16).
    ``ll_max_tokens > 0`` also allocates the low-latency buffers (``ll_dispatch`` /
    ``ll_combine``: two sets of E_local x W regions of that many rows). The current CUDA device
    must be this rank's GPU.
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
    name, world, me, uid = nvshmem_bootstrap(group)
    if not isinstance(ll_max_tokens, int) or ll_max_tokens < 0:
        raise ValueError(f"ll_max_tokens must be an int >= 0, got {ll_max_tokens!r}")
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
        wait_limit_s(timeout_s),
        ll_max_tokens,
    )


def grown_capacity(current: int | None, needed: int) -> int:
    """``max_tokens`` of a runtime created (``current`` None) or re-created for a call whose
    largest batch over the ranks is ``needed`` tokens: a power of two, at least 256 and at
    least ``current``, so that batches up to that size reuse it."""
    want = max(256, 1 << max(0, int(needed) - 1).bit_length())
    return want if current is None else max(want, int(current))


def ensure_runtime(
    group_name: str, tokens: int, hidden: int, top_k: int, num_experts: int, grow: bool = False
) -> None:
    """Create the GPU runtime of the group named ``group_name`` on first use (collective).

    ``max_tokens`` becomes ``grown_capacity`` of the largest ``tokens`` over the ranks.
    ``hidden``, ``top_k`` and ``num_experts`` must be the same on every rank (the symmetric
    buffers are sized from them): a difference raises ValueError on every rank, naming the
    value and both ranks. A runtime that exists is kept: ``moe_forward`` grows it when a call
    needs more (``_runtime_for_call``), after agreeing on the sizes. ``grow``: this rank
    re-creates it when its ``tokens`` exceed the runtime's ``max_tokens`` or the sizes differ
    from the runtime's (another layer's), as ``moe_forward`` does; that is collective, so a
    caller passes it only where such a call comes on every rank together
    (``moe_forward_prepared``'s contract); at world 1 always.
    """
    _require_built("ensure_runtime")
    if _C.ep_exists(group_name):
        cfg = _C.ep_config(group_name)
        held = (int(cfg["hidden"]), int(cfg["top_k"]), int(cfg["num_experts"]))
        if grow and (tokens > int(cfg["max_tokens"]) or held != (hidden, top_k, num_experts)):
            _runtime_for_call(group_name, tokens, hidden, top_k, num_experts)
        return
    _runtime_for_call(group_name, tokens, hidden, top_k, num_experts)


def _runtime_for_call(
    group_name: str, tokens: int, hidden: int, top_k: int, num_experts: int
) -> None:
    """Create the group's runtime, or re-create it larger, for a call (collective: every rank
    calls it in the same call). The C++ ``moe_forward`` / ``moe_backward`` call it (set below)
    when the group has none, or when their agreed checks found it too small for this call on
    some rank; the new one holds the largest batch over the ranks and the call's sizes, and
    keeps the old one's row capacity, timeout and low-latency buffers."""
    group = dist.distributed_c10d._resolve_process_group(group_name) if group_name else None
    table = [[tokens]]
    if group is not None:
        # The sizes first, agreed like an op's arguments (a rank that failed its checks in
        # moe_forward meets this exchange and names its error here), then the largest batch.
        sizes = [("hidden", hidden), ("top_k", top_k), ("num_experts", num_experts)]
        _C.agree_call(group_name, "ep_runtime_create", sizes, "", "cuda")
        table = all_gather_ints([tokens], group, "the GPU runtime's creation (uniep.moe.ep)")
    most = max(row[0] for row in table)
    old = _C.ep_config(group_name) if _C.ep_exists(group_name) else None
    keep: dict[str, Any] = {}
    same = False
    if old is not None:
        same = (old["hidden"], old["top_k"], old["num_experts"]) == (hidden, top_k, num_experts)
        keep = {"timeout_s": old["timeout_s"], "ll_max_tokens": old["ll_max_tokens"]}
        if same:
            keep["max_row_bytes"] = old["max_row_bytes"]
        # Freeing symmetric memory is collective; work queued on it must be finished first.
        torch.cuda.synchronize()
        _C.ep_destroy(group_name)
    capacity = grown_capacity(old["max_tokens"] if same else None, most)
    init_runtime(
        group,
        max_tokens=capacity,
        hidden=hidden,
        top_k=top_k,
        num_experts=num_experts,
        **keep,
    )


if getattr(_C, "has_ep_runtime", False):
    # The CUDA moe_forward / moe_backward create and grow the runtime through this.
    _C.set_ep_runtime_factory(_runtime_for_call)


def all_gather_ints(values: list[int], group: dist.ProcessGroup, what: str) -> list[list[int]]:
    """Every rank's ``values`` (one row per rank), through ``group``; the wait is bounded by
    ``UNIEP_TIMEOUT_S`` so a rank that never joins makes the others raise, naming ``what``."""
    device = staging_device(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    everyone = torch.empty(world * len(values), dtype=torch.int64, device=device)
    work = dist.all_gather_into_tensor(everyone, mine, group=group, async_op=True)
    bounded_wait(work, group, what)
    return everyone.view(world, len(values)).tolist()


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
    another rank; ``torch.ops.uniep.expert_rows`` takes global ids: add ``rank x E_local`` where
    >= 0, docs/api.md); recv_topk_weights [N, K] float32; tokens_per_expert [E_local] int64
    grouped-GEMM rows per local expert."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor
    recv_src: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    handle: Handle


def _tuning_string(tuning: str | _C.TuningParams) -> str:
    params = parse_tuning(tuning)
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
    the kernel. Synchronizes the host once (to learn the receive count).

    Differentiable with respect to ``x`` (bf16 rows of ``hidden`` columns, ``dispatch=bf16``:
    the gradient of each receive slot comes home through a combine with unit weights) and
    ``topk_weights`` (the gradients of ``recv_topk_weights``, added over the ranks the token
    went to). The backward is collective like the forward: every rank must run it."""
    name = _group_name(group)
    text = _tuning_string(tuning)
    out = torch.ops.uniep.ep_dispatch(x, topk_idx, topk_weights, name, text)
    recv_x, scales, recv_src, recv_idx, recv_w, per_expert, row_slot, row_target, epoch = out
    handle = Handle(row_slot, row_target, topk_idx, topk_weights, name, text, epoch)
    return DispatchResult(recv_x, scales, recv_src, recv_idx, recv_w, per_expert, handle)


@dataclass(frozen=True)
class CachedDispatchResult:
    """recv_x [N, H]: the rows of x in the receive slots of the handle's plan (x's dtype, or
    float8_e4m3fn with ``dispatch=fp8``); recv_scales [N, H / 128] float32 (fp8 only, else
    [0, 0]); handle: this round's, for ``combine`` (the plan's rows and routing, a new epoch)."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor
    handle: Handle


def dispatch_cached(
    x: torch.Tensor, handle: Handle, tuning: str | _C.TuningParams | None = None
) -> CachedDispatchResult:
    """Send ``x`` [T, H] with the routing of ``handle``'s dispatch, on its plan: the rows land in
    the same receive slots, so that dispatch's recv_src, recv_topk_idx, recv_topk_weights,
    tokens_per_expert and row_slot describe them too. No routing layout, no count exchange and
    no host synchronisation: only a device-side barrier with the peers before the transfer
    (what DeepEP calls a cached dispatch). For a second tensor of the same tokens, or a
    gradient on the way back.

    The plan is the runtime's until the next ``dispatch`` with new routing on the group; a
    handle of an older plan raises ValueError. Every rank must call it in the same round: a
    rank whose peer passed new routing instead sends nothing, and its error (naming that peer)
    is raised by ``check`` or its next dispatch. ``tuning`` (default: the handle's) sets
    ``sms=`` and ``dispatch=fp8``; a ``combine=rank_partials`` of this round applies the plan
    dispatch's weights, as its combine would.

    Differentiable with respect to ``x`` as ``dispatch`` is (bf16 rows of ``hidden`` columns,
    ``dispatch=bf16``)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be a uniep.moe.ep.Handle, got {type(handle).__name__}")
    text = handle.tuning if tuning is None else _tuning_string(tuning)
    recv_x, scales, epoch = torch.ops.uniep.ep_dispatch_cached(
        x, handle.topk_idx, handle.topk_weights, handle.group_name, handle.epoch, text
    )
    return CachedDispatchResult(recv_x, scales, replace(handle, tuning=text, epoch=epoch))


def combine(y: torch.Tensor, handle: Handle) -> torch.Tensor:
    """``y`` [R, H] bf16 expert outputs, row r for ``handle.row_slot[r]``; returns [T, H] bf16
    with out[t] = sum_k topk_weights[t, k] * y_(t, k), k ascending, accumulated in fp32.

    With ``combine=rank_partials`` in the dispatch's tuning, each expert rank sums its own k's
    of a token first (ascending, fp32, stored once as a bf16 partial) and sends one row per
    (token, rank) instead of one per (token, k); the token's rank adds those partials in
    ascending rank order in fp32. There ``y`` may be float32: the expert outputs as the GEMM
    accumulated them, as ``moe_forward`` passes them, so that the partial's one rounding replaces
    the rows' own and the result keeps per_k's accuracy (bf16 rows are rounded twice: once as
    rows, once in the partial). Fewer bytes on the wire; deterministic and bit-identical to the
    CPU executor's ``combine=rank_partials`` on bf16 x, which sums the unrounded rows (and
    stores each partial in x's dtype: with float32 or float64 x, no extra rounding).

    Each dispatch is combined once, before the next dispatch on the group (its buffers are
    reused then); anything else raises ValueError.

    Differentiable with respect to ``y`` (grad_out[t] * topk_weights[t, k] for the row of
    (t, k)) and ``handle.topk_weights`` (grad_out[t] . y_(t, k), fp32). The backward dispatches
    grad_out with the same routing, so it is collective: every rank must run it."""
    return torch.ops.uniep.ep_combine(
        y,
        handle.row_target,
        handle.topk_idx,
        handle.topk_weights,
        handle.group_name,
        handle.epoch,
        handle.tuning,
    )


@dataclass(frozen=True)
class LowLatencyResult:
    """Views of the runtime's low-latency buffer (valid until its next ``ll_dispatch``):
    recv_x [E_local, W * L, H] bf16 (region (e, s) = rows s*L .. s*L + recv_count[e, s] - 1, in
    (token, k) order of source s); recv_count [E_local, W] int32; recv_slot [E_local, W * L]
    int64 = src_token * K + k."""

    recv_x: torch.Tensor
    recv_count: torch.Tensor
    recv_slot: torch.Tensor
    buffer: int


def ll_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    buffer: int = 0,
) -> LowLatencyResult:
    """Low-latency dispatch for decode batches: bf16 ``x`` [T, H] (T <= ll_max_tokens) and
    ``topk_idx`` [T, K]; no host synchronisation, so it can be captured in a CUDA graph. A token
    is sent once per (token, k) into fixed regions of its expert's rank. ``buffer`` (0 or 1)
    selects one of two buffer sets, so two rounds can be in flight."""
    rows, counts, slots = torch.ops.uniep.ll_dispatch(x, topk_idx, _group_name(group), buffer)
    return LowLatencyResult(rows, counts, slots, buffer)


def ll_combine(
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    buffer: int = 0,
) -> torch.Tensor:
    """``y`` [E_local, W * L, H] bf16 expert outputs in the ``ll_dispatch`` layout; returns
    [T, H] with out[t] = sum_k topk_weights[t, k] * y_(t, k), k ascending, fp32 (the same bits
    as ``combine``). No host synchronisation; errors surface through ``check``."""
    return torch.ops.uniep.ll_combine(y, topk_idx, topk_weights, _group_name(group), buffer)


def check(group: dist.ProcessGroup | None = None) -> None:
    """Synchronize and raise any error a device-side wait or capacity check recorded
    (NotImplementedError on a build without the GPU runtime)."""
    _require_built("check")
    _C.ep_check(_group_name(group))


def grad_tuning(tuning: str) -> str:
    """``tuning`` for the dispatches and combines inside a backward: ``dispatch=bf16`` (gradients
    travel in bf16 whatever the forward's precision; fp8 needs rows of exactly ``hidden`` bf16
    columns) and ``combine=per_k`` (those combines sum with unit weights, not the dispatch's,
    which ``rank_partials`` would apply on the expert side)."""
    params = parse_tuning(tuning)
    params.dispatch = "bf16"
    params.combine = "per_k"
    return params.to_string()


def _send_to_ranks(
    dest: torch.Tensor, index: torch.Tensor, values: torch.Tensor, group_name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sends item i, (``index[i]``, ``values[i]``), to rank ``dest[i]`` of the group over its
    process group (NCCL on GPUs); returns what reached this rank: (index, values, sender of each),
    grouped by sender in ascending rank order, each sender's items in the order it sent them.

    For small per-row metadata only: the runtime's combine carries bf16 rows of ``hidden``
    columns, and these are fp32 values that must arrive unrounded.
    """
    world = int(_C.ep_config(group_name)["world_size"])
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    index, values = index.index_select(0, order), values.index_select(0, order)
    if world == 1:
        return index, values, torch.zeros_like(index)
    group = dist.distributed_c10d._resolve_process_group(group_name)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    splits_in, splits_out = send_counts.tolist(), recv_counts.tolist()
    got_index = index.new_empty(sum(splits_out))
    got_values = values.new_empty((sum(splits_out), *values.shape[1:]))
    dist.all_to_all_single(got_index, index, splits_out, splits_in, group=group)
    dist.all_to_all_single(got_values, values, splits_out, splits_in, group=group)
    senders = torch.arange(world, device=recv_counts.device).repeat_interleave(recv_counts)
    return got_index, got_values, senders


def rows_to_slots(
    values: torch.Tensor, row_target: torch.Tensor, topk_idx: torch.Tensor, group_name: str
) -> torch.Tensor:
    """One fp32 value per grouped-GEMM row (``values`` [R]) back to slot (token, k) of the row's
    source rank: [T, K] float32 on each source, 0 where ``topk_idx`` is -1."""
    grad_w = torch.zeros(topk_idx.numel(), dtype=torch.float32, device=topk_idx.device)
    if int(_C.ep_config(group_name)["world_size"]) == 1:
        # Every row's source is this rank: no exchange, no sort, no count read back.
        grad_w[row_target] = values
        return grad_w.view_as(topk_idx).masked_fill(topk_idx < 0, 0.0)
    per_rank = int(_C.ep_config(group_name)["max_tokens"]) * topk_idx.shape[1]
    slots, got, _ = _send_to_ranks(
        row_target // per_rank, row_target % per_rank, values, group_name
    )
    grad_w[slots] = got
    return grad_w.view_as(topk_idx).masked_fill(topk_idx < 0, 0.0)


def _fake_received(x: torch.Tensor, n: Any, tuning: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The received rows of a fake dispatch (x's dtype, or e4m3 with dispatch=fp8) and their
    block scales ([0, 0] unless fp8)."""
    fp8 = parse_tuning(tuning).dispatch == "fp8"
    recv_x = x.new_empty((n, x.shape[1]), dtype=torch.float8_e4m3fn if fp8 else x.dtype)
    scales = x.new_empty((n, x.shape[1] // 128) if fp8 else (0, 0), dtype=torch.float32)
    return recv_x, scales


@torch.library.register_fake("uniep::ep_dispatch")
def _dispatch_fake(x, topk_idx, topk_weights, group_name, tuning=""):  # noqa: ANN001, ANN202
    ctx = torch.library.get_ctx()
    n = ctx.new_dynamic_size()
    r = ctx.new_dynamic_size()
    k = topk_idx.shape[1]
    i64 = torch.int64
    recv_x, scales = _fake_received(x, n, tuning)
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


@torch.library.register_fake("uniep::ep_dispatch_cached")
def _dispatch_cached_fake(x, topk_idx, topk_weights, group_name, epoch, tuning=""):  # noqa: ANN001, ANN202
    recv_x, scales = _fake_received(x, torch.library.get_ctx().new_dynamic_size(), tuning)
    return recv_x, scales, 0


@torch.library.register_fake("uniep::ll_dispatch")
def _ll_dispatch_fake(x, topk_idx, group_name, buffer=0):  # noqa: ANN001, ANN202
    cfg = _C.ep_config(group_name)
    local = cfg["num_experts"] // cfg["world_size"]
    per = cfg["world_size"] * cfg["ll_max_tokens"]
    return (
        x.new_empty((local, per, x.shape[1])),
        x.new_empty((local, cfg["world_size"]), dtype=torch.int32),
        x.new_empty((local, per), dtype=torch.int64),
    )


@torch.library.register_fake("uniep::ll_combine")
def _ll_combine_fake(y, topk_idx, topk_weights, group_name, buffer=0):  # noqa: ANN001, ANN202
    return y.new_empty((topk_idx.shape[0], y.shape[2]))


@torch.library.register_fake("uniep::ep_combine")
def _combine_fake(y, row_target, topk_idx, topk_weights, group_name, epoch, tuning=""):  # noqa: ANN001, ANN202
    return y.new_empty((topk_idx.shape[0], y.shape[1]), dtype=torch.bfloat16)


@torch.library.register_fake("uniep::moe_backward_engine")
def _moe_backward_engine_fake(grad_out, x, topk_idx, topk_weights, w1, w2, group_name, tuning=""):  # noqa: ANN001, ANN202
    # R, the rows this rank's experts receive, is data-dependent.
    rows = torch.library.get_ctx().new_dynamic_size()
    return (
        torch.empty_like(x),
        x.new_empty((rows,), dtype=torch.float32),
        x.new_empty((rows,), dtype=torch.int64),
        torch.empty_like(w1),
        torch.empty_like(w2),
    )


# Autograd of the raw ops. Each backward is itself collective (a dispatch, a combine, an
# all_to_all): every rank of the group must run it, in the same order, with the same inputs
# requiring grad. The forward's plan and combine buffers are gone by the time backward runs
# (each dispatch is combined once, before the next), so the backward dispatches again with the
# saved routing: the planner is deterministic, so the new plan has the forward's slots and rows.


def _dispatch_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, topk_idx, topk_weights, group_name, tuning = inputs
    _, _, recv_src, _, _, _, row_slot, row_target, _ = output
    ctx.save_for_backward(topk_idx, topk_weights, recv_src, row_slot, row_target)
    ctx.x_dtype, ctx.x_cols = x.dtype, x.shape[1]
    ctx.group_name, ctx.tuning = group_name, tuning


def _dispatch_grad_x(ctx: Any, grad_recv_x: torch.Tensor, slots: int, op: str) -> torch.Tensor:
    """Gradient of x through a dispatch (``op``) of ``slots`` receive slots: each slot's gradient
    comes home through a combine with unit weights. ctx: topk_idx and topk_weights first in
    saved_tensors; group_name, tuning, x_dtype, x_cols."""
    topk_idx, topk_weights = ctx.saved_tensors[:2]
    hidden = int(_C.ep_config(ctx.group_name)["hidden"])
    if parse_tuning(ctx.tuning).dispatch == "fp8":
        raise NotImplementedError(
            f"{op} backward: no gradient of x through dispatch=fp8 (the rows are "
            "quantised); dispatch in bf16 to differentiate"
        )
    if ctx.x_dtype != torch.bfloat16 or ctx.x_cols != hidden:
        raise NotImplementedError(
            f"{op} backward: the gradient of x comes home through ep_combine, which "
            f"carries bfloat16 rows of hidden = {hidden} columns; got x {ctx.x_dtype} with "
            f"{ctx.x_cols} columns"
        )
    text = grad_tuning(ctx.tuning)
    # Rows of 16 bytes: only the plan (and a fresh epoch for the combine) is wanted.
    stub = topk_idx.new_zeros((topk_idx.shape[0], 8), dtype=torch.bfloat16)
    plan = torch.ops.uniep.ep_dispatch(stub, topk_idx, topk_weights, ctx.group_name, text)
    _, _, _, recv_idx, _, _, row_slot, row_target, epoch = plan
    if recv_idx.shape[0] != slots:
        raise RuntimeError(
            f"{op} backward: the routing now gives {recv_idx.shape[0]} receive slots, "
            f"the forward had {slots}; it must not change in between on any rank"
        )
    # A token reaches a rank once however many of its experts live there, but combine sums one
    # row per (token, k): the slot's gradient rides on the row of its first local k alone, and
    # the others carry exact zeros (masked, not multiplied, so inf/nan elsewhere cannot leak).
    first_k = (recv_idx >= 0).to(torch.int32).argmax(1)
    keep = (row_target % topk_idx.shape[1]) == first_k.index_select(0, row_slot)
    rows = grad_recv_x.index_select(0, row_slot)
    rows = torch.where(keep.unsqueeze(1), rows, torch.zeros_like(rows))
    ones = torch.ones_like(topk_weights)
    return torch.ops.uniep.ep_combine(
        rows.contiguous(), row_target, topk_idx, ones, ctx.group_name, epoch, text
    )


def _dispatch_grad_weights(ctx: Any, grad_recv_w: torch.Tensor) -> torch.Tensor:
    topk_idx, topk_weights, recv_src, row_slot, row_target = ctx.saved_tensors
    cfg = _C.ep_config(ctx.group_name)
    world = int(cfg["world_size"])
    per_rank = int(cfg["max_tokens"]) * topk_idx.shape[1]
    # Every slot has at least one row (a token is sent to a rank only for an expert there).
    source = torch.zeros_like(recv_src)
    source[row_slot] = row_target // per_rank
    tokens, values, holder = _send_to_ranks(source, recv_src, grad_recv_w.float(), ctx.group_name)
    # A token's K weights went to each of its ranks: their gradients add up, in rank order.
    dense = torch.zeros((world, *topk_idx.shape), dtype=torch.float32, device=topk_weights.device)
    dense[holder, tokens] = values
    return dense.sum(0).to(topk_weights.dtype)


def _dispatch_backward(ctx: Any, *grads: Any) -> tuple:
    grad_recv_x, grad_recv_w = grads[0], grads[4]
    needs = ctx.needs_input_grad
    grad_x = grad_w = None
    if needs[0]:
        slots = ctx.saved_tensors[2].shape[0]
        grad_x = _dispatch_grad_x(ctx, grad_recv_x, slots, "ep_dispatch")
    if needs[2]:
        grad_w = _dispatch_grad_weights(ctx, grad_recv_w)
    return grad_x, None, grad_w, None, None


torch.library.register_autograd(
    "uniep::ep_dispatch", _dispatch_backward, setup_context=_dispatch_setup_context
)


def _dispatch_cached_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, topk_idx, topk_weights, group_name, _, tuning = inputs
    ctx.save_for_backward(topk_idx, topk_weights)
    ctx.slots = output[0].shape[0]
    ctx.x_dtype, ctx.x_cols = x.dtype, x.shape[1]
    ctx.group_name, ctx.tuning = group_name, tuning


def _dispatch_cached_backward(ctx: Any, *grads: Any) -> tuple:
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = _dispatch_grad_x(ctx, grads[0], ctx.slots, "ep_dispatch_cached")
    return grad_x, None, None, None, None, None


torch.library.register_autograd(
    "uniep::ep_dispatch_cached",
    _dispatch_cached_backward,
    setup_context=_dispatch_cached_setup_context,
)


def _combine_setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    y, row_target, topk_idx, topk_weights, group_name, _, tuning = inputs
    ctx.save_for_backward(y, row_target, topk_idx, topk_weights)
    ctx.group_name, ctx.tuning = group_name, tuning


def _combine_backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
    y, row_target, topk_idx, topk_weights = ctx.saved_tensors
    needs = ctx.needs_input_grad
    # grad_out[t] goes to every row of (t, k), where the rows came from: a dispatch (of bf16
    # rows, the output's dtype, also where y is rank_partials' fp32).
    back = torch.ops.uniep.ep_dispatch(
        grad_out.to(torch.bfloat16).contiguous(),
        topk_idx,
        topk_weights,
        ctx.group_name,
        grad_tuning(ctx.tuning),
    )
    recv_go, _, _, _, recv_w, _, row_slot, plan_target, _ = back
    if plan_target.shape != row_target.shape:
        raise RuntimeError(
            f"ep_combine backward: the routing gives {plan_target.shape[0]} rows, the forward "
            f"combined {row_target.shape[0]}; it must not change in between on any rank"
        )
    # y's rows may come in any order (row_target says where each goes): find each one's row in
    # the new plan by its target, which is unique per (rank, token, k).
    order = torch.argsort(plan_target)
    rows = order.index_select(0, torch.searchsorted(plan_target.index_select(0, order), row_target))
    slot = row_slot.index_select(0, rows)
    go = recv_go.index_select(0, slot).float()
    grad_y = grad_w = None
    if needs[0]:
        k_of_row = (row_target % topk_idx.shape[1]).unsqueeze(1)
        w_row = recv_w.index_select(0, slot).gather(1, k_of_row)
        grad_y = (go * w_row).to(y.dtype)
    if needs[3]:
        dots = (go * y.float()).sum(1)
        grad_w = rows_to_slots(dots, row_target, topk_idx, ctx.group_name)
        grad_w = grad_w.to(topk_weights.dtype)
    return grad_y, None, None, grad_w, None, None, None


torch.library.register_autograd(
    "uniep::ep_combine", _combine_backward, setup_context=_combine_setup_context
)
