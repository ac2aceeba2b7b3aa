"""The multi-GPU run checked on CPU: the plan of bench/multigpu_run.sh (--dry-run), the summary's
goal logic on recorded GPU results, and the pure helpers of the scripts it runs. Nothing here
needs a GPU; what the run measures is checked on the GPU machine only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "bench" / "harness")]
import bench_experts  # noqa: E402
import bench_moe_ep  # noqa: E402
import bench_parm  # noqa: E402
import bench_ulysses_ag  # noqa: E402
import common  # noqa: E402
import multigpu_summary as ms  # noqa: E402

# Real GPU results, copied from the runs: bench_dispatch / bench_overlap JSON of a full
# device_check.sh run on 2x H200 (2026-11-23, commit 2a0c59e), and part 1's bench_dispatch JSON of
# a multi-GPU run on 2x H200 (2026-11-25, commit 8e48801).
RECORDED = ROOT / "tests" / "data" / "multigpu" / "h200x2-2a0c59e"
RECORDED_PART1 = ROOT / "tests" / "data" / "multigpu" / "h200x2-8e48801-part1"


def _record(work: Path, step: str, status: str, out_dir: Path | None = None, **kw: Any) -> None:
    args = ["record", "--work", str(work), "--step", step, "--status", status]
    if out_dir is not None:
        args += ["--out-dir", str(out_dir)]
    for key, value in kw.items():
        args += [f"--{key.replace('_', '-')}={value}"]
    assert ms.main(args) == 0


def _by_name(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in summary["goals"]}


def test_kind_from_gpu_names_follows_the_device_tool() -> None:
    assert common.kind_from_gpus("NVIDIA H100 80GB HBM3", 2) == "nvidia-h100-x2"
    assert common.kind_from_gpus("NVIDIA H100 80GB HBM3", 1) == "nvidia-h100-x1"
    assert common.kind_from_gpus("NVIDIA H200", 1) == "nvidia-h200"
    assert common.kind_from_gpus("NVIDIA H200", 8) == "nvidia-h200-x8"
    assert common.kind_from_gpus("NVIDIA A100-SXM4-80GB", 4) == "nvidia-a100-x4"
    assert common.kind_from_gpus("anything", 0) == "none"


def test_env_info_names_the_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIEP_DEVICE_KIND", "nvidia-h100-x2")
    env = common.env_info()
    assert env["kind"] == "nvidia-h100-x2" and "gpu_count" in env
    monkeypatch.delenv("UNIEP_DEVICE_KIND")
    assert common.env_info()["kind"]


def test_summary_judges_recorded_gpu_results(tmp_path: Path) -> None:
    work = tmp_path / "work"
    for step, prefix in (("part1-dispatch", "bench_dispatch"), ("part3-overlap", "bench_overlap")):
        (work / step).mkdir(parents=True)
        for f in RECORDED.glob(f"{prefix}-*.json"):
            shutil.copy(f, work / step)
        _record(work, step, "ok", work / step, rc=0, seconds=20, timeout=90)
    _record(work, "part2-moe", "timeout", work / "part2", rc=124, timeout=140)
    _record(work, "part4-parm-w2", "failed", work / "p4", rc=1)
    ms.main(["meta", "--work", str(work), "gpu_count=2", "kind=nvidia-h200-x2", "parm_mp=2"])
    summary = ms.build(work)
    goals = _by_name(summary)
    # 2a0c59e at <= 24 SMs: bf16 dispatch 394 GB/s, fp8 271, combine 114; LL 73.9 us.
    bf16 = goals["bf16 dispatch, DeepSeek-V3 shape"]
    assert bf16["status"] == ms.MET and bf16["measured"] == pytest.approx(394.07, abs=0.01)
    assert "EP2" in bf16["why"] and bf16["nccl_GBps"] > 0
    assert goals["fp8 dispatch, DeepSeek-V3 shape"]["status"] == ms.MISSED
    # That result's combines took the whole GPU (no combine_sms): not a figure at <= 24 SMs.
    for name in ("combine (per_k)", "combine (rank_partials"):
        comb = next(g for n, g in goals.items() if n.startswith(name))
        assert comb["status"] == ms.NOT_RUN and "whole GPU" in comb["why"]
    ll = goals["low-latency dispatch + combine, 128 tokens, 288 experts (eager)"]
    assert ll["status"] == ms.MET and ll["measured"] == pytest.approx(73.888, abs=1e-3)
    ag = goals["TP=2 AG+GEMM 8192x8192_n7168"]
    assert ag["status"] == ms.MISSED and ag["measured"] == pytest.approx(1.1387, abs=1e-4)
    assert ag["nccl_mm_ms"] and ag["torch_fused_ms"]
    assert goals["TP=2 GEMM+RS 8192x8192_n7168"]["status"] == ms.MET
    tp4 = goals["TP=4 AG+GEMM 4096x8192_n2048"]
    assert tp4["status"] == ms.NOT_RUN and "4 GPUs" in tp4["why"]
    moe = goals["dsv3-like forward (overlap=sequential) / expert GEMMs alone, same rank"]
    assert moe["status"] == ms.NOT_RUN and "140" in moe["why"] and "timeout" in moe["why"]
    fused = goals[MK_GOAL.format("mixtral-like")]
    assert fused["status"] == ms.NOT_RUN and "timeout" in fused["why"]
    parm2 = next(g for g in summary["goals"] if g["name"].startswith("2 GPUs"))
    assert parm2["status"] == ms.NOT_RUN and "exit 1" in parm2["why"]
    parm8 = next(g for g in summary["goals"] if g["name"].startswith("8 GPUs"))
    assert "8 GPUs needed" in parm8["why"]
    counts = summary["counts"]
    assert counts[ms.MET] >= 3 and counts[ms.MISSED] >= 3
    assert sum(counts.values()) == len(summary["goals"])
    assert all(g["status"] != ms.NOT_RUN or g.get("why") for g in summary["goals"])


MK_GOAL = (
    "{} fused MegaKernel (uniep.moe.megakernel.launch.moe_forward_ep, best launch point) "
    "forward / expert GEMMs alone, same rank"
)


def _moe_row(
    shape: str, fwd_ratio: float, pick_ratio: float, mk_ratio: float | None = None
) -> dict[str, Any]:
    row = {"shape": shape, "world_size": 2, "ms": {"fwd_sequential": 8.0, "fwd_fused": 8.0}}
    if mk_ratio is not None:  # a build with the MegaKernel across ranks
        row["ms"]["fwd_megakernel"] = 8.0 * mk_ratio / fwd_ratio
        row["megakernel_over_experts"] = mk_ratio
        row["megakernel_goal_met"] = mk_ratio <= bench_moe_ep.GOAL_FWD_OVER_EXPERTS
    row.update(bench_moe_ep.forward_goal([fwd_ratio, fwd_ratio - 0.01]))
    retimed = {"a": 1.0, "b": pick_ratio}
    row["tune"] = {"pick": "b", "retimed_ms": retimed}
    row.update(bench_moe_ep.tune_goal("b", retimed))
    row["fused_bits_equal_sequential"] = True
    return row


def test_summary_of_the_moe_layer_and_parm(tmp_path: Path) -> None:
    work = tmp_path / "work"
    part2 = work / "part2"
    part2.mkdir(parents=True)
    rows = [_moe_row("dsv3-like", 1.2, 1.01, 1.08), _moe_row("mixtral-like", 1.05, 1.2)]
    (part2 / "bench_moe_ep-x.json").write_text(json.dumps({"rows": rows}))
    _record(work, "part2-moe", "ok", part2, rc=0)
    p4 = work / "p4"
    p4.mkdir()
    measure = {"kind": "measure", "tokens": 512, "hidden": 1024, "ffn_hidden": 2048}
    measure.update(num_experts=2, top_k=1, capacity_factor=1.2, chosen="s1", measured_best="s1")
    measure.update(
        predicted={"baseline": 2e-3, "s1": 1e-3}, measured={"baseline": 3e-3, "s1": 2e-3}
    )
    choice = {"kind": "choice", "right_fraction": 1.0, "layers": 1, "mp_size": 2}
    choice.update(mean_regret=0.0, placement="one-rank-per-gpu")
    (p4 / "bench_parm-x.json").write_text(json.dumps({"rows": [measure, choice]}))
    _record(work, "part4-parm-w2", "ok", p4, rc=0)
    goals = _by_name(ms.build(work))
    dsv3 = goals["dsv3-like forward (overlap=sequential) / expert GEMMs alone, same rank"]
    assert dsv3["status"] == ms.MISSED and dsv3["measured"] == pytest.approx(1.2)
    assert goals["dsv3-like uniep.tune's pick / best re-timed point"]["status"] == ms.MET
    mix = goals["mixtral-like forward (overlap=sequential) / expert GEMMs alone, same rank"]
    assert mix["status"] == ms.MET
    assert goals["mixtral-like uniep.tune's pick / best re-timed point"]["status"] == ms.MISSED
    mk = goals[MK_GOAL.format("dsv3-like")]
    assert mk["status"] == ms.MET and mk["measured"] == pytest.approx(1.08)
    assert mk["megakernel_ms"] == pytest.approx(7.2) and mk["sequential_ms"] == 8.0
    no_mk = goals[MK_GOAL.format("mixtral-like")]
    assert no_mk["status"] == ms.NOT_RUN and "no MegaKernel across ranks" in no_mk["why"]
    parm = goals["2 GPUs (MP 2): the cost model chose the measured-faster schedule"]
    assert parm["status"] == ms.MET and "4 and 8" in parm["why"]
    assert parm["per_layer"][0]["predicted_ms"]["s1"] == pytest.approx(1.0)


def test_goal_helpers_of_the_scripts() -> None:
    assert bench_moe_ep.forward_goal([1.05, 1.11])["forward_goal_met"] is False
    assert bench_moe_ep.forward_goal([1.05, 1.09])["forward_over_experts"] == 1.09
    assert bench_moe_ep.forward_goal([1.0, float("nan")])["forward_goal_met"] is None
    assert bench_moe_ep.tune_goal("a", {"a": 1.02, "b": 1.0})["tune_goal_met"] is True
    assert bench_moe_ep.tune_goal("a", {"a": 1.04, "b": 1.0})["tune_goal_met"] is False
    assert bench_moe_ep.tune_goal("c", {"a": 1.0})["tune_goal_met"] is None
    assert bench_ulysses_ag.ratio_goal(0.9, 1.0, True)["goal_met"]
    assert not bench_ulysses_ag.ratio_goal(0.9, 1.0, False)["goal_met"]
    assert not bench_ulysses_ag.ratio_goal(None, 1.0, True)["goal_met"]
    # [S/W, H, D] bf16: one rank's block to one peer is S*H*D*2 / W^2 bytes.
    assert bench_ulysses_ag.ulysses_block_bytes(((8192, 32, 128),), 2) == 8192 * 32 * 128 // 2
    cfg = bench_moe_ep.build_config(bench_moe_ep.parse_args(["--iters", "7"]), cuda=True)
    assert cfg["iters"] == 7 and cfg["warmup"] == 5 and cfg["tune_candidates"] == 4
    with pytest.raises(SystemExit):
        bench_moe_ep.parse_args(["--iters", "0"])


def test_extra_loads_run_only_when_named() -> None:
    assert bench_experts.selected([]) == bench_experts.LAYERS
    picked = bench_experts.selected(["dsv3-ep4-rank", "qwen3-30b-a3b"])
    assert [layer[0] for layer in picked] == ["qwen3-30b-a3b", "dsv3-ep4-rank"]
    # One rank's share of the EP4 layer of part 2: 64 experts, ~512 rows each.
    _, tokens, _, _, experts, top_k = picked[1]
    assert (experts, tokens * top_k // experts) == (64, 512)


def test_parm_grid_sample_fits_the_layout() -> None:
    for world, mp in ((2, 2), (4, 2), (8, 2), (8, 4)):
        layers = bench_parm.grid_layers(world, mp, 8)
        assert len(layers) == 8 and len({json.dumps(x, sort_keys=True) for x in layers}) == 8
        for layer in layers:
            assert set(layer) == set(bench_parm.LAYER_KEYS)
            assert layer["top_k"] <= layer["num_experts"]
            assert layer["num_experts"] % (world // mp) == 0
        assert layers == bench_parm.grid_layers(world, mp, 8)  # a fixed seed
    with pytest.raises(ValueError, match="MP size 1"):
        bench_parm.grid_layers(2, 1, 4)
    with pytest.raises(ValueError):
        bench_parm.grid_layers(4, 3, 4)


def test_parm_one_rank_per_gpu_arguments() -> None:
    with pytest.raises(SystemExit):
        bench_parm.parse_args(["--ranks-per-gpu", "1"])  # needs --device cuda
    args = bench_parm.parse_args(["--device", "cuda", "--ranks-per-gpu", "1", "--world-size", "4"])
    assert args.world_size == 4 and args.grid_sample == 0
    assert bench_parm.parse_args([]).world_size == 4
    if bench_parm._gpu_count() < 4:
        assert "GPU" in (bench_parm.per_gpu_problem(args) or "")
    assert bench_parm.per_gpu_problem(bench_parm.parse_args([])) is None


def test_parm_saa_chunks_argument() -> None:
    assert bench_parm.parse_args([]).saa_chunks == "auto"
    assert bench_parm.parse_args(["--saa-chunks", "4"]).saa_chunks == 4
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            bench_parm.parse_args(["--saa-chunks", bad])


def _dry_run(tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MGPU_WORK": str(tmp_path / "work")}
    env["UNIEP_DEVICE_KIND"] = "nvidia-h100-x2"
    env["UNIEP_COMMIT"] = "abc1234"
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "device_check.sh"), "--multigpu", "--dry-run", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8, files  # the device tool returns at most 8 files
    summary = json.loads((tmp_path / "out" / "summary-nvidia-h100-x2-abc1234.json").read_text())
    return proc.stdout, summary


def test_dry_run_plans_every_part_inside_the_budget(tmp_path: Path) -> None:
    out, summary = _dry_run(tmp_path, "--gpus", "2")
    for step in ("build", "multigpu-tests", "part1-dispatch", "part2-moe", "part3-overlap"):
        assert f"== [{step}]" in out
    assert "--world-size 2" in out and "--tp 2 " in out and "--ranks-per-gpu 1" in out
    assert summary["kind"] == "nvidia-h100-x2" and summary["commit"] == "abc1234"
    steps = {s["step"]: s for s in summary["steps"]}
    assert all(s["status"] == "dry-run" for s in steps.values())
    assert sum(s["timeout_s"] for s in steps.values()) > 0
    assert all(g["status"] == ms.NOT_RUN for g in summary["goals"])
    done = [line for line in out.splitlines() if "done in" in line][0]
    assert int(done.split("done in ")[1].split("s")[0]) <= 580


def test_dry_run_on_eight_gpus_and_a_short_budget(tmp_path: Path) -> None:
    out, summary = _dry_run(tmp_path / "a", "--gpus", "8", "--iters", "7")
    assert "--tp 2,4" in out and "--world-size 4 --iters 7" in out
    assert "part4-parm-w4" in out and "part4-parm-w8" in out
    out, summary = _dry_run(tmp_path / "b", "--gpus", "2", "--budget", "180", "--skip-build")
    skipped = [s for s in summary["steps"] if s["status"] == "skipped"]
    assert any("budget" in s.get("why", "") for s in skipped)
    assert any(s["step"] == "part4-parm-w2" and s["status"] == "dry-run" for s in summary["steps"])


def test_meta_keeps_a_commit_that_reads_as_a_number(tmp_path: Path) -> None:
    # 8e48801 is a float to JSON (inf): the first H200x2 summary of that commit said "commit inf".
    ms.main(["meta", "--work", str(tmp_path), "commit=8e48801", "gpu_count=2", "kind=x-2"])
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["commit"] == "8e48801" and meta["gpu_count"] == 2


def test_summary_counts_combines_run_on_the_budget(tmp_path: Path) -> None:
    # 8e48801 on 2 x H200: the combines on the row's SMs (combine_sms), 24 SMs the best <= 24.
    work = tmp_path / "work"
    (work / "part1-dispatch").mkdir(parents=True)
    for f in RECORDED_PART1.glob("bench_dispatch-*.json"):
        shutil.copy(f, work / "part1-dispatch")
    _record(work, "part1-dispatch", "ok", work / "part1-dispatch", rc=0, seconds=17, timeout=90)
    ms.main(["meta", "--work", str(work), "gpu_count=2", "kind=nvidia-h200-x2"])
    goals = _by_name(ms.build(work))
    per_k = goals["combine (per_k), DeepSeek-V3 shape"]
    assert per_k["status"] == ms.MISSED and per_k["measured"] == pytest.approx(108.74, abs=0.01)
    partials = next(g for n, g in goals.items() if n.startswith("combine (rank_partials"))
    assert partials["status"] == ms.MISSED
    assert partials["measured"] == pytest.approx(154.18, abs=0.01)
    assert partials["nccl_GBps"] > 0 and "EP2" in partials["why"]


def test_shape_clock_shares_one_budget_between_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: now[0])
    # Without a budget, every shape gets --timeout.
    assert common.ShapeClock(90.0, None, floor_s=45.0).timeout(1) == 90.0
    clock = common.ShapeClock(300.0, 116.0, floor_s=45.0)
    # The first of two shapes may use all but the second's floor...
    assert clock.timeout(1) == pytest.approx(71.0)
    # ...and the second what the first left, the whole rest when it finished early.
    now[0] += 60.0
    assert clock.timeout(0) == pytest.approx(56.0)
    # Never more than --timeout, never less than one second.
    assert common.ShapeClock(30.0, 116.0, floor_s=45.0).timeout(1) == 30.0
    now[0] += 500.0
    assert clock.timeout(0) == 1.0
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        common.ShapeClock(90.0, 0.0, floor_s=45.0)


def test_part_five_runs_only_when_named(tmp_path: Path) -> None:
    out, _ = _dry_run(tmp_path / "a", "--gpus", "8")
    assert "part5-multinode" not in out
    out, summary = _dry_run(tmp_path / "b", "--gpus", "8", "--parts", "5", "--skip-build")
    assert "== [part5-multinode]" in out and "--layouts 4x2,8x4,8x2 --rail-sockets" in out
    out, summary = _dry_run(tmp_path / "c", "--gpus", "2", "--parts", "5", "--skip-build")
    (step,) = [s for s in summary["steps"] if s["step"] == "part5-multinode"]
    assert step["status"] == "skipped" and "4 GPUs" in step["why"]


def test_part_six_runs_deepep_only_when_named_and_carried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = _dry_run(tmp_path / "a", "--gpus", "4")
    assert "part6-deepep" not in out
    monkeypatch.setenv("UNIEP_DEEPEP_SRC", str(tmp_path / "nowhere"))
    out, summary = _dry_run(tmp_path / "b", "--gpus", "4", "--parts", "1,6", "--skip-build")
    (step,) = [s for s in summary["steps"] if s["step"] == "part6-deepep"]
    assert step["status"] == "skipped" and "no DeepEP source tree" in step["why"]
    src = tmp_path / "DeepEP"
    src.mkdir()
    (src / "setup.py").write_text("")
    monkeypatch.setenv("UNIEP_DEEPEP_SRC", str(src))
    out, summary = _dry_run(tmp_path / "c", "--gpus", "4", "--parts", "1,6", "--skip-build")
    assert "== [part6-deepep]" in out and "bench/peers/deepep.sh" in out and "--ep 4" in out


def test_deepep_script_refuses_bad_arguments(tmp_path: Path) -> None:
    script = ROOT / "bench" / "peers" / "deepep.sh"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True)

    assert run().returncode == 2  # no --out-dir
    assert run("--out-dir", str(tmp_path), "--ep", "0").returncode == 2
    bad = run("--src", str(tmp_path / "none"), "--out-dir", str(tmp_path / "o"))
    assert bad.returncode == 1 and "no DeepEP source" in bad.stderr
    (tmp_path / "half").mkdir()
    bad = run("--src", str(tmp_path / "half"), "--out-dir", str(tmp_path / "o"))
    assert bad.returncode == 1 and "not a DeepEP source tree" in bad.stderr


# The lines DeepEP v1.2.1's tests print (their format; the figures are ANCHORS.md's EP4 run).
DEEPEP_INTRANODE = """\
[config] num_tokens=4096, hidden=7168, num_topk=8
[tuning] SMs 24, NVL chunk 4: 240.10 GB/s (NVL), avg_t: 450.00 us
[tuning] Best dispatch (FP8): SMs 24, NVL chunk 8, 255.00 GB/s (NVL), t: 429.00 us

