"""``moe_forward`` on CUDA tensors for a group that spans nodes (docs/multinode.md).

Composed of pieces that each exist and are tested, so autograd gives the backward:

1. **Rail** (the network leg; ``torch.distributed`` on the rail sub-group, the ranks with this
   rank's local index): each token goes once to every node holding one of its experts, to the
   rank there with this rank's local index (its relay), with its routing remapped to that
   node's experts (-1 elsewhere).
2. **Node** (NVLink): the relay runs ``moe_forward`` over its node's group (UniEP's CUDA runtime
   within one NVLink domain) on the rows it received.
3. **Rail back** and the combine at home:

   - ``combine=node_partials``: the node's call combines each row's k's of the node (ascending,
     fp32, weights applied, one rounding): the relay's partial; one row per (token, node) goes
     back, and the token's rank sums the partials in ascending node order in fp32.
   - ``combine=per_k`` (the default): the relay runs each row once per k of its node, alone and
     with weight 1, so the node's call returns the expert's row itself; one row per (token, k)
     goes back, and the token's rank combines them with the combines' own arithmetic
     (``combine_rows``): one node's ``per_k`` bits wherever the expert rows have them.

On CPU tensors the same composition gives the CPU executor's bits for both (the tests check it);
``uniep.moe_forward`` sends only CUDA tensors here. ``rank_partials`` across nodes is refused by
name. Every wait on the rail is bounded (``UNIEP_TIMEOUT_S``) and names the group.
"""

from __future__ import annotations

import socket
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import distributed

__all__ = ["NodeGroups", "node_groups", "moe_forward"]


@dataclass(frozen=True)
class NodeGroups:
    """A group's nodes as this rank sees them: its node's group (the NVLink domain the CUDA
    runtime runs in) and its rail group (one rank a node, this rank's local index)."""

    node: dist.ProcessGroup
    rail: dist.ProcessGroup
    nodes: int
    node_size: int
    node_index: int
    local_index: int
    # Some host runs more than one node (logical nodes): their NVSHMEM start-ups must not overlap
    # (node_runtime).
    shared_host: bool = False


# Group name -> (the group, its ranks per node, its node groups): made again for another group
# under the name (torch names groups "0", "1", ... again after destroy_process_group) or another
# topology (init(group, ranks_per_node=...) again).
_GROUPS: dict[str, tuple[weakref.ref, int, NodeGroups]] = {}


def node_groups(group: dist.ProcessGroup) -> NodeGroups:
    """This rank's node and rail groups of ``group`` (created on first use; only the members of
    each sub-group take part, so a sub-group of WORLD works)."""
    name = group.group_name
    size = distributed.ranks_per_node(group)
    known = _GROUPS.get(name)
    if known is not None and known[0]() is group and known[1] == size:
        return known[2]
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if size >= world:
        raise ValueError(f"group '{name}' is one node of {world} ranks: no rail to build")
    ranks = dist.get_process_group_ranks(group)
    node, local = divmod(me, size)
    hosts = _check_hosts(group, size)
    backend = dist.get_backend(group)
    node_ranks = ranks[node * size : (node + 1) * size]
    rail_ranks = ranks[local::size]
    made = NodeGroups(
        node=dist.new_group(node_ranks, backend=backend, use_local_synchronization=True),
        rail=dist.new_group(rail_ranks, backend=backend, use_local_synchronization=True),
        nodes=world // size,
        node_size=size,
        node_index=node,
        local_index=local,
        shared_host=len(set(hosts)) < world // size,
    )
    _GROUPS[name] = (weakref.ref(group), size, made)
    return made


