"""The collective schedules as pure plans (uniep._C, no process group).

Every kind, both peer orders, W = 1..8 and 1..4 chunks per rank: the C++ validator accepts them,
and the properties the executors rely on are re-derived here independently in Python (matching,
every chunk computed once, the tail-free placement of the local chunk, ring neighbours, the fixed
reduction order). Broken schedules must be rejected with a message naming the violation.
"""

from __future__ import annotations

from collections import Counter

import pytest
from uniep import _C, collectives

KINDS = collectives.KINDS
ORDERS = ("direct", "ring")
WORLDS = range(1, 9)
CHUNKS = range(1, 5)


def _world(kind: str, world: int, chunks: int, order: str) -> list[_C.CollectiveSchedule]:
    return [collectives.schedule(kind, world, r, chunks, order) for r in range(world)]


def _pairs(transfers: list[_C.Transfer]) -> list[tuple[int, int]]:
    return [(t.peer, t.chunk) for t in transfers]


def _own(s: _C.CollectiveSchedule, chunk: int) -> bool:
    block = s.chunk_block(chunk)
    if s.kind == "all_to_all_ulysses":
        return block // s.world_size == s.rank
    return block == s.rank


def _check_matching(ranks: list[_C.CollectiveSchedule]) -> None:
    sent, received = Counter(), Counter()
    for s in ranks:
        for t, st in enumerate(s.steps):
            sent.update((t, s.rank, p, c) for p, c in _pairs(st.sends))
            received.update((t, p, s.rank, c) for p, c in _pairs(st.recvs))
    assert sent == received
    assert all(n == 1 for n in sent.values()), "a chunk crosses one link twice in a step"
    steps = {len(s.steps) for s in ranks}
    assert len(steps) == 1, "ranks disagree on the number of steps"
    for t in range(steps.pop()):
        assert len({s.steps[t].has_transfers() for s in ranks}) == 1, f"step {t} not lockstep"


def _check_ring(ranks: list[_C.CollectiveSchedule]) -> None:
    world = len(ranks)
    for s in ranks:
        for st in s.steps:
            assert all(p == (s.rank + 1) % world for p, _ in _pairs(st.sends))
            assert all(p == (s.rank - 1) % world for p, _ in _pairs(st.recvs))


def _check_gather(ranks: list[_C.CollectiveSchedule]) -> None:
    """AG-GEMM / all-to-all: local chunk first, each GEMM reads an arrival of an earlier step,
    and nothing is issued by the last step (nothing in flight once the last GEMM starts)."""
    for s in ranks:
        arrived = {}
        for t, st in enumerate(s.steps):
            for _, c in _pairs(st.sends):
                assert _own(s, c) or arrived[c][0] < t, f"rank {s.rank} forwards {c} early"
            if st.compute >= 0:
                c = st.compute
                if _own(s, c):
                    assert _pairs(st.input_waits) == []
                else:
                    step, peer = arrived[c]
                    assert step < t, f"rank {s.rank} step {t}: GEMM waits on a same-step transfer"
                    assert _pairs(st.input_waits) == [(peer, c)]
            for p, c in _pairs(st.recvs):
                assert c not in arrived and not _own(s, c)
                arrived[c] = (t, p)
        computes = [st.compute for st in s.steps]
        if s.kind == "all_gather":
            assert computes == [-1] * len(s.steps)
            assert len(arrived) == (s.world_size - 1) * s.chunks_per_rank
            continue
        expected = set(range(s.num_chunks))
        if s.kind == "all_to_all_ulysses":
            expected = {c for c in expected if s.chunk_block(c) % s.world_size == s.rank}
        assert sorted(computes) == sorted(expected), "every chunk computed exactly once"
        assert _own(s, computes[0]), "the first GEMM is on the local chunk"
        assert not s.steps[-1].has_transfers(), "the last step must not issue transfers"


