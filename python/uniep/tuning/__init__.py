"""Tuning: the tuning space's points and choosing one for a load.

- ``params``: the one parse of a tuning string (``parse``), into the typed ``TuningParams``
  that knows which keys were given;
- ``tuner``: ``uniep.tune(...)``, which times candidate points on the caller's shape and keeps a
  winner only if it beats the default beyond the noise and gives the same bits;
- ``cache``: the per-device JSON cache of winners that ``moe_forward(tuning="auto")`` reads.

The tuner imports the MoE engine it times, so this package's ``__init__`` imports only
``params``: ``uniep.moe`` reads the cache and parses strings without pulling the tuner in.
"""

from .params import TuningParams, as_string, parse

__all__ = ["TuningParams", "as_string", "parse"]
