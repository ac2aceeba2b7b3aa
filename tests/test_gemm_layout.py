"""uniep.gemm's packed w1 layout (what the SwiGLU epilogue reads), on CPU."""

from __future__ import annotations

import pytest
import torch
from uniep.gemm import pack_gate_up, unpack_gate_up


@pytest.mark.parametrize("e,h,i", [(1, 4, 8), (3, 5, 24), (2, 16, 64)])
def test_pack_interleaves_gate_and_up_in_blocks_of_eight(e: int, h: int, i: int) -> None:
    w1 = torch.randn(e, h, 2 * i, dtype=torch.float64)
    packed = pack_gate_up(w1)
    assert packed.shape == w1.shape and packed.is_contiguous()
    for b in range(i // 8):
        gate, up = w1[:, :, 8 * b : 8 * b + 8], w1[:, :, i + 8 * b : i + 8 * b + 8]
        assert torch.equal(packed[:, :, 16 * b : 16 * b + 8], gate)
        assert torch.equal(packed[:, :, 16 * b + 8 : 16 * b + 16], up)
    assert torch.equal(unpack_gate_up(packed), w1)


def test_products_pair_up() -> None:
    # What the epilogue relies on: column c of a gate block and c + 8 are gate j and up j.
    x = torch.randn(7, 32, dtype=torch.float64)
    w1 = torch.randn(1, 32, 48, dtype=torch.float64)
    h, hp = x @ w1[0], x @ pack_gate_up(w1)[0]
    for j in range(24):
        c = 16 * (j // 8) + j % 8
        assert torch.equal(hp[:, c], h[:, j]) and torch.equal(hp[:, c + 8], h[:, 24 + j])


def test_named_errors() -> None:
    with pytest.raises(ValueError, match=r"w1 must be 3-D \[E, H, 2I\]"):
        pack_gate_up(torch.zeros(4, 16))
    with pytest.raises(ValueError, match=r"w1.size\(2\) = 2I must be a multiple of 16.*got 24"):
        pack_gate_up(torch.zeros(1, 4, 24))
    with pytest.raises(ValueError, match=r"w1_packed.size\(2\)"):
        unpack_gate_up(torch.zeros(1, 4, 8))
