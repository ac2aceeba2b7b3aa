"""The MegaKernel's tile gate on the GPU (uniep.moe.tile_gates, cpp/cuda/megakernel): a grouped
GEMM whose producer waits for each tile's rows.

Checked: the device's tile_base equals the CPU plan's; with every gate open the gated GEMM gives
grouped_mm's bits (the gate changes when a tile is loaded, never what is computed), with the
SwiGLU epilogue too, and its done signal counts every warp of every tile; rows released late
from another stream are waited for; a first GEMM releasing a second, gated on its done signal,
gives the chain's bits; a tile whose rows never come raises a timeout naming it; the combine of
the rows gives the CPU op's bits.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)
from uniep.gemm import pack_gate_up
from uniep.moe import tile_gates as gate

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

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


def _assert_cuda_equals_cpu(
    plan: Callable[..., tuple[torch.Tensor, ...]], idx: torch.Tensor, experts: int
) -> None:
    """Every output of ``plan(idx, experts, tile_m)`` on CUDA equals the CPU op's, dtype and all,
    at the tile heights 1, 64 and 128."""
    for tile_m in (1, 64, 128):
        want = plan(idx, experts, tile_m)
        got = plan(idx.cuda(), experts, tile_m)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


# 9,000 experts are counted in global memory (the kernel's shared-memory counts hold 8,192);
# 70,000 entries are 35 blocks of 2,048 and a last one that finishes the plan; the skewed case
# sends almost every entry to one expert (every atomic on one address).
@pytest.mark.parametrize(
    "tokens,top_k,experts,skew", [(0, 4, 16, False), (700, 9, 256, False),
                                  (10000, 7, 9000, False), (8750, 8, 128, True)],
)  # fmt: skip
def test_device_expert_tiles_equal_the_cpu_plan(
    tokens: int, top_k: int, experts: int, skew: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    idx = torch.randint(-1, experts + 1, (tokens, top_k), generator=gen)
    if skew:
        idx[torch.rand(idx.shape, generator=gen) < 0.9] = 5
    _assert_cuda_equals_cpu(gate.expert_tiles, idx, experts)


# The counting sort (up to 1,024 experts): the one-block plan up to 4,096 entries, many blocks of
# 2,048 entries past it, a partial last warp, the skewed routing; 2,000 experts take the counts
# and the cross-rank plan kernel. In one block the batch is split evenly over the 8 warps in
# steps of 32: 512 entries (64 a warp), 700 (96 a warp, the last warp's segment partial,
# skewed), 2,048 (256 a warp), 3,500 (448 a warp, skewed) and 4,096 (the whole block, 512 a warp).
@pytest.mark.parametrize(
    "tokens,top_k,experts,skew", [(0, 4, 16, False), (5, 3, 7, False), (64, 8, 128, False),
                                  (100, 7, 128, True), (256, 8, 64, False), (700, 9, 256, False),
                                  (500, 7, 128, True), (512, 8, 1024, False),
                                  (10001, 7, 1024, False), (8750, 8, 128, True),
                                  (3000, 8, 2000, False)],
)  # fmt: skip
def test_device_local_plan_equals_the_cpu_plan(
    tokens: int, top_k: int, experts: int, skew: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens + experts)
    idx = torch.randint(-1, experts, (tokens, top_k), generator=gen)
    if skew:
        idx[torch.rand(idx.shape, generator=gen) < 0.9] = 5
    _assert_cuda_equals_cpu(gate.local_plan, idx, experts)
    if tokens > 0:  # an id past the experts is reported, naming the entry, as on CPU
        bad = idx.clone()
        bad[tokens // 2, top_k - 1] = experts
        error = gate.local_plan(bad.cuda(), experts, 64)[-1]
        assert error.item() == gate.local_plan(bad, experts, 64)[-1].item() != 0
        with pytest.raises(ValueError, match=rf"\(token {tokens // 2}, k {top_k - 1}\)"):
            gate.check_send_error(error, top_k, "local_plan")


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
    side = torch.cuda.Stream()
    # The writers' kernels run once first: under lazy module loading, a kernel's first launch
    # may wait for the device to go idle, which a GEMM spinning on its rows never does (the
    # first H100 run of this test timed out so).
    with torch.cuda.stream(side):
        torch.cuda._sleep(1)
        landing.copy_(x)
        counters.copy_(need)
    torch.cuda.synchronize()
    landing.zero_()
    counters.zero_()
    torch.cuda.synchronize()
    out, timeout = gate.grouped_mm_gated(
        landing, w, offs, counters, base, timeout_s=20.0, sm_count=_half_sms()
    )
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


# ---- the MegaKernel's dispatch (uniep.moe.tile_gates.sender_rows / send_rows) ----


def _routing(world: int, experts: int, top_k: int, tokens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tokens:
        idx = torch.randint(0, experts, (t, top_k), generator=gen)
        idx[torch.rand(t, top_k, generator=gen) < 0.1] = -1
        out.append(idx)
    counts = torch.stack([torch.bincount(i[i >= 0], minlength=experts) for i in out])
    return out, counts.to(torch.int64)


def _gathered(x: torch.Tensor, dest: torch.Tensor, row: torch.Tensor, total: int) -> torch.Tensor:
    """The reference dispatch: x's rows at their planned GEMM rows, by indexing."""
    out = torch.zeros(total, x.shape[1], dtype=x.dtype, device=x.device)
    used = dest.to(x.device) >= 0
    out[row.to(x.device)[used]] = x.unsqueeze(1).expand(-1, dest.shape[1], -1)[used]
    return out


