"""bench/harness/summarize.py: one readable table per benchmark, no JSON in a cell; the headline
tables of bench/harness/headlines.py (ours, the peer's, their ratio, the goal, met) and the generic
fallback."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench" / d) for d in ("", "harness")]

import headlines  # noqa: E402
import summarize  # noqa: E402
from headlines import Figure, Goal, Pair, Spec  # noqa: E402


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


# ---- the headline tables (bench/harness/headlines.py) ----


def _committed(name: str) -> dict:
    return json.loads((summarize.DEFAULT_DIR / name / f"{name}.json").read_text())


RESULTS = [
    p for p in summarize.result_files(summarize.DEFAULT_DIR) if "rows" in json.loads(p.read_text())
]


def _table_rows(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """The header and the body cells of the one Markdown table in ``lines``."""
    table = [line for line in lines if line.startswith("| ")]
    assert table, "\n".join(lines)
    split = [[c.strip() for c in line.strip("|").split(" | ")] for line in table]
    return split[0], split[1:]


def test_the_committed_results_are_all_there() -> None:
    names = {p.stem for p in RESULTS}
    assert names == set(headlines.SPECS), "a benchmark without a headline spec, or a spec too many"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_every_committed_result_has_a_headline_table(path: Path) -> None:
    payload = json.loads(path.read_text())
    spec = headlines.SPECS[payload["name"]]
    lines = headlines.headline(payload)  # raises SpecMismatch where the spec does not fit
    assert summarize.render(payload) == lines
    header, body = _table_rows(lines)
    assert body
    assert header[-2:] == ["goal", "met"]
    assert any(name.startswith("ours") for name in header)
    if any(f.peer for f in spec.figures) and "no peer in these rows" not in lines:
        # ours, the peer's, then the ratio, named for how it reads
        ratio = header.index("goal") - 1
        assert header[ratio].endswith(" time" if spec.ratio == "time" else " speedup")
        assert header[ratio].startswith("ours/" if spec.ratio == "time" else "")
        assert header[ratio - 2].startswith("ours")
    for cells in body:
        assert len(cells) == len(header)
        assert cells[-1] in ("yes", "no", "-", "no (check failed)")
        for cell in cells:
            # No JSON in a cell: a dict, a list, a per-rank or per-round record.
            assert "{" not in cell and "}" not in cell and not cell.startswith("["), cell
            assert not any(t in cell for t in ("': ", '": ', "['", "[{", "None", "nan")), cell


@pytest.mark.parametrize(
    ("name", "verdict"),
    [("bench_overlap", "goal_met"), ("bench_ulysses_ag", "goal_met"), ("bench_parm", "meets_goal")],
)
def test_met_agrees_with_the_verdicts_the_benchmarks_record(name: str, verdict: str) -> None:
    payload = _committed(name)
    header, body = _table_rows(headlines.headline(payload))
    recorded = [r[verdict] for r in payload["rows"] if verdict in r]
    assert [c[-1] for c in body].count("yes") == sum(recorded)
    assert sum(c[-1] != "-" for c in body) == len(recorded)


def test_the_headline_reproduces_results_md() -> None:
    """The ratios bench/RESULTS.md quotes for bench_dispatch (EP4, 24 SMs, DeepSeek-V3 shape)."""
    payload = _committed("bench_dispatch")
    header, body = _table_rows(headlines.headline(payload))
    ratio = header.index("ours/NCCL time")
    got = {(c[0], c[1]): c for c in body}
    assert got[("dsv3", "bf16 dispatch")][ratio] == "1.294"
    assert got[("dsv3", "bf16 dispatch")][-2:] == [">= 300 GB/s (323.5)", "yes"]
    assert got[("dsv3", "combine rank_partials")][ratio] == "0.647"
    assert got[("ll", "low-latency dispatch + combine")][-2:] == ["<= 75 us", "no"]


def test_a_missing_field_falls_back_to_the_generic_table_and_says_which() -> None:
    payload = _committed("bench_dispatch")
    del payload["rows"][3]["dispatch_us_max"]
    lines = summarize.render(payload)
    assert lines[:-2] == summarize.table(payload)
    assert "row 4 (shape ll, SMs 24, W 4) has no field 'dispatch_us_max'" in lines[-1]

    payload = _committed("bench_moe_ep")
    payload["rows"][0]["ms"]["fwd_baseline"] = {"median": 1.0}
    assert (
        "'ms.fwd_baseline' of row 1 (shape dsv3-like, W 2) is dict" in summarize.render(payload)[-1]
    )

    payload = _committed("bench_overlap")
    del payload["config"]["goal_ideal"]
    assert "has no goal field '@config.goal_ideal'" in summarize.render(payload)[-1]

    payload = _committed("bench_moe")
    payload["rows"] = [r for r in payload["rows"] if not r["impl"].startswith("baseline")]
    assert "no peer row (impl 'baseline*') of the same case" in summarize.render(payload)[-1]


def test_an_unknown_benchmark_gets_the_generic_table() -> None:
    payload = {"name": "bench_new", "env": {}, "rows": [{"a": 1, "ms": 2.0}, {"a": 2, "ms": 3.0}]}
    lines = summarize.render(payload)
    assert lines[:-2] == summarize.table(payload)
    assert lines[-1] == "(no headline spec for bench_new in bench/harness/headlines.py)"


def test_an_odd_result_never_crashes_the_summary() -> None:
    payload = _committed("bench_gemm")
    payload["rows"][0] = copy.deepcopy(payload["rows"][0]) | {"M": {"odd": [1]}}
    payload["rows"].append("not a row")
    lines = summarize.render(payload)
    assert lines[0].startswith("### bench_gemm:")
    assert lines[6].startswith("| - | 8192 | 7168 |")  # a dict is no case name

    payload["rows"][1]["cublas_ms"] = "fast"
    lines = summarize.render(payload)
    assert "'cublas_ms' of row 2 (M 2048, K 8192, N 7168) is str 'fast', not a number" in lines[-1]
    payload["name"] = "bench_new"
    assert summarize.render(payload)[-1].startswith("(no headline spec for bench_new")


SYNTH = Spec(
    title="synthetic",
    case=headlines._case("n"),
    figures=(
        Figure(
            "time",
            "ms.ours",
            "ms",
            "ms.peer",
            "NCCL",
            where={"kind": "t"},
            check="ok",
            goals=(Goal("<=", "goal_ratio", "ratio"), Goal("<=", 5.0)),
        ),
        Figure(
            "bandwidth",
            "gbps",
            "GB/s",
            "nccl_gbps",
            "NCCL",
            where={"kind": "b"},
            goals=(Goal(">=", "@goal_gbps", "gbps_fp8", "fp8", unit="GB/s", where={"n": 1}),),
        ),
    ),
)


def _synth_rows() -> list[dict]:
    return [
        {"n": 1, "kind": "t", "ms": {"ours": 1.0, "peer": 4.0}, "goal_ratio": 0.5, "ok": True},
        {"n": 2, "kind": "t", "ms": {"ours": 3.0, "peer": 2.0}, "goal_ratio": 1.5, "ok": "pass"},
        {"n": 3, "kind": "t", "ms": {"ours": 6.0, "peer": 12.0}, "goal_ratio": 2.0, "ok": True},
        {"n": 4, "kind": "t", "ms": {"ours": 1.0, "peer": 4.0}, "goal_ratio": 0.5, "ok": False},
        {"n": 1, "kind": "b", "gbps": 300.0, "nccl_gbps": 400.0, "gbps_fp8": 280.0},
        {"n": 2, "kind": "b", "gbps": 300.0, "nccl_gbps": 150.0, "gbps_fp8": 280.0},
        {"n": 5, "kind": "t", "skipped": "no GPU"},
    ]


def test_ratio_and_met_on_a_synthetic_result() -> None:
    payload = {"name": "s", "env": {}, "goal_gbps": 250.0, "rows": _synth_rows()}
    lines = headlines.headline(payload, SYNTH)
    header, body = _table_rows(lines)
    assert header == ["n", "figure", "unit", "ours", "NCCL", "ours/NCCL time", "goal", "met"]
    assert body == [
        # ours / peer time 0.25 <= 0.5, and 1 ms <= 5 ms
        ["1", "time", "ms", "1.000", "4.000", "0.250", "ours/NCCL <= 0.5; <= 5 ms", "yes"],
        # a goal met exactly is met
        ["2", "time", "ms", "3.000", "2.000", "1.500", "ours/NCCL <= 1.5; <= 5 ms", "yes"],
        # 0.5 <= 2, but 6 ms > 5 ms
        ["3", "time", "ms", "6.000", "12.00", "0.500", "ours/NCCL <= 2; <= 5 ms", "no"],
        ["4", "time", "ms", "1.000", "4.000", "0.250", "ours/NCCL <= 0.5; <= 5 ms",
         "no (check failed)"],
        # GB/s: more is better, so ours / peer time is 400 / 300; the goal only where n is 1
        ["1", "bandwidth", "GB/s", "300.0", "400.0", "1.333", "fp8 >= 250 GB/s (280.0)", "yes"],
        ["2", "bandwidth", "GB/s", "300.0", "150.0", "0.500", "-", "-"],
    ]  # fmt: skip
    assert lines[-1] == "not measured: n 5: no GPU"

    payload["goal_gbps"] = 300.0
    speedup = Spec("s", SYNTH.case, SYNTH.figures, ratio="speedup")
    header, body = _table_rows(headlines.headline(payload, speedup))
    assert header[5] == "NCCL/ours speedup"
    assert [c[5] for c in body] == ["4.000", "0.667", "2.000", "4.000", "0.750", "2.000"]
    # A goal of the ratio reads the ratio column: the speedup 4 is not <= 0.5.
    assert body[0][-2:] == ["NCCL/ours <= 0.5; <= 5 ms", "no"]
    assert body[4][-2:] == ["fp8 >= 300 GB/s (280.0)", "no"]


def test_paired_rows_and_a_benchmark_without_a_peer() -> None:
    spec = Spec(
        "paired",
        headlines._case("shape"),
        (Figure("forward", "ms", "ms", "ms", "{impl}"),),
        pair=Pair("impl", {"ours": "base*", "ours fast": "base*"}),
    )
    rows = [
        {"shape": "a", "impl": "ours", "ms": 2.0},
        {"shape": "a", "impl": "ours fast", "ms": 1.0},
        {"shape": "a", "impl": "baseline: a2a", "ms": 4.0},
        {"shape": "b", "impl": "baseline: a2a", "ms": 8.0},
        {"shape": "b", "impl": "ours", "ms": 2.0},
    ]
    lines = headlines.headline({"name": "p", "env": {}, "rows": rows}, spec)
    header, body = _table_rows(lines)
    assert header == ["shape", "impl", "ours ms", "peer ms", "ours/peer time", "goal", "met"]
    assert [c[:5] for c in body] == [
        ["a", "ours", "2.000", "4.000", "0.500"],
        ["a", "ours fast", "1.000", "4.000", "0.250"],
        ["b", "ours", "2.000", "8.000", "0.250"],
    ]
    assert lines[-1] == "peer: baseline: a2a"

    alone = Spec("alone", headlines._case("n"), (Figure("energy", "mj", "mJ"),))
    rows = [{"n": 1, "mj": 3.0}, {"n": 2, "mj": 4.5}]
    lines = headlines.headline({"name": "a", "env": {}, "rows": rows}, alone)
    header, body = _table_rows(lines)
    assert header == ["n", "ours mJ", "goal", "met"]
    assert body == [["1", "3.000", "-", "-"], ["2", "4.500", "-", "-"]]
    assert lines[-1] == "no peer in this benchmark"


def test_a_result_that_measured_nothing_says_why() -> None:
    payload = {"name": "bench_dispatch", "env": {}, "rows": [{"skipped": "no CUDA GPUs"}]}
    assert summarize.render(payload)[-1] == "nothing measured: no CUDA GPUs"
    payload = {
        "name": "bench_overlap",
        "env": {},
        "config": {},
        "rows": [{"tp": 2, "kind": "-", "shape": "-", "status": "no CUDA GPUs"}],
    }
    assert summarize.render(payload)[-1] == "nothing measured: TP 2: no CUDA GPUs"


def test_main_prints_the_headlines_first_then_the_detail(tmp_path: Path, capsys) -> None:
    for name in ("bench_moe", "bench_layout"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.json").write_text(json.dumps(_committed(name)))
    argv = ["--out-dir", str(tmp_path), "--expect", "bench_gemm", "--expect", "bench_moe"]
    assert summarize.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Headline tables")
    assert out.index("### bench_gemm\n") < out.index("### bench_layout:") < out.index("bench_moe:")
    assert "### bench_gemm\n\nno result from this run" in out
    assert "## Detail" not in out and "| shape | W | impl |" in out

    assert summarize.main([*argv, "--detail"]) == 0
    out = capsys.readouterr().out
    detail = out.index("## Detail")
    assert out.index("### bench_moe:") < detail < out.index("### bench_moe on ")
