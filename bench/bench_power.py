"""Clock, power and energy per call of the world-1 MoE forward and its parts, each run back to
back for a few seconds so that the GPU settles at its power limit, as in a training step.

Why: on an H200 (700 W) the Qwen3-like layer's expert GEMMs run at the power cap (nvidia-smi's
throttle reason 0x4, "SW power cap"), their SM clock well under the 1980 MHz maximum. A GPU at
its cap runs at (power limit - static power) / dynamic energy per call, so overlapping two pieces
of work saves time only while it is under the cap; at the cap the time of a call follows the
energy of everything it does, overlapped or not. This script measures that energy:

  - each variant runs back to back for ``--seconds`` (the host syncs every 10 calls), nvidia-smi
    sampling the SM clock, the power and the throttle reasons every 20 ms;
  - then 10 calls under the torch profiler in that state (per-kernel GPU time), the host's time
    per call (launches only, the GPU still busy) and, for the fused launch, its traced phases;
  - the idle power before the first variant, so that a call's dynamic energy is
    (median power - idle power) x time per call.

Variants (``uniep.moe.megakernel.launch.moe_forward_local`` and the launches it is made of, on the
layer of ``bench_experts``' loads): the engine's two GEMMs alone on rows gathered beforehand (the
MegaKernel's reference), the two gated GEMMs of the sequential path, the plan, the send (the row
gather) and the combine alone, the GEMMs then the combine (the floor of any design with a free
plan and dispatch), the sequential composition, and the fused MegaKernel at its default point.

    python bench/bench_power.py --loads qwen3-30b-a3b [--seconds 2] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "harness"))
from common import (  # noqa: E402
    add_out_dir_argument,
    profile_kernels,
    sm90_kernel_missing,
    write_result,
)

SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def parse_smi_line(line: str) -> tuple[float, float, float, str] | None:
    """One line of ``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits``: (UTC
    seconds, SM MHz, watts, throttle reasons) or None for a line that is not a sample (a header,
    a field nvidia-smi reports as ``[N/A]``)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        stamp = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
        return (
            stamp.replace(tzinfo=dt.timezone.utc).timestamp(),
            float(parts[1]),
            float(parts[2]),
            parts[3],
        )
    except ValueError:
        return None


def window_stats(
    samples: list[tuple[float, float, float, str]], start: float, end: float, settle_s: float
) -> dict[str, Any]:
    """The median clock and power of the samples in [start + settle_s, end] and how often each
    throttle reason was active there; ``{}`` when no sample falls in the window."""
    sel = [s for s in samples if start + settle_s <= s[0] <= end]
    if not sel:
        return {}
    return {
        "samples": len(sel),
        "sm_mhz_median": statistics.median(s[1] for s in sel),
        "power_w_median": statistics.median(s[2] for s in sel),
        "throttle_reasons": dict(Counter(s[3] for s in sel)),
    }


def energy_mj(power_w: float, idle_w: float, ms_per_call: float) -> dict[str, float]:
    """A call's energy in millijoules: all of it, and the part over the idle power."""
    if ms_per_call <= 0:
        raise ValueError(f"ms_per_call must be > 0, got {ms_per_call}")
    return {
        "mj_per_call": power_w * ms_per_call,
        "dynamic_mj_per_call": (power_w - idle_w) * ms_per_call,
    }


