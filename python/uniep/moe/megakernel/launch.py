"""The MoE MegaKernel's pieces composed at world 1 (docs/megakernel.md, step 2): the forward of
one rank's experts on its own tokens with no host sync anywhere, from the same device functions
the persistent kernel will run.

1. the counts per expert, their row ends and the tiles' gate counters, on the device in one
   launch (:func:`uniep.moe.tile_gates.expert_tiles`);
2. the dispatch (:func:`uniep.moe.tile_gates.sender_rows`,
   :func:`uniep.moe.tile_gates.send_rows`): every ``(token, k)`` row stored at its grouped-GEMM
   row, expert-contiguous, each row counted on its tile gate;
3. GEMM 1 with the SwiGLU epilogue (``w1`` packed by :func:`uniep.gemm.pack_gate_up`), gated on
   the rows' counters, signalling ``done`` per tile;
4. GEMM 2, gated on ``done``;
5. the reduce over k (:func:`uniep.moe.tile_gates.combine_rows`).

Across the ranks of a group, :func:`moe_forward_ep` runs the same kernel on the group's fused
runtime (:func:`init_fused_ep`; include/uniep/cuda/fused_ep.hpp): a count exchange, the plan, and
one persistent launch per rank that stores each row straight into its expert's GEMM row on the
expert's rank, computes the local experts gated tile by tile (GEMM 2 storing each output in its
source's (token, k) slot), and reduces the rank's tokens from its own slots. On CPU tensors the
CPU executor runs the same plan over gloo.

Buffers are sized by capacity (``tokens x top_k`` rows), so the host never reads a count.
``overlap="sequential"`` runs the steps one after the other on the current stream;
``overlap="streams"`` runs the send on ``comm_sms`` SMs beside GEMM 1, which waits per tile;
``overlap="fused"`` is the MegaKernel (``torch.ops.uniep.moe_fused_local``,
include/uniep/cuda/fused_moe.hpp): one persistent launch in which the first ``comm_sms`` CTAs
send the rows (in GEMM-row order, or in token order when every CTA sends) and then join the
GEMMs, both GEMMs run as one grouped GEMM gated tile by tile, and after its tiles each CTA's
warps take the tokens in turn and reduce them. All three give the
same bits: a gate changes when a tile starts, never what it computes.
"""

from __future__ import annotations

import atexit
import threading
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ... import _C, distributed
from ...tuning.params import parse as parse_tuning
from .. import tile_gates

__all__ = [
    "check_errors",
    "ensure_fused_ep",
    "expert_counts",
    "fused_by_default",
    "fused_ep_fits",
    "fused_ep_heap_bytes",
    "fused_tile_m",
    "fused_tile_n",
    "fused_tile_shape",
    "init_fused_ep",
    "megakernel_numerics",
    "megakernel_overlap",
    "megakernel_shape_ok",
    "moe_forward_ep",
    "moe_forward_local",
    "runs_fused",
    "sends_beside_gemms",
    "shutdown_fused_ep",
    "trace_phases",
]

OVERLAPS = ("sequential", "streams", "fused")
# The fused kernel's tile heights (include/uniep/cuda/fused_moe.hpp, FusedMoeLaunch::tile_m).
FUSED_TILE_MS = (128, 64)
# Its tile widths (FusedMoeLaunch::tile_n): 256, and with 64-row tiles also 128 (the decode
# shape: clusters of one CTA, twice the tiles reading weights at once).
FUSED_TILE_NS = (256, 128)
# CTAs that send first across ranks by default (moe_forward_ep).
EP_COMM_SMS = 32


# Error words of calls made with check="deferred", oldest first: each call's event and its
# (kind, pinned host copy, what, top_k) entries, read once the event has passed.
_PENDING: list[tuple[torch.cuda.Event, list[tuple[str, torch.Tensor, str, int]]]] = []
# Threads of one process (a server's) share the list: each call is taken off it once, by one.
_PENDING_LOCK = threading.Lock()
_AT_EXIT: list[bool] = []
# The deferred calls' errors inside CUDA graphs: per (kind, what, top_k, device), a device word
# that keeps the first error any replay recorded (a graph cannot copy to the host for each
# replay). Made by the eager calls before capture (the warm-up every captured call needs),
# read by check_errors().
_STICKY: dict[tuple[str, str, int, torch.device], torch.Tensor] = {}


def _raise_from(entries: list[tuple[str, torch.Tensor, str, int]]) -> None:
    for kind, word, what, top_k in entries:
        if kind == "send":
            tile_gates.check_send_error(word, top_k, what)
        else:
            tile_gates.check_gate_timeout(word, what)


def check_errors(wait: bool = True) -> None:
    """Raise the error of the oldest earlier call made with ``check="deferred"`` that recorded
    one (``ValueError`` for a bad expert id, ``TimeoutError`` for rows or a rank that never came,
    as ``check=True`` would have raised it then), and forget the calls checked. ``wait``: wait for
    the calls still on their streams; without it only the ones finished are checked (no wait).
    Every deferred call runs ``check_errors(wait=False)`` first, so an error surfaces at the
    latest one call after its own once its stream has reached it, or here.

    Deferred calls captured in a CUDA graph keep their first error on the device, across
    replays: only ``check_errors()`` with ``wait`` reads them (after synchronizing the device),
    raises the first, and clears them."""
    while True:
        with _PENDING_LOCK:
            if not _PENDING:
                break
            event, entries = _PENDING[0]
            if not wait and not event.query():
                return
            _PENDING.pop(0)
        event.synchronize()
        _raise_from(entries)
    if wait and _STICKY:
        _check_sticky()


def _check_sticky() -> None:
    """Raise the first error the captured calls kept (in the order the calls made their words:
    a call's plan before its kernel), clearing every word: the others come from the same failed
    replays, as a failed eager call raises its first error only."""
    for device in {key[3] for key in _STICKY}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    found = []
    for (kind, what, top_k, _), word in _STICKY.items():
        host = word.to("cpu", copy=True)  # a copy also of a CPU word, which is zeroed next
        if host.any():
            word.zero_()
            found.append((kind, host, f"{what} (in a CUDA graph)", top_k))
    _raise_from(found)


