"""UniEP's grouped GEMM (``torch.ops.uniep.grouped_mm``, cpp/cuda/gemm/grouped) against
``torch._grouped_mm`` and a float64 reference.

Same semantics as ``torch._grouped_mm(x [R, K], w [E, K, N], offs [E] int32)``: expert e multiplies
rows [offs[e-1], offs[e]) of x by w[e]. Checked here: empty experts, one-row experts, row counts
that fill no tile, K and N that are multiples of 8 or 64 but not of 128, 1 to 300 experts, R = 0;
the same bits run to run and for an expert computed on its own; capture in a CUDA graph (offs
read on the device at replay); a malformed offs staying in bounds; named errors.
"""

from __future__ import annotations

import pytest
import torch
import uniep  # noqa: F401  (registers torch.ops.uniep)

pytestmark = [pytest.mark.gpu, pytest.mark.hopper]


def _op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # Poison first: a freed block of the output's size, full of NaN, is what the caching
    # allocator hands the op, so a row the kernel misses shows up as NaN.
    poison = torch.full((x.shape[0], w.shape[2]), float("nan"), device="cuda", dtype=x.dtype)
    del poison
    return torch.ops.uniep.grouped_mm(x, w, offs)


def _operands(
    counts: list[int], k: int, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(len(counts), k, n, generator=gen, device="cuda") * k**-0.5).bfloat16()
    offs = torch.tensor(counts, device="cuda", dtype=torch.int64).cumsum(0).to(torch.int32)
    return x, w, offs


def _reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """float64, expert by expert, written for clarity."""
    out = torch.zeros(x.shape[0], w.shape[2], device=x.device, dtype=torch.float64)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        out[lo:hi] = x[lo:hi].double() @ w[e].double()
        lo = hi
    return out


def _assert_bf16_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    assert not got.isnan().any(), "rows left unwritten (NaN poison) or NaN results"
    # One bf16 rounding of an fp32 sum of O(1) values: 2^-8 relative, plus accumulation noise.
    torch.testing.assert_close(got.double(), ref, rtol=1.6e-2, atol=2e-2)


def _random_counts(num_experts: int, max_rows: int, seed: int, empty_every: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_rows + 1, (num_experts,), generator=gen).tolist()
    if empty_every:
        counts = [0 if e % empty_every == 0 else c for e, c in enumerate(counts)]
    return counts


