"""GPU expert-parallel runtime: dispatch/combine kernels against the CPU planner and executor.

Needs >= 2 CUDA GPUs (marker `multigpu`); skipped cleanly elsewhere. Each test spawns one NCCL
process per GPU (up to 4) and batches its cases into that one spawn.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _ep_grad_case import ragged_tokens

pytestmark = pytest.mark.multigpu

HIDDEN = 1152  # not a power of two; a multiple of 128 (fp8 blocks)
FFN = 256
EXPERTS = 16
TOP_K = 8
MAX_TOKENS = 256


def _world() -> int:
    return min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0


def _device(rank: int) -> torch.device:
    """This rank's GPU: its own under NCCL, or one shared by every rank (test_gpu_on_one_gpu)."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _routing(kind: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        idx = torch.rand(tokens, EXPERTS, generator=gen).topk(TOP_K, dim=1).indices
        drop = torch.rand(tokens, TOP_K, generator=gen) < 0.2
        return torch.where(drop, torch.full_like(idx, -1), idx)
    if kind == "one_expert":
        idx = torch.full((tokens, TOP_K), -1, dtype=torch.long)
        idx[:, 0] = 0
        return idx
    if kind == "top1":
        idx = torch.full((tokens, TOP_K), -1, dtype=torch.long)
        idx[:, 3] = torch.randint(0, EXPERTS, (tokens,), generator=gen)
        return idx
    raise ValueError(kind)


def _case(kind: str, world: int, seed: int) -> tuple[list[torch.Tensor], ...]:
    """Every rank's inputs, generated identically on all ranks."""
    gen = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(world):
        tokens = 0 if (kind == "empty_rank" and r == 1) else ragged_tokens(MAX_TOKENS, r)
        idx = _routing("random" if kind == "empty_rank" else kind, tokens, gen)
        xs.append(torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16))
        idxs.append(idx)
        ws.append(torch.rand(tokens, TOP_K, generator=gen))
    return xs, idxs, ws


def _planned_rows(
    xs: list[torch.Tensor], idxs: list[torch.Tensor], rank: int
) -> tuple[dict, torch.Tensor]:
    """The CPU planner's plan for `rank` and the rows it receives, in slot order."""
    from uniep import _C

    plan = _C.build_rank_plan([i.numpy() for i in idxs], EXPERTS, rank)
    offsets = plan["recv_offsets"]
    rows = [
        xs[int(np.searchsorted(offsets, slot, side="right") - 1)][token]
        for slot, token in enumerate(plan["recv_src_token"])
    ]
    return plan, torch.stack(rows) if rows else torch.empty(0, HIDDEN).bfloat16()


def _expected_combine(ybuf: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ybuf [T, K, H] (the row of each (t, k)): out[t] = sum_k w*y over valid k, k ascending,
    one fp32 rounding per product and sum."""
    acc = torch.zeros(ybuf.shape[0], ybuf.shape[2], dtype=torch.float32)
    for k in range(ybuf.shape[1]):
        term = w[:, k : k + 1] * ybuf[:, k, :].float()
        acc = torch.where((idx[:, k] >= 0).unsqueeze(1), acc + term, acc)
    return acc.to(torch.bfloat16)


def _expected_rank_partials(
    ybuf: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts_per_rank: int, world: int
) -> torch.Tensor:
    """combine=rank_partials: per expert rank, sum_k w*y over its k's ascending (fp32), rounded
    to bf16; then those partials summed in ascending rank order (fp32). ybuf [T, K, H]."""
    owner = torch.where(idx >= 0, idx // experts_per_rank, -1)
    out = torch.zeros(ybuf.shape[0], ybuf.shape[2], dtype=torch.float32)
    for r in range(world):
        part = torch.zeros_like(out)
        for k in range(ybuf.shape[1]):
            term = w[:, k : k + 1] * ybuf[:, k, :].float()
            part = torch.where((owner[:, k] == r).unsqueeze(1), part + term, part)
        went = (owner == r).any(1, keepdim=True)
        out = torch.where(went, out + part.to(torch.bfloat16).float(), out)
    return out.to(torch.bfloat16)


def _rows_of_my_slots(
    y: torch.Tensor, row_target: torch.Tensor, rank: int, world: int, tokens: int, group: object
) -> torch.Tensor:
    """Every rank's expert rows (y, CPU) placed at the (token, k) slot of this rank they answer:
    [tokens * TOP_K, HIDDEN] in y's dtype."""
    per_rank_slots = MAX_TOKENS * TOP_K
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, (y, row_target.cpu()), group=group)
    ybuf = torch.zeros(tokens * TOP_K, HIDDEN, dtype=y.dtype)
    for ys, targets in gathered:  # type: ignore[misc]
        mine = targets // per_rank_slots == rank
        ybuf[targets[mine] % per_rank_slots] = ys[mine]
    return ybuf


