"""Randomized properties of the GPU expert-parallel runtime (marker `gpu`): the seeded
cases of _routing_gen on one GPU at world 1, and with 2, 4 and 8 ranks sharing it.

The ranks join as in test_gpu_on_one_gpu.py (NCCL at world 1; gloo from 2, with every rank
on the first visible GPU, NVSHMEM's multiple processes per GPU). A runtime is sized for one
(hidden, top_k, experts) and re-creating NVSHMEM is slow, so each world size creates one runtime
per shape of SHAPES up front, each on its own group, and runs all the cases drawn for it in one
spawn: tokens per rank (some empty) and routing kinds vary inside a shape, SHAPES spread hidden
(64 to 1152, fp8 where it is a multiple of 128), top-k (1 to 16) and experts (4 to 512).

For each case, what README promises:
- ep.dispatch: rows, sources, row lists and row targets are the CPU planner's, bit for bit, at
  every SM budget; dispatch=fp8 gives the CPU executor's e4m3 bytes and block scales;
- ep.combine: the ascending-k fp32 sum (per_k), or the documented per-rank partials
  (combine=rank_partials, y's rows in any order), the same bits at every SM budget;
- dispatch_cached: another tensor's rows land as a fresh dispatch puts them (bf16 and fp8), and
  a cached round combines like its plan's;
- moe_forward (bf16, dispatch=fp8 with bf16 experts, combine=rank_partials): within bf16
  tolerance of the CPU executor over a gloo group, the same bits for every SM budget and
  schedule key;
- ll_dispatch / ll_combine on the case's first ll_max_tokens tokens: regions as documented, and
  the high-throughput combine's bits.
Each rank records mismatches instead of raising, so that the ranks stay in step and one run
names every failing case; an exception (a desynchronised or broken runtime) still fails fast.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _routing_gen import ROUTINGS, RoutingCase, draw_case, global_inputs
from test_gpu_ep import _expected_combine as _expected_per_k
from test_gpu_ep import _expected_rank_partials


@dataclass(frozen=True)
class Shape:
    """What a runtime is created for; every case drawn for it fits it."""

    name: str
    hidden: int
    ffn: int
    top_k: int
    experts: int  # global: a multiple of 4 (shapes_of rounds it up to 8 ranks' multiple)
    max_tokens: int
    ll_max_tokens: int


SHAPES = [
    # Rows of 8 16-byte vectors (a combine=rank_partials segment shorter than a warp), and a
    # top-k wider than the experts: at least 4 of a token's 12 slots are -1.
    Shape("h64-k12-e8", hidden=64, ffn=32, top_k=12, experts=8, max_tokens=2048, ll_max_tokens=128),
    Shape("h128-k8-e64", 128, 64, 8, 64, 2048, 128),
    Shape("h256-k16-e512", 256, 32, 16, 512, 1024, 64),
    Shape("h1152-k2-e4", 1152, 128, 2, 4, 1024, 256),  # not a power of two; one expert per rank
    Shape("h128-k1-e12", 128, 32, 1, 12, 4096, 128),  # top-1, the longest token runs
]
WORLDS = [1, 2, 4, 8]
# Cases per (world, shape): 4 x 5 x 20 = 400 in all. UNIEP_PROPERTY_CASES overrides it.
CASES_PER_SHAPE = int(os.environ.get("UNIEP_PROPERTY_CASES", "20"))
# The CPU executor runs every case three times on the ranks' cores: keep its work bounded.
GPU_WORK_CAP = 1 << 25
# Two bf16 pipelines (the expert GEMM engine here, the CPU executor's loops), each within 1e-2 of
# the float64 reference on these cases.
TOLERANCE = 2e-2
SMS = [24, 8, 32]
# On CUDA the tile keys pick one of the expert GEMM engine's compiled configurations: these name
# four of the five (ping-pong 64 x 128, cooperative 256 x 128 and 128 x 128, ping-pong 64 x 256).
SCHEDULES = [
    "sms=24",
    "sms=8,overlap=sequential,tile_m=64,tile_n=128,tile_k=128",
    "sms=32,overlap=chunked,token_tile=16,tile_m=256",
    "sms=16,overlap=fused,token_tile=4096,tile_m=128,tile_n=128",
    "sms=12,token_tile=7,tile_m=64,tile_n=256",
]


def shapes_of(world: int) -> list[Shape]:
    """SHAPES as a world size runs them: where the experts do not split over the ranks, as many
    more as the next multiple of the world size (the same hidden, ffn and top-k)."""
    out = []
    for shape in SHAPES:
        if shape.experts % world:
            experts = -(-shape.experts // world) * world
            name = shape.name.rsplit("-e", 1)[0] + f"-e{experts}"
            shape = dataclasses.replace(shape, name=name, experts=experts)
        out.append(shape)
    return out


def cases_of(world: int) -> list[tuple[Shape, RoutingCase]]:
    """Every case a world size runs, shape by shape; seeds disjoint across worlds and shapes."""
    return [
        (
            shape,
            draw_case(
                100_000 + 10_000 * world + 1_000 * s + i,
                world,
                dtypes=("bfloat16",),
                work_cap=GPU_WORK_CAP,
                hidden=shape.hidden,
                ffn=shape.ffn,
                experts=shape.experts,
                top_k=shape.top_k,
                max_tokens=shape.max_tokens,
            ),
        )
        for s, shape in enumerate(shapes_of(world))
        for i in range(CASES_PER_SHAPE)
    ]


def _device(rank: int) -> torch.device:
    """This rank's GPU: all ranks share the first visible one (test_gpu_on_one_gpu)."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _rows_of_targets(target: torch.Tensor, hidden: int) -> torch.Tensor:
    """Expert-output rows that a token's own rank can rebuild from the row's combine target
    (source * max_tokens * K + token * K + k) alone: a hash of target and column, bf16 in
    [-1, 1). Combine checks need no exchange of y then."""
    cols = torch.arange(hidden, device=target.device)
    mixed = (target.unsqueeze(1) * 2654435761 + cols * 40503 + 12345) % 65536
    return (mixed.float() / 32768 - 1).to(torch.bfloat16)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.cpu().double() - want.double()).norm().item()
    return diff / max(want.double().norm().item(), 1e-6)