def _check_hosts(group: dist.ProcessGroup, size: int) -> list[str]:
    """Every declared node's ranks on one host (logical nodes may share one; a node may not span
    two: its legs are NVLink). Collective; raises on every rank naming the first node that spans
    hosts; returns each rank's host."""
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    for n in range(len(hosts) // size):
        seen = sorted(set(hosts[n * size : (n + 1) * size]))
        if len(seen) > 1:
            raise ValueError(
                f"ranks_per_node={size} puts ranks {n * size}-{(n + 1) * size - 1} of group "
                f"'{group.group_name}' in one node, but they run on {len(seen)} hosts "
                f"({', '.join(seen)}): a node's ranks must share a host (their legs are NVLink); "
                "the launcher's order (torchrun: consecutive ranks a node) is assumed"
            )
    return hosts


def _rail_exchange(
    x: torch.Tensor, send: list[int], recv: list[int], rail: dist.ProcessGroup, what: str
) -> torch.Tensor:
    """``all_to_all_single`` of rows on the rail, every wait bounded. Gloo moves CPU tensors:
    rows of a CUDA tensor are staged through the host there."""
    device = distributed.staging_device(rail)
    src = x.to(device).contiguous()
    out = src.new_empty((sum(recv), *x.shape[1:]))
    work = dist.all_to_all_single(out, src, recv, send, group=rail, async_op=True)
    distributed.bounded_wait(work, rail, what)
    return out.to(x.device)


class _Rail(torch.autograd.Function):
    """The rail exchange, differentiable: its gradient is the exchange the other way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], rail: Any, what: str
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.rail, ctx.what = send, recv, rail, what
        return _rail_exchange(x, send, recv, rail, what)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        back = _rail_exchange(grad, ctx.recv, ctx.send, ctx.rail, f"{ctx.what} (backward)")
        return back, None, None, None, None


def _counts_on_rail(counts: list[int], rail: dist.ProcessGroup, what: str) -> list[int]:
    device = distributed.staging_device(rail)
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    theirs = torch.empty_like(mine)
    work = dist.all_to_all_single(theirs, mine, group=rail, async_op=True)
    distributed.bounded_wait(work, rail, what)
    return [int(c) for c in theirs.cpu()]


def _argument_error(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    world: int,
) -> str:
    """What is wrong with this rank's arguments, or "" (the node's call checks the rest)."""
    if x.dim() != 2:
        return f"x must be a 2-D tensor [T, H], got shape {tuple(x.shape)}"
    if x.dtype != torch.bfloat16:
        # The CUDA executor's expert GEMMs and combine_rows are bf16.
        return f"x must be bfloat16 across nodes (the CUDA executor's dtype), got {x.dtype}"
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64 or topk_idx.shape[0] != x.shape[0]:
        return (
            f"topk_idx must be [T = {x.shape[0]}, K] int64, got shape {tuple(topk_idx.shape)} "
            f"{topk_idx.dtype}"
        )
    if topk_weights.shape != topk_idx.shape:
        return (
            f"topk_weights must have the shape of topk_idx {tuple(topk_idx.shape)}, got "
            f"{tuple(topk_weights.shape)}"
        )
    if w1.dim() != 3:
        return f"w1 must be a 3-D tensor [E_local, H, 2*I], got shape {tuple(w1.shape)}"
    experts = w1.shape[0] * world
    bad = (topk_idx < -1) | (topk_idx >= experts)
    if bool(bad.any()):
        t, k = (int(v) for v in torch.nonzero(bad)[0])
        return (
            f"topk_idx contains expert id {int(topk_idx[t, k])} at [{t}, {k}], outside "
            f"[-1, {experts})"
        )
    return ""


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup,
    tuning: str,
) -> torch.Tensor:
    """``uniep.moe_forward`` over a group that spans nodes, on CUDA tensors (module docstring).
    ``tuning``'s combine is ``per_k`` (the default) or ``node_partials``; its other keys go to
    the node's call."""
    from .. import _C

    g = node_groups(group)
    name = group.group_name
    world = dist.get_world_size(group)
    # Every rank checks its arguments and agrees with the others before the rail moves a row: a
    # bad argument on one rank raises on every rank with that rank's reason.
    error = _argument_error(x, topk_idx, topk_weights, w1, world)
    fields = [
        ("hidden (x.size(1))", int(x.shape[1]) if x.dim() == 2 else -1),
        ("top_k (topk_idx.size(1))", int(topk_idx.shape[1]) if topk_idx.dim() == 2 else -1),
        ("experts per rank (w1.size(0))", int(w1.shape[0]) if w1.dim() == 3 else -1),
        ("ranks per node", g.node_size),
    ]
    _C.agree_call(name, "moe_forward", fields, error, x.device.type)
    if x.is_cuda and topk_weights.dtype == torch.bfloat16:
        topk_weights = topk_weights.float()  # the CUDA dispatch sends fp32 weights
    params = _C.TuningParams.parse(tuning)
    combine = params.combine
    if combine not in ("per_k", "node_partials"):
        raise ValueError(
            "on CUDA tensors a group that spans nodes combines with per_k or node_partials; got "
            f"combine={combine}: rank partials across nodes are the CPU executor's only "
            "(docs/multinode.md)"
        )
    params.combine = "per_k"  # the node's own combine (for node partials, the relay's sum)
    node_tuning = params.to_string(given_only=True)
    experts_per_node = w1.shape[0] * g.node_size

    # Which tokens each node gets: those with an expert there, in token order.
    valid = topk_idx >= 0
    node_of = torch.where(valid, topk_idx // experts_per_node, torch.full_like(topk_idx, -1))
    tokens_of: list[torch.Tensor] = []
    rows_x, rows_idx, rows_w = [], [], []
    for n in range(g.nodes):
        here = node_of == n
        tokens = torch.nonzero(here.any(dim=1)).flatten()
        tokens_of.append(tokens)
        local_ids = torch.where(
            here, topk_idx - n * experts_per_node, torch.full_like(topk_idx, -1)
        )
        rows_x.append(x.index_select(0, tokens))
        rows_idx.append(local_ids.index_select(0, tokens))
        rows_w.append(topk_weights.index_select(0, tokens))
    send = [int(t.numel()) for t in tokens_of]
    recv = _counts_on_rail(send, g.rail, f"moe_forward's rail counts on group '{name}'")

    what = f"moe_forward's rail exchange on group '{name}'"
    relay_x = _Rail.apply(torch.cat(rows_x), send, recv, g.rail, what)
    relay_idx = _rail_exchange(torch.cat(rows_idx), send, recv, g.rail, what)
    node_name = g.node.group_name

    def node_call(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if rows.is_cuda:
            experts = w1.shape[0] * g.node_size
            node_runtime(group, g, max(rows.shape[0], 1), x.shape[1], ids.shape[1], experts)
        return torch.ops.uniep.moe_forward(rows, ids, weights, w1, w2, node_name, node_tuning)

    if combine == "node_partials":
        relay_w = _Rail.apply(torch.cat(rows_w), send, recv, g.rail, what)
        partial = node_call(relay_x, relay_idx, relay_w)
        back = _Rail.apply(partial, recv, send, g.rail, f"moe_forward's partials on group '{name}'")
        # The partials of each token in ascending node order, in fp32: one index_add per node, a
        # token at most once in each.
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        start = 0
        for n in range(g.nodes):
            rows = back[start : start + send[n]].to(acc)
            out = out.index_add(0, tokens_of[n], rows)
            start += send[n]
        return out.to(x.dtype)

    # per_k: the relay runs each of its rows once per k of this node, alone and with weight 1
    # (the node's combine then returns the expert's row itself: 1 x y rounds to y), and the rows
    # go back to be combined at home by the combines' own arithmetic (combine_rows): the bits of
    # one node's per_k wherever the experts' rows have them.
    row_of, k_of = torch.nonzero(relay_idx >= 0, as_tuple=True)  # row-major: row, then k
    single = relay_idx[row_of, k_of].unsqueeze(1)
    ones = torch.ones(single.shape, dtype=torch.float32, device=x.device)
    y_rows = node_call(relay_x.index_select(0, row_of), single, ones)
    # Per source node m, the relayed rows' k's; per node n, this rank's (token, k)s there.
    group_of = torch.bucketize(
        row_of, torch.tensor(recv, device=row_of.device).cumsum(0), right=True
    )
    relay_k = torch.bincount(group_of, minlength=g.nodes).tolist()
    home_k = torch.bincount(node_of[valid], minlength=g.nodes).tolist()
    back = _Rail.apply(y_rows, relay_k, home_k, g.rail, f"moe_forward's rows on group '{name}'")
    top_k = topk_idx.shape[1]
    slot = torch.cat([torch.nonzero((node_of == n).flatten()).flatten() for n in range(g.nodes)])
    y_all = torch.zeros(topk_idx.numel(), x.shape[1], dtype=back.dtype, device=x.device)
    y_all = y_all.index_copy(0, slot, back)
    gemm_row = torch.where(
        valid, torch.arange(topk_idx.numel(), device=x.device).view(-1, top_k), -1
    )
    return _CombineRows.apply(y_all, gemm_row, topk_weights)


def node_runtime(
    group: dist.ProcessGroup, g: NodeGroups, tokens: int, hidden: int, top_k: int, experts: int
) -> None:
    """This rank's node's CUDA runtime, created on first use (collectively over the node; a
    later call grows it as one node's does). Where a host runs several nodes, their first
    start-ups take turns in node order (a barrier over ``group`` after each): NVSHMEM names the
    shared-memory slab of the processes that share a GPU after the team's first PE, the same
    name in every node's NVSHMEM, and a start-up removes the name another is still opening (seen
    as "Failed to create shared memory slab" and "mapping of buffer object failed" with two and
    four logical nodes of two processes on one GPU). Every rank of ``group`` calls it in the
    same call, so all take the same turns."""
    from .. import _C
    from . import ep

    name = g.node.group_name
    if _C.ep_exists(name) or not g.shared_host:
        ep.ensure_runtime(name, tokens, hidden, top_k, experts)
        return
    for n in range(g.nodes):
        if n == g.node_index:
            ep.ensure_runtime(name, tokens, hidden, top_k, experts)
        dist.barrier(group=group)


class _CombineRows(torch.autograd.Function):
    """``combine_rows`` (the combines' arithmetic: out[t] = sum over k ascending of
    w[t, k] * y[row[t, k]], fp32 products and sums each rounded, one rounding to bf16), with its
    gradient: each used row gets w times the output's gradient, each weight the dot product of
    the output's gradient with its row (fp32)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, y: torch.Tensor, row: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        out, error = torch.ops.uniep.combine_rows(y, row, w.float())
        if int(error.item()) != 0:
            raise RuntimeError(f"moe_forward's combine across nodes: combine_rows error {error}")
        ctx.save_for_backward(y, row, w)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        y, row, w = ctx.saved_tensors
        used = row >= 0
        flat = row.clamp_min(0).flatten()
        g = grad.float()
        top_k = row.shape[1]
        # [T, K, H]: each (token, k)'s row gradient and its weight's.
        rows = y.index_select(0, flat).float().view(row.shape[0], top_k, y.shape[1])
        grad_w = torch.where(used, (rows * g.unsqueeze(1)).sum(-1), 0.0).to(w.dtype)
        per_k = torch.where(used.unsqueeze(-1), w.float().unsqueeze(-1) * g.unsqueeze(1), 0.0)
        grad_y = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        grad_y = grad_y.index_add(0, flat, per_k.reshape(-1, y.shape[1]))
        return grad_y.to(y.dtype), None, grad_w
