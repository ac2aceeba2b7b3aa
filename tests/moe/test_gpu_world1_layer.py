"""moe_forward and moe_backward at world 1 on CUDA (marker `gpu`): the local paths
(cpp/torch/ep/local_layer.hpp: the routing's plan on the device, each token stored at its GEMM
rows, the engine's GEMMs, the per-k combine of the rows) against the runtime's path (the forward
composed from its public pieces: the dispatch's rows, the same GEMMs, the runtime's combine; the
backward as the op runs it with `combine=rank_partials`, whose gradients are per_k's): the same
bits on random, skewed and sparse routing, empty experts, one token, top-k 1 to 9, FFN sizes with
and without the SwiGLU epilogue on w1 as stored, past 1,024 experts and past one plan block of
entries, and within bf16 tolerance of float64; the fp8 layer (dispatch=fp8) against the fp8
dispatch's path of uniep.moe.prepared; and a bad expert id raised naming the entry, with the next
call unaffected."""

from __future__ import annotations

import pytest
import torch
import uniep
from uniep.gemm import pack_gate_up
from uniep.reference import moe_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.hopper,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (tokens, hidden, ffn, experts, top-k, routing)
CASES = [
    (300, 256, 128, 16, 4, "random"),
    (1, 128, 64, 8, 2, "random"),
    (513, 128, 96, 8, 3, "random"),  # I = 96: GEMM 1, then the one-pass SwiGLU
    (700, 256, 128, 32, 8, "skewed"),  # every token's first choice on expert 0
    (200, 128, 64, 64, 9, "sparse"),  # half the entries unused, most experts empty
    (400, 128, 64, 1100, 2, "random"),  # past the one-block plan's expert table
    (2500, 128, 128, 8, 1, "random"),  # more entries than one plan block
    (64, 128, 64, 4, 2, "unused"),  # every entry unused
]


def _case(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, routing: str, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(tokens, hidden, generator=gen, device=dev).bfloat16()
    idx = torch.rand(tokens, experts, generator=gen, device=dev).topk(top_k, dim=1).indices
    if routing == "skewed":
        idx[:, 0] = 0
        idx[:, 1:] = idx[:, 1:].clamp_min(1)
    elif routing == "sparse":
        idx[torch.rand(tokens, top_k, generator=gen, device=dev) < 0.5] = -1
    elif routing == "unused":
        idx[:] = -1
    w = torch.rand(tokens, top_k, generator=gen, device=dev)
    w1 = (torch.randn(experts, hidden, 2 * ffn, generator=gen, device=dev) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen, device=dev) / ffn**0.5).bfloat16()
    return x, idx, w, w1, w2


