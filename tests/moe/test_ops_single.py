"""torch.ops.uniep on one rank (group_name ""): numerics, bits, backward, opcheck, torch.compile."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _moe_cases import MoeCase, make_inputs, rel_err, same_bits
from uniep import _C
from uniep.moe import ops
from uniep.reference import moe_reference

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}
TUNINGS = [
    "",
    "overlap=sequential,tile_m=16",
    "overlap=chunked,token_tile=16,tile_m=32,tile_n=64,tile_k=32,stages=1",
    "overlap=fused,tile_m=256,tile_n=256,tile_k=128,stages=8,sms=64/132",
    "sms=4/16,token_tile=1,overlap=sequential",
    "tile_m=64,stages=3,token_tile=4096",
]

CASES = [
    MoeCase(f"{routing}-t{t}-h{h}-i{i}-e{e}-k{k}-{dtype}", (t,), h, i, e, k, dtype, routing, seed)
    for seed, (routing, t, h, i, e, k) in enumerate(
        [
            ("random", 37, 48, 32, 4, 2),
            ("random", 21, 100, 24, 8, 8),
            ("random", 1, 17, 5, 3, 1),
            ("random", 0, 40, 16, 4, 3),
            ("one_expert", 30, 72, 40, 6, 4),
            ("random", 50, 33, 20, 16, 5),
        ]
    )
    for dtype in ("float32", "bfloat16", "float64")
]


def _args(g: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return g["x"], g["topk_idx"], g["topk_weights"], g["w1"], g["w2"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_reference(case: MoeCase) -> None:
    g = make_inputs(case)
    y = torch.ops.uniep.moe_forward(*_args(g), "", "")
    assert y.shape == g["x"].shape and y.dtype == g["x"].dtype
    assert torch.isfinite(y).all()
    ref = moe_reference(*_args(g))
    err = rel_err(y, ref)
    assert err <= TOLERANCE[case.dtype], f"rel. err {err:.3e}"
    # The Python wrapper is the same op.
    assert same_bits(ops.moe_forward(*_args(g)), y)


@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: c.name)
def test_forward_bits_same_across_tunings(case: MoeCase) -> None:
    g = make_inputs(case)
    first = torch.ops.uniep.moe_forward(*_args(g), "", TUNINGS[0])
    for tuning in TUNINGS:
        for _ in range(2):
            y = torch.ops.uniep.moe_forward(*_args(g), "", tuning)
            assert same_bits(y, first), f"tuning {tuning!r}"
        assert same_bits(ops.moe_forward(*_args(g), tuning=_C.TuningParams.parse(tuning)), y)


def test_unused_slots_and_their_weights_are_ignored() -> None:
    case = MoeCase("ignore", (12,), 20, 8, 4, 3, "float64", seed=5)
    g = make_inputs(case)
    y = torch.ops.uniep.moe_forward(*_args(g), "", "")
    w = g["topk_weights"].clone()
    w[g["topk_idx"] < 0] = 1e30
    assert same_bits(
        torch.ops.uniep.moe_forward(g["x"], g["topk_idx"], w, g["w1"], g["w2"], "", ""), y
    )
    none = torch.full_like(g["topk_idx"], -1)
    zero = torch.ops.uniep.moe_forward(g["x"], none, g["topk_weights"], g["w1"], g["w2"], "", "")
    assert (zero == 0).all()


def test_forward_is_linear_in_topk_weights() -> None:
    case = MoeCase("linear", (9,), 12, 6, 4, 2, "float64", seed=6)
    g = make_inputs(case)
    y1 = torch.ops.uniep.moe_forward(*_args(g), "", "")
    y2 = torch.ops.uniep.moe_forward(
        g["x"], g["topk_idx"], 2 * g["topk_weights"], g["w1"], g["w2"], "", ""
    )
    torch.testing.assert_close(y2, 2 * y1, rtol=1e-14, atol=0)


@pytest.mark.parametrize(
    "case",
    [
        MoeCase("bwd-random-k2", (11,), 14, 6, 4, 2, "float64", seed=40),
        MoeCase("bwd-random-k4-e8", (13,), 10, 8, 8, 4, "float64", seed=41),
        MoeCase("bwd-one-expert", (7,), 9, 5, 3, 2, "float64", "one_expert", 42),
        MoeCase("bwd-zero-tokens", (0,), 8, 4, 2, 1, "float64", seed=43),
        MoeCase("bwd-random-f32", (10,), 24, 12, 4, 2, "float32", seed=44),
    ],
    ids=lambda c: c.name,
)
def test_backward_matches_reference_autograd(case: MoeCase) -> None:
    g = make_inputs(case)
    names = ("x", "topk_weights", "w1", "w2")
    ours = {n: g[n].clone().requires_grad_(True) for n in names}
    y = torch.ops.uniep.moe_forward(
        ours["x"], g["topk_idx"], ours["topk_weights"], ours["w1"], ours["w2"], "", ""
    )
    y.backward(g["grad_out"])
    ref = {n: g[n].double().requires_grad_(True) for n in names}
    ref_y = moe_reference(ref["x"], g["topk_idx"], ref["topk_weights"], ref["w1"], ref["w2"])
    if ref_y.requires_grad:  # not when no token reaches any expert: every gradient is zero
        ref_y.backward(g["grad_out"].double())
    tol = 1e-10 if case.dtype == "float64" else 1e-4
    for n in names:
        got = ours[n].grad
        assert got is not None and got.dtype == g[n].dtype and got.shape == g[n].shape, n
        assert torch.isfinite(got).all(), n
        want = ref[n].grad if ref[n].grad is not None else torch.zeros_like(ref[n])
        assert rel_err(got, want) <= tol, n
    assert (ours["topk_weights"].grad[g["topk_idx"] < 0] == 0).all()


def test_backward_only_some_inputs_require_grad() -> None:
    g = make_inputs(MoeCase("partial", (8,), 12, 6, 4, 2, "float64", seed=45))
    w1 = g["w1"].clone().requires_grad_(True)
    y = torch.ops.uniep.moe_forward(g["x"], g["topk_idx"], g["topk_weights"], w1, g["w2"], "", "")
    (grad_w1,) = torch.autograd.grad(y, [w1], g["grad_out"])
    full = torch.ops.uniep.moe_backward(g["grad_out"], *_args(g), "", "")
    assert same_bits(grad_w1, full[2])


def test_a_second_derivative_is_refused_not_left_out() -> None:
    """A gradient penalty (backward with create_graph=True) through the op raises: its backward
    has no derivative, and autograd would otherwise leave the second-order gradients out."""
    g = make_inputs(MoeCase("penalty", (6,), 8, 6, 4, 2, "float64", seed=47))
    x = g["x"].clone().requires_grad_(True)
    w1 = g["w1"].clone().requires_grad_(True)
    y = torch.ops.uniep.moe_forward(x, g["topk_idx"], g["topk_weights"], w1, g["w2"], "", "")
    with pytest.raises(ValueError, match="moe_forward has no second derivative"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    # The same backward without create_graph is the ordinary one.
    (gx,) = torch.autograd.grad(y, x, g["grad_out"])
    full = torch.ops.uniep.moe_backward(g["grad_out"], x.detach(), *_args(g)[1:], "", "")
    assert same_bits(gx, full[0])


def test_gradcheck_float64() -> None:
    g = make_inputs(MoeCase("gradcheck", (5,), 6, 3, 3, 2, "float64", seed=46))
    idx = g["topk_idx"]

    def f(x: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.ops.uniep.moe_forward(x, idx, w, w1, w2, "", "")

    inputs = tuple(g[n].clone().requires_grad_(True) for n in ("x", "topk_weights", "w1", "w2"))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


# ---- routing_layout (the torch op) ----


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("tokens", [0, 1, 29])
def test_routing_layout_matches_numpy(world: int, tokens: int) -> None:
    experts, top_k = 8, 3
    gen = torch.Generator().manual_seed(world * 100 + tokens)
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
    idx[torch.rand(tokens, top_k, generator=gen) < 0.3] = -1
    per_rank, per_expert, in_rank = torch.ops.uniep.routing_layout(idx, experts, world)
    assert per_rank.dtype == per_expert.dtype == torch.int64 and in_rank.dtype == torch.bool
    want = _C.compute_layout(idx.numpy(), experts, world)
    np.testing.assert_array_equal(per_rank.numpy(), want[0])
    np.testing.assert_array_equal(per_expert.numpy(), want[1])
    np.testing.assert_array_equal(in_rank.numpy().astype(np.uint8), want[2])
    owner = torch.where(idx >= 0, idx // (experts // world), -1)
    for r in range(world):
        expect = (owner == r).any(dim=1)
        assert torch.equal(in_rank[:, r], expect)
        assert per_rank[r] == expect.sum()
    for e in range(experts):
        assert per_expert[e] == (idx == e).sum()


# ---- torch.library.opcheck and torch.compile ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_moe_forward(dtype: torch.dtype, requires_grad: bool) -> None:
    case = MoeCase("opcheck", (6,), 8, 4, 4, 2, "float64" if dtype == torch.float64 else "float32")
    g = make_inputs(case)
    args = [g[n] for n in ("x", "topk_idx", "topk_weights", "w1", "w2")]
    if requires_grad:
        args = [a.requires_grad_(True) if a.is_floating_point() else a for a in args]
    torch.library.opcheck(torch.ops.uniep.moe_forward.default, (*args, "", ""))


def test_opcheck_moe_backward() -> None:
    g = make_inputs(MoeCase("opcheck-bwd", (6,), 8, 4, 4, 2, "float64"))
    torch.library.opcheck(torch.ops.uniep.moe_backward.default, (g["grad_out"], *_args(g), "", ""))


def test_opcheck_routing_layout() -> None:
    idx = torch.tensor([[0, 3], [-1, 5], [7, 2], [-1, -1]], dtype=torch.int64)
    torch.library.opcheck(torch.ops.uniep.routing_layout.default, (idx, 8, 2))


def test_fake_kernel_shapes_on_meta() -> None:
    g = make_inputs(MoeCase("meta", (5,), 8, 4, 4, 2))
    meta = [t.to("meta") for t in _args(g)]
    y = torch.ops.uniep.moe_forward(*meta, "", "")
    assert y.device.type == "meta" and y.shape == (5, 8) and y.dtype == torch.float32
    per_rank, per_expert, in_rank = torch.ops.uniep.routing_layout(meta[1], 4, 2)
    assert per_rank.shape == (2,) and per_expert.shape == (4,) and in_rank.shape == (5, 2)


requires_dynamo = pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported on this Python"
)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    # Earlier compiled tests must not leave guards or caches that hide a graph break here.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@requires_dynamo
@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_fullgraph_forward_backward() -> None:
    g = make_inputs(MoeCase("compile", (7,), 16, 8, 4, 2, "float64", seed=50))

    def layer(x: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        y = torch.ops.uniep.moe_forward(torch.tanh(x), g["topk_idx"], w, w1, w2, "", "")
        return (y * y).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    names = ("x", "topk_weights", "w1", "w2")
    eager_in = [g[n].clone().requires_grad_(True) for n in names]
    comp_in = [g[n].clone().requires_grad_(True) for n in names]
    eager = layer(*eager_in)
    eager.backward()
    out = compiled(*comp_in)
    out.backward()
    assert same_bits(out.detach(), eager.detach())
    for n, a, b in zip(names, eager_in, comp_in, strict=True):
        assert same_bits(a.grad, b.grad), n


@requires_dynamo
@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_fullgraph_python_wrapper() -> None:
    g = make_inputs(MoeCase("compile-wrapper", (6,), 12, 8, 4, 2, "float32", seed=51))

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.moe_forward(x, g["topk_idx"], g["topk_weights"], g["w1"], g["w2"]) + 1

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert same_bits(compiled(g["x"]), f(g["x"]))


# ---- dispatch=fp8: a numerics choice, still independent of the schedule ----


def fp8_roundtrip(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """What an fp8 e4m3 dispatch delivers: one fp32 scale (amax / 448) per 1x128 block."""
    xf = x.float()
    out = torch.empty_like(xf)
    for c0 in range(0, x.shape[1], block):
        blk = xf[:, c0 : c0 + block]
        amax = blk.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (blk / scale).to(torch.float8_e4m3fn)
        out[:, c0 : c0 + block] = q.float() * scale
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_fp8_dispatch_matches_quantised_reference(dtype: str) -> None:
    case = MoeCase("fp8", (33,), 200, 24, 8, 3, dtype, seed=60)
    g = make_inputs(case)
    # experts=bf16: the rows' rounding alone (fp8 experts: tests/gemm/test_fp8_experts.py).
    y = torch.ops.uniep.moe_forward(*_args(g), "", "dispatch=fp8,experts=bf16")
    assert torch.isfinite(y).all()
    for tuning in (
        "dispatch=fp8,experts=bf16,overlap=sequential,tile_m=16",
        "dispatch=fp8,experts=bf16,token_tile=1",
    ):
        assert same_bits(torch.ops.uniep.moe_forward(*_args(g), "", tuning), y), tuning
    x_q = fp8_roundtrip(g["x"])
    ref_q = moe_reference(x_q, g["topk_idx"], g["topk_weights"], g["w1"], g["w2"])
    assert rel_err(y, ref_q) <= TOLERANCE[dtype]
    # Against the unquantised input, only fp8's own accuracy (3 mantissa bits).
    assert rel_err(y, moe_reference(*_args(g))) <= 0.08
