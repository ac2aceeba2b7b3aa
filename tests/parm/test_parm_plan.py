"""The Parm plans (cpp/core/parm through uniep._C.parm): layout, capacity, the step lists' bytes
and the cost model. No processes: pure functions."""

from __future__ import annotations

import inspect
import random

import pytest
from uniep import _C, parm

P = _C.parm
SCHEDULES = ("baseline", "s1", "s2")


def shape(**kw: float) -> object:
    base = dict(
        world_size=32,
        mp_size=8,
        gpus_per_node=8,
        tokens=4096,
        hidden=1024,
        ffn_hidden=4096,
        num_experts=8,
        top_k=2,
        capacity_factor=1.2,
        dtype_bytes=2,
    )
    base.update(kw)
    return P.ParmShape(**base)


def steps(s: object, schedule: str, pass_: str = "forward") -> list:
    return list(P.build_steps(s, schedule, pass_).steps)


def test_layout_groups_and_links() -> None:
    lay = P.rank_layout(16, 4, 8)
    assert (lay.ep_size, lay.nodes) == (4, 2)
    assert lay.mp_group(6) == [4, 5, 6, 7] and lay.ep_group(6) == [2, 6, 10, 14]
    assert (lay.mp_index(6), lay.ep_index(6), lay.first_expert(6, 8)) == (2, 1, 2)
    # MP inside a node; EP peers: one on the node (r +/- 4), two off it.
    assert (lay.mp_link, lay.ep_link, lay.ep_peers_intra, lay.ep_peers_inter) == (
        "intra",
        "inter",
        1,
        2,
    )
    assert P.rank_layout(8, 8, 4).mp_link == "inter"  # an MP group wider than a node
    assert P.rank_layout(4, 1, 4).mp_link == "local"
    assert P.rank_layout(4, 4, 4).ep_link == "local"


