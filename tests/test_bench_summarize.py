"""bench/summarize.py: one readable table per benchmark, no JSON in a cell."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import summarize  # noqa: E402


def test_table_spreads_dicts_leaves_detail_in_the_json_and_notes_long_strings() -> None:
    note = "the separate launches on CPU, the MegaKernel on a Hopper GPU with bf16 weights"
    payload = {
        "name": "bench_x",
        "env": {"device": "cpu-x86_64", "torch": "2.13", "commit": "abc1234", "date": "d"},
        "rows": [
            {
                "tp": 2,
                "kind": "a",
                "ms": {"ours": 0.25, "nccl": 0.5},
                "ratio_to_baseline": 0.5,
                "goal_met": True,
                "per_rank": [{"ours": {"median": 0.25}}],
                "note": note,
            },
            {"tp": 2, "kind": "b", "ms": {"ours": 2.0, "nccl": 1.0}, "goal_met": False},
        ],
    }
    lines = summarize.table(payload)
    text = "\n".join(lines)
    assert "{" not in text.split("\n", 1)[1] and "[{" not in text  # no JSON under the title
    assert "all rows: tp 2" in text
    header = next(line for line in lines if line.startswith("| kind"))
    assert header == "| kind | ms.ours | ms.nccl | ratio_to_baseline | goal_met | note |"
    assert "| a | 0.25 | 0.5 | 0.5 | yes | [1] |" in lines
    assert "| b | 2 | 1 |  | no |  |" in lines
    assert f"[1] {note}" in lines
    assert lines[-1] == "in the JSON only (per rank, per round or nested): per_rank"


def test_table_of_no_rows() -> None:
    assert summarize.table({"name": "n", "env": {}, "rows": []})[-1] == "(no rows)"


def test_one_row_reads_as_named_values() -> None:
    payload = {"name": "n", "env": {}, "rows": [{"ms": {"ours": 1.5, "peer": 3.0}, "met": True}]}
    lines = summarize.table(payload)
    assert lines[2:] == [
        "| field | value |",
        "|---|---|",
        "| ms.ours | 1.5 |",
        "| ms.peer | 3 |",
        "| met | yes |",
    ]
