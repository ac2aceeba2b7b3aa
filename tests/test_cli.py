"""The `uniep` command line, run as a user would: a subprocess with a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import uniep
from uniep.cli import _parser


def _uniep_command() -> list[str]:
    script = Path(sys.executable).with_name("uniep")
    if script.exists():
        return [str(script)]
    found = shutil.which("uniep")
    assert found, "the `uniep` console script is not installed"
    return [found]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # The CPU path, even where a GPU is visible (the GPU path has its own tests).
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [*_uniep_command(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_info_prints_versions() -> None:
    proc = _run("info", timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert torch.__version__ in out, out
    version = getattr(uniep, "__version__", "0.1.0")
    assert version in out, out


def test_info_prints_cmake_prefix_path() -> None:
    proc = _run("info", "--cmake-prefix-path", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == uniep.cmake_prefix_path()
    assert (Path(proc.stdout.strip()) / "lib" / "cmake" / "uniep" / "uniepConfig.cmake").is_file()


def test_demo_runs_on_cpu() -> None:
    proc = _run("demo", timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "PASS" in proc.stdout and "cpu" in proc.stdout, proc.stdout


def test_demo_reports_bad_arguments() -> None:
    proc = _run("demo", "--experts", "3", "--world-size", "2", timeout=60)
    assert proc.returncode != 0
    assert "--experts" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--timeout", "0", "must be a finite number of seconds > 0, got '0'"),
        ("--timeout", "-5", "must be a finite number of seconds > 0, got '-5'"),
        ("--timeout", "nan", "must be a finite number of seconds > 0, got 'nan'"),
        ("--timeout", "inf", "must be a finite number of seconds > 0, got 'inf'"),
        ("--timeout", "soon", "must be a number of seconds > 0, got 'soon'"),
        ("--world-size", "0", "must be an integer >= 1, got '0'"),
        ("--tokens", "-1", "must be an integer >= 1, got '-1'"),
        ("--hidden", "0", "must be an integer >= 1, got '0'"),
        ("--ffn", "0", "must be an integer >= 1, got '0'"),
        ("--experts", "-8", "must be an integer >= 1, got '-8'"),
        ("--top-k", "0", "must be an integer >= 1, got '0'"),
        ("--iters", "0", "must be an integer >= 1, got '0'"),
        ("--iters", "2.5", "must be an integer >= 1, got '2.5'"),
        ("--seed", "-1", "must be an integer in [0, 2**32), got '-1'"),
        ("--seed", str(2**64), f"must be an integer in [0, 2**32), got '{2**64}'"),
    ],
)
def test_demo_rejects_out_of_range_numbers(
    option: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The parser alone: a bad value must stop `uniep demo` before it spawns anything.
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["demo", option, value])
    assert exc.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert f"argument {option}: {words}" in err, err


def test_demo_accepts_the_boundaries() -> None:
    args = _parser().parse_args(
        ["demo", "--timeout", "0.5", "--world-size", "1", "--tokens", "1", "--seed", "0"]
    )
    assert (args.timeout, args.world_size, args.tokens, args.seed) == (0.5, 1, 1, 0)