def test_capacity_rule() -> None:
    # c = ceil(k f S / (E N)): 2 * 1.2 * 4096 / 64 = 153.6 -> 154 per (slice, expert).
    s = shape()
    assert (s.slice_capacity, s.capacity) == (154, 8 * 154)
    # 1.2 * 10 / 12 is 1.0000000000000002 in binary: still one slot, not two.
    assert shape(world_size=12, mp_size=1, tokens=10, num_experts=12, top_k=1).slice_capacity == 1
    assert shape(capacity_factor=0.0, tokens=4097).slice_capacity == 513  # no drops: ceil(S/N)
    assert shape(tokens=3, capacity_factor=0.01).slice_capacity == 1
    assert [shape(tokens=10, mp_size=4, world_size=8).slice_tokens(m) for m in range(4)] == [
        3,
        3,
        2,
        2,
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mp_size", 3),
        ("ffn_hidden", 4095),
        ("num_experts", 6),
        ("top_k", 9),
        ("tokens", 0),
        ("dtype_bytes", 0),
    ],
)
def test_shape_errors_name_the_field(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        shape(**{field: value})
    with pytest.raises(ValueError, match="schedule"):
        P.build_steps(shape(), "s3", "forward")


def _coll(lst: list, op: str) -> list:
    return [s for s in lst if s.op == op]


@pytest.mark.parametrize(
    "dims",
    [
        dict(),
        dict(
            world_size=8, mp_size=2, gpus_per_node=2, tokens=333, hidden=96, top_k=3, num_experts=4
        ),
    ],
)
def test_bytes_per_step_follow_the_spec(dims: dict) -> None:
    s = shape(**dims)
    N, b, M = s.mp_size, s.dtype_bytes, s.hidden
    D = s.num_experts * s.capacity * M * b
    assert s.dispatch_bytes == D
    base, s1, s2 = (steps(s, name) for name in SCHEDULES)
    # Baseline (DeepSpeed-MoE, TP experts): A2A(D), AllReduce(D), A2A(D).
    assert [x.bytes for x in _coll(base, "ep_all_to_all_dispatch")] == [D]
    assert [x.bytes for x in _coll(base, "esp_all_reduce")] == [D]
    assert [x.bytes for x in _coll(base, "ep_all_to_all_combine")] == [D]
    for lst in (s1, s2):
        # Paused MP: A2A(D/N) pipelined with the ESP all-gather (output D); RS(D); A2A(D/N).
        (a2a,) = _coll(lst, "ep_all_to_all_dispatch")
        (ag,) = _coll(lst, "esp_all_gather")
        assert (a2a.bytes, ag.bytes, a2a.overlap_with, ag.stream) == (D // N, D, lst.index(ag), 1)
        assert [x.bytes for x in _coll(lst, "esp_reduce_scatter")] == [D]
        assert [x.bytes for x in _coll(lst, "ep_all_to_all_combine")] == [D // N]
        assert not _coll(lst, "esp_all_reduce")
    # S1 gathers the tokens (X, padded to N equal slices), S2 the capacity blocks (D).
    assert [x.bytes for x in _coll(s1, "mp_all_gather_tokens")] == [N * s.max_slice_tokens * M * b]
    assert [x.bytes for x in _coll(s2, "mp_all_gather_capacity")] == [D]
    # S1 routes 1/N of the tokens; the gate flops say so.
    assert _coll(s1, "gate")[0].flops < _coll(base, "gate")[0].flops / N * 1.01
    # Backward: the baseline's ColumnParallel all-reduce; S1's gate-gradient all-reduce (M*E fp32).
    assert [x.bytes for x in _coll(steps(s, "baseline", "backward"), "esp_all_reduce")] == [D]
    assert [x.bytes for x in _coll(steps(s, "s1", "backward"), "mp_all_reduce_gate_grad")] == [
        M * s.num_experts * 4
    ]
    assert not _coll(steps(s, "s2", "backward"), "mp_all_reduce_gate_grad")


def test_tokens_cross_the_network_once() -> None:
    """Every dispatched row leaves its MP group exactly once under S1/S2, N times under the
    baseline: summed over the N ranks of an MP group, the EP all-to-all carries D vs N*D."""
    for N in (1, 2, 4, 8):
        s = shape(mp_size=N, world_size=4 * N, gpus_per_node=N)
        D = s.dispatch_bytes
        for name, copies in (("baseline", N), ("s1", 1), ("s2", 1)):
            for pass_ in ("forward", "backward"):
                a2a = [x for x in steps(s, name, pass_) if x.collective == "all_to_all"]
                assert [N * x.bytes for x in a2a] == [copies * D] * 2, (name, pass_, N)


@pytest.mark.parametrize("N", [2, 4, 8])
def test_paused_mp_moves_fewer_inter_node_bytes(N: int) -> None:
    s = shape(mp_size=N, world_size=4 * N, gpus_per_node=N)
    for pass_ in ("forward", "backward"):
        base = P.build_steps(s, "baseline", pass_)
        for name in ("s1", "s2"):
            lst = P.build_steps(s, name, pass_)
            # The A2As shrink N-fold; only the 24-byte-per-rank routing agreement stays.
            assert lst.wire_inter * N <= base.wire_inter + 24 * s.world_size * N, (name, pass_)
            assert lst.wire_inter < base.wire_inter


def test_fit_recovers_alpha_beta() -> None:
    rng = random.Random(0)
    alpha, beta = 3e-5, 2.5e-10
    sizes = [2**18 * i for i in range(1, 25)]
    exact = parm.fit_alpha_beta(sizes, [alpha + beta * n for n in sizes])
    assert exact.r2 == pytest.approx(1.0) and exact.samples == 24
    assert exact.alpha == pytest.approx(alpha, rel=1e-6) and exact.beta == pytest.approx(beta)
    noisy = parm.fit_alpha_beta(
        sizes, [(alpha + beta * n) * (1 + rng.gauss(0, 0.01)) for n in sizes]
    )
    assert noisy.beta == pytest.approx(beta, rel=0.02) and noisy.r2 > 0.99
    assert abs(noisy.alpha - alpha) < 0.05 * (alpha + beta * sizes[-1])
    with pytest.raises(ValueError, match="distinct"):
        parm.fit_alpha_beta([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="two samples"):
        parm.fit_alpha_beta([4], [1.0])


def test_saa_pipeline_model() -> None:
    a2a, ag = P.AlphaBeta(1e-5, 1e-9), P.AlphaBeta(1e-5, 1e-10)
    t1, r1 = P.saa_seconds(a2a, 1e6, ag, 4e6, 1)
    assert r1 == 1 and t1 == pytest.approx(a2a.at(1e6) + ag.at(4e6))
    t, r = P.saa_seconds(a2a, 1e6, ag, 4e6, 16)
    assert t < t1 and r > 1
    # Large start-up cost: chunking does not pay.
    assert P.saa_seconds(P.AlphaBeta(1.0, 1e-9), 1e6, P.AlphaBeta(1.0, 1e-9), 1e6, 16)[1] == 1


def test_pricing_and_choice() -> None:
    model = parm.cost_model(32, 8, "h100-ib")
    s = shape()
    chosen, costs = P.choose(s, model)
    totals = {k: f + b for k, (f, b) in costs.items()}
    assert chosen == min(totals, key=totals.get)
    pricing = P.price(P.build_steps(s, "s2", "forward"), model)
    assert pricing.seconds == pytest.approx(sum(pricing.step_seconds))
    assert pricing.seconds == pytest.approx(costs["s2"][0])
    plan = parm.plan(
        32, 8, 4096, 1024, 4096, 8, 2, capacity_factor=1.2, dtype=2, cluster="h100-ib"
    )  # shape()'s 2-byte rows
    assert plan.schedule == chosen and plan.speedup > 1
    assert plan.predicted["s1"]["total"] == pytest.approx(totals["s1"])


def test_plan_defaults_to_the_layer_dtype() -> None:
    """plan() with ParmMoELayer's arguments prices what the layer runs: one default dtype (plan's
    was bf16, the layer's float32, and these layouts' choices differ between the two)."""
    layer_dtype = inspect.signature(parm.ParmMoELayer).parameters["dtype"].default
    assert inspect.signature(parm.plan).parameters["dtype"].default is layer_dtype
    for tokens, gpus_per_node in ((16384, None), (1024, 2)):
        args = (4, 2, tokens, 64, 256, 8, 2, 1.0)
        got = parm.plan(*args, gpus_per_node=gpus_per_node)
        want = parm.plan(*args, gpus_per_node=gpus_per_node, dtype=layer_dtype)
        assert (got.schedule, got.predicted) == (want.schedule, want.predicted)
        assert got.shape.dtype_bytes == 4


def test_at_mp_one_the_schedules_coincide() -> None:
    model = parm.cost_model(8, 1, "a6000-ib", gpus_per_node=1)
    _, costs = P.choose(shape(world_size=8, mp_size=1, gpus_per_node=1), model)
    for name in ("s1", "s2"):
        assert costs[name] == pytest.approx(costs["baseline"], rel=1e-12), name


def test_slow_network_favours_paused_mp() -> None:
    speedup = {}
    for cluster in parm.CLUSTERS:
        p = parm.plan(32, 8, 4096, 2048, 8192, 8, 2, capacity_factor=1.2, cluster=cluster)
        assert p.schedule in ("s1", "s2") and p.speedup > 1.2, (cluster, p.predicted)
        speedup[cluster] = p.speedup
    # Free links: what is left is S1's 1/N of the routing work (gate, order, I-order).
    free = dict(
        parm.CLUSTERS["h100-ib"], inter_bw=1e18, intra_bw=1e18, inter_alpha=0, intra_alpha=0
    )
    cheap = parm.plan(32, 8, 4096, 2048, 8192, 8, 2, capacity_factor=1.2, cluster=free)
    assert cheap.schedule == "s1" and 1 < cheap.speedup < speedup["h100-ib"]
    model = parm.cost_model(32, 8, free)

    def routing(name: str) -> float:
        return sum(
            model.compute_seconds(x.flops, x.mem_bytes)
            for x in cheap.steps(name).steps
            if x.op in ("gate", "order", "iorder")
        )

    f_base, f_s1 = cheap.predicted["baseline"]["forward"], cheap.predicted["s1"]["forward"]
    assert routing("s1") < routing("baseline") / 2
    assert f_base - f_s1 == pytest.approx(routing("baseline") - routing("s1"), rel=1e-6)


def _random_shapes(n: int, seed: int = 0) -> list[object]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        N = rng.choice([1, 2, 3, 4, 8])
        G = rng.choice([1, 2, 3, 4])
        E = G * rng.randint(1, 4)
        out.append(
            shape(
                world_size=N * G,
                mp_size=N,
                gpus_per_node=rng.choice([1, N, 2 * N, 8]),
                tokens=rng.randint(1, 5000),
                hidden=rng.randint(1, 300),
                ffn_hidden=N * rng.randint(1, 64),
                num_experts=E,
                top_k=rng.randint(1, E),
                capacity_factor=rng.choice([0.0, 0.5, 1.0, 1.3]),
                dtype_bytes=rng.choice([1, 2, 4]),
            )
        )
    return out


# What each pass may read before any step wrote it: its inputs and the forward's saved buffers.
PASS_INPUTS = {"forward": {"x"}, "backward": {"dy", "route"}}
# Outputs besides `output` (include/uniep/parm.hpp, step model).
EXTRA_OUTPUTS = {"iorder_bwd": ("d_w",), "gate_bwd": ("d_wg",)}


def test_random_shapes_plan_invariants() -> None:
    model = parm.cost_model(8, 2, "a6000-ib")
    for s in _random_shapes(150):
        N, D = s.mp_size, s.dispatch_bytes
        assert s.capacity == N * s.slice_capacity and D % N == 0
        assert sum(s.slice_tokens(m) for m in range(N)) == s.tokens
        expert_flops = set()
        for name in SCHEDULES:
            for pass_ in ("forward", "backward"):
                lst = steps(s, name, pass_)
                have = set(PASS_INPUTS[pass_])
                for i, x in enumerate(lst):
                    # Buffers flow: every input was produced before.
                    assert x.input in have, (name, pass_, i, x.op, x.input)
                    have |= {x.output, *EXTRA_OUTPUTS.get(x.op, ())}
                    if x.overlap_with >= 0:
                        a, g = sorted((i, x.overlap_with))
                        assert g == a + 1 and lst[a].collective == "all_to_all"
                        assert lst[g].collective == "all_gather" and lst[g].stream == 1
                    assert x.wire_intra >= 0 and x.wire_inter >= 0
                assert {"forward": "y", "backward": "dx"}[pass_] in have
                a2a = [x.bytes for x in lst if x.collective == "all_to_all"]
                assert [b * N for b in a2a] == [D * (N if name == "baseline" else 1)] * 2
                expert_flops.add(sum(x.flops for x in lst if x.op.startswith("expert")))
        # The expert work is the same in every schedule (forward and backward, two values).
        assert len(expert_flops) == 2, expert_flops
        best, costs = P.choose(s, model)
        totals = {k: f + b for k, (f, b) in costs.items()}
        assert all(t > 0 for t in totals.values()) and totals[best] == min(totals.values())
