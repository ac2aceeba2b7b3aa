"""The GPU expert-parallel layer (uniep.moe.ep) on a machine without it: clear errors, fake
kernels."""

from __future__ import annotations

import pytest
import torch
import uniep
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from uniep import _C

no_gpu_runtime = pytest.mark.skipif(
    uniep.moe.ep.available(), reason="this build and machine have the GPU runtime"
)


@no_gpu_runtime
def test_init_runtime_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="CUDA build of torch"):
        uniep.moe.ep.init_runtime(max_tokens=16, hidden=128, top_k=2, num_experts=4)


@pytest.mark.skipif(
    bool(getattr(_C, "has_ep_runtime", False)), reason="this build has the GPU runtime"
)
def test_check_and_ensure_runtime_name_the_missing_runtime() -> None:
    # A CPU-only build has no _C.ep_* functions: an AttributeError on them named none of this.
    with pytest.raises(NotImplementedError, match="uniep.moe.ep.check needs the UniEP GPU runtime"):
        uniep.moe.ep.check()
    with pytest.raises(NotImplementedError, match="ensure_runtime needs the UniEP GPU runtime"):
        uniep.moe.ep.ensure_runtime("", 4, 128, 2, 4)


@no_gpu_runtime
def test_dispatch_of_cpu_tensors_is_not_implemented() -> None:
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.long)
    w = torch.ones(4, 2)
    with pytest.raises(NotImplementedError, match="ep_dispatch"):
        uniep.moe.ep.dispatch(x, idx, w)


@pytest.mark.parametrize(
    ("tuning", "key"), [("sms=abc", "sms"), ("bogus=1", "bogus"), ("dispatch=fp4", "dispatch")]
)
def test_dispatch_rejects_bad_tuning_by_name(tuning: str, key: str) -> None:
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=key):
        uniep.moe.ep.dispatch(x, idx, torch.ones(4, 2), tuning=tuning)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_dispatch_fake_kernel_shapes(precision: str) -> None:
    # Receive counts are data-dependent: the fake kernel returns unbacked sizes, which need a
    # ShapeEnv (as torch.compile provides).
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(8, 256, dtype=torch.bfloat16))
        idx = mode.from_tensor(torch.empty(8, 4, dtype=torch.long))
        w = mode.from_tensor(torch.empty(8, 4))
        out = torch.ops.uniep.ep_dispatch(x, idx, w, "", f"dispatch={precision}")
    recv_x, scales, recv_src, recv_idx, recv_w, per_expert, row_slot, row_target, epoch = out
    assert recv_x.dtype == (torch.float8_e4m3fn if precision == "fp8" else torch.bfloat16)
    assert recv_x.shape[1] == 256 and recv_idx.shape[1] == 4 and recv_w.dtype == torch.float32
    assert scales.shape[1] == (2 if precision == "fp8" else 0)
    assert recv_src.dtype == row_slot.dtype == row_target.dtype == per_expert.dtype == torch.int64
    assert isinstance(epoch, int)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_dispatch_cached_fake_kernel_shapes(precision: str) -> None:
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(8, 256, dtype=torch.bfloat16))
        idx = mode.from_tensor(torch.empty(8, 4, dtype=torch.long))
        w = mode.from_tensor(torch.empty(8, 4))
        recv_x, scales, epoch = torch.ops.uniep.ep_dispatch_cached(
            x, idx, w, "", 5, f"dispatch={precision}"
        )
    assert recv_x.dtype == (torch.float8_e4m3fn if precision == "fp8" else torch.bfloat16)
    assert recv_x.shape[1] == 256 and scales.dtype == torch.float32
    assert scales.shape[1] == (2 if precision == "fp8" else 0)
    assert isinstance(epoch, int)


def test_dispatch_cached_needs_a_handle() -> None:
    with pytest.raises(TypeError, match="handle must be a uniep.moe.ep.Handle"):
        uniep.moe.ep.dispatch_cached(torch.zeros(4, 128), "epoch 3")  # type: ignore[arg-type]


@no_gpu_runtime
def test_dispatch_cached_of_cpu_tensors_is_not_implemented() -> None:
    idx = torch.zeros(4, 2, dtype=torch.long)
    handle = uniep.moe.ep.Handle(idx[:, 0], idx[:, 0], idx, torch.ones(4, 2), "", "", 1)
    with pytest.raises(NotImplementedError, match="ep_dispatch_cached"):
        uniep.moe.ep.dispatch_cached(torch.randn(4, 128, dtype=torch.bfloat16), handle)


def test_combine_fake_kernel_shape() -> None:
    with FakeTensorMode() as mode:
        y = mode.from_tensor(torch.empty(10, 256, dtype=torch.bfloat16))
        target = mode.from_tensor(torch.empty(10, dtype=torch.long))
        idx = mode.from_tensor(torch.empty(6, 4, dtype=torch.long))
        w = mode.from_tensor(torch.empty(6, 4))
        out = torch.ops.uniep.ep_combine(y, target, idx, w, "", 1, "")
    assert tuple(out.shape) == (6, 256) and out.dtype == torch.bfloat16


def test_build_reports_the_gpu_runtime() -> None:
    assert isinstance(_C.has_ep_runtime, bool)
    assert _C.has_ep_runtime == bool(_C.build_info()["cuda_ops"])
