"""Across nodes on one machine: the two-level path against one node on the same ranks.

For each layout ``WxL`` of ``--layouts`` (W ranks, as W / L logical nodes of L), one spawn of W
ranks runs the layer as one node (``moe_forward``, default ``per_k``) and another as nodes of L
(``uniep.init(ranks_per_node=L)``, ``combine=node_partials``, docs/multinode.md), because a
process holds one NVSHMEM runtime and the two levels need one per node. Per layout:

- ``ms.flat``, ``ms.two_level``: the layer forward, each rank's median after warm-up, the slowest
  rank's in the row;
- ``ms.rail``, ``rail_gbs``: the rail's exchange alone of the rows the two-level forward sends
  (each token once to every node holding one of its experts), and the bytes that cross between
  nodes per second on the slowest rank (each rank's own node's rows stay home);
- ``rel_err``: the two levels' output against one node's (node partials round once per node,
  so they differ in the last bits; within bf16 rounding).

Devices: ``--device cuda`` puts each rank on GPU ``rank % GPUs`` (NCCL; ``--rail-sockets`` forces
NCCL onto sockets, the network leg's stand-in) or, with more ranks than GPUs, lets them share
(gloo, the rail staged through the host); ``--device cpu`` (``--quick``) runs the CPU executor
on gloo ranks. The times of ranks sharing a GPU or cores say little about a machine with one GPU
a rank; the JSON records how the ranks sat.

    python bench/bench_multinode.py --quick                       # CPU, 2 x 2
    python bench/bench_multinode.py --layouts 4x2,8x4,8x2         # one GPU a rank
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import add_out_dir_argument, median_time_ms, topk_routing, write_result  # noqa: E402

# NCCL between processes of one machine, kept off NVLink and shared memory: the rail's
# stand-in for a network.
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket"}


def _layout(text: str) -> tuple[int, int]:
    try:
        world, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is WxL (e.g. 4x2), got {text!r}") from None
    if world < 2 or per_node < 1 or world % per_node or world == per_node:
        raise argparse.ArgumentTypeError(
            f"layout {text}: L must divide W into at least two nodes of L ranks"
        )
    return world, per_node


def _inputs(rank: int, world: int, cfg: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    t, h, i, k = cfg["tokens"], cfg["hidden"], cfg["ffn"], cfg["top_k"]
    experts = cfg["experts_per_rank"] * world
    gen = torch.Generator().manual_seed(1000 + rank)
    x = (torch.randn(t, h, generator=gen) / 4).bfloat16()
    idx, w = topk_routing(t, experts, k, seed=2000 + rank)
    # Each expert's weights from a seed of its own id, drawn on the device by its rank alone:
    # the same experts in every layout, and no rank draws the others' (at the default size all
    # experts in fp32 are 15 GB a rank, minutes of the host's time).
    wgen = torch.Generator(device=dev)
    w1s, w2s = [], []
    per = cfg["experts_per_rank"]
    for e in range(rank * per, (rank + 1) * per):
        wgen.manual_seed(7_000_003 + e)
        w1s.append((torch.randn(h, 2 * i, generator=wgen, device=dev) * h**-0.5).bfloat16())
        w2s.append((torch.randn(i, h, generator=wgen, device=dev) * i**-0.5).bfloat16())
    return {
        "x": x.to(dev),
        "idx": idx.to(dev),
        "w": w.to(dev),
        "w1": torch.stack(w1s),
        "w2": torch.stack(w2s),
    }


def _device(rank: int, cfg: dict[str, Any]) -> torch.device:
    if cfg["device"] == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _slowest(value: float) -> float:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return max(out)


def _rank(rank: int, world: int, cfg: dict[str, Any], per_node: int) -> dict[str, Any]:
    import uniep
    from uniep.moe import multinode_cuda

    dev = _device(rank, cfg)
    cuda = dev.type == "cuda"
    inp = _inputs(rank, world, cfg, dev)
    args = (inp["x"], inp["idx"], inp["w"], inp["w1"], inp["w2"])
    uniep.init(ranks_per_node=per_node)
    tuning = "" if per_node == world else "combine=node_partials"
    with torch.no_grad():

        def layer() -> torch.Tensor:
            return uniep.moe_forward(*args, tuning=tuning)

        y = layer()[:256].cpu()  # enough rows to compare, few to ship
        out: dict[str, Any] = {"y": y}
        out["ms_layer"] = _slowest(median_time_ms(layer, cfg["warmup"], cfg["iters"], cuda))
        if per_node < world:
            group = uniep.distributed.default_group()
            g = multinode_cuda.node_groups(group)
            experts_per_node = cfg["experts_per_rank"] * per_node
            node_of = torch.where(inp["idx"] >= 0, inp["idx"] // experts_per_node, -1)
            send = [int((node_of == n).any(dim=1).sum()) for n in range(g.nodes)]
            recv = multinode_cuda._counts_on_rail(send, g.rail, "bench_multinode's counts")
            rows = torch.zeros(sum(send), cfg["hidden"], dtype=torch.bfloat16, device=dev)

            def rail() -> torch.Tensor:
                return multinode_cuda._rail_exchange(rows, send, recv, g.rail, "bench's rail")

            away = sum(c for n, c in enumerate(send) if n != g.node_index)
            out["rail_bytes"] = _slowest(float(away * cfg["hidden"] * 2))
            out["ms_rail"] = _slowest(median_time_ms(rail, cfg["warmup"], cfg["iters"], cuda))
    return out


def _spawn(world: int, per_node: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from uniep.distributed import run_local_ranks

    gpus = torch.cuda.device_count() if cfg["device"] == "cuda" else 0
    backend = "nccl" if cfg["device"] == "cuda" and world <= gpus else "gloo"
    env = {**(SOCKETS if cfg["rail_sockets"] else {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run_local_ranks(_rank, world, (cfg, per_node), backend=backend, timeout_s=600)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _row(world: int, per_node: int, cfg: dict[str, Any]) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if cfg["device"] == "cuda" else 0
    row: dict[str, Any] = {
        "layout": f"{world}x{per_node}",
        "world": world,
        "ranks_per_node": per_node,
        "nodes": world // per_node,
        "device": cfg["device"],
        "ranks_per_gpu": -(-world // gpus) if gpus else 0,
        "rail": "nccl sockets" if cfg["rail_sockets"] else ("nccl" if world <= gpus else "gloo"),
        **{k: cfg[k] for k in ("tokens", "hidden", "ffn", "experts_per_rank", "top_k")},
    }
    try:
        flat = _spawn(world, world, cfg)
        two = _spawn(world, per_node, cfg)
    except RuntimeError as e:
        return {**row, "error": str(e)[-4000:]}
    err = max(
        float((b["y"].double() - a["y"].double()).abs().max() / a["y"].double().abs().max())
        for a, b in zip(flat, two, strict=True)
    )
    ms = {"flat": flat[0]["ms_layer"], "two_level": two[0]["ms_layer"], "rail": two[0]["ms_rail"]}
    return {
        **row,
        "ms": ms,
        "rail_bytes": two[0]["rail_bytes"],
        "rail_gbs": two[0]["rail_bytes"] / ms["rail"] / 1e6,
        "rel_err": err,
        "check": {"pass": err < 2e-2},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=lambda s: [_layout(v) for v in s.split(",")])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--rail-sockets", action="store_true", help="NCCL on sockets (CUDA)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens a rank")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--ffn", type=int, default=None)
    parser.add_argument("--experts-per-rank", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="CPU, 2 x 2, a small layer")
    add_out_dir_argument(parser)
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    small = device == "cpu"
    cfg = {
        "device": device,
        "rail_sockets": args.rail_sockets and device == "cuda",
        "tokens": args.tokens or (32 if small else 4096),
        "hidden": args.hidden or (128 if small else 7168),
        "ffn": args.ffn or (64 if small else 2048),
        "experts_per_rank": args.experts_per_rank or (4 if small else 32),
        "top_k": args.top_k,
        "warmup": 1 if small else args.warmup,
        "iters": 3 if small else args.iters,
    }
    layouts = args.layouts or ([(4, 2)] if small else [(4, 2), (8, 4), (8, 2)])
    rows = []
    for world, per_node in layouts:
        row = _row(world, per_node, cfg)
        print(
            f"{row['layout']}: "
            + (
                f"error {row['error'][-300:]}"
                if "error" in row
                else f"one node {row['ms']['flat']:.3f} ms, two levels "
                f"{row['ms']['two_level']:.3f} ms, rail {row['rail_gbs']:.3g} GB/s, "
                f"rel_err {row['rel_err']:.2e}"
            ),
            flush=True,
        )
        rows.append(row)
    path = write_result("bench_multinode", rows, args.out_dir)
    print(f"wrote {path}")
    return 1 if any("error" in r or not r["check"]["pass"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