# The last case walks 40,000 entries: three chunks of the plan kernel's block scan (16,384
# entries each), the last one partial.
@pytest.mark.parametrize(
    "world,experts,top_k,tokens",
    [(1, 8, 2, 700), (2, 16, 9, 700), (4, 256, 8, 700), (8, 64, 4, 700), (2, 128, 8, 5000)],
)
def test_device_sender_rows_equal_the_cpu_plan(
    world: int, experts: int, top_k: int, tokens: int
) -> None:
    routing, counts = _routing(world, experts, top_k, [tokens] * (world - 1) + [3], seed=world)
    for rank in range(world):
        for tile_m in (16, 128):
            want = gate.sender_rows(routing[rank], counts, rank, tile_m=tile_m)
            got = gate.sender_rows(routing[rank].cuda(), counts.cuda(), rank, tile_m=tile_m)
            for g, w in zip(got[:3], want[:3], strict=True):
                assert torch.equal(g.cpu(), w)
        # The send order of the MegaKernel across ranks, from the same plan kernel.
        want_order = gate.send_order(routing[rank], counts, rank)
        assert torch.equal(gate.send_order(routing[rank].cuda(), counts.cuda(), rank).cpu(),
                           want_order)  # fmt: skip


def test_device_send_rows_equal_the_cpu_send() -> None:
    routing, counts = _routing(1, 24, 9, [1000], seed=7)
    idx = routing[0]
    x = torch.randn(1000, 264).to(torch.bfloat16)  # 528-byte rows: not a multiple of 128 bytes
    plan = gate.sender_rows(idx, counts, 0)
    total = int(counts.sum())
    ncounters = int(gate.tile_base(counts[0].cumsum(0).to(torch.int32), total)[-1])
    rows = torch.zeros(total, 264, dtype=torch.bfloat16)
    counters = torch.zeros(ncounters, dtype=torch.int32)
    gate.check_send_error(gate.send_rows(x, *plan[:3], rows, counters), 9)
    rows_d, counters_d = rows.cuda().zero_(), counters.cuda().zero_()
    err = gate.send_rows(x.cuda(), *(p.cuda() for p in plan[:3]), rows_d, counters_d, sm_count=5)
    gate.check_send_error(err, 9)
    assert torch.equal(rows_d.cpu(), rows)
    assert torch.equal(counters_d.cpu(), counters)


