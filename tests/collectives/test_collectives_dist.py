"""The P2P-decomposed collectives on 2 and 4 gloo ranks, and on one rank (group "").

Each world size is one spawn: every rank runs all cases (forward against the torch.distributed
collective + torch.matmul reference computed on the same ranks, backward against autograd through
that reference, bad inputs, the parallel linear layers against one full nn.Linear), and the test
process checks what they returned.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _moe_cases import rel_err, same_bits
from torch import nn
from uniep import collectives
from uniep.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear

WORLDS = (2, 4)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Products and sums; copies (gathers, all-to-all) must be exact.
TOLERANCE = {"float32": 1e-6, "bfloat16": 1e-2, "float64": 1e-12}
GRAD_TOLERANCE = 1e-12  # float64


@dataclass(frozen=True)
class Case:
    """One forward problem, run once per (chunks, order) variant.

    agmm: a [rows, k], b [k, n]; mmrs: a [W*rows, k], b [k, n]; ag: x [rows, k, n];
    rs: x [W*rows, k]; uly: x [rows, k*W, n] (or [W*rows, k, n] for dims (0, 1), or
    [2, rows, k*W, n] for the 4-D case), scattered on dims[0] and gathered on dims[1].
    Every rank draws its own inputs from (seed, rank).
    """

    name: str
    op: str  # agmm, mmrs, ag, rs, uly
    dtype: str
    rows: int
    k: int
    n: int
    seed: int
    variants: tuple[tuple[int, str], ...] = ((1, "direct"), (2, "direct"), (1, "ring"), (2, "ring"))
    dims: tuple[int, int] = (1, 0)


def _cases() -> list[Case]:
    out = []
    for i, dtype in enumerate(DTYPES):
        s = 10 * i
        more = ((1, "direct"), (2, "direct"), (4, "direct"), (1, "ring"), (2, "ring"), (4, "ring"))
        out += [
            Case(f"agmm-{dtype}", "agmm", dtype, 4, 24, 20, s + 1, more),
            Case(f"agmm-odd-{dtype}", "agmm", dtype, 6, 17, 9, s + 2),
            Case(f"mmrs-{dtype}", "mmrs", dtype, 4, 24, 20, s + 3, more),
            Case(f"mmrs-odd-{dtype}", "mmrs", dtype, 6, 13, 11, s + 4),
            Case(f"ag-{dtype}", "ag", dtype, 4, 3, 5, s + 5, more),
            Case(f"rs-{dtype}", "rs", dtype, 4, 3, 5, s + 6, more),
            Case(f"uly-seq-to-heads-{dtype}", "uly", dtype, 3, 2, 4, s + 7, ((1, "direct"),)),
            Case(
                f"uly-heads-to-seq-{dtype}", "uly", dtype, 3, 2, 4, s + 8, ((1, "direct"),), (0, 1)
            ),
        ]
    out += [
        Case("uly-4d-float32", "uly", "float32", 2, 3, 5, 40, ((1, "direct"),), (2, 1)),
        Case(
            "uly-negative-dims-float64", "uly", "float64", 2, 2, 3, 41, ((1, "direct"),), (-2, -3)
        ),
        Case("agmm-empty-k-float32", "agmm", "float32", 2, 0, 5, 42, ((1, "direct"), (2, "ring"))),
        Case("rs-empty-rows-float32", "rs", "float32", 0, 3, 2, 43, ((1, "direct"), (1, "ring"))),
    ]
    return out


CASES = _cases()


def _gen(seed: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * seed + rank)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _uly_input(case: Case, world: int, gen: torch.Generator) -> torch.Tensor:
    dtype = DTYPES[case.dtype]
    if case.name.startswith("uly-4d"):
        return _randn(gen, 2, case.rows, case.k * world, case.n, dtype=dtype)
    if case.dims == (0, 1):  # heads -> sequence: x [S, H/W, D]
        return _randn(gen, case.rows * world, case.k, case.n, dtype=dtype)
    return _randn(gen, case.rows, case.k * world, case.n, dtype=dtype)


def _inputs(case: Case, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    gen = _gen(case.seed, rank)
    dtype, m, k, n = DTYPES[case.dtype], case.rows, case.k, case.n
    if case.op == "agmm":
        return _randn(gen, m, k, dtype=dtype), _randn(gen, k, n, dtype=dtype)
    if case.op == "mmrs":
        return _randn(gen, world * m, k, dtype=dtype), _randn(gen, k, n, dtype=dtype)
    if case.op == "ag":
        return (_randn(gen, m, k, n, dtype=dtype),)
    if case.op == "rs":
        return (_randn(gen, world * m, k, dtype=dtype),)
    return (_uly_input(case, world, gen),)


# ---- references: the torch.distributed collective + torch.matmul ----


def _ref_all_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _ref_reduce_scatter(x: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    out = torch.empty_like(x.chunk(world)[0]) if x.shape[0] else x.new_empty((0, *x.shape[1:]))
    dist.reduce_scatter(out, [p.contiguous() for p in x.tensor_split(world)])
    return out


def _ref_ulysses(x: torch.Tensor, sd: int, gd: int, world: int) -> torch.Tensor:
    import torch.distributed as dist

    send = [p.contiguous() for p in x.tensor_split(world, sd)]
    recv = [torch.empty_like(p) for p in send]
    dist.all_to_all(recv, send)
    return torch.cat(recv, gd)


def _run_op(case: Case, args: tuple, group: str, chunks: int, order: str) -> Any:
    ops = torch.ops.uniep
    if case.op == "agmm":
        return ops.all_gather_matmul(*args, group, chunks, order)
    if case.op == "mmrs":
        return ops.matmul_reduce_scatter(*args, group, chunks, order)
    if case.op == "ag":
        return ops.all_gather(*args, group, chunks, order)
    if case.op == "rs":
        return ops.reduce_scatter(*args, group, chunks, order)
    return ops.all_to_all_ulysses(*args, *case.dims, group)


def _reference(case: Case, args: tuple, world: int) -> Any:
    if case.op == "agmm":
        ag = _ref_all_gather(args[0], world)
        return ag, ag @ args[1]
    if case.op == "mmrs":
        return _ref_reduce_scatter(args[0] @ args[1], world)
    if case.op == "ag":
        return _ref_all_gather(args[0], world)
    if case.op == "rs":
        return _ref_reduce_scatter(args[0], world)
    return _ref_ulysses(args[0], *case.dims, world)


# ---- backward: autograd through our ops vs through the functional collectives ----

BACKWARD = (
    "agmm-both-outputs",
    "agmm-mm-only",
    "agmm-ag-only",
    "agmm-b-only",
    "mmrs",
    "mmrs-b-only",
    "ag",
    "rs",
    "uly",
)


def _backward_case(name: str, rank: int, world: int, chunks: int, order: str) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from uniep.distributed import group_name

    group, pg = group_name(), dist.group.WORLD
    gen = _gen(100 + BACKWARD.index(name), rank)
    f64 = torch.float64
    m, k, n = 4, 6, 5

    def leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
        return [_randn(gen, *s, dtype=f64) for s in shapes]

    def grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], need: list[bool]):
        xs = [x.clone().requires_grad_(r) for x, r in zip(inputs, need, strict=True)]
        fn(*xs).backward()
        return [x.grad for x in xs]

    # torch's differentiable collectives (the *_single names are the current ones).
    fc_ag = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    fc_rs = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd

    def ref_ag(x: torch.Tensor) -> torch.Tensor:
        return fc_ag(x, 0, pg)

    def ref_rs(x: torch.Tensor) -> torch.Tensor:
        return fc_rs(x, "sum", 0, pg)

    if name.startswith("agmm"):
        a, b = leaves((m, k), (k, n))
        g_ag, g_mm = leaves((world * m, k), (world * m, n))
        use_ag = name in ("agmm-both-outputs", "agmm-ag-only")
        use_mm = name != "agmm-ag-only"
        need = [name != "agmm-b-only", True]

        def loss(ag: torch.Tensor, mm: torch.Tensor) -> torch.Tensor:
            terms = [(ag * g_ag).sum()] if use_ag else []
            return sum(terms + ([(mm * g_mm).sum()] if use_mm else []))

        def ours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return loss(*torch.ops.uniep.all_gather_matmul(a, b, group, chunks, order))

        def ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ag = ref_ag(a)
            return loss(ag, ag @ b)

        return {"ours": grads(ours, [a, b], need), "ref": grads(ref, [a, b], need)}
    if name.startswith("mmrs"):
        a, b = leaves((world * m, k), (k, n))
        (g,) = leaves((m, n))
        need = [name != "mmrs-b-only", True]

        def ours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (torch.ops.uniep.matmul_reduce_scatter(a, b, group, chunks, order) * g).sum()

        def ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (ref_rs(a @ b) * g).sum()

        return {"ours": grads(ours, [a, b], need), "ref": grads(ref, [a, b], need)}
    if name == "ag":
        (x,) = leaves((m, 3))
        (g,) = leaves((world * m, 3))
        return {
            "ours": grads(
                lambda x: (torch.ops.uniep.all_gather(x, group, chunks, order) * g).sum(),
                [x],
                [True],
            ),
            "ref": grads(lambda x: (ref_ag(x) * g).sum(), [x], [True]),
        }
    if name == "rs":
        (x,) = leaves((world * m, 3))
        (g,) = leaves((m, 3))
        return {
            "ours": grads(
                lambda x: (torch.ops.uniep.reduce_scatter(x, group, chunks, order) * g).sum(),
                [x],
                [True],
            ),
            "ref": grads(lambda x: (ref_rs(x) * g).sum(), [x], [True]),
        }
    # Ulysses: [S/W, H, D] -> [S, H/W, D]; the reference through all_to_all_single.
    (x,) = leaves((3, 2 * world, 4))
    (g,) = leaves((3 * world, 2, 4))

    def ref_uly(x: torch.Tensor) -> torch.Tensor:
        send = torch.stack(x.tensor_split(world, 1))
        recv = fc.all_to_all_single_autograd(send.reshape(world, -1), None, None, pg)
        return torch.cat(recv.reshape(send.shape).unbind(0), 0)

    return {
        "ours": grads(
            lambda x: (torch.ops.uniep.all_to_all_ulysses(x, 1, 0, group) * g).sum(), [x], [True]
        ),
        "ref": grads(lambda x: (ref_uly(x) * g).sum(), [x], [True]),
    }


# ---- bad inputs: (name, call, the words the error must contain) ----


def _error_cases(rank: int, world: int) -> list[tuple[str, Callable[[], Any], str]]:
    from uniep.distributed import group_name

    g = group_name()
    ops = torch.ops.uniep
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    x = torch.randn(world * 2, 3)
    last = world - 1

    def one_failed(op: str) -> str:
        return f"{op}: rank {last} passed invalid arguments"

    return [
        (
            "mmrs-rows-not-divisible",
            lambda: ops.matmul_reduce_scatter(torch.randn(world * 2 + 1, 6), b, g),
            "a.size(0) (M = ",
        ),
        (
            "rs-rows-not-divisible",
            lambda: ops.reduce_scatter(torch.randn(world + 1, 3), g),
            "must be divisible by the world size",
        ),
        (
            "agmm-dtype-mismatch",
            lambda: ops.all_gather_matmul(a, b.double(), g),
            "b must have a's dtype",
        ),
        ("agmm-a-3d", lambda: ops.all_gather_matmul(a[None], b, g), "a must be a 2-D"),
        (
            "agmm-k-mismatch",
            lambda: ops.all_gather_matmul(a, torch.randn(7, 5), g),
            "b must be [K, N] with K = a.size(1)",
        ),
        (
            "agmm-int",
            lambda: ops.all_gather_matmul(a.long(), b.long(), g),
            "a must be float32, bfloat16 or float64",
        ),
        (
            "agmm-chunks-not-dividing",
            lambda: ops.all_gather_matmul(a, b, g, 3),
            "chunks (3) must divide a.size(0)",
        ),
        ("rs-chunks-zero", lambda: ops.reduce_scatter(x, g, 0), "chunks must be >= 1"),
        (
            "ag-bad-order",
            lambda: ops.all_gather(x, g, 1, "tree"),
            'order must be "direct" or "ring"',
        ),
        ("ag-0d", lambda: ops.all_gather(torch.tensor(1.0), g), "x must have at least 1 dim"),
        (
            "uly-same-dims",
            lambda: ops.all_to_all_ulysses(torch.randn(2, world, 3), 1, 1, g),
            "scatter_dim and gather_dim must differ",
        ),
        (
            "uly-dim-range",
            lambda: ops.all_to_all_ulysses(torch.randn(2, world, 3), 3, 0, g),
            "scatter_dim must be in [-3, 3)",
        ),
        (
            "uly-not-divisible",
            lambda: ops.all_to_all_ulysses(torch.randn(2, world + 1, 3), 1, 0, g),
            "x.size(scatter_dim = 1)",
        ),
        (
            "uly-1d",
            lambda: ops.all_to_all_ulysses(torch.randn(world), 0, 0, g),
            "x must have at least 2 dimensions",
        ),
        ("unknown-group", lambda: ops.all_gather(x, "no-such-group"), "group_name 'no-such-group'"),
        # Only one rank is wrong: every rank must fail, the others naming it.
        (
            "one-rank-bad-shape",
            lambda: ops.all_gather_matmul(a[None] if rank == 0 else a, b, g),
            "a must be a 2-D" if rank == 0 else "rank 0 passed invalid arguments",
        ),
        # A mismatch: every rank raises the same message, rank 0's value against the first rank
        # that differs from it.
        (
            "k-differs",
            lambda: ops.all_gather_matmul(torch.randn(4, 6 + rank), torch.randn(6 + rank, 5), g),
            "all_gather_matmul: K (a.size(1)) differs across ranks: rank 0 has 6, rank 1 has 7",
        ),
        (
            "dtype-differs",
            lambda: ops.reduce_scatter(x.double() if rank == 0 else x, g),
            "reduce_scatter: dtype differs across ranks: rank 0 has float64, rank 1 has float32",
        ),
        (
            "order-differs",
            lambda: ops.all_gather(x, g, 1, "ring" if rank == 0 else "direct"),
            "all_gather: order differs across ranks: rank 0 has ring, rank 1 has direct",
        ),
        (
            "chunks-differ",
            lambda: ops.all_gather(x, g, 1 + (rank == 0)),
            "chunks differs across ranks: rank 0 has 2, rank 1 has 1",
        ),
        (
            "rows-differ",
            lambda: ops.all_gather(torch.randn(2 + (rank == 1), 3), g),
            "all_gather: x.shape differs across ranks: rank 0 has [2, 3], rank 1 has [3, 3]",
        ),
        # Same bytes per rank, another layout: silently mixed-up data before the shape was agreed.
        (
            "ag-row-shape-differs",
            lambda: ops.all_gather(torch.randn(2, 6, 4) if rank == 1 else torch.randn(2, 4, 6), g),
            "all_gather: x.shape differs across ranks: rank 0 has [2, 4, 6], rank 1 has [2, 6, 4]",
        ),
        (
            "ag-transposed-differs",
            lambda: ops.all_gather(torch.randn(6, 4) if rank == 1 else torch.randn(4, 6), g),
            "all_gather: x.shape differs across ranks: rank 0 has [4, 6], rank 1 has [6, 4]",
        ),
        (
            "ag-ndim-differs",
            lambda: ops.all_gather(torch.randn(4, 1) if rank == 1 else torch.randn(4), g),
            "all_gather: x.shape differs across ranks: rank 0 has [4], rank 1 has [4, 1]",
        ),
        (
            # 10 dims: more than the header carries inline, so the shapes take a second exchange.
            "ag-long-shape-differs",
            lambda: ops.all_gather(torch.randn(2, *[1] * 7, *((3, 2) if rank == 1 else (2, 3))), g),
            "all_gather: x.shape differs across ranks: rank 0 has [2, 1, 1, 1, 1, 1, 1, 1, 2, 3], "
            "rank 1 has [2, 1, 1, 1, 1, 1, 1, 1, 3, 2]",
        ),
        (
            "rs-row-shape-differs",
            lambda: ops.reduce_scatter(
                torch.randn(world, 6, 4) if rank == 1 else torch.randn(world, 4, 6), g
            ),
            f"reduce_scatter: x.shape differs across ranks: rank 0 has [{world}, 4, 6], "
            f"rank 1 has [{world}, 6, 4]",
        ),
        (
            "uly-scatter-dim-differs",
            lambda: ops.all_to_all_ulysses(torch.randn(4, 4, 3), 0 if rank == 1 else 1, 2, g),
            "all_to_all_ulysses: scatter_dim differs across ranks: rank 0 has 1, rank 1 has 0",
        ),
        (
            "uly-dims-swapped",
            lambda: ops.all_to_all_ulysses(
                torch.randn(4, 4, 3), *((0, 1) if rank == 1 else (1, 0)), g
            ),
            "all_to_all_ulysses: scatter_dim differs across ranks: rank 0 has 1, rank 1 has 0",
        ),
        (
            "uly-gather-dim-differs",
            lambda: ops.all_to_all_ulysses(torch.randn(4, 4, 3), 1, 2 if rank == 1 else 0, g),
            "all_to_all_ulysses: gather_dim differs across ranks: rank 0 has 0, rank 1 has 2",
        ),
        (
            "uly-shape-differs",
            lambda: ops.all_to_all_ulysses(
                torch.randn(2, 4, 3) if rank == 1 else torch.randn(3, 4, 2), 1, 0, g
            ),
            "all_to_all_ulysses: x.shape differs across ranks: rank 0 has [3, 4, 2], "
            "rank 1 has [2, 4, 3]",
        ),
        # The layers' own checks on one rank: its peers, in the op, raise at once naming it.
        (
            "col-layer-dtype-on-one-rank",
            lambda: ColumnParallelLinear(4, 2 * world)(
                torch.randn(2, 4, dtype=torch.float64 if rank == last else torch.float32)
            ),
            "x must have the layer's dtype" if rank == last else one_failed("all_gather_matmul"),
        ),
        (
            "row-layer-sequence-on-one-rank",
            lambda: RowParallelLinear(2 * world, 4)(torch.randn(world + (rank == last), 2)),
            "must be divisible by the group's world size"
            if rank == last
            else one_failed("matmul_reduce_scatter"),
        ),
    ]


# ---- the parallel linear layers against one full nn.Linear (float64) ----


def _module_cases(rank: int, world: int) -> dict[str, Any]:
    f64 = torch.float64
    S, IN, HID, OUT = 4 * world, 8, 4 * world, 6
    gen = _gen(77, 0)  # the same global data on every rank
    X = _randn(gen, S, IN, dtype=f64)
    GY = _randn(gen, S, HID, dtype=f64)
    GZ = _randn(gen, S, OUT, dtype=f64)
    hid = slice(rank * HID // world, (rank + 1) * HID // world)
    seq = slice(rank * S // world, (rank + 1) * S // world)
    out: dict[str, Any] = {}

    # Initialisation: the slice of what nn.Linear draws under the same seed, for every dtype.
    for dtype in (torch.float32, torch.bfloat16, f64):
        torch.manual_seed(5)
        full = nn.Linear(IN, HID, bias=True, dtype=dtype)
        torch.manual_seed(5)
        col = ColumnParallelLinear(IN, HID, bias=True, dtype=dtype)
        row = RowParallelLinear(HID, IN, bias=True, dtype=dtype)
        # The row layer was drawn after the column layer: so is its reference.
        torch.manual_seed(5)
        nn.Linear(IN, HID, bias=True, dtype=dtype)
        full_row = nn.Linear(HID, IN, bias=True, dtype=dtype)
        out[f"init-{dtype}"] = [
            (col.weight, full.weight[hid]),
            (col.bias, full.bias[hid]),
            (row.weight, full_row.weight[:, hid]),
            (row.bias, full_row.bias),
        ]

    for sp in (True, False):
        for chunks, order in ((1, "direct"), (2, "ring")):
            tag = f"sp={sp}-chunks={chunks}-{order}"
            torch.manual_seed(11)
            full1 = nn.Linear(IN, HID, bias=True, dtype=f64)
            full2 = nn.Linear(HID, OUT, bias=True, dtype=f64)
            torch.manual_seed(11)
            kw = {
                "sequence_parallel": sp,
                "bias": True,
                "dtype": f64,
                "chunks": chunks,
                "order": order,
            }
            col = ColumnParallelLinear(IN, HID, **kw)
            row = RowParallelLinear(HID, OUT, **kw)

            # Column alone: y [S, HID/W].
            xr = X.clone().requires_grad_(True)
            y_full = full1(xr)
            (y_full * GY).sum().backward()
            x_in = (X[seq] if sp else X).clone().requires_grad_(True)
            y = col(x_in)
            (y * GY[:, hid]).sum().backward()
            out[f"column-{tag}"] = [
                (y, y_full[:, hid]),
                (x_in.grad, xr.grad[seq] if sp else xr.grad),
                (col.weight.grad, full1.weight.grad[hid]),
                (col.bias.grad, full1.bias.grad[hid]),
            ]
            for p in (*full1.parameters(), *col.parameters()):
                p.grad = None

            # Column -> tanh -> row, as in a transformer MLP block: [S/W or S, OUT].
            xr = X.clone().requires_grad_(True)
            z_full = full2(torch.tanh(full1(xr)))
            (z_full * GZ).sum().backward()
            x_in = (X[seq] if sp else X).clone().requires_grad_(True)
            z = row(torch.tanh(col(x_in)))
            (z * (GZ[seq] if sp else GZ)).sum().backward()
            out[f"mlp-{tag}"] = [
                (z, z_full[seq] if sp else z_full),
                (x_in.grad, xr.grad[seq] if sp else xr.grad),
                (col.weight.grad, full1.weight.grad[hid]),
                (row.weight.grad, full2.weight.grad[:, hid]),
            ]
            # With sequence parallelism each rank holds its rows' share of the row bias grad.
            out[f"mlp-{tag}-row-bias"] = (row.bias.grad, full2.bias.grad)

    # from_full: the same slices, no RNG drawn.
    torch.manual_seed(3)
    full = nn.Linear(IN, HID, bias=True, dtype=f64)
    state = torch.random.get_rng_state()
    col = ColumnParallelLinear.from_full(full, chunks=2)
    row = RowParallelLinear.from_full(full.weight.t().contiguous())
    out["from_full"] = [
        (col.weight, full.weight[hid]),
        (col.bias, full.bias[hid]),
        (row.weight, full.weight.t()[:, hid]),
    ]
    out["from_full-rng-untouched"] = torch.equal(state, torch.random.get_rng_state())
    return out


def batch_worker(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    """Runs on every rank; each entry holds results or the traceback of the case."""
    import uniep  # noqa: F401  (ops, fake kernels, autograd)
    from uniep.distributed import group_name

    group = group_name()
    results: dict[str, Any] = {}

    def record(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except Exception:
            results[name] = traceback.format_exc()

    for case in cases:

        def forward(case: Case = case) -> dict[str, Any]:
            args = _inputs(case, rank, world)
            outs = [_run_op(case, args, group, c, o) for c, o in case.variants]
            return {"outs": outs, "ref": _reference(case, args, world)}

        record(case.name, forward)

    def non_contiguous() -> list[Any]:
        a = torch.randn(6, 4, generator=_gen(90, rank)).t()  # [4, 6], strided
        b = torch.randn(5, 6, generator=_gen(91, rank)).t()
        x = torch.randn(3, world * 2, generator=_gen(92, rank)).t()
        return [
            (
                torch.ops.uniep.all_gather_matmul(a, b, group, 2, "ring"),
                torch.ops.uniep.all_gather_matmul(a.contiguous(), b.contiguous(), group, 2, "ring"),
            ),
            (
                torch.ops.uniep.reduce_scatter(x, group),
                torch.ops.uniep.reduce_scatter(x.contiguous(), group),
            ),
        ]

    record("non-contiguous", non_contiguous)

    for name in BACKWARD:
        for chunks, order in ((1, "direct"), (2, "ring")):
            record(
                f"bwd-{name}-{chunks}-{order}",
                lambda n=name, c=chunks, o=order: _backward_case(n, rank, world, c, o),
            )

    errors: dict[str, Any] = {}
    for name, call, _ in _error_cases(rank, world):
        try:
            call()
            errors[name] = None
        except Exception as e:
            errors[name] = (type(e).__name__, str(e))
    results["errors"] = errors
    # The group must still be usable, in step, after every rank failed together.
    record("after-errors", lambda: torch.ops.uniep.all_gather(torch.full((2,), float(rank)), group))

    def agreed_layouts() -> dict[str, Any]:
        # What the agreement must accept: dims equal once normalised, shapes past the inline ones.
        x = torch.randn(2, world, 3, generator=_gen(93, rank))
        long = torch.full((1, *[1] * 8, 2), float(rank))
        return {
            "uly-mixed-sign-dims": (
                torch.ops.uniep.all_to_all_ulysses(x, -2 if rank % 2 else 1, 0, group),
                torch.ops.uniep.all_to_all_ulysses(x, 1, 0, group),
            ),
            "ag-long-shape": torch.ops.uniep.all_gather(long, group),
        }

    record("agreed-layouts", agreed_layouts)

    record("modules", lambda: _module_cases(rank, world))
    return results


_BATCHES: dict[int, list[dict[str, Any]] | Exception] = {}


def _batch(world: int) -> list[dict[str, Any]]:
    if world not in _BATCHES:
        try:
            _BATCHES[world] = run_ranks(world, batch_worker, CASES)
        except Exception as e:
            _BATCHES[world] = e
    result = _BATCHES[world]
    if isinstance(result, Exception):
        pytest.fail(f"multi-rank run failed:\n{result}", pytrace=False)
    return result


def _results(world: int, name: str) -> list[Any]:
    per_rank = [r[name] for r in _batch(world)]
    for rank, res in enumerate(per_rank):
        if isinstance(res, str):
            pytest.fail(f"{name}: rank {rank} raised:\n{res}", pytrace=False)
    return per_rank


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: rel. err {err:.3e} > {tol:.0e}"


def _params() -> list[Any]:
    return [pytest.param(w, c, id=f"w{w}-{c.name}") for w in WORLDS for c in CASES]


@pytest.mark.parametrize(("world", "case"), _params())
def test_forward_matches_torch_distributed(world: int, case: Case) -> None:
    tol = TOLERANCE[case.dtype]
    for rank, res in enumerate(_results(world, case.name)):
        got, ref = res["outs"][0], res["ref"]
        what = f"rank {rank}"
        if case.op == "agmm":
            assert same_bits(got[0], ref[0]), f"{what}: ag_out is not a bit-exact gather"
            _close(got[1], ref[1], tol, f"{what} mm_out")
        elif case.op in ("ag", "uly"):
            assert same_bits(got, ref), f"{what}: not a bit-exact copy"
        else:
            _close(got, ref, tol, what)
            if case.dtype == "float32" and world == 2 and case.op == "rs":
                # Two addends: any order gives the same bits.
                assert same_bits(got, ref), what


@pytest.mark.parametrize(("world", "case"), _params())
def test_bits_independent_of_chunks_and_order(world: int, case: Case) -> None:
    for rank, res in enumerate(_results(world, case.name)):
        first = res["outs"][0]
        for (chunks, order), out in zip(case.variants[1:], res["outs"][1:], strict=True):
            pairs = zip(first, out, strict=True) if case.op == "agmm" else [(first, out)]
            for a, b in pairs:
                assert same_bits(a, b), f"rank {rank}: chunks={chunks} order={order} differs"


@pytest.mark.parametrize("world", WORLDS)
def test_non_contiguous_inputs(world: int) -> None:
    for res in _results(world, "non-contiguous"):
        (ag, mm), (ag_c, mm_c) = res[0]
        assert same_bits(ag, ag_c) and same_bits(mm, mm_c)
        assert same_bits(res[1][0], res[1][1])


@pytest.mark.parametrize(
    ("world", "name"),
    [
        pytest.param(w, f"bwd-{n}-{c}-{o}", id=f"w{w}-{n}-{c}-{o}")
        for w in WORLDS
        for n in BACKWARD
        for c, o in ((1, "direct"), (2, "ring"))
    ],
)
def test_backward_matches_autograd_through_reference(world: int, name: str) -> None:
    for rank, res in enumerate(_results(world, name)):
        for i, (ours, ref) in enumerate(zip(res["ours"], res["ref"], strict=True)):
            if ref is None:
                assert ours is None, f"rank {rank} input {i}: unexpected gradient"
                continue
            assert ours is not None, f"rank {rank} input {i}: no gradient"
            _close(ours, ref, GRAD_TOLERANCE, f"rank {rank} grad of input {i}")


ERROR_NAMES = [name for name, _, _ in _error_cases(0, 2)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ERROR_NAMES)
def test_bad_inputs_raise_named_errors(world: int, name: str) -> None:
    index = ERROR_NAMES.index(name)
    for rank, res in enumerate(_batch(world)):
        words = _error_cases(rank, world)[index][2]
        got = res["errors"][name]
        assert got is not None, f"{name}: rank {rank} raised nothing"
        kind, message = got
        assert kind == "ValueError", f"{name}: rank {rank} raised {kind}: {message}"
        assert words in message, f"{name}: rank {rank}: {message!r} lacks {words!r}"


@pytest.mark.parametrize("world", WORLDS)
def test_equal_layouts_agree(world: int) -> None:
    for rank, res in enumerate(_results(world, "agreed-layouts")):
        mixed, plain = res["uly-mixed-sign-dims"]
        assert same_bits(mixed, plain), f"rank {rank}: scatter_dim -2 and 1 ran differently"
        want = torch.arange(world, dtype=torch.float32).repeat_interleave(2)
        got = res["ag-long-shape"]
        assert got.shape == (world, *[1] * 8, 2), f"rank {rank}: shape {tuple(got.shape)}"
        assert torch.equal(got.flatten(), want), f"rank {rank}: {got.flatten()}"


@pytest.mark.parametrize("world", WORLDS)
def test_group_usable_after_errors(world: int) -> None:
    for res in _results(world, "after-errors"):
        want = torch.arange(world, dtype=torch.float32).repeat_interleave(2)
        assert torch.equal(res, want)


@pytest.mark.parametrize("world", WORLDS)
def test_parallel_linear_layers_match_full_linear(world: int) -> None:
    per_rank = _results(world, "modules")
    for rank, res in enumerate(per_rank):
        for key, value in res.items():
            if key.endswith("-row-bias") or key == "from_full-rng-untouched":
                continue
            tol = 0.0 if key.startswith(("init", "from_full")) else GRAD_TOLERANCE
            for i, (got, want) in enumerate(value):
                _close(got.detach(), want.detach(), tol, f"rank {rank} {key}[{i}]")
        assert res["from_full-rng-untouched"], "from_full drew random numbers"
    for key in per_rank[0]:
        if not key.endswith("-row-bias"):
            continue
        want = per_rank[0][key][1]
        if "sp=True" in key:
            # Each rank saw only its rows: the shares sum to the full gradient.
            got = sum(r[key][0] for r in per_rank)
        else:
            got = per_rank[0][key][0]
        _close(got, want, GRAD_TOLERANCE, key)


# ---- one rank (group ""): opcheck, fake kernels, wrappers, errors ----


def _single_args() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(3)
    f64 = torch.float64
    a = torch.randn(4, 6, generator=g, dtype=f64)
    b = torch.randn(6, 5, generator=g, dtype=f64)
    x = torch.randn(4, 3, generator=g, dtype=f64)
    return {
        "all_gather_matmul": (a, b, "", 2, "ring"),
        "matmul_reduce_scatter": (a, b, "", 2, "direct"),
        "all_gather": (x, "", 1, "direct"),
        "reduce_scatter": (x, "", 4, "ring"),
        "all_to_all_ulysses": (torch.randn(2, 3, 4, generator=g, dtype=f64), 1, 0, ""),
    }


@pytest.mark.parametrize("op", collectives.KINDS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(op: str, requires_grad: bool) -> None:
    args = [
        t.requires_grad_(requires_grad) if isinstance(t, torch.Tensor) else t
        for t in _single_args()[op]
    ]
    torch.library.opcheck(getattr(torch.ops.uniep, op).default, tuple(args))


def test_single_rank_semantics_and_wrappers() -> None:
    args = _single_args()
    a, b = args["all_gather_matmul"][:2]
    x = args["all_gather"][0]
    ag, mm = collectives.all_gather_matmul(a, b, chunks=2, order="ring")
    assert same_bits(ag, a) and rel_err(mm, a @ b) <= 1e-15
    assert rel_err(collectives.matmul_reduce_scatter(a, b), a @ b) <= 1e-15
    assert same_bits(collectives.all_gather(x, chunks=2), x)
    assert same_bits(collectives.reduce_scatter(x, order="ring"), x)
    y = args["all_to_all_ulysses"][0]
    assert same_bits(collectives.all_to_all_ulysses(y, 1, 0), y)


def test_fake_kernels_on_meta() -> None:
    a, b = torch.empty(4, 6, device="meta"), torch.empty(6, 5, device="meta")
    ag, mm = torch.ops.uniep.all_gather_matmul(a, b, "", 2, "ring")
    assert ag.shape == (4, 6) and mm.shape == (4, 5) and mm.device.type == "meta"
    assert torch.ops.uniep.matmul_reduce_scatter(a, b, "").shape == (4, 5)
    x = torch.empty(4, 3, 2, device="meta", dtype=torch.bfloat16)
    assert torch.ops.uniep.all_gather(x, "").dtype == torch.bfloat16
    assert torch.ops.uniep.all_to_all_ulysses(x, -1, 0, "").shape == (4, 3, 2)
    with pytest.raises(ValueError, match="chunks \\(3\\) must divide"):
        torch.ops.uniep.all_gather_matmul(a, b, "", 3)
    with pytest.raises(ValueError, match="b must have a's dtype"):
        torch.ops.uniep.all_gather_matmul(a, b.to(torch.float64), "")


def test_single_rank_errors() -> None:
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="group_name 'nope'"):
        torch.ops.uniep.reduce_scatter(x, "nope")
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float64"):
        torch.ops.uniep.all_gather(x.half(), "")
    with pytest.raises(ValueError, match="scatter_dim and gather_dim must differ"):
        collectives.all_to_all_ulysses(x, -1, 1)


def test_set_gemm_validates_and_round_trips() -> None:
    before = collectives.gemm()
    assert before == ("cublas", 0)
    try:
        collectives.set_gemm("cutlass", sm_carveout=8)
        assert collectives.gemm() == ("cutlass", 8)
        collectives.set_gemm("gated", 4)
        assert collectives.gemm() == ("gated", 4)
        collectives.set_gemm("cublas")
        assert collectives.gemm() == ("cublas", 0)
        with pytest.raises(ValueError, match="backend must be one of"):
            collectives.set_gemm("auto")
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="sm_carveout must be an int >= 0"):
                collectives.set_gemm("cutlass", sm_carveout=bad)  # type: ignore[arg-type]
        assert collectives.gemm() == ("cublas", 0)  # a refused call changes nothing
    finally:
        collectives.set_gemm(*before)


def test_single_rank_layers_equal_linear() -> None:
    torch.manual_seed(0)
    full = nn.Linear(8, 6, bias=True, dtype=torch.float64)
    torch.manual_seed(0)
    col = ColumnParallelLinear(8, 6, bias=True, dtype=torch.float64, chunks=2)
    row = RowParallelLinear.from_full(full, sequence_parallel=False)
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    assert same_bits(col.weight, full.weight) and same_bits(col.bias, full.bias)
    assert rel_err(col(x), full(x)) <= 1e-15
    assert rel_err(row(x), full(x)) <= 1e-15
    with pytest.raises(ValueError, match="chunks"):
        ColumnParallelLinear(8, 6, chunks=0)
    with pytest.raises(ValueError, match="dtype must be"):
        ColumnParallelLinear(8, 6, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must be"):
        col(torch.randn(4, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype"):
        col(torch.randn(4, 8))
    assert math.isfinite(float(col(x).detach().sum()))


@pytest.mark.skipif(
    not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported on this Python"
)
def test_compile_fullgraph_parallel_mlp() -> None:
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        col = ColumnParallelLinear(8, 12, bias=True, dtype=torch.float64, chunks=2)
        row = RowParallelLinear(12, 8, bias=True, dtype=torch.float64, order="ring")

        def loss(x: torch.Tensor) -> torch.Tensor:
            return row(torch.tanh(col(x))).square().sum()

        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
        x = torch.randn(4, 8, dtype=torch.float64)
        results = []
        for fn in (loss, compiled):
            for p in (*col.parameters(), *row.parameters()):
                p.grad = None
            value = fn(x)
            value.backward()
            results.append([value.detach(), col.weight.grad, row.weight.grad, row.bias.grad])
        for eager, comp in zip(*results, strict=True):
            assert same_bits(eager, comp)
    finally:
        torch._dynamo.reset()


def _subgroup_worker(rank: int, world: int) -> dict[str, Any]:
    """subgroup_members on 4 gloo ranks: the MP-like groups {0, 1}, {2, 3} and the EP-like
    {0, 2}, {1, 3} (new_group is collective: every rank makes all four), in the world and in a
    parent of their own; and the errors."""
    import torch.distributed as dist

    layouts = ([0, 1], [2, 3], [0, 2], [1, 3])
    groups = [dist.new_group(r) for r in layouts]
    mine = [g for g, r in zip(groups, layouts, strict=True) if rank in r]
    out: dict[str, Any] = {
        "world": [collectives.subgroup_members(g, dist.group.WORLD) for g in mine]
    }
    # In a parent that is itself a sub-group: ranks {1, 3} of the world are ranks {0, 1} of it.
    odd = dist.new_group([1, 3])
    if rank in (1, 3):
        out["parent"] = collectives.subgroup_members(odd, odd)
        with pytest.raises(
            ValueError, match=r"group: ranks \[[02]\] are not in parent \(ranks \[1, 3\]\)"
        ):
            collectives.subgroup_members(mine[0], odd)
    with pytest.raises(ValueError, match="group: a sub-group .* must be a process group"):
        collectives.subgroup_members(None, dist.group.WORLD)
    return out


def test_subgroup_members_are_the_ranks_in_the_parent() -> None:
    reports = run_ranks(4, _subgroup_worker)
    assert [r["world"] for r in reports] == [
        [[0, 1], [0, 2]],
        [[0, 1], [1, 3]],
        [[2, 3], [0, 2]],
        [[2, 3], [1, 3]],
    ]
    assert reports[1]["parent"] == reports[3]["parent"] == [0, 1]


@pytest.mark.skipif(
    bool(getattr(collectives._C, "has_ep_runtime", False)), reason="this build has the GPU runtime"
)
def test_check_names_the_missing_runtime() -> None:
    # A CPU-only build has no _C.coll_* functions: an AttributeError on them named none of this.
    with pytest.raises(
        NotImplementedError, match="uniep.collectives.check needs the UniEP GPU runtime"
    ):
        collectives.check()
