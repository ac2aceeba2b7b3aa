"""The tuning string's one parse (uniep.tuning.params, include/uniep/tuning.hpp): the typed object
knows which keys were given, and the MegaKernel's choice reads that, not the text."""

from __future__ import annotations

import pytest
import uniep
from uniep.moe.megakernel.launch import megakernel_overlap, runs_fused
from uniep.tuning import as_string, parse


def test_parse_records_the_given_keys_in_key_order() -> None:
    p = parse(" overlap = fused , sms=16/100,tile_m=64")
    assert p.given_keys == ["sms", "tile_m", "overlap"]
    assert p.given("overlap") and p.given("sms") and not p.given("dispatch")
    assert (p.comm_sms, p.total_sms, p.tile_m, p.overlap) == (16, 100, 64, "fused")
    assert parse("").given_keys == []


def test_the_given_form_parses_back_to_the_same_keys_and_values() -> None:
    for text in ("", "overlap=chunked", "dispatch=fp8,experts=bf16,skip_rounds=3", "sms=8"):
        p = parse(text)
        again = parse(p.to_string(given_only=True))
        assert again == p and again.given_keys == p.given_keys, text
        # The full form gives every key: the same values, all of them named.
        assert parse(p.to_string()) == p
        assert len(parse(p.to_string()).given_keys) == 13


def test_setters_mark_their_key_given_and_equality_ignores_it() -> None:
    p = uniep.TuningParams()
    assert p.given_keys == []
    p.total_sms = 132
    p.overlap = "chunked"
    assert p.given_keys == ["sms", "overlap"]
    q = parse("sms=24/132,overlap=chunked")
    assert p == q
    # Same values, different keys given: still equal (given is not part of the value).
    assert parse("overlap=fused") == parse("")


def test_a_bad_setter_value_names_the_key() -> None:
    p = uniep.TuningParams()
    with pytest.raises(ValueError, match="overlap must be sequential, chunked or fused"):
        p.overlap = "pipelined"
    assert p.given_keys == []
    with pytest.raises(ValueError, match="unknown key 'overlapp'"):
        p.given("overlapp")


def test_parse_takes_an_object_as_it_is_and_names_a_wrong_type() -> None:
    p = parse("tile_m=64")
    assert parse(p) is p
    assert as_string(p) == "tile_m=64" and as_string("overlap=fused") == "overlap=fused"
    with pytest.raises(TypeError, match="tuning must be a str or uniep.TuningParams, got int"):
        parse(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer_tuning must be"):
        parse(None, "layer_tuning")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tuning", "world", "expect"),
    [
        ("", 1, None),  # overlap left at its default: the separate launches
        ("overlap=fused", 1, "fused"),
        ("overlap=fused", 4, "fused"),
        ("overlap=chunked", 1, "streams"),
        ("overlap=chunked", 2, None),
        ("overlap=fused,dispatch=fp8", 1, None),  # numerics the MegaKernel has not
        ("overlap=sequential", 1, None),
    ],
)
def test_the_megakernel_choice_reads_the_given_keys(
    tuning: str, world: int, expect: str | None
) -> None:
    assert megakernel_overlap(tuning, world) == expect
    assert megakernel_overlap(parse(tuning), world) == expect
    assert runs_fused(tuning) == (expect == "fused")
    # An object with overlap set through its setter asks as the string does.
    p = uniep.TuningParams()
    assert megakernel_overlap(p, 1) is None
    p.overlap = "fused"
    assert megakernel_overlap(p, 1) == "fused"
    assert megakernel_overlap("overlap=fused", 1, hidden=96, ffn=128) is None


def test_an_object_reaches_the_ops_as_its_given_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TuningParams handed to moe_forward, the nn modules or moe_forward_prepared means what
    its string form means: keys it does not give stay unasked (an empty object consults the tune
    cache as "" does; written out at their defaults, overlap=fused would ask for the MegaKernel)."""
    import torch
    from uniep.moe.prepared import moe_forward_prepared, prepare_experts
    from uniep.tuning import cache as tune_cache

    seen: list[str] = []

    def spy(*args: object, **kwargs: object) -> str:
        seen.append("cache")
        return ""

    monkeypatch.setattr(tune_cache, "tuning_for_call", spy)
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    weights, idx = torch.randn(6, 4).softmax(-1).topk(2, dim=-1)
    w1, w2 = torch.randn(4, 16, 32), torch.randn(4, 16, 16)
    y = uniep.moe_forward(x, idx, weights, w1, w2, tuning=uniep.TuningParams())
    assert seen == ["cache"]
    given = uniep.moe_forward(x, idx, weights, w1, w2, tuning=parse("dispatch=bf16"))
    assert seen == ["cache"]  # a given key: no cache lookup, as for the string
    assert torch.equal(y, given)

    layer = uniep.nn.MoELayer(
        hidden=16, ffn_hidden=16, num_experts=4, top_k=2, tuning=parse("dispatch=bf16")
    )
    assert layer.tuning == "dispatch=bf16"
    assert uniep.nn.MoELayer(16, 16, 4, 2, tuning=uniep.TuningParams()).tuning == ""

    experts = prepare_experts(w1, w2, "bf16_packed")
    as_object = moe_forward_prepared(x, idx, weights, experts, tuning=parse("dispatch=bf16"))
    assert torch.equal(
        as_object, moe_forward_prepared(x, idx, weights, experts, tuning="dispatch=bf16")
    )


def test_spaces_around_the_sms_slash_as_around_the_other_separators() -> None:
    assert parse(" sms = 24 / 132 , tile_m = 64 ") == parse("sms=24/132,tile_m=64")
