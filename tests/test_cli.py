"""The `uniep` command line, run as a user would: a subprocess with a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import uniep


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


def test_demo_runs_on_cpu() -> None:
    proc = _run("demo", timeout=150)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "PASS" in proc.stdout and "cpu" in proc.stdout, proc.stdout


def test_demo_reports_bad_arguments() -> None:
    proc = _run("demo", "--experts", "3", "--world-size", "2", timeout=60)
    assert proc.returncode != 0
    assert "--experts" in proc.stderr + proc.stdout
