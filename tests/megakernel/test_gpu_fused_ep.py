"""The MegaKernel across ranks (``uniep.moe.megakernel.launch.moe_forward_ep``, include/uniep/cuda/
fused_ep.hpp): the count exchange, the plan and one persistent launch per rank that stores rows
into the experts' ranks' GEMM rows, computes the local experts gated tile by tile, and reduces
the rank's tokens from the expert outputs where they were computed.

Here with one NCCL process per GPU (marker ``multigpu``, >= 2 Hopper GPUs, up to 4);
tests/moe/test_gpu_on_one_gpu.py runs the same workers with 2 and 4 ranks sharing one GPU over gloo
(their kernels take turns on it, so the peer paths and waits run, not the speed). Checked on
every rank: the output equals ``moe_forward_local`` on the same tokens with every expert's
weights bit for bit (every CTA sending in token order, or a few in the GEMMs' order; run to
run, call after call on one runtime), for random routings with unused entries, a routing that
sends everything to one rank's experts, a rank with no tokens, top-1 and top-9; a rank that skips
a call makes the others raise a timeout naming it instead of hanging. Both tile heights (128 and
the 64 the runtime picks for these sizes). A call captured in a CUDA graph and replayed on new
tokens, between eager calls, gives the same bits (the epoch and parity live on the device).

The fused backward across ranks (``uniep.moe.megakernel.backward.moe_backward_ep``, on a runtime
made with ``backward=True``): on every rank its gradients equal ``moe_backward_local`` on every
rank's tokens together with every expert's weights bit for bit (slices of grad_x, grad_topk_weights
and the rank's experts' weight gradients), run to run and with forward calls between, on
random routings with unused entries, a rank with no tokens, every entry on one rank's experts
and top-9; through autograd (``uniep.moe_forward(..., tuning="overlap=fused")``) too; the op
``moe_backward`` with ``overlap=fused`` equals its ``overlap=sequential`` (the EP runtime's
separate launches) bit for bit; a rank that skips a backward makes the others raise a timeout
naming it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from _hardware import is_hopper
from _moe_cases import bf16_layer

pytestmark = pytest.mark.multigpu

HIDDEN, FFN = 192, 128  # multiples of 64, not of 128
MAX_TOKENS = 512


def _world() -> int:
    if not is_hopper():
        return 0
    return min(torch.cuda.device_count(), 4)


def _case(kind: str, world: int, experts: int, top_k: int, seed: int):  # noqa: ANN202
    """Every rank's tokens, routing and weights, and every expert's weights (CPU, same on all)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen)) for _ in range(world)]
    if kind == "empty_rank":
        tokens[1] = 0
    # "one_rank": every entry on rank 0's experts.
    below = experts // world if kind == "one_rank" else None
    return bf16_layer(
        gen, tokens, HIDDEN, FFN, experts, top_k, unused=0.15, scale=16, route_below=below
    )


CASES = [  # kind, experts, top_k, tile_m (None: the runtime's choice, fused_tile_m's)
    ("random", 16, 4, 128),
    ("one_rank", 16, 4, 64),
    ("empty_rank", 32, 8, None),
    ("random", 8, 1, 128),
    ("random", 32, 9, 64),
]


