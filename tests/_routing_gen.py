"""Seeded random MoE problems for the property suites.

`draw_case(seed, world)` picks a shape and a routing kind from `seed` alone; `global_inputs(case)`
builds the whole problem (every rank's tokens, every expert's weights) from the case alone, so
each rank of a spawned group and the test process rebuild the same bits. `rank_inputs` slices a
rank's tokens and its experts out of it.

Shapes span what the runtime has to serve: top-k 1..16, 1..512 experts (a multiple of the world
size), 0..4096 tokens per rank with some ranks empty, hidden a multiple of 64 (half of them of
128, the fp8 block), float32 / bfloat16 / float64. The CPU executor is plain loops, so a case's
work (tokens x top-k x hidden x ffn) is capped: ffn, then hidden, then the token counts shrink
until it fits, which keeps thousands of tokens and hundreds of experts with a small hidden.

Routing kinds (every token's valid experts are distinct, as a router's top-k gives; -1 = unused):
  uniform       K distinct experts, uniformly; slots past E (when K > E) are -1
  zipf          K distinct experts drawn by a Zipf popularity over a random expert order
  one_expert    every token sends one slot (a random k) to the same expert, the others -1
  skew_to_rank  most choices on the experts of one rank (the others receive little or nothing)
  holes         uniform, then about 40% of the slots -1 and some tokens with no expert at all
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import torch
from _moe_cases import DTYPES, rank_slice

ROUTINGS = ("uniform", "zipf", "one_expert", "skew_to_rank", "holes")
MAX_TOKENS = 4096
MAX_EXPERTS = 512
MAX_TOP_K = 16
HIDDENS = (64, 128, 192, 256, 384, 512)
FFNS = (16, 32, 64, 96, 128)
# tokens x top_k x hidden x ffn of one case; about 15 ms per CPU-executor forward at the cap.
CPU_WORK_CAP = 1 << 24
# experts x hidden x ffn: the weights (w1 and w2 hold 3x this), 24 MiB in float64 at the cap.
WEIGHT_CAP = 1 << 20


@dataclass(frozen=True)
class RoutingCase:
    seed: int
    tokens: tuple[int, ...]  # tokens of each rank; len = world size
    hidden: int
    ffn: int  # I: w1 is [E, H, 2I]
    experts: int  # E, global, a multiple of the world size
    top_k: int
    routing: str
    dtype: str = "float32"
    # The world size the routing was drawn for (skew_to_rank favours one of its ranks' experts);
    # 0: this case's. Kept when the case moves to another world, so the problem stays the same.
    routing_world: int = 0

    @property
    def world_size(self) -> int:
        return len(self.tokens)

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world_size

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def work(self) -> int:
        return self.total_tokens * self.top_k * self.hidden * self.ffn

    @property
    def weight_size(self) -> int:
        return self.experts * self.hidden * self.ffn

    @property
    def name(self) -> str:
        tokens = "+".join(map(str, self.tokens))
        return (
            f"s{self.seed}-w{self.world_size}-{self.routing}-t{tokens}-h{self.hidden}"
            f"-i{self.ffn}-e{self.experts}-k{self.top_k}-{self.dtype}"
        )

    def token_range(self, rank: int) -> tuple[int, int]:
        begin = sum(self.tokens[:rank])
        return begin, begin + self.tokens[rank]

    def expert_range(self, rank: int) -> tuple[int, int]:
        return rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank

    def on_world(self, world: int) -> RoutingCase:
        """The same global problem (tokens, experts, routing, weights) split over `world` ranks:
        the tokens regrouped in order, so that the concatenated outputs are comparable."""
        total = self.total_tokens
        cuts = [total * r // world for r in range(world + 1)]
        tokens = tuple(cuts[r + 1] - cuts[r] for r in range(world))
        return replace(self, tokens=tokens, routing_world=self.routing_world or self.world_size)


def _tokens_of_rank(rng: random.Random, world: int) -> int:
    """Empty ranks often (never most of them at world 1), else a size class up to MAX_TOKENS."""
    if rng.random() < (0.05 if world == 1 else 0.2):
        return 0
    lo, hi = rng.choices([(1, 8), (9, 128), (129, 1024), (1025, MAX_TOKENS)], [25, 35, 25, 15])[0]
    return rng.randint(lo, hi)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _fit(case: RoutingCase, work_cap: int, shrink_shape: bool = True) -> RoutingCase:
    """Shrink ffn, then hidden (to multiples of 16 and 64; not with `shrink_shape` False) until
    the case's work is under `work_cap` and its weights under WEIGHT_CAP, then every rank's
    tokens in the same proportion (a non-empty rank keeps one) until its work is."""

    def big(c: RoutingCase) -> bool:
        return c.work > work_cap or c.weight_size > WEIGHT_CAP

    while shrink_shape and big(case) and case.ffn > 16:
        case = replace(case, ffn=max(16, case.ffn // 2 // 16 * 16))
    while shrink_shape and big(case) and case.hidden > 64:
        case = replace(case, hidden=max(64, case.hidden // 2 // 64 * 64))
    if case.work > work_cap:
        scale = work_cap / case.work
        case = replace(case, tokens=tuple(max(min(t, 1), int(t * scale)) for t in case.tokens))
    return case


def draw_case(
    seed: int,
    world: int,
    *,
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float64"),
    work_cap: int = CPU_WORK_CAP,
    hidden: int | None = None,
    ffn: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    max_tokens: int = MAX_TOKENS,
) -> RoutingCase:
    """A case over `world` ranks, every unfixed field drawn from `seed`. Fixing hidden, ffn,
    experts and top_k (and bounding the tokens per rank) draws cases that fit one GPU runtime."""
    rng = random.Random(seed * 7919 + world)
    tokens = tuple(min(max_tokens, _tokens_of_rank(rng, world)) for _ in range(world))
    if experts is None:
        experts = world * _log_uniform(rng, 1, MAX_EXPERTS // world)
    case = RoutingCase(
        seed=seed,
        tokens=tokens,
        hidden=hidden if hidden is not None else rng.choice(HIDDENS),
        ffn=ffn if ffn is not None else rng.choice(FFNS),
        experts=experts,
        top_k=top_k if top_k is not None else rng.choice([1, 2, 8, rng.randint(1, MAX_TOP_K)]),
        routing=rng.choice(ROUTINGS),
        dtype=rng.choice(dtypes),
    )
    # A fixed shape (a GPU runtime's) keeps its hidden and ffn: only the tokens may shrink.
    return _fit(case, work_cap, shrink_shape=hidden is None and ffn is None)


def draw_cases(count: int, worlds: tuple[int, ...], first_seed: int = 0, **fixed: object) -> list:
    """`count` cases, world sizes in turn; `fixed` as for draw_case."""
    return [
        draw_case(first_seed + i, worlds[i % len(worlds)], **fixed)  # type: ignore[arg-type]
        for i in range(count)
    ]


def _distinct_topk(scores: torch.Tensor, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Per row, the top_k experts of `scores` perturbed by Gumbel noise: a draw without
    replacement proportional to exp(scores). Slots beyond the expert count are -1, and the
    slots are shuffled so a -1 may sit at any k."""
    t, e = scores.shape
    gumbel = -torch.log(-torch.log(torch.rand(t, e, generator=gen, dtype=torch.float64)))
    picked = (scores + gumbel).topk(min(top_k, e), dim=1).indices
    if top_k > e:
        picked = torch.cat([picked, picked.new_full((t, top_k - e), -1)], dim=1)
        order = torch.rand(t, top_k, generator=gen).argsort(dim=1)
        picked = picked.gather(1, order)
    return picked


