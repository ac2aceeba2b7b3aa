"""``uniep parm profile``: measure the collectives the Parm cost model prices, fit alpha/beta.

Two devices, each timing what its executor runs:

- ``device="cpu"`` (``backend="gloo"``): local gloo ranks in the Parm layout. All-gather,
  reduce-scatter and all-reduce over the MP groups, all-to-all over the EP groups
  (torch.distributed on gloo, float32), plus a float32 GEMM (torch.matmul) for the compute
  coefficients. Every link is the loopback.
- ``device="cuda"`` (``backend="uniep-cuda"``): ``world`` local ranks that share ONE GPU
  (``CUDA_VISIBLE_DEVICES`` pinned to the first visible device, NVSHMEM's multiple processes per
  GPU, host agreement over gloo: how tests/parm/test_gpu_parm.py runs the CUDA executor). They time
  the CUDA executor's own primitives (``uniep.parm.cuda.CudaBackend``, bf16): the MP all-gather,
  reduce-scatter and all-reduce (an all-gather plus a sum in MP-rank order) and the EP
  all-to-all. These run on UniEP's P2P collectives over the MP and EP groups' own runtimes, as
  in the executor. The GEMM is a bf16 CUDA matmul.

  **This measures one GPU, not a cluster.** The ranks' kernels time-slice the GPU, and every
  "link", intra and inter alike, is copies within that GPU's memory. The coefficients describe
  the CUDA executor on this GPU at this world size, not NVLink or InfiniBand: they are what to
  price ``measure_layers(device="cuda")`` on the same GPU with, not a model of a real cluster.

On both, the MP groups count as intra-node and the EP groups as inter-node, as on a cluster with
one MP group per node. Message sizes follow the cost model's convention: all-gather output,
reduce-scatter input, all-reduce buffer, all-to-all per-rank send bytes. A sample is one call
after a barrier of the ranks (on CUDA: with ``torch.cuda.synchronize()`` before and after, wall
clock, so the side streams and the host's launches are in it). A size's time is the
slowest rank's median. The GEMM runs on rank 0 alone while the others wait, so its fit is the
device's own GEMM rate; in the measured layers the ranks' GEMMs share the GPU, which the cost
model does not know. Each (collective, link) and the GEMM is fitted with ``fit_alpha_beta``
(alpha, beta, R^2).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import _C
from . import fit_alpha_beta, new_groups

DEVICES = ("cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "uniep-cuda"}

# Message sizes in bytes, 1 MiB .. 16 MiB in 16 even steps (FSMoE's profile also steps linearly):
# large enough that the bandwidth term stands out of the scheduling noise of shared CPU cores.
DEFAULT_SIZES = [2**20 * i for i in range(1, 17)]
GEMM_SIZES = [(64 * i, 256, 256) for i in range(1, 13)]  # (m, k, n)
# On the GPU: 4 MiB .. 64 MiB, the range of the measured layers' transfers (a token block of
# 2048 x 1024 bf16 is 4 MiB), where a copy within HBM is not all launch and wait overhead.
CUDA_SIZES = [4 * 2**20 * i for i in range(1, 17)]
CUDA_GEMM_SIZES = [(1024 * i, 2048, 2048) for i in range(1, 13)]  # (m, k, n), bf16
# The calibration layer (num_experts = the world size, so that every EP size divides it): small
# enough that its transfers and GEMMs are a small part of its time. What its schedules take
# beyond the cost model's price of those is what each step costs the executor (the host's work
# and launches), fitted as the model's step_alpha.
CALIBRATION_LAYER = dict(tokens=256, hidden=256, ffn_hidden=512, top_k=1, capacity_factor=1.2)
# What the CUDA executor calls for the MP and EP collectives (parm_cuda.CudaBackend).
_CUDA_OPS = ("all_gather", "reduce_scatter", "all_to_all_ulysses")


def default_sizes(device: str = "cpu") -> list[int]:
    """The profile's message sizes in bytes on ``device`` (16 of them)."""
    check_device(device, need_cuda=False)
    return list(CUDA_SIZES if device == "cuda" else DEFAULT_SIZES)


