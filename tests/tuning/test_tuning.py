"""TuningParams: string form round-trips, any key order and subset, defaults."""

from __future__ import annotations

import itertools
import random

import pytest
from uniep import _C

FIELDS = ("comm_sms", "total_sms", "token_tile", "tile_m", "tile_n", "tile_k", "stages", "cluster")


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
                "cluster": rng.choice([0, 1, 2]),
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
        "cluster": f"cluster={point['cluster'] or 'auto'}",
        "overlap": f"overlap={point['overlap']}",
        "dispatch": f"dispatch={point['dispatch']}",
    }
    return ",".join(parts[k] for k in keys)


KEYS = [
    "sms",
    "token_tile",
    "tile_m",
    "tile_n",
    "tile_k",
    "stages",
    "cluster",
    "overlap",
    "dispatch",
]


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


def test_tile_keys_default_to_auto_and_gemm_to_the_engine() -> None:
    d = _C.TuningParams()
    assert (d.tile_m, d.tile_n, d.tile_k, d.stages) == (0, 0, 0, 0)
    assert d.gemm == "uniep"
    assert "tile_m=auto,tile_n=auto,tile_k=auto,stages=auto,cluster=auto" in d.to_string()
    assert d.to_string().endswith(",gemm=uniep,experts=auto")
    p = _C.TuningParams.parse("tile_m=auto,tile_n=256,stages=auto,gemm=torch")
    assert (p.tile_m, p.tile_n, p.stages, p.gemm) == (0, 256, 0, "torch")
    assert _C.TuningParams.parse(p.to_string()) == p
    assert p != _C.TuningParams.parse("tile_n=256")  # gemm is part of the point


def test_cluster_is_auto_one_or_two() -> None:
    # The expert GEMM engine's CTAs along M of a thread-block cluster: part of the point, named in
    # its errors.
    assert _C.TuningParams().cluster == 0
    p = _C.TuningParams.parse("tile_m=64,tile_n=256,cluster=1")
    assert p.cluster == 1 and p.given("cluster") and _C.TuningParams.parse(p.to_string()) == p
    assert p != _C.TuningParams.parse("tile_m=64,tile_n=256,cluster=2")
    assert _C.TuningParams.parse("cluster=auto").cluster == 0
    for bad in ("cluster=3", "cluster=0", "cluster=-1", "cluster=x", "cluster="):
        with pytest.raises(ValueError, match="cluster"):
            _C.TuningParams.parse(bad)
    d = _C.TuningParams()
    d.cluster = 4
    with pytest.raises(ValueError, match=r"cluster \(CTAs along M of a thread-block cluster\)"):
        d.validate()


def test_auto_cluster_is_one_for_experts_of_at_most_256_rows() -> None:
    assert _C.grouped_gemm_auto_cluster(256 * 128, 128) == 1
    assert _C.grouped_gemm_auto_cluster(256 * 128 + 1, 128) == 2
    assert _C.grouped_gemm_auto_cluster(0, 4) == 1
    with pytest.raises(ValueError, match="num_experts"):
        _C.grouped_gemm_auto_cluster(8, 0)


def test_skip_rounds_is_auto_unless_given() -> None:
    d = _C.TuningParams()
    assert d.skip_rounds == -1 and "cluster=auto,skip_rounds=auto,overlap=" in d.to_string()
    p = _C.TuningParams.parse("skip_rounds=3,overlap=fused")
    assert p.skip_rounds == 3 and _C.TuningParams.parse(p.to_string()) == p
    assert p != _C.TuningParams.parse("overlap=fused")  # skip_rounds is part of the point
    assert _C.TuningParams.parse("skip_rounds=auto").skip_rounds == -1
    for bad in ("skip_rounds=-1", "skip_rounds=x", "skip_rounds="):
        with pytest.raises(ValueError, match="skip_rounds"):
            _C.TuningParams.parse(bad)
    d.skip_rounds = -2
    with pytest.raises(ValueError, match=r"skip_rounds must be auto \(-1\) or in \[0, 2\^20\]"):
        d.validate()


@pytest.mark.parametrize(
    "text,match",
    [
        ("tile_m=0", "tile_m must be auto or a positive integer, got 0"),
        ("stages=0", "stages must be auto or a positive integer, got 0"),
        ("tile_k=Auto", "tile_k"),
        ("stages=9", "stages must be auto or in"),
        ("gemm=cublas", "gemm must be uniep or torch"),
        ("gemm=", "gemm must be uniep or torch"),
    ],
)
def test_auto_and_gemm_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _C.TuningParams.parse(text)


# Every enum key names its listed spellings in full; the fp8_e4m3 alias parses but is not listed.
@pytest.mark.parametrize(
    "text,message",
    [
        ("overlap=ring", "tuning: overlap must be sequential, chunked or fused, got 'ring'"),
        ("dispatch=fp16", "tuning: dispatch must be bf16 or fp8, got 'fp16'"),
        ("combine=sum", "tuning: combine must be per_k, rank_partials or node_partials, got 'sum'"),
        ("experts=int8", "tuning: experts must be auto, bf16 or fp8, got 'int8'"),
    ],
)
def test_enum_key_errors_list_the_spellings(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        _C.TuningParams.parse(text)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "text,message",
    [
        (",overlap=fused", "tuning: empty entry in ',overlap=fused'"),
        ("overlap=fused,,tile_m=64", "tuning: empty entry in 'overlap=fused,,tile_m=64'"),
        ("overlap=fused,", "tuning: empty entry at the end of 'overlap=fused,'"),
        ("overlap=fused , ", "tuning: empty entry at the end of 'overlap=fused , '"),
    ],
)
def test_empty_entries_are_refused_wherever_they_are(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        _C.TuningParams.parse(text)
    assert str(err.value) == message


def test_fp8_e4m3_is_an_alias_of_fp8() -> None:
    assert _C.TuningParams.parse("dispatch=fp8_e4m3") == _C.TuningParams.parse("dispatch=fp8")
    assert _C.TuningParams.parse("dispatch=fp8_e4m3").dispatch == "fp8"


def test_sms_total_may_equal_the_communication_sms() -> None:
    # A call that only communicates (a dispatch and its combine) kept to 24 SMs in all.
    p = _C.TuningParams.parse("sms=24/24")
    assert (p.comm_sms, p.total_sms) == (24, 24)
    assert _C.TuningParams.parse(p.to_string()) == p
    with pytest.raises(
        ValueError, match=r"sms total \(23\) must be 0 \(whole device\) or at least"
    ):
        _C.TuningParams.parse("sms=24/23")
