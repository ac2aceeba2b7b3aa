"""What the test host has: CUDA devices, and whether they are Hopper (compute capability 9.0, the
one the sm90a kernels are compiled for). One place, read by conftest.py's markers and by the
tests that size their ranks by it."""

from __future__ import annotations

import torch


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def is_hopper(device: torch.device | int | None = None) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)
