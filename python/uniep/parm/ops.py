"""torch.ops.uniep.parm_moe_forward / parm_moe_backward: the CPU and CUDA implementations (the
step-list interpreter of uniep.parm.executor over uniep.parm.cpu's gloo backend or uniep.parm.cuda's
backend on UniEP's collectives), fake kernels and autograd. Schemas:
cpp/torch/common/registration.cpp.

    parm_moe_forward(x [S, M], gate [M, E] float32, w1 [E_loc, M, H/N], w2 [E_loc, H/N, M],
                     mp_group, ep_group, top_k, capacity_factor, schedule, overflow="error",
                     chunks=[])
        -> y [S, M], l_aux [] float32, exp_in, comb, stats [E + 3] float64
    exp_in  [G, E_loc, N*c, M] (baseline) or [N, G, E_loc, c, M] (s1, s2): this rank's expert input
    comb    [E, N*c, M] (baseline, s2) or [E, c, M] (s1): this rank's combine input
    stats   top-1 counts of the MP group's tokens (E), dropped pairs, largest (slice, expert)
            demand, slice capacity c
    chunks  the plan's SAA chunk counts: ``price(forward list).chunks`` followed by
            ``price(backward list).chunks`` (one per step, ``parm_exec.check_chunks``); []
            leaves every pair to the executor's default. The values do not depend on it.

Group arguments are ``ProcessGroup.group_name``; "" is a group of one rank. The backward
recomputes the local compute steps from (x, gate, exp_in, comb) and runs the backward step list.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from .agreement import join_as_failed
from .cpu import CpuExecutor, Groups
from .executor import ParmExecutor, check_chunks

SCHEDULES = ("baseline", "s1", "s2")
_CUDA_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


def resolve_group(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    return dist.distributed_c10d._resolve_process_group(name)


def _sizes(mp_group: str, ep_group: str) -> tuple[int, int]:
    mp, ep = resolve_group(mp_group), resolve_group(ep_group)
    return (
        dist.get_world_size(mp) if mp is not None else 1,
        dist.get_world_size(ep) if ep is not None else 1,
    )


def _check(
    x: torch.Tensor,
    gate: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    schedule: str,
    N: int,
    G: int,
) -> None:
    def need(cond: bool, msg: str) -> None:
        torch._check_value(cond, lambda: msg)

    need(schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    need(x.dim() == 2, f"x must be [S, M], got shape {tuple(x.shape)}")
    for name, t in (("gate", gate), ("w1", w1), ("w2", w2)):
        need(t.device == x.device, f"{name} must be on x's device {x.device}, got {t.device}")
    M = x.shape[1]
    need(
        gate.dim() == 2 and gate.shape[0] == M and gate.dtype == torch.float32,
        f"gate must be float32 [M={M}, E], got {gate.dtype} {tuple(gate.shape)}",
    )
    E = gate.shape[1]
    need(E % G == 0, f"gate: E={E} experts must divide by the EP size {G}")
    need(
        w1.dim() == 3 and w1.shape[0] == E // G and w1.shape[1] == M and w1.dtype == x.dtype,
        f"w1 must be {x.dtype} [E_loc={E // G}, M={M}, H/N], got {w1.dtype} {tuple(w1.shape)}",
    )
    want = (E // G, w1.shape[2], M)
    need(
        w2.dim() == 3 and tuple(w2.shape) == want and w2.dtype == x.dtype,
        f"w2 must be {x.dtype} {list(want)}, got {w2.dtype} {tuple(w2.shape)}",
    )


def _shape(
    x: torch.Tensor,
    gate: torch.Tensor,
    w1: torch.Tensor,
    N: int,
    G: int,
    top_k: int,
    capacity_factor: float,
) -> Any:
    return _C.parm.ParmShape(
        world_size=N * G,
        mp_size=N,
        gpus_per_node=N,
        tokens=int(x.shape[0]),
        hidden=int(x.shape[1]),
        ffn_hidden=int(w1.shape[2]) * N,
        num_experts=int(gate.shape[1]),
        top_k=top_k,
        capacity_factor=capacity_factor,
        dtype_bytes=x.element_size(),
    )


def _executor(
    x: torch.Tensor,
    gate: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    mp_group: str,
    ep_group: str,
    top_k: int,
    capacity_factor: float,
    schedule: str,
    overflow: str,
) -> tuple[ParmExecutor, Any]:
    mp, ep = resolve_group(mp_group), resolve_group(ep_group)
    N, G = _sizes(mp_group, ep_group)
    _check(x, gate, w1, w2, schedule, N, G)
    groups = Groups(
        mp=mp,
        ep=ep,
        mp_size=N,
        ep_size=G,
        mp_index=dist.get_rank(mp) if mp is not None else 0,
        ep_index=dist.get_rank(ep) if ep is not None else 0,
    )
    shape = _shape(x, gate, w1, N, G, top_k, capacity_factor)
    if x.is_cuda:
        torch._check_value(
            x.dtype in _CUDA_DTYPES,
            lambda: f"x must be one of {_CUDA_DTYPES} on CUDA (UniEP's collectives), got {x.dtype}",
        )
        from .cuda import CudaExecutor

        return CudaExecutor(shape, groups, overflow), shape
    return CpuExecutor(shape, groups, overflow), shape


def _on_device(x: torch.Tensor) -> Any:
    """The CUDA executor's runtimes (NVSHMEM) bind to the current device: make it x's."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def split_chunks(chunks: Any, fwd: Any, bwd: Any) -> tuple[list[int], list[int]]:
    """The ops' ``chunks`` as (forward counts, backward counts), each checked against its list
    (both empty for [])."""
    got = list(chunks)
    if not got:
        return [], []
    n_fwd, n_bwd = len(fwd.steps), len(bwd.steps)
    if len(got) != n_fwd + n_bwd:
        raise ValueError(
            f"chunks: expected one count per step of the {fwd.schedule} forward list "
            f"({n_fwd}) and of its backward list ({n_bwd}), {n_fwd + n_bwd} in all, got {len(got)}"
        )
    return (
        check_chunks(got[:n_fwd], fwd, "chunks (forward part)"),
        check_chunks(got[n_fwd:], bwd, "chunks (backward part)"),
    )


