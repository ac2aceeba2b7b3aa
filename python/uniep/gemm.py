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

__all__ = ["grouped_mm_swiglu", "pack_gate_up", "unpack_gate_up"]

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
