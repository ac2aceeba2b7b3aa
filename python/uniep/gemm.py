"""The expert GEMM engine's Python side: the weight layout its SwiGLU epilogue reads, and the
fake kernel of ``torch.ops.uniep.grouped_mm_swiglu``.

The first expert GEMM computes ``h = x @ w1`` with ``w1 [E, H, 2I]`` holding the gate columns
``[:, :, :I]`` and the up columns ``[:, :, I:]``, then ``act = silu(gate) * up``. Done in the
GEMM's epilogue, each (gate j, up j) pair must land in one thread's accumulators, which hold two
adjacent columns of every block of 8: so the packed layout interleaves gate and up in blocks of
8 columns, ``[g0..g7, u0..u7, g8..g15, u8..u15, ...]``. ``pack_gate_up`` makes it once (a copy of
w1); ``grouped_mm_swiglu(x, pack_gate_up(w1), offs)`` then equals
``silu(h[:, :I]) * h[:, I:]`` of ``h = grouped_mm(x, w1, offs)`` without writing h.
"""

from __future__ import annotations

import torch

from .ops import check_grouped_mm_meta

__all__ = [
    "grouped_mm_dgrad",
    "grouped_mm_swiglu",
    "grouped_mm_wgrad",
    "pack_gate_up",
    "unpack_gate_up",
]

_BLOCK = 8


def _check_packable(w: torch.Tensor, name: str) -> tuple[int, int, int]:
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D [E, H, 2I], got shape {tuple(w.shape)}")
    e, h, two_i = w.shape
    if two_i % (2 * _BLOCK) != 0:
        raise ValueError(
            f"{name}.size(2) = 2I must be a multiple of {2 * _BLOCK} (gate and up interleave in "
            f"blocks of {_BLOCK} columns), got {two_i}"
        )
    return e, h, two_i // 2


def pack_gate_up(w1: torch.Tensor) -> torch.Tensor:
    """w1 [E, H, 2I] (gate columns, then up columns) -> the same values with gate and up
    interleaved in blocks of 8 columns, contiguous: the layout ``grouped_mm_swiglu`` reads."""
    e, h, i = _check_packable(w1, "w1")
    return (
        w1.reshape(e, h, 2, i // _BLOCK, _BLOCK)
        .permute(0, 1, 3, 2, 4)
        .reshape(e, h, 2 * i)
        .contiguous()
    )


def unpack_gate_up(w1_packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_gate_up`: [E, H, 2I] interleaved -> gate columns, then up."""
    e, h, i = _check_packable(w1_packed, "w1_packed")
    return (
        w1_packed.reshape(e, h, i // _BLOCK, 2, _BLOCK)
        .permute(0, 1, 3, 2, 4)
        .reshape(e, h, 2 * i)
        .contiguous()
    )


def grouped_mm_swiglu(
    x: torch.Tensor, w1_packed: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` for ``h = x @ w1[e]`` over each expert's rows
    ``[offs[e-1], offs[e])``, with SwiGLU applied in the GEMM's epilogue (CUDA, bf16, Hopper).

    w1_packed is ``pack_gate_up(w1)``. Numerics: h's columns rounded to bf16 (as a stored h
    would be), the activation in fp32, rounded once. tuning's tile_m, tile_n, tile_k and stages
    pick the engine's configuration (the bits do not depend on it).
    """
    return torch.ops.uniep.grouped_mm_swiglu(x, w1_packed, offs, tuning)


@torch.library.register_fake("uniep::grouped_mm_swiglu")
def _grouped_mm_swiglu_fake(
    x: torch.Tensor, w_packed: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    check_grouped_mm_meta(x, w_packed, offs)
    torch._check_value(
        w_packed.shape[2] % 16 == 0,
        lambda: (
            f"w must be [E, K, 2I] with 2I = w.size(2) a multiple of 16, got {w_packed.shape[2]}"
        ),
    )
    return x.new_empty((x.shape[0], w_packed.shape[2] // 2))


def grouped_mm_dgrad(
    dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    """``dy[rows of e] @ w[e].T`` for dy [R, N], w [E, K, N] -> [R, K]: the gradient of
    ``grouped_mm(x, w, offs)``'s input (CUDA, bf16, Hopper)."""
    return torch.ops.uniep.grouped_mm_dgrad(dy, w, offs, tuning)


def grouped_mm_wgrad(
    x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    """``x[rows of e].T @ dy[rows of e]`` for x [R, K], dy [R, N] -> [E, K, N] with E =
    offs.size(0): the gradient of ``grouped_mm(x, w, offs)``'s weight, summed over each expert's
    rows in ascending order (no split-K); zeros for an expert with no rows."""
    return torch.ops.uniep.grouped_mm_wgrad(x, dy, offs, tuning)


def _check_backward_meta(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, wgrad: bool) -> None:
    an, bn = ("x", "dy") if wgrad else ("dy", "w")
    torch._check_value(a.dim() == 2, lambda: f"{an} must be 2-D, got shape {tuple(a.shape)}")
    torch._check_value(
        b.dim() == (2 if wgrad else 3),
        lambda: (
            f"{bn} must be {'2-D [R, N]' if wgrad else '3-D [E, K, N]'}, got shape {tuple(b.shape)}"
        ),
    )
    torch._check_value(offs.dim() == 1, lambda: f"offs must be 1-D [E], got {tuple(offs.shape)}")
    torch._check_value(a.dtype == torch.bfloat16, lambda: f"{an} must be bfloat16, got {a.dtype}")
    torch._check_value(
        b.dtype == torch.bfloat16, lambda: f"{bn} must be bfloat16 like {an}, got {b.dtype}"
    )
    torch._check_value(offs.dtype == torch.int32, lambda: f"offs must be int32, got {offs.dtype}")
    if wgrad:
        torch._check_value(
            b.shape[0] == a.shape[0],
            lambda: f"dy must have the R = {a.shape[0]} rows of x, got {tuple(b.shape)}",
        )
    else:
        torch._check_value(
            offs.shape[0] == b.shape[0],
            lambda: f"offs must have E = w.size(0) = {b.shape[0]} entries, got {offs.shape[0]}",
        )
        torch._check_value(
            b.shape[2] == a.shape[1],
            lambda: f"w must be [E, K, N] with N = dy.size(1) = {a.shape[1]}, got {tuple(b.shape)}",
        )


@torch.library.register_fake("uniep::grouped_mm_dgrad")
def _grouped_mm_dgrad_fake(
    dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    _check_backward_meta(dy, w, offs, wgrad=False)
    return dy.new_empty((dy.shape[0], w.shape[1]))


@torch.library.register_fake("uniep::grouped_mm_wgrad")
def _grouped_mm_wgrad_fake(
    x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    _check_backward_meta(x, dy, offs, wgrad=True)
    return x.new_empty((offs.shape[0], x.shape[1], dy.shape[1]))
