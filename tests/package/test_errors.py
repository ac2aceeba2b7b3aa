"""Bad input raises an error whose message names the offending argument (one rank, CPU)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from uniep import _C

ERRORS = (ValueError, RuntimeError, TypeError)
T, H, FFN, E, K = 6, 16, 8, 4, 2


def _good() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()
    idx[0, 1] = -1
    return {
        "x": torch.randn(T, H, generator=gen),
        "topk_idx": idx,
        "topk_weights": torch.rand(T, K, generator=gen),
        "w1": torch.randn(E, H, 2 * FFN, generator=gen),
        "w2": torch.randn(E, FFN, H, generator=gen),
    }


def _forward(group: str = "", tuning: str = "", **changes: torch.Tensor) -> torch.Tensor:
    a = _good()
    a.update(changes)
    return torch.ops.uniep.moe_forward(
        a["x"], a["topk_idx"], a["topk_weights"], a["w1"], a["w2"], group, tuning
    )


def _backward(**changes: torch.Tensor) -> object:
    a = _good()
    grad_out = changes.pop("grad_out", torch.ones(T, H))
    a.update(changes)
    return torch.ops.uniep.moe_backward(
        grad_out, a["x"], a["topk_idx"], a["topk_weights"], a["w1"], a["w2"], "", ""
    )


def _idx_with(value: int) -> torch.Tensor:
    idx = _good()["topk_idx"].clone()
    idx[3, 0] = value
    return idx


def _strided(shape: tuple[int, ...]) -> torch.Tensor:
    """Right shape, not contiguous: every other element of the last dim of a wider tensor."""
    wide = torch.randn(*shape[:-1], 2 * shape[-1])
    return wide[..., ::2]


# (id, call, argument the message must name)
CASES: list[tuple[str, Callable[[], object], str]] = [
    ("x-int", lambda: _forward(x=torch.ones(T, H, dtype=torch.int32)), "x"),
    ("x-float16", lambda: _forward(x=torch.randn(T, H).half()), "x"),
    ("topk_idx-int32", lambda: _forward(topk_idx=_good()["topk_idx"].int()), "topk_idx"),
    (
        "topk_weights-float16",
        lambda: _forward(topk_weights=torch.rand(T, K).half()),
        "topk_weights",
    ),
    (
        "topk_weights-float64-with-float32-x",
        lambda: _forward(topk_weights=torch.rand(T, K, dtype=torch.float64)),
        "topk_weights",
    ),
    ("w1-dtype-not-x", lambda: _forward(w1=torch.randn(E, H, 2 * FFN).bfloat16()), "w1"),
    ("w2-dtype-not-x", lambda: _forward(w2=torch.randn(E, FFN, H, dtype=torch.float64)), "w2"),
    ("x-3d", lambda: _forward(x=torch.randn(1, T, H)), "x"),
    ("topk_idx-1d", lambda: _forward(topk_idx=torch.zeros(T, dtype=torch.int64)), "topk_idx"),
    (
        "topk_idx-tokens-mismatch",
        lambda: _forward(topk_idx=torch.zeros(T + 1, K, dtype=torch.int64)),
        "topk_idx",
    ),
    ("topk_weights-shape", lambda: _forward(topk_weights=torch.rand(T, K + 1)), "topk_weights"),
    ("w1-wrong-hidden", lambda: _forward(w1=torch.randn(E, H + 1, 2 * FFN)), "w1"),
    ("w1-not-2i-wide", lambda: _forward(w1=torch.randn(E, H, 2 * FFN + 2)), "w[12]"),
    ("w1-2d", lambda: _forward(w1=torch.randn(H, 2 * FFN)), "w1"),
    ("w2-wrong-hidden", lambda: _forward(w2=torch.randn(E, FFN, H + 3)), "w2"),
    ("w2-wrong-ffn", lambda: _forward(w2=torch.randn(E, FFN + 1, H)), "w2"),
    ("w2-experts-not-w1", lambda: _forward(w2=torch.randn(E - 1, FFN, H)), "w2"),
    ("x-non-contiguous", lambda: _forward(x=_strided((T, H))), "x"),
    ("w1-on-meta", lambda: _forward(w1=torch.randn(E, H, 2 * FFN, device="meta")), "w1"),
    ("topk_idx-expert-too-large", lambda: _forward(topk_idx=_idx_with(E)), "topk_idx"),
    ("topk_idx-expert-below-minus-1", lambda: _forward(topk_idx=_idx_with(-2)), "topk_idx"),
    ("tuning-unknown-key", lambda: _forward(tuning="tile_m=64,warp_size=32"), "warp_size"),
    ("tuning-bad-value", lambda: _forward(tuning="overlap=sometimes"), "overlap"),
    ("tuning-tile_m-0", lambda: _forward(tuning="tile_m=0"), "tile_m"),
    ("tuning-not-key-value", lambda: _forward(tuning="stages"), "stages"),
    ("unknown-group", lambda: _forward(group="no-such-group"), "group_name"),
    ("backward-grad_out-shape", lambda: _backward(grad_out=torch.ones(T, H + 1)), "grad_out"),
    (
        "backward-grad_out-dtype",
        lambda: _backward(grad_out=torch.ones(T, H, dtype=torch.float64)),
        "grad_out",
    ),
    ("backward-topk_idx-too-large", lambda: _backward(topk_idx=_idx_with(E + 5)), "topk_idx"),
    (
        "routing_layout-experts-not-divisible",
        lambda: torch.ops.uniep.routing_layout(torch.zeros(4, 2, dtype=torch.int64), 8, 3),
        "num_experts",
    ),
    (
        "routing_layout-topk_idx-int32",
        lambda: torch.ops.uniep.routing_layout(torch.zeros(4, 2, dtype=torch.int32), 8, 2),
        "topk_idx",
    ),
    (
        "routing_layout-expert-too-large",
        lambda: torch.ops.uniep.routing_layout(torch.full((4, 2), 8, dtype=torch.int64), 8, 2),
        "topk_idx",
    ),
    (
        "routing_layout-world_size-0",
        lambda: torch.ops.uniep.routing_layout(torch.zeros(4, 2, dtype=torch.int64), 8, 0),
        "world_size",
    ),
]


@pytest.mark.parametrize(("call", "name"), [pytest.param(c, n, id=i) for i, c, n in CASES])
def test_bad_argument_is_named(call: Callable[[], object], name: str) -> None:
    # Word boundaries: "x" must be the argument x, not a letter inside another word.
    with pytest.raises(ERRORS, match=rf"\b{name}\b"):
        call()


def test_good_arguments_pass() -> None:
    """The baseline every case above perturbs is itself valid."""
    y = _forward()
    assert y.shape == (T, H) and torch.isfinite(y).all()
    assert len(_backward()) == 4


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("warp_size=32", "warp_size"),
        ("tile_m=abc", "tile_m"),
        ("tile_m=0", "tile_m"),
        ("tile_m=96", "tile_m"),
        ("tile_n=512", "tile_n"),
        ("tile_k=8", "tile_k"),
        ("stages=0", "stages"),
        ("token_tile=", "token_tile"),
        ("token_tile=-4", "token_tile"),
        ("overlap=overlapped", "overlap"),
        ("dispatch=fp4", "dispatch"),
        ("sms=24/12", "sms"),
        ("sms=x/132", "sms"),
        ("tile_m=64,tile_m=128", "tile_m"),
        ("tile_k", "tile_k"),
    ],
)
def test_tuning_parse_error_names_key(text: str, name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _C.TuningParams.parse(text)


# ---- absurd expert and rank counts: a named ValueError, never a failed allocation ----

_IDX = torch.zeros(4, 2, dtype=torch.int64)
# (num_experts, world_size, the message): the bound names the argument, the limit and the value.
_E_MAX = "num_experts must be <= 1048576 (2**20, uniep::kMaxExperts), got "
_W_MAX = "world_size must be <= 65536 (2**16, uniep::kMaxWorldSize), got "
BOUNDS = [
    pytest.param(2**40, 1, _E_MAX + str(2**40), id="E-2**40"),
    pytest.param(2**21, 2, _E_MAX + str(2**21), id="E-2**21"),
    pytest.param(2**20, 2**17, _W_MAX + str(2**17), id="W-2**17"),
    pytest.param(2**40, 2**40, _W_MAX + str(2**40), id="both-2**40"),
]


@pytest.mark.parametrize(("experts", "world", "words"), BOUNDS)
def test_routing_layout_bounds_counts(experts: int, world: int, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        torch.ops.uniep.routing_layout(_IDX, experts, world)


@pytest.mark.parametrize(("experts", "world", "words"), BOUNDS)
def test_routing_layout_fake_bounds_counts(experts: int, world: int, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        torch.ops.uniep.routing_layout(_IDX.to("meta"), experts, world)


def test_routing_layout_at_the_bounds() -> None:
    per_rank, per_expert, in_rank = torch.ops.uniep.routing_layout(_IDX, 2**20, 2**16)
    assert per_expert.shape == (2**20,) and per_rank.shape == (2**16,)
    assert in_rank.shape == (4, 2**16)
    assert per_expert[0] == 8 and per_expert[1:].sum() == 0 and per_rank[0] == 4
    fake = torch.ops.uniep.routing_layout(_IDX.to("meta"), 2**20, 2**16)
    assert [t.shape for t in fake] == [per_rank.shape, per_expert.shape, in_rank.shape]


def test_expert_rows_bounds_num_experts() -> None:
    src, idx, from_rank = (
        torch.zeros(0, dtype=torch.int64),
        _IDX[:0],
        torch.zeros(1, dtype=torch.int64),
    )
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match="num_experts must be <= 1048576"):
            torch.ops.uniep.expert_rows(
                src.to(device), idx.to(device), from_rank.to(device), 0, 2**40, 1
            )


# ---- a NUL inside a tuning string: a C string would end there and hide what follows ----


@pytest.mark.parametrize(
    ("text", "position"),
    [
        ("sms=24\x00garbage", 6),
        ("\x00", 0),
        ("tile_m=64,\x00stages=2", 10),
        ("dispatch=bf16\x00", 13),
    ],
)
def test_tuning_parse_rejects_nul(text: str, position: int) -> None:
    with pytest.raises(ValueError, match=rf"tuning: NUL character at position {position} "):
        _C.TuningParams.parse(text)


def test_tuning_with_nul_rejected_by_the_op() -> None:
    with pytest.raises(ValueError, match="NUL character at position 6"):
        _forward(tuning="sms=24\x00garbage")


def test_grown_capacity() -> None:
    """The GPU runtime's token capacity when it is created or grown (uniep.moe.ep, pure)."""
    from uniep.moe.ep import grown_capacity

    assert grown_capacity(None, 1) == 256
    assert grown_capacity(None, 256) == 256
    assert grown_capacity(None, 257) == 512
    assert grown_capacity(None, 1000) == 1024
    assert grown_capacity(256, 1000) == 1024
    assert grown_capacity(4096, 1000) == 4096  # never smaller than before
