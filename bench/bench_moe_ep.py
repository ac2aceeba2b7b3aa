"""The MoE layer at EP = world, forward and backward: moe_forward / moe_backward with
overlap=sequential and overlap=fused against NCCL all_to_all_single + torch._grouped_mm, the expert
GEMMs alone on each rank, and uniep.tune's pick re-timed against the best point it measured
(the multi-GPU run's part 2).

**The fused rows.** ``uniep.moe_forward`` with ``overlap=fused`` runs the MegaKernel on CUDA in
bf16 (on a packed copy of w1 that ``uniep.moe.megakernel.forward`` keeps; the op
``torch.ops.uniep.moe_forward`` runs the separate launches in every overlap mode), so the fused
rows time it through ``moe_forward``, output compared bit for bit with sequential's; each row says
which ran (``fused_is_megakernel``, ``fused_note``). The MegaKernel across ranks called directly
(``uniep.moe.megakernel.launch.moe_forward_ep``) is timed beside them as ``fwd_megakernel``,
checked against the baseline first, with one traced call's phases on rank 0
(``megakernel_phases_us_rank0``), its launch points and ``megakernel_over_experts``.
``moe_backward`` with ``overlap=fused`` runs the MegaKernel's backward across ranks
(``uniep.moe.megakernel.backward.moe_backward_ep``) in bf16 on CUDA: ``bwd_fused`` times it,
``fused_backward_bits_equal_sequential`` compares its gradients with ``overlap=sequential``'s once.

Per shape (one spawn of W ranks per shape: NVSHMEM's heap is sized once per process), every rank:
- forward: ``moe_forward`` with ``overlap=sequential`` and ``overlap=fused``, and the baseline
  (``bench_moe.baseline_moe``: ``all_to_all_single`` of a token copy per (token, expert),
  ``torch._grouped_mm`` experts, ``all_to_all_single`` back, ``index_add``). Ours must agree with
  the baseline (bf16 tolerance) before anything is timed.
- forward + backward: ``moe_forward`` then ``moe_backward`` (which recomputes the experts'
  forward), and the baseline through autograd (``torch.distributed.nn.functional.
  all_to_all_single``, the grouped GEMMs' own backward); ``moe_backward`` alone too. The gradients
  are compared with the baseline's once and the differences recorded.
- the expert GEMMs alone on this rank: the rows this rank's experts receive under the same routing,
  through the up-projection grouped GEMM, SwiGLU and the down-projection grouped GEMM, with UniEP's
  engine (``torch.ops.uniep.grouped_mm``) and with ``torch._grouped_mm``. Goal: forward
  (sequential) <= 1.10 x the faster of the two, on the same rank.
- the tuner: ``uniep.tune`` on the group (cache off), then every point it measured re-timed in
  interleaved rounds on this benchmark's inputs. Goal: its pick within 3% of the best re-timed
  point.

Times are medians of per-call times (CUDA events on GPUs) after warm-up; a variant's time is its
slowest rank's median. Routing: each token picks top-k distinct experts uniformly at random.

    python bench/bench_moe_ep.py --quick    # 2 gloo ranks on CPU, float32, a small shape
    python bench/bench_moe_ep.py            # one NCCL rank per GPU (--world-size W, default all);
                                            # skipped (exit 0) without CUDA
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from bench_moe import (  # noqa: E402
    _experts_grouped,
    _experts_mm,
    _rel_diff,
    baseline_moe,
    route_rows,
)
from common import (  # noqa: E402
    ShapeClock,
    add_budget_argument,
    add_out_dir_argument,
    add_profile_argument,
    median_time_ms,
    profile_kernels,
    write_result,
)

# (name, tokens per rank, hidden, ffn, experts in total, top_k): the two layers.
GPU_SHAPES = [("dsv3-like", 4096, 7168, 2048, 256, 8), ("mixtral-like", 4096, 4096, 14336, 8, 2)]
CPU_SHAPES = [("cpu-small", 128, 64, 128, 8, 2)]
GOAL_FWD_OVER_EXPERTS = 1.10
GOAL_TUNE = 1.03
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
GRAD_TOLERANCE = {"float32": 1e-3, "bfloat16": 6e-2}
# The MegaKernel's launch points across ranks: (CTAs that send first, 10_000: every CTA; rounds
# of tiles the others take first, -1: the bandwidth model). fwd_megakernel is the default point.
MK_POINTS = {
    "every_cta": (10_000, -1),
    "send32": (32, -1),
    "send32_skip12": (32, 12),
    "send48_skip8": (48, 8),
    "send64": (64, -1),
}
FUSED_NOTE = (
    "fwd_fused: uniep.moe_forward with overlap=fused, the MegaKernel (moe_forward_ep on a packed "
    "copy of w1 kept per tensor) in bf16 on CUDA, else the separate launches"
)
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "UNIEP_TIMEOUT_S": "60",
}


def forward_goal(per_rank_ratios: list[float]) -> dict[str, Any]:
    """The worst rank's forward over its expert GEMMs alone, and whether it meets the goal (None
    when some rank has no ratio)."""
    if not per_rank_ratios or not all(math.isfinite(r) for r in per_rank_ratios):
        return {"forward_over_experts": None, "forward_goal_met": None}
    worst = max(per_rank_ratios)
    return {"forward_over_experts": worst, "forward_goal_met": worst <= GOAL_FWD_OVER_EXPERTS}


def tune_goal(pick: str, retimed_ms: dict[str, float]) -> dict[str, Any]:
    """The tuner's pick over the best re-timed point, and whether it is within 3%."""
    finite = {p: t for p, t in retimed_ms.items() if math.isfinite(t)}
    if pick not in finite or not finite:
        return {"pick_over_best": None, "tune_goal_met": None}
    ratio = finite[pick] / min(finite.values())
    return {"pick_over_best": ratio, "tune_goal_met": ratio <= GOAL_TUNE}


