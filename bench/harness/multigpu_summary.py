"""The summary of bench/multigpu_run.sh: each part of the multi-GPU run, its goal, the measured
figure, and met / missed / not-run with the reason, from the step records and the benchmark
JSON files.

    python bench/harness/multigpu_summary.py record --work DIR --step NAME --status ok --rc 0 ...
    python bench/harness/multigpu_summary.py meta --work DIR key=value ...
    python bench/harness/multigpu_summary.py build --work DIR --out FILE      # also prints a table

It imports no torch: it reads JSON only, so it runs whatever state the build left.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MET, MISSED, NOT_RUN = "met", "missed", "not-run"
# The goals.
DISPATCH_BF16_GBPS, DISPATCH_FP8_GBPS, COMBINE_GBPS, LL_TOTAL_US = 370.0, 300.0, 410.0, 75.0
MAX_SMS = 24
EP_GOAL_WORLD = 4
FWD_OVER_EXPERTS, TUNE_WITHIN = 1.10, 1.03
OVERLAP_IDEAL = 1.05
PARM_RIGHT = 0.95
PARM_WORLDS = (4, 8)
TP_SIZES = (2, 4)
ANCHOR_SHAPES = ("8192x8192_n7168", "4096x8192_n2048", "16384x4096_n3584")
MOE_SHAPES = ("dsv3-like", "mixtral-like")
# Which benchmark each step runs: it writes {out_dir}/{name}/{name}.json (common.result_path).
STEP_FILES = {
    "part1-dispatch": "bench_dispatch",
    "part2-moe": "bench_moe_ep",
    "part3-overlap": "bench_overlap",
    "part3-ulysses-dp-ag": "bench_ulysses_ag",
}
PARM_STEP = "part4-parm-w"  # + world size
PEER_STEP, PEER_FILE = "part6-deepep", "deepep.json"  # bench/peers/deepep.sh's


# ---- records ----


def append_jsonl(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def read_steps(work: Path) -> dict[str, dict[str, Any]]:
    """Step name -> its last record (a step recorded twice keeps the later one)."""
    steps: dict[str, dict[str, Any]] = {}
    path = work / "steps.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                steps[entry["step"]] = entry
    return steps


def load_payload(step: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    """Benchmark ``name``'s result in the step's out_dir, or None: ``{name}/{name}.json``, else
    the newest ``{name}-*.json`` (the files of benchmarks from before that layout)."""
    if not step or not step.get("out_dir"):
        return None
    out_dir = Path(step["out_dir"])
    dated = sorted(out_dir.glob(f"{name}-*.json"), key=lambda p: p.stat().st_mtime)
    files = [*dated, out_dir / name / f"{name}.json"]
    for path in reversed(files):
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


def step_reason(step: dict[str, Any] | None) -> str:
    """Why a step produced nothing usable."""
    if step is None:
        return "the step did not run (not among --parts, or the run ended before it)"
    status = step.get("status")
    if status == "skipped":
        return f"skipped: {step.get('why') or 'no reason recorded'}"
    if status == "dry-run":
        return "dry run: nothing was executed"
    if status == "timeout":
        return f"the step hit its {step.get('timeout_s')} s timeout"
    if status == "failed":
        return f"the step failed (exit {step.get('rc')}; see console.log)"
    return "the step ran but wrote no result for this"


# ---- goals ----


def goal(
    part: str,
    name: str,
    target: str,
    measured: float | None,
    unit: str,
    met: bool | None,
    why: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """One goal's entry: not-run when nothing was measured (``why`` says why), else met/missed."""
    if measured is None or (isinstance(measured, float) and not math.isfinite(measured)):
        status, measured = NOT_RUN, None
    else:
        status = MET if met else MISSED
    entry = {"part": part, "name": name, "goal": target, "measured": measured, "unit": unit}
    entry["status"] = status
    if why or status == NOT_RUN:
        entry["why"] = why or "nothing measured"
    entry.update({k: v for k, v in extra.items() if v is not None})
    return entry


