"""`uniep.parm.profile` and bench/bench_parm.py without a GPU: the device argument, the CUDA
mode's error where it cannot run, the fit and measure rows of both devices (from synthetic
per-rank times), and the CUDA profile's collective calls on CPU tensors (``CudaBackend`` runs on
UniEP's CPU collectives too). The CUDA profile itself: tests/parm/test_gpu_parm_profile.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from uniep import _C, parm
from uniep.cli import main
from uniep.parm import profile as pp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_parm  # noqa: E402

needs_no_cuda = pytest.mark.skipif(
    not pp.cuda_problems(), reason="CUDA is usable here: the error path cannot be reached"
)


def test_device_must_be_cpu_or_cuda() -> None:
    msg = "device must be 'cpu' or 'cuda', got 'gpu'"
    with pytest.raises(ValueError, match=msg):
        pp.profile(2, 1, device="gpu")
    with pytest.raises(ValueError, match=msg):
        pp.measure_layers(2, 1, [], device="gpu")
    with pytest.raises(ValueError, match=msg):
        pp.default_sizes("gpu")
    with pytest.raises(ValueError, match="got 'CUDA'"):
        pp.measure_rows([], [[]], 2, 1, device="CUDA")
    assert pp.default_sizes("cpu") == pp.DEFAULT_SIZES
    assert pp.default_sizes("cuda") == pp.CUDA_SIZES and len(pp.CUDA_SIZES) == 16


def test_largest_message_is_the_largest_step_of_any_schedule() -> None:
    layer = dict(
        tokens=8192, hidden=2048, ffn_hidden=4096, num_experts=8, top_k=2, capacity_factor=1.2
    )
    shape = parm.plan(4, 2, dtype=torch.bfloat16, gpus_per_node=2, **layer).shape
    steps = [
        st.bytes
        for schedule in parm.SCHEDULES
        for pass_ in ("forward", "backward")
        for st in _C.parm.build_steps(shape, schedule, pass_).steps
        if st.collective != "none"
    ]
    assert pp.largest_message([layer], 4, 2, "cuda") == max(steps) > 64 * 2**20
    # float32 on the CPU: twice the bytes; the largest of several layers; none: 0.
    assert pp.largest_message([layer], 4, 2, "cpu") == 2 * max(steps)
    small = dict(layer, tokens=1024)
    assert pp.largest_message([small, layer], 4, 2, "cuda") == max(steps)
    assert pp.largest_message([], 4, 2, "cuda") == 0


def test_profile_sizes_reach_the_largest_message_of_the_layers() -> None:
    # bench_parm's CUDA layers send up to ~77 MiB, past the 64 MiB of the default sizes.
    layers = bench_parm.CUDA_MEASURED_LAYERS
    most = pp.largest_message(layers, 4, 2, "cuda")
    sizes = pp.sizes_for_layers(layers, 4, 2, "cuda")
    assert most > pp.CUDA_SIZES[-1]
    assert len(sizes) == len(pp.CUDA_SIZES) and sizes[0] == pp.CUDA_SIZES[0]
    assert most <= sizes[-1] < most + 2**20
    assert sizes == sorted(set(sizes)) and all(n % 2**20 == 0 for n in sizes)
    # Layers within the defaults keep them.
    assert pp.sizes_for_layers(bench_parm.MEASURED_LAYERS, 4, 2, "cpu") == pp.DEFAULT_SIZES
    assert pp.sizes_for_layers([], 4, 2, "cuda") == pp.CUDA_SIZES
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        pp.sizes_for_layers(layers, 4, 2, "gpu")


def test_stretched_sizes_and_the_cli_option(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    assert pp.stretched_sizes("cuda", 0) == pp.CUDA_SIZES == pp.stretched_sizes("cuda", 2**26)
    sizes = pp.stretched_sizes("cpu", 100 * 2**20 + 1)
    assert sizes[0] == pp.DEFAULT_SIZES[0] and sizes[-1] == 101 * 2**20 and len(sizes) == 16
    seen = {}

    def fake_profile(world: int, mp_size: int, sizes: list[int], *args: Any, **kw: Any) -> Any:
        seen["sizes"] = sizes
        raise RuntimeError("stop here")

    monkeypatch.setattr(pp, "profile", fake_profile)
    base = ["parm", "profile", "--world-size", "2", "--mp-size", "1", "--sizes", "3"]
    # Fewer sizes still reach --up-to-mib: 3 even steps from the first size to 40 MiB.
    assert main([*base, "--up-to-mib", "40"]) == 1
    assert seen["sizes"] == [2**20, 21 * 2**20, 40 * 2**20]
    assert pp.stretched_sizes("cpu", 40 * 2**20, 3) == seen["sizes"]
    assert main([*base, "--up-to-mib", "3"]) == 1 and seen["sizes"] == pp.DEFAULT_SIZES[:3]
    assert main([*base, "--up-to-mib", "4"]) == 1
    assert seen["sizes"] == [2**20, 3 * 2**20, 4 * 2**20]
    assert main(base) == 1 and seen["sizes"] == pp.DEFAULT_SIZES[:3]
    assert main([*base[:-1], "16", "--device", "cpu"]) == 1 and seen["sizes"] == pp.DEFAULT_SIZES
    with pytest.raises(SystemExit):
        main([*base, "--up-to-mib", "0"])
    # 16 is the most (the default sizes' count) and 2 the fewest (a fit): refused, not capped.
    for bad in ("1", "17", "20"):
        with pytest.raises(SystemExit) as exc:
            main([*base[:-1], bad])
        assert exc.value.code == 2
        assert (
            f"argument --sizes: must be an integer in [2, 16], got {bad!r}"
            in capsys.readouterr().err
        )
    with pytest.raises(ValueError, match=r"count must be in \[2, 16\]"):
        pp.stretched_sizes("cuda", 0, 17)
    for device in ("cpu", "cuda"):
        for count in range(2, 17):
            for mib in (1, 17, 40, 65, 1000):
                sizes = pp.stretched_sizes(device, mib * 2**20, count)
                assert len(sizes) == count and sizes == sorted(set(sizes))
                assert sizes[-1] >= mib * 2**20 and sizes[0] == pp.default_sizes(device)[0]


@needs_no_cuda
def test_cuda_mode_says_what_is_missing() -> None:
    problems = pp.cuda_problems()
    for call in (
        lambda: pp.profile(2, 1, device="cuda"),
        lambda: pp.measure_layers(2, 1, [], device="cuda"),
    ):
        with pytest.raises(RuntimeError, match="device='cuda' needs") as info:
            call()
        assert all(p in str(info.value) for p in problems)


@needs_no_cuda
def test_cli_profile_device(capsys: pytest.CaptureFixture) -> None:
    args = ["parm", "profile", "--world-size", "2", "--mp-size", "1", "--sizes", "2"]
    assert main([*args, "--device", "cuda"]) == 1
    assert "FAILED: device='cuda' needs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--device", "gpu"])
    assert exit_info.value.code == 2


def _per_rank(device: str, world: int = 4) -> list[dict[str, Any]]:
    """Profile outputs of ``world`` ranks, linear in the size with rank-dependent slack."""
    sizes = pp.default_sizes(device)[:6]
    comm = {}
    for kind, link, _ in pp._plan(world, 2):
        alpha, beta = (3e-5, 2e-12) if link == "intra" else (5e-5, 4e-12)
        comm[f"{kind}/{link}"] = [(n, alpha + beta * n) for n in sizes]
    gemm = [(2.0 * m * k * n, 1e-5 + 2e-15 * m * k * n) for m, k, n in pp.CUDA_GEMM_SIZES]
    return [
        {
            "comm": {
                key: [(n, t * (1 + 0.01 * r)) for n, t in samples] for key, samples in comm.items()
            },
            "gemm": gemm if r == 0 else [],
            "device_name": "NVIDIA H100 80GB HBM3" if device == "cuda" else "cpu-x86_64",
        }
        for r in range(world)
    ]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fit_rows(device: str) -> None:
    result = pp.fit_profile(_per_rank(device), 4, 2, 3, device)
    backend = "uniep-cuda" if device == "cuda" else "gloo"
    assert result["backend"] == backend and result["device"] == device
    assert set(result["coefficients"]) == {
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "all_to_all",
    }
    ag = result["coefficients"]["all_gather"]["intra"]
    # The slowest rank (rank 3, 3% slack) is what is fitted.
    assert ag["alpha"] == pytest.approx(3e-5 * 1.03) and ag["beta"] == pytest.approx(2e-12 * 1.03)
    assert ag["r2"] == pytest.approx(1.0)
    assert result["gemm"]["beta"] == pytest.approx(1e-15)
    rows = bench_parm.fit_rows(result, 4, 2)
    assert len(rows) == 5 and rows[-1]["collective"] == "gemm"
    for row in rows:
        assert row["kind"] == "fit" and row["backend"] == backend
        assert row["device"] == result["device_name"]
        assert math.isfinite(row["alpha_s"]) and math.isfinite(row["beta"]) and row["r2"] <= 1.0
        assert row["beta_unit"] == ("s/flop" if row["collective"] == "gemm" else "s/byte")
    model = pp.cost_model_from_profile(result)
    assert model.get("all_to_all", "inter").alpha == pytest.approx(5e-5 * 1.03)


LAYERS = [
    dict(tokens=2048, hidden=1024, ffn_hidden=2048, num_experts=8, top_k=1, capacity_factor=1.2),
    dict(tokens=8192, hidden=2048, ffn_hidden=4096, num_experts=8, top_k=2, capacity_factor=1.2),
]


def test_measure_rows_same_format_on_both_devices() -> None:
    times = [{"baseline": 3.0, "s1": 2.0, "s2": 2.5}, {"baseline": 1.0, "s1": 1.5, "s2": 1.2}]
    per_rank = [[{s: t * (1 + 0.1 * r) for s, t in lay.items()} for lay in times] for r in range(4)]
    model = parm.cost_model(4, 2, gpus_per_node=2)
    rows = {d: pp.measure_rows(LAYERS, per_rank, 4, 2, model, d) for d in ("cpu", "cuda")}
    assert [list(r) for r in rows["cpu"]] == [list(r) for r in rows["cuda"]]
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        for cfg, row in zip(LAYERS, rows[device], strict=True):
            p = parm.plan(4, 2, dtype=dtype, gpus_per_node=2, model=model, **cfg)
            assert row["chosen"] == p.schedule
            assert row["predicted"] == {s: v["total"] for s, v in p.predicted.items()}
            # The slowest rank's time (rank 3).
            assert row["measured"]["s1"] == pytest.approx(
                1.3 * per_rank[0][LAYERS.index(cfg)]["s1"]
            )
            best = min(row["measured"], key=row["measured"].get)
            assert row["measured_best"] == best and row["right"] == (row["chosen"] == best)
            want = row["measured"][row["chosen"]] / row["measured"][best] - 1
            assert row["regret"] == pytest.approx(want) and row["regret"] >= 0
            # What the layers ran with: on CUDA the model's SAA chunk counts (1 for the
            # baseline); the gloo executor never cuts a pair.
            plans = {sch: parm.saa_chunk_plan(p.shape, sch, model) for sch in parm.SCHEDULES}
            want = {sch: max(v) if device == "cuda" else 1 for sch, v in plans.items()}
            assert row["saa_chunks"] == want and row["saa_chunks"]["baseline"] == 1
    # A fixed count is what ran on the SAA pairs; the baseline has none.
    fixed = pp.measure_rows(LAYERS, per_rank, 4, 2, model, "cuda", 3)
    assert [r["saa_chunks"] for r in fixed] == [{"baseline": 1, "s1": 3, "s2": 3}] * 2
    summary = bench_parm.choice_row(rows["cuda"], "uniep-cuda", 4, 2)
    assert summary["kind"] == "choice" and summary["layers"] == 2 and summary["goal"] == 0.95
    assert summary["right"] == sum(r["right"] for r in rows["cuda"])
    assert summary["meets_goal"] == (summary["right_fraction"] >= 0.95)
    # Auto over the baseline, measured beside predicted (geomeans over the same layers).
    for key, kind, pick in (
        ("auto_speedup_measured", "measured", "chosen"),
        ("auto_speedup_predicted", "predicted", "chosen"),
        ("best_speedup_measured", "measured", "measured_best"),
    ):
        ratios = [r[kind]["baseline"] / r[kind][r[pick]] for r in rows["cuda"]]
        want = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        assert summary[key] == pytest.approx(want)
    assert summary["best_speedup_measured"] >= summary["auto_speedup_measured"]


def test_cuda_measured_layers() -> None:
    layers = bench_parm.CUDA_MEASURED_LAYERS
    assert len(layers) >= 8
    for cfg in layers:
        assert 2048 <= cfg["tokens"] <= 8192 and 1024 <= cfg["hidden"] <= 2048
        assert all(cfg["num_experts"] % g == 0 for g in (1, 2, 4, 8))
        parm.plan(4, 2, dtype=torch.bfloat16, gpus_per_node=2, **cfg)  # a valid shape


def _cuda_collectives_worker(rank: int, world: int, mp_size: int) -> list[tuple]:
    """The CUDA profile's calls (``_cuda_collective`` over ``CudaBackend``) on CPU tensors:
    (collective, size, output shapes, distinct output values) per call."""
    import torch.distributed as dist
    from uniep.parm import cuda as parm_cuda
    from uniep.parm.cpu import Groups

    mp, ep = parm.new_groups(mp_size)
    groups = Groups(mp, ep, mp_size, world // mp_size, dist.get_rank(mp), dist.get_rank(ep))
    backend = parm_cuda.CudaBackend(None, groups, block_bytes=1 << 16)
    out = []
    for kind, _, size in pp._plan(world, mp_size):
        for n in (1 << 12, 3 << 12):
            got = pp._cuda_collective(kind, n, backend, size, torch.device("cpu"))()
            got = got if isinstance(got, list) else [got]
            values = sorted({float(v) for t in got for v in t.float().unique()})
            dtypes = {t.dtype for t in got}
            out.append((kind, n, [tuple(t.shape) for t in got], values, dtypes))
    return out


def test_cuda_profile_calls_on_cpu_groups() -> None:
    """The sizes follow the cost model's convention (all-gather output, reduce-scatter input,
    all-reduce buffer, all-to-all per-rank send bytes; bf16) and the sums are the MP group's."""
    reports = run_ranks(4, _cuda_collectives_worker, 2)
    elems = {1 << 12: 2048, 3 << 12: 6144}  # bf16 elements of n bytes
    for per_rank in reports:
        assert [(k, n) for k, n, *_ in per_rank] == [
            (k, n)
            for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
            for n in (1 << 12, 3 << 12)
        ]
        for kind, n, shapes, values, dtypes in per_rank:
            e = elems[n]
            assert dtypes == {torch.bfloat16}
            want = {
                "all_gather": ([(e // 2,)] * 2, [1.0]),
                "reduce_scatter": ([(e // 2,)], [2.0]),
                "all_reduce": ([(e,)], [2.0]),
                "all_to_all": ([(2, e // 2)], [1.0]),
            }[kind]
            assert (shapes, values) == want, (kind, n)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_step_alpha_is_what_the_calibration_layer_took_beyond_its_price(device: str) -> None:
    base = pp.fit_profile(_per_rank(device), 4, 2, 3, device)
    model = pp.cost_model_from_profile(base)
    assert model.step_alpha == 0.0  # no calibration in the profile: nothing priced per step
    model.max_chunks = 1
    cuda = device == "cuda"
    shape = _C.parm.ParmShape(
        world_size=4,
        mp_size=2,
        gpus_per_node=2,
        num_experts=4,
        dtype_bytes=2 if cuda else 4,
        **pp.CALIBRATION_LAYER,
    )
    per_step = 3e-4
    measured = {}
    for schedule in parm.SCHEDULES:
        t = 0.0
        for pass_ in ("forward", "backward"):
            lst = _C.parm.build_steps(shape, schedule, pass_)
            t += _C.parm.price(lst, model).seconds + per_step * len(lst.steps)
        measured[schedule] = t
    per_rank = _per_rank(device)
    for r, out in enumerate(per_rank):  # rank 3 the slowest, as for the collectives
        out["calibration"] = {s: t * (1 if r == 3 else 0.9) for s, t in measured.items()}
    result = pp.fit_profile(per_rank, 4, 2, 3, device)
    fit = result["step_alpha"]
    assert fit["seconds"] == pytest.approx(per_step) and fit["measured"] == measured
    fitted = pp.cost_model_from_profile(result)
    assert fitted.step_alpha == pytest.approx(per_step)
    # Every step of a list is priced step_alpha more, an SAA pair as its two steps.
    lst = _C.parm.build_steps(shape, "s2", "forward")
    more = _C.parm.price(lst, fitted).seconds - _C.parm.price(lst, model).seconds
    assert more == pytest.approx(per_step * len(lst.steps), rel=1e-9)
    # Nothing left beyond the price: 0, never negative.
    assert pp.fit_step_alpha(base, {s: 0.0 for s in parm.SCHEDULES})["seconds"] == 0.0
