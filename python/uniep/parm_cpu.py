"""The CPU executor of the Parm step lists: a small interpreter over torch.distributed (gloo).

It runs the steps of ``uniep._C.parm.build_steps`` in order, one handler per op, over named
buffers. Collectives are the plan's (all-gather, reduce-scatter, all-reduce, all-to-all over the
MP/ESP or EP group); an SAA pair runs as its all-to-all followed by its all-gather, which is what
the pipelined version computes. Compute steps are dense per-expert torch math; each forward compute
step keeps its small autograd graph so that the backward step of the same name is its
vector-Jacobian product. Sums over ranks (the reduce-scatter and all-reduce of the expert
partials, the gate gradient) add the partials in MP-rank order, so they do not depend on gloo's
reduction order.

Layout and capacity semantics: include/uniep/parm.hpp. Shapes (one rank):
    x, y           [S, M]                  replicated over the MP group
    route          gate output: top-k ids/weights [s, k], slot of each (token, choice)
    disp, comb     [E, rows, M]            rows = T = N*c (baseline, S2) or c (S1, S2's *_m)
    exp_in/out     [G, E_loc, T, M] (baseline) or [N, G, E_loc, c, M] (S1, S2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _C


class CapacityError(RuntimeError):
    """A (token, choice) pair found its (slice, expert) capacity full and dropping was not asked."""


@dataclass
class Groups:
    """This rank's place in the layout of ``uniep._C.parm.rank_layout``."""

    mp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    mp_size: int  # N
    ep_size: int  # G
    mp_index: int  # m
    ep_index: int  # g


@dataclass
class Routing:
    idx: torch.Tensor  # [s, k] int64 expert ids
    weights: torch.Tensor  # [s, k] float32, differentiable (softmax probabilities)
    slot: torch.Tensor  # [s, k] int64 row in the [E, rows, M] buffer
    kept: torch.Tensor  # [s, k] bool
    psum: torch.Tensor  # [E] float32, differentiable: sum of the probabilities over the tokens
    top1: torch.Tensor  # [E] float64: tokens whose first choice is e (before capacity)
    dropped: int  # pairs of this rank's tokens that found no slot
    max_demand: int  # the largest (slice, expert) count: the capacity that would drop nothing


@dataclass
class ForwardState:
    """What the backward steps need: the compute steps' graphs and the routing."""

    graphs: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    route: Routing | None = None
    laux: torch.Tensor | None = None
    stats: dict[str, int] = field(default_factory=dict)


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


