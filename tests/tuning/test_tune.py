"""uniep.tune on CPU: the cache file, the search, moe_forward's use of the cache and `uniep tune`.

Tiny shapes only: the search itself is timed, so what is checked is its contract (numerics kept,
bits equal, ranks agreeing, the cache keyed and robust), not which point wins.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
import uniep
from _dist import run_ranks
from uniep.cli import main
from uniep.tuning import tuner as tune

SHAPE = {"tokens": 8, "hidden": 16, "ffn": 16, "experts": 4, "top_k": 2, "dtype": torch.float32}
QUICK = {"candidates": 3, "warmup": 0, "iters": 2}
POINT = "tile_m=32,tile_n=16,tile_k=16,overlap=sequential"


def _full(tuning: str) -> str:
    return uniep.TuningParams.parse(tuning).to_string()


def _inputs(rank: int = 0, world: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5 + rank)
    t, h, f, e, k = (SHAPE[n] for n in ("tokens", "hidden", "ffn", "experts", "top_k"))
    idx = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous()
    return (
        torch.randn(t, h, generator=gen),
        idx,
        torch.rand(t, k, generator=gen),
        torch.randn(e // world, h, 2 * f, generator=gen),
        torch.randn(e // world, f, h, generator=gen),
    )


# ---- the cache file ----


def test_cache_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "tune.json"
    assert tune.lookup(**SHAPE, path=path) is None  # a missing file is an empty cache, silently
    written = tune.store(POINT, **SHAPE, path=path, info={"measured_ms": 1.5})
    assert written == path
    assert tune.lookup(**SHAPE, path=path) == _full(POINT)
    other = {**SHAPE, "tokens": 16}
    tune.store("tile_m=64", **other, path=path)
    assert tune.lookup(**SHAPE, path=path) == _full(POINT)  # earlier entries are kept
    assert tune.lookup(**other, path=path) == _full("tile_m=64")
    data = json.loads(path.read_text())
    assert data["kind"] == "uniep-tune-cache" and data["schema"] == tune.SCHEMA
    (key,) = [k for k in data["entries"] if "tokens=8|" in k]
    assert data["entries"][key]["measured_ms"] == 1.5
    assert f"uniep={uniep.__version__}" in key and "device=cpu-" in key
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tune-")]  # no temp left


def test_cache_path_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNIEP_TUNE_CACHE", str(tmp_path / "x.json"))
    assert tune.cache_path() == tmp_path / "x.json"
    monkeypatch.delenv("UNIEP_TUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.cache_path() == tmp_path / "uniep" / "tune.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, as the XDG spec says
    assert tune.cache_path() == Path.home() / ".cache" / "uniep" / "tune.json"


def test_keys_isolate_device_world_size_and_numerics(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    tune.store(POINT, **SHAPE, device_name="NVIDIA H100 80GB HBM3", path=path)
    assert tune.lookup(**SHAPE, path=path) is None  # this CPU never reuses a GPU's entry
    assert tune.lookup(**SHAPE, device_name="NVIDIA H200", path=path) is None
    assert tune.lookup(**SHAPE, device_name="NVIDIA H100 80GB HBM3", path=path) == _full(POINT)
    tune.store(POINT, **SHAPE, world_size=2, path=path)
    assert tune.lookup(**SHAPE, path=path) is None  # world 1 never reuses world 2's
    assert tune.lookup(**SHAPE, world_size=4, path=path) is None
    assert tune.lookup(**SHAPE, world_size=2, path=path) == _full(POINT)
    assert tune.lookup(**SHAPE, world_size=2, numerics="combine=rank_partials", path=path) is None
    key = tune.cache_key(device_name="d", world_size=2, **SHAPE)
    for field in (
        f"schema={tune.SCHEMA}",
        "device=d",
        "world=2",
        "tokens=8",
        "hidden=16",
        "ffn=16",
        "experts=4",
        "top_k=2",
        "dtype=float32",
        "dispatch=bf16,combine=per_k",
    ):
        assert field in key


def test_store_refuses_a_point_that_changes_numerics(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="numerics"):
        tune.store("dispatch=fp8", **SHAPE, path=tmp_path / "t.json")
    with pytest.raises(ValueError, match="key 'tile_m' is not a numerics key"):
        tune.lookup(**SHAPE, numerics="tile_m=64", path=tmp_path / "t.json")


_GOOD_ENTRY = {"tuning": _full(POINT)}


def _cache_text(
    entries: object, kind: str = "uniep-tune-cache", schema: object = tune.SCHEMA
) -> str:
    return json.dumps({"kind": kind, "schema": schema, "entries": entries})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "not a UniEP tune cache"),
        (_cache_text({}, kind="someone-else"), "not a UniEP tune cache"),
        (_cache_text({}, schema=99), "schema 99"),
        (_cache_text([1, 2]), '"entries" must be an object'),
        (b"\xff\xfe\x00garbage", "unreadable"),
        (None, "unreadable"),  # a folder where the file should be
    ],
    ids=[
        "bad-json",
        "empty",
        "list",
        "foreign-kind",
        "other-schema",
        "entries-list",
        "not-utf8",
        "folder",
    ],
)
def test_corrupt_or_foreign_cache_warns_and_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | bytes | None, problem: str
) -> None:
    path = tmp_path / "tune.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    # Never fatal: moe_forward with "" warns (once per version of the file) and runs the defaults.
    monkeypatch.setenv("UNIEP_TUNE_CACHE", str(path))
    x, idx, w, w1, w2 = _inputs()
    with pytest.warns(RuntimeWarning, match=re.escape(str(path)) + ".*" + re.escape(problem)):
        y = uniep.moe_forward(x, idx, w, w1, w2)
    assert torch.equal(y, uniep.moe_forward(x, idx, w, w1, w2, tuning=_full("")))
    assert tune.lookup(**SHAPE, path=path) is None
    if content is not None:  # store replaces a corrupt file
        with pytest.warns(RuntimeWarning, match="ignoring it"):
            tune.store(POINT, **SHAPE, path=path)
        assert tune.lookup(**SHAPE, path=path) == _full(POINT)


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("just a string", 'no "tuning" string'),
        ({"tuning": 5}, 'no "tuning" string'),
        ({"tuning": "tile_m=3"}, "bad tuning"),
        ({"tuning": _full("dispatch=fp8")}, "changes the numerics keys"),
    ],
)
def test_bad_entry_is_skipped_with_a_warning(tmp_path: Path, entry: object, problem: str) -> None:
    path = tmp_path / "tune.json"
    good_key = tune.cache_key(device_name=tune.device_name(), world_size=1, **SHAPE)
    other = {**SHAPE, "tokens": 9}
    bad_key = tune.cache_key(device_name=tune.device_name(), world_size=1, **other)
    path.write_text(_cache_text({good_key: _GOOD_ENTRY, bad_key: entry}))
    with pytest.warns(RuntimeWarning, match=re.escape(problem)):
        assert tune.lookup(**other, path=path) is None
    assert tune.lookup(**SHAPE, path=path) == _full(POINT)


# ---- the search ----


def test_candidates_keep_numerics_and_compiled_tiles() -> None:
    shape = tune.MoeShape(64, 128, 256, 8, 2, 1, "bfloat16")
    # gemm=torch has no fp8 GEMM: bf16 experts on the fp8 rows.
    numerics = "dispatch=fp8,combine=rank_partials,gemm=torch,experts=bf16"
    for device in ("cpu", "cuda"):
        points = tune.candidate_points(shape, device, numerics)
        # On CUDA the default point is the separate launches, what an empty string runs.
        default = numerics + (",overlap=sequential" if device == "cuda" else "")
        assert points[0] == _full(default) and len(set(points)) == len(points) > 1
        for text in points:
            p = uniep.TuningParams.parse(text)
            assert (p.dispatch, p.combine, p.gemm) == ("fp8", "rank_partials", "torch")
            assert p.experts == "bf16"
            if device == "cuda":
                assert (p.tile_m, p.tile_n, p.tile_k) in {(0, 0, 0), *tune.CUDA_TILES}
                assert p.stages == 0
                # The MegaKernel takes none of these numerics: the separate launches only.
                assert p.overlap == "sequential"
    model = tune.CostModel(
        "cuda", peak_flops=1e15, mem_bw=3e12, alpha=2e-6, beta=1e-11, sm_count=132
    )
    shape2 = tune.MoeShape(4096, 4096, 2048, 64, 8, 8, "bfloat16")
    times = [model.seconds(shape2, t) for t in tune.candidate_points(shape2, "cuda")]
    assert all(math.isfinite(s) and s > 0 for s in times) and len(set(times)) > 1


def test_fp8_experts_are_tuned_over_the_fp8_tiles_and_priced_at_the_fp8_rate() -> None:
    shape = tune.MoeShape(4096, 7168, 2048, 32, 8, 1, "bfloat16")
    assert tune.normalize_numerics("dispatch=fp8") == "dispatch=fp8,combine=per_k,gemm=uniep"
    assert tune.normalize_numerics("dispatch=fp8,experts=fp8") == tune.normalize_numerics(
        "dispatch=fp8"
    )
    wire_only = tune.normalize_numerics("dispatch=fp8,experts=bf16")
    assert wire_only.endswith(",experts=bf16") and wire_only != tune.normalize_numerics(
        "dispatch=fp8"
    )
    points = tune.candidate_points(shape, "cuda", "dispatch=fp8", sm_count=132)
    params = [uniep.TuningParams.parse(t) for t in points]
    assert all(p.fp8_experts for p in params)
    assert {(p.tile_m, p.tile_n, p.tile_k) for p in params} == {(0, 0, 0), *tune.CUDA_FP8_TILES}
    assert all(p.overlap == "sequential" for p in params)  # no fp8 MegaKernel
    model = tune.CostModel("cuda", peak_flops=1e15, mem_bw=4.8e12, sm_count=132)
    fp8 = model.seconds(shape, points[0])
    bf16 = model.seconds(shape, tune.candidate_points(shape, "cuda", wire_only)[0])
    assert 0.4 < fp8 / bf16 < 0.75, (fp8, bf16)


def test_packed_candidates_hold_both_paths() -> None:
    shape = tune.MoeShape(4096, 7168, 2048, 32, 8, 1, "bfloat16")
    points = tune.candidate_points(shape, "cuda", sm_count=132, weights="bf16_packed")
    params = [uniep.TuningParams.parse(t) for t in points]
    # The default is what an empty tuning string runs on packed experts: the separate launches.
    assert params[0].overlap == "sequential" and len(set(points)) == len(points)
    fused = [p for p in params if p.overlap == "fused"]
    assert {p.tile_m for p in fused} == {64, 128}
    assert {(p.comm_sms, p.skip_rounds) for p in fused} >= {(132, -1), (16, 16), (32, -1)}
    assert all((p.tile_n, p.tile_k, p.stages) == (0, 0, 0) for p in fused)
    separate = [p for p in params if p.overlap == "sequential"]
    assert len(separate) == len(params) - len(fused) > len(fused)
    # Plain weights search the same two paths (moe_forward runs the MegaKernel on a packed copy
    # of w1 for overlap=fused): the default is the separate launches there too.
    assert tune.candidate_points(shape, "cuda", sm_count=132) == points
    # The MegaKernel takes only bf16 dispatch, the per-k combine and the engine's GEMMs.
    for numerics in ("combine=rank_partials", "dispatch=fp8", "gemm=torch"):
        others = tune.candidate_points(shape, "cuda", numerics, 132, "bf16_packed")
        assert all(uniep.TuningParams.parse(t).overlap == "sequential" for t in others)
    with pytest.raises(ValueError, match="weights='bf16_packed' is tuned on cuda only"):
        tune.candidate_points(shape, "cpu", weights="bf16_packed")
    with pytest.raises(ValueError, match="weights must be one of"):
        tune.candidate_points(shape, "cuda", weights="fp8")
    model = tune.CostModel(
        "cuda", peak_flops=1e15, mem_bw=3e12, sm_count=132, weights="bf16_packed"
    )
    times = {t: model.seconds(shape, t) for t in points}
    assert all(math.isfinite(s) and s > 0 for s in times.values())
    # The send is charged whole, at its senders' rate: 8 senders are slower than every CTA.
    every = next(t for t in points if "sms=132/0" in t and "tile_m=64" in t)
    few = every.replace("sms=132/0", "sms=8/0")
    assert times[every] < times[few]
    # Plain weights price the same MegaKernel, and their separate launches as packed ones where
    # the SwiGLU epilogue reads w1 as stored (an FFN size that is a multiple of tile_n / 2)...
    plain = tune.CostModel("cuda", peak_flops=1e15, mem_bw=3e12, sm_count=132)
    assert plain.seconds(shape, every) == times[every]
    tiled = next(t for t in points if "tile_m=128,tile_n=256,tile_k=64" in t)
    assert plain.seconds(shape, tiled) == times[tiled]
    # ... and one SwiGLU pass more where it does not (2112 = 33 x 64 is no multiple of 256 / 2):
    # the first GEMM's [R, 2I] output read and [R, I] written, at the same tiles.
    odd = tune.MoeShape(4096, 7168, 2112, 32, 8, 1, "bfloat16")
    swiglu_pass = 3 * odd.tokens * odd.top_k * odd.ffn * 2 / 3e12
    packed_odd = model.seconds(odd, tiled)
    assert plain.seconds(odd, tiled) - packed_odd == pytest.approx(swiglu_pass)
    assert plain.seconds(odd, tiled.replace("tile_n=256", "tile_n=128")) == pytest.approx(
        model.seconds(odd, tiled.replace("tile_n=256", "tile_n=128"))
    )
    assert tune.plain_swiglu_epilogue(2112, uniep.TuningParams.parse(""))
    assert not tune.plain_swiglu_epilogue(2040, uniep.TuningParams.parse(""))
    with pytest.raises(ValueError, match="needs device cuda and dtype bfloat16"):
        tune.tune(**SHAPE, device="cpu", cache=False, weights="bf16_packed")


def test_auto_tiles_follow_the_devices_pingpong_rows() -> None:
    from uniep.gemm import pingpong_rows

    if not torch.cuda.is_available():
        assert pingpong_rows() == 2048  # no device to read: the H200 rule
    # 1024 rows per expert (DeepSeek-V3 EP8 rank): the down projection (k <= n) takes the 64-row
    # ping-pong tiles on an H200, the cooperative 128-row ones on an H100.
    assert tune._cuda_auto_tiles(32 * 1024, 32, 7168, 2048, 2048) == tune.CUDA_TILES[4]
    assert tune._cuda_auto_tiles(32 * 1024, 32, 7168, 2048, 256) == tune.CUDA_TILES[0]
    assert tune._cuda_auto_tiles(32 * 256, 32, 7168, 2048, 256) == tune.CUDA_TILES[4]
    # The up projection (k = 7168 > n = 4096): cooperative tiles with the store epilogue (plain
    # weights' separate SwiGLU pass), ping-pong ones with the SwiGLU epilogue (packed experts)
    # up to the device's rows.
    assert tune._cuda_auto_tiles(32 * 1024, 32, 4096, 7168, 2048) == tune.CUDA_TILES[0]
    assert tune._cuda_auto_tiles(32 * 1024, 32, 4096, 7168, 2048, True) == tune.CUDA_TILES[4]
    assert tune._cuda_auto_tiles(32 * 1024, 32, 4096, 7168, 256, True) == tune.CUDA_TILES[0]
    # Experts of at most 128 rows and outputs of at most 128 columns take the 64-row tiles.
    assert tune._cuda_auto_tiles(32 * 128, 32, 4096, 7168, 256) == tune.CUDA_TILES[4]
    assert tune._cuda_auto_tiles(32 * 4096, 32, 128, 7168, 256) == tune.CUDA_TILES[1]
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, 1048576\], got 0"):
        tune._cuda_auto_tiles(64, 0, 128, 128)
    with pytest.raises(ValueError, match="num_experts must be in .* got 9223372036854775807"):
        tune._cuda_auto_tiles(2**62, 2**63 - 1, 128, 128)  # overflowed 128 x num_experts
    shape = tune.MoeShape(4096, 7168, 2048, 32, 8, 1, "bfloat16")
    fused = "overlap=fused,sms=132,tile_m=auto"
    h200, h100 = (
        tune.CostModel("cuda", 1e15, 3e12, sm_count=132, weights="bf16_packed", pingpong_rows=r)
        for r in (2048, 256)
    )
    as_64 = fused.replace("auto", "64")
    as_128 = fused.replace("auto", "128")
    assert h200.seconds(shape, fused) == h200.seconds(shape, as_64)
    assert h100.seconds(shape, fused) == h100.seconds(shape, as_128)
    # The tile width as the launch picks it: 64 x 128 where the experts average at most one
    # 64-row tile (decode), 256 wide otherwise; a named tile_n=128 runs 64-row tiles.
    decode = tune.MoeShape(16, 7168, 2048, 256, 8, 1, "bfloat16")
    assert h200.seconds(decode, fused) == h200.seconds(decode, as_64 + ",tile_n=128")
    assert h200.seconds(decode, fused) != h200.seconds(decode, as_64 + ",tile_n=256")
    named = h100.seconds(decode, fused + ",tile_n=128")
    assert named == h100.seconds(decode, as_64 + ",tile_n=128")
    assert h200.seconds(shape, fused) == h200.seconds(shape, as_64 + ",tile_n=256")


def test_fp8_auto_tiles_take_64_rows_for_decode() -> None:
    from uniep import _C

    # Up to 32 rows per expert on average (decode): the ping-pong 64 x 128 tiles; above it the
    # cooperative 128 x 128 ones (at 64 rows routing spills many experts into a second tile).
    assert tune.CUDA_FP8_TILES[_C.grouped_gemm_fp8_auto_config(0, 128)] == (64, 128, 128)
    assert tune.CUDA_FP8_TILES[_C.grouped_gemm_fp8_auto_config(32 * 128, 128)] == (64, 128, 128)
    assert tune.CUDA_FP8_TILES[_C.grouped_gemm_fp8_auto_config(32 * 128 + 1, 128)] == (
        128,
        128,
        128,
    )
    with pytest.raises(ValueError, match=r"num_experts must be in \[1, 1048576\], got 0"):
        _C.grouped_gemm_fp8_auto_config(64, 0)
    with pytest.raises(ValueError, match="rows must be >= 0, got -1"):
        _C.grouped_gemm_fp8_auto_config(-1, 8)
    # The cost model prices the tiles the engine picks: auto as the 64-row tile in decode and as
    # the 128-row one in prefill.
    model = tune.CostModel("cuda", 1e15, 3e12, sm_count=132, weights="fp8")
    auto, m64, m128 = "dispatch=fp8", "dispatch=fp8,tile_m=64", "dispatch=fp8,tile_m=128"
    decode = tune.MoeShape(16, 7168, 2048, 256, 8, 1, "bfloat16")
    prefill = tune.MoeShape(4096, 7168, 2048, 256, 8, 1, "bfloat16")
    assert model.seconds(decode, auto) == model.seconds(decode, m64)
    assert model.seconds(prefill, auto) == model.seconds(prefill, m128)
    assert model.seconds(prefill, auto) != model.seconds(prefill, m64)


def test_packed_entries_have_their_own_key(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    plain = tune.cache_key(device_name="d", world_size=1, **SHAPE)
    packed = tune.cache_key(device_name="d", world_size=1, **SHAPE, weights="bf16_packed")
    assert "weights=" not in plain and "|weights=bf16_packed|" in packed
    assert packed.endswith("|" + tune.normalize_numerics(""))
    fused = "overlap=fused,sms=16,skip_rounds=2,tile_m=64"
    tune.store(fused, **SHAPE, path=path, weights="bf16_packed")
    assert tune.lookup(**SHAPE, path=path) is None
    assert tune.lookup(**SHAPE, path=path, weights="bf16_packed") == _full(fused)
    tune.store(POINT, **SHAPE, path=path)
    assert tune.lookup(**SHAPE, path=path) == _full(POINT)
    assert tune.lookup(**SHAPE, path=path, weights="bf16_packed") == _full(fused)
    with pytest.raises(ValueError, match="weights must be one of"):
        tune.lookup(**SHAPE, path=path, weights="packed")


def test_tune_keeps_numerics_and_winner_bits_equal_default(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    seen: list[str] = []
    result = tune.tune(
        **SHAPE,
        numerics="combine=rank_partials",
        device="cpu",
        path=path,
        progress=lambda done, total, what: seen.append(f"{done}/{total} {what}"),
        **QUICK,
    )
    assert result.default == _full("combine=rank_partials")
    # At hidden 16 and ffn 16 only tile_n=16 changes the CPU executor's loops: one point besides
    # the default runs differently, and only the two are measured.
    assert len(result.candidates) == result.distinct == 2
    assert result.considered == 1 + len(tune.CPU_TILES)
    assert seen[-1].startswith(f"{2 * len(result.candidates)}/{2 * len(result.candidates)} ")
    for c in [*result.candidates, tune.Candidate(result.tuning, 0.0)]:
        assert uniep.TuningParams.parse(c.tuning).combine == "rank_partials"
        assert uniep.TuningParams.parse(c.tuning).dispatch == "bf16"
    measured = [c.measured_ms for c in result.candidates]
    assert all(math.isfinite(m) and m > 0 for m in measured)
    assert result.best_ms in measured and result.bits_identical
    assert all(len(c.rounds_ms) == 2 for c in result.candidates)  # QUICK's 2 calls: 2 rounds
    assert result.cache_path == str(path)
    assert tune.lookup(**SHAPE, numerics="combine=rank_partials", path=path) == result.tuning
    x, idx, w, w1, w2 = _inputs()
    y_default = uniep.moe_forward(x, idx, w, w1, w2, tuning=result.default)
    assert torch.equal(y_default, uniep.moe_forward(x, idx, w, w1, w2, tuning=result.tuning))
    table = result.table()
    assert table.count("\n") == len(result.candidates) + 1 and "**yes**" in table
    with pytest.raises(ValueError, match="numerics: key 'overlap'"):
        tune.tune(**SHAPE, numerics="overlap=sequential", device="cpu", cache=False)
    with pytest.raises(ValueError, match="top_k"):
        tune.tune(**{**SHAPE, "top_k": 0}, device="cpu", cache=False)


def test_tune_refuses_a_winner_whose_bits_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from uniep.moe import ops

    real = ops.moe_forward
    default = _full("")

    def fake(x, topk_idx, topk_weights, w1, w2, group=None, tuning=""):  # noqa: ANN001, ANN202
        y = real(x, topk_idx, topk_weights, w1, w2, group, tuning)
        if tuning == default:
            time.sleep(0.02)  # every other point wins...
            return y
        return y + 1.0  # ...with other bits

    monkeypatch.setattr(ops, "moe_forward", fake)
    with pytest.warns(RuntimeWarning, match="differs bitwise .* keeping the default"):
        result = tune.tune(**SHAPE, device="cpu", cache=False, **QUICK)
    assert result.tuning == default and not result.bits_identical
    assert result.cache_path is None


def test_settle_calls() -> None:
    assert tune.settle_calls(0.0, [1.0, 2.0]) == [0, 0]
    # About settle_s of calls at the estimate, at least one, none for a failed point.
    assert tune.settle_calls(0.01, [1.0, 0.5, 30.0, math.inf]) == [10, 20, 1, 0]
    assert tune.settle_calls(600.0, [1e-9]) == [100_000]


def test_settle_runs_each_candidate_back_to_back_before_its_timed_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from collections import Counter

    from uniep.moe import ops

    real = ops.moe_forward
    calls: Counter[str] = Counter()

    def counting(x, topk_idx, topk_weights, w1, w2, group=None, tuning=""):  # noqa: ANN001, ANN202
        calls[tuning] += 1
        return real(x, topk_idx, topk_weights, w1, w2, group, tuning)

    monkeypatch.setattr(ops, "moe_forward", counting)
    plain = tune.tune(**SHAPE, device="cpu", cache=False, **QUICK)
    plain_calls = dict(calls)
    calls.clear()
    settled = tune.tune(**SHAPE, device="cpu", cache=False, settle_s=0.002, **QUICK)
    assert [c.tuning for c in settled.candidates] == [c.tuning for c in plain.candidates]
    for c in settled.candidates:
        # Two rounds (QUICK's 2 calls), each with at least one untimed call first.
        assert calls[c.tuning] >= plain_calls[c.tuning] + 2, (c.tuning, calls, plain_calls)
    for bad in (-1.0, math.nan, math.inf, 601.0, True, "1"):
        with pytest.raises(ValueError, match="settle_s must be a number of seconds in"):
            tune.tune(**SHAPE, device="cpu", cache=False, settle_s=bad, **QUICK)


def test_budget_stops_measuring_but_keeps_the_default() -> None:
    result = tune.tune(**SHAPE, device="cpu", cache=False, budget_s=1e-9, **QUICK)
    assert [c.tuning for c in result.candidates] == [result.default] == [result.tuning]
    assert math.isfinite(result.default_ms) and result.considered > QUICK["candidates"]
    with pytest.raises(ValueError, match="budget_s"):
        tune.tune(**SHAPE, device="cpu", cache=False, budget_s=0)


def test_unwritable_cache_warns_and_returns_the_result(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="could not write the uniep tune cache"):
        result = tune.tune(**SHAPE, device="cpu", path=blocker / "tune.json", **QUICK)
    assert result.cache_path is None and result.tuning


# ---- moe_forward and the nn modules with an empty tuning string ----


def test_empty_tuning_uses_the_cached_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tune.json"
    monkeypatch.setenv("UNIEP_TUNE_CACHE", str(path))
    real = torch.ops.uniep.moe_forward
    calls: list[str] = []

    def spy(*args: object) -> torch.Tensor:
        calls.append(str(args[6]))
        return real(*args)

    monkeypatch.setattr(torch.ops.uniep, "moe_forward", spy)
    x, idx, w, w1, w2 = _inputs()
    uniep.moe_forward(x, idx, w, w1, w2)
    assert calls[-1] == ""  # no cache entry: the built-in default
    tune.store(POINT, **SHAPE)
    y = uniep.moe_forward(x, idx, w, w1, w2)
    assert calls[-1] == _full(POINT)
    assert torch.equal(y, real(x, idx, w, w1, w2, "", ""))  # same bits, by design
    uniep.moe_forward(x, idx, w, w1, w2, tuning="tile_m=64")
    assert calls[-1] == "tile_m=64"  # an explicit point is never replaced
    # An object asks what its string form asks: no key given is "", the cached point.
    uniep.moe_forward(x, idx, w, w1, w2, tuning=uniep.TuningParams())
    assert calls[-1] == _full(POINT)
    uniep.moe_forward(x[:4], idx[:4], w[:4], w1, w2)
    assert calls[-1] == ""  # another token count is another key
    tune.store("tile_m=16", **SHAPE)  # a rewritten file is read again
    uniep.moe_forward(x, idx, w, w1, w2)
    assert calls[-1] == _full("tile_m=16")

    experts = uniep.nn.Experts(SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"])
    experts(x, idx, w)
    assert calls[-1] == _full("tile_m=16")
    layer = uniep.nn.MoELayer(SHAPE["hidden"], SHAPE["ffn"], SHAPE["experts"], SHAPE["top_k"])
    layer(x)
    assert calls[-1] == _full("tile_m=16")
    pinned = uniep.nn.MoELayer(16, 16, 4, 2, tuning="tile_m=64")
    pinned(x)
    assert calls[-1] == "tile_m=64"


# ---- two gloo ranks ----


def _two_ranks(rank: int, world: int, folder: str) -> dict:
    import warnings

    os.environ["UNIEP_TUNE_CACHE"] = os.path.join(folder, f"rank{rank}.json")
    # Settling too: every rank must make the same untimed calls (each is a collective).
    result = tune.tune(**SHAPE, device="cpu", settle_s=0.002, **QUICK)
    out = {
        "tuning": result.tuning,
        "measured": [c.measured_ms for c in result.candidates],
        "rounds": [c.rounds_ms for c in result.candidates],
        "verdict": result.verdict,
        "order": [c.tuning for c in result.candidates],
        "world": result.world_size,
        "looked_up": tune.lookup(**SHAPE, world_size=world),
        "world1": tune.lookup(**SHAPE, world_size=1),
    }
    # Both caches hold the same point: moe_forward with "" uses it on both ranks.
    x, idx, w, w1, w2 = _inputs(rank, world)
    y = uniep.moe_forward(x, idx, w, w1, w2)
    out["same_bits"] = torch.equal(y, uniep.moe_forward(x, idx, w, w1, w2, tuning=_full("")))
    # Ragged batches: a point cached for rank 0's token count and none for rank 1's. The call
    # agreement fails on both, each naming where its point came from and the ragged cause.
    other = _full(POINT) if result.tuning != _full(POINT) else _full("tile_m=16")
    if rank == 0:
        tune.store(other, **SHAPE, world_size=world)
    t = SHAPE["tokens"] if rank == 0 else SHAPE["tokens"] - 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            uniep.moe_forward(x[:t], idx[:t], w[:t], w1, w2)
        out["error"] = ""
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    # An explicit string chooses one point for every rank.
    out["explicit"] = uniep.moe_forward(x[:t], idx[:t], w[:t], w1, w2, tuning=_full("")).shape[0]
    # Different arguments: rank 0, whose own match its own, names the rank that differs.
    try:
        tune.tune(**SHAPE, device="cpu", **{**QUICK, "iters": 2 + rank})
        out["arguments"] = ""
    except ValueError as e:
        out["arguments"] = str(e)
    return out


def test_two_ranks_tune_collectively_and_a_cache_mismatch_fails_loudly(
    tmp_path: Path,
) -> None:
    r0, r1 = run_ranks(2, _two_ranks, str(tmp_path), timeout=90.0)
    assert r0["world"] == r1["world"] == 2
    assert r0["tuning"] == r1["tuning"] and r0["order"] == r1["order"]
    assert r0["measured"] == r1["measured"]  # the slowest rank's median, on both
    assert r0["rounds"] == r1["rounds"] and r0["verdict"] == r1["verdict"]
    assert all(len(times) == 2 for times in r0["rounds"])
    for r in (r0, r1):
        assert r["looked_up"] == r0["tuning"] and r["world1"] is None and r["same_bits"]
        # Not a hang, not silent divergence: every rank raises, naming a tuning key and the hint.
        assert r["error"].startswith("ValueError"), r["error"]
        assert re.search(r"tuning \w+ differs", r["error"]), r["error"]
        assert "ragged batches" in r["error"] and "tune cache" in r["error"], r["error"]
    assert "rank0.json" in r0["error"] and "rank1.json" in r1["error"]
    assert r0["explicit"] == SHAPE["tokens"] and r1["explicit"] == SHAPE["tokens"] - 2
    assert "rank 1's differ from rank 0's" in r0["arguments"], r0["arguments"]
    assert "rank 0: " in r1["arguments"] and "rank 1: " in r1["arguments"], r1["arguments"]


# ---- uniep tune ----


def test_cli_tune(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "cli.json"
    args = (
        "tune --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 --device cpu --candidates 2 "
        "--iters 2 --warmup 0 --combine rank_partials"
    ).split() + ["--cache", str(path)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "| # | schedule | predicted ms | measured ms | rounds ms | chosen |" in captured.out
    assert "**yes**" in captured.out and f"cached in {path}" in captured.out
    assert "6 candidates ranked by the cost model, 2 of them distinct on the cpu" in captured.out
    # The progress bar: the 2 distinct points, 2 rounds.
    assert re.search(r"\[#+\] 4/4 ", captured.err)
    # Why the chosen point was kept, on its own line: no speed-up is claimed within the noise.
    verdict = re.search(r"^chosen: \S+\n  (.*)$", captured.out, re.M).group(1)
    assert re.search(r"faster in every round|within noise: not|no other point", verdict), verdict
    if "faster in every round" not in verdict:
        assert "x)" not in verdict and verdict.startswith("the default, ")
    chosen = re.search(r"^chosen: (\S+)$", captured.out, re.M).group(1)
    assert "combine=rank_partials" in chosen
    assert (
        tune.lookup(**{**SHAPE, "dtype": "float32"}, numerics="combine=rank_partials", path=path)
        == chosen
    )
    with pytest.raises(SystemExit, match="divisible by --world-size"):
        main([*args[:7], "--experts", "3", "--top-k", "2", "--world-size", "2"])
    with pytest.raises(SystemExit):
        main([*args, "--dispatch", "fp9"])
    with pytest.raises(SystemExit, match="--weights bf16_packed tunes moe_forward_prepared"):
        main([*args, "--weights", "bf16_packed"])
    for bad in ("-1", "nan", "700", "soon"):
        with pytest.raises(SystemExit):
            main([*args, "--settle-s", bad])
    assert main([*args, "--settle-s", "0.001"]) == 0


def test_cli_tune_numerics_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from argparse import Namespace

    from uniep.cli.tune import check_numerics

    path = tmp_path / "cli.json"
    args = (
        "tune --tokens 8 --hidden 64 --ffn 64 --experts 4 --top-k 2 --device cpu --candidates 2 "
        "--iters 2 --warmup 0"
    ).split() + ["--cache", str(path)]
    # fp8 experts need 128-multiples; the advice names an option the command has.
    for extra in ([], ["--expert-precision", "fp8"], ["--expert-precision", "auto"]):
        with pytest.raises(SystemExit, match="add --expert-precision bf16 for bf16 expert GEMMs"):
            main([*args, "--dispatch", "fp8", *extra])
    with pytest.raises(SystemExit, match="--hidden and --ffn must be multiples of 128, got 64"):
        main([*args, "--dispatch", "fp8"])
    with pytest.raises(SystemExit, match="--expert-precision fp8 needs --dispatch fp8"):
        main([*args, "--expert-precision", "fp8"])
    with pytest.raises(SystemExit):
        main([*args, "--expert-precision", "fp16"])
    assert main([*args, "--dispatch", "fp8", "--expert-precision", "bf16"]) == 0
    chosen = re.search(r"^chosen: (\S+)$", capsys.readouterr().out, re.M).group(1)
    assert "dispatch=fp8" in chosen and "experts=bf16" in chosen
    shape = dict(tokens=8, hidden=64, ffn=64, experts=4, top_k=2, dtype="float32", path=path)
    assert tune.lookup(**shape, numerics="dispatch=fp8,experts=bf16") == chosen
    # node_partials: the CPU executor runs it (one node: per_k's bits), cached under its key.
    assert main([*args, "--combine", "node_partials"]) == 0
    chosen = re.search(r"^chosen: (\S+)$", capsys.readouterr().out, re.M).group(1)
    assert "combine=node_partials" in chosen
    assert tune.lookup(**shape, numerics="combine=node_partials") == chosen
    # On CUDA the tuner's ranks are one node: node_partials and gemm=torch under fp8 experts are
    # refused before any rank starts.
    cuda = dict(hidden=128, ffn=128, dispatch=None, combine=None, gemm=None, expert_precision=None)
    check_numerics(Namespace(**cuda), "cuda")
    with pytest.raises(SystemExit, match="--combine node_partials is the combine of a group"):
        check_numerics(Namespace(**{**cuda, "combine": "node_partials"}), "cuda")
    with pytest.raises(SystemExit, match="add --expert-precision bf16 or drop --gemm torch"):
        check_numerics(Namespace(**{**cuda, "dispatch": "fp8", "gemm": "torch"}), "cuda")
    check_numerics(
        Namespace(**{**cuda, "dispatch": "fp8", "gemm": "torch", "expert_precision": "bf16"}),
        "cuda",
    )


def test_runoff_points_are_the_close_calls_fastest_first() -> None:
    inf = math.inf
    assert tune.runoff_points([5.31, 5.61, 5.52, inf, 5.33]) == [0, 4, 2]
    assert tune.runoff_points([1.0, 1.2, 1.3]) == []  # nothing within 5%: nothing to settle
    assert tune.runoff_points([inf, inf]) == [] and tune.runoff_points([]) == []
    assert tune.runoff_points([1.0] * 6) == [0, 1, 2, 3]  # at most four
    assert tune.runoff_points([2.0, 1.0, 1.1], margin=1.2, most=2) == [1, 2]
    with pytest.raises(ValueError, match="margin must be >= 1 and most >= 2"):
        tune.runoff_points([1.0, 1.0], most=1)


# ---- points that run alike, and gains within the noise ----


def test_executor_point_names_what_each_executor_reads() -> None:
    shape = tune.MoeShape(64, 256, 512, 8, 2, 2, "float32")
    cpu = [tune.executor_point(shape, "cpu", _full(t)) for t in ("", "tile_n=128")]
    # The CPU executor reads tile_n as its inner loop's width and none of the other schedule keys.
    for other in (
        "tile_m=16",
        "tile_k=256",
        "overlap=sequential",
        "overlap=chunked",
        "sms=8/132",
        "token_tile=32",
        "stages=2",
        "skip_rounds=3",
    ):
        cpu.append(tune.executor_point(shape, "cpu", _full(other)))
    assert len(set(cpu)) == 1, cpu
    widths = {tn: tune.executor_point(shape, "cpu", _full(f"tile_n={tn}")) for tn in tune.CPU_TILES}
    assert len(set(widths.values())) == len(tune.CPU_TILES)
    # A loop at least as wide as N is N: tile_n 256 and up run alike when both N are <= 256.
    narrow = tune.MoeShape(64, 128, 64, 8, 2, 2, "float32")
    assert tune.executor_point(narrow, "cpu", _full("tile_n=128")) == tune.executor_point(
        narrow, "cpu", _full("tile_n=256")
    )
    assert tune.executor_point(shape, "cpu", _full("combine=rank_partials")) != cpu[0]
    # CUDA: token_tile alone is read by no path.
    cuda = {
        t: tune.executor_point(shape, "cuda", _full(t))
        for t in ("", "token_tile=32", "tile_m=64", "tile_k=128", "sms=8/132", "overlap=sequential")
    }
    assert cuda[""] == cuda["token_tile=32"]
    assert len({cuda[t] for t in cuda if t != "token_tile=32"}) == 5
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        tune.executor_point(shape, "mps", _full(""))


def test_cpu_candidates_vary_only_what_the_cpu_executor_reads() -> None:
    shape = tune.MoeShape(256, 256, 512, 8, 2, 2, "float32")
    points = tune.candidate_points(shape, "cpu")
    assert [uniep.TuningParams.parse(t).tile_n for t in points] == [0, *tune.CPU_TILES]
    assert {tune._label(t, points[0]) for t in points[1:]} == {
        f"tile_n={n}" for n in tune.CPU_TILES
    }
    # tile_n=128 is auto's width: 5 distinct executions among the 6 points.
    assert len({tune.executor_point(shape, "cpu", t) for t in points}) == 5


INF = math.inf


@pytest.mark.parametrize(
    ("medians", "rounds", "want"),
    [
        # A GPU-like search: 9.05 ms in every round against the default's 10.0-10.2.
        ([10.1, 9.05], [[10.0, 10.2, 10.1], [9.0, 9.1, 9.05]], (1, 1, "beyond noise")),
        # The same median, but slower than the default in the third round: within noise.
        ([10.1, 9.05], [[10.0, 10.2, 10.1], [8.0, 9.05, 10.5]], (0, 1, "within noise")),
        # CPU-like rounds (a 1.40x of medians from rounds that trade places): within noise.
        ([143.0, 102.0], [[98.0, 143.0, 160.0], [101.0, 102.0, 150.0]], (0, 1, "within noise")),
        # Beyond the noise but not the fastest median: the lowest median that clears the noise.
        (
            [10.0, 8.0, 9.0, INF],
            [[9.9, 10.1], [6.0, 10.2], [8.95, 9.05], []],
            (2, 1, "beyond noise"),
        ),
        # A lower median from one fast round: not faster in every round.
        ([10.0, 9.0], [[9.75, 10.25], [9.8, 8.2]], (0, 1, "within noise")),
        ([10.0, 11.0, INF], [[9.0, 11.0], [10.9, 11.1], []], (0, 0, "default fastest")),
        # One round gives no spread: the default stays whatever the medians.
        ([10.0, 1.0], [[10.0], [1.0]], (0, 1, "one round")),
        # The default failed: the fastest point that ran.
        ([INF, 5.0, 4.0], [[], [5.0, 5.1], [3.0, 5.0]], (2, 2, "default failed")),
        ([INF, INF], [[], []], (0, 0, "default failed")),
    ],
)
def test_pick_beyond_noise(
    medians: list[float], rounds: list[list[float]], want: tuple[int, int, str]
) -> None:
    pick = tune.pick_beyond_noise(medians, rounds, 0)
    assert (pick.chosen, pick.fastest, pick.why) == want
    # The rule does not depend on where the default sits in the list.
    flipped = tune.pick_beyond_noise(medians[::-1], rounds[::-1], len(medians) - 1)
    last = len(medians) - 1
    assert (flipped.chosen, flipped.fastest, flipped.why) == (
        last - want[0],
        last - want[1],
        want[2],
    )


def test_pick_beyond_noise_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="as long as each other"):
        tune.pick_beyond_noise([1.0, 2.0], [[1.0]], 0)
    with pytest.raises(ValueError, match="the default's index 2"):
        tune.pick_beyond_noise([1.0, 2.0], [[1.0], [2.0]], 2)


def _scripted(
    monkeypatch: pytest.MonkeyPatch, rounds: dict[str, list[float]], **kwargs: object
) -> tune.TuneResult:
    """tune() on CPU with each point's time in each round given (ms, by label), not measured."""
    from uniep.moe import ops

    real = ops.moe_forward
    called: list[str] = []

    def spy(x, topk_idx, topk_weights, w1, w2, group=None, tuning=""):  # noqa: ANN001, ANN202
        called.append(tuning)
        return real(x, topk_idx, topk_weights, w1, w2, group, tuning)

    timed: dict[str, int] = {}
    default = _full("")

    def times(fn, warmup, iters, cuda):  # noqa: ANN001, ANN202
        fn()
        label = tune._label(called[-1], default)
        r = timed.get(label, 0)
        timed[label] = r + 1
        return [rounds[label][r]] * iters

    monkeypatch.setattr(ops, "moe_forward", spy)
    monkeypatch.setattr(tune, "_times_ms", times)
    monkeypatch.setattr(tune, "_calibrate", lambda *a, **k: tune.CostModel("cpu", 1e9, 1e9))
    return tune.tune(**{**SHAPE, **kwargs}, device="cpu", cache=False, **QUICK)


