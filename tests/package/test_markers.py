"""tests/conftest.py skips `gpu`, `multigpu` and `hopper` tests cleanly, with the reason, on a host
without the hardware."""

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

@pytest.mark.hopper
def test_needs_hopper():
    assert torch.cuda.get_device_capability() == (9, 0)

def test_plain():
    pass
"""

INNER_INI = """[pytest]
markers =
    gpu: needs one CUDA GPU
    multigpu: needs two or more CUDA GPUs
    hopper: needs a compute capability 9.0 GPU
"""


def test_skip_reason_table() -> None:
    assert skip_reason(set(), 0) is None
    assert "gpu" in (skip_reason({"gpu"}, 0) or "")
    assert skip_reason({"gpu"}, 1) is None
    assert "multigpu" in (skip_reason({"multigpu"}, 1) or "")
    assert "multigpu" in (skip_reason({"gpu", "multigpu"}, 0) or "")
    assert skip_reason({"gpu", "multigpu"}, 2) is None
    assert "needs a CUDA GPU" in (skip_reason({"hopper"}, 0) or "")
    assert "compute capability 9.0" in (skip_reason({"gpu", "hopper"}, 1, hopper=False) or "")
    assert skip_reason({"gpu", "hopper"}, 1, hopper=True) is None


def test_markers_skip_in_a_real_session(tmp_path: Path) -> None:
    here = Path(__file__).resolve().parents[1]
    for helper in ("conftest.py", "_hardware.py"):
        (tmp_path / helper).write_text((here / helper).read_text())
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
    hopper = gpus > 0 and torch.cuda.get_device_capability() == (9, 0)
    skipped = (gpus < 1) + (gpus < 2) + (not hopper)
    assert f"{4 - skipped} passed" in out, out
    if skipped:
        assert f"{skipped} skipped" in out, out
    if gpus < 1:
        assert "needs a CUDA GPU" in out, out
    if gpus < 2:
        assert "needs >= 2 CUDA GPUs" in out, out


def test_hardware_is_chosen_by_markers_only() -> None:
    # One Hopper check (tests/_hardware.py, behind the `hopper` marker): a copy in a test file
    # would skip, or run, on its own terms, out of reach of `-m`.
    tests = Path(__file__).resolve().parents[1]
    copies = [
        str(p.relative_to(tests))
        for p in sorted(tests.rglob("*.py"))
        if p.name != "_hardware.py"
        and "get_device_capability" in p.read_text()
        and p != Path(__file__).resolve()
    ]
    assert not copies, f"a Hopper check outside tests/_hardware.py: {copies}"
    unmarked = [
        str(p.relative_to(tests))
        for p in sorted(tests.rglob("test_gpu_*.py"))
        if not any(f"pytest.mark.{m}" in p.read_text() for m in ("gpu", "multigpu", "hopper"))
    ]
    assert not unmarked, f"GPU test files with no gpu/multigpu/hopper marker: {unmarked}"
