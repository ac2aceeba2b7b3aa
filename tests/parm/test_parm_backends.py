"""The Parm step interpreter over its two backends, on CPU (no marker).

- ``chunk_pipeline`` (the CUDA executor's SAA pipelining) equals the unpipelined pair for every
  chunk count, also when the second halves run late and in reverse order (as a second stream may
  run them).
- ``CudaBackend`` on CPU tensors runs the CUDA executor's plumbing (the collectives on the MP
  and EP sub-groups, the ulysses all-to-all as a block all-to-all, the chunked SAA pairs) over
  UniEP's CPU collectives: on gloo ranks it must equal the CPU executor (``GlooBackend``) for
  baseline, S1 and S2, forward and backward. Only the streams, the NVSHMEM runtimes and
  torch._grouped_mm are left to tests/parm/test_gpu_parm.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _parm_cases import SCHEDULES, case_tensors
from uniep.parm.executor import CHUNK_DIM, SerialLanes, chunk_pipeline


class _LateLanes:
    """Runs every second half at ``join``, last chunk first: what a side stream may do."""

    def __init__(self) -> None:
        self.queue: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, Any]] = []

    def run_second(
        self, second: Callable[[torch.Tensor], torch.Tensor], mid: torch.Tensor
    ) -> torch.Tensor:
        shape = second(mid.to("meta")).shape
        out = torch.full(shape, float("nan"), dtype=mid.dtype)
        self.queue.append((second, mid, out))
        return out

    def join(self, outs: list[torch.Tensor]) -> None:
        for second, mid, out in reversed(self.queue):
            out.copy_(second(mid))
        self.queue.clear()


def _first(t: torch.Tensor) -> torch.Tensor:
    """An all-to-all-like move: blocks of dim 0 permuted and rescaled, rows kept in place."""
    G = t.shape[0]
    return torch.stack([t[(i + 1) % G] * (i + 2) for i in range(G)])


def _second(t: torch.Tensor) -> torch.Tensor:
    """An all-gather-like move: three "ranks'" copies stacked in front, rows kept in place."""
    return torch.stack([t, t.flip(0) - 1.0, 2.0 * t])


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 7, 100])
@pytest.mark.parametrize("lanes", [SerialLanes, _LateLanes])
def test_chunk_pipeline_equals_unpipelined(rows: int, chunks: int, lanes: type) -> None:
    t = torch.randn(4, 3, rows, 6, dtype=torch.float64)
    want = _second(_first(t))
    got = chunk_pipeline(_first, _second, t, chunks, lanes())
    assert got.shape == want.shape and CHUNK_DIM == -2
    assert torch.equal(got, want)


def test_chunk_pipeline_rejects_bad_chunks() -> None:
    with pytest.raises(ValueError, match="chunks must be an int >= 1, got 0"):
        chunk_pipeline(_first, _second, torch.zeros(2, 3, 4), 0, SerialLanes())
    from uniep.parm.cuda import set_saa_chunks

    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        set_saa_chunks(-1)


BASE = dict(M=8, H=6, E=4, k=2, f=2.0, seed=0, chunks=3)
CASES: list[dict[str, Any]] = [
    dict(BASE, name="n2-odd-shapes", N=2, S=13, M=7, H=10, seed=2),
    dict(BASE, name="n2-k8", N=2, S=7, E=8, k=8, f=0.0, seed=4, chunks=2),
    dict(BASE, name="n2-empty-experts-drop", N=2, S=16, f=1.0, one_expert=True, seed=7),
    dict(BASE, name="n4-mp-only", N=4, S=11, H=8, k=3, f=0.0, seed=8, chunks=1),
    dict(BASE, name="n1-ep-only", N=1, S=6, k=1, f=1.0, one_expert=True, seed=9),
]


def _compare_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Per case, dtype and schedule: the largest relative difference between the two backends
    over (y, l_aux, dx, d gate, d w1, d w2), and the dropped-pair counts of both."""
    from uniep import _C
    from uniep.parm import new_groups
    from uniep.parm.cpu import CpuExecutor, Groups
    from uniep.parm.cuda import CudaExecutor
    from uniep.parm.ops import _shape

    report = []
    for case in cases:
        N = case["N"]
        G = world // N
        mp, ep = new_groups(N)
        m, g = rank % N, rank // N
        groups = Groups(mp=mp, ep=ep, mp_size=N, ep_size=G, mp_index=m, ep_index=g)
        t = case_tensors(dict(case, world=world))
        E_loc, Hn = case["E"] // G, case["H"] // N
        es, hs = slice(g * E_loc, (g + 1) * E_loc), slice(m * Hn, (m + 1) * Hn)
        for dtype in (torch.float64, torch.float32):
            gate = t["gate"].float()
            w1 = t["w1"][es, :, hs].to(dtype).contiguous()
            w2 = t["w2"][es, hs, :].to(dtype).contiguous()
            x, dy = t["x"][g].to(dtype), t["dy"][g].to(dtype)
            dl = t["dl"][g].float()
            shape = _shape(x, gate, w1, N, G, case["k"], case["f"])
            for schedule in SCHEDULES:
                fwd = _C.parm.build_steps(shape, schedule, "forward")
                bwd = _C.parm.build_steps(shape, schedule, "backward")
                got = []
                for ex in (
                    CpuExecutor(shape, groups, "drop"),
                    CudaExecutor(shape, groups, "drop", chunks=case["chunks"]),
                ):
                    y, laux, st = ex.forward(x, gate, w1, w2, fwd)
                    grads = ex.backward(st, dy, dl, gate, w1, w2, bwd)
                    got.append(((y, laux, *grads), st.stats["dropped"]))
                (want, drop_cpu), (have, drop_uniep) = got
                err = max(
                    float((a.double() - b.double()).abs().max() / b.double().abs().max())
                    for a, b in zip(have, want, strict=True)
                )
                report.append((case["name"], str(dtype), schedule, err, drop_cpu, drop_uniep))
    return report


def test_uniep_collectives_backend_equals_gloo_backend() -> None:
    reports = run_ranks(4, _compare_worker, CASES)
    dropped_somewhere = False
    for per_rank in reports:
        for name, dtype, schedule, err, drop_cpu, drop_uniep in per_rank:
            # float64: the sums add the same partials in another order (reduce_order).
            tol = 1e-12 if dtype == "torch.float64" else 1e-5
            assert err <= tol, (name, dtype, schedule, err)
            assert drop_cpu == drop_uniep, (name, dtype, schedule, drop_cpu, drop_uniep)
            dropped_somewhere |= drop_cpu > 0
    assert dropped_somewhere, "no case dropped a pair: the overflow path went untested"
