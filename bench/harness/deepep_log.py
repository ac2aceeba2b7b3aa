"""DeepEP's own test output as figures beside UniEP's: the peer the EP goals are stated against,
timed on the same machine in the same run (bench/peers/deepep.sh runs DeepEP v1.2.1's
tests/test_intranode.py and tests/test_low_latency.py and hands their logs here).

What the tests print, and what is taken:
- intranode, rank 0: ``[tuning] Best dispatch (BF16): SMs 24, NVL chunk 6, 261.00 GB/s (NVL),
  t: 811.00 us`` (and FP8), ``[tuning] Best combine: SMs 24, NVL chunk 4: 357.00 GB/s (NVL), t:
  594.00 us``: the best of its own chunk-size sweep at 24 SMs, GB/s as bytes received over NVLink
  (the count bench_dispatch uses). Rank 0's figures: the test prints no other rank's.
- low latency, every rank: ``[rank 0] Dispatch bandwidth: ... avg_t=36.70 us | Combine
  bandwidth: ... avg_t=55.40 us`` (kernel times from its profiler) and ``[rank 0] Dispatch +
  combine bandwidth: ..., avg_t=95.00 us, ...`` (both calls, CUDA events): the slowest rank's.

    python bench/harness/deepep_log.py --intranode LOG --low-latency LOG --out FILE [key=value...]

It imports no torch. A figure the logs lack is left out, and ``missing`` says which.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_BEST_DISPATCH = re.compile(
    rf"\[tuning\] Best dispatch \((BF16|FP8)\): SMs (\d+), NVL chunk (\d+), {_NUM} GB/s \(NVL\), "
    rf"t: {_NUM} us"
)
_BEST_COMBINE = re.compile(
    rf"\[tuning\] Best combine: SMs (\d+), NVL chunk (\d+): {_NUM} GB/s \(NVL\), t: {_NUM} us"
)
_LL_KERNELS = re.compile(
    rf"\[rank (\d+)\] Dispatch bandwidth: {_NUM} GB/s, avg_t={_NUM} us \| "
    rf"Combine bandwidth: {_NUM} GB/s, avg_t={_NUM} us"
)
_LL_BOTH = re.compile(
    rf"\[rank (\d+)\] Dispatch \+ combine bandwidth: {_NUM} GB/s, avg_t={_NUM} us"
)
FIGURES = (
    "dispatch_bf16_GBps",
    "dispatch_bf16_us",
    "dispatch_fp8_GBps",
    "dispatch_fp8_us",
    "combine_GBps",
    "combine_us",
    "ll_dispatch_us",
    "ll_combine_us",
    "ll_total_us",
)


def parse_intranode(text: str) -> dict[str, Any]:
    """The best dispatch (bf16, fp8) and combine of the intranode test's sweep (the first of
    each, rank 0's)."""
    out: dict[str, Any] = {}
    for m in _BEST_DISPATCH.finditer(text):
        kind = m.group(1).lower()
        if f"dispatch_{kind}_GBps" in out:
            continue
        out[f"dispatch_{kind}_GBps"] = float(m.group(4))
        out[f"dispatch_{kind}_us"] = float(m.group(5))
        out[f"dispatch_{kind}_sms"] = int(m.group(2))
        out[f"dispatch_{kind}_nvl_chunk"] = int(m.group(3))
    m = _BEST_COMBINE.search(text)
    if m:
        out["combine_GBps"] = float(m.group(3))
        out["combine_us"] = float(m.group(4))
        out["combine_sms"] = int(m.group(1))
        out["combine_nvl_chunk"] = int(m.group(2))
    return out


def parse_low_latency(text: str) -> dict[str, Any]:
    """The low-latency test's kernel times and both calls' time, the slowest rank's."""
    dispatch: dict[int, float] = {}
    combine: dict[int, float] = {}
    both: dict[int, float] = {}
    for m in _LL_KERNELS.finditer(text):
        dispatch[int(m.group(1))] = float(m.group(3))
        combine[int(m.group(1))] = float(m.group(5))
    for m in _LL_BOTH.finditer(text):
        both[int(m.group(1))] = float(m.group(3))
    out: dict[str, Any] = {}
    for key, values in (
        ("ll_dispatch_us", dispatch),
        ("ll_combine_us", combine),
        ("ll_total_us", both),
    ):
        if values:
            out[key] = max(values.values())
            out[f"{key}_ranks"] = len(values)
    return out


def summarize(intranode: str, low_latency: str, **meta: Any) -> dict[str, Any]:
    figures = {**parse_intranode(intranode), **parse_low_latency(low_latency)}
    missing = [f for f in FIGURES if f not in figures]
    return {"peer": "DeepEP", **meta, **figures, "missing": missing}


def _read(path: str | None) -> str:
    if not path:
        return ""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intranode", help="the log of tests/test_intranode.py")
    parser.add_argument("--low-latency", help="the log of tests/test_low_latency.py")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("meta", nargs="*", help="key=value pairs recorded as they are")
    args = parser.parse_args(argv)
    meta = {}
    for item in args.meta:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"meta must be key=value, got {item!r}")
        meta[key] = _value(value)
    result = summarize(_read(args.intranode), _read(args.low_latency), **meta)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