def _ep_worker(rank: int, world: int) -> dict[str, object]:
    import uniep
    from uniep import _C

    dev = _device(rank)
    cpu_group = dist.new_group(backend="gloo")
    uniep.moe.ep.init_runtime(
        max_tokens=MAX_TOKENS, hidden=HIDDEN, top_k=TOP_K, num_experts=EXPERTS
    )
    report: dict[str, object] = {}
    el = EXPERTS // world
    for seed, kind in enumerate(("random", "one_expert", "empty_rank", "top1")):
        xs, idxs, ws = _case(kind, world, seed)
        x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)

        # Dispatch: rows bit-identical to the CPU planner's slots, whatever the SM budget.
        plan, expected = _planned_rows(xs, idxs, rank)
        per_rank_slots = MAX_TOKENS * TOP_K
        for sms in (24, 8, 32):
            res = uniep.moe.ep.dispatch(x, idx, w, tuning=f"sms={sms}")
            assert torch.equal(res.recv_x.cpu(), expected), (kind, sms)
            assert torch.equal(res.recv_src.cpu(), torch.from_numpy(plan["recv_src_token"]))
            assert torch.equal(res.handle.row_slot.cpu(), torch.from_numpy(plan["row_slot"]))
            target = plan["row_src_rank"] * per_rank_slots + plan["row_combine_slot"]
            assert torch.equal(res.handle.row_target.cpu(), torch.from_numpy(target))
            assert torch.equal(
                res.tokens_per_expert.cpu(), torch.from_numpy(np.diff(plan["row_offsets"]))
            )

        # fp8: the in-kernel cast gives the CPU executor's e4m3 bytes and block scales.
        res8 = uniep.moe.ep.dispatch(x, idx, w, tuning="sms=24,dispatch=fp8")
        q, scales = _C.encode_fp8_rows(expected.float().numpy())
        assert res8.recv_x.dtype == torch.float8_e4m3fn
        assert torch.equal(res8.recv_x.cpu().view(torch.uint8), torch.from_numpy(q)), kind
        assert torch.equal(res8.recv_scales.cpu(), torch.from_numpy(scales)), kind

        # Combine: bit-identical across SM budgets and runs, and to the ascending-k fp32 sum.
        gen = torch.Generator().manual_seed(1000 + seed)
        rows = res.handle.row_slot.numel()
        y = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16)
        outs = []
        for sms in (24, 8, 32, 24):
            res = uniep.moe.ep.dispatch(x, idx, w, tuning=f"sms={sms}")
            outs.append(uniep.moe.ep.combine(y.to(dev), res.handle).cpu())
        assert all(torch.equal(outs[0], o) for o in outs[1:]), kind
        ybuf = _rows_of_my_slots(y, res.handle.row_target, rank, world, idx.shape[0], cpu_group)
        want = _expected_combine(ybuf.view(-1, TOP_K, HIDDEN), idxs[rank], ws[rank])
        assert torch.equal(outs[0], want), kind

        # combine=rank_partials: bit-identical across SM budgets and runs, in its documented
        # order; y's rows in any order (row_target names each).
        parts = []
        for sms in (24, 8, 32, 24):
            res = uniep.moe.ep.dispatch(x, idx, w, tuning=f"sms={sms},combine=rank_partials")
            perm = torch.randperm(rows, generator=gen)
            handle = dataclasses.replace(res.handle, row_target=res.handle.row_target[perm.to(dev)])
            parts.append(uniep.moe.ep.combine(y[perm].to(dev), handle).cpu())
        uniep.moe.ep.check()
        assert all(torch.equal(parts[0], o) for o in parts[1:]), kind
        want_parts = _expected_rank_partials(
            ybuf.view(-1, TOP_K, HIDDEN), idxs[rank], ws[rank], el, world
        )
        assert torch.equal(parts[0], want_parts), kind
        # ... and on fp32 rows (moe_forward's: the second GEMM's sums, not rounded), the same
        # order over the fp32 values: one rounding, in the partial.
        y32 = torch.randn(rows, HIDDEN, generator=gen) * 3
        parts32 = []
        for sms in (24, 8):
            res = uniep.moe.ep.dispatch(x, idx, w, tuning=f"sms={sms},combine=rank_partials")
            parts32.append(uniep.moe.ep.combine(y32.to(dev), res.handle).cpu())
        uniep.moe.ep.check()
        assert parts32[0].dtype == torch.bfloat16 and torch.equal(parts32[0], parts32[1]), kind
        ybuf32 = _rows_of_my_slots(y32, res.handle.row_target, rank, world, idx.shape[0], cpu_group)
        want32 = _expected_rank_partials(
            ybuf32.view(-1, TOP_K, HIDDEN), idxs[rank], ws[rank], el, world
        )
        assert torch.equal(parts32[0], want32), kind
        # per_k sends rows as they are: fp32 rows are refused, naming the mode.
        res = uniep.moe.ep.dispatch(x, idx, w, tuning="sms=24")
        with pytest.raises(ValueError, match="float32 with combine=rank_partials"):
            uniep.moe.ep.combine(y32.to(dev), res.handle)
        uniep.moe.ep.combine(y.to(dev), res.handle)  # the round still needs its combine

        # moe_forward on GPU: within bf16 tolerance of the CPU executor, bits stable.
        gen = torch.Generator().manual_seed(2000 + seed)
        w1_all = (torch.randn(EXPERTS, HIDDEN, 2 * FFN, generator=gen) / HIDDEN**0.5).bfloat16()
        w2_all = (torch.randn(EXPERTS, FFN, HIDDEN, generator=gen) / FFN**0.5).bfloat16()
        w1 = w1_all[rank * el : (rank + 1) * el].contiguous()
        w2 = w2_all[rank * el : (rank + 1) * el].contiguous()
        name = uniep.distributed.group_name()
        gpu = [
            torch.ops.uniep.moe_forward(x, idx, w, w1.to(dev), w2.to(dev), name, f"sms={s}")
            for s in (24, 8, 24)
        ]
        assert all(torch.equal(gpu[0], g) for g in gpu[1:]), kind
        cpu = torch.ops.uniep.moe_forward(
            xs[rank], idxs[rank], ws[rank], w1, w2, cpu_group.group_name, ""
        )
        err = (gpu[0].cpu().float() - cpu.float()).norm() / cpu.float().norm().clamp_min(1e-6)
        assert err <= 1e-2, (kind, float(err))
        report[kind] = float(err)
        # Backward on GPU against the CPU executor's (same inputs, bf16 tolerance): the engine's
        # C++ op (also after an fp8 forward dispatch, and with the rank_partials combine named)
        # and the torch._grouped_mm path composed in Python.
        grad_out = torch.randn(idx.shape[0], HIDDEN, generator=gen).to(torch.bfloat16)
        for tuning in ("", "dispatch=fp8", "combine=rank_partials", "gemm=torch"):
            g_gpu = torch.ops.uniep.moe_backward(
                grad_out.to(dev), x, idx, w, w1.to(dev), w2.to(dev), name, tuning
            )
            g_cpu = torch.ops.uniep.moe_backward(
                grad_out, xs[rank], idxs[rank], ws[rank], w1, w2, cpu_group.group_name, tuning
            )
            labels = ("x", "topk_weights", "w1", "w2")
            for label, a, b in zip(labels, g_gpu, g_cpu, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype, (kind, tuning, label)
                gerr = (a.cpu().double() - b.double()).norm() / b.double().norm().clamp_min(1e-6)
                assert gerr <= 2e-2, (kind, tuning, label, float(gerr))

        # fp8 dispatch inside moe_forward, with bf16 experts: the same dequantisation as the
        # CPU executor's. With fp8 experts (the default): the CPU executor's roundings, where a
        # GEMM's one-ulp difference in h can move the activation's e4m3 rounding by a step.
        for numerics, tol in (("dispatch=fp8,experts=bf16", 1e-2), ("dispatch=fp8", 2e-2)):
            gpu8 = torch.ops.uniep.moe_forward(
                x, idx, w, w1.to(dev), w2.to(dev), name, f"sms=24,{numerics}"
            )
            cpu8 = torch.ops.uniep.moe_forward(
                xs[rank], idxs[rank], ws[rank], w1, w2, cpu_group.group_name, numerics
            )
            err8 = (gpu8.cpu().float() - cpu8.float()).norm() / cpu8.float().norm().clamp_min(1e-6)
            assert err8 <= tol, (kind, numerics, float(err8))

        # combine=rank_partials inside moe_forward: against the CPU executor's same mode.
        part_gpu = [
            torch.ops.uniep.moe_forward(
                x, idx, w, w1.to(dev), w2.to(dev), name, f"sms={s},combine=rank_partials"
            )
            for s in (24, 8)
        ]
        assert torch.equal(part_gpu[0], part_gpu[1]), kind
        part_cpu = torch.ops.uniep.moe_forward(
            xs[rank], idxs[rank], ws[rank], w1, w2, cpu_group.group_name, "combine=rank_partials"
        )
        errp = (part_gpu[0].cpu().float() - part_cpu.float()).norm()
        errp = errp / part_cpu.float().norm().clamp_min(1e-6)
        assert errp <= 1e-2, (kind, float(errp))

    # rank_partials applies the dispatch's weights on the expert side: other weights at the
    # combine are reported (checked on the device, raised by check), as is a repeated row.
    res = uniep.moe.ep.dispatch(x, idx, w, tuning="combine=rank_partials")
    y_any = torch.zeros(res.handle.row_slot.numel(), HIDDEN, dtype=torch.bfloat16, device=dev)
    other = dataclasses.replace(res.handle, topk_weights=w + 1)
    uniep.moe.ep.combine(y_any, other)
    with pytest.raises(ValueError, match="differs from the weights the dispatch carried"):
        uniep.moe.ep.check()
    # ... and it answers only a dispatch made for it (which keeps the weights): refused at once.
    res = uniep.moe.ep.dispatch(x, idx, w)
    asked = res.handle.tuning.replace("combine=per_k", "combine=rank_partials")
    assert asked != res.handle.tuning
    with pytest.raises(ValueError, match="answers a dispatch made with combine=rank_partials"):
        uniep.moe.ep.combine(y_any, dataclasses.replace(res.handle, tuning=asked))
    res = uniep.moe.ep.dispatch(x, idx, w, tuning="combine=rank_partials")
    dup = res.handle.row_target.clone()
    assert dup.numel() > 1  # every rank has rows here, and every rank must combine
    dup[1] = dup[0]
    uniep.moe.ep.combine(y_any, dataclasses.replace(res.handle, row_target=dup))
    with pytest.raises(ValueError, match="out of range or repeated"):
        uniep.moe.ep.check()
    dist.barrier()

    # A runtime the kernels cannot serve is refused at creation, on every rank.
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 31\]"):
        uniep.moe.ep.init_runtime(
            dist.new_group(list(range(world))),
            max_tokens=8,
            hidden=HIDDEN,
            top_k=32,
            num_experts=EXPERTS,
        )

    # Bad input is an error naming the argument, not a hang.
    with pytest.raises(ValueError, match="topk_idx"):
        uniep.moe.ep.dispatch(x, idx[:, :2].contiguous(), w[:, :2].contiguous())
    # hidden float32 columns are twice the default row capacity (hidden bf16).
    with pytest.raises(ValueError, match="row capacity"):
        uniep.moe.ep.dispatch(x.float(), idx, w)
    dist.barrier()
    return report


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_dispatch_combine_moe_against_cpu() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_ep_worker, _world(), backend="nccl", timeout_s=600)
    assert len(reports) == _world()