def _device(rank: int) -> torch.device:
    # One GPU per rank, or every rank on the one GPU (test_gpu_on_one_gpu.py).
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def fused_ep_worker(rank: int, world: int) -> dict[str, object]:
    from uniep import _C, distributed
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel

    dev = _device(rank)
    report: dict[str, object] = {}
    # One runtime per case, each on a group of its own, all alive to the end: NVSHMEM stays up
    # (finalising it and starting it again in one process is not supported).
    groups = []
    for seed, (kind, experts, top_k, tile_m) in enumerate(CASES):
        el = experts // world
        group = dist.new_group(list(range(world)))
        groups.append(group)
        megakernel.init_fused_ep(
            group, max_tokens=MAX_TOKENS, hidden=HIDDEN, ffn=FFN, top_k=top_k,
            num_experts=experts, tile_m=tile_m,
        )  # fmt: skip
        tiles = _C.fused_ep_config(distributed.group_name(group))["tile_m"]
        # Both heights named on every device; the runtime's own choice depends on the device's
        # memory bandwidth (uniep.gemm.pingpong_rows).
        auto = megakernel.fused_tile_m(world * MAX_TOKENS * top_k, experts, dev)
        assert tiles == (tile_m or auto), (kind, tiles)
        xs, idxs, ws, w1, w2 = _case(kind, world, experts, top_k, seed)
        x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
        w1p_all, w2_all = pack_gate_up(w1.to(dev)), w2.to(dev)
        mine = slice(rank * el, (rank + 1) * el)
        w1p, w2l = w1p_all[mine].contiguous(), w2_all[mine].contiguous()
        ref = megakernel.moe_forward_local(x, idx, w, w1p_all, w2_all) if x.shape[0] else None
        outs = [
            megakernel.moe_forward_ep(x, idx, w, w1p, w2l, group),
            megakernel.moe_forward_ep(x, idx, w, w1p, w2l, group),  # run to run, next epoch
            # Every CTA sending first, in token order.
            megakernel.moe_forward_ep(x, idx, w, w1p, w2l, group, comm_sms=10_000),
            # Fewer senders than CTAs: the send in the GEMMs' order, overlapping their tiles.
            megakernel.moe_forward_ep(x, idx, w, w1p, w2l, group, comm_sms=8),
            megakernel.moe_forward_ep(x, idx, w, w1p, w2l, group, comm_sms=32, skip_rounds=3),
            # w1 as stored (no packed copy): GEMM 1 reads its 64-column gate/up blocks.
            megakernel.moe_forward_ep(
                x, idx, w, w1.to(dev)[mine].contiguous(), w2l, group, w1_as_stored=True
            ),
        ]
        if tiles == 64:  # the decode shape: 64 x 128 tiles in clusters of one
            outs.append(megakernel.moe_forward_ep(x, idx, w, w1p, w2l, group, tile_n=128))
            outs.append(
                megakernel.moe_forward_ep(
                    x,
                    idx,
                    w,
                    w1.to(dev)[mine].contiguous(),
                    w2l,
                    group,
                    w1_as_stored=True,
                    tile_n=128,
                )  # fmt: skip
            )
        for i, out in enumerate(outs):
            assert out.shape == x.shape, (kind, i, out.shape)
            if ref is not None:
                assert torch.equal(out, ref), (
                    f"{kind}: call {i} differs from moe_forward_local by "
                    f"{(out.float() - ref.float()).abs().max().item()}"
                )
        report[f"{kind}-{experts}-{top_k}"] = x.shape[0]
    for group in groups:
        megakernel.shutdown_fused_ep(group)
    return report