def _check_reduce(ranks: list[_C.CollectiveSchedule]) -> None:
    """GEMM-RS: own rows last; simulate which contributions reach each output chunk."""
    world, c = ranks[0].world_size, ranks[0].chunks_per_rank
    ring = ranks[0].order == "ring"
    result: list[dict[int, list[int]]] = [{} for _ in ranks]
    arrivals: list[dict[tuple[int, int], tuple[int, list[int]]]] = [{} for _ in ranks]
    for t in range(world * c):
        inbox = {}
        for s in ranks:
            for p, u in _pairs(s.steps[t].sends):
                assert u in result[s.rank], "a result is sent one step after its GEMM at least"
                assert ring or p == s.chunk_block(u), "direct partials go to their destination"
                inbox[(p, s.rank, u)] = result[s.rank][u]
        for s in ranks:
            for p, u in _pairs(s.steps[t].recvs):
                arrivals[s.rank][(p, u)] = (t, inbox[(s.rank, p, u)])
        for s in ranks:
            st = s.steps[t]
            contents = []
            for p, u in _pairs(st.fold_waits):
                assert u == st.compute
                step, payload = arrivals[s.rank].pop((p, u))
                assert step <= t
                contents += payload
            result[s.rank][st.compute] = contents + [s.rank]
    for s in ranks:
        assert not arrivals[s.rank], "every arrival is folded by the last step"
        assert sorted(result[s.rank]) == list(range(world * c))
        assert s.chunk_block(s.steps[-1].compute) == s.rank, "own rows are computed last"
        for j in range(c):
            got = result[s.rank][s.chunk_id(s.rank, j)]
            assert got == collectives.reduce_order(world, s.rank)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_schedules_valid_for_every_world_and_chunking(kind: str, order: str) -> None:
    for world in WORLDS:
        for chunks in CHUNKS:
            ranks = _world(kind, world, chunks, order)
            collectives.validate_schedules(ranks)
            _check_matching(ranks)
            if order == "ring":
                _check_ring(ranks)
            if kind in ("matmul_reduce_scatter", "reduce_scatter"):
                _check_reduce(ranks)
            else:
                _check_gather(ranks)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_step_counts(kind: str, order: str) -> None:
    for world in WORLDS:
        for chunks in CHUNKS:
            s = collectives.schedule(kind, world, world - 1, chunks, order)
            want = (world - 1) * chunks if kind == "all_gather" else world * chunks
            assert len(s.steps) == want
            assert s.num_chunks == world * chunks * (world if "all_to_all" in kind else 1)
            transfers = sum(len(st.sends) for st in s.steps)
            if kind == "all_to_all_ulysses" and order == "ring":
                # Each block travels its distance hop by hop: W(W-1)/2 hops per part.
                assert transfers == world * (world - 1) // 2 * chunks
            else:
                assert transfers == (world - 1) * chunks


def test_pinned_direct_plans() -> None:
    """The exact orders the CUDA executor is written against (W=4, rank 1, one chunk)."""
    ag = collectives.schedule("all_gather_matmul", 4, 1, 1, "direct")
    assert [st.compute for st in ag.steps] == [1, 2, 3, 0]
    assert [_pairs(st.sends) for st in ag.steps] == [[(0, 1)], [(3, 1)], [(2, 1)], []]
    assert [_pairs(st.recvs) for st in ag.steps] == [[(2, 2)], [(3, 3)], [(0, 0)], []]
    assert [_pairs(st.input_waits) for st in ag.steps] == [[], [(2, 2)], [(3, 3)], [(0, 0)]]

    rs = collectives.schedule("matmul_reduce_scatter", 4, 1, 1, "direct")
    assert [st.compute for st in rs.steps] == [0, 3, 2, 1]
    assert [_pairs(st.sends) for st in rs.steps] == [[], [(0, 0)], [(3, 3)], [(2, 2)]]
    assert [_pairs(st.recvs) for st in rs.steps] == [[], [(2, 1)], [(3, 1)], [(0, 1)]]
    assert _pairs(rs.steps[-1].fold_waits) == [(2, 1), (3, 1), (0, 1)]
    assert collectives.reduce_order(4, 1) == [2, 3, 0, 1]


def test_pinned_ring_plans() -> None:
    ag = collectives.schedule("all_gather_matmul", 4, 1, 2, "ring")
    # Local parts first, then the blocks of ranks 0, 3, 2, each forwarded to rank 2 as it is used.
    assert [st.compute for st in ag.steps] == [2, 3, 0, 1, 6, 7, 4, 5]
    assert [_pairs(st.sends) for st in ag.steps[:6]] == [[(2, c)] for c in (2, 3, 0, 1, 6, 7)]
    assert not ag.steps[6].has_transfers() and not ag.steps[7].has_transfers()

    rs = collectives.schedule("reduce_scatter", 3, 0, 1, "ring")
    assert [st.compute for st in rs.steps] == [2, 1, 0]
    assert [_pairs(st.sends) for st in rs.steps] == [[], [(1, 2)], [(1, 1)]]
    assert [_pairs(st.fold_waits) for st in rs.steps] == [[], [(2, 1)], [(2, 0)]]


