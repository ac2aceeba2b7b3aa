"""The MegaKernel across ranks from Python without a GPU: its op's fake kernel gives the output
shapes (torch.compile traces it), and the entry points refuse what they cannot run with errors
that name what is missing."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from uniep import megakernel

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")


def test_fake_kernel_gives_the_shapes() -> None:
    with FakeTensorMode():
        x = torch.empty(300, 192, dtype=torch.bfloat16)
        idx = torch.empty(300, 4, dtype=torch.int64)
        w = torch.empty(300, 4, dtype=torch.float32)
        w1p = torch.empty(4, 192, 256, dtype=torch.bfloat16)
        w2 = torch.empty(4, 128, 192, dtype=torch.bfloat16)
        out, error, timeout = torch.ops.uniep.moe_fused_ep(x, idx, w, w1p, w2, "", 132, -1)
        assert out.shape == (300, 192) and out.dtype == torch.bfloat16
        assert error.shape == (1,) and timeout.shape == (5,) and timeout.dtype == torch.int32
        with pytest.raises(ValueError, match="topk_idx must be \\[T = 300, K\\]"):
            torch.ops.uniep.moe_fused_ep(x, idx[:10], w, w1p, w2, "", 132, -1)


@needs_no_cuda
def test_entry_points_name_the_missing_gpu() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch and a visible GPU"):
        megakernel.init_fused_ep(max_tokens=8, hidden=64, ffn=64, top_k=2, num_experts=4)
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    idx = torch.zeros(8, 2, dtype=torch.int64)
    w = torch.zeros(8, 2)
    w1p = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch"):
        megakernel.moe_forward_ep(x, idx, w, w1p, w2)
    with pytest.raises(RuntimeError, match="needs a CUDA build of torch"):
        megakernel.fused_ep_heap_bytes(2, 8, 64, 64, 2, 4)
    megakernel.shutdown_fused_ep()  # nothing to destroy: a no-op