class _Checks:
    """Mismatches of one case, recorded rather than raised (the ranks must stay in step)."""

    def __init__(self, case: RoutingCase, shape: Shape) -> None:
        self.where = f"{shape.name} {case.name}"
        self.failures: list[str] = []
        self.count = 0

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        self.count += 1
        got = got.cpu()
        if not (got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)):
            self.failures.append(f"{self.where}: {what} differs")

    def close(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        self.count += 1
        err = _rel_err(got, want)
        if not err <= TOLERANCE:
            self.failures.append(f"{self.where}: {what} rel. err {err:.3e} > {TOLERANCE}")


def _run_case(
    shape: Shape, case: RoutingCase, rank: int, world: int, group: dist.ProcessGroup
) -> _Checks:
    import numpy as np
    import uniep
    from uniep import _C

    dev = torch.cuda.current_device()
    check = _Checks(case, shape)
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    g = global_inputs(case)
    spans = [slice(*case.token_range(r)) for r in range(world)]
    idxs = [g["topk_idx"][s] for s in spans]
    x_cpu, idx_cpu, w_cpu = g["x"][spans[rank]], idxs[rank], g["topk_weights"][spans[rank]]
    x2_cpu = g["grad_out"][spans[rank]].contiguous()  # other rows of the same tokens
    e0, e1 = case.expert_range(rank)
    w1_cpu, w2_cpu = g["w1"][e0:e1].contiguous(), g["w2"][e0:e1].contiguous()
    x, idx, w = (t.contiguous().to(dev) for t in (x_cpu, idx_cpu, w_cpu))
    x2 = x2_cpu.to(dev)
    k_top, hidden, el = case.top_k, case.hidden, case.experts_per_rank
    fp8 = hidden % 128 == 0
    sms = [*SMS, rng.randint(1, 64)]

    # The CPU planner's plan for this rank and the rows it receives, in slot order.
    plan = _C.build_rank_plan([i.numpy() for i in idxs], case.experts, rank)
    offsets = torch.from_numpy(plan["recv_offsets"])
    source = torch.repeat_interleave(torch.arange(world), offsets.diff())
    first_token = torch.tensor([case.token_range(r)[0] for r in range(world)], dtype=torch.int64)
    src_token = torch.from_numpy(plan["recv_src_token"])
    global_token = first_token[source] + src_token
    rows_x, rows_x2 = g["x"][global_token], g["grad_out"][global_token]
    per_rank_slots = shape.max_tokens * k_top
    target = torch.from_numpy(plan["row_src_rank"] * per_rank_slots + plan["row_combine_slot"])
    per_expert = torch.from_numpy(np.diff(plan["row_offsets"]))

    for s in sms:
        res = uniep.moe.ep.dispatch(x, idx, w, group, tuning=f"sms={s}")
        check.equal(res.recv_x, rows_x, f"dispatch sms={s} recv_x")
        check.equal(res.recv_src, src_token, f"dispatch sms={s} recv_src")
        check.equal(res.handle.row_slot, torch.from_numpy(plan["row_slot"]), f"sms={s} row_slot")
        check.equal(res.handle.row_target, target, f"dispatch sms={s} row_target")
        check.equal(res.tokens_per_expert, per_expert, f"dispatch sms={s} tokens_per_expert")
    if fp8:
        q, scales = _C.encode_fp8_rows(rows_x.float().numpy())
        res8 = uniep.moe.ep.dispatch(x, idx, w, group, tuning=f"sms={sms[-1]},dispatch=fp8")
        check.equal(res8.recv_x.view(torch.uint8), torch.from_numpy(q), "fp8 dispatch bytes")
        check.equal(res8.recv_scales, torch.from_numpy(scales), "fp8 dispatch scales")

    # Combine: every row's output is a function of its target, so this rank knows its sums.
    mine = (rank * per_rank_slots + torch.arange(case.tokens[rank] * k_top)).to(dev)
    ys = _rows_of_targets(mine, hidden).view(-1, k_top, hidden).cpu()
    want = _expected_per_k(ys, idx_cpu, w_cpu)
    want_parts = _expected_rank_partials(ys, idx_cpu, w_cpu, el, world)
    for s in sms:
        res = uniep.moe.ep.dispatch(x, idx, w, group, tuning=f"sms={s}")
        y = _rows_of_targets(res.handle.row_target, hidden)
        check.equal(uniep.moe.ep.combine(y, res.handle), want, f"combine per_k sms={s}")
    for s in sms:
        res = uniep.moe.ep.dispatch(x, idx, w, group, tuning=f"sms={s},combine=rank_partials")
        perm = torch.randperm(res.handle.row_target.numel(), generator=gen).to(dev)
        handle = dataclasses.replace(res.handle, row_target=res.handle.row_target[perm])
        y = _rows_of_targets(handle.row_target, hidden)
        check.equal(uniep.moe.ep.combine(y, handle), want_parts, f"combine rank_partials sms={s}")
    uniep.moe.ep.check(group)

    # Cached dispatch: x2 on the plan of x's dispatch lands where a fresh dispatch puts it.
    res = uniep.moe.ep.dispatch(x, idx, w, group)
    for s in sms:
        cached = uniep.moe.ep.dispatch_cached(x2, res.handle, tuning=f"sms={s}")
        check.equal(cached.recv_x, rows_x2, f"dispatch_cached sms={s}")
    if fp8:
        q2, scales2 = _C.encode_fp8_rows(rows_x2.float().numpy())
        c8 = uniep.moe.ep.dispatch_cached(x2, res.handle, tuning="dispatch=fp8")
        check.equal(c8.recv_x.view(torch.uint8), torch.from_numpy(q2), "fp8 cached bytes")
        check.equal(c8.recv_scales, torch.from_numpy(scales2), "fp8 cached scales")
    cached = uniep.moe.ep.dispatch_cached(x2, res.handle)
    y = _rows_of_targets(cached.handle.row_target, hidden)
    check.equal(uniep.moe.ep.combine(y, cached.handle), want, "combine of a cached round")
    uniep.moe.ep.check(group)

    # moe_forward: bits across schedules, bf16 tolerance of the CPU executor, per mode.
    w1, w2 = w1_cpu.to(dev), w2_cpu.to(dev)
    name = group.group_name
    # dispatch=fp8 with bf16 experts (the wire's rounding alone): fp8 experts, whose activation
    # rounding amplifies a GEMM's one-ulp difference, have their own tolerance in
    # tests/gemm/test_gpu_prepared.py.
    modes = ["", "combine=rank_partials"] + (["dispatch=fp8,experts=bf16"] if fp8 else [])
    for mode in modes:
        # The first schedule again at the end: run to run.
        tunings = [f"{t},{mode}" if mode else t for t in [*SCHEDULES, SCHEDULES[0]]]
        outs = [torch.ops.uniep.moe_forward(x, idx, w, w1, w2, name, t) for t in tunings]
        for t, out in zip(tunings[1:], outs[1:], strict=True):
            check.equal(out, outs[0].cpu(), f"moe_forward [{t}] vs [{tunings[0]}]")
        cpu = torch.ops.uniep.moe_forward(x_cpu, idx_cpu, w_cpu, w1_cpu, w2_cpu, name, mode)
        check.close(outs[0], cpu, f"moe_forward [{mode or 'bf16'}] vs the CPU executor")
    uniep.moe.ep.check(group)

    # Low latency, on the first ll_max_tokens tokens of every rank (a decode batch).
    n_ll = [min(t, shape.ll_max_tokens) for t in case.tokens]
    ll_idxs = [i[:n] for i, n in zip(idxs, n_ll, strict=True)]
    ll_x, ll_idx, ll_w = x[: n_ll[rank]], idx[: n_ll[rank]], w[: n_ll[rank]]
    buffer = case.seed % 2
    res = uniep.moe.ep.ll_dispatch(ll_x, ll_idx, group, buffer=buffer)
    counts, slots, rows = res.recv_count.cpu(), res.recv_slot.cpu(), res.recv_x.cpu()
    for e in range(el):
        for s in range(world):
            # Region (e, s): source s's (token, k) pairs on expert e, in (token, k) order.
            pairs = (ll_idxs[s].reshape(-1) == e0 + e).nonzero().squeeze(1)
            n, base = pairs.numel(), s * shape.ll_max_tokens
            check.equal(counts[e, s].to(torch.int64), torch.tensor(n), f"ll count e{e} s{s}")
            check.equal(slots[e, base : base + n], pairs, f"ll slots e{e} s{s}")
            token = first_token[s] + pairs // k_top
            check.equal(rows[e, base : base + n], g["x"][token], f"ll rows e{e} s{s}")
    out_ll = uniep.moe.ep.ll_combine(res.recv_x.contiguous(), ll_idx, ll_w, group, buffer=buffer)
    ht = uniep.moe.ep.dispatch(ll_x.contiguous(), ll_idx.contiguous(), ll_w.contiguous(), group)
    out_ht = uniep.moe.ep.combine(ht.recv_x.index_select(0, ht.handle.row_slot), ht.handle)
    check.equal(out_ll, out_ht.cpu(), "ll_combine vs combine")
    uniep.moe.ep.check(group)
    return check


def _properties_worker(rank: int, world: int) -> dict[str, Any]:
    """Every case of this world size on this rank: one runtime (on its own gloo group, which
    also carries the CPU executor's exchange) per shape, created before any case runs."""
    import uniep
    from uniep import _C

    _device(rank)
    # NVSHMEM sizes its heap once per process: room for every shape's runtime.
    heap = sum(
        _C.ep_symmetric_heap_bytes(
            s.max_tokens, s.hidden, s.top_k, s.experts, world, 0, s.ll_max_tokens
        )
        for s in shapes_of(world)
    )
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap + (len(SHAPES) + 1) * (64 << 20)))
    groups = {}
    for shape in shapes_of(world):
        groups[shape.name] = dist.new_group(list(range(world)), backend="gloo")
        uniep.moe.ep.init_runtime(
            groups[shape.name],
            max_tokens=shape.max_tokens,
            hidden=shape.hidden,
            top_k=shape.top_k,
            num_experts=shape.experts,
            ll_max_tokens=shape.ll_max_tokens,
        )
    failures: list[str] = []
    checks = 0
    cases = cases_of(world)
    for shape, case in cases:
        try:
            done = _run_case(shape, case, rank, world, groups[shape.name])
        except Exception as e:
            raise RuntimeError(f"{shape.name} {case.name} raised on rank {rank}") from e
        failures += done.failures
        checks += done.count
    dist.barrier()
    return {"cases": len(cases), "checks": checks, "failures": failures}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("world", WORLDS)