def _runtime_path(x, idx, w, w1, w2) -> torch.Tensor:
    """The layer through the runtime's round at world 1: its rows, the engine's GEMMs (the
    one-pass SwiGLU's bits whatever w1's layout), its combine."""
    ops = torch.ops.uniep
    res = uniep.moe.ep.dispatch(x, idx, w)
    rows = res.recv_x.index_select(0, res.handle.row_slot)
    offs = res.tokens_per_expert.cumsum(0).to(torch.int32)
    if rows.shape[0] == 0:
        y = rows
    else:
        act = ops.grouped_mm_swiglu(rows, pack_gate_up(w1), offs, "")
        y = ops.grouped_mm(act, w2, offs, "")
    return uniep.moe.ep.combine(y, res.handle)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_local_path_has_the_runtime_paths_bits(case: int) -> None:
    tokens, hidden, ffn, experts, top_k, routing = CASES[case]
    x, idx, w, w1, w2 = _case(tokens, hidden, ffn, experts, top_k, routing, seed=case)
    try:
        got = uniep.moe_forward(x, idx, w, w1, w2)
        want = _runtime_path(x, idx, w, w1, w2)
        assert got.shape == (tokens, hidden) and got.dtype == torch.bfloat16
        assert torch.equal(got, want), CASES[case]
        assert torch.equal(uniep.moe_forward(x, idx, w, w1, w2), got), "run to run"
        if routing == "unused":
            assert not got.any()
        # Within bf16 tolerance of float64.
        ref = moe_reference(x.cpu(), idx.cpu(), w.cpu(), w1.cpu(), w2.cpu())
        err = (got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= 2e-2 or routing == "unused", (CASES[case], float(err))
    finally:
        uniep.moe.ep.shutdown(None)


# The fp8 layer's cases: hidden and FFN multiples of 128 (one scale per 128 columns).
FP8_CASES = [
    (300, 256, 128, 16, 4, "random"),
    (1, 128, 128, 8, 2, "random"),
    (700, 256, 256, 32, 8, "skewed"),
    (200, 128, 128, 64, 9, "sparse"),
    (400, 128, 128, 1100, 2, "random"),
    (2500, 128, 128, 8, 1, "random"),
    (64, 128, 128, 4, 2, "unused"),
]


@pytest.mark.parametrize("case", range(len(FP8_CASES)))
def test_local_fp8_path_has_the_runtime_paths_bits(case: int) -> None:
    # dispatch=fp8 (experts auto: fp8 GEMMs) at world 1 against the fp8 dispatch's path, which
    # moe_forward_prepared takes on fp8 experts below its eager threshold (all cases here).
    from uniep.moe import fp8_local
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts

    tokens, hidden, ffn, experts, top_k, routing = FP8_CASES[case]
    assert not fp8_local.takes_local_path(tokens * top_k)
    x, idx, w, w1, w2 = _case(tokens, hidden, ffn, experts, top_k, routing, seed=200 + case)
    try:
        got = uniep.moe_forward(x, idx, w, w1, w2, tuning="dispatch=fp8")
        with torch.no_grad():
            want = moe_forward_prepared(
                x, idx, w, prepare_experts(w1, w2, "fp8"), tuning="dispatch=fp8"
            )
        assert got.shape == (tokens, hidden) and got.dtype == torch.bfloat16
        assert torch.equal(got, want), FP8_CASES[case]
        assert torch.equal(uniep.moe_forward(x, idx, w, w1, w2, tuning="dispatch=fp8"), got)
        if routing == "unused":
            assert not got.any()
            return
        # Within the e4m3 format's error (relative ~0.064 on such operands) of float64.
        ref = moe_reference(x.cpu(), idx.cpu(), w.cpu(), w1.cpu(), w2.cpu())
        err = (got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err <= 0.1, (FP8_CASES[case], float(err))
    finally:
        uniep.moe.ep.shutdown(None)


def test_swapped_fp8_tiles_are_named_where_the_first_gemm_has_the_swiglu_epilogue() -> None:
    # The fp8 tiles with the operands' roles swapped (tile_m=16 / 32) lack the SwiGLU epilogue of
    # the first fp8 GEMM (w1 packed, in the prepared experts as in moe_forward's kept copy): a
    # request of one names the tiles there are, eager, on the graph path's launches and in
    # moe_forward, before anything runs.
    from uniep.moe import fp8_local
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts

    x, idx, w, w1, w2 = _case(37, 256, 256, 16, 4, "random", seed=321)
    fp8 = prepare_experts(w1, w2, "fp8")
    named = r"(?s)no fp8 grouped GEMM configuration has tile_m=(16|32).*tile_m=64"
    try:
        with torch.no_grad():
            for tiles in ("tile_m=16", "tile_m=32"):
                tuning = f"dispatch=fp8,{tiles}"
                with pytest.raises(ValueError, match=named):
                    moe_forward_prepared(x, idx, w, fp8, tuning=tuning)
                with pytest.raises(ValueError, match=named):
                    fp8_local.moe_forward_fp8_local(x, idx, w, fp8, tuning, check=True)
                with pytest.raises(ValueError, match=named):
                    uniep.moe_forward(x, idx, w, w1, w2, tuning=tuning)
    finally:
        uniep.moe.ep.shutdown(None)


def test_prepared_experts_grow_the_dispatch_runtime_at_world_1() -> None:
    # An eager batch larger than the dispatch's runtime holds (made by a smaller one) grows it,
    # and a layer of another hidden size re-creates it, as moe_forward's calls do; both keep
    # moe_forward's bits.
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts

    x, idx, w, w1, w2 = _case(8, 256, 256, 16, 4, "random", seed=322)
    fp8 = prepare_experts(w1, w2, "fp8")
    try:
        with torch.no_grad():
            moe_forward_prepared(x, idx, w, fp8, tuning="dispatch=fp8")
            held = int(uniep._C.ep_config("")["max_tokens"])
            x, idx, w, _, _ = _case(held + 1, 256, 256, 16, 4, "random", seed=323)
            got = moe_forward_prepared(x, idx, w, fp8, tuning="dispatch=fp8")
            assert int(uniep._C.ep_config("")["max_tokens"]) > held
            assert torch.equal(got, uniep.moe_forward(x, idx, w, w1, w2, tuning="dispatch=fp8"))
            x, idx, w, w1, w2 = _case(8, 512, 256, 16, 4, "random", seed=324)
            got = moe_forward_prepared(
                x, idx, w, prepare_experts(w1, w2, "fp8"), tuning="dispatch=fp8"
            )
            assert int(uniep._C.ep_config("")["hidden"]) == 512
            assert torch.equal(got, uniep.moe_forward(x, idx, w, w1, w2, tuning="dispatch=fp8"))
    finally:
        uniep.moe.ep.shutdown(None)


@pytest.mark.parametrize("case", [0, 2, 4])
def test_rank_partials_sum_the_second_gemms_fp32_outputs(case: int) -> None:
    """moe_forward with combine=rank_partials (at world 1 through the runtime's round): the
    partials of the second GEMM's fp32 sums (grouped_mm with out_dtype float32), rounded once,
    bit for bit; and no less accurate against float64 than the per-k combine, which rounds each
    row first (rank partials of bf16 rows lose about 9% more)."""
    tokens, hidden, ffn, experts, top_k, routing = CASES[case]
    x, idx, w, w1, w2 = _case(tokens, hidden, ffn, experts, top_k, routing, seed=300 + case)
    ops = torch.ops.uniep
    try:
        got = uniep.moe_forward(x, idx, w, w1, w2, tuning="combine=rank_partials")
        res = uniep.moe.ep.dispatch(x, idx, w, tuning="combine=rank_partials")
        rows = res.recv_x.index_select(0, res.handle.row_slot)
        offs = res.tokens_per_expert.cumsum(0).to(torch.int32)
        act = ops.grouped_mm_swiglu(rows, pack_gate_up(w1), offs, "")
        y32 = ops.grouped_mm(act, w2, offs, "", torch.float32)
        assert torch.equal(got, uniep.moe.ep.combine(y32, res.handle)), CASES[case]
        per_k = uniep.moe_forward(x, idx, w, w1, w2)
        ref = moe_reference(x.cpu().double(), idx.cpu(), w.cpu().double(), w1.cpu().double(),
                            w2.cpu().double())  # fmt: skip

        def rms(out: torch.Tensor) -> float:
            return float(((out.cpu().double() - ref) ** 2).mean().sqrt())

        assert rms(got) <= 1.03 * rms(per_k), (CASES[case], rms(got), rms(per_k))
    finally:
        uniep.moe.ep.shutdown(None)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_local_backward_has_the_runtime_paths_bits(case: int) -> None:
    tokens, hidden, ffn, experts, top_k, routing = CASES[case]
    x, idx, w, w1, w2 = _case(tokens, hidden, ffn, experts, top_k, routing, seed=100 + case)
    gen = torch.Generator(device="cuda").manual_seed(case)
    grad_out = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    backward = torch.ops.uniep.moe_backward
    try:
        got = backward(grad_out, x, idx, w, w1, w2, "", "")
        # The runtime's round (rank_partials changes the forward's sum only: the backward's
        # combine of grad_x is per_k whatever the forward's).
        want = backward(grad_out, x, idx, w, w1, w2, "", "combine=rank_partials")
        for name, g, r in zip(("grad_x", "grad_w", "grad_w1", "grad_w2"), got, want, strict=True):
            assert torch.equal(g, r), (CASES[case], name)
        if routing == "unused":
            assert not any(g.any() for g in got)
            return
        # Within bf16 tolerance of float64 autograd.
        leaves = [t.cpu().double().requires_grad_(True) for t in (x, w, w1, w2)]
        ref = moe_reference(leaves[0], idx.cpu(), leaves[1], leaves[2], leaves[3])
        refs = torch.autograd.grad(ref, leaves, grad_out.cpu().double())
        for name, g, r in zip(("grad_x", "grad_w", "grad_w1", "grad_w2"), got, refs, strict=True):
            err = (g.double().cpu() - r).norm() / r.norm().clamp_min(1e-12)
            assert err <= 3e-2, (CASES[case], name, float(err))
    finally:
        uniep.moe.ep.shutdown(None)


def test_empty_batch() -> None:
    x, idx, w, w1, w2 = _case(0, 128, 64, 4, 2, "random", seed=3)
    try:
        assert uniep.moe_forward(x, idx, w, w1, w2).shape == (0, 128)
        grads = torch.ops.uniep.moe_backward(x, x, idx, w, w1, w2, "", "")
        assert grads[0].shape == (0, 128) and grads[1].shape == (0, 2)
        assert not grads[2].any() and not grads[3].any()
    finally:
        uniep.moe.ep.shutdown(None)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
@pytest.mark.parametrize("bad", [4, 900, -2])
def test_a_bad_expert_id_is_named_and_the_next_call_runs(bad: int) -> None:
    x, idx, w, w1, w2 = _case(50, 128, 128, 4, 2, "random", seed=5)
    try:
        good = uniep.moe_forward(x, idx, w, w1, w2)
        wrong = idx.clone()
        wrong[7, 1] = bad
        match = rf"topk_idx contains expert id {bad} at \[7, 1\], outside \[-1, 4\)"
        with pytest.raises(ValueError, match=match):
            uniep.moe_forward(x, wrong, w, w1, w2)
        with pytest.raises(ValueError, match=match):
            uniep.moe_forward(x, wrong, w, w1, w2, tuning="dispatch=fp8")
        with pytest.raises(ValueError, match=match):
            torch.ops.uniep.moe_backward(x, x, wrong, w, w1, w2, "", "")
        assert torch.equal(uniep.moe_forward(x, idx, w, w1, w2), good)
        # A graph cannot hold the host's read of the plan's word: refused before any launch.
        with pytest.raises(NotImplementedError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                uniep.moe_forward(x, idx, w, w1, w2)
        with pytest.raises(NotImplementedError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.ops.uniep.moe_backward(x, x, idx, w, w1, w2, "", "")
        assert torch.equal(uniep.moe_forward(x, idx, w, w1, w2), good)
    finally:
        uniep.moe.ep.shutdown(None)
