"""torch.ops.uniep.expert_rows: the grouped-GEMM row lists of received slots.

The CPU op (the planner, uniep::plan_experts) is checked against the definition written out here
in plain Python; the CUDA op (the dispatch's own row-list kernels) must give the CPU op's bits on
every routing: skewed, with unused (-1) and repeated ids, empty source ranks, no slots, top-k up
to 31, slot counts off the kernels' 32-slot units, and up to thousands of local experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import uniep  # noqa: F401  (registers the ops)

ERRORS = (ValueError, RuntimeError, TypeError)
Received = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def received(
    tokens: list[int], top_k: int, experts: int, rank: int, kind: str, seed: int
) -> Received:
    """What rank `rank` receives when each source s dispatches tokens[s] tokens: the slots of the
    tokens that chose one of its experts, ordered by (source, token), with their full top-k."""
    world = len(tokens)
    per_rank = experts // world
    gen = torch.Generator().manual_seed(seed)
    srcs, ids, counts = [], [], []
    for t in tokens:
        if kind == "random":
            idx = torch.rand(t, experts, generator=gen).argsort(dim=1)[:, :top_k]
            idx[torch.rand(t, top_k, generator=gen) < 0.2] = -1
        elif kind == "repeats":
            idx = torch.randint(-1, experts, (t, top_k), generator=gen)
        elif kind == "skew":
            # Most choices land on the first expert of this rank.
            idx = torch.randint(0, experts, (t, top_k), generator=gen)
            idx[torch.rand(t, top_k, generator=gen) < 0.7] = rank * per_rank
        else:
            raise ValueError(kind)
        local = (idx >= rank * per_rank) & (idx < (rank + 1) * per_rank)
        keep = local.any(dim=1)
        srcs.append(torch.arange(t)[keep])
        ids.append(idx[keep])
        counts.append(int(keep.sum()))
    return (
        torch.cat(srcs).to(torch.int64),
        torch.cat(ids).reshape(-1, top_k).to(torch.int64).contiguous(),
        torch.tensor(counts, dtype=torch.int64),
    )


def definition(
    recv: Received, rank: int, experts: int, max_tokens: int
) -> tuple[list[int], list[int], list[int]]:
    src, ids, from_rank = recv
    world, top_k = from_rank.numel(), ids.shape[1]
    per_rank = experts // world
    source = torch.repeat_interleave(torch.arange(world), from_rank).tolist()
    ids_l, src_l = ids.tolist(), src.tolist()
    row_slot, row_target, per_expert = [], [], []
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        before = len(row_slot)
        for slot, row in enumerate(ids_l):
            for k, g in enumerate(row):
                if g == e:
                    row_slot.append(slot)
                    row_target.append(source[slot] * max_tokens * top_k + src_l[slot] * top_k + k)
        per_expert.append(len(row_slot) - before)
    return row_slot, row_target, per_expert


def expert_rows(recv: Received, rank: int, experts: int, max_tokens: int) -> Received:
    return torch.ops.uniep.expert_rows(*recv, rank, experts, max_tokens)


# (tokens per source, top_k, experts, rank, kind)
CPU_CASES = [
    ([12, 9], 2, 8, 0, "random"),
    ([12, 9], 2, 8, 1, "repeats"),
    ([40, 0, 33], 4, 12, 2, "skew"),
    ([0, 0], 3, 6, 1, "random"),
    ([7], 1, 5, 0, "random"),
    ([20, 20, 20, 20], 8, 32, 3, "repeats"),
]


@pytest.mark.parametrize("tokens,top_k,experts,rank,kind", CPU_CASES)
def test_cpu_op_follows_the_definition(
    tokens: list[int], top_k: int, experts: int, rank: int, kind: str
) -> None:
    max_tokens = max(tokens + [1])
    recv = received(tokens, top_k, experts, rank, kind, seed=len(tokens) * 7 + top_k)
    row_slot, row_target, per_expert = expert_rows(recv, rank, experts, max_tokens)
    want = definition(recv, rank, experts, max_tokens)
    assert row_slot.tolist() == want[0]
    assert row_target.tolist() == want[1]
    assert per_expert.tolist() == want[2]


def test_fake_kernel_and_schema() -> None:
    recv = received([16, 11], 4, 8, 1, "random", seed=3)
    torch.library.opcheck(torch.ops.uniep.expert_rows.default, (*recv, 1, 8, 16))


def _call(**changes: object) -> Callable[[], object]:
    recv = received([10, 6], 2, 4, 0, "random", seed=1)
    args = {"src": recv[0], "ids": recv[1], "from_rank": recv[2], "rank": 0, "experts": 4}
    args.update(changes)
    args.setdefault("max_tokens", 10)
    return lambda: torch.ops.uniep.expert_rows(
        args["src"],
        args["ids"],
        args["from_rank"],
        args["rank"],
        args["experts"],
        args["max_tokens"],
    )


def _with(tensor_index: int, index: tuple[int, ...], value: int) -> torch.Tensor:
    t = received([10, 6], 2, 4, 0, "random", seed=1)[tensor_index].clone()
    t[index] = value
    return t


def _slots() -> int:
    return received([10, 6], 2, 4, 0, "random", seed=1)[0].numel()


# (id, call, what the message must say)
ERROR_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("src-int32", _call(src=torch.zeros(_slots(), dtype=torch.int32)), "recv_src must be int64"),
    ("src-2d", _call(src=torch.zeros(_slots(), 1, dtype=torch.int64)), "recv_src must be 1-D"),
    ("ids-rows", _call(ids=torch.zeros(3, 2, dtype=torch.int64)), "recv_topk_idx must be [N, K]"),
    (
        "from-2d",
        _call(from_rank=torch.zeros(2, 1, dtype=torch.int64)),
        "recv_from_rank must be 1-D",
    ),
    ("rank", _call(rank=2), "rank must be in [0, 2)"),
    ("experts", _call(experts=5), "num_experts (5) must be a positive multiple"),
    ("max-tokens", _call(max_tokens=0), "max_tokens must be >= 1"),
    ("from-sum", _call(from_rank=torch.tensor([1, 1])), "recv_from_rank must sum to"),
    ("from-negative", _call(from_rank=torch.tensor([_slots() + 1, -1])), "no negative count"),
    ("src-range", _call(src=_with(0, (2,), 10)), "recv_src[2] = 10 is outside [0, 10)"),
    ("id-range", _call(ids=_with(1, (1, 1), 4)), "recv_topk_idx[1, 1] = 4 is outside [-1, 4)"),
    ("no-local", _call(ids=_with(1, (0,), 3)), "receive slot 0 names no expert of this rank"),
]


@pytest.mark.parametrize(
    "call,message", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_bad_input_is_named(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ERRORS, match=re.escape(message)):
        call()


# ---- CUDA: the dispatch's kernels against the CPU op ----

GPU_CASES = [
    ([4096, 4096], 8, 256, 0, "random"),  # DeepSeek-V3 at EP2
    ([4096, 4096, 4096, 4096], 8, 256, 3, "random"),  # and at EP4
    ([4096, 4096], 8, 256, 1, "skew"),
    ([333, 0, 517, 1], 6, 64, 2, "repeats"),
    ([1000], 8, 288, 0, "random"),  # every expert local
    ([100, 77], 31, 62, 1, "repeats"),  # top-k up to the runtime's limit
    ([0, 0], 4, 16, 0, "random"),
    ([5, 3], 2, 12000, 1, "random"),  # 6000 local experts: one unit per block
    ([31, 33, 64], 3, 9, 1, "skew"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens,top_k,experts,rank,kind", GPU_CASES)
def test_cuda_kernels_give_the_cpu_bits(
    tokens: list[int], top_k: int, experts: int, rank: int, kind: str
) -> None:
    max_tokens = max(tokens + [1])
    recv = received(tokens, top_k, experts, rank, kind, seed=sum(tokens) + top_k)
    want = expert_rows(recv, rank, experts, max_tokens)
    got = expert_rows(tuple(t.cuda() for t in recv), rank, experts, max_tokens)
    for name, g, w in zip(("row_slot", "row_target", "tokens_per_expert"), got, want, strict=True):
        assert g.is_cuda and g.dtype == torch.int64, name
        assert torch.equal(g.cpu(), w), f"{name} differs from the CPU op"
    again = expert_rows(tuple(t.cuda() for t in recv), rank, experts, max_tokens)
    assert all(torch.equal(a, g) for a, g in zip(again, got, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_names_bad_input_and_refuses_capture() -> None:
    recv = tuple(t.cuda() for t in received([10, 6], 2, 4, 0, "random", seed=1))
    bad = recv[1].clone()
    bad[1, 1] = 4
    with pytest.raises(ERRORS, match=re.escape("recv_topk_idx[1, 1] = 4 is outside [-1, 4)")):
        torch.ops.uniep.expert_rows(recv[0], bad, recv[2], 0, 4, 10)
    with pytest.raises(ERRORS, match="recv_from_rank must be a CUDA tensor"):
        torch.ops.uniep.expert_rows(recv[0], recv[1], recv[2].cpu(), 0, 4, 10)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), pytest.raises(ERRORS, match="cannot be captured"):
        with torch.cuda.graph(graph, stream=stream):
            torch.ops.uniep.expert_rows(*recv, 0, 4, 10)


# docs/api.md's conversion of ep_dispatch's local recv_topk_idx into expert_rows' global ids.
API_MD_CONVERSION = "torch.where(local >= 0, local + rank * (num_experts // W), -1)"


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_ep_dispatch_local_ids_converted_as_api_md_says(rank: int) -> None:
    """expert_rows takes global ids; ep_dispatch's recv_topk_idx holds local ones (-1 for the
    other ranks' experts, cpp/cuda/dispatch/dispatch.cu). docs/api.md says so and gives the
    conversion; converted, they give the rows of the full global top-k; unconverted they fail on
    every rank but 0."""
    from pathlib import Path

    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    entry = api[api.index("uniep::expert_rows(") :]
    entry = entry[: entry.index("```")]
    assert API_MD_CONVERSION in entry and "GLOBAL expert ids" in entry
    tokens, top_k, experts, world = [10, 7, 9], 3, 12, 3
    recv = received(tokens, top_k, experts, rank, "random", seed=40 + rank)
    src, ids, from_rank = recv
    first, per_rank = rank * (experts // world), experts // world
    mine = (ids >= first) & (ids < first + per_rank)
    local = torch.where(mine, ids - first, -1)  # what ep_dispatch returns
    converted = torch.where(local >= 0, local + rank * (experts // world), -1)  # the docs'
    want = expert_rows(recv, rank, experts, max(tokens))
    got = expert_rows((src, converted, from_rank), rank, experts, max(tokens))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    if rank > 0:
        with pytest.raises(ERRORS, match="names no expert of this rank"):
            expert_rows((src, local, from_rank), rank, experts, max(tokens))
