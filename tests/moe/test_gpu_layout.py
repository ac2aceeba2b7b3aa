"""CUDA routing_layout (cpp/cuda/dispatch/layout.cu) against the CPU op: identical bits.

The CPU op is the planner every executor trusts, so the CUDA kernel must agree with it exactly on
every routing: random with unused (-1) slots, repeated experts within a token, everything on one
expert, no tokens at all, top-k 1..8, expert counts 8..288, world sizes 1..8, and token counts
that do and do not fill the kernel's 128-token blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import uniep

# Independent of conftest: these tests must never run (and fail) on a host without CUDA.
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, requires_cuda]

EXPERTS = [8, 64, 256, 288]
WORLDS = [1, 2, 4, 8]
ROUTINGS = ["random", "repeats", "one_expert", "same_expert", "all_unused"]


def make_routing(kind: str, tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """A [tokens, top_k] int64 CPU routing of the given kind."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        # Distinct experts per token (as a router's top-k gives), a quarter of the slots unused.
        idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
        idx[torch.rand(tokens, top_k, generator=gen) < 0.25] = -1
    elif kind == "repeats":
        # Any id in [-1, E) in any slot: an expert may appear twice in one token.
        idx = torch.randint(-1, experts, (tokens, top_k), generator=gen)
    elif kind == "one_expert":
        # Every token sends slot 0 to the last expert, the other slots are unused.
        idx = torch.full((tokens, top_k), -1, dtype=torch.int64)
        idx[:, 0] = experts - 1
    elif kind == "same_expert":
        idx = torch.full((tokens, top_k), experts // 2, dtype=torch.int64)
    elif kind == "all_unused":
        idx = torch.full((tokens, top_k), -1, dtype=torch.int64)
    else:
        raise ValueError(f"unknown routing kind {kind!r}")
    return idx.to(torch.int64).contiguous()


def assert_same_as_cpu(idx: torch.Tensor, experts: int, world: int) -> None:
    want = torch.ops.uniep.routing_layout(idx, experts, world)
    got = torch.ops.uniep.routing_layout(idx.cuda(), experts, world)
    names = ("tokens_per_rank", "tokens_per_expert", "token_in_rank")
    for name, g, w in zip(names, got, want, strict=True):
        assert g.is_cuda, f"{name} is on {g.device}, not CUDA"
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.dtype}{tuple(g.shape)}"
        assert torch.equal(g.cpu(), w), f"{name} differs from the CPU op"
    # The definition, checked independently of both implementations.
    tokens_per_rank, tokens_per_expert, token_in_rank = want
    assert int(tokens_per_expert.sum()) == int((idx >= 0).sum())
    assert torch.equal(tokens_per_rank, token_in_rank.sum(dim=0))


def test_cuda_ops_were_built() -> None:
    """On a CUDA machine the build must have registered the CUDA implementations."""
    info = uniep.build_info()
    assert info["cuda_kernels"] and info["cuda_ops"], info


@pytest.mark.parametrize("top_k", range(1, 9))
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("experts", EXPERTS)
def test_random_routing_matches_cpu(experts: int, world: int, top_k: int) -> None:
    # 300 tokens: two full 128-token blocks and a partial one.
    idx = make_routing("random", 300, experts, top_k, seed=experts * 100 + world * 10 + top_k)
    assert_same_as_cpu(idx, experts, world)


@pytest.mark.parametrize("tokens", [0, 1, 127, 128, 129, 4096])
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize(("experts", "world"), [(8, 8), (64, 2), (256, 4), (288, 8)])
def test_routing_kinds_match_cpu(experts: int, world: int, kind: str, tokens: int) -> None:
    idx = make_routing(kind, tokens, experts, top_k=8, seed=tokens + experts)
    assert_same_as_cpu(idx, experts, world)


def test_histogram_in_global_memory_matches_cpu() -> None:
    # 8192 experts do not fit the kernel's shared-memory histogram: the global-atomic path.
    idx = make_routing("repeats", 1000, 8192, top_k=8, seed=7)
    assert_same_as_cpu(idx, 8192, 4)


