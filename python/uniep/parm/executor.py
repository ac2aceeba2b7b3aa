"""The Parm step-list interpreter, shared by the CPU and the CUDA executor.

``ParmExecutor`` runs the steps of ``uniep._C.parm.build_steps`` in order, one handler per op,
over named buffers. What moves data between ranks and what multiplies the expert shards is a
``ParmBackend``: ``uniep.parm.cpu.GlooBackend`` (torch.distributed over gloo, CPU tensors) or
``uniep.parm.cuda.CudaBackend`` (UniEP's collectives, CUDA tensors). The routing, the ordering
into the dispatch buffer, the I-order and every backward compute step are plain torch math here,
on the tensors' device. Each backward compute step is the explicit vector-Jacobian product of
its forward step: no autograd inside the kernels, so they run under any dispatch mode (opcheck's
schema check, FlopCounterMode).

An SAA pair (two collectives linked by ``overlap_with``: an EP all-to-all, then an MP all-gather
of what arrived) goes to ``ParmBackend.pipelined`` as two callables: the CPU backend runs them
one after the other, the CUDA backend cuts the capacity dimension into chunks and runs chunk i's
all-gather on a second stream beside chunk i+1's all-to-all (``chunk_pipeline``). Both pair
members keep the capacity dimension at -2 (``CHUNK_DIM``), so the chunks' results concatenate to
the unpipelined result.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import _C
from .agreement import CallConfig, raise_if_a_rank_failed, raise_if_configs_differ

# The capacity (row) dimension of every SAA pair's input, intermediate and output.
CHUNK_DIM = -2


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
    # [2] int64 on the routing's device: pairs of this rank's tokens that found no slot, and
    # the largest (slice, expert) count (the capacity that would drop nothing). Read on the
    # host once, by the routing agreement: a read waits for the device.
    overflow: torch.Tensor


@dataclass
class ForwardState:
    """What the backward steps read: the routing, the saved step inputs and statistics."""

    route: Routing | None = None
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


class ParmBackend(Protocol):
    """The primitives a Parm executor runs on. Group collectives are over this rank's MP (= ESP)
    group or its EP group, in group-rank order; every rank of the world calls the same
    primitives in the same order with the same shapes."""

    # The chunks an SAA pair runs in where the plan gives none (1: unpipelined); the routing
    # agreement compares it, since ranks that chunk a pair differently exchange other sizes.
    default_chunks: int

    def mp_all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every MP rank's ``t`` (same shape everywhere), in MP order."""
        ...

    def ep_all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [G, ...]: block j goes to EP rank j; returns [G, ...], block j from EP rank j."""
        ...

    def mp_reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [N, ...] partials -> [...]: block m summed over the MP group, on MP rank m."""
        ...

    def mp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the MP group, in MP-rank order."""
        ...

    def world_all_gather_ints(self, mine: torch.Tensor) -> torch.Tensor:
        """``mine`` [k] int64 (CPU) of every world rank: [P, k] int64 on the CPU."""
        ...

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[B, m, k] @ [B, k, n] -> [B, m, n]: the expert shards' GEMMs."""
        ...

    def pipelined(
        self,
        first: Callable[[torch.Tensor], torch.Tensor],
        second: Callable[[torch.Tensor], torch.Tensor],
        t: torch.Tensor,
        chunks: int | None = None,
    ) -> torch.Tensor:
        """``second(first(t))``, possibly in chunks of dim ``CHUNK_DIM`` (an SAA pair):
        ``chunks`` of them when given (the plan's count), else the backend's default."""
        ...

    def end_pass(self) -> None:
        """After a forward or backward: report what the collectives recorded (device timeouts)."""
        ...


class Lanes(Protocol):
    """Where the two halves of a chunk pipeline run: ``second`` may start once ``first`` of the
    same chunk is done and may run beside ``first`` of the next chunk."""

    def run_second(
        self, second: Callable[[torch.Tensor], torch.Tensor], mid: torch.Tensor
    ) -> torch.Tensor: ...

    def join(self, outs: list[torch.Tensor]) -> None:
        """Make every ``run_second`` result usable by what follows the pipeline."""
        ...


class SerialLanes:
    """Both halves in program order on the current stream (or the CPU)."""

    def run_second(
        self, second: Callable[[torch.Tensor], torch.Tensor], mid: torch.Tensor
    ) -> torch.Tensor:
        return second(mid)

    def join(self, outs: list[torch.Tensor]) -> None:
        return None


