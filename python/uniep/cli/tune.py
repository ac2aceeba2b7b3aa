"""``uniep tune``: the tuner from the command line, on CPU ranks or the GPUs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from .args import check_layer
from .info import has_cuda_moe_kernel, yes


class _ProgressBar:
    """A one-line text progress bar on stderr (rewritten in place with a carriage return)."""

    def __init__(self, stream: Any = None, width: int = 30) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width

    def __call__(self, done: int, total: int, what: str) -> None:
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r[{bar}] {done}/{total} {what[:60]:<60}{end}")
        self.stream.flush()


def _tune_rank(rank: int, world: int, cfg: dict[str, Any]) -> Any:
    from ..tuning import tuner

    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
    return tuner.tune(
        tokens=cfg["tokens"],
        hidden=cfg["hidden"],
        ffn=cfg["ffn"],
        experts=cfg["experts"],
        top_k=cfg["top_k"],
        dtype=cfg["dtype"],
        numerics=cfg["numerics"],
        candidates=cfg["candidates"],
        warmup=cfg["warmup"],
        iters=cfg["iters"],
        budget_s=cfg["budget"],
        device=cfg["device"],
        path=cfg["cache"],
        progress=_ProgressBar() if rank == 0 else None,
        weights=cfg["weights"],
        settle_s=cfg["settle_s"],
    )


def check_numerics(args: argparse.Namespace, device: str) -> None:
    """The numerics options' agreement with each other, the shape and the device, checked
    before any rank starts, naming the options (the ops' own errors name tuning keys)."""
    fp8_dispatch = args.dispatch == "fp8"
    experts = args.expert_precision or "auto"
    if experts == "fp8" and not fp8_dispatch:
        raise SystemExit(
            "uniep tune: --expert-precision fp8 needs --dispatch fp8 (the fp8 GEMMs read the "
            "rows in the fp8 dispatch's format)"
        )
    fp8_experts = experts == "fp8" or (experts == "auto" and fp8_dispatch)
    default = "" if args.expert_precision else " (the default)"
    if fp8_experts and (args.hidden % 128 or args.ffn % 128):
        raise SystemExit(
            f"uniep tune: --dispatch fp8 with --expert-precision {experts}{default} runs the "
            "experts in fp8 with one weight scale per 128 x 128 block: --hidden and --ffn must be "
            f"multiples of 128, got {args.hidden} and {args.ffn}; add --expert-precision bf16 for "
            "bf16 expert GEMMs on the fp8 rows"
        )
    if device != "cuda":
        return
    if fp8_experts and args.gemm == "torch":
        raise SystemExit(
            "uniep tune: --gemm torch has no fp8 expert GEMM, and --dispatch fp8 runs the experts "
            "in fp8: add --expert-precision bf16 or drop --gemm torch"
        )
    if args.combine == "node_partials":
        raise SystemExit(
            "uniep tune: --combine node_partials is the combine of a group that spans nodes "
            "(docs/multinode.md); on CUDA the tuner's ranks are one node, whose runtime combines "
            "with per_k or rank_partials (node_partials runs on --device cpu)"
        )


def cmd_tune(args: argparse.Namespace) -> int:
    from ..tuning import tuner

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and has_cuda_moe_kernel() else "cpu"
    if device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(
            f"uniep tune: --device cuda --world-size {args.world_size} needs one GPU per rank, "
            f"{torch.cuda.device_count()} visible"
        )
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    check_layer("tune", args.world_size, args.experts, args.top_k)
    check_numerics(args, device)
    numerics = ",".join(
        f"{key}={value}"
        for key, value in (
            ("dispatch", args.dispatch),
            ("combine", args.combine),
            ("gemm", args.gemm),
            ("experts", args.expert_precision),
        )
        if value is not None
    )
    cfg = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "ffn": args.ffn,
        "experts": args.experts,
        "top_k": args.top_k,
        "dtype": dtype,
        "numerics": tuner.normalize_numerics(numerics),
        "candidates": args.candidates,
        "warmup": args.warmup,
        "iters": args.iters,
        "budget": args.budget,
        "device": device,
        "cache": args.cache,
        "weights": args.weights,
        "settle_s": args.settle_s,
    }
    if args.weights != "plain" and (device != "cuda" or dtype != "bfloat16"):
        raise SystemExit(
            f"uniep tune: --weights {args.weights} tunes moe_forward_prepared on CUDA: it needs "
            f"--device cuda and --dtype bfloat16, got {device} and {dtype}"
        )
    target = args.cache or str(tuner.cache_path())
    print(
        f"uniep tune: {args.world_size} rank(s) on {device}, {dtype}, tokens/rank={args.tokens} "
        f"hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k}, "
        f"{cfg['numerics']}, weights {args.weights}",
        file=sys.stderr,
        flush=True,
    )
    if args.world_size == 1:
        result = _tune_rank(0, 1, cfg)
    else:
        from ..distributed import run_local_ranks

        backend = "nccl" if device == "cuda" else "gloo"
        try:
            result = run_local_ranks(
                _tune_rank, args.world_size, (cfg,), backend=backend, timeout_s=args.timeout
            )[0]
        except RuntimeError as exc:
            print(f"uniep tune: FAILED: {exc}", file=sys.stderr)
            return 1
    print(
        f"{result.considered} candidates ranked by the cost model, {result.distinct} of them "
        f"distinct on the {device} executor, {len(result.candidates)} measured (median of "
        f"{args.iters} calls in interleaved rounds, slowest of {result.world_size} rank(s)) on "
        f"{result.device_name}:\n"
    )
    print(result.table())
    print(f"\nchosen: {result.tuning}")
    print(f"  {result.verdict}")
    print(f"  output bits equal to the default's: {yes(result.bits_identical)}")
    if result.cache_path:
        print(f"  cached in {result.cache_path}")
    else:
        print(f"  NOT cached (see the warning above; target {target})")
    return 0
