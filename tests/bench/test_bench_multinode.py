"""bench/bench_multinode.py: its layouts are checked, and its CPU run writes a row that the
headline spec reads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "harness"))

import bench_multinode  # noqa: E402
import headlines  # noqa: E402


@pytest.mark.parametrize("text", ["4", "4x3", "4x4", "1x1", "ax2"])
def test_bad_layouts_are_named(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="layout"):
        bench_multinode._layout(text)


def test_cpu_run_writes_a_row_the_headline_reads(tmp_path: Path) -> None:
    argv = ["--quick", "--tokens", "8", "--hidden", "64", "--ffn", "32"]
    argv += ["--experts-per-rank", "2", "--top-k", "2", "--out-dir", str(tmp_path)]
    assert bench_multinode.main(argv) == 0
    payload = json.loads((tmp_path / "bench_multinode" / "bench_multinode.json").read_text())
    (row,) = payload["rows"]
    assert row["layout"] == "4x2" and row["nodes"] == 2 and row["rail"] == "gloo"
    assert row["check"]["pass"] and row["rail_bytes"] > 0
    assert set(row["ms"]) == {"flat", "two_level", "rail"}
    assert any("two levels" in line for line in headlines.headline(payload))
