"""The two-level path's simulator (uniep.moe.multinode_sim): its fit, its expected counts against
sampled routing, and the byte identities its predictions rest on."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from uniep.moe import multinode_sim as sim

ROOT = Path(__file__).resolve().parents[2]


def test_fit_leg_recovers_a_line_and_refuses_too_few_points() -> None:
    leg = sim.fit_leg([(1e6, 10.0 + 1e6 / 200e3), (5e7, 10.0 + 5e7 / 200e3), (2e8, 1010.0)])
    assert leg.alpha_us == pytest.approx(10.0, abs=1e-6)
    assert leg.gbs == pytest.approx(200.0)
    assert leg.time_us(2e5) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="two points"):
        sim.fit_leg([(1e6, 5.0), (1e6, 6.0)])
    with pytest.raises(ValueError, match="do not grow"):
        sim.fit_leg([(1e6, 50.0), (1e7, 5.0)])


def test_nvlink_leg_is_the_fit_of_the_committed_dispatch_run() -> None:
    rows = json.loads((ROOT / "bench/results/bench_dispatch/bench_dispatch.json").read_text())
    env = rows["env"]
    assert env["commit"] == "9b4addf" and env["gpu_count"] == 4
    normal = next(r for r in rows["rows"] if r["shape"] == "dsv3" and r["num_sms"] == 24)
    ll = next(r for r in rows["rows"] if r["shape"] == "ll")
    points = [
        (float(normal["recv_bytes"]), normal["dispatch_us"]),
        (float(ll["recv_bytes"]), ll["ll_dispatch_us_max"]),
    ]
    fitted = sim.fit_leg(points)
    assert fitted.alpha_us == pytest.approx(sim.NVLINK_H200.alpha_us, rel=1e-4)
    assert fitted.gbs == pytest.approx(sim.NVLINK_H200.gbs, rel=1e-4)


def _sampled(layer: sim.Layer, draws: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    per_node = layer.experts // layer.nodes
    per_rank = layer.experts // layer.world
    nodes = ranks = 0
    for _ in range(draws):
        span = layer.nodes if layer.node_limit is None else min(layer.node_limit, layer.nodes)
        chosen = rng.sample(range(layer.nodes), span)
        pool = [n * per_node + e for n in chosen for e in range(per_node)]
        experts = rng.sample(pool, layer.top_k)
        nodes += len({e // per_node for e in experts})
        ranks += len({e // per_rank for e in experts})
    return nodes / draws, ranks / draws


@pytest.mark.parametrize(
    "layer",
    [
        sim.Layer(world=32, experts=64, top_k=6, node_limit=None),
        sim.Layer(world=64, experts=256, top_k=8, node_limit=4),
        sim.Layer(world=16, gpus_per_node=4, experts=32, top_k=3, node_limit=2),
    ],
    ids=["any-node", "dsv3-4-nodes", "small"],
)
def test_expected_counts_match_sampled_routing(layer: sim.Layer) -> None:
    nodes, ranks = _sampled(layer, 20000, seed=layer.world)
    assert sim.expected_nodes(layer) == pytest.approx(nodes, rel=0.02)
    assert sim.expected_ranks(layer) == pytest.approx(ranks, rel=0.02)


def test_predictions_follow_the_bytes() -> None:
    one_node = sim.simulate(sim.Layer(world=8))
    assert one_node["dispatch_rail_bytes"] == 0 and one_node["combine_per_k_rail_bytes"] == 0
    for world in (16, 64, 256):
        r = sim.simulate(sim.Layer(world=world))
        # One row per (token, remote node) against one per (token, remote rank) or (token, k).
        assert r["dispatch_rail_bytes"] < r["flat_dispatch_rail_bytes"]
        assert r["combine_node_partials_rail_bytes"] < r["combine_per_k_rail_bytes"]
        assert r["dispatch_us"] < r["flat_dispatch_us"]
        assert r["combine_node_partials_us"] < r["combine_per_k_us"]
        assert 0 < r["exposed_node_partials_share"] <= r["exposed_per_k_share"] < 1
        assert 1 <= r["nodes_per_token"] <= min(4, world // 8)
        assert r["nodes_per_token"] <= r["ranks_per_token"] <= 8
    # The rail at most at its rate; all of it when the network is the slow leg.
    assert r["dispatch_rail_gbs"] <= sim.NETWORK_50GBS.gbs
    assert math.isclose(
        sim.simulate(sim.Layer(world=16, top_k=1, node_limit=None))["nodes_per_token"], 1.0
    )


def test_bad_layers_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        sim.simulate(sim.Layer(world=12))
    with pytest.raises(ValueError, match="experts"):
        sim.simulate(sim.Layer(world=16, experts=100))
    with pytest.raises(ValueError, match="node_limit"):
        sim.simulate(sim.Layer(world=16, node_limit=0))


def test_cli_prints_both_tables_beside_deepep(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    run = subprocess.run(
        [sys.executable, "-m", "uniep.cli", "multinode", "simulate", "--worlds", "16", "64",
         "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "| 16 |" in run.stdout and "(118)" in run.stdout and "(43)" in run.stdout
    saved = json.loads(out.read_text())
    assert [r["world"] for r in saved["rows"]] == [16, 64]
    assert saved["network"]["gbs"] == 50.0


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--network-gbs", "0"], "argument --network-gbs: must be a finite number > 0, got '0'"),
        (["--network-gbs", "-5"], "argument --network-gbs: must be a finite number > 0, got '-5'"),
        (["--network-gbs", "inf"], "argument --network-gbs: must be a finite number > 0"),
        (
            ["--network-alpha-us", "nan"],
            "argument --network-alpha-us: must be a finite number >= 0, got 'nan'",
        ),
        (["--network-alpha-us", "-1"], "argument --network-alpha-us: must be a finite number >= 0"),
        (["--gpus-per-node", "0"], "argument --gpus-per-node: must be an integer >= 1, got '0'"),
        (
            ["--worlds", "16", "12"],
            "argument --worlds: 12: not a multiple of --gpus-per-node (8); 12: does not divide "
            "the layer's 256 experts",
        ),
        (["--worlds", "1024"], "argument --worlds: 1024: does not divide the layer's 256 experts"),
        (
            ["--worlds", "16", "--gpus-per-node", "32"],
            "argument --worlds: 16: not a multiple of --gpus-per-node (32)",
        ),
    ],
)
def test_cli_refuses_bad_options_naming_them(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from uniep.cli import main

    out = tmp_path / "sim.json"
    with pytest.raises(SystemExit) as exc:
        main(["multinode", "simulate", *argv, "--out", str(out)])
    assert exc.value.code == 2  # a usage error, as argparse's
    err = capsys.readouterr().err
    assert f"uniep multinode simulate: error: {words}" in err, err
    assert "Traceback" not in err and not out.exists()


def test_legs_refuse_a_bandwidth_that_cannot_divide() -> None:
    for gbs in (0.0, -5.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="gbs must be a finite number > 0"):
            sim.Leg(alpha_us=5.0, gbs=gbs)
    with pytest.raises(ValueError, match="alpha_us must be finite"):
        sim.Leg(alpha_us=math.nan, gbs=50.0)