def test_tune_keeps_the_default_within_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    # The other point's median is lower, but its rounds overlap the default's.
    result = _scripted(monkeypatch, {"default": [8.0, 8.5], "tile_n=16": [5.0, 9.0]})
    assert [c.rounds_ms for c in result.candidates] == [[8.0, 8.5], [5.0, 9.0]]
    assert result.tuning == result.default and result.best_ms == result.default_ms == 8.25
    assert result.verdict == (
        "the default, 8.250 ms: the fastest point, tile_n=16 at 7.000 ms, is within noise: not "
        "faster in every round (round times: 5.000..9.000 ms, the default's 8.000..8.500 ms)"
    )
    assert "| 5.000..9.000 |" in result.table()


def test_tune_picks_a_point_faster_beyond_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _scripted(monkeypatch, {"default": [8.0, 8.4], "tile_n=16": [5.0, 5.2]})
    assert result.tuning == _full("tile_n=16") and result.best_ms == 5.1
    assert result.verdict == (
        "5.100 ms vs 8.200 ms for the default (1.61x), faster in every round (round times: "
        "5.000..5.200 ms, the default's 8.000..8.400 ms)"
    )


def test_tune_does_not_race_points_that_run_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # At hidden 16 and ffn 8 every tile_n runs loops of 16 columns: every point is the default's.
    result = _scripted(monkeypatch, {"default": [3.0, 2.0]}, ffn=8)
    assert result.distinct == 1 and result.considered == 1 + len(tune.CPU_TILES)
    assert [c.tuning for c in result.candidates] == [result.default] == [result.tuning]
    assert result.verdict.startswith(
        f"the default, 2.500 ms: all {result.considered} points run alike on the cpu executor "
        "at this shape (the CPU executor reads only tile_n"
    ), result.verdict


