"""The MegaKernel's dispatch on CPU (uniep.moe.tile_gates.sender_rows / send_rows;
cpp/core/experts.cpp plan_sender_rows, cpp/torch/megakernel/send_rows_ops.cpp): where every (token,
k) row of a rank goes (rank, grouped-GEMM row, tile gate counter there), and the world-1 send that
stores the rows and counts them. Checked against the receivers' plans, an independent reading of
the counts, and each other; bad entries and arguments give errors naming them. The device side is in
tests/megakernel/test_gpu_tile_gate.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)
from torch._subclasses.fake_tensor import FakeTensorMode
from uniep import _C
from uniep.moe import tile_gates as gate


def _routings(world: int, experts: int, top_k: int, tokens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in tokens:
        # Skewed: half the entries go to the first quarter of the experts; some entries unused.
        hot = torch.randint(0, max(1, experts // 4), (t, top_k), generator=gen)
        cold = torch.randint(0, experts, (t, top_k), generator=gen)
        idx = torch.where(torch.rand(t, top_k, generator=gen) < 0.5, hot, cold)
        idx[torch.rand(t, top_k, generator=gen) < 0.15] = -1
        out.append(idx)
    counts = torch.stack([torch.bincount(i[i >= 0], minlength=experts) for i in out]).to(
        torch.int64
    )
    return out, counts


def _expected_counter(counts: torch.Tensor, world: int, tile_m: int, dest: int, row: int) -> int:
    """Independently: the rows of each local expert on `dest` in order; the tile of `row`."""
    el = counts.shape[1] // world
    per_expert = counts[:, dest * el : (dest + 1) * el].sum(0).tolist()
    begin = tiles = 0
    for rows in per_expert:
        if row < begin + rows:
            return tiles + (row - begin) // tile_m
        begin += rows
        tiles += -(-rows // tile_m)
    raise AssertionError(f"row {row} lies past the rows of rank {dest}")


CASES = [
    # world, experts, top_k, tokens per rank
    (1, 8, 2, [37]),
    (1, 16, 9, [200]),
    (2, 8, 4, [50, 0]),
    (4, 32, 8, [64, 17, 1, 90]),
    (4, 4, 3, [30, 30, 30, 30]),
]


@pytest.mark.parametrize("world,experts,top_k,tokens", CASES)
def test_send_order_puts_every_ranks_first_experts_first(world, experts, top_k, tokens) -> None:
    routing, counts = _routings(world, experts, top_k, tokens, seed=world + top_k)
    el = experts // world
    for rank in range(world):
        idx = routing[rank].reshape(-1)
        order = gate.send_order(routing[rank], counts, rank)
        _, row, _, _ = gate.sender_rows(routing[rank], counts, rank)
        # Independently: (index on its rank, rank, row) sorted, at the announced counts' places.
        used = [i for i in range(idx.numel()) if idx[i] >= 0]
        key = {i: (int(idx[i]) % el, int(idx[i]) // el, int(row.reshape(-1)[i])) for i in used}
        want = sorted(used, key=key.__getitem__)
        assert order[: len(want)].tolist() == want
        assert (order[len(want) :] == -1).all()
    # Counts that announce more rows than the routing holds leave holes, never run past the end.
    idx = torch.tensor([[0, 1], [1, -1]])
    over = torch.tensor([[3, 2]])  # expert 0 announces 3 rows and has 1
    assert gate.send_order(idx, over, 0).tolist() == [0, -1, -1, 1]


@pytest.mark.parametrize("world,experts,top_k,tokens", CASES)
@pytest.mark.parametrize("tile_m", [16, 128])
def test_sender_rows_are_the_receivers_rows_and_tiles(
    world: int, experts: int, top_k: int, tokens: list[int], tile_m: int
) -> None:
    routing, counts = _routings(world, experts, top_k, tokens, seed=world * 31 + top_k)
    arrays = [r.numpy() for r in routing]
    el = experts // world
    written = {}
    for rank in range(world):
        dest, row, counter, error = gate.sender_rows(routing[rank], counts, rank, tile_m=tile_m)
        assert int(error) == 0
        plan = _C.build_rank_plan(arrays, experts, rank, "", tile_m)
        np.testing.assert_array_equal(dest.numpy(), plan["send_gemm_rank"])
        np.testing.assert_array_equal(row.numpy(), plan["send_gemm_row"])
        np.testing.assert_array_equal(counter.numpy(), plan["send_gate_counter"])
        used = routing[rank] >= 0
        assert torch.equal(dest >= 0, used) and torch.equal(counter >= 0, used)
        for t, k in used.nonzero().tolist():
            d, r, c = int(dest[t, k]), int(row[t, k]), int(counter[t, k])
            assert d == int(routing[rank][t, k]) // el
            assert c == _expected_counter(counts, world, tile_m, d, r)
            assert (d, r) not in written, "two entries write one row"
            written[(d, r)] = (rank, t, k)
    # Every destination's rows are written exactly once: as many as the counts say.
    for d in range(world):
        total = int(counts[:, d * el : (d + 1) * el].sum())
        assert sorted(r for dd, r in written if dd == d) == list(range(total))


def test_sender_rows_counters_fit_tile_base() -> None:
    """The counters a receiver needs are gate.tile_base over its own row ranges."""
    routing, counts = _routings(2, 6, 3, [80, 45], seed=5)
    el = 3
    for d in range(2):
        offs = counts[:, d * el : (d + 1) * el].sum(0).cumsum(0).to(torch.int32)
        base = gate.tile_base(offs, int(offs[-1]), 16)
        seen = set()
        for rank in range(2):
            dest, row, counter, _ = gate.sender_rows(routing[rank], counts, rank, tile_m=16)
            seen |= set(counter[dest == d].tolist())
        assert seen == set(range(int(base[-1])))


@pytest.mark.parametrize("tile_m", [16, 128])
def test_send_rows_at_world_one_stores_and_counts_every_row(tile_m: int) -> None:
    routing, counts = _routings(1, 12, 5, [150], seed=tile_m)
    idx = routing[0]
    x = torch.randn(150, 40).to(torch.bfloat16)  # 80-byte rows
    dest, row, counter, _ = gate.sender_rows(idx, counts, 0, tile_m=tile_m)
    total = int(counts.sum())
    offs = counts[0].cumsum(0).to(torch.int32)
    base = gate.tile_base(offs, total, tile_m)
    rows = torch.zeros(total + 3, 48, dtype=torch.bfloat16)  # wider rows and spare capacity
    counters = torch.zeros(int(base[-1]), dtype=torch.int32)
    error = gate.send_rows(x, dest, row, counter, rows, counters)
    gate.check_send_error(error, 5)
    # Rows: expert-major, each expert's rows in (token, k) order.
    order = [(int(idx[t, k]), t, k) for t in range(150) for k in range(5) if idx[t, k] >= 0]
    order.sort(key=lambda e: e[0])
    want = torch.stack([x[t] for _, t, _ in order])
    assert torch.equal(rows[:total, :40], want)
    assert not rows[:, 40:].any() and not rows[total:].any()
    # Counters: the rows in each tile, what the gate waits for with per_row = 1.
    need = []
    for c in counts[0].tolist():
        need += [min(tile_m, c - i * tile_m) for i in range(-(-c // tile_m))]
    assert counters.tolist() == need


def test_bad_entries_are_named_and_skipped() -> None:
    idx = torch.tensor([[0, 1], [2, 9], [1, -1]])
    counts = torch.tensor([[1, 2, 1, 0]])
    with pytest.raises(ValueError, match=r"entry \(token 1, k 1\) holds an expert id outside"):
        gate.sender_rows(idx, counts, 0)
    dest, row, counter, error = gate.sender_rows(idx, counts, 0, check=False)
    assert dest[1, 1] == row[1, 1] == counter[1, 1] == -1 and int(error) != 0
    assert row[:, 0].tolist() == [0, 3, 2] and row[0, 1] == 1  # the rest is planned
    # More rows to an expert than the rank announced: the extra ones are refused.
    short = torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"entry \(token 2, k 0\) routes more rows to its exp"):
        gate.sender_rows(torch.tensor([[0, 1], [2, -1], [1, -1]]), short, 0)


@pytest.mark.parametrize("bad", [-2, -7])
def test_ids_below_minus_one_are_named_not_dropped(bad: int) -> None:
    # -1 alone marks an unused slot: any other negative id is an error, never a dropped row.
    idx = torch.tensor([[0, 1], [bad, 2], [1, -1]])
    with pytest.raises(ValueError, match=r"entry \(token 1, k 0\) holds an expert id outside"):
        gate.sender_rows(idx, torch.tensor([[1, 2, 1, 0]]), 0)
    with pytest.raises(ValueError, match=r"entry \(token 1, k 0\) holds an expert id outside"):
        gate.check_send_error(torch.ops.uniep.local_plan(idx, 4, 2)[-1], 2)

    x = torch.ones(3, 8, dtype=torch.bfloat16)
    counts = torch.tensor([[1, 2, 1, 1]])
    dest, row, counter, _ = gate.sender_rows(torch.tensor([[0, 1], [2, 3], [1, -1]]), counts, 0)
    rows = torch.zeros(5, 8, dtype=torch.bfloat16)
    counters = torch.zeros(4, dtype=torch.int32)
    cases = [
        (dest.clone().index_fill_(1, torch.tensor([0]), 1), "goes to a rank outside the peer"),
        (row.clone().fill_(7), "has a GEMM row outside the destination's rows"),
        (counter.clone().fill_(-5), "has a gate counter outside the destination's counters"),
    ]
    for i, (bad, why) in enumerate(cases):
        args = [dest, row, counter]
        args[i] = bad
        rows.zero_()
        counters.zero_()
        error = gate.send_rows(x, *args, rows, counters)
        with pytest.raises(ValueError, match=r"entry \(token 0, k 0\) " + why):
            gate.check_send_error(error, 2)
        assert not rows[0].any(), "a refused entry is not stored"


def test_bad_arguments_name_the_argument() -> None:
    idx = torch.zeros(4, 2, dtype=torch.int64)
    counts = torch.tensor([[8, 0, 0, 0]])
    with pytest.raises(ValueError, match="rank must be in"):
        gate.sender_rows(idx, counts, 1)
    with pytest.raises(ValueError, match="topk_idx must have 1 to 32 columns"):
        gate.sender_rows(torch.zeros(4, 33, dtype=torch.int64), counts, 0)
    with pytest.raises(ValueError, match="multiple of world_size"):
        gate.sender_rows(idx, torch.zeros(3, 4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        gate.sender_rows(idx.int(), counts, 0)
    with pytest.raises(ValueError, match="expert_counts must be non-negative"):
        gate.sender_rows(idx, torch.tensor([[8, -1, 0, 0]]), 0)
    with pytest.raises(ValueError, match="tile_m must be in"):
        gate.sender_rows(idx, counts, 0, tile_m=0)
    dest, row, counter, _ = gate.sender_rows(idx, counts, 0)
    rows = torch.zeros(8, 8, dtype=torch.bfloat16)
    counters = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        gate.send_rows(torch.ones(4, 5, dtype=torch.bfloat16), dest, row, counter, rows, counters)
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        gate.send_rows(torch.ones(4, 8), dest, row, counter, rows, counters)
    with pytest.raises(ValueError, match="counter must have dest_rank's shape"):
        x = torch.ones(4, 8, dtype=torch.bfloat16)
        gate.send_rows(x, dest, row, counter[:, :1].contiguous(), rows, counters)
    with pytest.raises(ValueError, match="counters must be a contiguous 1-D int32"):
        gate.send_rows(x, dest, row, counter, rows, counters.long())


def test_fake_kernels_give_the_shapes() -> None:
    with FakeTensorMode():
        idx = torch.empty(6, 3, dtype=torch.int64)
        dest, row, counter, error = torch.ops.uniep.sender_rows(
            idx, torch.empty(2, 8, dtype=torch.int64), 0, 128
        )
        assert dest.shape == row.shape == counter.shape == (6, 3) and error.shape == (1,)
        x = torch.empty(6, 16, dtype=torch.bfloat16)
        err = torch.ops.uniep.send_rows(
            x,
            dest,
            row,
            counter,
            torch.empty(20, 16, dtype=torch.bfloat16),
            torch.empty(4, dtype=torch.int32),
            8,
        )
        assert err.shape == (1,) and err.dtype == torch.int64


def test_opcheck() -> None:
    routing, counts = _routings(2, 4, 2, [10, 6], seed=1)
    torch.library.opcheck(torch.ops.uniep.sender_rows.default, (routing[1], counts, 1, 16))
    dest, row, counter, _ = gate.sender_rows(routing[0], counts, 0, tile_m=16)
    total = int(counts[:, :2].sum())
    args = (
        torch.randn(10, 8).to(torch.bfloat16),
        dest,
        row,
        counter,
        torch.zeros(total, 8, dtype=torch.bfloat16),
        torch.zeros(8, dtype=torch.int32),
        4,
    )
    torch.library.opcheck(torch.ops.uniep.send_rows.default, args)


def test_combine_rows_is_the_combines_sum() -> None:
    """Ascending k, fp32 products and sums each rounded, one rounding to bf16: checked against
    the same sum written out in float64-free numpy float32 steps."""
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(40, 24, generator=gen).to(torch.bfloat16)
    row = torch.randint(0, 40, (9, 5), generator=gen)
    row[torch.rand(9, 5, generator=gen) < 0.2] = -1
    w = torch.rand(9, 5, generator=gen)
    out, error = gate.combine_rows(y, row, w)
    assert int(error) == 0 and out.dtype == torch.bfloat16
    yf = y.float().numpy()
    want = np.zeros((9, 24), np.float32)
    for t in range(9):
        for k in range(5):
            if row[t, k] >= 0:
                want[t] = np.float32(want[t] + np.float32(w[t, k].item()) * yf[int(row[t, k])])
    assert torch.equal(out, torch.from_numpy(want).to(torch.bfloat16))
    bad = row.index_put((torch.tensor([2]), torch.tensor([1])), torch.tensor(40))
    with pytest.raises(ValueError, match=r"entry \(token 2, k 1\) has a GEMM row outside"):
        gate.combine_rows(y, bad, w)
    # Without report the entry is still skipped, and no word is made.
    skipped, _ = gate.combine_rows(y, bad, w, check=False)
    out2, unreported = torch.ops.uniep.combine_rows(y, bad, w, report=False)
    assert unreported.shape == (0,) and torch.equal(out2, skipped)
    meta = torch.empty(40, 24, dtype=torch.bfloat16, device="meta")
    for report, words in ((True, 1), (False, 0)):
        fo, fe = torch.ops.uniep.combine_rows(meta, row.to("meta"), w.to("meta"), report=report)
        assert fo.shape == (9, 24) and fe.shape == (words,)
    with pytest.raises(ValueError, match="topk_weights must be contiguous float32"):
        gate.combine_rows(y, row, w.double())
    with pytest.raises(ValueError, match="y must be a contiguous bfloat16"):
        gate.combine_rows(y.float(), row, w)


def test_expert_counts_skip_unused_and_bad_ids() -> None:
    from uniep.moe.megakernel.launch import expert_counts

    idx = torch.tensor([[0, 3], [-1, 3], [7, 1]])
    assert expert_counts(idx, 4).tolist() == [1, 1, 0, 2]
    assert expert_counts(torch.empty(0, 2, dtype=torch.int64), 3).tolist() == [0, 0, 0]


def _expert_tiles_reference(idx: torch.Tensor, experts: int, tile_m: int):
    flat = idx.reshape(-1)
    valid = flat[(flat >= 0) & (flat < experts)]
    counts = torch.bincount(valid, minlength=experts)
    tiles = (counts + tile_m - 1) // tile_m
    base = torch.cat([torch.zeros(1, dtype=torch.int64), tiles.cumsum(0)])
    return counts, counts.cumsum(0).to(torch.int32), base.to(torch.int32)


@pytest.mark.parametrize("experts,tile_m", [(1, 1), (5, 3), (128, 64), (300, 128)])
def test_expert_tiles_are_the_counts_their_sums_and_the_tile_bases(
    experts: int, tile_m: int
) -> None:
    gen = torch.Generator().manual_seed(experts)
    idx = torch.randint(-1, experts + 2, (333, 7), generator=gen)  # unused and bad ids too
    counts, offs, base = gate.expert_tiles(idx, experts, tile_m)
    for got, want in zip((counts, offs, base), _expert_tiles_reference(idx, experts, tile_m),
                         strict=True):  # fmt: skip
        assert got.dtype == want.dtype and torch.equal(got, want)
    # The same row ends and tile counters as the gate's own plan over T x K rows.
    assert torch.equal(base, gate.tile_base(offs, idx.numel(), tile_m))
    empty = gate.expert_tiles(torch.empty(0, 3, dtype=torch.int64), experts, tile_m)
    assert [t.tolist() for t in empty] == [[0] * experts, [0] * experts, [0] * (experts + 1)]
    # The fake kernel (torch.compile, meta tensors) agrees with the op's shapes and dtypes.
    torch.library.opcheck(torch.ops.uniep.expert_tiles.default, (idx, experts, tile_m))


def test_local_plan_is_expert_tiles_then_sender_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 12, (500, 4), generator=gen)  # ids 10 and 11 are bad
    got = gate.local_plan(idx, 10, 64)
    counts, offs, base = gate.expert_tiles(idx, 10, 64)
    want = (counts, offs, base, *gate.sender_rows(idx, counts.view(1, 10), 0, tile_m=64,
                                                  check=False))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match=r"expert id outside \[-1, num_experts\)"):
        gate.check_send_error(got[-1], 4, "local_plan")
    torch.library.opcheck(torch.ops.uniep.local_plan.default, (idx, 10, 64))
    with pytest.raises(ValueError, match="num_experts must be in"):
        gate.local_plan(idx, 0, 64)
    with pytest.raises(ValueError, match="tile_m must be in"):
        gate.local_plan(idx, 10, 0)


def test_expert_tiles_refuses_bad_arguments() -> None:
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="num_experts must be in"):
        gate.expert_tiles(idx, 0)
    with pytest.raises(ValueError, match="tile_m must be in"):
        gate.expert_tiles(idx, 4, 0)
    with pytest.raises(ValueError, match="topk_idx must be int64"):
        gate.expert_tiles(idx.int(), 4)
    with pytest.raises(ValueError, match="topk_idx must be 2-D"):
        gate.expert_tiles(idx.reshape(-1), 4)
    with pytest.raises(ValueError, match="1 to 32 columns"):
        gate.expert_tiles(torch.zeros(1, 33, dtype=torch.int64), 4)


def test_moe_forward_local_refuses_bad_arguments() -> None:
    from uniep.moe.megakernel.launch import moe_forward_local

    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    w = torch.ones(4, 2)
    w1 = torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    w2 = torch.zeros(2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap must be one of"):
        moe_forward_local(x, idx, w, w1, w2, overlap="chunked")
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        moe_forward_local(x, idx, w, w1, w2)


def test_trace_phases_reads_each_ctas_stamps() -> None:
    from uniep.moe.megakernel.launch import trace_phases

    # Three CTAs that ran and one that did not (zeros); stamps in ns from an arbitrary origin.
    t0 = 1_000_000
    stamps = [
        [t0, t0 + 40_000, t0 + 700_000, t0 + 760_000],
        [t0 + 300, t0 + 45_000, t0 + 720_000, t0 + 765_000],
        [t0 + 100, t0 + 30_000, t0 + 750_000, t0 + 770_000],
        [0, 0, 0, 0],
    ]
    waits = [[1_000, 0], [3_000, 2_000], [2_000, 4_000], [9_999_999, 9_999_999]]
    trace = torch.tensor(stamps, dtype=torch.int64).view(-1)
    phases = trace_phases(trace)
    assert phases["send_end_us"] == pytest.approx(45.0)
    assert phases["first_gemm_end_us"] == pytest.approx(700.0)
    assert phases["median_gemm_end_us"] == pytest.approx(720.0)
    assert phases["gemm_end_us"] == pytest.approx(750.0)
    assert phases["reduce_end_us"] == pytest.approx(770.0)
    assert "rows_gate_wait_mean_us" not in phases
    full = torch.cat([trace, torch.tensor(waits, dtype=torch.int64).view(-1)])
    phases = trace_phases(full, sms=4)
    # The CTA that did not run is left out of the waits too.
    assert phases["rows_gate_wait_mean_us"] == pytest.approx(2.0)
    assert phases["rows_gate_wait_max_us"] == pytest.approx(3.0)
    assert phases["done_gate_wait_mean_us"] == pytest.approx(2.0)
    assert phases["done_gate_wait_max_us"] == pytest.approx(4.0)
    assert trace_phases(torch.zeros(16, dtype=torch.int64)) == {}


def test_trace_phases_reads_the_tile_stamps() -> None:
    from uniep.moe.megakernel.launch import trace_phases

    # Two CTAs: one with two gated tiles, one with one (only its first pair stamped); a third
    # that ran without a tile (zero stamps) and a fourth that did not run.
    t0 = 2_000_000
    stamps = [
        [t0, t0 + 1_000, t0 + 40_000, t0 + 45_000],
        [t0 + 500, t0 + 1_000, t0 + 30_000, t0 + 44_000],
        [t0 + 200, t0 + 800, t0 + 2_000, t0 + 43_000],
        [0, 0, 0, 0],
    ]
    waits = [[0, 0]] * 4
    tiles = [
        [t0 + 5_000, t0 + 6_000, t0 + 20_000, t0 + 25_000, t0 + 32_000, t0 + 37_000],
        [t0 + 5_500, t0 + 7_000, 0, 0, t0 + 22_000, t0 + 26_000],
        [0, 0, 0, 0, 0, 0],
        [t0, t0, t0, t0, t0, t0],
    ]
    trace = torch.cat([torch.tensor(v, dtype=torch.int64).view(-1) for v in (stamps, waits, tiles)])
    phases = trace_phases(trace, sms=4)
    assert phases["first_load_us"] == pytest.approx(7.0)
    assert phases["last_load_us"] == pytest.approx(25.0)
    assert phases["epilogue_start_us"] == pytest.approx(32.0)
    assert phases["epilogue_end_us"] == pytest.approx(37.0)
    assert phases["epilogue_mean_us"] == pytest.approx(4.5)
    assert "first_load_us" not in trace_phases(trace[: 6 * 4], sms=4)
