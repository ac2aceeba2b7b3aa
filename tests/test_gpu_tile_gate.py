"""The MegaKernel's tile gate on the GPU (uniep.gate, cpp/cuda/megakernel): a grouped GEMM whose
producer waits for each tile's rows.

Checked: the device's tile_base equals the CPU plan's; with every gate open the gated GEMM gives
grouped_mm's bits (the gate changes when a tile is loaded, never what is computed), with the
SwiGLU epilogue too, and its done signal counts every warp of every tile; rows released late
from another stream are waited for; a first GEMM releasing a second, gated on its done signal,
gives the chain's bits; a tile whose rows never come raises a timeout naming it.
"""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)
from uniep import gate
from uniep.gemm import pack_gate_up

hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hopper, reason="needs a compute capability 9.0 GPU"),
]

SAME_CONFIG = "tile_m=128,tile_n=256,tile_k=64"  # the gated GEMM's configuration


def _operands(counts: list[int], k: int, n: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(len(counts), k, n, generator=gen, device="cuda") * k**-0.5).bfloat16()
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    return x, w, offs


def _needs(counts: list[int], per_row: int, per_tile: int) -> torch.Tensor:
    """What each tile's counter must reach, in counter order."""
    need = []
    for c in counts:
        for i in range(-(-c // gate.TILE_M)):
            need.append(per_row * min(gate.TILE_M, c - i * gate.TILE_M) + per_tile)
    return torch.tensor(need, dtype=torch.int32, device="cuda")


def _half_sms() -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return sms // 2 // 2 * 2  # clusters of two CTAs


COUNTS = [300, 0, 1, 128, 129, 0, 517, 64]


def test_device_tile_base_equals_the_cpu_plan() -> None:
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, 300, (int(torch.randint(1, 200, (1,), generator=gen)),))
        offs = counts.cumsum(0).to(torch.int32)
        rows = int(offs[-1])
        for tile_m in (64, 128):
            cpu = gate.tile_base(offs, rows, tile_m)
            dev = gate.tile_base(offs.cuda(), rows, tile_m)
            assert torch.equal(dev.cpu(), cpu)


@pytest.mark.parametrize("swiglu", [False, True])
def test_open_gate_gives_grouped_mm_bits(swiglu: bool) -> None:
    x, w, offs = _operands(COUNTS, 192, 512, seed=1)
    base = gate.tile_base(offs, x.shape[0])
    counters = _needs(COUNTS, 1, 0)
    done = torch.zeros(int(base[-1]), dtype=torch.int32, device="cuda") if swiglu else None
    wp = pack_gate_up(w) if swiglu else w
    out, timeout = gate.grouped_mm_gated(
        x, wp, offs, counters, base, swiglu=swiglu, done=done, timeout_s=5.0
    )
    if swiglu:
        want = torch.ops.uniep.grouped_mm_swiglu(x, wp, offs, SAME_CONFIG)
    else:
        want = torch.ops.uniep.grouped_mm(x, w, offs, SAME_CONFIG)
    gate.check_gate_timeout(timeout)
    assert torch.equal(out, want)
    if swiglu:
        assert torch.equal(done, _needs(COUNTS, 0, gate.done_per_tile(wp.shape[2])))


def test_rows_released_late_are_waited_for() -> None:
    x, w, offs = _operands(COUNTS, 256, 256, seed=2)
    want = torch.ops.uniep.grouped_mm(x, w, offs, SAME_CONFIG)
    base = gate.tile_base(offs, x.shape[0])
    need = _needs(COUNTS, 1, 0)
    landing = torch.zeros_like(x)
    counters = torch.zeros_like(need)
    torch.cuda.synchronize()
    out, timeout = gate.grouped_mm_gated(
        landing, w, offs, counters, base, timeout_s=20.0, sm_count=_half_sms()
    )
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms: the GEMM is waiting by then
        landing.copy_(x)
        counters.copy_(need)
    torch.cuda.current_stream().wait_stream(side)
    gate.check_gate_timeout(timeout)
    assert torch.equal(out, want)


def test_first_gemm_releases_the_second() -> None:
    x, w1, offs = _operands(COUNTS, 256, 512, seed=3)
    w2 = (torch.randn(len(COUNTS), 256, 256, device="cuda") / 16).bfloat16()
    w1p = pack_gate_up(w1)
    act_want = torch.ops.uniep.grouped_mm_swiglu(x, w1p, offs, SAME_CONFIG)
    want = torch.ops.uniep.grouped_mm(act_want, w2, offs, SAME_CONFIG)
    base = gate.tile_base(offs, x.shape[0])
    open_rows = _needs(COUNTS, 1, 0)
    done = torch.zeros_like(open_rows)
    act = torch.zeros_like(act_want)
    torch.cuda.synchronize()
    # The second GEMM is enqueued first, on its own stream and a quarter of the SMs: it can
    # only finish through the first's done signal, and it leaves the first room for its whole
    # persistent grid (a waiting CTA never gives its SM back).
    second = torch.cuda.Stream()
    with torch.cuda.stream(second):
        out, t2 = gate.grouped_mm_gated(
            act,
            w2,
            offs,
            done,
            base,
            per_row=0,
            per_tile=gate.done_per_tile(512),
            timeout_s=20.0,
            sm_count=_half_sms() // 2 // 2 * 2,
        )
    torch.cuda._sleep(20_000_000)  # ~10 ms: the second GEMM is waiting by then
    _, t1 = gate.grouped_mm_gated(
        x,
        w1p,
        offs,
        open_rows,
        base,
        swiglu=True,
        done=done,
        timeout_s=5.0,
        sm_count=_half_sms(),
        out=act,
    )
    torch.cuda.current_stream().wait_stream(second)
    gate.check_gate_timeout(t1)
    gate.check_gate_timeout(t2)
    assert torch.equal(act, act_want)
    assert torch.equal(out, want)


def test_rows_that_never_come_time_out_naming_the_tile() -> None:
    x, w, offs = _operands([256, 100], 128, 256, seed=4)
    base = gate.tile_base(offs, x.shape[0])
    counters = torch.zeros(int(base[-1]), dtype=torch.int32, device="cuda")
    counters[0] = 128  # expert 0's first tile may go; the rest never comes
    _, timeout = gate.grouped_mm_gated(x, w, offs, counters, base, timeout_s=0.05)
    with pytest.raises(TimeoutError, match=r"expert \d+, m-tile \d+ never arrived"):
        gate.check_gate_timeout(timeout)


def test_too_few_counters_is_named_not_read() -> None:
    x, w, offs = _operands([256, 100], 128, 256, seed=5)
    base = gate.tile_base(offs, x.shape[0])  # 3 tiles
    counters = torch.full((2,), 1 << 20, dtype=torch.int32, device="cuda")
    _, timeout = gate.grouped_mm_gated(x, w, offs, counters, base, timeout_s=5.0)
    with pytest.raises(ValueError, match="counters holds 2 entries, but expert 1, m-tile 0"):
        gate.check_gate_timeout(timeout)