def _grad_worker(rank: int, world: int) -> dict[str, tuple[float, float]]:
    import uniep
    from _ep_grad_case import run_cases

    dev = _device(rank)
    uniep.moe.ep.init_runtime(
        max_tokens=MAX_TOKENS, hidden=HIDDEN, top_k=TOP_K, num_experts=EXPERTS
    )
    report = run_cases(
        rank, world, dev, max_tokens=MAX_TOKENS, hidden=HIDDEN, top_k=TOP_K, experts=EXPERTS
    )
    dist.barrier()
    return report


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_dispatch_combine_gradients_against_dense_autograd() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_grad_worker, _world(), backend="nccl", timeout_s=600)
    assert len(reports) == _world()


def _cached_worker(rank: int, world: int) -> None:
    import uniep

    dev = _device(rank)
    uniep.moe.ep.init_runtime(
        max_tokens=MAX_TOKENS, hidden=HIDDEN, top_k=TOP_K, num_experts=EXPERTS
    )
    xs, idxs, ws = _case("random", world, 7)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank)).bfloat16().to(dev)
    gen = torch.Generator().manual_seed(50)

    # Rows on the plan of x's dispatch: the bytes a fresh dispatch of x2 gives, at any budget.
    fresh = uniep.moe.ep.dispatch(x2, idx, w)
    fresh8 = uniep.moe.ep.dispatch(x2, idx, w, tuning="dispatch=fp8")
    y = torch.randn(fresh.handle.row_slot.numel(), HIDDEN, generator=gen).bfloat16().to(dev)
    want = uniep.moe.ep.combine(y, uniep.moe.ep.dispatch(x2, idx, w).handle)
    res = uniep.moe.ep.dispatch(x, idx, w)
    assert torch.equal(res.handle.row_target, fresh.handle.row_target)
    epochs = [res.handle.epoch]
    for sms in (24, 8, 32):
        cached = uniep.moe.ep.dispatch_cached(x2, res.handle, tuning=f"sms={sms}")
        assert torch.equal(cached.recv_x, fresh.recv_x), sms
        epochs.append(cached.handle.epoch)
    c8 = uniep.moe.ep.dispatch_cached(x2, res.handle, tuning="dispatch=fp8")
    assert torch.equal(c8.recv_x.view(torch.uint8), fresh8.recv_x.view(torch.uint8))
    assert torch.equal(c8.recv_scales, fresh8.recv_scales)
    # Each cached round is combined like a dispatch; the plan's own round is over.
    cached = uniep.moe.ep.dispatch_cached(x2, res.handle)
    assert torch.equal(uniep.moe.ep.combine(y, cached.handle), want)
    epochs.append(cached.handle.epoch)
    assert epochs == sorted(set(epochs)), epochs
    with pytest.raises(ValueError, match="combine each dispatch before the next"):
        uniep.moe.ep.combine(y, res.handle)

    # combine=rank_partials of a cached round applies the plan dispatch's weights.
    plan = uniep.moe.ep.dispatch(x, idx, w, tuning="combine=rank_partials")
    want_p = uniep.moe.ep.combine(y, plan.handle)
    cached = uniep.moe.ep.dispatch_cached(x2, plan.handle)
    assert torch.equal(uniep.moe.ep.combine(y, cached.handle), want_p)
    uniep.moe.ep.check()

    # A dispatch with new routing replaces the plan: older handles are refused on every rank.
    current = uniep.moe.ep.dispatch(x2, idx, w).handle
    with pytest.raises(ValueError, match="no longer holds"):
        uniep.moe.ep.dispatch_cached(x2, plan.handle)
    # x must have the plan's tokens (checked before the round starts, so no rank waits).
    with pytest.raises(ValueError, match="topk_idx must have T = 3 rows"):
        uniep.moe.ep.dispatch_cached(x2[:3].contiguous(), current)
    # Tuning the runtime would refuse is refused before a round starts, so no rank waits.
    with pytest.raises(ValueError, match=r"num_sms \(tuning sms\) must be in \[1, "):
        uniep.moe.ep.dispatch_cached(x2, current, tuning="sms=1000")
    with pytest.raises(ValueError, match=f"fp8 dispatch takes bf16 x of hidden = {HIDDEN} "):
        uniep.moe.ep.dispatch(x2[:, :1024].contiguous(), idx, w, tuning="dispatch=fp8")
    # A graph would freeze the round's epoch: capture is refused before anything is enqueued.
    with pytest.raises(NotImplementedError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            uniep.moe.ep.dispatch_cached(x2, current)
    # So is a dispatch with new routing: its host reads the counts to size the outputs.
    with pytest.raises(NotImplementedError, match="new routing cannot be captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            uniep.moe.ep.dispatch(x2, idx, w)
    assert torch.equal(uniep.moe.ep.dispatch_cached(x2, current).recv_x, fresh.recv_x)

    # Rank 0 reuses its plan while the others pass new routing: every rank raises, none hangs.
    # (A group of one has no other rank to disagree with.)
    plan = uniep.moe.ep.dispatch(x, idx, w)
    if world > 1 and rank == 0:
        uniep.moe.ep.dispatch_cached(x2, plan.handle)
        with pytest.raises(ValueError, match="passed new routing"):
            uniep.moe.ep.check()
    elif world > 1:
        with pytest.raises(ValueError, match="rank 0 dispatched on its cached plan"):
            uniep.moe.ep.dispatch(x2, idx, w)
    dist.barrier()
    # ... and the group goes on.
    again = uniep.moe.ep.dispatch(x2, idx, w)
    assert torch.equal(again.recv_x, fresh.recv_x)
    assert torch.equal(uniep.moe.ep.combine(y, again.handle), want)
    dist.barrier()


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_cached_dispatch_reuses_the_plan() -> None:
    from uniep.distributed import run_local_ranks

    run_local_ranks(_cached_worker, _world(), backend="nccl", timeout_s=300)


def _mixed_rounds_worker(rank: int, world: int) -> int:
    """Many rounds of every kind back to back, with no host sync or barrier between them and GPU
    skew between the ranks: the transfer starts before the host reads the counts, our own rows
    move on a side stream, and cached rounds run ahead of the host. Returns the mismatches."""
    import uniep

    dev = _device(rank)
    tokens, hidden, experts = 2048 - 256 * rank, 2048, 32
    uniep.moe.ep.init_runtime(
        max_tokens=2048, hidden=hidden, top_k=TOP_K, num_experts=experts, timeout_s=20.0
    )
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(dev)
    idx = torch.rand(tokens, experts, generator=gen).topk(TOP_K, dim=1).indices.to(dev)
    w = torch.rand(tokens, TOP_K, generator=gen).to(dev)
    fresh = uniep.moe.ep.dispatch(x, idx, w)
    fresh8 = uniep.moe.ep.dispatch(x, idx, w, tuning="dispatch=fp8")
    y = torch.randn(fresh.handle.row_slot.numel(), hidden, generator=gen).bfloat16().to(dev)
    want = uniep.moe.ep.combine(y, uniep.moe.ep.dispatch(x, idx, w).handle)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    handle = fresh.handle
    kinds = torch.randint(0, 5, (240,), generator=torch.Generator().manual_seed(9)).tolist()
    for step, kind in enumerate(kinds):
        if step % world == rank and step % 3 == 0:
            torch.cuda._sleep(100_000)  # this rank's GPU arrives late to the round
        if kind == 0:
            res = uniep.moe.ep.dispatch(x, idx, w, tuning="sms=24")
            handle = res.handle
            bad += (res.recv_x != fresh.recv_x).any()
            bad += (res.handle.row_slot != fresh.handle.row_slot).any()
        elif kind == 1:
            res = uniep.moe.ep.dispatch(x, idx, w, tuning="sms=16,dispatch=fp8")
            handle = res.handle
            bad += (res.recv_x.view(torch.uint8) != fresh8.recv_x.view(torch.uint8)).any()
            bad += (res.recv_scales != fresh8.recv_scales).any()
        elif kind == 2:
            got = uniep.moe.ep.dispatch_cached(
                x, handle, tuning="sms=24"
            ).recv_x  # not the handle's
            bad += (got != fresh.recv_x).any()
        elif kind == 3:
            got = uniep.moe.ep.dispatch_cached(x, handle, tuning="sms=32,dispatch=fp8").recv_x
            bad += (got.view(torch.uint8) != fresh8.recv_x.view(torch.uint8)).any()
        else:
            res = uniep.moe.ep.dispatch(x, idx, w)
            handle = res.handle
            bad += (uniep.moe.ep.combine(y, res.handle) != want).any()
    uniep.moe.ep.check()
    return int(bad.item())


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_mixed_rounds_without_syncs_stay_exact() -> None:
    from uniep.distributed import run_local_ranks

    assert (
        run_local_ranks(_mixed_rounds_worker, _world(), backend="nccl", timeout_s=300)
        == [0] * _world()
    )


def _timeout_worker(rank: int, world: int) -> str:
    import uniep

    uniep.moe.ep.init_runtime(
        max_tokens=16, hidden=HIDDEN, top_k=2, num_experts=EXPERTS, timeout_s=3.0
    )
    message = "rank 1 never called"
    if rank == 0:
        x = torch.randn(8, HIDDEN, device="cuda").bfloat16()
        idx = torch.randint(0, EXPERTS, (8, 2), device="cuda")
        w = torch.rand(8, 2, device="cuda")
        with pytest.raises(RuntimeError, match="waiting for rank 1") as info:
            uniep.moe.ep.dispatch(x, idx, w)
        message = str(info.value)
    dist.barrier()
    return message


def _torch_nvshmem_first_worker(rank: int, world: int) -> str:
    """torch's symmetric memory starts NVSHMEM first; the runtime then reuses it (no second
    init), its rounds are exact, and torch's symmetric buffers still work beside it. On one GPU
    only under MPS (test_gpu_on_one_gpu): torch's rendezvous refuses a group of one, and calls
    NVSHMEM team functions that processes sharing a GPU have only under MPS."""
    import torch.distributed._symmetric_memory as symm_mem
    import uniep

    dev = _device(rank)
    if not symm_mem.is_nvshmem_available():
        return "torch has no NVSHMEM"
    symm_mem.set_backend("NVSHMEM")
    group = dist.group.WORLD.group_name
    buf = symm_mem.empty(4 * world, dtype=torch.float32, device=dev).fill_(-1.0)
    handle = symm_mem.rendezvous(buf, group)  # NVSHMEM starts here, under torch
    uniep.moe.ep.init_runtime(
        max_tokens=MAX_TOKENS, hidden=HIDDEN, top_k=TOP_K, num_experts=EXPERTS
    )

    xs, idxs, ws = _case("random", world, 11)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    _, want_rows = _planned_rows(xs, idxs, rank)
    res = uniep.moe.ep.dispatch(x, idx, w)
    assert torch.equal(res.recv_x.cpu(), want_rows)
    # Every expert sends its row back unchanged: out[t] = sum over valid k of w[t, k] * x[t].
    out = uniep.moe.ep.combine(res.recv_x.index_select(0, res.handle.row_slot), res.handle)
    ybuf = xs[rank].unsqueeze(1).expand(-1, TOP_K, -1)
    assert torch.equal(out.cpu(), _expected_combine(ybuf, idxs[rank], ws[rank]))
    uniep.moe.ep.check()

    # torch's buffers beside ours: each rank writes its slice of every peer's buffer.
    for peer in range(world):
        view = handle.get_buffer(peer, (4 * world,), torch.float32)
        view[4 * rank : 4 * (rank + 1)].fill_(float(rank))
    torch.cuda.synchronize(dev)
    dist.barrier()
    assert torch.equal(buf.cpu(), torch.arange(world).float().repeat_interleave(4))
    uniep.moe.ep.shutdown()  # leaves torch's NVSHMEM running
    dist.barrier()
    return "reused"


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_runtime_reuses_nvshmem_that_torch_started() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_torch_nvshmem_first_worker, _world(), backend="nccl", timeout_s=300)
    assert reports == ["reused"] * _world(), reports


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_forced_timeout_raises_naming_the_peer() -> None:
    from uniep.distributed import run_local_ranks

    messages = run_local_ranks(_timeout_worker, 2, backend="nccl", timeout_s=300)
    assert "timed out" in messages[0]


def _demo_cli() -> int:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "uniep.cli", "demo", "--device", "cuda", "--dtype", "bfloat16"]
    return subprocess.run(cmd, timeout=300, check=False).returncode


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_demo_runs_on_gpus() -> None:
    assert _demo_cli() == 0


