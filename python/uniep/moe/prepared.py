"""MoE inference on expert weights prepared once for the expert GEMM engine.

``moe_forward`` takes the weights as training holds them (bf16 ``w1 [E, H, 2I]`` gate then up,
``w2 [E, I, H]``), so its SwiGLU runs between the GEMMs, and with ``dispatch=fp8`` it keeps an
e4m3 copy of the weights made on the first call (and again after each change of the weights). A
server's weights do not change: :func:`prepare_experts` lays them out once in one of the engine's
formats, and :func:`moe_forward_prepared` runs the layer on them.

- ``"bf16_packed"``: w1 with gate and up interleaved in blocks of 8 columns
  (``uniep.gemm.pack_gate_up``), so the first GEMM applies SwiGLU in its epilogue and the
  [R, 2I] product never reaches memory.
- ``"fp8"``: both weights in e4m3 with one scale per 128 x 128 block, stored K-major
  (``uniep.gemm.quantize_expert_weights``), w1's rows packed for the first GEMM's SwiGLU
  epilogue (``uniep.gemm.pack_gate_up_fp8``: blocks of 64 gate and 64 up rows, a scale per 64
  rows), so the [R, 2I] product never reaches memory; the tokens travel in the fp8 dispatch's
  format (1 x 128 scales) and feed the fp8 grouped GEMM as they arrive; the activation is
  quantized the same way for the second GEMM (``uniep.gemm.quantize_rows``' encoding). The
  fp8 GEMMs' tiles with the operands' roles swapped (``tile_m=16`` / ``32``) have no SwiGLU
  epilogue: a tuning naming one raises, naming the tiles there are, as ``moe_forward``'s. Needs
  ``dispatch=fp8`` in the tuning, hidden and the expert FFN size multiples of 128. The tuning's
  tile keys pick both fp8 GEMMs' tile (``uniep.gemm.grouped_mm_fp8``).

On CUDA, packed bf16 experts run the MegaKernel (``uniep.moe.megakernel.launch``) when the tuning
string names ``overlap=fused`` (with bf16 dispatch, the per-k combine and the engine's GEMMs): at
world 1 one persistent launch of the send into GEMM rows, both GEMMs and the reduce
(``moe_forward_local(overlap="fused")``); across the ranks of one NVLink domain the group's fused
runtime (created and grown on demand by ``ensure_fused_ep``, whose size exchange is one host
round trip, made only when the runtime must be created, grown or re-tiled: a batch larger than it
holds must come on every rank in the same call, or ``ensure_fused_ep`` be called on every rank
first) and ``moe_forward_ep``. The launch's keys there (:func:`fused_launch`):
``sms=`` the CTAs that send first (without it the measured defaults: every CTA at world 1,
``EP_COMM_SMS`` across ranks), ``skip_rounds=`` the rounds of tiles the others take first, and
``tile_m=`` 64 or 128, the kernel's tile height (auto: ``fused_tile_m``), and ``tile_n=`` 256
or, with 64-row tiles, 128: the decode shape, clusters of one CTA (auto: 128 where the experts
average at most one 64-row tile). Otherwise the
dispatch, the engine's GEMMs and the combine run as separate launches: at world 1 on one H200
they were about as fast as the MegaKernel's best point on the DeepSeek-V3, Mixtral, Qwen3-like
and 256-expert loads (2026-11-26, commit baad81e). Both give the same bits. An empty tuning
string takes the point ``uniep.tune(..., weights="bf16_packed")`` cached for the call's shape
(which may be either); else, at world 1 on decode batches (the experts averaging at most one
64-row tile: ``uniep.moe.megakernel.launch.fused_by_default``), the MegaKernel, which is also the
path a CUDA graph can capture; else the separate launches. The MegaKernel's errors (a bad expert
id, a rank or rows that never came) are checked without waiting for the stream: they are raised
by the next MegaKernel call once its stream has passed the failed one, or by
``uniep.moe.megakernel.launch.check_errors()`` (``check="deferred"``), while the separate launches
raise them in the call itself. Captured in a CUDA graph (after one eager call, which makes the
device words the graph keeps its errors in), the MegaKernel keeps the first error of any replay
on the device until ``check_errors()`` reads it.

fp8 experts at world 1 inside a CUDA graph's capture, and eagerly from
``uniep.moe.fp8_local.EAGER_MIN_ROWS`` rows, run launches with no host sync
(``uniep.moe.fp8_local``: the routing's plan puts each token's rows where the dispatch would, so
the bits are the dispatch path's); their errors are checked as the MegaKernel's. Smaller eager
batches, and every batch across ranks, take the dispatch, whose receive buffer is sized by a
host read (no capture across ranks).

On CPU the prepared weights are turned back into the plain ones (unpacked, or dequantized) and the
CPU executor runs ``moe_forward`` on them: the reference the GPU path is tested against.
Forward only (no autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed import group_name, world_size
from ..gemm import (
    dequantize_expert_weights,
    dequantize_rows,
    pack_gate_up,
    pack_gate_up_fp8,
    quantize_expert_weights,
    unpack_gate_up,
    unpack_gate_up_fp8,
)
from ..tuning.params import as_string as tuning_string
from ..tuning.params import parse as parse_tuning
from . import fp8_local
from .megakernel.launch import fused_by_default, megakernel_overlap

__all__ = [
    "FORMATS",
    "PreparedExperts",
    "fused_launch",
    "moe_forward_prepared",
    "prepare_experts",
]

FORMATS = ("bf16_packed", "fp8")


@dataclass(frozen=True)
class PreparedExperts:
    """One rank's experts in an engine format (see the module docstring)."""

    format: str
    # bf16_packed: [E, H, 2I] bf16 interleaved; fp8: [E, 2I, H] e4m3, pack_gate_up_fp8's rows
    w1: torch.Tensor
    w2: torch.Tensor  # bf16_packed: [E, I, H] bf16; fp8: [E, H, I] e4m3
    w1_scales: torch.Tensor | None = None  # fp8: [E, H / 128, 2I / 64] (a scale per 64 rows)
    w2_scales: torch.Tensor | None = None  # fp8: [E, I / 128, H / 128]

    @property
    def num_experts(self) -> int:
        return int(self.w1.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.w1.shape[1] if self.format == "bf16_packed" else self.w1.shape[2])

    @property
    def ffn(self) -> int:
        return int(self.w2.shape[1] if self.format == "bf16_packed" else self.w2.shape[2])

    def plain(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as ``moe_forward`` takes them (w1 [E, H, 2I] gate then up, w2 [E, I, H]),
        in ``dtype``: unpacked, or dequantized (e4m3 value times its block's scale)."""
        if self.format == "bf16_packed":
            return unpack_gate_up(self.w1).to(dtype), self.w2.to(dtype).contiguous()
        assert self.w1_scales is not None and self.w2_scales is not None
        w1 = dequantize_expert_weights(*unpack_gate_up_fp8(self.w1, self.w1_scales))
        w2 = dequantize_expert_weights(self.w2, self.w2_scales)
        return w1.to(dtype).contiguous(), w2.to(dtype).contiguous()


def prepare_experts(w1: torch.Tensor, w2: torch.Tensor, format: str) -> PreparedExperts:
    """This rank's experts (w1 [E, H, 2I], gate then up; w2 [E, I, H]) in ``format``
    (``"bf16_packed"`` or ``"fp8"``); one copy of the weights, made once."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w1 must be [E, H, 2I] and w2 [E, I, H], got {tuple(w1.shape)} and {tuple(w2.shape)}"
        )
    e, h, two_i = w1.shape
    if two_i % 2 or tuple(w2.shape) != (e, two_i // 2, h):
        raise ValueError(
            f"w2 must be [E, I, H] = [{e}, {two_i // 2}, {h}] for w1 {tuple(w1.shape)}, got "
            f"{tuple(w2.shape)}"
        )
    if w1.device != w2.device:
        raise ValueError(f"w1 and w2 must be on one device, got {w1.device} and {w2.device}")
    if format == "bf16_packed":
        w1p = pack_gate_up(w1.detach().to(torch.bfloat16))
        return PreparedExperts(format, w1p, w2.detach().to(torch.bfloat16).contiguous())
    if h % 128 or (two_i // 2) % 128:
        raise ValueError(
            f"fp8 experts need hidden and the expert FFN size to be multiples of 128 (one scale "
            f"per 128 x 128 block), got hidden {h}, FFN {two_i // 2}"
        )
    w1q, w1s = pack_gate_up_fp8(*quantize_expert_weights(w1.detach()))
    w2q, w2s = quantize_expert_weights(w2.detach())
    return PreparedExperts(format, w1q, w2q, w1s, w2s)


def moe_forward_prepared(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    group: dist.ProcessGroup | None = None,
    tuning: str = "",
) -> torch.Tensor:
    """The MoE layer of ``uniep.moe_forward`` on prepared experts (forward only).

    CUDA (bf16 x, Hopper): packed bf16 experts with ``overlap=fused`` named in ``tuning`` run
    the MegaKernel (module docstring); fp8 experts at world 1 in a capture or a large batch the
    plan, the fp8 GEMMs and the combine with no host sync (``uniep.moe.fp8_local``); otherwise
    the dispatch, the engine's GEMMs in the prepared format and the combine, as separate
    launches. All give ``moe_forward``'s bits.
    Across ranks the runtime (the MegaKernel's, or the dispatch's) is sized on first use for the
    largest batch over the ranks and checked on each rank alone after that (no host round trip
    per call): a larger batch must then come on every rank in the same call, or a server calls
    ``uniep.moe.megakernel.launch.ensure_fused_ep`` (``uniep.moe.ep.ensure_runtime`` for the
    dispatch's) once with its largest batch first. At world 1 it grows as needed. A rank
    whose batch outgrows the runtime alone leaves the others waiting until the timeout, which
    names it. (``uniep.moe_forward`` agrees on the sizes at every call instead.)
    CPU: the CPU executor's ``moe_forward`` on the plain form of the weights (``plain``).
    On CUDA, with autograd on and ``x`` or ``topk_weights`` requiring grad, it raises
    RuntimeError at once: those paths have no backward.
    """
    if not isinstance(experts, PreparedExperts):
        raise TypeError(f"experts must be a PreparedExperts, got {type(experts).__name__}")
    params = parse_tuning(tuning)
    tuning = tuning_string(params)  # the ops' form: the given keys alone
    if experts.format == "fp8" and params.dispatch != "fp8":
        raise ValueError(
            "fp8 experts take the tokens in the fp8 dispatch's format: add dispatch=fp8 to tuning"
        )
    if experts.format == "fp8" and not params.fp8_experts:
        raise ValueError("fp8 experts run fp8 GEMMs: tuning experts=bf16 contradicts them")
    if experts.format == "bf16_packed" and params.fp8_experts:
        raise ValueError(
            "bf16_packed experts run bf16 GEMMs, and dispatch=fp8 runs the experts in fp8: add "
            "experts=bf16 to tuning (bf16 GEMMs on the fp8 rows) or prepare the experts as fp8"
        )
    name = group_name(group)
    if x.device.type != "cuda":
        w1, w2 = experts.plain(x.dtype)
        return torch.ops.uniep.moe_forward(x, topk_idx, topk_weights, w1, w2, name, tuning)
    _refuse_autograd(x, topk_weights)
    _check_cuda_operands(x, topk_idx, experts)
    world = world_size(group)
    if tuning == "" and experts.format == "bf16_packed":
        from ..tuning import cache as tune_cache

        tuning = tune_cache.tuning_for_call(
            x, topk_idx, experts.ffn, experts.num_experts * world, world, weights=experts.format
        )
        rows = x.shape[0] * topk_idx.shape[1]
        if tuning == "" and fused_by_default(rows, experts.num_experts, world):
            tuning = "overlap=fused"
        params = parse_tuning(tuning)
    if experts.format == "bf16_packed" and megakernel_overlap(
        tuning, world, experts.hidden, experts.ffn
    ):
        return forward_fused(x, topk_idx, topk_weights, experts, group, world, tuning)
    if experts.format == "fp8" and world == 1:
        if fp8_local.takes_local_path(topk_idx.numel()):
            return fp8_local.moe_forward_fp8_local(x, topk_idx, topk_weights, experts, tuning)
        fp8_local.keep_graph_errors(x.device, topk_idx.shape[1])  # a capture may come next
    return _forward_cuda(x, topk_idx, topk_weights, experts, name, world, tuning)


def _refuse_autograd(x: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """The CUDA paths have no backward: say so at the forward, not in a backward that meets a
    launch with no gradient formula later."""
    if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad):
        raise RuntimeError(
            "moe_forward_prepared has no backward on CUDA (prepared experts are for inference), "
            "but x or topk_weights requires grad: call it under torch.no_grad() or "
            "torch.inference_mode(), or train with uniep.moe_forward on the experts' w1/w2"
        )


def _check_cuda_operands(x: torch.Tensor, topk_idx: torch.Tensor, experts: PreparedExperts) -> None:
    """What both CUDA paths need of the tokens before they run (the ops check the rest)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16 on CUDA, got {x.dtype}")
    if experts.w1.device != x.device:
        raise ValueError(f"the experts must be on x's device {x.device}, got {experts.w1.device}")
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"x must be [T, H = {experts.hidden}], got {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx must be [T = {x.shape[0]}, K], got shape {tuple(topk_idx.shape)}"
        )


def fused_launch(tuning: str) -> tuple[int | None, int, int | None, int | None]:
    """The MegaKernel's launch keys of ``tuning``: ``(comm_sms, skip_rounds, tile_m, tile_n)``,
    where ``comm_sms`` is None unless ``sms`` is named (the kernel's defaults then),
    ``skip_rounds`` -1 for auto (the launch's bandwidth model), ``tile_m`` None for auto
    (``fused_tile_m``; 64 where ``tile_n=128`` is named) and ``tile_n`` None for auto (the
    launch's choice).

    Raises:
        ValueError: a tile key the kernel was not built with (it has ``tile_m`` 64 or 128,
            ``tile_n`` 256, or 128 with 64-row tiles, ``tile_k`` 64 and its own pipeline depth),
            naming the key.
    """
    from .megakernel.launch import FUSED_TILE_MS, FUSED_TILE_NS, fused_tile_shape

    p = parse_tuning(tuning)
    built = {
        "tile_m": (0, *FUSED_TILE_MS),
        "tile_n": (0, *FUSED_TILE_NS),
        "tile_k": (0, 64),
        "stages": (0,),
        "cluster": (0,),
    }
    for key, allowed in built.items():
        value = getattr(p, key)
        if value not in allowed:
            shown = ", ".join("auto" if v == 0 else str(v) for v in allowed)
            why = " (each of its tile shapes is built in one cluster)" if key == "cluster" else ""
            raise ValueError(
                f"tuning: with overlap=fused (the MegaKernel) {key} must be one of {shown}, got "
                f"{value}{why}"
            )
    comm_sms = p.comm_sms if p.given("sms") else None
    try:
        tile_m, _ = fused_tile_shape(p.tile_m or None, p.tile_n or None)
    except ValueError as e:
        raise ValueError(f"tuning: {e}") from None
    return comm_sms, p.skip_rounds, tile_m, p.tile_n or None


def forward_fused(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    group: dist.ProcessGroup | None,
    world: int,
    tuning: str,
    backward: bool = False,
    w1_as_stored: bool = False,
    agree: bool = False,
) -> torch.Tensor:
    """The MegaKernel's forward (``backward``: across ranks, on a runtime that also holds the
    fused backward's buffers, for autograd). ``w1_as_stored``: ``experts.w1`` is w1 as stored
    (gate columns, then up). ``agree``: across ranks, exchange the call's sizes every call
    (``ensure_fused_ep``), so that a batch that outgrows the runtime on one rank grows it on
    every rank; else only a rank whose runtime does not fit makes that exchange (the fast check
    of ``moe_forward_prepared``'s contract)."""
    from ..distributed import wait_limit_s
    from .megakernel import launch

    if topk_weights.is_floating_point() and topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()  # as moe_forward: the sums take fp32 weights
    comm_sms, skip_rounds, tile_m, tile_n = fused_launch(tuning)
    if world == 1:
        overlap = megakernel_overlap(tuning, 1) or "fused"
        if overlap == "streams":
            # The gated GEMMs' one tile (128 rows); the send's SMs are the launch's only key.
            if tile_m not in (None, 128) or tile_n not in (None, 256):
                raise ValueError(
                    f"tuning: with overlap=chunked (the send beside the gated GEMMs, whose tiles "
                    f"are 128 x 256) tile_m and tile_n must be auto or 128 and 256, got "
                    f"{tile_m} and {tile_n}"
                )
            tile_m, tile_n, skip_rounds = None, None, -1
        return launch.moe_forward_local(
            x, topk_idx, topk_weights, experts.w1, experts.w2, overlap=overlap,
            comm_sms=comm_sms, skip_rounds=skip_rounds, timeout_s=wait_limit_s(None), tile_m=tile_m,
            check="deferred", w1_as_stored=w1_as_stored, tile_n=tile_n,
        )  # fmt: skip
    sizes = {
        "tokens": x.shape[0],
        "hidden": experts.hidden,
        "ffn": experts.ffn,
        "top_k": topk_idx.shape[1],
        "num_experts": experts.num_experts * world,
        "tile_m": tile_m,
        "backward": backward,
    }
    # The size agreement is a host round trip (it drains the stream before the launch). Without
    # it each rank judges the fit alone, which is safe only where every rank's batch fits
    # whenever one's does (moe_forward_prepared's contract); moe_forward promises that ranks
    # may pass different batches, so it agrees at every call, as its separate launches do.
    if agree or not launch.fused_ep_fits(group, **sizes):
        launch.ensure_fused_ep(group, **sizes)
    return launch.moe_forward_ep(
        x, topk_idx, topk_weights, experts.w1, experts.w2, group, comm_sms=comm_sms,
        skip_rounds=skip_rounds, check="deferred", w1_as_stored=w1_as_stored, tile_n=tile_n,
    )  # fmt: skip


def _forward_cuda(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: PreparedExperts,
    name: str,
    world: int,
    tuning: str,
) -> torch.Tensor:
    from .ep import ensure_runtime

    # Grown when the batch outgrows it (the docstring's contract makes that every rank's call).
    sizes = (x.shape[0], x.shape[1], topk_idx.shape[1], experts.num_experts * world)
    ensure_runtime(name, *sizes, grow=True)
    ops = torch.ops.uniep
    recv_x, scales, _, _, _, per_expert, row_slot, row_target, epoch = ops.ep_dispatch(
        x, topk_idx, topk_weights, name, tuning
    )
    offs = per_expert.cumsum(0).to(torch.int32)
    rows = recv_x.index_select(0, row_slot)
    # combine=rank_partials sums the second GEMM's fp32 outputs, as moe_forward does.
    y_dtype = torch.float32 if parse_tuning(tuning).combine == "rank_partials" else None
    if experts.format == "bf16_packed":
        if rows.dtype == torch.float8_e4m3fn:  # dispatch=fp8,experts=bf16
            rows = dequantize_rows(rows, scales.index_select(0, row_slot)).to(torch.bfloat16)
        act = ops.grouped_mm_swiglu(rows, experts.w1, offs, tuning)
        y = ops.grouped_mm(act, experts.w2, offs, tuning, y_dtype)
    else:
        row_scales = scales.index_select(0, row_slot)
        act = ops.grouped_mm_fp8_swiglu(
            rows, row_scales, experts.w1, experts.w1_scales, offs, tuning
        )
        act_q, act_s = ops.quantize_fp8(act)
        y = ops.grouped_mm_fp8(act_q, act_s, experts.w2, experts.w2_scales, offs, tuning, y_dtype)
    return ops.ep_combine(y.contiguous(), row_target, topk_idx, topk_weights, name, epoch, tuning)
