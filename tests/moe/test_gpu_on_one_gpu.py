"""The GPU runtimes on one GPU (marker `gpu`): a group of one rank, and groups of two, four and
eight ranks that share the GPU.

The workers of test_gpu_ep.py, test_gpu_collectives.py and test_gpu_fused_ep.py (the MegaKernel
across ranks) run unchanged. At world size 1 every
expert-parallel round runs the whole path (layout, count exchange with itself, own rows,
copy-out, row lists, combine) against the CPU planner. At world sizes 2, 4 and 8 the processes
open the same GPU (NVSHMEM's multiple processes per GPU) and join over gloo: then the peer paths
run too (the count exchange with other ranks, the transfer's rows and signals through the peers'
symmetric heaps, the cross-rank combine, the collectives' pushes and signals, a peer that never
calls), so a one-GPU machine checks them bit for bit. Their speed says nothing (the processes'
kernels take turns on the GPU): speed needs the multi-GPU benchmarks.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from test_gpu_collectives import (
    _coll_timeout_worker,
    _collectives_worker,
    _gated_ag_worker,
    _gated_timeout_worker,
    _gemm_backends_worker,
    _subgroup_worker,
)
from test_gpu_ep import (
    _cached_worker,
    _ep_worker,
    _grad_worker,
    _ll_worker,
    _mixed_rounds_worker,
    _timeout_worker,
    _torch_nvshmem_first_worker,
)
from test_gpu_fused_ep import (
    check_fused_ep_backward_reports,
    check_fused_ep_reports,
    check_skip_messages,
    fused_ep_backward_op_worker,
    fused_ep_backward_skip_worker,
    fused_ep_backward_worker,
    fused_ep_graph_worker,
    fused_ep_skip_worker,
    fused_ep_worker,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EP_WORKERS: list[tuple[str, Callable[[int, int], object]]] = [
    ("dispatch_combine_moe", _ep_worker),
    ("cached_dispatch", _cached_worker),
    ("mixed_rounds", _mixed_rounds_worker),
    ("low_latency", _ll_worker),
    ("gradients", _grad_worker),
]
# What eight ranks sharing the GPU run too: the workers that check bits (rows, combines, outputs and
# gradients against the CPU executor or the world-1 kernels) at the EP8 layout's world size.
EIGHT_RANK_WORKERS = [(n, w) for n, w in EP_WORKERS if n != "mixed_rounds"]
SHARED_WORKERS = EP_WORKERS + [
    ("collectives", _collectives_worker),
    ("collectives_gemm_backends", _gemm_backends_worker),
]


def _run(
    worker: Callable[[int, int], object], world: int, monkeypatch: pytest.MonkeyPatch
) -> list[object]:
    from uniep.distributed import run_local_ranks

    if world > 1:
        # The ranks (spawned, so they read it afresh) see one GPU, also on a multi-GPU machine.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    # NCCL refuses two ranks on one device; the workers need only gloo's CPU collectives then.
    backend = "nccl" if world == 1 else "gloo"
    reports = run_local_ranks(worker, world, backend=backend, timeout_s=300)
    if worker is _mixed_rounds_worker:
        assert reports == [0] * world, f"mismatched mixed rounds per rank: {reports}"
    return reports


@pytest.mark.parametrize("worker", [w for _, w in EP_WORKERS], ids=[n for n, _ in EP_WORKERS])
def test_one_rank_against_cpu(
    worker: Callable[[int, int], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(worker, 1, monkeypatch)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "worker", [w for _, w in SHARED_WORKERS], ids=[n for n, _ in SHARED_WORKERS]
)
def test_ranks_sharing_the_gpu(
    worker: Callable[[int, int], object], world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(worker, world, monkeypatch)


@pytest.mark.parametrize(
    "worker", [w for _, w in EIGHT_RANK_WORKERS], ids=[n for n, _ in EIGHT_RANK_WORKERS]
)
def test_eight_ranks_sharing_the_gpu(
    worker: Callable[[int, int], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(worker, 8, monkeypatch)


@pytest.mark.parametrize(
    ("worker", "what"), [(_timeout_worker, "dispatch"), (_coll_timeout_worker, "reduce_scatter")]
)
def test_two_ranks_sharing_the_gpu_time_out_naming_the_peer(
    worker: Callable[[int, int], str], what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (message, _) = _run(worker, 2, monkeypatch)
    assert "timed out" in message and "rank 1" in message, message
    assert worker is _timeout_worker or what in message, message


@pytest.mark.hopper
@pytest.mark.parametrize("world", [2, 4, 8])
def test_gated_all_gather_matmul_ranks_sharing_the_gpu(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank's one persistent GEMM waits on its tiles' chunks, which the other ranks push.
    reports = _run(_gated_ag_worker, world, monkeypatch)
    assert all(r["checked"] for r in reports)  # type: ignore[index]


def test_subgroup_collectives_ranks_sharing_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two runtimes per rank over sub-groups of the 4 ranks, whose NVSHMEM spans all of them.
    reports = _run(_subgroup_worker, 4, monkeypatch)
    assert [len(r["groups"]) for r in reports] == [2, 2, 2, 2]  # type: ignore[index]


@pytest.mark.hopper
def test_gated_all_gather_matmul_times_out_naming_the_peer_on_a_shared_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (message, _) = _run(_gated_timeout_worker, 2, monkeypatch)
    assert "all-gather + GEMM" in message and "rank 1" in message, message


@pytest.mark.hopper
@pytest.mark.parametrize("world", [2, 4, 8])
def test_megakernel_ranks_sharing_the_gpu(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank's persistent launch waits on rows and outputs the other ranks' launches store:
    # with the GPU time-sliced between the processes, every wait still ends.
    check_fused_ep_reports(_run(fused_ep_worker, world, monkeypatch), world)


@pytest.mark.hopper
def test_megakernel_ranks_sharing_the_gpu_replay_a_cuda_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _run(fused_ep_graph_worker, 2, monkeypatch) == [3, 3]


@pytest.mark.hopper
def test_megakernel_rank_that_skips_a_call_is_named_on_a_shared_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_skip_messages(_run(fused_ep_skip_worker, 2, monkeypatch), 2)


@pytest.mark.hopper
@pytest.mark.parametrize("world", [2, 4, 8])
def test_megakernel_backward_ranks_sharing_the_gpu(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_fused_ep_backward_reports(_run(fused_ep_backward_worker, world, monkeypatch), world)


@pytest.mark.hopper
def test_megakernel_backward_op_fused_equals_sequential_on_a_shared_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _run(fused_ep_backward_op_worker, 2, monkeypatch) == [2, 2]


@pytest.mark.hopper
def test_megakernel_backward_rank_that_skips_a_call_is_named_on_a_shared_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_skip_messages(_run(fused_ep_backward_skip_worker, 2, monkeypatch), 2)


# Set by bench/device_check.sh while an MPS server runs for this GPU.
UNDER_MPS = os.environ.get("UNIEP_TEST_MPS") == "1"


@pytest.mark.skipif(
    not UNDER_MPS,
    reason="needs an MPS server for the GPU and UNIEP_TEST_MPS=1 (bench/device_check.sh): "
    "torch's symmetric memory uses NVSHMEM teams, which processes sharing a GPU have only "
    "under MPS",
)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_sharing_the_gpu_under_mps_join_torch_nvshmem(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVSHMEM takes full multi-process support only when the ranks' shares add up to the GPU.
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // world))
    reports = _run(_torch_nvshmem_first_worker, world, monkeypatch)
    assert reports == ["reused"] * world, reports
