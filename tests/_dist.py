"""Run a function on N gloo ranks (spawned processes on this host) and collect what each returns.

Process start costs seconds (each child imports torch), so callers batch many cases into one
`run_ranks` call. A rank that raises, exits or hangs fails the whole call with every rank's
traceback instead of hanging the test session.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
# A rank stuck in a collective (its peer died) raises after this, well inside DEFAULT_TIMEOUT_S.
COLLECTIVE_TIMEOUT_S = 45.0


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed or timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out_dir: str,
) -> None:
    out = Path(out_dir)
    try:
        # 2-4 ranks share a couple of cores: intra-op threads would only oversubscribe them.
        torch.set_num_threads(1)
        if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
            # Gloo otherwise binds the interface the hostname resolves to, which may not exist.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _run_once(
    world_size: int, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float
) -> list[Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="uniep-dist-") as tmp:
        port = free_port()
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, port, fn, args, tmp), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        # Stop at the first failed rank: its peers would only wait for it until they time out.
        while True:
            running = [p for p in procs if p.exitcode is None]
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            remaining = deadline - time.monotonic()
            if failed or not running or remaining <= 0:
                break
            wait([p.sentinel for p in running], timeout=min(remaining, 1.0))
        hung = [r for r, p in enumerate(procs) if p.exitcode is None]
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        errors = {r: Path(tmp, f"rank{r}.err") for r in range(world_size)}
        errors = {r: f.read_text() for r, f in errors.items() if f.exists()}
        codes = [p.exitcode for p in procs]
        if errors or any(c != 0 for c in codes):
            lines = [f"{fn.__name__} on {world_size} ranks failed; exit codes {codes}"]
            if hung and not failed:
                lines.append(f"ranks {hung} did not finish within {timeout:.0f} s")
            for r, text in sorted(errors.items()):
                lines.append(f"--- rank {r} ---\n{text}")
            raise RankFailure("\n".join(lines))
        return [torch.load(Path(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world_size)]


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return each rank's result.

    `fn` must be a module-level function (spawned children import it by name) and return
    something `torch.save` can write with plain containers, tensors, numbers and strings.
    """
    try:
        return _run_once(world_size, fn, args, timeout)
    except RankFailure as e:
        # free_port() cannot reserve the port; another process may have taken it meanwhile.
        # Gloo says "Address already in use", torch's TCPStore "EADDRINUSE ... address already
        # in use" (seen on the GPU machine while a build ran beside the tests).
        if "address already in use" not in str(e).lower():
            raise
        return _run_once(world_size, fn, args, timeout)


def run_ranks_once(
    cache: dict[Any, Any],
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """:func:`run_ranks`, once per world size for the tests that read one spawn's results:
    ``cache`` keeps each world's results, or its failure, which every later call raises again."""
    if world_size not in cache:
        try:
            cache[world_size] = run_ranks(world_size, fn, *args, timeout=timeout)
        except Exception as e:
            cache[world_size] = e
    got = cache[world_size]
    if isinstance(got, Exception):
        raise got
    return got
