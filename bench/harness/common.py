"""Shared helpers for the benchmark scripts: environment capture, timing and JSON output.

Every result file carries the device, the torch/CUDA versions and the commit, so that a number can
always be traced back to what produced it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = BENCH_DIR / "results"
PLOT_SUFFIXES = (".svg", ".png")


def _commit() -> str:
    # Copies of the tree without .git (the GPU machine gets one) pass the commit in the environment.
    if os.environ.get("UNIEP_COMMIT"):
        return os.environ["UNIEP_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else "unknown"


def _device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    # platform.processor() is empty on many Linux systems; machine() ("x86_64") always has a value.
    return "cpu-" + (platform.processor() or platform.machine() or "unknown")


def kind_from_gpus(name: str, count: int) -> str:
    """The device tool's name for ``count`` GPUs called ``name``: ``nvidia-h100-x2``,
    ``nvidia-h200-x4``; one H200 is ``nvidia-h200`` and one H100 ``nvidia-h100-x1``, as the tool
    names them. A name without a chip model like ``h100`` gives its slug instead."""
    if count < 1:
        return "none"
    found = re.search(r"(?<![a-z0-9])([a-z]{1,2}\d{2,4})(?![0-9])", name.lower())
    chip = found.group(1) if found else _slug(name)
    if count == 1:
        return "nvidia-h200" if chip == "h200" else f"nvidia-{chip}-x1"
    return f"nvidia-{chip}-x{count}"


def device_kind() -> str:
    """The kind of machine a result comes from: ``$UNIEP_DEVICE_KIND`` when the caller names it
    (the device tool's kind, e.g. ``nvidia-h100-x2``), else :func:`kind_from_gpus` of the visible
    GPUs, else ``cpu-<machine>``."""
    named = os.environ.get("UNIEP_DEVICE_KIND", "").strip()
    if named:
        return named
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return kind_from_gpus(torch.cuda.get_device_name(0), torch.cuda.device_count())
    return "cpu-" + (platform.machine() or "unknown")


def env_info() -> dict:
    """What produced a result: device name, the machine's kind (:func:`device_kind`) and GPU
    count, torch and CUDA versions, commit, UTC date, host."""
    return {
        "device": _device(),
        "kind": device_kind(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "commit": _commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "unknown"


def result_path(name: str, out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where benchmark ``name`` keeps its result: ``{out_dir}/{name}/{name}.json``, ``out_dir``
    defaulting to ``bench/results``. One file per benchmark, which each run replaces; its plot,
    if any, goes beside it with the same stem. Earlier runs are in git history
    (``git log -- bench/results/{name}``)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip(".-")
    if not safe:
        raise ValueError(f"name must have a letter or digit, got {name!r}")
    return (Path(out_dir) if out_dir else DEFAULT_OUT_DIR) / safe / f"{safe}.json"


def measured(rows: list[dict]) -> bool:
    """Whether any row holds a measurement: not a row that says why it was skipped or failed."""
    return any("skipped" not in r and "error" not in r and r.get("kind") != "skipped" for r in rows)


def replace_result(path: str | os.PathLike[str], text: str, is_measurement: bool = True) -> Path:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half a result.
    Plots beside it from the run before (same stem, ``.svg`` or ``.png``) are removed: they would
    describe another run. A benchmark writes its own plot after its JSON.

    A run that measured nothing (``is_measurement`` False: every row skipped or failed, e.g. a
    multi-GPU benchmark on one GPU) does not replace an existing result; it goes only where
    there is none yet (a fresh ``--out-dir``, whose readers want the reason)."""
    path = Path(path)
    if not is_measurement and path.exists():
        print(f"nothing measured (every row skipped or failed): {path} is kept", file=sys.stderr)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix in PLOT_SUFFIXES:
        path.with_suffix(suffix).unlink(missing_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_result(name: str, rows: list[dict], out_dir: str | None = None) -> str:
    """Write ``{"name", "env", "rows"}`` to :func:`result_path`, replacing the run before unless
    this one measured nothing (:func:`replace_result`), and return the file path."""
    if not name:
        raise ValueError("name must be a non-empty string")
    path = result_path(name, out_dir)
    payload = {"name": path.stem, "env": env_info(), "rows": rows}
    text = json.dumps(payload, indent=2, sort_keys=False) + "\n"
    return str(replace_result(path, text, measured(rows)))


def add_out_dir_argument(parser: argparse.ArgumentParser) -> None:
    """``--out-dir DIR``: the results folder; a benchmark NAME writes ``DIR/NAME/NAME.json``."""
    parser.add_argument(
        "--out-dir",
        default=None,
        help="results folder: the JSON goes to DIR/NAME/NAME.json, replacing the last run's "
        "(default bench/results)",
    )


def topk_routing(
    tokens: int, experts: int, top_k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's top-k distinct experts, uniformly at random with ``seed`` (so row counts are
    uneven), and softmax weights: ``(topk_idx [T, K] int64, topk_weights [T, K] fp32)`` on the
    CPU."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    return idx, weights


def time_calls_ms(fn: Callable[[], object], iters: int, cuda: bool) -> list[float]:
    """The time of each of ``iters`` calls of ``fn()`` in milliseconds, no warm-up: UniEP's own
    timing (``uniep._util.timing.time_calls_ms``, CUDA events with ``cuda``, else the wall clock),
    so the benchmarks and ``uniep.tune`` measure alike."""
    from uniep._util.timing import time_calls_ms as uniep_time_calls_ms

    return uniep_time_calls_ms(fn, iters, cuda)


def median_time_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> float:
    """Median time of ``fn()`` in milliseconds over ``iters`` calls after ``warmup`` calls, timed
    as :func:`time_calls_ms` does."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    return float(statistics.median(time_calls_ms(fn, iters, cuda)))


class ShapeClock:
    """Spawn timeouts for a benchmark's shapes, run one after another: ``timeout_s`` each, or,
    with ``budget_s`` (seconds for all of them together), what is left of the budget less
    ``floor_s`` for each shape still to come. A shape that finishes early leaves its time to
    the next, so shapes of unequal cost share one budget without a fixed split; a shape that
    runs long cannot take the later shapes' floors."""

    def __init__(self, timeout_s: float, budget_s: float | None, floor_s: float) -> None:
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s must be > 0 seconds, got {budget_s}")
        self.timeout_s, self.floor_s = timeout_s, floor_s
        self.deadline = None if budget_s is None else time.monotonic() + budget_s

    def timeout(self, shapes_after: int) -> float:
        """The timeout of the next shape's spawn, ``shapes_after`` shapes coming after it."""
        if self.deadline is None:
            return self.timeout_s
        left = self.deadline - time.monotonic() - self.floor_s * shapes_after
        return max(1.0, min(self.timeout_s, left))


def add_budget_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for all shapes together: each gets what is left, less a floor for each "
        "shape after it (at most --timeout); default: --timeout per shape",
    )


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    """``--profile N``: the option of every benchmark that can call :func:`profile_kernels`."""
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also record rank 0's per-kernel GPU time over N profiled calls of each variant",
    )


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trace VARIANT`` (repeatable) and ``--trace-dir``: with ``--profile``, where
    :func:`profile_kernels` writes the Chrome traces of the named variants, one per rank."""
    parser.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="VARIANT",
        help="with --profile: write this variant's Chrome trace (per shape), one per rank",
    )
    parser.add_argument("--trace-dir", default=None, help="directory of the --trace files")


def trace_paths(cfg: dict[str, Any], prefix: str, rank: int) -> Callable[[str], str | None]:
    """The ``trace`` argument of :func:`profile_kernels` for ``--trace``/``--trace-dir`` (as
    ``cfg["trace"]`` and ``cfg["trace_dir"]``): ``{trace_dir}/{prefix}-{variant}-rank{rank}.json``
    for a named variant, None for the others or without a directory."""

    def path(variant: str) -> str | None:
        if variant not in cfg.get("trace", ()) or not cfg.get("trace_dir"):
            return None
        return os.path.join(cfg["trace_dir"], f"{prefix}-{variant}-rank{rank}.json")

    return path


def kernel_label(key: str) -> str:
    """A readable, distinct label for a profiler kernel key: ``uniep::cuda::dispatch_kernel`` for
    a mangled C++ kernel (anonymous namespaces dropped), the key itself otherwise (capped at 120
    characters). Cutting mangled names at a fixed length made kernels of one file collide."""
    at = key.find("_ZN")
    if at < 0:
        return key[:120]
    i, parts = at + 3, []
    while i < len(key) and key[i].isdigit():
        j = i
        while j < len(key) and key[j].isdigit():
            j += 1
        size = int(key[i:j])
        part = key[j : j + size]
        if not part.startswith("_GLOBAL__N_"):
            parts.append(part)
        i = j + size
    return "::".join(parts) if parts else key[:120]


def profile_kernels(
    fns: dict[str, Callable[[], object]],
    iters: int,
    trace: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """Per-call GPU time of each kernel (and copy) the variants launch, from the CUDA profiler.

    Where the time of a variant goes: the kernels' sum against the CUDA-event median shows the
    host-side gaps (syncs, launches) that no kernel accounts for. Profiled runs are not timed.
    ``trace(variant)``: a path to write that variant's Chrome trace to, or None.
    """
    if iters <= 0:
        return {}
    if not torch.cuda.is_available():
        raise RuntimeError(f"profile_kernels records CUDA kernels and needs a GPU (iters={iters})")
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, Any] = {}
    for variant, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        path = trace(variant) if trace is not None else None
        # A traced variant records the host's ops too: the gaps between kernels are host time.
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if path else [])
        with profile(activities=activities) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        if path:
            prof.export_chrome_trace(path)
        per_kernel: dict[str, float] = {}
        for evt in prof.key_averages():
            device_us = getattr(evt, "self_device_time_total", 0.0) or 0.0
            if device_us > 0:
                label = kernel_label(evt.key)
                per_kernel[label] = round(per_kernel.get(label, 0.0) + device_us / iters, 2)
        result[variant] = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    return result


def kernel_timeline(
    events: list[tuple[str, float, float]], calls: int
) -> list[tuple[str, float, float]]:
    """One call's kernels by when each ends: ``events`` are ``(name, start_us, end_us)`` of
    ``calls`` identical calls in time order (a CUDA graph replayed, each replay launching the
    same kernels); returns per kernel of a call ``(label, end_us, after_us)``: the median over
    the calls of its end after the call's first start, and of how long after the latest end
    ahead of it it ends.

    Why ends: under programmatic dependent launches a kernel starts while the one ahead runs and
    waits for it inside, so its own duration counts the wait; the time a kernel adds to a chain
    is how much later than the kernels ahead of it it finishes.
    """
    if calls < 1 or not events or len(events) % calls:
        raise ValueError(
            f"kernel_timeline: {len(events)} events do not split into {calls} equal calls"
        )
    n = len(events) // calls
    per_call = [sorted(events[c * n : (c + 1) * n], key=lambda e: e[1]) for c in range(calls)]
    names = [e[0] for e in per_call[0]]
    if any([e[0] for e in call] != names for call in per_call):
        raise ValueError("kernel_timeline: the calls did not launch the same kernels")

    out = []
    for i, name in enumerate(names):
        ends, afters = [], []
        for call in per_call:
            begin = call[0][1]
            ahead = max((e[2] for e in call[:i]), default=begin)
            ends.append(call[i][2] - begin)
            afters.append(call[i][2] - ahead)
        out.append(
            (
                kernel_label(name),
                round(statistics.median(ends), 2),
                round(statistics.median(afters), 2),
            )
        )
    return out


def graph_timeline(graph: Any, calls: int) -> list[tuple[str, float, float]]:
    """:func:`kernel_timeline` of ``calls`` replays of a captured CUDA graph (CUDA profiler)."""
    if not torch.cuda.is_available():
        raise RuntimeError("graph_timeline records CUDA kernels and needs a GPU")
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            graph.replay()
            torch.cuda.synchronize()
    events = [
        (e.name, float(e.time_range.start), float(e.time_range.end))
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return kernel_timeline(sorted(events, key=lambda e: e[1]), calls)


def sm90_gemm_bench_args(
    description: str,
    argv: list[str] | None,
    profile: bool = False,
    parts: tuple[str, ...] = (),
    trace: bool = False,
    tune: bool = False,
) -> argparse.Namespace:
    """The arguments of the single-GPU GEMM benchmarks (bench_gemm, bench_experts); ``profile``
    adds ``--profile N`` (:func:`add_profile_argument`), ``parts`` a ``--part`` choice among them
    (default all), ``tune`` ``--tune-candidates N``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="(CPU runs: nothing to measure)")
    add_out_dir_argument(parser)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    if profile:
        add_profile_argument(parser)
    if trace:
        add_trace_arguments(parser)
    if parts:
        parser.add_argument("--part", choices=[*parts, "all"], default="all")
        parser.add_argument("--loads", default="", help="comma-separated load names (default all)")
    if tune:
        parser.add_argument(
            "--tune-candidates", type=int, default=8, help="points uniep.tune measures (best N)"
        )
        parser.add_argument(
            "--settle-s",
            type=float,
            default=0.0,
            help="uniep.tune(settle_s=): seconds each point runs back to back before it is timed",
        )
    return parser.parse_args(argv)


def sm90_kernel_missing(script: str, op: str) -> bool:
    """True (after saying why the benchmark skips) unless a compute capability 9.0 GPU is
    visible and this build has a CUDA kernel for ``op`` (``uniep::...``)."""
    import uniep  # noqa: F401  (registers torch.ops.uniep)

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print(f"{script}: skipped (needs a compute capability 9.0 GPU)")
        return True
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"):
        print(f"{script}: skipped (this build has no CUDA kernel for {op})")
        return True
    return False
