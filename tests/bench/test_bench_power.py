"""bench/bench_power.py without a GPU: its nvidia-smi parsing, sample windows and energy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "bench" / d) for d in ("", "harness")]
import bench_power as bp  # noqa: E402


def test_parse_smi_line() -> None:
    got = bp.parse_smi_line("2026/11/28 15:12:54.948, 1485, 688.31, 0x0000000000000004")
    assert got is not None
    ts, mhz, watts, reasons = got
    assert (mhz, watts, reasons) == (1485.0, 688.31, "0x0000000000000004")
    assert ts == pytest.approx(1795878774.948)  # read as UTC
    assert bp.parse_smi_line("timestamp, clocks.sm [MHz], power.draw [W], reasons") is None
    assert bp.parse_smi_line("2026/11/28 15:12:54.948, 1485, [N/A], 0x0") is None
    assert bp.parse_smi_line("") is None


def test_window_stats() -> None:
    samples = [(float(t), 1000.0 + t, 100.0 * t, "0x4" if t > 2 else "0x0") for t in range(6)]
    got = bp.window_stats(samples, 1.0, 4.0, 0.5)  # t = 2, 3, 4
    assert got == {
        "samples": 3,
        "sm_mhz_median": 1003.0,
        "power_w_median": 300.0,
        "throttle_reasons": {"0x0": 1, "0x4": 2},
    }
    assert bp.window_stats(samples, 10.0, 12.0, 0.0) == {}


def test_energy() -> None:
    got = bp.energy_mj(688.0, 100.0, 0.739)
    assert got["mj_per_call"] == pytest.approx(508.432)
    assert got["dynamic_mj_per_call"] == pytest.approx(434.532)
    with pytest.raises(ValueError, match="ms_per_call must be > 0"):
        bp.energy_mj(688.0, 100.0, 0.0)


def test_cpu_run_skips(capsys: pytest.CaptureFixture[str]) -> None:
    if sys.modules.get("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: the skip path is not taken")
    assert bp.main(["--quick"]) == 0
    assert "skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bp.main(["--seconds", "0"])


def test_help_names_the_result_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bp.main(["--help"])
    assert exc.value.code == 0
    # --out-dir DIR: the run replaces DIR/bench_power/bench_power.json (default bench/results).
    assert "DIR/NAME/NAME.json" in " ".join(capsys.readouterr().out.split())
