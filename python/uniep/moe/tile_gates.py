"""Tile gates: the readiness counters the MoE MegaKernel's GEMMs wait on (docs/megakernel.md).

A gated grouped GEMM waits, before its producer loads the rows of output tile (expert e, m-tile
i), until ``counters[tile_base[e] + i] >= per_row * rows_in_tile + per_tile``. The writers of the
rows (the dispatch, or the previous GEMM's epilogue through ``done``) raise the counters. These
functions expose the gate on its own so it can be tested and timed; the MegaKernel composes it.
"""

from __future__ import annotations

import torch

from .. import _C
from ..gemm import check_grouped_mm_meta

# The gated GEMM's configuration (include/uniep/cuda/tile_gate.hpp): the cooperative
# 128 x 256 x 64 tile, two consumer warpgroups (8 warps) per tile.
TILE_M = 128
TILE_N = 256
WARPS_PER_TILE = 8


def tile_base(offs: torch.Tensor, rows: int, tile_m: int = TILE_M) -> torch.Tensor:
    """``[E + 1]`` int32: the first counter of each expert's ``tile_m``-row tiles, then the total,
    for the row ranges of ``offs`` (cumulative row ends, clamped as the grouped GEMM clamps
    them). CPU and CUDA give the same values; on CUDA nothing waits for the host."""
    return torch.ops.uniep.gate_tile_base(offs, rows, tile_m)