def largest_message(layers: list[dict], world: int, mp_size: int, device: str = "cpu") -> int:
    """The largest message, in bytes of the cost model's convention (``Step.bytes``), that any
    schedule of ``layers`` sends, forward or backward, on ``world`` ranks with MP groups of
    ``mp_size`` (one MP group per node, as the profile lays them out), in ``device``'s dtype
    (float32 on CPU, bf16 on CUDA); 0 for no layer."""
    from . import SCHEDULES, plan

    check_device(device, need_cuda=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    most = 0
    for cfg in layers:
        shape = plan(world, mp_size, dtype=dtype, gpus_per_node=mp_size, **cfg).shape
        for schedule in SCHEDULES:
            for pass_ in ("forward", "backward"):
                steps = _C.parm.build_steps(shape, schedule, pass_).steps
                most = max([most, *(st.bytes for st in steps if st.collective != "none")])
    return most


def stretched_sizes(device: str, most: int, count: int | None = None) -> list[int]:
    """The first ``count`` (2 to 16; None: all 16) of ``default_sizes(device)``, or where
    ``most`` bytes lie past the last of those, ``count`` even steps (in whole MiB) from the first
    size up to ``most`` rounded up to a MiB."""
    sizes = default_sizes(device)
    count = len(sizes) if count is None else count
    if not 2 <= count <= len(sizes):
        raise ValueError(f"count must be in [2, {len(sizes)}] (a fit needs two sizes), got {count}")
    sizes = sizes[:count]
    if most <= sizes[-1]:
        return sizes
    mib = 2**20
    first, top, steps = sizes[0] // mib, -(-most // mib), count - 1
    return [(first + round((top - first) * i / steps)) * mib for i in range(steps + 1)]


def sizes_for_layers(
    layers: list[dict], world: int, mp_size: int, device: str = "cpu"
) -> list[int]:
    """The profile's message sizes for pricing ``layers``: ``stretched_sizes`` up to the largest
    message any of their schedules sends (``largest_message``). Why: a fit is only as good as the
    range it saw, and the cost model priced the largest layers measured on four GPUs, whose
    messages lay past the profile's 64 MiB, outside it."""
    return stretched_sizes(device, largest_message(layers, world, mp_size, device))


def cuda_problems() -> list[str]:
    """Why the CUDA profile cannot run in this process; empty when it can."""
    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    if not getattr(_C, "has_ep_runtime", False):
        problems.append("this build of uniep has no CUDA collectives runtime")
    missing = [
        f"uniep::{op}"
        for op in _CUDA_OPS
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"uniep::{op}", "CUDA")
    ]
    if missing:
        problems.append(f"no CUDA kernel for {', '.join(missing)}")
    return problems


def check_device(device: str, need_cuda: bool = True) -> None:
    """Raise ValueError unless ``device`` is "cpu" or "cuda"; with ``need_cuda``, RuntimeError if
    "cuda" cannot run here (naming what is missing)."""
    if device not in DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    problems = cuda_problems() if device == "cuda" and need_cuda else []
    if problems:
        raise RuntimeError(
            "device='cuda' needs a CUDA build of torch, a visible GPU and uniep built with its "
            f"CUDA collectives: {'; '.join(problems)} (uniep build_info: {dict(_C.build_info())})"
        )


