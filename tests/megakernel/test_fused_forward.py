"""uniep.moe.megakernel.forward on the CPU: the packed copy of w1 that moe_forward's overlap=fused
path keeps (made once, made again after an in-place write, dropped with its tensor), the transposed
copy of w2 its backward keeps the same way, and which tuning strings take the MegaKernel."""

from __future__ import annotations

import gc

import pytest
import torch
from uniep.gemm import pack_gate_up
from uniep.moe import kept_weights
from uniep.moe.megakernel import forward as fused_forward


def test_the_packed_copy_is_kept_until_w1_changes() -> None:
    w1 = torch.randn(2, 16, 32).bfloat16()
    first = fused_forward.packed_gate_up(w1)
    assert torch.equal(first, pack_gate_up(w1))
    assert fused_forward.packed_gate_up(w1) is first
    w1.mul_(2)  # an in-place write (an optimizer step) bumps the version: packed again
    second = fused_forward.packed_gate_up(w1)
    assert second is not first and torch.equal(second, pack_gate_up(w1))
    other = w1.clone()  # equal values, another tensor: its own copy
    assert fused_forward.packed_gate_up(other) is not second
    fused_forward.clear_packed()
    assert fused_forward.packed_gate_up(w1) is not second


def test_the_copy_goes_with_its_tensor() -> None:
    fused_forward.clear_packed()
    w1 = torch.randn(1, 8, 16).bfloat16()
    fused_forward.packed_gate_up(w1)
    assert len(kept_weights._PACKED) == 1
    del w1
    gc.collect()
    assert not kept_weights._PACKED


def test_a_swapped_storage_is_packed_again_and_an_inference_tensor_is_kept() -> None:
    """``w.data = other`` leaves the version counter as it was; the new storage is seen even
    where it lies at the old one's address (the caching allocator hands a freed block back; here
    two tensors over one numpy buffer), which the data pointer alone missed. An inference tensor
    has no version counter: it is kept (its in-place writes, like ``.data`` writes, need
    clear_packed), not refused."""
    import numpy as np

    fused_forward.clear_packed()
    memory = np.random.default_rng(0).standard_normal((1, 8, 16)).astype(np.float32)
    w1 = torch.nn.Parameter(torch.empty(1, 8, 16))
    w1.data = torch.from_numpy(memory)
    first = fused_forward.packed_gate_up(w1)
    version, address = w1._version, w1.data_ptr()
    memory *= 2  # the next step's weights, written where the old ones were
    w1.data = torch.from_numpy(memory)  # a new storage at the same address
    assert w1._version == version and w1.data_ptr() == address
    second = fused_forward.packed_gate_up(w1)
    assert second is not first and torch.equal(second, pack_gate_up(w1.detach()))
    assert fused_forward.packed_gate_up(w1) is second
    with torch.inference_mode():
        served = torch.randn(1, 8, 16).bfloat16()
    kept = fused_forward.packed_gate_up(served)
    assert fused_forward.packed_gate_up(served) is kept
    assert torch.equal(kept, pack_gate_up(served))


def test_a_parameter_is_packed_detached() -> None:
    w1 = torch.nn.Parameter(torch.randn(1, 8, 16).bfloat16())
    packed = fused_forward.packed_gate_up(w1)
    assert not packed.requires_grad and torch.equal(packed, pack_gate_up(w1.detach()))


def test_the_transposed_w2_is_kept_beside_the_packed_w1() -> None:
    """The fused backward's copy of w2 (transposed): kept per tensor like the packed w1, under
    its own key, so both copies of one tensor coexist; a detached view is another tensor (the
    autograd backward keys it by the saved w2 itself for that reason)."""
    fused_forward.clear_packed()
    w2 = torch.nn.Parameter(torch.randn(2, 16, 32).bfloat16())
    w2t = fused_forward.transposed_w2(w2)
    assert w2t.shape == (2, 32, 16) and w2t.is_contiguous() and not w2t.requires_grad
    assert torch.equal(w2t, w2.detach().transpose(1, 2))
    assert fused_forward.transposed_w2(w2) is w2t
    fused_forward.packed_gate_up(w2)  # the same tensor under the other key
    assert len(kept_weights._PACKED) == 2 and fused_forward.transposed_w2(w2) is w2t
    assert fused_forward.transposed_w2(w2.detach()) is not w2t
    with torch.no_grad():
        w2.mul_(0.5)  # an optimizer step: transposed again
    assert fused_forward.transposed_w2(w2) is not w2t


@pytest.mark.parametrize(
    ("tuning", "fused"),
    [
        ("overlap=fused", True),
        ("overlap=fused,sms=16,tile_m=64", True),
        ("", False),
        ("overlap=sequential", False),
        ("overlap=fused,dispatch=fp8", False),
        ("overlap=fused,combine=rank_partials", False),
        ("overlap=fused,gemm=torch", False),
    ],
)
def test_which_tuning_runs_the_megakernel(tuning: str, fused: bool) -> None:
    assert fused_forward.runs_fused(tuning) is fused


@pytest.mark.parametrize(
    ("tuning", "world", "mode"),
    [
        ("overlap=fused", 1, "fused"),
        ("overlap=fused", 4, "fused"),
        ("overlap=chunked", 1, "streams"),
        ("overlap=chunked,sms=12", 1, "streams"),
        ("overlap=chunked", 2, None),  # across ranks: the separate launches
        ("overlap=chunked,dispatch=fp8", 1, None),
        ("overlap=chunked,gemm=torch", 1, None),
        ("overlap=sequential", 1, None),
        ("", 1, None),
    ],
)
def test_which_pieces_run_each_overlap(tuning: str, world: int, mode: str | None) -> None:
    assert fused_forward.megakernel_overlap(tuning, world) == mode


def test_a_bad_tuning_string_names_the_key() -> None:
    with pytest.raises(ValueError, match="overlap"):
        fused_forward.runs_fused("overlap=sometimes")


def test_bad_operands_are_named_before_the_packing() -> None:
    fused_forward.clear_packed()
    x = torch.randn(4, 16).bfloat16()
    idx = torch.zeros(4, 2, dtype=torch.long)
    w = torch.ones(4, 2)
    w1, w2 = torch.randn(2, 16, 32).bfloat16(), torch.randn(2, 16, 16).bfloat16()
    with pytest.raises(ValueError, match=r"w2 must be \[E_local = 2, I = 16, H = 16\]"):
        fused_forward._forward(x, idx, w, w1, w2[:, :8], None, "overlap=fused")
    with pytest.raises(ValueError, match=r"w1 must be \[E_local, H = 16, 2I\]"):
        fused_forward._forward(x, idx, w, w1[:, :8], w2, None, "overlap=fused")
    with pytest.raises(ValueError, match="w1 and w2 must be bfloat16"):
        fused_forward._forward(x, idx, w, w1.float(), w2, None, "overlap=fused")
    assert not kept_weights._PACKED  # nothing was packed for a call that failed its checks
