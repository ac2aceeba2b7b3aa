"""Copies of expert weights in the layout a kernel reads, kept while the weights are unchanged.

The MegaKernel's first GEMM applies SwiGLU in its epilogue and reads w1 with gate and up
interleaved (``uniep.gemm.pack_gate_up``); the fused backward's first GEMMs read w2 transposed.
One copy is kept per tensor and made again only when the tensor changed: its version counter
(every in-place write through autograd's view of it, an optimizer step included) or its storage
moved. Writes that bypass the version counter (``w.data.copy_(...)``, or through another
process) are not seen: call :func:`clear_packed` after them. A copy costs one more weight of GPU
memory; an inference server with fixed weights prepares them once instead (``uniep.moe.prepared``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .. import _C

__all__ = ["clear_packed", "packed_gate_up", "transposed_w2"]

# (id(w), what) -> (a weak reference to w, its version, its data pointer, the kept copy). The
# weak reference's callback drops the entry when w dies, so a later tensor with the same id never
# meets a stale copy.
_PACKED: dict[tuple[int, str], tuple[weakref.ref, int, int, torch.Tensor]] = {}


def _kept_copy(
    w: torch.Tensor, what: str, make: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``make(w.detach())``, made once per ``w`` and kept while ``w`` is unchanged (module
    docstring); made at every call while a CUDA graph is being captured (a kept copy would go
    stale when ``w`` is updated between replays)."""
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        return make(w.detach())
    key = (id(w), what)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr():
        return hit[3]
    kept = make(w.detach())
    ref = weakref.ref(w, lambda _ref, k=key: _PACKED.pop(k, None))
    _PACKED[key] = (ref, w._version, w.data_ptr(), kept)
    return kept


def packed_gate_up(w1: torch.Tensor) -> torch.Tensor:
    """``pack_gate_up(w1)``, made once per ``w1`` and kept while ``w1`` is unchanged (module
    docstring). Detached: the gradient goes to ``w1`` through ``moe_backward``."""
    from ..gemm import pack_gate_up

    return _kept_copy(w1, "packed_gate_up", pack_gate_up)


def transposed_w2(w2: torch.Tensor) -> torch.Tensor:
    """``w2.transpose(1, 2)`` contiguous (``[E, H, I]``), kept as :func:`packed_gate_up` keeps its
    copy: the fused backward's first GEMMs read it (``uniep.moe.megakernel.backward``)."""
    return _kept_copy(w2, "transposed_w2", lambda w: w.transpose(1, 2).contiguous())


def clear_packed() -> None:
    """Drops every packed copy (after writes the version counter does not see), and the e4m3
    copies ``moe_forward`` keeps for fp8 experts (``dispatch=fp8``)."""
    _PACKED.clear()
    _C.clear_fp8_experts()
