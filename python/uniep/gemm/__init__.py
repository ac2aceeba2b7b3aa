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

from .. import _C
from .fp8_gate_up import grouped_mm_fp8_swiglu, pack_gate_up_fp8, unpack_gate_up_fp8

__all__ = [
    "pingpong_rows",
    "dequantize_expert_weights",
    "dequantize_rows",
    "grouped_mm_dgrad",
    "grouped_mm_fp8",
    "grouped_mm_fp8_swiglu",
    "grouped_mm_swiglu",
    "grouped_mm_swiglu_plain",
    "grouped_mm_wgrad",
    "pack_gate_up",
    "pack_gate_up_fp8",
    "quantize_expert_weights",
    "quantize_rows",
    "swiglu_fp8",
    "unpack_gate_up",
    "unpack_gate_up_fp8",
]

_BLOCK = 8


def check_grouped_mm_meta(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    """The metadata checks of the grouped GEMM's CUDA kernel, worded alike (fake kernels)."""
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [R, K], got shape {tuple(x.shape)}")
    torch._check_value(w.dim() == 3, lambda: f"w must be 3-D [E, K, N], got shape {tuple(w.shape)}")
    torch._check_value(
        offs.dim() == 1, lambda: f"offs must be 1-D [E], got shape {tuple(offs.shape)}"
    )
    torch._check_value(x.dtype == torch.bfloat16, lambda: f"x must be bfloat16, got {x.dtype}")
    torch._check_value(
        w.dtype == torch.bfloat16, lambda: f"w must be bfloat16 like x, got {w.dtype}"
    )
    torch._check_value(offs.dtype == torch.int32, lambda: f"offs must be int32, got {offs.dtype}")
    torch._check_value(
        offs.shape[0] == w.shape[0],
        lambda: f"offs must have E = w.size(0) = {w.shape[0]} entries, got {offs.shape[0]}",
    )
    torch._check_value(
        w.shape[1] == x.shape[1],
        lambda: f"w must be [E, K, N] with K = x.size(1) = {x.shape[1]}, got {tuple(w.shape)}",
    )


def check_out_dtype(out_dtype: torch.dtype | None) -> torch.dtype:
    """The grouped GEMMs' output dtype: bf16 (None), or float32 (the accumulator as is)."""
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    torch._check_value(
        dtype in (torch.bfloat16, torch.float32),
        lambda: f"out_dtype must be bfloat16 or float32, got {out_dtype}",
    )
    return dtype


@torch.library.register_fake("uniep::grouped_mm")
def _grouped_mm_fake(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    tuning: str = "",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [R, K] bf16, w [E, K, N] bf16, offs [E] int32 (cumulative row ends) -> [R, N] bf16
    (float32 with out_dtype float32: the accumulator, not rounded).

    Expert e multiplies rows [offs[e-1], offs[e]) of x by w[e], as ``torch._grouped_mm``; rows
    past offs[E-1] are not written.
    """
    check_grouped_mm_meta(x, w, offs)
    return x.new_empty((x.shape[0], w.shape[2]), dtype=check_out_dtype(out_dtype))


def pingpong_rows(device: torch.device | int | None = None) -> int:
    """Rows per expert up to which the engine's automatic tile choice takes the 64-row ping-pong
    tiles for the SwiGLU GEMM and for k <= n on ``device`` (default: the current CUDA device):
    2048 where the memory moves at least 4 TB/s (H200), 256 below (H100), by the device's peak
    bandwidth (``include/uniep/cuda/grouped_gemm.hpp``, ``grouped_gemm_pingpong_rows``). 2048
    without a CUDA build or device. The MegaKernel's automatic tile height follows it too."""
    if not torch.cuda.is_available() or not hasattr(_C, "grouped_gemm_pingpong_rows"):
        return 2048
    if isinstance(device, torch.device):
        device = device.index if device.type == "cuda" else None
    return int(_C.grouped_gemm_pingpong_rows(-1 if device is None else device))


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


def _swiglu_meta(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, multiple: int, message: str
) -> torch.Tensor:
    """The SwiGLU GEMMs' fake: the grouped GEMM's checks, w's width a multiple of ``multiple``
    (``message`` names it), and the [R, I] activation."""
    check_grouped_mm_meta(x, w, offs)
    torch._check_value(w.shape[2] % multiple == 0, lambda: f"{message}, got {w.shape[2]}")
    return x.new_empty((x.shape[0], w.shape[2] // 2))


@torch.library.register_fake("uniep::grouped_mm_swiglu")
def _grouped_mm_swiglu_fake(
    x: torch.Tensor, w_packed: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    return _swiglu_meta(
        x, w_packed, offs, 16, "w must be [E, K, 2I] with 2I = w.size(2) a multiple of 16"
    )


def grouped_mm_swiglu_plain(
    x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    """:func:`grouped_mm_swiglu`'s activation, bit for bit, from ``w1 [E, H, 2I]`` as stored (gate
    columns ``[:, :, :I]``, then up): no packed copy, so nothing to redo when w1 changes (CUDA,
    bf16, Hopper). The kernel's loads read w1 as if packed in blocks of 64 columns, so w1 must be
    contiguous and I a multiple of 64 (and of ``tile_n / 2`` when tuning names ``tile_n``; the
    automatic choice takes a 128-wide tile where I is not a multiple of 128)."""
    return torch.ops.uniep.grouped_mm_swiglu_plain(x, w1, offs, tuning)


@torch.library.register_fake("uniep::grouped_mm_swiglu_plain")
def _grouped_mm_swiglu_plain_fake(
    x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, tuning: str = ""
) -> torch.Tensor:
    return _swiglu_meta(
        x, w1, offs, 128, "w1 must be [E, K, 2I] with I = w1.size(2) / 2 a multiple of 64 (2I)"
    )


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


# fp8 (e4m3, OCP "fn") with one fp32 scale per block: scale = amax / 448 (1 for an all-zero
# block), q = round-to-nearest-even(v / scale) saturated at 448. The rows' encoding is the fp8
# dispatch's (cpp/cuda/dispatch/dispatch.cu, cpp/core/numeric.hpp), so received rows feed
# grouped_mm_fp8 as they are.
_FP8_BLOCK = 128
_E4M3_MAX = 448.0


def _block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.where(amax > 0, amax / _E4M3_MAX, torch.ones_like(amax))
    inv = torch.where(amax > 0, _E4M3_MAX / amax, torch.ones_like(amax))
    return scale, inv


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (K a multiple of 128) -> (e4m3 [R, K], fp32 scales [R, K / 128]): one scale per
    row and 128 columns, the fp8 dispatch's format (``torch.ops.uniep.quantize_fp8`` gives the
    dispatch's own bytes for bf16 rows, in one launch on CUDA)."""
    if x.dim() != 2 or x.shape[1] % _FP8_BLOCK != 0:
        raise ValueError(f"x must be [R, K] with K a multiple of 128, got {tuple(x.shape)}")
    r, k = x.shape
    blocks = x.float().reshape(r, k // _FP8_BLOCK, _FP8_BLOCK)
    scale, inv = _block_scales(blocks.abs().amax(dim=2))
    q = (blocks * inv.unsqueeze(2)).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(r, k), scale


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values (e4m3 value times its block's scale) of :func:`quantize_rows`' output."""
    r, k = q.shape
    return (q.float().reshape(r, k // _FP8_BLOCK, _FP8_BLOCK) * scales.unsqueeze(2)).reshape(r, k)


def quantize_expert_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] (the bf16 expert weight moe_forward takes; K and N multiples of 128) ->
    (e4m3 [E, N, K], fp32 scales [E, K / 128, N / 128]): one scale per 128 x 128 block, the
    weight stored K-major as Hopper's fp8 tensor cores read it (``torch.ops.uniep.
    quantize_expert_weights``, on w's device one expert at a time; moe_forward's kept copy of
    bf16 weights is made by the same code)."""
    q, scales = torch.ops.uniep.quantize_expert_weights(w)
    return q, scales


def dequantize_expert_weights(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 [E, K, N] values of :func:`quantize_expert_weights`' output."""
    e, n, k = q.shape
    kb, nb = k // _FP8_BLOCK, n // _FP8_BLOCK
    blocks = q.transpose(1, 2).float().reshape(e, kb, _FP8_BLOCK, nb, _FP8_BLOCK)
    return (blocks * scales[:, :, None, :, None]).reshape(e, k, n)


def grouped_mm_fp8(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    offs: torch.Tensor,
    tuning: str = "",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[rows of e] @ w[e]`` in fp8 -> bf16 [R, N] (CUDA, Hopper; ``out_dtype=torch.float32``:
    the fp32 sums, not rounded, on the tiles that are not swapped): x and x_scales from
    :func:`quantize_rows` (or the fp8 dispatch), w and w_scales from
    :func:`quantize_expert_weights`; each 128-deep k-block's product scaled and summed in fp32.
    ``tuning``'s tile keys pick the configuration (``tile_m=128``: cooperative 128 x 128 x 128,
    ``tile_m=64``: ping-pong 64 x 128 x 128; the bits are the same), else the automatic one
    (the 64-row tiles where the experts average at most 32 rows:
    ``uniep._C.grouped_gemm_fp8_auto_config``)."""
    return torch.ops.uniep.grouped_mm_fp8(x, x_scales, w, w_scales, offs, tuning, out_dtype)


@torch.library.register_fake("uniep::grouped_mm_fp8")
def _grouped_mm_fp8_fake(
    x: torch.Tensor,
    x_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    offs: torch.Tensor,
    tuning: str = "",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [R, K], got {tuple(x.shape)}")
    torch._check_value(w.dim() == 3, lambda: f"w must be 3-D [E, N, K], got {tuple(w.shape)}")
    torch._check_value(
        x.dtype == torch.float8_e4m3fn, lambda: f"x must be float8_e4m3fn, got {x.dtype}"
    )
    torch._check_value(
        w.dtype == torch.float8_e4m3fn, lambda: f"w must be float8_e4m3fn, got {w.dtype}"
    )
    torch._check_value(
        w.shape[2] == x.shape[1],
        lambda: f"w must be [E, N, K] with K = x.size(1) = {x.shape[1]}, got {tuple(w.shape)}",
    )
    return x.new_empty((x.shape[0], w.shape[1]), dtype=check_out_dtype(out_dtype))


def swiglu_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation between the two fp8 expert GEMMs: ``h [R, 2I]`` bf16 (gate columns, then
    up) -> ``silu(gate) * up`` rounded to bf16, quantized as :func:`quantize_rows` quantizes a
    row: ``(e4m3 [R, I], fp32 scales [R, I / 128])``. One pass on CUDA; I % 128 == 0."""
    return torch.ops.uniep.swiglu_fp8(h)


def _check_swiglu_fp8(h: torch.Tensor) -> None:
    torch._check_value(h.dim() == 2, lambda: f"h must be 2-D [R, 2I], got {tuple(h.shape)}")
    torch._check_value(h.dtype == torch.bfloat16, lambda: f"h must be bfloat16, got {h.dtype}")
    torch._check_value(
        h.shape[1] % 256 == 0,
        lambda: (
            "h must be [R, 2I] with I a multiple of 128 (one scale per 128 columns), got "
            f"{tuple(h.shape)}"
        ),
    )


@torch.library.register_fake("uniep::swiglu_fp8")
def _swiglu_fp8_fake(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_swiglu_fp8(h)
    ffn = h.shape[1] // 2
    act = h.new_empty((h.shape[0], ffn), dtype=torch.float8_e4m3fn)
    return act, h.new_empty((h.shape[0], ffn // _FP8_BLOCK), dtype=torch.float32)


def _swiglu_fp8_cpu(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_swiglu_fp8(h)
    ffn = h.shape[1] // 2
    g, u = h[:, :ffn].float(), h[:, ffn:].float()
    # The CUDA kernel's formula (the SwiGLU epilogue's): g / (1 + exp(-g)) * u, in fp32.
    return quantize_rows((g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16))


torch.library.impl("uniep::swiglu_fp8", "CPU")(_swiglu_fp8_cpu)


def _check_quantize_fp8(x: torch.Tensor) -> None:
    torch._check_value(x.dim() == 2, lambda: f"x must be 2-D [R, K], got {tuple(x.shape)}")
    torch._check_value(x.dtype == torch.bfloat16, lambda: f"x must be bfloat16, got {x.dtype}")
    torch._check_value(
        x.shape[1] % _FP8_BLOCK == 0,
        lambda: f"x must have a multiple of 128 columns (one scale per 128), got {tuple(x.shape)}",
    )


@torch.library.register_fake("uniep::quantize_fp8")
def _quantize_fp8_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_quantize_fp8(x)
    q = x.new_empty(x.shape, dtype=torch.float8_e4m3fn)
    return q, x.new_empty((x.shape[0], x.shape[1] // _FP8_BLOCK), dtype=torch.float32)


def _quantize_fp8_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel's encoding (cuda/common/fp8_block.cuh), which the C++ CPU executor shares:
    both quotients are divisions rounded once. (torch's ``448 / amax`` is ``448 * (1 / amax)``,
    an ulp off a quarter of the time, so :func:`quantize_rows` may differ in a last bit.)"""
    _check_quantize_fp8(x)
    r, k = x.shape
    blocks = x.float().reshape(r, k // _FP8_BLOCK, _FP8_BLOCK)
    amax = blocks.abs().amax(dim=2)
    limit = torch.full_like(amax, _E4M3_MAX)
    some = amax > 0
    scale = torch.where(some, amax / limit, torch.ones_like(amax))
    inv = torch.where(some, limit / amax, torch.ones_like(amax))
    q = (blocks * inv.unsqueeze(2)).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(r, k), scale


torch.library.impl("uniep::quantize_fp8", "CPU")(_quantize_fp8_cpu)


def _check_quantize_fp8_rows(x: torch.Tensor, gemm_row: torch.Tensor) -> None:
    _check_quantize_fp8(x)
    torch._check_value(
        gemm_row.dim() == 2 and gemm_row.shape[0] == x.shape[0] and gemm_row.shape[1] >= 1,
        lambda: f"gemm_row must be [T = {x.shape[0]}, top_k >= 1], got {tuple(gemm_row.shape)}",
    )
    torch._check_value(
        gemm_row.dtype == torch.int64, lambda: f"gemm_row must be int64, got {gemm_row.dtype}"
    )
    torch._check_value(
        gemm_row.device == x.device,
        lambda: f"gemm_row must be on x's device {x.device}, got {gemm_row.device}",
    )


@torch.library.register_fake("uniep::quantize_fp8_rows")
def _quantize_fp8_rows_fake(
    x: torch.Tensor, gemm_row: torch.Tensor, report: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_quantize_fp8_rows(x, gemm_row)
    rows = x.shape[0] * gemm_row.shape[1]
    q = x.new_empty((rows, x.shape[1]), dtype=torch.float8_e4m3fn)
    scales = x.new_empty((rows, x.shape[1] // _FP8_BLOCK), dtype=torch.float32)
    return q, scales, x.new_empty(1 if report else 0, dtype=torch.int64)


def _quantize_fp8_rows_cpu(
    x: torch.Tensor, gemm_row: torch.Tensor, report: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_quantize_fp8_cpu` of each token stored at its entries' rows; the CUDA kernel's
    bytes. Rows no entry names are zero here (the CUDA op leaves them as allocated); the first
    entry whose row is past the rows is the error word's (on CUDA, one of them); without
    ``report`` the word is empty and such an entry only left out."""
    _check_quantize_fp8_rows(x, gemm_row)
    q, scales = _quantize_fp8_cpu(x)
    top_k = gemm_row.shape[1]
    rows = x.shape[0] * top_k
    out_q = torch.zeros((rows, q.shape[1]), dtype=torch.uint8)  # e4m3 bytes, copied as bytes
    out_scales = scales.new_zeros((rows, scales.shape[1]))
    flat = gemm_row.reshape(-1)
    token = torch.arange(flat.numel()) // top_k
    keep = (flat >= 0) & (flat < rows)
    out_q[flat[keep]] = q.view(torch.uint8)[token[keep]]
    out_scales[flat[keep]] = scales[token[keep]]
    error = torch.zeros(1 if report else 0, dtype=torch.int64)
    bad = torch.nonzero(flat >= rows).reshape(-1)
    if report and bad.numel():
        error[0] = _C.send_rows_error_word(_C.SEND_ROW_OUT_OF_RANGE, int(bad[0]))
    return out_q.view(torch.float8_e4m3fn), out_scales, error


torch.library.impl("uniep::quantize_fp8_rows", "CPU")(_quantize_fp8_rows_cpu)


# Fake kernel of the backward's element-wise op (CUDA only: uniep/moe/backward_cuda.py).
@torch.library.register_fake("uniep::swiglu_backward")
def _swiglu_backward_fake(
    h: torch.Tensor, grad_act: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    torch._check_value(
        h.dim() == 2 and grad_act.dim() == 2 and h.shape[1] == 2 * grad_act.shape[1],
        lambda: (
            f"h must be [R, 2I] for grad_act [R, I] = {tuple(grad_act.shape)}, got {tuple(h.shape)}"
        ),
    )
    torch._check_value(
        w.dim() == 1 and w.shape[0] == h.shape[0],
        lambda: f"w must be [R] = [{h.shape[0]}], got shape {tuple(w.shape)}",
    )
    dots = h.new_empty((h.shape[0],), dtype=torch.float32)
    return h.new_empty(grad_act.shape), torch.empty_like(h), dots