[tuning] Best dispatch (BF16): SMs 24, NVL chunk 6, 261.00 GB/s (NVL), t: 811.00 us

[tuning] SMs 24, NVL chunk 1: 200.00 GB/s (NVL), avg_t: 1060.00 us
[tuning] Best combine: SMs 24, NVL chunk 4: 357.00 GB/s (NVL), t: 594.00 us
"""
DEEPEP_LOW_LATENCY = "".join(
    f"[rank {r}] Dispatch + combine bandwidth: 120.00 GB/s, avg_t={t:.2f} us, min_t=90.00 us, "
    f"max_t=99.00 us\n[rank {r}] Dispatch bandwidth: 150.00 GB/s, avg_t={d:.2f} us | "
    f"Combine bandwidth: 160.00 GB/s, avg_t={c:.2f} us\n"
    for r, t, d, c in ((0, 94.0, 36.0, 55.0), (1, 95.0, 36.7, 55.4), (2, 93.5, 35.0, 54.0))
)


def test_deepep_log_reads_deepep_test_output() -> None:
    import deepep_log

    got = deepep_log.summarize(DEEPEP_INTRANODE, DEEPEP_LOW_LATENCY, ep=4)
    assert got["dispatch_bf16_GBps"] == 261.0 and got["dispatch_bf16_us"] == 811.0
    assert got["dispatch_fp8_GBps"] == 255.0 and got["dispatch_fp8_nvl_chunk"] == 8
    assert got["combine_GBps"] == 357.0 and got["combine_us"] == 594.0
    # The slowest of the ranks.
    assert (got["ll_dispatch_us"], got["ll_combine_us"], got["ll_total_us"]) == (36.7, 55.4, 95.0)
    assert got["ll_total_us_ranks"] == 3 and got["missing"] == [] and got["ep"] == 4
    partial = deepep_log.summarize("", "Traceback: NVSHMEM failed to initialise")
    assert partial["missing"] == list(deepep_log.FIGURES)


def test_summary_sets_deepep_of_the_same_run_beside_ours(tmp_path: Path) -> None:
    import deepep_log

    work = tmp_path / "work"
    (work / "part1-dispatch").mkdir(parents=True)
    for f in RECORDED_PART1.glob("bench_dispatch-*.json"):
        shutil.copy(f, work / "part1-dispatch")
    _record(work, "part1-dispatch", "ok", work / "part1-dispatch", rc=0)
    out = work / "part6"
    assert (
        deepep_log.main(
            ["--out", str(out / "deepep.json"), "ep=2"]
            + ["--intranode", str(_write(tmp_path / "i.log", DEEPEP_INTRANODE))]
            + ["--low-latency", str(_write(tmp_path / "l.log", DEEPEP_LOW_LATENCY))]
        )
        == 0
    )
    _record(work, "part6-deepep", "ok", out, rc=0)
    ms.main(["meta", "--work", str(work), "gpu_count=2", "kind=nvidia-h200-x2"])
    summary = ms.build(work)
    goals = _by_name(summary)
    bf16 = goals["bf16 dispatch, DeepSeek-V3 shape"]
    assert bf16["deepep_same_run"] == 261.0
    assert bf16["vs_deepep_same_run"] == pytest.approx(bf16["measured"] / 261.0, abs=1e-3)
    partials = next(g for n, g in goals.items() if n.startswith("combine (rank_partials"))
    assert partials["deepep_same_run"] == 357.0
    per_k = goals["combine (per_k), DeepSeek-V3 shape"]
    assert "deepep_same_run" not in per_k  # DeepEP's combine moves rank_partials' rows
    ll = goals["low-latency dispatch + combine, 128 tokens, 288 experts (eager)"]
    if ll["measured"] is not None:
        assert ll["vs_deepep_same_run"] == pytest.approx(95.0 / ll["measured"], abs=1e-3)
    assert any("DeepEP in this run: 261.0 GB/s" in line for line in ms.markdown(summary))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
