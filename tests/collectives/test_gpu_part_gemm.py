"""The part GEMM (``torch.ops.uniep.part_gemm``, include/uniep/cuda/part_gemm.hpp) at world 1:
the one persistent GEMM that ``set_gemm("gated")`` runs for an all-gather + GEMM, here over the
row blocks of one tensor. Its bits do not depend on the split into parts, the gate nor the
tiles' width (128 or 256, and the automatic choice between them), its values are within bf16
rounding of float64, a part whose word never reaches the epoch times out
naming the part, and bad arguments are named.
"""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

part_gemm = torch.ops.uniep.part_gemm


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    b = (torch.randn(k, n, generator=gen, device="cuda") * k**-0.5).bfloat16()
    return a, b


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (96, 160, 136), (520, 1024, 776), (2048, 4096, 3584)])
def test_matches_float64(m: int, k: int, n: int) -> None:
    a, b = _operands(m, k, n, m + k + n)
    out = part_gemm(a, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert _rel(out, a.double() @ b.double()) <= 8e-3


def test_bits_independent_of_parts_gate_and_carveout() -> None:
    a, b = _operands(1536, 1024, 768, 3)
    whole = part_gemm(a, b)
    # The expert GEMM engine's bits on the same product (one expert of every row).
    offs = torch.tensor([a.shape[0]], dtype=torch.int32, device="cuda")
    assert torch.equal(torch.ops.uniep.grouped_mm(a, b.unsqueeze(0), offs), whole)
    # And the dense Hopper GEMM's, which an all-gather + GEMM of small chunks runs instead.
    assert torch.equal(torch.ops.uniep.sm90_gemm(a, b), whole)
    for parts in (2, 3, 4, 8, 12, 48, 1536):
        assert torch.equal(part_gemm(a, b, parts), whole), parts
    # Every word at or past the epoch: the gate opens at once, the bits stay.
    ready = torch.tensor([5, 6, 5, 9], dtype=torch.int64, device="cuda")
    assert torch.equal(part_gemm(a, b, 4, ready, 5), whole)
    for carveout in (1, 16, 100):
        assert torch.equal(part_gemm(a, b, 4, ready, 5, 10.0, carveout), whole), carveout


@pytest.mark.parametrize(
    "m,k,n,parts",
    [(1024, 1024, 2048, 4), (520, 512, 776, 2), (2048, 512, 1792, 4), (96, 160, 136, 1)],
)
def test_bits_independent_of_tile_width(m: int, k: int, n: int, parts: int) -> None:
    # The first shape takes 128-wide tiles by itself (its 256-wide ones fill half a wave), the
    # third 256-wide ones; both widths named on each, with a gate that opens at once.
    a, b = _operands(m, k, n, m + n)
    whole = torch.ops.uniep.sm90_gemm(a, b)
    ready = torch.full((parts,), 7, dtype=torch.int64, device="cuda")
    for tile_n in (0, 128, 256):
        got = part_gemm(a, b, parts, None, 0, 10.0, 0, 0, "auto", tile_n)
        assert torch.equal(got, whole), (tile_n, parts)
        gated = part_gemm(a, b, parts, ready, 7, 10.0, 0, 0, "auto", tile_n)
        assert torch.equal(gated, whole), (tile_n, "gated")
    for raster in ("m", "n"):
        got = part_gemm(a, b, parts, None, 0, 10.0, 0, 4, raster, 128)
        assert torch.equal(got, whole), raster


def test_empty_and_one_row_parts() -> None:
    a, b = _operands(4, 64, 32, 5)
    assert torch.equal(part_gemm(a, b, 4), part_gemm(a, b))
    assert part_gemm(a[:0], b).shape == (0, 32)


def test_part_that_never_arrives_times_out_naming_it() -> None:
    a, b = _operands(256, 128, 128, 9)
    ready = torch.tensor([3, 3, 2, 3], dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=r"part 2 waited 0.2 s for ready\[2\] to reach epoch 3"):
        part_gemm(a, b, 4, ready, 3, 0.2)
    # The device is usable afterwards.
    assert torch.equal(part_gemm(a, b, 4, ready, 2), part_gemm(a, b))


def test_bad_arguments_are_named() -> None:
    a, b = _operands(64, 64, 64, 1)
    with pytest.raises(ValueError, match=r"parts \(3\) must be >= 1 and divide the rows of a"):
        part_gemm(a, b, 3)
    with pytest.raises(ValueError, match="a must be bfloat16"):
        part_gemm(a.float(), b.float())
    with pytest.raises(ValueError, match=r"ready must be a contiguous int64 tensor \[parts\]"):
        part_gemm(a, b, 2, torch.zeros(3, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=r"ready must be a contiguous int64 tensor \[parts\]"):
        part_gemm(a, b, 2, torch.zeros(2, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="b must be"):
        part_gemm(a, b[:32])
    with pytest.raises(ValueError, match="multiple of 8"):
        part_gemm(a[:, :60], b[:60])
    with pytest.raises(ValueError, match=r"tile_n must be 0 \(auto\), 128 or 256, got 64"):
        part_gemm(a, b, 1, None, 0, 10.0, 0, 0, "auto", 64)
