"""Shared pytest set-up: hardware markers skip cleanly on machines without the hardware.

`gpu` tests need one CUDA device, `multigpu` tests need two or more. They are skipped (with the
reason printed by `-ra`) instead of failing, so the whole suite runs on CPU-only CI.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# moe_forward with an empty tuning string reads uniep.tune's cache: the tests must not see the
# user's, so every test (and the ranks it spawns, which inherit the environment) gets an empty
# one unless it sets its own.
os.environ["UNIEP_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="uniep-tests-"), "tune.json")


def _cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(markers: set[str], device_count: int) -> str | None:
    """Why a test carrying `markers` cannot run on a host with `device_count` CUDA devices."""
    if "multigpu" in markers and device_count < 2:
        return f"multigpu: needs >= 2 CUDA GPUs, found {device_count}"
    if "gpu" in markers and device_count < 1:
        return "gpu: needs a CUDA GPU, torch.cuda.is_available() is False"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count = _cuda_device_count()
    for item in items:
        reason = skip_reason({m.name for m in item.iter_markers()}, count)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