def baseline_moe_autograd(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    grouped: bool,
) -> torch.Tensor:
    """``bench_moe.baseline_moe`` with autograd: the row exchanges through
    ``torch.distributed.nn.functional.all_to_all_single``, the expert chain differentiable."""
    import torch.distributed.nn.functional as dist_nn

    # torch >= 2.13 deprecates it for the functional collectives; the GPU machine runs 2.11.
    warnings.filterwarnings("ignore", r".*all_to_all_single is deprecated", FutureWarning)
    local_experts = w1.shape[0]
    with torch.no_grad():
        keep, tokens, send_splits, recv_splits, local = route_rows(topk_idx, local_experts)
        by_expert = torch.argsort(local, stable=True)
        back_to_slots = torch.argsort(by_expert)
        counts = torch.bincount(local, minlength=local_experts).tolist()
    recv_x = dist_nn.all_to_all_single(
        x.new_empty(sum(recv_splits), x.shape[1]), x[tokens], recv_splits, send_splits
    )
    run = _experts_grouped if grouped else _experts_mm
    out = run(recv_x[by_expert], counts, w1, w2).to(x.dtype)[back_to_slots]
    back = dist_nn.all_to_all_single(
        x.new_empty(tokens.numel(), x.shape[1]), out, send_splits, recv_splits
    )
    gates = topk_weights.reshape(-1)[keep].unsqueeze(1)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return y.index_add(0, tokens, back.float() * gates).to(x.dtype)


