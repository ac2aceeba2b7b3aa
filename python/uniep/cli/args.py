"""argparse types of the ``uniep`` command's options: each refuses a bad value naming what it
expects."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NamedTuple


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of counts and sizes: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type of --warmup: an integer >= 0."""
    return _int_at_least(text, 0)


def profile_sizes(text: str) -> int:
    """argparse type of ``uniep parm profile --sizes``: 2 (a fit needs two) to 16 (the default
    sizes; ``--up-to-mib`` spreads the same count further)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 2 <= value <= 16:
        raise argparse.ArgumentTypeError(f"must be an integer in [2, 16], got {text!r}")
    return value


def _finite(text: str, above: float, strict: bool) -> float:
    bound = f"> {above:g}" if strict else f">= {above:g}"
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > above if strict else value >= above)):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type of a bandwidth or a rate: a finite number > 0 (it divides)."""
    return _finite(text, 0.0, strict=True)


def non_negative_float(text: str) -> float:
    """argparse type of a latency: a finite number >= 0."""
    return _finite(text, 0.0, strict=False)


def check_layer(command: str, world_size: int, experts: int, top_k: int) -> None:
    """The layer options' agreement that argparse cannot check one option at a time: the
    experts split evenly over the ranks, and top-k no more than the experts."""
    if experts % world_size != 0:
        raise SystemExit(
            f"uniep {command}: --experts ({experts}) must be divisible by --world-size "
            f"({world_size})"
        )
    if top_k > experts:
        raise SystemExit(f"uniep {command}: --top-k ({top_k}) must be <= --experts")


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


class ProfileFile(NamedTuple):
    """A ``uniep parm profile`` JSON, read: its path and its contents."""

    path: str
    result: dict[str, Any]


def parm_profile_file(text: str) -> ProfileFile:
    """argparse type of --profile: a readable JSON of ``uniep parm profile`` whose coefficients
    make a cost model."""
    from ..parm.profile import cost_model_from_profile

    try:
        with open(text) as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc}") from None
    try:
        cost_model_from_profile(result)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not the JSON of `uniep parm profile` ({type(exc).__name__}: {exc})"
        ) from None
    return ProfileFile(text, result)