@contextlib.contextmanager
def _ranks_share_one_gpu() -> Iterator[None]:
    """Spawned ranks see only the first visible GPU, also on a multi-GPU machine."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = (before or "0").split(",")[0]
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _run(fn: Callable[..., Any], world: int, args: tuple, device: str, timeout_s: float) -> list:
    from ..distributed import run_local_ranks

    if device == "cpu":
        return run_local_ranks(fn, world, args, timeout_s=timeout_s)
    with _ranks_share_one_gpu():
        # NCCL refuses two ranks on one device: gloo carries the host agreement and barriers.
        return run_local_ranks(fn, world, args, backend="gloo", timeout_s=timeout_s)


def _rank_device(rank: int) -> torch.device:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    # platform.processor() is empty on many Linux systems; machine() always has a value.
    return "cpu-" + (platform.processor() or platform.machine() or "unknown")


def _sample(fn: Any, group: Any, sync: bool, cuda: bool) -> float:
    """Seconds of one call of ``fn``, after a barrier of ``group`` when ``sync``; with ``cuda``
    the device is idle at the start and the call's GPU work is done at the end."""
    if cuda:
        torch.cuda.synchronize()
    if sync:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _time(fn: Any, iters: int, group: Any = None, sync: bool = True, cuda: bool = False) -> float:
    fn()  # warm-up (buffers, connections, runtimes)
    return statistics.median(_sample(fn, group, sync, cuda) for _ in range(iters))