def _settle(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor([v if math.isfinite(v) else math.inf for v in values], dtype=torch.float64)
    t = t.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _grad_diffs(ours: tuple[torch.Tensor, ...], base: tuple[torch.Tensor, ...]) -> dict[str, float]:
    names = ("dx", "dtopk_weights", "dw1", "dw2")
    return {n: _rel_diff(a, b) for n, a, b in zip(names, ours, base, strict=True)}


def _expert_chain(
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    offs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    ffn = w2.shape[1]
    h = mm(rows, w1, offs)
    return mm(F.silu(h[:, :ffn]) * h[:, ffn:], w2, offs)


def _bench_shape(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    import uniep
    import uniep.moe.ep
    from uniep.tuning import tuner as tune_mod

    name, tokens, hidden, ffn, experts, top_k = cfg["shape"]
    cuda = cfg["device"] == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dname = str(dtype).removeprefix("torch.")
    warmup, iters = cfg["warmup"], cfg["iters"]
    if experts % world:
        raise ValueError(f"{name}: {experts} experts do not split over {world} ranks")
    e_local = experts // world
    group = dist.new_group(list(range(world)))
    megakernel = cuda and torch._C._dispatch_has_kernel_for_dispatch_key(
        "uniep::moe_fused_ep", "CUDA"
    )
    if megakernel and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        # NVSHMEM sizes its heap when the first runtime starts it: room for both runtimes.
        from uniep import _C
        from uniep.moe.megakernel.launch import fused_ep_heap_bytes

        heap = fused_ep_heap_bytes(world, tokens, hidden, ffn, top_k, experts, backward=True)
        heap += _C.ep_symmetric_heap_bytes(tokens, hidden, top_k, experts, world)
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(heap + (1 << 30))
    if cuda:
        uniep.moe.ep.init_runtime(
            group, max_tokens=tokens, hidden=hidden, top_k=top_k, num_experts=experts
        )
    gname = uniep.distributed.group_name(group)

    gen = torch.Generator(device=dev).manual_seed(1000 + 7919 * rank)
    x = torch.randn(tokens, hidden, generator=gen, device=dev, dtype=dtype)
    idx = torch.rand(tokens, experts, generator=gen, device=dev).topk(top_k, dim=1).indices
    idx = idx.contiguous()
    w = torch.randn(tokens, top_k, generator=gen, device=dev).softmax(dim=1).contiguous()
    w1 = torch.randn(e_local, hidden, 2 * ffn, generator=gen, device=dev, dtype=dtype)
    w1.mul_(hidden**-0.5)
    w2 = torch.randn(e_local, ffn, hidden, generator=gen, device=dev, dtype=dtype)
    w2.mul_(ffn**-0.5)
    go = torch.randn(tokens, hidden, generator=gen, device=dev, dtype=dtype)

    seq, fused = "overlap=sequential", "overlap=fused"

    def fwd(tuning: str) -> torch.Tensor:
        if tuning == fused:  # the MegaKernel through moe_forward (the op runs the launches)
            return uniep.moe_forward(x, idx, w, w1, w2, group, tuning)
        return torch.ops.uniep.moe_forward(x, idx, w, w1, w2, gname, tuning)

    def bwd(tuning: str) -> tuple[torch.Tensor, ...]:
        return torch.ops.uniep.moe_backward(go, x, idx, w, w1, w2, gname, tuning)

    def fwd_bwd(tuning: str) -> tuple[torch.Tensor, ...]:
        fwd(tuning)
        return bwd(tuning)

    grouped = cuda and hasattr(torch, "_grouped_mm")
    # New leaves on the same storage (no copy of the experts' weights).
    leaves = [t.detach().requires_grad_(True) for t in (x, w, w1, w2)]

    def base_fwd_bwd() -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            xl, wl, w1l, w2l = leaves
            y = baseline_moe_autograd(xl, idx, wl, w1l, w2l, grouped=grouped)
            return torch.autograd.grad(y, leaves, go)

    def time_ms(fn: Callable[[], object]) -> float:
        _settle(cuda)
        return median_time_ms(fn, warmup, iters, cuda)

    row: dict[str, Any] = {
        "shape": name,
        "tokens_per_rank": tokens,
        "hidden": hidden,
        "ffn": ffn,
        "experts": experts,
        "top_k": top_k,
        "world_size": world,
        "dtype": dname,
        "device": dev.type,
        "warmup": warmup,
        "iters": iters,
        "fused_is_megakernel": cuda and dtype == torch.bfloat16,
        "fused_note": FUSED_NOTE,
    }
    mine: dict[str, float] = {}
    with torch.no_grad():
        try:
            baseline_moe(x, idx, w, w1, w2, grouped=grouped)
        except RuntimeError:
            grouped = False
        y_base = baseline_moe(x, idx, w, w1, w2, grouped=grouped)
        y_seq, y_fused = fwd(seq), fwd(fused)
        diff, fused_differs = _max_over_ranks(
            [_rel_diff(y_seq, y_base), float(not torch.equal(y_seq, y_fused))], dev
        )
        if not diff <= TOLERANCE[dname]:
            raise RuntimeError(
                f"{name}: moe_forward and the baseline disagree: max rel diff {diff:.2e} > "
                f"{TOLERANCE[dname]:.0e}"
            )
        row["forward_max_rel_diff_vs_baseline"] = diff
        row["fused_bits_equal_sequential"] = fused_differs == 0.0
        row["baseline"] = "a2a + " + ("torch._grouped_mm" if grouped else "per-expert mm")
        del y_base, y_seq, y_fused
        mine["fwd_sequential"] = time_ms(lambda: fwd(seq))
        mine["fwd_fused"] = time_ms(lambda: fwd(fused))
        mine["fwd_baseline"] = time_ms(lambda: baseline_moe(x, idx, w, w1, w2, grouped))
        if megakernel:
            fwd_mk = _megakernel_forward(group, cfg, x, idx, w, w1, w2)
            y_mk, phases = fwd_mk(True)
            mk_diff = _max_over_ranks(
                [_rel_diff(y_mk, baseline_moe(x, idx, w, w1, w2, grouped))], dev
            )[0]
            if not mk_diff <= TOLERANCE[dname]:
                raise RuntimeError(
                    f"{name}: the MegaKernel and the baseline disagree: max rel diff "
                    f"{mk_diff:.2e} > {TOLERANCE[dname]:.0e}"
                )
            row["megakernel_max_rel_diff_vs_baseline"] = mk_diff
            row["megakernel_phases_us_rank0"] = phases if rank == 0 else None
            del y_mk
            mine["fwd_megakernel"] = time_ms(lambda: fwd_mk(False))
            # The launch's tuning points (CTAs that send first, rounds the others take first),
            # interleaved, each rank's medians then the slowest rank's per point.
            from uniep._util.timing import interleaved_medians_ms

            fns = {p: (lambda p=p: fwd_mk(False, *MK_POINTS[p])) for p in MK_POINTS}
            med = interleaved_medians_ms(fns, 3, max(1, iters // 3), cuda, warmup=1,
                                         before=lambda: _settle(cuda))  # fmt: skip
            worst = _max_over_ranks([med[p] for p in MK_POINTS], dev)
            row["megakernel_points_ms"] = dict(zip(MK_POINTS, worst, strict=True))
            best = min(MK_POINTS, key=lambda p: row["megakernel_points_ms"][p])
            row["megakernel_best_point"] = best
            mine["fwd_megakernel_best"] = med[best]
            # The same launch at world 1 on the rows this rank's experts receive (top-1, no
            # exchange, local send and reduce): what the GEMMs cost inside the launch here.
            same = _same_rows_local(group, idx, x, w1, w2, experts, e_local, rank)
            mine["fwd_local_fused_same_rows"] = time_ms(lambda: same(False))
            if rank == 0:
                row["local_fused_same_rows_phases_us_rank0"] = same(True)

        # The expert GEMMs alone: this rank's received rows, counted from every rank's routing.
        counts = torch.bincount(idx.reshape(-1), minlength=experts)
        dist.all_reduce(counts)
        local = counts[rank * e_local : (rank + 1) * e_local]
        rows = torch.randn(int(local.sum()), hidden, generator=gen, device=dev, dtype=dtype)
        offs = local.cumsum(0).to(torch.int32)
        chains: dict[str, Callable[[], object]] = {}
        if cuda:
            if torch._C._dispatch_has_kernel_for_dispatch_key("uniep::grouped_mm", "CUDA"):
                engine = torch.ops.uniep.grouped_mm
                chains["uniep_engine"] = lambda: _expert_chain(engine, rows, offs, w1, w2)
            if grouped:

                def tgm(a: torch.Tensor, b: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
                    return torch._grouped_mm(a, b, offs=o)

                chains["torch_grouped_mm"] = lambda: _expert_chain(tgm, rows, offs, w1, w2)
        else:
            counts_list = local.tolist()
            chains["per_expert_mm"] = lambda: _experts_mm(rows, counts_list, w1, w2)
        for key, chain in chains.items():
            mine[f"experts_{key}"] = time_ms(chain)
        row["expert_rows_this_rank"] = int(local.sum())

    # Backward: ours once against the baseline's autograd, then timed. A grouped GEMM without a
    # backward here makes the baseline's backward per-expert matmuls (agreed over the ranks).
    with torch.no_grad():
        ours_grads = bwd(seq)
        # overlap=fused: the MegaKernel's backward across ranks in bf16 on CUDA (its own
        # runtime, made with the backward's buffers on first use), else the launches again.
        fused_grads = bwd(fused)
        same = all(torch.equal(a, b) for a, b in zip(ours_grads, fused_grads, strict=True))
        row["fused_backward_bits_equal_sequential"] = (
            _max_over_ranks([float(not same)], dev)[0] == 0.0
        )
        del fused_grads
    try:
        base_grads = base_fwd_bwd()
        failed = 0.0
    except RuntimeError:
        failed = 1.0
    if _max_over_ranks([failed], dev)[0]:
        grouped = False
        base_grads = base_fwd_bwd()
    row["baseline_backward"] = "autograd: a2a + " + (
        "torch._grouped_mm" if grouped else "per-expert mm"
    )
    grad_diff = _grad_diffs(ours_grads, base_grads)
    worst = _max_over_ranks(list(grad_diff.values()), dev)
    row["backward_max_rel_diff_vs_baseline"] = dict(zip(grad_diff, worst, strict=True))
    row["backward_check_pass"] = all(v <= GRAD_TOLERANCE[dname] for v in worst)
    del ours_grads, base_grads
    with torch.no_grad():
        mine["bwd_sequential"] = time_ms(lambda: bwd(seq))
        mine["bwd_fused"] = time_ms(lambda: bwd(fused))
        mine["fwd_bwd_sequential"] = time_ms(lambda: fwd_bwd(seq))
        mine["fwd_bwd_fused"] = time_ms(lambda: fwd_bwd(fused))
    mine["fwd_bwd_baseline"] = time_ms(base_fwd_bwd)
    if cfg.get("profile_iters", 0) > 0 and cuda:
        # Every rank runs the profiled calls (they are collective); rank 0's numbers are kept.
        profiled: dict[str, Callable[[], object]] = {
            "fwd_sequential": lambda: fwd(seq),
            **({"fwd_megakernel": lambda: fwd_mk(False)} if megakernel else {}),
            "fwd_baseline": lambda: baseline_moe(x, idx, w, w1, w2, grouped),
            "bwd_sequential": lambda: bwd(seq),
            "fwd_bwd_baseline": base_fwd_bwd,
        }
        profiled.update({f"experts_{k}": chain for k, chain in chains.items()})
        _settle(cuda)
        with torch.no_grad():
            profile = profile_kernels(profiled, cfg["profile_iters"])
        if rank == 0:
            row["kernel_us_rank0"] = profile

    # Per rank: the forward over this rank's expert GEMMs (the faster chain).
    expert_keys = [k for k in mine if k.startswith("experts_")]
    best_chain = min((mine[k] for k in expert_keys), default=math.nan)
    ratio = mine["fwd_sequential"] / best_chain if expert_keys else math.nan
    mk_ratio = mine["fwd_megakernel_best"] / best_chain if "fwd_megakernel_best" in mine else None
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(
        per_rank,
        {"ms": mine, "forward_over_experts": ratio, "megakernel_over_experts": mk_ratio},
    )
    keys = sorted(mine)
    slowest = dict(zip(keys, _max_over_ranks([mine[k] for k in keys], dev), strict=True))
    row["ms"] = slowest
    row["per_rank"] = per_rank
    ratios = [r["forward_over_experts"] for r in per_rank]
    row.update(forward_goal(ratios))
    row["forward_over_experts_per_rank"] = ratios
    mk_ratios = [r["megakernel_over_experts"] for r in per_rank]
    if all(r is not None for r in mk_ratios):
        row["megakernel_over_experts"] = max(mk_ratios)
        row["megakernel_over_experts_per_rank"] = mk_ratios
        row["megakernel_goal_met"] = max(mk_ratios) <= GOAL_FWD_OVER_EXPERTS
        row["megakernel_over_sequential"] = (
            slowest["fwd_megakernel_best"] / slowest["fwd_sequential"]
        )
    row["forward_over_baseline"] = slowest["fwd_sequential"] / slowest["fwd_baseline"]
    row["fwd_bwd_over_baseline"] = slowest["fwd_bwd_sequential"] / slowest["fwd_bwd_baseline"]
    row["goal_forward_over_experts"] = GOAL_FWD_OVER_EXPERTS

    if cfg["tune_candidates"] > 0:
        row["tune"] = _tune_and_retime(group, cfg, dtype, dev, fwd, tune_mod)
        row.update(tune_goal(row["tune"]["pick"], row["tune"]["retimed_ms"]))
        row["goal_tune"] = GOAL_TUNE
        if megakernel and dtype == torch.bfloat16:
            # The same search over packed experts: moe_forward_prepared's separate launches and
            # the MegaKernel's points (sms, skip_rounds, tile_m) in one space.
            from uniep.moe.prepared import moe_forward_prepared, prepare_experts

            packed = prepare_experts(w1, w2, "bf16_packed")

            def fwd_packed(t: str) -> torch.Tensor:
                return moe_forward_prepared(x, idx, w, packed, group, t)

            row["tune_packed"] = _tune_and_retime(
                group, cfg, dtype, dev, fwd_packed, tune_mod, weights="bf16_packed"
            )
            packed_goal = tune_goal(row["tune_packed"]["pick"], row["tune_packed"]["retimed_ms"])
            row["packed_pick_over_best"] = packed_goal["pick_over_best"]
            row["packed_tune_goal_met"] = packed_goal["tune_goal_met"]
            pick_ms = row["tune_packed"]["retimed_ms"].get(row["tune_packed"]["pick"])
            if pick_ms is not None and math.isfinite(best_chain):
                # Over the slowest rank's expert GEMMs alone (the fastest chain on each rank).
                chains = [min(v for k, v in r["ms"].items() if k.startswith("experts_"))
                          for r in per_rank]  # fmt: skip
                row["packed_pick_over_experts"] = pick_ms / max(chains)
            del packed
    if cuda:
        _settle(cuda)
        uniep.moe.ep.shutdown(group)
    if megakernel:
        from uniep.moe.megakernel.launch import shutdown_fused_ep

        shutdown_fused_ep(group)
    return row if rank == 0 else None


def _megakernel_forward(
    group: dist.ProcessGroup,
    cfg: dict[str, Any],
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> Callable[[bool], Any]:
    """The MegaKernel across the ranks (uniep.moe.megakernel.launch.moe_forward_ep) on this shape:
    ``call(True)`` checks the call's errors and returns (out, rank's phase trace in us),
    ``call(False)`` is the timed form (no host read)."""
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel

    _, tokens, hidden, ffn, experts, top_k = cfg["shape"]
    # moe_forward's fused rows may have created the group's fused runtime already.
    megakernel.ensure_fused_ep(
        group, tokens=tokens, hidden=hidden, ffn=ffn, top_k=top_k, num_experts=experts
    )
    w1p = pack_gate_up(w1)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def call(checked: bool, comm_sms: int | None = None, skip_rounds: int = -1) -> Any:
        if not checked:
            return megakernel.moe_forward_ep(
                x, idx, w, w1p, w2, group, comm_sms=comm_sms, skip_rounds=skip_rounds, check=False
            )
        trace = torch.zeros(4 * sms, dtype=torch.int64, device=x.device)
        out = megakernel.moe_forward_ep(x, idx, w, w1p, w2, group, trace=trace)
        return out, megakernel.trace_phases(trace)

    return call


def _same_rows_local(
    group: dist.ProcessGroup,
    idx: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    experts: int,
    e_local: int,
    rank: int,
) -> Callable[[bool], Any]:
    """moe_forward_local(overlap="fused") at world 1 on as many rows per local expert as this
    rank's experts receive from every rank (top-1 rows of x, weight 1): ``call(True)`` returns
    the launch's phases (us), ``call(False)`` is the timed form."""
    from uniep.gemm import pack_gate_up
    from uniep.moe.megakernel import launch as megakernel

    flat = idx.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=experts)
    dist.all_reduce(counts, group=group)
    local = counts[rank * e_local : (rank + 1) * e_local]
    ids = torch.repeat_interleave(torch.arange(e_local, device=x.device), local).unsqueeze(1)
    rows = x[torch.arange(ids.shape[0], device=x.device) % x.shape[0]].contiguous()
    ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
    w1p = pack_gate_up(w1)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count

    def call(traced: bool) -> Any:
        if not traced:
            return megakernel.moe_forward_local(rows, ids, ones, w1p, w2, overlap="fused",
                                                check=False)  # fmt: skip
        trace = torch.zeros(4 * sms, dtype=torch.int64, device=x.device)
        megakernel.moe_forward_local(rows, ids, ones, w1p, w2, overlap="fused", trace=trace)
        return megakernel.trace_phases(trace)

    return call


def _tune_and_retime(
    group: dist.ProcessGroup,
    cfg: dict[str, Any],
    dtype: torch.dtype,
    dev: torch.device,
    fwd: Callable[[str], torch.Tensor],
    tune_mod: Any,
    weights: str = "plain",
) -> dict[str, Any]:
    """uniep.tune's pick, and every point it measured re-timed in interleaved rounds
    (``weights="bf16_packed"``: the tuner on packed experts, ``fwd`` moe_forward_prepared)."""
    from uniep._util.timing import interleaved_medians_ms

    _, tokens, hidden, ffn, experts, top_k = cfg["shape"]
    cuda = dev.type == "cuda"
    result = tune_mod.tune(
        group,
        tokens=tokens,
        hidden=hidden,
        ffn=ffn,
        experts=experts,
        top_k=top_k,
        dtype=dtype,
        candidates=cfg["tune_candidates"],
        warmup=cfg["tune_warmup"],
        iters=cfg["tune_iters"],
        device=dev.type,
        cache=False,
        weights=weights,
    )
    points = [c.tuning for c in result.candidates if math.isfinite(c.measured_ms)]
    per_round = max(1, cfg["tune_iters"] // 3)
    fns = {p: lambda p=p: fwd(p) for p in points}
    with torch.no_grad():
        medians = interleaved_medians_ms(
            fns, 3, per_round, cuda, warmup=1, before=lambda: _settle(cuda)
        )
    again = dict(zip(points, _max_over_ranks([medians[p] for p in points], dev), strict=True))
    return {
        "pick": result.tuning,
        "default": result.default,
        "considered": result.considered,
        "tuner_ms": {c.tuning: c.measured_ms for c in result.candidates},
        "retimed_ms": again,
        "rounds": 3,
        "calls_per_round": per_round,
    }


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| shape | W | fwd seq ms | fwd fused* ms | fwd NCCL+grouped_mm | experts alone ms | "
        "fwd / experts (goal 1.10) | fwd+bwd seq | fwd+bwd NCCL | tuner pick / best (goal 1.03) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = r.get("skipped") or "FAILED: " + str(r["error"]).strip().splitlines()[-1]
            lines.append(f"| {r.get('shape', '-')} | {r.get('world_size', '-')} | {why} |")
            continue
        ms = r["ms"]
        experts = min((v for k, v in ms.items() if k.startswith("experts_")), default=math.nan)

        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.3f}"

        lines.append(
            f"| {r['shape']} | {r['world_size']} | {f(ms['fwd_sequential'])} | "
            f"{f(ms['fwd_fused'])} | {f(ms['fwd_baseline'])} | {f(experts)} | "
            f"{f(r.get('forward_over_experts'))} | {f(ms['fwd_bwd_sequential'])} | "
            f"{f(ms['fwd_bwd_baseline'])} | {f(r.get('pick_over_best'))} |"
        )
    lines.append(f"(*) {FUSED_NOTE}")
    return lines


def build_config(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """What every rank is given, from the command line (the shape is added per spawn)."""
    quick = args.quick or not cuda
    return {
        "device": "cuda" if cuda else "cpu",
        "warmup": args.warmup if args.warmup is not None else (1 if quick else 5),
        "iters": args.iters if args.iters is not None else (3 if quick else 20),
        "tune_candidates": args.tune_candidates if args.tune_candidates is not None else 4,
        "tune_warmup": 1 if quick else 2,
        "tune_iters": args.tune_iters if args.tune_iters is not None else (3 if quick else 9),
        "profile_iters": args.profile,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 gloo ranks on CPU, small shape")
    add_out_dir_argument(parser)
    parser.add_argument("--world-size", type=int, default=None, help="default: all GPUs (CPU: 2)")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5)")
    parser.add_argument(
        "--tune-candidates",
        type=int,
        default=None,
        help="points uniep.tune measures besides the default (default 4; 0: no tuner check)",
    )
    parser.add_argument("--tune-iters", type=int, default=None, help="tuner calls per point")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per shape")
    add_budget_argument(parser)
    add_profile_argument(parser)
    args = parser.parse_args(argv)
    for name in ("iters", "tune_iters"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.tune_candidates is not None and args.tune_candidates < 0:
        parser.error("--tune-candidates must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uniep

    cuda = (
        torch.cuda.is_available()
        and not args.quick
        and torch._C._dispatch_has_kernel_for_dispatch_key("uniep::moe_forward", "CUDA")
    )
    if not args.quick and not cuda:
        why = (
            "no CUDA GPU" if not torch.cuda.is_available() else "no CUDA moe_forward in this build"
        )
        print(f"bench_moe_ep: skipped ({why}; --quick runs the CPU harness)")
        print(f"wrote {write_result('bench_moe_ep', [{'skipped': why}], args.out_dir)}")
        return 0
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    wanted = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(wanted) - {s[0] for s in shapes})
    if unknown:
        print(f"bench_moe_ep: unknown --shapes {unknown}; known: {[s[0] for s in shapes]}")
        return 2
    shapes = [s for s in shapes if not wanted or s[0] in wanted]
    cfg = build_config(args, cuda)
    world = args.world_size or (torch.cuda.device_count() if cuda else 2)
    rows: list[dict[str, Any]] = []
    failed = False
    if cuda and not 2 <= world <= torch.cuda.device_count():
        rows.append(
            {"world_size": world, "skipped": f"needs 2..{torch.cuda.device_count()} GPU ranks"}
        )
        shapes = []
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    # One runtime per spawn; room for the largest shape's buffers in NVSHMEM's heap.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(8 << 30))
    # On 4 H100s the two spawns took 103 s together; 55 s was too short for the DeepSeek-V3-like
    # one, so the Mixtral-like one took under 48 s.
    clock = ShapeClock(args.timeout, args.budget, floor_s=45.0)
    for i, shape in enumerate(shapes):
        try:
            out = uniep.distributed.run_local_ranks(
                _bench_shape,
                world,
                ({**cfg, "shape": shape},),
                backend="nccl" if cuda else "gloo",
                timeout_s=clock.timeout(len(shapes) - 1 - i),
            )
            rows.append(out[0])
        except RuntimeError as exc:  # keep the other shapes' numbers; the run still fails
            failed = True
            print(f"{shape[0]}: {exc}", file=sys.stderr, flush=True)
            rows.append({"shape": shape[0], "world_size": world, "error": str(exc)[-4000:]})
        print(markdown(rows[-1:])[2], flush=True)
    path = write_result("bench_moe_ep", rows, args.out_dir)
    print("\n".join(markdown(rows)))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