LL_TOKENS = 128


def _ll_worker(rank: int, world: int) -> None:
    import uniep

    dev = _device(rank)
    uniep.moe.ep.init_runtime(
        max_tokens=LL_TOKENS,
        hidden=HIDDEN,
        top_k=TOP_K,
        num_experts=EXPERTS,
        ll_max_tokens=LL_TOKENS,
    )
    el = EXPERTS // world
    for seed, kind in enumerate(("random", "one_expert", "top1", "random")):
        gen = torch.Generator().manual_seed(500 + seed)
        xs, idxs, ws = [], [], []
        for r in range(world):
            tokens = LL_TOKENS - 17 * r
            idxs.append(_routing(kind, tokens, gen))
            xs.append(torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16))
            ws.append(torch.rand(tokens, TOP_K, generator=gen))
        x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
        buffer = seed % 2

        # Regions: source s's (token, k) pairs for each local expert, in (token, k) order.
        res = uniep.moe.ep.ll_dispatch(x, idx, buffer=buffer)
        counts, slots, rows = res.recv_count.cpu(), res.recv_slot.cpu(), res.recv_x.cpu()
        for e in range(el):
            expert = rank * el + e
            for s in range(world):
                pairs = (idxs[s].reshape(-1) == expert).nonzero().squeeze(1)
                n = pairs.numel()
                assert int(counts[e, s]) == n, (kind, e, s)
                base = s * LL_TOKENS
                assert torch.equal(slots[e, base : base + n], pairs), (kind, e, s)
                want = xs[s][pairs // TOP_K]
                assert torch.equal(rows[e, base : base + n], want), (kind, e, s)

        # The low-latency combine gives the high-throughput combine's bits.
        out_ll = uniep.moe.ep.ll_combine(res.recv_x.contiguous(), idx, w, buffer=buffer)
        ht = uniep.moe.ep.dispatch(x, idx, w)
        out_ht = uniep.moe.ep.combine(ht.recv_x.index_select(0, ht.handle.row_slot), ht.handle)
        assert torch.equal(out_ll, out_ht), kind

    # Captured in a CUDA graph (no host sync inside), replayed: same bits as eager.
    uniep.moe.ep.check()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            warm = uniep.moe.ep.ll_dispatch(x, idx, buffer=0)
            uniep.moe.ep.ll_combine(warm.recv_x * 2, idx, w, buffer=0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = uniep.moe.ep.ll_dispatch(x, idx, buffer=1)
        out_graph = uniep.moe.ep.ll_combine(captured.recv_x * 2, idx, w, buffer=1)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_graph.cpu(), (2 * out_ll.float()).bfloat16().cpu())
    uniep.moe.ep.check()

    # Overflowing a region (an expert repeated in a token's top-k) is an error, not a drop.
    dup = torch.zeros(LL_TOKENS, TOP_K, dtype=torch.long, device=dev)
    x_dup = torch.randn(LL_TOKENS, HIDDEN, device=dev).bfloat16()
    uniep.moe.ep.ll_dispatch(x_dup, dup, buffer=0)
    if rank == 0:
        with pytest.raises(RuntimeError, match="exceed the region"):
            uniep.moe.ep.check()
    torch.cuda.synchronize()
    dist.barrier()

    # An expert id outside [-1, E) on one rank is named there, not sent nowhere in silence.
    bad = idx.clone()
    if rank == 0:
        bad[3, 1] = EXPERTS + 5
    uniep.moe.ep.ll_dispatch(x, bad, buffer=1)
    if rank == 0:
        match = rf"expert id {EXPERTS + 5} at \[3, 1\], outside \[-1, {EXPERTS}\)"
        with pytest.raises(ValueError, match=match):
            uniep.moe.ep.check()
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_low_latency_dispatch_combine_and_graph_capture() -> None:
    from uniep.distributed import run_local_ranks

    run_local_ranks(_ll_worker, _world(), backend="nccl", timeout_s=300)
