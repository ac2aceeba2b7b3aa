"""uniep.gemm's packed w1 layout (what the SwiGLU epilogue reads), on CPU."""

from __future__ import annotations

import pytest
import torch
from uniep.gemm import pack_gate_up, unpack_gate_up


@pytest.mark.parametrize("e,h,i", [(1, 4, 8), (3, 5, 24), (2, 16, 64)])
def test_pack_interleaves_gate_and_up_in_blocks_of_eight(e: int, h: int, i: int) -> None:
    w1 = torch.randn(e, h, 2 * i, dtype=torch.float64)
    packed = pack_gate_up(w1)
    assert packed.shape == w1.shape and packed.is_contiguous()
    for b in range(i // 8):
        gate, up = w1[:, :, 8 * b : 8 * b + 8], w1[:, :, i + 8 * b : i + 8 * b + 8]
        assert torch.equal(packed[:, :, 16 * b : 16 * b + 8], gate)
        assert torch.equal(packed[:, :, 16 * b + 8 : 16 * b + 16], up)
    assert torch.equal(unpack_gate_up(packed), w1)


def test_products_pair_up() -> None:
    # What the epilogue relies on: column c of a gate block and c + 8 are gate j and up j.
    x = torch.randn(7, 32, dtype=torch.float64)
    w1 = torch.randn(1, 32, 48, dtype=torch.float64)
    h, hp = x @ w1[0], x @ pack_gate_up(w1)[0]
    for j in range(24):
        c = 16 * (j // 8) + j % 8
        assert torch.equal(hp[:, c], h[:, j]) and torch.equal(hp[:, c + 8], h[:, 24 + j])


def test_plain_w1_read_in_blocks_of_64_pairs_gate_and_up() -> None:
    # What the SwiGLU epilogue on w1 as stored relies on (cpp/cuda/gemm/grouped/
    # gate_up_mainloop.cuh): B's TMA views w1 with N = (64, 2, I / 64) : (1, I, 64), so tile
    # column p = c + 64 g + 128 j is w1's column g I + 64 j + c, gate column p (p % 128 < 64)
    # pairs with p + 64, and its activation column is (p // 128) * 64 + p % 64.
    e, h, i = 2, 16, 192
    w1 = torch.randn(e, h, 2 * i, dtype=torch.float64)
    view = w1.as_strided((e, h, i // 64, 2, 64), (h * 2 * i, 2 * i, 64, i, 1)).reshape(e, h, 2 * i)
    x = torch.randn(5, h, dtype=torch.float64)
    hv, hw = x @ view[1], x @ w1[1]
    for p in range(2 * i):
        if p % 128 >= 64:
            continue
        j = (p // 128) * 64 + p % 64
        assert torch.equal(hv[:, p], hw[:, j]) and torch.equal(hv[:, p + 64], hw[:, i + j])


def test_plain_swiglu_fake_shapes_and_errors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(10, 64, dtype=torch.bfloat16)
        w1 = torch.empty(3, 64, 384, dtype=torch.bfloat16)
        offs = torch.empty(3, dtype=torch.int32)
        act = torch.ops.uniep.grouped_mm_swiglu_plain(x, w1, offs)
        assert act.shape == (10, 192) and act.dtype == torch.bfloat16
        with pytest.raises(ValueError, match=r"I = w1.size\(2\) / 2 a multiple of 64.*320"):
            torch.ops.uniep.grouped_mm_swiglu_plain(x, w1[:, :, :320], offs)
        with pytest.raises(ValueError, match=r"w must be \[E, K, N\] with K = x.size\(1\)"):
            torch.ops.uniep.grouped_mm_swiglu_plain(x, w1[:, :32], offs)


def test_named_errors() -> None:
    with pytest.raises(ValueError, match=r"w1 must be 3-D \[E, H, 2I\]"):
        pack_gate_up(torch.zeros(4, 16))
    with pytest.raises(ValueError, match=r"w1.size\(2\) = 2I must be a multiple of 16.*got 24"):
        pack_gate_up(torch.zeros(1, 4, 24))
    with pytest.raises(ValueError, match=r"w1_packed.size\(2\)"):
        unpack_gate_up(torch.zeros(1, 4, 8))


def test_quantize_rows_blocks_and_error() -> None:
    from uniep.gemm import dequantize_rows, quantize_rows

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 384, generator=gen) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(128)
    x[2, 128:256] = 0.0  # an all-zero block: scale 1, values 0
    q, scales = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.shape == (5, 3) and scales.dtype == torch.float32
    amax = x.abs().reshape(5, 3, 128).amax(2)
    torch.testing.assert_close(scales, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    assert scales[2, 1] == 1.0 and torch.count_nonzero(q[2, 128:256].float()) == 0
    # Each block's largest value lands on +-448; e4m3 keeps 3 mantissa bits: error <= 2^-4.
    assert q.float().abs().reshape(5, 3, 128).amax(2)[amax > 0].eq(448).all()
    err = (dequantize_rows(q, scales) - x).abs()
    assert (err <= x.abs() * 2**-4 + scales.repeat_interleave(128, 1) * 2**-9).all()


def test_quantize_fp8_op_divides_once_as_the_kernels() -> None:
    # The op's CPU kernel against numpy's float32 arithmetic (each division and product rounded
    # once, as the CUDA encoding and the C++ CPU executor compute them), byte for byte.
    import numpy as np

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 512, generator=gen) * 7).bfloat16()
    x[3, 256:384] = 0.0  # an all-zero block: scale 1, zeros
    x[4, 0] = 3.0e38  # a block whose other values round to zero
    q, scales = torch.ops.uniep.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (9, 4)
    blocks = x.float().numpy().reshape(9, 4, 128)
    amax = np.abs(blocks).max(axis=2)
    limit = np.float32(448.0)
    want_scale = np.where(amax > 0, amax / limit, np.float32(1.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, limit / amax, np.float32(1.0)).astype(np.float32)
    product = np.clip((blocks * inv[:, :, None]).astype(np.float32), -limit, limit)
    want_q = torch.from_numpy(product.reshape(9, 512)).to(torch.float8_e4m3fn)
    assert np.array_equal(scales.numpy(), want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert scales[3, 2] == 1.0 and not q[3, 256:384].float().any()
    # The names in its errors are the op's.
    for bad, match in [
        (torch.zeros(4, 100, dtype=torch.bfloat16), "multiple of 128 columns"),
        (torch.zeros(4, 128), "x must be bfloat16"),
        (torch.zeros(128, dtype=torch.bfloat16), "x must be 2-D"),
    ]:
        with pytest.raises((ValueError, RuntimeError), match=match):
            torch.ops.uniep.quantize_fp8(bad)
    # The fake kernel's shapes (torch.compile, meta tensors).
    fq, fs = torch.ops.uniep.quantize_fp8(torch.empty(6, 256, dtype=torch.bfloat16, device="meta"))
    assert fq.shape == (6, 256) and fq.dtype == torch.float8_e4m3fn and fs.shape == (6, 2)


def test_quantize_fp8_rows_stores_each_token_at_its_entries_rows() -> None:
    # quantize_fp8_rows is quantize_fp8 of the tokens scattered to their GEMM rows: each named
    # row holds its token's bytes and scales, -1 entries store nothing, and a row past the
    # T x top_k rows is left out and named in the error word (the send's: code 4 << 48 | entry).
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(4, 384, generator=gen) * 3).bfloat16()
    gemm_row = torch.tensor([[3, 0], [5, -1], [1, 7], [2, 6]])
    q, scales, error = torch.ops.uniep.quantize_fp8_rows(x, gemm_row)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (8, 384) and scales.shape == (8, 3)
    assert int(error) == 0
    tq, ts = torch.ops.uniep.quantize_fp8(x)
    for t in range(4):
        for k in range(2):
            row = int(gemm_row[t, k])
            if row >= 0:
                assert torch.equal(q[row].view(torch.uint8), tq[t].view(torch.uint8)), (t, k)
                assert torch.equal(scales[row], ts[t]), (t, k)
    assert not q[4].view(torch.uint8).any()  # no entry names row 4
    bad = gemm_row.clone()
    bad[2, 1] = 8
    q2, _, error = torch.ops.uniep.quantize_fp8_rows(x, bad)
    assert int(error) == (4 << 48) | 5  # entry (token 2, k 1)
    assert torch.equal(q2[:7].view(torch.uint8), q[:7].view(torch.uint8))
    # Without report the entry is still left out, and no word is made.
    q3, _, unreported = torch.ops.uniep.quantize_fp8_rows(x, bad, report=False)
    assert unreported.shape == (0,) and torch.equal(q3.view(torch.uint8), q2.view(torch.uint8))
    for args, match in [
        ((x, gemm_row[:3]), "gemm_row must be \\[T = 4"),
        ((x, gemm_row.int()), "gemm_row must be int64"),
        ((x.float(), gemm_row), "x must be bfloat16"),
    ]:
        with pytest.raises((ValueError, RuntimeError), match=match):
            torch.ops.uniep.quantize_fp8_rows(*args)
    meta = torch.empty(6, 256, dtype=torch.bfloat16, device="meta")
    fq, fs, fe = torch.ops.uniep.quantize_fp8_rows(
        meta, torch.empty(6, 8, dtype=torch.long, device="meta")
    )
    assert fq.shape == (48, 256) and fs.shape == (48, 2) and fe.shape == (1,)
    _, _, fe = torch.ops.uniep.quantize_fp8_rows(
        meta, torch.empty(6, 8, dtype=torch.long, device="meta"), report=False
    )
    assert fe.shape == (0,)


def test_quantize_expert_weights_is_k_major_with_block_scales() -> None:
    from uniep.gemm import dequantize_expert_weights, quantize_expert_weights

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 256, 384, generator=gen)
    w[1, :128, 128:256] *= 1000.0  # one block far larger than the rest keeps its own scale
    q, scales = quantize_expert_weights(w.bfloat16())
    assert q.shape == (3, 384, 256) and q.is_contiguous()  # [E, N, K]
    assert scales.shape == (3, 2, 3)
    wb = w.bfloat16().float()
    amax = wb.reshape(3, 2, 128, 3, 128).abs().amax(dim=(2, 4))
    torch.testing.assert_close(scales, amax / 448)
    back = dequantize_expert_weights(q, scales)
    assert back.shape == w.shape
    rel = (back - wb).abs() / scales.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert (rel <= 448 * 2**-4).all()  # at most half an e4m3 step of the block's range
    torch.testing.assert_close(back, wb, rtol=2**-4, atol=float(scales.max()) * 2**-6)
    with pytest.raises(ValueError, match="K and N multiples of 128"):
        quantize_expert_weights(torch.zeros(1, 128, 100))


def test_pack_gate_up_fp8_puts_gate_and_up_rows_64_apart_with_their_block_scales() -> None:
    from uniep.gemm import pack_gate_up_fp8, quantize_expert_weights, unpack_gate_up_fp8

    gen = torch.Generator().manual_seed(5)
    e, k, ffn = 2, 256, 384  # I = 384: a 128-row scale block spans the gate/up halves' 64s
    w1 = torch.randn(e, k, 2 * ffn, generator=gen)
    w1[:, :, ffn + 128 : ffn + 256] *= 50.0  # the up's second block: a scale of its own
    q1, s1 = quantize_expert_weights(w1.bfloat16())
    q, s = pack_gate_up_fp8(q1, s1)
    assert q.shape == q1.shape and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert s.shape == (e, k // 128, 2 * ffn // 64)
    qb, q1b = q.view(torch.uint8), q1.view(torch.uint8)
    for j in range(ffn // 64):
        for g in range(2):  # packed row c + 64 g + 128 j is row g I + 64 j + c
            src = g * ffn + 64 * j
            assert torch.equal(
                qb[:, 128 * j + 64 * g : 128 * j + 64 * g + 64], q1b[:, src : src + 64]
            )
            assert torch.equal(s[:, :, 2 * j + g], s1[:, :, src // 128])
    back_q, back_s = unpack_gate_up_fp8(q, s)
    assert torch.equal(back_q.view(torch.uint8), q1b) and torch.equal(back_s, s1)
    with pytest.raises(ValueError, match=r"must be \[E, K / 128, 2I / 128\]"):
        pack_gate_up_fp8(q1, s)
    with pytest.raises(ValueError, match=r"must be \[E, K / 128, 2I / 64\]"):
        unpack_gate_up_fp8(q, s1)
    with pytest.raises(ValueError, match="multiples of 128"):
        pack_gate_up_fp8(q1[:, :192], s1[:, :, :1])


def test_grouped_mm_fp8_swiglu_fake_gives_the_activation_shape() -> None:
    from uniep.gemm import grouped_mm_fp8_swiglu

    meta = {"device": "meta"}
    x = torch.empty(10, 256, dtype=torch.float8_e4m3fn, **meta)
    w = torch.empty(4, 768, 256, dtype=torch.float8_e4m3fn, **meta)
    act = grouped_mm_fp8_swiglu(
        x,
        torch.empty(10, 2, **meta),
        w,
        torch.empty(4, 2, 12, **meta),
        torch.empty(4, dtype=torch.int32, **meta),
    )
    assert act.shape == (10, 384) and act.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"K = x.size\(1\) = 256"):
        grouped_mm_fp8_swiglu(
            x,
            torch.empty(10, 2, **meta),
            torch.empty(4, 768, 128, dtype=torch.float8_e4m3fn, **meta),
            torch.empty(4, 1, 12, **meta),
            torch.empty(4, dtype=torch.int32, **meta),
        )


def _swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    ffn = h.shape[1] // 2
    g, u = h[:, :ffn].double(), h[:, ffn:].double()
    return g * torch.sigmoid(g) * u


def test_swiglu_fp8_is_swiglu_then_the_row_quantization() -> None:
    from uniep.gemm import dequantize_rows, quantize_rows, swiglu_fp8

    gen = torch.Generator().manual_seed(3)
    h = (torch.randn(37, 2 * 384, generator=gen) * 3).bfloat16()
    h[5, :384] = 0  # a row whose activation is all zeros: scale 1, zeros
    act, scales = swiglu_fp8(h)
    assert act.dtype == torch.float8_e4m3fn and act.shape == (37, 384)
    assert scales.dtype == torch.float32 and scales.shape == (37, 3)
    assert torch.equal(scales[5], torch.ones(3)) and not act[5].float().any()
    # The bf16 activation (the engine's formula), then quantize_rows: the same bytes, but for
    # the odd last-ulp difference of torch's CPU exp (its vector and scalar paths differ, and
    # which elements take which depends on the buffers' alignment).
    g, u = h[:, :384].float(), h[:, 384:].float()
    q, s = quantize_rows((g / (1.0 + torch.exp(-g)) * u).bfloat16())
    assert act.view(torch.uint8).eq(q.view(torch.uint8)).float().mean() >= 0.99
    torch.testing.assert_close(scales, s, rtol=2**-7, atol=0)
    # Within e4m3's rounding of the exact activation.
    ref = _swiglu_reference(h)
    err = (dequantize_rows(act, scales).double() - ref).abs()
    assert bool((err <= 0.07 * ref.abs() + scales.repeat_interleave(128, 1).double() / 32).all())


def test_swiglu_fp8_named_errors() -> None:
    from uniep.gemm import swiglu_fp8

    with pytest.raises(ValueError, match="I a multiple of 128"):
        swiglu_fp8(torch.zeros(4, 2 * 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="h must be bfloat16"):
        swiglu_fp8(torch.zeros(4, 256))
    torch.library.opcheck(
        torch.ops.uniep.swiglu_fp8,
        (torch.randn(8, 256).bfloat16(),),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