def fused_ep_graph_worker(rank: int, world: int) -> int:
    """Decode steps as a CUDA graph: one captured call replayed on new tokens, an eager call after
    each replay (the device's epoch carries on across both); every output equals the world-1
    kernel with every expert's weights."""
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel

    dev = _device(rank)
    experts, top_k, tokens = 16, 4, 96
    el = experts // world
    megakernel.init_fused_ep(
        max_tokens=tokens, hidden=HIDDEN, ffn=FFN, top_k=top_k, num_experts=experts
    )
    gen = torch.Generator().manual_seed(50)
    w1p_all = pack_gate_up((torch.randn(experts, HIDDEN, 2 * FFN, generator=gen) / 16).bfloat16())
    w2_all = (torch.randn(experts, FFN, HIDDEN, generator=gen) / 16).bfloat16()
    w1p_all, w2_all = w1p_all.to(dev), w2_all.to(dev)
    mine = slice(rank * el, (rank + 1) * el)
    w1p, w2l = w1p_all[mine].contiguous(), w2_all[mine].contiguous()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
        idx = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
        idx[torch.rand(tokens, top_k, generator=g) < 0.1] = -1
        return x.to(dev), idx.to(dev), torch.rand(tokens, top_k, generator=g).to(dev)

    sx, sidx, sw = batch(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch asks
        megakernel.moe_forward_ep(sx, sidx, sw, w1p, w2l, check=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = megakernel.moe_forward_ep(sx, sidx, sw, w1p, w2l, check=False)
    for step in (1, 2, 3):
        x, idx, w = batch(step)
        sx.copy_(x)
        sidx.copy_(idx)
        sw.copy_(w)
        graph.replay()
        ref = megakernel.moe_forward_local(x, idx, w, w1p_all, w2_all)
        assert torch.equal(out, ref), f"replay {step} differs from the world-1 kernel"
        eager = megakernel.moe_forward_ep(x, idx, w, w1p, w2l)
        assert torch.equal(eager, ref), f"the eager call after replay {step} differs"
    torch.cuda.synchronize()
    dist.barrier()
    megakernel.shutdown_fused_ep()
    return 3


def check_fused_ep_reports(reports: list[dict[str, object]], world: int) -> None:
    assert len(reports) == world
    assert reports[1]["empty_rank-32-8"] == 0
    for report in reports:
        assert sorted(report) == sorted(f"{k}-{e}-{t}" for k, e, t, _ in CASES), report


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 Hopper GPUs")
def test_fused_ep_equals_the_local_kernel_bit_for_bit() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(fused_ep_worker, _world(), backend="nccl", timeout_s=600)
    check_fused_ep_reports(reports, _world())


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 Hopper GPUs")
def test_fused_ep_replays_in_a_cuda_graph() -> None:
    from uniep.distributed import run_local_ranks

    assert (
        run_local_ranks(fused_ep_graph_worker, _world(), backend="nccl", timeout_s=300)
        == [3] * _world()
    )


def fused_ep_skip_worker(rank: int, world: int) -> str:
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel

    dev = _device(rank)
    experts, top_k = 8, 2
    el = experts // world
    megakernel.init_fused_ep(
        max_tokens=64, hidden=HIDDEN, ffn=FFN, top_k=top_k, num_experts=experts, timeout_s=3.0
    )
    x = torch.randn(64, HIDDEN, device=dev).bfloat16()
    idx = torch.randint(0, experts, (64, top_k), device=dev)
    w = torch.rand(64, top_k, device=dev)
    w1p = pack_gate_up((torch.randn(el, HIDDEN, 2 * FFN, device=dev) / 16).bfloat16())
    w2 = (torch.randn(el, FFN, HIDDEN, device=dev) / 16).bfloat16()
    megakernel.moe_forward_ep(x, idx, w, w1p, w2)  # every rank: call 1
    message = "no error"
    if rank != world - 1:  # the last rank skips call 2
        try:
            megakernel.moe_forward_ep(x, idx, w, w1p, w2)
        except TimeoutError as e:
            message = str(e)
    dist.barrier()
    megakernel.shutdown_fused_ep()
    return message


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 Hopper GPUs")
def test_a_rank_that_skips_a_call_is_named() -> None:
    from uniep.distributed import run_local_ranks

    world = _world()
    messages = run_local_ranks(fused_ep_skip_worker, world, backend="nccl", timeout_s=300)
    check_skip_messages(messages, world)


def check_skip_messages(messages: list[str], world: int) -> None:
    assert messages[-1] == "no error", messages
    for rank, message in enumerate(messages[:-1]):
        assert f"rank {world - 1} never joined the count exchange of call 2" in message, (
            rank,
            message,
        )


BACKWARD_CASES = [  # kind, experts, top_k, tile_m of the runtime (the backward's tiles are 128)
    ("random", 16, 4, 128),
    ("empty_rank", 32, 8, None),
    ("one_rank", 16, 4, 64),
    ("random", 32, 9, 64),
]


def _check_grads(
    got: tuple[torch.Tensor, ...], what: str, *, want: tuple[torch.Tensor, ...], case: str
) -> None:
    names = ("grad_x", "grad_w", "grad_w1", "grad_w2")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape, f"{case}: {what}: {name} is {tuple(a.shape)}, not {b.shape}"
        if torch.equal(a, b):
            continue
        diff = (a.float() - b.float()).abs()
        raise AssertionError(
            f"{case}: {what}: {name} differs from moe_backward_local by up to "
            f"{diff.max().item()} in {int((diff > 0).sum())} of {diff.numel()} entries (its "
            f"largest entry {b.float().abs().max().item()})"
        )


def fused_ep_backward_worker(rank: int, world: int) -> dict[str, object]:
    import uniep
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel
    from uniep.moe.megakernel.backward import moe_backward_ep, moe_backward_local

    dev = _device(rank)
    report: dict[str, object] = {}
    groups = []
    for seed, (kind, experts, top_k, tile_m) in enumerate(BACKWARD_CASES):
        el = experts // world
        group = dist.new_group(list(range(world)))
        groups.append(group)
        megakernel.init_fused_ep(
            group, max_tokens=MAX_TOKENS, hidden=HIDDEN, ffn=FFN, top_k=top_k,
            num_experts=experts, tile_m=tile_m, backward=True,
        )  # fmt: skip
        xs, idxs, ws, w1, w2 = _case(kind, world, experts, top_k, seed + 20)
        gos = [
            torch.randn(x.shape, generator=torch.Generator().manual_seed(900 + r)).bfloat16()
            for r, x in enumerate(xs)
        ]
        x, idx, w, go = (t[rank].to(dev) for t in (xs, idxs, ws, gos))
        w1d, w2d = w1.to(dev), w2.to(dev)
        mine = slice(rank * el, (rank + 1) * el)
        w1l, w2l = w1d[mine].contiguous(), w2d[mine].contiguous()
        start = sum(t.shape[0] for t in xs[:rank])
        rows = slice(start, start + x.shape[0])
        every = [torch.cat(t).to(dev) for t in (gos, xs, idxs, ws)]
        ref = moe_backward_local(*every, w1d, w2d, overlap="fused")
        want = (ref[0][rows], ref[1][rows], ref[2][mine], ref[3][mine])

        check = functools.partial(_check_grads, want=want, case=kind)
        check(moe_backward_ep(go, x, idx, w, w1l, w2l, group), "call 1")
        check(moe_backward_ep(go, x, idx, w, w1l, w2l, group), "call 2 (run to run)")
        out = megakernel.moe_forward_ep(x, idx, w, pack_gate_up(w1l), w2l, group)
        if x.shape[0]:
            fwd = megakernel.moe_forward_local(x, idx, w, pack_gate_up(w1d), w2d)
            assert torch.equal(out, fwd), f"{kind}: the forward between the backwards differs"
        check(moe_backward_ep(go, x, idx, w, w1l, w2l, group), "call 4 (after a forward)")
        if kind == "random" and top_k == 4:
            # Autograd: moe_forward with overlap=fused across ranks, then its fused backward.
            leaves = [t.clone().requires_grad_(True) for t in (x, w, w1l, w2l)]
            y = uniep.moe_forward(
                leaves[0], idx, leaves[1], leaves[2], leaves[3], group, tuning="overlap=fused"
            )
            y.backward(go)
            check(tuple(t.grad for t in leaves), "autograd")
            report["autograd"] = True
        report[f"{kind}-{experts}-{top_k}"] = x.shape[0]
    for group in groups:
        megakernel.shutdown_fused_ep(group)
    return report


def check_fused_ep_backward_reports(reports: list[dict[str, object]], world: int) -> None:
    assert len(reports) == world
    assert reports[1]["empty_rank-32-8"] == 0
    for report in reports:
        assert report.pop("autograd") is True, report
        assert sorted(report) == sorted(f"{k}-{e}-{t}" for k, e, t, _ in BACKWARD_CASES), report


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 Hopper GPUs")
def test_fused_ep_backward_equals_the_local_backward_bit_for_bit() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(fused_ep_backward_worker, _world(), backend="nccl", timeout_s=600)
    check_fused_ep_backward_reports(reports, _world())


def fused_ep_backward_op_worker(rank: int, world: int) -> int:
    """``torch.ops.uniep.moe_backward`` with ``overlap=fused`` across ranks (the fused runtime made
    on first use, with the backward's buffers) against ``overlap=sequential`` (the separate
    launches on the group's EP runtime): the same bits, call after call."""
    import uniep

    dev = _device(rank)
    experts, top_k = 16, 4
    el = experts // world
    uniep.moe.ep.init_runtime(
        max_tokens=MAX_TOKENS, hidden=HIDDEN, top_k=top_k, num_experts=experts
    )
    xs, idxs, ws, w1, w2 = _case("random", world, experts, top_k, 40)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).bfloat16().to(dev)
    mine = slice(rank * el, (rank + 1) * el)
    w1l, w2l = w1[mine].contiguous().to(dev), w2[mine].contiguous().to(dev)
    name = uniep.distributed.group_name(None)
    seq = torch.ops.uniep.moe_backward(go, x, idx, w, w1l, w2l, name, "overlap=sequential")
    for call in range(2):
        fused = torch.ops.uniep.moe_backward(go, x, idx, w, w1l, w2l, name, "overlap=fused")
        _check_grads(fused, f"call {call}", want=seq, case="overlap=fused vs sequential")
    torch.cuda.synchronize()
    dist.barrier()
    from uniep.moe.megakernel import launch as megakernel

    megakernel.shutdown_fused_ep()
    uniep.moe.ep.shutdown()
    return 2


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 Hopper GPUs")
def test_fused_ep_backward_op_equals_sequential() -> None:
    from uniep.distributed import run_local_ranks

    world = _world()
    reports = run_local_ranks(fused_ep_backward_op_worker, world, backend="nccl", timeout_s=300)
    assert reports == [2] * world


def fused_ep_backward_skip_worker(rank: int, world: int) -> str:
    from uniep.moe.megakernel import launch as megakernel
    from uniep.moe.megakernel.backward import moe_backward_ep

    dev = _device(rank)
    experts, top_k = 8, 2
    el = experts // world
    megakernel.init_fused_ep(
        max_tokens=64, hidden=HIDDEN, ffn=FFN, top_k=top_k, num_experts=experts, timeout_s=3.0,
        backward=True,
    )  # fmt: skip
    x = torch.randn(64, HIDDEN, device=dev).bfloat16()
    go = torch.randn(64, HIDDEN, device=dev).bfloat16()
    idx = torch.randint(0, experts, (64, top_k), device=dev)
    w = torch.rand(64, top_k, device=dev)
    w1 = (torch.randn(el, HIDDEN, 2 * FFN, device=dev) / 16).bfloat16()
    w2 = (torch.randn(el, FFN, HIDDEN, device=dev) / 16).bfloat16()
    moe_backward_ep(go, x, idx, w, w1, w2)  # every rank: call 1
    message = "no error"
    if rank != world - 1:  # the last rank skips call 2
        try:
            moe_backward_ep(go, x, idx, w, w1, w2)
        except TimeoutError as e:
            message = str(e)
    dist.barrier()
    megakernel.shutdown_fused_ep()
    return message


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 Hopper GPUs")
def test_a_rank_that_skips_a_backward_is_named() -> None:
    from uniep.distributed import run_local_ranks

    world = _world()
    messages = run_local_ranks(fused_ep_backward_skip_worker, world, backend="nccl", timeout_s=300)
    check_skip_messages(messages, world)
