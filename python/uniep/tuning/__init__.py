"""Tuning: choosing a point of the tuning space for a load.

- ``tuner``: ``uniep.tune(...)``, which times candidate points on the caller's shape and keeps a
  winner only if it beats the default beyond the noise and gives the same bits;
- ``cache``: the per-device JSON cache of winners that ``moe_forward(tuning="auto")`` reads.

The tuner imports the MoE engine it times, so this package's ``__init__`` imports neither module:
``uniep.moe`` reads the cache without pulling the tuner in.
"""
