"""The MegaKernel across ranks without a GPU: its op's fake kernel gives the output shapes
(torch.compile traces it); the CUDA-only entry points refuse with errors that name what is
missing; and on CPU tensors ``moe_forward_ep`` runs the same plan on the CPU executor (counts
all-gathered, sender rows, rows to their experts' ranks, outputs back to their slots) over gloo
ranks, within bf16 rounding of a float64 reference, with a rank of no tokens and unused entries."""

from __future__ import annotations

import pytest
import torch
from _moe_cases import bf16_layer
from torch._subclasses.fake_tensor import FakeTensorMode
from uniep import megakernel
from uniep.distributed import run_local_ranks
from uniep.gemm import pack_gate_up
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