def test_repeatable() -> None:
    idx = make_routing("repeats", 4096, 256, 8, seed=3).cuda()
    first = torch.ops.uniep.routing_layout(idx, 256, 4)
    for _ in range(3):
        again = torch.ops.uniep.routing_layout(idx, 256, 4)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_outputs_are_overwritten_not_accumulated() -> None:
    """The caching allocator hands back dirty memory; counts must not start from it."""
    idx = make_routing("random", 500, 64, 4, seed=11)
    # Blocks of the outputs' sizes (rounded to 512 bytes), poisoned and handed back to the cache,
    # which gives them to the op's outputs next.
    poison = [
        torch.full((n,), 0x5A, dtype=torch.uint8, device="cuda") for n in (512,) * 4 + (2048,) * 2
    ]
    torch.cuda.synchronize()
    del poison
    assert_same_as_cpu(idx, 64, 4)


def test_current_stream_is_used() -> None:
    idx = make_routing("random", 777, 288, 8, seed=5)
    want = torch.ops.uniep.routing_layout(idx, 288, 8)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # Asynchronous on `stream`: an op that ran on another stream could read it half-copied.
        idx_cuda = idx.pin_memory().cuda(non_blocking=True)
        got = torch.ops.uniep.routing_layout(idx_cuda, 288, 8)
    stream.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


def test_cuda_graph_capture_and_replay() -> None:
    """Under capture the op must not synchronize; a replay sees the new routing."""
    experts, world = 256, 4
    first = make_routing("random", 256, experts, 8, seed=1)
    second = make_routing("repeats", 256, experts, 8, seed=2)
    static_idx = first.cuda()
    torch.ops.uniep.routing_layout(static_idx, experts, world)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.uniep.routing_layout(static_idx, experts, world)
    for idx in (first, second):
        static_idx.copy_(idx)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.ops.uniep.routing_layout(idx, experts, world)
        assert all(torch.equal(o.cpu(), w) for o, w in zip(out, want, strict=True))


@pytest.mark.parametrize(("bad", "where"), [(288, (5, 1)), (-2, (0, 7)), (10**12, (299, 0))])
def test_bad_expert_id_raises_like_cpu(bad: int, where: tuple[int, int]) -> None:
    experts, world = 288, 8
    idx = make_routing("random", 300, experts, 8, seed=9)
    idx[where] = bad
    # A second bad id later in row-major order: the first one must be the one reported.
    idx[-1, -1] = experts + 1 if where != (299, 0) else -5
    with pytest.raises(ValueError) as cpu_error:
        torch.ops.uniep.routing_layout(idx, experts, world)
    with pytest.raises(ValueError) as cuda_error:
        torch.ops.uniep.routing_layout(idx.cuda(), experts, world)
    pattern = rf"topk_idx contains expert id {bad} at \[{where[0]}, {where[1]}\], outside \[-1, "
    assert re.search(pattern, str(cpu_error.value)), str(cpu_error.value)
    assert re.search(pattern, str(cuda_error.value)), str(cuda_error.value)
    # The op still works afterwards: the error is a host exception, not a lost CUDA context.
    assert_same_as_cpu(make_routing("random", 10, experts, 8, seed=0), experts, world)


@pytest.mark.parametrize(
    ("make", "experts", "world", "name"),
    [
        (lambda: torch.zeros(4, 2, dtype=torch.int32, device="cuda"), 8, 2, "topk_idx"),
        (lambda: torch.zeros(4, dtype=torch.int64, device="cuda"), 8, 2, "topk_idx"),
        (lambda: torch.zeros(4, 0, dtype=torch.int64, device="cuda"), 8, 2, "topk_idx"),
        (lambda: torch.zeros(2, 4, dtype=torch.int64, device="cuda").t(), 8, 2, "topk_idx"),
        (lambda: torch.zeros(4, 2, dtype=torch.int64, device="cuda"), 8, 3, "num_experts"),
        (lambda: torch.zeros(4, 2, dtype=torch.int64, device="cuda"), 8, 0, "world_size"),
        (lambda: torch.zeros(4, 2, dtype=torch.int64, device="cuda"), 8, -4, "world_size"),
        (lambda: torch.zeros(4, 2, dtype=torch.int64, device="cuda"), 0, 1, "num_experts"),
    ],
    ids=[
        "int32",
        "1-D",
        "no-columns",
        "non-contiguous",
        "indivisible",
        "world-0",
        "world-neg",
        "experts-0",
    ],
)
def test_bad_argument_is_named(
    make: Callable[[], torch.Tensor], experts: int, world: int, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        torch.ops.uniep.routing_layout(make(), experts, world)


def test_opcheck_cuda() -> None:
    idx = make_routing("random", 40, 16, 4, seed=4).cuda()
    torch.library.opcheck(torch.ops.uniep.routing_layout.default, (idx, 16, 4))