def _lists(shape: Any, schedule: str) -> tuple[Any, Any]:
    return (
        _C.parm.build_steps(shape, schedule, "forward"),
        _C.parm.build_steps(shape, schedule, "backward"),
    )


def _forward_kernel(
    x,
    gate,
    w1,
    w2,
    mp_group,
    ep_group,
    top_k,
    capacity_factor,
    schedule,
    overflow="error",
    chunks=(),
):
    try:
        if overflow not in ("error", "drop"):
            raise ValueError(f"overflow must be 'error' or 'drop', got {overflow!r}")
        ex, shape = _executor(
            x, gate, w1, w2, mp_group, ep_group, top_k, capacity_factor, schedule, overflow
        )
        fwd, bwd = _lists(shape, schedule)
        fwd_chunks, bwd_chunks = split_chunks(chunks, fwd, bwd)
    except ValueError as e:
        # The other ranks are in the routing agreement by now: tell them why, then raise.
        join_as_failed(str(e))
        raise
    with _on_device(x):
        # The backward's counts too: the forward's routing agreement is the only one.
        y, laux, st = ex.forward(x.contiguous(), gate, w1, w2, fwd, fwd_chunks, bwd_chunks)
    s = st.stats
    tail = torch.tensor([s["dropped"], s["max_demand"], s["slice_capacity"]], dtype=torch.float64)
    if x.is_cuda:
        # Pinned and non-blocking: a blocking copy would wait here for the whole forward.
        tail = tail.pin_memory().to(x.device, non_blocking=True)
    stats = torch.cat([st.saved["top1_total"].double(), tail])
    return y, laux, st.saved["exp_in"], st.saved["comb"], stats


def _backward_kernel(
    grad_y,
    grad_l_aux,
    x,
    gate,
    w1,
    w2,
    exp_in,
    comb,
    stats,
    mp_group,
    ep_group,
    top_k,
    capacity_factor,
    schedule,
    chunks=(),
):
    ex, shape = _executor(
        x, gate, w1, w2, mp_group, ep_group, top_k, capacity_factor, schedule, "drop"
    )
    E = int(gate.shape[1])
    fwd, bwd = _lists(shape, schedule)
    _, bwd_chunks = split_chunks(chunks, fwd, bwd)
    with _on_device(x):
        st = ex.rebuild(x.contiguous(), gate, exp_in, comb, stats[:E].clone(), fwd)
        return ex.backward(st, grad_y, grad_l_aux, gate, w1, w2, bwd, bwd_chunks)


