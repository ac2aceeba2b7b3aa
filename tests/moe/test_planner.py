"""The host planner (uniep._C.compute_layout / build_rank_plan) against a numpy recomputation of
the plan's definition, plus the invariants the executors rely on across ranks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from uniep import _C


@dataclass(frozen=True)
class Routing:
    name: str
    tokens: tuple[int, ...]  # per rank
    experts: int
    top_k: int
    seed: int
    unused: float = 0.25  # fraction of -1 slots
    duplicates: bool = False  # allow the same expert twice in a token's top-k

    @property
    def world_size(self) -> int:
        return len(self.tokens)

    def topk(self) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        out = []
        for t in self.tokens:
            if self.duplicates:
                idx = rng.integers(0, self.experts, size=(t, self.top_k))
            else:
                idx = np.argsort(rng.random((t, self.experts)), axis=1)[:, : self.top_k]
            idx = np.ascontiguousarray(idx, dtype=np.int64)
            idx[rng.random(idx.shape) < self.unused] = -1
            out.append(idx)
        return out


ROUTINGS = [
    Routing("w1-k2", (23,), 4, 2, 1),
    Routing("w2-k1", (17, 30), 4, 1, 2),
    Routing("w2-k4-zero-rank", (0, 25), 8, 4, 3),
    Routing("w3-k3", (11, 19, 7), 6, 3, 4),
    Routing("w4-k8", (20, 0, 13, 31), 16, 8, 5),
    Routing("w4-k2-all-unused", (5, 6, 7, 8), 8, 2, 6, unused=1.0),
    Routing("w4-k6-no-unused", (40, 33, 1, 29), 8, 6, 7, unused=0.0),
    Routing("w8-k5", (9, 4, 12, 0, 7, 15, 3, 10), 16, 5, 8),
    Routing("w2-k3-duplicate-experts", (12, 9), 4, 3, 9, duplicates=True),
]


def np_layout(idx: np.ndarray, num_experts: int, world: int) -> dict[str, np.ndarray]:
    per = num_experts // world
    used = idx >= 0
    owner = np.where(used, idx // per, -1)
    token_in_rank = np.stack([(owner == r).any(axis=1) for r in range(world)], axis=1)
    token_in_rank = token_in_rank.reshape(idx.shape[0], world).astype(np.uint8)
    return {
        "tokens_per_rank": token_in_rank.sum(axis=0, dtype=np.int64),
        "tokens_per_expert": np.bincount(idx[used], minlength=num_experts).astype(np.int64),
        "token_in_rank": token_in_rank,
    }


def np_rank_plan(all_topk: list[np.ndarray], num_experts: int, me: int) -> dict[str, np.ndarray]:
    """The plan straight from its definition: slots ordered by (source rank, source token)."""
    world = len(all_topk)
    per = num_experts // world
    top_k = all_topk[0].shape[1]
    layouts = [np_layout(a, num_experts, world) for a in all_topk]
    counts = np.stack([lay["tokens_per_rank"] for lay in layouts])  # [src, dst]
    mine = layouts[me]["token_in_rank"]
    send_tokens = [np.flatnonzero(mine[:, d]) for d in range(world)]
    send_slots = [counts[:me, d].sum() + np.arange(counts[me, d]) for d in range(world)]
    recv_offsets = np.concatenate([[0], np.cumsum(counts[:, me])])
    row_slot, row_src, row_combine = [], [], []
    row_offsets, eso = [0], np.zeros((per, world + 1), np.int64)
    for e in range(per):
        g = me * per + e
        for s in range(world):
            eso[e, s] = len(row_slot)
            arrived = np.flatnonzero(layouts[s]["token_in_rank"][:, me])
            for j, t in enumerate(arrived):
                for k in range(top_k):
                    if all_topk[s][t, k] == g:
                        row_slot.append(recv_offsets[s] + j)
                        row_src.append(s)
                        row_combine.append(t * top_k + k)
        eso[e, world] = len(row_slot)
        row_offsets.append(len(row_slot))
    row_src_arr = np.asarray(row_src, np.int64)
    return {
        "send_offsets": np.concatenate([[0], np.cumsum(counts[me])]),
        "send_tokens": np.concatenate(send_tokens),
        "send_slots": np.concatenate(send_slots),
        "recv_offsets": recv_offsets,
        "row_offsets": np.asarray(row_offsets),
        "row_slot": np.asarray(row_slot, np.int64),
        "row_src_rank": row_src_arr,
        "row_combine_slot": np.asarray(row_combine, np.int64),
        "return_counts": np.bincount(row_src_arr, minlength=world).astype(np.int64),
        "expert_source_offsets": eso,
    }


def _plans(r: Routing, tuning: str = "") -> list[dict[str, np.ndarray]]:
    topk = r.topk()
    return [_C.build_rank_plan(topk, r.experts, rank, tuning) for rank in range(r.world_size)]


@pytest.mark.parametrize("r", ROUTINGS, ids=lambda r: r.name)
def test_compute_layout_matches_numpy(r: Routing) -> None:
    for idx in r.topk():
        got = _C.compute_layout(idx, r.experts, r.world_size)
        want = np_layout(idx, r.experts, r.world_size)
        for name, value in zip(
            ("tokens_per_rank", "tokens_per_expert", "token_in_rank"), got, strict=True
        ):
            assert value.dtype == want[name].dtype, name
            np.testing.assert_array_equal(value, want[name], err_msg=name)


@pytest.mark.parametrize("r", ROUTINGS, ids=lambda r: r.name)
def test_rank_plan_matches_definition(r: Routing) -> None:
    topk = r.topk()
    for rank, plan in enumerate(_plans(r)):
        want = np_rank_plan(topk, r.experts, rank)
        for name, value in want.items():
            got = np.asarray(plan[name])
            assert got.dtype == np.int64, name
            np.testing.assert_array_equal(
                got.reshape(value.shape), value, err_msg=f"rank {rank}: {name}"
            )


@pytest.mark.parametrize("r", ROUTINGS, ids=lambda r: r.name)
def test_rank_plan_invariants(r: Routing) -> None:
    topk = r.topk()
    plans = _plans(r)
    world, top_k = r.world_size, r.top_k
    per = r.experts // world
    for me, plan in enumerate(plans):
        so, st = plan["send_offsets"], plan["send_tokens"]
        for d in range(world):
            sent = st[so[d] : so[d + 1]]
            assert len(np.unique(sent)) == len(sent), f"rank {me} sends a token twice to {d}"
            assert (np.diff(sent) > 0).all(), "send_tokens must ascend per destination"
            # What I send to d lands exactly in the slot range d reserves for me.
            recv = plans[d]["recv_offsets"]
            np.testing.assert_array_equal(
                np.sort(plan["send_slots"][so[d] : so[d + 1]]), np.arange(recv[me], recv[me + 1])
            )
        ro, rows = plan["row_offsets"], plan["row_slot"]
        assert ro[-1] == len(rows) == plan["return_counts"].sum()
        eso = np.asarray(plan["expert_source_offsets"]).reshape(per, world + 1)
        for e in range(per):
            assert (np.diff(rows[ro[e] : ro[e + 1]]) >= 0).all(), "rows of an expert in slot order"
            assert eso[e, 0] == ro[e] and eso[e, world] == ro[e + 1]
            for s in range(world):
                src = plan["row_src_rank"][eso[e, s] : eso[e, s + 1]]
                assert (src == s).all(), f"expert {e}: source range {s} holds other sources"
    # Every used (token, k) of a source rank comes back exactly once, from the expert's rank.
    for s in range(world):
        combine = np.concatenate([p["row_combine_slot"][p["row_src_rank"] == s] for p in plans])
        used = np.flatnonzero(topk[s].reshape(-1) >= 0)
        assert len(np.unique(combine)) == len(combine), f"source {s}: combine slot twice"
        np.testing.assert_array_equal(np.sort(combine), used)
        assert sum(p["return_counts"][s] for p in plans) == len(used)
        assert (combine // top_k < r.tokens[s]).all()


def _check_tiles(plan: dict[str, np.ndarray], world: int, per: int, tile_m: int) -> np.ndarray:
    tiles = np.asarray(plan["tiles"]).reshape(-1, 4)
    rows = len(plan["row_slot"])
    eso = np.asarray(plan["expert_source_offsets"]).reshape(per, world + 1)
    cover = np.zeros(rows, np.int64)
    for e, begin, end, src in tiles:
        assert 0 <= e < per and 0 <= src < world
        assert 0 < end - begin <= tile_m, f"tile {(e, begin, end, src)} size"
        assert eso[e, src] <= begin and end <= eso[e, src + 1], "tile straddles a source/expert"
        assert (plan["row_src_rank"][begin:end] == src).all()
        cover[begin:end] += 1
    np.testing.assert_array_equal(cover, np.ones(rows, np.int64), err_msg="rows covered once")
    return tiles


@pytest.mark.parametrize("r", ROUTINGS, ids=lambda r: r.name)
def test_sender_rows_are_the_receivers_rows(r: Routing) -> None:
    """The MegaKernel's sender-side gather: each (token, k) computes its GEMM row on the
    destination from its own routing and the counts, and it is the row the receiver's plan has."""
    topk = r.topk()
    plans = _plans(r)
    el = r.experts // r.world_size
    covered = [np.zeros(len(p["row_slot"]), dtype=np.int64) for p in plans]
    for src, plan in enumerate(plans):
        dest, row = plan["send_gemm_rank"], plan["send_gemm_row"]
        idx = topk[src]
        assert dest.shape == row.shape == idx.shape
        np.testing.assert_array_equal(dest < 0, idx < 0)
        np.testing.assert_array_equal(row < 0, idx < 0)
        for t, k in zip(*np.nonzero(idx >= 0), strict=True):
            d, g = int(dest[t, k]), int(idx[t, k])
            assert d == g // el
            there = plans[d]
            i = int(row[t, k])
            lo, hi = there["row_offsets"][g - d * el], there["row_offsets"][g - d * el + 1]
            assert lo <= i < hi, "the row lies in the destination expert's rows"
            assert there["row_src_rank"][i] == src
            assert there["row_combine_slot"][i] == t * r.top_k + k
            covered[d][i] += 1
    for c in covered:
        assert (c == 1).all(), "every GEMM row is written by exactly one sender entry"


