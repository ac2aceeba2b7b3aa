"""Copies of expert weights in the layout a kernel reads, kept while the weights are unchanged.

The MegaKernel's first GEMM applies SwiGLU in its epilogue and reads w1 with gate and up
interleaved (``uniep.gemm.pack_gate_up``); the fused backward's first GEMMs read w2 transposed.
One copy is kept per tensor and made again only when the tensor changed: its version counter
(every in-place write through autograd's view of it, an optimizer step included), its storage
(``w.data = other``, even where the new storage has the old address) or its data pointer.
Writes that bypass the version counter (``w.data.copy_(...)``, a buffer ``w.data`` aliases
written through another tensor, writes from another process, and any in-place write to an
inference tensor, which has no version counter) are not seen: call :func:`clear_packed` after
them. A copy costs one more weight of GPU
memory; an inference server with fixed weights prepares them once instead (``uniep.moe.prepared``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import _C

__all__ = ["clear_packed", "packed_gate_up", "transposed_w2"]

# (id(w), what) -> (a weak reference to w, its state, the kept copy). The weak reference's
# callback drops the entry when w dies, so a later tensor with the same id never meets a stale
# copy.
_PACKED: dict[tuple[int, str], tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _state(w: torch.Tensor) -> tuple:
    """What changes when ``w``'s values may have: its version (-1 for an inference tensor, which
    has none), its data pointer and its storage. The storage is held by a weak reference, which
    keeps the storage's record (not its memory) alive, so a new storage never takes the old one's
    identity even where it takes its address."""
    version = -1 if w.is_inference() else w._version
    return version, w.data_ptr(), StorageWeakRef(w.untyped_storage())


def _same_state(kept: tuple, w: torch.Tensor) -> bool:
    version, ptr, storage = kept
    now = -1 if w.is_inference() else w._version
    return (
        version == now
        and ptr == w.data_ptr()
        and not storage.expired()
        and storage.cdata == w.untyped_storage()._cdata
    )


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
    if hit is not None and hit[0]() is w and _same_state(hit[1], w):
        return hit[2]
    kept = make(w.detach())
    ref = weakref.ref(w, lambda _ref, k=key: _PACKED.pop(k, None))
    _PACKED[key] = (ref, _state(w), kept)
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
