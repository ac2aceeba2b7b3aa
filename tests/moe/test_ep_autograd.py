"""Autograd of torch.ops.uniep.ep_dispatch / ep_combine without a GPU.

The registrations and the fake (meta) path are checked directly. The backward formulas are run
over gloo ranks with the two ops simulated on CPU tensors from the CPU planner (the slots and
rows the GPU tests hold the kernels to), so what runs there is the real Python backward, its
all_to_all included; tests/moe/test_gpu_ep.py runs the same cases on the GPU runtime.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import uniep
from _ep_grad_case import run_cases
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

EXPERTS = 12
TOP_K = 4
HIDDEN = 64
MAX_TOKENS = 80


@pytest.mark.parametrize("op", ["ep_dispatch", "ep_dispatch_cached", "ep_combine"])
def test_autograd_is_registered(op: str) -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"uniep::{op}", "Autograd")


def test_fake_outputs_carry_the_backward() -> None:
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(8, 256, dtype=torch.bfloat16)).requires_grad_(True)
        idx = mode.from_tensor(torch.empty(8, 4, dtype=torch.long))
        w = mode.from_tensor(torch.empty(8, 4)).requires_grad_(True)
        recv_x, _, _, _, recv_w, _, _, row_target, epoch = torch.ops.uniep.ep_dispatch(
            x, idx, w, "", ""
        )
        out = torch.ops.uniep.ep_combine(recv_x, row_target, idx, w, "", epoch, "")
    assert recv_x.requires_grad and recv_w.requires_grad
    assert "ep_dispatch" in type(recv_x.grad_fn).__name__
    assert out.requires_grad and "ep_combine" in type(out.grad_fn).__name__
    assert tuple(out.shape) == (8, 256)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(8, 256, dtype=torch.bfloat16)).requires_grad_(True)
        idx = mode.from_tensor(torch.empty(8, 4, dtype=torch.long))
        w = mode.from_tensor(torch.empty(8, 4))
        recv_x, _, epoch = torch.ops.uniep.ep_dispatch_cached(x, idx, w, "", 3, "")
    assert recv_x.requires_grad and "ep_dispatch_cached" in type(recv_x.grad_fn).__name__
    assert isinstance(epoch, int)


def test_fake_of_the_engine_backward() -> None:
    # moe_backward_engine's rows (and so its per-row outputs) depend on the routing.
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(8, 256, dtype=torch.bfloat16))
        idx = mode.from_tensor(torch.empty(8, 4, dtype=torch.long))
        w = mode.from_tensor(torch.empty(8, 4))
        w1 = mode.from_tensor(torch.empty(3, 256, 128, dtype=torch.bfloat16))
        w2 = mode.from_tensor(torch.empty(3, 64, 256, dtype=torch.bfloat16))
        gx, dots, target, gw1, gw2 = torch.ops.uniep.moe_backward_engine(
            x, x, idx, w, w1, w2, "", ""
        )
    assert tuple(gx.shape) == (8, 256) and gx.dtype == torch.bfloat16
    assert dots.dtype == torch.float32 and target.dtype == torch.int64
    assert str(dots.shape[0]) == str(target.shape[0]) and not isinstance(dots.shape[0], int)
    assert tuple(gw1.shape) == (3, 256, 128) and tuple(gw2.shape) == (3, 64, 256)


@pytest.mark.skipif(uniep.moe.ep.available(), reason="this build and machine have the GPU runtime")
def test_dispatch_requiring_grad_on_cpu_is_not_implemented() -> None:
    x = torch.randn(4, 128, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="ep_dispatch"):
        uniep.moe.ep.dispatch(x, idx, torch.ones(4, 2, requires_grad=True))


class _WithConfig:
    """uniep._C with an ep_config, as a GPU runtime of the simulated group would answer."""

    def __init__(self, real: Any, config: dict[str, int]) -> None:
        self._real, self._config = real, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def ep_config(self, group_name: str) -> dict[str, int]:
        return self._config


def _simulate_ops() -> torch.library.Library:
    """CPU kernels of ep_dispatch (and ep_dispatch_cached) / ep_combine with the GPU ops'
    outputs, exchanging over the group with gloo. The caller keeps the returned Library
    alive."""
    from uniep import _C

    per_rank = MAX_TOKENS * TOP_K

    def ranks(group_name: str) -> tuple[Any, int, int]:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        return group, dist.get_world_size(group), dist.get_rank(group)

    def dispatch(x, topk_idx, topk_weights, group_name, tuning=""):  # noqa: ANN001, ANN202
        group, world, me = ranks(group_name)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, (x.detach(), topk_idx, topk_weights.detach()), group=group)
        plan = _C.build_rank_plan([i.numpy() for _, i, _ in every], EXPERTS, me)
        offsets = plan["recv_offsets"]
        tokens = torch.from_numpy(plan["recv_src_token"])
        sources = [int(np.searchsorted(offsets, s, side="right") - 1) for s in range(len(tokens))]
        pick = [(every[s], int(t)) for s, t in zip(sources, tokens.tolist(), strict=True)]
        k = topk_idx.shape[1]
        recv_x = torch.stack([e[0][t] for e, t in pick]) if pick else x.new_empty(0, x.shape[1])
        ids = torch.stack([e[1][t] for e, t in pick]) if pick else topk_idx.new_empty(0, k)
        recv_w = torch.stack([e[2][t] for e, t in pick]) if pick else x.new_empty(0, k).float()
        local = EXPERTS // world
        mine = (ids >= me * local) & (ids < (me + 1) * local)
        recv_idx = torch.where(mine, ids - me * local, torch.full_like(ids, -1))
        row_target = plan["row_src_rank"] * per_rank + plan["row_combine_slot"]
        return (
            recv_x,
            x.new_empty((0, 0), dtype=torch.float32),
            tokens,
            recv_idx,
            recv_w,
            torch.from_numpy(np.diff(plan["row_offsets"])),
            torch.from_numpy(plan["row_slot"]),
            torch.from_numpy(row_target),
            1,
        )

    def combine(y, row_target, topk_idx, topk_weights, group_name, epoch, tuning=""):  # noqa: ANN001, ANN202
        group, world, me = ranks(group_name)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, (y.detach(), row_target), group=group)
        slots = torch.zeros(topk_idx.numel(), y.shape[1], dtype=torch.bfloat16)
        for ys, targets in every:
            here = targets // per_rank == me
            slots[targets[here] % per_rank] = ys[here]
        slots = slots.view(*topk_idx.shape, y.shape[1])
        # The kernels' arithmetic: fp32 products and sums, k ascending, one rounding to bf16.
        acc = torch.zeros(topk_idx.shape[0], y.shape[1])
        for k in range(topk_idx.shape[1]):
            term = topk_weights[:, k : k + 1] * slots[:, k].float()
            acc = torch.where((topk_idx[:, k] >= 0).unsqueeze(1), acc + term, acc)
        return acc.to(torch.bfloat16)

    def dispatch_cached(x, topk_idx, topk_weights, group_name, epoch, tuning=""):  # noqa: ANN001, ANN202
        out = dispatch(x, topk_idx, topk_weights, group_name, tuning)
        return out[0], out[1], epoch + 1

    lib = torch.library.Library("uniep", "IMPL")
    lib.impl("ep_dispatch", dispatch, "CPU")
    lib.impl("ep_dispatch_cached", dispatch_cached, "CPU")
    lib.impl("ep_combine", combine, "CPU")
    return lib


def _simulated_worker(rank: int, world: int) -> dict[str, tuple[float, float]]:
    config = {"world_size": world, "max_tokens": MAX_TOKENS, "hidden": HIDDEN, "top_k": TOP_K}
    uniep.moe.ep._C = _WithConfig(uniep.moe.ep._C, config)  # type: ignore[assignment]
    lib = _simulate_ops()
    try:
        report = run_cases(
            rank,
            world,
            torch.device("cpu"),
            max_tokens=MAX_TOKENS,
            hidden=HIDDEN,
            top_k=TOP_K,
            experts=EXPERTS,
        )
        # Every rank raises at the same point, before any collective of the backward.
        x = torch.randn(5, HIDDEN, requires_grad=True)
        idx = torch.arange(5 * TOP_K).view(5, TOP_K) % EXPERTS
        res = uniep.moe.ep.dispatch(x, idx, torch.rand(5, TOP_K))
        with pytest.raises(NotImplementedError, match="bfloat16 rows"):
            res.recv_x.sum().backward()
        return report
    finally:
        lib._destroy()


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_through_simulated_ops_match_dense_autograd(world: int) -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_simulated_worker, world, backend="gloo", timeout_s=120)
    assert len(reports) == world
