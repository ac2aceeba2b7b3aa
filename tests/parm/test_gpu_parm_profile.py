"""The GPU mode of `uniep parm profile` and of the measured check (marker `gpu`).

Two local ranks share one GPU (as in test_gpu_parm.py: NVSHMEM's multiple processes per GPU,
host agreement over gloo; ``uniep.parm.profile`` pins the ranks to the first visible device).
With the quick settings of bench_parm.py (8 sizes, 3 calls each): at MP size 1 the EP
all-to-all, at MP size 2 the MP all-gather, reduce-scatter and all-reduce, each through the CUDA
executor's ``CudaBackend``, and a bf16 matmul are fitted; the fits must be finite with R^2
reported. Then two small bf16 layers are timed under every schedule on the CUDA executor, and
their rows must have the CPU rows' format. Nothing here checks a speed: the ranks time-slice
the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORLD = 2
LAYERS = [
    dict(tokens=512, hidden=256, ffn_hidden=512, num_experts=4, top_k=k, capacity_factor=1.2)
    for k in (1, 2)
]


def _check_fit(c: dict, samples: int) -> None:
    assert len(c["samples"]) == samples
    assert all(math.isfinite(t) and t > 0 for _, t in c["samples"]), c["samples"]
    assert math.isfinite(c["alpha"]) and math.isfinite(c["beta"])
    assert math.isfinite(c["r2"]) and c["r2"] <= 1.0 + 1e-9


def _quick_profile(mp_size: int) -> dict:
    from uniep.parm import profile as pp

    sizes = pp.default_sizes("cuda")[::2]
    result = pp.profile(WORLD, mp_size, sizes, iters=3, timeout_s=240, device="cuda")
    assert result["backend"] == "uniep-cuda" and result["device"] == "cuda"
    assert result["device_name"] == torch.cuda.get_device_name(0)
    for links in result["coefficients"].values():
        for c in links.values():
            _check_fit(c, len(sizes))
    _check_fit(result["gemm"], len(pp.CUDA_GEMM_SIZES))
    # A larger bf16 matmul takes longer.
    assert result["gemm"]["beta"] > 0
    return result


def test_profile_fits_the_all_to_all() -> None:
    result = _quick_profile(mp_size=1)
    assert {k: set(v) for k, v in result["coefficients"].items()} == {"all_to_all": {"inter"}}


def test_profile_fits_the_mp_collectives_and_measures_layers() -> None:
    from uniep import parm
    from uniep.parm.profile import cost_model_from_profile, measure_layers

    result = _quick_profile(mp_size=2)
    assert {k: set(v) for k, v in result["coefficients"].items()} == {
        "all_gather": {"intra"},
        "reduce_scatter": {"intra"},
        "all_reduce": {"intra"},
    }
    model = cost_model_from_profile(result)
    rows = measure_layers(WORLD, 2, LAYERS, iters=2, model=model, timeout_s=240, device="cuda")
    assert len(rows) == len(LAYERS)
    keys = {"measured", "predicted", "chosen", "measured_best", "right", "regret", "saa_chunks"}
    for cfg, row in zip(LAYERS, rows, strict=True):
        assert set(row) == set(cfg) | keys
        assert {k: row[k] for k in cfg} == cfg
        assert set(row["measured"]) == set(row["predicted"]) == set(parm.SCHEDULES)
        assert all(math.isfinite(t) and t > 0 for t in row["measured"].values())
        assert row["chosen"] in parm.SCHEDULES
        assert row["measured_best"] == min(row["measured"], key=row["measured"].get)
        assert row["right"] == (row["chosen"] == row["measured_best"])
        assert math.isfinite(row["regret"]) and row["regret"] >= 0