def chunk_pipeline(
    first: Callable[[torch.Tensor], torch.Tensor],
    second: Callable[[torch.Tensor], torch.Tensor],
    t: torch.Tensor,
    chunks: int,
    lanes: Lanes,
) -> torch.Tensor:
    """``second(first(t))`` in ``chunks`` pieces of dim ``CHUNK_DIM``: chunk i's ``first`` is
    issued before chunk i-1's ``second`` is waited for, so with two lanes (CUDA streams) they
    overlap, as in the released SAA kernel. Both callables must act on each row of that dim on
    its own (the Parm all-to-alls and all-gathers move whole rows), so that the result equals
    the unpipelined one; every rank must use the same ``chunks``."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    rows = t.shape[CHUNK_DIM]
    n = max(1, min(chunks, rows))
    outs = []
    for part in torch.tensor_split(t, n, dim=CHUNK_DIM):
        mid = first(part.contiguous())
        outs.append(lanes.run_second(second, mid))
    lanes.join(outs)
    return outs[0] if n == 1 else torch.cat(outs, dim=CHUNK_DIM)


def check_chunks(chunks: Sequence[int] | None, steps: Any, name: str = "chunks") -> list[int]:
    """``chunks`` as the plan gives it (``uniep._C.parm.price(steps, model).chunks``): one count
    per step of ``steps``, 1 off the SAA pairs, the two members of a pair equal. None or empty
    means no plan (the backend's default for every pair); returns [] then.

    Raises:
        ValueError: a wrong length, a count below 1, or a pair whose members differ.
    """
    if not chunks:
        return []
    lst = list(steps.steps)
    got = list(chunks)
    if len(got) != len(lst):
        raise ValueError(
            f"{name}: expected one chunk count per step of the {steps.schedule} "
            f"{steps.pass_} list ({len(lst)}), got {len(got)}"
        )
    for i, (c, step) in enumerate(zip(got, lst, strict=True)):
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"{name}: step {i} ({step.op}): expected an int >= 1, got {c!r}")
        j = step.overlap_with
        if 0 <= j < len(lst) and got[j] != c:
            raise ValueError(
                f"{name}: the SAA pair of steps {min(i, j)} and {max(i, j)} must have one chunk "
                f"count, got {got[min(i, j)]} and {got[max(i, j)]}"
            )
    return got


def _count(ids: torch.Tensor, bins: int) -> torch.Tensor:
    """bincount(ids, minlength=bins) for ids < bins, without bincount's read of the largest id
    on the host (on CUDA a wait for the device)."""
    out = torch.zeros(bins, dtype=torch.long, device=ids.device)
    return out.scatter_add_(0, ids, torch.ones_like(ids))


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ..., in that order (bits independent of a backend's order)."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def _gelu_grad(h: torch.Tensor) -> torch.Tensor:
    """d gelu(h) / dh of the exact (erf) GELU."""
    cdf = 0.5 * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * h * h) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + h * pdf


class ParmExecutor:
    """Runs one layer's forward and backward step lists on this rank, over ``backend``."""

    def __init__(self, shape: Any, groups: Groups, overflow: str, backend: ParmBackend) -> None:
        self.shape = shape
        self.g = groups
        self.overflow = overflow
        self.be = backend
        self.E = shape.num_experts
        self.k = shape.top_k
        self.c = shape.slice_capacity
        self.N = shape.mp_size
        self.G = shape.ep_size
        self.E_loc = shape.local_experts

    # ---- walking a step list ----
    @staticmethod
    def _walk(steps: Any):
        """(index, step, SAA partner or None) in list order; a pair's second member is not
        repeated."""
        lst = list(steps.steps)
        i = 0
        while i < len(lst):
            step = lst[i]
            if step.overlap_with > i:
                if step.overlap_with != i + 1 or lst[i + 1].input != step.output:
                    raise ValueError(
                        f"steps: an SAA pair must be two adjacent steps, the second reading the "
                        f"first's output; step {i} ({step.op}) pairs with step {step.overlap_with}"
                    )
                yield i, step, lst[i + 1]
                i += 2
            else:
                yield i, step, None
                i += 1

    def _pair(
        self, first_op: str, second_op: str, t: torch.Tensor, chunks: int | None
    ) -> torch.Tensor:
        """An SAA pair (an EP all-to-all, then an MP all-gather of what arrived) on ``t``, in
        ``chunks`` pieces (None: the backend's default)."""

        def first(chunk: torch.Tensor) -> torch.Tensor:
            return self._move(first_op, chunk)

        if second_op == "mp_all_gather_capacity":
            # Gathered as [E, N, rows, M] so that the rows stay at CHUNK_DIM; the capacity
            # layout [E, N*rows, M] (MP rank n's rows at [n*rows, (n+1)*rows)) once whole.
            out = self.be.pipelined(first, self._gather_capacity, t, chunks)
            return out.reshape(out.shape[0], -1, out.shape[-1])

        def second(chunk: torch.Tensor) -> torch.Tensor:
            return self._move(second_op, chunk)

        return self.be.pipelined(first, second, t, chunks)

    # ---- routing ----
    def _slices(self, tokens: int, split: bool, device: torch.device) -> torch.Tensor:
        """The slice of each routed token: this rank's under S1, else the MP group's N slices."""
        if split:
            return torch.full((tokens,), self.g.mp_index, dtype=torch.long, device=device)
        # Built on the device from host ints: a host tensor copied over would wait for the
        # stream (a blocking copy), and the host would stop enqueueing until the device drains.
        out = torch.empty(tokens, dtype=torch.long, device=device)
        start = 0
        for m in range(self.N):
            n = self.shape.slice_tokens(m)
            out[start : start + n] = m
            start += n
        return out

    def _route(self, x: torch.Tensor, wg: torch.Tensor, split: bool) -> Routing:
        """Gate + slot assignment. Under S1 the slot is the position in this rank's slice (the
        [E, c] buffer); otherwise slice * c + position (the [E, N*c] buffer)."""
        s, E, k, c = x.shape[0], self.E, self.k, self.c
        dev = x.device
        slices = self._slices(s, split, dev)
        probs = torch.softmax(x.float() @ wg.float(), dim=-1)
        weights, idx = probs.topk(k, dim=-1)
        # Choice-major order inside each (slice, expert): all first choices, then all second...
        key = slices.repeat(k) * E + idx.t().reshape(-1)
        order = torch.argsort(key, stable=True)
        counts = _count(key, self.N * E)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.empty_like(key)
        pos[order] = torch.arange(key.numel(), device=dev) - starts[key[order]]
        pos = pos.view(k, s).t()
        kept = pos < c
        return Routing(
            x_in=x,
            probs=probs,
            idx=idx,
            weights=weights,
            slot=pos + (0 if split else slices[:, None] * c),
            kept=kept,
            top1=_count(idx[:, 0], E).double(),
            overflow=torch.stack([(~kept).sum(), counts.max()]) if s else key.new_zeros(2),
        )

    def _pairs(self, r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (token, choice) pair, token-major ([s * k]): its row of the [E * rows] buffer,
        with the dropped pairs at one sink row E * rows past the end; that row with the dropped
        pairs at row 0 instead (to read from the buffer itself); and whether it was kept
        ([s * k, 1]). All pairs rather than the kept ones: selecting them (nonzero) would read
        their count on the host, which waits for the device."""
        kept = r.kept.reshape(-1, 1)
        row = (r.idx * self._rows + r.slot).reshape(-1)
        return torch.where(kept[:, 0], row, self.E * self._rows), row * kept[:, 0], kept

    def _per_pair(self, t: torch.Tensor) -> torch.Tensor:
        """[s, M] -> [s * k, M]: each token's row once per choice, token-major."""
        k = self.k
        return t[:, None, :].expand(t.shape[0], k, t.shape[1]).reshape(-1, t.shape[1])

    # ---- forward ----
    def forward(
        self,
        x: torch.Tensor,
        wg: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        steps: Any,
        chunks: Sequence[int] | None = None,
        backward_chunks: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardState]:
        """(y, l_aux, what the backward needs). ``chunks``: the SAA pairs' chunk counts, one per
        step (``check_chunks``); None: the backend's default. ``backward_chunks``: those the
        backward will run with (checked by the caller), agreed here with the forward's."""
        st = ForwardState()
        env: dict[str, torch.Tensor] = {"x": x}
        split = self._begin(steps)
        plan = check_chunks(chunks, steps)
        for i, step, partner in self._walk(steps):
            op = step.op
            if partner is not None:
                n = plan[i] if plan else None
                env[partner.output] = self._pair(op, partner.op, env[step.input], n)
            elif op == "gate":
                st.route = self._route(env[step.input], wg, split)
                self._top1_total = st.route.top1
                self._psum_total = st.route.probs.sum(0)
            elif op == "world_agree_routing":
                config = self._config(steps, x.dtype, plan, backward_chunks)
                self._agree(st, x.shape[0], config, counts_drops=split or self.g.mp_index == 0)
            elif op == "mp_all_reduce_stats":
                both = torch.cat([st.route.probs.sum(0).double(), st.route.top1])
                tot = self.be.mp_all_reduce(both)
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
        self.be.end_pass()
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

    def _config(
        self,
        steps: Any,
        dtype: torch.dtype,
        plan: list[int],
        backward_chunks: Sequence[int] | None,
    ) -> CallConfig:
        """This call's configuration, as the routing agreement compares it across ranks."""

        def pairs(lst: Any, counts: Sequence[int] | None) -> tuple[int, ...]:
            return tuple(int(counts[i]) for i, s in enumerate(lst.steps) if s.overlap_with > i)

        sh = self.shape
        # Without a plan every pair runs in the backend's default count (set_saa_chunks on
        # CUDA), the backward's too: the forward's pairs carry it.
        default = [self.be.default_chunks] * len(steps.steps)
        bwd = _C.parm.build_steps(sh, steps.schedule, "backward") if backward_chunks else None
        return CallConfig(
            schedule=steps.schedule,
            mp_size=self.N,
            ep_size=self.G,
            hidden=sh.hidden,
            ffn_hidden=sh.ffn_hidden,
            num_experts=self.E,
            top_k=self.k,
            capacity_factor=sh.capacity_factor,
            overflow=self.overflow,
            dtype=dtype,
            chunks=(
                pairs(steps, plan or default),
                pairs(bwd, backward_chunks) if backward_chunks else (),
            ),
        )

    def _agree(self, st: ForwardState, S: int, config: CallConfig, counts_drops: bool) -> None:
        """Every rank learns every rank's token count, overflow and configuration, so all raise
        or none does. Ranks that route the same tokens (baseline, S2) count drops on MP rank 0
        only."""
        dropped_here, demand_here = st.route.overflow.tolist()
        mine = torch.tensor(
            [S, dropped_here if counts_drops else 0, demand_here, 0, *config.words()],
            dtype=torch.long,
        )
        rows = self.be.world_all_gather_ints(mine)
        # A rank whose own checks failed joined marked (uniep.parm.agreement): all raise now.
        raise_if_a_rank_failed(rows)
        raise_if_configs_differ(rows)
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
        sink, _, _ = self._pairs(r)
        M = xin.shape[1]
        # Kept pairs have distinct rows; the dropped ones all land on the sink row, cut off.
        out = xin.new_zeros(self.E * self._rows + 1, M).index_copy(0, sink, self._per_pair(xin))
        return out[:-1].view(self.E, self._rows, M)

    def _expert(self, inp: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """inp [..., E_loc, r, M] -> the partial outputs of this rank's shards, same shape."""
        rows = inp.movedim(-3, 0).reshape(self.E_loc, -1, inp.shape[-1])
        out = self.be.bmm(torch.nn.functional.gelu(self.be.bmm(rows, w1)), w2)
        return out.reshape(inp.movedim(-3, 0).shape).movedim(0, -3)

    def _iorder(self, comb: torch.Tensor, r: Routing, dtype: torch.dtype) -> torch.Tensor:
        _, row, kept = self._pairs(r)
        M = comb.shape[-1]
        vals = comb.reshape(-1, M)[row].float() * r.weights.reshape(-1, 1)
        # A dropped pair adds an exact zero (where, not a product: nothing from its row leaks).
        vals = torch.where(kept, vals, 0.0)
        return vals.view(-1, self.k, M).sum(1).to(dtype)

    # ---- data movement (the same handlers serve both passes) ----
    def _gather_capacity(self, t: torch.Tensor) -> torch.Tensor:
        """[E, rows, M] of every MP rank -> [E, N, rows, M]."""
        return torch.stack(self.be.mp_all_gather(t), 1)

    def _move(self, op: str, t: torch.Tensor) -> torch.Tensor:
        N, m = self.N, self.g.mp_index
        if op == "mp_split_tokens":
            return torch.tensor_split(t, N)[m].contiguous()
        if op == "mp_all_gather_tokens":
            sizes = [self.shape.slice_tokens(i) for i in range(N)]
            pad = t.new_zeros(max(sizes), t.shape[1])
            pad[: t.shape[0]] = t
            parts = self.be.mp_all_gather(pad)
            return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        if op == "mp_split_capacity":
            E, T, M = t.shape
            return t.view(E, N, T // N, M)[:, m].contiguous()
        if op == "mp_all_gather_capacity":
            E, rows, M = t.shape
            return self._gather_capacity(t).reshape(E, N * rows, M)
        if op == "ep_all_to_all_dispatch":
            E, rows, M = t.shape
            return self.be.ep_all_to_all(t.reshape(self.G, self.E_loc, rows, M))
        if op == "ep_all_to_all_combine":
            got = self.be.ep_all_to_all(t)
            return got.reshape(self.E, t.shape[-2], t.shape[-1])
        if op == "esp_all_gather":
            return torch.stack(self.be.mp_all_gather(t))
        if op == "esp_reduce_scatter":
            return self.be.mp_reduce_scatter(t)
        if op in ("esp_all_reduce", "mp_all_reduce_gate_grad"):
            return self.be.mp_all_reduce(t)
        raise NotImplementedError(f"parm executor: no handler for step {op!r}")

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
        chunks: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dx, d gate, d w1, d w2) from the backward step list; ``chunks`` as in ``forward``."""
        env: dict[str, torch.Tensor] = {"dy": dy.contiguous()}
        r = st.route
        grads: dict[str, torch.Tensor] = {}
        plan = check_chunks(chunks, steps)
        for i, step, partner in self._walk(steps):
            op, g = step.op, env.get(step.input)
            if partner is not None:
                n = plan[i] if plan else None
                env[partner.output] = self._pair(op, partner.op, g, n)
            elif op == "iorder_bwd":
                env[step.output], env["d_w"] = self._iorder_bwd(g, st.saved["comb"], r)
            elif op == "expert_bwd":
                env[step.output], grads["w1"], grads["w2"] = self._expert_bwd(
                    g, st.saved["exp_in"], w1, w2
                )
            elif op == "order_bwd":
                _, row, kept = self._pairs(r)
                M = g.shape[-1]
                d = torch.where(kept, g.reshape(-1, M)[row], 0).view(-1, self.k, M).sum(1)
                env[step.output] = env[step.output] + d if step.output in env else d
            elif op == "gate_bwd":
                d_x, env["d_wg"] = self._gate_bwd(g, dlaux, st, wg, dy.shape[0])
                env[step.output] = env[step.output] + d_x if step.output in env else d_x
            else:
                env[step.output] = self._move(op, g)
        self.be.end_pass()
        return env["dx"], env["d_wg"], grads["w1"], grads["w2"]

    def _iorder_bwd(self, dy: torch.Tensor, comb: torch.Tensor, r: Routing):
        sink, row, kept = self._pairs(r)
        M = comb.shape[-1]
        d_vals = self._per_pair(dy.float())
        d_comb = torch.zeros(comb.numel() // M + 1, M, dtype=comb.dtype, device=comb.device)
        d_comb.index_copy_(0, sink, (d_vals * r.weights.reshape(-1, 1)).to(comb.dtype))
        d_w = (d_vals * comb.reshape(-1, M)[row].float()).sum(-1, keepdim=True)
        d_w = torch.where(kept, d_w, 0.0).view_as(r.weights)
        return d_comb[:-1].view(comb.shape), d_w

    def _expert_bwd(
        self, d_out: torch.Tensor, inp: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
    ):
        """(d input partial, d w1, d w2). The first GEMM is recomputed from the saved input."""
        M = inp.shape[-1]
        mm = self.be.bmm
        rows = inp.movedim(-3, 0).reshape(self.E_loc, -1, M)
        d_rows_out = d_out.movedim(-3, 0).reshape(self.E_loc, -1, M)
        pre = mm(rows, w1)
        h = torch.nn.functional.gelu(pre)
        d_w2 = mm(h.transpose(1, 2), d_rows_out)
        d_pre = mm(d_rows_out, w2.transpose(1, 2)) * _gelu_grad(pre)
        d_w1 = mm(rows.transpose(1, 2), d_pre)
        d_in = mm(d_pre, w1.transpose(1, 2))
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