@pytest.mark.parametrize("r", ROUTINGS, ids=lambda r: r.name)
@pytest.mark.parametrize("tile_m", [16, 64])
def test_schedule_tiles_cover_rows_in_mode_order(r: Routing, tile_m: int) -> None:
    world, per = r.world_size, r.experts // r.world_size
    seq_plans = _plans(r, f"overlap=sequential,tile_m={tile_m}")
    fused_plans = _plans(r, f"overlap=fused,tile_m={tile_m}")
    for me, (seq, fused) in enumerate(zip(seq_plans, fused_plans, strict=True)):
        t_seq = _check_tiles(seq, world, per, tile_m)
        t_fused = _check_tiles(fused, world, per, tile_m)
        # sequential walks expert-major after everything arrived ...
        order = [(e, b) for e, b, _, _ in t_seq]
        assert order == sorted(order), f"rank {me}: sequential tiles not expert-major"
        # ... fused in expected arrival order: own rank first, then rank + 1, ...
        arrival = (t_fused[:, 3] - me) % world
        assert (np.diff(arrival) >= 0).all(), f"rank {me}: fused tiles not in arrival order"
        # Same rows either way: a schedule never changes what is computed.
        rows_seq = sorted((e, x) for e, b0, b1, _ in t_seq for x in range(b0, b1))
        rows_fused = sorted((e, x) for e, b0, b1, _ in t_fused for x in range(b0, b1))
        assert rows_seq == rows_fused


