"""argparse types of the ``uniep`` command's options: each refuses a bad value naming what it
expects."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type of --warmup: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    """argparse type of --seed: an integer in [0, 2**32), so that the per-rank seeds derived from
    it stay within what torch.Generator.manual_seed takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [0, 2**32), got {text!r}"
        ) from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**32), got {text!r}")
    return value


def settle_seconds(text: str) -> float:
    """argparse type of --settle-s: a number of seconds in [0, 600]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 <= value <= 600):
        raise argparse.ArgumentTypeError(f"must be a number of seconds in [0, 600], got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type of a timeout: a finite number of seconds > 0 (0 would stop every rank at
    once, and nan or inf would never stop a hung one)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value
