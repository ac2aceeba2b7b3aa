"""The MoE backward at world 1 on the MegaKernel's pieces (``uniep.moe.megakernel.backward``,
``torch.ops.uniep.moe_fused_backward_local``, include/uniep/cuda/fused_moe_backward.hpp): the send
of x's and grad_out's rows and the GEMMs on them as one persistent launch, then the element-wise
pass, the data-gradient GEMM, the reduce over k and the weight gradients.

Checked: the three overlap modes give the same bits, run to run, and so does moe_backward on the
expert GEMM engine, on top-k 1 to 9, hundreds of experts, skewed routings, empty experts, -1
entries and sizes that are multiples of 64 but not of 128; every gradient is within bf16
rounding of float64 autograd of the dense layer; zero tokens and all-unused routings give empty
and zero gradients; a bad expert id is named; rows that never come raise a timeout naming the
tile; bad operands are named.
"""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)
from uniep.moe import tile_gates as gate

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]


def _layer(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, seed: int,
           skew: bool = False):  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    go = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
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
    return go, x, idx, w, w1, w2


def _reference(go, x, idx, w, w1, w2) -> list[torch.Tensor]:
    """float64 autograd of the dense layer: grads of x, w, w1, w2."""
    ffn = w2.shape[1]
    leaves = [t.double().requires_grad_(True) for t in (x, w, w1, w2)]
    xd, wd, w1d, w2d = leaves
    y = torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    for e in range(w1.shape[0]):
        t, k = (idx == e).nonzero(as_tuple=True)
        if t.numel():
            h = xd[t] @ w1d[e]
            out = (torch.nn.functional.silu(h[:, :ffn]) * h[:, ffn:]) @ w2d[e]
            y = y.index_add(0, t, out * wd[t, k].unsqueeze(1))
    (y * go.double()).sum().backward()
    return [t.grad for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp(min=1e-30))


LAYERS = [
    # tokens, hidden, ffn, experts, top_k, skew
    (1000, 256, 256, 16, 9, False),
    (777, 192, 192, 8, 1, False),  # multiples of 64, not of 128; top-1
    (600, 128, 128, 256, 4, False),  # hundreds of experts, most with a few rows
    (2048, 512, 128, 32, 8, True),  # skewed: two experts hold most rows
    (3, 64, 64, 4, 2, False),  # fewer rows than one tile
]


@pytest.mark.parametrize("tokens,hidden,ffn,experts,top_k,skew", LAYERS)
def test_modes_agree_bit_for_bit_and_with_float64(
    tokens, hidden, ffn, experts, top_k, skew
) -> None:
    from uniep.moe.megakernel.backward import moe_backward_local

    go, x, idx, w, w1, w2 = _layer(tokens, hidden, ffn, experts, top_k, tokens + experts, skew)
    runs = {
        mode: moe_backward_local(go, x, idx, w, w1, w2, overlap=mode)
        for mode in ("sequential", "streams", "fused")
    }
    again = moe_backward_local(go, x, idx, w, w1, w2)  # fused, the default
    names = ("grad_x", "grad_topk_weights", "grad_w1", "grad_w2")
    for mode in ("streams", "fused"):
        for name, a, b in zip(names, runs[mode], runs["sequential"], strict=True):
            assert torch.equal(a, b), f"{name}: {mode} against sequential"
    for name, a, b in zip(names, again, runs["fused"], strict=True):
        assert torch.equal(a, b), f"{name}: fused run to run"
    ref = _reference(go, x, idx, w, w1, w2)
    for name, got, want in zip(names, runs["fused"], ref, strict=True):
        assert got.shape == want.shape, name
        assert _rel(got, want) < 2e-2, f"{name}: relative error {_rel(got, want):.3g}"
    assert not runs["fused"][1][idx < 0].any(), "unused entries get no weight gradient"


