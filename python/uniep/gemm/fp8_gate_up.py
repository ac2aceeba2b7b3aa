"""fp8 w1 packed for the SwiGLU epilogue of the first fp8 expert GEMM.

:func:`uniep.gemm.quantize_expert_weights` stores w1 K-major, ``[E, 2I, K]`` e4m3: rows
``[0, I)`` are the gate's columns, ``[I, 2I)`` the up's, with one scale per 128 x 128 block,
``[E, K / 128, 2I / 128]``. The fp8 GEMM's SwiGLU epilogue needs gate column c and up column c
in one tile, 64 tile columns apart, so :func:`pack_gate_up_fp8` orders the rows in blocks of 64
(gate, up): packed row ``c + 64 g + 128 j`` is row ``g I + 64 j + c`` (c < 64, g 0 for the gate
and 1 for the up, j < I / 64), and each packed 64-row group keeps the scale of the 128 x 128 block
its rows came from: ``[E, K / 128, 2I / 64]``. The values are not touched, so
:func:`grouped_mm_fp8_swiglu` on the packed weights gives the bits of ``grouped_mm_fp8`` on the
unpacked ones followed by ``silu(gate) * up`` rounded to bf16, without the ``[R, 2I]`` product
reaching memory. ``uniep.moe.prepared``'s ``"fp8"`` experts hold w1 this way, as ``moe_forward``'s
kept e4m3 copy does; ``include/uniep/fp8_weights.hpp`` defines the layout, with host functions
for C++ servers.
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm_fp8_swiglu", "pack_gate_up_fp8", "unpack_gate_up_fp8"]


def pack_gate_up_fp8(q1: torch.Tensor, s1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 as :func:`uniep.gemm.quantize_expert_weights` stores it (``q1 [E, 2I, K]`` e4m3,
    ``s1 [E, K / 128, 2I / 128]``) -> the layout :func:`grouped_mm_fp8_swiglu` reads (module
    docstring): ``([E, 2I, K], [E, K / 128, 2I / 64])``, contiguous copies on q1's device
    (``torch.ops.uniep.pack_gate_up_fp8``, the layout of the C++ ``uniep::pack_gate_up_fp8``)."""
    q, s = torch.ops.uniep.pack_gate_up_fp8(q1, s1)
    return q, s


def unpack_gate_up_fp8(
    q_packed: torch.Tensor, s_packed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_gate_up_fp8`: the gate rows, then the up rows, with one scale
    per 128 x 128 block (both 64-row halves of a block carry its scale);
    ``torch.ops.uniep.unpack_gate_up_fp8``."""
    q, s = torch.ops.uniep.unpack_gate_up_fp8(q_packed, s_packed)
    return q, s


def grouped_mm_fp8_swiglu(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w_packed: torch.Tensor,
    w_scales: torch.Tensor,
    offs: torch.Tensor,
    tuning: str = "",
) -> torch.Tensor:
    """The first fp8 expert GEMM with SwiGLU in its epilogue (CUDA, Hopper): ``x [R, K]`` e4m3
    with ``x_scales [R, K / 128]`` times w1 packed by :func:`pack_gate_up_fp8` -> the activation
    ``silu(gate) * up`` as bf16 ``[R, I]`` (the bits of :func:`uniep.gemm.grouped_mm_fp8` on the
    unpacked weights, then SwiGLU rounded to bf16); rows past ``offs[E - 1]`` are not written.
    ``tuning``'s tile keys pick the configuration, as for ``grouped_mm_fp8`` (the swapped tiles
    have no SwiGLU epilogue)."""
    return torch.ops.uniep.grouped_mm_fp8_swiglu(x, x_scales, w_packed, w_scales, offs, tuning)


@torch.library.register_fake("uniep::grouped_mm_fp8_swiglu")
def _grouped_mm_fp8_swiglu_fake(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w_packed: torch.Tensor,
    w_scales: torch.Tensor,
    offs: torch.Tensor,
    tuning: str = "",
) -> torch.Tensor:
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [R, K], got {tuple(x.shape)}")
    torch._check_value(
        w_packed.dim() == 3, lambda: f"w must be 3-D [E, N, K], got {tuple(w_packed.shape)}"
    )
    torch._check_value(
        x.dtype == torch.float8_e4m3fn, lambda: f"x must be float8_e4m3fn, got {x.dtype}"
    )
    torch._check_value(
        w_packed.dtype == torch.float8_e4m3fn,
        lambda: f"w must be float8_e4m3fn, got {w_packed.dtype}",
    )
    torch._check_value(
        w_packed.shape[2] == x.shape[1],
        lambda: (
            f"w must be [E, N, K] with K = x.size(1) = {x.shape[1]}, got {tuple(w_packed.shape)}"
        ),
    )
    return x.new_empty((x.shape[0], w_packed.shape[1] // 2), dtype=torch.bfloat16)
