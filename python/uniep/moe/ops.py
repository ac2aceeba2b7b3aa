"""Python side of ``torch.ops.uniep``: fake kernels (torch.compile), autograd, and wrappers.

The schemas and the CPU/CUDA kernels are registered in C++ (``cpp/torch``); loading ``uniep._C``
defines them, so this module imports it first.
"""

from __future__ import annotations

import torch

# Importing _C registers the torch.ops.uniep schemas and kernels that the code below extends.
from .. import _C, distributed
from ..tuning.params import as_string as tuning_string

# Imported for what they register: moe_forward's autograd formula, the CUDA moe_backward.
from . import autograd as _moe_autograd  # noqa: F401
from . import backward_cuda as _moe_backward_cuda  # noqa: F401
from . import expert_shards
from .megakernel import forward as megakernel_forward
from .megakernel.launch import megakernel_overlap

__all__ = ["moe_forward"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _check_moe_args(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    # Only what the output's metadata depends on, worded like the C++ checks; value checks
    # (expert ids, group membership) need the data and stay in the real kernels.
    torch._check_value(
        x.dim() == 2, lambda: f"x must be 2-D [T, H], got {x.dim()}-D {tuple(x.shape)}"
    )
    torch._check_value(
        x.dtype != torch.float16,
        lambda: (
            "x must be float32, bfloat16 or float64, got float16: the expert kernels have no "
            "float16 path (cast to bfloat16: same size, wider range)"
        ),
    )
    torch._check_value(
        x.dtype in _FLOAT_DTYPES, lambda: f"x must be float32, bfloat16 or float64, got {x.dtype}"
    )
    torch._check_value(
        topk_idx.dim() == 2, lambda: f"topk_idx must be 2-D [T, K], got {topk_idx.dim()}-D"
    )
    torch._check_value(
        topk_idx.dtype == torch.int64, lambda: f"topk_idx must be int64, got {topk_idx.dtype}"
    )
    torch._check_value(
        topk_idx.shape[1] >= 1, lambda: "topk_idx must have at least one column (top-k >= 1)"
    )
    torch._check_value(
        topk_idx.shape[0] == x.shape[0],
        lambda: f"topk_idx must have T={x.shape[0]} rows like x, got {topk_idx.shape[0]}",
    )
    torch._check_value(
        topk_weights.dim() == 2
        and topk_weights.shape[0] == topk_idx.shape[0]
        and topk_weights.shape[1] == topk_idx.shape[1],
        lambda: (
            f"topk_weights must be [T, K] = {tuple(topk_idx.shape)} like topk_idx, "
            f"got {tuple(topk_weights.shape)}"
        ),
    )
    torch._check_value(
        topk_weights.dtype != torch.float16,
        lambda: (
            "topk_weights must be float32 or bfloat16, got float16: the executors read float32 "
            "or bfloat16 routing weights (cast the [T, K] weights to float32)"
        ),
    )
    allowed = (torch.float32, torch.bfloat16)
    if x.dtype == torch.float64:
        allowed += (torch.float64,)
    torch._check_value(
        topk_weights.dtype in allowed,
        lambda: (
            f"topk_weights must be float32 or bfloat16 (float64 only with float64 x), "
            f"got {topk_weights.dtype}"
        ),
    )
    torch._check_value(w1.dim() == 3, lambda: f"w1 must be 3-D [E_local, H, 2I], got {w1.dim()}-D")
    torch._check_value(w2.dim() == 3, lambda: f"w2 must be 3-D [E_local, I, H], got {w2.dim()}-D")
    torch._check_value(
        w1.shape[0] >= 1, lambda: f"w1 must hold at least one local expert, got {tuple(w1.shape)}"
    )
    torch._check_value(
        w1.shape[1] == x.shape[1],
        lambda: f"w1 must be [E_local, H={x.shape[1]}, 2I], got H={w1.shape[1]}",
    )
    torch._check_value(
        w2.shape[0] == w1.shape[0] and w1.shape[2] == 2 * w2.shape[1] and w2.shape[2] == x.shape[1],
        lambda: (
            f"w2 must be [E_local={w1.shape[0]}, I={w1.shape[2] // 2}, H={x.shape[1]}] "
            f"to match w1 {tuple(w1.shape)}, got {tuple(w2.shape)}"
        ),
    )
    for name, t in (("w1", w1), ("w2", w2)):
        torch._check_value(
            t.dtype == x.dtype,
            lambda n=name, t=t: f"{n} must have x's dtype {x.dtype}, got {t.dtype}",
        )
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w1", w1), ("w2", w2)):
        torch._check_value(
            t.device == x.device,
            lambda n=name, t=t: f"{n} must be on x's device {x.device}, got {t.device}",
        )


@torch.library.register_fake("uniep::moe_forward")
def _moe_forward_fake(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    tuning: str = "",
) -> torch.Tensor:
    _check_moe_args(x, topk_idx, topk_weights, w1, w2)
    return x.new_empty(x.shape)


@torch.library.register_fake("uniep::moe_backward")
def _moe_backward_fake(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_name: str,
    tuning: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_moe_args(x, topk_idx, topk_weights, w1, w2)
    torch._check_value(
        grad_out.dim() == 2 and grad_out.shape[0] == x.shape[0] and grad_out.shape[1] == x.shape[1],
        lambda: f"grad_out must have x's shape {tuple(x.shape)}, got {tuple(grad_out.shape)}",
    )
    torch._check_value(
        grad_out.dtype == x.dtype,
        lambda: f"grad_out must have x's dtype {x.dtype}, got {grad_out.dtype}",
    )
    return (
        x.new_empty(x.shape),
        topk_weights.new_empty(topk_weights.shape),
        w1.new_empty(w1.shape),
        w2.new_empty(w2.shape),
    )


def _check_at_most(value: int, name: str, bound: int, why: str) -> None:
    # The C++ bound (MoeShape::validate): larger counts would size the outputs past any memory.
    torch._check_value(value <= bound, lambda: f"{name} must be <= {bound} ({why}), got {value}")


@torch.library.register_fake("uniep::routing_layout")
def _routing_layout_fake(
    topk_idx: torch.Tensor, num_experts: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check_value(
        topk_idx.dim() == 2, lambda: f"topk_idx must be 2-D [T, K], got {topk_idx.dim()}-D"
    )
    torch._check_value(
        topk_idx.dtype == torch.int64, lambda: f"topk_idx must be int64, got {topk_idx.dtype}"
    )
    torch._check_value(world_size > 0, lambda: f"world_size must be > 0, got {world_size}")
    _check_at_most(world_size, "world_size", _C.MAX_WORLD_SIZE, "2**16, uniep::kMaxWorldSize")
    torch._check_value(num_experts > 0, lambda: f"num_experts must be > 0, got {num_experts}")
    _check_at_most(num_experts, "num_experts", _C.MAX_EXPERTS, "2**20, uniep::kMaxExperts")
    torch._check_value(
        num_experts % world_size == 0,
        lambda: f"num_experts ({num_experts}) must be divisible by world_size ({world_size})",
    )
    tokens = topk_idx.shape[0]
    return (
        topk_idx.new_empty((world_size,), dtype=torch.int64),
        topk_idx.new_empty((num_experts,), dtype=torch.int64),
        topk_idx.new_empty((tokens, world_size), dtype=torch.bool),
    )


@torch.library.register_fake("uniep::expert_rows")
def _expert_rows_fake(
    recv_src: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    recv_from_rank: torch.Tensor,
    rank: int,
    num_experts: int,
    max_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for name, t in (
        ("recv_src", recv_src),
        ("recv_topk_idx", recv_topk_idx),
        ("recv_from_rank", recv_from_rank),
    ):
        torch._check_value(
            t.dtype == torch.int64, lambda n=name, t=t: f"{n} must be int64, got {t.dtype}"
        )
    torch._check_value(
        recv_src.dim() == 1, lambda: f"recv_src must be 1-D [N], got {recv_src.dim()}-D"
    )
    torch._check_value(
        recv_topk_idx.dim() == 2 and recv_topk_idx.shape[0] == recv_src.shape[0],
        lambda: (
            f"recv_topk_idx must be [N, K] with N = {recv_src.shape[0]}, "
            f"got {tuple(recv_topk_idx.shape)}"
        ),
    )
    torch._check_value(
        recv_from_rank.dim() == 1 and recv_from_rank.shape[0] >= 1,
        lambda: f"recv_from_rank must be 1-D [world_size], got {tuple(recv_from_rank.shape)}",
    )
    world = recv_from_rank.shape[0]
    torch._check_value(0 <= rank < world, lambda: f"rank must be in [0, {world}), got {rank}")
    torch._check_value(
        num_experts >= 1 and num_experts % world == 0,
        lambda: (
            f"num_experts ({num_experts}) must be a positive multiple of the world size ({world})"
        ),
    )
    _check_at_most(num_experts, "num_experts", _C.MAX_EXPERTS, "2**20, uniep::kMaxExperts")
    # R, the number of (slot, k) entries naming a local expert, is data-dependent.
    rows = torch.library.get_ctx().new_dynamic_size()
    return (
        recv_src.new_empty((rows,)),
        recv_src.new_empty((rows,)),
        recv_src.new_empty((num_experts // world,)),
    )


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group: torch.distributed.ProcessGroup | None = None,
    tuning: str | _C.TuningParams = "",
) -> torch.Tensor:
    """Expert-parallel SwiGLU MoE: dispatch tokens to their experts, run them, combine.

    ``y[t] = sum_k topk_weights[t, k] * (silu(x[t] @ W1g[e]) * (x[t] @ W1u[e])) @ W2[e]`` with
    ``e = topk_idx[t, k]``, reduced over ``k`` in ascending order in fp32. Experts are split evenly
    over the ``W`` ranks of ``group``: rank ``r`` owns global experts
    ``[r * E_local, (r + 1) * E_local)``, ``E = E_local * W``. Every rank of the group must call it.
    Differentiable with respect to ``x``, ``topk_weights``, ``w1`` and ``w2``.

    Args:
        x: ``[T, H]`` float32, bfloat16 or float64, contiguous: this rank's tokens (float16 is
            refused: the expert kernels have no float16 path).
        topk_idx: ``[T, K]`` int64 global expert ids in ``[0, E)``; -1 marks an unused slot.
        topk_weights: ``[T, K]`` float32 or bfloat16 gate weights (float64 allowed with float64
            ``x``), contiguous. The CPU executor promotes bfloat16 weights to fp32 as it reads
            them (no copy; their gradient comes back in bfloat16); on CUDA this wrapper casts them
            to float32 (one ``[T, K]`` cast, differentiable), since the dispatch sends fp32.
        w1: ``[E_local, H, 2I]`` dtype of ``x``: this rank's gate (columns ``0..I-1``) and up
            (columns ``I..2I-1``) projections. Any strides on CPU (e.g. ``gate_up.transpose(1,
            2)`` of a ``[E_local, 2I, H]`` tensor: read in place, no copy); contiguous on CUDA.
        w2: ``[E_local, I, H]`` dtype of ``x``: this rank's down projections; strides as ``w1``.
        group: the process group the experts are split over; None uses the group given to
            ``uniep.init``, else WORLD, else a world of one rank (no torch.distributed needed).
            CPU tensors need a gloo group. A group that spans nodes (``uniep.init(group,
            ranks_per_node=...)``, or torchrun's ``LOCAL_WORLD_SIZE``) moves tokens in two
            levels, once per (token, node) between nodes, with one node's ``per_k`` bits; on
            CUDA tensors through a CUDA runtime per node (docs/multinode.md).
        tuning: a ``TuningParams`` or its string form, e.g. ``"sms=24/132,token_tile=64"``.
            ``""`` uses the point ``uniep.tune`` cached for this call's shape (``tokens =
            x.shape[0]``, this device and world size), else the defaults; every rank must see
            the same cache file (a rank that picks another point fails the call on every rank,
            naming the tuning key). It never changes the output bits, except ``dispatch=fp8``,
            ``experts`` and ``combine=rank_partials`` / ``node_partials``, which a cached point
            never changes. ``combine=node_partials`` (one partial per (token, node) across
            nodes: docs/multinode.md) runs on the CPU executor and, on CUDA, across nodes.
            ``dispatch=fp8`` sends the tokens in e4m3 (one scale per 1 x 128 block) and, with
            ``experts=auto`` (the default), runs the experts in fp8 too: w1 and w2 quantized in
            128 x 128 blocks (on CUDA one e4m3 copy kept while they are unchanged: half their
            memory; ``uniep.moe.kept_weights.clear_packed`` drops it), the SwiGLU activation
            quantized like a token row; hidden and I multiples of 128. ``experts=bf16`` keeps
            bf16 expert GEMMs on the fp8 rows. The gradient is the bf16 layer's at the rows the
            experts received (the weights' and activation's rounding passed straight through).
            On CUDA,
            ``overlap=fused`` named (with bf16 dispatch, the per-k combine and UniEP's GEMMs)
            runs the MegaKernel, and ``overlap=chunked`` at one rank its pieces on streams (the
            rows' send beside the gated GEMMs), on a packed copy of ``w1`` kept while ``w1`` is
            unchanged (``uniep.moe.megakernel.forward``: one more ``w1`` of memory, packed again
            after each in-place update); other numerics, ``overlap=chunked`` across ranks, layers
            whose hidden or ffn size is not a multiple of 64 (forward and backward alike) and
            calls under ``torch.compile`` run the separate launches. Same bits either way.

    Returns:
        ``[T, H]`` tensor of ``x``'s dtype and device. On CUDA tensors the group's GPU runtime
        (``uniep.moe.ep``) is created on the first call, sized for the largest batch of that call,
        and re-created larger (on every rank, in the same call) when a later call needs more.

    Raises:
        ValueError: an argument has the wrong shape, dtype or device, or an expert id is out of
            range; the message names the argument.
        RuntimeError: the exchange with another rank failed; or, on a layer's first call with
            trainable ``w1`` / ``w2`` at more than one rank, they are bit-identical on every
            rank (a plain ``DistributedDataParallel`` copies rank 0's shard everywhere: see
            ``uniep.nn.mark_expert_shards`` and ``uniep.nn.data_parallel``).
    """
    name = distributed.group_name(group)
    if isinstance(tuning, _C.TuningParams):
        # Its given keys alone: a key written out at its default would read as asked for.
        tuning = tuning_string(tuning)
    elif not isinstance(tuning, str):
        error = f"tuning must be a str or TuningParams, got {type(tuning).__name__}"
        distributed.raise_on_all_ranks(name, "moe_forward", error, x.device.type)
    if torch.is_grad_enabled() and isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor):
        # Also where torch.compile traces this call, which the op's autograd cannot check then
        # (no collective: raised while tracing, the call is run again eagerly and raises).
        expert_shards.refuse_ddp_replicas(name, distributed.world_size(group), w1, w2)
    if (
        isinstance(x, torch.Tensor)
        and x.is_cuda
        and distributed.ranks_per_node(group) < distributed.world_size(group)
    ):
        # Across nodes: the rail between nodes, the CUDA runtime within each (CPU tensors run
        # the two levels in the CPU executor, through the op below).
        from . import multinode_cuda

        resolved = distributed.resolve_group(group)
        return multinode_cuda.moe_forward(x, topk_idx, topk_weights, w1, w2, resolved, tuning)
    cached = (
        tuning == ""
        and not torch.compiler.is_compiling()
        and all(isinstance(t, torch.Tensor) for t in (x, topk_idx, w1, w2))
        and w1.dim() == 3
        and w2.dim() == 3
    )
    if x.is_cuda and topk_weights.dtype == torch.bfloat16:
        # The CUDA dispatch sends fp32 weights: the one small [T, K] cast, here.
        topk_weights = topk_weights.float()

    def run(tuning: str) -> torch.Tensor:
        if (
            x.is_cuda
            and not torch.compiler.is_compiling()
            and x.dim() == 2
            and w2.dim() == 3
            and megakernel_overlap(tuning, distributed.world_size(group), x.shape[1], w2.shape[1])
        ):
            # The MegaKernel (overlap=chunked at one rank: its pieces on streams), on a packed
            # copy of w1 kept while w1 is unchanged (uniep.moe.megakernel.forward).
            return megakernel_forward.moe_forward_fused(
                x, topk_idx, topk_weights, w1, w2, group, name, tuning
            )
        if x.is_cuda and x.dim() == 2 and topk_idx.dim() == 2 and w1.dim() == 3:
            # CUDA tensors run on the group's GPU runtime: created here on first use
            # (collective).
            from . import ep

            experts = w1.shape[0] * distributed.world_size(group)
            ep.ensure_runtime(name, x.shape[0], x.shape[1], topk_idx.shape[1], experts)
        return torch.ops.uniep.moe_forward(x, topk_idx, topk_weights, w1, w2, name, tuning)

    if not cached:
        return run(tuning)
    from ..tuning import cache as tune_cache

    world = distributed.world_size(group)
    return tune_cache.call_with_cached_point(
        run, x, topk_idx, w2.shape[1], w1.shape[0] * world, world
    )