def make_routing(case: RoutingCase, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int64 global expert ids (-1 unused) of every rank's tokens, in rank order."""
    t, e, k = case.total_tokens, case.experts, case.top_k
    if t == 0:
        return torch.empty(0, k, dtype=torch.int64)
    flat = torch.zeros(t, e, dtype=torch.float64)
    if case.routing in ("uniform", "holes"):
        idx = _distinct_topk(flat, k, gen)
        if case.routing == "holes":
            idx[torch.rand(t, k, generator=gen) < 0.4] = -1
            idx[torch.rand(t, generator=gen) < 0.1] = -1  # tokens that go nowhere
        return idx.contiguous()
    if case.routing == "zipf":
        popularity = torch.randperm(e, generator=gen).to(torch.float64) + 1.0
        return _distinct_topk(flat - 1.1 * popularity.log(), k, gen).contiguous()
    if case.routing == "skew_to_rank":
        world = case.routing_world or case.world_size
        hot = int(torch.randint(world, (1,), generator=gen))
        first, last = hot * e // world, (hot + 1) * e // world
        scores = flat.clone()
        scores[:, first:last] = 6.0  # e^6: about 400 times as likely as any other expert
        return _distinct_topk(scores, k, gen).contiguous()
    if case.routing == "one_expert":
        hot = int(torch.randint(e, (1,), generator=gen))
        idx = torch.full((t, k), -1, dtype=torch.int64)
        idx[torch.arange(t), torch.randint(k, (t,), generator=gen)] = hot
        return idx
    raise ValueError(f"unknown routing kind {case.routing!r}")


def global_inputs(case: RoutingCase) -> dict[str, torch.Tensor]:
    """The whole problem: x [T, H], topk_idx [T, K] int64, topk_weights [T, K] float32,
    w1 [E, H, 2I], w2 [E, I, H] (x's dtype) and grad_out [T, H], all from case.seed."""
    gen = torch.Generator().manual_seed(case.seed)
    t, h, i, e = case.total_tokens, case.hidden, case.ffn, case.experts
    dtype = case.torch_dtype
    idx = make_routing(case, gen)
    # Drawn in float32 (three times faster than float64 draws) and cast: exact in float64.
    x = torch.randn(t, h, generator=gen)
    # Unused slots keep nonzero weights: the output must ignore them, not rely on zeros.
    weights = torch.rand(t, case.top_k, generator=gen) + 0.05
    w1 = torch.randn(e, h, 2 * i, generator=gen) / math.sqrt(h)
    w2 = torch.randn(e, i, h, generator=gen) / math.sqrt(i)
    grad_out = torch.randn(t, h, generator=gen)
    return {
        "x": x.to(dtype),
        "topk_idx": idx,
        "topk_weights": weights.to(torch.float32),
        "w1": w1.to(dtype),
        "w2": w2.to(dtype),
        "grad_out": grad_out.to(dtype),
    }


def rank_inputs(case: RoutingCase, rank: int) -> dict[str, torch.Tensor]:
    """This rank's tokens and its slice of the experts, as fresh contiguous tensors."""
    return rank_slice(global_inputs(case), case, rank)


def random_tuning(rng: random.Random, *, dispatch: str = "bf16", combine: str = "per_k") -> str:
    """A point of the tuning space that may not change the output bits: every schedule key
    drawn, the numerics keys (dispatch, combine) as given."""
    comm = rng.randint(1, 64)
    total = rng.choice([0, comm + rng.randint(1, 200)])
    return ",".join(
        [
            f"sms={comm}/{total}",
            f"token_tile={rng.choice([1, 7, 16, 64, 128, 4096, rng.randint(1, 4096)])}",
            f"tile_m={2 ** rng.randint(4, 8)}",
            f"tile_n={2 ** rng.randint(4, 8)}",
            f"tile_k={2 ** rng.randint(4, 8)}",
            f"stages={rng.randint(1, 8)}",
            f"overlap={rng.choice(['sequential', 'chunked', 'fused'])}",
            f"dispatch={dispatch}",
            f"combine={combine}",
        ]
    )