def sticky_word(kind: str, word: torch.Tensor, what: str, top_k: int) -> torch.Tensor:
    """The sticky word of (kind, what, top_k) on ``word``'s device, made (zeroed) outside
    capture; inside a capture a missing one is an error naming the warm-up."""
    key = (kind, what, top_k, word.device)
    sticky = _STICKY.get(key)
    if sticky is None:
        if word.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{what}: check='deferred' inside a CUDA graph keeps its errors in a device word "
                "made by an eager call: run the call once (with the same top_k) before capturing "
                "it, as torch.cuda.graphs asks of every captured call"
            )
        sticky = torch.zeros_like(word)
        _STICKY[key] = sticky
    return sticky


def _check_at_exit() -> None:
    try:
        check_errors()
    except (ValueError, TimeoutError, RuntimeError) as e:
        warnings.warn(
            "uniep.moe.megakernel.launch: a call made with check='deferred' failed and was "
            f"never checked: {e}",
            RuntimeWarning,
            stacklevel=1,
        )


def finish_call(check: bool | str, entries: list[tuple[str, torch.Tensor, str, int]]) -> None:
    """The end of a call: raise its errors now (``True``, waits for the stream), record them for
    :func:`check_errors` (``"deferred"``), or leave them (``False``)."""
    if check is True:
        _raise_from(entries)
    elif check == "deferred":
        stickies = [sticky_word(kind, word, what, top_k) for kind, word, what, top_k in entries]
        if entries and entries[0][1].is_cuda and torch.cuda.is_current_stream_capturing():
            # Each sticky word takes its word where it holds no error yet (its first element 0),
            # every word of the call in one launch: what a replayed graph can do instead of
            # copying the words to the host.
            words = [word.reshape(-1) for _, word, _, _ in entries]
            torch.ops.uniep.keep_first_errors([s.view(-1) for s in stickies], words)
            return
        host = []
        for kind, word, what, top_k in entries:
            copy = torch.empty(word.shape, dtype=word.dtype, pin_memory=True)
            copy.copy_(word, non_blocking=True)
            host.append((kind, copy, what, top_k))
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(entries[0][1].device))  # the call's stream
        with _PENDING_LOCK:
            _PENDING.append((event, host))
        if not _AT_EXIT:
            _AT_EXIT.append(True)
            atexit.register(_check_at_exit)


def begin_call(check: bool | str) -> None:
    """The start of a call: validate ``check`` and raise what earlier deferred calls recorded."""
    if check not in (True, False, "deferred"):
        raise ValueError(f"check must be True, False or 'deferred', got {check!r}")
    if check == "deferred" and not torch.cuda.is_current_stream_capturing():
        # Inside a capture nothing is read: the call's errors stay on the device (finish_call).
        check_errors(wait=False)


def fused_tile_m(
    rows: int,
    num_experts: int,
    device: torch.device | int | None = None,
    pingpong_rows: int | None = None,
) -> int:
    """The fused kernel's tile height for ``rows`` GEMM rows over ``num_experts`` experts on
    ``device`` (default: the current one): 64 (the ping-pong tiles, one warpgroup's epilogue
    under the other's mainloop) when the experts average at most
    :func:`uniep.gemm.pingpong_rows` rows (2048 on an H200, 256 on an H100), else 128. At world
    1 on one H200 with every CTA sending, 64-row tiles were 6-15% faster on experts of 128 to
    1024 rows and 128-row tiles 10% faster on Mixtral's 8192 (2026-11-26, commit 17282dd); on
    one H100 the 128-row tiles were 5-12% faster on experts of 512 and 1024 rows and the 64-row
    ones 13% on 256 (2026-11-26, commit 59fa2a5). ``pingpong_rows``
    given: that limit instead of ``device``'s (the tuner's cost model prices a device by its
    calibrated limit)."""
    if pingpong_rows is None:
        from ...gemm import pingpong_rows as device_rows

        pingpong_rows = device_rows(device)
    return 64 if rows <= pingpong_rows * num_experts else 128


def fused_tile_n(tile_m: int, rows: int, num_experts: int, ffn: int = 0, sms: int = 0) -> int:
    """The fused kernel's tile width when it is left to the launch (``tile_n`` auto;
    ``_C.fused_auto_tile_n``, the C++ ``uniep::fused_auto_tile_n`` the launch runs): 128, the
    decode shape in clusters of one CTA, where the tiles are 64 rows and ``rows`` GEMM rows
    average at most one tile over ``num_experts`` experts, unless GEMM 1's tiles over the most
    experts the rows can touch take two rounds of ``sms`` SMs at 128 columns and one at 256
    (experts of FFN ``ffn``; 0: not checked); else 256. At world 1 on one H200 the 128-wide
    tiles were 5-16% faster than 64 x 256 ones from 1 to 512 tokens on 128 experts (2026-12-02,
    commit feae907), but 7% slower at one token on 256 experts of FFN 2048, whose 8 experts'
    GEMM-1 tiles took two rounds of the SMs at 128 columns (b03d94d)."""
    return int(_C.fused_auto_tile_n(tile_m, rows, num_experts, ffn, sms))


def fused_by_default(rows: int, num_experts: int, world: int) -> bool:
    """Whether ``moe_forward_prepared`` with packed bf16 experts and an empty tuning string (and
    nothing cached for the shape) runs the MegaKernel: at world 1 where ``rows`` GEMM rows
    average at most one 64-row tile over the experts (decode). On one H200 (2026-12-02, commit
    feae907, bench_decode, eager calls) its launch (``moe_forward_local``) took 0.24-0.59x the
    separate launches' time from 1 to 512 tokens on 128 experts of FFN 768 and 0.27-0.91x on
    256 of FFN 2048, and it alone has no host sync, so a decode step can be captured in a CUDA
    graph. Across ranks the fused runtime's size agreement is a host round trip per call, so the
    default stays the separate launches there."""
    return world == 1 and num_experts > 0 and 0 < rows <= 64 * num_experts


# The most entries (tokens x top_k) and experts whose plan the MegaKernel's first launch makes
# itself (kFusedPlanMaxEntries and kFusedPlanMaxExperts, include/uniep/cuda/fused_moe.hpp).
FUSED_PLAN_MAX_ENTRIES = 4096
FUSED_PLAN_MAX_EXPERTS = 1024


def planned_in_launch(
    entries: int, num_experts: int, comm_sms: int, sms: int, trace: torch.Tensor | None
) -> bool:
    """Whether ``moe_forward_local(overlap="fused")`` plans the routing in the MegaKernel's first
    launch (``torch.ops.uniep.moe_fused_local_planned``: a decode step in two launches, not
    three, with the same bits): a decode batch, every CTA sending, no trace."""
    return (
        entries <= FUSED_PLAN_MAX_ENTRIES
        and num_experts <= FUSED_PLAN_MAX_EXPERTS
        and comm_sms >= sms
        and trace is None
    )


