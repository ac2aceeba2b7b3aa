"""Shared pytest set-up: hardware markers skip cleanly on machines without the hardware.

`gpu` tests need one CUDA device, `multigpu` tests need two or more, `hopper` tests a compute
capability 9.0 device (the sm90a kernels). They are skipped (with the reason printed by `-ra`)
instead of failing, so the whole suite runs on CPU-only CI. Select by marker: `-m gpu` for the
one-GPU suite, `-m multigpu` for the tests that need several.

The tests live in feature folders (moe/, megakernel/, gemm/, collectives/, parm/, nn/, tuning/,
bench/, package/); the helpers they share (`_dist.py`, `_moe_cases.py`, ...) sit here.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from _hardware import cuda_device_count, is_hopper

# Some test modules import another's workers across folders (test_gpu_on_one_gpu.py reruns the
# GPU tests' rank workers with ranks sharing one GPU), so every feature folder is importable, as
# pytest's default import mode makes a test file's own folder.
_HERE = Path(__file__).resolve().parent
for _folder in sorted(_HERE.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# moe_forward with an empty tuning string reads uniep.tune's cache: the tests must not see the
# user's, so every test (and the ranks it spawns, which inherit the environment) gets an empty
# one unless it sets its own.
os.environ["UNIEP_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="uniep-tests-"), "tune.json")


def skip_reason(markers: set[str], device_count: int, hopper: bool = True) -> str | None:
    """Why a test carrying `markers` cannot run on a host with `device_count` CUDA devices
    (`hopper`: whether they have compute capability 9.0)."""
    if "multigpu" in markers and device_count < 2:
        return f"multigpu: needs >= 2 CUDA GPUs, found {device_count}"
    if ("gpu" in markers or "hopper" in markers) and device_count < 1:
        return "gpu: needs a CUDA GPU, torch.cuda.is_available() is False"
    if "hopper" in markers and not hopper:
        return "hopper: needs a compute capability 9.0 GPU (the sm90a kernels)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = cuda_device_count()
    hopper = count > 0 and is_hopper()
    for item in items:
        reason = skip_reason({m.name for m in item.iter_markers()}, count, hopper)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
