"""The tile gate's plan on CPU (uniep.moe.tile_gates, cpp/core/schedule.cpp gate_tile_base): where
each expert's tile counters start, with the grouped GEMM's clamp of a malformed offs; the fake
kernels; the timeout report. The device side is tests/megakernel/test_gpu_tile_gate.py."""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)
from torch._subclasses.fake_tensor import FakeTensorMode
from uniep.moe import tile_gates as gate


def _reference(offs: list[int], rows: int, tile_m: int) -> list[int]:
    """Written for clarity: clamp each end into [0, rows] and up to the largest earlier end."""
    base, end, tiles = [], 0, 0
    for o in offs:
        base.append(tiles)
        begin, end = end, max(end, min(max(o, 0), rows))
        tiles += -(-(end - begin) // tile_m)
    return base + [tiles]


@pytest.mark.parametrize("tile_m", [1, 64, 128, 256])
@pytest.mark.parametrize("seed", range(4))
def test_tile_base_matches_reference(tile_m: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    experts = int(torch.randint(1, 300, (1,), generator=gen))
    counts = torch.randint(0, 400, (experts,), generator=gen)
    counts[torch.rand(experts, generator=gen) < 0.3] = 0  # empty experts
    offs = counts.cumsum(0).to(torch.int32)
    rows = int(offs[-1])
    got = gate.tile_base(offs, rows, tile_m)
    assert got.dtype == torch.int32 and got.shape == (experts + 1,)
    assert got.tolist() == _reference(offs.tolist(), rows, tile_m)
    # Each expert's tiles cover its rows exactly once.
    tiles = (got[1:] - got[:-1]).tolist()
    assert tiles == [-(-c // tile_m) for c in counts.tolist()]


def test_tile_base_clamps_a_malformed_offs() -> None:
    offs = torch.tensor([5, 3, -2, 900, 40, 1000], dtype=torch.int32)
    got = gate.tile_base(offs, 300, 128)
    # Ends clamp to [5, 5, 5, 300, 300, 300]: tiles 1, 0, 0, 3 (295 rows), 0, 0.
    assert got.tolist() == [0, 1, 1, 1, 4, 4, 4]
    assert got.tolist() == _reference(offs.tolist(), 300, 128)


def test_tile_base_rejects_bad_arguments() -> None:
    offs = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="tile_m"):
        gate.tile_base(offs, 5, 0)
    with pytest.raises(ValueError, match="offs must be int32"):
        gate.tile_base(offs.long(), 5, 128)
    with pytest.raises(ValueError, match="offs must be 1-D"):
        gate.tile_base(offs.reshape(1, 2), 5, 128)
    with pytest.raises(ValueError, match="rows"):
        gate.tile_base(offs, -1, 128)


def test_done_per_tile_counts_warps_and_n_tiles() -> None:
    assert gate.done_per_tile(256) == gate.WARPS_PER_TILE
    assert gate.done_per_tile(257) == 2 * gate.WARPS_PER_TILE
    assert gate.done_per_tile(2 * 2048) == 16 * gate.WARPS_PER_TILE


def test_check_gate_timeout_names_the_tile() -> None:
    gate.check_gate_timeout(torch.zeros(5, dtype=torch.int32))  # no timeout: no error
    with pytest.raises(TimeoutError, match="expert 3, m-tile 7 never arrived .*12 of 128"):
        gate.check_gate_timeout(torch.tensor([1, 3, 7, 12, 128], dtype=torch.int32))
    with pytest.raises(ValueError, match="counters holds 4 entries, but expert 2, m-tile 1 needs"):
        gate.check_gate_timeout(torch.tensor([2, 2, 1, 4, 5], dtype=torch.int32))
    # The fused kernel's reduce: a token's expert output that never came.
    with pytest.raises(TimeoutError, match="output of token 41, k = 2 never arrived .*3 of 8"):
        gate.check_gate_timeout(torch.tensor([3, 41, 2, 3, 8], dtype=torch.int32), "fused")
    # Its count exchange across ranks: rank 2 stayed at call 6 while this rank made call 7.
    with pytest.raises(TimeoutError, match="rank 2 never joined the count exchange of call 7"):
        gate.check_gate_timeout(torch.tensor([4, 2, 0, 6, 7], dtype=torch.int32), "fused ep")


def test_fake_kernels_give_the_shapes() -> None:
    with FakeTensorMode():
        x = torch.empty(300, 64, dtype=torch.bfloat16)
        w = torch.empty(4, 64, 512, dtype=torch.bfloat16)
        offs = torch.empty(4, dtype=torch.int32)
        counters = torch.empty(10, dtype=torch.int32)
        assert torch.ops.uniep.gate_tile_base(offs, 300, 128).shape == (5,)
        out = torch.empty(300, 256, dtype=torch.bfloat16)
        timeout = torch.ops.uniep.grouped_mm_gated(
            x, w, offs, counters, counters[:5], 1, 0, 1.0, True, None, 8, out
        )
        assert timeout.shape == (5,)
        assert timeout.dtype == torch.int32
        idx = torch.empty(300, 4, dtype=torch.int64)
        w2 = torch.empty(4, 256, 64, dtype=torch.bfloat16)
        out, error, timeout = torch.ops.uniep.moe_fused_local(
            x, torch.empty(300, 4), idx, idx, w, w2, offs, counters[:5], 16, -1, 1.0
        )
        assert out.shape == (300, 64) and out.dtype == torch.bfloat16
        assert error.shape == (1,) and timeout.shape == (5,)
        out, error, timeout = torch.ops.uniep.moe_fused_local_planned(
            x, idx, torch.empty(300, 4), w, w2, 1.0, 64
        )
        assert out.shape == (300, 64) and out.dtype == torch.bfloat16
        assert error.shape == (1,) and error.dtype == torch.int64
        assert timeout.shape == (5,) and timeout.dtype == torch.int32
        with pytest.raises(ValueError, match="topk_idx must be"):
            torch.ops.uniep.moe_fused_local_planned(x, idx[:5], torch.empty(300, 4), w, w2, 1.0)


def test_the_fused_launch_plans_decode_batches_itself() -> None:
    from uniep.moe.megakernel.launch import planned_in_launch

    # A decode batch with every CTA sending and no trace: the planned launch.
    assert planned_in_launch(4096, 1024, 132, 132, None)
    # Past one block's entries or experts, fewer senders, or a trace: the plan apart.
    assert not planned_in_launch(4097, 128, 132, 132, None)
    assert not planned_in_launch(8, 1025, 132, 132, None)
    assert not planned_in_launch(8, 128, 16, 132, None)
    assert not planned_in_launch(8, 128, 132, 132, torch.zeros(4 * 132, dtype=torch.int64))


def test_fused_backward_fake_kernel_gives_the_shapes() -> None:
    with FakeTensorMode():
        x = torch.empty(300, 64, dtype=torch.bfloat16)
        idx = torch.empty(300, 4, dtype=torch.int64)
        w1 = torch.empty(4, 64, 512, dtype=torch.bfloat16)
        w2t = torch.empty(4, 64, 256, dtype=torch.bfloat16)
        offs = torch.empty(4, dtype=torch.int32)
        base = torch.empty(5, dtype=torch.int32)
        rows_x, rows_go, h, grad_act, error, timeout = torch.ops.uniep.moe_fused_backward_local(
            x, x, idx, idx, w1, w2t, offs, base, 1.0
        )
        assert rows_x.shape == rows_go.shape == (1200, 64)
        assert h.shape == (1200, 512) and grad_act.shape == (1200, 256)
        assert error.shape == (1,) and timeout.shape == (5,) and timeout.dtype == torch.int32


def test_fused_backward_needs_cuda_tensors() -> None:
    from uniep.moe.megakernel.backward import moe_backward_local

    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    idx = torch.zeros(8, 2, dtype=torch.int64)
    w1 = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        moe_backward_local(x, x, idx, torch.zeros(8, 2), w1, w2)
