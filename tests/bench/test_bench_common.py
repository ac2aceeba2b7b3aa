"""The benchmark helpers that every bench script shares (bench/harness/common.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench" / d) for d in ("", "harness")]
import common  # noqa: E402


def test_profile_argument_parses_a_call_count() -> None:
    parser = argparse.ArgumentParser()
    common.add_profile_argument(parser)
    assert parser.parse_args([]).profile == 0
    assert parser.parse_args(["--profile", "7"]).profile == 7


def test_trace_arguments_collect_variants_and_a_directory() -> None:
    parser = argparse.ArgumentParser()
    common.add_trace_arguments(parser)
    none = parser.parse_args([])
    assert none.trace == [] and none.trace_dir is None
    args = parser.parse_args(["--trace", "ours_c1", "--trace", "mm_alone", "--trace-dir", "t"])
    assert args.trace == ["ours_c1", "mm_alone"] and args.trace_dir == "t"


def test_profile_kernels_with_no_calls_runs_nothing() -> None:
    calls: list[int] = []
    assert common.profile_kernels({"v": lambda: calls.append(1)}, 0) == {}
    assert calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_profile_kernels_without_a_gpu_names_the_reason() -> None:
    with pytest.raises(RuntimeError, match="needs a GPU"):
        common.profile_kernels({"v": lambda: None}, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_kernels_reports_the_kernels_of_each_call() -> None:
    a = torch.randn(256, 256, device="cuda")
    result = common.profile_kernels({"mm": lambda: a @ a}, 3)
    assert set(result) == {"mm"}
    assert result["mm"], "the matrix product launched no kernel the profiler saw"
    assert all(us > 0 for us in result["mm"].values())


def test_kernel_labels_keep_kernels_of_one_file_apart() -> None:
    prefix = "__nv_static_38__708314f3_16_rank_partials_cu_324ea7fc__ZN5uniep4cuda"
    ns = "49_GLOBAL__N__708314f3_16_rank_partials_cu_324ea7fc"
    fill = "15partials_kernelENS0_13SymmetricViewENS0_6EpDimsE"
    index = "17index_rows_kernelENS0_6EpDimsENS0_11CombineArgsE"
    assert common.kernel_label(prefix + ns + fill) == "uniep::cuda::partials_kernel"
    assert common.kernel_label(prefix + ns + index) == "uniep::cuda::index_rows_kernel"
    assert common.kernel_label("Memset (Device)") == "Memset (Device)"
    assert common.kernel_label("x" * 300) == "x" * 120


def test_kernel_timeline_times_each_kernel_by_its_end() -> None:
    """Two calls of a plan, a GEMM launched early (a programmatic launch: it starts while the
    plan runs and waits inside) and a combine: each kernel's end after the call's start, and
    after the latest end ahead of it; medians over the calls."""
    call = [("plan", 0.0, 3.0), ("gemm", 1.0, 20.0), ("combine", 18.0, 24.0)]
    later = [(n, s + 100.0, e + 102.0) for n, s, e in call]  # every end 2 us later
    got = common.kernel_timeline(call + later, 2)
    assert got == [("plan", 4.0, 4.0), ("gemm", 21.0, 17.0), ("combine", 25.0, 4.0)]
    with pytest.raises(ValueError, match="do not split into 2 equal calls"):
        common.kernel_timeline(call + later[:2], 2)
    with pytest.raises(ValueError, match="did not launch the same kernels"):
        common.kernel_timeline(call + [("other", s, e) for _, s, e in later], 2)


def test_graph_timeline_without_a_gpu_names_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        common.graph_timeline(None, 3)


def test_trace_paths_name_only_the_traced_variants() -> None:
    cfg = {"trace": ["ours_c1"], "trace_dir": "out"}
    path = common.trace_paths(cfg, "trace-tp2-ag_mm-8x8_n8", 1)
    assert path("ours_c1") == str(Path("out") / "trace-tp2-ag_mm-8x8_n8-ours_c1-rank1.json")
    assert path("mm_alone") is None
    assert common.trace_paths({"trace": ["ours_c1"], "trace_dir": None}, "t", 0)("ours_c1") is None


def test_result_path_is_one_file_per_benchmark(tmp_path: Path) -> None:
    assert common.result_path("bench_moe") == common.BENCH_DIR / "results/bench_moe/bench_moe.json"
    assert common.result_path("bench_moe", tmp_path) == tmp_path / "bench_moe" / "bench_moe.json"
    # A name cannot leave the results folder.
    assert common.result_path("../x y", tmp_path) == tmp_path / "x-y" / "x-y.json"
    with pytest.raises(ValueError, match="letter or digit"):
        common.result_path("..", tmp_path)


def test_write_result_replaces_the_last_run_and_its_plot(tmp_path: Path) -> None:
    first = Path(common.write_result("bench_x", [{"ms": 1.0}], str(tmp_path)))
    assert first == tmp_path / "bench_x" / "bench_x.json"
    first.with_suffix(".svg").write_text("<svg/>")  # the first run's plot
    second = Path(common.write_result("bench_x", [{"ms": 2.0}], str(tmp_path)))
    assert second == first
    assert sorted(p.name for p in first.parent.iterdir()) == ["bench_x.json"]
    payload = json.loads(second.read_text())
    assert payload["name"] == "bench_x" and payload["rows"] == [{"ms": 2.0}]
    assert {"device", "kind", "commit", "date"} <= set(payload["env"])


def test_out_dir_argument_defaults_to_bench_results() -> None:
    parser = argparse.ArgumentParser()
    common.add_out_dir_argument(parser)
    assert parser.parse_args([]).out_dir is None
    assert parser.parse_args(["--out-dir", "d"]).out_dir == "d"
    assert "DIR/NAME/NAME.json" in parser.format_help()


def test_results_keep_the_latest_run_of_each_benchmark_only() -> None:
    # bench/results/NAME/ holds NAME.json and its plot; older runs are in git history. The whole
    # of bench/ (scripts included) stays within 1 MB.
    results = common.DEFAULT_OUT_DIR
    stray = [
        str(p.relative_to(results))
        for p in results.rglob("*")
        if p.is_file()
        and not (
            p.parent.parent == results
            and p.stem == p.parent.name
            and p.suffix in (".json", *common.PLOT_SUFFIXES)
        )
    ]
    assert stray == [], f"only NAME/NAME.json and its plot belong in bench/results: {stray}"
    size = sum(p.stat().st_size for p in results.rglob("*") if p.is_file())
    assert size <= 600_000, f"bench/results holds {size} bytes: over its share of bench/'s 1 MB"


def test_a_run_that_measured_nothing_keeps_the_last_result(tmp_path: Path) -> None:
    assert common.measured([{"skipped": "one GPU"}, {"ms": 1.0}])
    assert not common.measured([{"skipped": "one GPU"}, {"error": "died"}, {"kind": "skipped"}])
    assert not common.measured([])
    # Where there is no result yet (a fresh --out-dir), the reason is written...
    path = Path(common.write_result("bench_x", [{"skipped": "one GPU"}], str(tmp_path)))
    assert json.loads(path.read_text())["rows"] == [{"skipped": "one GPU"}]
    # ...and a measurement replaces it, but a later skip does not replace the measurement.
    common.write_result("bench_x", [{"ms": 1.0}], str(tmp_path))
    assert common.write_result("bench_x", [{"skipped": "one GPU"}], str(tmp_path)) == str(path)
    assert json.loads(path.read_text())["rows"] == [{"ms": 1.0}]