def fused_tile_shape(
    tile_m: int | None, tile_n: int | None, overlap: str = "fused"
) -> tuple[int | None, int]:
    """``(tile_m, tile_n)`` for the fused kernel's launch from the caller's: tile_n 0 for auto
    (the launch's choice), and 64-row tiles where 128-wide ones are asked for with the height left
    to the choice.

    Raises:
        ValueError: a width the kernel was not built with, or 128 with 128-row tiles, or any
            width with another overlap than ``fused``.
    """
    if tile_n is None:
        return tile_m, 0
    if overlap != "fused" or tile_n not in FUSED_TILE_NS:
        raise ValueError(
            f"tile_n must be None or, with overlap='fused', one of {FUSED_TILE_NS}; got {tile_n} "
            f"with overlap={overlap!r}"
        )
    if tile_n == 128:
        if tile_m == 128:
            raise ValueError(
                "tile_n=128 runs 64-row tiles (clusters of one CTA); got tile_m=128: ask for "
                "tile_m 64 or leave it to the choice"
            )
        tile_m = 64
    return tile_m, tile_n


def expert_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64: the entries of ``topk_idx`` routed to each expert, on its device
    without a host sync. Negative entries count nowhere; ids >= ``num_experts`` count nowhere
    either (:func:`uniep.moe.tile_gates.sender_rows` reports them)."""
    return tile_gates.expert_tiles(topk_idx.reshape(-1, 1).contiguous(), num_experts)[0]


def trace_phases(trace: torch.Tensor, sms: int | None = None) -> dict[str, float]:
    """The fused kernel's phases from a ``trace`` that one call filled (zeroed before it): in
    microseconds after the first CTA started, the last CTA to finish its send, its GEMM tiles and
    its reduce, the first to finish its tiles (where the reduce's tail begins) and the median CTA
    (how unevenly the tiles fell: the static round-robin left CTAs up to 200 us apart). With ``sms``
    (the device's SM count) and a trace of at least 6 x ``sms`` entries, also the time the CTAs'
    producers waited at the gates: at GEMM 1's (its rows not yet sent) and at GEMM 2's (GEMM 1's
    tiles of its rows not yet done), the mean and the largest over the CTAs. With 12 x ``sms``,
    also the tiles' stamps (``FusedMoeArgs::tile_stamps``): when the last CTA's first gate let it
    load (``first_load_us``) and its last gate did (``last_load_us``), when the last CTA began and
    ended its last tile's epilogue, and the mean epilogue (``epilogue_mean_us``)."""
    trace = trace.cpu()  # one copy from the device for all of it
    waits = stamps6 = None
    if sms is not None and trace.numel() >= 6 * sms:
        waits = trace[4 * sms : 6 * sms].view(-1, 2).double() / 1e3
        if trace.numel() >= 12 * sms:
            stamps6 = trace[6 * sms : 12 * sms].view(-1, 6).double()
        trace = trace[: 4 * sms]
    stamps = trace.view(-1, 4)
    ran = stamps[:, 0] > 0
    stamps = stamps[ran].double()
    if stamps.numel() == 0:
        return {}
    start = float(stamps[:, 0].min())
    us = (stamps - start) / 1e3
    out = {
        "send_end_us": float(us[:, 1].max()),
        "first_gemm_end_us": float(us[:, 2].min()),
        "median_gemm_end_us": float(torch.quantile(us[:, 2], 0.5)),
        "gemm_end_us": float(us[:, 2].max()),
        "reduce_end_us": float(us[:, 3].max()),
    }
    if waits is not None:
        waits = waits[ran]
        for i, gate_name in enumerate(("rows", "done")):
            out[f"{gate_name}_gate_wait_mean_us"] = float(waits[:, i].mean())
            out[f"{gate_name}_gate_wait_max_us"] = float(waits[:, i].max())
    if stamps6 is not None:
        s = stamps6[ran]
        tiled = s[:, 1] > 0
        if bool(tiled.any()):
            s = s[tiled]
            # A CTA with one gated tile stamped only its first (reached, opened) pair.
            last_open = torch.where(s[:, 3] > 0, s[:, 3], s[:, 1])
            out["first_load_us"] = float((s[:, 1].max() - start) / 1e3)
            out["last_load_us"] = float((last_open.max() - start) / 1e3)
            epi = s[s[:, 5] > 0]
            if epi.numel():
                out["epilogue_start_us"] = float((epi[:, 4].max() - start) / 1e3)
                out["epilogue_end_us"] = float((epi[:, 5].max() - start) / 1e3)
                out["epilogue_mean_us"] = float(((epi[:, 5] - epi[:, 4]) / 1e3).mean())
    return out


def check_call(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    overlap: str,
    comm_sms: int,
) -> None:
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
    if not x.is_cuda:
        raise ValueError(f"x must be a CUDA tensor (the gated GEMMs run on Hopper), got {x.device}")
    check_operands(x, topk_idx, topk_weights, w1_packed, w2)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    if overlap == "streams" and not 1 <= comm_sms <= sms - 2:
        raise ValueError(
            f"comm_sms must be in [1, {sms - 2}] (GEMM 1 keeps the rest), got {comm_sms}"
        )
    if overlap == "fused" and comm_sms < 1:
        raise ValueError(f"comm_sms must be >= 1 (CTAs that send; >= {sms}: all), got {comm_sms}")


def check_operands(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    experts: str = "E",
    w1_name: str = "w1_packed",
) -> None:
    """The operands' dtypes and shapes (``experts``: how the messages name the expert count;
    ``w1_name``: the first weight's, which has the packed layout's shape either way)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 [T, H], got {x.dtype} of shape {tuple(x.shape)}")
    t, h = x.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_idx.dtype != torch.int64:
        raise ValueError(
            f"topk_idx must be int64 [T = {t}, K], got {topk_idx.dtype} of shape "
            f"{tuple(topk_idx.shape)}"
        )
    if topk_weights.shape != topk_idx.shape or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be float32 of topk_idx's shape {tuple(topk_idx.shape)}, got "
            f"{topk_weights.dtype} of shape {tuple(topk_weights.shape)}"
        )
    if w1_packed.dim() != 3 or w1_packed.shape[1] != h:
        raise ValueError(
            f"{w1_name} must be [{experts}, H = {h}, 2I], got {tuple(w1_packed.shape)}"
        )
    e, _, two_i = w1_packed.shape
    if w2.dim() != 3 or w2.shape != (e, two_i // 2, h):
        raise ValueError(
            f"w2 must be [{experts} = {e}, I = {two_i // 2}, H = {h}], got {tuple(w2.shape)}"
        )


def moe_forward_local(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    *,
    overlap: str = "sequential",
    comm_sms: int | None = None,
    skip_rounds: int = -1,
    timeout_s: float = 10.0,
    check: bool | str = True,
    trace: torch.Tensor | None = None,
    tile_m: int | None = None,
    w1_as_stored: bool = False,
    tile_n: int | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t, k] * expert_(topk_idx[t, k])(x[t])`` with SwiGLU experts
    (``w1_packed = pack_gate_up(w1)``, ``w2``), every expert on this GPU. With ``check`` the
    recorded errors (a bad expert id, a gate that timed out) are raised at the end, which waits
    for the stream; with ``check="deferred"`` they are copied to the host behind the call and
    raised by a later call or :func:`check_errors` (nothing waits); with ``False`` nothing
    checks them, and the caller should not trust ``out`` until it has checked them some other
    way. ``comm_sms``: the SMs that send (default 16 for ``streams``; for ``fused`` every CTA,
    which measured fastest at world 1 on three loads of four on one H100, 2026-11-26, commit
    0a5ffcc). ``skip_rounds`` (``fused`` only): rounds of tiles the CTAs that do not send take
    before the senders join (-1: a bandwidth model).
    ``trace`` (``fused`` only; int64, 4 per SM): each CTA's global-timer stamps in ns at its
    start, after its send, after its GEMM tiles and after its reduce (:func:`trace_phases`);
    with 6 per SM, then 2 per SM: the ns each CTA's producer waited at the gates of GEMM 1 and
    of GEMM 2; with 12 per SM, then 6 per SM: its tiles' stamps (:func:`trace_phases`).
    ``tile_m`` (``fused`` only): the rows of the kernel's output tiles, 128 (cooperative) or 64
    (ping-pong, for experts of a few hundred rows); None picks by the rows per expert
    (:func:`fused_tile_m`). ``tile_n`` (``fused`` only): the tiles' columns, 256 or, with 64-row
    tiles, 128 in clusters of one CTA (the decode shape, for experts of a few rows each); None
    picks 128 where the tiles are 64 rows and the experts average at most 64 rows, else 256;
    128 with ``tile_m`` None takes 64-row tiles. ``w1_as_stored``: ``w1_packed`` is w1 as the
    model stores it (gate columns, then up), read without a packed copy; the FFN size must then
    be a multiple of ``tile_n / 2`` (128 for 256-wide tiles). Neither the tile nor any other of
    these choices changes the bits."""
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 0
    if comm_sms is None:
        comm_sms = sms if overlap == "fused" else 16
    check_call(x, topk_idx, topk_weights, w1_packed, w2, overlap, comm_sms)
    begin_call(check)
    if tile_m is not None and (overlap != "fused" or tile_m not in FUSED_TILE_MS):
        raise ValueError(
            f"tile_m must be None or, with overlap='fused', one of {FUSED_TILE_MS}; got {tile_m} "
            f"with overlap={overlap!r} (the gated GEMMs of the other modes have 128-row tiles)"
        )
    tile_m, tn = fused_tile_shape(tile_m, tile_n, overlap)
    t, h = x.shape
    if t == 0:  # no rows for the GEMMs: nothing to launch
        return x.new_empty(0, h)
    k = topk_idx.shape[1]
    e, _, two_i = w1_packed.shape
    capacity = t * k
    tm = tile_gates.TILE_M
    if overlap == "fused":
        tm = tile_m if tile_m is not None else fused_tile_m(capacity, e, x.device)
    if overlap == "fused" and planned_in_launch(capacity, e, comm_sms, sms, trace):
        out, error, t1 = torch.ops.uniep.moe_fused_local_planned(
            x, topk_idx, topk_weights, w1_packed, w2, timeout_s, tm, w1_as_stored, tn
        )
        finish_call(
            check,
            [
                # A bad expert id is what its plan finds.
                ("send", error, "moe_forward_local (plan, in the fused launch)", k),
                ("gate", t1, "moe_forward_local (fused)", k),
            ],
        )
        return out
    _, offs, base, dest, row, counter, plan_error = tile_gates.local_plan(topk_idx, e, tm)
    if overlap == "fused":
        out, send_error, t1 = torch.ops.uniep.moe_fused_local(
            x, topk_weights, row, counter, w1_packed, w2, offs, base, comm_sms, skip_rounds,
            timeout_s, trace, tm, w1_as_stored, tn,
        )  # fmt: skip
        finish_call(
            check,
            [
                ("send", plan_error, "moe_forward_local (plan)", k),
                ("send", send_error, "moe_forward_local (fused)", k),
                ("gate", t1, "moe_forward_local (fused)", k),
            ],
        )
        return out

    # Every expert's tiles, whatever the routing: at most capacity / TILE_M + E.
    counters = torch.zeros(
        capacity // tile_gates.TILE_M + e + 1, dtype=torch.int32, device=x.device
    )
    done = torch.zeros_like(counters)
    rows = torch.empty(capacity, h, dtype=x.dtype, device=x.device)
    act = torch.empty(capacity, two_i // 2, dtype=x.dtype, device=x.device)
    y = torch.empty(capacity, h, dtype=x.dtype, device=x.device)

    def gemms(gemm1_sms: int) -> list[torch.Tensor]:
        _, t1 = tile_gates.grouped_mm_gated(
            rows, w1_packed, offs, counters, base, swiglu=True, done=done,
            timeout_s=timeout_s, sm_count=gemm1_sms, out=act, w1_as_stored=w1_as_stored,
        )  # fmt: skip
        _, t2 = tile_gates.grouped_mm_gated(
            act, w2, offs, done, base, per_row=0, per_tile=tile_gates.done_per_tile(two_i),
            timeout_s=timeout_s, sm_count=sms, out=y,
        )  # fmt: skip
        return [t1, t2]

    def send(send_sms: int) -> list[torch.Tensor]:
        return [tile_gates.send_rows(x, dest, row, counter, rows, counters, sm_count=send_sms)]

    if overlap == "sequential":
        (send_error,), (t1, t2) = send(sms), gemms(sms)
    else:
        uses = (x, dest, row, counter, rows, counters)
        (send_error,), (t1, t2) = sends_beside_gemms(x.device, send, gemms, sms, comm_sms, uses)
    out, combine_error = tile_gates.combine_rows(y, row, topk_weights, check=False)
    finish_call(
        check,
        [
            ("send", plan_error, "moe_forward_local (plan)", k),
            ("send", send_error, "moe_forward_local (send)", k),
            ("gate", t1, "moe_forward_local (GEMM 1)", k),
            ("gate", t2, "moe_forward_local (GEMM 2)", k),
            ("send", combine_error, "moe_forward_local (combine)", k),
        ],
    )
    return out


def sends_beside_gemms(
    device: torch.device,
    send: Callable[[int], list[torch.Tensor]],
    gemms: Callable[[int], list[torch.Tensor]],
    sms: int,
    comm_sms: int,
    uses: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The streams mode: ``send(comm_sms)`` on a side stream, then ``gemms(n)`` on the current
    stream with the other SMs (``n`` even), which waits for the side stream after them; returns
    both calls' results (error words). The send is enqueued first: two streams may share one
    hardware queue (torch's pool has more streams than ``CUDA_DEVICE_MAX_CONNECTIONS``), where a
    GEMM enqueued ahead of the send would wait for rows the send, queued behind it, never
    stores. ``uses``: the tensors the send reads or writes, kept for the side stream."""
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        sent = send(comm_sms)
    waited = gemms((sms - comm_sms) // 2 * 2)
    main.wait_stream(side)
    for tensor in uses:
        tensor.record_stream(side)
    for tensor in sent:
        tensor.record_stream(main)  # made on the side stream, read on this one
    return sent, waited


def require_runtime() -> None:
    if not getattr(_C, "has_ep_runtime", False) or not torch.cuda.is_available():
        raise RuntimeError(
            "the fused MoE kernel across ranks needs a CUDA build of torch and a visible GPU "
            f"(build_info: {_C.build_info()})"
        )


def fused_ep_heap_bytes(
    world_size: int,
    max_tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    num_experts: int,
    tile_m: int | None = None,
    backward: bool = False,
) -> int:
    """Bytes of NVSHMEM symmetric heap :func:`init_fused_ep` allocates per rank with these
    sizes (its GEMM rows hold ``world_size x max_tokens x top_k`` rows, the most any rank can
    receive, a token's top-k naming one expert more than once included; its combine slots
    ``max_tokens x top_k``; ``backward``: as many rows again for grad_out's, a weight per row
    and a dot and a flag per slot). NVSHMEM's
    heap is sized when the first UniEP runtime starts it: set ``NVSHMEM_SYMMETRIC_SIZE`` to the
    sum of the runtimes' bytes before that (``uniep.moe.ep`` and ``uniep.collectives`` have theirs),
    or create this runtime first when it is the process's only one."""
    require_runtime()
    if tile_m is None:
        tile_m = fused_tile_m(world_size * max_tokens * top_k, num_experts)
    return int(
        _C.fused_ep_symmetric_heap_bytes(
            world_size, max_tokens, hidden, ffn, top_k, num_experts, tile_m, backward
        )
    )


def init_fused_ep(
    group: dist.ProcessGroup | None = None,
    *,
    max_tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    num_experts: int,
    timeout_s: float | None = None,
    tile_m: int | None = None,
    backward: bool = False,
) -> None:
    """Create the fused MoE runtime of ``group`` on every rank (collective): NVSHMEM from rank
    0's unique id (shared with the other UniEP runtimes of the same ranks), the symmetric GEMM
    buffers (:func:`fused_ep_heap_bytes`), and the count exchange's words. Every rank of
    ``group`` must be on one NVLink domain (at most 8 ranks), with this rank's GPU current.
    ``timeout_s`` bounds every device wait (default ``UNIEP_TIMEOUT_S`` or 100 s). ``tile_m``:
    the kernel's tile rows, 128 or 64, the same on every rank (None: :func:`fused_tile_m` of
    the rows a local expert gets when every rank sends ``max_tokens`` tokens). ``backward``: also
    the buffers of the fused backward (:func:`uniep.moe.megakernel.backward.moe_backward_ep`), the
    same on every rank."""
    from ...distributed import wait_limit_s

    require_runtime()
    for name, value in (
        ("max_tokens", max_tokens),
        ("hidden", hidden),
        ("ffn", ffn),
        ("top_k", top_k),
        ("num_experts", num_experts),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if tile_m is not None and tile_m not in FUSED_TILE_MS:
        raise ValueError(f"tile_m must be None or one of {FUSED_TILE_MS}, got {tile_m!r}")
    name, world, me, uid = distributed.nvshmem_bootstrap(group)
    if tile_m is None:
        tile_m = fused_tile_m(world * max_tokens * top_k, num_experts)
    _C.fused_ep_create(
        name,
        uid,
        world,
        me,
        max_tokens,
        hidden,
        ffn,
        top_k,
        num_experts,
        wait_limit_s(timeout_s),
        tile_m,
        bool(backward),
    )


def ensure_fused_ep(
    group: dist.ProcessGroup | None = None,
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    num_experts: int,
    tile_m: int | None = None,
    backward: bool = False,
) -> None:
    """The group's fused MoE runtime, sized for this call (collective: every rank calls it in
    the same call, with its own ``tokens``). The ranks' sizes are exchanged first (one small
    all-gather over ``group``: a host round trip, bounded by ``UNIEP_TIMEOUT_S``); sizes that
    differ raise ValueError on every rank, naming the value and both ranks. A runtime with these
    sizes and room for the largest batch is kept; otherwise it is created, or destroyed and
    created again, with ``max_tokens = uniep.moe.ep.grown_capacity(...)`` of the largest batch (a
    power of two, at least 256, never below the old one; a runtime that only grows keeps its
    timeout and tile height). ``tile_m`` (128 or 64, the same on every rank): the kernel's tile
    height; a runtime of another height is created again; None keeps the runtime's, or picks
    :func:`fused_tile_m`'s for a new one. ``backward``: with the fused backward's buffers (on any
    rank that asks: a runtime is created again to add them, and keeps them once it has them).
    NVSHMEM's heap is sized by the first
    UniEP runtime of the process: a runtime that grows later needs ``NVSHMEM_SYMMETRIC_SIZE``
    set for it beforehand (:func:`fused_ep_heap_bytes`), or it fails naming that variable."""
    from ..ep import grown_capacity

    require_runtime()
    if tile_m is not None and tile_m not in FUSED_TILE_MS:
        raise ValueError(f"tile_m must be None or one of {FUSED_TILE_MS}, got {tile_m!r}")
    pg = distributed.resolve_group(group)
    name = distributed.group_name(group)
    mine = [tokens, hidden, ffn, top_k, num_experts, tile_m or 0, int(bool(backward))]
    if pg is None:
        table = [mine]
    else:
        from ..ep import all_gather_ints

        table = all_gather_ints(
            mine, pg, "the fused MoE runtime's sizes (uniep.moe.megakernel.launch)"
        )
    what_cols = ("hidden", "ffn", "top_k", "num_experts", "tile_m (0: auto)")
    for col, what in enumerate(what_cols, start=1):
        for rank, row in enumerate(table):
            if row[col] != table[0][col]:
                raise ValueError(
                    f"{what} must be the same on every rank of the group: rank 0 has "
                    f"{table[0][col]}, rank {rank} has {row[col]}"
                )
    most = max(row[0] for row in table)
    backward = any(row[6] for row in table)
    sizes = {"hidden": hidden, "ffn": ffn, "top_k": top_k, "num_experts": num_experts}
    if fused_ep_fits(group, tokens=most, tile_m=tile_m, backward=backward, **sizes):
        return
    old = _C.fused_ep_config(name) if _C.fused_ep_exists(name) else None
    same = old is not None and all(old[key] == value for key, value in sizes.items())
    timeout_s = None
    if old is not None:
        timeout_s = old["timeout_s"]
        if same and tile_m is None:  # a runtime that only grows keeps its tile height
            tile_m = old["tile_m"]
        backward = backward or bool(old["backward"])
        shutdown_fused_ep(group)
    init_fused_ep(
        group,
        max_tokens=grown_capacity(old["max_tokens"] if same else None, most),
        timeout_s=timeout_s,
        tile_m=tile_m,
        backward=backward,
        **sizes,
    )


def fused_ep_fits(
    group: dist.ProcessGroup | None = None,
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    num_experts: int,
    tile_m: int | None = None,
    backward: bool = False,
) -> bool:
    """Whether the group's fused runtime exists with these sizes, room for ``tokens``, the
    tile height ``tile_m`` (None: any) and, with ``backward``, the backward's buffers, judged
    on this rank alone (no communication). A caller that calls :func:`ensure_fused_ep` only
    when this is False saves its host round trip on every other call; every rank must then
    reach the same answer, so a batch larger than the runtime holds must come on every rank in
    the same call (or :func:`ensure_fused_ep` be called on every rank first, with each rank's
    largest batch); a rank that grows alone leaves the others waiting for it until the timeout,
    which names it."""
    name = distributed.group_name(group)
    if not (getattr(_C, "has_ep_runtime", False) and _C.fused_ep_exists(name)):
        return False
    c = _C.fused_ep_config(name)
    return (
        (c["hidden"], c["ffn"], c["top_k"], c["num_experts"]) == (hidden, ffn, top_k, num_experts)
        and tokens <= c["max_tokens"]
        and (tile_m is None or c["tile_m"] == tile_m)
        and (not backward or bool(c["backward"]))
    )


def shutdown_fused_ep(group: dist.ProcessGroup | None = None) -> None:
    """Destroy the group's fused MoE runtime (collective; a no-op if there is none)."""
    name = distributed.group_name(group)
    if getattr(_C, "has_ep_runtime", False) and _C.fused_ep_exists(name):
        torch.cuda.synchronize()
        _C.fused_ep_destroy(name)


def moe_forward_ep(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    comm_sms: int | None = None,
    skip_rounds: int = -1,
    check: bool | str = True,
    trace: torch.Tensor | None = None,
    w1_as_stored: bool = False,
    tile_n: int | None = None,
) -> torch.Tensor:
    """The MoE forward across the ranks of ``group`` as one persistent kernel per rank:
    ``out[t] = sum_k topk_weights[t, k] * expert_(topk_idx[t, k])(x[t])`` for this rank's
    tokens, with ``topk_idx`` global expert ids and this rank's experts' weights (``w1_packed =
    pack_gate_up(w1)`` ``[E / W, H, 2I]``, ``w2`` ``[E / W, I, H]``; rank r holds experts
    ``[r E / W, (r + 1) E / W)``). Every rank calls it in the same order (a rank with no tokens
    too: its experts still compute what the others send). The bits equal
    :func:`moe_forward_local` on the same tokens with every expert's weights. ``comm_sms``: the
    CTAs that send before they compute, in the order the GEMMs take the rows, while the others
    start on the tiles (default 32 with several ranks, the best of five points at EP4 on four
    H200s on both the DeepSeek-V3-like and the Mixtral-like layer, 2026-11-26, commit edef84b;
    every CTA at one rank; >= the SM count: every CTA, in token order); ``skip_rounds``: rounds
    of tiles the others take first (-1: a model of the send's time over NVLink); ``check`` as
    in :func:`moe_forward_local`: a bad expert id, an exchange a rank never joined or rows that
    never came raise here, which waits for the stream. ``w1_as_stored``: ``w1_packed`` is w1 as
    stored (gate columns, then up), read without a packed copy (the FFN size a multiple of 128).
    ``tile_n``: as in :func:`moe_forward_local`, 128 only on a runtime of 64-row tiles.

    On CPU tensors (a gloo group) the CPU executor runs the same plan, once every rank's
    arguments are checked and agreed (:func:`agree_cpu_call`: a bad argument on one rank, or a
    size that differs across ranks, raises ValueError on every rank naming it, and every wait
    is bounded by ``UNIEP_TIMEOUT_S``): the counts all-gathered,
    :func:`uniep.moe.tile_gates.sender_rows`, each row sent to its GEMM row on its expert's rank,
    the experts with the kernel's numerics (fp32 products, h and the activation rounded to bf16),
    the outputs sent back to their (token, k) slots and summed in ascending k in fp32; within bf16
    rounding of the GPU's bits (the GEMMs' summation order differs)."""
    if not x.is_cuda and not w1_packed.is_cuda:
        return _moe_forward_ep_cpu(x, topk_idx, topk_weights, w1_packed, w2, group, w1_as_stored)
    require_runtime()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 0
    if comm_sms is None:
        comm_sms = EP_COMM_SMS if distributed.world_size(group) > 1 else sms
    check_call(x, topk_idx, topk_weights, w1_packed, w2, "fused", comm_sms)
    _, tn = fused_tile_shape(None, tile_n)
    begin_call(check)
    name = distributed.group_name(group)
    if not _C.fused_ep_exists(name):
        raise RuntimeError(
            f"group '{name}' has no fused MoE runtime: call "
            "uniep.moe.megakernel.launch.init_fused_ep(group, max_tokens=..., hidden=..., "
            "ffn=..., top_k=..., num_experts=...) on every rank first"
        )
    out, error, timeout = torch.ops.uniep.moe_fused_ep(
        x, topk_idx, topk_weights, w1_packed, w2, name, comm_sms, skip_rounds, trace,
        w1_as_stored, tn,
    )  # fmt: skip
    k = topk_idx.shape[1]
    finish_call(
        check, [("gate", timeout, "moe_forward_ep", k), ("send", error, "moe_forward_ep", k)]
    )
    return out


@torch.library.register_fake("uniep::moe_fused_ep")
def _moe_fused_ep_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    comm_ctas: int,
    skip_rounds: int,
    trace: torch.Tensor | None = None,
    w1_as_stored: bool = False,
    tile_n: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tile_gates.check_routing_meta(x, topk_idx)
    return tile_gates.fused_outputs_meta(x)


# The error code of an expert id outside [-1, E) in a send error word (kSendBadExpert,
# include/uniep/send_rows_error.hpp).
_SEND_BAD_EXPERT = 1


def agree_cpu_call(
    kind: str,
    what: str,
    group: dist.ProcessGroup | None,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    checks: Callable[[], None],
    w1_name: str = "w1",
) -> None:
    """The CPU executor's argument checks, agreed with the group's other ranks before its first
    collective (``_C.agree_call``; ``kind``: ``"moe_forward"`` or ``"moe_backward"``): this
    rank's ``checks`` (raising ValueError) and an even ``2I``, and the sizes every rank must
    share (hidden, ffn, experts per rank, top_k). A failed check on any rank, or a size that
    differs, raises ValueError on every rank at once, naming the rank and the cause; the wait is
    bounded by ``UNIEP_TIMEOUT_S``. The expert ids, whose range is known only once the experts
    per rank are agreed, are checked in :class:`CpuPlan`'s count exchange."""
    error = ""
    try:
        checks()
        if w1.shape[2] % 2:
            raise ValueError(
                f"{w1_name}'s last dimension must be even (2I: gate then up columns), got "
                f"{w1.shape[2]} in shape {tuple(w1.shape)}"
            )
    except ValueError as e:
        error = f"{what}: {e}"

    def size(t: torch.Tensor, dims: int, dim: int) -> int:
        return int(t.shape[dim]) if t.dim() == dims else -1

    fields = [
        ("hidden (x.size(1))", size(x, 2, 1)),
        ("ffn (w2.size(1))", size(w2, 3, 1)),
        ("experts per rank (w2.size(0))", size(w2, 3, 0)),
        ("top_k (topk_idx.size(1))", size(topk_idx, 2, 1)),
    ]
    _C.agree_call(distributed.group_name(group), kind, fields, error, "cpu")


def _bad_expert_word(topk_idx: torch.Tensor, num_experts: int) -> int:
    """The send error word of ``topk_idx``'s first entry outside ``[-1, num_experts)`` (the
    plan's, :func:`uniep.moe.tile_gates.sender_rows`), 0 if none."""
    bad = ((topk_idx < -1) | (topk_idx >= num_experts)).reshape(-1).nonzero()
    return int(_C.send_rows_error_word(_SEND_BAD_EXPERT, int(bad[0]))) if bad.numel() else 0


class CpuPlan:
    """The CPU executor's plan of one call across ranks (:func:`moe_forward_ep` and
    ``uniep.moe.megakernel.backward.moe_backward_ep`` on CPU tensors, after
    :func:`agree_cpu_call`): the counts all-gathered (an expert id outside ``[-1, E)`` on any
    rank raises ValueError on every rank, naming the rank and its entry, before any row moves),
    :func:`uniep.moe.tile_gates.sender_rows`, and the used entries in the order they travel (by
    destination rank, then entry), with what each rank sends and receives. Every collective's
    wait is bounded by ``UNIEP_TIMEOUT_S`` (``uniep.distributed.bounded_wait``)."""

    def __init__(
        self, topk_idx: torch.Tensor, experts_per_rank: int, group: dist.ProcessGroup | None,
        what: str,
    ) -> None:  # fmt: skip
        self.pg = distributed.resolve_group(group)
        self.what = what
        pg = self.pg
        self.world, self.rank = (
            (1, 0) if pg is None else (dist.get_world_size(pg), dist.get_rank(pg))
        )
        self.top_k = topk_idx.shape[1]
        el = experts_per_rank
        num_experts = el * self.world
        # Each rank's counts travel with its first bad expert id's error word (0: none), so that
        # every rank raises its message, the same text, before any row moves.
        bad = torch.tensor([_bad_expert_word(topk_idx, num_experts)])
        counts = torch.cat([expert_counts(topk_idx, num_experts), bad])
        matrix = [counts] if pg is None else [torch.empty_like(counts) for _ in range(self.world)]
        if pg is not None:
            work = dist.all_gather(matrix, counts, group=pg, async_op=True)
            distributed.bounded_wait(work, pg, f"{what}: the count exchange")
        matrix = torch.stack(matrix)
        words, matrix = matrix[:, -1].tolist(), matrix[:, :-1].contiguous()
        for r, word in enumerate(words):
            if word:
                message = _C.send_rows_error_message(word, self.top_k, f"{what} (plan)")
                if r != self.rank:
                    note = "" if pg is None else _C.group_ranks_note(pg.group_name)
                    message = (
                        f"{what} on rank {self.rank}: rank {r} failed its checks: {message}{note}"
                    )
                raise ValueError(message)
        self.dest, self.row, _, error = tile_gates.sender_rows(
            topk_idx, matrix, self.rank, check=False
        )
        tile_gates.check_send_error(error, self.top_k, f"{what} (plan)")
        # This rank's experts' rows per expert, in GEMM-row order.
        self.local = matrix[:, self.rank * el : (self.rank + 1) * el].sum(0)
        dest = self.dest.reshape(-1)
        entries = (dest >= 0).nonzero().squeeze(1)
        self.entries = entries[torch.argsort(dest[entries], stable=True)]
        self.send = torch.bincount(dest[self.entries], minlength=self.world).tolist()
        self.recv = self.send
        if pg is not None:
            recv = torch.empty(self.world, dtype=torch.int64)
            work = dist.all_to_all_single(recv, torch.tensor(self.send), group=pg, async_op=True)
            distributed.bounded_wait(work, pg, f"{what}: the row count exchange")
            self.recv = recv.tolist()

    def to_experts(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (a row per entry in :attr:`entries`' order) to the experts' ranks: what this
        rank receives, grouped by sender in rank order."""
        return self._exchange(out, self.send, self.recv)

    def to_sources(self, back: torch.Tensor) -> torch.Tensor:
        """Rows in the order :meth:`to_experts` received them, back to their senders: this rank's
        rows in :attr:`entries`' order."""
        return self._exchange(back, self.recv, self.send)

    def _exchange(self, out: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.pg is None:
            return out
        got = out.new_empty(sum(recv), *out.shape[1:])
        work = dist.all_to_all_single(got, out, recv, send, group=self.pg, async_op=True)
        distributed.bounded_wait(work, self.pg, f"{self.what}: the rows' exchange")
        return got


def _moe_forward_ep_cpu(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1_packed: torch.Tensor,
    w2: torch.Tensor,
    group: dist.ProcessGroup | None,
    w1_as_stored: bool = False,
) -> torch.Tensor:
    from ...gemm import unpack_gate_up

    agree_cpu_call(
        "moe_forward", "moe_forward_ep", group, x, topk_idx, w1_packed, w2,
        lambda: check_operands(x, topk_idx, topk_weights, w1_packed, w2, experts="E / W"),
        w1_name="w1_packed",
    )  # fmt: skip
    t, h = x.shape
    el, _, two_i = w1_packed.shape
    k = topk_idx.shape[1]
    plan = CpuPlan(topk_idx, el, group, "moe_forward_ep")

    # The send: each used entry's row to its GEMM row on its rank, the entry travelling with it.
    rows_in = plan.to_experts(x[plan.entries // k].view(torch.uint8))  # bytes: the transport's
    meta_in = plan.to_experts(plan.row.reshape(-1)[plan.entries])
    local = plan.local
    gemm_rows = torch.zeros(int(local.sum()), h, dtype=torch.bfloat16)
    gemm_rows[meta_in] = rows_in.view(torch.bfloat16)

    # The experts, with the fused kernel's numerics.
    w1 = w1_packed if w1_as_stored else unpack_gate_up(w1_packed)
    i = two_i // 2
    y = torch.empty_like(gemm_rows)
    ends = local.cumsum(0).tolist()
    for e in range(el):
        b, end = (ends[e - 1] if e else 0), ends[e]
        if end == b:
            continue
        hh = (gemm_rows[b:end].float() @ w1[e].float()).bfloat16().float()
        g, u = hh[:, :i], hh[:, i:]
        act = (g / (1.0 + torch.exp(-g)) * u).bfloat16()
        y[b:end] = (act.float() @ w2[e].float()).bfloat16()

    # The outputs back to their slots, in the order their rows came; the reduce in ascending k.
    back_in = plan.to_sources(y[meta_in].view(torch.uint8))
    entries, dest = plan.entries, plan.dest
    slots = torch.zeros(t * k, h, dtype=torch.bfloat16)
    slots[entries] = back_in.view(torch.bfloat16)
    slots = slots.view(t, k, h).float()
    used = (dest >= 0).unsqueeze(2)
    acc = torch.zeros(t, h, dtype=torch.float32)
    for j in range(k):
        acc = torch.where(used[:, j], acc + topk_weights[:, j : j + 1] * slots[:, j], acc)
    return acc.bfloat16()


# ---- which tunings and shapes run the MegaKernel ----


def megakernel_numerics(p: _C.TuningParams) -> bool:
    """Whether the MegaKernel serves ``p``'s numerics: bf16 dispatch, the per-k combine and
    UniEP's GEMMs (the kernel has no fp8 rows, no expert-side weighting and no torch GEMMs)."""
    return p.dispatch == "bf16" and p.combine == "per_k" and p.gemm == "uniep"


def runs_fused(tuning: str | _C.TuningParams) -> bool:
    """Whether ``tuning`` asks for the MegaKernel and it can serve its numerics: ``overlap=fused``
    named, with ``megakernel_numerics`` (other numerics run the separate launches)."""
    p = parse_tuning(tuning)
    return p.given("overlap") and p.overlap == "fused" and megakernel_numerics(p)


# The MegaKernel's GEMM tiles and the fused backward's both step hidden and ffn by 64 columns.
MEGAKERNEL_MULTIPLE = 64


def megakernel_shape_ok(hidden: int, ffn: int) -> bool:
    """Whether the MegaKernel, forward and backward alike, runs layers of ``hidden`` and ``ffn``
    (both positive multiples of :data:`MEGAKERNEL_MULTIPLE`)."""
    return all(v > 0 and v % MEGAKERNEL_MULTIPLE == 0 for v in (hidden, ffn))


def megakernel_overlap(
    tuning: str | _C.TuningParams, world: int, hidden: int | None = None, ffn: int | None = None
) -> str | None:
    """How the MegaKernel's pieces run ``tuning`` at ``world`` ranks: ``"fused"`` for
    :func:`runs_fused` (one persistent launch); ``"streams"`` for ``overlap=chunked`` named at one
    rank with the same numerics (the send of the rows on ``sms`` SMs of their own, beside the gated
    GEMMs, which take each tile as its rows land:
    ``uniep.moe.megakernel.launch.moe_forward_local(overlap= "streams")``, and the backward's first
    step the same way); None otherwise: the separate launches (``overlap=chunked`` across ranks
    too, whose pipelined form is not built). Given the layer's ``hidden`` and ``ffn``, also None
    where the MegaKernel cannot run them (:func:`megakernel_shape_ok`): the forward and the
    backward of one call then both take the separate launches, which give the same bits, so neither
    accepts a shape the other refuses."""
    if hidden is not None and ffn is not None and not megakernel_shape_ok(hidden, ffn):
        return None
    p = parse_tuning(tuning)
    if runs_fused(p):
        return "fused"
    chunked = p.given("overlap") and p.overlap == "chunked"
    return "streams" if chunked and world == 1 and megakernel_numerics(p) else None
