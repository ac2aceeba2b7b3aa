"""bench_decode's CPU-side parts: the plot of a result, the headline of the committed one."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench" / d) for d in ("", "harness")]
import bench_decode as bd  # noqa: E402
import headlines  # noqa: E402

RESULT = ROOT / "bench" / "results" / "bench_decode" / "bench_decode.json"


def test_the_plot_has_a_panel_per_load_with_the_goal(tmp_path: Path) -> None:
    copy = tmp_path / "bench_decode.json"
    shutil.copy(RESULT, copy)
    svg = bd.plot_decode(copy).read_text()
    for load, *_ in bd.LOADS:
        assert f"{load}:" in svg
    assert "goal" in svg and "CUDA graph, fused layer" in svg


def test_a_failed_path_leaves_a_gap(tmp_path: Path) -> None:
    payload = json.loads(RESULT.read_text())
    for row in payload["rows"]:
        row["graph[local 64x256]"] = "RuntimeError: capture failed"  # not a number
        row.pop("ms[prepared]", None)
    path = tmp_path / "bench_decode.json"
    path.write_text(json.dumps(payload))
    assert bd.plot_decode(path).is_file()


def test_the_committed_result_fits_its_headline() -> None:
    payload = json.loads(RESULT.read_text())
    lines = headlines.headline(payload)
    assert any("CUDA graph of the fused layer" in line for line in lines)


def test_bad_token_counts_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "1,x", ","):
        with pytest.raises(SystemExit) as exc:
            bd.main(["--tokens", bad])
        assert exc.value.code == 2
    assert "--tokens" in capsys.readouterr().err