# One Python implementation per op for both keys: the executor picks its backend from x's
# device (torch.library.impl's decorator returns None, hence the plain calls).
for _key in ("CPU", "CUDA"):
    torch.library.impl("uniep::parm_moe_forward", _key)(_forward_kernel)
    torch.library.impl("uniep::parm_moe_backward", _key)(_backward_kernel)


def _saved_shapes(x, gate, w1, mp_group, ep_group, top_k, capacity_factor, schedule):
    N, G = _sizes(mp_group, ep_group)
    shape = _shape(x, gate, w1, N, G, top_k, capacity_factor)
    E, M, c = shape.num_experts, shape.hidden, shape.slice_capacity
    if schedule == "baseline":
        return (G, E // G, N * c, M), (E, N * c, M)
    return (N, G, E // G, c, M), (E, c if schedule == "s1" else N * c, M)


@torch.library.register_fake("uniep::parm_moe_forward")
def _forward_fake(
    x,
    gate,
    w1,
    w2,
    mp_group,
    ep_group,
    top_k,
    capacity_factor,
    schedule,
    overflow="error",
    chunks=(),
):
    N, G = _sizes(mp_group, ep_group)
    _check(x, gate, w1, w2, schedule, N, G)
    exp_in, comb = _saved_shapes(x, gate, w1, mp_group, ep_group, top_k, capacity_factor, schedule)
    return (
        x.new_empty(x.shape),
        gate.new_empty(()),
        x.new_empty(exp_in),
        x.new_empty(comb),
        gate.new_empty((gate.shape[1] + 3,), dtype=torch.float64),
    )


@torch.library.register_fake("uniep::parm_moe_backward")
def _backward_fake(
    grad_y,
    grad_l_aux,
    x,
    gate,
    w1,
    w2,
    exp_in,
    comb,
    stats,
    mp_group,
    ep_group,
    top_k,
    capacity_factor,
    schedule,
    chunks=(),
):
    N, G = _sizes(mp_group, ep_group)
    _check(x, gate, w1, w2, schedule, N, G)
    torch._check_value(grad_y.shape == x.shape, lambda: "grad_y must have x's shape")
    return (
        x.new_empty(x.shape),
        gate.new_empty(gate.shape),
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
    )


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, gate, w1, w2, mp_group, ep_group, top_k, capacity_factor, schedule, *rest = inputs
    _, _, exp_in, comb, stats = output
    ctx.save_for_backward(x, gate, w1, w2, exp_in, comb, stats)
    chunks = list(rest[1]) if len(rest) > 1 else []
    ctx.args = (mp_group, ep_group, top_k, capacity_factor, schedule, chunks)
    ctx.mark_non_differentiable(exp_in, comb, stats)


def _backward(ctx: Any, grad_y: torch.Tensor, grad_l_aux: torch.Tensor, *_: Any) -> tuple:
    x, gate, w1, w2, exp_in, comb, stats = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t.requires_grad for t in (grad_y, x, gate, w1, w2)):
        # A backward with create_graph=True (a gradient penalty, say) through the layer: its
        # backward op has no derivative, and autograd would leave the second-order terms out.
        # Every rank makes the same request, so each raises here before any collective.
        raise ValueError(
            "ParmMoELayer has no second derivative: its backward (torch.ops.uniep."
            "parm_moe_backward) is not differentiable, but autograd is building the backward's "
            "graph (create_graph=True) through it; take the higher-order term over the parts of "
            "the model without it"
        )
    # Every rank must run the backward: its collectives pair with the peers'.
    gx, gg, g1, g2 = torch.ops.uniep.parm_moe_backward(
        grad_y.contiguous(), grad_l_aux, x, gate, w1, w2, exp_in, comb, stats, *ctx.args
    )
    return gx, gg, g1, g2, None, None, None, None, None, None, None


torch.library.register_autograd("uniep::parm_moe_forward", _backward, setup_context=_setup_context)