def test_schedule_order_differs_between_sequential_and_fused() -> None:
    r = Routing("w2-dense", (40, 40), 4, 4, 10, unused=0.0)
    for me in range(r.world_size):
        seq = np.asarray(_plans(r, "overlap=sequential,tile_m=16")[me]["tiles"]).reshape(-1, 4)
        fused = np.asarray(_plans(r, "overlap=fused,tile_m=16")[me]["tiles"]).reshape(-1, 4)
        assert not np.array_equal(seq, fused), f"rank {me}: same tile order in both modes"
        np.testing.assert_array_equal(
            np.unique(seq, axis=0), np.unique(fused, axis=0), err_msg="different tiles"
        )


def test_plan_does_not_depend_on_tuning_except_tiles() -> None:
    r = ROUTINGS[4]
    base = _plans(r, "")
    other = _plans(r, "sms=8/132,token_tile=16,tile_m=32,tile_n=64,tile_k=32,overlap=chunked")
    for a, b in zip(base, other, strict=True):
        for name in a:
            if name != "tiles":
                np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_compute_layout_rejects_bad_expert_ids() -> None:
    idx = np.array([[0, 1], [2, 8]], np.int64)
    with pytest.raises(ValueError, match="topk_idx"):
        _C.compute_layout(idx, 8, 2)
    idx[1, 1] = -2
    with pytest.raises(ValueError, match="topk_idx"):
        _C.compute_layout(idx, 8, 2)


def test_compute_layout_rejects_indivisible_experts() -> None:
    with pytest.raises(ValueError, match="num_experts"):
        _C.compute_layout(np.zeros((3, 2), np.int64), 8, 3)


def test_build_rank_plan_rejects_bad_rank() -> None:
    topk = Routing("w2", (4, 4), 4, 2, 11).topk()
    with pytest.raises(ValueError, match="rank"):
        _C.build_rank_plan(topk, 4, 2, "")
