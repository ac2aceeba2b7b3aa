"""The MegaKernel across ranks without a GPU: its ops' fake kernels give the output shapes
(torch.compile traces them); the CUDA-only entry points refuse with errors that name what is
missing; and on CPU tensors ``moe_forward_ep`` and ``moe_backward_ep`` run the same plan on the
CPU executor (counts all-gathered, sender rows, rows to their experts' ranks, outputs or
gradients back to their slots) over gloo ranks, within bf16 rounding of a float64 reference, with
a rank of no tokens and unused entries; the backward's gradients across ranks equal its world-1
run on every rank's tokens together bit for bit (an expert's rows come in the same order); one
rank's bad argument, or a size that differs across ranks, raises on every rank, and the executor's
collectives are bounded by UNIEP_TIMEOUT_S."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _moe_cases import bf16_layer
from torch._subclasses.fake_tensor import FakeTensorMode
from uniep.distributed import run_local_ranks
from uniep.gemm import pack_gate_up
from uniep.moe.megakernel import launch as megakernel
from uniep.moe.megakernel.backward import moe_backward_ep
from uniep.reference import moe_reference

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")

HIDDEN, FFN = 64, 32


def test_fake_kernel_gives_the_shapes() -> None:
    with FakeTensorMode():
        x = torch.empty(300, 192, dtype=torch.bfloat16)
        idx = torch.empty(300, 4, dtype=torch.int64)
        w = torch.empty(300, 4, dtype=torch.float32)
        w1p = torch.empty(4, 192, 256, dtype=torch.bfloat16)
        w2 = torch.empty(4, 128, 192, dtype=torch.bfloat16)
        out, error, timeout = torch.ops.uniep.moe_fused_ep(x, idx, w, w1p, w2, "", 132, -1)
        assert out.shape == (300, 192) and out.dtype == torch.bfloat16
        assert error.shape == (1,) and timeout.shape == (5,) and timeout.dtype == torch.int32
        with pytest.raises(ValueError, match="topk_idx must be \\[T = 300, K\\]"):
            torch.ops.uniep.moe_fused_ep(x, idx[:10], w, w1p, w2, "", 132, -1)


def test_backward_fake_kernel_gives_the_shapes() -> None:
    with FakeTensorMode():
        x = torch.empty(300, 192, dtype=torch.bfloat16)
        idx = torch.empty(300, 4, dtype=torch.int64)
        w = torch.empty(300, 4, dtype=torch.float32)
        w1 = torch.empty(4, 192, 256, dtype=torch.bfloat16)
        w2t = torch.empty(4, 192, 128, dtype=torch.bfloat16)
        gx, gw, gw1, gw2, error, timeout = torch.ops.uniep.moe_fused_ep_backward(
            x, x, idx, w, w1, w2t, ""
        )
        assert gx.shape == (300, 192) and gx.dtype == torch.bfloat16
        assert gw.shape == (300, 4) and gw.dtype == torch.float32
        assert gw1.shape == (4, 192, 256) and gw2.shape == (4, 128, 192)
        assert error.shape == (1,) and timeout.shape == (5,)
        with pytest.raises(ValueError, match="topk_idx must be \\[T = 300, K\\]"):
            torch.ops.uniep.moe_fused_ep_backward(x, x, idx[:10], w, w1, w2t, "")


@needs_no_cuda
def test_cuda_entry_points_name_the_missing_gpu() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch and a visible GPU"):
        megakernel.init_fused_ep(max_tokens=8, hidden=64, ffn=64, top_k=2, num_experts=4)
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch"):
        megakernel.fused_ep_heap_bytes(2, 8, 64, 64, 2, 4)
    megakernel.shutdown_fused_ep()  # nothing to destroy: a no-op


def _layer(world: int, experts: int, top_k: int, seed: int):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    tokens = [int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(world)]
    if world > 1:
        tokens[1] = 0  # a rank with no tokens still computes what the others send it
    return bf16_layer(gen, tokens, HIDDEN, FFN, experts, top_k, unused=0.2, scale=8)


def _rank(rank: int, world: int, experts: int, top_k: int) -> float:
    xs, idxs, ws, w1, w2 = _layer(world, experts, top_k, seed=world * 100 + top_k)
    el = experts // world
    mine = slice(rank * el, (rank + 1) * el)
    out = megakernel.moe_forward_ep(
        xs[rank], idxs[rank], ws[rank], pack_gate_up(w1)[mine].contiguous(), w2[mine].contiguous()
    )
    assert out.shape == xs[rank].shape and out.dtype == torch.bfloat16
    # w1 as stored: the same plan and arithmetic, the packing skipped.
    stored = megakernel.moe_forward_ep(
        xs[rank], idxs[rank], ws[rank], w1[mine].contiguous(), w2[mine].contiguous(),
        w1_as_stored=True,
    )  # fmt: skip
    assert torch.equal(stored, out)
    if xs[rank].shape[0] == 0:
        return 0.0
    ref = moe_reference(xs[rank], idxs[rank], ws[rank], w1, w2)
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("world,experts,top_k", [(1, 4, 2), (2, 8, 3), (4, 8, 2)])
def test_cpu_executor_runs_the_plan_across_ranks(world: int, experts: int, top_k: int) -> None:
    if world == 1:
        errors = [_rank(0, 1, experts, top_k)]
    else:
        errors = run_local_ranks(_rank, world, (experts, top_k), timeout_s=120)
    assert max(errors) < 2e-2, errors


def test_cpu_executor_names_a_bad_expert() -> None:
    x = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [5, -1], [1, 0]])  # expert 5 of 2
    w = torch.ones(3, 2)
    w1p = torch.zeros(2, HIDDEN, 2 * FFN, dtype=torch.bfloat16)
    w2 = torch.zeros(2, FFN, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(plan\): entry \(token 1, k 0\) holds an expert id"):
        megakernel.moe_forward_ep(x, idx, w, w1p, w2)
    with pytest.raises(ValueError, match="w2 must be \\[E / W = 2"):
        megakernel.moe_forward_ep(x, idx, w, w1p, w2[:, :16])


def _grad_out(rank: int, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7000 + rank)
    return torch.randn(tokens, HIDDEN, generator=gen).bfloat16()


def _rank_backward(rank: int, world: int, experts: int, top_k: int) -> dict[str, float]:
    xs, idxs, ws, w1, w2 = _layer(world, experts, top_k, seed=world * 100 + top_k + 1)
    el = experts // world
    mine = slice(rank * el, (rank + 1) * el)
    gos = [_grad_out(r, x.shape[0]) for r, x in enumerate(xs)]
    got = moe_backward_ep(
        gos[rank], xs[rank], idxs[rank], ws[rank], w1[mine].contiguous(), w2[mine].contiguous()
    )
    gx, gw, gw1, gw2 = got
    assert gx.shape == xs[rank].shape and gx.dtype == torch.bfloat16
    assert gw.shape == idxs[rank].shape and gw.dtype == torch.float32
    assert bool((gw[idxs[rank] < 0] == 0).all())
    # The world-1 run on every rank's tokens together (a group of this rank alone): the same bits.
    x, idx, w, go = torch.cat(xs), torch.cat(idxs), torch.cat(ws), torch.cat(gos)
    one = got
    if world > 1:
        alone = [dist.new_group([r]) for r in range(world)][rank]  # collective: every rank
        one = moe_backward_ep(go, x, idx, w, w1, w2, alone)
    start = sum(t.shape[0] for t in xs[:rank])
    rows = slice(start, start + xs[rank].shape[0])
    assert torch.equal(gx, one[0][rows]) and torch.equal(gw, one[1][rows])
    assert torch.equal(gw1, one[2][mine]) and torch.equal(gw2, one[3][mine])
    # Against float64 autograd of the whole layer.
    leaves = [t.double().requires_grad_(True) for t in (x, w, w1, w2)]
    ref = moe_reference(leaves[0], idx, leaves[1], leaves[2], leaves[3])
    ref.backward(go.double())
    rx, rw, rw1, rw2 = (t.grad for t in leaves)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        scale = float(b.abs().max())
        return float((a.double() - b).abs().max()) / scale if scale > 0 else float(a.abs().max())

    return {
        "x": err(gx, rx[rows]) if gx.numel() else 0.0,
        "w": err(gw, rw[rows]) if gw.numel() else 0.0,
        "w1": err(gw1, rw1[mine]),
        "w2": err(gw2, rw2[mine]),
    }


@pytest.mark.parametrize("world,experts,top_k", [(1, 4, 2), (2, 8, 3), (4, 8, 2), (2, 16, 9)])
def test_cpu_backward_runs_the_plan_across_ranks(world: int, experts: int, top_k: int) -> None:
    if world == 1:
        reports = [_rank_backward(0, 1, experts, top_k)]
    else:
        reports = run_local_ranks(_rank_backward, world, (experts, top_k), timeout_s=120)
    for report in reports:
        assert max(report.values()) < 3e-2, reports


def test_cpu_backward_names_bad_operands() -> None:
    x = torch.zeros(3, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [5, -1], [1, 0]])  # expert 5 of 2
    w = torch.ones(3, 2)
    w1 = torch.zeros(2, HIDDEN, 2 * FFN, dtype=torch.bfloat16)
    w2 = torch.zeros(2, FFN, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(plan\): entry \(token 1, k 0\) holds an expert id"):
        moe_backward_ep(x, x, idx, w, w1, w2)
    with pytest.raises(ValueError, match="grad_out must be torch.bfloat16 \\[T, H\\]"):
        moe_backward_ep(x[:2], x, idx, w, w1, w2)
    with pytest.raises(ValueError, match="w2 must be \\[E / W = 2"):
        moe_backward_ep(x, x, idx, w, w1, w2[:, :16])


def _bad_call_case(rank: int, case: str) -> str:
    """One call of the CPU executor with rank 1's arguments spoiled as ``case`` says: what it
    raised on this rank (``ValueError: ...``), or ``ok``."""
    el, k, t = 2, 2, 4
    hidden = 32 if case.endswith("hidden") and rank == 1 else HIDDEN
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(t, hidden, generator=gen).bfloat16()
    idx = torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1]])
    w = torch.rand(t, k, generator=gen)
    w1 = torch.randn(el, hidden, 2 * FFN, generator=gen).bfloat16() / 8
    w2 = torch.randn(el, FFN, hidden, generator=gen).bfloat16() / 8
    go = torch.randn(t, hidden, generator=gen).bfloat16()
    if rank == 1:
        if case == "experts":
            w1, w2 = w1[:1].contiguous(), w2[:1].contiguous()
        elif case == "x dtype":
            x = x.float()
        elif case in ("expert id", "backward expert id"):
            idx[2, 1] = 9  # of 4 experts
        elif case == "grad_out dtype":
            go = go.float()
    try:
        if case.startswith("backward") or case == "grad_out dtype":
            moe_backward_ep(go, x, idx, w, w1, w2)
        else:
            megakernel.moe_forward_ep(x, idx, w, w1, w2, w1_as_stored=True)
    except ValueError as e:
        return f"ValueError: {e}"
    return "ok"


_BAD_CALL_CASES = ["hidden", "experts", "x dtype", "expert id", "grad_out dtype",
                   "backward expert id", "backward hidden", "none"]  # fmt: skip


def _bad_calls(rank: int, world: int) -> list[str]:
    import os

    os.environ["UNIEP_TIMEOUT_S"] = "20"
    # In sequence on one group: each failed call leaves the ranks in step for the next.
    return [_bad_call_case(rank, case) for case in _BAD_CALL_CASES]


def test_cpu_executor_raises_one_ranks_bad_call_on_every_rank() -> None:
    """A size that differs across ranks or one rank's bad argument raises ValueError on every
    rank at once, naming it (the call agreement, then the count exchange for expert ids), where
    the ranks aborted in gloo (sizes) or the others waited in a plain collective."""
    from _dist import run_ranks

    got = run_ranks(2, _bad_calls, timeout=90)
    results = {case: (got[0][i], got[1][i]) for i, case in enumerate(_BAD_CALL_CASES)}
    for case in ("hidden", "backward hidden"):
        for message in results[case]:
            assert "hidden (x.size(1)) differs across ranks: rank 0 has 64, rank 1 has 32" in (
                message
            ), (case, message)
    for message in results["experts"]:
        assert "experts per rank (w2.size(0)) differs across ranks" in message, message
    theirs, mine = results["x dtype"]
    assert "rank 1 failed its argument checks" in theirs and "x must be bfloat16" in theirs
    assert mine.startswith("ValueError: moe_forward_ep: x must be bfloat16"), mine
    for case, what in (("expert id", "moe_forward_ep"), ("backward expert id", "moe_backward_ep")):
        theirs, mine = results[case]
        entry = f"{what} (plan): entry (token 2, k 1) holds an expert id outside [-1, num_experts)"
        assert f"rank 1 failed its checks: {entry}" in theirs, theirs
        assert mine.startswith(f"ValueError: {entry}"), mine
    theirs, mine = results["grad_out dtype"]
    assert "rank 1 failed its argument checks" in theirs and "grad_out must be" in theirs
    assert "moe_backward_ep: grad_out must be torch.bfloat16" in mine, mine
    assert results["none"] == ("ok", "ok"), results["none"]


def _subgroup_bad_expert(rank: int, world: int) -> str:
    """4 ranks; on the sub-group {1, 3}, global rank 3 (the group's rank 1) routes to an expert
    that does not exist; {0, 2} runs the same call with good routing."""
    import os

    import torch.distributed as dist

    os.environ["UNIEP_TIMEOUT_S"] = "20"
    odd, even = dist.new_group([1, 3]), dist.new_group([0, 2])
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, HIDDEN, generator=gen).bfloat16()
    idx = torch.tensor([[0, 3], [1, -1], [2, 0], [3, 1]])
    if rank == 3:
        idx[2, 1] = 9  # of 4 experts
    w1 = torch.randn(2, HIDDEN, 2 * FFN, generator=gen).bfloat16() / 8
    w2 = torch.randn(2, FFN, HIDDEN, generator=gen).bfloat16() / 8
    try:
        megakernel.moe_forward_ep(
            x, idx, torch.rand(4, 2, generator=gen), w1, w2, odd if rank % 2 else even,
            w1_as_stored=True,
        )  # fmt: skip
    except ValueError as e:
        return str(e)
    return "ok"


def test_cpu_executor_names_a_subgroups_ranks_globally_too() -> None:
    """The count exchange's message names the failing rank by its number in the call's group;
    on a sub-group it says which global ranks those numbers are."""
    from _dist import run_ranks

    got = run_ranks(4, _subgroup_bad_expert, timeout=90)
    assert got[0] == got[2] == "ok", got
    assert "rank 1 failed its checks" in got[1], got[1]
    assert "whose ranks 0, 1, ... are global ranks 1, 3" in got[1], got[1]
    assert "global ranks" not in got[3] and "expert id outside" in got[3], got[3]


def _plan_without_peer(rank: int, world: int) -> str:
    import os
    import time

    os.environ["UNIEP_TIMEOUT_S"] = "2"
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1]])
    w1 = torch.zeros(1, HIDDEN, 2 * FFN, dtype=torch.bfloat16)
    w2 = torch.zeros(1, FFN, HIDDEN, dtype=torch.bfloat16)
    if rank == 1:
        # Agrees on the call, then never joins the count exchange (a rank that failed between
        # the two): its peer must not wait for gloo's own timeout.
        megakernel.agree_cpu_call(
            "moe_forward", "moe_forward_ep", None, x, idx, w1, w2, lambda: None
        )
        time.sleep(4)
        return "skipped"
    start = time.monotonic()
    try:
        megakernel.moe_forward_ep(x, idx, torch.ones(2, 2), w1, w2, w1_as_stored=True)
    except RuntimeError as e:
        return f"{time.monotonic() - start:.1f} s: {e}"
    return "no error"


def test_cpu_executor_bounds_its_collectives() -> None:
    """The CPU executor's collectives after the agreement wait at most ``UNIEP_TIMEOUT_S``, then
    raise naming the exchange."""
    from _dist import run_ranks

    got, _ = run_ranks(2, _plan_without_peer, timeout=60)
    assert "moe_forward_ep: the count exchange on rank 0" in got and "UNIEP_TIMEOUT_S" in got, got
    assert float(got.split(" s:")[0]) < 5, got