CASES = {
    "one-expert": ([200], 256, 128),
    "empty-experts": ([0, 5, 0, 0, 130, 0], 128, 256),
    "one-row-experts": ([1] * 17, 512, 384),
    "odd-rows": ([3, 127, 129, 255, 1, 77], 1024, 512),
    "k-n-multiples-of-64": ([100, 200, 64, 1], 192, 320),
    "k-n-multiples-of-8": ([33, 150, 9], 72, 136),
    "many-experts": (_random_counts(300, 40, 1, empty_every=7), 256, 256),
    "dsv3-like": (_random_counts(32, 600, 2), 2048, 1024),
    "last-experts-empty": ([64, 64, 0, 0], 128, 128),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_and_torch(name: str) -> None:
    counts, k, n = CASES[name]
    x, w, offs = _operands(counts, k, n, seed=len(counts) + k + n)
    out = _op(x, w, offs)
    assert out.shape == (sum(counts), n)
    ref = _reference(x, w, offs)
    _assert_bf16_close(out, ref)
    _assert_bf16_close(torch._grouped_mm(x, w, offs=offs), ref)


def test_no_rows() -> None:
    x, w, offs = _operands([0, 0, 0], 128, 256, seed=3)
    out = _op(x, w, offs)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def test_bits_run_to_run() -> None:
    x, w, offs = _operands(_random_counts(64, 300, 4, empty_every=5), 1024, 768, seed=4)
    first = _op(x, w, offs)
    for _ in range(3):
        assert torch.equal(_op(x, w, offs), first)


def test_bits_independent_of_the_other_experts() -> None:
    # No split-K, and a row's K loop is the same wherever it sits in a tile: an expert's rows
    # computed alone (other offsets, other tiles) have the bits they have in the full call.
    counts = [70, 0, 300, 129, 1]
    x, w, offs = _operands(counts, 512, 256, seed=5)
    whole = _op(x, w, offs)
    lo = 0
    for e, c in enumerate(counts):
        if c:
            alone = _op(
                x[lo : lo + c], w[e : e + 1], torch.tensor([c], device="cuda", dtype=torch.int32)
            )
            assert torch.equal(alone, whole[lo : lo + c]), e
        lo += c


def test_cuda_graph_reads_offs_at_replay() -> None:
    # No host sync: the op can be captured, and the row counts are read when the graph runs.
    x, w, offs = _operands([100, 100, 56], 256, 128, seed=6)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.uniep.grouped_mm(x, w, offs)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.uniep.grouped_mm(x, w, offs)
    for counts in ([100, 100, 56], [0, 256, 0], [1, 2, 253]):
        offs.copy_(torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _assert_bf16_close(out, _reference(x, w, offs))


def test_malformed_offs_stay_in_bounds() -> None:
    # offs is device data: the kernel clamps each end to [0, R] and to the largest earlier end
    # instead of reading it on the host. Here [5, 3, 100] on R = 10 acts as [5, 5, 10].
    x, w, _ = _operands([10, 0, 0], 128, 128, seed=7)
    bad = torch.tensor([5, 3, 100], device="cuda", dtype=torch.int32)
    out = _op(x, w, bad)
    clamped = torch.tensor([5, 5, 10], device="cuda", dtype=torch.int32)
    _assert_bf16_close(out, _reference(x, w, clamped))


def test_named_errors() -> None:
    x, w, offs = _operands([32, 32], 64, 64, seed=8)
    op = torch.ops.uniep.grouped_mm
    with pytest.raises(ValueError, match="x must be bfloat16"):
        op(x.float(), w, offs)
    with pytest.raises(ValueError, match="w must be bfloat16"):
        op(x, w.float(), offs)
    with pytest.raises(ValueError, match="offs must be int32"):
        op(x, w, offs.long())
    with pytest.raises(ValueError, match="x must be 2-D"):
        op(x[None], w, offs)
    with pytest.raises(ValueError, match="w must be 3-D"):
        op(x, w[0], offs)
    with pytest.raises(ValueError, match="offs must have E = w.size.0. = 2 entries, got 3"):
        op(x, w, torch.cat([offs, offs[-1:]]))
    with pytest.raises(ValueError, match=r"w must be \[E, K, N\] with K = x.size.1. = 64"):
        op(x, w[:, :32], offs)
    with pytest.raises(ValueError, match="offs must be on x's device"):
        op(x, w, offs.cpu())
    with pytest.raises(ValueError, match="x must be contiguous"):
        op(x.t().contiguous().t(), w, offs)
    with pytest.raises(ValueError, match="w must be contiguous"):
        op(x, w.repeat(1, 1, 2)[:, :, : w.shape[2]], offs)  # rows 2N apart: neither layout
    x60, w60, offs60 = _operands([16], 60, 64, seed=9)
    with pytest.raises(NotImplementedError, match=r"K = x.size.1. must be a multiple of 8.*got 60"):
        op(x60, w60, offs60)
    x_, w_, offs_ = _operands([16], 64, 60, seed=10)
    with pytest.raises(NotImplementedError, match=r"N = w.size.2. must be a multiple of 8.*got 60"):
        op(x_, w_, offs_)


def test_opcheck() -> None:
    x, w, offs = _operands([40, 0, 88], 128, 192, seed=11)
    torch.library.opcheck(torch.ops.uniep.grouped_mm, (x, w, offs))


# Every compiled configuration, as a tuning request (include/uniep/cuda/grouped_gemm.hpp).
CONFIGS = [
    "tile_m=128,tile_n=256,tile_k=64",
    "tile_m=64,tile_n=128,tile_k=128",
    "tile_m=128,tile_n=128,tile_k=64",
    "tile_m=256,tile_n=128,tile_k=64",
    "tile_m=64,tile_n=256,tile_k=64,cluster=2",
    # The same tile in clusters of one (the automatic choice for experts of at most 256 rows).
    "tile_m=64,tile_n=256,tile_k=64,cluster=1",
]


@pytest.mark.parametrize(
    "counts,k,n",
    [
        (_random_counts(40, 300, 12, empty_every=6), 1024, 768),
        ([1, 0, 129, 64, 511, 3], 192, 320),  # K, N multiples of 64 but not 128
        (_random_counts(260, 20, 13, empty_every=3), 256, 136),  # hundreds of tiny experts
    ],
)
def test_bits_identical_across_configurations(counts: list[int], k: int, n: int) -> None:
    # No split-K, one K order: the tile shape, cluster and schedule must not change a bit.
    x, w, offs = _operands(counts, k, n, seed=sum(counts))
    auto = _op(x, w, offs)
    _assert_bf16_close(auto, _reference(x, w, offs))
    for tuning in CONFIGS:
        got = torch.ops.uniep.grouped_mm(x, w, offs, tuning)
        assert torch.equal(got, auto), tuning


def test_fp32_output_is_the_bf16_output_unrounded() -> None:
    """out_dtype=float32 stores the accumulator as is: the bf16 output is it rounded once (round
    to nearest even, as torch's cast), on every configuration; rows past offs stay unwritten and
    the others hold no NaN. moe_forward's second GEMM under combine=rank_partials."""
    counts = _random_counts(24, 150, 21, empty_every=5)
    x, w, offs = _operands(counts, 256, 384, seed=21)
    auto = _op(x, w, offs)
    poison = torch.full((x.shape[0], 384), float("nan"), device="cuda")
    del poison
    out32 = torch.ops.uniep.grouped_mm(x, w, offs, "", torch.float32)
    assert out32.dtype == torch.float32 and not out32.isnan().any()
    assert torch.equal(out32.bfloat16(), auto)
    torch.testing.assert_close(out32.double(), _reference(x, w, offs), rtol=1e-4, atol=1e-4)
    for tuning in CONFIGS:
        got = torch.ops.uniep.grouped_mm(x, w, offs, tuning, torch.float32)
        assert torch.equal(got, out32), tuning
    # A K-major w (the transpose of a contiguous [E, N, K]) is copied for the fp32 store.
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(torch.ops.uniep.grouped_mm(x, wt, offs, "", torch.float32), out32)
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float32"):
        torch.ops.uniep.grouped_mm(x, w, offs, "", torch.float16)
    torch.library.opcheck(torch.ops.uniep.grouped_mm, (x, w, offs, "", torch.float32))


def test_partial_requests_and_unknown_combinations() -> None:
    x, w, offs = _operands([50, 70], 128, 128, seed=14)
    auto = _op(x, w, offs)
    # A partial request takes the first configuration that matches it.
    for tuning in ("tile_m=256", "tile_n=256", "tile_k=128", "tile_m=64,tile_n=256"):
        assert torch.equal(torch.ops.uniep.grouped_mm(x, w, offs, tuning), auto), tuning
    with pytest.raises(
        ValueError,
        match=r"no grouped GEMM configuration has tile_m=32(.|\n)*tile_m=128,tile_n=256,tile_k=64",
    ):
        torch.ops.uniep.grouped_mm(x, w, offs, "tile_m=32")
    with pytest.raises(ValueError, match="stages=1"):
        torch.ops.uniep.grouped_mm(x, w, offs, "stages=1")
    # A cluster the tile was not compiled in is named, with the tile asked for or chosen.
    with pytest.raises(
        ValueError, match=r"(?s)no grouped GEMM configuration has tile_m=128.*cluster=1 \(0: any"
    ):
        torch.ops.uniep.grouped_mm(x, w, offs, "tile_m=128,tile_n=256,cluster=1")
    with pytest.raises(ValueError, match=r"cluster=1: the automatic choice for this shape"):
        torch.ops.uniep.grouped_mm(x, w, offs, "cluster=1")  # 64 x 128 here, in clusters of two
    assert torch.equal(torch.ops.uniep.grouped_mm(x, w, offs, "cluster=2"), auto)
    with pytest.raises(ValueError, match="tuning: gemm must be uniep or torch"):
        torch.ops.uniep.grouped_mm(x, w, offs, "gemm=cublas")


SWIGLU_CASES = {
    "one-expert": ([200], 256, 128),
    "empty-and-one-row": ([0, 1, 0, 130, 1], 128, 256),
    "odd-rows": ([3, 127, 129, 255, 1, 77], 512, 512),
    "k-multiple-of-64": ([100, 200, 64, 1], 192, 320),
    "many-experts": (_random_counts(300, 40, 15, empty_every=7), 256, 128),
    "dsv3-like": (_random_counts(32, 600, 16), 2048, 1024),
    "ffn-multiple-of-64-not-128": ([5, 300, 0, 77, 1], 256, 384),
}


@pytest.mark.parametrize("name", sorted(SWIGLU_CASES))
def test_swiglu_epilogue(name: str) -> None:
    from uniep.gemm import grouped_mm_swiglu, pack_gate_up

    counts, k, two_i = SWIGLU_CASES[name]
    x, w1, offs = _operands(counts, k, two_i, seed=len(counts) + k + 3 * two_i)
    i = two_i // 2
    act = grouped_mm_swiglu(x, pack_gate_up(w1), offs)
    assert act.shape == (sum(counts), i) and act.dtype == torch.bfloat16
    assert not act.isnan().any(), "rows left unwritten (NaN poison) or NaN results"
    # The unfused chain's numerics: h stored in bf16, silu(g) * u in fp32, rounded once.
    h = _op(x, w1, offs).float()
    chain = (torch.nn.functional.silu(h[:, :i]) * h[:, i:]).bfloat16()
    torch.testing.assert_close(act.float(), chain.float(), rtol=8e-3, atol=1e-3)
    # And the float64 truth within bf16 error.
    ref = _reference(x, w1, offs)
    truth = torch.nn.functional.silu(ref[:, :i]) * ref[:, i:]
    torch.testing.assert_close(act.double(), truth, rtol=3e-2, atol=3e-2)
    # Every configuration, and every run, gives the same bits.
    for tuning in CONFIGS:
        assert torch.equal(grouped_mm_swiglu(x, pack_gate_up(w1), offs, tuning), act), tuning
    assert torch.equal(grouped_mm_swiglu(x, pack_gate_up(w1), offs), act)
    if i % 64 == 0:
        _check_plain_gate_up(x, w1, offs, act)


def _check_plain_gate_up(
    x: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor, act: torch.Tensor
) -> None:
    """w1 as stored gives the packed layout's bits, in every configuration whose tile holds
    whole 64-column (gate, up) pairs of the FFN size; the others are a named error."""
    from uniep.gemm import grouped_mm_swiglu_plain

    i = w1.shape[2] // 2
    poison = torch.full_like(act, float("nan"))
    del poison
    assert torch.equal(grouped_mm_swiglu_plain(x, w1, offs), act)
    # A partial request takes the first matching configuration whose tile fits.
    for tuning in ("tile_m=128", "tile_m=64", "tile_k=64"):
        assert torch.equal(grouped_mm_swiglu_plain(x, w1, offs, tuning), act), tuning
    for tuning in CONFIGS:
        tile_n = int(tuning.split("tile_n=")[1].split(",")[0])
        if i % (tile_n // 2) == 0:
            assert torch.equal(grouped_mm_swiglu_plain(x, w1, offs, tuning), act), tuning
        else:
            with pytest.raises(NotImplementedError, match=rf"multiple of tile_n / 2.*{tile_n}"):
                grouped_mm_swiglu_plain(x, w1, offs, tuning)


def test_swiglu_plain_w1_runs_to_run_and_errors() -> None:
    from uniep.gemm import grouped_mm_swiglu_plain, pack_gate_up

    counts = _random_counts(64, 300, 21, empty_every=9)
    x, w1, offs = _operands(counts, 512, 768, seed=22)
    act = grouped_mm_swiglu_plain(x, w1, offs)
    assert torch.equal(act, torch.ops.uniep.grouped_mm_swiglu(x, pack_gate_up(w1), offs))
    assert torch.equal(grouped_mm_swiglu_plain(x, w1, offs), act)
    # The experts are read from one tensor by index: a slice of experts reads its own.
    lo = int(offs[31])
    sub = grouped_mm_swiglu_plain(x[lo:], w1[32:].contiguous(), offs[32:] - lo)
    assert torch.equal(sub[: int(offs[-1]) - lo], act[lo : int(offs[-1])])
    with pytest.raises(NotImplementedError, match=r"I = w1.size\(2\) / 2 a multiple of 64.*320"):
        grouped_mm_swiglu_plain(x[:, :128].contiguous(), w1[:, :128, :320].contiguous(), offs)
    with pytest.raises(ValueError, match="w1 must be contiguous"):
        grouped_mm_swiglu_plain(x, w1.transpose(1, 2).contiguous().transpose(1, 2), offs)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        grouped_mm_swiglu_plain(x.float(), w1, offs)
    torch.library.opcheck(torch.ops.uniep.grouped_mm_swiglu_plain, (x[:40], w1, offs.clamp(max=40)))


def test_swiglu_named_errors() -> None:
    x, w, offs = _operands([16, 16], 64, 24, seed=17)
    with pytest.raises(NotImplementedError, match=r"2I = w.size.2. a multiple of 16.*got 24"):
        torch.ops.uniep.grouped_mm_swiglu(x, w, offs)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        torch.ops.uniep.grouped_mm_swiglu(x.float(), w, offs)
    x, w, offs = _operands([16, 16], 64, 32, seed=18)
    torch.library.opcheck(torch.ops.uniep.grouped_mm_swiglu, (x, w, offs))


BACKWARD_CASES = {
    "empty-and-one-row": ([0, 1, 0, 130, 1], 128, 256),
    "odd-rows": ([3, 127, 129, 255, 1, 77], 512, 384),
    "k-n-multiples-of-64": ([100, 200, 64, 1], 192, 320),
    "many-experts": (_random_counts(260, 30, 19, empty_every=5), 256, 128),
    "dsv3-like": (_random_counts(32, 600, 20), 2048, 1024),
}


@pytest.mark.parametrize("name", sorted(BACKWARD_CASES))
def test_dgrad_and_wgrad(name: str) -> None:
    from uniep.gemm import grouped_mm_dgrad, grouped_mm_wgrad

    counts, k, n = BACKWARD_CASES[name]
    x, w, offs = _operands(counts, k, n, seed=len(counts) + 5 * k + n)
    gen = torch.Generator(device="cuda").manual_seed(21)
    dy = torch.randn(x.shape[0], n, generator=gen, device="cuda").bfloat16()
    # The gradient of the input: dy w[e]^T, against float64.
    poison = torch.full((x.shape[0], k), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison
    dx = grouped_mm_dgrad(dy, w, offs)
    assert dx.shape == x.shape and not dx.isnan().any()
    ref_dx = _reference(dy, w.transpose(1, 2), offs)
    torch.testing.assert_close(dx.double(), ref_dx, rtol=1.6e-2, atol=2e-2)
    # The gradient of the weight: x[rows]^T dy[rows], zeros for the empty experts.
    poison = torch.full((len(counts), k, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison
    dw = grouped_mm_wgrad(x, dy, offs)
    assert dw.shape == w.shape and not dw.isnan().any()
    ref_dw = torch.zeros(w.shape, device="cuda", dtype=torch.float64)
    lo = 0
    for e, c in enumerate(counts):
        ref_dw[e] = x[lo : lo + c].double().T @ dy[lo : lo + c].double()
        lo += c
    scale = max(1.0, max(counts) ** 0.5)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1.6e-2, atol=2e-2 * scale)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(dw[e]) == 0, e
    # And what torch._grouped_mm's autograd gives, within bf16 error; the same bits every run.
    xr = x.detach().requires_grad_(True)
    wr = w.detach().requires_grad_(True)
    torch._grouped_mm(xr, wr, offs=offs).backward(dy)
    torch.testing.assert_close(dx.float(), xr.grad.float(), rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), wr.grad.float(), rtol=1.6e-2, atol=2e-2 * scale)
    assert torch.equal(grouped_mm_dgrad(dy, w, offs), dx)
    # The small-expert tile in either cluster (on the large-expert tile a request is ignored).
    for cluster in ("cluster=1", "cluster=2"):
        assert torch.equal(grouped_mm_dgrad(dy, w, offs, cluster), dx), cluster
    assert torch.equal(grouped_mm_wgrad(x, dy, offs), dw)


def test_backward_named_errors_and_opcheck() -> None:
    x, w, offs = _operands([16, 16], 64, 32, seed=22)
    dy = torch.ones(32, 32, device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.uniep
    with pytest.raises(ValueError, match=r"w must be \[E, K, N\] with N = dy.size.1. = 24"):
        ops.grouped_mm_dgrad(dy[:, :24].contiguous(), w, offs)
    with pytest.raises(ValueError, match="dy must have the R = 32 rows of x"):
        ops.grouped_mm_wgrad(x, dy[:16], offs)
    with pytest.raises(ValueError, match="dy must be bfloat16"):
        ops.grouped_mm_dgrad(dy.float(), w, offs)
    torch.library.opcheck(ops.grouped_mm_dgrad, (dy, w, offs))
    torch.library.opcheck(ops.grouped_mm_wgrad, (x, dy, offs))


FP8_CASES = {
    "empty-and-one-row": ([0, 1, 0, 130, 1], 256, 256),
    "odd-rows": ([3, 127, 129, 255, 1, 77], 512, 384),
    "many-experts": (_random_counts(260, 30, 23, empty_every=5), 256, 128),
    "dsv3-like": (_random_counts(32, 600, 24), 2048, 1024),
    # Odd k-block counts, one included: the mainloop promotes k-block t - 1 while t runs, in
    # pairs of partial sums, and ends on either of the pair.
    "one-k-block": ([70, 0, 129], 128, 256),
    "three-k-blocks": ([5, 200, 0, 64], 384, 256),
}


@pytest.mark.parametrize("name", sorted(FP8_CASES))
def test_fp8_grouped_gemm(name: str) -> None:
    from uniep.gemm import (
        dequantize_expert_weights,
        dequantize_rows,
        grouped_mm_fp8,
        quantize_expert_weights,
        quantize_rows,
    )

    counts, k, n = FP8_CASES[name]
    x, w, offs = _operands(counts, k, n, seed=len(counts) + 7 * k + n)
    xq, xs = quantize_rows(x)
    wq, ws = quantize_expert_weights(w)
    poison = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison
    out = grouped_mm_fp8(xq, xs, wq, ws, offs)
    assert out.shape == (x.shape[0], n) and out.dtype == torch.bfloat16
    assert not out.isnan().any(), "rows left unwritten (NaN poison) or NaN results"
    # Against float64 of the dequantized operands: only fp32 accumulation and bf16 rounding.
    ref_q = _reference(dequantize_rows(xq, xs), dequantize_expert_weights(wq, ws), offs)
    torch.testing.assert_close(out.double(), ref_q, rtol=1.6e-2, atol=2e-2)
    # Against the bf16 operands' product: the fp8 quantization error, within the goal of 5e-2.
    ref = _reference(x, w, offs)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel <= 5e-2, rel
    assert torch.equal(grouped_mm_fp8(xq, xs, wq, ws, offs), out)
    # Every compiled tile walks k in the same 128-deep blocks: the same bits, the swapped tiles
    # (tile_m=16 and 32: the weights' columns on the MMA's M side) included.
    for tuning in (
        "tile_m=128",
        "tile_m=64",
        "tile_m=64,tile_n=128,tile_k=128",
        "tile_m=16",
        "tile_m=32",
    ):
        assert torch.equal(grouped_mm_fp8(xq, xs, wq, ws, offs, tuning), out), tuning
    # out_dtype=float32: the same sums before their rounding, on the tiles that are not swapped.
    out32 = grouped_mm_fp8(xq, xs, wq, ws, offs, "", torch.float32)
    assert out32.dtype == torch.float32 and torch.equal(out32.bfloat16(), out)
    for tuning in ("tile_m=128", "tile_m=64"):
        got = grouped_mm_fp8(xq, xs, wq, ws, offs, tuning, torch.float32)
        assert torch.equal(got, out32), tuning
    with pytest.raises(ValueError, match="no fp8 grouped GEMM configuration has tile_m=16"):
        grouped_mm_fp8(xq, xs, wq, ws, offs, "tile_m=16", torch.float32)


@pytest.mark.parametrize("name", ["empty-and-one-row", "odd-rows", "many-experts"])
def test_fp8_swiglu_epilogue_on_packed_w1_gives_the_chain_s_bits(name: str) -> None:
    # SwiGLU in the first fp8 GEMM's epilogue on w1 packed by pack_gate_up_fp8, then the
    # activation's quantization, against the plain GEMM and swiglu_fp8: the same bytes on every
    # compiled tile that has the epilogue (uniep.moe.prepared's fp8 experts take the former).
    from uniep.gemm import (
        grouped_mm_fp8,
        grouped_mm_fp8_swiglu,
        pack_gate_up_fp8,
        quantize_expert_weights,
        quantize_rows,
        swiglu_fp8,
    )

    counts, k, n = FP8_CASES[name]
    n = 2 * max(n, 256)  # 2I with I a multiple of 128: the activation's 1 x 128 scales
    x, w, offs = _operands(counts, k, n, seed=41 + len(counts))
    xq, xs = quantize_rows(x)
    wq, ws = quantize_expert_weights(w)
    routed = int(offs[-1])
    act_q, act_s = swiglu_fp8(grouped_mm_fp8(xq, xs, wq, ws, offs)[:routed].contiguous())
    pq, ps = pack_gate_up_fp8(wq, ws)
    for tuning in ("", "tile_m=128", "tile_m=64"):
        act = grouped_mm_fp8_swiglu(xq, xs, pq, ps, offs, tuning)
        assert act.shape == (x.shape[0], n // 2) and act.dtype == torch.bfloat16
        got_q, got_s = torch.ops.uniep.quantize_fp8(act[:routed].contiguous())
        assert torch.equal(got_q.view(torch.uint8), act_q.view(torch.uint8)), tuning
        assert torch.equal(got_s, act_s), tuning
    with pytest.raises(ValueError, match=r"w_scales must be \[E, K / 128, N / 64\]"):
        grouped_mm_fp8_swiglu(xq, xs, pq, ws, offs)
    with pytest.raises(ValueError, match="no fp8 grouped GEMM configuration has tile_m=16"):
        grouped_mm_fp8_swiglu(xq, xs, pq, ps, offs, "tile_m=16")


def test_fp8_named_errors() -> None:
    from uniep.gemm import quantize_expert_weights, quantize_rows

    x, w, offs = _operands([64, 64], 256, 128, seed=25)
    xq, xs = quantize_rows(x)
    wq, ws = quantize_expert_weights(w)
    op = torch.ops.uniep.grouped_mm_fp8
    with pytest.raises(ValueError, match="x must be float8_e4m3fn"):
        op(x, xs, wq, ws, offs)
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\] with K = x.size.1. = 256"):
        op(xq, xs, wq.transpose(1, 2).contiguous(), ws, offs)
    with pytest.raises(ValueError, match=r"x_scales must be \[R, K / 128\]"):
        op(xq, xs[:, :1].contiguous(), wq, ws, offs)
    # A tile the fp8 kernels lack is named with the compiled ones, also for a call of no rows.
    for rows in (x.shape[0], 0):
        with pytest.raises(
            ValueError,
            match=r"(?s)no fp8 grouped GEMM configuration has tile_m=0,"
            r"tile_n=256.*tile_m=128,tile_n=128,tile_k=128",
        ):
            op(xq[:rows], xs[:rows], wq, ws, offs.clamp(max=rows), "tile_n=256")
    with pytest.raises(ValueError, match=r"no fp8 grouped GEMM configuration has .*cluster=2"):
        op(xq, xs, wq, ws, offs, "cluster=2")
    # Not test_schema: its mutation check compares fp8 tensors with allclose, which torch does
    # not implement for float8_e4m3fn.
    torch.library.opcheck(
        op,
        (xq, xs, wq, ws, offs),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_k_major_weights_run_without_a_copy() -> None:
    # w [E, K, N] as the transpose of a contiguous [E, N, K] (HF's gate_up_proj layout) runs as
    # the data-gradient kind's product, reading w K-major: the same values, and the same bits
    # as the contiguous w (one fp32 sum over K in the same k-step order).
    counts = [70, 0, 300, 129, 1]
    x, w, offs = _operands(counts, 512, 256, seed=26)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not w_t.is_contiguous() and w_t.transpose(1, 2).is_contiguous()
    got = _op(x, w_t, offs)
    _assert_bf16_close(got, _reference(x, w, offs))
    assert torch.equal(got, _op(x, w, offs))


def test_swiglu_fp8_one_pass() -> None:
    # The fp8 layer's activation in one pass: SwiGLU rounded to bf16, then the row quantization
    # (1x128 scales), against the same two steps in torch on the device and the float64 truth.
    from uniep.gemm import dequantize_rows, quantize_rows, swiglu_fp8

    gen = torch.Generator(device="cuda").manual_seed(31)
    h = (torch.randn(1000, 2 * 640, generator=gen, device="cuda") * 4).bfloat16()
    h[7, :640] = 0  # an all-zero activation row: scales 1, zeros
    act, scales = swiglu_fp8(h)
    assert act.shape == (1000, 640) and scales.shape == (1000, 5)
    assert torch.equal(scales[7], torch.ones(5, device="cuda")) and not act[7].float().any()
    g, u = h[:, :640].float(), h[:, 640:].float()
    q, s = quantize_rows((g / (1.0 + torch.exp(-g)) * u).bfloat16())
    assert act.view(torch.uint8).eq(q.view(torch.uint8)).float().mean() >= 0.999
    torch.testing.assert_close(scales, s, rtol=2**-7, atol=0)
    truth = g.double() * torch.sigmoid(g.double()) * u.double()
    err = (dequantize_rows(act, scales).double() - truth).abs()
    assert bool((err <= 0.07 * truth.abs() + scales.repeat_interleave(128, 1).double() / 32).all())
    again = swiglu_fp8(h)
    assert torch.equal(again[0].view(torch.uint8), act.view(torch.uint8))
    assert torch.equal(again[1], scales)
    with pytest.raises(ValueError, match="I a multiple of 128"):
        swiglu_fp8(h[:, :192].contiguous())
    with pytest.raises(ValueError, match="h must be contiguous"):
        swiglu_fp8(h[:, :512])


def test_quantize_fp8_op_on_cuda_gives_the_cpu_kernel_s_bytes() -> None:
    # The op's CUDA kernel (the fp8 dispatch's encoding) against its CPU kernel byte for byte,
    # with zero blocks, one huge value and bf16 extremes; an empty batch; its errors by name.
    gen = torch.Generator().manual_seed(32)
    x = (torch.randn(333, 7 * 128, generator=gen) * 30).bfloat16()
    x[5, 128:256] = 0.0
    x[6, 0] = 3.0e38
    x[7, 300] = -1e-30
    q, scales = torch.ops.uniep.quantize_fp8(x.cuda())
    cq, cs = torch.ops.uniep.quantize_fp8(x)
    assert torch.equal(q.cpu().view(torch.uint8), cq.view(torch.uint8))
    assert torch.equal(scales.cpu(), cs)
    eq, es = torch.ops.uniep.quantize_fp8(x[:0].cuda())
    assert eq.shape == (0, 7 * 128) and es.shape == (0, 7)
    with pytest.raises(ValueError, match="x must be contiguous"):
        torch.ops.uniep.quantize_fp8(x.cuda()[:, :256])
    with pytest.raises(ValueError, match="multiple of 128 columns"):
        torch.ops.uniep.quantize_fp8(x.cuda()[:, :200].contiguous())


def test_quantize_fp8_rows_on_cuda_gives_the_cpu_kernel_s_rows() -> None:
    # Every row an entry names holds the CPU kernel's bytes and scales; a row past the rows is
    # named in the error word as on the CPU (one bad entry, so no race picks another).
    gen = torch.Generator().manual_seed(33)
    tokens, top_k, cols = 37, 8, 7 * 128
    x = (torch.randn(tokens, cols, generator=gen) * 30).bfloat16()
    x[5, 128:256] = 0.0
    gemm_row = torch.randperm(tokens * top_k, generator=gen).reshape(tokens, top_k)
    gemm_row[3, 2] = -1
    gemm_row[9, 0] = -1
    named = gemm_row[gemm_row >= 0]
    for rows_in in (gemm_row, torch.where(gemm_row == named.max(), tokens * top_k, gemm_row)):
        q, scales, error = torch.ops.uniep.quantize_fp8_rows(x.cuda(), rows_in.cuda())
        cq, cs, ce = torch.ops.uniep.quantize_fp8_rows(x, rows_in)
        kept = rows_in[(rows_in >= 0) & (rows_in < tokens * top_k)]
        assert torch.equal(q.cpu()[kept].view(torch.uint8), cq[kept].view(torch.uint8))
        assert torch.equal(scales.cpu()[kept], cs[kept])
        assert int(error) == int(ce)
        # Without report: the same rows, no word.
        q2, s2, unreported = torch.ops.uniep.quantize_fp8_rows(
            x.cuda(), rows_in.cuda(), report=False
        )
        assert unreported.shape == (0,)
        assert torch.equal(q2.cpu()[kept].view(torch.uint8), cq[kept].view(torch.uint8))
        assert torch.equal(s2.cpu()[kept], cs[kept])
    assert int(ce) != 0
    with pytest.raises(ValueError, match="x must be contiguous"):
        torch.ops.uniep.quantize_fp8_rows(x.cuda()[:, :256], gemm_row.cuda())
    with pytest.raises((ValueError, RuntimeError), match="gemm_row"):
        torch.ops.uniep.quantize_fp8_rows(x.cuda(), gemm_row)  # on the CPU


def test_backward_elementwise_op_matches_the_torch_chain() -> None:
    # moe_backward's one-pass step against the torch chain it replaces (fp32, op by op).
    ops = torch.ops.uniep
    gen = torch.Generator(device="cuda").manual_seed(41)
    rows, ffn, hidden = 777, 392, 520  # ffn a multiple of 8 but not of 32 x 8: a ragged lane
    h = (torch.randn(rows, 2 * ffn, generator=gen, device="cuda") * 3).bfloat16()
    grad_act = torch.randn(rows, ffn, generator=gen, device="cuda").bfloat16()
    w = torch.rand(rows, generator=gen, device="cuda")
    w[5] = 0.0  # a zero routing weight: zero gradients, its dot still computed
    act_w, grad_h, dots = ops.swiglu_backward(h, grad_act, w)
    g, u, ga = h[:, :ffn].float(), h[:, ffn:].float(), grad_act.float()
    sig = torch.sigmoid(g)
    act = (g * sig * u).bfloat16().float()
    gw = ga * w.unsqueeze(1)
    ref_act_w = (act * w.unsqueeze(1)).bfloat16()
    ref_grad = torch.cat([gw * u * sig * (1 + g * (1 - sig)), gw * g * sig], dim=1).bfloat16()
    for got, ref in ((act_w, ref_act_w), (grad_h, ref_grad)):
        assert got.view(torch.int16).eq(ref.view(torch.int16)).float().mean() >= 0.999
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1e-5)
    assert not grad_h[5].float().any() and not act_w[5].float().any()
    exact = (act.double() * ga.double()).sum(1)
    torch.testing.assert_close(dots.double(), exact, rtol=1e-5, atol=1e-3)
    assert dots[5] != 0

    # The dot is the routing weight's gradient: <act, grad_out w2^T> = <grad_out, act w2>.
    w2 = (torch.randn(ffn, hidden, generator=gen, device="cuda") / ffn**0.5).bfloat16()
    go = torch.randn(rows, hidden, generator=gen, device="cuda").bfloat16()
    g = go.float() @ w2.float().t()
    _, _, via_act = ops.swiglu_backward(h, g.bfloat16(), w)
    via_y = (go.double() * (act.double() @ w2.double())).sum(1)
    # Rounding g to bf16 moves each term by at most 2^-9 of itself (2^-8: margin for fp32 sums).
    bound = (act.double() * g.double()).abs().sum(1) * 2**-8
    assert bool(((via_act.double() - via_y).abs() <= bound).all())

    again = ops.swiglu_backward(h, grad_act, w)
    for a, b in zip(again, (act_w, grad_h, dots), strict=True):
        assert torch.equal(a, b)
    empty = ops.swiglu_backward(h[:0], grad_act[:0], w[:0])
    assert [tuple(t.shape) for t in empty] == [(0, ffn), (0, 2 * ffn), (0,)]
    with pytest.raises(ValueError, match=r"h must be \[R, 2I\] for grad_act"):
        ops.swiglu_backward(h[:, :256].contiguous(), grad_act, w)
    with pytest.raises(ValueError, match=r"w must be \[R\]"):
        ops.swiglu_backward(h, grad_act, w[:-1])
    with pytest.raises(ValueError, match="w must be contiguous float32"):
        ops.swiglu_backward(h, grad_act, w.double())


def test_wgrad_bits_do_not_depend_on_its_tile() -> None:
    """The weight gradient takes ping-pong 64 x 256 tiles for experts of 512 rows or more (by
    x's rows, the most offs may describe) and cooperative 128 x 256 ones below: rows padded past
    offs[-1], which no expert reads, switch the tile and must change no bit."""
    from uniep.gemm import grouped_mm_wgrad

    counts, k, n = [100, 0, 37, 300], 256, 384  # 437 rows over 4 experts: cooperative tiles
    x, _, offs = _operands(counts, k, n, seed=23)
    gen = torch.Generator(device="cuda").manual_seed(24)
    dy = torch.randn(x.shape[0], n, generator=gen, device="cuda").bfloat16()
    coop = grouped_mm_wgrad(x, dy, offs)
    pad = 512 * len(counts) - x.shape[0]
    x_pad = torch.cat([x, torch.randn(pad, k, generator=gen, device="cuda").bfloat16()])
    dy_pad = torch.cat([dy, torch.randn(pad, n, generator=gen, device="cuda").bfloat16()])
    assert torch.equal(grouped_mm_wgrad(x_pad, dy_pad, offs), coop)
