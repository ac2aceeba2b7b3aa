"""Where a GPU waited for the host: the idle gaps between kernels in a torch-profiler Chrome trace
(``bench_experts.py --profile N --trace VARIANT --trace-dir DIR`` writes them), and the host ops
and CUDA runtime calls that ran during the gaps.

    python bench/harness/trace_gaps.py TRACE.json [--min-gap-us 15] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gaps(trace: dict[str, Any], min_gap_us: float) -> tuple[list[tuple[float, float, str]], dict]:
    """The idle intervals (start, end, next kernel's name) longer than ``min_gap_us`` and the
    span / busy totals of the GPU events."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    if not gpu:
        return [], {"span_us": 0.0, "busy_us": 0.0, "kernels": 0}
    out = []
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        if e["ts"] - end > min_gap_us:
            out.append((end, e["ts"], e["name"]))
        end = max(end, e["ts"] + e["dur"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    return out, {"span_us": span, "busy_us": sum(e["dur"] for e in gpu), "kernels": len(gpu)}


def blame(trace: dict[str, Any], idle: list[tuple[float, float, str]]) -> dict[str, dict]:
    """Microseconds of each host op (nested ops counted each) and CUDA runtime call that
    overlapped the idle intervals."""
    per: dict[str, dict[str, float]] = {
        "cpu_op": defaultdict(float),
        "cuda_runtime": defaultdict(float),
    }
    for e in trace["traceEvents"]:
        cat = e.get("cat")
        if e.get("ph") != "X" or cat not in per:
            continue
        s, f = e["ts"], e["ts"] + e["dur"]
        for a, b, _ in idle:
            overlap = min(f, b) - max(s, a)
            if overlap > 0:
                per[cat][e["name"]] += overlap
    return per


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--min-gap-us", type=float, default=15.0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    with open(args.trace, encoding="utf-8") as f:
        trace = json.load(f)
    idle, totals = gaps(trace, args.min_gap_us)
    print(
        f"span {totals['span_us']:.0f} us, gpu busy {totals['busy_us']:.0f} us, "
        f"kernels {totals['kernels']}"
    )
    print(
        f"gaps > {args.min_gap_us:g} us: {len(idle)}, total {sum(b - a for a, b, _ in idle):.0f} us"
    )
    for cat, table in blame(trace, idle).items():
        print(f"{cat} during the gaps (us):")
        for name, us in sorted(table.items(), key=lambda t: -t[1])[: args.top]:
            print(f"  {us:9.0f}  {name[:90]}")
    print("largest gaps (us, the kernel after):")
    for a, b, name in sorted(idle, key=lambda g: g[0] - g[1])[: args.top // 2]:
        print(f"  {b - a:7.0f}  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
