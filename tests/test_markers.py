"""tests/conftest.py skips `gpu` and `multigpu` tests cleanly, with the reason, without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from conftest import skip_reason

INNER_TESTS = """
import pytest
import torch

@pytest.mark.gpu
def test_needs_gpu():
    assert torch.cuda.is_available()

@pytest.mark.multigpu
def test_needs_two_gpus():
    assert torch.cuda.device_count() >= 2

def test_plain():
    pass
"""

INNER_INI = """[pytest]
markers =
    gpu: needs one CUDA GPU
    multigpu: needs two or more CUDA GPUs
"""


def test_skip_reason_table() -> None:
    assert skip_reason(set(), 0) is None
    assert "gpu" in (skip_reason({"gpu"}, 0) or "")
    assert skip_reason({"gpu"}, 1) is None
    assert "multigpu" in (skip_reason({"multigpu"}, 1) or "")
    assert "multigpu" in (skip_reason({"gpu", "multigpu"}, 0) or "")
    assert skip_reason({"gpu", "multigpu"}, 2) is None


def test_markers_skip_in_a_real_session(tmp_path: Path) -> None:
    here = Path(__file__).parent
    (tmp_path / "conftest.py").write_text((here / "conftest.py").read_text())
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    (tmp_path / "pytest.ini").write_text(INNER_INI)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "--strict-markers"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skipped = (gpus < 1) + (gpus < 2)
    assert f"{3 - skipped} passed" in out, out
    if skipped:
        assert f"{skipped} skipped" in out, out
    if gpus < 1:
        assert "needs a CUDA GPU" in out, out
    if gpus < 2:
        assert "needs >= 2 CUDA GPUs" in out, out
