"""The CPU executor of the Parm step lists: a small interpreter over torch.distributed (gloo).

It runs the steps of ``uniep._C.parm.build_steps`` in order, one handler per op, over named
buffers. Collectives are the plan's (all-gather, reduce-scatter, all-reduce, all-to-all over the
MP/ESP or EP group); an SAA pair runs as its all-to-all followed by its all-gather, which is what
the pipelined version computes. Compute steps are dense per-expert torch math, and each backward
compute step is the explicit vector-Jacobian product of its forward step: no autograd inside the
kernels, so they run under any dispatch mode (opcheck's schema check, FlopCounterMode). Sums over
ranks (the reduce-scatter and all-reduce of the expert partials, the gate gradient) add the
partials in MP-rank order, so they do not depend on the backend's reduction order.

Layout and capacity semantics: include/uniep/parm.hpp. Shapes (one rank):
    x, y           [S, M]                  replicated over the MP group
    route          gate output: top-k ids/weights [s, k], slot of each (token, choice)
    disp, comb     [E, rows, M]            rows = T = N*c (baseline, S2) or c (S1, S2's *_m)
    exp_in/out     [G, E_loc, T, M] (baseline) or [N, G, E_loc, c, M] (S1, S2)
The backward needs, from the forward: the routing (recomputed from x and the gate: it is a pure
function of them), the expert input ``exp_in``, the combine input ``comb`` and the MP group's
top-1 counts (for the load-balancing loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


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
    x_in: torch.Tensor  # [s, M] the routed tokens (all S, or this rank's slice under S1)
    probs: torch.Tensor  # [s, E] float32 softmax of the gate logits
    idx: torch.Tensor  # [s, k] int64 expert ids
    weights: torch.Tensor  # [s, k] float32 combine weights (the top-k probabilities)
    slot: torch.Tensor  # [s, k] int64 row in the [E, rows, M] buffer
    kept: torch.Tensor  # [s, k] bool
    top1: torch.Tensor  # [E] float64: tokens whose first choice is e (before capacity)
    dropped: int  # pairs of this rank's tokens that found no slot
    max_demand: int  # the largest (slice, expert) count: the capacity that would drop nothing


@dataclass
class ForwardState:
    """What the backward steps read: the routing, the saved step inputs and statistics."""

    route: Routing | None = None
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def _gelu_grad(h: torch.Tensor) -> torch.Tensor:
    """d gelu(h) / dh of the exact (erf) GELU."""
    cdf = 0.5 * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * h * h) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + h * pdf


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
    def _slices(self, tokens: int, split: bool) -> torch.Tensor:
        """The slice of each routed token: this rank's under S1, else the MP group's N slices."""
        if split:
            return torch.full((tokens,), self.g.mp_index, dtype=torch.long)
        sizes = torch.tensor([self.shape.slice_tokens(m) for m in range(self.N)])
        return torch.repeat_interleave(torch.arange(self.N), sizes)

    def _route(self, x: torch.Tensor, wg: torch.Tensor, split: bool) -> Routing:
        """Gate + slot assignment. Under S1 the slot is the position in this rank's slice (the
        [E, c] buffer); otherwise slice * c + position (the [E, N*c] buffer)."""
        s, E, k, c = x.shape[0], self.E, self.k, self.c
        slices = self._slices(s, split)
        probs = torch.softmax(x.float() @ wg.float(), dim=-1)
        weights, idx = probs.topk(k, dim=-1)
        # Choice-major order inside each (slice, expert): all first choices, then all second...
        key = slices.repeat(k) * E + idx.t().reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.N * E)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(key)
        pos[order] = torch.arange(key.numel()) - starts[key[order]]
        pos = pos.view(k, s).t()
        kept = pos < c
        return Routing(
            x_in=x,
            probs=probs,
            idx=idx,
            weights=weights,
            slot=pos + (0 if split else slices[:, None] * c),
            kept=kept,
            top1=torch.bincount(idx[:, 0], minlength=E).double(),
            dropped=int((~kept).sum()),
            max_demand=int(counts.max()) if s else 0,
        )

    def _flat(self, r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token, choice, row of [E * rows]) of every kept pair, token-major."""
        tok, j = r.kept.nonzero(as_tuple=True)
        return tok, j, r.idx[tok, j] * self._rows + r.slot[tok, j]

    # ---- forward ----
    def forward(
        self, x: torch.Tensor, wg: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, steps: Any
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardState]:
        """(y, l_aux, what the backward needs)."""
        st = ForwardState()
        env: dict[str, torch.Tensor] = {"x": x}
        split = self._begin(steps)
        for step in steps.steps:
            op = step.op
            if op == "gate":
                st.route = self._route(env[step.input], wg, split)
                self._top1_total = st.route.top1
                self._psum_total = st.route.probs.sum(0)
            elif op == "world_agree_routing":
                self._agree(st, x.shape[0], counts_drops=split or self.g.mp_index == 0)
            elif op == "mp_all_reduce_stats":
                both = torch.cat([st.route.probs.sum(0).double(), st.route.top1])
                tot = self._all_reduce(both)
                self._psum_total, self._top1_total = tot[: self.E].float(), tot[self.E :]
            elif op == "order":
                env[step.output] = self._order(env[step.input], st.route)
            elif op == "expert":
                st.saved["exp_in"] = env[step.input]
                env[step.output] = self._expert(env[step.input], w1, w2)
            elif op == "iorder":
                st.saved["comb"] = env[step.input]
                env[step.output] = self._iorder(env[step.input], st.route, x.dtype)
            else:
                env[step.output] = self._move(op, env[step.input])
        st.saved["top1_total"] = self._top1_total
        S = x.shape[0]
        ce = self._top1_total.float() / S
        laux = self.E * (self._psum_total * ce).sum() / S
        return env["y"], laux, st

    def _begin(self, steps: Any) -> bool:
        # S1 routes one slice per MP rank into a [E, c] buffer; the others route all S tokens
        # into [E, N*c], slice m's tokens in rows [m*c, (m+1)*c).
        split = steps.schedule == "s1"
        self._rows = self.c if split else self.N * self.c
        return split

    def rebuild(
        self,
        x: torch.Tensor,
        wg: torch.Tensor,
        exp_in: torch.Tensor,
        comb: torch.Tensor,
        top1_total: torch.Tensor,
        steps: Any,
    ) -> ForwardState:
        """The forward state from its saved tensors, for a backward in another call (the
        torch.ops path). No collective: routing is a pure function of (x, gate)."""
        split = self._begin(steps)
        xin = torch.tensor_split(x, self.N)[self.g.mp_index].contiguous() if split else x
        st = ForwardState(route=self._route(xin, wg, split))
        st.saved = {"exp_in": exp_in, "comb": comb, "top1_total": top1_total}
        return st

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
        tok, _, flat = self._flat(r)
        out = xin.new_zeros(self.E * self._rows, xin.shape[1]).index_copy(0, flat, xin[tok])
        return out.view(self.E, self._rows, xin.shape[1])

    def _expert(self, inp: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """inp [..., E_loc, r, M] -> the partial outputs of this rank's shards, same shape."""
        rows = inp.movedim(-3, 0).reshape(self.E_loc, -1, inp.shape[-1])
        out = torch.bmm(torch.nn.functional.gelu(torch.bmm(rows, w1)), w2)
        return out.reshape(inp.movedim(-3, 0).shape).movedim(0, -3)

    def _iorder(self, comb: torch.Tensor, r: Routing, dtype: torch.dtype) -> torch.Tensor:
        tok, j, flat = self._flat(r)
        M = comb.shape[-1]
        vals = comb.reshape(-1, M)[flat].float() * r.weights[tok, j][:, None]
        y = torch.zeros(r.idx.shape[0], M, dtype=torch.float32).index_add(0, tok, vals)
        return y.to(dtype)

    # ---- data movement (the same handlers serve both passes) ----
    def _move(self, op: str, t: torch.Tensor) -> torch.Tensor:
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
        self,
        st: ForwardState,
        dy: torch.Tensor,
        dlaux: torch.Tensor | None,
        wg: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        steps: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx, d gate, d w1, d w2) from the backward step list."""
        env: dict[str, torch.Tensor] = {"dy": dy.contiguous()}
        r = st.route
        grads: dict[str, torch.Tensor] = {}
        for step in steps.steps:
            op, g = step.op, env.get(step.input)
            if op == "iorder_bwd":
                env[step.output], env["d_w"] = self._iorder_bwd(g, st.saved["comb"], r)
            elif op == "expert_bwd":
                env[step.output], grads["w1"], grads["w2"] = self._expert_bwd(
                    g, st.saved["exp_in"], w1, w2
                )
            elif op == "order_bwd":
                tok, _, flat = self._flat(r)
                d = torch.zeros_like(r.x_in).index_add(0, tok, g.reshape(-1, g.shape[-1])[flat])
                env[step.output] = env[step.output] + d if step.output in env else d
            elif op == "gate_bwd":
                d_x, env["d_wg"] = self._gate_bwd(g, dlaux, st, wg, dy.shape[0])
                env[step.output] = env[step.output] + d_x if step.output in env else d_x
            else:
                env[step.output] = self._move(op, g)
        return env["dx"], env["d_wg"], grads["w1"], grads["w2"]

    def _iorder_bwd(self, dy: torch.Tensor, comb: torch.Tensor, r: Routing):
        tok, j, flat = self._flat(r)
        M = comb.shape[-1]
        d_vals = dy.float()[tok]
        d_comb = torch.zeros(comb.numel() // M, M, dtype=comb.dtype)
        d_comb.index_add_(0, flat, (d_vals * r.weights[tok, j][:, None]).to(comb.dtype))
        d_w = torch.zeros_like(r.weights)
        d_w[tok, j] = (d_vals * comb.reshape(-1, M)[flat].float()).sum(-1)
        return d_comb.view(comb.shape), d_w

    def _expert_bwd(
        self, d_out: torch.Tensor, inp: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
    ):
        """(d input partial, d w1, d w2). The first GEMM is recomputed from the saved input."""
        M = inp.shape[-1]
        rows = inp.movedim(-3, 0).reshape(self.E_loc, -1, M)
        d_rows_out = d_out.movedim(-3, 0).reshape(self.E_loc, -1, M)
        pre = torch.bmm(rows, w1)
        h = torch.nn.functional.gelu(pre)
        d_w2 = torch.bmm(h.transpose(1, 2), d_rows_out)
        d_pre = torch.bmm(d_rows_out, w2.transpose(1, 2)) * _gelu_grad(pre)
        d_w1 = torch.bmm(rows.transpose(1, 2), d_pre)
        d_in = torch.bmm(d_pre, w1.transpose(1, 2))
        return d_in.reshape(inp.movedim(-3, 0).shape).movedim(0, -3), d_w1, d_w2

    def _gate_bwd(
        self,
        d_w: torch.Tensor,
        dlaux: torch.Tensor | None,
        st: ForwardState,
        wg: torch.Tensor,
        S: int,
    ):
        """(d routed tokens, d gate weight) through top-k, softmax and the logits GEMM; l_aux =
        E * sum_e me_e * ce_e gives each probability E * ce_e / S (ce: the MP group's top-1
        fractions; under S1 the other slices' probabilities are their ranks' gradient)."""
        r = st.route
        d_probs = torch.zeros_like(r.probs)
        d_probs.scatter_add_(1, r.idx, d_w)
        if dlaux is not None:
            ce = st.saved["top1_total"].float() / S
            d_probs += dlaux.float() * self.E * ce / S
        d_logits = r.probs * (d_probs - (d_probs * r.probs).sum(-1, keepdim=True))
        d_x = (d_logits @ wg.float().t()).to(r.x_in.dtype)
        d_wg = (r.x_in.float().t() @ d_logits).to(wg.dtype)
        return d_x, d_wg