class CpuExecutor:
    """Runs one layer's forward and backward step lists on this rank."""

    def __init__(self, shape: Any, groups: Groups, overflow: str) -> None:
        self.shape = shape
        self.g = groups
        self.overflow = overflow
        self.E = shape.num_experts
        self.k = shape.top_k
        self.c = shape.slice_capacity
        self.N = shape.mp_size
        self.G = shape.ep_size
        self.E_loc = shape.local_experts

    # ---- collectives over the MP (= ESP) and EP groups ----
    def _all_gather(self, t: torch.Tensor, group: dist.ProcessGroup | None, n: int):
        if n == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    def _all_to_all(self, t: torch.Tensor, group: dist.ProcessGroup | None, n: int):
        """t [n, ...]: block i goes to group rank i; returns [n, ...], block j from rank j."""
        if n == 1:
            return t.clone()
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=group)
        return out

    def _reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """t [N, ...] partial -> [...] summed over the MP group, block m to rank m.

        As an all-to-all of the blocks and a local sum in MP-rank order (the same order as
        _all_reduce's), so the bits do not depend on the backend's reduction order."""
        got = self._all_to_all(t, self.g.mp, self.N)
        return _ordered_sum(list(got.unbind(0)))

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return _ordered_sum(self._all_gather(t, self.g.mp, self.N))

    # ---- routing ----
    def _route(self, x: torch.Tensor, wg: torch.Tensor, slices: torch.Tensor, rows_per_slice: bool):
        """Gate + slot assignment. slices [s]: the slice of each token; rows_per_slice: the slot
        is slice * c + position (the [E, N*c] buffer) rather than the position (one slice)."""
        s, E, k, c = x.shape[0], self.E, self.k, self.c
        probs = torch.softmax(x.float() @ wg.float(), dim=-1)
        weights, idx = probs.topk(k, dim=-1)
        # Choice-major order inside each (slice, expert): all first choices, then all second...
        e_flat = idx.t().reshape(-1)
        key = slices.repeat(k) * E + e_flat
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.N * E)
        starts = torch.cumsum(counts, 0) - counts
        pos_sorted = torch.arange(key.numel()) - starts[key[order]]
        pos = torch.empty_like(pos_sorted)
        pos[order] = pos_sorted
        pos = pos.view(k, s).t()
        kept = pos < c
        base = slices[:, None] * c if rows_per_slice else 0
        return Routing(
            idx=idx,
            weights=weights,
            slot=pos + base,
            kept=kept,
            psum=probs.sum(0),
            top1=torch.bincount(idx[:, 0], minlength=E).double(),
            dropped=int((~kept).sum()),
            max_demand=int(counts.max()) if s else 0,
        )

    # ---- forward ----
    def forward(
        self,
        x: torch.Tensor,
        wg: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        steps: Any,
        need_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardState]:
        st = ForwardState()
        env: dict[str, torch.Tensor] = {"x": x}
        S = x.shape[0]
        # S1 routes one slice per MP rank into a [E, c] buffer; the others route all S tokens
        # into [E, N*c], slice m's tokens in rows [m*c, (m+1)*c).
        split = steps.schedule == "s1"
        self._rows = self.c if split else self.N * self.c
        for step in steps.steps:
            op = step.op
            if op == "gate":
                xin = env[step.input]
                if not split:
                    slices = torch.repeat_interleave(
                        torch.arange(self.N),
                        torch.tensor([self.shape.slice_tokens(m) for m in range(self.N)]),
                    )
                else:
                    slices = torch.full((xin.shape[0],), self.g.mp_index, dtype=torch.long)
                with torch.enable_grad():
                    x_leaf = xin.detach().requires_grad_(need_grad)
                    wg_leaf = wg.detach().requires_grad_(need_grad)
                    st.route = self._route(x_leaf, wg_leaf, slices, rows_per_slice=not split)
                st.graphs["gate"] = ([x_leaf, wg_leaf], [])
                self._psum_total = st.route.psum.detach()
                self._top1_total = st.route.top1
            elif op == "world_agree_routing":
                self._agree(st, S, counts_drops=split or self.g.mp_index == 0)
            elif op == "mp_all_reduce_stats":
                both = torch.cat([st.route.psum.detach().double(), st.route.top1])
                tot = self._all_reduce(both)
                self._psum_total, self._top1_total = tot[: self.E].float(), tot[self.E :]
            elif op == "order":
                env[step.output] = self._compute(
                    st,
                    "order",
                    [env[step.input]],
                    need_grad,
                    lambda xin: self._order(xin, st.route),
                )
            elif op == "expert":
                env[step.output] = self._compute(
                    st, "expert", [env[step.input], w1, w2], need_grad, self._expert
                )
            elif op == "iorder":
                env[step.output] = self._compute(
                    st,
                    "iorder",
                    [env[step.input], st.route.weights],
                    need_grad,
                    lambda comb, w: self._iorder(comb, w, st.route, x.dtype),
                )
            else:
                env[step.output] = self._move(op, env[step.input], S)
        st.laux = self._laux(st, S, need_grad)
        return env["y"], st.laux.detach(), st

    def _compute(
        self, st: ForwardState, name: str, inputs: list[torch.Tensor], need_grad: bool, fn: Any
    ) -> torch.Tensor:
        with torch.enable_grad() if need_grad else torch.no_grad():
            leaves = [t.detach().requires_grad_(need_grad) for t in inputs]
            out = fn(*leaves)
        st.graphs[name] = (leaves, [out])
        return out.detach()

    def _laux(self, st: ForwardState, S: int, need_grad: bool) -> torch.Tensor:
        """GShard's E * sum_e me_e * ce_e over the MP group's S tokens. Only this rank's psum is
        differentiable here: under S1 the other slices' share is their ranks' gradient."""
        r = st.route
        ce = self._top1_total.float() / S
        with torch.enable_grad() if need_grad else torch.no_grad():
            own = self.E * (r.psum * ce).sum() / S
            rest = self.E * ((self._psum_total - r.psum.detach()) * ce).sum() / S
            laux = own + rest
        gate_in, _ = st.graphs["gate"]
        st.graphs["gate"] = (gate_in, [r.weights, laux])
        return laux

    def _agree(self, st: ForwardState, S: int, counts_drops: bool) -> None:
        """Every rank learns every rank's token count and overflow, so all raise or none does.
        Ranks that route the same tokens (baseline, S2) count drops on MP rank 0 only."""
        r = st.route
        mine = torch.tensor([S, r.dropped if counts_drops else 0, r.max_demand], dtype=torch.long)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rows = torch.stack(self._all_gather(mine, None, world)) if world > 1 else mine[None]
        sizes = rows[:, 0]
        if not bool((sizes == sizes[0]).all()):
            raise ValueError(
                f"x: every rank must pass the same number of tokens, got {sizes.tolist()} "
                "(per rank); the MP group replicates them and the all-to-alls need equal sizes"
            )
        dropped, demand = int(rows[:, 1].sum()), int(rows[:, 2].max())
        st.stats = {"dropped": dropped, "max_demand": demand, "slice_capacity": self.c}
        if dropped and self.overflow != "drop":
            raise CapacityError(
                f"capacity overflow: {dropped} (token, choice) pairs found their (slice, expert) "
                f"capacity of {self.c} full (the largest demand was {demand}); raise "
                "capacity_factor, or pass overflow='drop' to drop them (counted in "
                "last_stats['dropped'])"
            )

    def _order(self, xin: torch.Tensor, r: Routing) -> torch.Tensor:
        rows = self._rows
        tok, j = r.kept.nonzero(as_tuple=True)
        flat = r.idx[tok, j] * rows + r.slot[tok, j]
        out = xin.new_zeros(self.E * rows, xin.shape[1]).index_copy(0, flat, xin[tok])
        return out.view(self.E, rows, xin.shape[1])

    def _expert(self, inp: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """inp [..., E_loc, r, M] -> the partial outputs of this rank's shards, same shape."""
        shape = inp.shape
        rows = inp.movedim(-3, 0).reshape(self.E_loc, -1, shape[-1])
        h = F.gelu(torch.bmm(rows, w1))
        out = torch.bmm(h, w2)
        lead = inp.movedim(-3, 0).shape
        return out.reshape(lead).movedim(0, -3)

    def _iorder(self, comb: torch.Tensor, w: torch.Tensor, r: Routing, dtype: torch.dtype):
        E, rows, M = comb.shape
        tok, j = r.kept.nonzero(as_tuple=True)  # token-major: each token's choices in order
        flat = r.idx[tok, j] * rows + r.slot[tok, j]
        vals = comb.reshape(E * rows, M)[flat].float() * w[tok, j][:, None]
        y = torch.zeros(r.idx.shape[0], M, dtype=torch.float32).index_add(0, tok, vals)
        return y.to(dtype)

    # ---- data movement (the same handlers serve both passes) ----
    def _move(self, op: str, t: torch.Tensor, S: int) -> torch.Tensor:
        N, G, m = self.N, self.G, self.g.mp_index
        if op == "mp_split_tokens":
            return torch.tensor_split(t, N)[m].contiguous()
        if op == "mp_all_gather_tokens":
            sizes = [self.shape.slice_tokens(i) for i in range(N)]
            pad = t.new_zeros(max(sizes), t.shape[1])
            pad[: t.shape[0]] = t
            parts = self._all_gather(pad, self.g.mp, N)
            return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        if op == "mp_split_capacity":
            E, T, M = t.shape
            return t.view(E, N, T // N, M)[:, m].contiguous()
        if op == "mp_all_gather_capacity":
            parts = self._all_gather(t, self.g.mp, N)
            E, c, M = t.shape
            return torch.stack(parts, 1).reshape(E, N * c, M)
        if op == "ep_all_to_all_dispatch":
            E, rows, M = t.shape
            return self._all_to_all(t.view(G, self.E_loc, rows, M), self.g.ep, G)
        if op == "ep_all_to_all_combine":
            got = self._all_to_all(t, self.g.ep, G)
            return got.reshape(self.E, t.shape[-2], t.shape[-1])
        if op == "esp_all_gather":
            return torch.stack(self._all_gather(t, self.g.mp, N))
        if op == "esp_reduce_scatter":
            return self._reduce_scatter(t)
        if op in ("esp_all_reduce", "mp_all_reduce_gate_grad"):
            return self._all_reduce(t)
        raise NotImplementedError(f"parm CPU executor: no handler for step {op!r}")

    # ---- backward ----
    def backward(
        self, st: ForwardState, dy: torch.Tensor, dlaux: torch.Tensor | None, steps: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        env: dict[str, torch.Tensor] = {"dy": dy.contiguous()}
        grads: dict[str, torch.Tensor] = {}
        S = dy.shape[0]
        for step in steps.steps:
            op = step.op
            if op == "iorder_bwd":
                (comb, w), (y,) = st.graphs["iorder"]
                d_comb, d_w = torch.autograd.grad(y, [comb, w], env[step.input], allow_unused=True)
                env[step.output] = d_comb
                env["d_w"] = d_w if d_w is not None else torch.zeros_like(w)
            elif op == "expert_bwd":
                (inp, w1, w2), (out,) = st.graphs["expert"]
                d_in, grads["w1"], grads["w2"] = torch.autograd.grad(
                    out, [inp, w1, w2], env[step.input]
                )
                env[step.output] = d_in
            elif op == "order_bwd":
                (xin,), (disp,) = st.graphs["order"]
                (d_x,) = torch.autograd.grad(disp, [xin], env[step.input])
                env[step.output] = env[step.output] + d_x if step.output in env else d_x
            elif op == "gate_bwd":
                (xin, wg), (w, laux) = st.graphs["gate"]
                dl = dlaux if dlaux is not None else torch.zeros_like(laux)
                d_x, d_wg = torch.autograd.grad([w, laux], [xin, wg], [env[step.input], dl])
                env[step.output] = env[step.output] + d_x if step.output in env else d_x
                env["d_wg"] = d_wg
            else:
                env[step.output] = self._move(op, env[step.input], S)
        return env["dx"], env["d_wg"], grads["w1"], grads["w2"]


def plan_steps(shape: Any, schedule: str) -> tuple[Any, Any]:
    """(forward, backward) step lists of one schedule."""
    return (
        _C.parm.build_steps(shape, schedule, "forward"),
        _C.parm.build_steps(shape, schedule, "backward"),
    )
