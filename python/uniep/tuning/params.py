"""The tuning string's one parse: ``parse`` turns ``"sms=24/132,overlap=fused,..."`` (or a
``uniep.TuningParams``) into the typed object, which knows which keys were given
(``p.given("overlap")``, ``p.given_keys``) as well as every value with its default.

A key left at its default and the same value given are different requests (``overlap=fused``
named asks for the MegaKernel; the default lets each path pick its own launches), so code asks
the object, never the text. The torch ops take the string form: ``as_string`` gives the given keys
alone, which parse back to the same object.
"""

from __future__ import annotations

from .. import _C

TuningParams = _C.TuningParams


def parse(tuning: str | TuningParams, name: str = "tuning") -> TuningParams:
    """``tuning`` as a ``TuningParams`` (an object is returned as it is).

    Raises:
        TypeError: ``tuning`` is neither a str nor a TuningParams (the message says ``name``).
        ValueError: a bad key or value, naming it and what it accepts.
    """
    if isinstance(tuning, TuningParams):
        return tuning
    if not isinstance(tuning, str):
        raise TypeError(f"{name} must be a str or uniep.TuningParams, got {type(tuning).__name__}")
    return TuningParams.parse(tuning)


def as_string(tuning: str | TuningParams, name: str = "tuning") -> str:
    """The string form the torch ops take: a str as it is, an object's given keys alone."""
    if isinstance(tuning, str):
        return tuning
    return parse(tuning, name).to_string(given_only=True)
