"""bench/bench_overlap.py and bench/harness/plot_svg.py without a GPU: the pure helpers and the
plot."""

from __future__ import annotations

import argparse
import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench" / d) for d in ("", "harness")]
import bench_overlap as bo  # noqa: E402
import plot_svg  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"


def test_shapes() -> None:
    anchors = bo.build_shapes("anchors")
    assert [(s.m, s.k, s.n) for s in anchors] == [
        (8192, 8192, 7168),
        (4096, 8192, 2048),
        (16384, 4096, 3584),
    ]
    full = bo.build_shapes("all")
    assert full[:3] == anchors
    assert [(s.m, s.k, s.n) for s in full[3:]] == [(2048, 8192, 7168), (32768, 8192, 7168)]
    assert {s.name for s in anchors} == set(bo.ANCHORS_TP4)
    quick = bo.build_shapes("quick")
    assert len({(s.k, s.n) for s in quick}) == 1 and len({s.m for s in quick}) == len(quick)
    with pytest.raises(ValueError, match="all, anchors or quick"):
        bo.build_shapes("huge")


def test_tp_and_chunks() -> None:
    assert bo.parse_tp("4,2,4") == [2, 4]
    with pytest.raises(Exception, match="integers"):
        bo.parse_tp("two")
    assert bo.valid_chunks(2048) == [1, 2, 4]
    assert bo.valid_chunks(6) == [1, 2]
    assert bo.valid_chunks(3) == [1]


def test_gemm_choices() -> None:
    want = [("cublas", 0), ("cutlass", 0), ("cutlass", 8)]
    assert bo.parse_gemms("cublas,cutlass,cutlass@8") == want
    for bad in ("auto", "cutlass@x", "cublas,cublas", "cutlass@-1"):
        with pytest.raises(Exception, match="expected"):
            bo.parse_gemms(bad)
    assert bo.ours_prefix() == "ours_c"
    assert bo.ours_prefix(("cublas", 0)) == "ours_c"
    assert bo.ours_prefix(("cutlass", 0)) == "ours_cutlass_c"
    assert bo.ours_prefix(("cutlass", 8)) == "ours_cutlass_sm8_c"
    assert bo.ours_prefix(("cublas", 4)) == "ours_cublas_sm4_c"
    assert bo.parse_gemms("gated,gated@2") == [("gated", 0), ("gated", 2)]
    assert bo.ours_prefix(("gated", 0)) == "ours_gated_c"
    assert ("gated", 0) in bo.GPU_GEMMS  # the next GPU run times the one-GEMM overlap
    assert bo.GEMM_BACKENDS == pytest.importorskip("uniep.collectives").GEMM_BACKENDS


def test_max_block_bytes() -> None:
    shapes = bo.build_shapes("all")
    # TP=2: the AG block of M=32768 (16384 x 8192 bf16) is 256 MiB; the 1 GiB bucket's half wins.
    assert bo.max_block_bytes(shapes, 2) == 16384 * 8192 * 2
    assert bo.max_block_bytes(shapes, 2, 1 << 30) == 1 << 29
    assert bo.max_block_bytes(shapes, 4, 1 << 30) == 1 << 28
    # RS block (M/W x N) wins when N > K.
    assert bo.max_block_bytes([bo.Shape(1024, 128, 512)], 4) == 256 * 512 * 2


def test_stats_and_ratios() -> None:
    st = bo.time_stats([float(i) for i in range(1, 12)])
    assert st["median"] == 6.0 and st["p10"] == 2.0 and st["p90"] == 10.0
    assert bo.time_stats([3.0]) == {"median": 3.0, "p10": 3.0, "p90": 3.0}
    per_rank = [
        {"a": {"median": 1.0}, "b": {"median": 5.0}},
        {"a": {"median": 2.0}, "b": None},
    ]
    assert bo.slowest_medians([{k: v for k, v in r.items() if v} for r in per_rank]) == {"a": 2.0}
    assert bo.best_ours({"ours_c1": 2.0, "ours_c4": 1.5, "nccl_mm": 1.0}) == (4, 1.5)
    assert bo.best_ours({"nccl_mm": 1.0}) == (None, None)
    # Other GEMM choices' variants share the "ours_c" start but are not chunk counts of it.
    ms = {"ours_c2": 2.0, "ours_cutlass_c2": 1.0, "ours_cutlass_sm8_c4": 0.5}
    assert bo.best_ours(ms) == (2, 2.0)
    assert bo.best_ours(ms, "ours_cutlass_c") == (2, 1.0)
    assert bo.best_ours(ms, bo.ours_prefix(("cutlass", 8))) == (4, 0.5)

    g = bo.goals(1.25, mm=1.21, coll=0.41, base=1.60, check_ok=True)
    assert g["ratio_to_ideal"] == pytest.approx(1.25 / 1.21)
    assert g["ratio_to_baseline"] == pytest.approx(1.25 / 1.60)
    assert g["goal_ideal_met"] and g["goal_baseline_met"] and g["goal_met"]
    assert not bo.goals(1.25, 1.21, 0.41, 1.60, check_ok=False)["goal_met"]
    slow = bo.goals(1.30, 1.21, 0.41, 1.28, True)
    assert not slow["goal_ideal_met"] and not slow["goal_baseline_met"] and not slow["goal_met"]
    none = bo.goals(None, 1.0, 1.0, 1.0, True)
    assert none["ratio_to_ideal"] is None and not none["goal_met"]


