"""Logical nodes on the CPU executor: a group declared as N nodes of L ranks (``uniep.init(group,
ranks_per_node=L)``) moves its tokens in two levels (docs/multinode.md): once per (token, node)
on the rail to the relay with the source's local index, then over "NVLink" to the expert ranks;
the combine is the mirror. Gloo ranks stand in for both engines.

What must hold, 2 x 2, 2 x 4 and 4 x 2:
- combine=per_k and rank_partials give the flat path's bits, forward and backward;
- combine=node_partials equals its documented order (each node's k's summed on the relay in
  ascending k, one rounding, then the nodes' partials in ascending node order), rebuilt here from
  the per-(token, k) expert outputs; on one node it is per_k's bits;
- bad topologies raise a clear error on every rank.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np
import pytest
import torch
import uniep
from _dist import run_ranks, run_ranks_once
from _moe_cases import MoeCase, rank_inputs, same_bits
from uniep import _C

# world -> the node sizes tried (each below the world: the group spans nodes).
TOPOLOGIES = {4: [2], 8: [4, 2]}
CASES = {
    4: [
        MoeCase("w4-random-k4-bf16", (9, 0, 7, 11), 40, 16, 8, 4, "bfloat16", seed=70),
        MoeCase("w4-one-rank-k2-f32", (5, 6, 4, 3), 24, 8, 8, 2, "float32", "one_rank", 71),
    ],
    8: [
        MoeCase("w8-random-k6-bf16", (5, 3, 0, 6, 4, 7, 2, 5), 32, 8, 16, 6, "bfloat16", seed=72),
        MoeCase("w8-random-k3-f64", (3, 4, 2, 5, 1, 3, 4, 2), 24, 8, 8, 3, "float64", seed=73),
    ],
}
NAMES = ("x", "topk_weights", "w1", "w2")
STORE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _forward_backward(
    inp: dict[str, torch.Tensor], tuning: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = inp["x"].clone().requires_grad_(True)
    w = inp["topk_weights"].clone().requires_grad_(True)
    w1 = inp["w1"].clone().requires_grad_(True)
    w2 = inp["w2"].clone().requires_grad_(True)
    y = uniep.moe_forward(x, inp["topk_idx"], w, w1, w2, tuning=tuning)
    y.backward(inp["grad_out"])
    return y.detach(), [x.grad, w.grad, w1.grad, w2.grad]


def _outputs(inp: dict[str, torch.Tensor], with_choices: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["per_k"], out["grads"] = _forward_backward(inp, "")
    out["rank_partials"], _ = _forward_backward(inp, "combine=rank_partials")
    x, idx, w, w1, w2 = (inp[k] for k in ("x", "topk_idx", "topk_weights", "w1", "w2"))
    out["node_partials"] = uniep.moe_forward(x, idx, w, w1, w2, tuning="combine=node_partials")
    if with_choices:
        # y_(t, k) for every choice: one choice kept, weight 1 (exact in every dtype).
        ys = []
        for k in range(idx.shape[1]):
            only = torch.full_like(idx, -1)
            only[:, k] = idx[:, k]
            ones = torch.zeros_like(w)
            ones[:, k] = 1.0
            ys.append(uniep.moe_forward(x, only, ones, w1, w2))
        out["ys"] = ys
    return out


def topology_worker(rank: int, world: int, cases: list[MoeCase]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for case in cases:
        try:
            inp = rank_inputs(case, rank)
            uniep.init(ranks_per_node=world)  # one node: the flat path
            flat = _outputs(inp, with_choices=True)
            per_node = {}
            for nodes_of in TOPOLOGIES[world]:
                rt = uniep.init(ranks_per_node=nodes_of)
                assert rt.ranks_per_node == nodes_of
                per_node[nodes_of] = _outputs(inp, with_choices=False)
            uniep.init(ranks_per_node=world)
            results[case.name] = {"flat": flat, "nodes": per_node, "inp": inp}
        except Exception:
            results[case.name] = traceback.format_exc()
    return results


_RESULTS: dict[int, Any] = {}


def _results(world: int) -> list[dict[str, Any]]:
    return run_ranks_once(_RESULTS, world, topology_worker, CASES[world], timeout=300)


def _case(world: int, case: MoeCase) -> list[dict[str, Any]]:
    per_rank = [r[case.name] for r in _results(world)]
    for rank, r in enumerate(per_rank):
        if isinstance(r, str):
            pytest.fail(f"rank {rank} of {case.name}:\n{r}")
    return per_rank


def _node_partials_reference(case: MoeCase, r: dict[str, Any], nodes_of: int) -> torch.Tensor:
    """The documented order, from the per-(token, k) outputs: relay sums of each node's k's
    (ascending k, fp32 or fp64, weights applied, one rounding), then the nodes in order."""
    inp, ys = r["inp"], r["flat"]["ys"]
    idx, w = inp["topk_idx"], inp["topk_weights"]
    store = STORE[case.dtype]
    acc = torch.float64 if store == torch.float64 else torch.float32
    node_of_expert = (idx // case.experts_per_rank) // nodes_of
    total = torch.zeros(idx.shape[0], case.hidden, dtype=acc)
    for n in range(case.world_size // nodes_of):
        part = torch.zeros(idx.shape[0], case.hidden, dtype=acc)
        for k in range(case.top_k):
            here = ((idx[:, k] >= 0) & (node_of_expert[:, k] == n)).unsqueeze(1)
            term = w[:, k : k + 1].to(acc) * ys[k].to(acc)
            part = part + torch.where(here, term, torch.zeros_like(term))
        total = total + part.to(store).to(acc)
    return total.to(store)


@pytest.mark.parametrize(
    ("world", "case"), [(w, c) for w, cases in CASES.items() for c in cases], ids=lambda v: str(v)
)
def test_two_levels_keep_the_flat_bits_and_the_node_order(world: int, case: MoeCase) -> None:
    differs: set[int] = set()
    for rank, r in enumerate(_case(world, case)):
        flat = r["flat"]
        # One node: node partials are per_k's sum rounded once more to what it is.
        assert same_bits(flat["node_partials"], flat["per_k"]), f"rank {rank}: one node"
        for nodes_of, got in r["nodes"].items():
            where = f"rank {rank}, {world // nodes_of} nodes of {nodes_of}"
            assert same_bits(got["per_k"], flat["per_k"]), f"{where}: per_k forward"
            for name, a, b in zip(NAMES, got["grads"], flat["grads"], strict=True):
                assert same_bits(a, b), f"{where}: grad of {name}"
            assert same_bits(got["rank_partials"], flat["rank_partials"]), f"{where}: rank_partials"
            ref = _node_partials_reference(case, r, nodes_of)
            assert same_bits(got["node_partials"], ref), f"{where}: node_partials order"
            if not same_bits(got["node_partials"], flat["per_k"]):
                differs.add(nodes_of)
    if case.dtype == "bfloat16" and case.routing == "random":
        # The node order rounds where per_k does not, on some rank: the topology took effect.
        assert differs == set(TOPOLOGIES[world]), differs


def _flat_slot_owner(all_topk: list[np.ndarray], experts: int, dest: int) -> list[tuple[int, int]]:
    owners: list[tuple[int, int]] = []
    for src in range(len(all_topk)):
        plan = _C.build_rank_plan(all_topk, experts, src)
        lo, hi = plan["send_offsets"][dest], plan["send_offsets"][dest + 1]
        owners += [(src, int(t)) for t in plan["send_tokens"][lo:hi]]
    return owners


@pytest.mark.parametrize(("world", "nodes_of"), [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_relays_deliver_every_row_to_its_flat_slot(world: int, nodes_of: int) -> None:
    gen = torch.Generator().manual_seed(world * 10 + nodes_of)
    experts, top_k = 2 * world, 3
    all_topk = []
    for r in range(world):
        idx = torch.rand(3 + r, experts, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
        idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
        all_topk.append(idx.numpy())
    plans = [_C.build_node_plan(all_topk, experts, nodes_of, r) for r in range(world)]
    for dest in range(world):
        node, local = divmod(dest, nodes_of)
        arrived: list[tuple[int, int]] = []
        for j in range(nodes_of):
            relay = plans[node * nodes_of + j]
            lo, hi = relay["forward_offsets"][local], relay["forward_offsets"][local + 1]
            rows = relay["forward_rows"][lo:hi]
            arrived += [
                (int(relay["relayed_src_rank"][i]), int(relay["relayed_token"][i])) for i in rows
            ]
        slots = plans[dest]["arrival_slots"]
        assert sorted(slots.tolist()) == list(range(len(arrived)))
        placed = [None] * len(arrived)
        for slot, owner in zip(slots, arrived, strict=True):
            placed[slot] = owner
        assert placed == _flat_slot_owner(all_topk, experts, dest), f"rank {dest}"
    # The rail carries one row per (token, node): a token crosses to a node once, whatever the
    # number of its experts there.
    for src in range(world):
        sent = plans[src]["node_send_offsets"]
        for n in range(world // nodes_of):
            ranks = range(n * nodes_of, (n + 1) * nodes_of)
            owner = all_topk[src] // (experts // world)
            bound = [t for t, row in enumerate(owner) if any(o >= 0 and o in ranks for o in row)]
            got = plans[src]["node_send_tokens"][sent[n] : sent[n + 1]].tolist()
            assert got == bound, f"rank {src} to node {n}"


def bad_topology_worker(rank: int, world: int) -> dict[str, str]:
    case = MoeCase("w4-bad", (3, 2, 4, 1), 16, 8, 8, 2, "float32", seed=74)
    inp = rank_inputs(case, rank)
    args = [inp[k] for k in ("x", "topk_idx", "topk_weights", "w1", "w2")]
    errors: dict[str, str] = {}
    # torchrun's LOCAL_WORLD_SIZE splits WORLD into nodes when init does not say otherwise.
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    errors["launcher"] = str(uniep.distributed.ranks_per_node())
    # The CUDA runtimes stop at one NVLink domain: their start-up refuses the group.
    try:
        uniep.distributed.nvshmem_bootstrap(None)
    except NotImplementedError as e:
        errors["cuda"] = str(e)
    try:
        uniep.init(ranks_per_node=3)
    except ValueError as e:
        errors["init"] = str(e)
    # Ranks that disagree: rank 0 declares nodes of 2, the others one node.
    uniep.init(ranks_per_node=2 if rank == 0 else world)
    try:
        uniep.moe_forward(*args)
    except Exception as e:
        errors["disagree"] = f"{type(e).__name__}: {e}"
    # A node size that does not divide the world, recorded past init's check.
    _C.set_ranks_per_node(uniep.distributed.group_name(), 3)
    try:
        uniep.moe_forward(*args)
    except Exception as e:
        errors["divide"] = f"{type(e).__name__}: {e}"
    uniep.init(ranks_per_node=world)
    return errors


def test_bad_topologies_raise_on_every_rank() -> None:
    results = run_ranks(4, bad_topology_worker)
    for rank, errors in enumerate(results):
        assert errors["launcher"] == "2", errors
        assert "spans 2 nodes of 2 ranks" in errors["cuda"], errors
        assert "ranks_per_node must divide the group's 4 ranks" in errors["init"], errors
        assert "ranks per node" in errors["disagree"], (rank, errors)
        assert "rank 0 has 2" in errors["disagree"] or "differs" in errors["disagree"], errors
        assert "ranks_per_node (3) must divide the world size (4)" in errors["divide"], errors


def uneven_launcher_worker(rank: int, world: int) -> dict[str, str]:
    case = MoeCase("w4-uneven", (3, 2, 4, 1), 16, 8, 8, 2, "float32", seed=75)
    inp = rank_inputs(case, rank)
    args = [inp[k] for k in ("x", "topk_idx", "topk_weights", "w1", "w2")]
    # A launcher's nodes of 3 and 1 ranks (LOCAL_WORLD_SIZE differs by node): neither read as
    # one node nor left for the ranks to disagree about.
    os.environ["LOCAL_WORLD_SIZE"] = "3" if rank < 3 else "1"
    errors = {"launcher": str(uniep.distributed.ranks_per_node())}
    try:
        uniep.distributed.nvshmem_bootstrap(None)
    except NotImplementedError as e:
        errors["cuda"] = str(e)
    try:
        uniep.moe_forward(*args)
    except ValueError as e:
        errors["forward"] = str(e)
    uniep.init(ranks_per_node=world)
    return errors


def test_a_launcher_node_size_that_does_not_divide_the_world_raises_on_every_rank() -> None:
    results = run_ranks(4, uneven_launcher_worker)
    for rank, errors in enumerate(results):
        assert errors["launcher"] == ("3" if rank < 3 else "1"), errors
        if rank < 3:
            assert "declares nodes of 3 ranks, which do not divide its 4" in errors["cuda"], errors
        assert "ranks_per_node (3) must divide the world size (4)" in errors["forward"], errors
        assert "LOCAL_WORLD_SIZE" in errors["forward"], errors


def reinit_worker(rank: int, world: int) -> dict[str, int]:
    import datetime
    import socket

    import torch.distributed as dist

    # The next group's port, from rank 0, over this group.
    port = [0]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    uniep.init(ranks_per_node=1)  # nodes of one rank
    before = uniep.distributed.ranks_per_node()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    # torch names the new WORLD "0" again: the old group's nodes must not come with the name.
    runtime = uniep.init()
    return {
        "before": before,
        "after": uniep.distributed.ranks_per_node(),
        "rt": runtime.ranks_per_node,
    }


def test_a_new_group_under_a_reused_name_starts_as_one_node() -> None:
    for rep in run_ranks(2, reinit_worker):
        assert rep == {"before": 1, "after": 2, "rt": 2}, rep


def test_init_checks_ranks_per_node_alone() -> None:
    with pytest.raises(ValueError, match="ranks_per_node must be an int"):
        uniep.init(ranks_per_node=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ranks_per_node must be 1"):
        uniep.init(ranks_per_node=2)
    assert uniep.init(ranks_per_node=1).ranks_per_node == 1
    uniep.init()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def composed_worker(rank: int, world: int, case: MoeCase, nodes_of: int) -> dict[str, Any]:
    # The composition the CUDA path runs (rail exchange, each node's own call, the combine at
    # home), here on CPU tensors, where its node calls run the CPU executor.
    from uniep.moe import multinode_cuda

    uniep.init(ranks_per_node=nodes_of)
    inp = rank_inputs(case, rank)
    group = uniep.distributed.default_group()
    out: dict[str, Any] = {}
    for combine in ("node_partials", "per_k"):
        tuning = f"combine={combine}"
        leaves = [inp[k].clone().requires_grad_(True) for k in ("x", "topk_weights", "w1", "w2")]
        composed = multinode_cuda.moe_forward(
            leaves[0], inp["topk_idx"], *leaves[1:], group, tuning
        )
        composed.backward(inp["grad_out"])
        native = [inp[k].clone().requires_grad_(True) for k in ("x", "topk_weights", "w1", "w2")]
        y = uniep.moe_forward(native[0], inp["topk_idx"], *native[1:], tuning=tuning)
        y.backward(inp["grad_out"])
        out[combine] = {
            "same": same_bits(composed.detach(), y.detach()),
            "grads": [_rel(a.grad, b.grad) for a, b in zip(leaves, native, strict=True)],
        }
    try:
        multinode_cuda.moe_forward(
            inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w1"], inp["w2"], group,
            "combine=rank_partials",
        )  # fmt: skip
    except ValueError as e:
        out["refused"] = str(e)
    return out


@pytest.mark.parametrize(("world", "nodes_of"), [(4, 2), (8, 4)])
def test_the_cuda_composition_gives_the_executors_bits(world: int, nodes_of: int) -> None:
    case = CASES[world][0]
    for rank, r in enumerate(run_ranks(world, composed_worker, case, nodes_of, timeout=300)):
        for combine in ("node_partials", "per_k"):
            got = r[combine]
            assert got["same"], f"rank {rank}: composed {combine} differs from the executor's"
            # The gradient is the same function's through other pieces: equal up to rounding.
            assert max(got["grads"]) < 2e-2, (rank, combine, got["grads"])
        assert "combine=rank_partials" in r["refused"], r


def hosts_worker(rank: int, world: int) -> str:
    import socket

    from uniep.moe import multinode_cuda

    # Nodes of 2 declared over hosts a, a, b, b would be right; a, b, a, b is not.
    socket.gethostname = lambda: "host-a" if rank % 2 == 0 else "host-b"  # type: ignore[assignment]
    uniep.init(ranks_per_node=2)
    try:
        multinode_cuda.node_groups(uniep.distributed.default_group())
    except ValueError as e:
        return str(e)
    return ""


def test_a_node_spanning_hosts_is_refused_on_every_rank() -> None:
    for rank, error in enumerate(run_ranks(4, hosts_worker)):
        assert "ranks 0-1" in error and "2 hosts (host-a, host-b)" in error, (rank, error)