class Sampler:
    """nvidia-smi writing a sample every 20 ms into a file, while the variants run."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkstemp(prefix="uniep-smi-", suffix=".csv")[1])
        self._proc = subprocess.Popen(
            [
                "nvidia-smi",
                f"--query-gpu={SMI_FIELDS}",
                "--format=csv,noheader,nounits",
                "-lms",
                "20",
            ],
            stdout=self.path.open("w"),
        )

    def samples(self) -> list[tuple[float, float, float, str]]:
        self._proc.terminate()
        self._proc.wait(timeout=10)
        lines = self.path.read_text().splitlines()
        self.path.unlink()
        return [s for s in map(parse_smi_line, lines) if s is not None]


def _variants(
    load: tuple[str, int, int, int, int, int],
) -> tuple[dict[str, Callable[[], object]], Any]:
    import bench_experts as be
    from uniep.moe import tile_gates as gate
    from uniep.moe.megakernel.launch import moe_forward_local
    from uniep.moe.prepared import prepare_experts

    _, x, w1, w2, idx, weights = be._layer_inputs(load)
    prepared = prepare_experts(w1, w2, "bf16_packed")
    del w1
    experts = prepared.w1.shape[0]
    rows, offs, grow_alone, gemm_only = be._gemms_alone(x, idx, prepared)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    _, _, _, dest, grow, counter, _ = gate.local_plan(idx, experts, gate.TILE_M)
    counters = torch.zeros(rows.shape[0] // gate.TILE_M + experts + 1, dtype=torch.int32,
                           device=x.device)  # fmt: skip
    sent = torch.empty_like(rows)
    gated_gemms = be._gated_gemms(rows, offs, prepared)
    y = gated_gemms()  # the combine's rows

    def send_only() -> None:
        counters.zero_()
        gate.send_rows(x, dest, grow, counter, sent, counters, sm_count=sms)

    def forward(overlap: str, **kw: Any) -> Callable[[], object]:
        return lambda: moe_forward_local(x, idx, weights, prepared.w1, prepared.w2, check=False,
                                         overlap=overlap, **kw)  # fmt: skip

    trace = torch.zeros(6 * sms, dtype=torch.int64, device=x.device)
    fns = {
        "gemm_only": gemm_only,
        "gated_gemms": gated_gemms,
        "plan": lambda: gate.local_plan(idx, experts, 64),
        "send": send_only,
        "combine": lambda: gate.combine_rows(y, grow, weights, check=False),
        "gemms_combine": be._gemms_combine(gemm_only, grow_alone, weights),
        "sequential": forward("sequential"),
        "fused": forward("fused"),
        "fused_traced": forward("fused", trace=trace),
    }
    return fns, (trace, sms)


def measure(load: tuple[str, int, int, int, int, int], seconds: float) -> list[dict[str, Any]]:
    from uniep.moe.megakernel.launch import trace_phases

    fns, (trace, sms) = _variants(load)
    sampler = Sampler() if shutil.which("nvidia-smi") else None
    time.sleep(1.0)
    idle = (time.time() - 0.8, time.time())
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for name, fn in fns.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            calls, t0 = 0, time.time()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            while time.time() - t0 < seconds:
                for _ in range(10):
                    fn()
                calls += 10
                torch.cuda.synchronize()
            end.record()
            torch.cuda.synchronize()
            row: dict[str, Any] = {"load": load[0], "variant": name, "calls": calls,
                                   "t0": t0, "t1": time.time(),
                                   "ms_per_call": start.elapsed_time(end) / calls}  # fmt: skip
            # The host's time per call, the GPU still behind it (launches do not wait).
            h0 = time.perf_counter()
            for _ in range(10):
                fn()
            row["host_us_per_call"] = (time.perf_counter() - h0) * 1e5
            row["kernels_us"] = profile_kernels({name: fn}, 10)[name]
            if name == "fused_traced":
                # One call's phases, still at the cap (the gate waits add up across calls).
                trace.zero_()
                fn()
                torch.cuda.synchronize()
                row["phases_us"] = trace_phases(trace, sms)
            rows.append(row)
            time.sleep(0.3)
    samples = sampler.samples() if sampler is not None else []
    idle_stats = window_stats(samples, idle[0], idle[1], 0.0)
    for row in rows:
        row.update(window_stats(samples, row.pop("t0"), row.pop("t1"), 0.3))
        if "power_w_median" in row and "power_w_median" in idle_stats:
            row["idle_w"] = idle_stats["power_w_median"]
            row.update(energy_mj(row["power_w_median"], row["idle_w"], row["ms_per_call"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="(CPU runs: nothing to measure)")
    add_out_dir_argument(parser)
    parser.add_argument("--loads", default="qwen3-30b-a3b", help="comma-separated load names")
    parser.add_argument("--seconds", type=float, default=2.0, help="back-to-back time per variant")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
    if sm90_kernel_missing("bench_power", "uniep::moe_fused_local"):
        return 0
    import bench_experts as be

    names = [n for n in args.loads.split(",") if n]
    loads = be.selected(names)
    if len(loads) != len(names):
        known = [layer[0] for layer in be.LAYERS + be.EXTRA_LAYERS]
        print(f"bench_power: unknown --loads in {names}; known: {known}")
        return 2
    rows = [r for load in loads for r in measure(load, args.seconds)]
    print("| load | variant | us/call | SM MHz | W | mJ/call | dynamic mJ | throttle |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    nan = float("nan")
    for r in rows:
        cells = [f"{r['ms_per_call'] * 1e3:.1f}", f"{r.get('sm_mhz_median', nan):.0f}",
                 f"{r.get('power_w_median', nan):.0f}", f"{r.get('mj_per_call', nan):.1f}",
                 f"{r.get('dynamic_mj_per_call', nan):.1f}"]  # fmt: skip
        reasons = r.get("throttle_reasons", {})
        print(f"| {r['load']} | {r['variant']} | {' | '.join(cells)} | {reasons} |")
    print(f"wrote {write_result('bench_power', rows, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
