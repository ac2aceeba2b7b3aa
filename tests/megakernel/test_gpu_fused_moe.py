"""The MegaKernel's forward at world 1 on the GPU (``moe_forward_local(overlap="fused")``,
``torch.ops.uniep.moe_fused_local``, include/uniep/cuda/fused_moe.hpp): one persistent launch of
the send into GEMM rows, both expert GEMMs and the reduce over k.

Checked: the fused output equals the sequential composition bit for bit at every tuning point
(how many CTAs send, how many rounds the others take first, every CTA sending; cooperative
128 x 256 tiles, ping-pong 64 x 256 ones and the decode shape's 64 x 128 in clusters of one) and
run to run, on decode batches of one and a few tokens (planned in the launch itself, as
``moe_fused_local_planned``, and apart),
top-k 1 to 9, hundreds of experts, skewed routings, empty experts, -1 entries, hidden and FFN
sizes that are multiples of 64 but not of 128; it is within bf16 rounding of float64; zero tokens
and all-unused routings give empty and zero outputs; a bad expert id is named; rows that never
come and expert outputs that never come raise timeouts naming the tile or the token.
"""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)
from uniep.gemm import pack_gate_up
from uniep.moe import tile_gates as gate

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]

# (CTAs that send first, rounds the others take first): the model's guess, none, many, everyone.
POINTS = [(16, -1), (2, 0), (2, 7), (32, 3), (10_000, 0)]
# The kernel's tile shapes (tile_m, tile_n): cooperative, ping-pong, and the decode shape.
TILES = [(128, 256), (64, 256), (64, 128)]


def _layer(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, seed: int,
           skew: bool = False):  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    if skew:  # most entries on the first two experts
        p = torch.full((experts,), 0.2 / experts, device="cuda")
        p[:2] = 0.4
        idx = torch.multinomial(p.expand(tokens, -1), top_k, generator=gen)
    else:
        idx = torch.randint(0, experts - 1, (tokens, top_k), generator=gen, device="cuda")
    idx[torch.rand(tokens, top_k, generator=gen, device="cuda") < 0.1] = -1  # expert E-1 empty
    w = torch.rand(tokens, top_k, generator=gen, device="cuda")
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen, device="cuda") / 16).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen, device="cuda") / 16).bfloat16()
    return x, idx, w, w1, w2


def _reference(x, idx, w, w1, w2) -> torch.Tensor:
    ffn = w2.shape[1]
    xd, w1d, w2d = x.double(), w1.double(), w2.double()
    ref = torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    for e in range(w1.shape[0]):
        t, k = (idx == e).nonzero(as_tuple=True)
        if t.numel():
            h = xd[t] @ w1d[e]
            out = (torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]) @ w2d[e]
            ref.index_add_(0, t, out * w[t, k].double().unsqueeze(1))
    return ref


LAYERS = [
    # tokens, hidden, ffn, experts, top_k, skew
    (1000, 256, 256, 16, 9, False),
    (777, 192, 192, 8, 1, False),  # multiples of 64, not of 128; top-1
    (600, 128, 128, 256, 4, False),  # hundreds of experts, most with a few rows
    (2048, 512, 128, 32, 8, True),  # skewed: two experts hold most rows
    (3, 64, 64, 4, 2, False),  # fewer rows than one tile
    (1, 256, 192, 64, 8, False),  # decode: one token, eight experts of one row
    (16, 384, 256, 128, 8, False),  # decode: most experts touched by one or two rows
]