# ---- the validator rejects broken plans ----


def _mutated(kind: str, order: str, edit, all_ranks: bool) -> list:
    """W=4, 2 chunks: `edit` applied to rank 1's steps, or to every rank's."""
    ranks = _world(kind, 4, 2, order)
    for s in ranks if all_ranks else ranks[1:2]:
        steps = s.steps
        edit(steps)
        s.steps = steps
    return ranks


def _drop_recv(steps: list) -> None:
    for st in steps:
        if st.recvs:
            st.recvs = st.recvs[1:]
            return


def _swap_first_and_last(steps: list) -> None:
    # Local chunk last: the head GEMM would wait for data.
    first, last = steps[0], steps[-1]
    first.compute, last.compute = last.compute, first.compute
    first.input_waits, last.input_waits = last.input_waits, first.input_waits


def _duplicate_compute(steps: list) -> None:
    steps[1].compute = steps[0].compute


def _reverse_folds(steps: list) -> None:
    st = steps[-1]
    st.fold_waits = list(reversed(st.fold_waits))


def _own_rows_first(steps: list) -> None:
    steps[0].compute, steps[-1].compute = steps[-1].compute, steps[0].compute
    steps[0].fold_waits, steps[-1].fold_waits = steps[-1].fold_waits, steps[0].fold_waits


def _send_to_far_peer(steps: list) -> None:
    for st in steps:
        if st.sends:
            st.sends = [_C.Transfer((st.sends[0].peer + 1) % 4, st.sends[0].chunk)]
            return


def _append_idle_step(steps: list) -> None:
    # A step without a GEMM: whatever it transfers is exposed.
    steps.append(_C.ChunkStep())


def _wait_on_wrong_peer(steps: list) -> None:
    for st in steps:
        if st.input_waits:
            w = st.input_waits[0]
            st.input_waits = [_C.Transfer((w.peer + 1) % 4, w.chunk)]
            return


BROKEN = [
    ("unmatched-send", "all_gather_matmul", "direct", _drop_recv, False, "no matching"),
    ("local-chunk-last", "all_gather_matmul", "direct", _swap_first_and_last, False, "arrived"),
    ("compute-twice", "all_gather_matmul", "ring", _duplicate_compute, False, "second time"),
    ("fold-order", "matmul_reduce_scatter", "direct", _reverse_folds, False, "reduce_order"),
    ("own-rows-first", "matmul_reduce_scatter", "ring", _own_rows_first, True, "before"),
    ("ring-far-peer", "all_gather", "ring", _send_to_far_peer, False, "neighbour"),
    ("idle-step-gather", "all_to_all_ulysses", "direct", _append_idle_step, True, "exposed"),
    ("idle-step-reduce", "reduce_scatter", "ring", _append_idle_step, True, "exposed"),
    ("not-lockstep", "all_gather_matmul", "ring", _append_idle_step, False, "steps"),
    ("wrong-signal", "all_gather_matmul", "direct", _wait_on_wrong_peer, False, "input_waits"),
]


@pytest.mark.parametrize(
    ("kind", "order", "edit", "all_ranks", "words"),
    [b[1:] for b in BROKEN],
    ids=[b[0] for b in BROKEN],
)
def test_validator_rejects(kind: str, order: str, edit, all_ranks: bool, words: str) -> None:
    ranks = _mutated(kind, order, edit, all_ranks)
    with pytest.raises(RuntimeError, match=words):
        collectives.validate_schedules(ranks)


def test_validator_needs_every_rank() -> None:
    ranks = _world("all_gather", 4, 1, "direct")
    with pytest.raises(RuntimeError, match="one schedule per rank"):
        collectives.validate_schedules(ranks[:3])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("all_gather", 0, 0, 1, "direct"), "world_size"),
        (("all_gather", 4, 4, 1, "direct"), "rank"),
        (("all_gather", 4, -1, 1, "direct"), "rank"),
        (("all_gather", 4, 0, 0, "direct"), "chunks"),
        (("all_gather", 4, 0, 1, "tree"), "order"),
        (("all_reduce", 4, 0, 1, "direct"), "kind"),
    ],
)
def test_bad_schedule_arguments(args: tuple, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        collectives.schedule(*args)