def test_send_rows_release_the_gated_gemms() -> None:
    """World 1, the sequence the MegaKernel runs: the send on a few SMs beside gated GEMM 1
    (SwiGLU, done signal) and GEMM 2 gated on done, enqueued first; same bits as the
    ungated chain on the gathered rows."""
    tokens, hidden, ffn, experts, top_k = 2048, 256, 256, 16, 4
    routing, counts = _routing(1, experts, top_k, [tokens], seed=11)
    idx = routing[0].cuda()
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda") / 16).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen, device="cuda") / 16).bfloat16()
    w1p = pack_gate_up(w1)
    dest, row, counter, err = gate.sender_rows(idx, counts.cuda(), 0, check=False)
    total = int(counts.sum())
    offs = counts[0].cuda().cumsum(0).to(torch.int32)
    base = gate.tile_base(offs, total)
    # The reference: the rows gathered on the host's plan, the ungated chain.
    gathered = _gathered(x, dest, row, total)
    act_want = torch.ops.uniep.grouped_mm_swiglu(gathered, w1p, offs, SAME_CONFIG)
    want = torch.ops.uniep.grouped_mm(act_want, w2, offs, SAME_CONFIG)

    rows = torch.zeros_like(gathered)
    counters = torch.zeros(int(base[-1]), dtype=torch.int32, device="cuda")
    done = torch.zeros_like(counters)
    act = torch.zeros_like(act_want)
    out = torch.zeros_like(want)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemm_sms = (sms - 8) // 2 * 2
    torch.cuda.synchronize()
    gemms = torch.cuda.Stream()
    with torch.cuda.stream(gemms):
        _, t1 = gate.grouped_mm_gated(
            rows,
            w1p,
            offs,
            counters,
            base,
            swiglu=True,
            done=done,
            timeout_s=20.0,
            sm_count=gemm_sms,
            out=act,
        )
        _, t2 = gate.grouped_mm_gated(
            act,
            w2,
            offs,
            done,
            base,
            per_row=0,
            per_tile=gate.done_per_tile(2 * ffn),
            timeout_s=20.0,
            sm_count=gemm_sms,
            out=out,
        )
    torch.cuda._sleep(20_000_000)  # ~10 ms: GEMM 1 is waiting on every tile by then
    send_err = gate.send_rows(x, dest, row, counter, rows, counters, sm_count=sms - gemm_sms)
    torch.cuda.current_stream().wait_stream(gemms)
    gate.check_send_error(err, top_k, "sender_rows")
    gate.check_send_error(send_err, top_k)
    gate.check_gate_timeout(t1, "GEMM 1")
    gate.check_gate_timeout(t2, "GEMM 2")
    assert torch.equal(rows, gathered)
    assert torch.equal(act, act_want)
    assert torch.equal(out, want)


