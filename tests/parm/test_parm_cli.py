"""`uniep parm simulate` and `uniep parm profile`, and the simulator's grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from uniep import _C, parm
from uniep.cli import main
from uniep.parm import sim as parm_sim
from uniep.parm.profile import cost_model_from_profile


def test_grid_has_1296_layers() -> None:
    configs = parm_sim.grid_configs()
    assert len(configs) == 1296
    assert len({tuple(c.values()) for c in configs}) == 1296


def test_simulate_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sim.json"
    assert main(["parm", "simulate", "--cluster", "a6000-ib", "--inter-bw", "2.5",
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "1296 layers on 32 GPUs" in text and "auto geomean" in text
    data = json.loads(out.read_text())
    assert data["cluster"]["inter_bw"] == 2.5e9
    assert len(data["rows"]) == 1296 and data["summary"]["all"]["layers"] == 1296
    row = data["rows"][0]
    assert row["choice"] in ("baseline", "s1", "s2")
    assert row["speedup"] == pytest.approx(
        row["seconds"]["baseline"] / row["seconds"][row["choice"]]
    )
    # The speedup Parm's schedules must show on the described clusters: auto >= 1.5x over the
    # baseline (geomean).
    assert data["summary"]["all"]["auto_geomean"] >= 1.5


def test_simulate_says_which_layers_it_leaves_out(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # 12 GPUs: no layout has an MP group of 8, so the grid's N = 8 layers are left out, by name.
    out = tmp_path / "sim.json"
    argv = ["parm", "simulate", "--gpus-per-node", "6", "--nodes", "2", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "864 layers on 12 GPUs" in text
    assert "left out of the grid: MP size 8 (432 layers): the MP size must divide the 12 GPUs" in (
        text
    )
    assert json.loads(out.read_text())["left_out"] == {"mp_size": {"8": 432}}
    assert parm_sim.left_out("a6000-ib") == {}  # 32 GPUs: the whole grid


@pytest.mark.parametrize(
    ("argv", "gpus", "layers", "left"),
    [
        # One node of 8: at N = 8 one MP group holds 1 or 2 experts; 1 expert cannot take top-2.
        (["--nodes", "1"], 8, 1188, {"top_k": {"8": 108}}),
        (
            ["--cluster", "2080ti-ib", "--nodes", "1"],
            4,
            756,
            {"mp_size": {"8": 432}, "top_k": {"4": 108}},
        ),
    ],
)
def test_simulate_leaves_out_layers_with_fewer_experts_than_top_k(
    argv: list[str],
    gpus: int,
    layers: int,
    left: dict,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    out = tmp_path / "sim.json"
    assert main(["parm", "simulate", *argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{layers} layers on {gpus} GPUs" in text
    n = next(iter(left["top_k"]))
    assert (
        f"left out of the grid: MP size {n} ({left['top_k'][n]} layers): fewer experts than "
        "top-k (experts per MP group x 1 MP group(s))"
    ) in text
    data = json.loads(out.read_text())
    assert data["left_out"] == left and len(data["rows"]) == layers
    assert all(r["experts_per_group"] * gpus // r["mp_size"] >= r["top_k"] for r in data["rows"])


def test_simulate_refuses_a_cluster_no_layer_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "sim.json"
    argv = ["parm", "simulate", "--gpus-per-node", "1", "--nodes", "1", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no layer of the grid fits 1 GPU(s) (1 node(s) x 1), nothing written" in err
    assert "MP size 2 (432 layers): the MP size must divide the 1 GPUs" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--intra-bw", "0", "must be a finite number > 0, got '0'"),
        ("--inter-bw", "-5", "must be a finite number > 0, got '-5'"),
        ("--inter-bw", "inf", "must be a finite number > 0, got 'inf'"),
        ("--peak-tflops", "0", "must be a finite number > 0, got '0'"),
        ("--intra-alpha", "-1", "must be a finite number >= 0, got '-1'"),
        ("--inter-alpha", "nan", "must be a finite number >= 0, got 'nan'"),
        ("--profile", "/nonexistent/prof.json", "cannot read '/nonexistent/prof.json'"),
    ],
)
def test_simulate_rejects_bad_numbers(
    option: str, value: str, words: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["parm", "simulate", option, value, "--out", "/nonexistent/sim.json"])
    assert exc.value.code == 2  # argparse's usage error
    assert f"argument {option}: {words}" in capsys.readouterr().err


def test_simulate_rejects_a_profile_that_is_not_one(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    for name, text in (("garbage.json", "{not json"), ("other.json", '{"rows": []}')):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(SystemExit) as exc:
            main(["parm", "simulate", "--profile", str(path), "--out", str(tmp_path / "s.json")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --profile: " in err and str(path) in err, err
    assert not (tmp_path / "s.json").exists()


def test_auto_never_predicted_slower_than_baseline() -> None:
    rows = parm_sim.simulate("h100-ib")
    assert all(r["speedup"] >= 1.0 for r in rows)
    assert parm_sim.summarize(rows)["all"]["auto_geomean"] >= 1.5


def test_profile_fits_and_feeds_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "prof.json"
    args = ["parm", "profile", "--world-size", "4", "--mp-size", "2", "--sizes", "4"]
    assert main([*args, "--iters", "2", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert set(prof["coefficients"]) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    assert set(prof["coefficients"]["all_to_all"]) == {"inter"}
    for links in prof["coefficients"].values():
        for c in links.values():
            assert len(c["samples"]) == 4 and c["r2"] <= 1.0
    model = cost_model_from_profile(prof)
    assert (
        model.get("all_gather", "intra").beta == prof["coefficients"]["all_gather"]["intra"]["beta"]
    )
    # The calibration layer ran every schedule; what it took beyond its price, per step.
    assert set(prof["step_alpha"]["measured"]) == set(parm.SCHEDULES)
    assert prof["step_alpha"]["seconds"] >= 0.0
    assert model.step_alpha == prof["step_alpha"]["seconds"]
    # Any fit prices a plan (CPU loopback coefficients say little about a real cluster).
    plan = parm.plan(4, 2, 1024, 256, 512, 4, 2, gpus_per_node=2, model=model)
    assert plan.schedule in parm.SCHEDULES
    assert main(["parm", "simulate", "--profile", str(out), "--out", str(tmp_path / "s.json")]) == 0


def test_profile_rejects_a_layout_without_ep(capsys: pytest.CaptureFixture) -> None:
    assert main(["parm", "profile", "--world-size", "4", "--mp-size", "4"]) == 2
    assert "must divide" in capsys.readouterr().err


def _profile_file(tmp_path: Path, coefficients: dict, **rest: object) -> Path:
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"coefficients": coefficients, **rest}))
    return path


def test_simulate_profile_keeps_the_cluster_for_what_it_did_not_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A profile at MP size 1 measures the EP all-to-all alone: the MP collectives, the intra
    # links and mem_beta it lacks stay the cluster's, not zero.
    base = ["parm", "simulate", "--cluster", "a6000-ib"]
    assert main([*base, "--out", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())["rows"]
    empty = _profile_file(tmp_path, {})
    assert main([*base, "--profile", str(empty), "--out", str(tmp_path / "empty.json")]) == 0
    assert json.loads((tmp_path / "empty.json").read_text())["rows"] == plain
    capsys.readouterr()

    a2a = {"alpha": 3e-5, "beta": 5e-10, "r2": 1.0, "samples": []}
    prof = _profile_file(tmp_path, {"all_to_all": {"inter": a2a}})
    out = tmp_path / "a2a.json"
    assert main([*base, "--profile", str(prof), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"from the profile {prof}: all_to_all/inter; from the cluster (a6000-ib and the " in text
    assert "all_gather/intra, all_gather/inter," in text and "all_to_all/intra, gemm, " in text
    data = json.loads(out.read_text())
    assert data["from_profile"] == ["all_to_all/inter"]
    cluster = parm.cluster_spec("a6000-ib")
    for row, before in zip(data["rows"], plain, strict=True):
        model = parm.cost_model(32, row["mp_size"], cluster)
        model.set("all_to_all", "inter", _C.parm.AlphaBeta(a2a["alpha"], a2a["beta"]))
        rows = parm_sim.simulate(
            "a6000-ib", model=model, grid={k: (row[k],) for k in parm_sim.GRID}
        )
        assert row["seconds"] == rows[0]["seconds"]
        assert row["seconds"]["s1"] > before["seconds"]["s1"]  # the slower all-to-all priced
    with pytest.raises(ValueError, match="model or profile, not both"):
        parm_sim.simulate("a6000-ib", model=model, profile={"coefficients": {}})