def test_packed_decode_batches_default_to_the_megakernel() -> None:
    # One token of top-8 over 128 experts: an empty string runs the MegaKernel on packed experts
    # (fused_by_default), so the tuner's default point is that one, every CTA sending.
    decode = tune.MoeShape(1, 2048, 768, 128, 8, 1, "bfloat16")
    points = tune.candidate_points(decode, "cuda", sm_count=132, weights="bf16_packed")
    first = uniep.TuningParams.parse(points[0])
    assert (first.overlap, first.comm_sms, first.skip_rounds, first.tile_m) == ("fused", 132, -1, 0)
    assert len(set(points)) == len(points)
    assert any(uniep.TuningParams.parse(t).overlap == "sequential" for t in points[1:])
    assert tune.packed_default_is_fused(decode)
    # Plain weights keep the separate launches first; so do prefill batches and other ranks.
    assert uniep.TuningParams.parse(tune.candidate_points(decode, "cuda")[0]).overlap == (
        "sequential"
    )
    for shape in (
        tune.MoeShape(4096, 2048, 768, 128, 8, 1, "bfloat16"),
        tune.MoeShape(1, 2048, 768, 128, 8, 2, "bfloat16"),
        tune.MoeShape(1, 2048, 96, 128, 8, 1, "bfloat16"),  # an FFN the MegaKernel does not take
    ):
        assert not tune.packed_default_is_fused(shape)
        packed = tune.candidate_points(shape, "cuda", sm_count=132, weights="bf16_packed")
        assert uniep.TuningParams.parse(packed[0]).overlap == "sequential"