def test_device_send_errors_name_the_entry() -> None:
    idx = torch.tensor([[0, 1], [2, 9], [1, -1]], device="cuda")
    counts = torch.tensor([[1, 2, 1, 0]], device="cuda")
    with pytest.raises(ValueError, match=r"entry \(token 1, k 1\) holds an expert id outside"):
        gate.sender_rows(idx, counts, 0)
    with pytest.raises(ValueError, match=r"entry \(token 2, k 0\) routes more rows to its exp"):
        gate.sender_rows(idx[:, :1].contiguous(), torch.tensor([[1, 0, 1, 0]], device="cuda"), 0)
    dest, row, counter, _ = gate.sender_rows(
        torch.tensor([[0, 1], [2, 3], [1, -1]], device="cuda"),
        torch.tensor([[1, 2, 1, 1]], device="cuda"),
        0,
    )
    x = torch.ones(3, 8, dtype=torch.bfloat16, device="cuda")
    rows = torch.zeros(5, 8, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(4, dtype=torch.int32, device="cuda")
    error = gate.send_rows(x, dest.clone().fill_(3), row, counter, rows, counters)
    with pytest.raises(ValueError, match="goes to a rank outside the peer table"):
        gate.check_send_error(error, 2)
    assert not rows.any() and not counters.any()


# ---- the pieces composed at world 1 (uniep.moe.megakernel.launch.moe_forward_local) ----


def _local_layer(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    idx = torch.randint(0, experts - 1, (tokens, top_k), generator=gen, device="cuda")
    idx[torch.rand(tokens, top_k, generator=gen, device="cuda") < 0.1] = -1  # expert E-1 empty
    w = torch.rand(tokens, top_k, generator=gen, device="cuda")
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda") / 16).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen, device="cuda") / 16).bfloat16()
    return x, idx, w, w1, w2


def test_moe_forward_local_modes_agree_bit_for_bit() -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _local_layer(1000, 256, 256, 16, 9, seed=21)
    w1p = pack_gate_up(w1)
    seq = moe_forward_local(x, idx, w, w1p, w2)
    assert torch.equal(moe_forward_local(x, idx, w, w1p, w2), seq), "run to run"
    for comm in (4, 16):
        got = moe_forward_local(x, idx, w, w1p, w2, overlap="streams", comm_sms=comm)
        assert torch.equal(got, seq), f"streams with {comm} SMs"
    # The engine's chain on rows gathered by the host's plan, then the combines' sum: same bits.
    counts = torch.bincount(idx[idx >= 0], minlength=16).cpu().view(1, 16)
    dest, row, _, _ = gate.sender_rows(idx.cpu(), counts, 0)
    offs = counts[0].cumsum(0).to(torch.int32).cuda()
    rows = _gathered(x, dest, row, int(counts.sum()))
    act = torch.ops.uniep.grouped_mm_swiglu(rows, w1p, offs, SAME_CONFIG)
    y = torch.ops.uniep.grouped_mm(act, w2, offs, SAME_CONFIG)
    want, _ = gate.combine_rows(y, row.cuda(), w)
    assert torch.equal(seq, want)
    # Without report: the same sum, no word; a row past y skipped as with it.
    unreported, word = torch.ops.uniep.combine_rows(y, row.cuda(), w, report=False)
    assert word.shape == (0,) and torch.equal(unreported, want)
    bad = row.cuda().clone()
    bad[0, 0] = y.shape[0]
    reported, error = gate.combine_rows(y, bad, w, check=False)
    assert int(error) != 0
    unreported, word = torch.ops.uniep.combine_rows(y, bad, w, report=False)
    assert word.shape == (0,) and torch.equal(unreported, reported)
    # And the layer itself, against float64.
    xd, w1d, w2d = x.double(), w1.double(), w2.double()
    ref = torch.zeros(1000, 256, dtype=torch.float64, device="cuda")
    for e in range(16):
        t, k = (idx == e).nonzero(as_tuple=True)
        if t.numel():
            h = xd[t] @ w1d[e]
            ref.index_add_(0, t, (torch.nn.functional.silu(h[:, :256]) * h[:, 256:]) @ w2d[e]
                           * w[t, k].double().unsqueeze(1))  # fmt: skip
    err = (seq.double() - ref).norm() / ref.norm()
    assert err < 2e-2, f"relative error {err:.3g}"


def test_moe_forward_local_edge_cases() -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _local_layer(0, 128, 128, 4, 2, seed=1)
    assert moe_forward_local(x, idx, w, pack_gate_up(w1), w2).shape == (0, 128)
    x, idx, w, w1, w2 = _local_layer(5, 128, 128, 4, 1, seed=2)
    idx[:] = -1
    assert not moe_forward_local(x, idx, w, pack_gate_up(w1), w2).any()
    idx[0, 0] = 9
    with pytest.raises(ValueError, match=r"entry \(token 0, k 0\) holds an expert id"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2)
    # Only -1 marks an unused slot: another negative id is named, not dropped.
    idx[0, 0] = -3
    with pytest.raises(ValueError, match=r"entry \(token 0, k 0\) holds an expert id outside"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2)


@pytest.mark.parametrize("experts", [4, 2000])
@pytest.mark.parametrize("tokens", [3, 3000])
def test_device_plans_name_ids_below_minus_one(experts: int, tokens: int) -> None:
    """Each of the device's plans (the cross-rank plan kernel, the one-block and multi-block
    local plans, and past 1,024 experts the counts then the plan kernel) names an id below -1 as
    the CPU plan does."""
    idx = torch.randint(0, experts, (tokens, 2), device="cuda")
    idx[1, 0] = -2
    idx[2, 1] = -1
    counts = torch.bincount(idx.clamp_min(-1).view(-1) + 1, minlength=experts + 1)[1:]
    for error in (
        gate.sender_rows(idx, counts.view(1, -1), 0, check=False)[-1],
        torch.ops.uniep.local_plan(idx, experts, 64)[-1],
    ):
        with pytest.raises(ValueError, match=r"entry \(token 1, k 0\) holds an expert id outs"):
            gate.check_send_error(error, 2)


@pytest.mark.parametrize("top_k", [1, 8, 11, 32])
def test_combine_rows_equals_the_cpu_op(top_k: int) -> None:
    """The CUDA combine takes its k rows several at a time (loads first, sums after): the sums
    stay in ascending k, so its bits are the CPU executor's, empty entries (-1) and a top-k past
    one batch of loads included."""
    gen = torch.Generator().manual_seed(top_k)
    tokens, hidden, rows = 37, 264, 200
    y = torch.randn(rows, hidden, generator=gen).bfloat16()
    row = torch.randint(0, rows, (tokens, top_k), generator=gen)
    row[torch.rand(tokens, top_k, generator=gen) < 0.2] = -1
    w = torch.rand(tokens, top_k, generator=gen)
    want, _ = gate.combine_rows(y, row, w)
    got, _ = gate.combine_rows(y.cuda(), row.cuda(), w.cuda())
    assert torch.equal(got.cpu(), want)