def done_per_tile(n: int) -> int:
    """What a tile of the second GEMM waits for when the first GEMM (width ``n`` = 2 x FFN)
    signals through ``done``: one arrival per warp and N-tile of the row block."""
    return WARPS_PER_TILE * -(-n // TILE_N)


def grouped_mm_gated(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    counters: torch.Tensor,
    base: torch.Tensor,
    *,
    per_row: int = 1,
    per_tile: int = 0,
    timeout_s: float = 10.0,
    swiglu: bool = False,
    done: torch.Tensor | None = None,
    sm_count: int | None = None,
    out: torch.Tensor | None = None,
    w1_as_stored: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_mm(x, w, offs)`` (or ``grouped_mm_swiglu`` with ``swiglu``; with
    ``w1_as_stored`` too, ``grouped_mm_swiglu_plain`` on w as stored) with each tile waiting
    at the gate first, written into ``out`` (a new tensor if None). Returns ``(out, timeout)``;
    pass ``timeout`` to :func:`check_gate_timeout` once the stream has run. ``sm_count``
    (default: all SMs) bounds the persistent grid: work that releases the gate from another
    stream needs SMs the GEMM leaves free, and its kernels must have run once before (under
    CUDA's lazy module loading a kernel's first launch may wait for the device to go idle, which
    a waiting GEMM never lets it; UniEP's own send is loaded here, before the launch)."""
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
    if out is None:
        out = x.new_empty((x.shape[0], w.shape[2] // 2 if swiglu else w.shape[2]))
    timeout = torch.ops.uniep.grouped_mm_gated(
        x, w, offs, counters, base, per_row, per_tile, timeout_s, swiglu, done, sm_count, out,
        w1_as_stored,
    )  # fmt: skip
    return out, timeout


def check_gate_timeout(timeout: torch.Tensor, what: str = "gated GEMM") -> None:
    """Raise ``TimeoutError`` naming the tile (or, for the fused kernel, the token and k, or
    the rank missing from the count exchange) if a gated wait gave up, or ``ValueError`` if a
    tile's counter lay past the end of ``counters`` (reads ``timeout``, so it waits for the
    stream that wrote it)."""
    flag, expert, m_tile, have, need = (int(v) for v in timeout.cpu().tolist())
    if flag == 2:
        raise ValueError(
            f"{what}: counters holds {have} entries, but expert {expert}, m-tile {m_tile} needs "
            f"entry {need} (size counters by tile_base's last entry)"
        )
    if flag == 3:
        raise TimeoutError(
            f"{what}: the expert output of token {expert}, k = {m_tile} never arrived "
            f"(its tile's counter reached {have} of {need})"
        )
    if flag == 4:
        raise TimeoutError(
            f"{what}: rank {expert} never joined the count exchange of call {need} (its last "
            f"call was {have}); every rank of the group must make the same calls"
        )
    if flag:
        raise TimeoutError(
            f"{what}: the rows of expert {expert}, m-tile {m_tile} never arrived "
            f"(its counter reached {have} of {need})"
        )


def expert_tiles(
    topk_idx: torch.Tensor, num_experts: int, tile_m: int = TILE_M
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan a MegaKernel call on one rank needs before its send, from the routing alone:
    ``(counts, offs, tile_base)``. ``counts`` ``[E]`` int64: the entries of ``topk_idx`` (``[T,
    K]`` int64) routed to each expert, where negative ids and ids >= ``num_experts`` count
    nowhere (:func:`sender_rows` reports both but -1). ``offs`` ``[E]`` int32: their inclusive
    sums, the grouped GEMM's row ends. ``tile_base`` ``[E + 1]`` int32: :func:`tile_base` of
    ``offs`` over ``T x K`` rows. On CUDA: a memset and one launch, no host sync."""
    return torch.ops.uniep.expert_tiles(topk_idx, num_experts, tile_m)


def local_plan(
    topk_idx: torch.Tensor, num_experts: int, tile_m: int = TILE_M
) -> tuple[torch.Tensor, ...]:
    """The whole plan of a world-1 MegaKernel call: :func:`expert_tiles`'s ``(counts, offs,
    tile_base)``, then :func:`sender_rows`'s ``(dest_rank, gemm_row, counter, error)`` for
    rank 0 of one, with the same values. On CUDA, up to 1,024 experts, a memset and two
    launches (a counting sort, where :func:`sender_rows` has every expert's block walk every
    id). Nothing waits for the host; read ``error`` later with :func:`check_send_error`."""
    return torch.ops.uniep.local_plan(topk_idx, num_experts, tile_m)


def sender_rows(
    topk_idx: torch.Tensor,
    expert_counts: torch.Tensor,
    rank: int,
    *,
    tile_m: int = TILE_M,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each of this rank's ``(token, k)`` rows goes in the MegaKernel's dispatch:
    ``(dest_rank, gemm_row, counter, error)``, the first three ``[T, K]`` int64 (-1 for unused
    entries): the destination rank, the grouped-GEMM row there (its local experts' rows in order,
    each expert's rows by source rank, then in this rank's ``(token, k)`` order) and the row's
    tile gate counter there (:func:`tile_base` over that rank's rows, plus the m-tile).
    ``expert_counts`` is ``[W, E]``: the rows every rank routes to every expert, as all ranks
    agreed. With ``check`` a failing entry (an id >= E, more rows to an expert than this rank's
    count) raises ``ValueError`` (on CUDA this waits for the stream); without it, read ``error``
    later with :func:`check_send_error`."""
    dest, row, counter, error = torch.ops.uniep.sender_rows(topk_idx, expert_counts, rank, tile_m)
    if check:
        check_send_error(error, topk_idx.shape[1], "sender_rows")
    return dest, row, counter, error


def send_rows(
    x: torch.Tensor,
    dest_rank: torch.Tensor,
    gemm_row: torch.Tensor,
    counter: torch.Tensor,
    rows: torch.Tensor,
    counters: torch.Tensor,
    *,
    sm_count: int | None = None,
) -> torch.Tensor:
    """The MegaKernel's dispatch at world 1: ``rows[gemm_row[t, k]] = x[t]`` and
    ``counters[counter[t, k]] += 1`` for every used entry (the plan of :func:`sender_rows`), on
    ``sm_count`` SMs on CUDA (default 16), so that a gated GEMM waiting on ``counters`` from
    another stream starts on each tile once its rows are in. Returns the error word; pass it to
    :func:`check_send_error` once the stream has run. A failing entry is neither stored nor
    counted."""
    if sm_count is None:
        sm_count = 16
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            sm_count = min(sm_count, sms)
    return torch.ops.uniep.send_rows(x, dest_rank, gemm_row, counter, rows, counters, sm_count)


def combine_rows(
    y: torch.Tensor, gemm_row: torch.Tensor, topk_weights: torch.Tensor, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out[t] = sum_k topk_weights[t, k] * y[gemm_row[t, k]]`` over the entries with
    ``gemm_row >= 0``, in ascending k, fp32, rounded once to bf16: every combine's arithmetic, so
    the bits are theirs. Returns ``(out, error)``; with ``check`` a row past ``y``'s raises
    ``ValueError`` naming the entry (on CUDA this waits for the stream)."""
    out, error = torch.ops.uniep.combine_rows(y, gemm_row, topk_weights)
    if check:
        check_send_error(error, gemm_row.shape[1], "combine_rows")
    return out, error


def check_send_error(error: torch.Tensor, top_k: int, what: str = "send_rows") -> None:
    """Raise ``ValueError`` naming the failing ``(token, k)`` entry if ``error`` (from
    :func:`sender_rows` or :func:`send_rows`) records one; reads it, so it waits for its stream."""
    message = _C.send_rows_error_message(int(error.cpu().item()), top_k, what)
    if message:
        raise ValueError(message)


def _check_topk_idx_2d(topk_idx: torch.Tensor) -> None:
    """The fake kernels' shape check of ``topk_idx``: ``[T, K]``."""
    torch._check_value(
        topk_idx.dim() == 2, lambda: f"topk_idx must be 2-D, got shape {tuple(topk_idx.shape)}"
    )


@torch.library.register_fake("uniep::sender_rows")
def _sender_rows_fake(
    topk_idx: torch.Tensor, expert_counts: torch.Tensor, rank: int, tile_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_topk_idx_2d(topk_idx)
    return (
        torch.empty_like(topk_idx),
        torch.empty_like(topk_idx),
        torch.empty_like(topk_idx),
        topk_idx.new_empty((1,)),
    )


@torch.library.register_fake("uniep::send_order")
def _send_order_fake(
    topk_idx: torch.Tensor, expert_counts: torch.Tensor, rank: int
) -> torch.Tensor:
    _check_topk_idx_2d(topk_idx)
    return topk_idx.new_empty((topk_idx.numel(),))


def send_order(topk_idx: torch.Tensor, expert_counts: torch.Tensor, rank: int) -> torch.Tensor:
    """The plan's order of this rank's ``(token, k)`` entries (flat ``t * K + k``) for a send
    that overlaps the GEMMs (the MegaKernel across ranks with fewer senders than CTAs): by the
    expert's index on its rank, then its rank, each expert's entries in row order, at positions
    the announced counts give; -1 elsewhere. Every rank's first experts are complete first."""
    return torch.ops.uniep.send_order(topk_idx, expert_counts, rank)


@torch.library.register_fake("uniep::send_rows")
def _send_rows_fake(
    x: torch.Tensor,
    dest_rank: torch.Tensor,
    gemm_row: torch.Tensor,
    counter: torch.Tensor,
    rows: torch.Tensor,
    counters: torch.Tensor,
    sm_count: int,
) -> torch.Tensor:
    return x.new_empty((1,), dtype=torch.int64)


@torch.library.register_fake("uniep::keep_first_errors")
def _keep_first_errors_fake(sticky: list[torch.Tensor], words: list[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("uniep::combine_rows")
def _combine_rows_fake(
    y: torch.Tensor, gemm_row: torch.Tensor, topk_weights: torch.Tensor, report: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check_value(y.dim() == 2, lambda: f"y must be 2-D, got shape {tuple(y.shape)}")
    return y.new_empty((gemm_row.shape[0], y.shape[1])), gemm_row.new_empty((1 if report else 0,))


@torch.library.register_fake("uniep::expert_tiles")
def _expert_tiles_fake(
    topk_idx: torch.Tensor, num_experts: int, tile_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_topk_idx_2d(topk_idx)
    torch._check_value(num_experts >= 1, lambda: f"num_experts must be >= 1, got {num_experts}")
    offs = topk_idx.new_empty((num_experts,), dtype=torch.int32)
    return topk_idx.new_empty((num_experts,)), offs, offs.new_empty((num_experts + 1,))


@torch.library.register_fake("uniep::local_plan")
def _local_plan_fake(
    topk_idx: torch.Tensor, num_experts: int, tile_m: int
) -> tuple[torch.Tensor, ...]:
    counts, offs, base = _expert_tiles_fake(topk_idx, num_experts, tile_m)
    return (
        counts,
        offs,
        base,
        torch.empty_like(topk_idx),
        torch.empty_like(topk_idx),
        torch.empty_like(topk_idx),
        topk_idx.new_empty((1,)),
    )


@torch.library.register_fake("uniep::gate_tile_base")
def _gate_tile_base_fake(offs: torch.Tensor, rows: int, tile_m: int) -> torch.Tensor:
    torch._check_value(offs.dim() == 1, lambda: f"offs must be 1-D, got shape {tuple(offs.shape)}")
    return offs.new_empty((offs.shape[0] + 1,))


@torch.library.register_fake("uniep::grouped_mm_gated")
def _grouped_mm_gated_fake(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    counters: torch.Tensor,
    tile_base: torch.Tensor,
    per_row: int,
    per_tile: int,
    timeout_s: float,
    swiglu: bool,
    done: torch.Tensor | None,
    sm_count: int,
    out: torch.Tensor,
    w1_as_stored: bool = False,
) -> torch.Tensor:
    check_grouped_mm_meta(x, w, offs)
    return x.new_empty((5,), dtype=torch.int32)


def fused_outputs_meta(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MegaKernel forward ops' fake outputs: out shaped as x, the error word and the timeout
    record."""
    return (
        x.new_empty(x.shape),
        x.new_empty((1,), dtype=torch.int64),
        x.new_empty((5,), dtype=torch.int32),
    )


def check_routing_meta(x: torch.Tensor, topk_idx: torch.Tensor) -> None:
    """The fake kernels' check of ``x`` [T, H] and its routing ``topk_idx`` [T, K]."""
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    torch._check_value(
        topk_idx.dim() == 2 and topk_idx.shape[0] == x.shape[0],
        lambda: f"topk_idx must be [T = {x.shape[0]}, K], got shape {tuple(topk_idx.shape)}",
    )


def fused_local_meta(
    x: torch.Tensor, w2: torch.Tensor, tile_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The world-1 MegaKernel ops' fake checks and outputs."""
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    torch._check_value(tile_m in (128, 64), lambda: f"tile_m must be 128 or 64, got {tile_m}")
    torch._check_value(
        w2.dim() == 3 and w2.shape[2] == x.shape[1],
        lambda: f"w2 must be [E, I, H = {x.shape[1]}], got shape {tuple(w2.shape)}",
    )
    return fused_outputs_meta(x)


@torch.library.register_fake("uniep::moe_fused_local_planned")
def _moe_fused_local_planned_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    timeout_s: float,
    tile_m: int = 128,
    w1_as_stored: bool = False,
    tile_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_routing_meta(x, topk_idx)
    return fused_local_meta(x, w2, tile_m)


@torch.library.register_fake("uniep::moe_fused_local")
def _moe_fused_local_fake(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    gemm_row: torch.Tensor,
    counter: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    offs: torch.Tensor,
    tile_base: torch.Tensor,
    comm_ctas: int,
    skip_rounds: int,
    timeout_s: float,
    trace: torch.Tensor | None = None,
    tile_m: int = 128,
    w1_as_stored: bool = False,
    tile_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_local_meta(x, w2, tile_m)