def _engine_worker(rank: int, world: int) -> list[bool]:
    """moe_backward on the expert GEMM engine (one C++ op: dispatch, GEMMs, combine) against the
    MegaKernel's sequential backward, layer by layer, at world 1."""
    import torch.distributed as dist
    from uniep.distributed import group_name
    from uniep.moe.megakernel.backward import moe_backward_local

    equal = []
    for tokens, hidden, ffn, experts, top_k, skew in LAYERS:
        go, x, idx, w, w1, w2 = _layer(tokens, hidden, ffn, experts, top_k, 40 + experts, skew)
        group = dist.new_group([0])
        uniep.moe.ep.init_runtime(
            group, max_tokens=tokens, hidden=hidden, top_k=top_k, num_experts=experts
        )
        engine = torch.ops.uniep.moe_backward(go, x, idx, w, w1, w2, group_name(group), "")
        local = moe_backward_local(go, x, idx, w, w1, w2, overlap="sequential")
        equal.append(all(torch.equal(a, b.to(a.dtype)) for a, b in zip(local, engine, strict=True)))
    return equal


def test_engine_backward_has_the_same_bits() -> None:
    """The engine's moe_backward (its routing weights and grad_out rows gathered by our own
    kernels) gives the MegaKernel backward's bits on every layer above."""
    from uniep.distributed import run_local_ranks

    (equal,) = run_local_ranks(_engine_worker, 1, backend="nccl", timeout_s=300)
    assert equal == [True] * len(LAYERS), list(zip(LAYERS, equal, strict=True))


def test_edge_cases() -> None:
    from uniep.moe.megakernel.backward import moe_backward_local

    go, x, idx, w, w1, w2 = _layer(0, 128, 128, 4, 2, seed=1)
    gx, gw, g1, g2 = moe_backward_local(go, x, idx, w, w1, w2)
    assert gx.shape == (0, 128) and gw.shape == (0, 2)
    assert not g1.any() and not g2.any() and g1.shape == w1.shape and g2.shape == w2.shape
    go, x, idx, w, w1, w2 = _layer(5, 128, 64, 4, 3, seed=2)  # I != H: w2t is not w2
    idx[:] = -1
    for grad in moe_backward_local(go, x, idx, w, w1, w2):
        assert not grad.any()
    idx[1, 2] = 4
    with pytest.raises(ValueError, match=r"entry \(token 1, k 2\) holds an expert id"):
        moe_backward_local(go, x, idx, w, w1, w2)
    idx[1, 2] = 0
    with pytest.raises(ValueError, match="grad_out must be"):
        moe_backward_local(go[:4], x, idx, w, w1, w2)
    with pytest.raises(ValueError, match="w2t must be w2 transposed"):
        moe_backward_local(go, x, idx, w, w1, w2, w2t=w2)
    with pytest.raises(ValueError, match="overlap must be one of"):
        moe_backward_local(go, x, idx, w, w1, w2, overlap="chunked")


def _plan(idx: torch.Tensor, experts: int):
    """The op's plan operands for idx: (gemm_row, counter, offs, tile_base) at 128-row tiles."""
    counts = torch.bincount(idx[idx >= 0], minlength=experts).view(1, experts)
    _, row, counter, _ = gate.sender_rows(idx, counts, 0)
    offs = counts[0].cumsum(0).to(torch.int32)
    return row, counter, offs, gate.tile_base(offs, idx.numel())


def test_rows_that_never_come_time_out_naming_the_tile() -> None:
    from uniep.moe.megakernel.forward import transposed_w2

    go, x, idx, w, w1, w2 = _layer(64, 128, 128, 4, 2, seed=3)
    row, counter, offs, base = _plan(idx, w1.shape[0])
    # Expert 0's rows are in the GEMM's shapes, but no entry sends them.
    mine = idx == 0
    row, counter = row.masked_fill(mine, -1), counter.masked_fill(mine, -1)
    *_, timeout = torch.ops.uniep.moe_fused_backward_local(
        go, x, row, counter, w1, transposed_w2(w2), offs, base, 0.2
    )
    with pytest.raises(TimeoutError, match=r"the rows of expert 0, m-tile 0 never arrived"):
        gate.check_gate_timeout(timeout, "fused backward")


