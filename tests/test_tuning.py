"""TuningParams: string form round-trips, any key order and subset, defaults."""

from __future__ import annotations

import itertools
import random

import pytest
from uniep import _C

FIELDS = ("comm_sms", "total_sms", "token_tile", "tile_m", "tile_n", "tile_k", "stages")


def _fields(p: _C.TuningParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in (*FIELDS, "overlap", "dispatch")}


def _points(n: int) -> list[dict[str, object]]:
    rng = random.Random(1234)
    pow2 = [16, 32, 64, 128, 256]
    points = []
    for _ in range(n):
        comm = rng.randint(1, 64)
        points.append(
            {
                "comm_sms": comm,
                "total_sms": rng.choice([0, comm + 1, 132, 1000]),
                "token_tile": rng.choice([1, 7, 16, 64, 4096]),
                "tile_m": rng.choice(pow2),
                "tile_n": rng.choice(pow2),
                "tile_k": rng.choice(pow2),
                "stages": rng.randint(1, 8),
                "overlap": rng.choice(["sequential", "chunked", "fused"]),
                "dispatch": rng.choice(["bf16", "fp8"]),
            }
        )
    return points


def _text(point: dict[str, object], keys: list[str]) -> str:
    parts = {
        "sms": f"sms={point['comm_sms']}/{point['total_sms']}",
        "token_tile": f"token_tile={point['token_tile']}",
        "tile_m": f"tile_m={point['tile_m']}",
        "tile_n": f"tile_n={point['tile_n']}",
        "tile_k": f"tile_k={point['tile_k']}",
        "stages": f"stages={point['stages']}",
        "overlap": f"overlap={point['overlap']}",
        "dispatch": f"dispatch={point['dispatch']}",
    }
    return ",".join(parts[k] for k in keys)


KEYS = ["sms", "token_tile", "tile_m", "tile_n", "tile_k", "stages", "overlap", "dispatch"]


@pytest.mark.parametrize("point", _points(60), ids=lambda p: _text(p, KEYS))
def test_parse_to_string_round_trip(point: dict[str, object]) -> None:
    keys = KEYS[:]
    random.Random(str(point)).shuffle(keys)
    p = _C.TuningParams.parse(_text(point, keys))
    assert _fields(p) == point
    text = p.to_string()
    q = _C.TuningParams.parse(text)
    assert q == p and not (q != p)
    assert q.to_string() == text
    assert repr(p)


def test_defaults_round_trip_and_empty_string() -> None:
    d = _C.TuningParams()
    assert _C.TuningParams.parse("") == d
    assert _C.TuningParams.parse(d.to_string()) == d
    assert d.overlap in ("sequential", "chunked", "fused")
    assert d.dispatch in ("bf16", "fp8")


@pytest.mark.parametrize("size", [1, 2, 3])
def test_any_subset_keeps_other_defaults(size: int) -> None:
    point = _points(1)[0]
    default = _fields(_C.TuningParams())
    for keys in itertools.combinations(KEYS, size):
        p = _C.TuningParams.parse(_text(point, list(keys)))
        changed = {"sms": ("comm_sms", "total_sms")}
        touched = {f for k in keys for f in changed.get(k, (k,))}
        for field, value in _fields(p).items():
            assert value == (point[field] if field in touched else default[field]), (keys, field)


def test_inequality() -> None:
    a = _C.TuningParams.parse("tile_m=64")
    b = _C.TuningParams.parse("tile_m=128")
    assert a != b and not (a == b)