def _best(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return max(values) if values else None


def _world_note(world: Any, wanted: int, what: str) -> str:
    if isinstance(world, int) and world != wanted:
        return f"measured at {what}{world}; the goal is stated for {what}{wanted}"
    return ""


def load_peer(step: dict[str, Any] | None) -> dict[str, Any] | None:
    """DeepEP's figures from this run (bench/peers/deepep.sh's JSON in the step's out_dir)."""
    if not step or not step.get("out_dir"):
        return None
    try:
        return json.loads((Path(step["out_dir"]) / PEER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _vs_peer(
    peer: dict[str, Any] | None, key: str, ours: float | None, higher_better: bool
) -> dict[str, Any]:
    """DeepEP's figure ``key`` from the same run and how far ahead ours is (> 1: ahead)."""
    theirs = (peer or {}).get(key)
    if not isinstance(theirs, int | float) or theirs <= 0:
        return {}
    out: dict[str, Any] = {"deepep_same_run": theirs}
    if isinstance(ours, int | float) and ours > 0:
        out["vs_deepep_same_run"] = round(ours / theirs if higher_better else theirs / ours, 3)
    return out


def part1_goals(
    step: dict[str, Any] | None,
    payload: dict[str, Any] | None,
    peer: dict[str, Any] | None = None,
) -> list[dict]:
    """``peer``: DeepEP's figures from the same run (load_peer), set beside ours where given."""
    rows = (payload or {}).get("rows", [])
    dsv3 = [r for r in rows if r.get("shape") == "dsv3" and r.get("num_sms", 99) <= MAX_SMS]
    ll = [r for r in rows if r.get("shape") == "ll" and "ll_total_us_max" in r]
    failed = [r for r in rows if "error" in r or "skipped" in r]

    def why(found: list[dict[str, Any]], shape: str) -> str:
        if found:
            return _world_note(found[0].get("world_size"), EP_GOAL_WORLD, "EP")
        bad = [r for r in failed if r.get("shape") in (shape, None)]
        if bad:
            text = str(bad[0].get("skipped") or bad[0].get("error")).strip().splitlines()
            return f"{shape}: {text[-1] if text else '?'}"
        return step_reason(step) if payload is None else f"no {shape} row in the result"

    part = "1 dispatch/combine"
    d_why, l_why = why(dsv3, "dsv3"), why(ll, "ll")
    bf16, fp8 = (_best(dsv3, k) for k in ("dispatch_GBps", "fp8_dispatch_GBps"))
    # Combines count only where they ran on the row's budget: bench_dispatch records combine_sms
    # since they do (before, they took the whole GPU whatever the row's num_sms said).
    budget = [r for r in dsv3 if isinstance(r.get("combine_sms"), int)]
    c_why = d_why
    if dsv3 and not budget:
        c_why = (
            "the result's combines ran on the whole GPU (no combine_sms: bench_dispatch from "
            "before the SM budget applied to them), so none was measured at <= "
            f"{MAX_SMS} SMs"
        )

    def combine_goal(name: str, prefix: str, **extra: Any) -> dict:
        measured = _best(budget, f"{prefix}_GBps")
        if prefix == "rank_partials_combine":  # DeepEP's combine moves the same rows
            extra.update(_vs_peer(peer, "combine_GBps", measured, True))
        return goal(
            part,
            f"{name}, DeepSeek-V3 shape",
            f">= {COMBINE_GBPS:.0f} GB/s at <= {MAX_SMS} SMs",
            measured,
            "GB/s",
            measured is not None and measured >= COMBINE_GBPS,
            c_why,
            whole_gpu_GBps=_best(dsv3, f"{prefix}_whole_gpu_GBps"),
            nccl_GBps=_best(dsv3, "nccl_combine_GBps"),
            **extra,
        )

    ll_us = min((r["ll_total_us_max"] for r in ll), default=None)
    return [
        goal(
            part,
            "bf16 dispatch, DeepSeek-V3 shape",
            f">= {DISPATCH_BF16_GBPS:.0f} GB/s at <= {MAX_SMS} SMs",
            bf16,
            "GB/s",
            bf16 is not None and bf16 >= DISPATCH_BF16_GBPS,
            d_why,
            cached_GBps=_best(dsv3, "cached_dispatch_GBps"),
            nccl_GBps=_best(dsv3, "nccl_dispatch_GBps"),
            world_size=dsv3[0]["world_size"] if dsv3 else None,
            **_vs_peer(peer, "dispatch_bf16_GBps", bf16, True),
        ),
        goal(
            part,
            "fp8 dispatch, DeepSeek-V3 shape",
            f">= {DISPATCH_FP8_GBPS:.0f} GB/s at <= {MAX_SMS} SMs",
            fp8,
            "GB/s",
            fp8 is not None and fp8 >= DISPATCH_FP8_GBPS,
            d_why,
            cached_GBps=_best(dsv3, "fp8_cached_dispatch_GBps"),
            **_vs_peer(peer, "dispatch_fp8_GBps", fp8, True),
        ),
        combine_goal(
            "combine (per_k)",
            "combine",
            bytes_note="per_k sends one row per (token, k): top_k / (ranks per token) times the "
            "bytes counted",
        ),
        combine_goal(
            "combine (rank_partials: DeepEP's bytes, one row per (token, rank))",
            "rank_partials_combine",
        ),
        goal(
            part,
            "low-latency dispatch + combine, 128 tokens, 288 experts (eager)",
            f"<= {LL_TOTAL_US:.0f} us",
            ll_us,
            "us",
            ll_us is not None and ll_us <= LL_TOTAL_US,
            l_why,
            graph_us=min((r["ll_total_graph_us_max"] for r in ll), default=None),
            **_vs_peer(peer, "ll_total_us", ll_us, False),
        ),
    ]


def part2_goals(step: dict[str, Any] | None, payload: dict[str, Any] | None) -> list[dict]:
    rows = {r.get("shape"): r for r in (payload or {}).get("rows", [])}
    out = []
    part = "2 MoE layer"
    for shape in MOE_SHAPES:
        # A row without a shape says why no shape ran (no GPU, too few ranks).
        r = rows.get(shape, rows.get(None))
        why = ""
        if r is None:
            why = step_reason(step) if payload is None else f"no {shape} row in the result"
        elif "error" in r or "skipped" in r:
            text = str(r.get("skipped") or r.get("error")).strip().splitlines()
            why = text[-1] if text else "failed"
            r = None
        else:
            why = _world_note(r.get("world_size"), EP_GOAL_WORLD, "EP")
        ms = (r or {}).get("ms", {})
        tune = (r or {}).get("tune") or {}
        out.append(
            goal(
                part,
                f"{shape} forward (overlap=sequential) / expert GEMMs alone, same rank",
                f"<= {FWD_OVER_EXPERTS:.2f}x",
                (r or {}).get("forward_over_experts"),
                "x",
                (r or {}).get("forward_goal_met"),
                why,
                forward_ms=ms.get("fwd_sequential"),
                baseline_forward_ms=ms.get("fwd_baseline"),
                fwd_bwd_ms=ms.get("fwd_bwd_sequential"),
                baseline_fwd_bwd_ms=ms.get("fwd_bwd_baseline"),
            )
        )
        tune_why = why
        if r is not None and not tune:
            tune_why = "the tuner check was off (--tune-candidates 0)"
        out.append(
            goal(
                part,
                f"{shape} uniep.tune's pick / best re-timed point",
                f"<= {TUNE_WITHIN:.2f}x",
                (r or {}).get("pick_over_best"),
                "x",
                (r or {}).get("tune_goal_met"),
                tune_why,
                pick=tune.get("pick"),
            )
        )
        packed = (r or {}).get("tune_packed") or {}
        out.append(
            goal(
                part,
                f"{shape} uniep.tune's pick on packed experts (separate launches and the "
                "MegaKernel) / best re-timed point",
                f"<= {TUNE_WITHIN:.2f}x",
                (r or {}).get("packed_pick_over_best"),
                "x",
                (r or {}).get("packed_tune_goal_met"),
                why if r is None or packed else "no packed-experts tuner in this run",
                pick=packed.get("pick"),
                pick_over_experts=(r or {}).get("packed_pick_over_experts"),
            )
        )
        mk = (r or {}).get("megakernel_over_experts")
        mk_why = why
        if r is not None and mk is None:
            mk_why = (
                "this build has no MegaKernel across ranks (uniep::moe_fused_ep); "
                "moe_forward's overlap=fused runs the sequential launches (fwd_fused)"
            )
        out.append(
            goal(
                part,
                f"{shape} fused MegaKernel (uniep.moe.megakernel.launch.moe_forward_ep, "
                "best launch point) forward / expert GEMMs alone, same rank",
                f"<= {FWD_OVER_EXPERTS:.2f}x",
                mk,
                "x",
                (r or {}).get("megakernel_goal_met"),
                mk_why,
                megakernel_ms=ms.get("fwd_megakernel"),
                best_point=(r or {}).get("megakernel_best_point"),
                points_ms=(r or {}).get("megakernel_points_ms"),
                local_fused_same_rows_ms=ms.get("fwd_local_fused_same_rows"),
                sequential_ms=ms.get("fwd_sequential"),
                baseline_forward_ms=ms.get("fwd_baseline"),
                megakernel_over_sequential=(r or {}).get("megakernel_over_sequential"),
                phases_us_rank0=(r or {}).get("megakernel_phases_us_rank0"),
                fused_ms=ms.get("fwd_fused"),
                fused_bits_equal_sequential=(r or {}).get("fused_bits_equal_sequential"),
            )
        )
        # The fused backward across ranks: no speed goal of its own; its gradients
        # must equal overlap=sequential's, and its time beside sequential's is reported.
        bwd_bits = (r or {}).get("fused_backward_bits_equal_sequential")
        seq_bwd, fused_bwd = ms.get("bwd_sequential"), ms.get("bwd_fused")
        ratio = fused_bwd / seq_bwd if fused_bwd and seq_bwd else None
        out.append(
            goal(
                part,
                f"{shape} fused backward across ranks (moe_backward overlap=fused): gradients "
                "equal overlap=sequential's bit for bit; measured: its time / sequential's",
                "bits equal",
                ratio if bwd_bits is not None else None,
                "x",
                bool(bwd_bits),
                why if r is None or bwd_bits is not None else "no fused-backward check in this run",
                bwd_fused_ms=fused_bwd,
                bwd_sequential_ms=seq_bwd,
            )
        )
    return out


def _tp_results(payload: dict[str, Any] | None) -> list[dict[str, Any]]:
    return (payload or {}).get("results", [])


def part3_goals(
    step: dict[str, Any] | None,
    payload: dict[str, Any] | None,
    step_ua: dict[str, Any] | None,
    payload_ua: dict[str, Any] | None,
    gpus: int,
) -> list[dict]:
    part = "3 TP/SP overlap"
    out = []
    results = _tp_results(payload)
    skipped = {s.get("tp"): s.get("skipped") for s in (payload or {}).get("skipped", [])}
    errors = {e.get("tp"): e.get("error") for e in (payload or {}).get("errors", [])}
    for tp in TP_SIZES:
        for shape in ANCHOR_SHAPES:
            for kind in ("ag_mm", "mm_rs"):
                r = next(
                    (
                        x
                        for x in results
                        if x.get("tp") == tp and x.get("shape") == shape and x.get("kind") == kind
                    ),
                    None,
                )
                why = ""
                ms: dict[str, Any] = {}
                ratio = met = None
                if tp > gpus:
                    why = f"TP={tp} needs {tp} GPUs, this machine has {gpus}"
                elif r is None:
                    why = skipped.get(tp) or errors.get(tp) or step_reason(step)
                    why = str(why).strip().splitlines()[-1] if why else "no result"
                elif "error" in r or "skipped" in r:
                    why = str(r.get("skipped") or r.get("error")).strip().splitlines()[-1]
                else:
                    ms = r.get("ms", {})
                    ratio = r.get("ratio_to_ideal")
                    met = bool(r.get("goal_ideal_met")) and bool(r.get("check", {}).get("pass"))
                    if not r.get("check", {}).get("pass"):
                        why = "the output check failed"
                label = "AG+GEMM" if kind == "ag_mm" else "GEMM+RS"
                out.append(
                    goal(
                        part,
                        f"TP={tp} {label} {shape}",
                        f"<= {OVERLAP_IDEAL:.2f}x max(GEMM alone, communication alone)",
                        ratio,
                        "x",
                        met,
                        why,
                        ours_ms=ms.get("ours_best"),
                        nccl_mm_ms=ms.get("nccl_mm"),
                        torch_fused_ms=ms.get("torch_fused"),
                        mm_alone_ms=ms.get("mm_alone"),
                        coll_alone_ms=ms.get("coll_alone"),
                    )
                )
    for r in (payload or {}).get("dp", []):
        if "error" in r or "skipped" in r:
            continue
        ms = r.get("ms", {})
        out.append(
            goal(
                part,
                f"TP={r.get('tp')} DP reduce-scatter beside a GEMM (1 GiB fp32)",
                "<= NCCL's overlap (the bench's own goal; the issue names no number)",
                r.get("ratio_to_baseline"),
                "x",
                bool(r.get("goal_met")),
                ours_ms=ms.get("ours_best"),
                nccl_overlap_ms=ms.get("nccl_overlap"),
            )
        )
    rows_ua = (payload_ua or {}).get("rows", [])
    kinds = ("ulysses_seq_to_heads", "ulysses_heads_to_seq", "dp_ag")
    for tp in TP_SIZES:
        mine = [r for r in rows_ua if r.get("tp") == tp]
        if not mine or all("kind" not in r for r in mine):
            why = f"W={tp} needs {tp} GPUs, this machine has {gpus}" if tp > gpus else ""
            if not why:
                bad = [r for r in mine if "error" in r or "skipped" in r]
                why = (
                    str(bad[0].get("skipped") or bad[0].get("error")).strip().splitlines()[-1]
                    if bad
                    else step_reason(step_ua)
                )
            for kind in kinds:
                out.append(goal(part, f"W={tp} {kind}", "<= NCCL", None, "x", None, why))
            continue
        for r in mine:
            if "kind" not in r:
                continue
            why = ""
            if "skipped" in r or "error" in r:
                why = str(r.get("skipped") or r.get("error")).strip().splitlines()[-1]
            elif r.get("check", {}).get("ours_skipped"):
                why = f"ours did not run: {r['check']['ours_skipped']}"
            ms = r.get("ms", {})
            out.append(
                goal(
                    part,
                    f"W={tp} {r['kind']} {r.get('shape', '')}".strip(),
                    "<= NCCL (the issue's 'beside NCCL'; no number given)",
                    None if why else r.get("ratio_to_baseline"),
                    "x",
                    bool(r.get("goal_met")),
                    why,
                    ours_ms=ms.get("ours", ms.get("ours_best")),
                    nccl_ms=ms.get("nccl", ms.get("nccl_overlap")),
                )
            )
    return out


def part4_goals(steps: dict[str, dict[str, Any]], gpus: int, mp_size: Any = None) -> list[dict]:
    part = "4 Parm"
    out = []
    worlds = sorted(
        {*PARM_WORLDS, *(int(k[len(PARM_STEP) :]) for k in steps if k.startswith(PARM_STEP))}
    )
    for world in worlds:
        step = steps.get(f"{PARM_STEP}{world}")
        payload = load_payload(step, "bench_parm")
        rows = (payload or {}).get("rows", [])
        choice = next((r for r in rows if r.get("kind") == "choice"), None)
        measured = [r for r in rows if r.get("kind") == "measure"]
        skipped = next((r for r in rows if r.get("kind") == "skipped"), None)
        why = ""
        if world > gpus and step is None:
            why = f"{world} GPUs needed, this machine has {gpus}"
        elif skipped:
            why = skipped.get("why", "skipped")
        elif choice is None:
            why = step_reason(step) if payload is None else "no measured layers in the result"
        elif world not in PARM_WORLDS:
            why = f"measured at {world} GPUs; the issue asks for 4 and 8"
        mp = choice.get("mp_size") if choice else mp_size
        out.append(
            goal(
                part,
                f"{world} GPUs (MP {mp}): the cost model chose the measured-faster schedule",
                f">= {PARM_RIGHT:.0%} of the layers",
                choice.get("right_fraction") if choice else None,
                "fraction",
                choice.get("right_fraction", 0) >= PARM_RIGHT if choice else None,
                why,
                layers=choice.get("layers") if choice else None,
                mean_regret=choice.get("mean_regret") if choice else None,
                # The report: auto over the baseline, measured beside predicted.
                auto_speedup_measured=choice.get("auto_speedup_measured") if choice else None,
                auto_speedup_predicted=choice.get("auto_speedup_predicted") if choice else None,
                placement=choice.get("placement") if choice else None,
                per_layer=[
                    {
                        "layer": {k: r.get(k) for k in ("tokens", "hidden", "ffn_hidden")}
                        | {k: r.get(k) for k in ("num_experts", "top_k", "capacity_factor")},
                        "predicted_ms": {s: v * 1e3 for s, v in r.get("predicted", {}).items()},
                        "measured_ms": {s: v * 1e3 for s, v in r.get("measured", {}).items()},
                        "chosen": r.get("chosen"),
                        "measured_best": r.get("measured_best"),
                    }
                    for r in measured
                ]
                or None,
            )
        )
    return out


def build(work: Path) -> dict[str, Any]:
    """The summary of a run from its work directory."""
    steps = read_steps(work)
    meta_path = work / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    gpus = int(meta.get("gpu_count", 0) or 0)

    def payload(name: str) -> dict[str, Any] | None:
        return load_payload(steps.get(name), STEP_FILES[name])

    goals = (
        part1_goals(
            steps.get("part1-dispatch"),
            payload("part1-dispatch"),
            load_peer(steps.get(PEER_STEP)),
        )
        + part2_goals(steps.get("part2-moe"), payload("part2-moe"))
        + part3_goals(
            steps.get("part3-overlap"),
            payload("part3-overlap"),
            steps.get("part3-ulysses-dp-ag"),
            payload("part3-ulysses-dp-ag"),
            gpus,
        )
        + part4_goals(steps, gpus, meta.get("parm_mp"))
    )
    counts = {s: sum(g["status"] == s for g in goals) for s in (MET, MISSED, NOT_RUN)}
    started = meta.get("started_epoch")
    return {
        **{k: v for k, v in meta.items() if k != "started_epoch"},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.time() - float(started), 1) if started else None,
        "steps": list(steps.values()),
        "counts": counts,
        "goals": goals,
    }


def finite(obj: Any) -> Any:
    """``obj`` with every inf or NaN float replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def markdown(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"## multi-GPU run on {summary.get('kind', '?')} ({summary.get('device', '?')}),"
        f" commit {summary.get('commit', '?')}, {summary.get('date', '?')}",
        "",
        "| step | status | seconds | timeout | why |",
        "|---|---|---:|---:|---|",
    ]
    for s in summary["steps"]:
        lines.append(
            f"| {s['step']} | {s.get('status')} | {s.get('seconds', '-')} | "
            f"{s.get('timeout_s', '-')} | {s.get('why', '')} |"
        )
    lines += [
        "",
        "| part | goal | target | measured | status | why |",
        "|---|---|---|---:|---|---|",
    ]
    for g in summary["goals"]:
        m = g["measured"]
        shown = "-" if m is None else (f"{m:.3f}" if isinstance(m, float) else str(m))
        why = g.get("why", "")
        if "vs_deepep_same_run" in g:  # the peer timed in this run
            peer = (
                f"DeepEP in this run: {g['deepep_same_run']} {g['unit']}; our speed over its: "
                f"{g['vs_deepep_same_run']}x"
            )
            why = f"{why}; {peer}" if why else peer
        lines.append(
            f"| {g['part']} | {g['name']} | {g['goal']} | {shown} {g['unit']} | {g['status']} | "
            f"{why} |"
        )
    c = summary["counts"]
    lines.append(f"\nmet {c[MET]}, missed {c[MISSED]}, not run {c[NOT_RUN]}")
    return lines


# Always text: a short commit such as 8e48801 reads as a JSON number (inf).
TEXT_KEYS = frozenset({"commit", "kind", "device", "date", "started"})


def _kv(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {item!r}")
        if key in TEXT_KEYS:
            out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="append one step's record to WORK/steps.jsonl")
    rec.add_argument("--work", required=True)
    rec.add_argument("--step", required=True)
    rec.add_argument(
        "--status", required=True, choices=["ok", "failed", "timeout", "skipped", "dry-run"]
    )
    rec.add_argument("--rc", type=int, default=None)
    rec.add_argument("--seconds", type=float, default=None)
    rec.add_argument("--timeout", type=float, default=None)
    rec.add_argument("--out-dir", default=None)
    rec.add_argument("--why", default="")
    rec.add_argument("--command", default="")
    meta = sub.add_parser("meta", help="merge key=value pairs into WORK/meta.json")
    meta.add_argument("--work", required=True)
    meta.add_argument("pairs", nargs="*")
    bld = sub.add_parser("build", help="write the summary JSON and print it as Markdown")
    bld.add_argument("--work", required=True)
    bld.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.cmd == "record":
        entry = {"step": args.step, "status": args.status}
        for key in ("rc", "seconds", "out_dir", "why", "command"):
            value = getattr(args, key)
            if value not in (None, ""):
                entry[key] = value
        if args.timeout is not None:
            entry["timeout_s"] = args.timeout
        append_jsonl(work / "steps.jsonl", entry)
        return 0
    if args.cmd == "meta":
        path = work / "meta.json"
        current = json.loads(path.read_text()) if path.exists() else {}
        current.update(_kv(args.pairs))
        work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(current, indent=1) + "\n")
        return 0
    summary = build(work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(summary), indent=1, allow_nan=False, default=str) + "\n")
    tmp.replace(out)
    print("\n".join(markdown(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