def _time_interleaved(fns: dict[str, Any], iters: int, cuda: bool) -> dict[str, float]:
    """Median seconds of each function's calls. The calls take turns (a round calls each once),
    so a drift in the shared GPU's speed hits all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(_sample(fn, None, True, cuda))
    return {name: statistics.median(t) for name, t in times.items()}


def _collective(kind: str, n_bytes: int, group: Any, size: int) -> Any:
    elems = max(size, n_bytes // 4 // size * size)  # divisible by the group size
    if kind == "all_gather":
        inp, out = torch.ones(elems // size), torch.empty(elems)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if kind == "reduce_scatter":
        inp, out = torch.ones(elems), torch.empty(elems // size)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    if kind == "all_reduce":
        buf = torch.ones(elems)
        return lambda: dist.all_reduce(buf, group=group)
    inp, out = torch.ones(elems), torch.empty(elems)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def _cuda_collective(kind: str, n_bytes: int, backend: Any, size: int, dev: torch.device) -> Any:
    """The CUDA executor's primitive of ``kind`` on bf16 buffers of ``n_bytes`` (the cost
    model's convention), as the step interpreter calls it."""
    elems = max(size, n_bytes // 2 // size * size)  # divisible by the group size

    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(*shape, dtype=torch.bfloat16, device=dev)

    if kind == "all_gather":
        part = ones(elems // size)
        return lambda: backend.mp_all_gather(part)
    if kind == "reduce_scatter":
        partials = ones(size, elems // size)
        return lambda: backend.mp_reduce_scatter(partials)
    if kind == "all_reduce":
        buf = ones(elems)
        return lambda: backend.mp_all_reduce(buf)
    blocks = ones(size, elems // size)
    return lambda: backend.ep_all_to_all(blocks)


def _plan(world: int, mp_size: int) -> list[tuple[str, str, int]]:
    """(collective, link, group size) of the profile; groups of one rank are left out."""
    plan = [
        ("all_gather", "intra", mp_size),
        ("reduce_scatter", "intra", mp_size),
        ("all_reduce", "intra", mp_size),
        ("all_to_all", "inter", world // mp_size),
    ]
    return [p for p in plan if p[2] > 1]


def profile_rank(
    rank: int, world: int, mp_size: int, sizes: list[int], iters: int, device: str = "cpu"
) -> dict:
    """Every rank's median seconds per (collective, link, size), and rank 0's GEMM times."""
    if device == "cuda":
        return _profile_rank_cuda(rank, world, mp_size, sizes, iters)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_tensor names, deprecated
    mp, ep = new_groups(mp_size)
    out: dict[str, Any] = {"comm": {}, "gemm": [], "device_name": _device_name("cpu")}
    for kind, link, size in _plan(world, mp_size):
        group = mp if link == "intra" else ep
        out["comm"][f"{kind}/{link}"] = [
            (n, _time(_collective(kind, n, group, size), iters, group)) for n in sizes
        ]
    if rank == 0:  # alone: the other ranks wait in the barrier below
        for m, k, n in GEMM_SIZES:
            a, b = torch.randn(m, k), torch.randn(k, n)
            t = _time(lambda a=a, b=b: a @ b, iters, sync=False)
            out["gemm"].append((2.0 * m * k * n, t))
    dist.barrier()
    out["calibration"] = _calibration(world, mp, ep, iters, None)
    return out


def _calibration(
    world: int, mp: Any, ep: Any, iters: int, dev: torch.device | None
) -> dict[str, float]:
    """Median seconds of one forward + backward of ``CALIBRATION_LAYER`` per schedule, its SAA
    pairs unpipelined (the executor's calls one per step), on ``dev`` (None: the CPU)."""
    cfg = dict(CALIBRATION_LAYER, num_experts=world)
    calls = _schedule_calls(mp, ep, cfg, dev, chunks=1)
    return _time_interleaved(calls, iters, cuda=dev is not None)


def _profile_rank_cuda(rank: int, world: int, mp_size: int, sizes: list[int], iters: int) -> dict:
    from . import cuda as parm_cuda
    from .cpu import Groups

    dev = _rank_device(rank)
    mp, ep = new_groups(mp_size)
    groups = Groups(
        mp=mp,
        ep=ep,
        mp_size=mp_size,
        ep_size=world // mp_size,
        mp_index=dist.get_rank(mp),
        ep_index=dist.get_rank(ep),
    )
    # One runtime per group for the whole profile, sized for the largest block (an all-reduce
    # gathers its whole buffer from every rank): none is re-created between sizes.
    backend = parm_cuda.CudaBackend(None, groups, block_bytes=max(sizes))
    out: dict[str, Any] = {"comm": {}, "gemm": [], "device_name": _device_name("cuda")}
    for kind, link, size in _plan(world, mp_size):
        # Every rank calls at once (its own group's collective): the barrier is the world's.
        out["comm"][f"{kind}/{link}"] = [
            (n, _time(_cuda_collective(kind, n, backend, size, dev), iters, cuda=True))
            for n in sizes
        ]
    backend.end_pass()  # a device wait that timed out raises here, naming the peer
    if rank == 0:  # alone: the other ranks wait in the barrier below
        for m, k, n in CUDA_GEMM_SIZES:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
            t = _time(lambda a=a, b=b: a @ b, iters, sync=False, cuda=True)
            out["gemm"].append((2.0 * m * k * n, t))
    dist.barrier()
    out["calibration"] = _calibration(world, mp, ep, iters, dev)
    parm_cuda.shutdown()
    return out


def profile(
    world: int = 4,
    mp_size: int = 2,
    sizes: list[int] | None = None,
    iters: int = 5,
    timeout_s: float = 300.0,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run the profile on ``world`` local ranks (gloo on CPU, or ranks sharing one GPU with
    ``device="cuda"``; see the module docstring) and fit every (collective, link) and the GEMM.

    Args:
        world, mp_size: the Parm layout (MP groups of ``mp_size`` consecutive ranks).
        sizes: message sizes in bytes (None: ``default_sizes(device)``).
        iters: timed calls per size (after one warm-up call).
        device: "cpu" or "cuda".

    Returns:
        ``{"world_size", "mp_size", "iters", "device", "backend", "device_name",
        "coefficients": {collective: {link: {"alpha", "beta", "r2", "samples"}}},
        "gemm": {"alpha", "beta", "r2", "samples"}}``; ``samples`` are (bytes or flops, seconds).

    Raises:
        ValueError: ``device`` is neither "cpu" nor "cuda".
        RuntimeError: ``device="cuda"`` cannot run here (no GPU, no CUDA collectives), or a
            rank failed.
    """
    check_device(device)
    sizes = sizes or default_sizes(device)
    per_rank = _run(profile_rank, world, (mp_size, sizes, iters, device), device, timeout_s)
    return fit_profile(per_rank, world, mp_size, iters, device)


def fit_profile(
    per_rank: list[dict], world: int, mp_size: int, iters: int, device: str = "cpu"
) -> dict[str, Any]:
    """``profile``'s result from every rank's ``profile_rank`` output."""
    check_device(device, need_cuda=False)
    result: dict[str, Any] = {
        "world_size": world,
        "mp_size": mp_size,
        "iters": iters,
        "device": device,
        "backend": BACKENDS[device],
        "device_name": per_rank[0]["device_name"],
        "coefficients": {},
    }
    for key in per_rank[0]["comm"]:
        # A collective is as slow as its slowest rank.
        samples = [
            (n, max(r["comm"][key][i][1] for r in per_rank))
            for i, (n, _) in enumerate(per_rank[0]["comm"][key])
        ]
        fit = fit_alpha_beta([n for n, _ in samples], [t for _, t in samples])
        kind, link = key.split("/")
        result["coefficients"].setdefault(kind, {})[link] = {
            "alpha": fit.alpha,
            "beta": fit.beta,
            "r2": fit.r2,
            "samples": samples,
        }
    gemm = per_rank[0]["gemm"]
    fit = fit_alpha_beta([f for f, _ in gemm], [t for _, t in gemm])
    result["gemm"] = {"alpha": fit.alpha, "beta": fit.beta, "r2": fit.r2, "samples": gemm}
    if "calibration" in per_rank[0]:
        # Each schedule as slow as its slowest rank, as for the collectives.
        calib = [r["calibration"] for r in per_rank]
        measured = {s: max(c[s] for c in calib) for s in calib[0]}
        result["step_alpha"] = fit_step_alpha(result, measured)
    return result


def fit_step_alpha(result: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
    """The cost model's ``step_alpha`` from the calibration layer's ``measured`` seconds per
    schedule (forward + backward): what they took beyond the price of the profile's own
    coefficients, per step, over the three schedules together (0 if nothing is left)."""
    from . import plan

    world, mp_size = result["world_size"], result["mp_size"]
    dtype = torch.bfloat16 if result["device"] == "cuda" else torch.float32
    cfg = dict(CALIBRATION_LAYER, num_experts=world)
    shape = plan(world, mp_size, dtype=dtype, gpus_per_node=mp_size, **cfg).shape
    model = cost_model_from_profile(dict(result, step_alpha=None))
    model.max_chunks = 1  # the calibration ran its SAA pairs whole
    residual, steps = 0.0, 0
    for schedule, seconds in measured.items():
        for pass_ in ("forward", "backward"):
            lst = _C.parm.build_steps(shape, schedule, pass_)
            seconds -= _C.parm.price(lst, model).seconds
            steps += len(lst.steps)
        residual += seconds
    return {"seconds": max(0.0, residual / steps), "measured": measured, "steps": steps}


# What a CostModel holds, as profiled_coefficients names it: each (collective, link), the GEMM's
# alpha/beta, the roofline's memory term and the cost per step.
COEFFICIENTS = (
    *(
        f"{kind}/{link}"
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        for link in ("intra", "inter")
    ),
    "gemm",
    "mem_beta",
    "step_alpha",
)


def profiled_coefficients(result: dict[str, Any]) -> list[str]:
    """The names (of ``COEFFICIENTS``) that ``cost_model_from_profile`` takes from the profile
    ``result``; the others keep ``base``'s values. A profile never measures ``mem_beta``, nor
    the MP collectives at MP size 1."""
    names = [f"{kind}/{link}" for kind, links in result["coefficients"].items() for link in links]
    if "gemm" in result:
        names.append("gemm")
    if result.get("step_alpha"):
        names.append("step_alpha")
    return [name for name in COEFFICIENTS if name in names]


def cost_model_from_profile(result: dict[str, Any], base: Any = None) -> Any:
    """A ``CostModel`` with the profile's coefficients (``profiled_coefficients``); what it did
    not measure comes from ``base`` (another CostModel, changed in place and returned) or is
    zero. Pricing a described cluster with a profile: ``base`` its ``cost_model`` for the
    layout, so that nothing unmeasured is priced free."""
    model = base or _C.parm.CostModel()
    for kind, links in result["coefficients"].items():
        for link, c in links.items():
            model.set(kind, link, _C.parm.AlphaBeta(c["alpha"], c["beta"]))
    if "gemm" in result:
        model.gemm = _C.parm.AlphaBeta(result["gemm"]["alpha"], result["gemm"]["beta"])
    if result.get("step_alpha"):
        model.step_alpha = result["step_alpha"]["seconds"]
    return model


def _new_layer(
    mp: Any,
    ep: Any,
    cfg: dict,
    schedule: str,
    dtype: torch.dtype,
    model: Any = None,
    chunks: int | str = "auto",
) -> Any:
    from . import ParmMoELayer

    torch.manual_seed(0)
    return ParmMoELayer(
        mp,
        ep,
        cfg["hidden"],
        cfg["ffn_hidden"],
        cfg["num_experts"],
        cfg["top_k"],
        capacity_factor=cfg["capacity_factor"],
        schedule=schedule,
        overflow="drop",
        dtype=dtype,
        model=model,
        chunks=chunks,
    )


def _layer_input(cfg: dict) -> torch.Tensor:
    """The layer's input [tokens, hidden] float32, the same on every rank."""
    return torch.randn(cfg["tokens"], cfg["hidden"], generator=torch.Generator().manual_seed(1))


def measure_rank(
    rank: int,
    world: int,
    mp_size: int,
    layers: list[dict],
    iters: int,
    device: str = "cpu",
    model: Any = None,
    chunks: int | str = "auto",
) -> list:
    """Median seconds of ParmMoELayer forward+backward per layer config and schedule. With
    ``chunks="auto"`` ``model`` prices the layers' SAA chunk counts, so each layer runs what the
    model priced (None: the h100-ib preset); an int runs every pair in that many."""
    if device == "cuda":
        return _measure_rank_cuda(rank, world, mp_size, layers, iters, model, chunks)
    mp, ep = new_groups(mp_size)
    out = []
    for cfg in layers:
        calls = _schedule_calls(mp, ep, cfg, None, model, chunks)
        out.append({schedule: _time(call, iters) for schedule, call in calls.items()})
    return out


def _fwd_bwd(layer: Any, x: torch.Tensor) -> None:
    y = layer(x)
    (y.float().sum() + layer.l_aux).backward()


def _schedule_calls(
    mp: Any,
    ep: Any,
    cfg: dict,
    dev: torch.device | None,
    model: Any = None,
    chunks: int | str = "auto",
) -> dict[str, Callable[[], None]]:
    """Per schedule, one forward + backward of the layer ``cfg`` on ``dev`` (bf16), or on the
    CPU (float32) when ``dev`` is None, with ``model`` and ``chunks`` as in ``ParmMoELayer``."""
    from . import SCHEDULES

    dtype = torch.float32 if dev is None else torch.bfloat16
    calls = {}
    for schedule in SCHEDULES:
        layer = _new_layer(mp, ep, cfg, schedule, dtype, model, chunks)
        x = _layer_input(cfg).to(dtype)
        if dev is not None:
            layer, x = layer.to(dev), x.to(dev)
        x.requires_grad_()
        calls[schedule] = lambda layer=layer, x=x: _fwd_bwd(layer, x)
    return calls


def _measure_rank_cuda(
    rank: int,
    world: int,
    mp_size: int,
    layers: list[dict],
    iters: int,
    model: Any,
    chunks: int | str,
) -> list[dict[str, float]]:
    from . import cuda as parm_cuda
    from . import plan

    dev = _rank_device(rank)
    mp, ep = new_groups(mp_size)
    blocks = [
        parm_cuda.layer_block_bytes(
            plan(world, mp_size, dtype=torch.bfloat16, gpus_per_node=mp_size, **cfg).shape
        )
        for cfg in layers
    ]
    out: list[dict[str, float]] = [{} for _ in layers]
    # The layer with the largest blocks first: the groups' runtimes are created for it
    # (and NVSHMEM's heap, which is sized when the first one starts) and never grow.
    for i in sorted(range(len(layers)), key=lambda i: -blocks[i]):
        calls = _schedule_calls(mp, ep, layers[i], dev, model, chunks)
        out[i] = _time_interleaved(calls, iters, cuda=True)
    parm_cuda.shutdown()
    return out


def measure_layers(
    world: int,
    mp_size: int,
    layers: list[dict],
    iters: int = 3,
    model: Any = None,
    timeout_s: float = 600.0,
    device: str = "cpu",
    chunks: int | str = "auto",
) -> list[dict[str, Any]]:
    """Measure every schedule of every layer and set beside it the cost model's prediction: per
    layer the measured and predicted seconds, the predicted choice, the measured best, and the
    regret of the choice (``measure_rows``).

    A layer's time is one forward + backward of ``ParmMoELayer`` (``overflow="drop"``), the
    slowest rank's median over ``iters`` calls after a warm-up. ``device="cpu"``: float32 on
    local gloo ranks (the CPU executor), the schedules timed one after the other.
    ``device="cuda"``: bf16 on ``world`` ranks sharing one GPU (the CUDA executor; ranks and
    caveats as in ``profile``), the three schedules' calls taking turns, each call between
    ``torch.cuda.synchronize()`` calls. ``model`` is the ``CostModel`` that chooses (e.g.
    ``cost_model_from_profile`` of a profile on the same device) and prices the SAA chunk counts
    the layers run with (``chunks="auto"``; an int runs every pair in that many); None: the
    h100-ib preset.

    ``layers``: dicts of ``tokens, hidden, ffn_hidden, num_experts, top_k, capacity_factor``.

    Raises:
        ValueError: ``device`` is neither "cpu" nor "cuda".
        RuntimeError: ``device="cuda"`` cannot run here, or a rank failed.
    """
    check_device(device)
    fn_args = (mp_size, layers, iters, device, model, chunks)
    per_rank = _run(measure_rank, world, fn_args, device, timeout_s)
    return measure_rows(layers, per_rank, world, mp_size, model, device, chunks)


def measure_rows(
    layers: list[dict],
    per_rank: list[list[dict[str, float]]],
    world: int,
    mp_size: int,
    model: Any = None,
    device: str = "cpu",
    chunks: int | str = "auto",
) -> list[dict[str, Any]]:
    """``measure_layers``' rows from every rank's ``measure_rank`` output: per layer its config
    and ``measured`` / ``predicted`` seconds per schedule, ``chosen`` (the cost model's pick,
    priced in the device's dtype: float32 on CPU, bf16 on CUDA), ``measured_best``, ``right``,
    ``regret`` (the chosen schedule's measured time over the best's, minus 1) and ``saa_chunks``
    (per schedule, the largest SAA chunk count the layers ran with: on CUDA the model's with
    ``chunks="auto"``, else ``chunks``; 1: no pair was pipelined, as always on the CPU, whose
    gloo executor runs every pair whole)."""
    from . import cost_model, plan, saa_chunk_plan

    check_device(device, need_cuda=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for i, cfg in enumerate(layers):
        measured = {s: max(r[i][s] for r in per_rank) for s in per_rank[0][i]}
        p = plan(world, mp_size, dtype=dtype, gpus_per_node=mp_size, model=model, **cfg)
        priced = model or cost_model(world, mp_size, "h100-ib", mp_size)
        ran = {
            s: max(saa_chunk_plan(p.shape, s, priced, chunks)) if device == "cuda" else 1
            for s in measured
        }
        best = min(measured, key=measured.get)
        rows.append(
            dict(
                cfg,
                measured=measured,
                predicted={s: v["total"] for s, v in p.predicted.items()},
                chosen=p.schedule,
                measured_best=best,
                right=p.schedule == best,
                regret=measured[p.schedule] / measured[best] - 1,
                saa_chunks=ran,
            )
        )
    return rows