def test_random_cases_against_the_cpu_plan_and_executor(
    world: int, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    from uniep.distributed import run_local_ranks

    if world > 1:
        # The ranks (spawned, so they read it afresh) see one GPU, also on a multi-GPU machine.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    # NCCL refuses two ranks on one device; the workers need only gloo's CPU collectives then.
    backend = "nccl" if world == 1 else "gloo"
    reports = run_local_ranks(_properties_worker, world, backend=backend, timeout_s=540)
    cases = reports[0]["cases"]
    checks = sum(r["checks"] for r in reports)
    record_property("property_cases", cases)
    record_property("property_checks", checks)
    print(f"\nproperty cases (GPU, world {world}): {cases} cases, {checks} checks on all ranks")
    assert cases == len(SHAPES) * CASES_PER_SHAPE
    failures = [f"rank {r}: {f}" for r, rep in enumerate(reports) for f in rep["failures"]]
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:50])


def test_cases_fit_their_runtimes() -> None:
    """Runs anywhere (no GPU): every drawn case fits its shape's runtime and the GPU limits
    (hidden % 8, top_k <= 31, tokens <= max_tokens), covers empty ranks, and every routing kind
    shows up, so a generator change cannot quietly make the GPU run test less."""
    for world in WORLDS:
        cases = cases_of(world)
        for shape, case in cases:
            assert (case.hidden, case.ffn, case.top_k, case.experts) == (
                shape.hidden,
                shape.ffn,
                shape.top_k,
                shape.experts,
            ), case.name
            assert case.hidden % 8 == 0 and case.top_k <= 31 and case.dtype == "bfloat16"
            assert max(case.tokens) <= shape.max_tokens, case.name
            assert case.experts % world == 0
        assert {c.routing for _, c in cases} == set(ROUTINGS), world
        if world > 1:
            assert any(0 in c.tokens for _, c in cases), world