@pytest.mark.parametrize("tokens,hidden,ffn,experts,top_k,skew", LAYERS)
def test_fused_equals_sequential_bit_for_bit(tokens, hidden, ffn, experts, top_k, skew) -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _layer(tokens, hidden, ffn, experts, top_k, tokens + experts, skew)
    w1p = pack_gate_up(w1)
    seq = moe_forward_local(x, idx, w, w1p, w2)
    first = moe_forward_local(x, idx, w, w1p, w2, overlap="fused")
    assert torch.equal(first, seq), "fused (default point) against sequential"
    assert torch.equal(moe_forward_local(x, idx, w, w1p, w2, overlap="fused"), first), "run to run"
    for tile_m, tile_n in TILES:
        for comm, skip in POINTS:
            got = moe_forward_local(x, idx, w, w1p, w2, overlap="fused", comm_sms=comm,
                                    skip_rounds=skip, tile_m=tile_m, tile_n=tile_n)  # fmt: skip
            assert torch.equal(got, seq), (
                f"fused with tile {tile_m} x {tile_n}, comm_sms={comm}, skip_rounds={skip}"
            )
    if ffn % 128 == 0:
        # w1 as stored (no packed copy): GEMM 1 reads it in 64-column gate/up blocks, same bits,
        # in the separate launches and on streams.
        for overlap in ("sequential", "streams"):
            got = moe_forward_local(x, idx, w, w1, w2, overlap=overlap, w1_as_stored=True)
            assert torch.equal(got, seq), f"w1 as stored, overlap={overlap}"
    # And in the persistent kernel: 256-wide tiles need the FFN size a multiple of 128, the
    # 128-wide ones of 64.
    for tile_m, tile_n in TILES:
        if ffn % (tile_n // 2) != 0:
            continue
        for comm, skip in POINTS[:2]:
            got = moe_forward_local(
                x, idx, w, w1, w2, overlap="fused", comm_sms=comm, skip_rounds=skip,
                tile_m=tile_m, tile_n=tile_n, w1_as_stored=True,
            )  # fmt: skip
            assert torch.equal(got, seq), f"w1 as stored, tile {tile_m} x {tile_n}, comm_sms={comm}"
    ref = _reference(x, idx, w, w1, w2)
    err = (first.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 2e-2, f"relative error {err:.3g} against float64"


def test_w1_as_stored_errors() -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _layer(64, 128, 192, 4, 2, 5)
    for overlap in ("fused", "sequential"):
        with pytest.raises(NotImplementedError, match=r"w1_as_stored needs ffn .* of 128"):
            moe_forward_local(x, idx, w, w1, w2, overlap=overlap, w1_as_stored=True)
    rows = torch.zeros(8, 128, dtype=torch.bfloat16, device="cuda")
    offs = torch.tensor([8, 8, 8, 8], dtype=torch.int32, device="cuda")
    zeros = torch.zeros(16, dtype=torch.int32, device="cuda")
    base = gate.tile_base(offs, 8, gate.TILE_M)
    with pytest.raises(ValueError, match="pass swiglu=True with it"):
        gate.grouped_mm_gated(
            rows, w2[:, :128].contiguous(), offs, zeros, base, per_row=0, w1_as_stored=True
        )


def test_fused_edge_cases() -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _layer(0, 128, 128, 4, 2, seed=1)
    assert moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused").shape == (0, 128)
    x, idx, w, w1, w2 = _layer(5, 128, 128, 4, 3, seed=2)
    idx[:] = -1
    assert not moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused").any()
    idx[1, 2] = 4
    with pytest.raises(ValueError, match=r"entry \(token 1, k 2\) holds an expert id"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused")
    with pytest.raises(ValueError, match="comm_sms must be >= 1"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused", comm_sms=0)
    with pytest.raises(ValueError, match="tile_m must be None or"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused", tile_m=32)
    with pytest.raises(ValueError, match="tile_m must be None or"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, tile_m=64)  # sequential: 128 only
    with pytest.raises(ValueError, match="tile_n must be None or"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused", tile_n=64)
    with pytest.raises(ValueError, match="tile_n must be None or"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, tile_n=128)  # sequential: 256 only
    with pytest.raises(ValueError, match="tile_n=128 runs 64-row tiles"):
        moe_forward_local(x, idx, w, pack_gate_up(w1), w2, overlap="fused", tile_m=128, tile_n=128)


def _plan(x, idx, w1p, tile_m: int = 128):
    e = w1p.shape[0]
    counts = torch.bincount(idx[idx >= 0], minlength=e).view(1, e)
    _, row, counter, _ = gate.sender_rows(idx, counts, 0, tile_m=tile_m)
    offs = counts[0].cumsum(0).to(torch.int32)
    return row, counter, offs


@pytest.mark.parametrize("tile_m", [128, 64])
def test_rows_that_never_come_time_out_naming_the_tile(tile_m: int) -> None:
    x, idx, w, w1, w2 = _layer(64, 128, 128, 4, 2, seed=3)
    w1p = pack_gate_up(w1)
    row, counter, offs = _plan(x, idx, w1p, tile_m)
    # Expert 0's rows are in the GEMM's shapes, but no entry sends them.
    mine = idx == 0
    row, counter = row.masked_fill(mine, -1), counter.masked_fill(mine, -1)
    base = gate.tile_base(offs, idx.numel(), tile_m)
    _, _, timeout = torch.ops.uniep.moe_fused_local(
        x, w, row, counter, w1p, w2, offs, base, 16, -1, 0.2, None, tile_m
    )
    with pytest.raises(TimeoutError, match=r"the rows of expert 0, m-tile 0 never arrived"):
        gate.check_gate_timeout(timeout, "fused")


def test_outputs_that_never_come_time_out_naming_the_token() -> None:
    x, idx, w, w1, w2 = _layer(64, 128, 128, 4, 2, seed=4)
    idx[:, 1] = -1
    idx[:, 0] = 0
    idx[7, 1] = 1  # token 7's second entry goes to expert 1
    w1p = pack_gate_up(w1)
    row, counter, offs = _plan(x, idx, w1p)
    # Expert 1's row is sent, but the GEMM's shapes give expert 1 no rows: no tile computes it.
    offs = torch.full_like(offs, int(offs[0]))
    base = gate.tile_base(offs, idx.numel())
    _, _, timeout = torch.ops.uniep.moe_fused_local(
        x, w, row, counter, w1p, w2, offs, base, 16, -1, 0.2
    )
    with pytest.raises(TimeoutError, match=r"expert output of token 7, k = 1 never arrived"):
        gate.check_gate_timeout(timeout, "fused")


def test_bad_arguments_are_named() -> None:
    x, idx, w, w1, w2 = _layer(8, 128, 128, 4, 2, seed=5)
    w1p = pack_gate_up(w1)
    row, counter, offs = _plan(x, idx, w1p)
    base = gate.tile_base(offs, idx.numel())
    op = torch.ops.uniep.moe_fused_local
    with pytest.raises(ValueError, match="w2 must be"):
        op(x, w, row, counter, w1p, w2[:, :64], offs, base, 16, -1, 1.0)
    with pytest.raises(ValueError, match="topk_weights must be"):
        op(x, w.double(), row, counter, w1p, w2, offs, base, 16, -1, 1.0)
    with pytest.raises(ValueError, match="comm_ctas must be"):
        op(x, w, row, counter, w1p, w2, offs, base, 0, -1, 1.0)
    with pytest.raises(ValueError, match="skip_rounds must be"):
        op(x, w, row, counter, w1p, w2, offs, base, 16, -2, 1.0)
    with pytest.raises(ValueError, match="tile_m must be 128 or 64"):
        op(x, w, row, counter, w1p, w2, offs, base, 16, -1, 1.0, None, 96)
    x2, _, _, w1b, w2b = _layer(8, 96, 128, 4, 2, seed=6)
    with pytest.raises(ValueError, match="multiple of 64"):
        op(x2, w, row, counter, pack_gate_up(w1b), w2b, offs, base, 16, -1, 1.0)


@pytest.mark.parametrize(
    "tokens,hidden,ffn,experts,top_k,skew",
    [
        (1, 256, 192, 64, 8, False),  # one token: eight experts of one row
        (256, 128, 128, 1024, 8, False),  # 2,048 entries over 1,024 experts
        (512, 128, 128, 1024, 8, False),  # 4,096 entries over 1,024 experts: the bounds
        (255, 128, 64, 16, 8, True),  # skewed, with empty experts and -1 entries
    ],
)
def test_the_planned_launch_has_the_plan_apart_bits(tokens, hidden, ffn, experts, top_k, skew):
    """moe_fused_local_planned (the plan made by the MegaKernel's first launch) against
    local_plan followed by moe_fused_local, at every tile shape; past its bounds
    moe_forward_local plans apart, and the op itself refuses naming them."""
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _layer(tokens, hidden, ffn, experts, top_k, tokens + experts, skew)
    w1p = pack_gate_up(w1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tile_m, tile_n in TILES:
        _, offs, base, _, row, counter, plan_error = gate.local_plan(idx, experts, tile_m)
        apart, error, timeout = torch.ops.uniep.moe_fused_local(
            x, w, row, counter, w1p, w2, offs, base, sms, -1, 5.0, None, tile_m, False, tile_n
        )
        gate.check_send_error(plan_error, top_k, "plan")
        gate.check_send_error(error, top_k, "fused")
        gate.check_gate_timeout(timeout, "fused")
        got, error, timeout = torch.ops.uniep.moe_fused_local_planned(
            x, idx, w, w1p, w2, 5.0, tile_m, False, tile_n
        )
        gate.check_send_error(error, top_k, "planned")
        gate.check_gate_timeout(timeout, "planned")
        assert torch.equal(got, apart), f"tile {tile_m} x {tile_n}"
    seq = moe_forward_local(x, idx, w, w1p, w2)
    assert torch.equal(moe_forward_local(x, idx, w, w1p, w2, overlap="fused"), seq)
    ref = _reference(x, idx, w, w1, w2)
    err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 2e-2, f"relative error {err:.3g} against float64"


def test_the_planned_launch_bounds_and_errors() -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    # One entry past the bound: moe_forward_local plans apart, with the same bits.
    x, idx, w, w1, w2 = _layer(1366, 128, 128, 16, 3, seed=21)  # 4,098 entries
    w1p = pack_gate_up(w1)
    seq = moe_forward_local(x, idx, w, w1p, w2)
    assert torch.equal(moe_forward_local(x, idx, w, w1p, w2, overlap="fused"), seq)
    with pytest.raises(ValueError, match=r"plans at most 4096 entries .* got 4098 and 16"):
        torch.ops.uniep.moe_fused_local_planned(x, idx, w, w1p, w2, 1.0)
    # A bad id is named, and the next call (same buffers' sizes) starts with clean words.
    x, idx, w, w1, w2 = _layer(4, 128, 128, 4, 2, seed=22)
    w1p = pack_gate_up(w1)
    good = moe_forward_local(x, idx, w, w1p, w2)
    bad = idx.clone()
    bad[2, 1] = 9
    _, error, _ = torch.ops.uniep.moe_fused_local_planned(x, bad, w, w1p, w2, 1.0, 64, False, 128)
    with pytest.raises(ValueError, match=r"entry \(token 2, k 1\) holds an expert id"):
        gate.check_send_error(error, 2, "planned")
    got, error, timeout = torch.ops.uniep.moe_fused_local_planned(
        x, idx, w, w1p, w2, 1.0, 64, False, 128
    )
    gate.check_send_error(error, 2, "planned")
    gate.check_gate_timeout(timeout, "planned")
    assert torch.equal(got, good)
    with pytest.raises(ValueError, match="topk_idx must be"):
        torch.ops.uniep.moe_fused_local_planned(x, idx.int(), w, w1p, w2, 1.0)


@pytest.mark.parametrize(("comm_sms", "tile_m"), [(None, None), (16, 128), (10_000, 64)])
def test_fused_is_captured_in_a_cuda_graph(comm_sms: int | None, tile_m: int | None) -> None:
    """The decode path: nothing in the fused forward waits for the host (check=False), so a CUDA
    graph holds the plan and the launch; replays on new tokens of the same shape give eager's
    bits."""
    from uniep.moe.megakernel.launch import moe_forward_local

    x, idx, w, w1, w2 = _layer(128, 256, 128, 16, 8, seed=11)
    w1p = pack_gate_up(w1)
    kw = {"overlap": "fused", "comm_sms": comm_sms, "tile_m": tile_m}
    sx, sidx, sw = x.clone(), idx.clone(), w.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        moe_forward_local(sx, sidx, sw, w1p, w2, check=False, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward_local(sx, sidx, sw, w1p, w2, check=False, **kw)
    for seed in (11, 12, 13):
        x2, idx2, wts2, _, _ = _layer(128, 256, 128, 16, 8, seed=seed)
        sx.copy_(x2)
        sidx.copy_(idx2)
        sw.copy_(wts2)
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_forward_local(x2, idx2, wts2, w1p, w2, **kw)
        assert torch.equal(out, eager), f"replay with seed {seed} differs from eager"


@pytest.mark.parametrize("comm_sms", [2, None])
def test_trace_records_phases_and_gate_waits(comm_sms: int | None) -> None:
    # The trace is a diagnostic: it must not change the bits, and with 6 entries per SM it also
    # gives each CTA's producer's waits at the two gates; with 12, the tiles' stamps.
    from uniep.moe.megakernel.launch import moe_forward_local, trace_phases

    x, idx, w, w1, w2 = _layer(1024, 256, 256, 8, 4, seed=11)
    w1p = pack_gate_up(w1)
    plain = moe_forward_local(x, idx, w, w1p, w2, overlap="fused", comm_sms=comm_sms)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for entries in (4 * sms, 6 * sms, 12 * sms):
        trace = torch.zeros(entries, dtype=torch.int64, device="cuda")
        got = moe_forward_local(x, idx, w, w1p, w2, overlap="fused", comm_sms=comm_sms,
                                trace=trace)  # fmt: skip
        assert torch.equal(got, plain)
        phases = trace_phases(trace, sms)
        assert 0 <= phases["send_end_us"] <= phases["gemm_end_us"] <= phases["reduce_end_us"]
        waits = [k for k in phases if "gate_wait" in k]
        stamped = ("first_load_us", "last_load_us", "epilogue_start_us", "epilogue_end_us")
        if entries == 12 * sms:
            assert all(0 <= phases[k] <= phases["reduce_end_us"] for k in stamped)
            assert phases["first_load_us"] <= phases["last_load_us"] <= phases["epilogue_end_us"]
        else:
            assert not any(k in phases for k in stamped)
        if entries >= 6 * sms:
            assert sorted(waits) == sorted(
                f"{g}_gate_wait_{s}_us" for g in ("rows", "done") for s in ("mean", "max")
            )
            assert all(0 <= phases[k] <= phases["reduce_end_us"] for k in waits)
            # Two CTAs send the rows while the others wait at GEMM 1's gates.
            if comm_sms == 2:
                assert phases["rows_gate_wait_max_us"] > 0
        else:
            assert waits == []
    short = torch.zeros(4 * sms - 1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=r"trace must be contiguous int64 with >= 4 x SMs"):
        moe_forward_local(x, idx, w, w1p, w2, overlap="fused", trace=short)