def test_bad_arguments_are_named() -> None:
    go, x, idx, w, w1, w2 = _layer(8, 128, 64, 4, 2, seed=5)
    row, counter, offs, base = _plan(idx, w1.shape[0])
    w2t = w2.transpose(1, 2).contiguous()
    op = torch.ops.uniep.moe_fused_backward_local
    with pytest.raises(ValueError, match=r"w2t \(w2 transposed\) must be"):
        op(go, x, row, counter, w1, w2, offs, base, 1.0)
    with pytest.raises(ValueError, match="grad_out must be"):
        op(go.float(), x, row, counter, w1, w2t, offs, base, 1.0)
    with pytest.raises(ValueError, match="counter must be"):
        op(go, x, row, counter[:, :1], w1, w2t, offs, base, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be"):
        op(go, x, row, counter, w1, w2t, offs, base, -1.0)


def test_trace_records_the_send_and_the_tiles() -> None:
    from uniep.moe.megakernel.backward import moe_backward_local
    from uniep.moe.megakernel.launch import trace_phases

    go, x, idx, w, w1, w2 = _layer(1000, 256, 128, 16, 4, seed=7)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    trace = torch.zeros(4 * sms, dtype=torch.int64, device="cuda")
    traced = moe_backward_local(go, x, idx, w, w1, w2, trace=trace)
    for a, b in zip(traced, moe_backward_local(go, x, idx, w, w1, w2), strict=True):
        assert torch.equal(a, b), "the trace changes no bit"
    phases = trace_phases(trace)
    assert 0 < phases["send_end_us"] <= phases["gemm_end_us"] == phases["reduce_end_us"], phases
    with pytest.raises(ValueError, match="trace is for overlap='fused' only"):
        moe_backward_local(go, x, idx, w, w1, w2, overlap="sequential", trace=trace)


def test_fused_backward_is_captured_in_a_cuda_graph() -> None:
    """Nothing in the fused backward waits for the host (check=False): a CUDA graph holds the
    plan and every launch, and replays on new tokens and gradients of the same shape give
    eager's bits."""
    from uniep.moe.megakernel.backward import moe_backward_local
    from uniep.moe.megakernel.forward import transposed_w2

    go, x, idx, w, w1, w2 = _layer(128, 256, 128, 16, 8, seed=11)
    w2t = transposed_w2(w2)
    s_go, sx, sidx, sw = go.clone(), x.clone(), idx.clone(), w.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        moe_backward_local(s_go, sx, sidx, sw, w1, w2, w2t=w2t, check=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = moe_backward_local(s_go, sx, sidx, sw, w1, w2, w2t=w2t, check=False)
    for seed in (11, 12):
        go2, x2, idx2, w_2, _, _ = _layer(128, 256, 128, 16, 8, seed=seed)
        for dst, src in ((s_go, go2), (sx, x2), (sidx, idx2), (sw, w_2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_backward_local(go2, x2, idx2, w_2, w1, w2, w2t=w2t)
        for a, b in zip(grads, eager, strict=True):
            assert torch.equal(a, b), f"replay with seed {seed} differs from eager"


def test_opcheck() -> None:
    from uniep.moe.megakernel.forward import transposed_w2

    go, x, idx, w, w1, w2 = _layer(40, 128, 64, 4, 2, seed=9)
    row, counter, offs, base = _plan(idx, w1.shape[0])
    args = (go, x, row, counter, w1, transposed_w2(w2), offs, base, 5.0)
    # The rows past offs[-1] of the outputs are never written (torch.empty): compare only the
    # schema, the fake kernel and the dispatch, not values across two runs.
    torch.library.opcheck(
        torch.ops.uniep.moe_fused_backward_local,
        args,
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