def test_rel_err_and_json() -> None:
    import torch

    ref = torch.ones(4, 4)
    assert bo.rel_norm_err(ref.bfloat16(), ref) == 0.0
    assert bo.rel_norm_err(ref[:2], ref) == math.inf
    out = bo.finite_json({"a": [math.inf, 1.0], "b": {"c": math.nan}})
    assert json.dumps(out, allow_nan=False) == '{"a": [null, 1.0], "b": {"c": null}}'


def _fake_payload() -> dict:
    results = []
    for tp in (2, 4):
        for kind in bo.KINDS:
            for m in (2048, 8192, 32768):
                t = m / 8192
                ms = {
                    "nccl_mm": 1.6 * t,
                    "mm_alone": 1.2 * t,
                    "coll_alone": 0.4 * t,
                    "ours_best": 1.3 * t,
                }
                if m != 2048:  # a failed variant leaves a gap
                    ms["torch_fused"] = 1.7 * t
                results.append({"tp": tp, "kind": kind, "M": m, "K": 8192, "N": 7168, "ms": ms})
            results.append({"tp": tp, "kind": kind, "M": 4096, "K": 8192, "N": 2048, "ms": {}})
    return {"env": {"device": "test <&>", "commit": "abc"}, "results": results}


def test_plot_svg_is_well_formed(tmp_path: Path) -> None:
    panels, subtitle = plot_svg.overlap_panels(_fake_payload())
    assert [p.title for p in panels] == [
        "TP=2, AG + GEMM",
        "TP=2, GEMM + RS",
        "TP=4, AG + GEMM",
        "TP=4, GEMM + RS",
    ]
    assert subtitle == "bf16, K=8192, N=7168 per rank"
    assert list(panels[0].series[0].xs) == [2048, 8192, 32768]

    path = tmp_path / "overlap.svg"
    assert plot_svg.write_plot(_fake_payload(), path, prefer_matplotlib=False) == "svg"
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "TP=4, GEMM + RS" in texts and "ours (best chunks)" in texts
    assert any("<&>" in t for t in texts)  # escaped in the file, intact once parsed
    # ours, NCCL + mm, mm alone, collective alone: one line each; torch fused: 2 points only.
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 4 * 5
    assert sum(1 for p in lines if p.get("stroke-dasharray")) == 4


def test_render_svg_empty_and_ticks() -> None:
    root = ET.fromstring(plot_svg.render_svg([plot_svg.Panel("empty", [])]))
    assert any(t.text == "no data" for t in root.iter(f"{SVG}text"))
    assert plot_svg.nice_ticks(1.7) == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert plot_svg.nice_ticks(0.0) == [0.0, 1.0]


def test_help_without_cuda() -> None:
    with pytest.raises(SystemExit) as exc:
        bo.main(["--help"])
    assert exc.value.code == 0


def test_result_and_plot_paths(tmp_path: Path) -> None:
    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(
            **{"out": None, "out_dir": None, "plot": None, "no_plot": False, **kw}
        )

    default = bo.out_path(args())
    assert default == Path(bo.__file__).parent / "results" / "bench_overlap" / "bench_overlap.json"
    assert bo.plot_path(args()) == default.with_suffix(".svg")
    assert plot_svg.OVERLAP_RESULT == default  # plot_svg.py's default input
    mine = bo.out_path(args(out_dir=str(tmp_path)))
    assert mine == tmp_path / "bench_overlap" / "bench_overlap.json"
    assert bo.out_path(args(out=str(tmp_path / "o.json"))) == tmp_path / "o.json"
    assert bo.plot_path(args(out=str(tmp_path / "o.json"))) == tmp_path / "o.svg"
    assert bo.plot_path(args(plot="p.svg")) == Path("p.svg")
    assert bo.plot_path(args(no_plot=True)) is None
    # A run replaces the last one's JSON and drops its plot (the new one is drawn after).
    mine.parent.mkdir(parents=True)
    mine.with_suffix(".svg").write_text("<svg/>")
    payload = {"env": {}, "results": [{"tp": 2, "ms": {}}], "dp": [], "x": math.inf}
    assert bo._write(payload, args(out_dir=str(tmp_path))) == mine
    assert json.loads(mine.read_text())["x"] is None
    assert sorted(p.name for p in mine.parent.iterdir()) == ["bench_overlap.json"]
    # A run on too few GPUs, which measured nothing, leaves that result in place.
    skipped = {"env": {}, "results": [{"tp": 4, "skipped": "needs 4 GPUs"}], "dp": []}
    assert bo._write(skipped, args(out_dir=str(tmp_path))) == mine
    assert json.loads(mine.read_text())["results"] == payload["results"]
