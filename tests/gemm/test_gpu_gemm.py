"""UniEP's Hopper GEMM (``torch.ops.uniep.sm90_gemm``, cpp/cuda/gemm) against an fp32 reference.

The collectives run it for their chunks with ``set_gemm("cutlass")``; here it is checked alone:
shapes that fill no whole tile, an addend (D = A @ B + C), the same bits for every SM carve-out
and for a row range computed on its own, strided inputs, and named errors.
"""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

gemm = torch.ops.uniep.sm90_gemm


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    b = (torch.randn(k, n, generator=gen, device="cuda") * k**-0.5).bfloat16()
    c = torch.randn(m, n, generator=gen, device="cuda").bfloat16()
    return a, b, c


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (96, 160, 136), (520, 1024, 776), (2048, 4096, 3584)])
def test_matches_fp32_reference(m: int, k: int, n: int) -> None:
    a, b, c = _operands(m, k, n, m + k + n)
    ref = a.float() @ b.float()
    out = gemm(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert _rel(out, ref) <= 8e-3
    assert _rel(gemm(a, b, c), ref + c.float()) <= 8e-3


def test_bits_independent_of_carveout_and_row_ranges() -> None:
    a, b, c = _operands(1000, 2048, 1024, 7)
    whole = gemm(a, b, c)
    for carveout in (1, 8, 16, 100):
        assert torch.equal(gemm(a, b, c, carveout), whole), carveout
    # Any row range on its own gives its rows' bits (no split-K: each output's K loop is fixed).
    for lo, hi in ((0, 128), (128, 1000), (333, 777)):
        assert torch.equal(gemm(a[lo:hi], b, c[lo:hi]), whole[lo:hi]), (lo, hi)


def test_bits_independent_of_tiling() -> None:
    a, b, c = _operands(777, 1024, 768, 11)
    whole = gemm(a, b, c)
    for tile_n in (128, 256):
        for swizzle in (1, 2, 8):
            for raster in ("m", "n"):
                got = gemm(a, b, c, 0, tile_n, swizzle, raster)
                assert torch.equal(got, whole), (tile_n, swizzle, raster)


def test_strided_inputs_are_made_contiguous() -> None:
    a, b, _ = _operands(256, 512, 384, 3)
    at = a.t().contiguous().t()  # same values, column-major
    assert torch.equal(gemm(at, b), gemm(a, b))
    wide = torch.zeros(256, 520, device="cuda", dtype=torch.bfloat16)
    wide[:, :512] = a
    assert torch.equal(gemm(wide[:, :512], b), gemm(a, b))


def test_named_errors() -> None:
    a, b, c = _operands(64, 64, 64, 1)
    with pytest.raises(ValueError, match="a must be bfloat16"):
        gemm(a.float(), b.float())
    with pytest.raises(ValueError, match="c must be"):
        gemm(a, b, c[:32])
    with pytest.raises(ValueError, match="sm_carveout=-1"):
        gemm(a, b, None, -1)
    with pytest.raises(ValueError, match="sm_carveout=100000"):
        gemm(a, b, None, 100000)
    with pytest.raises(ValueError, match="tile_n must be 0 .auto., 128 or 256, got 64"):
        gemm(a, b, None, 0, 64)
    with pytest.raises(ValueError, match="swizzle must be 0 .auto., 1, 2, 4 or 8, got 3"):
        gemm(a, b, None, 0, 0, 3)
    with pytest.raises(ValueError, match='raster must be "auto", "m" or "n", got "k"'):
        gemm(a, b, None, 0, 0, 0, "k")
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        gemm(a[:, :60], b[:60])  # k = 60: TMA needs 16-byte rows


def test_opcheck() -> None:
    a, b, c = _operands(128, 256, 192, 5)
    torch.library.opcheck(gemm, (a, b, c, 0))
    torch.library.opcheck(gemm, (a, b))
